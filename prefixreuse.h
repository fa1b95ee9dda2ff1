/* prefixreuse.h — shared-prefix reuse for GRPO training of Llama-family models, in one header.

   In GRPO a prompt (the prefix, P tokens) is sampled G times. The ordinary trainer runs every
   trajectory [prefix ; suffix_i] through the model, so the prefix is computed G times forward and
   backward. This library runs it once per group:

     Phase A  prefix forward once; every layer publishes its post-RoPE K/V (the reuse cache)
              and keeps the rest of its saved tensors for Phase C.
     Phase B  suffix microbatches (any split of the G suffixes, padded or packed) read the cached
              prefix K/V and add the prefix-side gradients dK/dV into one accumulator per layer (gK/gV).
     Phase C  prefix backward once, with gK/gV injected into every layer's prefix attention.

   Prefix backward is a vector-Jacobian product on a fixed forward trace, so it is linear in its
   incoming adjoints: one backward on the summed gK/gV equals the sum of G separate backwards.
   The two schedules agree exactly over the reals; the double build shows it to ~1e-12.

   USAGE
     #define PREFIXREUSE_IMPLEMENTATION   (in exactly one C file)
     #include "prefixreuse.h"

     Options, defined before the include:
       PR_DOUBLE        every real number is a double (exact-equivalence checks)
       PR_USE_CBLAS     route GEMMs to the system CBLAS (link e.g. -lopenblas)
       PRDEF            storage class of the public functions (e.g. `static`)
       PR_MALLOC/PR_REALLOC/PR_FREE   allocator, all three or none
     OpenMP (-fopenmp) parallelises the GEMM and attention loops when enabled.

   EXAMPLE
     pr_error err; pr_config cfg; pr_trace trace; pr_trainer *tr;
     if (pr_config_load(&cfg, "model/tiny", &err) ||
         pr_trace_read(&trace, "data/sample.trace", &err) ||
         pr_trainer_create(&tr, &cfg, pr_backend_cpu(), &err) ||
         pr_trainer_init_params(tr, 1234, &err)) { fprintf(stderr, "%s\n", err.message); return 1; }
     pr_step_opts opt = pr_step_opts_default();      // reuse schedule, padded, all G at once
     pr_step_stats st;
     pr_adamw_opts adam = pr_adamw_opts_default();
     if (pr_trainer_compute_grads(tr, &trace.groups[0], &opt, &st, NULL, &err) ||
         pr_trainer_adamw_step(tr, &adam, NULL, &err)) { ... }

   CONTENTS
     1. Basics: reals, status and error messages
     2. Model configuration (Hugging Face config.json)
     3. GRPO traces (data/README.md has the format)
     4. safetensors checkpoints (Hugging Face names, sharded through an index)
     5. Backend interface (GEMM, attention with a prefix K/V region, norms, RoPE, loss, optimizer,
        memory tiers); the CPU backend is below, the CUDA one in prefixreuse_cuda.cu
     6. Trainer: parameters, the GRPO loss, the baseline and reuse schedules, gKV hooks, AdamW
   Conventions: public names pr_, private pr__. Every public function returns pr_status and fills
   a pr_error (may be NULL) with a readable reason; nothing aborts or exits. On failure the
   caller's buffers are left as they were.
   Dimension legend used in shape comments: N rows (tokens) of a pass, C hidden, NH query heads,
   NKV key/value heads, HS head dim, F MLP width, V vocabulary, P prefix rows, L layers. */
#ifndef PREFIXREUSE_H
#define PREFIXREUSE_H

#include <stddef.h>
#include <stdint.h>

#ifndef PRDEF
#define PRDEF extern
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- 1. Basics */
#ifdef PR_DOUBLE
typedef double pr_real;
#else
typedef float pr_real;
#endif

typedef enum {
    PR_OK = 0,
    PR_ERR_ARG,         /* a bad argument: shapes, counts, ranges */
    PR_ERR_IO,          /* a file could not be opened, read, written or renamed */
    PR_ERR_FORMAT,      /* a file's contents are malformed */
    PR_ERR_CONFIG,      /* a model configuration does not validate */
    PR_ERR_NOMEM,       /* an allocation failed or a size overflowed */
    PR_ERR_UNSUPPORTED  /* valid input asking for something not implemented */
} pr_status;

typedef struct {
    pr_status status;
    char message[512];
} pr_error;

PRDEF const char *pr_status_name(pr_status s);

/* @@PUBLIC io */

/* @@PUBLIC trace */

/* ---------------------------------------------------------------- 5. Backend interface */
/* Where a buffer lives. DEVICE is the compute memory (host RAM for the CPU backend); HOST is
   pinned host memory, the offload tier. */
typedef enum { PR_TIER_DEVICE = 0, PR_TIER_HOST = 1 } pr_tier;

/* The rows of one pass through the model: n_seg sequences ("segments"), segment s occupying rows
   seg_off[s] .. seg_off[s+1]-1. Row r of segment s sits at RoPE position pos0 + (r - seg_off[s]).
   Every segment attends to all n_prefix rows of the shared prefix K/V (0: none), then causally to
   its own rows, never to another segment. Padded batches are segments of equal length whose tail
   rows are padding (causal masking keeps padding from touching real rows).
       baseline microbatch   n_prefix 0, pos0 0, segments = full [prefix ; suffix] sequences
       Phase A / Phase C     n_prefix 0, pos0 0, one segment = the prefix
       Phase B microbatch    n_prefix P, pos0 P, segments = suffixes (padded or packed) */
typedef struct {
    int n_seg;
    const int *seg_off;   /* (n_seg+1), host memory */
    int pos0;
    int n_prefix;
} pr_seq_layout;

/* GRPO loss settings. Per token: r = exp(logp - old_logp),
   l = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) + kl_coef * (exp(ref-logp) - (ref-logp) - 1). */
typedef enum {
    PR_NORM_TOKEN_MEAN = 0,          /* sum of masked token losses / masked tokens in the group */
    PR_NORM_SEQ_MEAN_TOKEN_MEAN = 1  /* mean over the G trajectories of each one's token mean */
} pr_loss_norm;
typedef struct {
    double eps_low, eps_high;
    double kl_coef;                  /* 0: no KL term (reference log-probs not needed) */
    pr_loss_norm norm;
} pr_loss_opts;

/* Per-row inputs of the loss head: the token each row predicts and what its loss needs. */
typedef struct {
    int M;
    const int32_t *target;      /* (M) */
    const pr_real *old_logp;    /* (M) */
    const pr_real *ref_logp;    /* (M) or NULL */
    const pr_real *advantage;   /* (M) */
    const pr_real *weight;      /* (M) normaliser times loss mask: the row's share of the loss */
} pr_head_rows;

/* The kernels the schedule needs. Buffers named `void *` hold activations in the backend's
   element type (act_bytes each; pr_real on the CPU); `pr_real *` are parameters and gradients.
   Every backward ADDS into its gradient outputs (dinp, dw, dq, ...); callers zero them first. */
typedef struct pr_backend pr_backend;
struct pr_backend {
    const char *name;
    size_t act_bytes;
    void *ctx;
    /* memory */
    void *(*alloc)(const pr_backend *be, size_t bytes, pr_tier tier);
    void (*release)(const pr_backend *be, void *p, pr_tier tier);
    void (*zero)(const pr_backend *be, void *p, size_t bytes);
    void (*copy)(const pr_backend *be, void *dst, const void *src, size_t bytes);   /* any tiers */
    void (*upload_reals)(const pr_backend *be, pr_real *dst, const pr_real *host, size_t n);
    void (*download_reals)(const pr_backend *be, pr_real *host, const pr_real *src, size_t n);
    void (*sync)(const pr_backend *be);
    /* out (N,OC) = inp (N,C) @ w^T, w (OC,C) */
    void (*matmul_fwd)(const pr_backend *be, void *out, const void *inp, const pr_real *w, int N, int C, int OC);
    /* dinp (N,C) += dout @ w;  dw (OC,C) += dout^T @ inp */
    void (*matmul_bwd)(const pr_backend *be, void *dinp, pr_real *dw, const void *dout, const void *inp,
                       const pr_real *w, int N, int C, int OC);
    /* out (N,C) = inp / rms(inp) * w; rstd (N) saved */
    void (*rmsnorm_fwd)(const pr_backend *be, void *out, void *rstd, const void *inp, const pr_real *w, int N, int C, double eps);
    void (*rmsnorm_bwd)(const pr_backend *be, void *dinp, pr_real *dw, const void *dout, const void *inp,
                        const pr_real *w, const void *rstd, int N, int C);
    /* in place on x (N, heads*HS), rotate-half pairing (see the CPU kernel) at the layout's positions */
    void (*rope_fwd)(const pr_backend *be, void *x, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq);
    void (*rope_bwd)(const pr_backend *be, void *dx, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq);
    /* out (N,NH*HS), lse (N,NH) from q (N,NH*HS), own k,v (N,NKV*HS), prefix kp,vp (n_prefix,NKV*HS) */
    void (*attention_fwd)(const pr_backend *be, void *out, void *lse, const void *q, const void *k, const void *v,
                          const void *kp, const void *vp, const pr_seq_layout *lay, int NH, int NKV, int HS);
    void (*attention_bwd)(const pr_backend *be, void *dq, void *dk, void *dv, void *dkp, void *dvp,
                          const void *dout, const void *out, const void *lse, const void *q, const void *k,
                          const void *v, const void *kp, const void *vp, const pr_seq_layout *lay,
                          int NH, int NKV, int HS);
    /* h = silu(gate) * up, n elements */
    void (*swiglu_fwd)(const pr_backend *be, void *h, const void *gate, const void *up, size_t n);
    void (*swiglu_bwd)(const pr_backend *be, void *dgate, void *dup, const void *dh, const void *gate, const void *up, size_t n);
    void (*embed_fwd)(const pr_backend *be, void *out, const int32_t *tokens, const pr_real *emb, int N, int C);
    void (*embed_bwd)(const pr_backend *be, pr_real *demb, const void *dout, const int32_t *tokens, int N, int C);
    void (*add)(const pr_backend *be, void *y, const void *x, size_t n);                 /* y += x */
    void (*gather_rows)(const pr_backend *be, void *dst, const void *src, const int *rows, int M, int C);
    void (*scatter_add_rows)(const pr_backend *be, void *dst, const void *src, const int *rows, int M, int C);
    /* The loss head on logits (M,V): writes each row's log-prob of its target (logp, host, M) and
       adds sum_rows weight*loss to *loss; replaces logits by d(loss)/d(logits). */
    void (*loss_head)(const pr_backend *be, void *logits, const pr_head_rows *rows, const pr_loss_opts *opt,
                      int V, pr_real *logp, double *loss);
    /* optimizer pieces, on parameter-typed arrays */
    double (*sum_squares)(const pr_backend *be, const pr_real *x, size_t n);
    void (*scale)(const pr_backend *be, pr_real *x, size_t n, double s);
    void (*adamw)(const pr_backend *be, pr_real *p, const pr_real *g, pr_real *m, pr_real *v, size_t n,
                  double lr, double beta1, double beta2, double eps, double weight_decay, long step);
};

/* The CPU backend: pr_real everywhere, OpenMP when compiled with it. */
PRDEF const pr_backend *pr_backend_cpu(void);

/* ---------------------------------------------------------------- 6. Trainer */
/* One parameter tensor: its Hugging Face name, shape and place in the parameter arena. */
typedef struct {
    char name[96];
    int ndim;
    int64_t shape[2];
    size_t offset, numel;
    int decay;              /* AdamW weight decay applies (matrices yes, norm weights no) */
} pr_tensor_info;

/* gKV hooks: the public seam of the schedule. Pointers are backend memory (host memory for the
   CPU backend), valid only during the call; k/v rows are (P, NKV*HS), post-RoPE. */
typedef struct {
    void *user;
    /* Phase A: layer `layer` published its prefix K/V */
    void (*on_kv_capture)(void *user, int layer, const void *k, const void *v, int P, int kv_dim);
    /* Phase B: microbatch `mb` produced these prefix dK/dV for `layer` (about to be added to gK/gV) */
    void (*on_dkv)(void *user, int layer, int mb, const void *dk, const void *dv, int P, int kv_dim);
    /* Phase C: the accumulated gK/gV are injected into `layer`'s prefix backward */
    void (*on_kv_inject)(void *user, int layer, const void *gk, const void *gv, int P, int kv_dim);
} pr_hooks;

typedef enum { PR_SCHEDULE_BASELINE = 0, PR_SCHEDULE_REUSE = 1 } pr_schedule;
typedef enum { PR_LAYOUT_PADDED = 0, PR_LAYOUT_PACKED = 1 } pr_layout;

typedef struct {
    pr_schedule schedule;
    int microbatch;          /* trajectories per microbatch; 0 = all G in one */
    pr_layout layout;        /* Phase B layout (the baseline always pads) */
    pr_loss_opts loss;
    pr_hooks hooks;
} pr_step_opts;

enum { PR_PHASE_A = 0, PR_PHASE_B = 1, PR_PHASE_C = 2 };
typedef struct {
    double loss;
    double seconds[3];       /* wall time of Phase A, B, C (the baseline reports all of it as B) */
    size_t peak_bytes[3];    /* peak activation bytes live during each phase */
    long rows;               /* token rows run through the model (padding included) */
    long loss_tokens;        /* tokens with a nonzero loss weight */
    int microbatches;
    double flops;            /* model FLOPs of the step (pr_step_flops) */
} pr_step_stats;

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    double max_grad_norm;    /* global-norm clipping; <= 0: off */
} pr_adamw_opts;

typedef struct pr_trainer pr_trainer;

PRDEF pr_step_opts pr_step_opts_default(void);
PRDEF pr_adamw_opts pr_adamw_opts_default(void);

PRDEF pr_status pr_trainer_create(pr_trainer **tr, const pr_config *cfg, const pr_backend *be, pr_error *err);
PRDEF void pr_trainer_destroy(pr_trainer *tr);
PRDEF const pr_config *pr_trainer_config(const pr_trainer *tr);
/* Deterministic initialisation: N(0, 0.02) matrices and embeddings, norm weights 1; AdamW state zeroed. */
PRDEF pr_status pr_trainer_init_params(pr_trainer *tr, uint64_t seed, pr_error *err);
/* Parameters from a safetensors file or folder (sharded through model.safetensors.index.json). */
PRDEF pr_status pr_trainer_load(pr_trainer *tr, const char *path, pr_error *err);
/* config.json + model.safetensors (sharded above max_shard_bytes, 0 = never) into dir, atomically. */
PRDEF pr_status pr_trainer_save(pr_trainer *tr, const char *dir, pr_dtype dtype, uint64_t max_shard_bytes, pr_error *err);
/* The gradients of the last step under the parameters' names ("model.layers.0.mlp.up_proj.weight"). */
PRDEF pr_status pr_trainer_save_grads(pr_trainer *tr, const char *path, pr_error *err);

PRDEF int pr_trainer_tensor_count(const pr_trainer *tr);
PRDEF const pr_tensor_info *pr_trainer_tensor(const pr_trainer *tr, int i);
PRDEF size_t pr_trainer_param_count(const pr_trainer *tr);
/* Host copies of the whole arena (n = pr_trainer_param_count reals). */
PRDEF pr_status pr_trainer_get_params(const pr_trainer *tr, pr_real *dst, size_t n, pr_error *err);
PRDEF pr_status pr_trainer_set_params(pr_trainer *tr, const pr_real *src, size_t n, pr_error *err);
PRDEF pr_status pr_trainer_get_grads(const pr_trainer *tr, pr_real *dst, size_t n, pr_error *err);

/* The gradient of the group's GRPO loss w.r.t. every parameter, by either schedule; overwrites
   the gradient arena. logp (optional, g->suffix_off[G] reals) receives every suffix token's
   log-prob. The group and options are validated before anything is touched. */
PRDEF pr_status pr_trainer_compute_grads(pr_trainer *tr, const pr_group *g, const pr_step_opts *opt,
                                         pr_step_stats *stats, pr_real *logp, pr_error *err);
/* Global-norm clipping then AdamW on the gradient arena; grad_norm (optional) gets the pre-clip norm. */
PRDEF pr_status pr_trainer_adamw_step(pr_trainer *tr, const pr_adamw_opts *opt, double *grad_norm, pr_error *err);

/* Model FLOPs one step of a schedule performs on a group (matmuls, attention, loss head; forward
   and backward), the measure the speed-up bound is computed from. */
PRDEF double pr_step_flops(const pr_config *cfg, const pr_group *g, pr_schedule schedule);

#ifdef __cplusplus
}
#endif
#endif /* PREFIXREUSE_H */

/* ============================================================================================ */
#ifdef PREFIXREUSE_IMPLEMENTATION

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(PR_MALLOC) && defined(PR_REALLOC) && defined(PR_FREE)
#elif !defined(PR_MALLOC) && !defined(PR_REALLOC) && !defined(PR_FREE)
#define PR_MALLOC(sz) malloc(sz)
#define PR_REALLOC(p, sz) realloc(p, sz)
#define PR_FREE(p) free(p)
#else
#error "prefixreuse.h: define all of PR_MALLOC, PR_REALLOC and PR_FREE, or none"
#endif

/* ---------------------------------------------------------------- basics */
PRDEF const char *pr_status_name(pr_status s) {
    switch (s) {
    case PR_OK: return "ok";
    case PR_ERR_ARG: return "bad argument";
    case PR_ERR_IO: return "i/o error";
    case PR_ERR_FORMAT: return "malformed file";
    case PR_ERR_CONFIG: return "invalid configuration";
    case PR_ERR_NOMEM: return "out of memory";
    case PR_ERR_UNSUPPORTED: return "unsupported";
    }
    return "unknown status";
}

static pr_status pr__fail(pr_error *err, pr_status code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        err->status = code;
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* Overflow-checked size arithmetic: 0 on overflow. */
static int pr__mul_size(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return 0;
    *out = a * b;
    return 1;
}

/* Wall-clock seconds (C11 timespec_get: no POSIX feature macros needed). */
static double pr__now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* @@IMPL gemm */

/* @@IMPL io */

/* @@IMPL trace */

/* ---------------------------------------------------------------- CPU backend */
/* Activations are pr_real; the casts below are the CPU reading of the backend's `void *`. */
#define PR__R(p) ((pr_real *)(p))
#define PR__CR(p) ((const pr_real *)(p))

static void *pr__cpu_alloc(const pr_backend *be, size_t bytes, pr_tier tier) {
    (void)be; (void)tier;
    return PR_MALLOC(bytes ? bytes : 1);
}
static void pr__cpu_release(const pr_backend *be, void *p, pr_tier tier) { (void)be; (void)tier; PR_FREE(p); }
static void pr__cpu_zero(const pr_backend *be, void *p, size_t bytes) { (void)be; memset(p, 0, bytes); }
static void pr__cpu_copy(const pr_backend *be, void *dst, const void *src, size_t bytes) { (void)be; memcpy(dst, src, bytes); }
static void pr__cpu_upload(const pr_backend *be, pr_real *dst, const pr_real *host, size_t n) { (void)be; memcpy(dst, host, n * sizeof(pr_real)); }
static void pr__cpu_download(const pr_backend *be, pr_real *host, const pr_real *src, size_t n) { (void)be; memcpy(host, src, n * sizeof(pr_real)); }
static void pr__cpu_sync(const pr_backend *be) { (void)be; }

static void pr__cpu_matmul_fwd(const pr_backend *be, void *out, const void *inp, const pr_real *w, int N, int C, int OC) {
    (void)be;
    pr__gemm(0, 1, N, OC, C, PR__CR(inp), C, w, C, 0, PR__R(out), OC);   /* out = inp @ w^T */
}

static void pr__cpu_matmul_bwd(const pr_backend *be, void *dinp, pr_real *dw, const void *dout, const void *inp,
                               const pr_real *w, int N, int C, int OC) {
    (void)be;
    if (dinp) pr__gemm(0, 0, N, C, OC, PR__CR(dout), OC, w, C, 1, PR__R(dinp), C);   /* dinp += dout @ w */
    pr__gemm(1, 0, OC, C, N, PR__CR(dout), OC, PR__CR(inp), C, 1, dw, C);            /* dw += dout^T @ inp */
}

/* forward: out = x * rstd * w,  rstd = 1/sqrt(mean(x^2) + eps) */
static void pr__cpu_rmsnorm_fwd(const pr_backend *be, void *out_, void *rstd_, const void *inp_, const pr_real *w,
                                int N, int C, double eps) {
    (void)be;
    pr_real *out = PR__R(out_), *rstd = PR__R(rstd_);
    const pr_real *inp = PR__CR(inp_);
    for (int n = 0; n < N; n++) {
        const pr_real *x = inp + (size_t)n * C;
        double ss = 0;
        for (int i = 0; i < C; i++) ss += (double)x[i] * x[i];
        double r = 1.0 / sqrt(ss / C + eps);
        pr_real *o = out + (size_t)n * C;
        for (int i = 0; i < C; i++) o[i] = (pr_real)(x[i] * r) * w[i];
        rstd[n] = (pr_real)r;
    }
}

/* backward of out_i = x_i * r * w_i with r = (mean(x^2)+eps)^(-1/2):
   dx_i = r * (dout_i w_i - x_i * r^2 * mean_j(dout_j w_j x_j)),  dw_i += dout_i * x_i * r */
static void pr__cpu_rmsnorm_bwd(const pr_backend *be, void *dinp_, pr_real *dw, const void *dout_, const void *inp_,
                                const pr_real *w, const void *rstd_, int N, int C) {
    (void)be;
    pr_real *dinp = PR__R(dinp_);
    const pr_real *dout = PR__CR(dout_), *inp = PR__CR(inp_), *rstd = PR__CR(rstd_);
    for (int n = 0; n < N; n++) {
        const pr_real *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
        double r = rstd[n], dot = 0;
        for (int i = 0; i < C; i++) dot += (double)dy[i] * w[i] * x[i];
        double k = r * r * r * dot / C;
        pr_real *dx = dinp + (size_t)n * C;
        for (int i = 0; i < C; i++) {
            dx[i] += (pr_real)(r * dy[i] * w[i] - k * x[i]);
            dw[i] += (pr_real)(dy[i] * x[i] * r);
        }
    }
}

/* RoPE, Hugging Face rotate-half pairing: within a head of HS values, element i (i < HS/2) is
   rotated together with element i + HS/2 by angle pos * inv_freq[i]:
       [ x0 x1 .. x(h-1) | xh .. x(2h-1) ]   pairs (x0,xh), (x1,xh+1), ...   ([ccss], not [cscs])
       y_i = x_i cos - x_{i+h} sin,   y_{i+h} = x_{i+h} cos + x_i sin
   The backward is the rotation by -angle. */
static void pr__cpu_rope(void *x_, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq, double sign) {
    pr_real *x = PR__R(x_);
    int half = HS / 2;
    for (int s = 0; s < lay->n_seg; s++)
        for (int r = lay->seg_off[s]; r < lay->seg_off[s + 1]; r++) {
            double pos = lay->pos0 + (r - lay->seg_off[s]);
            for (int i = 0; i < half; i++) {
                double ang = pos * inv_freq[i];
                pr_real c = (pr_real)cos(ang), sn = (pr_real)(sign * sin(ang));
                for (int h = 0; h < heads; h++) {
                    pr_real *v = x + ((size_t)r * heads + h) * HS;
                    pr_real a = v[i], b = v[i + half];
                    v[i] = a * c - b * sn;
                    v[i + half] = b * c + a * sn;
                }
            }
        }
}
static void pr__cpu_rope_fwd(const pr_backend *be, void *x, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq) {
    (void)be; pr__cpu_rope(x, lay, heads, HS, inv_freq, 1.0);
}
static void pr__cpu_rope_bwd(const pr_backend *be, void *dx, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq) {
    (void)be; pr__cpu_rope(dx, lay, heads, HS, inv_freq, -1.0);
}

static pr_real pr__dot(const pr_real *a, const pr_real *b, int n) {
    pr_real s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static void pr__axpy(pr_real *y, pr_real a, const pr_real *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* The keys a query row sees: the n_prefix shared rows (kp), then its own segment's rows up to and
   including itself (k). Key j < n_prefix is kp row j; key j >= n_prefix is k row seg0 + j - n_prefix. */
#define PR__KEY(kp, k, j, np, seg0, kvd, hk) \
    ((j) < (np) ? (kp) + (size_t)(j) * (kvd) + (hk) : (k) + (size_t)((seg0) + (j) - (np)) * (kvd) + (hk))

/* Attention forward, one query row at a time with an online softmax (running max m, running sum,
   output rescaled when m grows): no score matrix and no scratch memory. Query head h reads
   key/value head h / (NH/NKV) (GQA). lse keeps each row's log-sum-exp so that the backward can
   rebuild every probability. Parallel over (segment, head): no two tasks write the same output. */
static void pr__cpu_attention_fwd(const pr_backend *be, void *out_, void *lse_, const void *q_, const void *k_, const void *v_,
                                  const void *kp_, const void *vp_, const pr_seq_layout *lay, int NH, int NKV, int HS) {
    (void)be;
    pr_real *out = PR__R(out_), *lse = PR__R(lse_);
    const pr_real *q = PR__CR(q_), *k = PR__CR(k_), *v = PR__CR(v_), *kp = PR__CR(kp_), *vp = PR__CR(vp_);
    const int np = lay->n_prefix, qd = NH * HS, kvd = NKV * HS, group = NH / NKV;
    const double scale = 1.0 / sqrt((double)HS);
    const int tasks = lay->n_seg * NH;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1)
#endif
    for (int t = 0; t < tasks; t++) {
        int s = t / NH, h = t % NH, hk = (h / group) * HS;
        int seg0 = lay->seg_off[s], seg1 = lay->seg_off[s + 1];
        for (int r = seg0; r < seg1; r++) {
            const pr_real *qr = q + (size_t)r * qd + (size_t)h * HS;
            pr_real *o = out + (size_t)r * qd + (size_t)h * HS;
            int nk = np + (r - seg0) + 1;
            double m = -INFINITY, sum = 0;
            memset(o, 0, sizeof(pr_real) * HS);
            for (int j = 0; j < nk; j++) {
                double sc = pr__dot(qr, PR__KEY(kp, k, j, np, seg0, kvd, hk), HS) * scale;
                if (sc > m) {   /* new maximum: rescale what was accumulated under the old one */
                    double c = exp(m - sc);
                    for (int i = 0; i < HS; i++) o[i] = (pr_real)(o[i] * c);
                    sum *= c;
                    m = sc;
                }
                double pj = exp(sc - m);
                sum += pj;
                pr__axpy(o, (pr_real)pj, PR__KEY(vp, v, j, np, seg0, kvd, hk), HS);
            }
            for (int i = 0; i < HS; i++) o[i] = (pr_real)(o[i] / sum);
            lse[(size_t)r * NH + h] = (pr_real)(m + log(sum));
        }
    }
}

/* Attention backward (quoting the forward: o = sum_j p_j v_j, p_j = exp(s_j - lse), s_j = q.k_j * scale):
     dv_j += p_j do;   dp_j = do.v_j;   ds_j = p_j (dp_j - D) with D = do.o;
     dq += scale ds_j k_j;   dk_j += scale ds_j q.
   Keys in the prefix region send dk/dv to dkp/dvp: summed over every query row of every segment,
   this is the prefix-side gradient the reuse schedule accumulates into gK/gV. Parallel over KV
   heads only, so that each dk/dv/dkp/dvp row has one writer and a fixed summation order. */
static void pr__cpu_attention_bwd(const pr_backend *be, void *dq_, void *dk_, void *dv_, void *dkp_, void *dvp_,
                                  const void *dout_, const void *out_, const void *lse_, const void *q_, const void *k_,
                                  const void *v_, const void *kp_, const void *vp_, const pr_seq_layout *lay,
                                  int NH, int NKV, int HS) {
    (void)be;
    pr_real *dq = PR__R(dq_), *dk = PR__R(dk_), *dv = PR__R(dv_), *dkp = PR__R(dkp_), *dvp = PR__R(dvp_);
    const pr_real *dout = PR__CR(dout_), *out = PR__CR(out_), *lse = PR__CR(lse_);
    const pr_real *q = PR__CR(q_), *k = PR__CR(k_), *v = PR__CR(v_), *kp = PR__CR(kp_), *vp = PR__CR(vp_);
    const int np = lay->n_prefix, qd = NH * HS, kvd = NKV * HS, group = NH / NKV;
    const double scale = 1.0 / sqrt((double)HS);
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1)
#endif
    for (int kh = 0; kh < NKV; kh++) {
        int hk = kh * HS;
        for (int s = 0; s < lay->n_seg; s++) {
            int seg0 = lay->seg_off[s], seg1 = lay->seg_off[s + 1];
            for (int h = kh * group; h < (kh + 1) * group; h++)
                for (int r = seg0; r < seg1; r++) {
                    size_t qo = (size_t)r * qd + (size_t)h * HS;
                    const pr_real *qr = q + qo, *dor = dout + qo;
                    pr_real *dqr = dq + qo;
                    double D = pr__dot(dor, out + qo, HS), l = lse[(size_t)r * NH + h];
                    int nk = np + (r - seg0) + 1;
                    for (int j = 0; j < nk; j++) {
                        const pr_real *kj = PR__KEY(kp, k, j, np, seg0, kvd, hk);
                        const pr_real *vj = PR__KEY(vp, v, j, np, seg0, kvd, hk);
                        double pj = exp(pr__dot(qr, kj, HS) * scale - l);
                        double dsj = pj * (pr__dot(dor, vj, HS) - D) * scale;
                        pr__axpy(PR__KEY(dvp, dv, j, np, seg0, kvd, hk), (pr_real)pj, dor, HS);
                        pr__axpy(PR__KEY(dkp, dk, j, np, seg0, kvd, hk), (pr_real)dsj, qr, HS);
                        pr__axpy(dqr, (pr_real)dsj, kj, HS);
                    }
                }
        }
    }
}

/* h = silu(g) * u,  silu(g) = g * sigmoid(g) */
static void pr__cpu_swiglu_fwd(const pr_backend *be, void *h_, const void *gate_, const void *up_, size_t n) {
    (void)be;
    pr_real *h = PR__R(h_);
    const pr_real *g = PR__CR(gate_), *u = PR__CR(up_);
    for (size_t i = 0; i < n; i++) {
        double sg = 1.0 / (1.0 + exp(-(double)g[i]));
        h[i] = (pr_real)(g[i] * sg * u[i]);
    }
}
/* dg += dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  du += dh * silu(g) */
static void pr__cpu_swiglu_bwd(const pr_backend *be, void *dgate_, void *dup_, const void *dh_, const void *gate_,
                               const void *up_, size_t n) {
    (void)be;
    pr_real *dg = PR__R(dgate_), *du = PR__R(dup_);
    const pr_real *dh = PR__CR(dh_), *g = PR__CR(gate_), *u = PR__CR(up_);
    for (size_t i = 0; i < n; i++) {
        double sg = 1.0 / (1.0 + exp(-(double)g[i]));
        dg[i] += (pr_real)(dh[i] * u[i] * sg * (1.0 + g[i] * (1.0 - sg)));
        du[i] += (pr_real)(dh[i] * g[i] * sg);
    }
}

static void pr__cpu_embed_fwd(const pr_backend *be, void *out, const int32_t *tokens, const pr_real *emb, int N, int C) {
    (void)be;
    for (int n = 0; n < N; n++) memcpy(PR__R(out) + (size_t)n * C, emb + (size_t)tokens[n] * C, sizeof(pr_real) * C);
}
static void pr__cpu_embed_bwd(const pr_backend *be, pr_real *demb, const void *dout, const int32_t *tokens, int N, int C) {
    (void)be;
    for (int n = 0; n < N; n++) pr__axpy(demb + (size_t)tokens[n] * C, 1, PR__CR(dout) + (size_t)n * C, C);
}

static void pr__cpu_add(const pr_backend *be, void *y, const void *x, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) PR__R(y)[i] += PR__CR(x)[i];
}
static void pr__cpu_gather_rows(const pr_backend *be, void *dst, const void *src, const int *rows, int M, int C) {
    (void)be;
    for (int m = 0; m < M; m++) memcpy(PR__R(dst) + (size_t)m * C, PR__CR(src) + (size_t)rows[m] * C, sizeof(pr_real) * C);
}
static void pr__cpu_scatter_add_rows(const pr_backend *be, void *dst, const void *src, const int *rows, int M, int C) {
    (void)be;
    for (int m = 0; m < M; m++) pr__axpy(PR__R(dst) + (size_t)rows[m] * C, 1, PR__CR(src) + (size_t)m * C, C);
}

/* The GRPO token loss and its derivative in logp; shared by every backend's loss head.
   r = exp(logp - old);  pg = -min(r A, clip(r, 1-eps_low, 1+eps_high) A)
   kl = exp(ref - logp) - (ref - logp) - 1   (k3 estimator, >= 0)
   The min picks the clipped term only when it is smaller; there its slope in logp is 0. */
static double pr__grpo_token_loss(double logp, double old, const pr_real *ref, double adv, const pr_loss_opts *o,
                                  double *dloss_dlogp) {
    double r = exp(logp - old);
    double rc = r < 1 - o->eps_low ? 1 - o->eps_low : (r > 1 + o->eps_high ? 1 + o->eps_high : r);
    double unclipped = r * adv, clipped = rc * adv, loss, d;
    if (unclipped <= clipped) { loss = -unclipped; d = -unclipped; }
    else { loss = -clipped; d = 0; }
    if (ref && o->kl_coef != 0) {
        double delta = (double)*ref - logp, e = exp(delta);
        loss += o->kl_coef * (e - delta - 1);
        d += o->kl_coef * (1 - e);
    }
    *dloss_dlogp = d;
    return loss;
}

/* logp = logits[target] - logsumexp(logits);  d(w l)/dlogits = w l'(logp) (onehot(target) - softmax) */
static void pr__cpu_loss_head(const pr_backend *be, void *logits_, const pr_head_rows *rows, const pr_loss_opts *opt,
                              int V, pr_real *logp, double *loss) {
    (void)be;
    double total = 0;
    for (int m = 0; m < rows->M; m++) {
        pr_real *z = PR__R(logits_) + (size_t)m * V;
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < V; i++) if (z[i] > mx) mx = z[i];
        for (int i = 0; i < V; i++) sum += exp(z[i] - mx);
        double lse = mx + log(sum), lp = z[rows->target[m]] - lse, dl;
        double l = pr__grpo_token_loss(lp, rows->old_logp[m], rows->ref_logp ? rows->ref_logp + m : NULL,
                                       rows->advantage[m], opt, &dl);
        double w = rows->weight[m], c = w * dl;
        total += w * l;
        logp[m] = (pr_real)lp;
        for (int i = 0; i < V; i++) z[i] = (pr_real)(-c * exp(z[i] - lse));
        z[rows->target[m]] += (pr_real)c;
    }
    *loss += total;
}

static double pr__cpu_sum_squares(const pr_backend *be, const pr_real *x, size_t n) {
    (void)be;
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return s;
}
static void pr__cpu_scale(const pr_backend *be, pr_real *x, size_t n, double s) {
    (void)be;
    for (size_t i = 0; i < n; i++) x[i] = (pr_real)(x[i] * s);
}
/* AdamW (decoupled weight decay, bias-corrected moments), one tensor */
static void pr__cpu_adamw(const pr_backend *be, pr_real *p, const pr_real *g, pr_real *m, pr_real *v, size_t n,
                          double lr, double b1, double b2, double eps, double wd, long step) {
    (void)be;
    double c1 = 1 - pow(b1, (double)step), c2 = 1 - pow(b2, (double)step);
    for (size_t i = 0; i < n; i++) {
        m[i] = (pr_real)(b1 * m[i] + (1 - b1) * g[i]);
        v[i] = (pr_real)(b2 * v[i] + (1 - b2) * (double)g[i] * g[i]);
        double mh = m[i] / c1, vh = v[i] / c2;
        p[i] = (pr_real)(p[i] - lr * (mh / (sqrt(vh) + eps) + wd * p[i]));
    }
}

static const pr_backend pr__cpu_backend = {
    "cpu", sizeof(pr_real), NULL,
    pr__cpu_alloc, pr__cpu_release, pr__cpu_zero, pr__cpu_copy, pr__cpu_upload, pr__cpu_download, pr__cpu_sync,
    pr__cpu_matmul_fwd, pr__cpu_matmul_bwd, pr__cpu_rmsnorm_fwd, pr__cpu_rmsnorm_bwd,
    pr__cpu_rope_fwd, pr__cpu_rope_bwd, pr__cpu_attention_fwd, pr__cpu_attention_bwd,
    pr__cpu_swiglu_fwd, pr__cpu_swiglu_bwd, pr__cpu_embed_fwd, pr__cpu_embed_bwd,
    pr__cpu_add, pr__cpu_gather_rows, pr__cpu_scatter_add_rows, pr__cpu_loss_head,
    pr__cpu_sum_squares, pr__cpu_scale, pr__cpu_adamw,
};

PRDEF const pr_backend *pr_backend_cpu(void) { return &pr__cpu_backend; }

/* ---------------------------------------------------------------- trainer: layout of the parameters */
/* Offsets (in reals) of one layer's tensors in the parameter arena; the gradient, AdamW-moment
   arenas use the same offsets. qn/kn exist only with per-head q/k norms (Qwen3). */
typedef struct { size_t ln1, wq, wk, wv, qn, kn, wo, ln2, wg, wu, wd; } pr__layer_off;
typedef struct { pr_real *ln1, *wq, *wk, *wv, *qn, *kn, *wo, *ln2, *wg, *wu, *wd; } pr__layer_w;

/* Activation memory: a bump allocator over backend chunks that are kept across resets, so a
   phase that runs many microbatches allocates once. Every byte handed out is counted in the
   trainer's live total, from which each phase's peak is read. */
typedef struct pr__chunk { struct pr__chunk *next; char *mem; size_t cap, used; } pr__chunk;
typedef struct { pr__chunk *head, *cur; size_t used; } pr__arena;

struct pr_trainer {
    pr_config cfg;
    const pr_backend *be;
    int n_tensors;
    pr_tensor_info *tensors;
    size_t n_params;
    pr_real *arena;                        /* 4 * n_params: parameters, gradients, AdamW m, AdamW v */
    pr_real *params, *grads, *adam_m, *adam_v;
    size_t off_embed, off_norm, off_lm_head;
    pr__layer_off *layer_off;              /* (L) */
    pr_real *inv_freq;                     /* (HS/2) RoPE frequencies, llama3 scaling applied */
    long adam_step;
    pr__arena prefix_arena;                /* Phase A..C: prefix saved tensors, K/V cache, gK/gV */
    pr__arena step_arena;                  /* one microbatch (Phase B, baseline) or one backward's scratch */
    size_t live_bytes, phase_peak[3];
    int phase;
    int alloc_failed;
};

static pr__layer_w pr__layer_view(pr_real *base, const pr__layer_off *o, int qk_norm) {
    pr__layer_w w;
    w.ln1 = base + o->ln1; w.wq = base + o->wq; w.wk = base + o->wk; w.wv = base + o->wv;
    w.qn = qk_norm ? base + o->qn : NULL; w.kn = qk_norm ? base + o->kn : NULL;
    w.wo = base + o->wo; w.ln2 = base + o->ln2; w.wg = base + o->wg; w.wu = base + o->wu; w.wd = base + o->wd;
    return w;
}
static pr_real *pr__lm_head(pr_trainer *tr, pr_real *base) {
    return base + (tr->cfg.tie_word_embeddings ? tr->off_embed : tr->off_lm_head);
}

/* Appends one tensor to the table (table may be NULL to count) and returns its offset. */
static size_t pr__add_tensor(pr_tensor_info *table, int *count, size_t *total, const char *name,
                             int64_t rows, int64_t cols, int decay) {
    size_t off = *total, numel = (size_t)rows * (size_t)(cols ? cols : 1);
    if (table) {
        pr_tensor_info *t = &table[*count];
        snprintf(t->name, sizeof t->name, "%s", name);
        t->ndim = cols ? 2 : 1;
        t->shape[0] = rows; t->shape[1] = cols;
        t->offset = off; t->numel = numel; t->decay = decay;
    }
    (*count)++;
    *total += numel;
    return off;
}

/* The Hugging Face tensor list of a Llama / Qwen3 model, in arena order. */
static void pr__build_layout(pr_trainer *tr, pr_tensor_info *table, int *count, size_t *total) {
    const pr_config *c = &tr->cfg;
    int64_t C = c->hidden_size, F = c->intermediate_size, V = c->vocab_size;
    int64_t qd = (int64_t)c->num_attention_heads * c->head_dim, kvd = (int64_t)c->num_key_value_heads * c->head_dim;
    char nm[96];
    *count = 0; *total = 0;
    tr->off_embed = pr__add_tensor(table, count, total, "model.embed_tokens.weight", V, C, 1);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        pr__layer_off o;
        memset(&o, 0, sizeof o);
#define PR__T(field, suffix, r, cl, d) \
        (snprintf(nm, sizeof nm, "model.layers.%d.%s", l, suffix), o.field = pr__add_tensor(table, count, total, nm, r, cl, d))
        PR__T(ln1, "input_layernorm.weight", C, 0, 0);
        PR__T(wq, "self_attn.q_proj.weight", qd, C, 1);
        PR__T(wk, "self_attn.k_proj.weight", kvd, C, 1);
        PR__T(wv, "self_attn.v_proj.weight", kvd, C, 1);
        if (c->qk_norm) {
            PR__T(qn, "self_attn.q_norm.weight", c->head_dim, 0, 0);
            PR__T(kn, "self_attn.k_norm.weight", c->head_dim, 0, 0);
        }
        PR__T(wo, "self_attn.o_proj.weight", C, qd, 1);
        PR__T(ln2, "post_attention_layernorm.weight", C, 0, 0);
        PR__T(wg, "mlp.gate_proj.weight", F, C, 1);
        PR__T(wu, "mlp.up_proj.weight", F, C, 1);
        PR__T(wd, "mlp.down_proj.weight", C, F, 1);
#undef PR__T
        if (tr->layer_off) tr->layer_off[l] = o;
    }
    tr->off_norm = pr__add_tensor(table, count, total, "model.norm.weight", C, 0, 0);
    if (!c->tie_word_embeddings) tr->off_lm_head = pr__add_tensor(table, count, total, "lm_head.weight", V, C, 1);
}

/* inv_freq[i] = theta^(-2i/HS), then Llama 3's scaling when configured: wavelengths longer than
   original/low_freq_factor are slowed by `factor`, shorter than original/high_freq_factor kept,
   and the band between interpolated smoothly (Hugging Face's _compute_llama3_parameters). */
static void pr__rope_frequencies(const pr_config *c, pr_real *inv_freq) {
    const double pi = 3.14159265358979323846;
    int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        double f = pow(c->rope_theta, -(2.0 * i) / c->head_dim);
        if (c->rope_llama3) {
            double old = c->rope_original_max_position, wavelen = 2 * pi / f;
            double low_wl = old / c->rope_low_freq_factor, high_wl = old / c->rope_high_freq_factor;
            if (wavelen > low_wl) f = f / c->rope_factor;
            else if (wavelen >= high_wl) {
                double smooth = (old / wavelen - c->rope_low_freq_factor) / (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1 - smooth) * f / c->rope_factor + smooth * f;
            }
        }
        inv_freq[i] = (pr_real)f;
    }
}

PRDEF pr_step_opts pr_step_opts_default(void) {
    pr_step_opts o;
    memset(&o, 0, sizeof o);
    o.schedule = PR_SCHEDULE_REUSE;
    o.microbatch = 0;
    o.layout = PR_LAYOUT_PADDED;
    o.loss.eps_low = 0.2;
    o.loss.eps_high = 0.28;
    o.loss.kl_coef = 0.0;
    o.loss.norm = PR_NORM_TOKEN_MEAN;
    return o;
}
PRDEF pr_adamw_opts pr_adamw_opts_default(void) {
    pr_adamw_opts o;
    o.lr = 1e-3; o.beta1 = 0.9; o.beta2 = 0.999; o.eps = 1e-8; o.weight_decay = 0.01; o.max_grad_norm = 1.0;
    return o;
}

PRDEF pr_status pr_trainer_create(pr_trainer **out, const pr_config *cfg, const pr_backend *be, pr_error *err) {
    if (!out || !cfg || !be) return pr__fail(err, PR_ERR_ARG, "pr_trainer_create: NULL argument");
    pr_status st = pr_config_validate(cfg, err);
    if (st) return st;
    pr_trainer *tr = PR_MALLOC(sizeof *tr);
    if (!tr) return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: out of memory");
    memset(tr, 0, sizeof *tr);
    tr->cfg = *cfg;
    tr->be = be;
    int count; size_t total;
    pr__build_layout(tr, NULL, &count, &total);           /* sizes only */
    size_t arena_bytes;
    tr->tensors = PR_MALLOC(sizeof(pr_tensor_info) * (size_t)count);
    tr->layer_off = PR_MALLOC(sizeof(pr__layer_off) * (size_t)cfg->num_hidden_layers);
    if (!tr->tensors || !tr->layer_off || !pr__mul_size(total, 4 * sizeof(pr_real), &arena_bytes)) {
        pr_trainer_destroy(tr);
        return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: out of memory");
    }
    pr__build_layout(tr, tr->tensors, &tr->n_tensors, &tr->n_params);
    tr->arena = be->alloc(be, arena_bytes, PR_TIER_DEVICE);
    tr->inv_freq = be->alloc(be, sizeof(pr_real) * (size_t)(cfg->head_dim / 2), PR_TIER_DEVICE);
    if (!tr->arena || !tr->inv_freq) {
        pr_trainer_destroy(tr);
        return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: cannot allocate %zu bytes of parameters, gradients and AdamW state", arena_bytes);
    }
    tr->params = tr->arena;
    tr->grads = tr->arena + tr->n_params;
    tr->adam_m = tr->arena + 2 * tr->n_params;
    tr->adam_v = tr->arena + 3 * tr->n_params;
    be->zero(be, tr->arena, arena_bytes);
    pr_real host_freq[1024];
    if (cfg->head_dim / 2 > 1024) {
        pr_trainer_destroy(tr);
        return pr__fail(err, PR_ERR_UNSUPPORTED, "head_dim %d is larger than 2048", cfg->head_dim);
    }
    pr__rope_frequencies(cfg, host_freq);
    be->upload_reals(be, tr->inv_freq, host_freq, (size_t)(cfg->head_dim / 2));
    *out = tr;
    return PR_OK;
}

static void pr__arena_free(pr_trainer *tr, pr__arena *a) {
    for (pr__chunk *c = a->head, *n; c; c = n) {
        n = c->next;
        tr->be->release(tr->be, c->mem, PR_TIER_DEVICE);
        PR_FREE(c);
    }
    a->head = a->cur = NULL;
    a->used = 0;
}

PRDEF void pr_trainer_destroy(pr_trainer *tr) {
    if (!tr) return;
    pr__arena_free(tr, &tr->prefix_arena);
    pr__arena_free(tr, &tr->step_arena);
    if (tr->arena) tr->be->release(tr->be, tr->arena, PR_TIER_DEVICE);
    if (tr->inv_freq) tr->be->release(tr->be, tr->inv_freq, PR_TIER_DEVICE);
    PR_FREE(tr->tensors);
    PR_FREE(tr->layer_off);
    PR_FREE(tr);
}

PRDEF const pr_config *pr_trainer_config(const pr_trainer *tr) { return &tr->cfg; }
PRDEF int pr_trainer_tensor_count(const pr_trainer *tr) { return tr->n_tensors; }
PRDEF const pr_tensor_info *pr_trainer_tensor(const pr_trainer *tr, int i) {
    return i >= 0 && i < tr->n_tensors ? &tr->tensors[i] : NULL;
}
PRDEF size_t pr_trainer_param_count(const pr_trainer *tr) { return tr->n_params; }

static pr_status pr__check_count(const pr_trainer *tr, size_t n, const char *fn, pr_error *err) {
    if (n != tr->n_params)
        return pr__fail(err, PR_ERR_ARG, "%s: buffer holds %zu reals, the model has %zu parameters", fn, n, tr->n_params);
    return PR_OK;
}
PRDEF pr_status pr_trainer_get_params(const pr_trainer *tr, pr_real *dst, size_t n, pr_error *err) {
    pr_status st = pr__check_count(tr, n, "pr_trainer_get_params", err);
    if (!st) tr->be->download_reals(tr->be, dst, tr->params, n);
    return st;
}
PRDEF pr_status pr_trainer_set_params(pr_trainer *tr, const pr_real *src, size_t n, pr_error *err) {
    pr_status st = pr__check_count(tr, n, "pr_trainer_set_params", err);
    if (!st) tr->be->upload_reals(tr->be, tr->params, src, n);
    return st;
}
PRDEF pr_status pr_trainer_get_grads(const pr_trainer *tr, pr_real *dst, size_t n, pr_error *err) {
    pr_status st = pr__check_count(tr, n, "pr_trainer_get_grads", err);
    if (!st) tr->be->download_reals(tr->be, dst, tr->grads, n);
    return st;
}

/* splitmix64 drives a Box-Muller normal: the same seed gives the same weights on every machine. */
static uint64_t pr__splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double pr__normal(uint64_t *s) {
    double u1 = ((pr__splitmix(s) >> 11) + 1.0) / 9007199254740993.0;   /* (0,1] */
    double u2 = (pr__splitmix(s) >> 11) / 9007199254740992.0;
    return sqrt(-2 * log(u1)) * cos(2 * 3.14159265358979323846 * u2);
}

PRDEF pr_status pr_trainer_init_params(pr_trainer *tr, uint64_t seed, pr_error *err) {
    if (!tr) return pr__fail(err, PR_ERR_ARG, "pr_trainer_init_params: NULL trainer");
    pr_real *host = PR_MALLOC(sizeof(pr_real) * tr->n_params);
    if (!host) return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_init_params: out of memory");
    uint64_t s = seed;
    for (int t = 0; t < tr->n_tensors; t++) {
        const pr_tensor_info *ti = &tr->tensors[t];
        for (size_t i = 0; i < ti->numel; i++)
            host[ti->offset + i] = ti->ndim == 2 ? (pr_real)(0.02 * pr__normal(&s)) : (pr_real)1;
    }
    tr->be->upload_reals(tr->be, tr->params, host, tr->n_params);
    PR_FREE(host);
    tr->be->zero(tr->be, tr->grads, 3 * tr->n_params * sizeof(pr_real));
    tr->adam_step = 0;
    return PR_OK;
}

/* ---------------------------------------------------------------- trainer: activation memory */
#define PR__CHUNK_BYTES ((size_t)16 << 20)
#define PR__ALIGN 256

/* n elements of the backend's activation type from arena a. Returns NULL and sets alloc_failed
   when memory runs out, so the schedule finishes its straight-line code and reports one error. */
static void *pr__act(pr_trainer *tr, pr__arena *a, size_t n) {
    size_t bytes;
    if (!pr__mul_size(n ? n : 1, tr->be->act_bytes, &bytes) || bytes > SIZE_MAX - PR__ALIGN) {
        tr->alloc_failed = 1;
        return NULL;
    }
    bytes = (bytes + PR__ALIGN - 1) / PR__ALIGN * PR__ALIGN;
    pr__chunk *c = a->cur;
    while (c && c->cap - c->used < bytes) c = c->next;   /* chunks after cur are empty since the reset */
    if (!c) {
        c = PR_MALLOC(sizeof *c);
        size_t cap = bytes > PR__CHUNK_BYTES ? bytes : PR__CHUNK_BYTES;
        char *mem = c ? tr->be->alloc(tr->be, cap, PR_TIER_DEVICE) : NULL;
        if (!mem) {
            PR_FREE(c);
            tr->alloc_failed = 1;
            return NULL;
        }
        c->mem = mem; c->cap = cap; c->used = 0; c->next = NULL;
        pr__chunk **end = &a->head;
        while (*end) end = &(*end)->next;
        *end = c;
    }
    a->cur = c;
    void *p = c->mem + c->used;
    c->used += bytes;
    a->used += bytes;
    tr->live_bytes += bytes;
    if (tr->live_bytes > tr->phase_peak[tr->phase]) tr->phase_peak[tr->phase] = tr->live_bytes;
    return p;
}

/* Everything in the arena is dead; its chunks stay for the next user. */
static void pr__arena_reset(pr_trainer *tr, pr__arena *a) {
    for (pr__chunk *c = a->head; c; c = c->next) c->used = 0;
    a->cur = a->head;
    tr->live_bytes -= a->used;
    a->used = 0;
}

static void pr__enter_phase(pr_trainer *tr, int phase) {
    tr->phase = phase;
    if (tr->live_bytes > tr->phase_peak[phase]) tr->phase_peak[phase] = tr->live_bytes;
}

/* ---------------------------------------------------------------- trainer: one pass through the model */
/* The tensors a layer's backward reads, saved by its forward (shapes for N rows). */
typedef struct {
    void *ln1, *ln1_rstd;     /* (N,C) (N) */
    void *q_pre, *k_pre;      /* (N,NH*HS) (N,NKV*HS) projections before the q/k norms (Qwen3 only) */
    void *q_rstd, *k_rstd;    /* (N*NH) (N*NKV) (Qwen3 only) */
    void *q, *k, *v;          /* (N,NH*HS) (N,NKV*HS) (N,NKV*HS) post-norm, post-RoPE: k, v are the K/V cache */
    void *att, *lse;          /* (N,NH*HS) (N,NH) */
    void *x_mid;              /* (N,C) residual after attention */
    void *ln2, *ln2_rstd;     /* (N,C) (N) */
    void *gate, *up, *h;      /* (N,F) */
} pr__layer_acts;

/* A batch of rows: the layout, the tokens (host), each layer's saved tensors, and the residual
   stream res[0..L] (res[0] the embeddings, res[l+1] the output of layer l). */
typedef struct {
    pr_seq_layout lay;
    int N;
    const int32_t *tokens;
    pr__layer_acts *acts;     /* (L) host array of pointers into the arena */
    void **res;               /* (L+1) */
} pr__pass;

/* Scratch for one backward, shared by every layer of it. */
typedef struct { void *dres, *dln, *dq, *dk, *dv, *dq_pre, *dk_pre, *datt, *dh, *dgate, *dup; } pr__bwd_scratch;

static pr_status pr__pass_alloc(pr_trainer *tr, pr__arena *a, pr__pass *ps, int N, pr_error *err) {
    const pr_config *c = &tr->cfg;
    size_t n = (size_t)N, C = c->hidden_size, F = c->intermediate_size, NH = c->num_attention_heads;
    size_t qd = NH * c->head_dim, NKV = c->num_key_value_heads, kvd = NKV * c->head_dim;
    int L = c->num_hidden_layers;
    ps->N = N;
    ps->acts = PR_MALLOC(sizeof(pr__layer_acts) * (size_t)L);
    ps->res = PR_MALLOC(sizeof(void *) * (size_t)(L + 1));
    if (!ps->acts || !ps->res) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for a pass of %d rows", N);
    ps->res[0] = pr__act(tr, a, n * C);
    for (int l = 0; l < L; l++) {
        pr__layer_acts *x = &ps->acts[l];
        memset(x, 0, sizeof *x);
        x->ln1 = pr__act(tr, a, n * C); x->ln1_rstd = pr__act(tr, a, n);
        if (c->qk_norm) {
            x->q_pre = pr__act(tr, a, n * qd); x->k_pre = pr__act(tr, a, n * kvd);
            x->q_rstd = pr__act(tr, a, n * NH); x->k_rstd = pr__act(tr, a, n * NKV);
        }
        x->q = pr__act(tr, a, n * qd); x->k = pr__act(tr, a, n * kvd); x->v = pr__act(tr, a, n * kvd);
        x->att = pr__act(tr, a, n * qd); x->lse = pr__act(tr, a, n * NH);
        x->x_mid = pr__act(tr, a, n * C);
        x->ln2 = pr__act(tr, a, n * C); x->ln2_rstd = pr__act(tr, a, n);
        x->gate = pr__act(tr, a, n * F); x->up = pr__act(tr, a, n * F); x->h = pr__act(tr, a, n * F);
        ps->res[l + 1] = pr__act(tr, a, n * C);
    }
    if (tr->alloc_failed) return pr__fail(err, PR_ERR_NOMEM, "out of activation memory for a pass of %d rows", N);
    return PR_OK;
}

static void pr__pass_free_host(pr__pass *ps) {
    PR_FREE(ps->acts);
    PR_FREE(ps->res);
    ps->acts = NULL;
    ps->res = NULL;
}

static pr_status pr__bwd_scratch_alloc(pr_trainer *tr, pr__arena *a, pr__bwd_scratch *s, int N, pr_error *err) {
    const pr_config *c = &tr->cfg;
    size_t n = (size_t)N, C = c->hidden_size, F = c->intermediate_size;
    size_t qd = (size_t)c->num_attention_heads * c->head_dim, kvd = (size_t)c->num_key_value_heads * c->head_dim;
    memset(s, 0, sizeof *s);
    s->dres = pr__act(tr, a, n * C); s->dln = pr__act(tr, a, n * C);
    s->dq = pr__act(tr, a, n * qd); s->dk = pr__act(tr, a, n * kvd); s->dv = pr__act(tr, a, n * kvd);
    if (c->qk_norm) { s->dq_pre = pr__act(tr, a, n * qd); s->dk_pre = pr__act(tr, a, n * kvd); }
    s->datt = pr__act(tr, a, n * qd);
    s->dh = pr__act(tr, a, n * F); s->dgate = pr__act(tr, a, n * F); s->dup = pr__act(tr, a, n * F);
    if (tr->alloc_failed) return pr__fail(err, PR_ERR_NOMEM, "out of activation memory for a backward of %d rows", N);
    return PR_OK;
}

static void pr__zero_acts(pr_trainer *tr, void *p, size_t n) { tr->be->zero(tr->be, p, n * tr->be->act_bytes); }

/* Layer l forward over the pass's rows; kp/vp are the cached prefix K/V (Phase B) or NULL. */
static void pr__layer_forward(pr_trainer *tr, pr__pass *ps, int l, const void *kp, const void *vp) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int N = ps->N, C = c->hidden_size, F = c->intermediate_size, NH = c->num_attention_heads;
    const int NKV = c->num_key_value_heads, HS = c->head_dim, qd = NH * HS, kvd = NKV * HS;
    pr__layer_w w = pr__layer_view(tr->params, &tr->layer_off[l], c->qk_norm);
    pr__layer_acts *a = &ps->acts[l];
    const void *x = ps->res[l];
    void *y = ps->res[l + 1];

    be->rmsnorm_fwd(be, a->ln1, a->ln1_rstd, x, w.ln1, N, C, c->rms_norm_eps);
    if (c->qk_norm) {            /* Qwen3: RMSNorm over each head's HS values, before RoPE */
        be->matmul_fwd(be, a->q_pre, a->ln1, w.wq, N, C, qd);
        be->matmul_fwd(be, a->k_pre, a->ln1, w.wk, N, C, kvd);
        be->rmsnorm_fwd(be, a->q, a->q_rstd, a->q_pre, w.qn, N * NH, HS, c->rms_norm_eps);
        be->rmsnorm_fwd(be, a->k, a->k_rstd, a->k_pre, w.kn, N * NKV, HS, c->rms_norm_eps);
    } else {
        be->matmul_fwd(be, a->q, a->ln1, w.wq, N, C, qd);
        be->matmul_fwd(be, a->k, a->ln1, w.wk, N, C, kvd);
    }
    be->matmul_fwd(be, a->v, a->ln1, w.wv, N, C, kvd);
    be->rope_fwd(be, a->q, &ps->lay, NH, HS, tr->inv_freq);
    be->rope_fwd(be, a->k, &ps->lay, NKV, HS, tr->inv_freq);
    be->attention_fwd(be, a->att, a->lse, a->q, a->k, a->v, kp, vp, &ps->lay, NH, NKV, HS);
    be->matmul_fwd(be, a->x_mid, a->att, w.wo, N, qd, C);      /* x_mid = x + att @ wo^T */
    be->add(be, a->x_mid, x, (size_t)N * C);
    be->rmsnorm_fwd(be, a->ln2, a->ln2_rstd, a->x_mid, w.ln2, N, C, c->rms_norm_eps);
    be->matmul_fwd(be, a->gate, a->ln2, w.wg, N, C, F);
    be->matmul_fwd(be, a->up, a->ln2, w.wu, N, C, F);
    be->swiglu_fwd(be, a->h, a->gate, a->up, (size_t)N * F);
    be->matmul_fwd(be, y, a->h, w.wd, N, F, C);                /* y = x_mid + h @ wd^T */
    be->add(be, y, a->x_mid, (size_t)N * C);
}

/* Layer l backward. On entry s->dres holds d(layer output); on return d(layer input).
   dk/dv: the buffers the attention backward adds this pass's own dK/dV into, already holding
   whatever must be injected (gK/gV in Phase C, zeros otherwise). dkp/dvp: where dK/dV of the
   cached prefix rows go (Phase B), or NULL. */
static void pr__layer_backward(pr_trainer *tr, pr__pass *ps, int l, pr__bwd_scratch *s, void *dk, void *dv,
                               const void *kp, const void *vp, void *dkp, void *dvp) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int N = ps->N, C = c->hidden_size, F = c->intermediate_size, NH = c->num_attention_heads;
    const int NKV = c->num_key_value_heads, HS = c->head_dim, qd = NH * HS, kvd = NKV * HS;
    pr__layer_w w = pr__layer_view(tr->params, &tr->layer_off[l], c->qk_norm);
    pr__layer_w g = pr__layer_view(tr->grads, &tr->layer_off[l], c->qk_norm);
    pr__layer_acts *a = &ps->acts[l];
    const size_t nC = (size_t)N * C, nF = (size_t)N * F;

    /* y = x_mid + h @ wd^T  (the residual passes dres through unchanged) */
    pr__zero_acts(tr, s->dh, nF);
    be->matmul_bwd(be, s->dh, g.wd, s->dres, a->h, w.wd, N, F, C);
    /* h = silu(gate) * up */
    pr__zero_acts(tr, s->dgate, nF);
    pr__zero_acts(tr, s->dup, nF);
    be->swiglu_bwd(be, s->dgate, s->dup, s->dh, a->gate, a->up, nF);
    /* gate = ln2 @ wg^T, up = ln2 @ wu^T */
    pr__zero_acts(tr, s->dln, nC);
    be->matmul_bwd(be, s->dln, g.wg, s->dgate, a->ln2, w.wg, N, C, F);
    be->matmul_bwd(be, s->dln, g.wu, s->dup, a->ln2, w.wu, N, C, F);
    /* ln2 = rmsnorm(x_mid): dres becomes d(x_mid) */
    be->rmsnorm_bwd(be, s->dres, g.ln2, s->dln, a->x_mid, w.ln2, a->ln2_rstd, N, C);
    /* x_mid = x + att @ wo^T */
    pr__zero_acts(tr, s->datt, (size_t)N * qd);
    be->matmul_bwd(be, s->datt, g.wo, s->dres, a->att, w.wo, N, qd, C);
    /* att = attention(q, [kp; k], [vp; v]) */
    pr__zero_acts(tr, s->dq, (size_t)N * qd);
    be->attention_bwd(be, s->dq, dk, dv, dkp, dvp, s->datt, a->att, a->lse, a->q, a->k, a->v, kp, vp, &ps->lay, NH, NKV, HS);
    /* q, k = rope(...) */
    be->rope_bwd(be, s->dq, &ps->lay, NH, HS, tr->inv_freq);
    be->rope_bwd(be, dk, &ps->lay, NKV, HS, tr->inv_freq);
    void *dq = s->dq, *dkk = dk;
    if (c->qk_norm) {            /* q = q_norm(q_pre), k = k_norm(k_pre) */
        pr__zero_acts(tr, s->dq_pre, (size_t)N * qd);
        pr__zero_acts(tr, s->dk_pre, (size_t)N * kvd);
        be->rmsnorm_bwd(be, s->dq_pre, g.qn, s->dq, a->q_pre, w.qn, a->q_rstd, N * NH, HS);
        be->rmsnorm_bwd(be, s->dk_pre, g.kn, dk, a->k_pre, w.kn, a->k_rstd, N * NKV, HS);
        dq = s->dq_pre;
        dkk = s->dk_pre;
    }
    /* q_pre/k/v = ln1 @ w^T */
    pr__zero_acts(tr, s->dln, nC);
    be->matmul_bwd(be, s->dln, g.wq, dq, a->ln1, w.wq, N, C, qd);
    be->matmul_bwd(be, s->dln, g.wk, dkk, a->ln1, w.wk, N, C, kvd);
    be->matmul_bwd(be, s->dln, g.wv, dv, a->ln1, w.wv, N, C, kvd);
    /* ln1 = rmsnorm(x): dres becomes d(x) */
    be->rmsnorm_bwd(be, s->dres, g.ln1, s->dln, ps->res[l], w.ln1, a->ln1_rstd, N, C);
}

/* ---------------------------------------------------------------- trainer: batches and the loss head */
/* Which rows of a pass predict which suffix tokens, with what the loss needs for each. */
typedef struct {
    int M;
    int *row;           /* row of the pass whose final hidden state predicts the token */
    long *flat;         /* index of the token in the group's flattened suffix arrays */
    int32_t *target;
    pr_real *old_logp, *ref_logp, *advantage, *weight;
} pr__head_plan;

/* The host side of one pass: layout, tokens, and its loss rows. */
typedef struct {
    pr_seq_layout lay;
    int *seg_off;
    int32_t *tokens;
    int N;
    pr__head_plan head;
} pr__batch;

typedef enum {
    PR__BATCH_FULL,          /* baseline: whole [prefix ; suffix] sequences, padded to the longest */
    PR__BATCH_SUFFIX,        /* Phase B: suffixes after the cached prefix, padded or packed */
    PR__BATCH_PREFIX         /* Phase A/C: the prefix once; its loss rows are each suffix's first token */
} pr__batch_kind;

static void pr__batch_free(pr__batch *b) {
    PR_FREE(b->seg_off); PR_FREE(b->tokens);
    PR_FREE(b->head.row); PR_FREE(b->head.flat); PR_FREE(b->head.target);
    PR_FREE(b->head.old_logp); PR_FREE(b->head.ref_logp); PR_FREE(b->head.advantage); PR_FREE(b->head.weight);
    memset(b, 0, sizeof *b);
}

static void pr__head_push(pr__head_plan *h, const pr_group *g, const pr_real *tok_weight, int row, int i, int j) {
    long f = (long)g->suffix_off[i] + j;
    int m = h->M++;
    h->row[m] = row;
    h->flat[m] = f;
    h->target[m] = g->tokens[f];
    h->old_logp[m] = g->old_logp[f];
    if (h->ref_logp) h->ref_logp[m] = g->ref_logp[f];
    h->advantage[m] = g->advantage[i];
    h->weight[m] = tok_weight[f];
}

/* Trajectories i0 .. i0+n-1 of group g as one batch of the given kind.
   Token j of suffix i is predicted by the row just before it: the last prefix row for j = 0
   (which the prefix batch owns under reuse), else the row of suffix token j-1. */
static pr_status pr__batch_build(pr__batch *b, const pr_group *g, const pr_real *tok_weight, int i0, int n,
                                 pr__batch_kind kind, int packed, pr_error *err) {
    const int P = g->P;
    int smax = 0;
    long sum = 0;
    for (int i = i0; i < i0 + n; i++) { if (g->suffix_len[i] > smax) smax = g->suffix_len[i]; sum += g->suffix_len[i]; }
    memset(b, 0, sizeof *b);
    int nseg = kind == PR__BATCH_PREFIX ? 1 : n;
    long rows = kind == PR__BATCH_PREFIX ? P : kind == PR__BATCH_FULL ? (long)n * (P + smax) : packed ? sum : (long)n * smax;
    long mrows = kind == PR__BATCH_PREFIX ? n : kind == PR__BATCH_FULL ? sum : sum - n;
    b->N = (int)rows;
    b->seg_off = PR_MALLOC(sizeof(int) * (size_t)(nseg + 1));
    b->tokens = PR_MALLOC(sizeof(int32_t) * (size_t)rows);
    size_t mr = (size_t)(mrows > 0 ? mrows : 1);
    b->head.row = PR_MALLOC(sizeof(int) * mr);
    b->head.flat = PR_MALLOC(sizeof(long) * mr);
    b->head.target = PR_MALLOC(sizeof(int32_t) * mr);
    b->head.old_logp = PR_MALLOC(sizeof(pr_real) * mr);
    b->head.ref_logp = g->ref_logp ? PR_MALLOC(sizeof(pr_real) * mr) : NULL;
    b->head.advantage = PR_MALLOC(sizeof(pr_real) * mr);
    b->head.weight = PR_MALLOC(sizeof(pr_real) * mr);
    if (!b->seg_off || !b->tokens || !b->head.row || !b->head.flat || !b->head.target || !b->head.old_logp ||
        (g->ref_logp && !b->head.ref_logp) || !b->head.advantage || !b->head.weight) {
        pr__batch_free(b);
        return pr__fail(err, PR_ERR_NOMEM, "out of host memory for a batch of %ld rows", rows);
    }
    b->lay.n_seg = nseg;
    b->lay.seg_off = b->seg_off;
    b->lay.pos0 = kind == PR__BATCH_SUFFIX ? P : 0;
    b->lay.n_prefix = kind == PR__BATCH_SUFFIX ? P : 0;
    if (kind == PR__BATCH_PREFIX) {
        b->seg_off[0] = 0; b->seg_off[1] = P;
        memcpy(b->tokens, g->prefix, sizeof(int32_t) * (size_t)P);
        for (int i = i0; i < i0 + n; i++) pr__head_push(&b->head, g, tok_weight, P - 1, i, 0);
        return PR_OK;
    }
    int off = 0;
    for (int s = 0; s < n; s++) {
        int i = i0 + s, S = g->suffix_len[i];
        int len = kind == PR__BATCH_FULL ? P + smax : packed ? S : smax;
        const int32_t *suf = g->tokens + g->suffix_off[i];
        int32_t *t = b->tokens + off;
        b->seg_off[s] = off;
        if (kind == PR__BATCH_FULL) {
            memcpy(t, g->prefix, sizeof(int32_t) * (size_t)P);
            t += P;
        }
        memcpy(t, suf, sizeof(int32_t) * (size_t)S);
        for (int r = (int)(t - (b->tokens + off)) + S; r < len; r++) b->tokens[off + r] = 0;   /* padding */
        if (kind == PR__BATCH_FULL)
            for (int j = 0; j < S; j++) pr__head_push(&b->head, g, tok_weight, off + P - 1 + j, i, j);
        else
            for (int j = 1; j < S; j++) pr__head_push(&b->head, g, tok_weight, off + j - 1, i, j);
        off += len;
    }
    b->seg_off[n] = off;
    return PR_OK;
}

/* Final norm, LM head and GRPO loss for the plan's rows of x_final, fused with their backward:
   the loss of a row depends on nothing but that row's log-prob, so d(loss)/d(x_final) is known at
   once and is added into dx_final. Rows go through in chunks that bound the logits' memory. */
static pr_status pr__head(pr_trainer *tr, pr__arena *a, const void *x_final, void *dx_final, const pr__head_plan *hp,
                          const pr_loss_opts *lo, pr_real *logp_flat, double *loss, pr_error *err) {
    const pr_backend *be = tr->be;
    const int C = tr->cfg.hidden_size, V = tr->cfg.vocab_size;
    if (hp->M == 0) return PR_OK;
    int ch = (int)((size_t)(4 << 20) / (size_t)V);
    if (ch < 1) ch = 1;
    if (ch > hp->M) ch = hp->M;
    void *xr = pr__act(tr, a, (size_t)ch * C), *xn = pr__act(tr, a, (size_t)ch * C), *rstd = pr__act(tr, a, (size_t)ch);
    void *logits = pr__act(tr, a, (size_t)ch * V), *dxn = pr__act(tr, a, (size_t)ch * C), *dxr = pr__act(tr, a, (size_t)ch * C);
    pr_real *lp = PR_MALLOC(sizeof(pr_real) * (size_t)ch);
    if (tr->alloc_failed || !lp) {
        PR_FREE(lp);
        return pr__fail(err, PR_ERR_NOMEM, "out of memory for the loss head (%d rows x vocabulary %d)", ch, V);
    }
    pr_real *wn = tr->params + tr->off_norm, *gn = tr->grads + tr->off_norm;
    pr_real *wh = pr__lm_head(tr, tr->params), *gh = pr__lm_head(tr, tr->grads);
    for (int m0 = 0; m0 < hp->M; m0 += ch) {
        int n = hp->M - m0 < ch ? hp->M - m0 : ch;
        pr_head_rows rows = { n, hp->target + m0, hp->old_logp + m0, hp->ref_logp ? hp->ref_logp + m0 : NULL,
                              hp->advantage + m0, hp->weight + m0 };
        be->gather_rows(be, xr, x_final, hp->row + m0, n, C);
        be->rmsnorm_fwd(be, xn, rstd, xr, wn, n, C, tr->cfg.rms_norm_eps);
        be->matmul_fwd(be, logits, xn, wh, n, C, V);
        be->loss_head(be, logits, &rows, lo, V, lp, loss);              /* logits now hold dlogits */
        pr__zero_acts(tr, dxn, (size_t)n * C);
        be->matmul_bwd(be, dxn, gh, logits, xn, wh, n, C, V);
        pr__zero_acts(tr, dxr, (size_t)n * C);
        be->rmsnorm_bwd(be, dxr, gn, dxn, xr, wn, rstd, n, C);
        be->scatter_add_rows(be, dx_final, dxr, hp->row + m0, n, C);
        if (logp_flat)
            for (int m = 0; m < n; m++) logp_flat[hp->flat[m0 + m]] = lp[m];
    }
    PR_FREE(lp);
    return PR_OK;
}

/* ---------------------------------------------------------------- trainer: the schedules */
/* State that lives from Phase A to Phase C. */
typedef struct {
    pr__batch batch;          /* the prefix as one segment, with the first-suffix-token loss rows */
    pr__pass pass;            /* its saved tensors; pass.acts[l].k/v are layer l's K/V cache */
    void **gk, **gv;          /* (L) accumulated prefix dK/dV, (P, NKV*HS) each */
    void *dk_mb, *dv_mb;      /* (P, NKV*HS) one microbatch's prefix dK/dV for one layer */
} pr__prefix_state;

typedef struct {
    const pr_group *g;
    const pr_step_opts *opt;
    const pr_real *tok_weight;
    pr_real *logp;
    double loss;
    long rows;
} pr__step_ctx;

/* Forward, loss and backward of one microbatch, all of it in the step arena. With a prefix state
   (Phase B) attention also reads the cached prefix K/V, and the prefix dK/dV this microbatch
   produces are handed to the hook and added into gK/gV. */
static pr_status pr__run_microbatch(pr_trainer *tr, pr__step_ctx *cx, const pr__batch *b, int mb,
                                    pr__prefix_state *ps, pr_error *err) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int L = c->num_hidden_layers, C = c->hidden_size;
    const size_t kv_n = ps ? (size_t)cx->g->P * c->num_key_value_heads * c->head_dim : 0;
    pr__pass p;
    pr__bwd_scratch s;
    memset(&p, 0, sizeof p);
    p.lay = b->lay;
    p.tokens = b->tokens;
    pr_status st = pr__pass_alloc(tr, &tr->step_arena, &p, b->N, err);
    if (!st) st = pr__bwd_scratch_alloc(tr, &tr->step_arena, &s, b->N, err);
    if (!st) {
        be->embed_fwd(be, p.res[0], p.tokens, tr->params + tr->off_embed, p.N, C);
        for (int l = 0; l < L; l++)
            pr__layer_forward(tr, &p, l, ps ? ps->pass.acts[l].k : NULL, ps ? ps->pass.acts[l].v : NULL);
        pr__zero_acts(tr, s.dres, (size_t)p.N * C);
        st = pr__head(tr, &tr->step_arena, p.res[L], s.dres, &b->head, &cx->opt->loss, cx->logp, &cx->loss, err);
    }
    if (!st) {
        size_t kvn_own = (size_t)p.N * c->num_key_value_heads * c->head_dim;
        for (int l = L - 1; l >= 0; l--) {
            pr__zero_acts(tr, s.dk, kvn_own);
            pr__zero_acts(tr, s.dv, kvn_own);
            if (ps) { pr__zero_acts(tr, ps->dk_mb, kv_n); pr__zero_acts(tr, ps->dv_mb, kv_n); }
            pr__layer_backward(tr, &p, l, &s, s.dk, s.dv, ps ? ps->pass.acts[l].k : NULL, ps ? ps->pass.acts[l].v : NULL,
                               ps ? ps->dk_mb : NULL, ps ? ps->dv_mb : NULL);
            if (ps) {
                const pr_hooks *h = &cx->opt->hooks;
                if (h->on_dkv) h->on_dkv(h->user, l, mb, ps->dk_mb, ps->dv_mb, cx->g->P, (int)(kv_n / (size_t)cx->g->P));
                be->add(be, ps->gk[l], ps->dk_mb, kv_n);
                be->add(be, ps->gv[l], ps->dv_mb, kv_n);
            }
        }
        be->embed_bwd(be, tr->grads + tr->off_embed, s.dres, p.tokens, p.N, C);
        cx->rows += p.N;
    }
    pr__pass_free_host(&p);
    pr__arena_reset(tr, &tr->step_arena);
    return st;
}

/* Phase A: the prefix forward once. Its saved tensors stay in the prefix arena until Phase C;
   each layer's k/v rows are the K/V cache Phase B reads. */
static pr_status pr__phase_a_prefix_forward(pr_trainer *tr, pr__step_ctx *cx, pr__prefix_state *ps, pr_error *err) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int L = c->num_hidden_layers, P = cx->g->P, kvd = c->num_key_value_heads * c->head_dim;
    const pr_hooks *h = &cx->opt->hooks;
    pr_status st = pr__batch_build(&ps->batch, cx->g, cx->tok_weight, 0, cx->g->G, PR__BATCH_PREFIX, 0, err);
    if (st) return st;
    ps->pass.lay = ps->batch.lay;
    ps->pass.tokens = ps->batch.tokens;
    ps->gk = PR_MALLOC(sizeof(void *) * (size_t)L);
    ps->gv = PR_MALLOC(sizeof(void *) * (size_t)L);
    if (!ps->gk || !ps->gv) return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
    st = pr__pass_alloc(tr, &tr->prefix_arena, &ps->pass, P, err);
    if (st) return st;
    for (int l = 0; l < L; l++) {
        ps->gk[l] = pr__act(tr, &tr->prefix_arena, (size_t)P * kvd);
        ps->gv[l] = pr__act(tr, &tr->prefix_arena, (size_t)P * kvd);
    }
    ps->dk_mb = pr__act(tr, &tr->prefix_arena, (size_t)P * kvd);
    ps->dv_mb = pr__act(tr, &tr->prefix_arena, (size_t)P * kvd);
    if (tr->alloc_failed) return pr__fail(err, PR_ERR_NOMEM, "out of memory for the gK/gV cache (%d prefix rows)", P);
    be->embed_fwd(be, ps->pass.res[0], ps->pass.tokens, tr->params + tr->off_embed, P, c->hidden_size);
    for (int l = 0; l < L; l++) {
        pr__layer_forward(tr, &ps->pass, l, NULL, NULL);
        if (h->on_kv_capture) h->on_kv_capture(h->user, l, ps->pass.acts[l].k, ps->pass.acts[l].v, P, kvd);
        pr__zero_acts(tr, ps->gk[l], (size_t)P * kvd);
        pr__zero_acts(tr, ps->gv[l], (size_t)P * kvd);
    }
    cx->rows += P;
    return PR_OK;
}

/* Phase B: one suffix microbatch over the cached prefix K/V. */
static pr_status pr__phase_b_suffix_microbatch(pr_trainer *tr, pr__step_ctx *cx, pr__prefix_state *ps, int i0, int n,
                                               int mb, pr_error *err) {
    pr__batch b;
    pr_status st = pr__batch_build(&b, cx->g, cx->tok_weight, i0, n, PR__BATCH_SUFFIX,
                                   cx->opt->layout == PR_LAYOUT_PACKED, err);
    if (st) return st;
    st = pr__run_microbatch(tr, cx, &b, mb, ps, err);
    pr__batch_free(&b);
    return st;
}

/* Phase C: the prefix backward once. The first token of every suffix is predicted from the last
   prefix row, so its loss enters here directly (through the final norm and LM head at row P-1);
   everything else the suffixes ask of the prefix arrives through gK/gV, which become the starting
   dK/dV of each layer's prefix attention backward. */
static pr_status pr__phase_c_prefix_backward(pr_trainer *tr, pr__step_ctx *cx, pr__prefix_state *ps, pr_error *err) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int L = c->num_hidden_layers, P = cx->g->P, C = c->hidden_size, kvd = c->num_key_value_heads * c->head_dim;
    const pr_hooks *h = &cx->opt->hooks;
    pr__bwd_scratch s;
    pr_status st = pr__bwd_scratch_alloc(tr, &tr->step_arena, &s, P, err);
    if (st) return st;
    pr__zero_acts(tr, s.dres, (size_t)P * C);
    st = pr__head(tr, &tr->step_arena, ps->pass.res[L], s.dres, &ps->batch.head, &cx->opt->loss, cx->logp, &cx->loss, err);
    if (st) return st;
    for (int l = L - 1; l >= 0; l--) {
        if (h->on_kv_inject) h->on_kv_inject(h->user, l, ps->gk[l], ps->gv[l], P, kvd);
        pr__layer_backward(tr, &ps->pass, l, &s, ps->gk[l], ps->gv[l], NULL, NULL, NULL, NULL);
    }
    be->embed_bwd(be, tr->grads + tr->off_embed, s.dres, ps->pass.tokens, P, C);
    return PR_OK;
}

static pr_status pr__validate_step(const pr_trainer *tr, const pr_group *g, const pr_step_opts *o, pr_error *err) {
    if (!g || !o) return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads: NULL group or options");
    pr_status st = pr_group_validate(g, tr->cfg.vocab_size, err);
    if (st) return st;
    int smax = 0;
    for (int i = 0; i < g->G; i++) if (g->suffix_len[i] > smax) smax = g->suffix_len[i];
    if ((long)g->P + smax > tr->cfg.max_position_embeddings)
        return pr__fail(err, PR_ERR_ARG, "prefix %d + longest suffix %d tokens exceed max_position_embeddings %d",
                        g->P, smax, tr->cfg.max_position_embeddings);
    if (o->schedule != PR_SCHEDULE_BASELINE && o->schedule != PR_SCHEDULE_REUSE)
        return pr__fail(err, PR_ERR_ARG, "unknown schedule %d", (int)o->schedule);
    if (o->layout != PR_LAYOUT_PADDED && o->layout != PR_LAYOUT_PACKED)
        return pr__fail(err, PR_ERR_ARG, "unknown layout %d", (int)o->layout);
    if (o->microbatch < 0) return pr__fail(err, PR_ERR_ARG, "microbatch must be >= 1 (or 0 for the whole group), got %d", o->microbatch);
    int mb = o->microbatch == 0 || o->microbatch > g->G ? g->G : o->microbatch;
    if ((double)mb * ((double)g->P + smax) * tr->cfg.intermediate_size > 4e18 || (double)mb * ((double)g->P + smax) > 2e9)
        return pr__fail(err, PR_ERR_ARG, "a microbatch of %d x %d rows is too large", mb, g->P + smax);
    const pr_loss_opts *lo = &o->loss;
    if (!(lo->eps_low >= 0 && lo->eps_low < 1) || !(lo->eps_high >= 0 && lo->eps_high < 1e6))
        return pr__fail(err, PR_ERR_ARG, "clip range eps_low %g / eps_high %g out of range (eps_low in [0,1), eps_high >= 0)",
                        lo->eps_low, lo->eps_high);
    if (!(lo->kl_coef >= 0 && lo->kl_coef < 1e6)) return pr__fail(err, PR_ERR_ARG, "kl_coef %g must be >= 0", lo->kl_coef);
    if (lo->kl_coef > 0 && !g->ref_logp) return pr__fail(err, PR_ERR_ARG, "kl_coef %g needs reference log-probs, the group has none", lo->kl_coef);
    if (lo->norm != PR_NORM_TOKEN_MEAN && lo->norm != PR_NORM_SEQ_MEAN_TOKEN_MEAN)
        return pr__fail(err, PR_ERR_ARG, "unknown loss normalisation %d", (int)lo->norm);
    return PR_OK;
}

/* Each suffix token's share of the loss: mask / (masked tokens of the group) for token-mean, or
   mask / (G * masked tokens of its trajectory) for seq-mean-token-mean. Both are known before any
   forward runs, which is what lets the loss split over suffixes and microbatches. */
static void pr__token_weights(const pr_group *g, pr_loss_norm norm, pr_real *w) {
    long total = 0;
    for (long f = 0; f < g->suffix_off[g->G]; f++) total += g->loss_mask[f];
    for (int i = 0; i < g->G; i++) {
        long n_i = 0;
        for (long f = g->suffix_off[i]; f < g->suffix_off[i + 1]; f++) n_i += g->loss_mask[f];
        double denom = norm == PR_NORM_TOKEN_MEAN ? (double)total : (double)g->G * (double)n_i;
        for (long f = g->suffix_off[i]; f < g->suffix_off[i + 1]; f++)
            w[f] = g->loss_mask[f] ? (pr_real)(1.0 / denom) : 0;
    }
}

PRDEF pr_status pr_trainer_compute_grads(pr_trainer *tr, const pr_group *g, const pr_step_opts *opt,
                                         pr_step_stats *stats, pr_real *logp, pr_error *err) {
    if (!tr) return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads: NULL trainer");
    pr_status st = pr__validate_step(tr, g, opt, err);
    if (st) return st;
    const pr_backend *be = tr->be;
    const int G = g->G, mb = opt->microbatch == 0 || opt->microbatch > G ? G : opt->microbatch;
    long n_tok = g->suffix_off[G];
    pr_real *tok_weight = PR_MALLOC(sizeof(pr_real) * (size_t)n_tok);
    pr_real *lp = logp ? logp : PR_MALLOC(sizeof(pr_real) * (size_t)n_tok);
    if (!tok_weight || !lp) {
        PR_FREE(tok_weight);
        if (!logp) PR_FREE(lp);
        return pr__fail(err, PR_ERR_NOMEM, "out of host memory for %ld suffix tokens", n_tok);
    }
    pr__token_weights(g, opt->loss.norm, tok_weight);
    pr__step_ctx cx = { g, opt, tok_weight, lp, 0.0, 0 };
    pr_step_stats s;
    memset(&s, 0, sizeof s);
    memset(tr->phase_peak, 0, sizeof tr->phase_peak);
    tr->alloc_failed = 0;
    be->zero(be, tr->grads, tr->n_params * sizeof(pr_real));
    double t0 = pr__now();
    if (opt->schedule == PR_SCHEDULE_BASELINE) {
        pr__enter_phase(tr, PR_PHASE_B);
        for (int i0 = 0; i0 < G && !st; i0 += mb, s.microbatches++) {
            pr__batch b;
            st = pr__batch_build(&b, g, tok_weight, i0, i0 + mb <= G ? mb : G - i0, PR__BATCH_FULL, 0, err);
            if (!st) st = pr__run_microbatch(tr, &cx, &b, s.microbatches, NULL, err);
            pr__batch_free(&b);
        }
        be->sync(be);
        s.seconds[PR_PHASE_B] = pr__now() - t0;
    } else {
        pr__prefix_state ps;
        memset(&ps, 0, sizeof ps);
        pr__enter_phase(tr, PR_PHASE_A);
        st = pr__phase_a_prefix_forward(tr, &cx, &ps, err);
        be->sync(be);
        double t1 = pr__now();
        pr__enter_phase(tr, PR_PHASE_B);
        for (int i0 = 0; i0 < G && !st; i0 += mb, s.microbatches++)
            st = pr__phase_b_suffix_microbatch(tr, &cx, &ps, i0, i0 + mb <= G ? mb : G - i0, s.microbatches, err);
        be->sync(be);
        double t2 = pr__now();
        pr__enter_phase(tr, PR_PHASE_C);
        if (!st) st = pr__phase_c_prefix_backward(tr, &cx, &ps, err);
        be->sync(be);
        double t3 = pr__now();
        s.seconds[PR_PHASE_A] = t1 - t0; s.seconds[PR_PHASE_B] = t2 - t1; s.seconds[PR_PHASE_C] = t3 - t2;
        pr__pass_free_host(&ps.pass);
        pr__batch_free(&ps.batch);
        PR_FREE(ps.gk);
        PR_FREE(ps.gv);
        pr__arena_reset(tr, &tr->step_arena);
        pr__arena_reset(tr, &tr->prefix_arena);
    }
    for (long f = 0; f < n_tok; f++) s.loss_tokens += tok_weight[f] != 0;
    PR_FREE(tok_weight);
    if (!logp) PR_FREE(lp);
    if (st) return st;
    s.loss = cx.loss;
    s.rows = cx.rows;
    memcpy(s.peak_bytes, tr->phase_peak, sizeof s.peak_bytes);
    s.flops = pr_step_flops(&tr->cfg, g, opt->schedule);
    if (stats) *stats = s;
    return PR_OK;
}

PRDEF pr_status pr_trainer_adamw_step(pr_trainer *tr, const pr_adamw_opts *o, double *grad_norm, pr_error *err) {
    if (!tr || !o) return pr__fail(err, PR_ERR_ARG, "pr_trainer_adamw_step: NULL argument");
    if (!(o->lr >= 0) || !(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) || !(o->eps > 0) ||
        !(o->weight_decay >= 0))
        return pr__fail(err, PR_ERR_ARG, "AdamW settings out of range (lr %g, betas %g %g, eps %g, weight decay %g)",
                        o->lr, o->beta1, o->beta2, o->eps, o->weight_decay);
    const pr_backend *be = tr->be;
    double norm = sqrt(be->sum_squares(be, tr->grads, tr->n_params));
    if (!isfinite(norm)) return pr__fail(err, PR_ERR_ARG, "gradient norm is %g: parameters left unchanged", norm);
    if (o->max_grad_norm > 0 && norm > o->max_grad_norm) be->scale(be, tr->grads, tr->n_params, o->max_grad_norm / norm);
    tr->adam_step++;
    for (int t = 0; t < tr->n_tensors; t++) {
        const pr_tensor_info *ti = &tr->tensors[t];
        be->adamw(be, tr->params + ti->offset, tr->grads + ti->offset, tr->adam_m + ti->offset, tr->adam_v + ti->offset,
                  ti->numel, o->lr, o->beta1, o->beta2, o->eps, ti->decay ? o->weight_decay : 0.0, tr->adam_step);
    }
    if (grad_norm) *grad_norm = norm;
    return PR_OK;
}

PRDEF double pr_step_flops(const pr_config *c, const pr_group *g, pr_schedule schedule) {
    double C = c->hidden_size, F = c->intermediate_size, V = c->vocab_size;
    double qd = (double)c->num_attention_heads * c->head_dim, kvd = (double)c->num_key_value_heads * c->head_dim;
    double per_token = 6 * (C * qd + 2 * C * kvd + qd * C + 3 * C * F) * c->num_hidden_layers;   /* fwd 2x, bwd 4x */
    double per_pair = 12 * qd * c->num_hidden_layers;          /* QK^T and PV: fwd 4*HS*NH, bwd 8*HS*NH */
    double P = g->P, tokens = 0, pairs = 0, head_rows = 0;
    for (int i = 0; i < g->G; i++) {
        double S = g->suffix_len[i], T = P + S;
        head_rows += S;
        if (schedule == PR_SCHEDULE_BASELINE) { tokens += T; pairs += T * (T + 1) / 2; }
        else { tokens += S; pairs += S * P + S * (S + 1) / 2; }
    }
    if (schedule == PR_SCHEDULE_REUSE) { tokens += P; pairs += P * (P + 1) / 2; }
    return tokens * per_token + pairs * per_pair + head_rows * 6 * C * V;
}

/* ---------------------------------------------------------------- trainer: checkpoints */
PRDEF pr_status pr_trainer_load(pr_trainer *tr, const char *path, pr_error *err) {
    if (!tr || !path) return pr__fail(err, PR_ERR_ARG, "pr_trainer_load: NULL argument");
    pr_checkpoint *ck;
    pr_status st = pr_checkpoint_open(&ck, path, err);
    if (st) return st;
    pr_real *host = PR_MALLOC(sizeof(pr_real) * tr->n_params);
    if (!host) st = pr__fail(err, PR_ERR_NOMEM, "pr_trainer_load: out of memory");
    for (int i = 0; i < tr->n_tensors && !st; i++) {
        const pr_tensor_info *ti = &tr->tensors[i];
        const pr_st_tensor *t = pr_checkpoint_find(ck, ti->name);
        if (!t) { st = pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s is missing", path, ti->name); break; }
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
        int same = t->ndim == ti->ndim && t->shape[0] == ti->shape[0] && (ti->ndim == 1 || t->shape[1] == ti->shape[1]);
        if (!same) {
            st = pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s has shape [%lld%s%lld], the config asks for [%lld%s%lld]", path, ti->name,
                          (long long)t->shape[0], t->ndim > 1 ? ", " : "", t->ndim > 1 ? (long long)t->shape[1] : 0LL,
                          (long long)ti->shape[0], ti->ndim > 1 ? ", " : "", ti->ndim > 1 ? (long long)ti->shape[1] : 0LL);
            break;
        }
        st = pr_checkpoint_read(ck, t, host + ti->offset, (size_t)numel, err);
    }
    if (!st) tr->be->upload_reals(tr->be, tr->params, host, tr->n_params);
    PR_FREE(host);
    pr_checkpoint_close(ck);
    return st;
}

/* One host copy of an arena (parameters or gradients) described by the tensor table. */
static pr_status pr__entries(pr_trainer *tr, const pr_real *arena, pr_real **host, pr_st_entry **entries, pr_error *err) {
    *host = PR_MALLOC(sizeof(pr_real) * tr->n_params);
    *entries = PR_MALLOC(sizeof(pr_st_entry) * (size_t)tr->n_tensors);
    if (!*host || !*entries) {
        PR_FREE(*host);
        PR_FREE(*entries);
        return pr__fail(err, PR_ERR_NOMEM, "out of memory for a host copy of %zu parameters", tr->n_params);
    }
    tr->be->download_reals(tr->be, *host, arena, tr->n_params);
    for (int i = 0; i < tr->n_tensors; i++) {
        const pr_tensor_info *ti = &tr->tensors[i];
        pr_st_entry *e = &(*entries)[i];
        memset(e, 0, sizeof *e);
        e->name = ti->name;
        e->data = *host + ti->offset;
        e->ndim = ti->ndim;
        e->shape[0] = ti->shape[0];
        e->shape[1] = ti->shape[1];
    }
    return PR_OK;
}

PRDEF pr_status pr_trainer_save(pr_trainer *tr, const char *dir, pr_dtype dtype, uint64_t max_shard_bytes, pr_error *err) {
    if (!tr || !dir) return pr__fail(err, PR_ERR_ARG, "pr_trainer_save: NULL argument");
    pr_real *host;
    pr_st_entry *entries;
    pr_status st = pr__entries(tr, tr->params, &host, &entries, err);
    if (st) return st;
    st = pr_checkpoint_save(dir, entries, tr->n_tensors, dtype, max_shard_bytes, err);
    if (!st) {
        char path[4096];
        snprintf(path, sizeof path, "%s/config.json", dir);
        st = pr_config_save(&tr->cfg, path, err);
    }
    PR_FREE(host);
    PR_FREE(entries);
    return st;
}

PRDEF pr_status pr_trainer_save_grads(pr_trainer *tr, const char *path, pr_error *err) {
    if (!tr || !path) return pr__fail(err, PR_ERR_ARG, "pr_trainer_save_grads: NULL argument");
    pr_real *host;
    pr_st_entry *entries;
    pr_status st = pr__entries(tr, tr->grads, &host, &entries, err);
    if (st) return st;
    st = pr_safetensors_write(path, entries, tr->n_tensors, sizeof(pr_real) == 8 ? PR_DT_F64 : PR_DT_F32,
                              "{\"content\": \"gradients\"}", err);
    PR_FREE(host);
    PR_FREE(entries);
    return st;
}

#endif /* PREFIXREUSE_IMPLEMENTATION */
