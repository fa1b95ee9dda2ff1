/* GPU tests of the tensor-core attention (pr_backend_cuda_set_attention(PR_CUDA_ATTENTION_MMA)):
   over a table of shapes (prefix P in {0, 1, 63, 64, 65, 1000}, ragged packed and equal-length
   padded segments, GQA ratios 1, 2, 4 and 8, head dims 64 and 128, the prefix dK/dV both chunked
   and added directly), forward and backward, against
     - the double-precision CPU attention (test/gpu_ref.c), and
     - the FFMA kernels, the backend's reference (PR_CUDA_ATTENTION_FFMA), and
     - the tile-level model of the same algorithm (test/attn_model.c), with the same bf16 roundings
       of P and dS, which the kernels must match far more closely (MODEL below),
   and the backward's bits run to run (on the emulated device the second run in the other
   thread order: test/gpu_copy.h); and the fused backward (PR_CUDA_ATTENTION_MMA_ATOMIC): its dq
   against the reference and the model, its other outputs bitwise the MMA kernels'; and the wgmma
   kernels (PR_CUDA_ATTENTION_WGMMA, where the GPU runs them: forward, dQ and dK/dV): every output
   against the reference and the model, bitwise run to run. q, k and kp are drawn with standard deviation sqrt(2.5), so
   that the scores q.k/sqrt(HS) have a standard deviation of about 2.5 and the softmax is peaked.
   The backward runs from the reference forward's out (rounded to bf16) and lse (fp32), so that all
   three backwards see the same inputs. Its outputs are added into (dq, dk, dv bf16; dkp, dvp
   fp32): they start from random contents at half the scale of what is added, and the INCREMENTS
   (after - before) are compared.
   TOLERANCE per element (test/attn_model.c's): |inc - ref| <= atol + rtol |before + ref|, with
   u = 2^-8, atol = 2 u max|ref| of the tensor (the bf16 rounding of P and dS before their mma, and
   of the inputs of each product), rtol = u for bf16 outputs (their one rounding), 2^-22 for fp32
   ones. lse: 2e-5 (|lse| + 1). MODEL: atol = u/2 max|ref|, rtol one bf16 spacing (2u: a final
   rounding the kernels' other fp32 summation order flips) or 4 fp32 units; on the host emulator
   (test/test_mma_kernels.cc) the kernels stay within a quarter of u max|ref|. Outputs start as NaN where the kernel writes them (out, lse), so a
   row it forgets fails. Each line prints the worst error / tolerance per tensor.
   Needs a GPU: build/test_gpu_attention [--quick | --shape I] [--kind mma|wgmma] (make
   test-gpu-attention; --quick: the first six shapes, --shape I: shape I alone, both for
   compute-sanitizer; --kind: one tensor-core family, for the same). Last line: N passed, N failed. */
#define _POSIX_C_SOURCE 200809L   /* setenv (gpu_copy.h) */
#include <ctype.h>

#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "attn_model.h"
#include "gpu_copy.h"
#include "gpu_ref.h"
#include "harness.h"
#include "xorshift.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define U_BF16 (1.0 / 256)
#define U_FP32 (1.0 / 4194304)

static const pr_backend *be;
static int fused_here;        /* the atomic-dQ backward runs on this GPU (its shared memory: pr_backend_cuda_set_attention) */
static int wgmma_here;        /* the wgmma kernels run here (compute capability 9.0, sm_90a code) */
static int wgmma_only;        /* --kind wgmma: the MMA kernels once (the comparisons' base), no second run, no fused backward */
static uint64_t rng = 0x2545F4914F6CDD1Dull;
static double bf16_round(double x) { return pr_bf16_to_f32(pr_f32_to_bf16((float)x)); }
static double *alloc_d(size_t n) { return calloc(n ? n : 1, sizeof(double)); }
static double *draw(size_t n, double sd, int normal, int bf16) {
    double *x = alloc_d(n);
    for (size_t i = 0; i < n; i++) {
        double y = sd * (normal ? test_gaussian(&rng) : test_uniform(&rng));
        x[i] = bf16 ? bf16_round(y) : (float)y;
    }
    return x;
}

/* device buffers from host doubles, bf16 or fp32, and back */
static int same_bits(const void *a, const void *b, size_t bytes) {
    char *x = malloc(bytes ? bytes : 1), *y = malloc(bytes ? bytes : 1);
    be->copy(be, x, a, bytes);
    be->copy(be, y, b, bytes);
    be->sync(be);
    int same = !memcmp(x, y, bytes);
    free(x);
    free(y);
    return same;
}
static void release(void *d) { be->release(be, d, PR_TIER_DEVICE); }
static void select_kernels(int kind) {
    pr_error err;
    CHECK(pr_backend_cuda_set_attention(be, kind, &err) == PR_OK, "set_attention(%d): %s", kind, err.message);
}
static void expect_ok(const char *what) {
    pr_error err;
    CHECK(be->take_error(be, &err) == PR_OK, "%s: %s", what, err.message);
}

static double max_abs(const double *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}
/* worst |(after - before) - want| / (atol + rtol |before + want|) over a tensor; NaN counts as infinite */
static double incr_ratio(const double *after, const double *before, const double *want, size_t n, double atol, double rtol) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double s0 = before ? before[i] : 0, inc = after[i] - s0;
        if (inc != inc) return INFINITY;
        double tol = atol + rtol * fabs(s0 + want[i]), r = fabs(inc - want[i]) / (tol > 0 ? tol : 1e-300);
        if (r > worst) worst = r;
    }
    return worst;
}
/* against the double reference: atol 2u max|ref|, rtol u (bf16) or 4 fp32 units */
static double worst_ratio(const double *after, const double *before, const double *ref, size_t n, int fp32) {
    return incr_ratio(after, before, ref, n, 2 * U_BF16 * max_abs(ref, n), fp32 ? 4 * U_FP32 : U_BF16);
}
static double worst_lse(const double *gpu, const double *ref, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        if (gpu[i] != gpu[i]) return INFINITY;
        double r = fabs(gpu[i] - ref[i]) / (2e-5 * (fabs(ref[i]) + 1));
        if (r > worst) worst = r;
    }
    return worst;
}

/* against the tile model: atol u/2 max|ref|, rtol 2u (a final rounding that flips) or 4 fp32 units */
static double model_ratio(const double *after, const double *before, const double *model, const double *ref, size_t n, int fp32) {
    return incr_ratio(after, before, model, n, 0.5 * U_BF16 * max_abs(ref, n), fp32 ? 4 * U_FP32 : 2 * U_BF16);
}
static float *to_float(const double *x, size_t n) {
    float *y = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) y[i] = (float)x[i];
    return y;
}

typedef struct { int n_prefix, n_seg, lens[8], NH, NKV, HS; } shape;

enum { T_OUT, T_DQ, T_DK, T_DV, T_DKP, T_DVP, NT };
static const char *tname[NT] = { "out", "dq", "dk", "dv", "dkp", "dvp" };

/* One run of the selected kernels: forward into fresh NaN buffers, then the backward into buffers
   holding `init`, from the reference forward's out (rounded to bf16) and lse (fp32), in[6] and
   in[7]: every backward (MMA, FFMA, the reference) sees the same inputs. */
typedef struct { void *o, *l, *g[5]; } run_out;
static run_out run(int kind, const shape *s, const int *seg_off, void *const *in, double *const *init, const size_t *n) {
    const int N = seg_off[s->n_seg], np = s->n_prefix;
    pr_seq_layout lay = { s->n_seg, seg_off, np, np };
    run_out r;
    select_kernels(kind);
    r.o = gpu_poison(be, n[T_OUT], 2);
    r.l = gpu_poison(be, (size_t)N * s->NH, 4);
    be->attention_fwd(be, r.o, r.l, in[0], in[1], in[2], np ? in[3] : NULL, np ? in[4] : NULL, &lay, s->NH, s->NKV, s->HS);
    for (int t = 0; t < 5; t++) r.g[t] = gpu_upload(be, init[t], n[T_DQ + t], t < 3);
    be->attention_bwd(be, r.g[0], r.g[1], r.g[2], np ? (float *)r.g[3] : NULL, np ? (float *)r.g[4] : NULL, in[5], in[6], in[7],
                      in[0], in[1], in[2], np ? in[3] : NULL, np ? in[4] : NULL, &lay, s->NH, s->NKV, s->HS);
    expect_ok(kind == PR_CUDA_ATTENTION_MMA ? "tensor-core attention" : kind == PR_CUDA_ATTENTION_MMA_ATOMIC ? "tensor-core attention, fused backward"
              : kind == PR_CUDA_ATTENTION_WGMMA ? "tensor-core attention, wgmma" : "FFMA attention");
    return r;
}
/* Whether two runs left the same bits: out, lse (nl values) and the gradients from `first` on (dq: 0). */
static int runs_same(const run_out *a, const run_out *b, int first, size_t nl, const size_t *n) {
    int same = same_bits(a->o, b->o, 2 * n[T_OUT]) && same_bits(a->l, b->l, 4 * nl);
    for (int t = first; t < 5 && same; t++) same = same_bits(a->g[t], b->g[t], (t < 3 ? 2 : 4) * n[T_DQ + t]);
    return same;
}
static void release_run(run_out *r) {
    release(r->o);
    release(r->l);
    for (int t = 0; t < 5; t++) release(r->g[t]);
}

static void test_shape(const shape *s) {
    int seg_off[9] = { 0 };
    for (int i = 0; i < s->n_seg; i++) seg_off[i + 1] = seg_off[i] + s->lens[i];
    const int N = seg_off[s->n_seg], np = s->n_prefix, qd = s->NH * s->HS, kvd = s->NKV * s->HS;
    const size_t nq = (size_t)N * qd, nk = (size_t)N * kvd, npk = (size_t)(np ? np : 1) * kvd, nl = (size_t)N * s->NH;
    const size_t n[NT] = { nq, nq, nk, nk, npk, npk };
    const double sd = sqrt(2.5);
    double *q = draw(nq, sd, 1, 1), *k = draw(nk, sd, 1, 1), *kp = draw(npk, sd, 1, 1);
    double *v = draw(nk, 1, 0, 1), *vp = draw(npk, 1, 0, 1), *dout = draw(nq, 1, 0, 1);
    char what[200];
    int len = snprintf(what, sizeof what, "P %d NH %d NKV %d HS %d, segments", np, s->NH, s->NKV, s->HS);
    for (int i = 0; i < s->n_seg && len < 180; i++) len += snprintf(what + len, sizeof what - len, " %d", s->lens[i]);

    /* the reference: forward, then the backward's increments from zero */
    double *ro = alloc_d(nq), *rl = alloc_d(nl);
    ref_attention_fwd(ro, rl, q, k, v, np ? kp : NULL, np ? vp : NULL, seg_off, s->n_seg, np, s->NH, s->NKV, s->HS);
    double *ref[5];
    for (int t = 0; t < 5; t++) ref[t] = alloc_d(n[T_DQ + t]);
    /* the backward's out and lse: the reference forward's, in the GPU's formats */
    double *bo = alloc_d(nq), *bl = alloc_d(nl);
    for (size_t i = 0; i < nq; i++) bo[i] = bf16_round(ro[i]);
    for (size_t i = 0; i < nl; i++) bl[i] = (float)rl[i];
    ref_attention_bwd(ref[0], ref[1], ref[2], np ? ref[3] : NULL, np ? ref[4] : NULL, dout, bo, bl, q, k, v,
                      np ? kp : NULL, np ? vp : NULL, seg_off, s->n_seg, np, s->NH, s->NKV, s->HS);
    double *init[5];
    for (int t = 0; t < 5; t++) {
        const double scale = 0.5 * max_abs(ref[t], n[T_DQ + t]);
        init[t] = draw(n[T_DQ + t], scale > 0 ? scale : 1, 0, t < 3);
    }
    void *in[8] = { gpu_upload(be, q, nq, 1), gpu_upload(be, k, nk, 1), gpu_upload(be, v, nk, 1),
                    gpu_upload(be, kp, npk, 1), gpu_upload(be, vp, npk, 1), gpu_upload(be, dout, nq, 1),
                    gpu_upload(be, bo, nq, 1), gpu_upload(be, bl, nl, 0) };

    /* each kernel family's second run in the other order on the emulated device (gpu_copy.h) */
    run_out m1 = run(PR_CUDA_ATTENTION_MMA, s, seg_off, in, init, n);
    run_out m2;
    if (!wgmma_only) {
        const int order = gpu_order_flip();
        m2 = run(PR_CUDA_ATTENTION_MMA, s, seg_off, in, init, n);
        gpu_order_restore(order);
    } else memset(&m2, 0, sizeof m2);
    run_out f = run(PR_CUDA_ATTENTION_FFMA, s, seg_off, in, init, n);
    run_out a, w1, w2;
    double *adq = NULL;
    memset(&a, 0, sizeof a);
    memset(&w1, 0, sizeof w1);
    memset(&w2, 0, sizeof w2);
    if (wgmma_here) {
        w1 = run(PR_CUDA_ATTENTION_WGMMA, s, seg_off, in, init, n);
        const int order = gpu_order_flip();
        w2 = run(PR_CUDA_ATTENTION_WGMMA, s, seg_off, in, init, n);
        gpu_order_restore(order);
    }
    if (fused_here) {
        a = run(PR_CUDA_ATTENTION_MMA_ATOMIC, s, seg_off, in, init, n);
        adq = gpu_download(be, a.g[0], nq, 1);
    }

    double *mo = gpu_download(be, m1.o, nq, 1), *ml = gpu_download(be, m1.l, nl, 0);
    double *fo = gpu_download(be, f.o, nq, 1), *fl = gpu_download(be, f.l, nl, 0);
    double *mg[5], *fg[5];
    for (int t = 0; t < 5; t++) {
        mg[t] = gpu_download(be, m1.g[t], n[T_DQ + t], t < 3);
        fg[t] = gpu_download(be, f.g[t], n[T_DQ + t], t < 3);
    }
    double r_ref[NT], r_ffma[NT];
    r_ref[T_OUT] = worst_ratio(mo, NULL, ro, nq, 0);
    r_ffma[T_OUT] = worst_ratio(fo, NULL, ro, nq, 0);
    for (int t = 0; t < 5; t++) {
        r_ref[T_DQ + t] = worst_ratio(mg[t], init[t], ref[t], n[T_DQ + t], t >= 3);
        r_ffma[T_DQ + t] = worst_ratio(fg[t], init[t], ref[t], n[T_DQ + t], t >= 3);
    }
    const double lse_ref = worst_lse(ml, rl, nl), lse_ffma = worst_lse(fl, rl, nl);
    /* the MMA kernels beside the FFMA kernels: their difference within the two tolerances */
    double *fo_inc[5];
    for (int t = 0; t < 5; t++) {
        fo_inc[t] = alloc_d(n[T_DQ + t]);
        for (size_t i = 0; i < n[T_DQ + t]; i++) fo_inc[t][i] = fg[t][i] - init[t][i];
    }
    /* the model: forward from the inputs, backward from the same out, lse and start values */
    double r_model[NT], lse_model, r_fused_model = INFINITY, r_wg_model = INFINITY, lse_wg_model = INFINITY;
    double *model_inc[5];                             /* the model's increments */
    double *wo = wgmma_here ? gpu_download(be, w1.o, nq, 1) : NULL, *wl = wgmma_here ? gpu_download(be, w1.l, nl, 0) : NULL;
    {
        float *fq = to_float(q, nq), *fk = to_float(k, nk), *fv = to_float(v, nk), *fkp = to_float(kp, npk), *fvp = to_float(vp, npk);
        float *fdo = to_float(dout, nq), *fbo = to_float(bo, nq), *fbl = to_float(bl, nl);
        float *amo = malloc(sizeof(float) * nq), *aml = malloc(sizeof(float) * nl), *amg[5];
        for (int t = 0; t < 5; t++) amg[t] = to_float(init[t], n[T_DQ + t]);
        am_layout alay = { s->n_seg, seg_off, np };
        int ok = am_attention_fwd(amo, aml, fq, fk, fv, np ? fkp : NULL, np ? fvp : NULL, &alay, s->NH, s->NKV, s->HS, NULL) == 0 &&
                 am_attention_bwd(amg[0], amg[1], amg[2], np ? amg[3] : NULL, np ? amg[4] : NULL, fdo, fbo, fbl, fq, fk, fv,
                                  np ? fkp : NULL, np ? fvp : NULL, &alay, s->NH, s->NKV, s->HS, NULL) == 0;
        CHECK(ok, "%s: the model runs", what);
        double *dmo = alloc_d(nq), *dml = alloc_d(nl);
        for (size_t i = 0; i < nq; i++) dmo[i] = amo[i];
        for (size_t i = 0; i < nl; i++) dml[i] = aml[i];
        r_model[T_OUT] = model_ratio(mo, NULL, dmo, ro, nq, 0);
        lse_model = worst_lse(ml, dml, nl);
        if (wo) r_wg_model = model_ratio(wo, NULL, dmo, ro, nq, 0), lse_wg_model = worst_lse(wl, dml, nl);
        for (int t = 0; t < 5; t++) {
            double *minc = alloc_d(n[T_DQ + t]);
            for (size_t i = 0; i < n[T_DQ + t]; i++) minc[i] = amg[t][i] - init[t][i];
            r_model[T_DQ + t] = model_ratio(mg[t], init[t], minc, ref[t], n[T_DQ + t], t >= 3);
            if (t == 0 && adq) r_fused_model = model_ratio(adq, init[0], minc, ref[0], nq, 0);
            model_inc[t] = minc;
        }
        free(fq); free(fk); free(fv); free(fkp); free(fvp); free(fdo); free(fbo); free(fbl); free(amo); free(aml);
        for (int t = 0; t < 5; t++) free(amg[t]);
        free(dmo); free(dml);
    }
    double r_mf[NT];
    r_mf[T_OUT] = worst_ratio(mo, NULL, fo, nq, 0) / 2;
    for (int t = 0; t < 5; t++) r_mf[T_DQ + t] = worst_ratio(mg[t], init[t], fo_inc[t], n[T_DQ + t], t >= 3) / 2;

    printf("%s\n  err/tol   ", what);
    for (int t = 0; t < NT; t++) if (t < T_DKP || np) printf(" %s %.2f", tname[t], r_ref[t]);
    printf(" lse %.2f   (FFMA:", lse_ref);
    for (int t = 0; t < NT; t++) if (t < T_DKP || np) printf(" %.2f", r_ffma[t]);
    printf(" %.2f; MMA vs FFMA:", lse_ffma);
    for (int t = 0; t < NT; t++) if (t < T_DKP || np) printf(" %.2f", r_mf[t]);
    printf(")\n  vs model  ");
    for (int t = 0; t < NT; t++) if (t < T_DKP || np) printf(" %s %.2f", tname[t], r_model[t]);
    printf(" lse %.2f\n", lse_model);
    for (int t = 0; t < NT; t++) {
        if (t >= T_DKP && !np) continue;
        CHECK(r_ref[t] <= 1, "%s: MMA %s off the double reference by %.2f x the tolerance", what, tname[t], r_ref[t]);
        CHECK(r_mf[t] <= 1, "%s: MMA %s off the FFMA kernels by %.2f x the tolerance", what, tname[t], 2 * r_mf[t]);
        CHECK(r_model[t] <= 1, "%s: MMA %s off the model by %.2f x its tolerance", what, tname[t], r_model[t]);
    }
    CHECK(lse_model <= 1, "%s: MMA lse off the model by %.2f x the tolerance", what, lse_model);
    CHECK(lse_ref <= 1, "%s: MMA lse off the reference by %.2f x the tolerance", what, lse_ref);
    CHECK(lse_ffma <= 1, "%s: FFMA lse off the reference by %.2f x the tolerance", what, lse_ffma);

    /* bits run to run: forward and backward */
    CHECK(wgmma_only || runs_same(&m1, &m2, 0, nl, n), "%s: MMA forward and backward bitwise reproducible", what);

    /* the fused backward (PR_CUDA_ATTENTION_MMA_ATOMIC): its dq within the same tolerances, the rest MMA's bits */
    if (fused_here) {
        const double r_fused = worst_ratio(adq, init[0], ref[0], nq, 0);
        const int fused_same = runs_same(&a, &m1, 1, nl, n);
        printf("  fused backward: dq %.2f, vs model %.2f; dq's bits %s MMA's\n", r_fused, r_fused_model,
               same_bits(a.g[0], m1.g[0], 2 * nq) ? "equal to" : "differ from");
        CHECK(r_fused <= 1, "%s: fused backward's dq off the double reference by %.2f x the tolerance", what, r_fused);
        CHECK(r_fused_model <= 1, "%s: fused backward's dq off the model by %.2f x its tolerance", what, r_fused_model);
        CHECK(fused_same, "%s: the fused backward's out, lse, dk, dv, dkp, dvp are MMA's, bit for bit", what);
        release_run(&a);
        free(adq);
    }

    /* the wgmma kernels (PR_CUDA_ATTENTION_WGMMA): out, lse and every gradient within the same
       tolerances of the reference and the model as MMA's, all bits run to run */
    if (wgmma_here) {
        double r_w[NT], r_wm[NT];
        const double lse_wg = worst_lse(wl, rl, nl);
        r_w[T_OUT] = worst_ratio(wo, NULL, ro, nq, 0), r_wm[T_OUT] = r_wg_model;
        const int wg_same = runs_same(&w1, &w2, 0, nl, n), mma_same = runs_same(&w1, &m1, 0, nl, n);
        for (int t = 0; t < 5; t++) {
            double *g = gpu_download(be, w1.g[t], n[T_DQ + t], t < 3);
            r_w[T_DQ + t] = worst_ratio(g, init[t], ref[t], n[T_DQ + t], t >= 3);
            r_wm[T_DQ + t] = model_ratio(g, init[t], model_inc[t], ref[t], n[T_DQ + t], t >= 3);
            free(g);
        }
        printf("  wgmma:     ");
        for (int t = 0; t < NT; t++) if (t < T_DKP || np) printf(" %s %.2f", tname[t], r_w[t]);
        printf(" lse %.2f; vs model", lse_wg);
        for (int t = 0; t < NT; t++) if (t < T_DKP || np) printf(" %.2f", r_wm[t]);
        printf(" %.2f; bits %s MMA's\n", lse_wg_model, mma_same ? "equal to" : "differ from");
        for (int t = 0; t < NT; t++) {
            if (t >= T_DKP && !np) continue;
            CHECK(r_w[t] <= 1, "%s: wgmma %s off the double reference by %.2f x the tolerance", what, tname[t], r_w[t]);
            CHECK(r_wm[t] <= 1, "%s: wgmma %s off the model by %.2f x its tolerance", what, tname[t], r_wm[t]);
        }
        CHECK(lse_wg <= 1 && lse_wg_model <= 1, "%s: wgmma lse off the reference by %.2f, the model by %.2f x the tolerance", what, lse_wg,
              lse_wg_model);
        CHECK(wg_same, "%s: wgmma forward and backward bitwise reproducible", what);
        release_run(&w1);
        release_run(&w2);
        free(wo);
        free(wl);
    }
    for (int t = 0; t < 5; t++) free(model_inc[t]);

    release_run(&m1);
    if (!wgmma_only) release_run(&m2);
    release_run(&f);
    for (int i = 0; i < 8; i++) release(in[i]);
    for (int t = 0; t < 5; t++) free(ref[t]), free(init[t]), free(mg[t]), free(fg[t]), free(fo_inc[t]);
    free(q); free(k); free(kp); free(v); free(vp); free(dout); free(ro); free(rl); free(bo); free(bl); free(mo); free(ml); free(fo); free(fl);
}

/* Head dims 16 and 32, and misaligned buffers, fall back to the FFMA kernels: same bits. */
static void test_fallback(void) {
    const shape s = { 5, 2, { 9, 40 }, 4, 1, 32, };
    int seg_off[3] = { 0, 9, 49 };
    const int N = 49, qd = s.NH * s.HS, kvd = s.NKV * s.HS;
    double *q = draw((size_t)N * qd, 1, 1, 1), *k = draw((size_t)N * kvd, 1, 1, 1), *v = draw((size_t)N * kvd, 1, 0, 1);
    double *kp = draw((size_t)5 * kvd, 1, 1, 1), *vp = draw((size_t)5 * kvd, 1, 0, 1);
    void *q_ = gpu_upload(be, q, (size_t)N * qd, 1), *k_ = gpu_upload(be, k, (size_t)N * kvd, 1), *v_ = gpu_upload(be, v, (size_t)N * kvd, 1);
    void *kp_ = gpu_upload(be, kp, (size_t)5 * kvd, 1), *vp_ = gpu_upload(be, vp, (size_t)5 * kvd, 1);
    void *o[2], *l[2];
    pr_seq_layout lay = { 2, seg_off, 5, 5 };
    for (int kind = 0; kind < 2; kind++) {
        select_kernels(kind ? PR_CUDA_ATTENTION_MMA : PR_CUDA_ATTENTION_FFMA);
        o[kind] = gpu_poison(be, (size_t)N * qd, 2);
        l[kind] = gpu_poison(be, (size_t)N * s.NH, 4);
        be->attention_fwd(be, o[kind], l[kind], q_, k_, v_, kp_, vp_, &lay, s.NH, s.NKV, s.HS);
    }
    expect_ok("fallback");
    CHECK(same_bits(o[0], o[1], 2 * (size_t)N * qd) && same_bits(l[0], l[1], 4 * (size_t)N * s.NH),
          "head dim 32 runs the FFMA kernels under PR_CUDA_ATTENTION_MMA");
    for (int i = 0; i < 2; i++) release(o[i]), release(l[i]);
    release(q_); release(k_); release(v_); release(kp_); release(vp_);
    free(q); free(k); free(v); free(kp); free(vp);
    pr_error err;
    CHECK(pr_backend_cuda_set_attention(be, 7, &err) == PR_ERR_ARG, "an unknown attention kind is refused");
}

int main(int argc, char **argv) {
    /* --quick: the first six shapes; --shape I: shape I alone (each for compute-sanitizer, whose
       racecheck runs these kernels some hundred times slower); --kind mma: without the wgmma
       kernels; --kind wgmma: the wgmma kernels beside one run of the others (MMA's second run and
       the fused backward left out) */
    int quick = 0, only = -1, bad = 0, kind_mma = 0;
    for (int i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc && isdigit((unsigned char)argv[i + 1][0])) {
            char *end;
            const long v = strtol(argv[++i], &end, 10);
            if (*end || v >= 1000) bad = 1;
            else only = (int)v;
        } else if (!strcmp(argv[i], "--kind") && i + 1 < argc && (!strcmp(argv[i + 1], "mma") || !strcmp(argv[i + 1], "wgmma"))) {
            kind_mma = !strcmp(argv[++i], "mma");
            wgmma_only = !kind_mma;
        } else bad = 1;
    }
    if (bad || (quick && only >= 0)) {
        fprintf(stderr, "usage: test_gpu_attention [--quick | --shape I] [--kind mma|wgmma]\n");
        return 2;
    }
    pr_error err;
    if (pr_backend_cuda_create(&be, 0, &err)) {
        printf("FAIL no CUDA backend: %s\n", err.message);
        printf("0 passed, 1 failed\n");
        return 1;
    }
    printf("tensor-core attention (MMA) against the double CPU path and the FFMA kernels; backward twice\n");
    const int default_kind = pr_backend_cuda_attention(be);
    fused_here = !wgmma_only && pr_backend_cuda_set_attention(be, PR_CUDA_ATTENTION_MMA_ATOMIC, &err) == PR_OK;
    if (!fused_here && !wgmma_only) printf("the atomic-dQ backward does not run on this GPU: %s\n", err.message);
    wgmma_here = !kind_mma && pr_backend_cuda_set_attention(be, PR_CUDA_ATTENTION_WGMMA, &err) == PR_OK;
    if (!wgmma_here && !kind_mma) printf("the wgmma kernels do not run here: %s\n", err.message);
    if (!kind_mma) {      /* PR_CUDA_ATTENTION_AUTO, at creation and when asked for */
        const int fastest = wgmma_here ? PR_CUDA_ATTENTION_WGMMA : PR_CUDA_ATTENTION_MMA;
        CHECK(default_kind == fastest, "a new backend runs the fastest kernels here (kind %d), not kind %d", fastest, default_kind);
        CHECK(pr_backend_cuda_set_attention(be, PR_CUDA_ATTENTION_FFMA, &err) == PR_OK &&
              pr_backend_cuda_set_attention(be, PR_CUDA_ATTENTION_AUTO, &err) == PR_OK && pr_backend_cuda_attention(be) == fastest,
              "PR_CUDA_ATTENTION_AUTO selects kind %d again", fastest);
    }
    if (wgmma_only && !wgmma_here) {
        printf("FAIL --kind wgmma: the wgmma kernels do not run here\n");
        printf("0 passed, 1 failed\n");
        pr_backend_cuda_destroy(be);
        return 1;
    }
    const shape shapes[] = {
        { 0, 1, { 1 }, 4, 4, 64 },                                   /* S = 1 */
        { 0, 1, { 200 }, 8, 2, 128 },                                /* one causal segment, GQA 4 */
        { 0, 2, { 100, 100 }, 4, 2, 64 },                            /* baseline, padded, GQA 2 */
        { 0, 4, { 130, 1, 64, 65 }, 16, 2, 128 },                    /* packed ragged, GQA 8 */
        { 1, 1, { 1 }, 4, 4, 64 },                                   /* P = 1, S = 1, G = 1 */
        { 1, 3, { 65, 65, 65 }, 8, 4, 128 },                         /* padded */
        { 63, 2, { 64, 64 }, 8, 2, 64 },                             /* the prefix's tail tile */
        { 63, 5, { 1, 63, 64, 65, 2 }, 16, 2, 128 },                 /* packed, tiles and tails */
        { 64, 3, { 63, 1, 129 }, 4, 4, 128 },                        /* one whole prefix tile */
        { 64, 4, { 64, 64, 64, 64 }, 8, 4, 64 },
        { 65, 2, { 65, 65 }, 16, 2, 64 },
        { 65, 3, { 7, 128, 33 }, 8, 2, 128 },
        { 1000, 4, { 300, 17, 129, 64 }, 8, 4, 128 },                /* long prefix, C = 4 chunks */
        { 1000, 8, { 130, 130, 130, 130, 130, 130, 130, 130 }, 16, 2, 64 },   /* G = 8 padded, GQA 8 */
        { 1000, 2, { 40, 90 }, 32, 16, 64 },                         /* C = 1: added into dkp/dvp directly */
        { 1000, 1, { 1000 }, 4, 1, 128 },                            /* P = S */
    };
    const int n_shapes = (int)(sizeof shapes / sizeof *shapes);
    if (only >= n_shapes) {
        printf("FAIL --shape %d: there are %d shapes (0 to %d)\n", only, n_shapes, n_shapes - 1);
        printf("0 passed, 1 failed\n");
        pr_backend_cuda_destroy(be);
        return 1;
    }
    for (int i = 0; i < (quick ? 6 : n_shapes); i++)
        if (only < 0 || i == only) test_shape(&shapes[i]);
    if (only < 0) test_fallback();
    pr_backend_cuda_destroy(be);
    return test_report();
}
