/* The double-precision CPU backend behind gpu_ref.h (see there). */
#define PR_DOUBLE
#define PRDEF static inline
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "gpu_ref.h"

static const pr_backend *cpu(void) { return pr_backend_cpu(); }
static pr_seq_layout layout(const int *seg_off, int n_seg, int pos0, int n_prefix) {
    pr_seq_layout l = { n_seg, seg_off, pos0, n_prefix };
    return l;
}

void ref_matmul_fwd(double *out, const double *inp, const double *w, int N, int C, int OC) {
    cpu()->matmul_fwd(cpu(), out, inp, w, N, C, OC);
}
void ref_matmul_bwd(double *dinp, double *dw, const double *dout, const double *inp, const double *w, int N, int C, int OC) {
    cpu()->matmul_bwd(cpu(), dinp, dw, dout, inp, w, N, C, OC);
}
void ref_rmsnorm_fwd(double *out, double *rstd, const double *inp, const double *w, int N, int C, double eps) {
    cpu()->rmsnorm_fwd(cpu(), out, rstd, inp, w, N, C, eps);
}
void ref_rmsnorm_bwd(double *dinp, double *dw, const double *dout, const double *inp, const double *w,
                     const double *rstd, int N, int C) {
    cpu()->rmsnorm_bwd(cpu(), dinp, dw, dout, inp, w, rstd, N, C);
}
void ref_rope(double *x, const int *seg_off, int n_seg, int pos0, int heads, int HS, const double *inv_freq, int backward) {
    pr_seq_layout l = layout(seg_off, n_seg, pos0, 0);
    if (backward) cpu()->rope_bwd(cpu(), x, &l, heads, HS, inv_freq);
    else cpu()->rope_fwd(cpu(), x, &l, heads, HS, inv_freq);
}
void ref_attention_fwd(double *out, double *lse, const double *q, const double *k, const double *v, const double *kp,
                       const double *vp, const int *seg_off, int n_seg, int n_prefix, int NH, int NKV, int HS) {
    pr_seq_layout l = layout(seg_off, n_seg, n_prefix, n_prefix);
    cpu()->attention_fwd(cpu(), out, lse, q, k, v, kp, vp, &l, NH, NKV, HS);
}
void ref_attention_bwd(double *dq, double *dk, double *dv, double *dkp, double *dvp, const double *dout,
                       const double *out, const double *lse, const double *q, const double *k, const double *v,
                       const double *kp, const double *vp, const int *seg_off, int n_seg, int n_prefix,
                       int NH, int NKV, int HS) {
    pr_seq_layout l = layout(seg_off, n_seg, n_prefix, n_prefix);
    cpu()->attention_bwd(cpu(), dq, dk, dv, dkp, dvp, dout, out, lse, q, k, v, kp, vp, &l, NH, NKV, HS);
}
void ref_embed_fwd(double *out, const int32_t *tokens, const double *emb, int N, int C) {
    cpu()->embed_fwd(cpu(), out, tokens, emb, N, C);
}
void ref_embed_bwd(double *demb, const double *dout, const int32_t *tokens, int N, int C) {
    cpu()->embed_bwd(cpu(), demb, dout, tokens, N, C);
}
void ref_logit_stats(double *stats, const double *logits, const int32_t *target, int M, int V) {
    cpu()->logit_stats(cpu(), stats, logits, target, M, V);
}
void ref_logit_grad(double *logits, const double *lse, const double *coef, const int32_t *target, int M, int V) {
    cpu()->logit_grad(cpu(), logits, lse, coef, target, M, V);
}
void ref_adamw(double *p, const double *g, double *m, double *v, size_t n, double lr, double b1, double b2,
               double eps, double wd, long step) {
    cpu()->adamw(cpu(), p, g, m, v, n, lr, b1, b2, eps, wd, step);
}
