/* bench_cuda — the CUDA backend's GEMMs and attention, measured side by side in one run:
     GEMM: every Llama3-8B projection (forward, and the two GEMMs of its backward) through the
           backend's matmul, beside the best of cuBLASLt's top algorithms for the same problem
           timed here (the ratio ours / best is the issue's >= 85% target);
     attention: forward and backward TFLOP/s, 32 query / 8 KV heads, causal over one 8k sequence
           and the two-region variant (a shared prefix region plus causal suffixes), at head dim
           128 (Llama3-8B's) and for two cases at 64 (Llama-3.2-1B's), the other head dim the
           tensor-core kernels run at full speed.
   FLOPs: GEMM 2mnk; attention 4 * pairs * HS * NH forward and 2.5x that backward (FlashAttention's
   convention), pairs = the (query, key) pairs the mask allows. Times: median of --reps runs after
   a warm-up, the device drained around each run; fewer runs where the warm-up shows that --reps
   would take longer than --max-seconds. Needs a GPU: `make bench-cuda`.

     build/bench_cuda [--reps N] [--rows N] [--max-seconds S] [--only gemm|attention] [--att LIST]
     build/bench_cuda --smoke
   --att: attention cases by name, comma-separated (default all; names in the table it prints).
   --smoke: the first things a new GPU should do, each announced before it runs (so that a crash
   says where): device properties, one GEMM, one attention forward and backward, one training step
   of the tiny preset each way. Exit 0 only if all ran and gave finite results. */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const pr_backend *be;
static int reps = 20;
static double max_seconds = 3;

static double now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
/* median seconds of fn(arg) over reps runs (fewer when they would take over max_seconds), one
   warm-up first */
static double median_time(void (*fn)(void *), void *arg) {
    double t0 = now();
    fn(arg);
    cudaDeviceSynchronize();
    be->sync(be);
    double warm = now() - t0;
    int n = reps;
    if (warm * n > max_seconds) n = (int)(max_seconds / warm);
    if (n < 1) n = 1;
    double *t = malloc(sizeof(double) * n);
    for (int r = 0; r < n; r++) {
        double t0 = now();
        fn(arg);
        cudaDeviceSynchronize();
        be->sync(be);
        t[r] = now() - t0;
    }
    qsort(t, n, sizeof(double), cmp_double);
    double m = t[n / 2];
    free(t);
    return m;
}
static void fill_random_bf16(void *dev, size_t n, unsigned seed) {
    uint16_t *h = malloc(2 * n);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        h[i] = pr_f32_to_bf16((float)(((s >> 11) / 9007199254740992.0) * 2 - 1));
    }
    cudaMemcpy(dev, h, 2 * n, cudaMemcpyHostToDevice);
    free(h);
}
static void *dalloc(size_t bytes) {
    void *p = be->alloc(be, bytes, PR_TIER_DEVICE);
    if (!p) { fprintf(stderr, "bench_cuda: out of device memory (%zu bytes)\n", bytes); exit(1); }
    return p;
}

/* ---------------------------------------------------------------- GEMM */
typedef struct { int m, n, k, ta, tb, lda, ldb, ldd, d_fp32; const void *A, *B; void *D; float beta; } lt_problem;
typedef struct { cublasLtHandle_t lt; cublasLtMatmulDesc_t op; cublasLtMatrixLayout_t la, lb, ld; cublasLtMatmulAlgo_t algo;
                 const lt_problem *p; void *ws; size_t ws_bytes; cudaStream_t stream; } lt_run;

static void lt_call(void *arg) {
    lt_run *r = arg;
    float alpha = 1;
    cublasLtMatmul(r->lt, r->op, &alpha, r->p->A, r->la, r->p->B, r->lb, &r->p->beta, r->p->D, r->ld, r->p->D, r->ld,
                   &r->algo, r->ws, r->ws_bytes, r->stream);
}

/* The fastest of cuBLASLt's first 16 heuristic candidates for the problem, each timed. */
static double best_cublaslt(cublasLtHandle_t lt, const lt_problem *p, void *ws, size_t ws_bytes, cudaStream_t stream) {
    lt_run r;
    memset(&r, 0, sizeof r);
    r.lt = lt; r.p = p; r.ws = ws; r.ws_bytes = ws_bytes; r.stream = stream;
    cublasOperation_t ta = p->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDescCreate(&r.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatmulDescSetAttribute(r.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(r.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    cublasLtMatrixLayoutCreate(&r.la, CUDA_R_16BF, p->ta ? p->k : p->m, p->ta ? p->m : p->k, p->lda);
    cublasLtMatrixLayoutCreate(&r.lb, CUDA_R_16BF, p->tb ? p->n : p->k, p->tb ? p->k : p->n, p->ldb);
    cublasLtMatrixLayoutCreate(&r.ld, p->d_fp32 ? CUDA_R_32F : CUDA_R_16BF, p->m, p->n, p->ldd);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes);
    cublasLtMatmulHeuristicResult_t res[16];
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(lt, r.op, r.la, r.lb, r.ld, r.ld, pref, 16, res, &found);
    double best = INFINITY;
    for (int i = 0; i < found; i++) {
        r.algo = res[i].algo;
        double t = median_time(lt_call, &r);
        if (cudaGetLastError() == cudaSuccess && t < best) best = t;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(r.la); cublasLtMatrixLayoutDestroy(r.lb); cublasLtMatrixLayoutDestroy(r.ld);
    cublasLtMatmulDescDestroy(r.op);
    return best;
}

typedef struct { void *out, *inp, *dout, *dinp; const void *w; float *dw; int N, C, OC, which; } mm_args;
static void mm_call(void *arg) {
    mm_args *a = arg;
    if (a->which == 0) be->matmul_fwd(be, a->out, a->inp, a->w, a->N, a->C, a->OC);
    else be->matmul_bwd(be, a->dinp, a->dw, a->dout, a->inp, a->w, a->N, a->C, a->OC);
}

static void bench_gemm(int N) {
    static const struct { const char *name; int C, OC; } shapes[] = {
        { "q_proj", 4096, 4096 }, { "k/v_proj", 4096, 1024 }, { "o_proj", 4096, 4096 },
        { "gate_up_proj", 4096, 2 * 14336 }, { "down_proj", 14336, 4096 }, { "lm_head (2k rows)", 4096, 128256 },
    };
    cublasLtHandle_t lt;
    cudaStream_t stream;
    cublasLtCreate(&lt);
    cudaStreamCreate(&stream);
    size_t ws_bytes = (size_t)32 << 20;
    void *ws = dalloc(ws_bytes);
    printf("GEMM, bf16 in, fp32 compute, %d rows (ours = the backend's matmul; best = fastest of cuBLASLt's top 16, timed here)\n", N);
    printf("%-18s %6s %6s %6s %10s %10s %8s\n", "shape", "m", "n", "k", "ours TF/s", "best TF/s", "ours/best");
    double sum = 0;
    int cells = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int C = shapes[s].C, OC = shapes[s].OC, rows = shapes[s].OC > 100000 ? 2048 : N;
        float *dw = dalloc(sizeof(float) * (size_t)OC * C);
        void *inp = dalloc(2 * (size_t)rows * C), *dinp = dalloc(2 * (size_t)rows * C);
        void *out = dalloc(2 * (size_t)rows * OC), *dout = dalloc(2 * (size_t)rows * OC);
        fill_random_bf16(inp, (size_t)rows * C, 1);
        fill_random_bf16(dout, (size_t)rows * OC, 2);
        fill_random_bf16(dinp, (size_t)rows * C, 3);
        cudaMemset(dw, 0, sizeof(float) * (size_t)OC * C);
        void *wb = dalloc(2 * (size_t)OC * C);            /* the bf16 weights the kernels read */
        fill_random_bf16(wb, (size_t)OC * C, 4);
        mm_args a = { out, inp, dout, dinp, wb, dw, rows, C, OC, 0 };
        lt_problem fwd = { OC, rows, C, 1, 0, C, C, OC, 0, wb, inp, out, 0.0f };
        lt_problem bdx = { C, rows, OC, 0, 0, C, OC, C, 0, wb, dout, dinp, 1.0f };
        lt_problem bdw = { C, OC, rows, 0, 1, C, OC, C, 1, inp, dout, dw, 1.0f };
        double flop = 2.0 * rows * C * OC;
        double t_ours_f = median_time(mm_call, &a);
        a.which = 1;
        double t_ours_b = median_time(mm_call, &a);
        double t_best_f = best_cublaslt(lt, &fwd, ws, ws_bytes, stream);
        double t_best_b = best_cublaslt(lt, &bdx, ws, ws_bytes, stream) + best_cublaslt(lt, &bdw, ws, ws_bytes, stream);
        char name[48];
        snprintf(name, sizeof name, "%s fwd", shapes[s].name);
        printf("%-18s %6d %6d %6d %10.1f %10.1f %8.3f\n", name, OC, rows, C, flop / t_ours_f / 1e12, flop / t_best_f / 1e12, t_best_f / t_ours_f);
        snprintf(name, sizeof name, "%s bwd", shapes[s].name);
        printf("%-18s %6d %6d %6d %10.1f %10.1f %8.3f\n", name, OC, rows, C, 2 * flop / t_ours_b / 1e12, 2 * flop / t_best_b / 1e12, t_best_b / t_ours_b);
        sum += t_best_f / t_ours_f + t_best_b / t_ours_b;
        cells += 2;
        be->release(be, dw, PR_TIER_DEVICE); be->release(be, inp, PR_TIER_DEVICE);
        be->release(be, dinp, PR_TIER_DEVICE); be->release(be, out, PR_TIER_DEVICE); be->release(be, dout, PR_TIER_DEVICE);
        be->release(be, wb, PR_TIER_DEVICE);
    }
    printf("GEMM: mean ours/best %.3f over %d cells\n\n", sum / cells, cells);
    be->release(be, ws, PR_TIER_DEVICE);
    cublasLtDestroy(lt);
    cudaStreamDestroy(stream);
}

/* ---------------------------------------------------------------- attention */
typedef struct { pr_seq_layout lay; void *q, *k, *v, *kp, *vp, *o, *lse, *dout, *dq, *dk, *dv, *dkp, *dvp; int NH, NKV, HS, bwd; } att_args;
static void att_call(void *arg) {
    att_args *a = arg;
    if (!a->bwd) be->attention_fwd(be, a->o, a->lse, a->q, a->k, a->v, a->kp, a->vp, &a->lay, a->NH, a->NKV, a->HS);
    else be->attention_bwd(be, a->dq, a->dk, a->dv, a->kp ? a->dkp : NULL, a->kp ? a->dvp : NULL, a->dout, a->o, a->lse,
                           a->q, a->k, a->v, a->kp, a->vp, &a->lay, a->NH, a->NKV, a->HS);
}

/* n_prefix prefix keys, then n_seg segments of len rows each, at head dim HS: the forward (unless
   bwd_only) and the backward timed, printed as TFLOP/s; the backward's seconds returned. With
   base_bwd > 0 (the deterministic backward's seconds on the same case), the line also gives
   base_bwd / this one. */
static double bench_attention(const char *label, int n_prefix, int n_seg, int len, int HS, int bwd_only, double base_bwd) {
    const int NH = 32, NKV = 8, N = n_seg * len;
    int *seg = malloc(sizeof(int) * (n_seg + 1));
    for (int s = 0; s <= n_seg; s++) seg[s] = s * len;
    att_args a;
    memset(&a, 0, sizeof a);
    a.lay.n_seg = n_seg; a.lay.seg_off = seg; a.lay.pos0 = n_prefix; a.lay.n_prefix = n_prefix;
    a.NH = NH; a.NKV = NKV; a.HS = HS;
    size_t nq = (size_t)N * NH * HS, nk = (size_t)N * NKV * HS, np = (size_t)(n_prefix ? n_prefix : 1) * NKV * HS;
    void **bufs[] = { &a.q, &a.o, &a.dout, &a.dq };
    for (int i = 0; i < 4; i++) { *bufs[i] = dalloc(2 * nq); fill_random_bf16(*bufs[i], nq, 10 + i); }
    void **kbufs[] = { &a.k, &a.v, &a.dk, &a.dv };
    for (int i = 0; i < 4; i++) { *kbufs[i] = dalloc(2 * nk); fill_random_bf16(*kbufs[i], nk, 20 + i); }
    if (n_prefix) {
        a.kp = dalloc(2 * np); fill_random_bf16(a.kp, np, 30);
        a.vp = dalloc(2 * np); fill_random_bf16(a.vp, np, 31);
        /* dkp, dvp: room for fp32 accumulators, zero (0 in bf16 and in fp32 alike) */
        a.dkp = dalloc(4 * np); cudaMemset(a.dkp, 0, 4 * np);
        a.dvp = dalloc(4 * np); cudaMemset(a.dvp, 0, 4 * np);
    }
    a.lse = dalloc(sizeof(float) * (size_t)N * NH);
    double pairs = (double)n_seg * ((double)len * n_prefix + (double)len * (len + 1) / 2);
    double ffwd = 4 * pairs * HS * NH, fbwd = 2.5 * ffwd;
    a.bwd = 0;
    if (bwd_only) att_call(&a);                        /* out and lse for the backward */
    double tf = bwd_only ? 0 : median_time(att_call, &a);
    a.bwd = 1;
    double tb = median_time(att_call, &a);
    pr_error err;
    if (be->take_error(be, &err)) printf("attention: %s\n", err.message);
    if (bwd_only) {
        char ratio[32] = "-";
        if (base_bwd > 0) snprintf(ratio, sizeof ratio, "%.3f", base_bwd / tb);
        printf("%-48s %8s %8.1f   (%.2f ms; deterministic / this: %s)\n", label, "-", fbwd / tb / 1e12, tb * 1e3, ratio);
    }
    else
        printf("%-48s %8.1f %8.1f   (%.2f / %.2f ms)\n", label, ffwd / tf / 1e12, fbwd / tb / 1e12, tf * 1e3, tb * 1e3);
    void *all[] = { a.q, a.o, a.dout, a.dq, a.k, a.v, a.dk, a.dv, a.kp, a.vp, a.dkp, a.dvp, a.lse };
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) if (all[i]) be->release(be, all[i], PR_TIER_DEVICE);
    free(seg);
    return tb;
}

/* ---------------------------------------------------------------- --smoke */
static void smoke_say(const char *what) {
    printf("smoke: %s\n", what);
    fflush(stdout);
}
static int smoke_fail(const char *what, const char *why) {
    printf("smoke: FAILED at %s: %s\n", what, why);
    return 1;
}
static int smoke_backend_ok(const char *what) {
    pr_error err;
    if (be->take_error(be, &err) != PR_OK) return !smoke_fail(what, err.message);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return !smoke_fail(what, cudaGetErrorString(e));
    return 1;
}
/* n bf16 values from the device: finite? */
static int finite_bf16(const void *d, size_t n) {
    uint16_t *h = malloc(2 * n);
    cudaMemcpy(h, d, 2 * n, cudaMemcpyDeviceToHost);
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) ok = isfinite(pr_bf16_to_f32(h[i]));
    free(h);
    return ok;
}

/* One attention call each way with the kernels of `kind`: prefix 32, 2 segments of 16, 4 query /
   2 KV heads, head dim 128 (where the tensor-core kernels run); 0, or 1 after saying what failed. */
static int smoke_attention(int kind, const char *name) {
    char what[160];
    pr_error err;
    if (pr_backend_cuda_set_attention(be, kind, &err)) {
        printf("smoke: %s attention does not run here: %s\n", name, err.message);
        return 0;
    }
    snprintf(what, sizeof what, "%s attention forward: prefix 32, 2 segments of 16, 4 query / 2 KV heads, head dim 128", name);
    smoke_say(what);
    att_args a;
    memset(&a, 0, sizeof a);
    const int NH = 4, NKV = 2, HS = 128, np = 32, seg[3] = { 0, 16, 32 }, N = 32;
    a.lay.n_seg = 2; a.lay.seg_off = seg; a.lay.pos0 = np; a.lay.n_prefix = np;
    a.NH = NH; a.NKV = NKV; a.HS = HS;
    size_t nq = (size_t)N * NH * HS, nk = (size_t)N * NKV * HS, npk = (size_t)np * NKV * HS;
    void **qb[] = { &a.q, &a.o, &a.dout, &a.dq }, **kb[] = { &a.k, &a.v, &a.dk, &a.dv };
    for (int i = 0; i < 4; i++) { *qb[i] = dalloc(2 * nq); fill_random_bf16(*qb[i], nq, 40 + i); }
    for (int i = 0; i < 4; i++) { *kb[i] = dalloc(2 * nk); fill_random_bf16(*kb[i], nk, 50 + i); }
    a.kp = dalloc(2 * npk); fill_random_bf16(a.kp, npk, 60);
    a.vp = dalloc(2 * npk); fill_random_bf16(a.vp, npk, 61);
    a.dkp = dalloc(4 * npk); cudaMemset(a.dkp, 0, 4 * npk);
    a.dvp = dalloc(4 * npk); cudaMemset(a.dvp, 0, 4 * npk);
    a.lse = dalloc(sizeof(float) * (size_t)N * NH);
    att_call(&a);
    if (!smoke_backend_ok(what)) return 1;
    if (!finite_bf16(a.o, nq)) return smoke_fail(what, "non-finite output");
    snprintf(what, sizeof what, "%s attention backward (same shapes)", name);
    smoke_say(what);
    a.bwd = 1;
    att_call(&a);
    if (!smoke_backend_ok(what)) return 1;
    if (!finite_bf16(a.dq, nq) || !finite_bf16(a.dk, nk) || !finite_bf16(a.dv, nk))
        return smoke_fail(what, "non-finite gradient");
    void *all[] = { a.q, a.o, a.dout, a.dq, a.k, a.v, a.dk, a.dv, a.kp, a.vp, a.dkp, a.dvp, a.lse };
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) be->release(be, all[i], PR_TIER_DEVICE);
    pr_backend_cuda_set_attention(be, PR_CUDA_ATTENTION_AUTO, NULL);   /* the default again */
    return 0;
}

static int smoke(void) {
    pr_error err;
    int driver = 0, runtime = 0, ndev = 0;
    smoke_say("CUDA driver and runtime");
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    cudaError_t e = cudaGetDeviceCount(&ndev);
    printf("smoke: driver API %d, runtime %d, %d device(s)%s%s\n", driver, runtime, ndev, e ? ": " : "", e ? cudaGetErrorString(e) : "");
    if (e != cudaSuccess || ndev < 1) return smoke_fail("device count", e ? cudaGetErrorString(e) : "no device");
    smoke_say("device properties");
    struct cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, 0)) != cudaSuccess) return smoke_fail("device properties", cudaGetErrorString(e));
    printf("smoke: %s, compute capability %d.%d, %d SMs, %.1f GiB, L2 %.0f MiB, shared memory per block up to %zu KiB\n",
           prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0,
           prop.l2CacheSize / 1048576.0, prop.sharedMemPerBlockOptin / 1024);
    smoke_say("backend (streams, cuBLASLt handle)");
    if (pr_backend_cuda_create(&be, 0, &err)) return smoke_fail("backend", err.message);

    smoke_say("GEMM 64 x 256 -> 192 (matmul_fwd) against the host");
    {
        const int N = 64, C = 256, OC = 192;
        float *w = malloc(sizeof(float) * OC * C);
        uint16_t *x = malloc(2 * N * C), *y = malloc(2 * N * OC);
        uint64_t s = 12345;
        for (int i = 0; i < OC * C; i++) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; w[i] = pr_bf16_to_f32(pr_f32_to_bf16((float)((s >> 11) * 0x1p-53 - 0.5) * 0.1f)); }
        for (int i = 0; i < N * C; i++) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; x[i] = pr_f32_to_bf16((float)((s >> 11) * 0x1p-53 - 0.5)); }
        float *dw = dalloc(sizeof(float) * OC * C);
        void *dwb = dalloc(2 * OC * C), *dx = dalloc(2 * N * C), *dy = dalloc(2 * N * OC);
        cudaMemcpy(dw, w, sizeof(float) * OC * C, cudaMemcpyHostToDevice);
        cudaMemcpy(dx, x, 2 * N * C, cudaMemcpyHostToDevice);
        cudaDeviceSynchronize();     /* a pageable copy may return before it lands; the backend's stream does not wait for it */
        be->reals_to_acts(be, dwb, dw, (size_t)OC * C);       /* the bf16 weights the kernels read */
        be->matmul_fwd(be, dy, dx, dwb, N, C, OC);
        if (!smoke_backend_ok("GEMM")) return 1;
        cudaMemcpy(y, dy, 2 * N * OC, cudaMemcpyDeviceToHost);
        double num = 0, den = 0;
        for (int n = 0; n < N; n++)
            for (int o = 0; o < OC; o++) {
                double r = 0;
                for (int c = 0; c < C; c++) r += (double)pr_bf16_to_f32(x[n * C + c]) * w[o * C + c];
                double d = pr_bf16_to_f32(y[n * OC + o]) - r;
                num += d * d;
                den += r * r;
            }
        double rel = sqrt(num / den);
        printf("smoke: GEMM relative error %.2e\n", rel);
        be->release(be, dw, PR_TIER_DEVICE); be->release(be, dwb, PR_TIER_DEVICE);
        be->release(be, dx, PR_TIER_DEVICE); be->release(be, dy, PR_TIER_DEVICE);
        free(w); free(x); free(y);
        if (!(rel <= 1e-2)) return smoke_fail("GEMM", "relative error above 1e-2");
    }

    if (smoke_attention(PR_CUDA_ATTENTION_FFMA, "FFMA")) return 1;

    const pr_schedule schedules[2] = { PR_SCHEDULE_REUSE, PR_SCHEDULE_BASELINE };
    for (int si = 0; si < 2; si++) {
        const char *sname = si ? "baseline" : "reuse";
        char what[96];
        snprintf(what, sizeof what, "training step: model/tiny, data/sample.trace group 0, %s schedule", sname);
        smoke_say(what);
        pr_config cfg;
        pr_trace trace;
        pr_trainer *tr = NULL;
        if (pr_config_load(&cfg, "model/tiny", &err) || pr_trace_read(&trace, "data/sample.trace", &err))
            return smoke_fail("training step setup", err.message);
        if (pr_trainer_create(&tr, &cfg, be, &err) || pr_trainer_init_params(tr, 7, &err)) {
            pr_trace_free(&trace);
            return smoke_fail("trainer", err.message);
        }
        pr_step_opts o = pr_step_opts_default();
        o.schedule = schedules[si];
        o.microbatch = 3;
        pr_step_stats st;
        pr_adamw_opts ao = pr_adamw_opts_default();
        double norm = 0;
        pr_status rc = pr_trainer_compute_grads(tr, &trace.groups[0], &o, &st, NULL, &err);
        if (!rc) rc = pr_trainer_adamw_step(tr, &ao, &norm, &err);
        pr_trainer_destroy(tr);
        pr_trace_free(&trace);
        if (rc) return smoke_fail(what, err.message);
        printf("smoke: %s step: loss %.6f, gradient norm %.6f, %.1f ms\n", sname, st.loss, norm,
               1e3 * (st.seconds[0] + st.seconds[1] + st.seconds[2]));
        if (!isfinite(st.loss) || !isfinite(norm)) return smoke_fail(what, "non-finite loss or gradient norm");
    }
    /* the tensor-core kernels last: a fault there leaves the figures above standing */
    if (smoke_attention(PR_CUDA_ATTENTION_MMA, "tensor-core (mma)") || smoke_attention(PR_CUDA_ATTENTION_WGMMA, "tensor-core (wgmma)"))
        return 1;
    pr_backend_cuda_destroy(be);
    printf("smoke: ok\n");
    return 0;
}

/* ---------------------------------------------------------------- main */
/* The attention cases: prefix keys, segments, rows per segment, head dim. */
static const struct { const char *name, *label; int n_prefix, n_seg, len, HS; } att_cases[] = {
    { "causal8k", "causal, one 8k sequence", 0, 1, 8192, 128 },
    { "p6k-4x512", "two-region: prefix 6k + 4 x 512", 6144, 4, 512, 128 },
    { "p2k-4x1.5k", "two-region: prefix 2k + 4 x 1.5k", 2048, 4, 1536, 128 },
    { "p10k-8x2k", "two-region: prefix 10k + 8 x 2k", 10240, 8, 2048, 128 },
    { "p10k-32x2k", "two-region: prefix 10k + 32 x 2k", 10240, 32, 2048, 128 },
    { "causal8k-hd64", "HS 64: causal, one 8k sequence", 0, 1, 8192, 64 },
    { "p10k-8x2k-hd64", "HS 64: prefix 10k + 8 x 2k", 10240, 8, 2048, 64 },
};
#define N_ATT_CASES (int)(sizeof att_cases / sizeof *att_cases)

static void usage(FILE *f) {
    fprintf(f, "usage: bench_cuda [--reps N] [--rows N] [--max-seconds S] [--only gemm|attention] [--att LIST]\n"
               "       bench_cuda --smoke\n"
               "  --att: attention cases, comma-separated, of:");
    for (int i = 0; i < N_ATT_CASES; i++) fprintf(f, " %s", att_cases[i].name);
    fprintf(f, "\n");
}

/* One table of the selected attention cases with the kernels of `kind`: the FFMA ones (the
   reference), the tensor-core ones (PR_CUDA_ATTENTION_MMA), the tensor-core backward that adds dQ
   with atomics (PR_CUDA_ATTENTION_MMA_ATOMIC; its forward is MMA's, so only the backward is timed),
   each case beside the deterministic backward's time in bwd_time (filled by the MMA table): the
   cost of determinism, measured; then the wgmma kernels (PR_CUDA_ATTENTION_WGMMA, sm_90a: forward,
   dQ and dK/dV on Hopper's warpgroup MMA), the default where they run. */
static void bench_attention_table(const int *sel, int kind, const char *title, double *bwd_time) {
    pr_error err;
    if (pr_backend_cuda_set_attention(be, kind, &err)) {
        printf("\n%s: %s\n", title, err.message);
        return;
    }
    printf("%-48s %8s %8s\n", title, "fwd TF/s", "bwd TF/s");
    for (int c = 0; c < N_ATT_CASES; c++)
        if (sel[c]) {
            char label[80];
            snprintf(label, sizeof label, "%s [%s]", att_cases[c].label, att_cases[c].name);
            const int atomic = kind == PR_CUDA_ATTENTION_MMA_ATOMIC;
            const double tb = bench_attention(label, att_cases[c].n_prefix, att_cases[c].n_seg, att_cases[c].len,
                                              att_cases[c].HS, atomic, atomic ? bwd_time[c] : 0);
            if (kind == PR_CUDA_ATTENTION_MMA) bwd_time[c] = tb;
        }
    pr_backend_cuda_set_attention(be, PR_CUDA_ATTENTION_AUTO, NULL);   /* the default again */
}

int main(int argc, char **argv) {
    int N = 12288, gemm = 1, attention = 1;
    int att_sel[N_ATT_CASES];
    for (int i = 0; i < N_ATT_CASES; i++) att_sel[i] = 1;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--smoke")) return smoke();
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!v) { usage(stderr); return 2; }
        if (!strcmp(a, "--reps")) reps = atoi(v);
        else if (!strcmp(a, "--rows")) N = atoi(v);
        else if (!strcmp(a, "--max-seconds")) max_seconds = atof(v);
        else if (!strcmp(a, "--only") && (!strcmp(v, "gemm") || !strcmp(v, "attention"))) { gemm = v[0] == 'g'; attention = !gemm; }
        else if (!strcmp(a, "--att")) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", v);
            for (int c = 0; c < N_ATT_CASES; c++) att_sel[c] = 0;
            for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
                int found = 0;
                for (int c = 0; c < N_ATT_CASES; c++) if (!strcmp(tok, att_cases[c].name)) att_sel[c] = found = 1;
                if (!found) { fprintf(stderr, "bench_cuda: no attention case '%s'\n", tok); usage(stderr); return 2; }
            }
        } else { usage(stderr); return 2; }
    }
    if (reps < 1) reps = 1;
    if (N < 1) N = 1;
    pr_error err;
    if (pr_backend_cuda_create(&be, 0, &err)) { fprintf(stderr, "bench_cuda: %s\n", err.message); return 1; }
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("bench_cuda on %s (%d SMs), median of %d runs (fewer where they would take over %.0f s)\n\n", prop.name,
           prop.multiProcessorCount, reps, max_seconds);
    if (gemm) bench_gemm(N);
    if (attention) {
        double bwd_time[N_ATT_CASES] = { 0 };
        bench_attention_table(att_sel, PR_CUDA_ATTENTION_FFMA, "attention (FFMA), bf16, 32 query / 8 KV heads, HS 128 unless said", bwd_time);
        printf("\n");
        bench_attention_table(att_sel, PR_CUDA_ATTENTION_MMA, "tensor-core attention (MMA), same cases", bwd_time);
        printf("\n");
        bench_attention_table(att_sel, PR_CUDA_ATTENTION_MMA_ATOMIC, "MMA, backward with atomic dQ (not deterministic)", bwd_time);
        printf("\n");
        bench_attention_table(att_sel, PR_CUDA_ATTENTION_WGMMA, "wgmma (sm_90a): the same kernels on Hopper's warpgroup MMA", bwd_time);
    }
    if (be->take_error(be, &err)) { fprintf(stderr, "bench_cuda: %s\n", err.message); return 1; }
    pr_backend_cuda_destroy(be);
    return 0;
}
