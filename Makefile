# prefixreuse — `make` builds ./train; `make test` runs every CPU test (last line: N passed, N failed).
#   make PRECISION=double    every real number in double (exact-equivalence checks)
#   make BLAS=1              GEMMs through the system CBLAS (Debian: libopenblas-dev)
#   make OMP=0               without OpenMP
#   make NATIVE=0            without -march=native
#   make asan                the test suite under AddressSanitizer + UBSan
#   make bench-gemm          the header's GEMM beside OpenBLAS on the model's shapes
#   make fuzz                the trace and safetensors/config parsers under libFuzzer (clang)
#   make cuda                ./train_cuda: the same driver on the CUDA backend (nvcc, cuBLASLt)
#   make test-gpu            the GPU tests (needs a GPU; last line: N passed, N failed)
#   make bench-cuda          the CUDA GEMMs beside cuBLASLt's best, and attention TFLOP/s (needs a GPU)

CC      ?= cc
CFLAGS  ?= -O2
WARN    := -std=c11 -Wall -Wextra
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

.PHONY: all test asan bench-gemm bench-cuda fuzz clean info cuda test-gpu sass FORCE

all: train

info:
	@echo "cc $(CC); precision $(PRECISION); openmp '$(OPENMP)'; arch '$(ARCH)'; blas $(BLAS)"

# The flags ./train was built with: changing PRECISION, BLAS, OMP or CC rebuilds it.
build/flags: FORCE | build
	@echo '$(CC) $(ALL_CFLAGS) $(LDLIBS)' | cmp -s - $@ || echo '$(CC) $(ALL_CFLAGS) $(LDLIBS)' > $@
FORCE:

train: train.c $(HEADER) build/flags
	$(CC) $(ALL_CFLAGS) -o $@ train.c $(LDLIBS)

# The suite: the core tests in both precisions, the parsers' tests, and ./train --check in both.
build/%-float: test/%.c $(HEADER) test/harness.h | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) -o $@ $< -lm
build/%-double: test/%.c $(HEADER) test/harness.h | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) -DPR_DOUBLE -o $@ $< -lm
build/train-float: train.c $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) -o $@ train.c -lm
build/train-double: train.c $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) $(ARCH) $(OPENMP) -DPR_DOUBLE -o $@ train.c -lm
build:
	mkdir -p build

TEST_BINS = build/test_core-float build/test_core-double build/test_gemm-float build/test_gemm-double \
            build/test_io-float build/test_io-double build/test_trace-float build/test_trace-double \
            build/test_comm-float build/test_comm-double \
            build/train-float build/train-double build/test_mma_emul build/test_mma_kernels

# The tensor-core attention on the host (C++17, no GPU): its warp-level rules through an emulation
# of ldmatrix and mma.sync (test_mma_emul), and its kernels on an emulated block against the double
# CPU attention (test_mma_kernels; prefixreuse_cuda.cu compiled with PR_CUDA_HOST_EMULATION).
CXX ?= c++
MMA_EMU_DEPS = prefixreuse_cuda.cu test/mma_emu.h test/harness.h
build/test_mma_emul: test/test_mma_emul.cc $(MMA_EMU_DEPS) | build
	$(CXX) -std=c++17 -Wall -Wextra $(CFLAGS) -o $@ test/test_mma_emul.cc
build/gpu_ref_host.o: test/gpu_ref.c test/gpu_ref.h $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) -c -o $@ test/gpu_ref.c
build/test_mma_kernels: test/test_mma_kernels.cc build/gpu_ref_host.o test/gpu_ref.h $(MMA_EMU_DEPS) | build
	$(CXX) -std=c++17 -Wall -Wextra $(CFLAGS) -o $@ test/test_mma_kernels.cc build/gpu_ref_host.o -lm

test: $(TEST_BINS)
	@sh test/run.sh build

SAN = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
asan: | build
	$(MAKE) --no-print-directory BUILD_SAN=1 build/asan build/asan/test_mma_emul build/asan/test_mma_kernels
	@sh test/run.sh build/asan

build/asan: $(HEADER) test/*.c train.c
	mkdir -p build/asan
	for p in float double; do d=; [ $$p = double ] && d=-DPR_DOUBLE; \
	  for t in test_core test_gemm test_io test_trace test_comm; do \
	    $(CC) $(WARN) -O1 -g $(SAN) $$d -o build/asan/$$t-$$p test/$$t.c -lm || exit 1; done; \
	  $(CC) $(WARN) -O1 -g $(SAN) $$d -o build/asan/train-$$p train.c -lm || exit 1; done
	touch build/asan

build/asan/test_mma_emul: test/test_mma_emul.cc $(MMA_EMU_DEPS) build/asan
	$(CXX) -std=c++17 -Wall -Wextra -O1 -g $(SAN) -o $@ test/test_mma_emul.cc
build/asan/test_mma_kernels: test/test_mma_kernels.cc test/gpu_ref.c test/gpu_ref.h $(MMA_EMU_DEPS) build/asan
	$(CC) $(WARN) -O1 -g $(SAN) -c -o build/asan/gpu_ref_host.o test/gpu_ref.c
	$(CXX) -std=c++17 -Wall -Wextra -O1 -g $(SAN) -o $@ test/test_mma_kernels.cc build/asan/gpu_ref_host.o -lm

bench-gemm: | build
	$(CC) $(WARN) -O3 $(ARCH) $(OPENMP) -DPR_BENCH_CBLAS -o build/bench_gemm test/bench_gemm.c -lm -lopenblas
	./build/bench_gemm

FUZZ_SECONDS ?= 60
fuzz: | build
	clang $(WARN) -g -O1 -fsanitize=fuzzer,address,undefined -o build/fuzz_trace test/fuzz_trace.c -lm
	clang $(WARN) -g -O1 -fsanitize=fuzzer,address,undefined -o build/fuzz_safetensors test/fuzz_safetensors.c -lm
	mkdir -p build/corpus_trace build/corpus_st
	cp data/sample.trace build/corpus_trace/
	./build/fuzz_trace -max_len=4096 -max_total_time=$(FUZZ_SECONDS) build/corpus_trace
	./build/fuzz_safetensors -max_len=65536 -max_total_time=$(FUZZ_SECONDS) build/corpus_st

# CUDA: sm_90a machine code for H100/H200, plus compute_80 PTX that newer or older (>= sm_80)
# GPUs compile at load. train.c and the tests are C, compiled by $(CC) and linked by nvcc.
NVCC      ?= nvcc
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=compute_80
NVFLAGS   := -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -Wall,-Wextra -Werror all-warnings
CUDA_LIBS := -lcublasLt -lnccl

cuda: train_cuda

build/prefixreuse_cuda.o: prefixreuse_cuda.cu $(HEADER) | build
	$(NVCC) $(NVFLAGS) -c -o $@ prefixreuse_cuda.cu
build/train_cuda.o: train.c $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) -DPR_CUDA -c -o $@ train.c
train_cuda: build/train_cuda.o build/prefixreuse_cuda.o
	$(NVCC) $(CUDA_ARCH) -o $@ $^ $(CUDA_LIBS)

build/test_gpu: test/test_gpu.c test/gpu_ref.c test/gpu_ref.h build/prefixreuse_cuda.o $(HEADER) test/harness.h | build
	$(CC) $(WARN) $(CFLAGS) -c -o build/test_gpu.o test/test_gpu.c
	$(CC) $(WARN) $(CFLAGS) -c -o build/gpu_ref.o test/gpu_ref.c
	$(NVCC) $(CUDA_ARCH) -o $@ build/test_gpu.o build/gpu_ref.o build/prefixreuse_cuda.o $(CUDA_LIBS)
build/compare_st: test/compare_st.c $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) -o $@ test/compare_st.c -lm

CUDA_HOME ?= $(patsubst %/bin/,%,$(dir $(shell command -v $(NVCC))))
build/bench_cuda: bench/bench_cuda.c build/prefixreuse_cuda.o $(HEADER) | build
	$(CC) $(WARN) $(CFLAGS) -I$(CUDA_HOME)/include -c -o build/bench_cuda.o bench/bench_cuda.c
	$(NVCC) $(CUDA_ARCH) -o $@ build/bench_cuda.o build/prefixreuse_cuda.o $(CUDA_LIBS)
bench-cuda: build/bench_cuda
	./build/bench_cuda

test-gpu: build/test_gpu train_cuda build/train-double build/compare_st
	@sh test/run_gpu.sh

# The attention kernels' resource use and instruction mix (no GPU needed): registers, spills,
# and the count of each SASS opcode class per kernel.
CUOBJDUMP ?= cuobjdump
sass: build/prefixreuse_cuda.o
	$(CUOBJDUMP) -res-usage build/prefixreuse_cuda.o | grep -A1 attention
	$(CUOBJDUMP) -sass build/prefixreuse_cuda.o | awk '/Function :/{f=$$3} /HMMA|HGMMA|FFMA|MUFU.EX2|LDS|STL|LDL/{split($$0,a,/ +/); for(i in a) if (a[i] ~ /^(HMMA|HGMMA|FFMA|MUFU|LDS|STL|LDL)/) {sub(/\..*/,"",a[i]); n[f" "a[i]]++}} END{for(k in n) print k, n[k]}' | sort

clean:
	rm -rf build train train_cuda

# The tensor-core attention kernels' SASS: HMMA present, no local memory (needs cuobjdump and
# nvdisasm; says so and passes without them).
.PHONY: check-sass
check-sass: build/prefixreuse_cuda.o
	@sh test/check_sass.sh build/prefixreuse_cuda.o

# The tensor-core attention against the double CPU path and the FFMA kernels (needs a GPU).
.PHONY: test-gpu-attention
build/test_gpu_attention: test/test_gpu_attention.c test/gpu_ref.c test/gpu_ref.h build/prefixreuse_cuda.o $(HEADER) test/harness.h | build
	$(CC) $(WARN) $(CFLAGS) -c -o build/test_gpu_attention.o test/test_gpu_attention.c
	$(CC) $(WARN) $(CFLAGS) -c -o build/gpu_ref_attention.o test/gpu_ref.c
	$(NVCC) $(CUDA_ARCH) -o $@ build/test_gpu_attention.o build/gpu_ref_attention.o build/prefixreuse_cuda.o $(CUDA_LIBS)
test-gpu-attention: build/test_gpu_attention
	./build/test_gpu_attention
