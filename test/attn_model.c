/* attn_model.c — the tile-level model of the tensor-core attention; attn_model.h is its manual.
   Reading order: number formats; the tile walk (tiles, masks, GQA); tile loads and the score
   tile; the forward block; the backward step shared by dQ and dK/dV; the dQ block; the dK/dV block;
   the chunked prefix reduction; the entry points. Every loop is sequential: each sum has one
   order, so the model's bits depend on the shape and the options only. */
#include "attn_model.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Plain IEEE operations, one rounding each: no contraction of a*b+c into an fma (gcc does not
   contract in ISO C mode, -std=c11; clang needs to be told). */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

#define AM_LOG2E 1.44269504088896340736f
#define AM_LN2 0.69314718055994530942f

/* ---------------------------------------------------------------- number formats */
float am_bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x00400000u;   /* NaN: keep it quiet, so truncation cannot make it inf */
    else u += 0x7fffu + ((u >> 16) & 1);                       /* ties to even; a carry into the exponent gives inf */
    u &= 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}

/* An mma operand the kernel computes itself (P or dS): rounded to bf16, the format the tensor
   core takes. The one place the fault AM_FAULT_P_DS_FP32 (keep fp32) can act. */
static float am__operand(float x, am_fault fault) { return fault == AM_FAULT_P_DS_FP32 ? x : am_bf16_round(x); }

/* a . b over one head, fp32, left to right (the order inside an mma is not modelled) */
static float am__dot(const float *a, const float *b, int HS) {
    float s = 0.0f;
    for (int d = 0; d < HS; d++) s += a[d] * b[d];
    return s;
}

/* ---------------------------------------------------------------- options */
static am_opts am__resolve(const am_opts *opts) {
    am_opts o = { 0 };
    if (opts) o = *opts;
    if (o.br <= 0) o.br = 64;
    if (o.bc <= 0) o.bc = 64;
    if (o.br_b <= 0) o.br_b = 64;
    if (o.bc_b <= 0) o.bc_b = 64;
    if (o.prefix_blocks <= 0) o.prefix_blocks = 256;
    return o;
}

/* ---------------------------------------------------------------- the tile walk */
/* A key tile: keys [j0, j0 + cols) of region 0 (prefix rows of kp, vp) or region 1 (rows of k, v
   in one segment). Keys at or past end (the prefix's end, or the segment's end) are not there:
   they are zero-filled in the tile and masked. */
typedef struct { int region, j0, end; } am__ktile;

int am_query_tiles(am_qtile *out, const am_layout *lay, int rows) {
    int n = 0;
    for (int s = 0; s < lay->n_seg; s++)
        for (int r0 = lay->seg_off[s]; r0 < lay->seg_off[s + 1]; r0 += rows) {
            if (out) {
                am_qtile t = { r0, r0 + rows < lay->seg_off[s + 1] ? r0 + rows : lay->seg_off[s + 1],
                               lay->seg_off[s], lay->seg_off[s + 1] };
                out[n] = t;
            }
            n++;
        }
    return n;
}

/* The prefix key tiles: ceil(n_prefix / cols), the last one partial (its tail masked). */
static int am__prefix_tiles(int n_prefix, int cols, am_fault fault) {
    if (fault == AM_FAULT_DROP_PREFIX_TAIL) return n_prefix / cols;
    return (n_prefix + cols - 1) / cols;
}

/* Does key j of tile kt reach query row r? The one mask of the model. */
static int am__visible(const am__ktile *kt, int j, int r, am_fault fault) {
    if (j >= kt->end) return 0;                                /* the prefix's tail, or past the segment's end */
    if (kt->region == 0) return 1;                             /* every row sees every prefix key */
    int last = r;                                              /* causal inside the own segment */
    if (fault == AM_FAULT_CAUSAL_PLUS_ONE) last = r + 1;
    if (fault == AM_FAULT_CAUSAL_MINUS_ONE) last = r - 1;
    return j <= last;
}

/* Does some row of query tile qt see some key of tile kt? Prefix tiles: always. Own tiles (of
   qt's segment, by construction): iff the tile's first key is at or before qt's last row, which
   that row then sees; tiles starting later lie wholly above the diagonal and are skipped. */
static int am__tile_seen(const am_qtile *qt, const am__ktile *kt) {
    return kt->region == 0 || kt->j0 <= qt->r1 - 1;
}

/* The key tiles query tile qt walks, in order: the prefix's, then its segment's that it sees.
   out holds prefix tiles + ceil(segment length / cols). Returns the count. */
static int am__key_walk(am__ktile *out, const am_qtile *qt, int n_prefix, int cols, am_fault fault) {
    int n = 0;
    for (int t = 0; t < am__prefix_tiles(n_prefix, cols, fault); t++) {
        am__ktile kt = { 0, t * cols, n_prefix };
        out[n++] = kt;
    }
    for (int j0 = qt->seg0; j0 < qt->seg1; j0 += cols) {
        am__ktile kt = { 1, j0, qt->seg1 };
        if (am__tile_seen(qt, &kt)) out[n++] = kt;
    }
    return n;
}

/* GQA, both directions: the KV head of query head h, and the g-th query head of KV head kh. */
static int am__kv_head(int h, int NH, int NKV, am_fault fault) {
    return fault == AM_FAULT_KV_HEAD_MOD ? h % NKV : h / (NH / NKV);
}
static int am__group_head(int kh, int g, int NH, int NKV, am_fault fault) {
    return fault == AM_FAULT_KV_HEAD_MOD ? g * NKV + kh : kh * (NH / NKV) + g;
}

/* ---------------------------------------------------------------- tiles in "shared memory" */
/* The inputs and constants of one call. */
typedef struct {
    const float *q, *k, *v, *kp, *vp;   /* (N, NH*HS), (N, NKV*HS) x2, (n_prefix, NKV*HS) x2 */
    const float *dout, *lse, *D;        /* backward only: (N, NH*HS), (N, NH), (N, NH) */
    int n_prefix, NH, NKV, HS;
    float scale, scale_log2;            /* 1/sqrt(HS), and times log2(e): fp32, as the kernel has them */
    am_opts o;
} am__ctx;

/* One block's working set: the tiles a kernel keeps in shared memory and registers.
   R = max query tile rows, C = max key tile columns. */
typedef struct {
    float *Q, *dO, *acc;    /* (R, HS): query-side tiles; acc is O's or dQ's fp32 accumulator */
    float *K, *V, *dK, *dV; /* (C, HS): key-side tiles and dK/dV's fp32 accumulators */
    float *S, *dS;          /* (R, C): scores, then P; dS */
    float *m, *l, *lse2, *D;/* (R): running max and sum; lse*log2e and D of the tile's rows */
    am__ktile *walk;        /* a query tile's key walk */
    void *mem;
} am__scratch;

static int am__scratch_alloc(am__scratch *w, int R, int C, int HS, int max_walk) {
    size_t rh = (size_t)R * HS, ch = (size_t)C * HS, rc = (size_t)R * C;
    size_t nf = 3 * rh + 4 * ch + 2 * rc + 4 * (size_t)R;
    w->mem = malloc(sizeof(float) * nf + sizeof(am__ktile) * (size_t)max_walk);
    if (!w->mem) return -1;
    float *p = (float *)w->mem;
    w->Q = p; p += rh; w->dO = p; p += rh; w->acc = p; p += rh;
    w->K = p; p += ch; w->V = p; p += ch; w->dK = p; p += ch; w->dV = p; p += ch;
    w->S = p; p += rc; w->dS = p; p += rc;
    w->m = p; p += R; w->l = p; p += R; w->lse2 = p; p += R; w->D = p; p += R;
    w->walk = (am__ktile *)(void *)p;
    return 0;
}

/* Rows [row0, row0 + n) of one head (columns [col, col + HS) of a matrix with ld columns) into
   a (rows, HS) tile as bf16 values, rows n.. zero-filled (what cp.async's zero-fill leaves). */
static void am__load(float *tile, const float *src, int row0, int n, int rows, int ld, int col, int HS) {
    for (int i = 0; i < rows; i++)
        for (int d = 0; d < HS; d++)
            tile[(size_t)i * HS + d] = i < n ? am_bf16_round(src[(size_t)(row0 + i) * ld + col + d]) : 0.0f;
}

/* K and V tiles (cols, HS) of key tile kt, KV head kh: kp/vp rows for region 0, k/v rows for 1. */
static void am__load_keys(am__scratch *w, const am__ctx *c, const am__ktile *kt, int kh, int cols) {
    const int kvd = c->NKV * c->HS, n = kt->end - kt->j0 < cols ? kt->end - kt->j0 : cols;
    am__load(w->K, kt->region == 0 ? c->kp : c->k, kt->j0, n, cols, kvd, kh * c->HS, c->HS);
    am__load(w->V, kt->region == 0 ? c->vp : c->v, kt->j0, n, cols, kvd, kh * c->HS, c->HS);
}

/* S (rows of qt, cols) = Q K^T in fp32, unscaled (the scale enters each exponent by one fma);
   masked entries -inf. */
static void am__scores(float *S, const float *Q, const float *K, const am_qtile *qt, const am__ktile *kt, int cols,
                       const am__ctx *c) {
    for (int i = 0; i < qt->r1 - qt->r0; i++)
        for (int jj = 0; jj < cols; jj++)
            S[(size_t)i * cols + jj] = am__visible(kt, kt->j0 + jj, qt->r0 + i, c->o.fault)
                                           ? am__dot(Q + (size_t)i * c->HS, K + (size_t)jj * c->HS, c->HS)
                                           : -INFINITY;
}

/* ---------------------------------------------------------------- forward */
/* One block: query tile qt, query head h. Online softmax over its key walk (attn_model.h). */
static void am__fwd_block(float *out, float *lse, const am__ctx *c, const am_qtile *qt, int h, am__scratch *w) {
    const int nr = qt->r1 - qt->r0, cols = c->o.bc, HS = c->HS, qd = c->NH * HS;
    const int kh = am__kv_head(h, c->NH, c->NKV, c->o.fault);
    /* Q tile (nr, HS), loaded once for the whole walk; m = -inf, l = 0, acc = 0 */
    am__load(w->Q, c->q, qt->r0, nr, nr, qd, h * HS, HS);
    for (int i = 0; i < nr; i++) w->m[i] = -INFINITY, w->l[i] = 0.0f;
    memset(w->acc, 0, sizeof(float) * (size_t)nr * HS);
    const int nkt = am__key_walk(w->walk, qt, c->n_prefix, cols, c->o.fault);
    for (int t = 0; t < nkt; t++) {
        am__load_keys(w, c, &w->walk[t], kh, cols);
        am__scores(w->S, w->Q, w->K, qt, &w->walk[t], cols, c);
        for (int i = 0; i < nr; i++) {
            float *s = w->S + (size_t)i * cols, *a = w->acc + (size_t)i * HS;
            /* m_new = max(m, rowmax S), unscaled (scaling by c > 0 keeps the order); still -inf
               while nothing is visible to the row */
            float m_new = w->m[i];
            for (int jj = 0; jj < cols; jj++) m_new = fmaxf(m_new, s[jj]);
            /* FA2's rule: subtract 0 instead of a max of -inf, so exp2f sees -inf - 0 = -inf (0), not NaN */
            const float base = m_new == -INFINITY ? 0.0f : m_new * c->scale_log2;
            /* correction of what was accumulated under the old max (the product a statement of its
               own, so that no compiler fuses it with the subtraction: corr is exactly 1 where the
               max stays), then P = exp2f(S c - m_new c) in place, the scale inside one fma */
            const float m_old = w->m[i] * c->scale_log2;
            const float corr = exp2f(m_old - base);
            float rowsum = 0.0f;
            for (int jj = 0; jj < cols; jj++) {
                s[jj] = exp2f(fmaf(s[jj], c->scale_log2, -base));
                rowsum += s[jj];
            }
            /* l sums P in fp32; acc takes bf16(P) V, the mma's operands, in fp32 */
            w->l[i] = corr * w->l[i] + rowsum;
            for (int d = 0; d < HS; d++) a[d] *= corr;
            for (int jj = 0; jj < cols; jj++) {
                const float p = am__operand(s[jj], c->o.fault);
                const float *vj = w->V + (size_t)jj * HS;
                for (int d = 0; d < HS; d++) a[d] += p * vj[d];
            }
            w->m[i] = m_new;
        }
    }
    /* epilogue: out = bf16(acc / l) through one reciprocal; lse in natural log, fp32 */
    for (int i = 0; i < nr; i++) {
        const int r = qt->r0 + i;
        float *o = out + (size_t)r * qd + (size_t)h * HS;
        const float l = w->l[i], inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int d = 0; d < HS; d++) o[d] = am_bf16_round(w->acc[(size_t)i * HS + d] * inv);
        lse[(size_t)r * c->NH + h] = l > 0.0f ? (w->m[i] * c->scale_log2 + log2f(l)) * AM_LN2 : INFINITY;
    }
}

/* ---------------------------------------------------------------- backward */
/* D (N, NH) = dO . O per row and head, fp32 sums of products of bf16 values, one warp per row. */
void am_attention_rowdot(float *D, const float *dout, const float *out, int N, int NH, int HS) {
    for (size_t rh = 0; rh < (size_t)N * NH; rh++) {
        float s = 0.0f;
        for (int d = 0; d < HS; d++) s += am_bf16_round(dout[rh * HS + d]) * am_bf16_round(out[rh * HS + d]);
        D[rh] = s;
    }
}

/* The query side of a backward tile: Q, dO (rows of qt, HS) of head h, lse*log2e and D per row. */
static void am__load_queries(am__scratch *w, const am__ctx *c, const am_qtile *qt, int h) {
    const int nr = qt->r1 - qt->r0, qd = c->NH * c->HS;
    am__load(w->Q, c->q, qt->r0, nr, nr, qd, h * c->HS, c->HS);
    am__load(w->dO, c->dout, qt->r0, nr, nr, qd, h * c->HS, c->HS);
    for (int i = 0; i < nr; i++) {
        w->lse2[i] = c->lse[(size_t)(qt->r0 + i) * c->NH + h] * AM_LOG2E;
        w->D[i] = c->D[(size_t)(qt->r0 + i) * c->NH + h];
    }
}

/* The step for one (query tile, key tile, head), shared by the dQ and the dK/dV blocks so that
   both use the same bits of P and dS. Quoting the forward (p = exp(s - lse), o = sum_j p_j v_j):
     S  = Q K^T                          (rows, cols) fp32, masked -inf
     P  = exp2f(fmaf(S, scale*log2e, -lse*log2e))   fp32, 0 where masked
     dP = dO V^T                         fp32
     dS = P * (dP - D)                   fp32          (w->S holds P, w->dS holds dS) */
static void am__bwd_step(am__scratch *w, const am__ctx *c, const am_qtile *qt, const am__ktile *kt, int cols) {
    am__scores(w->S, w->Q, w->K, qt, kt, cols, c);
    for (int i = 0; i < qt->r1 - qt->r0; i++)
        for (int jj = 0; jj < cols; jj++) {
            const size_t e = (size_t)i * cols + jj;
            const float p = exp2f(fmaf(w->S[e], c->scale_log2, -w->lse2[i]));
            const float dp = am__dot(w->dO + (size_t)i * c->HS, w->V + (size_t)jj * c->HS, c->HS);
            w->S[e] = p;
            w->dS[e] = p * (dp - w->D[i]);
        }
}

/* One dQ block: query tile qt, head h, the key tiles in the forward's order.
     dQ += bf16(dS) K (fp32);   dq = bf16(dq + scale dQ). */
static void am__dq_block(float *dq, const am__ctx *c, const am_qtile *qt, int h, am__scratch *w) {
    const int nr = qt->r1 - qt->r0, cols = c->o.bc_b, HS = c->HS, qd = c->NH * HS;
    const int kh = am__kv_head(h, c->NH, c->NKV, c->o.fault);
    am__load_queries(w, c, qt, h);
    memset(w->acc, 0, sizeof(float) * (size_t)nr * HS);
    const int nkt = am__key_walk(w->walk, qt, c->n_prefix, cols, c->o.fault);
    for (int t = 0; t < nkt; t++) {
        am__load_keys(w, c, &w->walk[t], kh, cols);
        am__bwd_step(w, c, qt, &w->walk[t], cols);
        for (int i = 0; i < nr; i++)
            for (int jj = 0; jj < cols; jj++) {
                const float ds = am__operand(w->dS[(size_t)i * cols + jj], c->o.fault);
                const float *kj = w->K + (size_t)jj * HS;
                float *a = w->acc + (size_t)i * HS;
                for (int d = 0; d < HS; d++) a[d] += ds * kj[d];
            }
    }
    /* epilogue: the one rounding of dq */
    for (int i = 0; i < nr; i++) {
        float *g = dq + (size_t)(qt->r0 + i) * qd + (size_t)h * HS;
        for (int d = 0; d < HS; d++) g[d] = am_bf16_round(g[d] + c->scale * w->acc[(size_t)i * HS + d]);
    }
}

/* One dK/dV block: key tile kt of KV head kh, K and V loaded once for the whole GQA group; for each
   query head of the group in order, for each of the query tiles qts[0, nq) that sees kt, in order:
     dV += bf16(P)^T dO;   dK += bf16(dS)^T Q          (fp32)
   Leaves scale*dK and dV (cols, HS) in w->dK, w->dV for the caller to write. */
static void am__dkv_block(const am__ctx *c, const am__ktile *kt, int kh, const am_qtile *qts, int nq, am__scratch *w) {
    const int cols = c->o.bc_b, HS = c->HS, group = c->NH / c->NKV;
    am__load_keys(w, c, kt, kh, cols);
    memset(w->dK, 0, sizeof(float) * (size_t)cols * HS);
    memset(w->dV, 0, sizeof(float) * (size_t)cols * HS);
    for (int g = 0; g < group; g++) {
        const int h = am__group_head(kh, g, c->NH, c->NKV, c->o.fault);
        for (int t = 0; t < nq; t++) {
            const am_qtile *qt = &qts[t];
            if (!am__tile_seen(qt, kt)) continue;
            am__load_queries(w, c, qt, h);
            am__bwd_step(w, c, qt, kt, cols);
            for (int i = 0; i < qt->r1 - qt->r0; i++)
                for (int jj = 0; jj < cols; jj++) {
                    const float p = am__operand(w->S[(size_t)i * cols + jj], c->o.fault);
                    const float ds = am__operand(w->dS[(size_t)i * cols + jj], c->o.fault);
                    const float *qi = w->Q + (size_t)i * HS, *doi = w->dO + (size_t)i * HS;
                    float *gk = w->dK + (size_t)jj * HS, *gv = w->dV + (size_t)jj * HS;
                    for (int d = 0; d < HS; d++) {
                        gv[d] += p * doi[d];
                        gk[d] += ds * qi[d];
                    }
                }
        }
    }
    for (int e = 0; e < cols * HS; e++) w->dK[e] *= c->scale;
}

/* The rows of a dK/dV block's tile into dst (rows, NKV*HS) at KV head kh: own tiles add into the
   bf16 dk/dv and round once (add_bf16); prefix tiles store their fp32 partial (overwrite). */
static void am__store_tile(float *dst, const float *acc, const am__ktile *kt, int cols, int kh, const am__ctx *c,
                           int add_bf16) {
    const int kvd = c->NKV * c->HS, n = kt->end - kt->j0 < cols ? kt->end - kt->j0 : cols;
    for (int jj = 0; jj < n; jj++) {
        float *o = dst + (size_t)(kt->j0 + jj) * kvd + (size_t)kh * c->HS;
        const float *a = acc + (size_t)jj * c->HS;
        for (int d = 0; d < c->HS; d++) o[d] = add_bf16 ? am_bf16_round(o[d] + a[d]) : a[d];
    }
}

/* The chunk rule (attn_model.h): C = ceil(prefix_blocks / (prefix key tiles * NKV)) in
   [1, query tiles]. From the shape only. */
int am_prefix_chunks(const am_layout *lay, int NKV, const am_opts *opts) {
    const am_opts o = am__resolve(opts);
    const int kt = am__prefix_tiles(lay->n_prefix, o.bc_b, AM_FAULT_NONE), nq = am_query_tiles(NULL, lay, o.br_b);
    if (kt == 0 || NKV <= 0) return 0;
    int C = (o.prefix_blocks + kt * NKV - 1) / (kt * NKV);
    if (C > nq) C = nq;
    return C < 1 ? 1 : C;
}

/* dst (n) += sum of the C partials part[c] (C, n), summed in chunk order, one fixed order. */
static void am__reduce_chunks(float *dst, const float *part, int C, size_t n, am_fault fault) {
    const int used = fault == AM_FAULT_SKIP_LAST_CHUNK && C > 1 ? C - 1 : C;
    for (size_t e = 0; e < n; e++) {
        float s = part[e];
        for (int ch = 1; ch < used; ch++) s += part[(size_t)ch * n + e];
        dst[e] += s;
    }
}

/* ---------------------------------------------------------------- entry points */
static int am__check(const am_layout *lay, int NH, int NKV, int HS, const void *kp, const void *vp) {
    if (!lay || lay->n_seg < 0 || (lay->n_seg > 0 && !lay->seg_off) || lay->n_prefix < 0) return -1;
    if (NH <= 0 || NKV <= 0 || NH % NKV || HS <= 0) return -1;
    if (lay->n_prefix > 0 && (!kp || !vp)) return -1;
    for (int s = 0; s < lay->n_seg; s++)
        if (lay->seg_off[s] < 0 || lay->seg_off[s + 1] < lay->seg_off[s]) return -1;
    return 0;
}

static am__ctx am__context(const am_layout *lay, int NH, int NKV, int HS, const am_opts *opts) {
    am__ctx c;
    memset(&c, 0, sizeof c);
    c.n_prefix = lay->n_prefix;
    c.NH = NH, c.NKV = NKV, c.HS = HS;
    c.scale = 1.0f / sqrtf((float)HS);
    c.scale_log2 = c.scale * AM_LOG2E;
    c.o = am__resolve(opts);
    return c;
}

/* The longest key walk of a layout at cols columns (scratch size). */
static int am__max_walk(const am_layout *lay, int cols) {
    int longest = 0;
    for (int s = 0; s < lay->n_seg; s++)
        if (lay->seg_off[s + 1] - lay->seg_off[s] > longest) longest = lay->seg_off[s + 1] - lay->seg_off[s];
    return am__prefix_tiles(lay->n_prefix, cols, AM_FAULT_NONE) + (longest + cols - 1) / cols + 1;
}

int am_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v, const float *kp,
                     const float *vp, const am_layout *lay, int NH, int NKV, int HS, const am_opts *opts) {
    if (am__check(lay, NH, NKV, HS, kp, vp)) return -1;
    am__ctx c = am__context(lay, NH, NKV, HS, opts);
    c.q = q, c.k = k, c.v = v, c.kp = kp, c.vp = vp;
    const int nq = am_query_tiles(NULL, lay, c.o.br);
    am_qtile *tiles = malloc(sizeof(am_qtile) * (size_t)(nq ? nq : 1));
    am__scratch w;
    if (!tiles || am__scratch_alloc(&w, c.o.br, c.o.bc, HS, am__max_walk(lay, c.o.bc))) {
        free(tiles);
        return -1;
    }
    am_query_tiles(tiles, lay, c.o.br);
    /* the grid (query tiles, NH): blocks are independent, any order gives the same bits */
    for (int t = 0; t < nq; t++)
        for (int h = 0; h < NH; h++) am__fwd_block(out, lse, &c, &tiles[t], h, &w);
    free(w.mem);
    free(tiles);
    return 0;
}

int am_attention_bwd(float *dq, float *dk, float *dv, float *dkp, float *dvp, const float *dout, const float *out,
                     const float *lse, const float *q, const float *k, const float *v, const float *kp,
                     const float *vp, const am_layout *lay, int NH, int NKV, int HS, const am_opts *opts) {
    if (am__check(lay, NH, NKV, HS, kp, vp) || (lay->n_prefix > 0 && (!dkp || !dvp))) return -1;
    am__ctx c = am__context(lay, NH, NKV, HS, opts);
    c.q = q, c.k = k, c.v = v, c.kp = kp, c.vp = vp, c.dout = dout, c.lse = lse;
    const int N = lay->n_seg ? lay->seg_off[lay->n_seg] : 0, np = lay->n_prefix, kvd = NKV * HS;
    const int nq = am_query_tiles(NULL, lay, c.o.br_b), C = am_prefix_chunks(lay, NKV, &c.o);
    const size_t nprefix = (size_t)np * kvd;
    /* every buffer first, so that a failure leaves the outputs untouched */
    am_qtile *tiles = malloc(sizeof(am_qtile) * (size_t)(nq ? nq : 1));
    float *D = malloc(sizeof(float) * ((size_t)N * NH + 1));
    /* the partial buffers (C, n_prefix, NKV*HS): every block overwrites its rows; zeroed only so
       that a planted fault that skips a block reads zeros, not garbage */
    float *part_k = calloc((size_t)C * nprefix + 1, sizeof(float)), *part_v = calloc((size_t)C * nprefix + 1, sizeof(float));
    am__scratch w = { 0 };
    int rc = -1;
    if (!tiles || !D || !part_k || !part_v || am__scratch_alloc(&w, c.o.br_b, c.o.bc_b, HS, am__max_walk(lay, c.o.bc_b)))
        goto done;
    am_query_tiles(tiles, lay, c.o.br_b);
    c.D = D;

    /* pass 1: D = rowdot(dO, O) */
    am_attention_rowdot(D, dout, out, N, NH, HS);

    /* pass 2: dQ, grid (query tiles, NH) */
    for (int t = 0; t < nq; t++)
        for (int h = 0; h < NH; h++) am__dq_block(dq, &c, &tiles[t], h, &w);

    /* pass 3a: dK/dV of the own key tiles, grid (own key tiles, NKV); a segment's query tiles are
       tiles[a, b), and the block keeps those that see its key tile */
    for (int a = 0, b; a < nq; a = b) {
        for (b = a; b < nq && tiles[b].seg0 == tiles[a].seg0; b++) {}
        for (int j0 = tiles[a].seg0; j0 < tiles[a].seg1; j0 += c.o.bc_b)
            for (int kh = 0; kh < NKV; kh++) {
                am__ktile kt = { 1, j0, tiles[a].seg1 };
                am__dkv_block(&c, &kt, kh, tiles + a, b - a, &w);
                am__store_tile(dk, w.dK, &kt, c.o.bc_b, kh, &c, 1);
                am__store_tile(dv, w.dV, &kt, c.o.bc_b, kh, &c, 1);
            }
    }

    /* pass 3b: dK/dV of the prefix key tiles, grid (prefix key tiles, NKV, C): chunk ch takes the
       query tiles [ch*nq/C, (ch+1)*nq/C) and writes its fp32 partial */
    for (int t = 0; t < am__prefix_tiles(np, c.o.bc_b, c.o.fault); t++)
        for (int kh = 0; kh < NKV; kh++)
            for (int ch = 0; ch < C; ch++) {
                const int lo = (int)((long long)ch * nq / C), hi = (int)((long long)(ch + 1) * nq / C);
                am__ktile kt = { 0, t * c.o.bc_b, np };
                am__dkv_block(&c, &kt, kh, tiles + lo, hi - lo, &w);
                am__store_tile(part_k + (size_t)ch * nprefix, w.dK, &kt, c.o.bc_b, kh, &c, 0);
                am__store_tile(part_v + (size_t)ch * nprefix, w.dV, &kt, c.o.bc_b, kh, &c, 0);
            }

    /* pass 4: dkp, dvp += the partials summed in chunk order */
    if (np > 0) {
        am__reduce_chunks(dkp, part_k, C, nprefix, c.o.fault);
        am__reduce_chunks(dvp, part_v, C, nprefix, c.o.fault);
    }
    rc = 0;
done:
    free(w.mem);
    free(tiles);
    free(D);
    free(part_k);
    free(part_v);
    return rc;
}
