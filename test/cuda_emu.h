/* cuda_emu.h — an emulated CUDA runtime, cuBLASLt and device, on the host. test/cuda_emu.cc
   compiles prefixreuse_cuda.cu (PR_CUDA_DEVICE_EMULATION) against it, so that the
   GPU tests (test/test_gpu.c, test/test_gpu_attention.c, test/run_gpu.sh) and train_cuda run on
   the CPU: `make test-gpu-emu`. Linked in place of the real backend object, that build checks what the
   kernel emulation alone (test/test_mma_kernels.cc) cannot: the backend's host code (sizes,
   offsets, launch geometry, the staging ring, the cuBLASLt layouts and transposes, offload's
   copies and events) and every small kernel, all against the CPU double build.

   The device, as the CUDA documentation defines it and no more:
     - streams run their work in issue order, and as late as allowed: queued work runs only when
       something waits for it (cudaStreamSynchronize, an event a later operation waits on, a copy
       into pageable host memory, cudaFree and cudaFreeHost, which synchronise the device). A
       missing synchronisation then shows as a wrong or NaN result, not as a lucky race.
       PR_EMU_SCHEDULE=eager-side in the environment runs the other extreme for every stream but
       the first created (the backend's compute stream): each operation as soon as it is queued,
       after the work it waits for. That catches what running late cannot: a side stream's copy
       overwriting what compute queued before it still reads, or one that waits for nothing;
     - a copy from pageable host memory reads its source when called (the runtime stages it), one
       from pinned memory (cudaMallocHost) when it runs; a copy into pageable memory returns when
       done. Copies and memsets must stay inside the allocations their kind names;
     - device and pinned memory start as NaN bytes (what initcheck would flag shows as NaN), or,
       with PR_EMU_UNDEFINED=1 in the environment, device memory is left as malloc gives it, so
       that valgrind's memcheck does initcheck's work: a result that depends on a device byte no
       copy, memset, kernel or GEMM wrote is reported where it is used, with its origin
       (`valgrind --track-origins=yes`; build with -DEMU_UCONTEXT, whose stack switches valgrind
       follows);
     - kernels run on test/gpu_emu.h's emulated block, one block after another (blocks, warps and
       lanes in reverse order with PR_EMU_ORDER=reverse: a result that depends on the order, such
       as two threads adding into one element, then changes), with its checks
       (warp-collective instructions, barriers, races in shared memory); launch geometry and
       dynamic shared memory are checked against an H100's limits and each kernel's opt-in;
     - cuBLASLt: D = alpha op(A) op(B) + beta C, column-major, bf16 A and B, products summed in
       double and rounded once to D's type; layouts, operands and workspace checked against the
       allocations, pointers against the alignment the algorithm was chosen for.
   With PR_EMU_FAIL_ALLOC=k in the environment, allocation number k (device or pinned, from 0)
   fails as out of memory, once, and says so on stderr: test/check_oom.sh sweeps k over training
   steps to see what each failure leaves behind.
   A fault inside a kernel is sticky, as on a GPU: every later call returns it. Not emulated:
   timing, overlap of two streams' operations (each runs whole, in one of the two orders the
   schedules force; compute-sanitizer's part on a GPU). NCCL: test/nccl_emu.h, ranks as processes.
   test/test_cuda_emu.cc checks these rules themselves. */
#ifndef PR_CUDA_EMU_H
#define PR_CUDA_EMU_H
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include <map>
#include <memory>
#include <tuple>
#include <vector>

/* ================================================================ faults */
static int emu_sticky;                          /* the first kernel fault, as cudaError_t */
static void emu_device_fault(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "emulated device: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    if (!emu_sticky) emu_sticky = 719;          /* cudaErrorLaunchFailure */
}
#define CHECK(cond, ...)                                          \
    do {                                                          \
        if (!(cond)) emu_device_fault(__VA_ARGS__);               \
    } while (0)
#define EMU_REPORT(...) emu_device_fault(__VA_ARGS__)
#include "mma_emu.h"
#include "gpu_emu.h"

/* ================================================================ the runtime's types */
typedef enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorLaunchFailure = 719,
} cudaError_t;
typedef enum { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault } cudaMemcpyKind;
typedef enum { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97, cudaDevAttrComputeCapabilityMajor = 75 } cudaDeviceAttr;
typedef enum { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 } cudaFuncAttribute;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType_t;
#define cudaStreamNonBlocking 1u
#define cudaEventDisableTiming 2u

/* ================================================================ memory */
enum { MEM_DEVICE, MEM_PINNED };
struct emu_alloc { size_t bytes; int kind; };
static std::map<const char *, emu_alloc> emu_allocs;
static size_t emu_device_bytes;                 /* allocated on the device now */
static const size_t EMU_DEVICE_TOTAL = (size_t)80 << 30;   /* an H100's memory, for cudaMemGetInfo */
static const int EMU_SMEM_OPTIN = 232448;       /* an H100's dynamic shared memory a block, opted in */

/* the allocation [p, p + bytes) lies in, or NULL */
static const emu_alloc *emu_find(const void *p, size_t bytes, int kind) {
    std::map<const char *, emu_alloc>::const_iterator it = emu_allocs.upper_bound((const char *)p);
    if (it == emu_allocs.begin()) return NULL;
    --it;
    if (it->second.kind != kind || (const char *)p + bytes > it->first + it->second.bytes) return NULL;
    return &it->second;
}
static bool emu_is_device(const void *p, size_t bytes) { return emu_find(p, bytes, MEM_DEVICE) != NULL; }
static bool emu_is_pinned(const void *p, size_t bytes) { return emu_find(p, bytes, MEM_PINNED) != NULL; }

/* ================================================================ streams and events */
/* Queued work: stream s's operations in order; `done` of them have run. An operation is called
   with `block`: true, it runs to its end; false (cudaStreamQuery), it may instead return false
   when it cannot finish now (NCCL's waiting for its peers), to be called again. An event is the
   point a stream had reached when it was recorded. `held`: operations a library has taken for the
   stream and not yet queued (a non-blocking NCCL call that its communicator has not yet said is
   queued, test/nccl_emu.h): a wait for the stream then would end without them, a fault. */
struct emu_stream { std::vector<std::function<bool(bool)>> ops; size_t done; int held; };
struct emu_event { emu_stream *stream; size_t at; bool timing; std::shared_ptr<double> when; };
typedef emu_stream *cudaStream_t;
typedef emu_event *cudaEvent_t;
static std::vector<emu_stream *> emu_streams;

/* runs s's queued operations up to position `until` (each may first run other streams' work it
   waits for); without `block`, stops at an operation that cannot finish now and returns false.
   `done` moves before the call, so that the operation's own waits never run it again. */
static bool emu_run_until(emu_stream *s, size_t until, bool block = true) {
    while (s->done < until && s->done < s->ops.size()) {
        std::function<bool(bool)> op = s->ops[s->done];
        s->done++;
        if (!op(block)) {
            s->done--;
            return false;
        }
    }
    return true;
}
static void emu_run_all(void) {
    for (emu_stream *s : emu_streams) emu_run_until(s, s->ops.size());
}
/* Whether streams after the first run each operation when queued: PR_EMU_SCHEDULE (see the top),
   read at the first operation queued; -1 until then. */
static int emu_eager_side = -1;
static void emu_enqueue_resumable(cudaStream_t s, std::function<bool(bool)> op) {
    if (emu_eager_side < 0) {
        const char *v = getenv("PR_EMU_SCHEDULE");
        emu_eager_side = v && !strcmp(v, "eager-side");
        if (v && !emu_eager_side && strcmp(v, "late"))
            fprintf(stderr, "emulated device: PR_EMU_SCHEDULE=%s is neither late nor eager-side; running late\n", v);
    }
    s->ops.push_back(op);
    if (emu_eager_side && s != emu_streams.front()) emu_run_until(s, s->ops.size());
}
static void emu_enqueue(cudaStream_t s, std::function<void()> op) {
    emu_enqueue_resumable(s, [op](bool) {
        op();
        return true;
    });
}
static bool emu_known_stream(cudaStream_t s) {
    for (emu_stream *x : emu_streams) if (x == s) return true;
    return false;
}

/* ================================================================ the runtime's calls */
static cudaError_t emu_last;                    /* the launch error cudaGetLastError hands over */
static cudaError_t emu_result(cudaError_t e) { return emu_sticky ? (cudaError_t)emu_sticky : e; }

static inline const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument (emulated)";
    case cudaErrorMemoryAllocation: return "out of memory (emulated)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (emulated)";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle (emulated)";
    case cudaErrorNotReady: return "device not ready (emulated)";
    case cudaErrorLaunchFailure: return "unspecified launch failure (emulated: see the fault above)";
    }
    return "unknown error (emulated)";
}
static cudaError_t cudaGetLastError(void) {
    cudaError_t e = emu_last;
    emu_last = cudaSuccess;
    return emu_result(e);
}
/* a node's GPUs, one a process (test/nccl_emu.h: one rank each); this process has one device's memory */
static const int EMU_DEVICES = 8;
static inline cudaError_t cudaGetDeviceCount(int *n) { *n = EMU_DEVICES; return emu_result(cudaSuccess); }
static inline cudaError_t cudaSetDevice(int d) { return emu_result(d >= 0 && d < EMU_DEVICES ? cudaSuccess : cudaErrorInvalidDevice); }
static inline cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int device) {
    if (device < 0 || device >= EMU_DEVICES) return cudaErrorInvalidDevice;
    if (a == cudaDevAttrComputeCapabilityMajor) *v = 9;
    else if (a == cudaDevAttrMaxSharedMemoryPerBlockOptin) *v = EMU_SMEM_OPTIN;
    else return cudaErrorInvalidValue;
    return emu_result(cudaSuccess);
}
static inline cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total) {
    *total = EMU_DEVICE_TOTAL;
    *free_b = EMU_DEVICE_TOTAL > emu_device_bytes ? EMU_DEVICE_TOTAL - emu_device_bytes : 0;
    return emu_result(cudaSuccess);
}

/* Whether this allocation is the one PR_EMU_FAIL_ALLOC names. */
static bool emu_allocation_fails() {
    static long fail_at = -2, made = 0;
    if (fail_at == -2) fail_at = getenv("PR_EMU_FAIL_ALLOC") ? atol(getenv("PR_EMU_FAIL_ALLOC")) : -1;
    if (fail_at < 0 || made++ != fail_at) return false;
    fprintf(stderr, "emulated device: allocation %ld fails, as PR_EMU_FAIL_ALLOC asks\n", fail_at);
    return true;
}

static cudaError_t emu_allocate(void **p, size_t bytes, int kind) {
    if (!p) return cudaErrorInvalidValue;
    *p = NULL;
    if (kind == MEM_DEVICE && emu_device_bytes + bytes > EMU_DEVICE_TOTAL) return cudaErrorMemoryAllocation;
    if (emu_allocation_fails()) return cudaErrorMemoryAllocation;
    /* cudaMalloc's alignment, and not a byte more than asked: under AddressSanitizer an access
       past the end is caught, as compute-sanitizer's memcheck would */
    void *q = NULL;
    if (posix_memalign(&q, 256, bytes ? bytes : 1)) return cudaErrorMemoryAllocation;
    static int undefined = -1;                  /* PR_EMU_UNDEFINED=1: device memory left undefined, for valgrind */
    if (undefined < 0) undefined = getenv("PR_EMU_UNDEFINED") && !strcmp(getenv("PR_EMU_UNDEFINED"), "1");
    if (!(undefined && kind == MEM_DEVICE)) memset(q, 0xFF, bytes);
    emu_allocs[(const char *)q] = emu_alloc{ bytes, kind };
    if (kind == MEM_DEVICE) {
        emu_device_bytes += bytes;
        emu_buffer_add(emu_inputs, q, bytes);
        emu_buffer_add(emu_accumulators, q, bytes);
    }
    *p = q;
    return emu_result(cudaSuccess);
}
static cudaError_t emu_release(void *p, int kind) {
    if (!p) return emu_result(cudaSuccess);
    emu_run_all();                              /* both synchronise the device */
    std::map<const char *, emu_alloc>::iterator it = emu_allocs.find((const char *)p);
    if (it == emu_allocs.end() || it->second.kind != kind) return cudaErrorInvalidValue;
    if (kind == MEM_DEVICE) {
        emu_device_bytes -= it->second.bytes;
        emu_buffer_remove(emu_inputs, p);
        emu_buffer_remove(emu_accumulators, p);
    }
    emu_allocs.erase(it);
    free(p);
    return emu_result(cudaSuccess);
}
static cudaError_t cudaMalloc(void **p, size_t bytes) { return emu_allocate(p, bytes, MEM_DEVICE); }
static cudaError_t cudaMallocHost(void **p, size_t bytes) { return emu_allocate(p, bytes, MEM_PINNED); }
static cudaError_t cudaFree(void *p) { return emu_release(p, MEM_DEVICE); }
static cudaError_t cudaFreeHost(void *p) { return emu_release(p, MEM_PINNED); }

static cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    (void)flags;
    *s = new emu_stream();
    (*s)->done = 0;
    emu_streams.push_back(*s);
    return emu_result(cudaSuccess);
}
static cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (!emu_known_stream(s)) return cudaErrorInvalidResourceHandle;
    emu_run_until(s, s->ops.size());           /* queued work still completes */
    for (size_t i = 0; i < emu_streams.size(); i++)
        if (emu_streams[i] == s) emu_streams.erase(emu_streams.begin() + (long)i);
    delete s;
    return emu_result(cudaSuccess);
}
/* A wait for s while a library holds operations for it: a fault (the wait would miss them). */
static void emu_check_held(cudaStream_t s, const char *what) {
    if (s->held)
        emu_device_fault("%s: a wait for a stream for which %d operation(s) of a non-blocking NCCL communicator are not yet "
                         "queued (ncclCommGetAsyncError has not yet said ncclSuccess)", what, s->held);
}
static cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if (!emu_known_stream(s)) return cudaErrorInvalidResourceHandle;
    emu_check_held(s, "cudaStreamSynchronize");
    emu_run_until(s, s->ops.size());
    return emu_result(cudaSuccess);
}
/* runs what can run now: cudaSuccess when all of s's work is done, cudaErrorNotReady while an
   operation waits (an NCCL peer that has not come). Not ready is also kept as the last error, as
   the runtime does (its callers clear it with cudaGetLastError, or their next launch check sees
   it). */
static cudaError_t cudaStreamQuery(cudaStream_t s) {
    if (!emu_known_stream(s)) return cudaErrorInvalidResourceHandle;
    emu_check_held(s, "cudaStreamQuery");
    if (emu_run_until(s, s->ops.size(), false)) return emu_result(cudaSuccess);
    emu_last = cudaErrorNotReady;
    return emu_result(cudaErrorNotReady);
}
static cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    *e = new emu_event();
    (*e)->stream = NULL, (*e)->at = 0, (*e)->timing = !(flags & cudaEventDisableTiming);
    return emu_result(cudaSuccess);
}
static inline cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }
static cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return emu_result(cudaSuccess);
}
/* A timing event also takes the host's clock when its stream runs up to it (the stamp is the
   event's own, so destroying the event with the stamp still queued is safe, as in CUDA). */
static cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (!emu_known_stream(s)) return cudaErrorInvalidResourceHandle;
    e->stream = s, e->at = s->ops.size();
    if (e->timing) {
        std::shared_ptr<double> when = std::make_shared<double>(-1.0);
        e->when = when;
        emu_enqueue(s, [when] {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            *when = ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
        });
    }
    return emu_result(cudaSuccess);
}
/* milliseconds from `start` to `end`, both recorded with timing and reached by their streams */
static inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!ms || !start || !end || !start->timing || !end->timing) return cudaErrorInvalidResourceHandle;
    if (!start->when || !end->when || *start->when < 0 || *end->when < 0) return cudaErrorNotReady;
    *ms = (float)(*end->when - *start->when);
    return emu_result(cudaSuccess);
}
/* s's later work waits for what the event's stream had queued when it was recorded */
static cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    if (!emu_known_stream(s) || flags) return cudaErrorInvalidValue;
    emu_stream *other = e->stream;
    const size_t at = e->at;
    if (other) emu_enqueue_resumable(s, [other, at](bool block) { return emu_run_until(other, at, block); });
    return emu_result(cudaSuccess);
}

static cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
    if (!emu_known_stream(s)) return cudaErrorInvalidResourceHandle;
    if (!bytes) return emu_result(cudaSuccess);
    if (!emu_is_device(p, bytes)) {
        emu_device_fault("cudaMemsetAsync of %zu bytes at %p: not inside one device allocation", bytes, p);
        return cudaErrorInvalidValue;
    }
    emu_enqueue(s, [p, value, bytes] { memset(p, value, bytes); });
    return emu_result(cudaSuccess);
}
static cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
    if (!emu_known_stream(s)) return cudaErrorInvalidResourceHandle;
    if (!bytes) return emu_result(cudaSuccess);
    const bool dst_dev = emu_is_device(dst, bytes), src_dev = emu_is_device(src, bytes);
    const bool dst_host_ok = !dst_dev && !emu_find(dst, 1, MEM_DEVICE), src_host_ok = !src_dev && !emu_find(src, 1, MEM_DEVICE);
    bool ok;
    switch (kind) {
    case cudaMemcpyHostToDevice: ok = src_host_ok && dst_dev; break;
    case cudaMemcpyDeviceToHost: ok = src_dev && dst_host_ok; break;
    case cudaMemcpyDeviceToDevice: ok = src_dev && dst_dev; break;
    case cudaMemcpyDefault: ok = (src_dev || src_host_ok) && (dst_dev || dst_host_ok); break;
    default: ok = false;
    }
    if (!ok) {
        emu_device_fault("cudaMemcpyAsync (kind %d) of %zu bytes from %p to %p: a side runs past its device allocation, or lies "
                         "in host memory where the kind names the device (or the reverse)", (int)kind, bytes, src, dst);
        return cudaErrorInvalidValue;
    }
    if (!src_dev && !emu_is_pinned(src, bytes)) {
        /* from pageable memory: read now, written when the stream gets there */
        std::vector<char> staged((const char *)src, (const char *)src + bytes);
        emu_enqueue(s, [dst, staged] { memcpy(dst, staged.data(), staged.size()); });
    } else {
        emu_enqueue(s, [dst, src, bytes] { memcpy(dst, src, bytes); });
    }
    if (!dst_dev && !emu_is_pinned(dst, bytes)) emu_run_until(s, s->ops.size());   /* into pageable: returns when done */
    return emu_result(cudaSuccess);
}

/* ================================================================ kernels */
static std::map<const void *, int> emu_smem_optin;   /* cudaFuncSetAttribute's, per kernel */
template <typename K> static cudaError_t cudaFuncSetAttribute(K kernel, cudaFuncAttribute a, int value) {
    if (a != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > EMU_SMEM_OPTIN) return cudaErrorInvalidValue;
    emu_smem_optin[reinterpret_cast<const void *>(kernel)] = value;
    return emu_result(cudaSuccess);
}

/* A launch: its geometry and shared memory checked now, as the runtime does (an error for
   cudaGetLastError), its arguments and PR_EMU_ORDER taken now, the kernel run when the stream
   gets there. The emulated block is one-dimensional, as all of the backend's are. */
template <typename K, typename... A>
static void emu_kernel_launch(const char *name, K kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t s, A... args) {
    const std::map<const void *, int>::const_iterator opted = emu_smem_optin.find(reinterpret_cast<const void *>(kernel));
    const int optin = opted == emu_smem_optin.end() ? 0 : opted->second;
    const char *bad = NULL;
    if (!emu_known_stream(s)) bad = "unknown stream";
    else if (grid.x < 1 || grid.x > 0x7fffffffu || grid.y < 1 || grid.y > 65535 || grid.z != 1) bad = "grid out of range (or 3-D)";
    else if (block.x < 32 || block.x > 1024 || block.x % 32 || block.y != 1 || block.z != 1) bad = "block not 32 to 1024 threads in whole warps";
    else if (smem > 49152 && (int)smem > optin) bad = "dynamic shared memory over 48 KiB without the kernel's opt-in";
    if (bad) {
        fprintf(stderr, "emulated device: launch of %s (grid %u x %u x %u, block %u x %u x %u, %zu bytes shared): %s\n", name,
                grid.x, grid.y, grid.z, block.x, block.y, block.z, smem, bad);
        emu_last = cudaErrorInvalidValue;
        return;
    }
    std::tuple<A...> bound(args...);
    const bool reversed = emu_order_env();
    emu_enqueue(s, [=] {
        if (emu_sticky) return;                 /* a faulted context runs nothing more */
        emu_launch(grid.x, grid.y, block.x, smem, std::vector<emu_out>(), [&] { std::apply(kernel, bound); }, reversed);
        if (emu_errors || emu_races) emu_device_fault("in kernel %s (grid %u x %u, %u threads)", name, grid.x, grid.y, block.x);
    });
}
#define PR_LAUNCH(kernel, grid, block, smem, stream, ...) \
    emu_kernel_launch(#kernel, kernel, dim3(grid), dim3(block), (size_t)(smem), stream, __VA_ARGS__)

/* ================================================================ cuBLASLt */
typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
} cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLASLT_MATMUL_DESC_TRANSA = 3, CUBLASLT_MATMUL_DESC_TRANSB = 4 } cublasLtMatmulDescAttributes_t;
typedef enum {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
} cublasLtMatmulPreferenceAttributes_t;
struct emu_lt { int live; };
struct emu_desc { cublasOperation_t ta, tb; };
struct emu_layout { cudaDataType_t type; uint64_t rows, cols; int64_t ld; };
struct emu_pref { uint64_t workspace; uint32_t align[4]; };
typedef emu_lt *cublasLtHandle_t;
typedef emu_desc *cublasLtMatmulDesc_t;
typedef emu_layout *cublasLtMatrixLayout_t;
typedef emu_pref *cublasLtMatmulPreference_t;
/* what the heuristic chose for: the workspace and the operands' alignments */
typedef struct { uint64_t workspace; uint32_t align[4]; } cublasLtMatmulAlgo_t;
typedef struct { cublasLtMatmulAlgo_t algo; size_t workspaceSize; cublasStatus_t state; float wavesCount; int reserved[4]; } cublasLtMatmulHeuristicResult_t;

static cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) { *h = new emu_lt{ 1 }; return CUBLAS_STATUS_SUCCESS; }
static cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) { delete h; return CUBLAS_STATUS_SUCCESS; }
static cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType_t scale) {
    if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    *d = new emu_desc{ CUBLAS_OP_N, CUBLAS_OP_N };
    return CUBLAS_STATUS_SUCCESS;
}
static cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { delete d; return CUBLAS_STATUS_SUCCESS; }
static cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void *buf, size_t n) {
    if (n != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
    cublasOperation_t op;
    memcpy(&op, buf, n);
    if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
    if (a == CUBLASLT_MATMUL_DESC_TRANSA) d->ta = op;
    else if (a == CUBLASLT_MATMUL_DESC_TRANSB) d->tb = op;
    else return CUBLAS_STATUS_NOT_SUPPORTED;
    return CUBLAS_STATUS_SUCCESS;
}
/* column-major rows x cols, leading dimension ld >= rows */
static cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    if ((type != CUDA_R_32F && type != CUDA_R_16BF) || ld < (int64_t)rows || ld < 1) return CUBLAS_STATUS_INVALID_VALUE;
    *l = new emu_layout{ type, rows, cols, ld };
    return CUBLAS_STATUS_SUCCESS;
}
static cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { delete l; return CUBLAS_STATUS_SUCCESS; }
static cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) { *p = new emu_pref{ 0, { 1, 1, 1, 1 } }; return CUBLAS_STATUS_SUCCESS; }
static cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) { delete p; return CUBLAS_STATUS_SUCCESS; }
static cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t a,
                                                           const void *buf, size_t n) {
    if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
        if (n != sizeof p->workspace) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&p->workspace, buf, n);
    } else if (a >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && a <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
        if (n != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&p->align[a - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf, n);
    } else {
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
}
/* op(X)'s shape: the layout's, transposed when asked */
static void emu_op_shape(const emu_layout *l, cublasOperation_t op, uint64_t *rows, uint64_t *cols) {
    *rows = op == CUBLAS_OP_T ? l->cols : l->rows;
    *cols = op == CUBLAS_OP_T ? l->rows : l->cols;
}
static bool emu_shapes_agree(const emu_desc *d, const emu_layout *A, const emu_layout *B, const emu_layout *C, const emu_layout *D) {
    uint64_t am, ak, bk, bn;
    emu_op_shape(A, d->ta, &am, &ak);
    emu_op_shape(B, d->tb, &bk, &bn);
    return A->type == CUDA_R_16BF && B->type == CUDA_R_16BF && ak == bk && C->rows == am && C->cols == bn &&
           D->rows == C->rows && D->cols == C->cols && D->ld == C->ld && D->type == C->type;
}
static cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t A,
                                                     cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                                     cublasLtMatmulPreference_t p, int requested, cublasLtMatmulHeuristicResult_t *res,
                                                     int *found) {
    if (!h || requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
    if (!emu_shapes_agree(d, A, B, C, D)) return CUBLAS_STATUS_NOT_SUPPORTED;
    memset(res, 0, sizeof *res);
    res->algo.workspace = p->workspace;
    memcpy(res->algo.align, p->align, sizeof p->align);
    *found = 1;
    return CUBLAS_STATUS_SUCCESS;
}
static size_t emu_type_bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }
static double emu_load(const void *p, cudaDataType_t t, size_t i) {
    if (t == CUDA_R_32F) { float f; memcpy(&f, (const char *)p + 4 * i, 4); return f; }
    uint16_t b;
    memcpy(&b, (const char *)p + 2 * i, 2);
    return bf16_value(b);
}
static bool emu_operand_ok(const char *what, const void *p, const emu_layout *l, uint32_t align) {
    const size_t bytes = ((size_t)l->ld * (l->cols - 1) + l->rows) * emu_type_bytes(l->type);
    if (!emu_is_device(p, bytes)) { emu_device_fault("cublasLtMatmul: %s (%zu bytes from %p) is not inside one device allocation", what, bytes, p); return false; }
    if ((uintptr_t)p % align) { emu_device_fault("cublasLtMatmul: %s at %p is not aligned to the %u bytes its algorithm was chosen for", what, p, align); return false; }
    return true;
}
static cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, const void *A, cublasLtMatrixLayout_t la,
                                     const void *B, cublasLtMatrixLayout_t lb, const void *beta, const void *C, cublasLtMatrixLayout_t lc,
                                     void *D, cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t *algo, void *ws, size_t ws_bytes,
                                     cudaStream_t s) {
    if (!h || !algo || !emu_known_stream(s) || !emu_shapes_agree(d, la, lb, lc, ld)) return CUBLAS_STATUS_INVALID_VALUE;
    if (C != D) return CUBLAS_STATUS_NOT_SUPPORTED;   /* the backend accumulates in place */
    if (ws_bytes > algo->workspace || (ws_bytes && !emu_is_device(ws, ws_bytes))) {
        emu_device_fault("cublasLtMatmul: workspace of %zu bytes, %llu allowed, or outside the device", ws_bytes, (unsigned long long)algo->workspace);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (!emu_operand_ok("A", A, la, algo->align[0]) || !emu_operand_ok("B", B, lb, algo->align[1]) ||
        !emu_operand_ok("C", C, lc, algo->align[2]) || !emu_operand_ok("D", D, ld, algo->align[3]))
        return CUBLAS_STATUS_INVALID_VALUE;
    float a, b;                                 /* the scalars are read now (host pointer mode) */
    memcpy(&a, alpha, 4);
    memcpy(&b, beta, 4);
    const emu_desc op = *d;                     /* the descriptors may be destroyed once this returns */
    const emu_layout LA = *la, LB = *lb, LD = *ld;
    emu_enqueue(s, [=] {
        if (emu_sticky) return;
        const uint64_t m = LD.rows, n = LD.cols;
        uint64_t k, unused;
        emu_op_shape(&LA, op.ta, &unused, &k);
        /* op(A) row by row and op(B) column by column, read once: each dot product then runs over
           contiguous doubles, in the same order (the same bits) */
        std::vector<double> rows_a(m * k), cols_b(n * k);
        for (uint64_t i = 0; i < m; i++)
            for (uint64_t p = 0; p < k; p++)
                rows_a[i * k + p] = emu_load(A, LA.type, op.ta == CUBLAS_OP_T ? p + i * LA.ld : i + p * LA.ld);
        for (uint64_t j = 0; j < n; j++)
            for (uint64_t p = 0; p < k; p++)
                cols_b[j * k + p] = emu_load(B, LB.type, op.tb == CUBLAS_OP_T ? j + p * LB.ld : p + j * LB.ld);
        for (uint64_t j = 0; j < n; j++)
            for (uint64_t i = 0; i < m; i++) {
                const double *x = &rows_a[i * k], *y = &cols_b[j * k];
                double acc = 0;
                for (uint64_t p = 0; p < k; p++) acc += x[p] * y[p];
                const size_t id = i + j * LD.ld;
                const double v = a * acc + (b != 0 ? b * emu_load(D, LD.type, id) : 0.0);   /* C unread when beta is 0 */
                if (LD.type == CUDA_R_32F) { const float f = (float)v; memcpy((char *)D + 4 * id, &f, 4); }
                else { const uint16_t bits = emu_bf16_bits(emu_round_bf16(v)); memcpy((char *)D + 2 * id, &bits, 2); }
            }
    });
    return CUBLAS_STATUS_SUCCESS;
}
#endif
