# prefixreuse — `make` builds ./train; `make test` runs every CPU test (last line: N passed, N failed).
#   make PRECISION=double    every real number in double (exact-equivalence checks)
#   make BLAS=1              GEMMs through the system CBLAS (Debian: libopenblas-dev)
#   make OMP=0               without OpenMP
#   make NATIVE=0            without -march=native
#   make asan                the test suite under AddressSanitizer + UBSan
#   make bench-gemm          the header's GEMM beside OpenBLAS on the model's shapes
#   make bench-attention     the CPU attention alone, forward and backward, on the model's shapes
#   make fuzz                the trace and safetensors/config parsers, the config size checks and the training-state
#                            loader under libFuzzer (clang); then random --check, resume and allocation-failure cases (test/fuzz_check.py)
#   make cuda                ./train_cuda: the same driver on the CUDA backend (nvcc, cuBLASLt)
#   make test-gpu            the GPU tests (needs a GPU; last line: N passed, N failed)
#   make test-gpu-mesh       train_cuda on dp, tp, pp, cp and ep meshes, one process a GPU (needs 4 GPUs)
#   make bench-cuda          the CUDA GEMMs beside cuBLASLt's best, and attention TFLOP/s (needs a GPU)
#   make NCCL=0 cuda         without NCCL (found in NCCL_HOME, the CUDA toolkit or PyTorch's nvidia-nccl wheel)
#   make info                what was found: compiler, OpenMP, BLAS, nvcc, NCCL
#   make STD=c99 CFLAGS="-O2 -DPR_NO_THREADS" train   the C99 build (no in-process ranks)
#   make CXX=clang++ CXXSTD=c++20 build/test_cxx      the C++ program with another compiler or standard
# LDFLAGS is passed to every link.

CC      ?= cc
CFLAGS  ?= -O2
STD     ?= c11
WARN    := -std=$(STD) -Wall -Wextra
# C++ (test/test_cxx.cc: the header compiled into a C++ program); its threads are POSIX threads
CXXSTD  ?= c++17
CXXWARN := -std=$(CXXSTD) -Wall -Wextra
LDLIBS  := -lm
PRECISION ?= float
OMP     ?= 1
NATIVE  ?= 1
BLAS    ?= 0

ifeq ($(NATIVE),1)
  ARCH := $(shell $(CC) -march=native -E -x c /dev/null >/dev/null 2>&1 && echo -march=native)
endif
ifeq ($(OMP),1)
  OPENMP := $(shell echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null >/dev/null 2>&1 && echo -fopenmp)
endif
ifeq ($(PRECISION),double)
  DEFS += -DPR_DOUBLE
else ifneq ($(PRECISION),float)
  $(error PRECISION must be float or double)
endif
ifeq ($(BLAS),1)
  DEFS += -DPR_USE_CBLAS
  LDLIBS += -lopenblas
endif

ALL_CFLAGS = $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) $(DEFS)
HEADER = prefixreuse.h
# what every test program includes: the harness and the random numbers (test/harness.h, test/xorshift.h)
TEST_H = test/harness.h test/xorshift.h

.PHONY: all test asan bench-gemm bench-attention bench-cuda fuzz clean info cuda test-gpu sass FORCE

all: train

info:
	@echo "cc $(CC); precision $(PRECISION); openmp '$(OPENMP)'; arch '$(ARCH)'; blas $(BLAS)"
	@echo "nvcc '$(NVCC_PATH)'; cuda home '$(CUDA_HOME)'; nccl: $(NCCL_FOUND)"

# The flags ./train was built with: changing PRECISION, BLAS, OMP or CC rebuilds it.
build/flags: FORCE | build
	@echo '$(CC) $(ALL_CFLAGS) $(LDFLAGS) $(LDLIBS)' | cmp -s - $@ || echo '$(CC) $(ALL_CFLAGS) $(LDFLAGS) $(LDLIBS)' > $@
FORCE:

train: train.c $(HEADER) build/flags
	$(CC) $(ALL_CFLAGS) $(LDFLAGS) -o $@ train.c $(LDLIBS)

# The suite: the core tests in both precisions, the parsers' tests, and ./train --check in both.
build/%-float: test/%.c $(HEADER) $(TEST_H) | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) $(LDFLAGS) -o $@ $< -lm
build/%-double: test/%.c $(HEADER) $(TEST_H) | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) -DPR_DOUBLE $(LDFLAGS) -o $@ $< -lm
build/train-float: train.c $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) $(LDFLAGS) -o $@ train.c -lm
build/train-double: train.c $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) -DPR_DOUBLE $(LDFLAGS) -o $@ train.c -lm
# The attention tests' comparison (test/attn_check.h, shared with the GPU tests) on the CPU: planted
# faults in a scalar attention must fail it, the same attention without them must pass.
build/test_attn_check: test/test_attn_check.c test/attn_check.h test/gpu_ref.c test/gpu_ref.h $(HEADER) $(TEST_H) | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) $(LDFLAGS) -o $@ test/test_attn_check.c test/gpu_ref.c -lm
# The header in a C++ program (C++17 and later, g++ or clang++).
build/test_cxx: test/test_cxx.cc $(HEADER) $(TEST_H) | build
	$(CXX) $(CXXWARN) $(CFLAGS) $(ARCH) $(OPENMP) -pthread $(LDFLAGS) -o $@ test/test_cxx.cc -lm
build:
	mkdir -p build

TEST_BINS = build/test_core-float build/test_core-double build/test_gemm-float build/test_gemm-double \
            build/test_io-float build/test_io-double build/test_trace-float build/test_trace-double \
            build/test_comm-float build/test_comm-double build/test_attn_check build/test_cxx \
            build/train-float build/train-double build/train_faults-double
# train with an allocation failing on demand (test/train_faults.c includes train.c)
build/train_faults-double build/asan/train_faults-double: train.c
# The tile-level model of the tensor-core attention (test/attn_model.c) against its references: one
# program, in double, since the library's CPU attention it is also compared with is the double
# reference (the model computes in bf16/fp32 whatever the build).
ATTN_MODEL = test/test_attn_model.c test/attn_model.c test/attn_model.h $(HEADER) $(TEST_H)
build/test_attn_model-double: $(ATTN_MODEL) | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) -DPR_DOUBLE $(LDFLAGS) -o $@ test/test_attn_model.c test/attn_model.c -lm
TEST_BINS += build/test_attn_model-double
TEST_BINS += build/test_mma_emul build/test_mma_kernels
# the CUDA backend on the emulated device (below): the GPU suite without a GPU
TEST_BINS += build/test_cuda_emu build/emu/train_cuda build/emu/test_gpu build/emu/test_gpu_attention build/compare_st

# The tensor-core attention on the host (C++17, no GPU): its warp-level rules through an emulation
# of ldmatrix and mma.sync (test_mma_emul), and its kernels on an emulated block against the double
# CPU attention, the FFMA kernels' too (test_mma_kernels; prefixreuse_cuda.cu compiled with
# PR_CUDA_HOST_EMULATION and PR_CUDA_KERNEL_EMULATION).
MMA_EMU_DEPS = prefixreuse_cuda.cu test/mma_emu.h $(TEST_H) test/gpu_emu.h test/wgmma_emu.h $(HEADER)
build/test_mma_emul: test/test_mma_emul.cc $(MMA_EMU_DEPS) | build
	$(CXX) -std=c++17 -Wall -Wextra $(CFLAGS) $(LDFLAGS) -o $@ test/test_mma_emul.cc
build/gpu_ref_host.o: test/gpu_ref.c test/gpu_ref.h $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) -c -o $@ test/gpu_ref.c
build/attn_model_host.o: test/attn_model.c test/attn_model.h | build
	$(CC) $(WARN) $(CFLAGS) -c -o $@ test/attn_model.c
build/test_mma_kernels: test/test_mma_kernels.cc build/gpu_ref_host.o build/attn_model_host.o test/gpu_ref.h test/attn_model.h $(MMA_EMU_DEPS) | build
	$(CXX) -std=c++17 -Wall -Wextra $(CFLAGS) $(LDFLAGS) -o $@ test/test_mma_kernels.cc build/gpu_ref_host.o build/attn_model_host.o -lm

# The test programs are built one a core unless make was given -j (a clean build is minutes of C++
# for the emulated device), and test/run.sh runs them one a core too (TEST_JOBS=1: one after another).
NPROC := $(shell getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
JOBS_FLAG = $(if $(filter -j%,$(MAKEFLAGS)),,-j$(NPROC))
test: | build
	@$(MAKE) --no-print-directory $(JOBS_FLAG) $(TEST_BINS)
	@sh test/run.sh build

# -O2 (and, for the C library, the same -march as its own build): at -O1 the GEMM's inner loops run
# unvectorised with a check at every element, and a step under the sanitizers took three times as long
SAN = -O2 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
SAN_C = $(CC) $(WARN) $(SAN) $(ARCH) $(OPENMP) $(LDFLAGS)
ASAN_BINS = $(foreach p,float double,$(foreach t,test_core test_gemm test_io test_trace test_comm train,build/asan/$(t)-$(p))) \
            build/asan/test_attn_model-double build/asan/test_attn_check build/asan/test_cxx build/asan/test_mma_emul \
            build/asan/test_mma_kernels build/asan/test_cuda_emu build/asan/train_cuda-emu build/asan/train_faults-double
asan: | build/asan
	@$(MAKE) --no-print-directory $(JOBS_FLAG) $(ASAN_BINS)
	@sh test/run.sh build/asan

build/asan:
	mkdir -p build/asan
build/asan/%-float: test/%.c $(HEADER) $(TEST_H) | build/asan
	$(SAN_C) -o $@ $< -lm
build/asan/%-double: test/%.c $(HEADER) $(TEST_H) | build/asan
	$(SAN_C) -DPR_DOUBLE -o $@ $< -lm
build/asan/train-float: train.c $(HEADER) | build/asan
	$(SAN_C) -o $@ train.c -lm
build/asan/train-double: train.c $(HEADER) | build/asan
	$(SAN_C) -DPR_DOUBLE -o $@ train.c -lm
build/asan/test_attn_check: test/test_attn_check.c test/attn_check.h test/gpu_ref.c test/gpu_ref.h $(HEADER) $(TEST_H) | build/asan
	$(SAN_C) -o $@ test/test_attn_check.c test/gpu_ref.c -lm
build/asan/test_cxx: test/test_cxx.cc $(HEADER) $(TEST_H) | build/asan
	$(CXX) $(CXXWARN) $(SAN) -pthread $(LDFLAGS) -o $@ test/test_cxx.cc -lm
build/asan/test_attn_model-double: $(ATTN_MODEL) | build/asan
	$(SAN_C) -DPR_DOUBLE -o $@ test/test_attn_model.c test/attn_model.c -lm

build/asan/test_mma_emul: test/test_mma_emul.cc $(MMA_EMU_DEPS) | build/asan
	$(CXX) -std=c++17 -Wall -Wextra $(SAN) -o $@ test/test_mma_emul.cc
build/asan/test_cuda_emu: test/test_cuda_emu.cc test/cuda_emu.h test/nccl_emu.h $(MMA_EMU_DEPS) | build/asan
	$(CXX) -std=c++17 -Wall -Wextra $(SAN) -o $@ test/test_cuda_emu.cc
# train_cuda on the emulated device: the CUDA backend's host code and kernels under the sanitizers
build/asan/cuda_emu.o: test/cuda_emu.cc test/cuda_emu.h test/nccl_emu.h $(MMA_EMU_DEPS) $(HEADER) | build/asan
	$(CXX) -std=c++17 -Wall -Wextra $(SAN) -c -o $@ test/cuda_emu.cc
build/asan/train_cuda.o: train.c $(HEADER) | build/asan
	$(CC) $(WARN) $(SAN) -DPR_CUDA -c -o $@ train.c
build/asan/train_cuda-emu: build/asan/train_cuda.o build/asan/cuda_emu.o
	$(CXX) $(SAN) $(LDFLAGS) -o $@ $^ -lm
build/asan/%_host.o: test/%.c test/gpu_ref.h test/attn_model.h $(HEADER) | build/asan
	$(CC) $(WARN) $(SAN) -c -o $@ $<
build/asan/test_mma_kernels: test/test_mma_kernels.cc build/asan/gpu_ref_host.o build/asan/attn_model_host.o $(MMA_EMU_DEPS) | build/asan
	$(CXX) -std=c++17 -Wall -Wextra $(SAN) $(LDFLAGS) -o $@ test/test_mma_kernels.cc build/asan/gpu_ref_host.o build/asan/attn_model_host.o -lm

bench-gemm: | build
	$(CC) $(WARN) -O3 $(ARCH) $(OPENMP) -DPR_BENCH_CBLAS $(LDFLAGS) -o build/bench_gemm test/bench_gemm.c -lm -lopenblas
	./build/bench_gemm

# the CPU attention alone at model/small's head shapes over the bench's splits (train's flags: CC,
# PRECISION, CFLAGS)
bench-attention: build/bench_attention
	./build/bench_attention
build/bench_attention: test/bench_attention.c test/xorshift.h $(HEADER) | build
	$(CC) $(ALL_CFLAGS) $(LDFLAGS) -o $@ test/bench_attention.c $(LDLIBS)

FUZZ_SECONDS ?= 60
fuzz: train build/train-double build/train_faults-double | build
	clang $(WARN) -g -O1 -fsanitize=fuzzer,address,undefined $(LDFLAGS) -o build/fuzz_trace test/fuzz_trace.c -lm
	clang $(WARN) -g -O1 -fsanitize=fuzzer,address,undefined $(LDFLAGS) -o build/fuzz_safetensors test/fuzz_safetensors.c -lm
	clang $(WARN) -g -O1 -fsanitize=fuzzer,address,undefined $(LDFLAGS) -o build/fuzz_state test/fuzz_state.c -lm
	rm -rf build/fuzz_state.d && ./train --dp 2 --tp 2 --zero 2 --steps 1 --save-state build/fuzz_state.d > /dev/null
	mkdir -p build/corpus_trace build/corpus_st build/corpus_state
	{ printf '\000'; cat build/fuzz_state.d/step-*/state_index.json; } > build/corpus_state/index
	{ printf '\001'; cat build/fuzz_state.d/step-*/trainer_state.json; } > build/corpus_state/trainer
	cp data/sample.trace build/corpus_trace/
	$(PYTHON) -c "import sys; sys.path.insert(0, 'data'); import prtrace as p; g, v = p.read_trace('data/sample.trace'); p.write_trace('build/corpus_trace/sample-v2.trace', g, v, steps=[3, 1])"
	$(PYTHON) -c "import sys; sys.path.insert(0, 'data'); import prtrace as p; g, v = p.read_trace('data/multiturn.trace'); p.write_trace('build/corpus_trace/multiturn-2.trace', [g[0], g[3]], v)"
	for f in model/*/config.json; do { printf '\002'; cat $$f; } > build/corpus_st/config-$$(basename $$(dirname $$f)); done
	printf '\006\000\000\001\000\000\100\000\000\000\260\000\000\000\002\000\000\000\004\000\000\000\002\000\000\000\020\000\000\000\000\002\000\000\000\000\000\000\000\000\000\000\000\000\000\000' > build/corpus_st/sizes-tiny
	./build/fuzz_trace -max_len=4096 -max_total_time=$(FUZZ_SECONDS) build/corpus_trace
	./build/fuzz_safetensors -max_len=65536 -max_total_time=$(FUZZ_SECONDS) build/corpus_st
	FUZZ_STATE=build/fuzz_state.d ./build/fuzz_state -max_len=65536 -max_total_time=$(FUZZ_SECONDS) build/corpus_state
	$(PYTHON) test/fuzz_check.py --train build/train-double --seconds $(FUZZ_SECONDS)
	$(PYTHON) test/fuzz_check.py --resume --train build/train-double --seconds $(FUZZ_SECONDS)
	$(PYTHON) test/fuzz_check.py --faults --train build/train_faults-double --seconds $(FUZZ_SECONDS)

# CUDA: sm_90a machine code for H100/H200, plus compute_80 PTX that newer or older (>= sm_80)
# GPUs compile at load. train.c and the tests are C, compiled by $(CC) and linked by nvcc.
# NVTHREADS: nvcc compiles the two targets in parallel (0: as many threads as cores).
NVCC      ?= nvcc
NVTHREADS ?= 0
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=compute_80
NVCC_PATH := $(shell command -v $(NVCC) 2>/dev/null)
CUDA_HOME ?= $(patsubst %/bin/,%,$(dir $(NVCC_PATH)))
PYTHON    ?= python3

# NCCL, looked for in this order: NCCL_HOME if given (include/nccl.h, lib/); the CUDA toolkit's
# include dir; the nvidia-nccl wheel that PyTorch installs (Python package nvidia.nccl: include/nccl.h
# and lib/libnccl.so.2, no unversioned .so, linked by that name with an rpath). Without any, or with
# NCCL=0, prefixreuse_cuda.cu is compiled with -DPR_NO_NCCL (pr_comm_nccl_create then returns
# PR_ERR_UNSUPPORTED) and nothing links NCCL.
NCCL ?= 1
NCCL_PROBE = import nvidia.nccl as m, os; f = m.__file__; print(os.path.dirname(f) if f else next(iter(m.__path__)))
ifeq ($(NCCL),0)
  NCCL_FOUND := none (NCCL=0): built with -DPR_NO_NCCL
else ifneq ($(NCCL_HOME),)
  NCCL_FOUND := $(NCCL_HOME) (NCCL_HOME)
else ifneq ($(wildcard $(CUDA_HOME)/include/nccl.h),)
  NCCL_FOUND := $(CUDA_HOME)/include/nccl.h (CUDA toolkit)
  NCCL_TOOLKIT := 1
else
  NCCL_HOME := $(shell $(PYTHON) -c '$(NCCL_PROBE)' 2>/dev/null)
  ifneq ($(wildcard $(NCCL_HOME)/include/nccl.h),)
    NCCL_FOUND := $(NCCL_HOME) (PyTorch's nvidia-nccl wheel)
  else
    NCCL_HOME :=
    NCCL_FOUND := not found (no NCCL_HOME, no nccl.h in $(CUDA_HOME)/include, no nvidia.nccl for $(PYTHON)): built with -DPR_NO_NCCL
  endif
endif
ifeq ($(NCCL_TOOLKIT),1)
  NCCL_CFLAGS :=
  NCCL_LIBS   := -lnccl
else ifneq ($(NCCL_HOME),)
  NCCL_CFLAGS := -I$(NCCL_HOME)/include
  NCCL_LIBS   := -L$(NCCL_HOME)/lib $(if $(wildcard $(NCCL_HOME)/lib/libnccl.so),-lnccl,-l:libnccl.so.2) -Xlinker -rpath=$(NCCL_HOME)/lib
else
  NCCL_CFLAGS := -DPR_NO_NCCL
  NCCL_LIBS   :=
endif

NVFLAGS   := -O3 -std=c++17 $(CUDA_ARCH) --threads $(NVTHREADS) -Xcompiler -Wall,-Wextra -Werror all-warnings $(NCCL_CFLAGS)
CUDA_LIBS := -lcublasLt $(NCCL_LIBS)
# LDFLAGS as nvcc takes them: -Wl,X as -Xlinker X, -L and -l as they are, anything else through -Xcompiler.
comma     := ,
NV_LDFLAGS = $(foreach f,$(LDFLAGS),$(if $(filter -Wl$(comma)%,$(f)),-Xlinker $(patsubst -Wl$(comma)%,%,$(f)),$(if $(filter -L% -l%,$(f)),$(f),-Xcompiler $(f))))

cuda: train_cuda

# The flags the CUDA object was compiled with: changing NCCL, NVCC or CUDA_ARCH recompiles it.
build/cuda-flags: FORCE | build
	@echo '$(NVCC) $(NVFLAGS)' | cmp -s - $@ || echo '$(NVCC) $(NVFLAGS)' > $@
build/prefixreuse_cuda.o: prefixreuse_cuda.cu $(HEADER) build/cuda-flags | build
	$(NVCC) $(NVFLAGS) -c -o $@ prefixreuse_cuda.cu
# OpenMP for the host's own loops: drawing a Llama3-8B layer's 1.27B initial weights takes ~20 s on
# one core (pr_trainer_init_params gives the same bits on any number of threads). nvcc links with
# g++, whose -fopenmp is libgomp: a C compiler with another runtime (clang's libomp) builds
# train_cuda's host loops single-threaded.
CUDA_HOST_OPENMP := $(if $(OPENMP),$(shell $(CC) $(OPENMP) -### -x c /dev/null -o /dev/null 2>&1 | grep -q -e '-lgomp' && echo $(OPENMP)))
build/train_cuda.o: train.c $(HEADER) build/flags | build
	$(CC) $(WARN) $(CFLAGS) $(CUDA_HOST_OPENMP) -DPR_CUDA -c -o $@ train.c
train_cuda: build/train_cuda.o build/prefixreuse_cuda.o
	$(NVCC) $(CUDA_ARCH) $(NV_LDFLAGS) $(if $(CUDA_HOST_OPENMP),-Xcompiler $(CUDA_HOST_OPENMP)) -o $@ $^ $(CUDA_LIBS)

build/test_gpu: test/test_gpu.c test/attn_check.h test/gpu_copy.h test/gpu_ref.c test/gpu_ref.h build/prefixreuse_cuda.o $(HEADER) $(TEST_H) | build
	$(CC) $(WARN) $(CFLAGS) -c -o build/test_gpu.o test/test_gpu.c
	$(CC) $(WARN) $(CFLAGS) -c -o build/gpu_ref.o test/gpu_ref.c
	$(NVCC) $(CUDA_ARCH) $(NV_LDFLAGS) -o $@ build/test_gpu.o build/gpu_ref.o build/prefixreuse_cuda.o $(CUDA_LIBS)
build/compare_st: test/compare_st.c $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) $(LDFLAGS) -o $@ test/compare_st.c -lm

build/bench_cuda: bench/bench_cuda.c build/prefixreuse_cuda.o $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) -I$(CUDA_HOME)/include -c -o build/bench_cuda.o bench/bench_cuda.c
	$(NVCC) $(CUDA_ARCH) $(NV_LDFLAGS) -o $@ build/bench_cuda.o build/prefixreuse_cuda.o $(CUDA_LIBS)
bench-cuda: build/bench_cuda
	./build/bench_cuda

test-gpu: build/test_gpu train_cuda build/train-double build/compare_st
	@sh test/run_gpu.sh

# The attention kernels' resource use and instruction mix (no GPU needed): registers, spills,
# the count of each SASS opcode class per kernel, and each tensor-core kernel's inner loop
# (bench/sass_loops.py: instructions per HMMA).
CUOBJDUMP ?= cuobjdump
sass: build/prefixreuse_cuda.o
	$(CUOBJDUMP) -res-usage build/prefixreuse_cuda.o | grep -A1 attention
	$(CUOBJDUMP) -sass build/prefixreuse_cuda.o | python3 bench/sass_loops.py
	$(CUOBJDUMP) -sass build/prefixreuse_cuda.o | awk '/Function :/{f=$$3} /HMMA|HGMMA|FFMA|MUFU.EX2|LDS|STL|LDL/{split($$0,a,/ +/); for(i in a) if (a[i] ~ /^(HMMA|HGMMA|FFMA|MUFU|LDS|STL|LDL)/) {sub(/\..*/,"",a[i]); n[f" "a[i]]++}} END{for(k in n) print k, n[k]}' | sort

clean:
	rm -rf build train train_cuda

# The tensor-core attention kernels' SASS: HMMA (HGMMA) present, no local memory (needs cuobjdump
# and nvdisasm; says so and passes without them); and the wgmma kernels as ptxas -v reports them:
# no warpgroup instruction it had to inject or serialize (test/check_wgmma.sh, which compiles the
# CUDA file again: 15-20 s). A pass is kept in build/check-sass.log until the object or the checks
# change, so a second call on the same build prints it at once; a run without the tools is not kept.
.PHONY: check-sass
check-sass: build/check-sass.log
	@cat build/check-sass.log
	@if grep -q 'not checked' build/check-sass.log; then rm -f build/check-sass.log; fi
build/check-sass.log: build/prefixreuse_cuda.o test/check_sass.sh test/check_wgmma.sh
	@{ sh test/check_sass.sh build/prefixreuse_cuda.o && \
	   sh test/check_wgmma.sh "$(NVCC)" "-O3 -std=c++17 --threads $(NVTHREADS) $(NCCL_CFLAGS)"; } > $@.part 2>&1 || \
	 { cat $@.part; rm -f $@.part $@; exit 1; }
	@mv $@.part $@

# The tensor-core attention against the double CPU path and the FFMA kernels (needs a GPU).
.PHONY: test-gpu-attention
build/test_gpu_attention: test/test_gpu_attention.c test/gpu_copy.h test/gpu_ref.c test/gpu_ref.h test/attn_model.c test/attn_model.h build/prefixreuse_cuda.o $(HEADER) $(TEST_H) | build
	$(CC) $(WARN) $(CFLAGS) -c -o build/test_gpu_attention.o test/test_gpu_attention.c
	$(CC) $(WARN) $(CFLAGS) -c -o build/gpu_ref_attention.o test/gpu_ref.c
	$(CC) $(WARN) $(CFLAGS) -c -o build/attn_model_attention.o test/attn_model.c
	$(NVCC) $(CUDA_ARCH) $(NV_LDFLAGS) -o $@ build/test_gpu_attention.o build/gpu_ref_attention.o build/attn_model_attention.o build/prefixreuse_cuda.o $(CUDA_LIBS)
test-gpu-attention: build/test_gpu_attention
	./build/test_gpu_attention

# The CUDA backend on an emulated device (test/cuda_emu.cc; no GPU, no nvcc): prefixreuse_cuda.cu's
# host code and every kernel compiled for the host against an emulated CUDA runtime, cuBLASLt and
# device, linked into the GPU tests and train_cuda in place of the CUDA object, with an emulated NCCL
# between processes (test/nccl_emu.h). make test-gpu-emu runs test/run_gpu.sh (the GPU suite) and
# test/run_mesh_gpu.sh (train_cuda on meshes of processes) with them, against the CPU double build.
.PHONY: test-gpu-emu
EMU_CUDA = build/emu/prefixreuse_cuda.o
build/emu:
	mkdir -p build/emu
$(EMU_CUDA): test/cuda_emu.cc test/cuda_emu.h test/nccl_emu.h $(MMA_EMU_DEPS) $(HEADER) | build/emu
	$(CXX) -std=c++17 -Wall -Wextra $(CFLAGS) -c -o $@ test/cuda_emu.cc
# the emulated device's own rules, each shown by the failure it turns a mistake into
build/test_cuda_emu: test/test_cuda_emu.cc test/cuda_emu.h test/nccl_emu.h $(MMA_EMU_DEPS) | build
	$(CXX) -std=c++17 -Wall -Wextra $(CFLAGS) $(LDFLAGS) -o $@ test/test_cuda_emu.cc
build/emu/%.o: test/%.c $(HEADER) $(TEST_H) test/gpu_copy.h test/gpu_ref.h test/attn_check.h test/attn_model.h | build/emu
	$(CC) $(WARN) $(CFLAGS) -c -o $@ $<
build/emu/train_cuda: build/train_cuda.o $(EMU_CUDA)
	$(CXX) $(CFLAGS) $(CUDA_HOST_OPENMP) $(LDFLAGS) -o $@ $^ -lm
build/emu/test_gpu: build/emu/test_gpu.o build/emu/gpu_ref.o $(EMU_CUDA)
	$(CXX) $(CFLAGS) $(LDFLAGS) -o $@ $^ -lm
build/emu/test_gpu_attention: build/emu/test_gpu_attention.o build/emu/gpu_ref.o build/emu/attn_model.o $(EMU_CUDA)
	$(CXX) $(CFLAGS) $(LDFLAGS) -o $@ $^ -lm
test-gpu-emu: build/emu/test_gpu build/emu/train_cuda build/train-double build/compare_st
	@TRAIN_CUDA=build/emu/train_cuda TEST_GPU=build/emu/test_gpu sh test/run_gpu.sh
	@EMULATED_NCCL=1 TRAIN_CUDA=build/emu/train_cuda sh test/run_mesh_gpu.sh
# train_cuda on meshes of up to 4 processes, one a GPU (needs 4 GPUs and NCCL)
.PHONY: test-gpu-mesh
test-gpu-mesh: train_cuda build/train-double build/compare_st
	@sh test/run_mesh_gpu.sh
