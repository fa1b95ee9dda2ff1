/* What the attention tests compare and how, in plain doubles: shared by test_gpu.c (the CUDA kernels
   against the double CPU path) and test_attn_check.c (the same comparison on the CPU, where planted
   faults must fail it). Include after prefixreuse.h (bf16 rounding) and gpu_ref.h (the reference).

     rel_err, incr_err    the error measures: of an output, and of the increment of an output that
                          the kernel adds into (+=);
     att_cases            the shapes: segments, prefix length, heads, head dim; indexed for
                          `test_gpu --cases`;
     att_problem          one case's inputs, start values of the += outputs, and the reference.
   dq, dk, dv are bf16 activations; dkp, dvp (the prefix region's dK/dV) fp32 accumulators.

   Two choices make a wrong kernel visible:
   - q and k are drawn from (-ATT_QK_SCALE, ATT_QK_SCALE): the scores q.k / sqrt(HS) then have a
     standard deviation of ATT_QK_SCALE^2 / 3 = 2.5, so each row's softmax is peaked. At scale 1
     (deviation 1/3) it is nearly uniform, and a mask off by one key or a key from the wrong head
     changes the result by about 1/keys: inside a bf16 tolerance.
   - The += outputs (dq, dk, dv, dkp, dvp) start from random values of the size of their increment,
     and the error is taken on the increment: ||got - ref|| / ||ref - init||. Start values of
     (-1, 1) next to an increment a hundred times smaller let any increment pass, a missing one
     included. */
#ifndef PR_ATTN_CHECK_H
#define PR_ATTN_CHECK_H
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "xorshift.h"

#define ATT_TOL 1e-2              /* bf16 outputs, on the output or on its increment */
#define ATT_TOL_LSE 1e-5          /* fp32 row statistics */
#define ATT_QK_SCALE 2.75

/* ||a - b|| / ||b||, NaN when any element of a is NaN */
static double rel_err(const double *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] != a[i]) return NAN;
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
/* An output added into, from start values init: ||got - ref|| / ||ref - init||, the error relative
   to the increment. NaN when any element of got is NaN; the rms of got - ref when the increment is
   zero. */
static double incr_err(const double *got, const double *ref, const double *init, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (got[i] != got[i]) return NAN;
        num += (got[i] - ref[i]) * (got[i] - ref[i]);
        den += (ref[i] - init[i]) * (ref[i] - init[i]);
    }
    return den > 0 ? sqrt(num / den) : sqrt(num / (double)(n ? n : 1));
}

/* ---------------------------------------------------------------- shapes */
typedef struct { int n_seg, lens[8], n_prefix, NH, NKV, HS; } att_case;

static const att_case att_cases[] = {
    { 1, { 1 }, 0, 4, 4, 64 },                    /* 0: S = 1 */
    { 1, { 200 }, 0, 8, 2, 128 },                 /* 1: Phase A/C: one causal segment */
    { 2, { 100, 100 }, 0, 4, 1, 64 },             /* 2: baseline, padded */
    { 1, { 1 }, 1, 4, 4, 64 },                    /* 3: P = 1, S = 1, G = 1 */
    { 1, { 70 }, 130, 8, 8, 128 },                /* 4: G = 1, GQA 1 */
    { 4, { 65, 65, 65, 65 }, 63, 8, 2, 128 },     /* 5: padded: equal lengths, GQA 4 */
    { 5, { 1, 64, 3, 129, 17 }, 97, 16, 2, 64 },  /* 6: packed ragged, GQA 8 */
    { 3, { 33, 1, 80 }, 64, 32, 8, 128 },         /* 7: Llama 3 heads */
    { 2, { 9, 40 }, 200, 4, 1, 16 },              /* 8: tiny preset's head dim */
    { 3, { 50, 20, 7 }, 45, 4, 1, 32 },           /* 9: tiny-qwen3's */
    { 8, { 5, 6, 7, 8, 9, 10, 11, 12 }, 300, 8, 8, 64 },   /* 10 */
};
#define ATT_N_CASES (int)(sizeof att_cases / sizeof *att_cases)

static void att_case_name(const att_case *c, char *buf, size_t cap) {
    int len = snprintf(buf, cap, "attention P %d NH %d NKV %d HS %d segments", c->n_prefix, c->NH, c->NKV, c->HS);
    for (int s = 0; s < c->n_seg && len > 0 && (size_t)len + 12 < cap; s++) len += snprintf(buf + len, cap - len, " %d", c->lens[s]);
}

/* "3", "0,4,8-10": sets sel[i] = 1 for each listed case; 0 on a malformed list or an index out of range. */
static int att_parse_cases(const char *list, int *sel) {
    const char *p = list;
    if (!*p) return 0;
    while (*p) {
        char *end;
        long a = strtol(p, &end, 10), b = a;
        if (end == p) return 0;
        if (*end == '-') {
            const char *q = end + 1;
            b = strtol(q, &end, 10);
            if (end == q) return 0;
        }
        if (a < 0 || b < a || b >= ATT_N_CASES) return 0;
        for (long i = a; i <= b; i++) sel[i] = 1;
        if (*end == ',' && end[1]) end++;
        else if (*end) return 0;
        p = end;
    }
    return 1;
}

/* ---------------------------------------------------------------- one case's problem */
static double att_round(double x, int bf16) { return bf16 ? pr_bf16_to_f32(pr_f32_to_bf16((float)x)) : (float)x; }
static double *att_random(uint64_t *s, size_t n, double scale, int bf16) {
    double *x = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = att_round(scale * test_uniform(s), bf16);
    return x;
}

enum { ATT_DQ, ATT_DK, ATT_DV, ATT_DKP, ATT_DVP, ATT_N_GRADS };
static const char *const att_grad_name[ATT_N_GRADS] = { "dq", "dk", "dv", "dk prefix", "dv prefix" };

typedef struct {
    const att_case *c;
    int seg_off[9], N, np;
    size_t nq, nk, npk, n[ATT_N_GRADS];         /* element counts: q rows, k rows, prefix rows; per gradient */
    double *q, *k, *v, *kp, *vp, *dout;          /* (N,NH*HS) (N,NKV*HS) x2 (np,NKV*HS) x2 (N,NH*HS); bf16 values */
    double *init[ATT_N_GRADS], *ref[ATT_N_GRADS];
    uint64_t rng;                                /* the problem's own random stream */
} att_problem;

/* Is gradient g stored in bf16 by the backend? (dkp, dvp are fp32) */
static int att_grad_bf16(int g) { return g < ATT_DKP; }

/* The inputs of case c, q and k drawn at qk_scale, v and dout at 1, each rounded to bf16, from a
   random stream of their own (seed: the case's index, so that a case sees the same inputs when run
   alone). */
static void att_problem_init(att_problem *p, const att_case *c, double qk_scale, uint64_t seed) {
    memset(p, 0, sizeof *p);
    p->c = c;
    p->rng = (seed + 1) * 0x9E3779B97F4A7C15ull;
    for (int s = 0; s < c->n_seg; s++) p->seg_off[s + 1] = p->seg_off[s] + c->lens[s];
    p->N = p->seg_off[c->n_seg];
    p->np = c->n_prefix;
    p->nq = (size_t)p->N * c->NH * c->HS;
    p->nk = (size_t)p->N * c->NKV * c->HS;
    p->npk = (size_t)(p->np ? p->np : 1) * c->NKV * c->HS;
    p->n[ATT_DQ] = p->nq; p->n[ATT_DK] = p->n[ATT_DV] = p->nk; p->n[ATT_DKP] = p->n[ATT_DVP] = p->npk;
    p->q = att_random(&p->rng, p->nq, qk_scale, 1);
    p->k = att_random(&p->rng, p->nk, qk_scale, 1);
    p->v = att_random(&p->rng, p->nk, 1, 1);
    p->kp = att_random(&p->rng, p->npk, qk_scale, 1);
    p->vp = att_random(&p->rng, p->npk, 1, 1);
    p->dout = att_random(&p->rng, p->nq, 1, 1);
}

/* The backward's start values and reference, from the forward outputs the kernel under test made
   (out (N,NH*HS), lse (N,NH)). init_scale > 0: start values in (-init_scale, init_scale); 0: of
   the size of each gradient's increment (its rms; 1/16 where the increment is zero). Then
   ref = init + the reference's increment. */
static void att_problem_reference(att_problem *p, const double *out, const double *lse, double init_scale) {
    const att_case *c = p->c;
    double *inc[ATT_N_GRADS];
    for (int g = 0; g < ATT_N_GRADS; g++) inc[g] = calloc(p->n[g], sizeof(double));
    ref_attention_bwd(inc[ATT_DQ], inc[ATT_DK], inc[ATT_DV], p->np ? inc[ATT_DKP] : NULL, p->np ? inc[ATT_DVP] : NULL,
                      p->dout, out, lse, p->q, p->k, p->v, p->np ? p->kp : NULL, p->np ? p->vp : NULL, p->seg_off,
                      c->n_seg, p->np, c->NH, c->NKV, c->HS);
    for (int g = 0; g < ATT_N_GRADS; g++) {
        double scale = init_scale, ss = 0;
        if (scale <= 0) {
            for (size_t i = 0; i < p->n[g]; i++) ss += inc[g][i] * inc[g][i];
            scale = ss > 0 ? sqrt(ss / (double)p->n[g]) : 1.0 / 16;
        }
        free(p->init[g]);
        free(p->ref[g]);
        p->init[g] = att_random(&p->rng, p->n[g], scale, att_grad_bf16(g));
        p->ref[g] = malloc(sizeof(double) * p->n[g]);
        for (size_t i = 0; i < p->n[g]; i++) p->ref[g][i] = p->init[g][i] + inc[g][i];
        free(inc[g]);
    }
}

static void att_problem_free(att_problem *p) {
    free(p->q); free(p->k); free(p->v); free(p->kp); free(p->vp); free(p->dout);
    for (int g = 0; g < ATT_N_GRADS; g++) { free(p->init[g]); free(p->ref[g]); }
    memset(p, 0, sizeof *p);
}

/* The error of each gradient the kernel made (got[g], from p->init[g]) against the reference;
   the prefix gradients only when there is a prefix (else 0). */
static void att_grad_errors(const att_problem *p, double *const got[ATT_N_GRADS], double err[ATT_N_GRADS]) {
    for (int g = 0; g < ATT_N_GRADS; g++)
        err[g] = g >= ATT_DKP && !p->np ? 0 : incr_err(got[g], p->ref[g], p->init[g], p->n[g]);
}
#endif
