/* cuda_emu.cc — the CUDA backend without a GPU: prefixreuse_cuda.cu, host code and every kernel,
   compiled for the host against test/cuda_emu.h's emulated runtime, cuBLASLt and device. Linked in
   place of the real backend object into the GPU tests and train_cuda (make test-gpu-emu), with
   test/nccl_emu.h's NCCL between processes for train_cuda on a mesh. */
#include "cuda_emu.h"
#include "nccl_emu.h"
#define PR_CUDA_DEVICE_EMULATION
#include "../prefixreuse_cuda.cu"
