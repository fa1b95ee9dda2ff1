/* The CPU backend in double precision, behind plain double arrays: the reference the GPU tests
   compare every CUDA kernel with. gpu_ref.c compiles the header with PR_DOUBLE in its own
   translation unit, so the float test program and the double reference live side by side. */
#ifndef PR_GPU_REF_H
#define PR_GPU_REF_H
#include <stdint.h>

void ref_matmul_fwd(double *out, const double *inp, const double *w, int N, int C, int OC);
void ref_matmul_bwd(double *dinp, double *dw, const double *dout, const double *inp, const double *w, int N, int C, int OC);
void ref_rmsnorm_fwd(double *out, double *rstd, const double *inp, const double *w, int N, int C, double eps);
void ref_rmsnorm_bwd(double *dinp, double *dw, const double *dout, const double *inp, const double *w,
                     const double *rstd, int N, int C);
void ref_rope(double *x, const int *seg_off, int n_seg, int pos0, int heads, int HS, const double *inv_freq, int backward);
void ref_attention_fwd(double *out, double *lse, const double *q, const double *k, const double *v, const double *kp,
                       const double *vp, const int *seg_off, int n_seg, int n_prefix, int NH, int NKV, int HS);
void ref_attention_bwd(double *dq, double *dk, double *dv, double *dkp, double *dvp, const double *dout,
                       const double *out, const double *lse, const double *q, const double *k, const double *v,
                       const double *kp, const double *vp, const int *seg_off, int n_seg, int n_prefix,
                       int NH, int NKV, int HS);
void ref_embed_fwd(double *out, const int32_t *tokens, const double *emb, int N, int C);
void ref_embed_bwd(double *demb, const double *dout, const int32_t *tokens, int N, int C);
void ref_logit_stats(double *stats, const double *logits, const int32_t *target, int M, int V);
void ref_logit_grad(double *logits, const double *lse, const double *coef, const int32_t *target, int M, int V);
void ref_adamw(double *p, const double *g, double *m, double *v, size_t n, double lr, double b1, double b2,
               double eps, double wd, long step);
#endif
