/* bench_cuda — the CUDA backend's GEMMs and attention, measured side by side in one run:
     GEMM: every Llama3-8B projection (forward, and the two GEMMs of its backward) through the
           backend's matmul, beside the best of cuBLASLt's top algorithms for the same problem
           timed here (the ratio ours / best is the issue's >= 85% target);
     attention: forward and backward TFLOP/s at head dim 128, causal over one 8k sequence, and the
           two-region variant (a shared prefix region plus causal suffixes) at 8k rows and keys.
   FLOPs: GEMM 2mnk; attention 4 * pairs * HS * NH forward and 2.5x that backward (FlashAttention's
   convention), pairs = the (query, key) pairs the mask allows. Times: median of --reps runs after
   a warm-up, the device drained around each run. Needs a GPU: `make bench-cuda`. */
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

static double now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
/* median seconds of fn(arg) over reps runs, one warm-up first */
static double median_time(void (*fn)(void *), void *arg) {
    double *t = malloc(sizeof(double) * reps);
    fn(arg);
    cudaDeviceSynchronize();
    be->sync(be);
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        fn(arg);
        cudaDeviceSynchronize();
        be->sync(be);
        t[r] = now() - t0;
    }
    qsort(t, reps, sizeof(double), cmp_double);
    double m = t[reps / 2];
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

typedef struct { void *out, *inp, *dout, *dinp; float *w, *dw; int N, C, OC, which; } mm_args;
static void mm_call(void *arg) {
    mm_args *a = arg;
    if (a->which == 0) be->matmul_fwd(be, a->out, a->inp, a->w, a->N, a->C, a->OC);
    else be->matmul_bwd(be, a->dinp, a->dw, a->dout, a->inp, a->w, a->N, a->C, a->OC);
}

static void bench_gemm(int N) {
    static const struct { const char *name; int C, OC; } shapes[] = {
        { "q_proj", 4096, 4096 }, { "k/v_proj", 4096, 1024 }, { "o_proj", 4096, 4096 },
        { "gate/up_proj", 4096, 14336 }, { "down_proj", 14336, 4096 }, { "lm_head (2k rows)", 4096, 128256 },
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
        float *w = dalloc(sizeof(float) * (size_t)OC * C), *dw = dalloc(sizeof(float) * (size_t)OC * C);
        void *inp = dalloc(2 * (size_t)rows * C), *dinp = dalloc(2 * (size_t)rows * C);
        void *out = dalloc(2 * (size_t)rows * OC), *dout = dalloc(2 * (size_t)rows * OC);
        fill_random_bf16(inp, (size_t)rows * C, 1);
        fill_random_bf16(dout, (size_t)rows * OC, 2);
        fill_random_bf16(dinp, (size_t)rows * C, 3);
        cudaMemset(dw, 0, sizeof(float) * (size_t)OC * C);
        void *wtmp = dalloc(2 * (size_t)OC * C);
        fill_random_bf16(wtmp, (size_t)OC * C, 4);      /* random fp32 weights via bf16 values */
        {
            uint16_t *h = malloc(2 * (size_t)OC * C);
            float *f = malloc(sizeof(float) * (size_t)OC * C);
            cudaMemcpy(h, wtmp, 2 * (size_t)OC * C, cudaMemcpyDeviceToHost);
            for (size_t i = 0; i < (size_t)OC * C; i++) f[i] = pr_bf16_to_f32(h[i]) * 0.02f;
            cudaMemcpy(w, f, sizeof(float) * (size_t)OC * C, cudaMemcpyHostToDevice);
            free(h); free(f);
        }
        be->prepare_weights(be, w, (size_t)OC * C);
        be->sync(be);
        const void *wb = wtmp;                         /* same shape and type as the backend's bf16 copy */
        mm_args a = { out, inp, dout, dinp, w, dw, rows, C, OC, 0 };
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
        be->release(be, w, PR_TIER_DEVICE); be->release(be, dw, PR_TIER_DEVICE); be->release(be, inp, PR_TIER_DEVICE);
        be->release(be, dinp, PR_TIER_DEVICE); be->release(be, out, PR_TIER_DEVICE); be->release(be, dout, PR_TIER_DEVICE);
        be->release(be, wtmp, PR_TIER_DEVICE);
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

/* n_prefix prefix keys, then n_seg segments of len rows each. */
static void bench_attention(const char *label, int n_prefix, int n_seg, int len) {
    const int NH = 32, NKV = 8, HS = 128, N = n_seg * len;
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
        void **pbufs[] = { &a.kp, &a.vp, &a.dkp, &a.dvp };
        for (int i = 0; i < 4; i++) { *pbufs[i] = dalloc(2 * np); fill_random_bf16(*pbufs[i], np, 30 + i); }
    }
    a.lse = dalloc(sizeof(float) * (size_t)N * NH);
    double pairs = (double)n_seg * ((double)len * n_prefix + (double)len * (len + 1) / 2);
    double ffwd = 4 * pairs * HS * NH, fbwd = 2.5 * ffwd;
    a.bwd = 0;
    double tf = median_time(att_call, &a);
    a.bwd = 1;
    double tb = median_time(att_call, &a);
    pr_error err;
    if (be->take_error(be, &err)) printf("attention: %s\n", err.message);
    printf("%-34s %8.1f %8.1f   (%.2f / %.2f ms)\n", label, ffwd / tf / 1e12, fbwd / tb / 1e12, tf * 1e3, tb * 1e3);
    void *all[] = { a.q, a.o, a.dout, a.dq, a.k, a.v, a.dk, a.dv, a.kp, a.vp, a.dkp, a.dvp, a.lse };
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) if (all[i]) be->release(be, all[i], PR_TIER_DEVICE);
    free(seg);
}

/* The tensor-core attention (PR_CUDA_ATTENTION_MMA) beside the FFMA kernels, head dim 128, 32 query
   / 8 KV heads: causal over one 8k sequence, and the two-region shapes of a long-prefix GRPO group
   (prefix 10k, G suffixes of 2k, G = 8 and 32) as one Phase-B microbatch. FLOPs as FlashAttention
   counts them: 4 * (query, key) pairs seen * HS * NH forward, 2.5x that backward. The FFMA kernels
   are timed over at most 3 runs (seconds each at G = 32). */
static void bench_attention_kernels(void) {
    static const struct { const char *label; int n_prefix, n_seg, len; } shapes[] = {
        { "causal, one 8k sequence", 0, 1, 8192 },
        { "two-region: prefix 10k + 8 x 2k", 10240, 8, 2048 },
        { "two-region: prefix 10k + 32 x 2k", 10240, 32, 2048 },
    };
    const int NH = 32, NKV = 8, HS = 128, saved_reps = reps;
    printf("\nattention kernels, bf16, head dim 128, 32 query / 8 KV heads (TF/s)\n");
    printf("%-34s %9s %9s %9s %9s %8s %8s\n", "", "FFMA fwd", "MMA fwd", "FFMA bwd", "MMA bwd", "fwd x", "bwd x");
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        const int n_prefix = shapes[i].n_prefix, n_seg = shapes[i].n_seg, len = shapes[i].len, N = n_seg * len;
        int *seg = malloc(sizeof(int) * (n_seg + 1));
        for (int s = 0; s <= n_seg; s++) seg[s] = s * len;
        att_args a;
        memset(&a, 0, sizeof a);
        a.lay.n_seg = n_seg; a.lay.seg_off = seg; a.lay.pos0 = n_prefix; a.lay.n_prefix = n_prefix;
        a.NH = NH; a.NKV = NKV; a.HS = HS;
        size_t nq = (size_t)N * NH * HS, nk = (size_t)N * NKV * HS, np = (size_t)(n_prefix ? n_prefix : 1) * NKV * HS;
        void **bufs[] = { &a.q, &a.o, &a.dout, &a.dq };
        for (int b = 0; b < 4; b++) { *bufs[b] = dalloc(2 * nq); fill_random_bf16(*bufs[b], nq, 10 + b); }
        void **kbufs[] = { &a.k, &a.v, &a.dk, &a.dv };
        for (int b = 0; b < 4; b++) { *kbufs[b] = dalloc(2 * nk); fill_random_bf16(*kbufs[b], nk, 20 + b); }
        if (n_prefix) {
            a.kp = dalloc(2 * np); fill_random_bf16(a.kp, np, 30);
            a.vp = dalloc(2 * np); fill_random_bf16(a.vp, np, 31);
            a.dkp = dalloc(4 * np); cudaMemset(a.dkp, 0, 4 * np);    /* fp32 accumulators */
            a.dvp = dalloc(4 * np); cudaMemset(a.dvp, 0, 4 * np);
        }
        a.lse = dalloc(sizeof(float) * (size_t)N * NH);
        const double pairs = (double)n_seg * ((double)len * n_prefix + (double)len * (len + 1) / 2);
        const double ffwd = 4 * pairs * HS * NH, fbwd = 2.5 * ffwd;
        double t[2][2];                                   /* [kind][fwd, bwd] */
        pr_error err;
        for (int kind = 0; kind < 2; kind++) {
            if (pr_backend_cuda_set_attention(be, kind ? PR_CUDA_ATTENTION_MMA : PR_CUDA_ATTENTION_FFMA, &err)) {
                printf("attention kernels: %s\n", err.message);
                t[kind][0] = t[kind][1] = NAN;
                continue;
            }
            reps = kind ? saved_reps : (saved_reps < 3 ? saved_reps : 3);
            a.bwd = 0;
            t[kind][0] = median_time(att_call, &a);      /* the forward's out and lse feed the backward */
            a.bwd = 1;
            t[kind][1] = median_time(att_call, &a);
            if (be->take_error(be, &err)) printf("attention kernels: %s\n", err.message);
        }
        reps = saved_reps;
        printf("%-34s %9.1f %9.1f %9.1f %9.1f %8.2f %8.2f\n", shapes[i].label, ffwd / t[0][0] / 1e12, ffwd / t[1][0] / 1e12,
               fbwd / t[0][1] / 1e12, fbwd / t[1][1] / 1e12, t[0][0] / t[1][0], t[0][1] / t[1][1]);
        void *all[] = { a.q, a.o, a.dout, a.dq, a.k, a.v, a.dk, a.dv, a.kp, a.vp, a.dkp, a.dvp, a.lse };
        for (size_t b = 0; b < sizeof all / sizeof *all; b++) if (all[b]) be->release(be, all[b], PR_TIER_DEVICE);
        free(seg);
    }
    pr_backend_cuda_set_attention(be, PR_CUDA_ATTENTION_FFMA, NULL);
}

int main(int argc, char **argv) {
    int N = 12288;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rows")) N = atoi(argv[i + 1]);
    }
    if (reps < 1) reps = 1;
    pr_error err;
    if (pr_backend_cuda_create(&be, 0, &err)) { fprintf(stderr, "bench_cuda: %s\n", err.message); return 1; }
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("bench_cuda on %s (%d SMs), median of %d runs\n\n", prop.name, prop.multiProcessorCount, reps);
    bench_gemm(N);
    printf("attention, bf16, head dim 128, 32 query / 8 KV heads    fwd TF/s bwd TF/s\n");
    bench_attention("causal, one 8k sequence", 0, 1, 8192);
    bench_attention("two-region: prefix 6k + 4 x 512", 6144, 4, 512);
    bench_attention("two-region: prefix 2k + 4 x 1.5k", 2048, 4, 1536);
    bench_attention_kernels();
    if (be->take_error(be, &err)) { fprintf(stderr, "bench_cuda: %s\n", err.message); return 1; }
    pr_backend_cuda_destroy(be);
    return 0;
}
