/* GPU tests: every kernel of the CUDA backend against the CPU backend in double precision
   (test/gpu_ref.c), on fresh random inputs, with poisoned outputs; the attention kernels over many
   shapes; bitwise determinism of the attention backward and of a whole training step.
   Inputs are drawn, rounded to bf16, and given to both sides, so the reference sees exactly what
   the GPU sees. Errors are ||gpu - ref|| / ||ref||: bf16 outputs within 1e-2, fp32 outputs within
   1e-5 (the limits the CUDA backend promises). Needs a GPU: `make test-gpu`. */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "gpu_ref.h"
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TOL_BF16 1e-2
#define TOL_FP32 1e-5

static const pr_backend *be;
static uint64_t rng = 0x9E3779B97F4A7C15ull;

static double uniform(void) {                 /* (-1, 1) */
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return ((rng >> 11) / 9007199254740992.0) * 2 - 1;
}
static uint16_t to_bf16(double x) { return pr_f32_to_bf16((float)x); }
static double from_bf16(uint16_t b) { return pr_bf16_to_f32(b); }
/* n values in (-scale, scale), already representable in bf16 */
static double *random_bf16(size_t n, double scale) {
    double *x = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = from_bf16(to_bf16(scale * uniform()));
    return x;
}
static double *random_f32(size_t n, double scale) {
    double *x = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = (float)(scale * uniform());
    return x;
}
static double *copy_of(const double *x, size_t n) {
    double *y = malloc(sizeof(double) * (n ? n : 1));
    memcpy(y, x, sizeof(double) * n);
    return y;
}

/* Device buffers from host doubles (bf16 or fp32 on the device) and back. */
static void *dev_copy(const double *x, size_t n, int bf16) {
    size_t elem = bf16 ? 2 : 4;
    char *h = malloc(elem * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        if (bf16) { uint16_t b = to_bf16(x[i]); memcpy(h + 2 * i, &b, 2); }
        else { float f = (float)x[i]; memcpy(h + 4 * i, &f, 4); }
    }
    void *d = be->alloc(be, elem * (n ? n : 1), PR_TIER_DEVICE);
    be->copy(be, d, h, elem * n);
    be->sync(be);
    free(h);
    return d;
}
static void *dev_bf16(const double *x, size_t n) { return dev_copy(x, n, 1); }
static void *dev_f32(const double *x, size_t n) { return dev_copy(x, n, 0); }
/* An output buffer filled with NaN: every element the kernel forgets stays NaN and fails. */
static void *dev_poison(size_t n, size_t elem) {
    void *h = malloc(elem * (n ? n : 1));
    memset(h, 0xFF, elem * n);
    void *d = be->alloc(be, elem * (n ? n : 1), PR_TIER_DEVICE);
    be->copy(be, d, h, elem * n);
    be->sync(be);
    free(h);
    return d;
}
static double *host_copy(const void *d, size_t n, int bf16) {
    size_t elem = bf16 ? 2 : 4;
    char *h = malloc(elem * (n ? n : 1));
    be->copy(be, h, d, elem * n);
    be->sync(be);
    double *x = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        if (bf16) { uint16_t b; memcpy(&b, h + 2 * i, 2); x[i] = from_bf16(b); }
        else { float f; memcpy(&f, h + 4 * i, 4); x[i] = f; }
    }
    free(h);
    return x;
}
static double *host_bf16(const void *d, size_t n) { return host_copy(d, n, 1); }
static double *host_f32(const void *d, size_t n) { return host_copy(d, n, 0); }
static void release(void *d) { be->release(be, d, PR_TIER_DEVICE); }

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
#define EXPECT_CLOSE(gpu, ref, n, tol, what, ...)                                           \
    do {                                                                                    \
        double e_ = rel_err(gpu, ref, n);                                                   \
        CHECK(e_ <= (tol), "%s: relative error %.3e > %.0e", what, e_, (double)(tol));      \
    } while (0)

static void expect_backend_ok(const char *what) {
    pr_error err;
    CHECK(be->take_error(be, &err) == PR_OK, "%s: %s", what, err.message);
}

/* A parameter arena on the device holding w (n floats), handed to prepare_weights. */
static float *weights(const double *w, size_t n) {
    float *d = dev_f32(w, n);
    be->prepare_weights(be, d, n);
    return d;
}

/* ---------------------------------------------------------------- kernels */
static void test_matmul(int N, int C, int OC) {
    double *x = random_bf16((size_t)N * C, 1), *w = random_f32((size_t)OC * C, 0.1), *dy = random_bf16((size_t)N * OC, 1);
    double *wb = malloc(sizeof(double) * (size_t)OC * C);     /* the GEMM reads the bf16 copy */
    for (size_t i = 0; i < (size_t)OC * C; i++) wb[i] = from_bf16(to_bf16(w[i]));
    double *dx0 = random_bf16((size_t)N * C, 1), *dw0 = random_f32((size_t)OC * C, 1);
    double *ref_y = calloc((size_t)N * OC, sizeof(double)), *ref_dx = copy_of(dx0, (size_t)N * C), *ref_dw = copy_of(dw0, (size_t)OC * C);
    ref_matmul_fwd(ref_y, x, wb, N, C, OC);
    ref_matmul_bwd(ref_dx, ref_dw, dy, x, wb, N, C, OC);
    float *dw_arena = weights(w, (size_t)OC * C);
    void *dx_ = dev_bf16(x, (size_t)N * C), *dy_ = dev_bf16(dy, (size_t)N * OC), *y_ = dev_poison((size_t)N * OC, 2);
    void *ddx = dev_bf16(dx0, (size_t)N * C), *ddw = dev_f32(dw0, (size_t)OC * C);
    be->matmul_fwd(be, y_, dx_, dw_arena, N, C, OC);
    be->matmul_bwd(be, ddx, ddw, dy_, dx_, dw_arena, N, C, OC);
    expect_backend_ok("matmul");
    double *y = host_bf16(y_, (size_t)N * OC), *gdx = host_bf16(ddx, (size_t)N * C), *gdw = host_f32(ddw, (size_t)OC * C);
    char what[96];
    snprintf(what, sizeof what, "matmul_fwd %dx%dx%d", N, C, OC);
    EXPECT_CLOSE(y, ref_y, (size_t)N * OC, TOL_BF16, what);
    snprintf(what, sizeof what, "matmul_bwd dinp %dx%dx%d", N, C, OC);
    EXPECT_CLOSE(gdx, ref_dx, (size_t)N * C, TOL_BF16, what);
    snprintf(what, sizeof what, "matmul_bwd dw %dx%dx%d", N, C, OC);
    EXPECT_CLOSE(gdw, ref_dw, (size_t)OC * C, TOL_FP32, what);
    release(dw_arena); release(dx_); release(dy_); release(y_); release(ddx); release(ddw);
    free(x); free(w); free(wb); free(dy); free(dx0); free(dw0); free(ref_y); free(ref_dx); free(ref_dw);
    free(y); free(gdx); free(gdw);
}

static void test_rmsnorm(int N, int C) {
    double *x = random_bf16((size_t)N * C, 2), *w = random_f32(C, 1), *dy = random_bf16((size_t)N * C, 1);
    double *dx0 = random_bf16((size_t)N * C, 1), *dw0 = random_f32(C, 1);
    double *ry = malloc(sizeof(double) * N * C), *rr = malloc(sizeof(double) * N);
    double *rdx = copy_of(dx0, (size_t)N * C), *rdw = copy_of(dw0, C);
    ref_rmsnorm_fwd(ry, rr, x, w, N, C, 1e-5);
    void *x_ = dev_bf16(x, (size_t)N * C), *w_ = dev_f32(w, C), *y_ = dev_poison((size_t)N * C, 2), *r_ = dev_poison(N, 4);
    be->rmsnorm_fwd(be, y_, r_, x_, w_, N, C, 1e-5);
    double *gr = host_f32(r_, N);
    /* the backward on the GPU's own rstd, the reference on its own: both within fp32 of each other */
    ref_rmsnorm_bwd(rdx, rdw, dy, x, w, rr, N, C);
    void *dy_ = dev_bf16(dy, (size_t)N * C), *dx_ = dev_bf16(dx0, (size_t)N * C), *dw_ = dev_f32(dw0, C);
    be->rmsnorm_bwd(be, dx_, dw_, dy_, x_, w_, r_, N, C);
    expect_backend_ok("rmsnorm");
    double *gy = host_bf16(y_, (size_t)N * C), *gdx = host_bf16(dx_, (size_t)N * C), *gdw = host_f32(dw_, C);
    EXPECT_CLOSE(gy, ry, (size_t)N * C, TOL_BF16, "rmsnorm_fwd out");
    EXPECT_CLOSE(gr, rr, N, TOL_FP32, "rmsnorm_fwd rstd");
    EXPECT_CLOSE(gdx, rdx, (size_t)N * C, TOL_BF16, "rmsnorm_bwd dinp");
    EXPECT_CLOSE(gdw, rdw, C, TOL_FP32, "rmsnorm_bwd dw");
    release(x_); release(w_); release(y_); release(r_); release(dy_); release(dx_); release(dw_);
    free(x); free(w); free(dy); free(dx0); free(dw0); free(ry); free(rr); free(rdx); free(rdw); free(gr); free(gy); free(gdx); free(gdw);
}

static void test_rope(int heads, int HS, int pos0) {
    const int seg_off[] = { 0, 37, 37 + 64, 37 + 64 + 5 }, n_seg = 3, N = seg_off[3];
    double *x = random_bf16((size_t)N * heads * HS, 1), *f = malloc(sizeof(double) * HS / 2);
    for (int i = 0; i < HS / 2; i++) f[i] = (float)pow(500000.0, -2.0 * i / HS);
    pr_seq_layout lay = { n_seg, seg_off, pos0, 0 };
    void *f_ = dev_f32(f, HS / 2);
    for (int backward = 0; backward < 2; backward++) {
        double *r = copy_of(x, (size_t)N * heads * HS);
        ref_rope(r, seg_off, n_seg, pos0, heads, HS, f, backward);
        void *x_ = dev_bf16(x, (size_t)N * heads * HS);
        if (backward) be->rope_bwd(be, x_, &lay, heads, HS, f_);
        else be->rope_fwd(be, x_, &lay, heads, HS, f_);
        expect_backend_ok("rope");
        double *g = host_bf16(x_, (size_t)N * heads * HS);
        EXPECT_CLOSE(g, r, (size_t)N * heads * HS, TOL_BF16, backward ? "rope_bwd" : "rope_fwd");
        release(x_); free(r); free(g);
    }
    release(f_); free(x); free(f);
}

static void test_elementwise(size_t n) {
    double *g = random_bf16(n, 4), *u = random_bf16(n, 2), *dh = random_bf16(n, 1), *dg0 = random_bf16(n, 1), *du0 = random_bf16(n, 1);
    double *rh = malloc(sizeof(double) * n), *rdg = copy_of(dg0, n), *rdu = copy_of(du0, n);
    ref_swiglu_fwd(rh, g, u, n);
    ref_swiglu_bwd(rdg, rdu, dh, g, u, n);
    void *g_ = dev_bf16(g, n), *u_ = dev_bf16(u, n), *h_ = dev_poison(n, 2), *dh_ = dev_bf16(dh, n);
    void *dg_ = dev_bf16(dg0, n), *du_ = dev_bf16(du0, n);
    be->swiglu_fwd(be, h_, g_, u_, n);
    be->swiglu_bwd(be, dg_, du_, dh_, g_, u_, n);
    be->add(be, dh_, u_, n);                     /* dh += u */
    expect_backend_ok("swiglu/add");
    double *gh = host_bf16(h_, n), *gdg = host_bf16(dg_, n), *gdu = host_bf16(du_, n), *gsum = host_bf16(dh_, n);
    double *rsum = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) rsum[i] = dh[i] + u[i];
    EXPECT_CLOSE(gh, rh, n, TOL_BF16, "swiglu_fwd");
    EXPECT_CLOSE(gdg, rdg, n, TOL_BF16, "swiglu_bwd dgate");
    EXPECT_CLOSE(gdu, rdu, n, TOL_BF16, "swiglu_bwd dup");
    EXPECT_CLOSE(gsum, rsum, n, TOL_BF16, "add");
    release(g_); release(u_); release(h_); release(dh_); release(dg_); release(du_);
    free(g); free(u); free(dh); free(dg0); free(du0); free(rh); free(rdg); free(rdu); free(gh); free(gdg); free(gdu); free(gsum); free(rsum);
}

static void test_embed_rows(int N, int C, int V) {
    int32_t *tok = malloc(sizeof(int32_t) * N);
    for (int i = 0; i < N; i++) tok[i] = (int32_t)((uniform() + 1) / 2 * (V / 4));   /* repeats on purpose */
    double *emb = random_f32((size_t)V * C, 1), *dy = random_bf16((size_t)N * C, 1), *demb0 = random_f32((size_t)V * C, 1);
    double *ry = malloc(sizeof(double) * N * C), *rd = copy_of(demb0, (size_t)V * C);
    ref_embed_fwd(ry, tok, emb, N, C);
    ref_embed_bwd(rd, dy, tok, N, C);
    for (size_t i = 0; i < (size_t)N * C; i++) ry[i] = from_bf16(to_bf16(ry[i]));   /* the output is bf16 */
    void *emb_ = dev_f32(emb, (size_t)V * C), *y_ = dev_poison((size_t)N * C, 2), *dy_ = dev_bf16(dy, (size_t)N * C);
    void *d_ = dev_f32(demb0, (size_t)V * C);
    be->embed_fwd(be, y_, tok, emb_, N, C);
    be->embed_bwd(be, d_, dy_, tok, N, C);
    /* rows: gather every third row backwards, scatter them back onto dy */
    int M = N / 3, *rows = malloc(sizeof(int) * (M ? M : 1));
    for (int m = 0; m < M; m++) rows[m] = N - 1 - 3 * m;
    void *gat = dev_poison((size_t)M * C, 2);
    be->gather_rows(be, gat, dy_, rows, NULL, M, C);
    be->scatter_add_rows(be, dy_, gat, rows, NULL, M, C);
    expect_backend_ok("embed/rows");
    double *gy = host_bf16(y_, (size_t)N * C), *gd = host_f32(d_, (size_t)V * C), *gg = host_bf16(gat, (size_t)M * C);
    double *gs = host_bf16(dy_, (size_t)N * C), *rg = malloc(sizeof(double) * (M ? M : 1) * C), *rs = copy_of(dy, (size_t)N * C);
    for (int m = 0; m < M; m++)
        for (int c = 0; c < C; c++) {
            rg[(size_t)m * C + c] = dy[(size_t)rows[m] * C + c];
            rs[(size_t)rows[m] * C + c] += dy[(size_t)rows[m] * C + c];
        }
    EXPECT_CLOSE(gy, ry, (size_t)N * C, 1e-12, "embed_fwd (exact after bf16 rounding)");
    EXPECT_CLOSE(gd, rd, (size_t)V * C, TOL_FP32, "embed_bwd");
    EXPECT_CLOSE(gg, rg, (size_t)M * C, 1e-12, "gather_rows (exact)");
    EXPECT_CLOSE(gs, rs, (size_t)N * C, 1e-12, "scatter_add_rows (doubling is exact)");
    release(emb_); release(y_); release(dy_); release(d_); release(gat);
    free(tok); free(emb); free(dy); free(demb0); free(ry); free(rd); free(rows); free(gy); free(gd); free(gg); free(gs); free(rg); free(rs);
}

static void test_loss_head(int M, int V, double kl) {
    double *z = random_bf16((size_t)M * V, 4);
    int32_t *tg = malloc(sizeof(int32_t) * M);
    double *old = malloc(sizeof(double) * M), *ref = malloc(sizeof(double) * M), *adv = malloc(sizeof(double) * M);
    double *wt = malloc(sizeof(double) * M);
    float *oldf = malloc(sizeof(float) * M), *reff = malloc(sizeof(float) * M), *advf = malloc(sizeof(float) * M), *wtf = malloc(sizeof(float) * M);
    for (int m = 0; m < M; m++) {
        tg[m] = (int32_t)((uniform() + 1) / 2 * (V - 1));
        old[m] = oldf[m] = (float)(-log((double)V) + 0.5 * uniform());
        ref[m] = reff[m] = (float)(old[m] + 0.1 * uniform());
        adv[m] = advf[m] = (float)uniform();
        wt[m] = wtf[m] = (float)(1.0 / M);
    }
    double *rz = copy_of(z, (size_t)M * V), *rlp = malloc(sizeof(double) * M), rloss = 0;
    ref_loss_head(rz, M, tg, old, ref, adv, wt, kl, V, rlp, &rloss);
    void *z_ = dev_bf16(z, (size_t)M * V);
    pr_head_rows rows = { M, tg, oldf, reff, advf, wtf };
    pr_loss_opts o = pr_step_opts_default().loss;
    o.kl_coef = kl;
    float *lp = malloc(sizeof(float) * M);
    double loss = 0;
    be->loss_head(be, z_, &rows, &o, V, lp, &loss);
    expect_backend_ok("loss_head");
    double *gz = host_bf16(z_, (size_t)M * V), *glp = malloc(sizeof(double) * M);
    for (int m = 0; m < M; m++) glp[m] = lp[m];
    EXPECT_CLOSE(glp, rlp, M, TOL_FP32, "loss_head logp");
    CHECK(fabs(loss - rloss) <= 1e-4 * fabs(rloss) + 1e-7, "loss_head loss %.9g vs %.9g", loss, rloss);
    EXPECT_CLOSE(gz, rz, (size_t)M * V, TOL_BF16, "loss_head dlogits");
    release(z_);
    free(z); free(tg); free(old); free(ref); free(adv); free(wt); free(oldf); free(reff); free(advf); free(wtf);
    free(rz); free(rlp); free(lp); free(gz); free(glp);
}

static void test_optimizer(size_t n) {
    double *p = random_f32(n, 1), *g = random_f32(n, 0.01), *m = random_f32(n, 0.01), *v = random_f32(n, 1e-4);
    for (size_t i = 0; i < n; i++) v[i] = fabs(v[i]);
    double *rp = copy_of(p, n), *rm = copy_of(m, n), *rv = copy_of(v, n);
    ref_adamw(rp, g, rm, rv, n, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3);
    double ss = 0;
    for (size_t i = 0; i < n; i++) ss += g[i] * g[i];
    float *p_ = dev_f32(p, n), *g_ = dev_f32(g, n), *m_ = dev_f32(m, n), *v_ = dev_f32(v, n);
    double gss = be->sum_squares(be, g_, n);
    be->adamw(be, p_, g_, m_, v_, n, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3);
    be->scale(be, g_, n, 0.5);
    expect_backend_ok("optimizer");
    double *gp = host_f32(p_, n), *gm = host_f32(m_, n), *gv = host_f32(v_, n), *gg = host_f32(g_, n);
    double *rg = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) rg[i] = g[i] * 0.5;
    CHECK(fabs(gss - ss) <= 1e-12 * ss, "sum_squares %.17g vs %.17g", gss, ss);
    EXPECT_CLOSE(gp, rp, n, 1e-6, "adamw params");
    EXPECT_CLOSE(gm, rm, n, 1e-6, "adamw m");
    EXPECT_CLOSE(gv, rv, n, 1e-6, "adamw v");
    EXPECT_CLOSE(gg, rg, n, 0, "scale (exact)");
    release(p_); release(g_); release(m_); release(v_);
    free(p); free(g); free(m); free(v); free(rp); free(rm); free(rv); free(gp); free(gm); free(gv); free(gg); free(rg);
}

/* ---------------------------------------------------------------- attention */
typedef struct { int n_seg, lens[8], n_prefix, NH, NKV, HS; } att_case;

static void test_attention(const att_case *c) {
    int seg_off[9] = { 0 };
    for (int s = 0; s < c->n_seg; s++) seg_off[s + 1] = seg_off[s] + c->lens[s];
    const int N = seg_off[c->n_seg], np = c->n_prefix, qd = c->NH * c->HS, kvd = c->NKV * c->HS;
    const size_t nq = (size_t)N * qd, nk = (size_t)N * kvd, npk = (size_t)(np ? np : 1) * kvd;
    double *q = random_bf16(nq, 1), *k = random_bf16(nk, 1), *v = random_bf16(nk, 1);
    double *kp = random_bf16(npk, 1), *vp = random_bf16(npk, 1), *dout = random_bf16(nq, 1);
    double *ro = malloc(sizeof(double) * nq), *rl = malloc(sizeof(double) * (size_t)N * c->NH);
    ref_attention_fwd(ro, rl, q, k, v, np ? kp : NULL, np ? vp : NULL, seg_off, c->n_seg, np, c->NH, c->NKV, c->HS);
    pr_seq_layout lay = { c->n_seg, seg_off, np, np };
    void *q_ = dev_bf16(q, nq), *k_ = dev_bf16(k, nk), *v_ = dev_bf16(v, nk), *kp_ = dev_bf16(kp, npk), *vp_ = dev_bf16(vp, npk);
    void *o_ = dev_poison(nq, 2), *l_ = dev_poison((size_t)N * c->NH, 4);
    be->attention_fwd(be, o_, l_, q_, k_, v_, np ? kp_ : NULL, np ? vp_ : NULL, &lay, c->NH, c->NKV, c->HS);
    expect_backend_ok("attention_fwd");
    double *go = host_bf16(o_, nq), *gl = host_f32(l_, (size_t)N * c->NH);
    char what[160];
    int len = snprintf(what, sizeof what, "attention P %d NH %d NKV %d HS %d segments", np, c->NH, c->NKV, c->HS);
    for (int s = 0; s < c->n_seg && len < 140; s++) len += snprintf(what + len, sizeof what - len, " %d", c->lens[s]);
    char w2[200];
    snprintf(w2, sizeof w2, "%s: out", what);
    EXPECT_CLOSE(go, ro, nq, TOL_BF16, w2);
    snprintf(w2, sizeof w2, "%s: lse", what);
    EXPECT_CLOSE(gl, rl, (size_t)N * c->NH, TOL_FP32, w2);

    /* the backward from the GPU's own forward outputs; gradients start from random values (+=) */
    double *dq0 = random_bf16(nq, 1), *dk0 = random_bf16(nk, 1), *dv0 = random_bf16(nk, 1);
    double *dkp0 = random_bf16(npk, 1), *dvp0 = random_bf16(npk, 1);
    double *rdq = copy_of(dq0, nq), *rdk = copy_of(dk0, nk), *rdv = copy_of(dv0, nk), *rdkp = copy_of(dkp0, npk), *rdvp = copy_of(dvp0, npk);
    ref_attention_bwd(rdq, rdk, rdv, np ? rdkp : NULL, np ? rdvp : NULL, dout, go, gl, q, k, v, np ? kp : NULL,
                      np ? vp : NULL, seg_off, c->n_seg, np, c->NH, c->NKV, c->HS);
    void *dout_ = dev_bf16(dout, nq);
    void *bits[2][5];
    for (int run = 0; run < 2; run++) {
        void *dq_ = dev_bf16(dq0, nq), *dk_ = dev_bf16(dk0, nk), *dv_ = dev_bf16(dv0, nk);
        void *dkp_ = dev_bf16(dkp0, npk), *dvp_ = dev_bf16(dvp0, npk);
        be->attention_bwd(be, dq_, dk_, dv_, np ? dkp_ : NULL, np ? dvp_ : NULL, dout_, o_, l_, q_, k_, v_,
                          np ? kp_ : NULL, np ? vp_ : NULL, &lay, c->NH, c->NKV, c->HS);
        expect_backend_ok("attention_bwd");
        bits[run][0] = dq_; bits[run][1] = dk_; bits[run][2] = dv_; bits[run][3] = dkp_; bits[run][4] = dvp_;
    }
    double *gdq = host_bf16(bits[0][0], nq), *gdk = host_bf16(bits[0][1], nk), *gdv = host_bf16(bits[0][2], nk);
    double *gdkp = host_bf16(bits[0][3], npk), *gdvp = host_bf16(bits[0][4], npk);
    snprintf(w2, sizeof w2, "%s: dq", what); EXPECT_CLOSE(gdq, rdq, nq, TOL_BF16, w2);
    snprintf(w2, sizeof w2, "%s: dk", what); EXPECT_CLOSE(gdk, rdk, nk, TOL_BF16, w2);
    snprintf(w2, sizeof w2, "%s: dv", what); EXPECT_CLOSE(gdv, rdv, nk, TOL_BF16, w2);
    if (np) {
        snprintf(w2, sizeof w2, "%s: dk prefix", what); EXPECT_CLOSE(gdkp, rdkp, npk, TOL_BF16, w2);
        snprintf(w2, sizeof w2, "%s: dv prefix", what); EXPECT_CLOSE(gdvp, rdvp, npk, TOL_BF16, w2);
    }
    /* determinism: the second run's bits equal the first's */
    const size_t sizes[5] = { nq, nk, nk, npk, npk };
    int same = 1;
    for (int t = 0; t < 5; t++) {
        uint16_t *a = malloc(2 * sizes[t]), *b = malloc(2 * sizes[t]);
        be->copy(be, a, bits[0][t], 2 * sizes[t]);
        be->copy(be, b, bits[1][t], 2 * sizes[t]);
        be->sync(be);
        same &= !memcmp(a, b, 2 * sizes[t]);
        free(a); free(b);
        release(bits[0][t]); release(bits[1][t]);
    }
    snprintf(w2, sizeof w2, "%s: backward bitwise reproducible", what);
    CHECK(same, "%s", w2);
    release(q_); release(k_); release(v_); release(kp_); release(vp_); release(o_); release(l_); release(dout_);
    free(q); free(k); free(v); free(kp); free(vp); free(dout); free(ro); free(rl); free(go); free(gl);
    free(dq0); free(dk0); free(dv0); free(dkp0); free(dvp0); free(rdq); free(rdk); free(rdv); free(rdkp); free(rdvp);
    free(gdq); free(gdk); free(gdv); free(gdkp); free(gdvp);
}

/* ---------------------------------------------------------------- a whole step, twice */
static void test_step_determinism(const char *model, pr_schedule sched) {
    pr_error err;
    pr_config cfg;
    pr_trace trace;
    pr_trainer *tr = NULL;
    if (pr_config_load(&cfg, model, &err) || pr_trace_read(&trace, "data/sample.trace", &err)) {
        CHECK(0, "step determinism setup: %s", err.message);
        return;
    }
    if (pr_trainer_create(&tr, &cfg, be, &err) || pr_trainer_init_params(tr, 7, &err)) {
        CHECK(0, "step determinism trainer: %s", err.message);
        pr_trace_free(&trace);
        return;
    }
    size_t n = pr_trainer_param_count(tr);
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
    pr_step_opts o = pr_step_opts_default();
    o.schedule = sched;
    o.microbatch = 3;
    o.layout = PR_LAYOUT_PACKED;
    int ok = !pr_trainer_compute_grads(tr, &trace.groups[0], &o, NULL, NULL, &err) && !pr_trainer_get_grads(tr, a, n, &err) &&
             !pr_trainer_compute_grads(tr, &trace.groups[0], &o, NULL, NULL, &err) && !pr_trainer_get_grads(tr, b, n, &err);
    CHECK(ok, "step on %s: %s", model, err.message);
    CHECK(ok && !memcmp(a, b, sizeof(float) * n), "%s %s: two runs of one step differ", model,
          sched == PR_SCHEDULE_REUSE ? "reuse" : "baseline");
    free(a); free(b);
    pr_trainer_destroy(tr);
    pr_trace_free(&trace);
}

int main(void) {
    pr_error err;
    if (pr_backend_cuda_create(&be, 0, &err)) {
        printf("FAIL no CUDA backend: %s\n", err.message);
        printf("0 passed, 1 failed\n");
        return 1;
    }
    printf("kernels against the double CPU path\n");
    test_matmul(1, 64, 64);
    test_matmul(37, 256, 176);
    test_matmul(200, 512, 1000);
    test_rmsnorm(1, 64);
    test_rmsnorm(300, 4096);
    test_rmsnorm(5000, 128);       /* the q/k norm's shape: many short rows */
    test_rope(4, 16, 0);
    test_rope(8, 128, 9000);       /* positions past 8k: the angle is reduced in double */
    test_elementwise(100003);
    test_embed_rows(257, 96, 1000);
    test_loss_head(7, 257, 0);
    test_loss_head(33, 5000, 0.04);
    test_optimizer(1000003);
    printf("attention against the double CPU path, and its backward run twice\n");
    const att_case cases[] = {
        { 1, { 1 }, 0, 4, 4, 64 },                    /* S = 1 */
        { 1, { 200 }, 0, 8, 2, 128 },                 /* Phase A/C: one causal segment */
        { 2, { 100, 100 }, 0, 4, 1, 64 },             /* baseline, padded */
        { 1, { 1 }, 1, 4, 4, 64 },                    /* P = 1, S = 1, G = 1 */
        { 1, { 70 }, 130, 8, 8, 128 },                /* G = 1, GQA 1 */
        { 4, { 65, 65, 65, 65 }, 63, 8, 2, 128 },     /* padded: equal lengths, GQA 4 */
        { 5, { 1, 64, 3, 129, 17 }, 97, 16, 2, 64 },  /* packed ragged, GQA 8 */
        { 3, { 33, 1, 80 }, 64, 32, 8, 128 },         /* Llama 3 heads */
        { 2, { 9, 40 }, 200, 4, 1, 16 },              /* tiny preset's head dim */
        { 3, { 50, 20, 7 }, 45, 4, 1, 32 },           /* tiny-qwen3's */
        { 8, { 5, 6, 7, 8, 9, 10, 11, 12 }, 300, 8, 8, 64 },
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) test_attention(&cases[i]);
    printf("whole steps, twice each\n");
    test_step_determinism("model/tiny", PR_SCHEDULE_REUSE);
    test_step_determinism("model/tiny", PR_SCHEDULE_BASELINE);
    test_step_determinism("model/tiny-qwen3", PR_SCHEDULE_REUSE);
    pr_backend_cuda_destroy(be);
    return test_report();
}
