/* The header's GEMM beside the system CBLAS on the GEMM shapes of one model's layer, its LM head,
   forward and both backward products, in one run (`make bench-gemm`; needs libopenblas-dev).
   usage: build/bench_gemm [CONFIG (default model/small)] [REPEATS (default 5)] */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include <time.h>
#ifdef PR_BENCH_CBLAS
#include <cblas.h>
#endif

static double now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

typedef struct { const char *name; int ta, tb, M, N, K; } shape;

static void call(int lib, const shape *s, const pr_real *A, const pr_real *B, pr_real *C) {
    int lda = s->ta ? s->M : s->K, ldb = s->tb ? s->K : s->N;
    pr_real beta = (pr_real)s->ta; /* the weight-gradient GEMM accumulates */
    if (lib == 0)
        pr__gemm(s->ta, s->tb, s->M, s->N, s->K, A, lda, B, ldb, beta, C, s->N);
#ifdef PR_BENCH_CBLAS
    else
#ifdef PR_DOUBLE
        cblas_dgemm(
#else
        cblas_sgemm(
#endif
            CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans, s->tb ? CblasTrans : CblasNoTrans,
            s->M, s->N, s->K, 1, A, lda, B, ldb, beta, C, s->N);
#endif
}

/* One warm-up each, then `reps` rounds alternating ours and cblas so that noise
   from a shared host hits both alike; keeps the best time of each (GFLOP/s out). */
static void bench(const shape *s, const pr_real *A, const pr_real *B, pr_real *C, int reps,
                  double *gf) {
    int r, lib, nlib = 1;
    double best[2] = {1e30, 1e30}, flop = 2.0 * s->M * s->N * s->K;
#ifdef PR_BENCH_CBLAS
    nlib = 2;
#endif
    for (r = 0; r <= reps; r++)
        for (lib = 0; lib < nlib; lib++) {
            double t0 = now(), dt;
            call(lib, s, A, B, C);
            dt = now() - t0;
            if (r > 0 && dt < best[lib]) best[lib] = dt;
        }
    gf[0] = flop / best[0] * 1e-9;
    gf[1] = nlib > 1 ? flop / best[1] * 1e-9 : 0;
}

int main(int argc, char **argv) {
    static const int toks[2] = {256, 1024};
    const char *config = argc > 1 ? argv[1] : "model/small";
    pr_config cfg;
    pr_error err;
    if (pr_config_load(&cfg, config, &err)) { fprintf(stderr, "bench_gemm: %s\n", err.message); return 1; }
    const int C_ = cfg.hidden_size, F = cfg.intermediate_size, V = cfg.vocab_size;
    const int QD = cfg.num_attention_heads * cfg.head_dim, KVD = cfg.num_key_value_heads * cfg.head_dim;
    shape sh[64];
    char names[64][48];
    int ns = 0, t, i, reps = argc > 2 ? atoi(argv[2]) : 5;
    double sumratio = 0;
    size_t maxe = 0;
    pr_real *A, *B, *Cm;
    printf("GEMM shapes of %s (hidden %d, q %d, kv %d, MLP %d, vocabulary %d), float%s, best of %d\n", config, C_, QD, KVD, F, V,
           sizeof(pr_real) == 8 ? " (double build)" : "", reps);
    for (t = 0; t < 2; t++) {
        int T = toks[t];
        /* (out, in) of every weight: q, k/v, o, gate and up stacked (one GEMM), down, LM head */
        const int io[6][2] = {{QD, C_}, {KVD, C_}, {C_, QD}, {2 * F, C_}, {C_, F}, {V, C_}};
        for (i = 0; i < 6; i++) {
            int O = io[i][0], In = io[i][1];
            snprintf(names[ns], 48, "fwd T=%d %dx%d", T, O, In);
            sh[ns] = (shape){names[ns], 0, 1, T, O, In}; ns++;   /* out = inp * W^T */
            snprintf(names[ns], 48, "dinp T=%d %dx%d", T, O, In);
            sh[ns] = (shape){names[ns], 0, 0, T, In, O}; ns++;   /* dinp = dout * W */
            snprintf(names[ns], 48, "dW T=%d %dx%d", T, O, In);
            sh[ns] = (shape){names[ns], 1, 0, O, In, T}; ns++;   /* dW += dout^T * inp */
        }
    }
    for (i = 0; i < ns; i++) {
        size_t a = (size_t)sh[i].M * sh[i].K, b = (size_t)sh[i].K * sh[i].N, c = (size_t)sh[i].M * sh[i].N;
        if (a > maxe) maxe = a;
        if (b > maxe) maxe = b;
        if (c > maxe) maxe = c;
    }
    A = malloc(maxe * sizeof *A); B = malloc(maxe * sizeof *B); Cm = malloc(maxe * sizeof *Cm);
    if (!A || !B || !Cm) return 1;
    for (size_t e = 0; e < maxe; e++) {
        int i = (int)(e % 1000003);
        A[e] = (pr_real)((i * 7 % 13) - 6) / 8; B[e] = (pr_real)((i * 5 % 11) - 5) / 8; Cm[e] = 0;
    }
    printf("%-28s %10s %10s %7s\n", "shape (ta,tb) MxNxK", "ours GF/s", "cblas GF/s", "ratio");
    for (i = 0; i < ns; i++) {
        double gf[2], ours, ref;
        bench(&sh[i], A, B, Cm, reps, gf);
        ours = gf[0]; ref = gf[1];
        printf("%-20s (%d,%d) %5dx%5dx%5d %8.1f %10.1f %7.2f\n", sh[i].name, sh[i].ta, sh[i].tb,
               sh[i].M, sh[i].N, sh[i].K, ours, ref, ref > 0 ? ours / ref : 0);
        sumratio += ref > 0 ? ours / ref : 0;
    }
    printf("bench-gemm: mean ours/cblas %.3f over %d shapes\n", sumratio / ns, ns);
    free(A); free(B); free(Cm);
    return 0;
}
