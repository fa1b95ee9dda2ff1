/* test_cuda_emu.cc — the emulated device's own rules (test/cuda_emu.h), each shown by the wrong
   result it produces: the GPU suite on the emulated device (make test-gpu-emu) can only catch a
   missing synchronisation, a copy that runs past its allocation or a launch the hardware refuses
   because the emulation turns each into a visible failure, and this checks that it does. Every
   case runs a small program twice where it can, once with the synchronisation a real program
   needs and once without, and expects the second to go wrong. The emulated NCCL (test/nccl_emu.h)
   runs on three child processes: its sums must come out in rank order, bit for bit, its messages
   whole past a mailbox's size, and a mismatched receive must fault. Run in reverse order
   (PR_EMU_ORDER), two threads adding into one element must give other bits. */
#include "cuda_emu.h"
#include "nccl_emu.h"
#include <sys/wait.h>
#undef CHECK                                    /* cuda_emu.h's faults are done with; the harness's from here */
#include "harness.h"

static __global__ void k_fill(float *x, float v, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) x[i] = v;
}
static __global__ void k_copy(float *y, const float *x, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) y[i] = x[i];
}
/* every thread adds its own value into x[0], unsynchronised: the update a GPU can lose. The
   values' rounding in float depends on the order they land in. */
static __global__ void k_add_into_one(float *x) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    x[0] += i % 2 ? 1.0f : 1e-8f * (float)(i + 1);
}
/* each thread adds into its own element: one writer, any order the same bits */
static __global__ void k_add_own(float *x) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    x[i] += 1e-8f * (float)(i + 1);
}
/* thread 0 waits at a barrier the others never reach */
static __global__ void k_deadlock(int unused) {
    (void)unused;
    if (threadIdx.x == 0) __syncthreads();
}
/* the two warps wait at different barriers: each call site is a barrier of its own to CUDA */
static __global__ void k_split_barrier(int unused) {
    (void)unused;
    if (threadIdx.x < 32) __syncthreads();
    else __syncthreads();
}

enum { N = 64 };
static cudaStream_t compute, side;              /* created in this order: `side` is the one eager-side runs early */

/* the first fault of a case, cleared for the next: whether one was seen */
static bool fault_seen(void) {
    const bool seen = emu_sticky != 0;
    emu_sticky = 0, emu_errors = 0, emu_races = 0;
    (void)cudaGetLastError();
    return seen;
}

static void test_streams_run_late(float *a, float *pinned) {
    PR_LAUNCH(k_fill, 1, N, 0, compute, a, 1.0f, N);
    cudaMemcpyAsync(pinned, a, sizeof(float) * N, cudaMemcpyDeviceToHost, compute);
    CHECK(isnan(pinned[0]) && isnan(pinned[N - 1]), "a queued copy into pinned memory has not run before a wait: %g", pinned[0]);
    cudaStreamSynchronize(compute);
    CHECK(pinned[0] == 1 && pinned[N - 1] == 1, "after the stream's synchronisation, the kernel and the copy have run: %g", pinned[0]);

    float pageable[N];
    PR_LAUNCH(k_fill, 1, N, 0, compute, a, 2.0f, N);
    cudaMemcpyAsync(pageable, a, sizeof pageable, cudaMemcpyDeviceToHost, compute);
    CHECK(pageable[0] == 2 && pageable[N - 1] == 2, "a copy into pageable memory returns when done: %g", pageable[0]);

    PR_LAUNCH(k_fill, 1, N, 0, compute, a, 3.0f, N);
    cudaMemcpyAsync(pinned, a, sizeof(float) * N, cudaMemcpyDeviceToHost, compute);
    float *other;
    cudaMalloc((void **)&other, 16);
    cudaFree(other);
    CHECK(pinned[0] == 3, "cudaFree synchronises the device: %g", pinned[0]);
    CHECK(!fault_seen(), "no fault in the well-synchronised programs");
}

static void test_fresh_memory_is_nan(void) {
    float *fresh, *host, out[N];
    cudaMalloc((void **)&fresh, sizeof out);
    cudaMallocHost((void **)&host, sizeof out);
    cudaMemcpyAsync(out, fresh, sizeof out, cudaMemcpyDeviceToHost, compute);
    CHECK(isnan(out[0]) && isnan(out[N - 1]) && isnan(host[0]), "device and pinned memory start as NaN");
    cudaFree(fresh);
    cudaFreeHost(host);
}

/* a copy from pageable memory reads its source when called, one from pinned memory when it runs */
static void test_copy_sources(float *a, float *pinned) {
    float pageable[N], out[N];
    for (int i = 0; i < N; i++) pageable[i] = 4, pinned[i] = 4;
    cudaMemcpyAsync(a, pageable, sizeof pageable, cudaMemcpyHostToDevice, compute);
    pageable[0] = 5;
    cudaMemcpyAsync(out, a, sizeof out, cudaMemcpyDeviceToHost, compute);
    CHECK(out[0] == 4, "from pageable memory: the value at the call (%g)", out[0]);
    cudaMemcpyAsync(a, pinned, sizeof(float) * N, cudaMemcpyHostToDevice, compute);
    pinned[0] = 5;                              /* a host write racing the queued copy */
    cudaMemcpyAsync(out, a, sizeof out, cudaMemcpyDeviceToHost, compute);
    CHECK(out[0] == 5, "from pinned memory: the value when the copy runs (%g), so reusing the buffer early shows", out[0]);
}

/* the side stream waits for compute's work through an event, or sees it not done */
static void test_events_order_streams(float *a, float *pinned) {
    cudaEvent_t e;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    PR_LAUNCH(k_fill, 1, N, 0, compute, a, 6.0f, N);
    cudaEventRecord(e, compute);
    cudaStreamWaitEvent(side, e, 0);
    cudaMemcpyAsync(pinned, a, sizeof(float) * N, cudaMemcpyDeviceToHost, side);
    cudaStreamSynchronize(side);
    CHECK(pinned[0] == 6, "with the event: the side stream's copy sees compute's kernel (%g)", pinned[0]);

    PR_LAUNCH(k_fill, 1, N, 0, compute, a, 7.0f, N);
    cudaMemcpyAsync(pinned, a, sizeof(float) * N, cudaMemcpyDeviceToHost, side);
    cudaStreamSynchronize(side);
    CHECK(pinned[0] == 6, "without it: the copy reads what was there before compute's kernel (%g)", pinned[0]);
    cudaStreamSynchronize(compute);
    cudaEventDestroy(e);
}

/* compute reads `a` in a kernel queued after the side stream's copy into `a` was ordered behind
   the mark: the copy overwrites what compute still reads. Running late hides it (the copy runs
   when waited for, after the kernel); eager-side shows it. */
static int race_seen(float *a, float *b, float *pinned, int eager) {
    emu_eager_side = eager;
    float out[N];
    cudaEvent_t mark;
    cudaEventCreateWithFlags(&mark, cudaEventDisableTiming);
    PR_LAUNCH(k_fill, 1, N, 0, compute, a, 8.0f, N);
    cudaEventRecord(mark, compute);
    for (int i = 0; i < N; i++) pinned[i] = 9;
    cudaStreamWaitEvent(side, mark, 0);
    cudaMemcpyAsync(a, pinned, sizeof(float) * N, cudaMemcpyHostToDevice, side);
    PR_LAUNCH(k_copy, 1, N, 0, compute, b, (const float *)a, N);
    const bool kernel_pending = compute->done < compute->ops.size();
    cudaStreamSynchronize(compute);
    cudaStreamSynchronize(side);
    cudaMemcpyAsync(out, b, sizeof out, cudaMemcpyDeviceToHost, compute);
    cudaEventDestroy(mark);
    emu_eager_side = 0;
    CHECK(kernel_pending, "the side stream's work does not run compute's work queued after the mark");
    CHECK(out[0] == 8 || out[0] == 9, "the kernel read one of the two values (%g)", out[0]);
    return out[0] == 9;
}
static void test_schedules(float *a, float *b, float *pinned) {
    CHECK(!race_seen(a, b, pinned, 0), "late: the side stream's copy runs after the kernel");
    CHECK(race_seen(a, b, pinned, 1), "eager-side: the side stream's copy runs before the kernel, the race shows");
}

static void test_bounds(float *a) {
    float host[2 * N];
    CHECK(cudaMemcpyAsync(host, a, sizeof(float) * (N + 1), cudaMemcpyDeviceToHost, compute) == cudaErrorInvalidValue && fault_seen(),
          "a copy one element past its allocation");
    CHECK(cudaMemcpyAsync(a, host, sizeof(float) * N, cudaMemcpyDeviceToHost, compute) == cudaErrorInvalidValue && fault_seen(),
          "a copy whose kind names the wrong sides");
    CHECK(cudaMemsetAsync(a + 1, 0, sizeof(float) * N, compute) == cudaErrorInvalidValue && fault_seen(), "a memset past the end");
    CHECK(cudaMemsetAsync(host, 0, sizeof host, compute) == cudaErrorInvalidValue && fault_seen(), "a memset of host memory");
    cudaMemsetAsync(a + 1, 0, sizeof(float) * N, compute);
    CHECK(cudaMemsetAsync(a, 0, 4, compute) == cudaErrorLaunchFailure, "a fault is sticky: the next, correct call returns it");
    CHECK(fault_seen(), "and it was reported");
}

/* PR_EMU_ORDER=reverse: the blocks, warps and lanes of a launch in reverse order (the
   environment is read at each launch). Two writers of one element give other bits; one writer
   the same bits. */
static float run_ordered(bool reversed, float *a, bool one_writer) {
    setenv("PR_EMU_ORDER", reversed ? "reverse" : "forward", 1);
    const float zero[N] = { 0 };
    float out[N];
    cudaMemcpyAsync(a, zero, sizeof zero, cudaMemcpyHostToDevice, compute);
    if (one_writer) PR_LAUNCH(k_add_own, 2, N / 2, 0, compute, a);
    else PR_LAUNCH(k_add_into_one, 2, N / 2, 0, compute, a);
    cudaMemcpyAsync(out, a, sizeof out, cudaMemcpyDeviceToHost, compute);
    float s = 0;
    for (int i = 0; i < N; i++) s += out[i] * (float)(i + 1);
    return s;
}
static void test_order(float *a) {
    const float f = run_ordered(false, a, false), r = run_ordered(true, a, false);
    CHECK(f != r, "two threads adding into one element: forward and reverse order give other bits (%.9g, %.9g)", f, r);
    CHECK(run_ordered(false, a, true) == run_ordered(true, a, true), "one writer an element: the same bits in either order");
    unsetenv("PR_EMU_ORDER");
    CHECK(!fault_seen(), "no fault in the ordered launches");
}

static void test_launches(float *a) {
    float out[N];
    PR_LAUNCH(k_fill, 1, 48, 0, compute, a, 10.0f, N);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue, "a block of 48 threads is refused");
    PR_LAUNCH(k_fill, dim3(1, 65536), 64, 0, compute, a, 10.0f, N);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue, "a grid 65536 blocks high is refused");
    PR_LAUNCH(k_fill, 1, N, 64 << 10, compute, a, 10.0f, N);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue, "64 KiB of shared memory without the kernel's opt-in is refused");
    cudaMemcpyAsync(out, a, sizeof out, cudaMemcpyDeviceToHost, compute);
    CHECK(out[0] != 10, "no refused launch ran (%g)", out[0]);
    CHECK(cudaFuncSetAttribute(k_fill, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10) == cudaSuccess, "the opt-in");
    PR_LAUNCH(k_fill, 1, N, 64 << 10, compute, a, 10.0f, N);
    CHECK(cudaGetLastError() == cudaSuccess, "with the opt-in the launch is taken");
    cudaMemcpyAsync(out, a, sizeof out, cudaMemcpyDeviceToHost, compute);
    CHECK(out[0] == 10 && !fault_seen(), "and runs (%g)", out[0]);
    PR_LAUNCH(k_deadlock, 1, 64, 0, compute, 0);
    CHECK(cudaGetLastError() == cudaSuccess, "a faulting kernel launches");
    CHECK(cudaStreamSynchronize(compute) == cudaErrorLaunchFailure && fault_seen(), "its fault shows at the next wait");
    PR_LAUNCH(k_split_barrier, 1, 64, 0, compute, 0);
    CHECK(cudaStreamSynchronize(compute) == cudaErrorLaunchFailure && fault_seen(), "warps at different __syncthreads are a fault");
}

/* cuBLASLt: D (m x n, column-major) = op(A) op(B) + D, against a plain product, and its operands checked */
static void test_matmul(void) {
    enum { M = 5, K = 7, NC = 3 };
    float *A32;
    uint16_t *A, *B;
    float *D, hostD[M * NC];
    uint16_t hA[K * M], hB[K * NC];
    double ref[M * NC];
    for (int i = 0; i < K * M; i++) hA[i] = emu_bf16_bits(emu_round_bf16((i % 9) - 4));
    for (int i = 0; i < K * NC; i++) hB[i] = emu_bf16_bits(emu_round_bf16((i % 5) * 0.5));
    /* A stored K x M (op T gives M x K), B stored K x NC (op N) */
    for (int j = 0; j < NC; j++)
        for (int i = 0; i < M; i++) {
            double s = 1;                       /* D's initial value, accumulated onto */
            for (int p = 0; p < K; p++) s += bf16_value(hA[p + i * K]) * bf16_value(hB[p + j * K]);
            ref[i + j * M] = s;
        }
    cudaMalloc((void **)&A, sizeof hA + 2);
    cudaMalloc((void **)&B, sizeof hB);
    cudaMalloc((void **)&D, sizeof hostD);
    cudaMalloc((void **)&A32, 4);
    cudaMemcpyAsync(A, hA, sizeof hA, cudaMemcpyHostToDevice, compute);
    cudaMemcpyAsync(B, hB, sizeof hB, cudaMemcpyHostToDevice, compute);
    for (int i = 0; i < M * NC; i++) hostD[i] = 1;
    cudaMemcpyAsync(D, hostD, sizeof hostD, cudaMemcpyHostToDevice, compute);

    cublasLtHandle_t h;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulPreference_t pref;
    const cublasOperation_t T = CUBLAS_OP_T;
    const uint32_t align = 16;
    cublasLtCreate(&h);
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof T);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, M, K);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, NC, K);
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, M, NC, M);
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align, sizeof align);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &res, &found) == CUBLAS_STATUS_SUCCESS && found == 1,
          "an algorithm is found");
    const float one = 1;
    CHECK(cublasLtMatmul(h, desc, &one, A, la, B, lb, &one, D, ld, D, ld, &res.algo, NULL, 0, compute) == CUBLAS_STATUS_SUCCESS,
          "the product is queued");
    cudaMemcpyAsync(hostD, D, sizeof hostD, cudaMemcpyDeviceToHost, compute);
    double worst = 0;
    for (int i = 0; i < M * NC; i++) worst = fmax(worst, fabs(hostD[i] - ref[i]));
    CHECK(worst == 0, "op(A) = A^T: D = A^T B + D exactly (off by %g)", worst);

    CHECK(cublasLtMatmul(h, desc, &one, (const char *)A + 2, la, B, lb, &one, D, ld, D, ld, &res.algo, NULL, 0, compute) ==
                  CUBLAS_STATUS_INVALID_VALUE && fault_seen(),
          "A 2 bytes off the 16-byte alignment its algorithm was chosen for");
    CHECK(cublasLtMatmul(h, desc, &one, A, la, B, lb, &one, A32, ld, A32, ld, &res.algo, NULL, 0, compute) == CUBLAS_STATUS_INVALID_VALUE &&
                  fault_seen(),
          "D past its allocation");
    CHECK(cublasLtMatmul(h, desc, &one, A, la, B, lb, &one, D, ld, D, ld, &res.algo, D, 64, compute) == CUBLAS_STATUS_INVALID_VALUE &&
                  fault_seen(),
          "a workspace larger than the algorithm was chosen for");
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(h);
    cudaFree(A);
    cudaFree(B);
    cudaFree(D);
    cudaFree(A32);
}

/* ---------------------------------------------------------------- NCCL between processes */
enum { RANKS = 3, BIG = 40000 };               /* BIG floats: 156 KiB, past two mailboxes */

/* rank 0's values lie in [1, 2), the others' are 4e-8, under half of 1's spacing (2^-23): added to
   rank 0's one by one they vanish, added to each other first they do not, so any other order of
   the sum gives other bits */
static float value_at(int rank, size_t i) { return rank == 0 ? 1.0f + (float)(i % 977) * 0x1p-10f : 4e-8f; }

/* what a sum over the ranks must be: rank 0's value, plus rank 1's, plus rank 2's, rounded in turn */
static float sum_in_rank_order(size_t i) {
    float s = value_at(0, i);
    for (int r = 1; r < RANKS; r++) s += value_at(r, i);
    return s;
}

/* Rank 0 tells rank 1 through it when to receive (made before the ranks' processes). */
static int told[2];

/* One rank of the world `id`, in a child process: each collective the backend uses, sends that
   wait for their receives, a split, and a receive longer than its send, which must fault.
   Returns this rank's failed checks. */
static int nccl_rank(ncclUniqueId id, int rank) {
    if (rank != 0) close(told[1]);              /* so that rank 1's read ends if rank 0 does */
    if (rank != 1) close(told[0]);
    cudaStream_t s;
    ncclComm_t c, sub;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 2;
    CHECK(ncclCommInitRankConfig(&c, RANKS, id, rank, &config) == ncclInvalidArgument,
          "a configuration's blocking attribute other than 0 or 1 is refused, before joining, on rank %d", rank);
    config.blocking = 1;
    CHECK(ncclCommInitRankConfig(&c, RANKS, id, rank, &config) == ncclSuccess, "rank %d joins", rank);
    std::vector<float> host((size_t)RANKS * BIG);
    float *x, *y;
    cudaMalloc((void **)&x, sizeof(float) * RANKS * BIG);
    cudaMalloc((void **)&y, sizeof(float) * RANKS * BIG);

    for (size_t i = 0; i < BIG; i++) host[i] = value_at(rank, i);
    cudaMemcpyAsync(x, host.data(), sizeof(float) * BIG, cudaMemcpyHostToDevice, s);
    ncclAllReduce(x, x, BIG, ncclFloat32, ncclSum, c, s);
    cudaMemcpyAsync(host.data(), x, sizeof(float) * BIG, cudaMemcpyDeviceToHost, s);
    bool same = true;
    for (size_t i = 0; i < BIG; i++) same &= host[i] == sum_in_rank_order(i);
    CHECK(same, "all-reduce in place, past the mailbox's size: the sum in rank order, bit for bit, on rank %d", rank);

    for (size_t i = 0; i < BIG; i++) host[i] = value_at(rank, i);
    cudaMemcpyAsync(x + (size_t)rank * BIG, host.data(), sizeof(float) * BIG, cudaMemcpyHostToDevice, s);
    ncclAllGather(x + (size_t)rank * BIG, x, BIG, ncclFloat32, c, s);
    cudaMemcpyAsync(host.data(), x, sizeof(float) * RANKS * BIG, cudaMemcpyDeviceToHost, s);
    same = true;
    for (int q = 0; q < RANKS; q++)
        for (size_t i = 0; i < BIG; i++) same &= host[(size_t)q * BIG + i] == value_at(q, i);
    CHECK(same, "in-place all-gather: every rank's block in rank order, on rank %d", rank);

    for (int q = 0; q < RANKS; q++)                 /* block q goes to rank q: the sum there is q's */
        for (size_t i = 0; i < BIG; i++) host[(size_t)q * BIG + i] = value_at(rank, i + (size_t)q);
    cudaMemcpyAsync(x, host.data(), sizeof(float) * RANKS * BIG, cudaMemcpyHostToDevice, s);
    ncclReduceScatter(x, y, BIG, ncclFloat32, ncclSum, c, s);
    cudaMemcpyAsync(host.data(), y, sizeof(float) * BIG, cudaMemcpyDeviceToHost, s);
    same = true;
    for (size_t i = 0; i < BIG; i++) same &= host[i] == sum_in_rank_order(i + (size_t)rank);
    CHECK(same, "reduce-scatter: this rank's block of the sum, on rank %d", rank);

    for (int q = 0; q < RANKS; q++)                 /* an all-to-all as one group: block q to rank q */
        for (size_t i = 0; i < BIG; i++) host[(size_t)q * BIG + i] = (float)(rank * RANKS + q) + (float)i;
    cudaMemcpyAsync(x, host.data(), sizeof(float) * RANKS * BIG, cudaMemcpyHostToDevice, s);
    ncclGroupStart();
    for (int q = 0; q < RANKS; q++) {
        ncclSend(x + (size_t)q * BIG, BIG, ncclFloat32, q, c, s);
        ncclRecv(y + (size_t)q * BIG, BIG, ncclFloat32, q, c, s);
    }
    ncclGroupEnd();
    cudaMemcpyAsync(host.data(), y, sizeof(float) * RANKS * BIG, cudaMemcpyDeviceToHost, s);
    same = true;
    for (int q = 0; q < RANKS; q++)
        for (size_t i = 0; i < BIG; i++) same &= host[(size_t)q * BIG + i] == (float)(q * RANKS + rank) + (float)i;
    CHECK(same, "all-to-all of messages past the mailbox's size, sends and receives in one group, on rank %d", rank);

    if (rank == 0) {                                /* sends end with their receives, an empty one too */
        CHECK(ncclAllReduce(x, x, 0, ncclFloat32, ncclSum, c, s) == ncclSuccess && cudaStreamSynchronize(s) == cudaSuccess &&
                  !fault_seen(),
              "an empty all-reduce that only rank 0 calls is discarded: it ends at once");
        for (size_t i = 0; i < 4; i++) host[i] = (float)(i + 1);
        cudaMemcpyAsync(x, host.data(), sizeof(float) * 4, cudaMemcpyHostToDevice, s);
        ncclSend(x, 0, ncclFloat32, 1, c, s);
        const cudaError_t first = cudaStreamQuery(s);
        usleep(20000);
        const cudaError_t again = cudaStreamQuery(s);
        CHECK(first == cudaErrorNotReady && again == cudaErrorNotReady, "a send of 0 floats is not done before rank 1 receives it");
        ncclSend(x, 4, ncclFloat32, 1, c, s);
        CHECK(write(told[1], "x", 1) == 1, "rank 1 told to receive");
        CHECK(cudaStreamSynchronize(s) == cudaSuccess && !fault_seen(), "both sends end once rank 1 has received them");
        close(told[1]);
    } else if (rank == 1) {
        char byte = 0;
        const bool go = read(told[0], &byte, 1) == 1;
        close(told[0]);
        cudaMemsetAsync(y, 0, sizeof(float) * 4, s);
        ncclRecv(y, 0, ncclFloat32, 0, c, s);
        ncclRecv(y, 4, ncclFloat32, 0, c, s);
        cudaMemcpyAsync(host.data(), y, sizeof(float) * 4, cudaMemcpyDeviceToHost, s);
        cudaStreamSynchronize(s);
        CHECK(go && !fault_seen() && host[0] == 1.0f && host[3] == 4.0f,
              "rank 1 receives the empty message, then the 4 floats, in order");
    }

    int sub_rank = -1, sub_size = 0;                /* colour: rank parity; key: reversed */
    CHECK(ncclCommSplit(c, rank % 2, -rank, &sub, NULL) == ncclSuccess && ncclCommUserRank(sub, &sub_rank) == ncclSuccess &&
              ncclCommCount(sub, &sub_size) == ncclSuccess,
          "rank %d splits", rank);
    const int want_size = rank % 2 ? RANKS / 2 : (RANKS + 1) / 2, want_rank = (want_size - 1) - rank / 2;
    CHECK(sub_size == want_size && sub_rank == want_rank, "split by parity, ranked by key: rank %d is %d of %d, not %d of %d", rank,
          sub_rank, sub_size, want_rank, want_size);
    ncclCommDestroy(sub);

    CHECK(ncclCommSplit(c, 0, rank, &sub, NULL) == ncclSuccess, "rank %d splits again", rank);
    if (rank == 0) {                                /* a receive whose sender never sends: not ready, until aborted */
        for (size_t i = 0; i < 4; i++) host[i] = 7.0f;
        cudaMemcpyAsync(y, host.data(), sizeof(float) * 4, cudaMemcpyHostToDevice, s);
        ncclRecv(y, 4, ncclFloat32, 1, sub, s);
        const cudaError_t first = cudaStreamQuery(s);
        usleep(20000);
        const cudaError_t again = cudaStreamQuery(s);
        ncclResult_t async = ncclInternalError;
        CHECK(first == cudaErrorNotReady && again == cudaErrorNotReady && ncclCommGetAsyncError(sub, &async) == ncclSuccess &&
                  async == ncclSuccess,
              "a receive from a rank that never sends leaves its stream not ready, nothing reported");
        CHECK(ncclCommAbort(sub) == ncclSuccess && cudaStreamQuery(s) == cudaSuccess && !fault_seen(),
              "aborting its communicator ends the receive: the stream is done, no fault");
        cudaMemcpyAsync(host.data(), y, sizeof(float) * 4, cudaMemcpyDeviceToHost, s);
        CHECK(host[0] == 7.0f && host[3] == 7.0f, "the aborted receive left its buffer as it was");
    } else
        ncclCommDestroy(sub);

    CHECK(ncclAllReduce(host.data(), host.data(), 4, ncclFloat32, ncclSum, c, s) == ncclInvalidArgument && !fault_seen(),
          "a buffer outside the device's allocations is refused, the context unharmed, on rank %d", rank);
    /* overlapping buffers other than in place (NCCL does not check, and works through them as they lie) */
    CHECK(ncclAllReduce(x, x + 1, 4, ncclFloat32, ncclSum, c, s) == ncclInvalidArgument &&
              ncclAllGather(x, x + 1, 4, ncclFloat32, c, s) == ncclInvalidArgument &&
              ncclReduceScatter(x + 1, x, 4, ncclFloat32, ncclSum, c, s) == ncclInvalidArgument &&
              !fault_seen(),
          "a collective's send and receive buffers overlapping other than in place are refused, on rank %d", rank);
    if (rank == 0) {                                /* last: a message of 4 floats, a receive of 8; the box stays full */
        ncclSend(x, 4, ncclFloat32, 1, c, s);
        CHECK(cudaStreamQuery(s) == cudaErrorNotReady, "a send its receive never takes is not done");
        CHECK(ncclCommAbort(c) == ncclSuccess && cudaStreamQuery(s) == cudaSuccess && !fault_seen(),
              "aborting ends the send, no fault on the sending rank");
    } else if (rank == 1) {
        ncclRecv(y, 8, ncclFloat32, 0, c, s);
        cudaStreamSynchronize(s);
        CHECK(fault_seen(), "4 floats sent into a receive of 8 fault on the receiving rank");
    }
    if (rank != 0) ncclCommDestroy(c);
    cudaFree(x);
    cudaFree(y);
    cudaStreamDestroy(s);
    return test_failed;
}

/* A unique id for a world of two, and a pipe from rank 0 to its peer, made before the peer's fork
   (the output flushed, so that the child does not print it again). */
static void two_ranks(ncclUniqueId *id, int go[2]) {
    CHECK(ncclGetUniqueId(id) == ncclSuccess, "a unique id for two");
    fflush(stdout);
    fflush(stderr);
    CHECK(pipe(go) == 0, "a pipe");
}

/* ncclCommGetAsyncError's verdict on c once it no longer says ncclInProgress (10 s at most); how
   many looks said ncclInProgress in *looks. */
static ncclResult_t settled(ncclComm_t c, int *looks) {
    ncclResult_t async = ncclInProgress;
    *looks = 0;
    for (int k = 0; k < 100000 && async == ncclInProgress; k++) {
        if (ncclCommGetAsyncError(c, &async) != ncclSuccess) return ncclInternalError;
        if (async == ncclInProgress) ++*looks, usleep(100);
    }
    return async;
}

/* Whether every look at c for 0.3 s says ncclInProgress: a wait for a peer that does not come. */
static bool stays_in_progress(ncclComm_t c) {
    for (int k = 0; k < 30; k++) {
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(c, &async) != ncclSuccess || async != ncclInProgress) return false;
        usleep(10000);
    }
    return true;
}

/* One rank of a world of two non-blocking communicators: the init, a call refused while the init
   is in progress, an all-reduce that reaches the stream only once the communicator has said
   ncclSuccess (a wait for the stream before that is a fault), a destroy refused while a call is
   in progress, and splits into a blocking communicator and, with no configuration, into a
   non-blocking one like its parent. Returns this rank's failed checks. */
static int nonblocking_rank(ncclUniqueId id, int rank) {
    cudaStream_t s;
    ncclComm_t c = NULL, sub = NULL;
    float *x;
    float host[4];
    int looks = 0;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaMalloc((void **)&x, sizeof host);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    CHECK(ncclCommInitRankConfig(&c, 2, id, rank, &config) == ncclInProgress && c, "rank %d's non-blocking init returns at once", rank);
    if (!c) return test_failed;
    CHECK(ncclAllReduce(x, x, 4, ncclFloat32, ncclSum, c, s) == ncclInvalidArgument,
          "rank %d: a call while the init is in progress is refused", rank);
    CHECK(settled(c, &looks) == ncclSuccess, "rank %d: the init ends once both ranks have come", rank);

    for (int i = 0; i < 4; i++) host[i] = (float)(rank + 1);
    cudaMemcpyAsync(x, host, sizeof host, cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);
    CHECK(ncclAllReduce(x, x, 4, ncclFloat32, ncclSum, c, s) == ncclInProgress, "rank %d: an all-reduce returns in progress", rank);
    CHECK(ncclCommDestroy(c) == ncclInvalidArgument, "rank %d: a destroy while a call is in progress is refused", rank);
    cudaStreamSynchronize(s);
    CHECK(fault_seen(), "rank %d: a wait for the stream before the communicator has said the call is queued is a fault (on a GPU "
          "it would end without the call's operation)", rank);
    CHECK(settled(c, &looks) == ncclSuccess && looks == 1, "rank %d: the call is queued at the second look (%d said in progress)",
          rank, looks);
    cudaStreamSynchronize(s);
    cudaMemcpyAsync(host, x, sizeof host, cudaMemcpyDeviceToHost, s);
    CHECK(host[0] == 3.0f && host[3] == 3.0f, "rank %d: then the stream holds the sum (%g)", rank, host[0]);

    config.blocking = 1;
    CHECK(ncclCommSplit(c, 0, rank, &sub, &config) == ncclSuccess && !sub, "rank %d: a split of it returns at once, no communicator yet",
          rank);
    CHECK(settled(c, &looks) == ncclSuccess && sub, "rank %d: the split ends with its communicator", rank);
    if (sub) {
        CHECK(ncclAllReduce(x, x, 4, ncclFloat32, ncclSum, sub, s) == ncclSuccess && cudaStreamSynchronize(s) == cudaSuccess,
              "rank %d: the split made a blocking communicator, as configured", rank);
        cudaMemcpyAsync(host, x, sizeof host, cudaMemcpyDeviceToHost, s);
        CHECK(host[0] == 6.0f, "rank %d: its sum (%g)", rank, host[0]);
        ncclCommDestroy(sub);
    }
    sub = NULL;
    CHECK(ncclCommSplit(c, 0, rank, &sub, NULL) == ncclSuccess && settled(c, &looks) == ncclSuccess && sub,
          "rank %d: a split with no configuration", rank);
    if (sub) {
        CHECK(ncclAllReduce(x, x, 4, ncclFloat32, ncclSum, sub, s) == ncclInProgress && settled(sub, &looks) == ncclSuccess,
              "rank %d: made a non-blocking communicator, as its parent is", rank);
        ncclCommDestroy(sub);
    }
    CHECK(ncclCommDestroy(c) == ncclSuccess, "rank %d: destroyed once idle", rank);
    cudaFree(x);
    cudaStreamDestroy(s);
    return test_failed;
}

static void test_nccl_nonblocking(void) {
    ncclUniqueId id;
    CHECK(ncclGetUniqueId(&id) == ncclSuccess, "a unique id for two non-blocking ranks");
    fflush(stdout);
    fflush(stderr);
    pid_t child[2];
    for (int r = 0; r < 2; r++)
        if ((child[r] = fork()) == 0) {
            const int failures = nonblocking_rank(id, r);
            fflush(stdout);
            _exit(failures ? 1 : 0);
        }
    for (int r = 0; r < 2; r++) {
        int status = 0;
        CHECK(child[r] > 0 && waitpid(child[r], &status, 0) == child[r] && WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "non-blocking rank %d's process passed its checks (its failures are printed above)", r);
    }
}

/* A non-blocking init whose peer never comes stays in progress, with no limit of its own, until
   aborted, and the abort leaves no segment behind; NCCL_COMM_BLOCKING=0 makes a configuration's
   blocking communicator a non-blocking one. */
static void test_nccl_missing_rank(void) {
    ncclUniqueId id;
    ncclComm_t c = NULL;
    CHECK(ncclGetUniqueId(&id) == ncclSuccess, "a unique id for two");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    CHECK(ncclCommInitRankConfig(&c, 2, id, 0, &config) == ncclInProgress && c, "rank 0 of two: its init returns at once");
    if (!c) return;
    CHECK(stays_in_progress(c), "without rank 1, the init stays in progress");
    CHECK(ncclCommAbort(c) == ncclSuccess, "the abort ends it");
    const int fd = shm_open(id.internal, O_RDWR, 0600);
    CHECK(fd < 0, "the aborted init left no segment behind");
    if (fd >= 0) close(fd);

    CHECK(ncclGetUniqueId(&id) == ncclSuccess, "a unique id for one");
    setenv("NCCL_COMM_BLOCKING", "0", 1);
    config.blocking = 1;
    int looks = 0;
    CHECK(ncclCommInitRankConfig(&c, 1, id, 0, &config) == ncclInProgress && settled(c, &looks) == ncclSuccess,
          "NCCL_COMM_BLOCKING=0 overrides the configuration's blocking");
    unsetenv("NCCL_COMM_BLOCKING");
    ncclCommDestroy(c);
}

/* A split of a non-blocking parent that its peer never joins stays in progress until the parent
   is aborted; then, as NCCL's thread does at its end, *newcomm holds what the split was making,
   reporting the failure, for the caller to abort. */
static void test_nccl_split_abandoned(void) {
    ncclUniqueId id;
    int go[2];
    two_ranks(&id, go);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    int looks = 0;
    const pid_t peer = fork();
    if (peer == 0) {                                /* rank 1: joins, never splits, ends when told */
        ncclComm_t c = NULL;
        char byte;
        close(go[1]);
        bool ok = ncclCommInitRankConfig(&c, 2, id, 1, &config) == ncclInProgress && settled(c, &looks) == ncclSuccess;
        ok = read(go[0], &byte, 1) == 1 && ok;
        if (c) ncclCommDestroy(c);
        _exit(ok ? 0 : 1);
    }
    close(go[0]);
    ncclComm_t c = NULL, sub = NULL;
    CHECK(ncclCommInitRankConfig(&c, 2, id, 0, &config) == ncclInProgress && settled(c, &looks) == ncclSuccess, "rank 0 of two joins");
    CHECK(c && ncclCommSplit(c, 0, 0, &sub, NULL) == ncclSuccess && !sub, "rank 0 splits alone");
    CHECK(c && stays_in_progress(c) && !sub, "the split waits for rank 1");
    CHECK(ncclCommAbort(c) == ncclSuccess && sub, "the parent's abort ends it, and sets the new communicator");
    ncclResult_t async = ncclSuccess;
    CHECK(sub && ncclCommGetAsyncError(sub, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress,
          "which reports the failure (%s)", ncclGetErrorString(async));
    if (sub) CHECK(ncclCommAbort(sub) == ncclSuccess, "and is aborted");
    CHECK(write(go[1], "x", 1) == 1, "rank 1 told to end");
    close(go[1]);
    int status = 0;
    CHECK(waitpid(peer, &status, 0) == peer && WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank 1 joined, then ended");
}

/* A world of two whose rank 1 ends without destroying its communicator (as a killed rank does),
   left a zombie until the parent reaps it: rank 0's receive from it stays not ready, and
   ncclCommGetAsyncError reports ncclRemoteError within a few looks. */
static void test_nccl_ended_peer(void) {
    ncclUniqueId id;
    int go[2];
    two_ranks(&id, go);
    const pid_t peer = fork();
    if (peer == 0) {                                /* joins, waits for rank 0's first look, ends */
        ncclComm_t c;
        char byte;
        close(go[1]);                               /* so that the read ends if rank 0 does */
        const bool joined = ncclCommInitRank(&c, 2, id, 1) == ncclSuccess;
        _exit(joined && read(go[0], &byte, 1) == 1 ? 0 : 1);
    }
    cudaStream_t s;
    ncclComm_t c;
    float *y;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaMalloc((void **)&y, sizeof(float) * 4);
    CHECK(ncclCommInitRank(&c, 2, id, 0) == ncclSuccess, "rank 0 of two joins");
    ncclResult_t async = ncclInternalError;
    CHECK(ncclCommGetAsyncError(c, &async) == ncclSuccess && async == ncclSuccess, "nothing reported while both are there");
    CHECK(write(go[1], "x", 1) == 1, "rank 1 told to end");
    close(go[0]);
    close(go[1]);
    ncclRecv(y, 4, ncclFloat32, 1, c, s);
    bool not_ready = true, asked = true;
    for (int look = 0; look < 1000 && async == ncclSuccess; look++) {   /* 10 s at most */
        not_ready &= cudaStreamQuery(s) == cudaErrorNotReady;
        usleep(10000);
        asked &= ncclCommGetAsyncError(c, &async) == ncclSuccess;
    }
    cudaGetLastError();
    CHECK(asked && not_ready && async == ncclRemoteError, "a peer whose process ended is reported (%s), its message never comes",
          ncclGetErrorString(async));
    CHECK(ncclCommAbort(c) == ncclSuccess && cudaStreamQuery(s) == cudaSuccess && !fault_seen(), "aborting ends the receive");
    int status = 0;
    CHECK(waitpid(peer, &status, 0) == peer && WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank 1 joined, then ended");
    cudaFree(y);
    cudaStreamDestroy(s);
}

static void test_nccl(void) {
    ncclUniqueId id;
    CHECK(ncclGetUniqueId(&id) == ncclSuccess, "a unique id");
    fflush(stdout);
    fflush(stderr);
    pid_t child[RANKS];
    CHECK(pipe(told) == 0, "a pipe from rank 0 to rank 1");
    for (int r = 0; r < RANKS; r++)
        if ((child[r] = fork()) == 0) {
            const int failures = nccl_rank(id, r);
            fflush(stdout);
            _exit(failures ? 1 : 0);
        }
    close(told[0]);
    close(told[1]);
    for (int r = 0; r < RANKS; r++) {
        int status = 0;
        CHECK(child[r] > 0 && waitpid(child[r], &status, 0) == child[r] && WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "rank %d's process passed its checks (its failures are printed above)", r);
    }
    const int fd = shm_open(id.internal, O_RDWR, 0600);
    CHECK(fd < 0, "the world's shared segment is gone once every rank joined");
    if (fd >= 0) close(fd);
}

int main(void) {
    emu_eager_side = 0;                         /* the environment does not choose for this test */
    unsetenv("NCCL_COMM_BLOCKING");             /* nor which communicators block */
    cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
    float *a, *b, *pinned;
    cudaMalloc((void **)&a, sizeof(float) * N);
    cudaMalloc((void **)&b, sizeof(float) * N);
    cudaMallocHost((void **)&pinned, sizeof(float) * N);
    emu_quiet = true;                           /* the faults below are planted: checked, not reported */
    test_streams_run_late(a, pinned);
    test_fresh_memory_is_nan();
    test_copy_sources(a, pinned);
    test_events_order_streams(a, pinned);
    test_schedules(a, b, pinned);
    test_bounds(a);
    test_launches(a);
    test_order(a);
    test_matmul();
    test_nccl();
    test_nccl_ended_peer();
    test_nccl_nonblocking();
    test_nccl_missing_rank();
    test_nccl_split_abandoned();
    cudaFree(a);
    cudaFree(b);
    cudaFreeHost(pinned);
    cudaStreamDestroy(side);
    cudaStreamDestroy(compute);
    CHECK(emu_allocs.empty() && emu_device_bytes == 0, "every allocation released");
    return test_report();
}
