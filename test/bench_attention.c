/* The CPU backend's attention alone, forward and backward, at one model's head shapes, over the
   prefix/suffix splits of `./train --bench` (G segments of S suffix rows over a shared prefix of P
   rows: Phase B's call; P = 0 with one segment of the whole trajectory: the baseline's), in one
   run (`make bench-attention`). FLOPs are the model's count: 4 HS a (query, key) pair forward, 2.5
   times that backward (its five products). Best of REPEATS.
   usage: build/bench_attention [CONFIG (default model/small)] [TOTAL (default 1024)] [G (default 4)] [REPEATS (default 5)] */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "xorshift.h"
#include <time.h>

static double now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static pr_real *uniform(size_t n, uint64_t *rng) {
    pr_real *x = (pr_real *)malloc(sizeof(pr_real) * (n ? n : 1));
    for (size_t i = 0; x && i < n; i++) x[i] = (pr_real)test_uniform(rng);
    return x;
}

/* One cell: best forward and backward seconds of `reps`, and their GF/s. */
static int cell(const pr_backend *be, int NH, int NKV, int HS, int P, int S, int G, int reps) {
    int seg[65];
    for (int g = 0; g <= G; g++) seg[g] = g * S;
    const pr_seq_layout lay = { G, seg, 0, P };
    const size_t N = (size_t)G * S, qd = (size_t)NH * HS, kvd = (size_t)NKV * HS, pk = (size_t)P * kvd;
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    pr_real *q = uniform(N * qd, &rng), *k = uniform(N * kvd, &rng), *v = uniform(N * kvd, &rng), *kp = uniform(pk, &rng),
            *vp = uniform(pk, &rng), *o = uniform(N * qd, &rng), *lse = uniform(N * NH, &rng), *dout = uniform(N * qd, &rng),
            *dq = uniform(N * qd, &rng), *dk = uniform(N * kvd, &rng), *dv = uniform(N * kvd, &rng), *dkp = uniform(pk, &rng),
            *dvp = uniform(pk, &rng);
    pr_real *all[] = { q, k, v, kp, vp, o, lse, dout, dq, dk, dv, dkp, dvp };
    int ok = 1;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ok = ok && all[i];
    if (ok) {
        double pairs = 0, fwd = 1e30, bwd = 1e30;
        for (int g = 0; g < G; g++) pairs += (double)S * P + (double)S * (S + 1) / 2;
        for (int r = 0; r <= reps; r++) {   /* the first a warm-up */
            const double t0 = now();
            pr__cpu_attention_fwd(be, o, lse, q, k, v, kp, vp, &lay, NH, NKV, HS);
            const double t1 = now();
            pr__cpu_attention_bwd(be, dq, dk, dv, dkp, dvp, dout, o, lse, q, k, v, kp, vp, &lay, NH, NKV, HS);
            const double t2 = now();
            if (r && t1 - t0 < fwd) fwd = t1 - t0;
            if (r && t2 - t1 < bwd) bwd = t2 - t1;
        }
        const double flop = 4.0 * pairs * HS * NH;
        printf("%5d/%-5d %3d %10.4f %9.1f %10.4f %9.1f\n", P, S, G, fwd, flop / fwd * 1e-9, bwd, 2.5 * flop / bwd * 1e-9);
    }
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
    if (!ok) fprintf(stderr, "bench_attention: out of memory at P %d, S %d, G %d\n", P, S, G);
    return ok;
}

int main(int argc, char **argv) {
    const char *config = argc > 1 ? argv[1] : "model/small";
    const int total = argc > 2 ? atoi(argv[2]) : 1024, G = argc > 3 ? atoi(argv[3]) : 4, reps = argc > 4 ? atoi(argv[4]) : 5;
    if (total < 6 || total > 65536 || G < 1 || G > 64 || reps < 1) {
        fprintf(stderr, "usage: bench_attention [CONFIG] [TOTAL 6..65536] [G 1..64] [REPEATS >= 1]\n");
        return 2;
    }
    pr_config cfg;
    pr_error err;
    if (pr_config_load(&cfg, config, &err)) { fprintf(stderr, "bench_attention: %s\n", err.message); return 1; }
    const int NH = cfg.num_attention_heads, NKV = cfg.num_key_value_heads, HS = cfg.head_dim;
    printf("attention of %s (%d query heads, %d key/value heads, head dim %d), %s, %d thread(s), best of %d\n", config, NH, NKV,
           HS, sizeof(pr_real) == 8 ? "double" : "float",
#ifdef _OPENMP
           omp_get_max_threads(),
#else
           1,
#endif
           reps);
    printf("%-11s %3s %10s %9s %10s %9s\n", "P/S", "G", "fwd s", "fwd GF/s", "bwd s", "bwd GF/s");
    const pr_backend *be = pr_backend_cpu();
    if (!cell(be, NH, NKV, HS, 0, total, 1, reps)) return 1;   /* the baseline's: one causal sequence */
    const double splits[] = { 1.0 / 6, 0.5, 2.0 / 3, 5.0 / 6 };
    for (int s = 0; s < 4; s++) {
        const int P = (int)(splits[s] * total);
        if (!cell(be, NH, NKV, HS, P, total - P, G, reps)) return 1;
    }
    return 0;
}
