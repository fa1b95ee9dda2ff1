/* prefixreuse_cuda.cu — the CUDA backend of prefixreuse.h.

   It implements the header's pr_backend on one NVIDIA GPU, so the schedule, the loss and the
   optimizer bookkeeping in the header run unchanged on the device:
     - activations bf16, statistics (RMSNorm rstd, attention lse) fp32, every accumulation fp32;
     - master weights, gradients and AdamW state fp32 (the header's arena); every kernel reads the
       weights in bf16, the trainer's copy of them, converted (reals_to_acts) when the masters change;
     - GEMMs through cuBLASLt (bf16 in, fp32 compute; weight gradients accumulated into fp32);
     - attention: one kernel family for both key regions (the shared prefix K/V, then each
       segment's own causal rows), online softmax, no score matrix, and a backward that gives each
       dq/dk/dv/dkp/dvp row a single writer, so results are bitwise reproducible run to run (all
       but the comparison backward PR_CUDA_ATTENTION_MMA_ATOMIC, below);
     - every reduction (RMSNorm weight gradients, embedding gradients, the gradient norm) is a fixed
       tree or a fixed loop: no float atomics, except in the backward PR_CUDA_ATTENTION_MMA_ATOMIC
       selects, which exists to measure what that determinism costs.
   Kernels, GEMMs, ordinary copies and the NCCL communicator's collectives run on one stream, in
   issue order; only offload's block copies run on a second stream, ordered by events. A fault is
   reported at the next synchronisation; CUDA_LAUNCH_BLOCKING=1 makes every launch synchronous, so
   the failure names its kernel. Small host-side arguments (segment offsets, token ids, row lists)
   travel through a pinned staging ring. Kernels cannot return a status: the first failure is kept
   and handed to the trainer through take_error.

   Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a ... (the Makefile's `make cuda`).

   Compiled for the host, without a GPU, by the tests (C++17, the including file supplies what
   CUDA would):
     PR_CUDA_HOST_EMULATION: only the WARP-LEVEL PIECES section below (no CUDA header, no
       kernel), so that a test can run the tensor-core kernels' fragment, ldmatrix, swizzle and
       repacking rules through an emulation of the instructions (test/test_mma_emul.cc);
     with PR_CUDA_KERNEL_EMULATION beside it: the attention kernels too (test/test_mma_kernels.cc);
     PR_CUDA_DEVICE_EMULATION alone: the whole backend, host code and every kernel, against an
       emulated CUDA runtime, cuBLASLt and device (test/cuda_emu.h; test/cuda_emu.cc compiles
       this file against it), so that the GPU tests and train_cuda run on the CPU (make
       test-gpu-emu); no NCCL. */
#ifndef PR_CUDA_HOST_EMULATION
#include "prefixreuse.h"

#ifndef PR_CUDA_DEVICE_EMULATION
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#endif
#if !defined(PR_NO_NCCL) && !defined(PR_CUDA_DEVICE_EMULATION)
#include <nccl.h>
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef PR_DOUBLE
#error "the CUDA backend keeps fp32 master weights: build prefixreuse_cuda.cu and its callers without PR_DOUBLE"
#endif

#ifndef PR_CUDA_DEVICE_EMULATION
typedef __nv_bfloat16 bf16;
/* Every kernel launch goes through this: test/cuda_emu.h defines it to run the kernel on its
   emulated device instead, so the host code below runs unchanged without a GPU. */
#define PR_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif
#endif /* PR_CUDA_HOST_EMULATION */

/* ================================================================ WARP-LEVEL PIECES
   The tensor-core attention kernels (ATTENTION ON TENSOR CORES, below) are built from a few
   warp-level rules: where each lane's values sit in an mma fragment, which shared-memory row each
   lane hands ldmatrix, where a tile's elements sit in swizzled shared memory, how the fp32
   accumulators of P (or dS) become the bf16 A operand of the next product, and which lanes a quad
   reduction combines. A wrong lane order is the usual bug of hand-written MMA code and shows on no
   compiler, so each rule is written here once, as a plain function compiled for the device and,
   with PR_CUDA_HOST_EMULATION, for the host: test/test_mma_emul.cc runs them through an emulation
   of ldmatrix and mma.sync written from the PTX ISA ("Matrix Fragments for mma.m16n8k16 with
   floating point type"; "Warp-level matrix load instruction: ldmatrix") and checks tile products
   against a naive product, with planted wrong rules as negative controls.

   Shapes: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, D (16x8) = A (16x16) B (16x8) + C.
   With g = lane >> 2 (the PTX "groupID") and t = lane & 3 ("threadID_in_group"):
     A: 4 .b32 registers = 8 bf16, element i in register i/2 (even i in the low half)
          row g + 8*((i>>1)&1),  col 2t + (i&1) + 8*(i>>2)
     B: 2 registers = 4 bf16, element i in register i/2:  row (k) 2t + (i&1) + 8*(i>>1),  col (n) g
     C, D: 4 fp32:  row g + 8*(i>>1),  col 2t + (i&1)
   Shared-memory tiles hold rows of W = HS bf16 (64 or 128): 128 or 256 bytes, that is 8 or 16
   chunks of 16 bytes. Chunk c of row r is stored at chunk (c & ~7) | ((c ^ r) & 7): an XOR
   swizzle inside each 128-byte group. The 32 banks of 4 bytes cover 128 bytes, so a 16-byte
   access touches one of 8 bank groups, the chunk index mod 8. ldmatrix reads, per phase, one
   16-byte row of 8 consecutive tile rows at the same logical chunk: unswizzled those all fall in
   one bank group (8-way conflict); swizzled they fall in 8 different ones. The cp.async copies
   write, per quarter warp, 8 consecutive chunks of one row: a permutation of the 8 groups either
   way. (Padding rows by 16 bytes would also avoid the conflicts, at 6-12% more shared memory.) */
#include <stdint.h>
#include <string.h>
#ifdef __CUDACC__
#define PR_HD __host__ __device__
#define PR_UNROLL _Pragma("unroll")
#define PR_UNROLL_1 _Pragma("unroll 1")
#else
#define PR_HD
#define PR_UNROLL
#define PR_UNROLL_1
#endif

/* mma.m16n8k16 fragments: (lane, element) -> (row, col) of A (16x16), B (16x8, row = k), C/D. */
inline PR_HD int pr_mma_a_row(int lane, int i) { return (lane >> 2) + 8 * ((i >> 1) & 1); }
inline PR_HD int pr_mma_a_col(int lane, int i) { return 2 * (lane & 3) + (i & 1) + 8 * (i >> 2); }
inline PR_HD int pr_mma_b_row(int lane, int i) { return 2 * (lane & 3) + (i & 1) + 8 * (i >> 1); }
inline PR_HD int pr_mma_b_col(int lane, int i) { (void)i; return lane >> 2; }
inline PR_HD int pr_mma_c_row(int lane, int i) { return (lane >> 2) + 8 * (i >> 1); }
inline PR_HD int pr_mma_c_col(int lane, int i) { return 2 * (lane & 3) + (i & 1); }

/* ldmatrix.m8n8.x4 row addresses: lane l supplies row l%8 of 8x8 matrix l/8, and register m of every
   lane receives matrix m. Each rule gives the (row, col) of the tile row lane l addresses, relative
   to the 16x16 block being loaded; .x2 and .x1 read only lanes 0-15 and 0-7 of the same rule.
   A operand, array [m][k] (Q, dO, K, V as rows): matrices (rows 0-7, k 0-7), (8-15, 0-7),
     (0-7, 8-15), (8-15, 8-15) are registers a0..a3 of the k16 block.
   B operand without .trans, array [n][k] (K or V for Q K^T, dO V^T; Q, dO for K Q^T, V dO^T):
     matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15): registers b0, b1
     of n8 tile 0, then of n8 tile 1.
   B operand with .trans, array [k][n] (V for P V; K for dS K; dO, Q for P^T dO, dS^T Q):
     matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15): b0, b1 of n8
     tile 0, then of n8 tile 1.
   A operand with .trans, array [k][m] (dS stored transposed, keys as rows, for dQ = dS K in the
     fused backward): matrices (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15)
     are registers a0..a3, each transposed on the way in. Its lane rule is the same expression as
     the B operand's without .trans: lanes 8-15 address the second 8 columns of the first 8 rows. */
inline PR_HD int pr_ldm_a_row(int lane) { return lane & 15; }
inline PR_HD int pr_ldm_a_col(int lane) { return (lane >> 4) * 8; }
inline PR_HD int pr_ldm_bn_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
inline PR_HD int pr_ldm_bn_col(int lane) { return ((lane >> 3) & 1) * 8; }
inline PR_HD int pr_ldm_bt_row(int lane) { return lane & 15; }
inline PR_HD int pr_ldm_bt_col(int lane) { return (lane >> 4) * 8; }
inline PR_HD int pr_ldm_at_row(int lane) { return pr_ldm_bn_row(lane); }
inline PR_HD int pr_ldm_at_col(int lane) { return pr_ldm_bn_col(lane); }

/* The element offset of (row, col) in a swizzled tile of rows of W bf16 (W a multiple of 64). */
inline PR_HD int pr_swz(int row, int col, int W) {
    const int c = col >> 3;
    return row * W + (((c & ~7) | ((c ^ row) & 7)) << 3) + (col & 7);
}
/* The byte offset of the 16-byte chunk an ldmatrix lane addresses in a swizzled tile of rows of W
   bf16: tile row row0 + lr, columns [16 j + 8 cb, + 8), where row0 is a multiple of 8 (every
   caller's: tiles of 16-row blocks) and lr < 16 the lane's row in its block (pr_ldm_*_row),
   cb its 8-column half (pr_ldm_*_col / 8). 2 pr_swz(row0 + lr, 16 j + 8 cb, W), written so that
   the XOR is of lane constants alone: with row0's low bits known to be 0, the compiler takes it
   once for a lane rather than once for each load (dQ's inner loop: 454 -> 367 instructions). */
inline PR_HD uint32_t pr_ldsm_off(int row0, int lr, int j, int cb, int W) {
    return 2u * (uint32_t)((row0 + lr) * W) + 128u * (uint32_t)(j >> 2) + ((32u * (uint32_t)(j & 3)) ^ (16u * (uint32_t)((lr & 7) ^ cb)));
}
/* Hopper's wgmma (sm_90a) reads its shared-memory operands through a matrix descriptor, in
   layouts of its own: with the 128-byte swizzle, rows of 64 bf16 (128 bytes) in atoms of 8 rows
   (1,024 bytes, 1,024-aligned), chunk c of row r at chunk c ^ (r & 7), the same XOR as pr_swz at
   W = 64. A tile of `rows` rows and HS columns is stored as HS / 64 panels of 64 columns, one after
   another, each rows x 128 bytes: the element offset of (row, col). At HS 64 it is pr_swz's. */
inline PR_HD int pr_wg_swz(int row, int col, int rows) { return (col >> 6) * rows * 64 + pr_swz(row, col & 63, 64); }
/* The descriptor of an operand at shared-memory byte address addr (PTX ISA, "Matrix Descriptor
   Format"): bits 0-13 addr >> 4, 16-29 the leading-dimension byte offset >> 4, 32-45 the
   stride-dimension byte offset >> 4, 49-51 base offset 0 (the atoms are 1,024-aligned), 62-63
   layout 1 (128-byte swizzle). In these layouts the stride-dimension offset is 1,024 (from one
   8-row atom to the next); the leading-dimension one is the distance between panels, used only by
   an MN-major operand (V in P V, N = HS across panels), ignored for a K-major one (Q, K in
   Q K^T: a k16 block never leaves its panel). */
#define PR_WG_ATOM 1024u
inline PR_HD uint64_t pr_wg_desc(uint32_t addr, uint32_t lbo) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)((lbo >> 4) & 0x3FFFu) << 16 | (uint64_t)(PR_WG_ATOM >> 4) << 32 |
           (uint64_t)1 << 62;
}
/* A K-major operand's k16 block kc in a panel tile of `rows` rows at byte address base: panel
   kc / 4, 32 bytes a block inside it (the swizzle applies to the address bits the hardware sees). */
inline PR_HD uint64_t pr_wg_desc_k(uint32_t base, int kc, int rows) {
    return pr_wg_desc(base + 128u * (uint32_t)rows * (uint32_t)(kc >> 2) + 32u * (uint32_t)(kc & 3), 16u);
}
/* An MN-major operand's k16 block kc (rows 16 kc .. + 15, the k of the product) in a 64-row panel
   tile at base: 16 rows of 128 bytes a block, panels 64 x 128 bytes apart. */
inline PR_HD uint64_t pr_wg_desc_mn(uint32_t base, int kc) {
    return pr_wg_desc(base + 2048u * (uint32_t)kc, 64u * 128u);
}
/* The copy of a rows x W tile in 16-byte chunks: chunk e (thread e % threads, step e / threads)
   is row e / (W/8), chunk e % (W/8): consecutive threads copy consecutive chunks of a row. */
inline PR_HD int pr_chunk_row(int e, int W) { return e / (W >> 3); }
inline PR_HD int pr_chunk_col(int e, int W) { return (e % (W >> 3)) << 3; }

/* fp32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN). */
inline PR_HD uint32_t pr_bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
/* Two fp32 as one .b32 register of two bf16: lo in bits 0-15 (the even element), hi in 16-31. */
inline PR_HD uint32_t pr_pack_bf16x2(float lo, float hi) {
#ifdef __CUDA_ARCH__
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return pr_bf16_bits(lo) | (pr_bf16_bits(hi) << 16);
#endif
}
/* The accumulators of n8 tiles c0 (columns 0-7) and c1 (8-15) of a 16-row result (P or dS) as the A
   fragment of the k16 block those 16 columns form, rounded to bf16: the element (row, col) a lane
   holds in C is the one it must hold in A, so no value moves between lanes. */
inline PR_HD void pr_c_to_a(uint32_t a[4], const float c0[4], const float c1[4]) {
    a[0] = pr_pack_bf16x2(c0[0], c0[1]);   /* row g,   cols 2t, 2t+1 */
    a[1] = pr_pack_bf16x2(c0[2], c0[3]);   /* row g+8, cols 2t, 2t+1 */
    a[2] = pr_pack_bf16x2(c1[0], c1[1]);   /* row g,   cols 8+2t, 8+2t+1 */
    a[3] = pr_pack_bf16x2(c1[2], c1[3]);   /* row g+8, cols 8+2t, 8+2t+1 */
}
/* Where a lane's accumulators of rows g + 8 rr, columns col0 + 2t and + 1 of a 16-row tile at row0
   go in a swizzled [row][col] tile of W bf16 columns, as one packed pair (the fused backward's
   bf16(dS^T)): the pair's element offset. The warp's 32 lanes store 8 rows x 4 words at once; the
   swizzle puts them in 32 different banks. */
inline PR_HD int pr_c_pair_offset(int row0, int col0, int lane, int rr, int W) {
    return pr_swz(row0 + pr_mma_c_row(lane, 2 * rr), col0 + pr_mma_c_col(lane, 0), W);
}
/* Quad reductions: a row of C lives in the four lanes of one group (same g); shfl.bfly with masks
   1 then 2 combines them, every lane ends with the quad's value, in the same order on each lane. */
#define PR_QUAD_STEPS 2
inline PR_HD int pr_quad_xor(int step) { return 1 << step; }

#ifdef __CUDACC__
/* The instructions (sm_80+). Addresses are shared-state-space byte addresses. */
__device__ __forceinline__ uint32_t pr_smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void pr_ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void pr_ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
/* d += a b */
__device__ __forceinline__ void pr_mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* 16 bytes global -> shared, asynchronously; zero-filled when !fill (src must still be valid). */
__device__ __forceinline__ void pr_cp_async16(uint32_t dst, const void *src, bool fill) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void pr_cp_async4(uint32_t dst, const void *src, bool fill) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(fill ? 4 : 0));
}
__device__ __forceinline__ void pr_cp_async_commit(void) { asm volatile("cp.async.commit_group;" ::); }
template <int N> __device__ __forceinline__ void pr_cp_async_wait(void) { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
/* A plain 4-byte shared-memory load (dK/dV's lse and D rows): named, like the instructions above,
   so that the emulated block sees every shared-memory access the kernels make and can check each
   against the barriers (test/test_mma_kernels.cc). */
__device__ __forceinline__ float pr_lds_f32(const float *p) { return *p; }
/* A 4-byte shared-memory store (the fused backward's dS tile), named for the same reason. */
__device__ __forceinline__ void pr_sts_b32(uint32_t addr, uint32_t v) { asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory"); }
/* *p += v in global memory, atomically (red.global.add.f32): the fused backward's dQ only. */
__device__ __forceinline__ void pr_red_add_f32(float *p, float v) { atomicAdd(p, v); }
/* Hopper's warpgroup instructions (sm_90a; the kernels that use them compile only there). A
   warpgroup is 4 consecutive warps; each wgmma is issued by all its 128 threads, runs
   asynchronously, and its registers (accumulators, A fragments) must be left alone until
   wgmma.wait_group has retired it. */
__device__ __forceinline__ void pr_wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void pr_wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void pr_wg_wait(void) { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
/* Shared memory written by cp.async or plain stores (the generic proxy) made visible to wgmma's
   reads (the async proxy): each writing thread, after its writes, before the barrier. */
__device__ __forceinline__ void pr_fence_proxy_async(void) { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
/* n registers held in place: reads of them after a pr_wg_wait cannot be moved above it, since each
   depends on this empty statement, which stays after the (volatile) wait. */
template <int N> __device__ __forceinline__ void pr_wg_hold(float *d) {
PR_UNROLL
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
/* The same for A fragments, and both before a wgmma.fence: the writes of the registers a wgmma
   reads (the accumulators rescaled, P or dS packed) stay ahead of the fence, where the compiler
   could otherwise sink them past it (ptxas would then order them itself: test/check_wgmma.sh). */
template <int N> __device__ __forceinline__ void pr_wg_hold(uint32_t *a) {
PR_UNROLL
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(a[i])::"memory");
}
/* d (64 x 64, fp32, 32 a thread) += A B^T: A 64 x 16 and B 64 x 16, K-major, both
   from shared memory through descriptors. */
__device__ __forceinline__ void pr_wg_ss64(float d[32], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(1));
}
/* d (64 x N) += A B: A 64 x 16 from registers (mma.m16n8k16's A fragment, warp w of the
   warpgroup holding rows 16w .. 16w + 15), B 16 x N MN-major from shared memory (imm-trans-b 1). */
template <int N> __device__ __forceinline__ void pr_wg_rs(float *d, const uint32_t a[4], uint64_t db);
template <> __device__ __forceinline__ void pr_wg_rs<64>(float *d, const uint32_t a[4], uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
template <> __device__ __forceinline__ void pr_wg_rs<128>(float *d, const uint32_t a[4], uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
#endif
/* ================================================================ end of WARP-LEVEL PIECES */

#if !defined(PR_CUDA_HOST_EMULATION) || defined(PR_CUDA_KERNEL_EMULATION)
/* With PR_CUDA_KERNEL_EMULATION beside PR_CUDA_HOST_EMULATION, the attention kernels below also
   compile for the host, where test/test_mma_kernels.cc runs them on an emulated block (it defines
   bf16, the CUDA built-ins and the instructions of the WARP-LEVEL PIECES). */
#include <stdlib.h>

/* 2^x as the tensor-core kernels take it: ex2.approx.ftz.f32, one MUFU instruction (exp2f without
   fast math wraps it in a range test and two multiplies, 4 instructions per score where the
   exponentials are a tenth of a key tile's work), results below 2^-126 flushed to zero. The host
   (the emulated kernels) rounds exactly and flushes alike. volatile keeps each in program order:
   without it, nvcc 13.0 spills 4-10 registers in the hd-128 dK/dV kernel (test/check_sass.sh). */
__device__ __forceinline__ float pr_exp2(float x) {
#ifdef __CUDA_ARCH__
    float y;
    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    const float y = exp2f(x);
    return y < 0x1p-126f ? 0.0f : y;
#endif
}
/* wgmma's swizzled layouts are anchored to 1,024-byte boundaries (the descriptors' base offset 0):
   a kernel whose dynamic shared memory started elsewhere (a static __shared__ array added to it
   would do that) would compute garbage silently, so it stops at once instead, a launch failure
   the backend reports (pr_k_wgmma_probe checks the same before the kernels are selected). */
__device__ __forceinline__ void pr_wg_check_base(const void *smem) {
    if (pr_smem_u32(smem) % PR_WG_ATOM) __trap();
}
/* the quad reductions, through shfl.bfly (emulated on the host) */
__device__ __forceinline__ float pr_quad_max(float v) {
    for (int s = 0; s < PR_QUAD_STEPS; s++) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, pr_quad_xor(s)));
    return v;
}
__device__ __forceinline__ float pr_quad_add(float v) {
    for (int s = 0; s < PR_QUAD_STEPS; s++) v += __shfl_xor_sync(0xffffffffu, v, pr_quad_xor(s));
    return v;
}

/* ---------------------------------------------------------------- attention */
/* A tile: 64 consecutive rows [r0, r1) of the segment [seg0, seg1) (the FFMA kernels' prefix key
   tiles have seg0 = seg1 = -1). */
typedef struct { int r0, r1, seg0, seg1; } pr_att_tile;
/* The query tiles of segments seg_off (n_seg + 1 offsets): `rows`-row pieces of each segment (64,
   or 128 for the tensor-core forward), in segment order, then row order. Writes them to out unless
   NULL; returns their count. */
static int pr_att_query_tiles(pr_att_tile *out, int n_seg, const int *seg_off, int rows) {
    int n = 0;
    for (int s = 0; s < n_seg; s++)
        for (int r0 = seg_off[s]; r0 < seg_off[s + 1]; r0 += rows, n++)
            if (out) {
                pr_att_tile x = { r0, r0 + rows < seg_off[s + 1] ? r0 + rows : seg_off[s + 1], seg_off[s], seg_off[s + 1] };
                out[n] = x;
            }
    return n;
}

/* Tiles of 64 rows, four threads per row: thread part p holds head dims p, p+4, p+8, ... so that
   for each step the four parts read four neighbouring shared-memory words (no bank conflict) and
   the eight rows of a warp read the same words (a broadcast). A row's dot product is the sum of
   its four parts, reduced by two shuffles in a fixed order.
   Key index j of a query row: j < n_prefix is prefix row j (kp/vp), j >= n_prefix is row
   seg0 + j - n_prefix of its own segment, visible while j - n_prefix <= row - seg0 (causal).
   On an H200 they pass test/test_gpu.c's attention cases against the double CPU path, with
   memcheck, racecheck and synccheck clean; compiled for the host, they match it on an emulated
   block (test/test_mma_kernels.cc, head dims 64 and 128). */
#define PR_ATT_ROWS 64
#define PR_ATT_THREADS (PR_ATT_ROWS * 4)

/* Loads rows [r0, r0+n) (n <= 64) of one head (column offset col, row stride ld) into smem as
   float, zero-filling the rest of the tile. */
template <int HS>
__device__ void pr_att_load(float *dst, const bf16 *src, int r0, int n, size_t ld, int col) {
    for (int e = threadIdx.x; e < PR_ATT_ROWS * HS; e += blockDim.x) {
        int r = e / HS, d = e % HS;
        dst[e] = r < n ? __bfloat162float(src[(size_t)(r0 + r) * ld + col + d]) : 0.0f;
    }
}

/* Walks the keys query row r of tile t sees, in a fixed order: region 0, the n_prefix shared rows
   (kp, vp); region 1, the tile's own segment up to its last row (k, v), causal per row. Each
   64-key tile of K and V is loaded into shared memory, then visit(k_row, v_row, visible) runs for
   each of its keys on every thread of the block, so that shuffles inside visit see full warps;
   visible is false for the keys this row does not see. */
template <int HS, typename Visit>
__device__ __forceinline__ void pr_att_walk_keys(float *ks, float *vs, const pr_att_tile &t, int r, bool valid,
                                                 int n_prefix, const bf16 *k, const bf16 *v, const bf16 *kp,
                                                 const bf16 *vp, size_t kvd, int hk, Visit visit) {
    for (int region = 0; region < 2; region++) {
        const int count = region == 0 ? n_prefix : t.r1 - t.seg0, base = region == 0 ? 0 : t.seg0;
        const bf16 *kb = region == 0 ? kp : k, *vb = region == 0 ? vp : v;
        for (int j0 = 0; j0 < count; j0 += PR_ATT_ROWS) {
            const int jn = min(PR_ATT_ROWS, count - j0);
            __syncthreads();
            pr_att_load<HS>(ks, kb, base + j0, jn, kvd, hk * HS);
            pr_att_load<HS>(vs, vb, base + j0, jn, kvd, hk * HS);
            __syncthreads();
            for (int jj = 0; jj < jn; jj++)
                visit(ks + jj * HS, vs + jj * HS, valid && (region == 0 || j0 + jj <= r - t.seg0));
        }
    }
}

/* The thread of an FFMA query-tile block (the forward, dq): four threads a query row, row r of tile
   blockIdx.x for head blockIdx.y (KV head hk), this one holding its columns part + 4 i; K and V
   tiles staged in shared memory at ks and vs; o the offset of the row's column `part` in q-shaped
   buffers (rows of NH * HS). */
struct pr_att_qrow {
    pr_att_tile t;
    int h, hk, part, r;
    bool valid;
    size_t kvd, o;
    float *ks, *vs;
};
template <int HS>
__device__ __forceinline__ pr_att_qrow pr_att_qrow_of(const pr_att_tile *tiles, int NH, int NKV) {
    extern __shared__ __align__(128) unsigned char pr_dyn_smem[];
    pr_att_qrow x;
    x.t = tiles[blockIdx.x];
    x.h = blockIdx.y, x.hk = x.h / (NH / NKV), x.part = threadIdx.x & 3;
    x.r = x.t.r0 + (threadIdx.x >> 2);
    x.valid = x.r < x.t.r1;
    x.kvd = (size_t)NKV * HS;
    x.o = (size_t)x.r * NH * HS + (size_t)x.h * HS + x.part;
    x.ks = (float *)pr_dyn_smem, x.vs = x.ks + PR_ATT_ROWS * HS;
    return x;
}

/* Forward. Grid (query tiles, NH). Online softmax over the prefix keys, then the own keys. */
template <int HS>
__global__ void __launch_bounds__(PR_ATT_THREADS)
pr_k_attention_fwd(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *kp,
                   const bf16 *vp, const pr_att_tile *tiles, int n_prefix, int NH, int NKV) {
    constexpr int D = HS / 4;
    const pr_att_qrow x = pr_att_qrow_of<HS>(tiles, NH, NKV);
    const float scale = rsqrtf((float)HS);
    float qr[D], acc[D];
    for (int i = 0; i < D; i++) {
        qr[i] = x.valid ? __bfloat162float(q[x.o + 4 * i]) * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    pr_att_walk_keys<HS>(x.ks, x.vs, x.t, x.r, x.valid, n_prefix, k, v, kp, vp, x.kvd, x.hk, [&](const float *kj, const float *vj, bool visible) {
        float s = 0;
        for (int i = 0; i < D; i++) s += qr[i] * kj[x.part + 4 * i];
        s = pr_quad_add(s);
        if (!visible) return;
        if (s > m) {                   /* a new maximum: rescale what was accumulated under the old one */
            float c = __expf(m - s);
            for (int i = 0; i < D; i++) acc[i] *= c;
            l *= c;
            m = s;
        }
        float p = __expf(s - m);
        l += p;
        for (int i = 0; i < D; i++) acc[i] += p * vj[x.part + 4 * i];
    });
    if (!x.valid) return;
    float inv = 1.0f / l;
    for (int i = 0; i < D; i++) out[x.o + 4 * i] = __float2bfloat16(acc[i] * inv);
    if (x.part == 0) lse[(size_t)x.r * NH + x.h] = m + logf(l);
}

/* dq. Grid (query tiles, NH): like the forward, with p rebuilt from lse:
   p = exp(s - lse), ds = p (dout.v - D), dq += scale ds k. */
template <int HS>
__global__ void __launch_bounds__(PR_ATT_THREADS)
pr_k_attention_bwd_dq(bf16 *dq, const bf16 *dout, const float *lse, const float *Dr, const bf16 *q, const bf16 *k,
                      const bf16 *v, const bf16 *kp, const bf16 *vp, const pr_att_tile *tiles, int n_prefix,
                      int NH, int NKV) {
    constexpr int D = HS / 4;
    const pr_att_qrow x = pr_att_qrow_of<HS>(tiles, NH, NKV);
    const float scale = rsqrtf((float)HS);
    float qr[D], dor[D], g[D];
    for (int i = 0; i < D; i++) {
        qr[i] = x.valid ? __bfloat162float(q[x.o + 4 * i]) * scale : 0.0f;
        dor[i] = x.valid ? __bfloat162float(dout[x.o + 4 * i]) : 0.0f;
        g[i] = 0.0f;
    }
    const size_t rh = (size_t)x.r * NH + x.h;
    const float L = x.valid ? lse[rh] : 0.0f, Drow = x.valid ? Dr[rh] : 0.0f;
    pr_att_walk_keys<HS>(x.ks, x.vs, x.t, x.r, x.valid, n_prefix, k, v, kp, vp, x.kvd, x.hk, [&](const float *kj, const float *vj, bool visible) {
        float s = 0, dp = 0;
        for (int i = 0; i < D; i++) {
            s += qr[i] * kj[x.part + 4 * i];
            dp += dor[i] * vj[x.part + 4 * i];
        }
        s = pr_quad_add(s);
        dp = pr_quad_add(dp);
        if (!visible) return;
        float ds = __expf(s - L) * (dp - Drow) * scale;
        for (int i = 0; i < D; i++) g[i] += ds * kj[x.part + 4 * i];
    });
    if (!x.valid) return;
    for (int i = 0; i < D; i++) dq[x.o + 4 * i] = __float2bfloat16(__bfloat162float(dq[x.o + 4 * i]) + g[i]);
}

/* dk, dv. Grid (key tiles, NKV): a block owns 64 keys of one KV head and loops over every query
   row that sees them, for each query head of the GQA group, in a fixed order:
     prefix key tile (seg0 < 0): every row of every segment;   own key tile: the rest of its segment.
   dv += p dout,  dk += scale p (dout.v - D) q. One writer per row: no atomics, same bits every run.
   Own keys' sums are added to the bf16 dk/dv once; prefix keys' go into the fp32 accumulators
   dkp/dvp (the schedule's gK/gV precision), so nothing the suffixes send the prefix is rounded to
   bf16. */
template <int HS>
__global__ void __launch_bounds__(PR_ATT_THREADS)
pr_k_attention_bwd_dkv(bf16 *dk, bf16 *dv, float *dkp, float *dvp, const bf16 *dout, const float *lse, const float *Dr,
                       const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *kp, const bf16 *vp,
                       const pr_att_tile *ktiles, int N, int NH, int NKV) {
    constexpr int D = HS / 4;
    extern __shared__ __align__(128) unsigned char pr_dyn_smem[];
    float *const smem = (float *)pr_dyn_smem;
    float *qs = smem, *ds_ = smem + PR_ATT_ROWS * HS, *ls = ds_ + PR_ATT_ROWS * HS, *dd = ls + PR_ATT_ROWS;
    const pr_att_tile t = ktiles[blockIdx.x];
    const int hk = blockIdx.y, group = NH / NKV, part = threadIdx.x & 3;
    const bool prefix = t.seg0 < 0;
    const int j = t.r0 + (threadIdx.x >> 2);                /* prefix row, or row of the own segment */
    const bool valid = j < t.r1;
    const size_t qd = (size_t)NH * HS, kvd = (size_t)NKV * HS;
    const float scale = rsqrtf((float)HS);
    const bf16 *kb = prefix ? kp : k, *vb = prefix ? vp : v;
    float kr[D], vr[D], gk[D], gv[D];
    for (int i = 0; i < D; i++) {
        size_t o = (size_t)j * kvd + (size_t)hk * HS + part + 4 * i;
        kr[i] = valid ? __bfloat162float(kb[o]) * scale : 0.0f;
        vr[i] = valid ? __bfloat162float(vb[o]) : 0.0f;
        gk[i] = gv[i] = 0.0f;
    }
    /* the query rows to visit: [q_begin, q_end) */
    const int q_begin = prefix ? 0 : t.r0, q_end = prefix ? N : t.seg1;
    for (int h = hk * group; h < (hk + 1) * group; h++)
        for (int i0 = q_begin; i0 < q_end; i0 += PR_ATT_ROWS) {
            int in = min(PR_ATT_ROWS, q_end - i0);
            __syncthreads();
            pr_att_load<HS>(qs, q, i0, in, qd, h * HS);
            pr_att_load<HS>(ds_, dout, i0, in, qd, h * HS);
            for (int e = threadIdx.x; e < PR_ATT_ROWS; e += blockDim.x) {
                ls[e] = e < in ? lse[(size_t)(i0 + e) * NH + h] : 0.0f;
                dd[e] = e < in ? Dr[(size_t)(i0 + e) * NH + h] : 0.0f;
            }
            __syncthreads();
            for (int ii = 0; ii < in; ii++) {
                float s = 0, dp = 0;
                for (int i = 0; i < D; i++) {
                    s += kr[i] * qs[ii * HS + part + 4 * i];
                    dp += vr[i] * ds_[ii * HS + part + 4 * i];
                }
                s = pr_quad_add(s);
                dp = pr_quad_add(dp);
                /* own keys: query row i0+ii sees key j when j <= i0+ii (same segment by construction) */
                if (!valid || (!prefix && j > i0 + ii)) continue;
                float p = __expf(s - ls[ii]), ds = p * (dp - dd[ii]) * scale;
                for (int i = 0; i < D; i++) {
                    gv[i] += p * ds_[ii * HS + part + 4 * i];
                    gk[i] += ds * qs[ii * HS + part + 4 * i];
                }
            }
        }
    if (!valid) return;
    for (int i = 0; i < D; i++) {
        size_t o = (size_t)j * kvd + (size_t)hk * HS + part + 4 * i;
        if (prefix) {
            dkp[o] += gk[i];
            dvp[o] += gv[i];
        } else {
            dk[o] = __float2bfloat16(__bfloat162float(dk[o]) + gk[i]);
            dv[o] = __float2bfloat16(__bfloat162float(dv[o]) + gv[i]);
        }
    }
}

/* Dynamic shared memory of the kernels above: two tiles of 64 x HS floats (+ two rows of statistics for dkv). */
static size_t pr_att_smem_bytes(int HS, int with_stats) {
    return sizeof(float) * (size_t)(2 * PR_ATT_ROWS * HS + (with_stats ? 2 * PR_ATT_ROWS : 0));
}

/* The dk/dv blocks' key tiles: the prefix region's 64-key tiles (seg0 = seg1 = -1), then the own
   tiles, which are the nq query tiles qt themselves. Writes them to out unless NULL; returns their
   count. */
static int pr_att_key_tiles(pr_att_tile *out, const pr_att_tile *qt, int nq, int n_prefix) {
    const int npt = (n_prefix + PR_ATT_ROWS - 1) / PR_ATT_ROWS;
    if (out) {
        for (int i = 0; i < npt; i++) {
            pr_att_tile x = { i * PR_ATT_ROWS, (i + 1) * PR_ATT_ROWS < n_prefix ? (i + 1) * PR_ATT_ROWS : n_prefix, -1, -1 };
            out[i] = x;
        }
        if (nq) memcpy(out + npt, qt, sizeof(pr_att_tile) * (size_t)nq);
    }
    return npt + nq;
}

/* ---------------------------------------------------------------- attention on tensor cores */
/* The same attention as the kernels above (two key regions, causal own segment, GQA, one writer
   per output row, no atomics; PR_CUDA_ATTENTION_MMA_ATOMIC's dQ apart), on the tensor cores: bf16 mma.sync.m16n8k16 with fp32 accumulation,
   ldmatrix from XOR-swizzled shared memory, cp.async double buffering (FlashAttention-2's route,
   sm_80 and later; H100 runs it from the compute_80 PTX or the sm_90a build). Head dims 64 and 128;
   16 and 32 keep the kernels above, where a 16-wide k step would leave most of an mma idle and the
   FFMA kernels are already memory-bound.

   On an H200 and an H100 (bench/RESULTS.md, 2026-11-26) test/test_gpu_attention.c passes and
   compute-sanitizer's memcheck and racecheck find nothing, so a new backend runs these
   (or the wgmma ones below) where the GPU has them (PR_CUDA_ATTENTION_AUTO). They compile warning-free, ptxas reports no
   spills, the SASS holds HMMA and no local memory (test/check_sass.sh); their warp-level rules
   pass an emulation of the instructions (test/test_mma_emul.cc), and the kernels themselves,
   compiled for the host, match the double CPU attention on an emulated block
   (test/test_mma_kernels.cc), which also finds no shared-memory race against the barriers, no
   output element with two writing blocks and no bank conflict in their ldmatrix.

   The algorithm is test/attn_model.h's, with its names:
     Query tiles: 64-row pieces of one segment, a block of 4 warps x 16 rows (the forward takes
     two of them a block, each warp 16 rows of both, with the same results). Key tiles: 64 keys,
     region 0 (prefix rows [0, n_prefix), tail masked), then region 1 (the segment's rows from its
     first, up to the tile holding the query tile's last row; causal mask where a key can pass a
     row, past-the-segment keys masked). Scores S in fp32, online softmax in the log2 domain
     with c = scale*log2(e): m = running max of S, P = exp2(fma(S, c, -m c)) (a row with nothing
     visible yet subtracts 0, so P = 0, never NaN); P rounded to bf16 for P V; l summed from the
     fp32 P; out = bf16(acc / l); lse = (m c + log2 l) ln 2.
   Backward: D = rowsum(dO o O) (the rowdot kernel above). dQ blocks own a query tile and walk the
     forward's key tiles: S = Q K^T, P = exp2(S scale log2e - lse log2e), dP = dO V^T,
     dS = P (dP - D), dQ += bf16(dS) K; dq = bf16(dq + scale dQ). dK/dV blocks own a 64-key tile of
     one KV head and hold its K, V for the whole GQA group: for each query head of the group in
     order, for each query tile that sees the key tile in ascending order, in the transposed
     orientation (keys as the mma rows): S^T = K Q^T, dP^T = V dO^T, dV += bf16(P^T) dO,
     dK += bf16(dS^T) Q. Own keys: dk = bf16(dk + scale dK), dv = bf16(dv + dV). Prefix keys: the
     query tiles are cut into C chunks (the chunk rule, attn_model.h; C from the shape alone), block
     (tile, head, chunk) stores scale dK, dV in fp32 to partial buffer `chunk`, and a last kernel
     adds the partials, summed in chunk order, into dkp/dvp. With C = 1 the block adds into
     dkp/dvp itself (the same bits). Every sum has one order fixed by the shape: bitwise
     reproducible.
   For comparison only, PR_CUDA_ATTENTION_MMA_ATOMIC runs no dQ kernel: the dK/dV blocks also add
     each step's bf16(dS) K into an fp32 dQ accumulator with atomics (FlashAttention-2's fused
     backward), and a last kernel forms dq = bf16(dq + scale dQ): 5 products of a (query, key) tile
     instead of 7, at the price of dq's bits varying run to run.
   PR_CUDA_ATTENTION_WGMMA runs the same three kernels written for Hopper's warpgroup MMA (wgmma,
     sm_90a): a warpgroup of 4 warps takes the rows the mma.sync kernels' 4 warps take (the
     forward's 128 queries as two 64-row halves; 64 queries in dQ; in dK/dV two 64-key tiles, one
     a warpgroup, that walk one list of query tiles (in a segment's pair the second from its own
     on), each step's Q and dO loaded once for both), reads both
     operands of S = Q K^T, dP = dO V^T (and their transposes) from shared memory through
     descriptors, and P, dS (and their transposes) from registers for the products that follow; no
     ldmatrix. Each row's algorithm and every sum's order are the same, so on the emulated block
     (test/test_mma_kernels.cc, the wgmma layouts read from the PTX ISA in test/wgmma_emu.h) the two
     families give the same bits, and on an H100 too (bench/RESULTS.md: every output of
     test/test_gpu_attention.c's shapes; racecheck clean), at 1.6-1.7x their speed (the dK/dV of
     two key tiles a block: on the emulated block only so far). */
#define PR_MMA_ROWS 64                 /* query rows of a block, keys of a key tile */
#define PR_MMA_THREADS 128             /* 4 warps of 16 rows */
#define PR_MMA_FWD_ROWS 128            /* query rows of a forward block: 2 m tiles of 16 rows a warp */
#define PR_MMA_PREFIX_BLOCKS 256       /* the chunk rule's target of prefix dK/dV blocks */
#define PR_LOG2E 1.4426950408889634f
#define PR_LN2 0.6931471805599453f

/* A dK/dV block's work: keys [j0, min(j0 + 64, end)) of region 0 (prefix, chunk >= 0) or of a
   segment (region 1, chunk -1), seen by query tiles [qlo, qhi) of the query-tile list. */
typedef struct { int j0, end, qlo, qhi, chunk; } pr_att_ktile;

/* Rows [row0, row0 + n) of one head (column col, row stride ld; row row0 must exist) into a
   swizzled 64 x HS tile (pr_swz; PANELS: wgmma's panels, pr_wg_swz): n >= 64 a whole tile, rows
   n..63 zero-filled otherwise (all of them for n <= 0); 16-byte cp.async by the whole block of
   THREADS threads (not yet committed). Chunk e = threadIdx.x +
   i * threads (pr_chunk_row/col): a thread keeps its column and, the block's step being a
   multiple of 8 rows, its swizzled column too, so a chunk costs a row offset, not a swizzle; the
   chunks past row n read row row0 and land as zeros. Unrolled, with a fixed trip count: the
   forward's loop spends a sixth fewer instructions a key tile and dQ's a third fewer a 32-key
   sub-tile than with a loop over e, whose trip count the compiler cannot see. dK/dV (ROLLED)
   steps the same way in a loop it does not unroll: at hd 128 it holds 255 registers, and the
   unrolled copy's few more spill there (test/check_sass.sh); rolled, a chunk costs about 14
   instructions, against 25 for the loop over e. */
template <int HS, bool ROLLED = false, int THREADS = PR_MMA_THREADS, bool PANELS = false>
__device__ __forceinline__ void pr_mma_copy(bf16 *dst, const bf16 *src, int row0, int n, size_t ld, int col) {
    constexpr int STEP = THREADS / (HS / 8), PITCH = PANELS ? 64 : HS;   /* rows a turn; elements a stored row */
    static_assert(STEP % 8 == 0 && PR_MMA_ROWS % STEP == 0, "a thread's swizzled column must not move");
    const int r0 = pr_chunk_row(threadIdx.x, HS), c = pr_chunk_col(threadIdx.x, HS);
    uint32_t d = pr_smem_u32(dst) + 2u * (uint32_t)(PANELS ? pr_wg_swz(r0, c, PR_MMA_ROWS) : pr_swz(r0, c, HS));
    /* the rows' addresses stepped as integers, each made a pointer only where it is read: no
       pointer past the rows is formed */
    const bf16 *first = src + (size_t)row0 * ld + col + c;
    uintptr_t a = (uintptr_t)first + (uintptr_t)r0 * ld * sizeof(bf16);
    const uintptr_t step = (uintptr_t)STEP * ld * sizeof(bf16);
    if (ROLLED) {
PR_UNROLL_1
        for (int left = n - r0, i = 0; i < PR_MMA_ROWS / STEP; i++, left -= STEP, a += step, d += 2u * STEP * PITCH)
            pr_cp_async16(d, left > 0 ? (const void *)a : (const void *)first, left > 0);
        return;
    }
    if (n >= PR_MMA_ROWS) {                     /* a whole tile (most of them): no row test */
PR_UNROLL
        for (int i = 0; i < PR_MMA_ROWS / STEP; i++, a += step) pr_cp_async16(d + 2u * (uint32_t)(i * STEP * PITCH), (const void *)a, true);
        return;
    }
PR_UNROLL
    for (int i = 0; i < PR_MMA_ROWS / STEP; i++, a += step) {
        const bool in = r0 + i * STEP < n;
        pr_cp_async16(d + 2u * (uint32_t)(i * STEP * PITCH), in ? (const void *)a : (const void *)first, in);
    }
}

/* Key tile `it` of query tile t's walk: region 0 tiles first, then region 1. */
typedef struct { const bf16 *k, *v; int j0, end, own; } pr_mma_keys;
__device__ __forceinline__ pr_mma_keys pr_mma_key_tile(int it, int npt, const pr_att_tile &t, int n_prefix,
                                                        const bf16 *k, const bf16 *v, const bf16 *kp, const bf16 *vp) {
    pr_mma_keys x;
    if (it < npt) { x.k = kp; x.v = vp; x.j0 = it * PR_MMA_ROWS; x.end = n_prefix; x.own = 0; }
    else { x.k = k; x.v = v; x.j0 = t.seg0 + (it - npt) * PR_MMA_ROWS; x.end = t.seg1; x.own = 1; }
    return x;
}
/* The walk's length: every prefix tile, and the own tiles starting at or before the last row. */
__device__ __forceinline__ int pr_mma_walk(const pr_att_tile &t, int n_prefix) {
    return (n_prefix + PR_MMA_ROWS - 1) / PR_MMA_ROWS + (t.r1 - 1 - t.seg0) / PR_MMA_ROWS + 1;
}
/* Key tile `it` of the walk into ks and vs (PANELS: wgmma's layout), by a block of THREADS; not
   committed. */
template <int HS, bool PANELS, int THREADS = PR_MMA_THREADS>
__device__ __forceinline__ void pr_mma_load_keys(bf16 *ks, bf16 *vs, int it, int npt, const pr_att_tile &t, int n_prefix,
                                                 const bf16 *k, const bf16 *v, const bf16 *kp, const bf16 *vp, size_t kvd, int hk) {
    const pr_mma_keys x = pr_mma_key_tile(it, npt, t, n_prefix, k, v, kp, vp);
    pr_mma_copy<HS, false, THREADS, PANELS>(ks, x.k, x.j0, min(PR_MMA_ROWS, x.end - x.j0), kvd, hk * HS);
    pr_mma_copy<HS, false, THREADS, PANELS>(vs, x.v, x.j0, min(PR_MMA_ROWS, x.end - x.j0), kvd, hk * HS);
}

/* The A fragment of 16 rows (from a_row0) and k columns [16 kc, 16 kc + 16) of a swizzled [row][k]
   tile of rows of W. */
template <int W>
__device__ __forceinline__ void pr_mma_load_a_kc(uint32_t a[4], uint32_t a_base, int a_row0, int kc, int lane) {
    pr_ldsm_x4(a, a_base + pr_ldsm_off(a_row0, pr_ldm_a_row(lane), kc, pr_ldm_a_col(lane) / 8, W));
}
/* All KC of them (K = 16*KC): loaded once where a warp's rows stay in place across the walk and fit
   the registers (Q and dO in dQ, K in dK/dV), so each product below reads only its B operand
   from shared memory. */
template <int W, int KC>
__device__ __forceinline__ void pr_mma_load_a(uint32_t (*af)[4], uint32_t a_base, int a_row0, int lane) {
PR_UNROLL
    for (int kc = 0; kc < KC; kc++) pr_mma_load_a_kc<W>(af[kc], a_base, a_row0, kc, lane);
}
/* N n8 tiles' accumulators (4 floats a lane each) to zero, before a product sums into them */
template <int N>
__device__ __forceinline__ void pr_mma_zero(float (*acc)[4]) {
PR_UNROLL
    for (int nt = 0; nt < N; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
}
/* A double-buffered walk's turn: closes the group of copies just issued (the next tile's, or none
   on the last turn), waits for every group but that one, so this turn's tile has landed for this
   thread, and the barrier makes it so for every thread of the block. */
__device__ __forceinline__ void pr_cp_async_turn(void) {
    pr_cp_async_commit();
    pr_cp_async_wait<1>();
    __syncthreads();
}
/* acc (16 x 16*NP, 2*NP n8 tiles of this warp) += A (16 x 16, fragment a) B (16 x 16*NP, k16 block
   kc of a swizzled [n][k] tile at rows b_row0, without .trans). */
template <int W, int NP>
__device__ __forceinline__ void pr_mma_abt_kc(float (*acc)[4], const uint32_t a[4], uint32_t b_base, int b_row0, int kc, int lane) {
PR_UNROLL
    for (int np = 0; np < NP; np++) {
        uint32_t b[4];
        pr_ldsm_x4(b, b_base + pr_ldsm_off(b_row0 + 16 * np, pr_ldm_bn_row(lane), kc, pr_ldm_bn_col(lane) / 8, W));
        pr_mma_bf16(acc[2 * np], a, b[0], b[1]);
        pr_mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
    }
}
/* The same over K = 16*KC: A from its fragments af (pr_mma_abt) or read from shared memory a k16
   block at a time (pr_mma_abt_s: a swizzled [row][k] tile at rows a_row0). */
template <int W, int KC, int NP>
__device__ __forceinline__ void pr_mma_abt(float (*acc)[4], const uint32_t (*af)[4], uint32_t b_base, int b_row0, int lane) {
PR_UNROLL
    for (int kc = 0; kc < KC; kc++) pr_mma_abt_kc<W, NP>(acc, af[kc], b_base, b_row0, kc, lane);
}
template <int W, int KC, int NP>
__device__ __forceinline__ void pr_mma_abt_s(float (*acc)[4], uint32_t a_base, int a_row0, uint32_t b_base, int b_row0, int lane) {
PR_UNROLL
    for (int kc = 0; kc < KC; kc++) {
        uint32_t a[4];
        pr_mma_load_a_kc<W>(a, a_base, a_row0, kc, lane);
        pr_mma_abt_kc<W, NP>(acc, a, b_base, b_row0, kc, lane);
    }
}
/* For each of the first m_live of M 16-row tiles: acc[m] (16 x W, W/8 n8 tiles) += bf16(X[m])
   (16 x 16*KC, the accumulators x[m] of 2*KC n8 tiles, repacked) V (a swizzled [k][n] tile at rows
   b_row0, with .trans): the M tiles share each fragment of V read. */
template <int W, int KC, int M>
__device__ __forceinline__ void pr_mma_pv(float (*acc)[W / 8][4], float (*x)[2 * KC][4], int m_live, uint32_t b_base, int b_row0, int lane) {
PR_UNROLL
    for (int kc = 0; kc < KC; kc++) {
        uint32_t a[M][4];
PR_UNROLL
        for (int mi = 0; mi < M; mi++)
            if (mi < m_live) pr_c_to_a(a[mi], x[mi][2 * kc], x[mi][2 * kc + 1]);
PR_UNROLL
        for (int dp = 0; dp < W / 16; dp++) {
            uint32_t b[4];
            pr_ldsm_x4_trans(b, b_base + pr_ldsm_off(b_row0 + 16 * kc, pr_ldm_bt_row(lane), dp, pr_ldm_bt_col(lane) / 8, W));
PR_UNROLL
            for (int mi = 0; mi < M; mi++)
                if (mi < m_live) {
                    pr_mma_bf16(acc[mi][2 * dp], a[mi], b[0], b[1]);
                    pr_mma_bf16(acc[mi][2 * dp + 1], a[mi], b[2], b[3]);
                }
        }
    }
}
__device__ __forceinline__ float2 pr_bf16x2_unpack(uint32_t u) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}

/* A 64-key tile's step of the forward's online softmax for a warp's 16 rows from row0, of the
   64-row half from r0 (the forward kernels share it): s (8 n8 tiles, this warp's part of
   S = Q K^T) masked and turned into P in place, m and l (rows g, g + 8) the running max and this
   lane's part of the sum, acc (HS/8 n8 tiles of O) rescaled. */
template <int HS>
__device__ __forceinline__ void pr_fwd_softmax(float (*s)[4], float *m, float *l, float (*acc)[4], const pr_mma_keys &x, int r0, int row0,
                                               int lane, float sl2) {
    /* mask the prefix's tail, keys past the segment, the causal upper part: a tile all of whose
       keys every row of the 64-row half from r0 sees (most of a walk) skips the per-element test */
    const bool whole = x.j0 + PR_MMA_ROWS <= x.end && (!x.own || x.j0 + PR_MMA_ROWS - 1 <= r0);
    if (!whole)
PR_UNROLL
        for (int nt = 0; nt < 8; nt++)
PR_UNROLL
            for (int i = 0; i < 4; i++) {
                const int key = x.j0 + 8 * nt + pr_mma_c_col(lane, i), row = row0 + pr_mma_c_row(lane, i);
                if (!(key < x.end && (!x.own || key <= row))) s[nt][i] = -INFINITY;
            }
    /* online softmax, rows g (rr 0) and g+8 (rr 1), on the unscaled scores: their max is the max
       of the scaled ones (a positive factor keeps the order, rounding included), and the scale
       enters each exponent in one fma, FA2's way; m is unscaled, and its two products by sl2 are
       rounded alone (never fused into the subtraction), so that corr is exactly 1 where the max
       stays */
    float corr[2];
PR_UNROLL
    for (int rr = 0; rr < 2; rr++) {
        float mx = m[rr];
PR_UNROLL
        for (int nt = 0; nt < 8; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * rr], s[nt][2 * rr + 1]));
        mx = pr_quad_max(mx);
        const float base = mx == -INFINITY ? 0.0f : __fmul_rn(mx, sl2);
        corr[rr] = pr_exp2(__fmul_rn(m[rr], sl2) - base);
        m[rr] = mx;
        float sum = 0.0f;
PR_UNROLL
        for (int nt = 0; nt < 8; nt++)
PR_UNROLL
            for (int j = 0; j < 2; j++) {
                s[nt][2 * rr + j] = pr_exp2(fmaf(s[nt][2 * rr + j], sl2, -base));
                sum += s[nt][2 * rr + j];
            }
        l[rr] = l[rr] * corr[rr] + sum;   /* this lane's part of the row; the quad's sum at the end */
    }
    /* acc *= corr, skipped where it changes nothing: no max of the warp's 16 rows moved (every
       corr exactly 1), which deep in a long walk is most tiles */
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f))
PR_UNROLL
        for (int dt = 0; dt < HS / 8; dt++)
PR_UNROLL
            for (int i = 0; i < 4; i++) acc[dt][i] *= corr[i >> 1];
}
/* The forward's end for a warp's 16 rows from row0 (those at or past r1 skipped): out =
   bf16(acc / l), lse = (m + log2 l) ln 2; a row that saw nothing: 0, +inf. */
template <int HS>
__device__ __forceinline__ void pr_fwd_store(bf16 *out, float *lse, float (*acc)[4], const float *m, const float *l, int row0, int r1,
                                             size_t qd, int h, int NH, int lane, float sl2) {
PR_UNROLL
    for (int rr = 0; rr < 2; rr++) {
        const float lt = pr_quad_add(l[rr]);
        const int row = row0 + pr_mma_c_row(lane, 2 * rr);
        if (row >= r1) continue;
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
        bf16 *o = out + (size_t)row * qd + (size_t)h * HS + pr_mma_c_col(lane, 2 * rr);
PR_UNROLL
        for (int dt = 0; dt < HS / 8; dt++) *(uint32_t *)(o + 8 * dt) = pr_pack_bf16x2(acc[dt][2 * rr] * inv, acc[dt][2 * rr + 1] * inv);
        if ((lane & 3) == 0) lse[(size_t)row * NH + h] = lt > 0.0f ? (m[rr] * sl2 + log2f(lt)) * PR_LN2 : INFINITY;
    }
}

/* Forward. Grid (forward query tiles, NH); the tiles run in reverse, so the longest walks start
   first. A forward tile is up to PR_MMA_FWD_ROWS = 128 rows of one segment: two of the backward's
   64-row tiles, walking the key tiles of the later one. Warp w holds rows 16w and 64 + 16w of it
   (the 16-row m tiles mi = 0, 1), so each fragment of K and V read from shared memory feeds both;
   Q is read again at each key tile (beside two tiles' accumulators it does not fit the registers).
   The earlier half's rows see the extra key tiles entirely masked, which leaves their values
   unchanged bit for bit (corr = 1, P = 0): every row's result is the 64-row algorithm's
   (attn_model.h). A tile of up to 64 rows has a second m tile of zero rows of Q: S = Q K^T runs on
   it anyway (no branch among those mma, which the scheduler cannot move work across), and the
   softmax and P V skip it (unguarded, P V costs registers the hd-128 kernel does not have).
   Shared memory: Q (128 x HS), then K and V (two stages each). */
template <int HS>
__global__ void __launch_bounds__(PR_MMA_THREADS)
pr_k_attention_fwd_mma(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *kp,
                       const bf16 *vp, const pr_att_tile *tiles, int n_prefix, int NH, int NKV) {
    constexpr int T = PR_MMA_ROWS * HS, M = PR_MMA_FWD_ROWS / PR_MMA_ROWS;
    extern __shared__ __align__(128) unsigned char pr_dyn_smem[];
    bf16 *qs = (bf16 *)pr_dyn_smem, *ks = qs + M * T, *vs = ks + 2 * T;
    const pr_att_tile t = tiles[gridDim.x - 1 - blockIdx.x];
    const int h = blockIdx.y, hk = h / (NH / NKV), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t qd = (size_t)NH * HS, kvd = (size_t)NKV * HS;
    const float sl2 = rsqrtf((float)HS) * PR_LOG2E;
    const int npt = (n_prefix + PR_MMA_ROWS - 1) / PR_MMA_ROWS, nkt = pr_mma_walk(t, n_prefix);
    const int m_live = (t.r1 - t.r0 + PR_MMA_ROWS - 1) / PR_MMA_ROWS;   /* 64-row halves holding rows */

PR_UNROLL
    for (int mi = 0; mi < M; mi++)                  /* an empty half: zeros, from a row that exists */
        pr_mma_copy<HS>(qs + mi * T, q, mi < m_live ? t.r0 + mi * PR_MMA_ROWS : t.r0, t.r1 - t.r0 - mi * PR_MMA_ROWS, qd, h * HS);
    pr_cp_async_commit();
    pr_mma_load_keys<HS, false>(ks, vs, 0, npt, t, n_prefix, k, v, kp, vp, kvd, hk);
    pr_cp_async_commit();

    float acc[M][HS / 8][4], m[M][2], l[M][2];
PR_UNROLL
    for (int mi = 0; mi < M; mi++) {
        m[mi][0] = m[mi][1] = -INFINITY, l[mi][0] = l[mi][1] = 0.0f;
        pr_mma_zero<HS / 8>(acc[mi]);
    }
    for (int it = 0; it < nkt; it++) {
        const int st = it & 1;
        if (it + 1 < nkt)                           /* the next tile loads while this one computes */
            pr_mma_load_keys<HS, false>(ks + (st ^ 1) * T, vs + (st ^ 1) * T, it + 1, npt, t, n_prefix, k, v, kp, vp, kvd, hk);
        pr_cp_async_turn();
        const pr_mma_keys x = pr_mma_key_tile(it, npt, t, n_prefix, k, v, kp, vp);

        /* S = Q K^T (16 rows x 64 keys per warp and m tile), each K fragment feeding every m tile */
        float s[M][8][4];
PR_UNROLL
        for (int mi = 0; mi < M; mi++) pr_mma_zero<8>(s[mi]);
        const uint32_t kb = pr_smem_u32(ks + st * T);
PR_UNROLL
        for (int kc = 0; kc < HS / 16; kc++) {
            uint32_t a[M][4];
PR_UNROLL
            for (int mi = 0; mi < M; mi++) pr_mma_load_a_kc<HS>(a[mi], pr_smem_u32(qs + mi * T), 16 * warp, kc, lane);
PR_UNROLL
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                pr_ldsm_x4(b, kb + 2u * (uint32_t)pr_swz(16 * np + pr_ldm_bn_row(lane), 16 * kc + pr_ldm_bn_col(lane), HS));
PR_UNROLL
                for (int mi = 0; mi < M; mi++) {
                    pr_mma_bf16(s[mi][2 * np], a[mi], b[0], b[1]);
                    pr_mma_bf16(s[mi][2 * np + 1], a[mi], b[2], b[3]);
                }
            }
        }
PR_UNROLL
        for (int mi = 0; mi < M; mi++)
            if (mi < m_live)
                pr_fwd_softmax<HS>(s[mi], m[mi], l[mi], acc[mi], x, t.r0 + mi * PR_MMA_ROWS, t.r0 + mi * PR_MMA_ROWS + 16 * warp, lane, sl2);
        /* O += bf16(P) V */
        pr_mma_pv<HS, 4, M>(acc, s, m_live, pr_smem_u32(vs + st * T), 0, lane);
        __syncthreads();                             /* this stage is refilled next iteration */
    }
PR_UNROLL
    for (int mi = 0; mi < M; mi++) pr_fwd_store<HS>(out, lse, acc[mi], m[mi], l[mi], t.r0 + mi * PR_MMA_ROWS + 16 * warp, t.r1, qd, h, NH, lane, sl2);
}

/* The wgmma kernels' two kinds of product, each issued as one wgmma group (the caller waits for it
   and holds what it reads after the wait). Scores: d (64 x 64) += A B^T over the head dim, A and B
   64 x HS K-major in shared memory at a and b, after the caller's wgmma.fence. A tile's values
   times B: acc (64 x HS) += bf16(x) B, x 64 x 64 in accumulator fragments (P, dS), repacked into
   the A fragments a (the caller's: wgmma reads them until its wait), written ahead of this
   product's own fence, B 64 x HS MN-major at b. */
template <int HS>
__device__ __forceinline__ void pr_wg_scores(float (&d)[8][4], uint32_t a, uint32_t b) {
PR_UNROLL
    for (int kc = 0; kc < HS / 16; kc++) pr_wg_ss64(&d[0][0], pr_wg_desc_k(a, kc, PR_MMA_ROWS), pr_wg_desc_k(b, kc, PR_MMA_ROWS));
    pr_wg_commit();
}
template <int HS>
__device__ __forceinline__ void pr_wg_times(float (&acc)[HS / 8][4], const float (&x)[8][4], uint32_t (&a)[4][4], uint32_t b) {
PR_UNROLL
    for (int kc = 0; kc < 4; kc++) pr_c_to_a(a[kc], x[2 * kc], x[2 * kc + 1]);
    pr_wg_hold<16>(&a[0][0]);
    pr_wg_fence();
PR_UNROLL
    for (int kc = 0; kc < 4; kc++) pr_wg_rs<HS>(&acc[0][0], a[kc], pr_wg_desc_mn(b, kc));
    pr_wg_commit();
}

/* The forward on Hopper's warpgroup MMA (wgmma, sm_90a; an empty kernel elsewhere, which
   pr_backend_cuda_set_attention never selects: pr_k_wgmma_probe). The forward above, each row's
   algorithm the same (the tiles, walk, masks, online softmax, bf16 P): only the tensor-core
   instructions differ, so on the emulated block the two give the same bits. A block is two
   warpgroups (256 threads); warpgroup g holds the 64-row half g of the 128-row tile, its warp w
   rows 16w .. 16w + 15 of the half, in wgmma's accumulator layout, which is mma.sync's C fragment
   n8 tile by n8 tile. A key tile: S = Q K^T as HS/16 wgmma m64n64k16, Q and K both read from
   shared memory through descriptors (no ldmatrix, no registers for Q); O += bf16(P) V as 4 wgmma
   m64nHSk16, P from registers (mma.sync's A fragment), V MN-major. Shared memory in wgmma's panel
   layout (pr_wg_swz, 1,024-aligned): Q's two halves, then K and V two stages each, filled by
   cp.async as above and fenced into the async proxy before the barrier that publishes them. A
   half without rows (a tile of up to 64) skips its products and softmax: wgmma is issued by a
   whole warpgroup, so the branch is uniform there. On an H100 this form ran 4.6-6.1% faster than
   two others that keep the tensor cores busier on paper (bench/RESULTS.md, 2026-11-27): one
   barrier a tile with two blocks an SM, and one warpgroup holding both halves, one half's softmax
   while the other's products run. */
#define PR_WG_THREADS 256
template <int HS>
__global__ void __launch_bounds__(PR_WG_THREADS)
pr_k_attention_fwd_wgmma(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *kp,
                         const bf16 *vp, const pr_att_tile *tiles, int n_prefix, int NH, int NKV) {
#if !defined(__CUDACC__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)   /* sm_90a, or the host's emulation */
    constexpr int T = PR_MMA_ROWS * HS;
    extern __shared__ __align__(128) unsigned char pr_dyn_smem[];
    pr_wg_check_base(pr_dyn_smem);
    bf16 *qs = (bf16 *)pr_dyn_smem, *ks = qs + 2 * T, *vs = ks + 2 * T;
    const pr_att_tile t = tiles[gridDim.x - 1 - blockIdx.x];
    const int h = blockIdx.y, hk = h / (NH / NKV), wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const size_t qd = (size_t)NH * HS, kvd = (size_t)NKV * HS;
    const float sl2 = rsqrtf((float)HS) * PR_LOG2E;
    const int npt = (n_prefix + PR_MMA_ROWS - 1) / PR_MMA_ROWS, nkt = pr_mma_walk(t, n_prefix);
    const bool live = t.r0 + wg * PR_MMA_ROWS < t.r1;     /* this warpgroup's half holds rows */
    const int row0 = t.r0 + wg * PR_MMA_ROWS + 16 * warp;

PR_UNROLL
    for (int mi = 0; mi < 2; mi++)                  /* an empty half: zeros, from a row that exists */
        pr_mma_copy<HS, false, PR_WG_THREADS, true>(qs + mi * T, q, t.r0 + mi * PR_MMA_ROWS < t.r1 ? t.r0 + mi * PR_MMA_ROWS : t.r0,
                                                    t.r1 - t.r0 - mi * PR_MMA_ROWS, qd, h * HS);
    pr_cp_async_commit();
    pr_mma_load_keys<HS, true, PR_WG_THREADS>(ks, vs, 0, npt, t, n_prefix, k, v, kp, vp, kvd, hk);
    pr_cp_async_commit();
    float acc[HS / 8][4], m[2] = { -INFINITY, -INFINITY }, l[2] = { 0.0f, 0.0f };
    pr_mma_zero<HS / 8>(acc);
    const uint32_t qb = pr_smem_u32(qs + wg * T);
    for (int it = 0; it < nkt; it++) {
        const int st = it & 1;
        if (it + 1 < nkt)                           /* the next tile loads while this one computes */
            pr_mma_load_keys<HS, true, PR_WG_THREADS>(ks + (st ^ 1) * T, vs + (st ^ 1) * T, it + 1, npt, t, n_prefix, k, v, kp, vp, kvd, hk);
        pr_cp_async_commit();
        pr_cp_async_wait<1>();                      /* this thread's copies of this tile (and Q) landed, */
        pr_fence_proxy_async();                     /* visible to wgmma, */
        __syncthreads();                            /* and every thread's */
        if (live) {
            const pr_mma_keys x = pr_mma_key_tile(it, npt, t, n_prefix, k, v, kp, vp);
            const uint32_t kb = pr_smem_u32(ks + st * T), vb = pr_smem_u32(vs + st * T);
            float s[8][4];
            pr_mma_zero<8>(s);
            pr_wg_hold<32>(&s[0][0]);               /* zeroed before the fence, not moved past it */
            pr_wg_fence();
            pr_wg_scores<HS>(s, qb, kb);
            pr_wg_wait<0>();
            pr_wg_hold<32>(&s[0][0]);
            pr_fwd_softmax<HS>(s, m, l, acc, x, row0 - 16 * warp, row0, lane, sl2);
            uint32_t p[4][4];                       /* bf16(P) as the A fragments of its 4 k16 blocks */
            pr_wg_hold<HS / 2>(&acc[0][0]);         /* rescaled ahead of the fence */
            pr_wg_times<HS>(acc, s, p, vb);         /* O += bf16(P) V */
            pr_wg_wait<0>();                        /* V's stage is read before it is refilled */
            pr_wg_hold<HS / 2>(&acc[0][0]);
        }
        __syncthreads();                            /* this stage is refilled next iteration */
    }
    if (live) pr_fwd_store<HS>(out, lse, acc, m, l, row0, t.r1, qd, h, NH, lane, sl2);
#else
    (void)out, (void)lse, (void)q, (void)k, (void)v, (void)kp, (void)vp, (void)tiles, (void)n_prefix, (void)NH, (void)NKV;
#endif
}

/* dQ's pieces shared by its two kernels. Rows g and g + 8 of a warp's 16 from row0 (those at or
   past r1 read as 0): lse * log2e and D. */
__device__ __forceinline__ void pr_dq_rows(float lse2[2], float Drow[2], const float *lse, const float *Dr, int row0, int r1, int NH, int h,
                                           int lane) {
PR_UNROLL
    for (int rr = 0; rr < 2; rr++) {
        const int row = row0 + pr_mma_c_row(lane, 2 * rr);
        lse2[rr] = row < r1 ? lse[(size_t)row * NH + h] * PR_LOG2E : 0.0f;
        Drow[rr] = row < r1 ? Dr[(size_t)row * NH + h] : 0.0f;
    }
}
/* P = exp2(S scale log2e - lse log2e) into s where visible, else 0, for a warp's 16 rows from row0
   and N8 n8 tiles of keys from key0 (S = -inf: a row past the tile (row >= r1) or a row that saw
   no key has no visible key, so its lse2, 0 or +inf, gives -inf too). whole: every row sees every
   key here, no mask. Apart from dS below, so that the wgmma kernel runs it while dP is computed. */
template <int N8>
__device__ __forceinline__ void pr_dq_p(float (*s)[4], const pr_mma_keys &x, bool whole, int key0, int row0, int r1, int lane, float sl2,
                                        const float lse2[2]) {
    if (!whole)
PR_UNROLL
        for (int nt = 0; nt < N8; nt++)
PR_UNROLL
            for (int i = 0; i < 4; i++) {
                const int key = key0 + 8 * nt + pr_mma_c_col(lane, i), row = row0 + pr_mma_c_row(lane, i);
                if (!(key < x.end && row < r1 && (!x.own || key <= row))) s[nt][i] = -INFINITY;
            }
PR_UNROLL
    for (int nt = 0; nt < N8; nt++)
PR_UNROLL
        for (int i = 0; i < 4; i++) s[nt][i] = pr_exp2(fmaf(s[nt][i], sl2, -lse2[i >> 1]));
}
/* dS = P (dP - D), into s (P's). */
template <int N8>
__device__ __forceinline__ void pr_dq_ds(float (*s)[4], const float (*dp)[4], const float Drow[2]) {
PR_UNROLL
    for (int nt = 0; nt < N8; nt++)
PR_UNROLL
        for (int i = 0; i < 4; i++) s[nt][i] *= dp[nt][i] - Drow[i >> 1];
}
/* dq = bf16(dq + scale dQ) for a warp's 16 rows from row0 (those at or past r1 skipped). */
template <int HS>
__device__ __forceinline__ void pr_dq_store(bf16 *dq, const float (*acc)[4], int row0, int r1, size_t qd, int h, int lane, float scale) {
PR_UNROLL
    for (int rr = 0; rr < 2; rr++) {
        const int row = row0 + pr_mma_c_row(lane, 2 * rr);
        if (row >= r1) continue;
        uint32_t *g = (uint32_t *)(dq + (size_t)row * qd + (size_t)h * HS + pr_mma_c_col(lane, 2 * rr));
PR_UNROLL
        for (int dt = 0; dt < HS / 8; dt++) {
            const float2 o = pr_bf16x2_unpack(g[4 * dt]);
            g[4 * dt] = pr_pack_bf16x2(o.x + scale * acc[dt][2 * rr], o.y + scale * acc[dt][2 * rr + 1]);
        }
    }
}

/* dQ. Grid (query tiles, NH), tiles in reverse; the forward's key walk. Shared memory: Q, dO,
   then K and V (two stages each). dq = bf16(dq + scale * sum over keys of bf16(dS) K). The warp's
   Q and dO rows stay in registers as A fragments, so the inner loop reads from shared memory only
   the B operands, one ldmatrix.x4 per two mma; a key tile is taken in sub-tiles
   of KN keys, so that S and dP of HS 128 fit the registers beside dQ and those fragments (240 at
   HS 128 with nvcc 13.0, no spills: test/check_sass.sh). */
template <int HS>
__global__ void __launch_bounds__(PR_MMA_THREADS)
pr_k_attention_bwd_dq_mma(bf16 *dq, const bf16 *dout, const float *lse, const float *Dr, const bf16 *q, const bf16 *k,
                          const bf16 *v, const bf16 *kp, const bf16 *vp, const pr_att_tile *tiles, int n_prefix,
                          int NH, int NKV) {
    constexpr int T = PR_MMA_ROWS * HS, KN = HS == 128 ? 32 : 64;
    extern __shared__ __align__(128) unsigned char pr_dyn_smem[];
    bf16 *qs = (bf16 *)pr_dyn_smem, *dos = qs + T, *ks = dos + T, *vs = ks + 2 * T;
    const pr_att_tile t = tiles[gridDim.x - 1 - blockIdx.x];
    const int h = blockIdx.y, hk = h / (NH / NKV), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t qd = (size_t)NH * HS, kvd = (size_t)NKV * HS;
    const float scale = rsqrtf((float)HS), sl2 = scale * PR_LOG2E;
    const int npt = (n_prefix + PR_MMA_ROWS - 1) / PR_MMA_ROWS, nkt = pr_mma_walk(t, n_prefix);

    pr_mma_copy<HS>(qs, q, t.r0, t.r1 - t.r0, qd, h * HS);
    pr_mma_copy<HS>(dos, dout, t.r0, t.r1 - t.r0, qd, h * HS);
    pr_cp_async_commit();
    pr_mma_load_keys<HS, false>(ks, vs, 0, npt, t, n_prefix, k, v, kp, vp, kvd, hk);
    pr_cp_async_commit();
    pr_cp_async_wait<1>();                            /* Q and dO landed (the first K, V may not have) */
    __syncthreads();
    uint32_t qf[HS / 16][4], dof[HS / 16][4];         /* this warp's 16 rows of Q and dO, as A fragments */
    pr_mma_load_a<HS, HS / 16>(qf, pr_smem_u32(qs), 16 * warp, lane);
    pr_mma_load_a<HS, HS / 16>(dof, pr_smem_u32(dos), 16 * warp, lane);
    float lse2[2], Drow[2];
    pr_dq_rows(lse2, Drow, lse, Dr, t.r0 + 16 * warp, t.r1, NH, h, lane);
    float acc[HS / 8][4];
    pr_mma_zero<HS / 8>(acc);
    for (int it = 0; it < nkt; it++) {
        const int st = it & 1;
        if (it + 1 < nkt) pr_mma_load_keys<HS, false>(ks + (st ^ 1) * T, vs + (st ^ 1) * T, it + 1, npt, t, n_prefix, k, v, kp, vp, kvd, hk);
        pr_cp_async_turn();
        const pr_mma_keys x = pr_mma_key_tile(it, npt, t, n_prefix, k, v, kp, vp);
        const uint32_t kb = pr_smem_u32(ks + st * T), vb = pr_smem_u32(vs + st * T);
        /* every row of the tile sees every key of this tile (most of a walk): no mask */
        const bool whole = x.j0 + PR_MMA_ROWS <= x.end && t.r1 - t.r0 == PR_MMA_ROWS && (!x.own || x.j0 + PR_MMA_ROWS - 1 <= t.r0);
PR_UNROLL_1
        for (int sub = 0; sub < PR_MMA_ROWS / KN; sub++) {
            /* S = Q K^T, dP = dO V^T: 16 rows x KN keys */
            float s[KN / 8][4], dp[KN / 8][4];
            pr_mma_zero<KN / 8>(s);
            pr_mma_zero<KN / 8>(dp);
            pr_mma_abt<HS, HS / 16, KN / 16>(s, qf, kb, sub * KN, lane);
            pr_mma_abt<HS, HS / 16, KN / 16>(dp, dof, vb, sub * KN, lane);
            pr_dq_p<KN / 8>(s, x, whole, x.j0 + sub * KN, t.r0 + 16 * warp, t.r1, lane, sl2, lse2);
            pr_dq_ds<KN / 8>(s, dp, Drow);
            /* dQ += bf16(dS) K: K as the [k][n] operand, .trans */
            pr_mma_pv<HS, KN / 16, 1>(&acc, &s, 1, kb, sub * KN, lane);
        }
        __syncthreads();
    }
    pr_dq_store<HS>(dq, acc, t.r0 + 16 * warp, t.r1, qd, h, lane, scale);
}

/* dQ on Hopper's wgmma (sm_90a; PR_CUDA_ATTENTION_WGMMA): the kernel above, each row's algorithm
   the same, as one warpgroup (128 threads) a 64-row query tile: S = Q K^T and dP = dO V^T as HS/16
   wgmma m64n64k16 each, all four operands read from shared memory through descriptors (Q, dO, K,
   V all K-major), then dQ += bf16(dS) K as 4 wgmma m64nHSk16 with dS from registers and K
   MN-major. A whole 64-key tile a turn (no sub-tiles: Q and dO take no registers here). Shared
   memory in wgmma's panel layout: Q, dO, then K and V (two stages each), fenced into the async
   proxy before the barrier that publishes them, as in the wgmma forward. */
template <int HS>
__global__ void __launch_bounds__(PR_MMA_THREADS)
pr_k_attention_bwd_dq_wgmma(bf16 *dq, const bf16 *dout, const float *lse, const float *Dr, const bf16 *q, const bf16 *k,
                            const bf16 *v, const bf16 *kp, const bf16 *vp, const pr_att_tile *tiles, int n_prefix,
                            int NH, int NKV) {
#if !defined(__CUDACC__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)   /* sm_90a, or the host's emulation */
    constexpr int T = PR_MMA_ROWS * HS;
    extern __shared__ __align__(128) unsigned char pr_dyn_smem[];
    pr_wg_check_base(pr_dyn_smem);
    bf16 *qs = (bf16 *)pr_dyn_smem, *dos = qs + T, *ks = dos + T, *vs = ks + 2 * T;
    const pr_att_tile t = tiles[gridDim.x - 1 - blockIdx.x];
    const int h = blockIdx.y, hk = h / (NH / NKV), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t qd = (size_t)NH * HS, kvd = (size_t)NKV * HS;
    const float scale = rsqrtf((float)HS), sl2 = scale * PR_LOG2E;
    const int npt = (n_prefix + PR_MMA_ROWS - 1) / PR_MMA_ROWS, nkt = pr_mma_walk(t, n_prefix), row0 = t.r0 + 16 * warp;

    pr_mma_copy<HS, false, PR_MMA_THREADS, true>(qs, q, t.r0, t.r1 - t.r0, qd, h * HS);
    pr_mma_copy<HS, false, PR_MMA_THREADS, true>(dos, dout, t.r0, t.r1 - t.r0, qd, h * HS);
    pr_cp_async_commit();
    pr_mma_load_keys<HS, true>(ks, vs, 0, npt, t, n_prefix, k, v, kp, vp, kvd, hk);
    pr_cp_async_commit();
    float lse2[2], Drow[2];
    pr_dq_rows(lse2, Drow, lse, Dr, row0, t.r1, NH, h, lane);
    float acc[HS / 8][4];
    pr_mma_zero<HS / 8>(acc);
    const uint32_t qb = pr_smem_u32(qs), dob = pr_smem_u32(dos);
    for (int it = 0; it < nkt; it++) {
        const int st = it & 1;
        pr_cp_async_wait<0>();                      /* this thread's copies of this tile (and Q, dO) landed, */
        pr_fence_proxy_async();                     /* visible to wgmma, */
        __syncthreads();                            /* and every thread's; the other stage is read no more */
        const uint32_t kb = pr_smem_u32(ks + st * T), vb = pr_smem_u32(vs + st * T);
        float s[8][4], dp[8][4];
        pr_mma_zero<8>(s);
        pr_mma_zero<8>(dp);
        pr_wg_hold<32>(&s[0][0]);                   /* zeroed before the fence, not moved past it */
        pr_wg_hold<32>(&dp[0][0]);
        pr_wg_fence();
        pr_wg_scores<HS>(s, qb, kb);
        pr_wg_scores<HS>(dp, dob, vb);
        if (it + 1 < nkt) {                         /* the next tile loads into the other stage while they run */
            pr_mma_load_keys<HS, true>(ks + (st ^ 1) * T, vs + (st ^ 1) * T, it + 1, npt, t, n_prefix, k, v, kp, vp, kvd, hk);
            pr_cp_async_commit();
        }
        const pr_mma_keys x = pr_mma_key_tile(it, npt, t, n_prefix, k, v, kp, vp);
        const bool whole = x.j0 + PR_MMA_ROWS <= x.end && t.r1 - t.r0 == PR_MMA_ROWS && (!x.own || x.j0 + PR_MMA_ROWS - 1 <= t.r0);
        pr_wg_wait<1>();                            /* S is in: P while the tensor cores compute dP */
        pr_wg_hold<32>(&s[0][0]);
        pr_dq_p<8>(s, x, whole, x.j0, row0, t.r1, lane, sl2, lse2);
        pr_wg_wait<0>();
        pr_wg_hold<32>(&dp[0][0]);
        pr_dq_ds<8>(s, dp, Drow);
        uint32_t a[4][4];                           /* bf16(dS) as the A fragments of its 4 k16 blocks */
        pr_wg_times<HS>(acc, s, a, kb);             /* dQ += bf16(dS) K */
        pr_wg_wait<0>();                            /* K's stage is read before the next barrier lets it be refilled */
        pr_wg_hold<HS / 2>(&acc[0][0]);
    }
    pr_dq_store<HS>(dq, acc, row0, t.r1, qd, h, lane, scale);
#else
    (void)dq, (void)dout, (void)lse, (void)Dr, (void)q, (void)k, (void)v, (void)kp, (void)vp, (void)tiles, (void)n_prefix, (void)NH, (void)NKV;
#endif
}

/* The fused backward's dQ (FUSED_DQ below): dq_acc (fp32, unscaled) of query tile qt's rows, head
   h, += bf16(dS) K over the block's 64 keys. Warp w takes queries [16w, 16w + 16): dS as the A
   operand, read with .trans from the [key][query] tile dss (W 64), K as the [k][n] operand (.trans);
   32 columns of dQ at a time (16 accumulators beside the registers dK and dV hold), each added with
   an fp32 atomic: the order in which blocks add varies run to run, so dq's bits do too. */
template <int HS>
__device__ __forceinline__ void pr_mma_dq_atomic(float *dq_acc, uint32_t dss, uint32_t ks, const pr_att_tile &qt, int h,
                                                 size_t qd, int warp, int lane) {
    const int row = qt.r0 + 16 * warp + pr_mma_c_row(lane, 0);      /* rows g and g + 8 */
    size_t at = (size_t)row * qd + (size_t)h * HS + pr_mma_c_col(lane, 0);   /* an offset: past the tile, no pointer is formed */
    const bool live0 = row < qt.r1, live1 = row + 8 < qt.r1;
PR_UNROLL_1
    for (int dc = 0; dc < HS / 32; dc++, at += 32) {
        float acc[4][4];
        pr_mma_zero<4>(acc);
PR_UNROLL
        for (int kc = 0; kc < PR_MMA_ROWS / 16; kc++) {
            uint32_t a[4];                            /* read again for each 32 columns: kept, they would spill */
            pr_ldsm_x4_trans(a, dss + pr_ldsm_off(16 * kc, pr_ldm_at_row(lane), warp, pr_ldm_at_col(lane) / 8, PR_MMA_ROWS));
PR_UNROLL
            for (int dp = 0; dp < 2; dp++) {
                uint32_t b[4];
                pr_ldsm_x4_trans(b, ks + pr_ldsm_off(16 * kc, pr_ldm_bt_row(lane), 2 * dc + dp, pr_ldm_bt_col(lane) / 8, HS));
                pr_mma_bf16(acc[2 * dp], a, b[0], b[1]);
                pr_mma_bf16(acc[2 * dp + 1], a, b[2], b[3]);
            }
        }
        if (live0) {
            float *g = dq_acc + at;
PR_UNROLL
            for (int nt = 0; nt < 4; nt++) pr_red_add_f32(g + 8 * nt, acc[nt][0]), pr_red_add_f32(g + 8 * nt + 1, acc[nt][1]);
        }
        if (live1) {
            float *g = dq_acc + at + 8 * qd;
PR_UNROLL
            for (int nt = 0; nt < 4; nt++) pr_red_add_f32(g + 8 * nt, acc[nt][2]), pr_red_add_f32(g + 8 * nt + 1, acc[nt][3]);
        }
    }
}

/* dK/dV's pieces shared by its two kernels. A block's step s: query head hk*group + s/nq, query
   tile kt.qlo + s%nq (kt: the block's first key tile), counted as (tile, head) pairs that advance a
   step at a time (no % or /). */
struct pr_dkv_step {
    int tile, head;
    __device__ __forceinline__ void next(const pr_att_ktile &kt) {
        if (++tile == kt.qhi) tile = kt.qlo, head++;
    }
};
/* A step's loads (not yet committed): the query tile qt of head h (taken by value: read once from
   global memory), Q and dO into swizzled tiles (PANELS: wgmma's layout), lse and D of its rows a
   thread a row; rows past the tile read as zeros; by a block of THREADS. Rolled copies: at HS 128
   the mma kernel holds 255 registers. */
template <int HS, bool PANELS, int THREADS = PR_MMA_THREADS>
__device__ __forceinline__ void pr_dkv_load(bf16 *qs, bf16 *dos, float *ls, float *ds, const pr_att_tile qt, int h, const bf16 *q,
                                            const bf16 *dout, const float *lse, const float *Dr, size_t qd, int NH) {
    const int n = qt.r1 - qt.r0;
    pr_mma_copy<HS, true, THREADS, PANELS>(qs, q, qt.r0, n, qd, h * HS);
    pr_mma_copy<HS, true, THREADS, PANELS>(dos, dout, qt.r0, n, qd, h * HS);
    static_assert(PR_MMA_ROWS <= THREADS, "a thread a row of lse and D");
    const int e = threadIdx.x;
    if (e < PR_MMA_ROWS) {
        const size_t o = (size_t)(qt.r0 + (e < n ? e : 0)) * NH + h;
        pr_cp_async4(pr_smem_u32(ls + e), lse + o, e < n);
        pr_cp_async4(pr_smem_u32(ds + e), Dr + o, e < n);
    }
}
/* A step's P^T for a warp's 16 keys from key0 (rows) and N8 n8 tiles of queries from column c0 of
   the query tile qt (columns): exp2(S^T scale log2e - lse log2e) where visible, else 0 (S^T =
   -inf), into p. lst: the tile's lse in shared memory. A lane's elements lie in 2 query columns an
   n8 tile (its keys g and g + 8): lse read once a column. whole: every query sees every key here,
   no mask. Apart from dS^T below, so that the wgmma kernel runs it while dP^T is computed. */
template <int N8>
__device__ __forceinline__ void pr_dkv_p(float (*p)[4], const pr_att_ktile &kt, bool own, bool whole, int key0, const pr_att_tile &qt,
                                         int c0, const float *lst, int lane, float sl2) {
    if (!whole)
PR_UNROLL
        for (int nt = 0; nt < N8; nt++)
PR_UNROLL
            for (int i = 0; i < 4; i++) {
                const int row = qt.r0 + c0 + 8 * nt + pr_mma_c_col(lane, i), key = key0 + pr_mma_c_row(lane, i);
                if (!(key < kt.end && row < qt.r1 && (!own || key <= row))) p[nt][i] = -INFINITY;
            }
PR_UNROLL
    for (int nt = 0; nt < N8; nt++)
PR_UNROLL
        for (int j = 0; j < 2; j++) {
            const float lse2 = pr_lds_f32(lst + c0 + 8 * nt + pr_mma_c_col(lane, j)) * PR_LOG2E;
PR_UNROLL
            for (int i = j; i < 4; i += 2) p[nt][i] = pr_exp2(fmaf(p[nt][i], sl2, -lse2));
        }
}
/* dS^T = P^T (dP^T - D), into dp; dst: the tile's D in shared memory, read once a column. */
template <int N8>
__device__ __forceinline__ void pr_dkv_ds(const float (*p)[4], float (*dp)[4], int c0, const float *dst, int lane) {
PR_UNROLL
    for (int nt = 0; nt < N8; nt++)
PR_UNROLL
        for (int j = 0; j < 2; j++) {
            const float Dc = pr_lds_f32(dst + c0 + 8 * nt + pr_mma_c_col(lane, j));
PR_UNROLL
            for (int i = j; i < 4; i += 2) dp[nt][i] = p[nt][i] * (dp[nt][i] - Dc);
        }
}
/* The end of a block: own keys into the bf16 dk/dv once; prefix keys scale dK, dV into dkp/dvp
   (C = 1) or partial `chunk` (np_elems: a partial's size). A warp's 16 keys from key0. */
template <int HS>
__device__ __forceinline__ void pr_dkv_store(bf16 *dk, bf16 *dv, float *dkp, float *dvp, float *part, int C, const pr_att_ktile &kt,
                                             const float (*gk)[4], const float (*gv)[4], int key0, int hk, size_t np_elems, size_t kvd,
                                             int lane, float scale) {
PR_UNROLL
    for (int rr = 0; rr < 2; rr++) {
        const int key = key0 + pr_mma_c_row(lane, 2 * rr);
        if (key >= kt.end) continue;
        const size_t o = (size_t)key * kvd + (size_t)hk * HS + pr_mma_c_col(lane, 2 * rr);
PR_UNROLL
        for (int dt = 0; dt < HS / 8; dt++) {
            /* the product rounded on its own (never fused into the addition below), so that adding
               into dkp gives the bits a zeroed buffer added later would (the schedule's two ways) */
            const float k0 = __fmul_rn(scale, gk[dt][2 * rr]), k1 = __fmul_rn(scale, gk[dt][2 * rr + 1]);
            const float v0 = gv[dt][2 * rr], v1 = gv[dt][2 * rr + 1];
            if (kt.chunk < 0) {
                uint32_t *a = (uint32_t *)(dk + o + 8 * dt), *b = (uint32_t *)(dv + o + 8 * dt);
                const float2 ka = pr_bf16x2_unpack(*a), vb = pr_bf16x2_unpack(*b);
                *a = pr_pack_bf16x2(ka.x + k0, ka.y + k1);
                *b = pr_pack_bf16x2(vb.x + v0, vb.y + v1);
            } else if (!part) {
                float2 *a = (float2 *)(dkp + o + 8 * dt), *b = (float2 *)(dvp + o + 8 * dt);
                const float2 ka = *a, vb = *b;
                *a = make_float2(ka.x + k0, ka.y + k1);
                *b = make_float2(vb.x + v0, vb.y + v1);
            } else {
                *(float2 *)(part + (size_t)kt.chunk * np_elems + o + 8 * dt) = make_float2(k0, k1);
                *(float2 *)(part + (size_t)(C + kt.chunk) * np_elems + o + 8 * dt) = make_float2(v0, v1);
            }
        }
    }
}

/* dK/dV. Grid (key-tile work units, NKV). Shared memory: K, V (64 x HS), then Q, dO (two stages
   each) and lse, D of the query tile's 64 rows (two stages). The warp's 16 keys of K stay in
   registers as A fragments; those of V are read from shared memory at each sub-tile, where they
   cost 8 ldmatrix.x4 for 64 mma (40 instead of 32 a sub-tile at HS 128) but free the 32 registers
   whose lack made the compiler recompute lane-derived addresses inside the loop and spill at the
   least change. With them, with the steps' (query tile, head) pairs counted rather than divided
   out, pr_ldsm_off's addresses and the mask only on steps that cut a key's view, the step loop's
   static SASS went from 931 to 375 instructions (one 16-query sub-tile's 64 mma counted once, its
   two paths both; test/check_sass.sh, nvcc 13.0). The query tile is taken in sub-tiles of QN
   queries, so that S^T and dP^T of HS 128 fit the registers beside dK, dV and K (255 at HS 128,
   no spills).
   FUSED_DQ (PR_CUDA_ATTENTION_MMA_ATOMIC, for measuring what determinism costs): FlashAttention-2's
   fused backward, which needs no dQ kernel. Each step also stores bf16(dS^T) into a 64 x 64 tile
   of shared memory and, after a barrier, adds its dS K into the fp32 dq_acc with atomics
   (pr_mma_dq_atomic): 5 matrix products of a (query, key) tile instead of 7, and dq no longer
   bitwise reproducible. dk, dv, dkp and dvp are the deterministic kernel's, bit for bit. Its K
   fragments are read from shared memory at each use, as V's are: beside the dS tile's work they
   do not fit the registers (8 more ldmatrix.x4 a sub-tile, 60 for its 80 mma). */
template <int HS, bool FUSED_DQ = false>
__global__ void __launch_bounds__(PR_MMA_THREADS)
pr_k_attention_bwd_dkv_mma(bf16 *dk, bf16 *dv, float *dkp, float *dvp, float *part, int C, float *dq_acc,
                           const bf16 *dout, const float *lse, const float *Dr, const bf16 *q, const bf16 *k,
                           const bf16 *v, const bf16 *kp, const bf16 *vp, const pr_att_ktile *ktiles,
                           const pr_att_tile *qtiles, int n_prefix, int NH, int NKV) {
    constexpr int T = PR_MMA_ROWS * HS, QN = HS == 128 ? 16 : 64;
    extern __shared__ __align__(128) unsigned char pr_dyn_smem[];
    bf16 *ks = (bf16 *)pr_dyn_smem, *vs = ks + T, *qs = vs + T, *dos = qs + 2 * T;
    float *ls = (float *)(dos + 2 * T), *ds = ls + 2 * PR_MMA_ROWS;
    bf16 *dss = (bf16 *)(ds + 2 * PR_MMA_ROWS);       /* FUSED_DQ: bf16(dS^T) of a step, [key][query], swizzled */
    const pr_att_ktile kt = ktiles[blockIdx.x];
    const int hk = blockIdx.y, group = NH / NKV, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool own = kt.chunk < 0;
    const int nq = kt.qhi - kt.qlo, steps = group * nq;
    const size_t qd = (size_t)NH * HS, kvd = (size_t)NKV * HS;
    const float scale = rsqrtf((float)HS), sl2 = scale * PR_LOG2E;

    pr_mma_copy<HS, true>(ks, own ? k : kp, kt.j0, min(PR_MMA_ROWS, kt.end - kt.j0), kvd, hk * HS);
    pr_mma_copy<HS, true>(vs, own ? v : vp, kt.j0, min(PR_MMA_ROWS, kt.end - kt.j0), kvd, hk * HS);
    pr_cp_async_commit();
    pr_dkv_step ld = { kt.qlo, hk * group }, at = ld;  /* the loads' step runs one ahead of the products' */
    auto load_step = [&](int st) {
        pr_dkv_load<HS, false>(qs + st * T, dos + st * T, ls + st * PR_MMA_ROWS, ds + st * PR_MMA_ROWS, qtiles[ld.tile], ld.head, q, dout,
                               lse, Dr, qd, NH);
        ld.next(kt);
    };
    load_step(0);
    pr_cp_async_commit();
    pr_cp_async_wait<1>();                            /* K and V landed (the first step's Q, dO may not have) */
    __syncthreads();
    uint32_t kf[FUSED_DQ ? 1 : HS / 16][4];           /* this warp's 16 keys of K, as A fragments (FUSED_DQ: read at each use) */
    if constexpr (!FUSED_DQ) pr_mma_load_a<HS, HS / 16>(kf, pr_smem_u32(ks), 16 * warp, lane);

    float gk[HS / 8][4], gv[HS / 8][4];
    pr_mma_zero<HS / 8>(gk);
    pr_mma_zero<HS / 8>(gv);
    const int key0 = kt.j0 + 16 * warp;               /* this warp's 16 keys */
    for (int s = 0; s < steps; s++) {
        const int st = s & 1;
        if (s + 1 < steps) load_step(st ^ 1);
        pr_cp_async_turn();
        const pr_att_tile qt = qtiles[at.tile];
        const uint32_t qb = pr_smem_u32(qs + st * T), db = pr_smem_u32(dos + st * T);
        const float *lst = ls + st * PR_MMA_ROWS, *dst = ds + st * PR_MMA_ROWS;
        /* every query of the tile sees every key of the block (most steps): no mask */
        const bool whole = kt.j0 + PR_MMA_ROWS <= kt.end && qt.r1 - qt.r0 == PR_MMA_ROWS && (!own || kt.j0 + PR_MMA_ROWS - 1 <= qt.r0);
PR_UNROLL_1
        for (int sub = 0; sub < PR_MMA_ROWS / QN; sub++) {
            /* S^T = K Q^T, dP^T = V dO^T: 16 keys x QN queries */
            float p[QN / 8][4], dp[QN / 8][4];
            pr_mma_zero<QN / 8>(p);
            pr_mma_zero<QN / 8>(dp);
            if constexpr (FUSED_DQ) pr_mma_abt_s<HS, HS / 16, QN / 16>(p, pr_smem_u32(ks), 16 * warp, qb, sub * QN, lane);
            else pr_mma_abt<HS, HS / 16, QN / 16>(p, kf, qb, sub * QN, lane);
            pr_mma_abt_s<HS, HS / 16, QN / 16>(dp, pr_smem_u32(vs), 16 * warp, db, sub * QN, lane);
            pr_dkv_p<QN / 8>(p, kt, own, whole, key0, qt, sub * QN, lst, lane, sl2);
            pr_dkv_ds<QN / 8>(p, dp, sub * QN, dst, lane);
            if constexpr (FUSED_DQ) {                 /* bf16(dS^T), as the dK product below rounds it */
PR_UNROLL
                for (int nt = 0; nt < QN / 8; nt++)
PR_UNROLL
                    for (int rr = 0; rr < 2; rr++)
                        pr_sts_b32(pr_smem_u32(dss) + 2u * (uint32_t)pr_c_pair_offset(16 * warp, sub * QN + 8 * nt, lane, rr, PR_MMA_ROWS),
                                   pr_pack_bf16x2(dp[nt][2 * rr], dp[nt][2 * rr + 1]));
            }
            /* dV += bf16(P^T) dO,  dK += bf16(dS^T) Q: dO and Q as [k][n] operands, .trans */
            pr_mma_pv<HS, QN / 16, 1>(&gv, &p, 1, db, sub * QN, lane);
            pr_mma_pv<HS, QN / 16, 1>(&gk, &dp, 1, qb, sub * QN, lane);
        }
        if constexpr (FUSED_DQ) {
            __syncthreads();                          /* the step's dS tile is whole */
            pr_mma_dq_atomic<HS>(dq_acc, pr_smem_u32(dss), pr_smem_u32(ks), qt, at.head, qd, warp, lane);
        }
        at.next(kt);
        __syncthreads();
    }
    pr_dkv_store<HS>(dk, dv, dkp, dvp, part, C, kt, gk, gv, key0, hk, (size_t)n_prefix * kvd, kvd, lane, scale);
}

/* dK/dV on Hopper's wgmma (sm_90a; PR_CUDA_ATTENTION_WGMMA): the kernel above (without FUSED_DQ),
   each key's algorithm the same. A block is two warpgroups (256 threads) and two key tiles
   (pr_wg_key_pairs), warpgroup g tile g, its warp w keys 16w .. 16w + 15 of it: the tiles take the
   same query tiles in the same order, so that each step's Q and dO are loaded once for both. The
   second tile of an own pair sees the query tiles from its own on: its warpgroup passes over the
   first's (a branch uniform in the warpgroup, as wgmma needs), so that each tile's steps, and
   their order, are the one-tile kernel's. A step takes a whole 64-row query tile (no sub-tiles):
   S^T = K Q^T and dP^T = V dO^T as HS/16 wgmma m64n64k16 each, all four operands K-major in shared
   memory; then dV += bf16(P^T) dO and dK += bf16(dS^T) Q as 4 wgmma m64nHSk16 each, P^T and dS^T
   from registers, dO and Q MN-major. K and V are read from shared memory by every step's products,
   and no ldmatrix remains. Shared memory in wgmma's panel layout: the two tiles' K, then their V,
   then Q and dO two stages each and lse, D twice, fenced into the async proxy before the barrier
   that publishes a step. */
template <int HS>
__global__ void __launch_bounds__(PR_WG_THREADS)
pr_k_attention_bwd_dkv_wgmma(bf16 *dk, bf16 *dv, float *dkp, float *dvp, float *part, int C, float *dq_acc, const bf16 *dout,
                             const float *lse, const float *Dr, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *kp,
                             const bf16 *vp, const pr_att_ktile *pairs, const pr_att_tile *qtiles, int n_prefix, int NH, int NKV) {
    (void)dq_acc;                                     /* the mma kernel's signature: FUSED_DQ's, unused here */
#if !defined(__CUDACC__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)   /* sm_90a, or the host's emulation */
    constexpr int T = PR_MMA_ROWS * HS;
    extern __shared__ __align__(128) unsigned char pr_dyn_smem[];
    pr_wg_check_base(pr_dyn_smem);
    bf16 *ks = (bf16 *)pr_dyn_smem, *vs = ks + 2 * T, *qs = vs + 2 * T, *dos = qs + 2 * T;
    float *ls = (float *)(dos + 2 * T), *ds = ls + 2 * PR_MMA_ROWS;
    const pr_att_ktile k0 = pairs[2 * blockIdx.x];
    /* the warpgroup through a shuffle, and the region from the first tile: ptxas then knows both are
       the same in every lane of a warp and keeps the wgmma descriptors and the masks' tests uniform
       (taken from threadIdx.x and the warpgroup's tile, they were per lane: the step loop's SASS
       929 instructions at HS 128 against 797, 255 registers and a spill against 242) */
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);
    const pr_att_ktile kt = pairs[2 * blockIdx.x + wg];
    pr_att_ktile walk = kt;                           /* the block's steps: its first tile's (the pair's last query tile is the same) */
    walk.qlo = k0.qlo;
    const int hk = blockIdx.y, group = NH / NKV, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const bool own = k0.chunk < 0;                   /* both tiles' region */
    const int nq = kt.qhi - walk.qlo, steps = group * nq, key0 = kt.j0 + 16 * warp;
    const size_t qd = (size_t)NH * HS, kvd = (size_t)NKV * HS;
    const float scale = rsqrtf((float)HS), sl2 = scale * PR_LOG2E;

PR_UNROLL
    for (int g = 0; g < 2; g++) {                     /* a tile without keys: zeros, from a row that exists */
        const pr_att_ktile x = g ? pairs[2 * blockIdx.x + 1] : k0;
        pr_mma_copy<HS, true, PR_WG_THREADS, true>(ks + g * T, own ? k : kp, x.j0, min(PR_MMA_ROWS, x.end - x.j0), kvd, hk * HS);
        pr_mma_copy<HS, true, PR_WG_THREADS, true>(vs + g * T, own ? v : vp, x.j0, min(PR_MMA_ROWS, x.end - x.j0), kvd, hk * HS);
    }
    pr_cp_async_commit();
    pr_dkv_step ld = { walk.qlo, hk * group }, at = ld;  /* the loads' step runs one ahead of the products' */
    auto load_step = [&](int st) {
        pr_dkv_load<HS, true, PR_WG_THREADS>(qs + st * T, dos + st * T, ls + st * PR_MMA_ROWS, ds + st * PR_MMA_ROWS, qtiles[ld.tile],
                                             ld.head, q, dout, lse, Dr, qd, NH);
        ld.next(walk);
    };
    load_step(0);
    pr_cp_async_commit();
    float gk[HS / 8][4], gv[HS / 8][4];
    pr_mma_zero<HS / 8>(gk);
    pr_mma_zero<HS / 8>(gv);
    const uint32_t kb = pr_smem_u32(ks + wg * T), vb = pr_smem_u32(vs + wg * T);
    for (int s = 0; s < steps; s++) {
        const int st = s & 1;
        pr_cp_async_wait<0>();                      /* this thread's copies of this step (and K, V) landed, */
        pr_fence_proxy_async();                     /* visible to wgmma, */
        __syncthreads();                            /* and every thread's; the other stage is read no more */
        if (s + 1 < steps) {                        /* the next step loads into the other stage while this one computes: */
            load_step(st ^ 1);                      /* ahead of the products, as wgmma in flight across the loads, */
            pr_cp_async_commit();                   /* which both warpgroups run, would be serialized (C7518) */
        }
        if (at.tile >= kt.qlo) {                    /* the one-tile kernel's steps of this tile (none without keys) */
            const uint32_t qb = pr_smem_u32(qs + st * T), db = pr_smem_u32(dos + st * T);
            float p[8][4], dp[8][4];
            pr_mma_zero<8>(p);
            pr_mma_zero<8>(dp);
            pr_wg_hold<32>(&p[0][0]);               /* zeroed before the fence, not moved past it */
            pr_wg_hold<32>(&dp[0][0]);
            pr_wg_fence();
            pr_wg_scores<HS>(p, kb, qb);
            pr_wg_scores<HS>(dp, vb, db);
            const pr_att_tile qt = qtiles[at.tile];
            const bool whole = kt.j0 + PR_MMA_ROWS <= kt.end && qt.r1 - qt.r0 == PR_MMA_ROWS && (!own || kt.j0 + PR_MMA_ROWS - 1 <= qt.r0);
            pr_wg_wait<1>();                        /* S^T is in: P^T, and dV += bf16(P^T) dO, while dP^T is computed */
            pr_wg_hold<32>(&p[0][0]);
            pr_dkv_p<8>(p, kt, own, whole, key0, qt, 0, ls + st * PR_MMA_ROWS, lane, sl2);
            uint32_t pa[4][4], da[4][4];            /* bf16(P^T), bf16(dS^T) as the A fragments of their 4 k16 blocks */
            pr_wg_times<HS>(gv, p, pa, db);         /* dV += bf16(P^T) dO */
            pr_wg_wait<1>();                        /* dP^T is in (dV may still run): dS^T */
            pr_wg_hold<32>(&dp[0][0]);
            pr_dkv_ds<8>(p, dp, 0, ds + st * PR_MMA_ROWS, lane);
            pr_wg_times<HS>(gk, dp, da, qb);        /* dK += bf16(dS^T) Q */
            pr_wg_wait<0>();                        /* the stage is read before the next barrier lets it be refilled */
            pr_wg_hold<HS / 2>(&gv[0][0]);
            pr_wg_hold<HS / 2>(&gk[0][0]);
        }
        at.next(walk);
    }
    pr_dkv_store<HS>(dk, dv, dkp, dvp, part, C, kt, gk, gv, key0, hk, (size_t)n_prefix * kvd, kvd, lane, scale);
#else
    (void)dk, (void)dv, (void)dkp, (void)dvp, (void)part, (void)C, (void)dout, (void)lse, (void)Dr, (void)q, (void)k, (void)v, (void)kp,
        (void)vp, (void)pairs, (void)qtiles, (void)n_prefix, (void)NH, (void)NKV;
#endif
}

/* The fused backward's last step: dq = bf16(dq + scale acc), scale = 1/sqrt(HS) as the dQ kernel
   computes it; n (even) elements. */
__global__ void pr_k_attention_dq_add(bf16 *dq, const float *acc, int HS, size_t n) {
    const float scale = rsqrtf((float)HS);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; 2 * i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t *g = (uint32_t *)dq + i;
        const float2 o = pr_bf16x2_unpack(*g);
        *g = pr_pack_bf16x2(o.x + scale * acc[2 * i], o.y + scale * acc[2 * i + 1]);
    }
}

/* dkp, dvp (n each) += the C partials (part: dK's C, then dV's C), summed in chunk order. */
__global__ void pr_k_attention_chunk_sum(float *dkp, float *dvp, const float *part, int C, size_t n) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < 2 * n; e += (size_t)gridDim.x * blockDim.x) {
        const int which = e >= n;
        const size_t i = e - (which ? n : 0);
        const float *p = part + (size_t)which * C * n + i;
        float s = p[0];
        for (int c = 1; c < C; c++) s += p[(size_t)c * n];
        (which ? dvp : dkp)[i] += s;
    }
}

/* The chunk rule (attn_model.h): C = ceil(256 / (prefix key tiles * NKV)) in [1, query tiles]. */
static int pr_mma_prefix_chunks(int n_prefix, int NKV, int n_qtiles) {
    const int kt = (n_prefix + PR_MMA_ROWS - 1) / PR_MMA_ROWS;
    if (kt == 0) return 0;
    long long C = (PR_MMA_PREFIX_BLOCKS + (long long)kt * NKV - 1) / ((long long)kt * NKV);
    if (C > n_qtiles) C = n_qtiles;
    return C < 1 ? 1 : (int)C;
}

/* Dynamic shared memory of the kernels: 0 forward (Q of 128 rows, K and V twice), 1 dQ (Q, dO, K and V twice),
   2 dK/dV (K, V, Q and dO twice, lse and D twice), 3 the fused dK/dV (and the 64 x 64 bf16 dS tile),
   4 the wgmma dK/dV (K and V of two key tiles, Q and dO twice, lse and D twice). */
static size_t pr_mma_smem_bytes(int HS, int kernel) {
    const size_t T = 2 * PR_MMA_ROWS * (size_t)HS, dkv = 6 * T + 4 * PR_MMA_ROWS * sizeof(float);
    return kernel == 0 ? (PR_MMA_FWD_ROWS / PR_MMA_ROWS + 4) * T : kernel == 1 ? 6 * T : kernel == 2 ? dkv : kernel == 3 ? dkv + 2 * PR_MMA_ROWS * PR_MMA_ROWS
                                                                                                                        : dkv + 2 * T;
}

/* The dK/dV blocks' work: each of the prefix's key tiles in C chunks of the nq query tiles qt,
   then each own key tile (one per query tile: both are 64-row pieces of a segment from its first
   row), seen by the query tiles from its own to its segment's last. Writes them to out unless
   NULL; returns their count (prefix tiles * C + nq). */
static long long pr_mma_key_tiles(pr_att_ktile *out, const pr_att_tile *qt, int nq, int n_prefix, int C) {
    const int npt = (n_prefix + PR_MMA_ROWS - 1) / PR_MMA_ROWS;
    long long n = 0;
    for (int t = 0; t < npt; t++)
        for (int c = 0; c < C; c++, n++)
            if (out) {
                pr_att_ktile x = { t * PR_MMA_ROWS, n_prefix, (int)((long long)c * nq / C), (int)((long long)(c + 1) * nq / C), c };
                out[n] = x;
            }
    for (int a = 0, b; a < nq; a = b) {
        for (b = a; b < nq && qt[b].seg0 == qt[a].seg0; b++) {}
        for (int u = a; u < b; u++, n++)
            if (out) {
                pr_att_ktile x = { qt[u].r0, qt[u].seg1, u, b, -1 };
                out[n] = x;
            }
    }
    return n;
}

/* The wgmma dK/dV's blocks, two tiles each, from pr_mma_key_tiles's list kt of n: prefix tiles t
   and t + 1 of a chunk (the same query tiles), own tiles u and u + 1 of a segment (u + 1 sees the
   query tiles from its own on, a part of u's). A tile without a partner gets one without keys or
   query tiles, at its first key (a row that exists). Writes two tiles a block to out (2 n at
   most); returns the blocks' count. */
static long long pr_wg_key_pairs(pr_att_ktile *out, const pr_att_ktile *kt, long long n, int n_prefix, int C) {
    const long long npt = (n_prefix + PR_MMA_ROWS - 1) / PR_MMA_ROWS;
    long long b = 0;
    for (long long t = 0; t < npt; t += 2)
        for (int c = 0; c < C; c++, b++) {
            const pr_att_ktile first = kt[t * C + c], none = { first.j0, first.j0, first.qhi, first.qhi, first.chunk };
            out[2 * b] = first;
            out[2 * b + 1] = t + 1 < npt ? kt[(t + 1) * C + c] : none;
        }
    for (long long i = npt * C; i < n; b++) {
        const pr_att_ktile first = kt[i], none = { first.j0, first.j0, first.qhi, first.qhi, first.chunk };
        const int paired = i + 1 < n && kt[i + 1].qhi == first.qhi;   /* the same segment */
        out[2 * b] = first;
        out[2 * b + 1] = paired ? kt[i + 1] : none;
        i += 1 + paired;
    }
    return b;
}

#endif /* attention kernels */

#ifndef PR_CUDA_HOST_EMULATION

/* ---------------------------------------------------------------- backend state */
/* cuBLASLt's algorithm for each GEMM shape, asked of its heuristic once (tens of microseconds,
   longer than a small GEMM), kept with the shape's descriptors, so that a GEMM of a known shape is
   one cublasLtMatmul call: a set-associative cache, a shape's hash choosing a set of
   PR_CU_ALGO_WAYS entries, the least recently used of them making room. A dense model has a few
   dozen shapes; MoE gives every expert's row count its own, hundreds of new ones a pass, which must
   not push out the dense shapes used on every layer (a cache flushed whole when full would). */
#define PR_CU_ALGO_SETS 512
#define PR_CU_ALGO_WAYS 8

typedef struct {
    int transa, transb, m, n, k, lda, ldb, ldc, c_fp32, accumulate, align;
} pr_cu_gemm_shape;

typedef struct {
    pr_cu_gemm_shape shape;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
    uint64_t used;                 /* the lookup that last used it; 0: empty */
} pr_cu_algo;

/* Timing pairs: two events around a piece of a stream's work, kept until the times are read; each
   pair tagged with what it timed. */
typedef struct {
    cudaEvent_t *ev;               /* 2 a pair */
    int *tag;                      /* one a pair */
    int used, cap;                 /* pairs */
    int untimed;                   /* some work went untimed: no more events could be had */
} pr_cu_pairs;

/* The operation profile (pr_backend_cuda_profile): per operation its calls and milliseconds, the
   pairs not yet read, and the nesting depth (an operation that calls another is timed once, as the
   outer one). */
#define PR_CU_PROFILE_FOLD 8192    /* pairs read (a stream wait) at the end of the operation that fills them */
typedef struct {
    int on, depth, lost;           /* lost: an operation went untimed or a time could not be read */
    pr_cu_pairs pairs;
    int n;
    char name[PR_CUDA_PROFILE_OPS][PR_CUDA_OP_NAME];
    long calls[PR_CUDA_PROFILE_OPS];
    double ms[PR_CUDA_PROFILE_OPS];
} pr_cu_profile;

typedef struct {
    pr_backend be;                 /* first member: the vtable handed out points here */
    int device;
    cudaStream_t stream;           /* every kernel, GEMM and ordinary copy */
    cudaStream_t copy_stream;      /* offload's block copies, beside the compute */
    cudaEvent_t compute_mark;      /* where compute stood when a block copy was queued */
    cudaEvent_t copy_done[PR_COPY_TAGS];
    pr_cu_pairs copy_pairs;        /* a timing pair around each block copy since the last copy_seconds */
    pr_cu_profile prof;            /* pr_backend_cuda_profile: each operation's time on the stream */
    cublasLtHandle_t lt;
    void *workspace;
    size_t workspace_bytes;
    char *stage_host, *stage_dev;  /* staging ring for host arguments: pinned host, device */
    size_t stage_cap, stage_used;
    void *scratch;                 /* reduction partials and attention row statistics */
    size_t scratch_cap;
    double *reduce_host;           /* pinned: results the host waits for */
    float *row_host;               /* pinned: the loss head's per-row values (3 floats a row) */
    size_t row_host_cap;           /* rows it holds */
    pr_cu_algo algos[PR_CU_ALGO_SETS][PR_CU_ALGO_WAYS];
    pr_cuda_gemm_counts gemm_counts;   /* lookups, heuristic queries and evictions since creation */
    int attention_kind;            /* PR_CUDA_ATTENTION_FFMA, _MMA, _MMA_ATOMIC or _WGMMA (pr_backend_cuda_set_attention) */
    uint64_t smem_opted;           /* attention kernels given their shared memory (pr_cu_smem_attr) */
    pr_status failed;              /* first failure since take_error */
    char message[512];
} pr_cu;

static pr_cu *pr_cu_of(const pr_backend *be) { return (pr_cu *)be->ctx; }

static void pr_cu_fail(pr_cu *cx, pr_status st, const char *fmt, ...) {
    if (cx->failed) return;        /* the first failure explains the rest */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cx->message, sizeof cx->message, fmt, ap);
    va_end(ap);
    cx->failed = st;
}

/* A CUDA runtime call; on failure remember where. Returns nonzero when it succeeded. */
static int pr_cu_ok(pr_cu *cx, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 1;
    pr_cu_fail(cx, PR_ERR_DEVICE, "CUDA: %s: %s", what, cudaGetErrorString(e));
    return 0;
}
static int pr_lt_ok(pr_cu *cx, cublasStatus_t e, const char *what) {
    if (e == CUBLAS_STATUS_SUCCESS) return 1;
    pr_cu_fail(cx, PR_ERR_DEVICE, "cuBLASLt: %s: status %d", what, (int)e);
    return 0;
}
/* After every launch: a bad configuration shows up here, a fault at the next synchronisation. */
static void pr_cu_launched(pr_cu *cx, const char *kernel) { pr_cu_ok(cx, cudaGetLastError(), kernel); }

static unsigned pr_cu_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 0x7fffffff ? 0x7fffffff : (b ? b : 1));
}

/* Device scratch of at least `bytes`; growing it waits for the stream (rare: sizes settle after
   the first step). */
static void *pr_cu_scratch(pr_cu *cx, size_t bytes) {
    if (bytes <= cx->scratch_cap) return cx->scratch;
    cudaStreamSynchronize(cx->stream);
    cudaFree(cx->scratch);
    cx->scratch = NULL;
    cx->scratch_cap = 0;
    if (!pr_cu_ok(cx, cudaMalloc(&cx->scratch, bytes), "scratch allocation")) return NULL;
    cx->scratch_cap = bytes;
    return cx->scratch;
}

/* Host arguments travel through a ring: pinned host memory, so the copy is asynchronous, and a
   device twin the kernels read. An operation that stages several arrays reserves room for all of
   them first: a wrap in the middle would let a later copy overwrite a slot an earlier array of the
   same operation still needs. A wrap drains the stream, so no copy or kernel still reads the ring. */
#define PR_CU_STAGE_ALIGN 256
static size_t pr_cu_stage_size(size_t bytes) { return (bytes + PR_CU_STAGE_ALIGN - 1) / PR_CU_STAGE_ALIGN * PR_CU_STAGE_ALIGN; }

static int pr_cu_stage_reserve(pr_cu *cx, size_t need) {
    if (need > cx->stage_cap) {
        cudaStreamSynchronize(cx->stream);
        cudaFreeHost(cx->stage_host);
        cudaFree(cx->stage_dev);
        cx->stage_host = cx->stage_dev = NULL;
        cx->stage_cap = cx->stage_used = 0;
        size_t cap = need * 2 > ((size_t)16 << 20) ? need * 2 : ((size_t)16 << 20);
        if (!pr_cu_ok(cx, cudaMallocHost((void **)&cx->stage_host, cap), "staging ring (host)") ||
            !pr_cu_ok(cx, cudaMalloc((void **)&cx->stage_dev, cap), "staging ring (device)"))
            return 0;
        cx->stage_cap = cap;
    }
    if (cx->stage_used + need > cx->stage_cap) {
        pr_cu_ok(cx, cudaStreamSynchronize(cx->stream), "staging ring wrap");
        cx->stage_used = 0;
    }
    return 1;
}

/* Copies a host array into the ring (room reserved before, or reserved here) and returns its
   device address, valid for the kernels of the current operation. */
static const void *pr_cu_stage(pr_cu *cx, const void *host, size_t bytes) {
    size_t need = pr_cu_stage_size(bytes);
    if (cx->stage_used + need > cx->stage_cap && !pr_cu_stage_reserve(cx, need)) return NULL;
    char *h = cx->stage_host + cx->stage_used, *d = cx->stage_dev + cx->stage_used;
    memcpy(h, host, bytes);
    pr_cu_ok(cx, cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, cx->stream), "staging copy");
    cx->stage_used += need;
    return d;
}

/* ---------------------------------------------------------------- timing: block copies, the operation profile */
/* A pair for the next timed work (its index), tagged, or -1 when no more events can be had: the
   work goes untimed, and the next read says so. */
static int pr_cu_pair_take(pr_cu_pairs *p, int tag) {
    if (p->used == p->cap) {
        const int cap = p->cap ? 2 * p->cap : 32;
        cudaEvent_t *ev = (cudaEvent_t *)realloc(p->ev, sizeof(cudaEvent_t) * 2 * (size_t)cap);
        if (ev) p->ev = ev;
        int *tags = ev ? (int *)realloc(p->tag, sizeof(int) * (size_t)cap) : NULL;
        if (tags) p->tag = tags;
        while (tags && p->cap < cap && cudaEventCreate(&ev[2 * p->cap]) == cudaSuccess) {
            if (cudaEventCreate(&ev[2 * p->cap + 1]) != cudaSuccess) {
                cudaEventDestroy(ev[2 * p->cap]);
                break;
            }
            p->cap++;
        }
        if (p->cap < cap) cudaGetLastError();     /* a failed creation fails no launch after it */
        if (p->used == p->cap) {
            p->untimed = 1;
            return -1;
        }
    }
    p->tag[p->used] = tag;
    return p->used++;
}
/* Waits for stream s, adds each pair's milliseconds to ms[its tag], and frees the pairs. 0 when some
   work went untimed or a time could not be read (the sums are then short); a timing that fails
   fails no step. */
static int pr_cu_pairs_read(pr_cu *cx, pr_cu_pairs *p, cudaStream_t s, double *ms) {
    int ok = !p->untimed && pr_cu_ok(cx, cudaStreamSynchronize(s), "timing");
    for (int i = 0; ok && i < p->used; i++) {
        float one = 0;
        ok = cudaEventElapsedTime(&one, p->ev[2 * i], p->ev[2 * i + 1]) == cudaSuccess;
        ms[p->tag[i]] += one;
    }
    if (!ok) cudaGetLastError();
    p->used = 0;
    p->untimed = 0;
    return ok;
}
static void pr_cu_pairs_free(pr_cu_pairs *p) {
    for (int i = 0; i < 2 * p->cap; i++) cudaEventDestroy(p->ev[i]);
    free(p->ev);
    free(p->tag);
    memset(p, 0, sizeof *p);
}

/* The profile's row for an operation (name, and for a GEMM its shape), or -1 when the table is full. */
static int pr_cu_profile_row(pr_cu_profile *pf, const char *name, int in, int out) {
    char key[sizeof pf->name[0]];
    if (in) snprintf(key, sizeof key, "%s %dx%d", name, in, out);
    else snprintf(key, sizeof key, "%s", name);
    for (int i = 0; i < pf->n; i++)
        if (!strcmp(pf->name[i], key)) return i;
    if (pf->n == PR_CUDA_PROFILE_OPS) return -1;
    snprintf(pf->name[pf->n], sizeof pf->name[0], "%s", key);
    pf->calls[pf->n] = 0;
    pf->ms[pf->n] = 0;
    return pf->n++;
}
static void pr_cu_profile_read(pr_cu *cx) {
    if (!pr_cu_pairs_read(cx, &cx->prof.pairs, cx->stream, cx->prof.ms)) cx->prof.lost = 1;
}
/* One backend operation on the stream, timed while the profile is on: the scope's first line, so
   that the pair brackets everything the operation queues. An operation inside another (a wrapper
   calling the general one) counts as the outer one. `in`, `out`: a GEMM's sizes (0 otherwise). */
struct pr_cu_op_scope {
    pr_cu *cx;
    int pair;
    bool counted;                  /* the depth was raised */
    pr_cu_op_scope(const pr_backend *be, const char *name, int in = 0, int out = 0) : cx(pr_cu_of(be)), pair(-1), counted(false) {
        pr_cu_profile *pf = &cx->prof;
        if (!pf->on) return;
        counted = true;
        if (pf->depth++) return;
        const int row = pr_cu_profile_row(pf, name, in, out);
        if (row < 0) { pf->lost = 1; return; }
        pf->calls[row]++;
        pair = pr_cu_pair_take(&pf->pairs, row);
        if (pair >= 0 && !pr_cu_ok(cx, cudaEventRecord(pf->pairs.ev[2 * pair], cx->stream), "profile")) {
            pf->pairs.untimed = 1;     /* the pair may hold an old recording: its time is not this one's */
            pair = -1;
        }
    }
    ~pr_cu_op_scope() {
        pr_cu_profile *pf = &cx->prof;
        if (!counted || --pf->depth) return;
        if (pair >= 0 && !pr_cu_ok(cx, cudaEventRecord(pf->pairs.ev[2 * pair + 1], cx->stream), "profile")) pf->pairs.untimed = 1;
        if (pf->pairs.used >= PR_CU_PROFILE_FOLD) pr_cu_profile_read(cx);
    }
    pr_cu_op_scope(const pr_cu_op_scope &) = delete;
    pr_cu_op_scope &operator=(const pr_cu_op_scope &) = delete;
};
#define PR_CU_OP(be, ...) pr_cu_op_scope pr_cu_op_(be, __VA_ARGS__)

/* ---------------------------------------------------------------- memory */
static void *pr_cu_alloc(const pr_backend *be, size_t bytes, pr_tier tier) {
    void *p = NULL;
    cudaError_t e = tier == PR_TIER_HOST ? cudaMallocHost(&p, bytes ? bytes : 1) : cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cudaGetLastError();        /* an out-of-memory is reported as NULL, not kept as a failure */
        return NULL;
    }
    (void)be;
    return p;
}
static void pr_cu_release(const pr_backend *be, void *p, pr_tier tier) {
    pr_cu *cx = pr_cu_of(be);
    pr_cu_ok(cx, tier == PR_TIER_HOST ? cudaFreeHost(p) : cudaFree(p), "free");
}
static void pr_cu_zero(const pr_backend *be, void *p, size_t bytes) {
    PR_CU_OP(be, "zero");
    pr_cu *cx = pr_cu_of(be);
    pr_cu_ok(cx, cudaMemsetAsync(p, 0, bytes, cx->stream), "memset");
}
static void pr_cu_copy(const pr_backend *be, void *dst, const void *src, size_t bytes) {
    PR_CU_OP(be, "copy");
    pr_cu *cx = pr_cu_of(be);
    pr_cu_ok(cx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cx->stream), "copy");
}
/* From pageable host memory the runtime stages the data before returning, so `host` may be reused
   as soon as this returns. */
static void pr_cu_upload(const pr_backend *be, pr_real *dst, const pr_real *host, size_t n) {
    PR_CU_OP(be, "upload");
    pr_cu *cx = pr_cu_of(be);
    pr_cu_ok(cx, cudaMemcpyAsync(dst, host, n * sizeof(float), cudaMemcpyHostToDevice, cx->stream), "upload");
}
static void pr_cu_download(const pr_backend *be, pr_real *host, const pr_real *src, size_t n) {
    PR_CU_OP(be, "download");
    pr_cu *cx = pr_cu_of(be);
    if (pr_cu_ok(cx, cudaMemcpyAsync(host, src, n * sizeof(float), cudaMemcpyDeviceToHost, cx->stream), "download"))
        pr_cu_ok(cx, cudaStreamSynchronize(cx->stream), "download");
}
static void pr_cu_sync(const pr_backend *be) {
    pr_cu *cx = pr_cu_of(be);
    pr_cu_ok(cx, cudaStreamSynchronize(cx->stream), "synchronize") &&
        pr_cu_ok(cx, cudaStreamSynchronize(cx->copy_stream), "synchronize copies");
}
/* The copy starts once the compute queued so far is done, and runs beside what is queued after. */
static void pr_cu_copy_async(const pr_backend *be, void *dst, const void *src, size_t bytes, int tag) {
    pr_cu *cx = pr_cu_of(be);
    if (tag < 0 || tag >= PR_COPY_TAGS) { pr_cu_fail(cx, PR_ERR_ARG, "copy_async: tag %d out of range", tag); return; }
    const int t = pr_cu_pair_take(&cx->copy_pairs, 0);
    const cudaEvent_t *ev = t < 0 ? NULL : cx->copy_pairs.ev + 2 * t;
    const int ok = pr_cu_ok(cx, cudaEventRecord(cx->compute_mark, cx->stream), "copy_async mark") &&
                   pr_cu_ok(cx, cudaStreamWaitEvent(cx->copy_stream, cx->compute_mark, 0), "copy_async order") &&
                   (t < 0 || pr_cu_ok(cx, cudaEventRecord(ev[0], cx->copy_stream), "copy_async start")) &&
                   pr_cu_ok(cx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cx->copy_stream), "copy_async") &&
                   (t < 0 || pr_cu_ok(cx, cudaEventRecord(ev[1], cx->copy_stream), "copy_async end")) &&
                   pr_cu_ok(cx, cudaEventRecord(cx->copy_done[tag], cx->copy_stream), "copy_async done");
    if (!ok && t >= 0) cx->copy_pairs.untimed = 1;    /* its pair may hold an old recording */
}
/* The block copies' times since the last call, summed; -1 when some went untimed. */
static double pr_cu_copy_seconds(const pr_backend *be) {
    pr_cu *cx = pr_cu_of(be);
    double ms = 0;
    return pr_cu_pairs_read(cx, &cx->copy_pairs, cx->copy_stream, &ms) ? ms / 1e3 : -1;
}
static void pr_cu_copy_wait(const pr_backend *be, int tag) {
    PR_CU_OP(be, "copy_wait");       /* the compute stream idle until the block copy lands */
    pr_cu *cx = pr_cu_of(be);
    if (tag < 0 || tag >= PR_COPY_TAGS) { pr_cu_fail(cx, PR_ERR_ARG, "copy_wait: tag %d out of range", tag); return; }
    pr_cu_ok(cx, cudaStreamWaitEvent(cx->stream, cx->copy_done[tag], 0), "copy_wait");
}

/* ---------------------------------------------------------------- bf16 conversion */
__global__ void pr_k_to_bf16(bf16 *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(src[i]);
}

/* ---------------------------------------------------------------- GEMM (cuBLASLt) */
static int pr_cu_align(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 2 && a % (uintptr_t)al) al /= 2;
    return al;
}

/* The cache entry holding shape s (*hit = 1), or the one to fill with it (*hit = 0): an empty way
   of its set, else the least recently used. Either way it is marked used now. */
static pr_cu_algo *pr_cu_algo_entry(pr_cu *cx, const pr_cu_gemm_shape *s, int *hit) {
    const unsigned char *b = (const unsigned char *)s;
    uint32_t h = 2166136261u;                                   /* FNV-1a over the shape's ints */
    for (size_t i = 0; i < sizeof *s; i++) h = (h ^ b[i]) * 16777619u;
    pr_cu_algo *set = cx->algos[h % PR_CU_ALGO_SETS], *room = &set[0];
    const uint64_t now = ++cx->gemm_counts.lookups;
    *hit = 0;
    for (int w = 0; w < PR_CU_ALGO_WAYS; w++) {
        if (set[w].used && !memcmp(&set[w].shape, s, sizeof *s)) {
            room = &set[w];
            *hit = 1;
            break;
        }
        if (set[w].used < room->used) room = &set[w];
    }
    room->used = now;
    return room;
}

/* An entry back to empty, its descriptors destroyed. */
static void pr_cu_algo_clear(pr_cu_algo *e) {
    if (e->ld) cublasLtMatrixLayoutDestroy(e->ld);
    if (e->lb) cublasLtMatrixLayoutDestroy(e->lb);
    if (e->la) cublasLtMatrixLayoutDestroy(e->la);
    if (e->op) cublasLtMatmulDescDestroy(e->op);
    memset(e, 0, sizeof *e);
}

/* Entry e (marked used) takes shape s: its descriptors, and the heuristic's first choice for them.
   0 on a failure (recorded), which leaves e empty. */
static int pr_cu_algo_fill(pr_cu *cx, pr_cu_algo *e, const pr_cu_gemm_shape *s) {
    if (e->shape.m) cx->gemm_counts.evictions++;                /* the way held another shape */
    pr_cu_algo_clear(e);
    cx->gemm_counts.queries++;
    const cudaDataType_t dt = s->c_fp32 ? CUDA_R_32F : CUDA_R_16BF;
    const cublasOperation_t ta = s->transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = s->transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int m = s->m, n = s->n, k = s->k;
    const uint32_t al = (uint32_t)s->align;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    int ok = pr_lt_ok(cx, cublasLtMatmulDescCreate(&e->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc") &&
             pr_lt_ok(cx, cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "transa") &&
             pr_lt_ok(cx, cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "transb") &&
             pr_lt_ok(cx, cublasLtMatrixLayoutCreate(&e->la, CUDA_R_16BF, s->transa ? k : m, s->transa ? m : k, s->lda), "layout A") &&
             pr_lt_ok(cx, cublasLtMatrixLayoutCreate(&e->lb, CUDA_R_16BF, s->transb ? n : k, s->transb ? k : n, s->ldb), "layout B") &&
             pr_lt_ok(cx, cublasLtMatrixLayoutCreate(&e->ld, dt, m, n, s->ldc), "layout D") &&
             pr_lt_ok(cx, cublasLtMatmulPreferenceCreate(&pref), "preference") &&
             pr_lt_ok(cx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                               &cx->workspace_bytes, sizeof cx->workspace_bytes), "workspace") &&
             pr_lt_ok(cx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof al), "align A") &&
             pr_lt_ok(cx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof al), "align B") &&
             pr_lt_ok(cx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof al), "align C") &&
             pr_lt_ok(cx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof al), "align D") &&
             pr_lt_ok(cx, cublasLtMatmulAlgoGetHeuristic(cx->lt, e->op, e->la, e->lb, e->ld, e->ld, pref, 1, &res, &found), "heuristic");
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ok && !found) {
        pr_cu_fail(cx, PR_ERR_DEVICE, "cuBLASLt has no algorithm for a %dx%dx%d bf16 GEMM", m, n, k);
        ok = 0;
    }
    if (!ok) {
        pr_cu_algo_clear(e);
        return 0;
    }
    e->shape = *s;
    e->algo = res.algo;
    e->used = (uint64_t)cx->gemm_counts.lookups;               /* this lookup's mark, which the clear above undid */
    return 1;
}

/* D (m,n) = A op (m,k) * B op (k,n) [+ D], column-major as cuBLASLt sees it. A and B bf16; D bf16
   or fp32 (c_fp32); fp32 compute. Row-major callers pass the transposed problem (see matmul_*). */
static void pr_cu_gemm(pr_cu *cx, int transa, int transb, int m, int n, int k, const bf16 *A, int lda,
                       const bf16 *B, int ldb, void *D, int ldd, int c_fp32, int accumulate) {
    if (m <= 0 || n <= 0 || k <= 0 || !A || !B || cx->failed) return;
    /* the heuristic's choice depends only on the problem (the alignment of the pointers included),
       so it is asked once per shape */
    pr_cu_gemm_shape shape;
    memset(&shape, 0, sizeof shape);
    shape.transa = transa; shape.transb = transb; shape.m = m; shape.n = n; shape.k = k;
    shape.lda = lda; shape.ldb = ldb; shape.ldc = ldd; shape.c_fp32 = c_fp32; shape.accumulate = accumulate;
    shape.align = pr_cu_align(A);
    if (pr_cu_align(B) < shape.align) shape.align = pr_cu_align(B);
    if (pr_cu_align(D) < shape.align) shape.align = pr_cu_align(D);
    int known;
    pr_cu_algo *e = pr_cu_algo_entry(cx, &shape, &known);
    if (!known && !pr_cu_algo_fill(cx, e, &shape)) return;
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    pr_lt_ok(cx, cublasLtMatmul(cx->lt, e->op, &alpha, A, e->la, B, e->lb, &beta, D, e->ld, D, e->ld, &e->algo,
                                cx->workspace, cx->workspace_bytes, cx->stream), "matmul");
}

/* Row-major out (N,OC) = inp (N,C) @ w^T is column-major out^T (OC,N) = w (OC,C) . inp^T (C,N):
   A = w stored (C x OC) transposed, B = inp stored (C x N). */
static void pr_cu_matmul_fwd(const pr_backend *be, void *out, const void *inp, const void *w, int N, int C, int OC) {
    PR_CU_OP(be, "matmul_fwd", C, OC);
    pr_cu *cx = pr_cu_of(be);
    pr_cu_gemm(cx, 1, 0, OC, N, C, (const bf16 *)w, C, (const bf16 *)inp, C, out, OC, 0, 0);
}
/* dinp^T (C,N) += w^T (C,OC) . dout^T (OC,N);   dw^T (C,OC) += inp^T (C,N) . dout (N,OC) */
static void pr_cu_matmul_bwd(const pr_backend *be, void *dinp, pr_real *dw, const void *dout, const void *inp,
                             const void *w, int N, int C, int OC) {
    PR_CU_OP(be, "matmul_bwd", C, OC);
    pr_cu *cx = pr_cu_of(be);
    pr_cu_gemm(cx, 0, 0, C, N, OC, (const bf16 *)w, C, (const bf16 *)dout, OC, dinp, C, 0, 1);
    pr_cu_gemm(cx, 0, 1, C, OC, N, (const bf16 *)inp, C, (const bf16 *)dout, OC, dw, C, 1, 1);
}

/* ---------------------------------------------------------------- block reductions */
/* Sum over the block in a fixed tree; every thread gets the result. `buf` holds 32 floats. */
__device__ float pr_block_sum(float v, float *buf) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();               /* buf may still be read by a previous call */
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    v = lane < nw ? buf[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ float pr_block_max(float v, float *buf) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    v = lane < nw ? buf[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ float pr_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* ---------------------------------------------------------------- RMSNorm */
/* One warp per row: out = (x * r) * w, r = (mean(x^2) + eps)^(-1/2). */
__global__ void pr_k_rmsnorm_fwd(bf16 *out, float *rstd, const bf16 *inp, const bf16 *w, int N, int C, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const bf16 *x = inp + (size_t)row * C;
    float ss = 0;
    for (int i = lane; i < C; i += 32) { float v = __bfloat162float(x[i]); ss += v * v; }
    ss = pr_warp_sum(ss);
    float r = rsqrtf(ss / C + eps);
    bf16 *o = out + (size_t)row * C;
    for (int i = lane; i < C; i += 32) o[i] = __float2bfloat16(__bfloat162float(x[i]) * r * __bfloat162float(w[i]));
    if (lane == 0) rstd[row] = r;
}

/* dx += r (dy w) - x r^3 mean(dy w x); one warp per row. */
__global__ void pr_k_rmsnorm_bwd_dx(bf16 *dinp, const bf16 *dout, const bf16 *inp, const bf16 *w, const float *rstd,
                                    int N, int C) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const bf16 *x = inp + (size_t)row * C, *dy = dout + (size_t)row * C;
    float r = rstd[row], dot = 0;
    for (int i = lane; i < C; i += 32) dot += __bfloat162float(dy[i]) * __bfloat162float(w[i]) * __bfloat162float(x[i]);
    dot = pr_warp_sum(dot);
    float k = r * r * r * dot / C;
    bf16 *dx = dinp + (size_t)row * C;
    for (int i = lane; i < C; i += 32) {
        float g = r * __bfloat162float(dy[i]) * __bfloat162float(w[i]) - k * __bfloat162float(x[i]);
        dx[i] = __float2bfloat16(__bfloat162float(dx[i]) + g);
    }
}

/* dw partials: block (column slice, row chunk) sums dy x r over its rows into part[chunk][col]. */
__global__ void pr_k_rmsnorm_bwd_dw_part(float *part, const bf16 *dout, const bf16 *inp, const float *rstd,
                                         int N, int C, int rows_per_chunk) {
    int col = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (col >= C) return;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float s = 0;
    for (int r = r0; r < r1; r++)
        s += __bfloat162float(dout[(size_t)r * C + col]) * __bfloat162float(inp[(size_t)r * C + col]) * rstd[r];
    part[(size_t)chunk * C + col] = s;
}
/* dw[col] += sum of the chunks' partials, in chunk order. */
__global__ void pr_k_sum_parts(float *dw, const float *part, int chunks, int C) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= C) return;
    float s = 0;
    for (int c = 0; c < chunks; c++) s += part[(size_t)c * C + col];
    dw[col] += s;
}

static void pr_cu_rmsnorm_fwd(const pr_backend *be, void *out, void *rstd, const void *inp, const void *w,
                              int N, int C, double eps) {
    PR_CU_OP(be, "rmsnorm_fwd");
    pr_cu *cx = pr_cu_of(be);
    if (N <= 0) return;
    PR_LAUNCH(pr_k_rmsnorm_fwd, pr_cu_blocks((size_t)N, 8), 256, 0, cx->stream, (bf16 *)out, (float *)rstd, (const bf16 *)inp,
                                                                          (const bf16 *)w, N, C, (float)eps);
    pr_cu_launched(cx, "rmsnorm_fwd");
}
static void pr_cu_rmsnorm_bwd(const pr_backend *be, void *dinp, pr_real *dw, const void *dout, const void *inp,
                              const void *w, const void *rstd, int N, int C) {
    PR_CU_OP(be, "rmsnorm_bwd");
    pr_cu *cx = pr_cu_of(be);
    if (N <= 0) return;
    PR_LAUNCH(pr_k_rmsnorm_bwd_dx, pr_cu_blocks((size_t)N, 8), 256, 0, cx->stream, (bf16 *)dinp, (const bf16 *)dout,
                                                                             (const bf16 *)inp, (const bf16 *)w, (const float *)rstd, N, C);
    pr_cu_launched(cx, "rmsnorm_bwd_dx");
    /* at most 1024 chunks: the partials stay small and the final loop short */
    int rows_per_chunk = N / 1024 + 1, chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
    float *part = (float *)pr_cu_scratch(cx, (size_t)chunks * C * sizeof(float));
    if (!part) return;
    dim3 grid(pr_cu_blocks((size_t)C, 128), (unsigned)chunks);
    PR_LAUNCH(pr_k_rmsnorm_bwd_dw_part, grid, 128, 0, cx->stream, part, (const bf16 *)dout, (const bf16 *)inp,
                                                             (const float *)rstd, N, C, rows_per_chunk);
    pr_cu_launched(cx, "rmsnorm_bwd_dw");
    PR_LAUNCH(pr_k_sum_parts, pr_cu_blocks((size_t)C, 128), 128, 0, cx->stream, dw, part, chunks, C);
    pr_cu_launched(cx, "rmsnorm_bwd_sum");
}

/* ---------------------------------------------------------------- RoPE */
/* The row's segment by binary search over seg_off (n_seg+1 entries). */
__device__ int pr_segment_of(const int *seg_off, int n_seg, int r) {
    int lo = 0, hi = n_seg - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (seg_off[mid] <= r) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Rotate-half pairing (element i with i + HS/2), angle pos * inv_freq[i]; sign -1 is the backward.
   The angle is reduced in double: positions reach 10^5 and a float angle would lose the phase. */
__global__ void pr_k_rope(bf16 *x, const int *seg_off, int n_seg, int pos0, int N, int heads, int HS,
                          const float *inv_freq, float sign) {
    int half = HS / 2;
    size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x, total = (size_t)N * heads * half;
    if (idx >= total) return;
    int i = (int)(idx % half), h = (int)((idx / half) % heads), r = (int)(idx / ((size_t)half * heads));
    int s = pr_segment_of(seg_off, n_seg, r);
    double ang = (double)(pos0 + r - seg_off[s]) * (double)inv_freq[i];
    double sn, cs;
    sincos(ang, &sn, &cs);
    float c = (float)cs, sg = sign * (float)sn;
    bf16 *v = x + ((size_t)r * heads + h) * HS;
    float a = __bfloat162float(v[i]), b = __bfloat162float(v[i + half]);
    v[i] = __float2bfloat16(a * c - b * sg);
    v[i + half] = __float2bfloat16(b * c + a * sg);
}

static void pr_cu_rope(const pr_backend *be, void *x, const pr_seq_layout *lay, int heads, int HS,
                       const pr_real *inv_freq, float sign) {
    pr_cu *cx = pr_cu_of(be);
    int N = lay->seg_off[lay->n_seg];
    if (N <= 0) return;
    const int *seg = (const int *)pr_cu_stage(cx, lay->seg_off, sizeof(int) * (size_t)(lay->n_seg + 1));
    if (!seg) return;
    size_t total = (size_t)N * heads * (HS / 2);
    PR_LAUNCH(pr_k_rope, pr_cu_blocks(total, 256), 256, 0, cx->stream, (bf16 *)x, seg, lay->n_seg, lay->pos0, N, heads, HS,
                                                                 inv_freq, sign);
    pr_cu_launched(cx, "rope");
}
static void pr_cu_rope_fwd(const pr_backend *be, void *x, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq) {
    PR_CU_OP(be, "rope_fwd");
    pr_cu_rope(be, x, lay, heads, HS, inv_freq, 1.0f);
}
static void pr_cu_rope_bwd(const pr_backend *be, void *dx, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq) {
    PR_CU_OP(be, "rope_bwd");
    pr_cu_rope(be, dx, lay, heads, HS, inv_freq, -1.0f);
}

/* ---------------------------------------------------------------- attention: launches */
/* D[r, h] = dout . out over the head: the softmax backward's row term. */
__global__ void pr_k_attention_rowdot(float *Dr, const bf16 *dout, const bf16 *out, int N, int NH, int HS) {
    int idx = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (idx >= N * NH) return;
    const bf16 *a = dout + (size_t)idx * HS, *b = out + (size_t)idx * HS;
    float s = 0;
    for (int i = lane; i < HS; i += 32) s += __bfloat162float(a[i]) * __bfloat162float(b[i]);
    s = pr_warp_sum(s);
    if (lane == 0) Dr[idx] = s;
}

/* The query tiles of a layout (pr_att_query_tiles, `rows` a tile) in host memory the caller frees;
   the count, or -1. */
static int pr_cu_query_tiles(pr_att_tile **out, const pr_seq_layout *lay, int rows) {
    int n = pr_att_query_tiles(NULL, lay->n_seg, lay->seg_off, rows);
    pr_att_tile *t = (pr_att_tile *)malloc(sizeof(pr_att_tile) * (size_t)(n ? n : 1));
    if (!t) return -1;
    pr_att_query_tiles(t, lay->n_seg, lay->seg_off, rows);
    *out = t;
    return n;
}

/* A kernel with more than 48 KiB of dynamic shared memory opts in to it, once per device (the
   setting belongs to the function): the attention kernels' opt-ins, one bit each, by kernel and head dim. */
enum { PR_CU_ATT_FWD, PR_CU_ATT_DQ, PR_CU_ATT_DKV, PR_CU_ATT_FWD_MMA, PR_CU_ATT_DQ_MMA, PR_CU_ATT_DKV_MMA, PR_CU_ATT_DKV_FUSED,
       PR_CU_ATT_FWD_WGMMA, PR_CU_ATT_DQ_WGMMA, PR_CU_ATT_DKV_WGMMA };
template <typename K>
static int pr_cu_smem_attr(pr_cu *cx, K kernel, int which, int HS, size_t smem, const char *what) {
    const uint64_t bit = (uint64_t)1 << (4 * which + (HS == 16 ? 0 : HS == 32 ? 1 : HS == 64 ? 2 : 3));
    if (cx->smem_opted & bit) return 1;
    if (!pr_cu_ok(cx, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), what)) return 0;
    cx->smem_opted |= bit;
    return 1;
}


template <int HS>
static void pr_cu_attention_fwd_hs(pr_cu *cx, void *out, void *lse, const void *q, const void *k, const void *v,
                                   const void *kp, const void *vp, const pr_seq_layout *lay, int NH, int NKV) {
    pr_att_tile *tiles;
    int nt = pr_cu_query_tiles(&tiles, lay, PR_ATT_ROWS);
    if (nt < 0) { pr_cu_fail(cx, PR_ERR_NOMEM, "attention: out of host memory"); return; }
    const pr_att_tile *dt = nt ? (const pr_att_tile *)pr_cu_stage(cx, tiles, sizeof(pr_att_tile) * (size_t)nt) : NULL;
    free(tiles);
    if (!dt) return;
    size_t smem = pr_att_smem_bytes(HS, 0);
    if (!pr_cu_smem_attr(cx, pr_k_attention_fwd<HS>, PR_CU_ATT_FWD, HS, smem, "attention_fwd shared memory")) return;
    PR_LAUNCH(pr_k_attention_fwd<HS>, dim3((unsigned)nt, (unsigned)NH), PR_ATT_THREADS, smem, cx->stream,
        (bf16 *)out, (float *)lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, (const bf16 *)kp,
        (const bf16 *)vp, dt, lay->n_prefix, NH, NKV);
    pr_cu_launched(cx, "attention_fwd");
}

template <int HS>
static void pr_cu_attention_bwd_hs(pr_cu *cx, void *dq, void *dk, void *dv, float *dkp, float *dvp, const void *dout,
                                   const void *out, const void *lse, const void *q, const void *k, const void *v,
                                   const void *kp, const void *vp, const pr_seq_layout *lay, int NH, int NKV) {
    const int N = lay->seg_off[lay->n_seg], np = lay->n_prefix;
    pr_att_tile *qt;
    int nq = pr_cu_query_tiles(&qt, lay, PR_ATT_ROWS);
    if (nq < 0) { pr_cu_fail(cx, PR_ERR_NOMEM, "attention: out of host memory"); return; }
    const int nk = pr_att_key_tiles(NULL, qt, nq, np);
    pr_att_tile *kt = (pr_att_tile *)malloc(sizeof(pr_att_tile) * (size_t)(nk ? nk : 1));
    if (!kt) { free(qt); pr_cu_fail(cx, PR_ERR_NOMEM, "attention: out of host memory"); return; }
    pr_att_key_tiles(kt, qt, nq, np);
    if (!pr_cu_stage_reserve(cx, pr_cu_stage_size(sizeof(pr_att_tile) * (size_t)nq) + pr_cu_stage_size(sizeof(pr_att_tile) * (size_t)nk))) {
        free(qt);
        free(kt);
        return;
    }
    const pr_att_tile *dqt = nq ? (const pr_att_tile *)pr_cu_stage(cx, qt, sizeof(pr_att_tile) * (size_t)nq) : NULL;
    const pr_att_tile *dkt = nk ? (const pr_att_tile *)pr_cu_stage(cx, kt, sizeof(pr_att_tile) * (size_t)nk) : NULL;
    free(qt);
    free(kt);
    float *Dr = (float *)pr_cu_scratch(cx, sizeof(float) * (size_t)N * NH);
    if (!dqt || !dkt || !Dr) return;
    PR_LAUNCH(pr_k_attention_rowdot, pr_cu_blocks((size_t)N * NH, 8), 256, 0, cx->stream, Dr, (const bf16 *)dout,
                                                                                    (const bf16 *)out, N, NH, HS);
    pr_cu_launched(cx, "attention_rowdot");
    size_t smem = pr_att_smem_bytes(HS, 0);
    if (!pr_cu_smem_attr(cx, pr_k_attention_bwd_dq<HS>, PR_CU_ATT_DQ, HS, smem, "attention_bwd_dq shared memory")) return;
    PR_LAUNCH(pr_k_attention_bwd_dq<HS>, dim3((unsigned)nq, (unsigned)NH), PR_ATT_THREADS, smem, cx->stream,
        (bf16 *)dq, (const bf16 *)dout, (const float *)lse, Dr, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v,
        (const bf16 *)kp, (const bf16 *)vp, dqt, np, NH, NKV);
    pr_cu_launched(cx, "attention_bwd_dq");
    smem = pr_att_smem_bytes(HS, 1);
    if (!pr_cu_smem_attr(cx, pr_k_attention_bwd_dkv<HS>, PR_CU_ATT_DKV, HS, smem, "attention_bwd_dkv shared memory")) return;
    PR_LAUNCH(pr_k_attention_bwd_dkv<HS>, dim3((unsigned)nk, (unsigned)NKV), PR_ATT_THREADS, smem, cx->stream,
        (bf16 *)dk, (bf16 *)dv, dkp, dvp, (const bf16 *)dout, (const float *)lse, Dr,
        (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, (const bf16 *)kp, (const bf16 *)vp, dkt, N, NH, NKV);
    pr_cu_launched(cx, "attention_bwd_dkv");
}

/* a * b, or 0 with *ok cleared when it overflows size_t */
static size_t pr_cu_mul(size_t a, size_t b, int *ok) {
    if (a && b > (size_t)-1 / a) { *ok = 0; return 0; }
    return a * b;
}


template <int HS>
static void pr_cu_attention_fwd_mma(pr_cu *cx, void *out, void *lse, const void *q, const void *k, const void *v,
                                    const void *kp, const void *vp, const pr_seq_layout *lay, int NH, int NKV) {
    pr_att_tile *tiles;
    int nt = pr_cu_query_tiles(&tiles, lay, PR_MMA_FWD_ROWS);
    if (nt < 0) { pr_cu_fail(cx, PR_ERR_NOMEM, "attention: out of host memory"); return; }
    const pr_att_tile *dt = nt ? (const pr_att_tile *)pr_cu_stage(cx, tiles, sizeof(pr_att_tile) * (size_t)nt) : NULL;
    free(tiles);
    if (!dt) return;
    const size_t smem = pr_mma_smem_bytes(HS, 0);      /* the wgmma forward's too: Q of 128 rows, K and V twice */
    const int wg = cx->attention_kind == PR_CUDA_ATTENTION_WGMMA;
    auto kernel = wg ? pr_k_attention_fwd_wgmma<HS> : pr_k_attention_fwd_mma<HS>;
    if (!pr_cu_smem_attr(cx, kernel, wg ? PR_CU_ATT_FWD_WGMMA : PR_CU_ATT_FWD_MMA, HS, smem,
                         wg ? "attention_fwd_wgmma shared memory" : "attention_fwd_mma shared memory"))
        return;
    PR_LAUNCH(kernel, dim3((unsigned)nt, (unsigned)NH), wg ? PR_WG_THREADS : PR_MMA_THREADS, smem, cx->stream,
        (bf16 *)out, (float *)lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, (const bf16 *)kp,
        (const bf16 *)vp, dt, lay->n_prefix, NH, NKV);
    pr_cu_launched(cx, wg ? "attention_fwd_wgmma" : "attention_fwd_mma");
}

template <int HS>
static void pr_cu_attention_bwd_mma(pr_cu *cx, void *dq, void *dk, void *dv, float *dkp, float *dvp, const void *dout,
                                    const void *out, const void *lse, const void *q, const void *k, const void *v,
                                    const void *kp, const void *vp, const pr_seq_layout *lay, int NH, int NKV) {
    const int N = lay->seg_off[lay->n_seg], np = lay->n_prefix;
    pr_att_tile *qt;
    const int nq = pr_cu_query_tiles(&qt, lay, PR_MMA_ROWS);
    if (nq < 0) { pr_cu_fail(cx, PR_ERR_NOMEM, "attention: out of host memory"); return; }
    /* the dK/dV blocks' work (pr_mma_key_tiles) */
    const int C = pr_mma_prefix_chunks(np, NKV, nq);
    const long long nk_ll = pr_mma_key_tiles(NULL, qt, nq, np, C);
    if (nk_ll > 0x7fffffffLL) { free(qt); pr_cu_fail(cx, PR_ERR_ARG, "attention: %lld key-tile blocks", nk_ll); return; }
    const int wg = cx->attention_kind == PR_CUDA_ATTENTION_WGMMA;
    /* the wgmma kernel's blocks: pairs of the tiles, after them in the same allocation */
    pr_att_ktile *kt = (pr_att_ktile *)malloc(sizeof(pr_att_ktile) * (size_t)(nk_ll ? nk_ll : 1) * (wg ? 3 : 1));
    if (!kt) { free(qt); pr_cu_fail(cx, PR_ERR_NOMEM, "attention: out of host memory"); return; }
    pr_mma_key_tiles(kt, qt, nq, np, C);
    const int nk = wg ? (int)pr_wg_key_pairs(kt + nk_ll, kt, nk_ll, np, C) : (int)nk_ll;   /* the dK/dV blocks */
    const pr_att_ktile *blocks = wg ? kt + nk_ll : kt;
    const size_t kt_bytes = sizeof(pr_att_ktile) * (size_t)nk * (wg ? 2 : 1);
    int ok = pr_cu_stage_reserve(cx, pr_cu_stage_size(sizeof(pr_att_tile) * (size_t)nq) + pr_cu_stage_size(kt_bytes));
    const pr_att_tile *dqt = ok && nq ? (const pr_att_tile *)pr_cu_stage(cx, qt, sizeof(pr_att_tile) * (size_t)nq) : NULL;
    const pr_att_ktile *dkt = ok && nk ? (const pr_att_ktile *)pr_cu_stage(cx, blocks, kt_bytes) : NULL;
    free(qt);
    free(kt);
    if (!dqt || !dkt) return;
    /* scratch: D (N, NH), then, with C > 1, the partials (2, C, n_prefix, NKV*HS), then, fused, dQ's
       accumulator (N, NH*HS), all fp32 */
    const int fused = cx->attention_kind == PR_CUDA_ATTENTION_MMA_ATOMIC;
    int fits = 1;
    const size_t d_bytes = pr_cu_stage_size(pr_cu_mul(pr_cu_mul((size_t)N, (size_t)NH, &fits), sizeof(float), &fits));
    const size_t np_elems = pr_cu_mul((size_t)np, pr_cu_mul((size_t)NKV, (size_t)HS, &fits), &fits);
    const size_t part_bytes = pr_cu_stage_size(C > 1 ? pr_cu_mul(pr_cu_mul(2 * (size_t)C, np_elems, &fits), sizeof(float), &fits) : 0);
    const size_t nq_elems = pr_cu_mul((size_t)N, pr_cu_mul((size_t)NH, (size_t)HS, &fits), &fits);
    const size_t acc_bytes = fused ? pr_cu_mul(nq_elems, sizeof(float), &fits) : 0;
    if (!fits || d_bytes > (size_t)-1 - part_bytes || d_bytes + part_bytes > (size_t)-1 - acc_bytes) {
        pr_cu_fail(cx, PR_ERR_NOMEM, "attention: scratch size overflows");
        return;
    }
    char *scratch = (char *)pr_cu_scratch(cx, d_bytes + part_bytes + acc_bytes);
    if (!scratch) return;
    float *Dr = (float *)scratch, *part = C > 1 ? (float *)(scratch + d_bytes) : NULL;
    float *dq_acc = fused ? (float *)(scratch + d_bytes + part_bytes) : NULL;

    PR_LAUNCH(pr_k_attention_rowdot, pr_cu_blocks((size_t)N * NH, 8), 256, 0, cx->stream, Dr, (const bf16 *)dout,
                                                                                    (const bf16 *)out, N, NH, HS);
    pr_cu_launched(cx, "attention_rowdot");
    size_t smem;
    if (fused) {
        if (!pr_cu_ok(cx, cudaMemsetAsync(dq_acc, 0, acc_bytes, cx->stream), "attention: clearing dQ's accumulator")) return;
    } else {
        smem = pr_mma_smem_bytes(HS, 1);            /* the wgmma dQ's too: Q, dO, K and V twice */
        auto dqk = wg ? pr_k_attention_bwd_dq_wgmma<HS> : pr_k_attention_bwd_dq_mma<HS>;
        if (!pr_cu_smem_attr(cx, dqk, wg ? PR_CU_ATT_DQ_WGMMA : PR_CU_ATT_DQ_MMA, HS, smem,
                             wg ? "attention_bwd_dq_wgmma shared memory" : "attention_bwd_dq_mma shared memory"))
            return;
        PR_LAUNCH(dqk, dim3((unsigned)nq, (unsigned)NH), PR_MMA_THREADS, smem, cx->stream,
            (bf16 *)dq, (const bf16 *)dout, (const float *)lse, Dr, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v,
            (const bf16 *)kp, (const bf16 *)vp, dqt, np, NH, NKV);
        pr_cu_launched(cx, wg ? "attention_bwd_dq_wgmma" : "attention_bwd_dq_mma");
    }
    auto dkv = wg ? pr_k_attention_bwd_dkv_wgmma<HS> : fused ? pr_k_attention_bwd_dkv_mma<HS, true> : pr_k_attention_bwd_dkv_mma<HS, false>;
    smem = pr_mma_smem_bytes(HS, wg ? 4 : fused ? 3 : 2);
    if (!pr_cu_smem_attr(cx, dkv, wg ? PR_CU_ATT_DKV_WGMMA : fused ? PR_CU_ATT_DKV_FUSED : PR_CU_ATT_DKV_MMA, HS, smem,
                         wg ? "attention_bwd_dkv_wgmma shared memory" : "attention_bwd_dkv_mma shared memory"))
        return;
    PR_LAUNCH(dkv, dim3((unsigned)nk, (unsigned)NKV), wg ? PR_WG_THREADS : PR_MMA_THREADS, smem, cx->stream,
        (bf16 *)dk, (bf16 *)dv, dkp, dvp, part, C, dq_acc, (const bf16 *)dout, (const float *)lse, Dr, (const bf16 *)q,
        (const bf16 *)k, (const bf16 *)v, (const bf16 *)kp, (const bf16 *)vp, dkt, dqt, np, NH, NKV);
    pr_cu_launched(cx, wg ? "attention_bwd_dkv_wgmma" : fused ? "attention_bwd_dkv_mma (fused)" : "attention_bwd_dkv_mma");
    if (fused) {
        const unsigned blocks = pr_cu_blocks(nq_elems / 2, 256);
        PR_LAUNCH(pr_k_attention_dq_add, blocks < 65536 ? blocks : 65536, 256, 0, cx->stream, (bf16 *)dq, dq_acc, HS, nq_elems);
        pr_cu_launched(cx, "attention_dq_add");
    }
    if (part) {
        unsigned blocks = pr_cu_blocks(2 * np_elems, 256);
        PR_LAUNCH(pr_k_attention_chunk_sum, blocks < 4096 ? blocks : 4096, 256, 0, cx->stream, dkp, dvp, part, C, np_elems);
        pr_cu_launched(cx, "attention_chunk_sum");
    }
}

/* The tensor-core kernels run when selected, for head dims 64 and 128, on 16-byte aligned
   activations (their 16-byte copies) and 8-byte aligned dkp/dvp. */
static int pr_cu_use_mma(const pr_cu *cx, int HS, const void *const *p, int n, const float *dkp, const float *dvp) {
    if (cx->attention_kind == PR_CUDA_ATTENTION_FFMA || (HS != 64 && HS != 128)) return 0;
    for (int i = 0; i < n; i++)
        if ((uintptr_t)p[i] & 15) return 0;
    return !((uintptr_t)dkp & 7) && !((uintptr_t)dvp & 7);
}

#define PR_CU_HEAD_DIMS(X) X(16) X(32) X(64) X(128)

static void pr_cu_attention_fwd(const pr_backend *be, void *out, void *lse, const void *q, const void *k, const void *v,
                                const void *kp, const void *vp, const pr_seq_layout *lay, int NH, int NKV, int HS) {
    PR_CU_OP(be, "attention_fwd");
    pr_cu *cx = pr_cu_of(be);
    if (lay->seg_off[lay->n_seg] <= 0) return;
    const void *ptrs[] = { out, q, k, v, kp, vp };
    if (pr_cu_use_mma(cx, HS, ptrs, 6, NULL, NULL)) {
        if (HS == 64) pr_cu_attention_fwd_mma<64>(cx, out, lse, q, k, v, kp, vp, lay, NH, NKV);
        else pr_cu_attention_fwd_mma<128>(cx, out, lse, q, k, v, kp, vp, lay, NH, NKV);
        return;
    }
    switch (HS) {
#define PR_CU_CASE(hs) case hs: pr_cu_attention_fwd_hs<hs>(cx, out, lse, q, k, v, kp, vp, lay, NH, NKV); break;
    PR_CU_HEAD_DIMS(PR_CU_CASE)
#undef PR_CU_CASE
    default: pr_cu_fail(cx, PR_ERR_UNSUPPORTED, "attention: head dim %d is not compiled in (16, 32, 64, 128)", HS);
    }
}
static void pr_cu_attention_bwd(const pr_backend *be, void *dq, void *dk, void *dv, float *dkp, float *dvp,
                                const void *dout, const void *out, const void *lse, const void *q, const void *k,
                                const void *v, const void *kp, const void *vp, const pr_seq_layout *lay,
                                int NH, int NKV, int HS) {
    PR_CU_OP(be, "attention_bwd");
    pr_cu *cx = pr_cu_of(be);
    if (lay->seg_off[lay->n_seg] <= 0) return;
    const void *ptrs[] = { dq, dk, dv, dout, out, q, k, v, kp, vp };
    if (pr_cu_use_mma(cx, HS, ptrs, 10, dkp, dvp)) {
        if (HS == 64) pr_cu_attention_bwd_mma<64>(cx, dq, dk, dv, dkp, dvp, dout, out, lse, q, k, v, kp, vp, lay, NH, NKV);
        else pr_cu_attention_bwd_mma<128>(cx, dq, dk, dv, dkp, dvp, dout, out, lse, q, k, v, kp, vp, lay, NH, NKV);
        return;
    }
    switch (HS) {
#define PR_CU_CASE(hs) case hs: pr_cu_attention_bwd_hs<hs>(cx, dq, dk, dv, dkp, dvp, dout, out, lse, q, k, v, kp, vp, lay, NH, NKV); break;
    PR_CU_HEAD_DIMS(PR_CU_CASE)
#undef PR_CU_CASE
    default: pr_cu_fail(cx, PR_ERR_UNSUPPORTED, "attention: head dim %d is not compiled in (16, 32, 64, 128)", HS);
    }
}

/* ---------------------------------------------------------------- elementwise */
/* h = silu(g) u;  dg = dh u s (1 + g (1 - s)),  du = dh silu(g),  s = sigmoid(g). A row's g and
   u are the two halves of its row of gu (2F wide): the grid is (rows, blocks of a row), so that a
   thread finds its row and column without a division (pr_cu_swiglu_grid). */
__global__ void pr_k_swiglu_fwd(bf16 *h, const bf16 *gu, int F) {
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= F) return;
    const size_t r = blockIdx.x, gi = 2 * (size_t)F * r + j;
    float g = __bfloat162float(gu[gi]), s = 1.0f / (1.0f + __expf(-g));
    h[(size_t)F * r + j] = __float2bfloat16(g * s * __bfloat162float(gu[gi + F]));
}
__global__ void pr_k_swiglu_bwd(bf16 *dgu, const bf16 *dh, const bf16 *gu, int F) {
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= F) return;
    const size_t r = blockIdx.x, gi = 2 * (size_t)F * r + j, ui = gi + F;
    float g = __bfloat162float(gu[gi]), u = __bfloat162float(gu[ui]), d = __bfloat162float(dh[(size_t)F * r + j]);
    float s = 1.0f / (1.0f + __expf(-g));
    dgu[gi] = __float2bfloat16(d * u * s * (1.0f + g * (1.0f - s)));
    dgu[ui] = __float2bfloat16(d * g * s);
}
__global__ void pr_k_add(bf16 *y, const bf16 *x, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(__bfloat162float(y[i]) + __bfloat162float(x[i]));
}
__global__ void pr_k_add_f32(float *y, const float *x, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}
__global__ void pr_k_bf16_to_f32(float *dst, const bf16 *src, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __bfloat162float(src[i]);
}
/* a token < 0 (another TP rank's vocabulary slice): a zero row */
__global__ void pr_k_embed_fwd(bf16 *out, const int32_t *tok, const bf16 *emb, int N, int C) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)N * C) return;
    size_t r = i / C, c = i % C;
    out[i] = tok[r] >= 0 ? emb[(size_t)tok[r] * C + c] : __float2bfloat16(0.0f);
}
/* Block x: one distinct token; its rows (in row order) summed per column, then added once. */
__global__ void pr_k_embed_bwd(float *demb, const bf16 *dout, const int *uniq, const int *start, const int *rows, int C) {
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0;
    for (int i = start[blockIdx.x]; i < start[blockIdx.x + 1]; i++) s += __bfloat162float(dout[(size_t)rows[i] * C + c]);
    demb[(size_t)uniq[blockIdx.x] * C + c] += s;
}
/* w NULL: weight 1 */
__global__ void pr_k_gather_rows(bf16 *dst, const bf16 *src, const int *rows, const float *w, int M, int C) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)M * C) return;
    bf16 x = src[(size_t)rows[i / C] * C + i % C];
    dst[i] = w ? __float2bfloat16(w[i / C] * __bfloat162float(x)) : x;
}
/* Block x: one destination row; its source rows added one after another in source order, each
   weighted (w NULL: weight 1) and rounded to bf16 as it lands: what one writer at a time would
   leave, the same bits every run. */
__global__ void pr_k_scatter_add_rows(bf16 *dst, const bf16 *src, const int *dest, const int *start, const int *rows,
                                      const float *w, int C) {
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    bf16 *d = dst + (size_t)dest[blockIdx.x] * C + c;
    float acc = __bfloat162float(*d);
    for (int i = start[blockIdx.x]; i < start[blockIdx.x + 1]; i++) {
        float x = __bfloat162float(src[(size_t)rows[i] * C + c]);
        acc = __bfloat162float(__float2bfloat16(acc + (w ? w[rows[i]] * x : x)));
    }
    *d = __float2bfloat16(acc);
}
/* out[m] = a row m . b row m, one warp per row */
__global__ void pr_k_row_dots(float *out, const bf16 *a, const bf16 *b, int M, int C) {
    int m = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (m >= M) return;
    float s = 0;
    for (int i = lane; i < C; i += 32) s += __bfloat162float(a[(size_t)m * C + i]) * __bfloat162float(b[(size_t)m * C + i]);
    s = pr_warp_sum(s);
    if (lane == 0) out[m] = s;
}

/* A block of up to 256 threads a row's F columns, in whole warps: a small F (an expert's columns
   under TP: Qwen3-30B-A3B's 768 at tp 8 are 96) leaves no block mostly idle. */
static void pr_cu_swiglu_grid(int rows, int F, dim3 *grid, unsigned *threads) {
    *threads = F >= 256 ? 256u : (unsigned)(F + 31) / 32 * 32;
    *grid = dim3((unsigned)rows, pr_cu_blocks((size_t)F, *threads));
}
static void pr_cu_swiglu_fwd(const pr_backend *be, void *h, const void *gu, int rows, int F) {
    PR_CU_OP(be, "swiglu_fwd");
    pr_cu *cx = pr_cu_of(be);
    if (rows <= 0 || F <= 0) return;
    dim3 grid;
    unsigned threads;
    pr_cu_swiglu_grid(rows, F, &grid, &threads);
    PR_LAUNCH(pr_k_swiglu_fwd, grid, threads, 0, cx->stream, (bf16 *)h, (const bf16 *)gu, F);
    pr_cu_launched(cx, "swiglu_fwd");
}
static void pr_cu_swiglu_bwd(const pr_backend *be, void *dgu, const void *dh, const void *gu, int rows, int F) {
    PR_CU_OP(be, "swiglu_bwd");
    pr_cu *cx = pr_cu_of(be);
    if (rows <= 0 || F <= 0) return;
    dim3 grid;
    unsigned threads;
    pr_cu_swiglu_grid(rows, F, &grid, &threads);
    PR_LAUNCH(pr_k_swiglu_bwd, grid, threads, 0, cx->stream, (bf16 *)dgu, (const bf16 *)dh, (const bf16 *)gu, F);
    pr_cu_launched(cx, "swiglu_bwd");
}
static void pr_cu_add(const pr_backend *be, void *y, const void *x, size_t n) {
    PR_CU_OP(be, "add");
    pr_cu *cx = pr_cu_of(be);
    if (!n) return;
    PR_LAUNCH(pr_k_add, pr_cu_blocks(n, 256), 256, 0, cx->stream, (bf16 *)y, (const bf16 *)x, n);
    pr_cu_launched(cx, "add");
}
static void pr_cu_add_reals(const pr_backend *be, float *y, const float *x, size_t n) {
    PR_CU_OP(be, "add_reals");
    pr_cu *cx = pr_cu_of(be);
    if (!n) return;
    PR_LAUNCH(pr_k_add_f32, pr_cu_blocks(n, 256), 256, 0, cx->stream, y, x, n);
    pr_cu_launched(cx, "add_reals");
}
static void pr_cu_acts_to_reals(const pr_backend *be, float *dst, const void *src, size_t n) {
    PR_CU_OP(be, "acts_to_reals");
    pr_cu *cx = pr_cu_of(be);
    if (!n) return;
    PR_LAUNCH(pr_k_bf16_to_f32, pr_cu_blocks(n, 256), 256, 0, cx->stream, dst, (const bf16 *)src, n);
    pr_cu_launched(cx, "acts_to_reals");
}
static void pr_cu_reals_to_acts(const pr_backend *be, void *dst, const float *src, size_t n) {
    PR_CU_OP(be, "reals_to_acts");
    pr_cu *cx = pr_cu_of(be);
    if (!n) return;
    unsigned blocks = pr_cu_blocks(n, 256);
    PR_LAUNCH(pr_k_to_bf16, blocks < 65536 ? blocks : 65536, 256, 0, cx->stream, (bf16 *)dst, src, n);
    pr_cu_launched(cx, "reals_to_acts");
}
/* The gradient sum over dp in bf16: the same conversions, on the wire buffer. */
static void pr_cu_reals_to_bf16(const pr_backend *be, uint16_t *dst, const float *src, size_t n) {
    PR_CU_OP(be, "reals_to_bf16");
    pr_cu_reals_to_acts(be, dst, src, n);
}
static void pr_cu_bf16_to_reals(const pr_backend *be, float *dst, const uint16_t *src, size_t n) {
    PR_CU_OP(be, "bf16_to_reals");
    pr_cu_acts_to_reals(be, dst, src, n);
}
static void pr_cu_embed_fwd(const pr_backend *be, void *out, const int32_t *tokens, const void *emb, int N, int C) {
    PR_CU_OP(be, "embed_fwd");
    pr_cu *cx = pr_cu_of(be);
    if (N <= 0) return;
    const int32_t *dt = (const int32_t *)pr_cu_stage(cx, tokens, sizeof(int32_t) * (size_t)N);
    if (!dt) return;
    PR_LAUNCH(pr_k_embed_fwd, pr_cu_blocks((size_t)N * C, 256), 256, 0, cx->stream, (bf16 *)out, dt, (const bf16 *)emb, N, C);
    pr_cu_launched(cx, "embed_fwd");
}
/* Row indices grouped by key, for a sum with one writer per key: the rows i with key[i] >= 0 in
   a stable order by key (each key's rows in row order), the distinct keys, and where each key's
   rows start (n + 1 entries), staged on the device together with `extra` more bytes the caller
   stages next. Returns the number of distinct keys (0: none), or -1 with the failure recorded. */
typedef struct { const int *key, *start, *row; } pr_cu_groups;
static int pr_cu_group_by_key(pr_cu *cx, pr_cu_groups *g, const int *key, int N_rows, size_t extra, const char *what) {
    int *rows = (int *)malloc(sizeof(int) * (size_t)N_rows), *start = (int *)malloc(sizeof(int) * ((size_t)N_rows + 1));
    int *uniq = (int *)malloc(sizeof(int) * (size_t)N_rows);
    if (!rows || !start || !uniq) {
        free(rows); free(start); free(uniq);
        pr_cu_fail(cx, PR_ERR_NOMEM, "%s: out of host memory", what);
        return -1;
    }
    int N = 0;
    for (int i = 0; i < N_rows; i++)
        if (key[i] >= 0) rows[N++] = i;
    /* a bottom-up merge sort by key, stable, so each key's rows stay in row order (positions in
       size_t: 2 * width passes INT_MAX once N does 2^30) */
    for (size_t width = 1; width < (size_t)N; width *= 2) {
        int *tmp = start;          /* borrowed as the merge buffer; rebuilt below */
        for (size_t lo = 0; lo < (size_t)N; lo += 2 * width) {
            size_t mid = lo + width < (size_t)N ? lo + width : (size_t)N, hi = lo + 2 * width < (size_t)N ? lo + 2 * width : (size_t)N;
            size_t a = lo, b = mid, o = lo;
            while (a < mid && b < hi) tmp[o++] = key[rows[b]] < key[rows[a]] ? rows[b++] : rows[a++];
            while (a < mid) tmp[o++] = rows[a++];
            while (b < hi) tmp[o++] = rows[b++];
        }
        memcpy(rows, tmp, sizeof(int) * (size_t)N);
    }
    int nu = 0;
    for (int i = 0; i < N; i++)
        if (i == 0 || key[rows[i]] != key[rows[i - 1]]) { uniq[nu] = key[rows[i]]; start[nu++] = i; }
    start[nu] = N;
    memset(g, 0, sizeof *g);
    if (nu && pr_cu_stage_reserve(cx, pr_cu_stage_size(sizeof(int) * (size_t)nu) + pr_cu_stage_size(sizeof(int) * (size_t)(nu + 1)) +
                                          pr_cu_stage_size(sizeof(int) * (size_t)N) + pr_cu_stage_size(extra))) {
        g->key = (const int *)pr_cu_stage(cx, uniq, sizeof(int) * (size_t)nu);
        g->start = (const int *)pr_cu_stage(cx, start, sizeof(int) * (size_t)(nu + 1));
        g->row = (const int *)pr_cu_stage(cx, rows, sizeof(int) * (size_t)N);
    }
    free(rows); free(start); free(uniq);
    return !nu ? 0 : g->key && g->start && g->row ? nu : -1;
}
/* Each embedding row has one writer that sums its rows in row order. Tokens < 0 (another TP
   rank's rows) are left out. */
static void pr_cu_embed_bwd(const pr_backend *be, pr_real *demb, const void *dout, const int32_t *tokens, int N_rows, int C) {
    PR_CU_OP(be, "embed_bwd");
    pr_cu *cx = pr_cu_of(be);
    if (N_rows <= 0) return;
    pr_cu_groups g;
    const int nu = pr_cu_group_by_key(cx, &g, (const int *)tokens, N_rows, 0, "embedding backward");
    if (nu <= 0) return;
    PR_LAUNCH(pr_k_embed_bwd, dim3((unsigned)nu, pr_cu_blocks((size_t)C, 256)), 256, 0, cx->stream, demb, (const bf16 *)dout, g.key, g.start, g.row, C);
    pr_cu_launched(cx, "embed_bwd");
}
static void pr_cu_gather_rows(const pr_backend *be, void *dst, const void *src, const int *rows, const pr_real *w, int M, int C) {
    PR_CU_OP(be, "gather_rows");
    pr_cu *cx = pr_cu_of(be);
    if (M <= 0) return;
    /* the row list and the weights are staged together: both must survive until the kernel runs */
    if (!pr_cu_stage_reserve(cx, pr_cu_stage_size(sizeof(int) * (size_t)M) + pr_cu_stage_size(sizeof(float) * (size_t)M))) return;
    const int *dr = (const int *)pr_cu_stage(cx, rows, sizeof(int) * (size_t)M);
    const float *dw = w ? (const float *)pr_cu_stage(cx, w, sizeof(float) * (size_t)M) : NULL;
    if (!dr || (w && !dw)) return;
    PR_LAUNCH(pr_k_gather_rows, pr_cu_blocks((size_t)M * C, 256), 256, 0, cx->stream, (bf16 *)dst, (const bf16 *)src, dr, dw, M, C);
    pr_cu_launched(cx, "gather_rows");
}
/* Rows repeat (the loss head's last prefix row predicts every suffix's first token; MoE combines
   each token's experts): grouped by destination, each destination row has one writer. */
static void pr_cu_scatter_add_rows(const pr_backend *be, void *dst, const void *src, const int *rows, const pr_real *w, int M, int C) {
    PR_CU_OP(be, "scatter_add_rows");
    pr_cu *cx = pr_cu_of(be);
    if (M <= 0) return;
    pr_cu_groups g;
    const int nu = pr_cu_group_by_key(cx, &g, rows, M, w ? sizeof(float) * (size_t)M : 0, "scatter_add_rows");
    const float *dw = nu > 0 && w ? (const float *)pr_cu_stage(cx, w, sizeof(float) * (size_t)M) : NULL;
    if (nu <= 0 || (w && !dw)) return;
    PR_LAUNCH(pr_k_scatter_add_rows, dim3((unsigned)nu, pr_cu_blocks((size_t)C, 256)), 256, 0, cx->stream, (bf16 *)dst,
              (const bf16 *)src, g.key, g.start, g.row, dw, C);
    pr_cu_launched(cx, "scatter_add_rows");
}
static void pr_cu_row_dots(const pr_backend *be, pr_real *out, const void *a, const void *b, int M, int C) {
    PR_CU_OP(be, "row_dots");
    pr_cu *cx = pr_cu_of(be);
    if (M <= 0) return;
    float *dev = (float *)pr_cu_scratch(cx, sizeof(float) * (size_t)M);
    if (!dev) return;
    PR_LAUNCH(pr_k_row_dots, pr_cu_blocks((size_t)M, 8), 256, 0, cx->stream, dev, (const bf16 *)a, (const bf16 *)b, M, C);
    pr_cu_launched(cx, "row_dots");
    if (pr_cu_ok(cx, cudaMemcpyAsync(out, dev, sizeof(float) * (size_t)M, cudaMemcpyDeviceToHost, cx->stream), "row_dots download"))
        pr_cu_ok(cx, cudaStreamSynchronize(cx->stream), "row_dots");
}
/* Host reals to and from bf16 activations, converted on the host. */
static void pr_cu_upload_acts(const pr_backend *be, void *dst, const pr_real *host, size_t n) {
    PR_CU_OP(be, "upload_acts");
    pr_cu *cx = pr_cu_of(be);
    uint16_t *h = (uint16_t *)malloc(2 * (n ? n : 1));
    if (!h) { pr_cu_fail(cx, PR_ERR_NOMEM, "upload_acts: out of host memory"); return; }
    for (size_t i = 0; i < n; i++) h[i] = pr_f32_to_bf16(host[i]);
    /* h is freed at once, so the copy is waited for: the runtime only says that a copy from
       pageable memory "might" be staged before it returns */
    if (pr_cu_ok(cx, cudaMemcpyAsync(dst, h, 2 * n, cudaMemcpyHostToDevice, cx->stream), "upload_acts"))
        pr_cu_ok(cx, cudaStreamSynchronize(cx->stream), "upload_acts");
    free(h);
}
static void pr_cu_download_acts(const pr_backend *be, pr_real *host, const void *src, size_t n) {
    PR_CU_OP(be, "download_acts");
    pr_cu *cx = pr_cu_of(be);
    uint16_t *h = (uint16_t *)malloc(2 * (n ? n : 1));
    if (!h) { pr_cu_fail(cx, PR_ERR_NOMEM, "download_acts: out of host memory"); return; }
    if (pr_cu_ok(cx, cudaMemcpyAsync(h, src, 2 * n, cudaMemcpyDeviceToHost, cx->stream), "download_acts") &&
        pr_cu_ok(cx, cudaStreamSynchronize(cx->stream), "download_acts"))
        for (size_t i = 0; i < n; i++) host[i] = pr_bf16_to_f32(h[i]);
    free(h);
}

/* ---------------------------------------------------------------- loss head */
/* A row of logits is read and written in 16-byte pieces of eight bf16 when it can be: V a multiple
   of 8 and the row 16-byte aligned (the whole vocabulary, or a TP slice of a multiple of 8);
   otherwise one element at a time. The loss head is memory-bound: its two passes over the logits
   (these kernels) cost what they read and write. */
struct __align__(16) pr_bf16x8 { uint32_t w[4]; };
__device__ __forceinline__ bool pr_row_in_pieces(const bf16 *row, int V) { return V % 8 == 0 && ((uintptr_t)row & 15) == 0; }

/* The online softmax's step over n values: the running max mx rises to theirs (the sum s rescaled
   once), then their exp(z - mx) join s. */
__device__ __forceinline__ void pr_online_sum(float &mx, float &s, const float *z, int n) {
    float m = z[0];
    for (int k = 1; k < n; k++) m = fmaxf(m, z[k]);
    if (m == -INFINITY) return;       /* adds 0; exp(-inf - -inf) would be NaN */
    if (m > mx) {
        s *= __expf(mx - m);
        mx = m;
    }
    for (int k = 0; k < n; k++) s += __expf(z[k] - mx);
}

/* One block per row, reading its V columns once: max z and sum exp(z - max) by the online softmax
   (each thread's pair, then the block's in a fixed tree), and z[target] (0 for a target < 0, on
   another TP rank's slice of the vocabulary). */
__global__ void pr_k_logit_stats(float *stats, const bf16 *logits, const int32_t *target, int V) {
    static __shared__ float buf[32];
    const bf16 *z = logits + (size_t)blockIdx.x * V;
    float mx = -INFINITY, s = 0;
    if (pr_row_in_pieces(z, V)) {
        const pr_bf16x8 *zv = (const pr_bf16x8 *)z;
        for (int j = threadIdx.x; j < V / 8; j += blockDim.x) {
            const pr_bf16x8 x = zv[j];
            float f[8];
            for (int w = 0; w < 4; w++) {
                const float2 p = pr_bf16x2_unpack(x.w[w]);
                f[2 * w] = p.x;
                f[2 * w + 1] = p.y;
            }
            pr_online_sum(mx, s, f, 8);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float f = __bfloat162float(z[i]);
            pr_online_sum(mx, s, &f, 1);
        }
    }
    const float row_max = pr_block_max(mx, buf);
    s = pr_block_sum(mx == -INFINITY ? 0.0f : s * __expf(mx - row_max), buf);   /* a thread with no columns adds 0 */
    if (threadIdx.x == 0) {
        const int tg = target[blockIdx.x];
        stats[3 * blockIdx.x] = row_max;
        stats[3 * blockIdx.x + 1] = s;
        stats[3 * blockIdx.x + 2] = tg >= 0 ? __bfloat162float(z[tg]) : 0.0f;
    }
}
/* dlogits = c (onehot(target) - exp(z - lse)), in place; lse_coef: M log-sum-exps, then M slopes */
__device__ __forceinline__ float pr_logit_grad_of(float z, float L, float c, bool is_target) {
    return -c * __expf(z - L) + (is_target ? c : 0.0f);
}
__global__ void pr_k_logit_grad(bf16 *logits, const float *lse_coef, const int32_t *target, int M, int V) {
    bf16 *z = logits + (size_t)blockIdx.x * V;
    const float L = lse_coef[blockIdx.x], c = lse_coef[M + blockIdx.x];
    const int tg = target[blockIdx.x];
    if (pr_row_in_pieces(z, V)) {
        pr_bf16x8 *zv = (pr_bf16x8 *)z;
        for (int j = threadIdx.x; j < V / 8; j += blockDim.x) {
            pr_bf16x8 x = zv[j];
            for (int w = 0; w < 4; w++) {
                const float2 p = pr_bf16x2_unpack(x.w[w]);
                const int i = 8 * j + 2 * w;
                x.w[w] = pr_pack_bf16x2(pr_logit_grad_of(p.x, L, c, i == tg), pr_logit_grad_of(p.y, L, c, i + 1 == tg));
            }
            zv[j] = x;
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) z[i] = __float2bfloat16(pr_logit_grad_of(__bfloat162float(z[i]), L, c, i == tg));
    }
}

/* The pinned buffer for M rows of the loss head's host values (3 floats a row). */
static float *pr_cu_row_host(pr_cu *cx, int M) {
    if ((size_t)M <= cx->row_host_cap) return cx->row_host;
    cudaFreeHost(cx->row_host);
    cx->row_host = NULL;
    cx->row_host_cap = 0;
    if (!pr_cu_ok(cx, cudaMallocHost((void **)&cx->row_host, sizeof(float) * 3 * (size_t)M), "loss head buffer")) return NULL;
    cx->row_host_cap = (size_t)M;
    return cx->row_host;
}
/* The statistics come to the host, where the trainer combines the vocabulary slices' and applies
   the GRPO formula; the log-sum-exps and slopes come back for the gradient pass. */
static void pr_cu_logit_stats(const pr_backend *be, double *stats, const void *logits, const int32_t *target, int M, int V) {
    PR_CU_OP(be, "logit_stats");
    pr_cu *cx = pr_cu_of(be);
    if (M <= 0) return;
    float *host = pr_cu_row_host(cx, M);
    const int32_t *dt = (const int32_t *)pr_cu_stage(cx, target, sizeof(int32_t) * (size_t)M);
    float *dev = (float *)pr_cu_scratch(cx, sizeof(float) * 3 * (size_t)M);
    if (!host || !dt || !dev) return;
    PR_LAUNCH(pr_k_logit_stats, (unsigned)M, 512, 0, cx->stream, dev, (const bf16 *)logits, dt, V);
    pr_cu_launched(cx, "logit_stats");
    if (!pr_cu_ok(cx, cudaMemcpyAsync(host, dev, sizeof(float) * 3 * (size_t)M, cudaMemcpyDeviceToHost, cx->stream), "logit statistics download") ||
        !pr_cu_ok(cx, cudaStreamSynchronize(cx->stream), "logit statistics download"))
        return;
    for (size_t i = 0; i < 3 * (size_t)M; i++) stats[i] = host[i];
}
static void pr_cu_logit_grad(const pr_backend *be, void *logits, const double *lse, const double *coef, const int32_t *target,
                             int M, int V) {
    PR_CU_OP(be, "logit_grad");
    pr_cu *cx = pr_cu_of(be);
    if (M <= 0) return;
    float *host = pr_cu_row_host(cx, M);
    if (!host) return;
    for (int m = 0; m < M; m++) {
        host[m] = (float)lse[m];
        host[M + m] = (float)coef[m];
    }
    if (!pr_cu_stage_reserve(cx, pr_cu_stage_size(sizeof(int32_t) * (size_t)M) + pr_cu_stage_size(sizeof(float) * 2 * (size_t)M))) return;
    const int32_t *dt = (const int32_t *)pr_cu_stage(cx, target, sizeof(int32_t) * (size_t)M);
    const float *dlc = (const float *)pr_cu_stage(cx, host, sizeof(float) * 2 * (size_t)M);
    if (!dt || !dlc) return;
    PR_LAUNCH(pr_k_logit_grad, (unsigned)M, 512, 0, cx->stream, (bf16 *)logits, dlc, dt, M, V);
    pr_cu_launched(cx, "logit_grad");
}

/* ---------------------------------------------------------------- optimizer */
/* The sum of squares' blocks: a function of n alone (at least 4 elements a thread, at most 1024
   blocks), so the summation tree, and the result, never change for a given n; a small tensor does
   not launch 262,144 threads to sum a few thousand values. */
#define PR_CU_REDUCE_BLOCKS 1024
static unsigned pr_cu_reduce_blocks(size_t n) {
    const unsigned b = pr_cu_blocks(n, 4 * 256);
    return b < PR_CU_REDUCE_BLOCKS ? b : PR_CU_REDUCE_BLOCKS;
}

__global__ void pr_k_sum_squares(double *part, const float *x, size_t n) {
    static __shared__ double buf[32];
    double s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        s += (double)x[i] * x[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) t += buf[w];
        part[blockIdx.x] = t;
    }
}
__global__ void pr_k_sum_parts_double(double *out, const double *part, int n) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double s = 0;
    for (int i = 0; i < n; i++) s += part[i];
    *out = s;
}
__global__ void pr_k_scale(float *x, size_t n, float s) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
/* AdamW with decoupled weight decay and bias-corrected moments, the CPU formula in double. */
__global__ void pr_k_adamw(float *p, const float *g, float *m, float *v, size_t n, double lr, double b1, double b2,
                           double eps, double wd, double c1, double c2) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float mi = (float)(b1 * m[i] + (1 - b1) * g[i]);
    float vi = (float)(b2 * v[i] + (1 - b2) * (double)g[i] * g[i]);
    m[i] = mi;
    v[i] = vi;
    double mh = mi / c1, vh = vi / c2;
    p[i] = (float)(p[i] - lr * (mh / (sqrt(vh) + eps) + wd * p[i]));
}

static double pr_cu_sum_squares(const pr_backend *be, const pr_real *x, size_t n) {
    PR_CU_OP(be, "sum_squares");
    pr_cu *cx = pr_cu_of(be);
    const unsigned blocks = pr_cu_reduce_blocks(n);
    double *part = (double *)pr_cu_scratch(cx, sizeof(double) * (PR_CU_REDUCE_BLOCKS + 1));
    if (!part) return NAN;
    PR_LAUNCH(pr_k_sum_squares, blocks, 256, 0, cx->stream, part, x, n);
    pr_cu_launched(cx, "sum_squares");
    PR_LAUNCH(pr_k_sum_parts_double, 1, 32, 0, cx->stream, part + PR_CU_REDUCE_BLOCKS, part, (int)blocks);
    pr_cu_launched(cx, "sum_squares_total");
    if (!pr_cu_ok(cx, cudaMemcpyAsync(cx->reduce_host, part + PR_CU_REDUCE_BLOCKS, sizeof(double),
                                      cudaMemcpyDeviceToHost, cx->stream), "sum_squares download") ||
        !pr_cu_ok(cx, cudaStreamSynchronize(cx->stream), "sum_squares"))
        return NAN;
    return *cx->reduce_host;
}
static void pr_cu_scale(const pr_backend *be, pr_real *x, size_t n, double s) {
    PR_CU_OP(be, "scale");
    pr_cu *cx = pr_cu_of(be);
    if (!n) return;
    PR_LAUNCH(pr_k_scale, pr_cu_blocks(n, 256), 256, 0, cx->stream, x, n, (float)s);
    pr_cu_launched(cx, "scale");
}
static void pr_cu_adamw(const pr_backend *be, pr_real *p, const pr_real *g, pr_real *m, pr_real *v, size_t n,
                        double lr, double b1, double b2, double eps, double wd, long step) {
    PR_CU_OP(be, "adamw");
    pr_cu *cx = pr_cu_of(be);
    if (!n) return;
    double c1 = 1 - pow(b1, (double)step), c2 = 1 - pow(b2, (double)step);
    PR_LAUNCH(pr_k_adamw, pr_cu_blocks(n, 256), 256, 0, cx->stream, p, g, m, v, n, lr, b1, b2, eps, wd, c1, c2);
    pr_cu_launched(cx, "adamw");
}

/* ---------------------------------------------------------------- checks, errors, construction */
static pr_status pr_cu_check_config(const pr_backend *be, const pr_config *cfg, pr_error *err) {
    (void)be;
    int hs = cfg->head_dim;
    if (hs == 16 || hs == 32 || hs == 64 || hs == 128) return PR_OK;
    if (err) {
        err->status = PR_ERR_UNSUPPORTED;
        snprintf(err->message, sizeof err->message,
                 "the CUDA backend's attention is compiled for head dims 16, 32, 64 and 128, not %d", hs);
    }
    return PR_ERR_UNSUPPORTED;
}

/* What the driver could still hand out: offload's prefetches keep a margin of it. */
static size_t pr_cu_device_free(const pr_backend *be) {
    size_t free_b = 0, total = 0;
    if (!pr_cu_ok(pr_cu_of(be), cudaMemGetInfo(&free_b, &total), "memory info")) return 0;
    return free_b;
}

/* Drains the stream (so a fault of any earlier launch shows), then hands over the first failure. */
static pr_status pr_cu_take_error(const pr_backend *be, pr_error *err) {
    pr_cu *cx = pr_cu_of(be);
    pr_cu_sync(be);
    pr_status st = cx->failed;
    if (st && err) {
        err->status = st;
        snprintf(err->message, sizeof err->message, "%s", cx->message);
    }
    cx->failed = PR_OK;
    cx->message[0] = 0;
    return st;
}

void pr_backend_cuda_destroy(const pr_backend *be) {
    if (!be) return;
    pr_cu *cx = pr_cu_of(be);
    cudaSetDevice(cx->device);
    if (cx->stream) cudaStreamSynchronize(cx->stream);
    if (cx->copy_stream) cudaStreamSynchronize(cx->copy_stream);
    for (int t = 0; t < PR_COPY_TAGS; t++) if (cx->copy_done[t]) cudaEventDestroy(cx->copy_done[t]);
    pr_cu_pairs_free(&cx->copy_pairs);
    pr_cu_pairs_free(&cx->prof.pairs);
    if (cx->compute_mark) cudaEventDestroy(cx->compute_mark);
    if (cx->copy_stream) cudaStreamDestroy(cx->copy_stream);
    cudaFree(cx->workspace);
    cudaFree(cx->scratch);
    cudaFree(cx->stage_dev);
    cudaFreeHost(cx->stage_host);
    cudaFreeHost(cx->reduce_host);
    cudaFreeHost(cx->row_host);
    for (int i = 0; i < PR_CU_ALGO_SETS; i++)
        for (int w = 0; w < PR_CU_ALGO_WAYS; w++) pr_cu_algo_clear(&cx->algos[i][w]);
    if (cx->lt) cublasLtDestroy(cx->lt);
    if (cx->stream) cudaStreamDestroy(cx->stream);
    free(cx);
}

pr_status pr_backend_cuda_create(const pr_backend **out, int device, pr_error *err) {
    if (!out) {
        if (err) { err->status = PR_ERR_ARG; snprintf(err->message, sizeof err->message, "pr_backend_cuda_create: NULL argument"); }
        return PR_ERR_ARG;
    }
    pr_cu *cx = (pr_cu *)calloc(1, sizeof *cx);
    if (!cx) {
        if (err) { err->status = PR_ERR_NOMEM; snprintf(err->message, sizeof err->message, "pr_backend_cuda_create: out of memory"); }
        return PR_ERR_NOMEM;
    }
    cx->device = device;
    cx->workspace_bytes = (size_t)32 << 20;
    int n_dev = 0;
    if (pr_cu_ok(cx, cudaGetDeviceCount(&n_dev), "device count") && (device < 0 || device >= n_dev))
        pr_cu_fail(cx, PR_ERR_DEVICE, "CUDA device %d does not exist (%d found)", device, n_dev);
    if (!cx->failed)
        pr_cu_ok(cx, cudaSetDevice(device), "set device") &&
        pr_cu_ok(cx, cudaStreamCreateWithFlags(&cx->stream, cudaStreamNonBlocking), "stream") &&
        pr_cu_ok(cx, cudaStreamCreateWithFlags(&cx->copy_stream, cudaStreamNonBlocking), "copy stream") &&
        pr_cu_ok(cx, cudaEventCreateWithFlags(&cx->compute_mark, cudaEventDisableTiming), "event") &&
        pr_lt_ok(cx, cublasLtCreate(&cx->lt), "handle") &&
        pr_cu_ok(cx, cudaMalloc(&cx->workspace, cx->workspace_bytes), "workspace") &&
        pr_cu_ok(cx, cudaMallocHost((void **)&cx->reduce_host, sizeof(double)), "pinned result");
    for (int t = 0; t < PR_COPY_TAGS && !cx->failed; t++)
        pr_cu_ok(cx, cudaEventCreateWithFlags(&cx->copy_done[t], cudaEventDisableTiming), "event");
    if (cx->failed) {
        pr_status st = cx->failed;
        if (err) { err->status = st; snprintf(err->message, sizeof err->message, "%s", cx->message); }
        cx->be.ctx = cx;
        pr_backend_cuda_destroy(&cx->be);
        return st;
    }
    pr_backend *be = &cx->be;
    be->name = "cuda";
    be->act_bytes = sizeof(bf16);
    be->stat_bytes = sizeof(float);
    be->logit_chunk = PR_CUDA_LOGIT_CHUNK;
    be->ctx = cx;
    be->check_config = pr_cu_check_config;
    be->take_error = pr_cu_take_error;
    be->device_free = pr_cu_device_free;
    be->copy_async = pr_cu_copy_async;
    be->copy_wait = pr_cu_copy_wait;
    be->copy_seconds = pr_cu_copy_seconds;
    be->alloc = pr_cu_alloc;
    be->release = pr_cu_release;
    be->zero = pr_cu_zero;
    be->copy = pr_cu_copy;
    be->upload_reals = pr_cu_upload;
    be->download_reals = pr_cu_download;
    be->sync = pr_cu_sync;
    be->matmul_fwd = pr_cu_matmul_fwd;
    be->matmul_bwd = pr_cu_matmul_bwd;
    be->rmsnorm_fwd = pr_cu_rmsnorm_fwd;
    be->rmsnorm_bwd = pr_cu_rmsnorm_bwd;
    be->rope_fwd = pr_cu_rope_fwd;
    be->rope_bwd = pr_cu_rope_bwd;
    be->attention_fwd = pr_cu_attention_fwd;
    be->attention_bwd = pr_cu_attention_bwd;
    be->swiglu_fwd = pr_cu_swiglu_fwd;
    be->swiglu_bwd = pr_cu_swiglu_bwd;
    be->embed_fwd = pr_cu_embed_fwd;
    be->embed_bwd = pr_cu_embed_bwd;
    be->add = pr_cu_add;
    be->add_reals = pr_cu_add_reals;
    be->acts_to_reals = pr_cu_acts_to_reals;
    be->reals_to_acts = pr_cu_reals_to_acts;
    be->reals_to_bf16 = pr_cu_reals_to_bf16;
    be->bf16_to_reals = pr_cu_bf16_to_reals;
    be->gather_rows = pr_cu_gather_rows;
    be->scatter_add_rows = pr_cu_scatter_add_rows;
    be->row_dots = pr_cu_row_dots;
    be->upload_acts = pr_cu_upload_acts;
    be->download_acts = pr_cu_download_acts;
    be->logit_stats = pr_cu_logit_stats;
    be->logit_grad = pr_cu_logit_grad;
    be->sum_squares = pr_cu_sum_squares;
    be->scale = pr_cu_scale;
    be->adamw = pr_cu_adamw;
    const pr_status st = pr_backend_cuda_set_attention(be, PR_CUDA_ATTENTION_AUTO, err);
    if (st) {
        pr_backend_cuda_destroy(be);
        return st;
    }
    *out = be;
    return PR_OK;
}

/* Whether the wgmma forward runs here: its body is compiled for sm_90a alone, so on a GPU the probe
   answers 1 only where the driver picked that code (compute capability 9.0, and a build whose
   CUDA_ARCH has it), 2 if the dynamic shared memory were not 1,024-aligned as wgmma's swizzled
   layouts need, 0 elsewhere. */
__global__ void pr_k_wgmma_probe(int *answer) {
#if !defined(__CUDACC__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) unsigned char pr_dyn_smem[];
    *answer = pr_smem_u32(pr_dyn_smem) % PR_WG_ATOM ? 2 : 1;
#else
    *answer = 0;
#endif
}
static int pr_cu_wgmma_probe(pr_cu *cx) {
    int *answer = (int *)pr_cu_scratch(cx, sizeof(int));
    if (!answer) return -1;
    PR_LAUNCH(pr_k_wgmma_probe, 1, 32, PR_WG_ATOM, cx->stream, answer);
    pr_cu_launched(cx, "wgmma_probe");
    if (!pr_cu_ok(cx, cudaMemcpyAsync(cx->reduce_host, answer, sizeof(int), cudaMemcpyDeviceToHost, cx->stream), "wgmma probe download") ||
        !pr_cu_ok(cx, cudaStreamSynchronize(cx->stream), "wgmma probe"))
        return -1;
    int a;
    memcpy(&a, cx->reduce_host, sizeof a);
    return a;
}

/* The tensor-core kernels need compute capability 8.0 and, at head dim 128, the shared memory of
   their largest block: 99,328 bytes (dK/dV), 107,520 with the atomic-dQ backward's dS tile, which
   GPUs of 99 KiB a block (sm_86, sm_89, sm_120) do not have, 132,096 for the wgmma dK/dV's two key
   tiles. The wgmma kernels need sm_90a code (pr_k_wgmma_probe). AUTO tries the kinds from the fastest down; only PR_ERR_UNSUPPORTED moves
   it on, so a failing device is reported, not hidden behind slower kernels. */
pr_status pr_backend_cuda_set_attention(const pr_backend *be, int kind, pr_error *err) {
    if (be && kind == PR_CUDA_ATTENTION_AUTO) {
        const int fastest_first[] = { PR_CUDA_ATTENTION_WGMMA, PR_CUDA_ATTENTION_MMA, PR_CUDA_ATTENTION_FFMA };
        pr_status st = PR_ERR_UNSUPPORTED;
        pr_error tried;
        for (size_t i = 0; i < sizeof fastest_first / sizeof *fastest_first && st == PR_ERR_UNSUPPORTED; i++)
            st = pr_backend_cuda_set_attention(be, fastest_first[i], &tried);
        if (st && err) *err = tried;
        return st;
    }
    pr_status st = PR_OK;
    char why[sizeof pr_cu_of(be)->message] = "";
    int major = 0, optin = 0, probe = 1;
    const size_t need = pr_mma_smem_bytes(128, kind == PR_CUDA_ATTENTION_MMA_ATOMIC ? 3 : kind == PR_CUDA_ATTENTION_WGMMA ? 4 : 2);
    if (!be || kind < PR_CUDA_ATTENTION_FFMA || kind > PR_CUDA_ATTENTION_WGMMA) {
        st = PR_ERR_ARG;
        snprintf(why, sizeof why, "pr_backend_cuda_set_attention: no backend, or an unknown kind");
    } else if (kind != PR_CUDA_ATTENTION_FFMA &&
               (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, pr_cu_of(be)->device) != cudaSuccess ||
                cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, pr_cu_of(be)->device) != cudaSuccess ||
                major < 8 || (size_t)optin < need)) {
        st = PR_ERR_UNSUPPORTED;
        snprintf(why, sizeof why, "the tensor-core attention%s needs compute capability 8.0 and %zu bytes of shared memory a block; "
                 "this GPU: %d.x, %d bytes", kind == PR_CUDA_ATTENTION_MMA_ATOMIC ? " with the atomic-dQ backward" : "", need, major, optin);
    } else if (kind == PR_CUDA_ATTENTION_WGMMA && (probe = pr_cu_wgmma_probe(pr_cu_of(be))) != 1) {
        st = probe < 0 ? pr_cu_of(be)->failed : PR_ERR_UNSUPPORTED;
        if (probe < 0) snprintf(why, sizeof why, "%s", pr_cu_of(be)->message);
        else snprintf(why, sizeof why, "the wgmma attention needs a GPU of compute capability 9.0 and a build with sm_90a code (CUDA_ARCH)%s",
                      probe == 2 ? "; this one placed dynamic shared memory off a 1,024-byte boundary" : "");
    }
    if (st) {
        if (err) { err->status = st; snprintf(err->message, sizeof err->message, "%s", why); }
        return st;
    }
    pr_cu_of(be)->attention_kind = kind;
    return PR_OK;
}

int pr_backend_cuda_attention(const pr_backend *be) { return be ? pr_cu_of(be)->attention_kind : -1; }

/* ---------------------------------------------------------------- the operation profile */
pr_status pr_backend_cuda_profile(const pr_backend *be, int on, pr_error *err) {
    if (!be) {
        if (err) { err->status = PR_ERR_ARG; snprintf(err->message, sizeof err->message, "pr_backend_cuda_profile: no backend"); }
        return PR_ERR_ARG;
    }
    pr_cu *cx = pr_cu_of(be);
    pr_cu_profile *pf = &cx->prof;
    if (on) {                      /* fresh sums: the pairs still pending belong to the old ones */
        pr_cu_profile_read(cx);
        pf->n = 0;
        pf->lost = 0;
    }
    pf->on = on != 0;
    return PR_OK;
}

int pr_backend_cuda_profile_read(const pr_backend *be, pr_cuda_op_time *rows, int cap, int *complete) {
    if (complete) *complete = 0;
    if (!be) return 0;
    pr_cu *cx = pr_cu_of(be);
    pr_cu_profile *pf = &cx->prof;
    pr_cu_profile_read(cx);
    int order[PR_CUDA_PROFILE_OPS];
    for (int i = 0; i < pf->n; i++) {          /* the longest first; ties in the order first seen */
        int j = i;
        for (; j > 0 && pf->ms[order[j - 1]] < pf->ms[i]; j--) order[j] = order[j - 1];
        order[j] = i;
    }
    for (int i = 0; rows && i < pf->n && i < cap; i++) {
        snprintf(rows[i].name, sizeof rows[i].name, "%s", pf->name[order[i]]);
        rows[i].calls = pf->calls[order[i]];
        rows[i].seconds = pf->ms[order[i]] / 1e3;
    }
    if (complete) *complete = !pf->lost;
    return pf->n;
}

pr_cuda_gemm_counts pr_backend_cuda_gemm_counts(const pr_backend *be) {
    pr_cuda_gemm_counts none = {0, 0, 0};
    return be ? pr_cu_of(be)->gemm_counts : none;
}

/* ---------------------------------------------------------------- the NCCL communicator */
#ifndef PR_NO_NCCL
/* A communicator is bound to one CUDA backend: its collectives are queued on the backend's stream,
   behind the kernels that write their buffers and ahead of those that read them, and each call
   waits for that stream, so host-side callers find the result in place when it returns (the
   schedule's exchanges are layer-sized; overlap comes later). Sub-communicators from split keep
   the backend.
   NCCL waits forever for a peer that has stopped, so the wait is watched (pr_nccl_wait): an
   operation not complete after timeout_s, or one NCCL reports an error for (a peer's process or
   the network failed), aborts its communicator, which ends the operation on the device, and
   fails. A communicator and those split from it are one family: after such a failure every
   call of each fails at once with its reason, and each is aborted rather than destroyed, as
   NCCL's destroy would first complete the operations its peers no longer come to. A family is
   used from one thread, as NCCL's blocking communicators are.
   A blocking communicator's init and split wait on the host for every peer, without limit, and
   cannot be aborted (the handle comes back only when they end). So the family's first member is
   a non-blocking communicator, the root, whose init and splits go on in NCCL's own thread while
   this one watches them (pr_nccl_settle) and aborts them after timeout_s: the world is the
   root's split into one blocking communicator of every rank, and the world's splits are the
   root's, into blocking ones too. The root does nothing else: what it costs is a second init
   (its set-up time, and where NCCL_RUNTIME_CONNECT=0 the buffers of every algorithm, which it
   then connects and never uses). A split of a communicator other than the world is that
   communicator's own, watched only where it is non-blocking (NCCL_COMM_BLOCKING=0). */
typedef struct {
    int refs;                      /* the family's live communicators */
    int timeout_s;
    int world_rank;                /* this process's rank in the world communicator, for messages */
    ncclComm_t root;               /* non-blocking, every rank of the world; NULL once aborted */
    char failed[320];              /* empty, or why the family's communicators are unusable */
} pr_nccl_family;
typedef struct {
    pr_comm c;
    ncclComm_t nc;                 /* NULL once aborted */
    pr_cu *cx;                     /* the backend: its device and stream */
    float *one;                    /* device scratch for the barrier (zeroed once) */
    int world;                     /* the family's world: its splits are the root's */
    pr_nccl_family *family;
} pr_nccl;

static pr_nccl *pr_nccl_of(pr_comm *c) { return (pr_nccl *)c->ctx; }

static int pr_nccl_type(pr_comm_type t, ncclDataType_t *out, size_t *elem) {
    switch (t) {
    case PR_COMM_F32: *out = ncclFloat32; *elem = 4; return 1;
    case PR_COMM_F64: *out = ncclFloat64; *elem = 8; return 1;
    case PR_COMM_BF16: *out = ncclBfloat16; *elem = 2; return 1;
    }
    return 0;
}

static pr_status pr_nccl_error(pr_error *err, pr_status st, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        err->status = st;
    }
    return st;
}

static double pr_nccl_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* x's operation `what` failed, or NCCL refused it: the family is unusable from here on,
   and x is aborted, which ends the operation on the device. Said on stderr first, as the one
   thing this library prints: within a node the abort may itself wait until the peers' processes
   end or abort too (an NCCL maintainer's word, NVIDIA/nccl#863), and the reason must show even
   then. Only the failed operation is in flight (each call waits for its own), so the family's
   other communicators are idle when they are aborted in turn by their destroy; the root too is
   aborted here (a split of it that failed included), so that peers waiting in a split of it end
   at once rather than at their own timeout. */
static pr_status pr_nccl_abort(pr_nccl *x, const char *what, pr_error *err, const char *fmt, ...) {
    pr_nccl_family *f = x->family;
    int n = snprintf(f->failed, sizeof f->failed, "NCCL %s (rank %d of %d, world rank %d): ", what, x->c.rank, x->c.size, f->world_rank);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof f->failed) vsnprintf(f->failed + n, sizeof f->failed - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "prefixreuse: %s: aborting the communicator\n", f->failed);
    ncclCommAbort(x->nc);
    x->nc = NULL;
    if (f->root) ncclCommAbort(f->root);
    f->root = NULL;
    return pr_nccl_error(err, PR_ERR_DEVICE, "%s: the communicator is aborted", f->failed);
}

/* Between two looks at what NCCL or the device is doing, `waited` seconds into the wait: a yield
   for the first 100 ms, as cudaStreamSynchronize's spin would, so that an exchange ends as soon
   as the device does; then naps of 20 us, and past a second (an init, a long exchange) of 1 ms. */
static void pr_nccl_nap(double waited) {
    if (waited < 0.1) sched_yield();
    else usleep(waited < 1 ? 20 : 1000);
}

/* Waits, from t0, until nc has ended what its last call began on the host: the init, a split or
   the queueing of an operation of a non-blocking communicator (the root; any under
   NCCL_COMM_BLOCKING=0), which returns ncclInProgress and goes on in NCCL's thread. NCCL's
   verdict, or ncclInProgress where timeout_s has passed first (the caller aborts nc: that ends
   the work and joins NCCL's thread). */
static ncclResult_t pr_nccl_settle(ncclComm_t nc, double t0, int timeout_s) {
    for (;;) {
        ncclResult_t async = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(nc, &async);
        if (r != ncclSuccess) return r;
        if (async != ncclInProgress) return async;
        const double waited = pr_nccl_now() - t0;
        if (waited > timeout_s) return ncclInProgress;
        pr_nccl_nap(waited);
    }
}

/* Waits for the backend's stream (the operation queued, after the work queued before it, which
   the clock, started at t0, counts too), watching it: NCCL's asynchronous errors, and timeout_s
   without completion (pr_nccl). */
static pr_status pr_nccl_wait(pr_nccl *x, double t0, const char *what, pr_error *err) {
    for (;;) {
        cudaError_t e = cudaStreamQuery(x->cx->stream);
        if (e == cudaSuccess) return PR_OK;
        if (e == cudaErrorNotReady) {          /* the runtime keeps it as the last error: cleared, or the next launch check reports it */
            const cudaError_t last = cudaGetLastError();
            if (last != cudaSuccess && last != cudaErrorNotReady) e = last;
        }
        if (e != cudaErrorNotReady) return pr_nccl_abort(x, what, err, "%s", cudaGetErrorString(e));
        const double waited = pr_nccl_now() - t0;
        ncclResult_t async = ncclSuccess;
        if (waited > 1e-3 && ncclCommGetAsyncError(x->nc, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
            return pr_nccl_abort(x, what, err, "%s", ncclGetErrorString(async));
        if (waited > x->family->timeout_s)
            return pr_nccl_abort(x, what, err, "not complete after %d s (a peer rank has stopped or hangs, or the ranks' calls differ)",
                                 x->family->timeout_s);
        pr_nccl_nap(waited);
    }
}
/* r: what queueing the operation returned; ncclInProgress (a non-blocking communicator) until
   NCCL's thread has queued it. Any failure aborts, a call refused for its arguments too: the
   peers have queued their part of it, and NCCL pairs the ranks' calls by their order alone, so
   this rank's next call would meet the peers' pending one (other data, or a hang). */
static pr_status pr_nccl_status(pr_nccl *x, ncclResult_t r, const char *what, pr_error *err) {
    const double t0 = pr_nccl_now();
    if (r == ncclInProgress) r = pr_nccl_settle(x->nc, t0, x->family->timeout_s);
    if (r == ncclInProgress)
        return pr_nccl_abort(x, what, err, "not queued after %d s (a peer rank has stopped or hangs in NCCL's connection set-up)",
                             x->family->timeout_s);
    if (r != ncclSuccess) return pr_nccl_abort(x, what, err, "%s", ncclGetErrorString(r));
    return pr_nccl_wait(x, t0, what, err);
}

/* Whether c can run `what`: not once its family has failed (err says why). */
static pr_status pr_nccl_usable(pr_comm *c, const char *what, pr_error *err) {
    const pr_nccl_family *f = pr_nccl_of(c)->family;
    if (!f->failed[0]) return PR_OK;
    return pr_nccl_error(err, PR_ERR_DEVICE, "NCCL %s: the communicator was aborted after an earlier failure (%s)", what, f->failed);
}
/* The same, and t's NCCL type and element size. A call refused for its arguments aborts like a
   failed one: the peers go on into theirs (pr_nccl_status). */
static pr_status pr_nccl_begin(pr_comm *c, pr_comm_type t, ncclDataType_t *dt, size_t *elem, const char *what, pr_error *err) {
    const pr_status st = pr_nccl_usable(c, what, err);
    if (st || pr_nccl_type(t, dt, elem)) return st;
    return pr_nccl_abort(pr_nccl_of(c), what, err, "unknown type %d", (int)t);
}

static pr_status pr_nccl_all_reduce(pr_comm *c, void *buf, size_t n, pr_comm_type t, pr_error *err) {
    pr_nccl *x = pr_nccl_of(c);
    ncclDataType_t dt = ncclFloat32;
    size_t e = 0;
    pr_status st = pr_nccl_begin(c, t, &dt, &e, "all_reduce", err);
    if (st) return st;
    if (c->size > 1) c->bytes_sent += n * e;
    return pr_nccl_status(x, ncclAllReduce(buf, buf, n, dt, ncclSum, x->nc, x->cx->stream), "all_reduce", err);
}
static pr_status pr_nccl_all_gather(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type t, pr_error *err) {
    pr_nccl *x = pr_nccl_of(c);
    ncclDataType_t dt = ncclFloat32;
    size_t e = 0;
    pr_status st = pr_nccl_begin(c, t, &dt, &e, "all_gather", err);
    if (st) return st;
    if (c->size > 1) c->bytes_sent += n * e;
    return pr_nccl_status(x, ncclAllGather(in, out, n, dt, x->nc, x->cx->stream), "all_gather", err);
}
static pr_status pr_nccl_reduce_scatter(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type t, pr_error *err) {
    pr_nccl *x = pr_nccl_of(c);
    ncclDataType_t dt = ncclFloat32;
    size_t e = 0;
    pr_status st = pr_nccl_begin(c, t, &dt, &e, "reduce_scatter", err);
    if (st) return st;
    c->bytes_sent += n * e * (size_t)(c->size - 1);
    return pr_nccl_status(x, ncclReduceScatter(in, out, n, dt, ncclSum, x->nc, x->cx->stream), "reduce_scatter", err);
}
static pr_status pr_nccl_all_to_all(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type t, pr_error *err) {
    pr_nccl *x = pr_nccl_of(c);
    ncclDataType_t dt = ncclFloat32;
    size_t e = 0;
    pr_status st = pr_nccl_begin(c, t, &dt, &e, "all_to_all", err);
    if (st) return st;
    ncclResult_t r = ncclGroupStart();
    for (int p = 0; p < c->size && r == ncclSuccess; p++) {
        r = ncclSend((const char *)in + (size_t)p * n * e, n, dt, p, x->nc, x->cx->stream);
        if (r == ncclSuccess) r = ncclRecv((char *)out + (size_t)p * n * e, n, dt, p, x->nc, x->cx->stream);
    }
    ncclResult_t r2 = ncclGroupEnd();
    c->bytes_sent += n * e * (size_t)(c->size - 1);
    return pr_nccl_status(x, r != ncclSuccess ? r : r2, "all_to_all", err);
}
static pr_status pr_nccl_peer(pr_comm *c, int peer, const char *what, pr_error *err) {
    if (peer >= 0 && peer < c->size && peer != c->rank) return PR_OK;
    return pr_nccl_abort(pr_nccl_of(c), what, err, "peer %d is not another rank of %d", peer, c->size);
}
static pr_status pr_nccl_send(pr_comm *c, const void *buf, size_t n, pr_comm_type t, int peer, pr_error *err) {
    pr_nccl *x = pr_nccl_of(c);
    ncclDataType_t dt = ncclFloat32;
    size_t e = 0;
    pr_status st = pr_nccl_begin(c, t, &dt, &e, "send", err);
    if (st) return st;
    st = pr_nccl_peer(c, peer, "send", err);
    if (st) return st;
    c->bytes_sent += n * e;
    return pr_nccl_status(x, ncclSend(buf, n, dt, peer, x->nc, x->cx->stream), "send", err);
}
static pr_status pr_nccl_recv(pr_comm *c, void *buf, size_t n, pr_comm_type t, int peer, pr_error *err) {
    pr_nccl *x = pr_nccl_of(c);
    ncclDataType_t dt = ncclFloat32;
    size_t e = 0;
    pr_status st = pr_nccl_begin(c, t, &dt, &e, "recv", err);
    if (st) return st;
    st = pr_nccl_peer(c, peer, "recv", err);
    if (st) return st;
    return pr_nccl_status(x, ncclRecv(buf, n, dt, peer, x->nc, x->cx->stream), "recv", err);
}
static pr_status pr_nccl_send_recv(pr_comm *c, const void *send, size_t n_send, int to, void *recv, size_t n_recv, int from,
                                   pr_comm_type t, pr_error *err) {
    pr_nccl *x = pr_nccl_of(c);
    ncclDataType_t dt = ncclFloat32;
    size_t e = 0;
    pr_status st = pr_nccl_begin(c, t, &dt, &e, "send_recv", err);
    if (st) return st;
    st = pr_nccl_peer(c, to, "send_recv", err);
    if (!st) st = pr_nccl_peer(c, from, "send_recv", err);
    if (st) return st;
    c->bytes_sent += n_send * e;
    ncclResult_t r = ncclGroupStart();      /* one group: neither side waits for the other's half */
    if (r == ncclSuccess) r = ncclSend(send, n_send, dt, to, x->nc, x->cx->stream);
    if (r == ncclSuccess) r = ncclRecv(recv, n_recv, dt, from, x->nc, x->cx->stream);
    ncclResult_t r2 = ncclGroupEnd();
    return pr_nccl_status(x, r != ncclSuccess ? r : r2, "send_recv", err);
}
static pr_status pr_nccl_barrier(pr_comm *c, pr_error *err) {
    pr_nccl *x = pr_nccl_of(c);
    pr_status st = pr_nccl_usable(c, "barrier", err);
    if (st) return st;
    return pr_nccl_status(x, ncclAllReduce(x->one, x->one, 1, ncclFloat32, ncclSum, x->nc, x->cx->stream), "barrier", err);
}
static void pr_nccl_destroy(pr_comm *c) {
    if (!c) return;
    pr_nccl *x = pr_nccl_of(c);
    pr_nccl_family *f = x->family;
    if (x->nc) (f->failed[0] ? ncclCommAbort : ncclCommDestroy)(x->nc);
    if (x->one) cudaFree(x->one);
    if (--f->refs == 0) {
        if (f->root) (f->failed[0] ? ncclCommAbort : ncclCommDestroy)(f->root);
        free(f);
    }
    free(x);
}

/* parent split by (color >= 0, key) into a blocking communicator, *out: where parent is
   non-blocking, the split returns at once (ncclSuccess, NCCL's source says; ncclInProgress, its
   documentation), *out NULL until NCCL's thread has made it, which is watched until timeout_s
   from t0 (ncclInProgress where it has not ended: the caller then aborts parent, which ends the
   split and joins NCCL's thread, before it looks at *out again; NCCL's thread sets *out at its
   end even where the split failed, to what the caller must then abort). */
static ncclResult_t pr_nccl_split_into(ncclComm_t parent, int color, int key, ncclComm_t *out, double t0, int timeout_s) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    *out = NULL;
    ncclResult_t r = ncclCommSplit(parent, color, key, out, &config);
    if (r == ncclSuccess || r == ncclInProgress) r = pr_nccl_settle(parent, t0, timeout_s);   /* at once where parent blocks */
    return r == ncclSuccess && !*out ? ncclInternalError : r;
}

static pr_status pr_nccl_wrap(pr_comm **out, ncclComm_t nc, pr_cu *cx, pr_nccl_family *family, int world, pr_error *err);

static pr_status pr_nccl_split(pr_comm *c, int color, int key, pr_comm **sub, pr_error *err) {
    pr_nccl *x = pr_nccl_of(c);
    pr_nccl_family *f = x->family;
    pr_status st = pr_nccl_usable(c, "split", err);
    if (st) return st;
    if (color < 0)    /* NCCL's NCCL_SPLIT_NOCOLOR (-1) would give this rank no communicator */
        return pr_nccl_abort(x, "split", err, "color %d: every rank needs one >= 0", color);
    ncclComm_t nc = NULL;
    const ncclResult_t r = pr_nccl_split_into(x->world && f->root ? f->root : x->nc, color, key, &nc, pr_nccl_now(), f->timeout_s);
    if (r != ncclSuccess) {                       /* the peers may be in it */
        /* x's abort and the root's end a split of either under way */
        st = r == ncclInProgress ? pr_nccl_abort(x, "split", err, "not done after %d s (a peer rank has stopped or hangs, or the "
                                                                  "ranks' calls differ)", f->timeout_s)
                                 : pr_nccl_abort(x, "split", err, "%s", ncclGetErrorString(r));
        if (nc) ncclCommAbort(nc);                /* what the split made before it failed */
        return st;
    }
    st = pr_nccl_wrap(sub, nc, x->cx, f, 0, err);                    /* the peers hold theirs: this rank cannot go on */
    return st ? pr_nccl_abort(x, "split", err, "%s", err ? err->message : "out of memory") : PR_OK;
}

/* nc as a pr_comm of the family (which it joins; world: it is the family's world); on failure nc
   is destroyed. */
static pr_status pr_nccl_wrap(pr_comm **out, ncclComm_t nc, pr_cu *cx, pr_nccl_family *family, int world, pr_error *err) {
    pr_nccl *x = (pr_nccl *)calloc(1, sizeof *x);
    int rank = 0, size = 0;
    if (!x || ncclCommUserRank(nc, &rank) != ncclSuccess || ncclCommCount(nc, &size) != ncclSuccess ||
        cudaMalloc((void **)&x->one, sizeof(float)) != cudaSuccess ||
        cudaMemsetAsync(x->one, 0, sizeof(float), cx->stream) != cudaSuccess) {
        if (x && x->one) cudaFree(x->one);
        free(x);
        ncclCommDestroy(nc);
        return pr_nccl_error(err, PR_ERR_DEVICE, "NCCL: cannot set up the communicator");
    }
    x->nc = nc;
    x->cx = cx;
    x->world = world;
    x->family = family;
    family->refs++;
    pr_comm *c = &x->c;
    c->rank = rank;
    c->size = size;
    c->name = "nccl";
    c->ctx = x;
    c->all_reduce = pr_nccl_all_reduce;
    c->all_gather = pr_nccl_all_gather;
    c->reduce_scatter = pr_nccl_reduce_scatter;
    c->all_to_all = pr_nccl_all_to_all;
    c->send = pr_nccl_send;
    c->recv = pr_nccl_recv;
    c->send_recv = pr_nccl_send_recv;
    c->barrier = pr_nccl_barrier;
    c->split = pr_nccl_split;
    c->destroy = pr_nccl_destroy;
    *out = c;
    return PR_OK;
}

/* How much older than this call an id file may be and still belong to this launch: the launcher
   starts the ranks together, but rank 0 may write the file before a slow rank gets here. */
#define PR_NCCL_ID_SKEW_S 60

/* Rank 0 removes what an earlier launch left, writes a fresh id next to its final name and renames
   it into place; the other ranks take the first file no older than PR_NCCL_ID_SKEW_S before their
   own call (an older one is a crashed launch's, which would hang the init). Once the world is up
   every rank has read the file, and rank 0 removes it, so a finished launch leaves nothing behind. */
static pr_status pr_nccl_file_id(ncclUniqueId *id, int rank, const char *id_path, int timeout_s, pr_error *err) {
    if (rank == 0) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp.%ld", id_path, (long)getpid());
        remove(id_path);
        FILE *f = NULL;
        int ok = ncclGetUniqueId(id) == ncclSuccess && (f = fopen(tmp, "wb")) != NULL && fwrite(id, sizeof *id, 1, f) == 1;
        if (f && fclose(f) != 0) ok = 0;
        if (ok && rename(tmp, id_path) == 0) return PR_OK;
        remove(tmp);
        return pr_nccl_error(err, PR_ERR_IO, "NCCL: cannot write the unique id to %s", id_path);
    }
    const time_t since = time(NULL) - PR_NCCL_ID_SKEW_S;
    int stale = 0;
    for (long long waited = 0; waited <= (long long)timeout_s * 10; waited++) {
        struct stat sb;
        FILE *f = stat(id_path, &sb) == 0 ? fopen(id_path, "rb") : NULL;
        if (f) {
            int got = sb.st_mtime >= since && fread(id, sizeof *id, 1, f) == 1;
            fclose(f);
            if (got) return PR_OK;
            stale |= sb.st_mtime < since;
        }
        usleep(100000);
    }
    return pr_nccl_error(err, PR_ERR_IO, "NCCL: no unique id at %s after %d s%s", id_path, timeout_s,
                         stale ? " (the file there is older than this launch: rank 0 has not replaced it)" : "");
}

/* ---- the id over TCP (id_path "tcp://HOST:PORT"), for nodes without a shared filesystem.
   Rank 0 listens on PORT (every interface; HOST is the others' way to it). Each other rank
   connects and says who it is: a hello of the magic, its world size, its rank and its launch (a
   hash of pr_nccl_launch's value). A rank of another launch (a process of an earlier one still
   calling), of another world size, or one whose rank is already held (two processes with one
   RANK), is told so at once and takes no place. Rank 0 holds the others' connections (a rank that
   hangs up frees its place) until every rank has come, and only then hands each the id; after
   timeout_s it tells those it holds that it has given up, naming the ranks that did not come. So
   no rank enters NCCL's init unless the whole world has come. Rank 0
   closes the port before its own init (a relaunch can take it at once). The others connect until
   timeout_s, again while rank 0 is not yet listening, and wait for the handout until rank 0's
   limit. Integers in network byte order. */
#define PR_NCCL_TCP_MAGIC "prnccl02"
enum { PR_NCCL_TCP_HELLO = 24, PR_NCCL_TCP_REPLY = 16 + (int)sizeof(ncclUniqueId) };
/* a reply's verdict, and the number after it: rank 0's world size, or how many ranks did not come */
enum { PR_NCCL_TCP_JOINED, PR_NCCL_TCP_OTHER_SIZE, PR_NCCL_TCP_TAKEN, PR_NCCL_TCP_GAVE_UP, PR_NCCL_TCP_OTHER_LAUNCH };

/* The launch this process belongs to, the same in every rank of one: the first set of
   PR_NCCL_LAUNCH (the user's own), SLURM_JOB_ID (Slurm's job) and TORCHELASTIC_RUN_ID (torchrun's
   --rdzv-id), as a 64-bit FNV-1a hash of its value (of "" where none is set), and, in said, which
   one it was for messages. A process of an earlier launch that still retries its call would
   otherwise take a rank's place in the next launch on that port. */
static uint64_t pr_nccl_launch(char *said, size_t cap) {
    static const char *const from[] = { "PR_NCCL_LAUNCH", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID" };
    const char *value = "";
    snprintf(said, cap, "no launch id: PR_NCCL_LAUNCH, SLURM_JOB_ID and TORCHELASTIC_RUN_ID unset");
    for (size_t k = 0; k < sizeof from / sizeof *from; k++) {
        const char *v = getenv(from[k]);
        if (v && *v) {
            snprintf(said, cap, "%s=%s", from[k], v);
            value = v;
            break;
        }
    }
    uint64_t h = 14695981039346656037ull;
    for (const unsigned char *c = (const unsigned char *)value; *c; c++) h = (h ^ *c) * 1099511628211ull;
    return h;
}

/* Whether id_path names the TCP form rather than a file. */
static int pr_nccl_id_over_tcp(const char *id_path) { return !strncmp(id_path, "tcp://", 6); }

/* spec "tcp://HOST:PORT" (an IPv6 address as "[...]"): host and port, or 0 */
static int pr_tcp_parse(const char *spec, char *host, size_t host_cap, char *port, size_t port_cap) {
    const char *h = spec + 6, *colon = strrchr(h, ':');
    if (!colon || colon == h || !colon[1] || strlen(colon + 1) >= port_cap) return 0;
    for (const char *d = colon + 1; *d; d++) if (*d < '0' || *d > '9') return 0;
    const long p = strtol(colon + 1, NULL, 10);
    if (p < 1 || p > 65535) return 0;
    size_t n = (size_t)(colon - h);
    const int bracketed = h[0] == '[' && h[n - 1] == ']';
    if (bracketed) h++, n -= 2;
    if (n == 0 || n >= host_cap) return 0;
    memcpy(host, h, n);
    host[n] = 0;
    if (strpbrk(host, "[]") || (!bracketed && strchr(host, ':'))) return 0;   /* "tcp://::1" is not host :: port 1 */
    snprintf(port, port_cap, "%ld", p);
    return 1;
}

/* One step's deadline: `seconds` from now, but no later than the whole wait's. */
static double pr_tcp_within(double deadline, double seconds) {
    const double soon = pr_nccl_now() + seconds;
    return soon < deadline ? soon : deadline;
}

static int pr_tcp_ms_left(double deadline) {
    const double left = deadline - pr_nccl_now();
    return left <= 0 ? 0 : left > 1e6 ? 1000000000 : (int)(left * 1000) + 1;
}

/* n bytes into (out = 0) or from (out = 1) fd, a non-blocking socket, by the deadline: 0 when done */
static int pr_tcp_io(int fd, void *buf, size_t n, int out, double deadline) {
    unsigned char *b = (unsigned char *)buf;
    while (n) {
        struct pollfd pf = { fd, (short)(out ? POLLOUT : POLLIN), 0 };
        const int ms = pr_tcp_ms_left(deadline);
        if (ms == 0 || (poll(&pf, 1, ms) < 0 && errno != EINTR)) return -1;
        const ssize_t got = out ? send(fd, b, n, MSG_NOSIGNAL) : recv(fd, b, n, 0);
        if (got == 0 && !out) return -1;                  /* the peer closed */
        if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
        if (got > 0) b += got, n -= (size_t)got;
    }
    return 0;
}
static void pr_tcp_put32(unsigned char *p, uint32_t v) { v = htonl(v); memcpy(p, &v, 4); }
static uint32_t pr_tcp_get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return ntohl(v); }
static void pr_tcp_put64(unsigned char *p, uint64_t v) { pr_tcp_put32(p, (uint32_t)(v >> 32)); pr_tcp_put32(p + 4, (uint32_t)v); }
static uint64_t pr_tcp_get64(const unsigned char *p) { return (uint64_t)pr_tcp_get32(p) << 32 | pr_tcp_get32(p + 4); }

/* Rank 0: a listening socket on port, IPv6 taking IPv4 too where the host has IPv6, else IPv4. */
static int pr_tcp_listen(const char *port) {
    const uint16_t p = htons((uint16_t)atoi(port));
    for (int v6 = 1; v6 >= 0; v6--) {
        int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        const int yes = 1, no = 0;
        struct sockaddr_in6 a6;
        struct sockaddr_in a4;
        memset(&a6, 0, sizeof a6);
        memset(&a4, 0, sizeof a4);
        a6.sin6_family = AF_INET6, a6.sin6_port = p, a6.sin6_addr = in6addr_any;
        a4.sin_family = AF_INET, a4.sin_port = p, a4.sin_addr.s_addr = htonl(INADDR_ANY);
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);   /* a relaunch within TIME_WAIT */
        if (v6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &no, sizeof no);
        const int bound = v6 ? bind(fd, (const struct sockaddr *)&a6, sizeof a6) : bind(fd, (const struct sockaddr *)&a4, sizeof a4);
        if (bound == 0 && listen(fd, 256) == 0) return fd;
        const int e = errno;
        close(fd);
        errno = e;
        if (e == EADDRINUSE) break;                       /* IPv4 would find it taken too */
    }
    return -1;
}

/* Sends a reply (the id only with JOINED) and closes c. 0 when sent. */
static int pr_tcp_reply(int c, uint32_t verdict, uint32_t number, const ncclUniqueId *id, double deadline) {
    unsigned char reply[PR_NCCL_TCP_REPLY];
    memcpy(reply, PR_NCCL_TCP_MAGIC, 8);
    pr_tcp_put32(reply + 8, verdict);
    pr_tcp_put32(reply + 12, number);
    if (verdict == PR_NCCL_TCP_JOINED) memcpy(reply + 16, id, sizeof *id);
    else memset(reply + 16, 0, sizeof *id);
    const int sent = pr_tcp_io(c, reply, sizeof reply, 1, deadline);
    close(c);
    return sent;
}

/* Rank 0 holds one connection a rank: where the soft limit on open files is lower than that, it is
   raised as far as the hard one allows. */
static void pr_tcp_fd_room(int size) {
    struct rlimit r;
    const rlim_t want = (rlim_t)size + 256;
    if (getrlimit(RLIMIT_NOFILE, &r) || r.rlim_cur == RLIM_INFINITY || r.rlim_cur >= want) return;
    r.rlim_cur = r.rlim_max == RLIM_INFINITY || r.rlim_max > want ? want : r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
}

/* The ranks rank 0 does not hold (1 to size-1), as "1, 5, 9" with at most 8 listed. */
static void pr_tcp_missing(const int *held, int size, char *out, size_t cap) {
    size_t at = 0;
    out[0] = 0;
    for (int r = 1, listed = 0; r < size && at < cap; r++) {
        if (held[r] >= 0) continue;
        const int n = listed == 8 ? snprintf(out + at, cap - at, ", ...") : snprintf(out + at, cap - at, "%s%d", listed ? ", " : "", r);
        if (n < 0 || listed++ == 8) break;
        at += (size_t)n;
    }
}

static pr_status pr_nccl_tcp_serve(const ncclUniqueId *id, int size, uint64_t launch, const char *spec, const char *port,
                                   int timeout_s, pr_error *err) {
    int *held = (int *)malloc(sizeof(int) * 2 * (size_t)size);           /* held[r]: rank r's connection, or -1 */
    struct pollfd *pf = (struct pollfd *)malloc(sizeof(struct pollfd) * (size_t)size);
    if (!held || !pf) {
        free(held);
        free(pf);
        return pr_nccl_error(err, PR_ERR_NOMEM, "NCCL: out of host memory");
    }
    int *who = held + size;                                                /* who[k]: the rank of pf[k], k >= 1 */
    for (int r = 0; r < size; r++) held[r] = -1;
    pr_tcp_fd_room(size);
    const int fd = pr_tcp_listen(port);
    if (fd < 0) {
        const int e = errno;
        free(held);
        free(pf);
        return pr_nccl_error(err, PR_ERR_IO, "NCCL: rank 0 cannot listen on port %s (%s) for %s", port, strerror(e), spec);
    }
    const double deadline = pr_nccl_now() + timeout_s;
    pr_status st = PR_OK;
    int waiting = size - 1;
    while (!st) {
        int n = 0;
        pf[n].fd = fd, pf[n].events = POLLIN, pf[n++].revents = 0;
        for (int r = 1; r < size; r++)
            if (held[r] >= 0) pf[n].fd = held[r], pf[n].events = POLLIN, pf[n].revents = 0, who[n++] = r;
        const int last_look = waiting == 0;              /* everyone held: a look, without waiting, for a rank that left */
        const int ms = last_look ? 0 : pr_tcp_ms_left(deadline);
        if (!last_look && !ms) break;
        const int ready = poll(pf, (nfds_t)n, ms);
        if (ready < 0 && errno != EINTR) st = pr_nccl_error(err, PR_ERR_IO, "NCCL: rank 0 at %s: poll: %s", spec, strerror(errno));
        for (int k = 1; ready > 0 && k < n; k++)
            if (pf[k].revents) {                          /* a held rank hung up (or spoke out of turn): its place is free again */
                close(held[who[k]]);
                held[who[k]] = -1;
                waiting++;
            }
        if (last_look && !waiting) break;                 /* no one left: the world is whole */
        if (ready <= 0 || last_look || !(pf[0].revents & POLLIN)) continue;
        for (;;) {                                        /* every connection waiting to be taken */
            const int c = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (c < 0) {
                if (errno == EMFILE || errno == ENFILE)
                    st = pr_nccl_error(err, PR_ERR_IO, "NCCL: rank 0 ran out of open files holding the connections of %d ranks at %s "
                                                       "(raise `ulimit -n`)", size - 1 - waiting, spec);
                break;
            }
            unsigned char hello[PR_NCCL_TCP_HELLO];
            const double by = pr_tcp_within(deadline, 5);   /* one silent peer holds up no one long */
            if (pr_tcp_io(c, hello, sizeof hello, 0, by) || memcmp(hello, PR_NCCL_TCP_MAGIC, 8)) {
                close(c);
                continue;
            }
            const uint32_t their_size = pr_tcp_get32(hello + 8), their_rank = pr_tcp_get32(hello + 12);
            if (pr_tcp_get64(hello + 16) != launch) pr_tcp_reply(c, PR_NCCL_TCP_OTHER_LAUNCH, 0, id, by);
            else if (their_size != (uint32_t)size) pr_tcp_reply(c, PR_NCCL_TCP_OTHER_SIZE, (uint32_t)size, id, by);
            else if (their_rank == 0 || their_rank >= (uint32_t)size || held[their_rank] >= 0) pr_tcp_reply(c, PR_NCCL_TCP_TAKEN, 0, id, by);
            else held[their_rank] = c, waiting--;
        }
    }
    close(fd);
    char missing[160];
    pr_tcp_missing(held, size, missing, sizeof missing);
    const int all = waiting == 0 && !st;
    const double by = pr_nccl_now() + 5;
    int lost = -1;                                       /* a rank the id did not reach */
    for (int r = 1; r < size; r++)                       /* every rank the id, or every one held the news */
        if (held[r] >= 0 && pr_tcp_reply(held[r], all ? PR_NCCL_TCP_JOINED : PR_NCCL_TCP_GAVE_UP, (uint32_t)waiting, id, by) && all)
            lost = r;
    /* Those that have the id wait in NCCL's init for rank 0's bootstrap, which ends with this
       process: they fail then, rather than wait for a rank that will not come. */
    if (lost >= 0)
        st = pr_nccl_error(err, PR_ERR_IO, "NCCL: rank %d left %s before the id reached it", lost, spec);
    else if (!all && !st)
        st = pr_nccl_error(err, PR_ERR_IO, "NCCL: after %d s at %s, %d of the %d other ranks had not come (missing: rank %s)",
                           timeout_s, spec, waiting, size - 1, missing);
    free(held);
    free(pf);
    return st;
}

/* Whether fd is connected to itself: a retried connect to a port no one listens on yet can take
   that very port as its own (within the local port range), and would hold it from rank 0. */
static int pr_tcp_self(int fd) {
    struct sockaddr_storage a, b;
    socklen_t la = sizeof a, lb = sizeof b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    return !getsockname(fd, (struct sockaddr *)&a, &la) && !getpeername(fd, (struct sockaddr *)&b, &lb) && la == lb && !memcmp(&a, &b, la);
}

/* A connected non-blocking socket to host:port by the deadline (each address tried for 5 s at
   most), or -1 with why. A name that does not resolve is no answer yet either: under Kubernetes
   rank 0's name exists only once its pod does. */
static int pr_tcp_connect(const char *host, const char *port, double deadline, char *why, size_t why_cap) {
    struct addrinfo hints, *list = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const int g = getaddrinfo(host, port, &hints, &list);
    if (g) {
        snprintf(why, why_cap, "%s", gai_strerror(g));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *a = list; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        const int yes = 1;                                /* what it leaves on the port (TIME_WAIT) does not keep rank 0 off it */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
        int e = connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
        if (e == EINPROGRESS) {                           /* connected once writable; SO_ERROR says how */
            struct pollfd pf = { fd, POLLOUT, 0 };
            socklen_t len = sizeof e;
            if (poll(&pf, 1, pr_tcp_ms_left(pr_tcp_within(deadline, 5))) <= 0) e = ETIMEDOUT;
            else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len)) e = errno;
        }
        if (!e && pr_tcp_self(fd)) e = ECONNREFUSED;     /* no one listens there yet */
        if (e) {
            snprintf(why, why_cap, "%s", strerror(e));
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(list);
    return fd;
}

static pr_status pr_nccl_tcp_join(ncclUniqueId *id, int rank, int size, uint64_t launch, const char *launch_said, const char *spec,
                                  const char *host, const char *port, int timeout_s, pr_error *err) {
    const double deadline = pr_nccl_now() + timeout_s;
    char why[160] = "no answer";
    int fd = -1;
    for (double nap = 0.05; fd < 0; nap = nap < 0.8 ? 2 * nap : 1) {   /* rank 0 not listening yet: tries, then one a second */
        fd = pr_tcp_connect(host, port, deadline, why, sizeof why);
        if (fd >= 0) break;
        if (pr_tcp_ms_left(deadline) == 0)
            return pr_nccl_error(err, PR_ERR_IO, "NCCL: no id from rank 0 at %s within %d s (%s)", spec, timeout_s, why);
        usleep((useconds_t)(nap * 1e6));
    }
    unsigned char hello[PR_NCCL_TCP_HELLO], reply[PR_NCCL_TCP_REPLY];
    memcpy(hello, PR_NCCL_TCP_MAGIC, 8);
    pr_tcp_put32(hello + 8, (uint32_t)size);
    pr_tcp_put32(hello + 12, (uint32_t)rank);
    pr_tcp_put64(hello + 16, launch);
    /* rank 0 started its clock before it took this connection: its handout comes within timeout_s */
    const int ok = !pr_tcp_io(fd, hello, sizeof hello, 1, pr_nccl_now() + 5) && !pr_tcp_io(fd, reply, sizeof reply, 0, pr_nccl_now() + timeout_s + 5);
    close(fd);
    if (!ok) return pr_nccl_error(err, PR_ERR_IO, "NCCL: rank 0 at %s took this rank's call but handed out no id (has it failed?)", spec);
    const uint32_t verdict = pr_tcp_get32(reply + 8), number = pr_tcp_get32(reply + 12);
    if (memcmp(reply, PR_NCCL_TCP_MAGIC, 8))
        return pr_nccl_error(err, PR_ERR_IO, "NCCL: what answers at %s is not a rank 0 of this library's", spec);
    if (verdict == PR_NCCL_TCP_OTHER_LAUNCH)
        return pr_nccl_error(err, PR_ERR_ARG, "NCCL: rank 0 at %s belongs to another launch (this rank's: %s)", spec, launch_said);
    if (verdict == PR_NCCL_TCP_OTHER_SIZE)
        return pr_nccl_error(err, PR_ERR_ARG, "NCCL: rank 0 at %s has a world of %u ranks, this rank (%d) one of %d", spec, number, rank, size);
    if (verdict == PR_NCCL_TCP_TAKEN)
        return pr_nccl_error(err, PR_ERR_ARG, "NCCL: rank 0 at %s already holds a rank %d (two processes with one RANK?)", spec, rank);
    if (verdict == PR_NCCL_TCP_GAVE_UP)
        return pr_nccl_error(err, PR_ERR_IO, "NCCL: rank 0 at %s gave up: %u of the %d other ranks had not come (its message names them)",
                             spec, number, size - 1);
    memcpy(id, reply + 16, sizeof *id);
    return PR_OK;
}

/* The unique id from rank 0 to every rank, through a file or over TCP. */
static pr_status pr_nccl_share_id(ncclUniqueId *id, int rank, int size, const char *id_path, int timeout_s, pr_error *err) {
    if (!pr_nccl_id_over_tcp(id_path)) return pr_nccl_file_id(id, rank, id_path, timeout_s, err);
    char host[256], port[8];
    if (!pr_tcp_parse(id_path, host, sizeof host, port, sizeof port))
        return pr_nccl_error(err, PR_ERR_ARG, "NCCL: %s is not tcp://HOST:PORT (a port from 1 to 65535)", id_path);
    char launch_said[160];
    const uint64_t launch = pr_nccl_launch(launch_said, sizeof launch_said);
    if (rank) return pr_nccl_tcp_join(id, rank, size, launch, launch_said, id_path, host, port, timeout_s, err);
    if (ncclGetUniqueId(id) != ncclSuccess) return pr_nccl_error(err, PR_ERR_DEVICE, "NCCL: no unique id");
    return pr_nccl_tcp_serve(id, size, launch, id_path, port, timeout_s, err);
}

pr_status pr_comm_nccl_create(pr_comm **out, const pr_backend *be, int rank, int size, const char *id_path, int timeout_s,
                              pr_error *err) {
    if (!out || !be || !id_path || size < 1 || rank < 0 || rank >= size)
        return pr_nccl_error(err, PR_ERR_ARG, "pr_comm_nccl_create: rank %d of %d, backend %s, id path %s", rank, size,
                             be ? be->name : "NULL", id_path ? id_path : "NULL");
    if (be->alloc != pr_cu_alloc)
        return pr_nccl_error(err, PR_ERR_ARG, "pr_comm_nccl_create: backend '%s' is not a CUDA backend", be->name);
    if (timeout_s < 1) return pr_nccl_error(err, PR_ERR_ARG, "pr_comm_nccl_create: timeout %d s, at least 1 expected", timeout_s);
    pr_cu *cx = pr_cu_of(be);
    ncclUniqueId id;
    pr_status st = pr_nccl_share_id(&id, rank, size, id_path, timeout_s, err);
    if (st) return st;
    pr_nccl_family *family = (pr_nccl_family *)calloc(1, sizeof *family);
    if (!family) return pr_nccl_error(err, PR_ERR_NOMEM, "NCCL: out of host memory");
    family->timeout_s = timeout_s;
    family->world_rank = rank;
    ncclComm_t root = NULL, nc = NULL;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;                                   /* the root (pr_nccl_family): its init watched */
    const double t0 = pr_nccl_now();
    if (cudaSetDevice(cx->device) != cudaSuccess) {        /* NCCL binds the communicator to the current device */
        st = pr_nccl_error(err, PR_ERR_DEVICE, "NCCL init: cannot select CUDA device %d", cx->device);
    } else {
        ncclResult_t r = ncclCommInitRankConfig(&root, size, id, rank, &config);
        if (r == ncclInProgress) r = pr_nccl_settle(root, t0, timeout_s);
        if (r == ncclSuccess) r = pr_nccl_split_into(root, 0, rank, &nc, t0, timeout_s);   /* the world: every rank, as ranked */
        if (r != ncclSuccess) {
            if (r == ncclInProgress)
                pr_nccl_error(err, PR_ERR_DEVICE, "NCCL init (rank %d of %d): the world did not come together within %d s (a rank "
                              "that did not start or failed before its init, or one NCCL cannot reach)", rank, size, timeout_s);
            else
                pr_nccl_error(err, PR_ERR_DEVICE, "NCCL init (rank %d of %d): %s", rank, size, ncclGetErrorString(r));
            if (root) {                                    /* the abort may wait (pr_nccl_abort): said first */
                fprintf(stderr, "prefixreuse: %s: aborting the communicator\n", err ? err->message : "NCCL init failed");
                ncclCommAbort(root);                       /* ends an init or split under way, joining NCCL's thread */
            }
            if (nc) ncclCommAbort(nc);
            st = PR_ERR_DEVICE;
        } else {
            family->root = root;
            st = pr_nccl_wrap(out, nc, cx, family, 1, err);
            if (st) ncclCommAbort(root);
        }
    }
    if (rank == 0 && !pr_nccl_id_over_tcp(id_path)) remove(id_path);   /* joined, or failed: no later launch may take this id */
    if (st) free(family);
    return st;
}
#else
pr_status pr_comm_nccl_create(pr_comm **out, const pr_backend *be, int rank, int size, const char *id_path, int timeout_s,
                              pr_error *err) {
    (void)out; (void)be; (void)rank; (void)size; (void)id_path; (void)timeout_s;
    if (err) {
        err->status = PR_ERR_UNSUPPORTED;
        snprintf(err->message, sizeof err->message, "this build has no NCCL (built with PR_NO_NCCL): multi-GPU runs need it");
    }
    return PR_ERR_UNSUPPORTED;
}
#endif
#endif /* PR_CUDA_HOST_EMULATION */
