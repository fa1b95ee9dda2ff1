/* GPU tests: every kernel of the CUDA backend against the CPU backend in double precision
   (test/gpu_ref.c), on fresh random inputs, with poisoned outputs; the attention kernels over many
   shapes; bitwise determinism of the attention backward and of a whole training step (on the
   emulated device the repeat runs its threads in the other order: test/gpu_copy.h).
   Inputs are drawn, rounded to bf16, and given to both sides, so the reference sees exactly what
   the GPU sees. Errors are ||gpu - ref|| / ||ref||: bf16 outputs within 1e-2, fp32 outputs within
   1e-5 (the limits the CUDA backend promises). The attention backward's outputs are added into
   (+=): their error is taken on the increment (test/attn_check.h says why, and test_attn_check
   shows on the CPU that planted faults fail it). Needs a GPU: `make test-gpu`.

     build/test_gpu [kernels] [attention] [steps] [--cases LIST] [--list]
   runs the named parts only (all by default); --cases (e.g. 0,3,8-10) runs only those attention
   shapes (the attention part alone, unless parts are named); --list prints the shapes. */
#define _POSIX_C_SOURCE 200809L   /* setenv, strdup */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "gpu_copy.h"
#include "gpu_ref.h"
#include "attn_check.h"
#include "harness.h"
#include "xorshift.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TOL_BF16 1e-2
#define TOL_FP32 1e-5

static const pr_backend *be;
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint16_t to_bf16(double x) { return pr_f32_to_bf16((float)x); }
static double from_bf16(uint16_t b) { return pr_bf16_to_f32(b); }
/* n values in (-scale, scale), already representable in bf16 */
static double *random_bf16(size_t n, double scale) {
    double *x = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = from_bf16(to_bf16(scale * test_uniform(&rng)));
    return x;
}
static double *random_f32(size_t n, double scale) {
    double *x = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = (float)(scale * test_uniform(&rng));
    return x;
}
static double *copy_of(const double *x, size_t n) {
    double *y = malloc(sizeof(double) * (n ? n : 1));
    memcpy(y, x, sizeof(double) * n);
    return y;
}

/* Device buffers from host doubles (bf16 or fp32 on the device) and back (gpu_copy.h). */
static void *dev_bf16(const double *x, size_t n) { return gpu_upload(be, x, n, 1); }
static void *dev_f32(const double *x, size_t n) { return gpu_upload(be, x, n, 0); }
static void *dev_poison(size_t n, size_t elem) { return gpu_poison(be, n, elem); }
static double *host_bf16(const void *d, size_t n) { return gpu_download(be, d, n, 1); }
static double *host_f32(const void *d, size_t n) { return gpu_download(be, d, n, 0); }
static void release(void *d) { be->release(be, d, PR_TIER_DEVICE); }

#define EXPECT_CLOSE(gpu, ref, n, tol, what, ...)                                           \
    do {                                                                                    \
        double e_ = rel_err(gpu, ref, n);                                                   \
        CHECK(e_ <= (tol), "%s: relative error %.3e > %.0e", what, e_, (double)(tol));      \
    } while (0)

static void expect_backend_ok(const char *what) {
    pr_error err;
    CHECK(be->take_error(be, &err) == PR_OK, "%s: %s", what, err.message);
}

/* ---------------------------------------------------------------- kernels */
static void test_matmul(int N, int C, int OC) {
    /* the weights as the kernels read them: bf16 */
    double *x = random_bf16((size_t)N * C, 1), *wb = random_bf16((size_t)OC * C, 0.1), *dy = random_bf16((size_t)N * OC, 1);
    double *dx0 = random_bf16((size_t)N * C, 1), *dw0 = random_f32((size_t)OC * C, 1);
    double *ref_y = calloc((size_t)N * OC, sizeof(double)), *ref_dx = copy_of(dx0, (size_t)N * C), *ref_dw = copy_of(dw0, (size_t)OC * C);
    ref_matmul_fwd(ref_y, x, wb, N, C, OC);
    ref_matmul_bwd(ref_dx, ref_dw, dy, x, wb, N, C, OC);
    void *w_ = dev_bf16(wb, (size_t)OC * C);
    void *dx_ = dev_bf16(x, (size_t)N * C), *dy_ = dev_bf16(dy, (size_t)N * OC), *y_ = dev_poison((size_t)N * OC, 2);
    void *ddx = dev_bf16(dx0, (size_t)N * C), *ddw = dev_f32(dw0, (size_t)OC * C);
    be->matmul_fwd(be, y_, dx_, w_, N, C, OC);
    be->matmul_bwd(be, ddx, ddw, dy_, dx_, w_, N, C, OC);
    expect_backend_ok("matmul");
    double *y = host_bf16(y_, (size_t)N * OC), *gdx = host_bf16(ddx, (size_t)N * C), *gdw = host_f32(ddw, (size_t)OC * C);
    char what[96];
    snprintf(what, sizeof what, "matmul_fwd %dx%dx%d", N, C, OC);
    EXPECT_CLOSE(y, ref_y, (size_t)N * OC, TOL_BF16, what);
    snprintf(what, sizeof what, "matmul_bwd dinp %dx%dx%d", N, C, OC);
    EXPECT_CLOSE(gdx, ref_dx, (size_t)N * C, TOL_BF16, what);
    snprintf(what, sizeof what, "matmul_bwd dw %dx%dx%d", N, C, OC);
    EXPECT_CLOSE(gdw, ref_dw, (size_t)OC * C, TOL_FP32, what);
    release(w_); release(dx_); release(dy_); release(y_); release(ddx); release(ddw);
    free(x); free(wb); free(dy); free(dx0); free(dw0); free(ref_y); free(ref_dx); free(ref_dw);
    free(y); free(gdx); free(gdw);
}

/* The forward GEMM into memory nothing has written (a fresh allocation, not poisoned), then read
   back twice: by a copy, and by one of our kernels (the conversion to fp32, as pr_k_rope reads the
   q and k projections). Alone it checks the product again; under compute-sanitizer's initcheck
   (bench/run_gpu.sh) it tells whether the tool sees cuBLASLt's stores: if it reports the copy or
   the conversion as reading uninitialised memory, reports in kernels that read a GEMM's output
   are the tool's, not ours.
   Shapes: model/tiny's q projection over a padded baseline microbatch, and its MLP's up projection
   over a ragged one. */
static void test_matmul_fresh_output(int N, int C, int OC) {
    double *x = random_bf16((size_t)N * C, 1), *wb = random_bf16((size_t)OC * C, 0.1);
    double *ref_y = calloc((size_t)N * OC, sizeof(double));
    ref_matmul_fwd(ref_y, x, wb, N, C, OC);
    void *w_ = dev_bf16(wb, (size_t)OC * C), *x_ = dev_bf16(x, (size_t)N * C);
    void *y_ = be->alloc(be, sizeof(uint16_t) * (size_t)N * OC, PR_TIER_DEVICE);
    CHECK(y_ != NULL, "matmul_fwd into fresh memory: no allocation");
    if (y_) {
        be->matmul_fwd(be, y_, x_, w_, N, C, OC);
        expect_backend_ok("matmul into fresh memory");
        double *y = host_bf16(y_, (size_t)N * OC);
        char what[96];
        snprintf(what, sizeof what, "matmul_fwd %dx%dx%d into fresh memory", N, C, OC);
        EXPECT_CLOSE(y, ref_y, (size_t)N * OC, TOL_BF16, what);
        float *r_ = (float *)dev_poison((size_t)N * OC, 4);
        be->acts_to_reals(be, r_, y_, (size_t)N * OC);
        expect_backend_ok("a kernel reading a GEMM's fresh output");
        double *r = host_f32(r_, (size_t)N * OC);
        snprintf(what, sizeof what, "matmul_fwd %dx%dx%d into fresh memory, read by a kernel", N, C, OC);
        EXPECT_CLOSE(r, y, (size_t)N * OC, 0, what);
        free(y); free(r);
        release(y_); release(r_);
    }
    release(w_); release(x_);
    free(x); free(wb); free(ref_y);
}

static void test_rmsnorm(int N, int C) {
    double *x = random_bf16((size_t)N * C, 2), *w = random_bf16(C, 1), *dy = random_bf16((size_t)N * C, 1);
    double *dx0 = random_bf16((size_t)N * C, 1), *dw0 = random_f32(C, 1);
    double *ry = malloc(sizeof(double) * N * C), *rr = malloc(sizeof(double) * N);
    double *rdx = copy_of(dx0, (size_t)N * C), *rdw = copy_of(dw0, C);
    ref_rmsnorm_fwd(ry, rr, x, w, N, C, 1e-5);
    void *x_ = dev_bf16(x, (size_t)N * C), *w_ = dev_bf16(w, C), *y_ = dev_poison((size_t)N * C, 2), *r_ = dev_poison(N, 4);
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

/* SwiGLU over rows whose gate and up are the two halves of a row of gu (rows, 2F), against the
   formula here on separate gate and up arrays (its backward writes every element of dgu, which
   starts poisoned); then add. F not a multiple of a block, or below one. */
static void test_elementwise(int rows, int F) {
    const size_t n = (size_t)rows * F;
    double *g = random_bf16(n, 4), *u = random_bf16(n, 2), *dh = random_bf16(n, 1), *gu = malloc(sizeof(double) * 2 * n);
    double *rh = malloc(sizeof(double) * n), *rdg = malloc(sizeof(double) * n), *rdu = malloc(sizeof(double) * n);
    for (size_t r = 0; r < (size_t)rows; r++)
        for (size_t j = 0; j < (size_t)F; j++) {
            const size_t i = r * F + j;
            gu[2 * r * F + j] = g[i];
            gu[2 * r * F + F + j] = u[i];
            const double s = 1 / (1 + exp(-g[i]));
            rh[i] = g[i] * s * u[i];
            rdg[i] = dh[i] * u[i] * s * (1 + g[i] * (1 - s));
            rdu[i] = dh[i] * g[i] * s;
        }
    void *gu_ = dev_bf16(gu, 2 * n), *h_ = dev_poison(n, 2), *dh_ = dev_bf16(dh, n), *dgu_ = dev_poison(2 * n, 2);
    void *u_ = dev_bf16(u, n);
    be->swiglu_fwd(be, h_, gu_, rows, F);
    be->swiglu_bwd(be, dgu_, dh_, gu_, rows, F);
    be->add(be, dh_, u_, n);                     /* dh += u */
    expect_backend_ok("swiglu/add");
    double *gh = host_bf16(h_, n), *gdgu = host_bf16(dgu_, 2 * n), *gsum = host_bf16(dh_, n);
    double *gdg = malloc(sizeof(double) * n), *gdu = malloc(sizeof(double) * n), *rsum = malloc(sizeof(double) * n);
    for (size_t r = 0; r < (size_t)rows; r++)
        for (size_t j = 0; j < (size_t)F; j++) {
            gdg[r * F + j] = gdgu[2 * r * F + j];
            gdu[r * F + j] = gdgu[2 * r * F + F + j];
        }
    for (size_t i = 0; i < n; i++) rsum[i] = dh[i] + u[i];
    EXPECT_CLOSE(gh, rh, n, TOL_BF16, "swiglu_fwd");
    EXPECT_CLOSE(gdg, rdg, n, TOL_BF16, "swiglu_bwd dgate");
    EXPECT_CLOSE(gdu, rdu, n, TOL_BF16, "swiglu_bwd dup");
    EXPECT_CLOSE(gsum, rsum, n, TOL_BF16, "add");
    release(gu_); release(h_); release(dh_); release(dgu_); release(u_);
    free(g); free(u); free(dh); free(gu); free(rh); free(rdg); free(rdu);
    free(gh); free(gdgu); free(gsum); free(gdg); free(gdu); free(rsum);
}

static void test_embed_rows(int N, int C, int V) {
    int32_t *tok = malloc(sizeof(int32_t) * N);
    for (int i = 0; i < N; i++)     /* repeats on purpose; -1: a token of another TP rank's vocabulary slice */
        tok[i] = i % 7 == 3 ? -1 : (int32_t)((test_uniform(&rng) + 1) / 2 * (V / 4));
    double *emb = random_bf16((size_t)V * C, 1), *dy = random_bf16((size_t)N * C, 1), *demb0 = random_f32((size_t)V * C, 1);
    double *ry = malloc(sizeof(double) * N * C), *rd = copy_of(demb0, (size_t)V * C);
    ref_embed_fwd(ry, tok, emb, N, C);
    ref_embed_bwd(rd, dy, tok, N, C);
    void *emb_ = dev_bf16(emb, (size_t)V * C), *y_ = dev_poison((size_t)N * C, 2), *dy_ = dev_bf16(dy, (size_t)N * C);
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
    EXPECT_CLOSE(gy, ry, (size_t)N * C, 1e-12, "embed_fwd (exact: bf16 rows copied)");
    EXPECT_CLOSE(gd, rd, (size_t)V * C, TOL_FP32, "embed_bwd");
    EXPECT_CLOSE(gg, rg, (size_t)M * C, 1e-12, "gather_rows (exact)");
    EXPECT_CLOSE(gs, rs, (size_t)N * C, 1e-12, "scatter_add_rows (doubling is exact)");
    release(emb_); release(y_); release(dy_); release(d_); release(gat);
    free(tok); free(emb); free(dy); free(demb0); free(ry); free(rd); free(rows); free(gy); free(gd); free(gg); free(gs); free(rg); free(rs);
}

/* scatter_add_rows with repeated rows, as the loss head (a prefix's last row for every suffix) and
   MoE's combine (a token's experts) send them: each destination row must receive every addition,
   in source order, each rounded to bf16 as it lands. Small integers, halves and weights of powers
   of two keep every sum before its rounding exact, so the reference rounds the same way and the
   result must match it bit for bit, twice. */
static void test_scatter_repeats(int N, int M, int C) {
    int *rows = malloc(sizeof(int) * M);
    double *src = malloc(sizeof(double) * M * C), *d0 = malloc(sizeof(double) * N * C);
    pr_real *w = malloc(sizeof(pr_real) * M);
    for (int m = 0; m < M; m++) {
        rows[m] = m % 3 ? N - 1 : (m / 3) % N;     /* two thirds onto the last row, the rest spread */
        w[m] = m % 4 == 1 ? 0.5 : 1.0;
        for (int c = 0; c < C; c++) src[(size_t)m * C + c] = (double)((m + 3 * c) % 5 - 2);
    }
    for (size_t i = 0; i < (size_t)N * C; i++) d0[i] = (double)((int)(i % 17) - 8);
    double *ref = copy_of(d0, (size_t)N * C);
    for (int m = 0; m < M; m++)
        for (int c = 0; c < C; c++) {
            double *r = &ref[(size_t)rows[m] * C + c];
            *r = from_bf16(to_bf16(*r + w[m] * src[(size_t)m * C + c]));
        }
    void *src_ = dev_bf16(src, (size_t)M * C);
    double *got[2];
    for (int run = 0; run < 2; run++) {
        void *d_ = dev_bf16(d0, (size_t)N * C);
        be->scatter_add_rows(be, d_, src_, rows, w, M, C);
        expect_backend_ok("scatter_add_rows, repeated rows");
        got[run] = host_bf16(d_, (size_t)N * C);
        release(d_);
    }
    EXPECT_CLOSE(got[0], ref, (size_t)N * C, 1e-12, "scatter_add_rows, repeated rows (exact)");
    CHECK(!memcmp(got[0], got[1], sizeof(double) * N * C), "scatter_add_rows, repeated rows: two runs differ");
    release(src_);
    free(rows); free(src); free(d0); free(w); free(ref); free(got[0]); free(got[1]);
}

/* The loss head's two passes, rows whose target is on another TP rank's vocabulary slice (< 0)
   among them: the statistics against the CPU's on the same bf16 logits, then the gradient pass
   from the CPU's log-sum-exps and slopes. */
static void test_logit_head(int M, int V) {
    double *z = random_bf16((size_t)M * V, 4), *coef = random_f32((size_t)M, 0.1);
    int32_t *tg = malloc(sizeof(int32_t) * M);
    for (int m = 0; m < M; m++) tg[m] = m % 5 == 4 ? -1 : (int32_t)((test_uniform(&rng) + 1) / 2 * (V - 1));
    double *rst = malloc(sizeof(double) * 3 * M), *gst = malloc(sizeof(double) * 3 * M), *lse = malloc(sizeof(double) * M);
    double *rz = copy_of(z, (size_t)M * V);
    ref_logit_stats(rst, z, tg, M, V);
    for (int m = 0; m < M; m++) lse[m] = rst[3 * m] + log(rst[3 * m + 1]);
    ref_logit_grad(rz, lse, coef, tg, M, V);
    void *z_ = dev_bf16(z, (size_t)M * V);
    be->logit_stats(be, gst, z_, tg, M, V);
    be->logit_grad(be, z_, lse, coef, tg, M, V);
    expect_backend_ok("logit_stats/logit_grad");
    double *rmax = malloc(sizeof(double) * M), *gmax = malloc(sizeof(double) * M), *rsum = malloc(sizeof(double) * M);
    double *gsum = malloc(sizeof(double) * M), *rzt = malloc(sizeof(double) * M), *gzt = malloc(sizeof(double) * M);
    for (int m = 0; m < M; m++) {
        rmax[m] = rst[3 * m]; rsum[m] = rst[3 * m + 1]; rzt[m] = rst[3 * m + 2];
        gmax[m] = gst[3 * m]; gsum[m] = gst[3 * m + 1]; gzt[m] = gst[3 * m + 2];
    }
    EXPECT_CLOSE(gmax, rmax, M, 1e-12, "logit_stats max (exact: a bf16 logit)");
    EXPECT_CLOSE(gsum, rsum, M, TOL_FP32, "logit_stats sum of exponentials");
    EXPECT_CLOSE(gzt, rzt, M, 1e-12, "logit_stats target logit (exact; 0 off the slice)");
    double *gz = host_bf16(z_, (size_t)M * V);
    EXPECT_CLOSE(gz, rz, (size_t)M * V, TOL_BF16, "logit_grad dlogits");
    release(z_);
    free(z); free(coef); free(tg); free(rst); free(gst); free(lse); free(rz); free(rmax); free(gmax); free(rsum); free(gsum);
    free(rzt); free(gzt); free(gz);
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

/* The operation profile: each operation timed once (a wrapper that calls another counts as the
   outer one), GEMMs by shape, nothing counted while it is off, and a restart clears the sums. */
static const pr_cuda_op_time *profile_row(const pr_cuda_op_time *rows, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(rows[i].name, name)) return &rows[i];
    return NULL;
}
static void test_profile(void) {
    const int N = 96, C = 64, OC = 176;
    pr_error err;
    double *x = random_bf16((size_t)N * C, 1), *w = random_bf16((size_t)OC * C, 1);
    void *x_ = dev_bf16(x, (size_t)N * C), *w_ = dev_bf16(w, (size_t)OC * C), *y_ = dev_poison((size_t)N * OC, 2);
    float *r_ = (float *)dev_poison((size_t)N * OC, 4);
    be->matmul_fwd(be, y_, x_, w_, N, C, OC);                     /* before the profile: not counted */
    CHECK(pr_backend_cuda_profile(be, 1, &err) == PR_OK, "profile on: %s", err.message);
    for (int i = 0; i < 3; i++) be->matmul_fwd(be, y_, x_, w_, N, C, OC);
    be->matmul_fwd(be, y_, w_, x_, OC, C, N);
    be->bf16_to_reals(be, r_, (const uint16_t *)y_, (size_t)N * OC);   /* acts_to_reals inside */
    CHECK(pr_backend_cuda_profile(be, 0, &err) == PR_OK, "profile off: %s", err.message);
    be->matmul_fwd(be, y_, x_, w_, N, C, OC);                     /* after it: not counted */
    expect_backend_ok("profile");
    pr_cuda_op_time rows[8];
    int complete = 0;
    const int n = pr_backend_cuda_profile_read(be, rows, 8, &complete);
    char name[PR_CUDA_OP_NAME];
    snprintf(name, sizeof name, "matmul_fwd %dx%d", C, OC);
    const pr_cuda_op_time *a = profile_row(rows, n, name), *b, *conv = profile_row(rows, n, "bf16_to_reals");
    snprintf(name, sizeof name, "matmul_fwd %dx%d", C, N);
    b = profile_row(rows, n, name);
    CHECK(n == 3 && complete, "profile: %d operations (want 3: two GEMM shapes and a conversion), complete %d", n, complete);
    CHECK(a && a->calls == 3 && a->seconds > 0 && b && b->calls == 1 && b->seconds > 0,
          "profile: the GEMMs by shape, 3 and 1 calls with their time: %s %ld, %s %ld", a ? a->name : "none", a ? a->calls : 0,
          b ? b->name : "none", b ? b->calls : 0);
    CHECK(conv && conv->calls == 1 && !profile_row(rows, n, "acts_to_reals"), "profile: the conversion once, as the outer operation");
    for (int i = 1; i < n && i < 8; i++)
        CHECK(rows[i - 1].seconds >= rows[i].seconds, "profile: rows %d and %d not the longest first", i - 1, i);
    CHECK(pr_backend_cuda_profile(be, 1, &err) == PR_OK && pr_backend_cuda_profile_read(be, rows, 8, &complete) == 0 && complete,
          "profile: a restart clears the sums");
    pr_backend_cuda_profile(be, 0, &err);
    release(x_); release(w_); release(y_); release(r_);
    free(x); free(w);
}

/* The GEMM algorithm cache, as MoE uses it: 5,000 shapes each new (an expert's row count is a new
   shape), more than the cache holds, and between every ten of them one shape used all along (a
   dense layer's projection). Each new shape is asked of the heuristic once; the shape in use all
   along never again, however many new ones pass; and its product stays bit for bit the same
   (its algorithm was not overwritten by another's). */
static void test_gemm_algo_cache(void) {
    enum { NEW = 5000, DN = 24, DC = 96, DOC = 88, MAX = 128 };
    double *x = random_bf16(MAX * MAX, 1), *w = random_bf16(MAX * MAX, 0.1);
    void *x_ = dev_bf16(x, MAX * MAX), *w_ = dev_bf16(w, MAX * MAX), *y_ = dev_poison(MAX * MAX, 2);
    be->matmul_fwd(be, y_, x_, w_, DN, DC, DOC);
    double *first = host_bf16(y_, (size_t)DN * DOC);
    const pr_cuda_gemm_counts c0 = pr_backend_cuda_gemm_counts(be);
    for (int i = 0; i < NEW; i++) {
        if (i % 10 == 0) be->matmul_fwd(be, y_, x_, w_, DN, DC, DOC);
        /* 50 row counts x 10 widths x 10 outputs: none the shape in use all along (its width is 96),
           none a shape the tests above ran (their forward GEMMs' rows are outside 51 .. 100) */
        be->matmul_fwd(be, y_, x_, w_, 51 + i % 50, 8 * (1 + (i / 50) % 10), 8 * (1 + i / 500));
    }
    const pr_cuda_gemm_counts c1 = pr_backend_cuda_gemm_counts(be);
    be->matmul_fwd(be, y_, x_, w_, DN, DC, DOC);
    be->matmul_fwd(be, y_, x_, w_, 100, 80, 80);                 /* the newest shape: still held */
    const pr_cuda_gemm_counts c2 = pr_backend_cuda_gemm_counts(be);
    be->matmul_fwd(be, y_, x_, w_, DN, DC, DOC);
    double *last = host_bf16(y_, (size_t)DN * DOC);
    expect_backend_ok("GEMM algorithm cache");
    CHECK(c1.lookups - c0.lookups == NEW + NEW / 10, "GEMM algorithm cache: %ld lookups, want %d", c1.lookups - c0.lookups,
          NEW + NEW / 10);
    CHECK(c1.queries - c0.queries == NEW,
          "GEMM algorithm cache: %ld heuristic queries for %d new shapes and one in use all along (want one a new shape)",
          c1.queries - c0.queries, NEW);
    CHECK(c1.evictions - c0.evictions >= NEW - 4096 + 1 && c1.evictions - c0.evictions <= NEW,
          "GEMM algorithm cache: %ld evictions for %d shapes in a cache of 4096", c1.evictions - c0.evictions, NEW + 1);
    CHECK(c2.lookups - c1.lookups == 2 && c2.queries == c1.queries, "GEMM algorithm cache: shapes just used were asked again");
    EXPECT_CLOSE(last, first, (size_t)DN * DOC, 0, "GEMM algorithm cache: the shape in use all along, its product at the end");
    release(x_); release(w_); release(y_);
    free(x); free(w); free(first); free(last);
}

/* ---------------------------------------------------------------- attention */
static void test_attention(int index) {
    const att_case *c = &att_cases[index];
    att_problem p;
    att_problem_init(&p, c, ATT_QK_SCALE, (uint64_t)index);
    const int N = p.N, np = p.np;
    const size_t nq = p.nq, nk = p.nk, npk = p.npk;
    double *ro = malloc(sizeof(double) * nq), *rl = malloc(sizeof(double) * (size_t)N * c->NH);
    ref_attention_fwd(ro, rl, p.q, p.k, p.v, np ? p.kp : NULL, np ? p.vp : NULL, p.seg_off, c->n_seg, np, c->NH, c->NKV, c->HS);
    pr_seq_layout lay = { c->n_seg, p.seg_off, np, np };
    void *q_ = dev_bf16(p.q, nq), *k_ = dev_bf16(p.k, nk), *v_ = dev_bf16(p.v, nk), *kp_ = dev_bf16(p.kp, npk), *vp_ = dev_bf16(p.vp, npk);
    void *o_ = dev_poison(nq, 2), *l_ = dev_poison((size_t)N * c->NH, 4);
    be->attention_fwd(be, o_, l_, q_, k_, v_, np ? kp_ : NULL, np ? vp_ : NULL, &lay, c->NH, c->NKV, c->HS);
    expect_backend_ok("attention_fwd");
    double *go = host_bf16(o_, nq), *gl = host_f32(l_, (size_t)N * c->NH);
    char what[160], w2[200];
    att_case_name(c, what, sizeof what);
    snprintf(w2, sizeof w2, "%s: out", what);
    EXPECT_CLOSE(go, ro, nq, ATT_TOL, w2);
    snprintf(w2, sizeof w2, "%s: lse", what);
    EXPECT_CLOSE(gl, rl, (size_t)N * c->NH, ATT_TOL_LSE, w2);

    /* the backward from the GPU's own forward outputs, twice, adding into start values of the
       increment's size; errors on the increment */
    att_problem_reference(&p, go, gl, 0);
    void *dout_ = dev_bf16(p.dout, nq);
    void *bits[2][ATT_N_GRADS];
    for (int run = 0; run < 2; run++) {
        for (int g = 0; g < ATT_N_GRADS; g++)
            bits[run][g] = g < ATT_DKP ? dev_bf16(p.init[g], p.n[g]) : dev_f32(p.init[g], p.n[g]);
        const int order = run ? gpu_order_flip() : 0;       /* the second run in the other order (gpu_copy.h) */
        be->attention_bwd(be, bits[run][ATT_DQ], bits[run][ATT_DK], bits[run][ATT_DV], np ? bits[run][ATT_DKP] : NULL,
                          np ? bits[run][ATT_DVP] : NULL, dout_, o_, l_, q_, k_, v_, np ? kp_ : NULL, np ? vp_ : NULL,
                          &lay, c->NH, c->NKV, c->HS);
        if (run) gpu_order_restore(order);
        expect_backend_ok("attention_bwd");
    }
    double *got[ATT_N_GRADS], err[ATT_N_GRADS];
    for (int g = 0; g < ATT_N_GRADS; g++)
        got[g] = g < ATT_DKP ? host_bf16(bits[0][g], p.n[g]) : host_f32(bits[0][g], p.n[g]);
    att_grad_errors(&p, got, err);
    for (int g = 0; g < (np ? ATT_N_GRADS : ATT_DKP); g++)
        CHECK(err[g] <= ATT_TOL, "%s: %s: error %.3e of the increment > %.0e", what, att_grad_name[g], err[g], ATT_TOL);
    /* determinism: the second run's bits equal the first's */
    int same = 1;
    for (int g = 0; g < ATT_N_GRADS; g++) {
        size_t bytes = p.n[g] * (g < ATT_DKP ? 2 : 4);
        char *a = malloc(bytes), *b = malloc(bytes);
        be->copy(be, a, bits[0][g], bytes);
        be->copy(be, b, bits[1][g], bytes);
        be->sync(be);
        same &= !memcmp(a, b, bytes);
        free(a); free(b);
        release(bits[0][g]); release(bits[1][g]);
        free(got[g]);
    }
    CHECK(same, "%s: backward bitwise reproducible", what);
    release(q_); release(k_); release(v_); release(kp_); release(vp_); release(o_); release(l_); release(dout_);
    free(ro); free(rl); free(go); free(gl);
    att_problem_free(&p);
}

/* ---------------------------------------------------------------- whole steps */
/* A trainer of the model on the GPU, seeded, and the sample trace; NULL (a failed check) if
   either cannot be had. */
static pr_trainer *step_setup(const char *model, pr_trace *trace, const char *what) {
    pr_error err;
    pr_config cfg;
    pr_trainer *tr = NULL;
    if (pr_config_load(&cfg, model, &err) || pr_trace_read(trace, "data/sample.trace", &err)) {
        CHECK(0, "%s setup: %s", what, err.message);
        return NULL;
    }
    if (pr_trainer_create(&tr, &cfg, be, &err) || pr_trainer_init_params(tr, 7, &err)) {
        CHECK(0, "%s trainer: %s", what, err.message);
        pr_trainer_destroy(tr);
        pr_trace_free(trace);
        return NULL;
    }
    return tr;
}

/* One step, twice: the same gradients bitwise. */
static void test_step_determinism(const char *model, pr_schedule sched) {
    pr_error err;
    pr_trace trace;
    pr_trainer *tr = step_setup(model, &trace, "step determinism");
    if (!tr) return;
    size_t n = pr_trainer_param_count(tr);
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
    pr_step_opts o = pr_step_opts_default();
    o.schedule = sched;
    o.microbatch = 3;
    o.layout = PR_LAYOUT_PACKED;
    int ok = !pr_trainer_compute_grads(tr, &trace.groups[0], &o, NULL, NULL, &err) && !pr_trainer_get_grads(tr, a, n, &err);
    const int order = gpu_order_flip();                    /* the second step in the other order (gpu_copy.h) */
    ok = ok && !pr_trainer_compute_grads(tr, &trace.groups[0], &o, NULL, NULL, &err) && !pr_trainer_get_grads(tr, b, n, &err);
    gpu_order_restore(order);
    CHECK(ok, "step on %s: %s", model, err.message);
    CHECK(ok && !memcmp(a, b, sizeof(float) * n), "%s %s: two runs of one step differ", model,
          sched == PR_SCHEDULE_REUSE ? "reuse" : "baseline");
    free(a); free(b);
    pr_trainer_destroy(tr);
    pr_trace_free(&trace);
}

/* Offload's block copies are timed on the copy queue: a reuse step with offload reports their time
   (what --bench memory prints beside the step time), one without reports none. */
static void test_offload_copy_time(const char *model) {
    pr_error err;
    pr_trace trace;
    pr_trainer *tr = step_setup(model, &trace, "offload copy time");
    if (!tr) return;
    pr_step_opts o = pr_step_opts_default();
    pr_step_stats on, off;
    o.offload.enabled = 1;
    int ok = !pr_trainer_compute_grads(tr, &trace.groups[0], &o, &on, NULL, &err);
    o.offload.enabled = 0;
    ok = ok && !pr_trainer_compute_grads(tr, &trace.groups[0], &o, &off, NULL, &err);
    CHECK(ok, "offload step on %s: %s", model, err.message);
    CHECK(ok && on.offload.offloaded_bytes > 0 && on.offload.copy_seconds > 0, "%s: offload moved %zu bytes in %.3g s of copies",
          model, ok ? on.offload.offloaded_bytes : 0, ok ? on.offload.copy_seconds : 0.0);
    CHECK(ok && off.offload.copy_seconds == 0, "%s: a step without offload reports %.3g s of copies", model,
          ok ? off.offload.copy_seconds : 0.0);
    pr_trainer_destroy(tr);
    pr_trace_free(&trace);
}

/* A TCP port free at the moment below the local port range (32768 on, where an outgoing
   connection could take it), or 0. */
static int free_tcp_port(void) {
    for (int tries = 0; tries < 1000; tries++) {
        const int port = 20000 + (int)((getpid() + 7919 * tries) % 12000);
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        const int bound = fd >= 0 && !bind(fd, (struct sockaddr *)&a, sizeof a);
        if (fd >= 0) close(fd);
        if (bound) return port;
    }
    return 0;
}

/* The id over TCP on a world of one rank: a spec that is not tcp://HOST:PORT refused before
   anything is set up, and a well-formed one taking rank 0 through the port to a working
   communicator. (Ranks that meet over it, and those refused: test/run_mesh_gpu.sh.) */
static void test_nccl_tcp_one_rank(void) {
    pr_error err;
    pr_comm *world = NULL;
    const char *bad[] = { "tcp://host", "tcp://:29500", "tcp://host:0", "tcp://host:65536", "tcp://host:12x", "tcp://[]:29500",
                          "tcp://::1", "tcp://[::1]]:29500", "tcp://[::1:29500" };
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        pr_status st = pr_comm_nccl_create(&world, be, 0, 1, bad[k], 5, &err);
        CHECK((st == PR_ERR_ARG && strstr(err.message, "tcp://HOST:PORT")) || st == PR_ERR_UNSUPPORTED,
              "NCCL: the id spec %s accepted (%d: %s)", bad[k], (int)st, err.message);
    }
    char spec[64];
    const int port = free_tcp_port();
    CHECK(port > 0, "no free TCP port on the loopback");
    if (port <= 0) return;
    snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", port);
    pr_status st = pr_comm_nccl_create(&world, be, 0, 1, spec, 5, &err);
    if (st == PR_ERR_UNSUPPORTED) return;
    CHECK(st == PR_OK, "NCCL: one rank over %s: %s", spec, err.message);
    if (st) return;
    const int ok = !world->barrier(world, &err);
    CHECK(ok, "NCCL: a barrier over the communicator from %s: %s", spec, err.message);
    world->destroy(world);
    /* rank 0 closed the port once every rank had the id: the next launch may take it */
    st = pr_comm_nccl_create(&world, be, 0, 1, spec, 5, &err);
    CHECK(st == PR_OK, "NCCL: a second launch over %s: %s", spec, err.message);
    if (!st) world->destroy(world);
    expect_backend_ok("NCCL over TCP: one rank");
}

/* The NCCL communicator on a world of one rank (one GPU cannot hold more): its set-up through the
   id file, an all-reduce, an all-gather and a barrier, each waited for by the watched wait, a
   split, and a timeout below one second refused. A build without NCCL says so instead. (test/
   run_gpu.sh runs these once more under NCCL_COMM_BLOCKING=0, every communicator non-blocking.) */
static void test_nccl_one_rank(void) {
    pr_error err;
    char id_path[600];
    snprintf(id_path, sizeof id_path, "%s/pr-test-gpu-nccl-id.%ld", test_tmpdir(), (long)getpid());
    pr_comm *world = NULL, *sub = NULL;
    pr_status st = pr_comm_nccl_create(&world, be, 0, 1, id_path, 0, &err);
    CHECK(st == PR_ERR_ARG || st == PR_ERR_UNSUPPORTED, "NCCL: a timeout of 0 s accepted (%d: %s)", (int)st, err.message);
    st = pr_comm_nccl_create(&world, be, 0, 1, id_path, 5, &err);
    if (st == PR_ERR_UNSUPPORTED) {
        printf("NCCL: %s\n", err.message);
        return;
    }
    CHECK(st == PR_OK, "NCCL: one rank: %s", err.message);
    if (st) return;
    CHECK(access(id_path, F_OK) != 0, "NCCL: rank 0 left its id file %s behind", id_path);
    const size_t n = 1000;
    double *x = random_f32(n, 1.0);
    float *d = dev_f32(x, n), *all = dev_poison(n, sizeof(float));
    int ok = !world->all_reduce(world, d, n, PR_COMM_F32, &err) && !world->all_gather(world, all, d, n, PR_COMM_F32, &err) &&
             !world->barrier(world, &err) && !world->split(world, 0, 0, &sub, &err) && !sub->all_reduce(sub, d, n, PR_COMM_F32, &err);
    CHECK(ok, "NCCL: one rank's operations: %s", err.message);
    double *got = host_f32(d, n), *gathered = host_f32(all, n);
    CHECK(ok && !memcmp(got, x, sizeof(double) * n) && !memcmp(gathered, x, sizeof(double) * n),
          "NCCL: one rank's sum and gather change its values");
    free(got);
    free(gathered);
    free(x);
    release(d);
    release(all);
    if (sub) sub->destroy(sub);
    world->destroy(world);
    /* an argument a call refuses aborts the communicator like a failure (the peers would be in
       their part of it): a send to itself, and a split color below 0 (NCCL's "no color") */
    for (int k = 0; k < 2; k++) {
        if (pr_comm_nccl_create(&world, be, 0, 1, id_path, 5, &err)) {
            CHECK(0, "NCCL: one rank again: %s", err.message);
            break;
        }
        float *buf = dev_poison(4, sizeof(float));
        sub = NULL;
        st = k ? world->split(world, -1, 0, &sub, &err) : world->send(world, buf, 4, PR_COMM_F32, 0, &err);
        CHECK(st == PR_ERR_DEVICE && strstr(err.message, k ? "color -1" : "peer 0") && strstr(err.message, "aborted") && !sub,
              "NCCL: %s not refused with an abort (%d: %s)", k ? "a split color of -1" : "a send to itself", (int)st, err.message);
        st = world->barrier(world, &err);
        CHECK(st == PR_ERR_DEVICE && strstr(err.message, "aborted after an earlier failure"),
              "NCCL: a barrier after the refused call ran (%d: %s)", (int)st, err.message);
        release(buf);
        world->destroy(world);
    }
    expect_backend_ok("NCCL: one rank");
}

/* A world of two whose rank 1 never comes: rank 0's set-up gives up after its timeout, naming the
   wait, rather than wait in NCCL's init for ever, and leaves no id file behind. */
static void test_nccl_missing_peer(void) {
    const char *blocking = getenv("NCCL_COMM_BLOCKING");
    if (blocking && *blocking && strtoll(blocking, NULL, 0) == 1) {   /* as NCCL reads it */
        printf("NCCL: NCCL_COMM_BLOCKING=%s makes the set-up blocking, unwatched: a missing peer not tried\n", blocking);
        return;
    }
    pr_error err;
    char id_path[600];
    snprintf(id_path, sizeof id_path, "%s/pr-test-gpu-nccl-missing.%ld", test_tmpdir(), (long)getpid());
    pr_comm *world = NULL;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const pr_status st = pr_comm_nccl_create(&world, be, 0, 2, id_path, 2, &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (st == PR_ERR_UNSUPPORTED) return;
    const double took = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    CHECK(st == PR_ERR_DEVICE && strstr(err.message, "did not come together within 2 s") && !world,
          "NCCL: rank 0 of two without rank 1 (%d: %s)", (int)st, err.message);
    CHECK(took >= 2 && took < 60, "NCCL: rank 0 of two gave up after %.1f s, its timeout 2 s", took);
    CHECK(access(id_path, F_OK) != 0, "NCCL: rank 0 left its id file %s behind", id_path);
    if (world) world->destroy(world);
    expect_backend_ok("NCCL: a missing peer");
}

/* After an AdamW step the bf16 weights the kernels read are the updated fp32 masters rounded to
   nearest even, element for element (a stale copy would train on the old weights unnoticed). */
static void test_weights_refresh(const char *model) {
    pr_error err;
    pr_trace trace;
    pr_trainer *tr = step_setup(model, &trace, "weights refresh");
    if (!tr) return;
    const size_t n = pr_trainer_param_count(tr);
    float *master = malloc(sizeof(float) * n);
    double *before = host_bf16(tr->weights, n);
    pr_step_opts o = pr_step_opts_default();
    pr_adamw_opts adam = pr_adamw_opts_default();
    int ok = !pr_trainer_compute_grads(tr, &trace.groups[0], &o, NULL, NULL, &err) && !pr_trainer_adamw_step(tr, &adam, NULL, &err) &&
             !pr_trainer_get_params(tr, master, n, &err);
    CHECK(ok, "weights refresh step on %s: %s", model, err.message);
    double *after = host_bf16(tr->weights, n);
    size_t stale = 0, moved = 0;
    for (size_t i = 0; ok && i < n; i++) {
        stale += after[i] != (double)pr_bf16_to_f32(pr_f32_to_bf16(master[i]));
        moved += after[i] != before[i];
    }
    CHECK(ok && stale == 0, "%s: %zu of %zu bf16 weights are not the updated masters rounded", model, stale, n);
    CHECK(ok && moved > n / 10, "%s: only %zu of %zu bf16 weights changed in the step", model, moved, n);
    free(master); free(before); free(after);
    pr_trainer_destroy(tr);
    pr_trace_free(&trace);
}

static void usage(FILE *f) {
    fprintf(f, "usage: test_gpu [kernels] [nccl] [attention] [steps] [--cases LIST] [--list]\n"
               "  the named parts only (default: all); --cases 0,3,8-10: those attention shapes only\n"
               "  (and only the attention part unless parts are named); --list: the shapes\n");
}

int main(int argc, char **argv) {
    int kernels = 0, nccl = 0, attention = 0, steps = 0, cases_given = 0, sel[ATT_N_CASES] = { 0 };
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "kernels")) kernels = 1;
        else if (!strcmp(argv[i], "nccl")) nccl = 1;
        else if (!strcmp(argv[i], "attention")) attention = 1;
        else if (!strcmp(argv[i], "steps")) steps = 1;
        else if (!strcmp(argv[i], "--cases")) {
            if (i + 1 == argc || !att_parse_cases(argv[i + 1], sel)) {
                fprintf(stderr, "test_gpu: --cases wants indices 0..%d, e.g. 0,3,8-10 (--list shows them)\n", ATT_N_CASES - 1);
                return 2;
            }
            cases_given = 1;
            i++;
        }
        else if (!strcmp(argv[i], "--list")) {
            char name[160];
            for (int c = 0; c < ATT_N_CASES; c++) { att_case_name(&att_cases[c], name, sizeof name); printf("%2d  %s\n", c, name); }
            return 0;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { usage(stdout); return 0; }
        else {
            fprintf(stderr, "test_gpu: unknown argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!kernels && !nccl && !attention && !steps) { attention = 1; kernels = nccl = steps = !cases_given; }
    if (!cases_given) for (int c = 0; c < ATT_N_CASES; c++) sel[c] = 1;
    pr_error err;
    if (pr_backend_cuda_create(&be, 0, &err) || pr_backend_cuda_set_attention(be, PR_CUDA_ATTENTION_FFMA, &err)) {
        printf("FAIL no CUDA backend: %s\n", err.message);
        printf("0 passed, 1 failed\n");
        return 1;
    }
    /* Above: the FFMA attention, the reference, at every head dim (a new backend runs the fastest
       kernels at 64 and 128; test_gpu_attention checks those against these). */
    if (kernels) {
        printf("kernels against the double CPU path\n");
        test_matmul(1, 64, 64);
        test_matmul(37, 256, 176);
        test_matmul(200, 512, 1000);
        test_matmul_fresh_output(256, 64, 64);
        test_matmul_fresh_output(294, 64, 176);
        test_rmsnorm(1, 64);
        test_rmsnorm(300, 4096);
        test_rmsnorm(5000, 128);       /* the q/k norm's shape: many short rows */
        test_rope(4, 16, 0);
        test_rope(8, 128, 9000);       /* positions past 8k: the angle is reduced in double */
        test_elementwise(331, 303);
        test_elementwise(2, 4099);
        test_elementwise(57, 48);                /* a block of 64 threads a row */
        test_embed_rows(257, 96, 1000);
        test_scatter_repeats(37, 600, 300);
        test_logit_head(7, 257);
        test_logit_head(33, 5000);
        test_optimizer(1000003);
        test_profile();
        test_gemm_algo_cache();
    }
    if (nccl) {
        printf("the NCCL communicator on one rank%s\n", getenv("NCCL_COMM_BLOCKING") ? ", NCCL_COMM_BLOCKING set" : "");
        test_nccl_one_rank();
        test_nccl_tcp_one_rank();
        test_nccl_missing_peer();
    }
    if (attention) {
        printf("attention against the double CPU path, and its backward run twice\n");
        for (int c = 0; c < ATT_N_CASES; c++)
            if (sel[c]) {
                printf("attention case %d\n", c);
                fflush(stdout);
                test_attention(c);
            }
    }
    if (steps) {
        printf("whole steps, twice each\n");
        test_step_determinism("model/tiny", PR_SCHEDULE_REUSE);
        test_step_determinism("model/tiny", PR_SCHEDULE_BASELINE);
        test_step_determinism("model/tiny-qwen3", PR_SCHEDULE_REUSE);
        test_weights_refresh("model/tiny");
        test_offload_copy_time("model/tiny");
    }
    pr_backend_cuda_destroy(be);
    return test_report();
}
