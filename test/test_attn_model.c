/* The tile-level model of the tensor-core attention (test/attn_model.h) against an independent
   naive reference in double precision, over ragged layouts, GQA ratios, head dims and tile sizes;
   planted bugs that must fail; bitwise determinism of the chunked prefix reduction; and the
   library's own CPU attention (this program is built with PR_DOUBLE), which ties the conventions
   (natural-log lse, dkp summed over every segment, GQA h / (NH/NKV)) to the library's.

   Inputs are drawn, rounded to bf16 and given to both sides. The backward's O and lse are the
   reference's, rounded to bf16 and fp32, so that the backward is tested on its own. Gradients
   start from nonzero contents and the increments (result - start) are compared.

   TOLERANCE, per tensor: |model - ref| <= atol + rtol * |ref output|, u = 2^-8 (bf16's unit
   roundoff). The model's error is dominated by the bf16 rounding of the operands it makes itself:
     O  = sum_j bf16(P_j) V_j / l:    |error| <= u * sum_j P_j |V_j| / l        = u * M_o
     dV = sum_r bf16(P_rj) dO_r:      |error| <= u * sum_r P_rj |dO_r|           = u * M_dv
     dK = scale sum_r bf16(dS_rj) Q_r:|error| <= u * scale sum_r |dS_rj| |Q_r|   = u * M_dk
     dQ = scale sum_j bf16(dS_rj) K_j:|error| <= u * scale sum_j |dS_rj| |K_j|   = u * M_dq
   (the same for dkp, dvp), M_T being the largest such absolute sum over the tensor, computed by the
   reference beside each value. atol = 1.25 u M_T: the 0.25 covers the fp32 parts (a score's sum of
   HS products, exp2f, the sums over keys or rows), a few 2^-24 per term: even their worst case,
   about 3e-4 relative at HS 128, is under 0.25 u ~ 1e-3.
   rtol = u for bf16 outputs (their one final rounding, of start + increment), 2^-23 for fp32 ones.
   lse has no bf16 step: atol = 2^-24 (HS M_s + keys + 2|lse|), M_s the largest scale * sum_d
   |q_d k_d| (a score's fp32 sum), keys for the fp32 sum l, 2|lse| for the final scaling.
   The error envelope printed is the worst |error| / max |ref| per tensor: what GPU tolerances
   can be set from. */
#ifndef PR_DOUBLE
#error "build with -DPR_DOUBLE: the library's attention is compared in double precision here"
#endif
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "attn_model.h"
#include "harness.h"
#include "xorshift.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define U_BF16 0.00390625           /* 2^-8 */
#define U_FP32 5.9604644775390625e-8 /* 2^-24 */

enum { T_O, T_LSE, T_DQ, T_DK, T_DV, T_DKP, T_DVP, NT };
static const char *tensor_name[NT] = { "o", "lse", "dq", "dk", "dv", "dkp", "dvp" };

static uint64_t rng = 0x9E3779B97F4A7C15ull;
/* n bf16 values in (-a, a) */
static float *random_bf16(size_t n, double a) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = am_bf16_round((float)(a * test_uniform(&rng)));
    return x;
}
static float *copy_f(const float *x, size_t n) {
    float *y = malloc(sizeof(float) * (n ? n : 1));
    memcpy(y, x, sizeof(float) * n);
    return y;
}

/* ---------------------------------------------------------------- problems */
typedef struct {
    const char *name;
    int n_seg, lens[8], n_prefix, NH, NKV, HS;
} shape;

typedef struct {
    shape sh;
    int seg_off[9], N, max_keys;
    am_layout lay;
    size_t n[NT];                     /* elements of each tensor */
    float *q, *k, *v, *kp, *vp, *dout; /* inputs, bf16 values: (N,NH*HS), (N,NKV*HS) x2, (P,NKV*HS) x2, (N,NH*HS) */
    float *out_b, *lse_b;             /* the backward's O and lse: the reference's, as bf16 and fp32 */
    float *start[NT];                 /* dq .. dvp: the outputs' contents before the backward adds */
    double *ref[NT], *mag[NT];        /* reference values (increments for dq .. dvp) and magnitudes */
    double atol[NT], rtol[NT], scale[NT];
} problem;

/* Key j of a row of segment starting at seg0: prefix row j of kp, or row seg0 + j - P of k. */
static const float *key_row(const float *kp, const float *k, int j, int P, int seg0, int kvd, int hk) {
    return j < P ? kp + (size_t)j * kvd + hk : k + (size_t)(seg0 + j - P) * kvd + hk;
}

/* The naive reference forward in double: every row over every key it sees. */
static void reference_forward(problem *p) {
    const shape *s = &p->sh;
    const int P = s->n_prefix, HS = s->HS, qd = s->NH * HS, kvd = s->NKV * HS, group = s->NH / s->NKV;
    const double scale = 1.0 / sqrt((double)HS);
    double *sc = malloc(sizeof(double) * (size_t)(p->max_keys + 1));
    for (int g = 0; g < s->n_seg; g++)
        for (int h = 0; h < s->NH; h++)
            for (int r = p->seg_off[g]; r < p->seg_off[g + 1]; r++) {
                const int seg0 = p->seg_off[g], nk = P + r - seg0 + 1, hk = (h / group) * HS;
                const float *qr = p->q + (size_t)r * qd + (size_t)h * HS;
                double m = -INFINITY, l = 0, ms = 0;
                for (int j = 0; j < nk; j++) {
                    const float *kj = key_row(p->kp, p->k, j, P, seg0, kvd, hk);
                    double dot = 0, adot = 0;
                    for (int d = 0; d < HS; d++) dot += (double)qr[d] * kj[d], adot += fabs((double)qr[d] * kj[d]);
                    sc[j] = dot * scale;
                    if (sc[j] > m) m = sc[j];
                    if (adot * scale > ms) ms = adot * scale;
                }
                for (int j = 0; j < nk; j++) l += exp(sc[j] - m);
                double *o = p->ref[T_O] + (size_t)r * qd + (size_t)h * HS, *mo = p->mag[T_O] + (size_t)r * qd + (size_t)h * HS;
                for (int d = 0; d < HS; d++) o[d] = mo[d] = 0;
                for (int j = 0; j < nk; j++) {
                    const double pj = exp(sc[j] - m) / l;
                    const float *vj = key_row(p->vp, p->v, j, P, seg0, kvd, hk);
                    for (int d = 0; d < HS; d++) o[d] += pj * vj[d], mo[d] += pj * fabs((double)vj[d]);
                }
                p->ref[T_LSE][(size_t)r * s->NH + h] = m + log(l);
                p->mag[T_LSE][(size_t)r * s->NH + h] = ms;
            }
    free(sc);
}

/* The naive reference backward in double from the backward's O and lse (out_b, lse_b):
   increments of dq, dk, dv, dkp, dvp, and beside each the sum of the absolute values of the terms
   that the model rounds to bf16 (P for dv, dS for dq and dk). */
static void reference_backward(problem *p) {
    const shape *s = &p->sh;
    const int P = s->n_prefix, HS = s->HS, qd = s->NH * HS, kvd = s->NKV * HS, group = s->NH / s->NKV;
    const double scale = 1.0 / sqrt((double)HS);
    for (int t = T_DQ; t < NT; t++)
        for (size_t e = 0; e < p->n[t]; e++) p->ref[t][e] = p->mag[t][e] = 0;
    for (int g = 0; g < s->n_seg; g++)
        for (int h = 0; h < s->NH; h++)
            for (int r = p->seg_off[g]; r < p->seg_off[g + 1]; r++) {
                const int seg0 = p->seg_off[g], nk = P + r - seg0 + 1, hk = (h / group) * HS;
                const size_t qo = (size_t)r * qd + (size_t)h * HS;
                const float *qr = p->q + qo, *dor = p->dout + qo, *orow = p->out_b + qo;
                const double lse = p->lse_b[(size_t)r * s->NH + h];
                double D = 0;
                for (int d = 0; d < HS; d++) D += (double)dor[d] * orow[d];
                for (int j = 0; j < nk; j++) {
                    const float *kj = key_row(p->kp, p->k, j, P, seg0, kvd, hk), *vj = key_row(p->vp, p->v, j, P, seg0, kvd, hk);
                    double dot = 0, dp = 0;
                    for (int d = 0; d < HS; d++) dot += (double)qr[d] * kj[d], dp += (double)dor[d] * vj[d];
                    const double pj = exp(dot * scale - lse), ds = pj * (dp - D);
                    const size_t ko = j < P ? (size_t)j * kvd + hk : (size_t)(seg0 + j - P) * kvd + hk;
                    const int tk = j < P ? T_DKP : T_DK, tv = j < P ? T_DVP : T_DV;
                    for (int d = 0; d < HS; d++) {
                        p->ref[tv][ko + d] += pj * dor[d];
                        p->mag[tv][ko + d] += pj * fabs((double)dor[d]);
                        p->ref[tk][ko + d] += scale * ds * qr[d];
                        p->mag[tk][ko + d] += scale * fabs(ds * qr[d]);
                        p->ref[T_DQ][qo + d] += scale * ds * kj[d];
                        p->mag[T_DQ][qo + d] += scale * fabs(ds * kj[d]);
                    }
                }
            }
}

static double max_abs(const double *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}

static problem *make_problem(const shape *s) {
    problem *p = calloc(1, sizeof *p);
    p->sh = *s;
    for (int g = 0; g < s->n_seg; g++) {
        p->seg_off[g + 1] = p->seg_off[g] + s->lens[g];
        if (s->n_prefix + s->lens[g] > p->max_keys) p->max_keys = s->n_prefix + s->lens[g];
    }
    p->N = p->seg_off[s->n_seg];
    p->lay.n_seg = s->n_seg, p->lay.seg_off = p->seg_off, p->lay.n_prefix = s->n_prefix;
    const size_t nq = (size_t)p->N * s->NH * s->HS, nk = (size_t)p->N * s->NKV * s->HS, npk = (size_t)s->n_prefix * s->NKV * s->HS;
    const size_t n[NT] = { nq, (size_t)p->N * s->NH, nq, nk, nk, npk, npk };
    memcpy(p->n, n, sizeof n);
    /* q, k at 2.75: scores q.k/sqrt(HS) with std 2.75^2/3 ~ 2.5, a peaked softmax */
    p->q = random_bf16(nq, 2.75), p->k = random_bf16(nk, 2.75), p->v = random_bf16(nk, 1);
    p->kp = random_bf16(npk, 2.75), p->vp = random_bf16(npk, 1), p->dout = random_bf16(nq, 1);
    for (int t = 0; t < NT; t++) {
        p->ref[t] = malloc(sizeof(double) * (p->n[t] ? p->n[t] : 1));
        p->mag[t] = malloc(sizeof(double) * (p->n[t] ? p->n[t] : 1));
    }
    reference_forward(p);
    p->out_b = malloc(sizeof(float) * (nq ? nq : 1));
    p->lse_b = malloc(sizeof(float) * (n[T_LSE] ? n[T_LSE] : 1));
    for (size_t e = 0; e < nq; e++) p->out_b[e] = am_bf16_round((float)p->ref[T_O][e]);
    for (size_t e = 0; e < n[T_LSE]; e++) p->lse_b[e] = (float)p->ref[T_LSE][e];
    reference_backward(p);
    /* tolerances (see the top comment), scales, and starting contents at half each tensor's scale */
    for (int t = 0; t < NT; t++) {
        p->scale[t] = max_abs(p->ref[t], p->n[t]);
        p->atol[t] = 1.25 * U_BF16 * max_abs(p->mag[t], p->n[t]);
        p->rtol[t] = t == T_DKP || t == T_DVP ? 2 * U_FP32 : U_BF16;
        if (t >= T_DQ) {
            p->start[t] = random_bf16(p->n[t], 0.5 * p->scale[t]);
            if (t >= T_DKP) for (size_t e = 0; e < p->n[t]; e++) p->start[t][e] *= (float)(1 + test_uniform(&rng) / 64); /* fp32, not bf16 */
        }
    }
    p->atol[T_LSE] = U_FP32 * (s->HS * max_abs(p->mag[T_LSE], n[T_LSE]) + p->max_keys + 2 * p->scale[T_LSE]);
    p->rtol[T_LSE] = 0;
    return p;
}

static void free_problem(problem *p) {
    free(p->q); free(p->k); free(p->v); free(p->kp); free(p->vp); free(p->dout); free(p->out_b); free(p->lse_b);
    for (int t = 0; t < NT; t++) free(p->start[t]), free(p->ref[t]), free(p->mag[t]);
    free(p);
}

/* ---------------------------------------------------------------- the model against the reference */
typedef struct {
    double err[NT];    /* worst |model - ref| / max |ref| */
    double ratio[NT];  /* worst |model - ref| / tolerance: <= 1 passes (NaN: infinite) */
    double l2[NT];     /* ||model - ref|| / ||ref||, the GPU tests' measure */
    float *got[NT];    /* the model's outputs (kept for bitwise comparisons) */
} result;

/* err / tol, with NaN (a NaN output) counted as infinitely far */
static double over(double err, double tol) {
    if (err != err) return INFINITY;
    if (err == 0) return 0;
    return tol > 0 ? err / tol : INFINITY;
}

/* Worst error of tensor t: got is the output, start its contents before the call (none for o, lse). */
static void compare(result *res, const problem *p, int t) {
    double worst = 0, ratio = 0, num = 0, den = 0;
    for (size_t e = 0; e < p->n[t]; e++) {
        const double s0 = p->start[t] ? p->start[t][e] : 0, inc = (double)res->got[t][e] - s0;
        const double err = fabs(inc - p->ref[t][e]), tol = p->atol[t] + p->rtol[t] * fabs(s0 + p->ref[t][e]);
        const double r = over(err, tol), w = over(err, 1);
        ratio = r > ratio ? r : ratio;
        worst = w > worst ? w : worst;
        num += w * w, den += p->ref[t][e] * p->ref[t][e];
    }
    res->l2[t] = den > 0 ? sqrt(num / den) : sqrt(num);
    res->err[t] = p->scale[t] > 0 ? worst / p->scale[t] : worst;
    res->ratio[t] = ratio;
}

static void free_result(result *res) {
    for (int t = 0; t < NT; t++) free(res->got[t]), res->got[t] = NULL;
}

/* Runs the model forward (on the bf16 inputs) and backward (on the reference's O and lse, into
   copies of the starting contents) and compares every tensor. Returns the worst ratio. */
static double run_model(result *res, const problem *p, const am_opts *o) {
    const shape *s = &p->sh;
    memset(res, 0, sizeof *res);
    res->got[T_O] = malloc(sizeof(float) * (p->n[T_O] ? p->n[T_O] : 1));
    res->got[T_LSE] = malloc(sizeof(float) * (p->n[T_LSE] ? p->n[T_LSE] : 1));
    for (int t = T_DQ; t < NT; t++) res->got[t] = copy_f(p->start[t], p->n[t]);
    int rc = am_attention_fwd(res->got[T_O], res->got[T_LSE], p->q, p->k, p->v, p->kp, p->vp, &p->lay, s->NH, s->NKV,
                              s->HS, o);
    rc |= am_attention_bwd(res->got[T_DQ], res->got[T_DK], res->got[T_DV], res->got[T_DKP], res->got[T_DVP], p->dout,
                           p->out_b, p->lse_b, p->q, p->k, p->v, p->kp, p->vp, &p->lay, s->NH, s->NKV, s->HS, o);
    CHECK(rc == 0, "%s: the model refused the call", s->name);
    double worst = 0;
    for (int t = 0; t < NT; t++) {
        compare(res, p, t);
        worst = res->ratio[t] > worst ? res->ratio[t] : worst;
    }
    return worst;
}

/* ---------------------------------------------------------------- the cases */
/* P in {0, 1, 63, 64, 65, a few hundred}; S = 1; lengths off every tile; packed and padded; GQA
   1, 2, 4, 8 and 6/3; head dims 16 .. 128. */
static const shape shapes[] = {
    { "S=1 P=0 gqa1 hs64", 1, { 1 }, 0, 4, 4, 64 },
    { "phaseA 150 gqa4 hs64", 1, { 150 }, 0, 8, 2, 64 },
    { "baseline padded 3x70 hs32", 3, { 70, 70, 70 }, 0, 4, 1, 32 },
    { "P=1 S=1 gqa1 hs64", 1, { 1 }, 1, 4, 4, 64 },
    { "P=1 packed gqa2 hs32", 3, { 1, 17, 66 }, 1, 4, 2, 32 },
    { "P=63 packed gqa8 hs64", 5, { 1, 64, 3, 100, 17 }, 63, 8, 1, 64 },
    { "P=64 padded 4x65 gqa2 hs16", 4, { 65, 65, 65, 65 }, 64, 4, 2, 16 },
    { "P=65 packed 6/3 hs32", 3, { 33, 1, 80 }, 65, 6, 3, 32 },
    { "P=129 packed gqa2 hs32", 5, { 1, 1, 1, 63, 65 }, 129, 4, 2, 32 },
    { "P=300 packed gqa2 hs64", 5, { 5, 37, 64, 12, 90 }, 300, 4, 2, 64 },
    { "P=257 8 segs gqa1 hs32", 8, { 9, 10, 11, 12, 13, 14, 15, 16 }, 257, 4, 4, 32 },
    { "P=200 S=130 gqa4 hs16", 1, { 130 }, 200, 4, 1, 16 },
    { "P=0 S=60 gqa1 hs128", 1, { 60 }, 0, 2, 2, 128 },
    { "P=70 packed gqa2 hs128", 2, { 20, 45 }, 70, 2, 1, 128 },
};
#define NSHAPES (int)(sizeof shapes / sizeof *shapes)
static const shape cpu_shapes[] = {
    { "P=3 packed gqa2 hs6", 3, { 1, 17, 40 }, 3, 4, 2, 6 },
    { "P=64 padded 2x70 hs20", 2, { 70, 70 }, 64, 2, 1, 20 },
    { "P=70 packed gqa2 hs130", 2, { 20, 45 }, 70, 2, 1, 130 },
    { "P=40 packed gqa4 hs272", 3, { 5, 33, 18 }, 40, 4, 1, 272 },
    { "P=0 S=90 gqa1 hs260", 1, { 90 }, 0, 2, 2, 260 },
};
/* the cases the controls, the determinism and the library checks use */
enum { PHASE_A = 1, PADDED_BASELINE = 2, GQA8_P63 = 5, P65_6_3 = 7, P300 = 9, P257 = 10, P200 = 11, HS128_P70 = 13 };

/* Tile settings: the kernels' defaults, then others that must not change correctness. */
static const am_opts tilings[] = {
    { .br = 64, .bc = 64, .br_b = 64, .bc_b = 64 },
    { .br = 16, .bc = 16, .br_b = 16, .bc_b = 16 },
    { .br = 32, .bc = 128, .br_b = 128, .bc_b = 32 },
    { .br = 128, .bc = 16, .br_b = 16, .bc_b = 128, .prefix_blocks = 7 },   /* and another chunk count */
};
#define NTILINGS (int)(sizeof tilings / sizeof *tilings)

static void print_row(const char *name, const double *x) {
    printf("  %-28s", name);
    for (int t = 0; t < NT; t++) printf(" %8.1e", x[t]);
    printf("\n");
}

/* Every shape at every tiling: within tolerance. Prints the envelope (worst over the tilings). */
static void test_envelope(problem **probs) {
    double all_err[NT] = { 0 }, all_ratio[NT] = { 0 }, all_l2[NT] = { 0 };
    printf("error envelope: worst |model - ref| / max|ref| per tensor, over %d tilings\n", NTILINGS);
    printf("  %-28s", "case");
    for (int t = 0; t < NT; t++) printf(" %8s", tensor_name[t]);
    printf("   chunks\n");
    for (int i = 0; i < NSHAPES; i++) {
        const problem *p = probs[i];
        double err[NT] = { 0 };
        for (int k = 0; k < NTILINGS; k++) {
            result res;
            run_model(&res, p, &tilings[k]);
            for (int t = 0; t < NT; t++) {
                if (!p->n[t]) continue;
                CHECK(res.ratio[t] <= 1, "%s, tiles %d/%d/%d/%d: %s off by %.2f x its tolerance", p->sh.name,
                      tilings[k].br, tilings[k].bc, tilings[k].br_b, tilings[k].bc_b, tensor_name[t], res.ratio[t]);
                if (!(res.err[t] <= err[t])) err[t] = res.err[t];
                if (!(res.ratio[t] <= all_ratio[t])) all_ratio[t] = res.ratio[t];
                if (!(res.l2[t] <= all_l2[t])) all_l2[t] = res.l2[t];
            }
            free_result(&res);
        }
        printf("  %-28s", p->sh.name);
        for (int t = 0; t < NT; t++) p->n[t] ? printf(" %8.1e", err[t]) : printf(" %8s", "-");
        printf("   %d\n", am_prefix_chunks(&p->lay, p->sh.NKV, NULL));
        for (int t = 0; t < NT; t++) all_err[t] = err[t] > all_err[t] ? err[t] : all_err[t];
    }
    print_row("worst err / max|ref|", all_err);
    print_row("worst ||err|| / ||ref||", all_l2);
    print_row("worst err / tolerance", all_ratio);
}

/* ---------------------------------------------------------------- negative controls */
typedef struct { const char *what; am_fault fault; int shape; int must_fail; } control;

static void test_controls(problem **probs) {
    const control controls[] = {
        { "causal mask off by one (+1)", AM_FAULT_CAUSAL_PLUS_ONE, PHASE_A, 1 },
        { "causal mask off by one (-1)", AM_FAULT_CAUSAL_MINUS_ONE, P200, 1 },
        { "prefix tail tile dropped", AM_FAULT_DROP_PREFIX_TAIL, P65_6_3, 1 },
        { "prefix tail tile dropped", AM_FAULT_DROP_PREFIX_TAIL, P300, 1 },
        { "wrong GQA KV head (h % NKV)", AM_FAULT_KV_HEAD_MOD, PHASE_A, 1 },
        { "wrong GQA KV head (h % NKV)", AM_FAULT_KV_HEAD_MOD, P65_6_3, 1 },
        { "last prefix chunk skipped", AM_FAULT_SKIP_LAST_CHUNK, P300, 1 },
        { "last prefix chunk skipped", AM_FAULT_SKIP_LAST_CHUNK, P257, 1 },
        { "P, dS unrounded (not a bug)", AM_FAULT_P_DS_FP32, P300, 0 },
        { "P, dS unrounded (not a bug)", AM_FAULT_P_DS_FP32, HS128_P70, 0 },
    };
    printf("negative controls: worst |model - ref| / tolerance per tensor (> 1 fails)\n");
    printf("  %-28s", "planted fault, on case");
    for (int t = 0; t < NT; t++) printf(" %8s", tensor_name[t]);
    printf("\n");
    for (size_t i = 0; i < sizeof controls / sizeof *controls; i++) {
        const control *c = &controls[i];
        const problem *p = probs[c->shape];
        am_opts o = { 0 };
        o.fault = c->fault;
        if (c->fault == AM_FAULT_SKIP_LAST_CHUNK)
            CHECK(am_prefix_chunks(&p->lay, p->sh.NKV, &o) >= 2, "%s: needs two chunks", p->sh.name);
        result res;
        double worst = run_model(&res, p, &o);
        if (c->must_fail) CHECK(worst > 1, "%s on %s: not detected (%.2f x tolerance)", c->what, p->sh.name, worst);
        else CHECK(worst <= 1, "%s on %s: outside the tolerance (%.2f x)", c->what, p->sh.name, worst);
        printf("  %-28s", c->what);
        for (int t = 0; t < NT; t++) p->n[t] ? printf(" %8.1e", res.ratio[t]) : printf(" %8s", "-");
        printf("   %s: %s\n", p->sh.name, worst > 1 ? "FAILS" : "passes");
        free_result(&res);
    }
}

/* ---------------------------------------------------------------- rows that see nothing */
/* A query row that sees no key must give out 0, lse +inf and P = 0 in the backward, never NaN:
   the m = -inf path of the online softmax. No correct layout has such a row (every row sees
   itself), so the fault that hides a row's own key makes one: the first row of each segment
   without a prefix. The backward runs on the model's own out and lse. */
static void test_empty_rows(const problem *p, const am_opts *tiles) {
    const shape *s = &p->sh;
    am_opts o = *tiles;
    o.fault = AM_FAULT_CAUSAL_MINUS_ONE;
    float *out = malloc(sizeof(float) * p->n[T_O]), *lse = malloc(sizeof(float) * p->n[T_LSE]);
    float *dq = copy_f(p->start[T_DQ], p->n[T_DQ]), *dk = copy_f(p->start[T_DK], p->n[T_DK]), *dv = copy_f(p->start[T_DV], p->n[T_DV]);
    int rc = am_attention_fwd(out, lse, p->q, p->k, p->v, NULL, NULL, &p->lay, s->NH, s->NKV, s->HS, &o);
    rc |= am_attention_bwd(dq, dk, dv, NULL, NULL, p->dout, out, lse, p->q, p->k, p->v, NULL, NULL, &p->lay, s->NH,
                           s->NKV, s->HS, &o);
    int empty_ok = 1, finite = 1;
    for (int r = 0; r < p->N; r++) {
        int first = 0;
        for (int g = 0; g < s->n_seg; g++) first |= r == p->seg_off[g];
        for (int h = 0; h < s->NH; h++) {
            const float l = lse[(size_t)r * s->NH + h];
            empty_ok &= first ? l == INFINITY : isfinite(l);
            for (int d = 0; d < s->HS; d++) {
                const float x = out[((size_t)r * s->NH + h) * s->HS + d];
                empty_ok &= !first || x == 0.0f;
                finite &= isfinite(x) && isfinite(dq[((size_t)r * s->NH + h) * s->HS + d]);
            }
        }
    }
    for (size_t e = 0; e < p->n[T_DK]; e++) finite &= isfinite(dk[e]) && isfinite(dv[e]);
    CHECK(rc == 0 && empty_ok && finite, "%s, tiles %d/%d: rows that see nothing: out 0 and lse +inf %s, all else finite %s",
          s->name, o.br, o.bc, empty_ok ? "yes" : "NO", finite ? "yes" : "NO");
    free(out); free(lse); free(dq); free(dk); free(dv);
}

/* ---------------------------------------------------------------- determinism */
static int same_bits(const float *a, const float *b, size_t n) { return !memcmp(a, b, sizeof(float) * n); }
static size_t count_diff(const float *a, const float *b, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += memcmp(a + i, b + i, sizeof(float)) != 0;
    return c;
}

/* Twice with the rule's chunk count: the same bits. With another chunk count: dq, dk, dv the same
   bits (own key tiles are not chunked), dkp, dvp other bits, still within tolerance. */
static void test_determinism(const problem *p) {
    am_opts rule = { 0 }, other = { 0 };
    other.prefix_blocks = 1;   /* one chunk */
    const int c1 = am_prefix_chunks(&p->lay, p->sh.NKV, &rule), c2 = am_prefix_chunks(&p->lay, p->sh.NKV, &other);
    CHECK(c1 >= 2 && c2 == 1, "%s: chunk counts %d and %d", p->sh.name, c1, c2);
    result a, b, x;
    run_model(&a, p, &rule);
    run_model(&b, p, &rule);
    run_model(&x, p, &other);
    int same = 1;
    for (int t = 0; t < NT; t++) same &= same_bits(a.got[t], b.got[t], p->n[t]);
    CHECK(same, "%s: two runs differ", p->sh.name);
    for (int t = T_DQ; t <= T_DV; t++)
        CHECK(same_bits(a.got[t], x.got[t], p->n[t]), "%s: %s depends on the prefix chunk count", p->sh.name, tensor_name[t]);
    printf("determinism on %s: two runs with C=%d bitwise equal: %s\n", p->sh.name, c1, same ? "yes" : "NO");
    for (int t = T_DKP; t <= T_DVP; t++) {
        size_t nd = count_diff(a.got[t], x.got[t], p->n[t]);
        double maxd = 0;
        for (size_t e = 0; e < p->n[t]; e++) {
            double d = fabs((double)a.got[t][e] - x.got[t][e]);
            maxd = d > maxd ? d : maxd;
        }
        CHECK(nd > 0, "%s: %s has the same bits with C=%d and C=%d", p->sh.name, tensor_name[t], c1, c2);
        CHECK(x.ratio[t] <= 1, "%s: %s with C=%d off by %.2f x its tolerance", p->sh.name, tensor_name[t], c2, x.ratio[t]);
        printf("  %s with C=%d vs C=%d: %zu of %zu elements differ, by at most %.1e of max|ref| "
               "(err/tol %.2f and %.2f)\n", tensor_name[t], c2, c1, nd, p->n[t], maxd / p->scale[t], x.ratio[t], a.ratio[t]);
    }
    free_result(&a);
    free_result(&b);
    free_result(&x);
}

/* ---------------------------------------------------------------- the library's CPU attention */
static double *to_double(const float *x, size_t n) {
    double *y = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) y[i] = x[i];
    return y;
}
/* worst |a - b| / max|b| */
static double rel_worst(const double *a, const double *b, size_t n) {
    double w = 0, s = max_abs(b, n);
    for (size_t i = 0; i < n; i++) {
        const double e = over(fabs(a[i] - b[i]), 1);
        w = e > w ? e : w;
    }
    return s > 0 ? w / s : w;
}

/* The library's double CPU attention on the same inputs: its forward and backward agree with the
   reference to double rounding, and (with_model) the model is within tolerance of it. */
static void test_library(const problem *p, int with_model) {
    const shape *s = &p->sh;
    const pr_backend *be = pr_backend_cpu();
    pr_seq_layout lay = { s->n_seg, p->seg_off, s->n_prefix, s->n_prefix };
    double *q = to_double(p->q, p->n[T_O]), *k = to_double(p->k, p->n[T_DK]), *v = to_double(p->v, p->n[T_DV]);
    double *kp = to_double(p->kp, p->n[T_DKP]), *vp = to_double(p->vp, p->n[T_DVP]), *dout = to_double(p->dout, p->n[T_O]);
    double *lib[NT];
    lib[T_O] = malloc(sizeof(double) * p->n[T_O]);
    lib[T_LSE] = malloc(sizeof(double) * p->n[T_LSE]);
    be->attention_fwd(be, lib[T_O], lib[T_LSE], q, k, v, s->n_prefix ? kp : NULL, s->n_prefix ? vp : NULL, &lay,
                      s->NH, s->NKV, s->HS);
    /* the backward from the same O and lse as the model's, into the same starting contents */
    double *out = to_double(p->out_b, p->n[T_O]), *lse = to_double(p->lse_b, p->n[T_LSE]);
    for (int t = T_DQ; t < NT; t++) lib[t] = to_double(p->start[t], p->n[t]);
    be->attention_bwd(be, lib[T_DQ], lib[T_DK], lib[T_DV], s->n_prefix ? lib[T_DKP] : NULL, s->n_prefix ? lib[T_DVP] : NULL,
                      dout, out, lse, q, k, v, s->n_prefix ? kp : NULL, s->n_prefix ? vp : NULL, &lay, s->NH, s->NKV, s->HS);
    for (int t = T_DQ; t < NT; t++)
        for (size_t e = 0; e < p->n[t]; e++) lib[t][e] -= p->start[t][e];
    /* the model against the library with the same tolerances */
    result res;
    if (with_model) run_model(&res, p, NULL);
    double worst_lib = 0, worst_model = 0;
    for (int t = 0; t < NT; t++) {
        if (!p->n[t]) continue;
        double e = rel_worst(lib[t], p->ref[t], p->n[t]);
        CHECK(e <= 1e-12, "%s: library %s vs reference %.2e of max|ref|", s->name, tensor_name[t], e);
        worst_lib = e > worst_lib ? e : worst_lib;
        if (!with_model) continue;
        double ratio = 0;
        for (size_t i = 0; i < p->n[t]; i++) {
            const double s0 = p->start[t] ? p->start[t][i] : 0, err = fabs((double)res.got[t][i] - s0 - lib[t][i]);
            const double r = over(err, p->atol[t] + p->rtol[t] * fabs(s0 + lib[t][i]));
            ratio = r > ratio ? r : ratio;
        }
        CHECK(ratio <= 1, "%s: model %s vs library %.2f x tolerance", s->name, tensor_name[t], ratio);
        worst_model = ratio > worst_model ? ratio : worst_model;
    }
    if (with_model) {
        printf("library CPU attention on %s: vs reference %.1e of max|ref|; model vs library %.2f x tolerance\n",
               s->name, worst_lib, worst_model);
        free_result(&res);
    } else
        printf("library CPU attention on %s: vs reference %.1e of max|ref|\n", s->name, worst_lib);
    for (int t = 0; t < NT; t++) free(lib[t]);
    free(q); free(k); free(v); free(kp); free(vp); free(dout); free(out); free(lse);
}

/* ---------------------------------------------------------------- small checks */
static void test_bf16_round(void) {
    const float special[] = { 0.0f, -0.0f, 1.0f, 1.00390625f /* tie, to even: 1 */, 1.01171875f /* tie, to even: up */,
                              3.0e38f /* rounds to inf */, 1e-40f /* subnormal */, INFINITY, -INFINITY };
    int ok = 1;
    for (size_t i = 0; i < sizeof special / sizeof *special; i++)
        ok &= am_bf16_round(special[i]) == pr_bf16_to_f32(pr_f32_to_bf16(special[i]));
    for (int i = 0; i < 100000; i++) {
        uint32_t u = (uint32_t)(test_bits(&rng) >> 32);
        float f;
        memcpy(&f, &u, 4);
        if (f != f) continue;
        ok &= am_bf16_round(f) == pr_bf16_to_f32(pr_f32_to_bf16(f));
    }
    float nan = am_bf16_round(NAN);
    CHECK(ok && nan != nan, "am_bf16_round differs from the library's bf16 conversion");
    /* the chunk rule: C = ceil(256 / (prefix tiles * NKV)), at most the query tiles */
    int off[3] = { 0, 1000, 1064 };
    am_layout lay = { 2, off, 130 };   /* 3 prefix tiles; 16 + 1 query tiles */
    CHECK(am_prefix_chunks(&lay, 2, NULL) == 17 && am_prefix_chunks(&lay, 8, NULL) == 11 &&
          am_prefix_chunks(&lay, 128, NULL) == 1, "chunk rule: %d %d %d", am_prefix_chunks(&lay, 2, NULL),
          am_prefix_chunks(&lay, 8, NULL), am_prefix_chunks(&lay, 128, NULL));
    lay.n_prefix = 0;
    CHECK(am_prefix_chunks(&lay, 2, NULL) == 0, "chunk rule without a prefix");
}

int main(void) {
    clock_t t0 = clock();
    test_bf16_round();
    problem *probs[NSHAPES];
    for (int i = 0; i < NSHAPES; i++) probs[i] = make_problem(&shapes[i]);
    test_envelope(probs);
    test_controls(probs);
    for (int k = 0; k < NTILINGS; k++) test_empty_rows(probs[PADDED_BASELINE], &tilings[k]);
    test_determinism(probs[P300]);
    test_library(probs[P65_6_3], 1);
    test_library(probs[GQA8_P63], 1);
    for (int i = 0; i < NSHAPES; i++)
        if (i != P65_6_3 && i != GQA8_P63) test_library(probs[i], 0);
    for (int i = 0; i < NSHAPES; i++) free_problem(probs[i]);
    /* head dims the tensor-core kernels do not take: the CPU attention's head-dim chunks (128
       values; a last one of 2 or 4, short of its 4-wide and 16-wide passes) */
    for (size_t i = 0; i < sizeof cpu_shapes / sizeof *cpu_shapes; i++) {
        problem *p = make_problem(&cpu_shapes[i]);
        test_library(p, 0);
        free_problem(p);
    }
    printf("cpu time %.2f s\n", (double)(clock() - t0) / CLOCKS_PER_SEC);
    return test_report();
}
