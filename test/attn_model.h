/* attn_model — a tile-level model, in C, of the tensor-core attention kernels (FlashAttention-2
   route: bf16 mma.sync.m16n8k16, ldmatrix, cp.async, sm_80+). It runs the exact blocked algorithm
   the kernels will run, one CUDA block at a time, with the GPU's number formats emulated, so that
   the algorithm can be specified and tested without a GPU, and the real kernels compared with it.

   THE ATTENTION (the library's two-region attention, prefixreuse.h pr_seq_layout)
     Rows [seg_off[s], seg_off[s+1]) form segment s. A query row r of segment s sees region 0, all
     n_prefix shared prefix keys (kp, vp), then region 1, the keys of its own segment up to and
     including itself (k, v: key j visible iff j <= r), never another segment. GQA: query head h
     reads KV head h / (NH/NKV). scale = 1/sqrt(HS). lse is the natural-log log-sum-exp of a row.
       q, dout, out, dq  (N, NH*HS)     k, v, dk, dv  (N, NKV*HS)     lse  (N, NH)
       kp, vp, dkp, dvp  (n_prefix, NKV*HS)

   NUMBER FORMATS
     Every tensor the kernels read is bf16: q, k, v, kp, vp, out, dout are floats holding bf16
     values (am_bf16_round(x) == x); tiles are rounded to bf16 as they are loaded, which is the
     identity for such inputs. Every sum is fp32 (float). The two mma operands that are not inputs,
     P (for P V and P^T dO) and dS (for dS K and dS^T Q), are rounded to bf16 first, as an mma needs.
     Softmax in the log2 domain with exp2f, as FA2 does: t = (q . k) * scale*log2(e).
     Outputs: out bf16; lse fp32; dq, dk, dv bf16, added into once (read bf16, add the fp32 sum,
     round once); dkp, dvp fp32 accumulators (gK/gV) the kernel adds its fp32 sum into, as their
     single writer (no atomics).

   TILES (am_opts; zero fields take the defaults in brackets)
     Query tiles: BR-row pieces of one segment [64 = 4 warps x 16 rows]; key tiles: BC keys [64].
     The backward's own pair: BR_B query rows [64], BC_B keys [64]. Own key tiles are BC pieces of
     a segment aligned at its first row; prefix key tiles BC pieces of [0, n_prefix).

   FORWARD: one block per (query tile, query head). It walks the key tiles of region 0 (the prefix
   in BC pieces, the tail tile's columns past n_prefix masked), then of region 1 (own segment tiles
   from the segment's first row; causal mask inside the diagonal tiles, columns past the segment's
   end masked). Own key tiles that start after the query tile's last row are seen by no row of the
   tile and are skipped (the only skipped tiles: every row sees every prefix tile, and every own
   tile starting at or before the last row is seen at least by that row). Per row, online softmax:
     S = Q K^T (fp32, unscaled; masked -> -inf);  m_new = max(m, rowmax S);  with s2 = scale*log2e:
     c = exp2f(m s2 - m_new s2);  P = exp2f(fmaf(S, s2, -m_new s2)) (fp32);  l = c*l + rowsum(P);
     acc = c*acc + bf16(P) V (fp32);  m = m_new.
   (The max of S is the max of S s2, s2 > 0 keeping the order through the rounding; the scale goes
   into the exponent's one fma, as in FA2, and c is exactly 1 where the max stays.)
   A row whose keys are all masked so far has m = -inf: the exponents subtract 0 instead of m_new s2
   (FA2's rule), so P = 0 and c = 0, never NaN. Epilogue: out = bf16(acc * (1/l)),
   lse = (m s2 + log2f(l)) * ln 2 (fp32); a row that saw no key gets out 0, lse +inf (P = 0 backward).

   BACKWARD: three passes.
     1. rowdot: D[r,h] = sum_d dO[r,d] O[r,d] (fp32 from bf16).
     2. dQ: one block per (query tile, head), walking the key tiles in the forward's order. Per tile
        (the step shared with pass 3, so both see the same bits of P and dS):
          S = Q K^T;  P = exp2f(fmaf(S, scale*log2e, -lse*log2e)) (0 where masked);  dP = dO V^T;
          dS = P * (dP - D)                                               (all fp32)
        dQ += bf16(dS) K (fp32); epilogue dq = bf16(dq + scale * dQ).
     3. dK/dV: one block per (key tile, KV head [, prefix chunk]) holding K, V once for the whole
        GQA group: for each query head of the group in order, for each query tile that sees the key
        tile in ascending order: the step above, then dV += bf16(P)^T dO, dK += bf16(dS)^T Q (fp32).
        Own key tiles (the rest of their segment's rows see them): dk = bf16(dk + scale * dK),
        dv = bf16(dv + dV).
        Prefix key tiles are seen by every query row of the microbatch (sum over segments can be
        64k rows while the prefix has a few tiles), so their work is split into C query chunks:
        the list of all query tiles (segment order, then row order) cut into C contiguous runs
        [c*nqt/C, (c+1)*nqt/C). Block (tile, head, c) writes scale*dK, dV in fp32 to partial
        buffer c; a reduction sums the C partials in chunk order (p0 + p1 + ... left to right) and
        adds the sum into dkp, dvp.
        THE CHUNK RULE: C = ceil(prefix_blocks / (prefix key tiles * NKV)), clamped to
        [1, query tiles]; prefix_blocks = 256 by default (enough blocks to fill a GPU). C depends
        on the shape alone, never on the GPU or a run, so the summation order, and therefore every
        bit of dkp/dvp, is fixed by the shape: the gradients are bitwise reproducible. Another C
        gives other bits within the error envelope.

   NOT MODELLED (deliberately): the order of the products inside one mma (the model sums a tile
   product left to right, one fp32 rounding per product-add; the tensor core groups its k=16 sums
   differently), the fused multiply-adds the kernels may use, and the hardware's approximate
   exp2 (ex2.approx) and reciprocal. These move results by fp32 roundings, far below the bf16
   rounding of P and dS that sets the error envelope; compare kernels with the model by tolerance,
   not by bits. Query rows past a segment's end (zero-filled tile rows on the GPU) are not
   computed: the kernels never store them.

   FAULTS: am_opts.fault plants a known bug (or a legitimate variant) on the one code path, for the
   tests' negative controls. */
#ifndef ATTN_MODEL_H
#define ATTN_MODEL_H

typedef enum {
    AM_FAULT_NONE = 0,
    AM_FAULT_CAUSAL_PLUS_ONE,   /* own key j visible iff j <= r + 1: one future key leaks */
    AM_FAULT_CAUSAL_MINUS_ONE,  /* own key j visible iff j < r: a segment's first row sees nothing without a prefix */
    AM_FAULT_DROP_PREFIX_TAIL,  /* the prefix's partial last key tile is never walked */
    AM_FAULT_KV_HEAD_MOD,       /* query head h reads KV head h % NKV (interleaved, not grouped) */
    AM_FAULT_SKIP_LAST_CHUNK,   /* the reduction leaves out the last prefix chunk's partial */
    AM_FAULT_P_DS_FP32          /* not a bug: P and dS enter their mma unrounded (fp32); inside the tolerance */
} am_fault;

typedef struct {
    int br, bc;          /* forward: query tile rows, key tile columns [64, 64] */
    int br_b, bc_b;      /* backward: query tile rows, key tile columns [64, 64] */
    int prefix_blocks;   /* the chunk rule's target of prefix dK/dV blocks [256] */
    am_fault fault;
} am_opts;

typedef struct {
    int n_seg;
    const int *seg_off;  /* (n_seg+1) */
    int n_prefix;        /* 0: no prefix (kp, vp, dkp, dvp may be NULL) */
} am_layout;

/* A query tile: rows [r0, r1) of the segment [seg0, seg1). */
typedef struct { int r0, r1, seg0, seg1; } am_qtile;

/* x rounded to the nearest bf16 value, ties to even (NaN stays NaN, overflow gives inf). */
float am_bf16_round(float x);

/* The query tiles of a layout, rows-row pieces of each segment in order; returns their count.
   out may be NULL (count only). */
int am_query_tiles(am_qtile *out, const am_layout *lay, int rows);

/* The number of query chunks C of each prefix key tile's dK/dV work (0 without a prefix). */
int am_prefix_chunks(const am_layout *lay, int NKV, const am_opts *opts);

/* Forward: out (N, NH*HS) bf16 values, lse (N, NH) fp32. opts may be NULL (defaults).
   Returns 0, or -1 on bad arguments or out of memory. */
int am_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v, const float *kp,
                     const float *vp, const am_layout *lay, int NH, int NKV, int HS, const am_opts *opts);

/* The backward's first pass: D (N, NH) = rowwise dout . out in fp32. */
void am_attention_rowdot(float *D, const float *dout, const float *out, int N, int NH, int HS);

/* Backward: ADDS into dq, dk, dv (bf16 values, rounded once) and dkp, dvp (fp32). out and lse are
   the forward's. Returns 0, or -1 on bad arguments or out of memory (outputs untouched). */
int am_attention_bwd(float *dq, float *dk, float *dv, float *dkp, float *dvp, const float *dout, const float *out,
                     const float *lse, const float *q, const float *k, const float *v, const float *kp,
                     const float *vp, const am_layout *lay, int NH, int NKV, int HS, const am_opts *opts);

#endif
