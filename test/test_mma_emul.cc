/* The tensor-core attention's warp-level rules (prefixreuse_cuda.cu, WARP-LEVEL PIECES) run on the
   host through an emulation of the instructions, so that a wrong fragment, lane or swizzle order is
   caught without a GPU.

   The emulated machine (test/mma_emu.h) is written from the PTX ISA, not from the rules under test.

   Checked through the kernels' own rules (fragment maps, ldmatrix lane addresses, the swizzle, the
   tile copy, the P repacking, the quad reductions), for head dims 64 and 128, on a block's 64 x 64
   tile (four warps of 16 rows):
     S = Q K^T (A from shared memory, B without .trans, .x4 and .x2), O = bf16(P) V (P repacked from
     accumulators, B with .trans, .x4 and .x2) against a naive product; row max and row sum by quad
     reductions; every ldmatrix and every 16-byte copy free of bank conflicts; each map a bijection.
   The backward's products are the same forms (dP = dO V^T and S^T = K Q^T as Q K^T; dQ = dS K,
   dV = P^T dO, dK = dS^T Q as P V).
   The fused backward's dQ = bf16(dS) K, with dS^T stored from accumulators in packed pairs and read
   back as the A operand with .trans, against a naive product, stores and reads free of bank
   conflicts.
   Negative controls: each planted wrong rule (A registers 1 and 2 swapped, K loaded with .trans,
   V without, the C rows g and g+8 swapped, the repacked tiles swapped, the bf16 halves swapped, the
   swizzle left out of the reads, a quad mask crossing groups, the B lane rule of the other form,
   the A .trans operand read with the plain A lane rule or without .trans) must make the comparison fail; unswizzled tiles must show the conflicts.
   wgmma's descriptors (the wgmma forward's): each addresses what its tile copy stored, by
   test/wgmma_emu.h's reading of the PTX ISA (independent of the kernel's rules). */
#define PR_CUDA_HOST_EMULATION
#include "../prefixreuse_cuda.cu"
#include "harness.h"
#include "xorshift.h"
#include "wgmma_emu.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mma_emu.h"

/* ================================================================ the kernels' side */
enum fault {
    F_NONE,
    F_A_SWAP12,      /* A registers 1 and 2 exchanged (the a2,a3 / a4,a5 blocks) */
    F_K_TRANS,       /* K loaded with .trans */
    F_V_NO_TRANS,    /* V loaded without .trans */
    F_C_ROWS,        /* accumulator rows g and g+8 exchanged */
    F_REPACK_SWAP,   /* the two n8 tiles of a k16 block repacked in the wrong order */
    F_PACK_HALVES,   /* bf16 halves of a register exchanged */
    F_NO_SWIZZLE,    /* tiles stored swizzled, read without the swizzle */
    F_QUAD_MASK,     /* second quad step with mask 4: leaves the group */
    F_B_RULE,        /* the .trans lane rule used for a B operand loaded without .trans */
    F_COUNT
};
static const char *fault_name[F_COUNT] = { "none", "A registers 1/2 swapped", "K with .trans", "V without .trans",
                                           "C rows g/g+8 swapped", "repacked tiles swapped", "bf16 halves swapped",
                                           "reads unswizzled", "quad mask leaves the group", "B lane rule of .trans" };

static uint64_t rng = 0x243F6A8885A308D3ull;

/* A rows x W tile of bf16 values in shared memory, written by the kernels' copy (pr_chunk_*,
   pr_swz) by 128 threads in 16-byte chunks; the copy is checked for bank conflicts and for
   writing every element exactly once. */
struct tile {
    int rows, W;
    std::vector<double> val;     /* (rows, W) */
    std::vector<uint16_t> smem;  /* swizzled */
};
static tile make_tile(int rows, int W) {
    tile t;
    t.rows = rows, t.W = W;
    t.val.resize((size_t)rows * W);
    t.smem.assign((size_t)rows * W, 0);
    std::vector<int> written((size_t)rows * W, 0);
    for (double &x : t.val) x = emu_round_bf16(test_uniform(&rng));
    const int chunks = rows * W / 8, threads = 128;
    for (int step = 0; step * threads < chunks; step++)
        for (int warp = 0; warp < threads / 32; warp++) {
            uint32_t addr[32];
            for (int lane = 0; lane < 32; lane++) {
                int e = step * threads + warp * 32 + lane, r = pr_chunk_row(e, W), c = pr_chunk_col(e, W);
                int off = pr_swz(r, c, W);
                addr[lane] = 2u * (uint32_t)off;
                for (int j = 0; j < 8; j++) {
                    t.smem[(size_t)off + j] = emu_bf16_bits(t.val[(size_t)r * W + c + j]);
                    written[(size_t)off + j]++;
                }
            }
            for (int ph = 0; ph < 4; ph++) emu_phase(addr + 8 * ph);
        }
    int once = 1;
    for (int w : written) once &= w == 1;
    CHECK(once, "the tile copy writes every element of a %d x %d tile exactly once", rows, W);
    return t;
}
static uint32_t smem_addr(const tile &t, int row, int col, fault f) {
    return 2u * (uint32_t)(f == F_NO_SWIZZLE ? row * t.W + col : pr_swz(row, col, t.W));
}

typedef float acc_t[32][4];   /* one n8 accumulator tile of a warp */

/* S (16 x 64) of warp w = Q rows [16w, 16w+16) times K^T, as the forward's S = Q K^T (x2: one
   .x2 load per n8 tile instead of one .x4 per pair). */
static void warp_qk(acc_t S[8], const tile &Q, const tile &K, int w, fault f, bool x2) {
    memset(S, 0, sizeof(acc_t) * 8);
    for (int kc = 0; kc < Q.W / 16; kc++) {
        uint32_t a[32][4], addr[32];
        for (int l = 0; l < 32; l++) addr[l] = smem_addr(Q, 16 * w + pr_ldm_a_row(l), 16 * kc + pr_ldm_a_col(l), f);
        emu_ldmatrix(a, Q.smem.data(), Q.smem.size(), addr, 4, false);
        if (f == F_A_SWAP12)
            for (int l = 0; l < 32; l++) { uint32_t x = a[l][1]; a[l][1] = a[l][2]; a[l][2] = x; }
        for (int np = 0; np < 4; np++) {
            uint32_t b[32][4], b0[32][2], b1[32][2];
            for (int l = 0; l < 32; l++) {
                int r = f == F_B_RULE ? pr_ldm_bt_row(l) : pr_ldm_bn_row(l), c = f == F_B_RULE ? pr_ldm_bt_col(l) : pr_ldm_bn_col(l);
                addr[l] = smem_addr(K, 16 * np + r, 16 * kc + c, f);
            }
            if (x2) {
                uint32_t h[32][4];
                emu_ldmatrix(h, K.smem.data(), K.smem.size(), addr, 2, f == F_K_TRANS);       /* tile 2np: lanes 0-15 */
                for (int l = 0; l < 32; l++) b[l][0] = h[l][0], b[l][1] = h[l][1];
                for (int l = 0; l < 32; l++) {
                    int r = f == F_B_RULE ? pr_ldm_bt_row(l) : pr_ldm_bn_row(l), c = f == F_B_RULE ? pr_ldm_bt_col(l) : pr_ldm_bn_col(l);
                    addr[l] = smem_addr(K, 16 * np + 8 + r, 16 * kc + c, f);
                }
                emu_ldmatrix(h, K.smem.data(), K.smem.size(), addr, 2, f == F_K_TRANS);       /* tile 2np+1 */
                for (int l = 0; l < 32; l++) b[l][2] = h[l][0], b[l][3] = h[l][1];
            } else {
                emu_ldmatrix(b, K.smem.data(), K.smem.size(), addr, 4, f == F_K_TRANS);
            }
            for (int l = 0; l < 32; l++) b0[l][0] = b[l][0], b0[l][1] = b[l][1], b1[l][0] = b[l][2], b1[l][1] = b[l][3];
            emu_mma(S[2 * np], a, b0, S[2 * np]);
            emu_mma(S[2 * np + 1], a, b1, S[2 * np + 1]);
        }
    }
}

/* The row and column of accumulator element i of lane l, as the kernels place it. */
static int place_row(int l, int i, fault f) { return pr_mma_c_row(l, f == F_C_ROWS ? i ^ 2 : i); }
static int place_col(int l, int i) { return pr_mma_c_col(l, i); }

static double rel_err(const std::vector<double> &a, const std::vector<double> &b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); i++) {
        if (a[i] != a[i]) return INFINITY;
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return std::sqrt(num / (den > 0 ? den : 1));
}

/* S = Q K^T for a 64 x 64 tile; returns the relative error against the naive product. */
static double check_qk(int HS, fault f, bool x2, std::vector<double> *S_out) {
    tile Q = make_tile(64, HS), K = make_tile(64, HS);
    std::vector<double> S(64 * 64, NAN), ref(64 * 64);
    for (int i = 0; i < 64; i++)
        for (int j = 0; j < 64; j++) {
            double s = 0;
            for (int d = 0; d < HS; d++) s += Q.val[(size_t)i * HS + d] * K.val[(size_t)j * HS + d];
            ref[(size_t)i * 64 + j] = s;
        }
    for (int w = 0; w < 4; w++) {
        acc_t acc[8];
        warp_qk(acc, Q, K, w, f, x2);
        for (int nt = 0; nt < 8; nt++)
            for (int l = 0; l < 32; l++)
                for (int i = 0; i < 4; i++) S[(size_t)(16 * w + place_row(l, i, f)) * 64 + 8 * nt + place_col(l, i)] = acc[nt][l][i];
    }
    if (S_out) *S_out = ref;
    return rel_err(S, ref);
}

/* O = bf16(P) V for a 64-row P (fp32 values in the accumulator layout the ISA gives a warp's
   n8 tiles) and a 64 x HS V tile: the forward's P V and the backward's dS K, P^T dO, dS^T Q. */
static double check_pv(int HS, fault f, bool x2) {
    tile V = make_tile(64, HS);
    std::vector<double> P(64 * 64), O(64 * (size_t)HS, NAN), ref(64 * (size_t)HS);
    for (double &p : P) p = (float)(0.5 * (test_uniform(&rng) + 1));    /* fp32 values, rounded to bf16 by the repacking */
    for (int i = 0; i < 64; i++)
        for (int d = 0; d < HS; d++) {
            double s = 0;
            for (int j = 0; j < 64; j++) s += emu_round_bf16(P[(size_t)i * 64 + j]) * V.val[(size_t)j * HS + d];
            ref[(size_t)i * HS + d] = s;
        }
    for (int w = 0; w < 4; w++) {
        acc_t pc[8];                     /* P in the ISA's C layout */
        for (int nt = 0; nt < 8; nt++)
            for (int l = 0; l < 32; l++)
                for (int i = 0; i < 4; i++) {
                    int r, c;
                    emu_c_pos(l, i, &r, &c);
                    pc[nt][l][i] = (float)P[(size_t)(16 * w + r) * 64 + 8 * nt + c];
                }
        std::vector<acc_t> acc((size_t)HS / 8);
        for (auto &t : acc) memset(t, 0, sizeof(acc_t));
        for (int kc = 0; kc < 4; kc++) {
            uint32_t a[32][4];
            for (int l = 0; l < 32; l++) {
                if (f == F_REPACK_SWAP) pr_c_to_a(a[l], pc[2 * kc + 1][l], pc[2 * kc][l]);
                else pr_c_to_a(a[l], pc[2 * kc][l], pc[2 * kc + 1][l]);
                if (f == F_PACK_HALVES)
                    for (int r = 0; r < 4; r++) a[l][r] = (a[l][r] >> 16) | (a[l][r] << 16);
            }
            for (int dp = 0; dp < HS / 16; dp++) {
                uint32_t b[32][4], b0[32][2], b1[32][2], addr[32];
                if (x2) {
                    for (int half = 0; half < 2; half++) {
                        uint32_t h[32][4];
                        for (int l = 0; l < 32; l++)
                            addr[l] = smem_addr(V, 16 * kc + pr_ldm_bt_row(l), 16 * dp + 8 * half + pr_ldm_bt_col(l & 15), f);
                        emu_ldmatrix(h, V.smem.data(), V.smem.size(), addr, 2, f != F_V_NO_TRANS);
                        for (int l = 0; l < 32; l++) b[l][2 * half] = h[l][0], b[l][2 * half + 1] = h[l][1];
                    }
                } else {
                    for (int l = 0; l < 32; l++) addr[l] = smem_addr(V, 16 * kc + pr_ldm_bt_row(l), 16 * dp + pr_ldm_bt_col(l), f);
                    emu_ldmatrix(b, V.smem.data(), V.smem.size(), addr, 4, f != F_V_NO_TRANS);
                }
                for (int l = 0; l < 32; l++) b0[l][0] = b[l][0], b0[l][1] = b[l][1], b1[l][0] = b[l][2], b1[l][1] = b[l][3];
                emu_mma(acc[(size_t)2 * dp], a, b0, acc[(size_t)2 * dp]);
                emu_mma(acc[(size_t)2 * dp + 1], a, b1, acc[(size_t)2 * dp + 1]);
            }
        }
        for (int dt = 0; dt < HS / 8; dt++)
            for (int l = 0; l < 32; l++)
                for (int i = 0; i < 4; i++)
                    O[(size_t)(16 * w + place_row(l, i, f)) * HS + 8 * dt + place_col(l, i)] = acc[(size_t)dt][l][i];
    }
    return rel_err(O, ref);
}

/* dQ = bf16(dS) K as the fused backward forms it: each warp's accumulators of dS^T (its 16 keys
   x 64 queries, keys as rows) stored as packed bf16 pairs into a 64 x 64 [key][query] tile
   (pr_c_pair_offset, each store checked for bank conflicts), then each warp's 16 queries read back
   as the A operand with .trans (pr_ldm_at_*), times K (64 x HS) as the [k][n] operand with .trans.
   at_fault 1: the plain A lane rule (pr_ldm_a_*) used with .trans; 2: A loaded without .trans.
   Returns the relative error against the naive product. */
static double check_ds_k(int HS, int at_fault) {
    tile K = make_tile(64, HS);
    std::vector<double> dst(64 * 64), O(64 * (size_t)HS, NAN), ref(64 * (size_t)HS);
    for (double &x : dst) x = (float)test_uniform(&rng);
    std::vector<uint16_t> dss(64 * 64, 0);
    for (int w = 0; w < 4; w++)
        for (int nt = 0; nt < 8; nt++)
            for (int rr = 0; rr < 2; rr++) {
                uint32_t addr[32];
                for (int l = 0; l < 32; l++) {
                    float c[4];                  /* lane l's accumulators of n8 tile nt, by the ISA's C layout */
                    for (int i = 0; i < 4; i++) {
                        int r, q;
                        emu_c_pos(l, i, &r, &q);
                        c[i] = (float)dst[(size_t)(16 * w + r) * 64 + 8 * nt + q];
                    }
                    const int off = pr_c_pair_offset(16 * w, 8 * nt, l, rr, 64);
                    const uint32_t v = pr_pack_bf16x2(c[2 * rr], c[2 * rr + 1]);
                    dss[(size_t)off] = (uint16_t)v, dss[(size_t)off + 1] = (uint16_t)(v >> 16);
                    addr[l] = 2u * (uint32_t)off;
                }
                emu_words(addr);
            }
    for (int i = 0; i < 64; i++)
        for (int d = 0; d < HS; d++) {
            double sum = 0;
            for (int j = 0; j < 64; j++) sum += emu_round_bf16(dst[(size_t)j * 64 + i]) * K.val[(size_t)j * HS + d];
            ref[(size_t)i * HS + d] = sum;
        }
    for (int w = 0; w < 4; w++) {
        std::vector<acc_t> acc((size_t)HS / 8);
        for (auto &t : acc) memset(t, 0, sizeof(acc_t));
        for (int kc = 0; kc < 4; kc++) {
            uint32_t a[32][4], addr[32];
            for (int l = 0; l < 32; l++) {
                const int r = at_fault == 1 ? pr_ldm_a_row(l) : pr_ldm_at_row(l), c = at_fault == 1 ? pr_ldm_a_col(l) : pr_ldm_at_col(l);
                addr[l] = 2u * (uint32_t)pr_swz(16 * kc + r, 16 * w + c, 64);
            }
            emu_ldmatrix(a, dss.data(), dss.size(), addr, 4, at_fault != 2);
            for (int dp = 0; dp < HS / 16; dp++) {
                uint32_t b[32][4], b0[32][2], b1[32][2];
                for (int l = 0; l < 32; l++) addr[l] = smem_addr(K, 16 * kc + pr_ldm_bt_row(l), 16 * dp + pr_ldm_bt_col(l), F_NONE);
                emu_ldmatrix(b, K.smem.data(), K.smem.size(), addr, 4, true);
                for (int l = 0; l < 32; l++) b0[l][0] = b[l][0], b0[l][1] = b[l][1], b1[l][0] = b[l][2], b1[l][1] = b[l][3];
                emu_mma(acc[(size_t)2 * dp], a, b0, acc[(size_t)2 * dp]);
                emu_mma(acc[(size_t)2 * dp + 1], a, b1, acc[(size_t)2 * dp + 1]);
            }
        }
        for (int dt = 0; dt < HS / 8; dt++)
            for (int l = 0; l < 32; l++)
                for (int i = 0; i < 4; i++) O[(size_t)(16 * w + pr_mma_c_row(l, i)) * HS + 8 * dt + pr_mma_c_col(l, i)] = acc[(size_t)dt][l][i];
    }
    return rel_err(O, ref);
}

/* Row max and row sum of S (64 x 64, four warps) through per-lane partials and the quad
   reduction's shfl.bfly steps; returns the largest error over every lane's result. */
static double check_quad(int HS, fault f) {
    tile Q = make_tile(64, HS), K = make_tile(64, HS);
    double worst = 0;
    for (int w = 0; w < 4; w++) {
        acc_t S[8];
        warp_qk(S, Q, K, w, F_NONE, false);
        for (int rr = 0; rr < 2; rr++) {
            double mx[32], sm[32];
            for (int l = 0; l < 32; l++) {
                mx[l] = -INFINITY, sm[l] = 0;
                for (int nt = 0; nt < 8; nt++)
                    for (int i = 2 * rr; i < 2 * rr + 2; i++) mx[l] = std::fmax(mx[l], S[nt][l][i]), sm[l] += S[nt][l][i];
            }
            for (int s = 0; s < PR_QUAD_STEPS; s++) {
                int mask = f == F_QUAD_MASK && s == 1 ? 4 : pr_quad_xor(s);
                double m2[32], s2[32];
                for (int l = 0; l < 32; l++) m2[l] = std::fmax(mx[l], mx[l ^ mask]), s2[l] = sm[l] + sm[l ^ mask];
                memcpy(mx, m2, sizeof mx);
                memcpy(sm, s2, sizeof sm);
            }
            for (int l = 0; l < 32; l++) {
                int row = 16 * w + pr_mma_c_row(l, 2 * rr);
                double rmax = -INFINITY, rsum = 0;
                for (int j = 0; j < 64; j++) {
                    double s = 0;
                    for (int d = 0; d < HS; d++) s += Q.val[(size_t)row * HS + d] * K.val[(size_t)j * HS + d];
                    rmax = std::fmax(rmax, s), rsum += s;
                }
                worst = std::fmax(worst, std::fabs(mx[l] - rmax) / (1 + std::fabs(rmax)));
                worst = std::fmax(worst, std::fabs(sm[l] - rsum) / (1 + std::fabs(rsum)));
            }
        }
    }
    return worst;
}

/* Each fragment map covers its matrix exactly once over the 32 lanes. */
static void check_maps(void) {
    int a[16][16] = { { 0 } }, b[16][8] = { { 0 } }, c[16][8] = { { 0 } };
    for (int l = 0; l < 32; l++) {
        for (int i = 0; i < 8; i++) a[pr_mma_a_row(l, i)][pr_mma_a_col(l, i)]++;
        for (int i = 0; i < 4; i++) b[pr_mma_b_row(l, i)][pr_mma_b_col(l, i)]++, c[pr_mma_c_row(l, i)][pr_mma_c_col(l, i)]++;
    }
    int ok = 1;
    for (int r = 0; r < 16; r++)
        for (int q = 0; q < 16; q++) ok &= a[r][q] == 1 && (q >= 8 || (b[r][q] == 1 && c[r][q] == 1));
    CHECK(ok, "the A, B and C fragment maps are bijections");
    /* the kernels' maps agree with the ISA's tables element by element */
    int same = 1;
    for (int l = 0; l < 32; l++) {
        for (int i = 0; i < 8; i++) {
            int r, q;
            emu_a_pos(l, i, &r, &q);
            same &= r == pr_mma_a_row(l, i) && q == pr_mma_a_col(l, i);
        }
        for (int i = 0; i < 4; i++) {
            int r, q;
            emu_b_pos(l, i, &r, &q);
            same &= r == pr_mma_b_row(l, i) && q == pr_mma_b_col(l, i);
            emu_c_pos(l, i, &r, &q);
            same &= r == pr_mma_c_row(l, i) && q == pr_mma_c_col(l, i);
        }
    }
    CHECK(same, "pr_mma_{a,b,c}_{row,col} match the ISA's fragment tables");
}

/* ldmatrix .x1 and .x2 deliver the first one and two registers of .x4 from the same addresses. */
static void check_ldmatrix_widths(void) {
    tile T = make_tile(16, 64);
    uint32_t addr[32], r1[32][4], r2[32][4], r4[32][4];
    for (int l = 0; l < 32; l++) addr[l] = smem_addr(T, pr_ldm_a_row(l), pr_ldm_a_col(l), F_NONE);
    for (int trans = 0; trans < 2; trans++) {
        emu_ldmatrix(r4, T.smem.data(), T.smem.size(), addr, 4, trans);
        emu_ldmatrix(r2, T.smem.data(), T.smem.size(), addr, 2, trans);
        emu_ldmatrix(r1, T.smem.data(), T.smem.size(), addr, 1, trans);
        int ok = 1;
        for (int l = 0; l < 32; l++) ok &= r1[l][0] == r4[l][0] && r2[l][0] == r4[l][0] && r2[l][1] == r4[l][1];
        CHECK(ok, "ldmatrix .x1/.x2 agree with .x4%s", trans ? " (.trans)" : "");
    }
}

/* pr_ldsm_off, the kernels' ldmatrix addresses with the swizzle's XOR taken of lane constants, is
   2 pr_swz of the same element for every row block that starts at a multiple of 8, every lane
   row, k16 block and 8-column half, at each tile width; and it is not where a block starts
   elsewhere (its one precondition, which every caller meets). */
static void check_ldsm_off(void) {
    int ok = 1, off_grid_differs = 0;
    for (int W = 64; W <= 128; W += 64)
        for (int row0 = 0; row0 < 64; row0++)
            for (int lr = 0; lr < 16; lr++)
                for (int j = 0; j < W / 16; j++)
                    for (int cb = 0; cb < 2; cb++) {
                        const bool same = pr_ldsm_off(row0, lr, j, cb, W) == 2u * (uint32_t)pr_swz(row0 + lr, 16 * j + 8 * cb, W);
                        if (row0 % 8 == 0) ok &= same;
                        else off_grid_differs |= !same;
                    }
    CHECK(ok, "pr_ldsm_off equals 2 pr_swz for row blocks at multiples of 8");
    CHECK(off_grid_differs, "pr_ldsm_off differs from pr_swz off the multiples of 8 (the check can fail)");
}

/* wgmma's operands (test/wgmma_emu.h, read from the PTX ISA): the descriptors the wgmma forward
   builds address, for every k16 block, exactly the elements pr_wg_swz (its copies' layout) put
   there: Q or K (K-major, A 64 rows or B 64 rows, element (row, 16 kc + k)) and V (MN-major, B,
   element (key 16 kc + k, column n)), at both head dims; every address 1,024-atom-relative, so a
   wrong panel, SBO, LBO or swizzle shows. The negative control: the MN-major descriptor with the
   leading and stride offsets exchanged must miss. */
static void check_wgmma_desc(void) {
    const uint32_t base = 3 * 1024;
    for (int HS = 64; HS <= 128; HS *= 2) {
        int k_ok = 1, mn_ok = 1, swapped_ok = 1;
        for (int kc = 0; kc < HS / 16; kc++)
            for (int r = 0; r < 64; r++)
                for (int k = 0; k < 16; k++)
                    k_ok &= emu_wgmma_smem_addr(pr_wg_desc_k(base, kc, 64), r, k, 0, 2) == base + 2u * (uint32_t)pr_wg_swz(r, 16 * kc + k, 64);
        for (int kc = 0; kc < 4; kc++)
            for (int n = 0; n < HS; n++)
                for (int k = 0; k < 16; k++) {
                    const uint32_t want = base + 2u * (uint32_t)pr_wg_swz(16 * kc + k, n, 64);
                    const uint64_t d = pr_wg_desc_mn(base, kc);
                    const uint64_t lbo = (d >> 16) & 0x3FFF, sbo = (d >> 32) & 0x3FFF;
                    const uint64_t swapped = (d & ~((uint64_t)0x3FFF << 16) & ~((uint64_t)0x3FFF << 32)) | sbo << 16 | lbo << 32;
                    mn_ok &= emu_wgmma_smem_addr(d, n, k, 1, 2) == want;
                    swapped_ok &= emu_wgmma_smem_addr(swapped, n, k, 1, 2) == want;
                }
        CHECK(k_ok, "HS %d: the K-major descriptors (Q, K) address pr_wg_swz's elements", HS);
        CHECK(mn_ok, "HS %d: the MN-major descriptors (V) address pr_wg_swz's elements", HS);
        CHECK(!swapped_ok, "HS %d: the MN-major descriptor with LBO and SBO exchanged misses (the check can fail)", HS);
    }
}

/* Packing: round to nearest even, low half first, as the ISA's cvt.rn.bf16x2.f32 d, hi, lo. */
static void check_pack(void) {
    int ok = 1;
    for (int n = 0; n < 100000; n++) {
        float lo = (float)(test_uniform(&rng) * std::ldexp(1.0, (int)(test_uniform(&rng) * 20))), hi = (float)test_uniform(&rng);
        if (n == 0) lo = 1.00390625f, hi = 1.01171875f;           /* exact ties: 1 + 2^-8, 1 + 3*2^-8 */
        uint32_t p = pr_pack_bf16x2(lo, hi);
        ok &= bf16_value((uint16_t)p) == (float)emu_round_bf16(lo) && bf16_value((uint16_t)(p >> 16)) == (float)emu_round_bf16(hi);
    }
    CHECK(ok, "pr_pack_bf16x2 rounds to nearest even, low half first");
}

int main(void) {
    printf("tensor-core warp rules through an emulation of ldmatrix and mma.sync (PTX ISA)\n");
    check_maps();
    check_ldmatrix_widths();
    check_pack();
    check_ldsm_off();
    check_wgmma_desc();
    const double tol = 1e-6;   /* fp32 roundings of sums of exact bf16 products */
    for (int HS = 64; HS <= 128; HS *= 2) {
        for (int x2 = 0; x2 < 2; x2++) {
            emu_conflicts = 0;
            double e = check_qk(HS, F_NONE, x2, NULL);
            CHECK(e < tol, "HS %d: S = Q K^T (%s) relative error %.2e", HS, x2 ? ".x2" : ".x4", e);
            e = check_pv(HS, F_NONE, x2);
            CHECK(e < tol, "HS %d: O = bf16(P) V (%s) relative error %.2e", HS, x2 ? ".x2" : ".x4", e);
            CHECK(emu_conflicts == 0, "HS %d (%s): %ld shared-memory phases with bank conflicts", HS, x2 ? ".x2" : ".x4", emu_conflicts);
        }
        double e = check_quad(HS, F_NONE);
        CHECK(e < 1e-5, "HS %d: quad row max and row sum, error %.2e", HS, e);
        emu_conflicts = 0;
        e = check_ds_k(HS, 0);
        CHECK(e < tol, "HS %d: dQ = bf16(dS) K, dS^T stored in pairs and read as A with .trans, relative error %.2e", HS, e);
        CHECK(emu_conflicts == 0, "HS %d: %ld bank conflicts in dS's stores and reads", HS, emu_conflicts);
        for (int f = 1; f <= 2; f++) {
            e = check_ds_k(HS, f);
            CHECK(e > 1e-2, "HS %d: planted fault '%s' not detected (error %.2e)", HS,
                  f == 1 ? "the A .trans operand with the plain A lane rule" : "the A .trans operand loaded without .trans", e);
        }

        /* negative controls: each planted fault must be seen */
        for (int f = F_A_SWAP12; f < F_COUNT; f++) {
            emu_conflicts = 0;
            double eq = check_qk(HS, (fault)f, false, NULL), ev = check_pv(HS, (fault)f, false);
            long conflicts = emu_conflicts;
            double eqd = f == F_QUAD_MASK ? check_quad(HS, (fault)f) : 0;
            int seen = eq > 1e-2 || ev > 1e-2 || eqd > 1e-2;
            if (f == F_NO_SWIZZLE) {
                CHECK(conflicts > 0, "HS %d: unswizzled reads show bank conflicts", HS);
                seen = eq > 1e-2 && ev > 1e-2;
            }
            CHECK(seen, "HS %d: planted fault '%s' not detected (errors %.2e %.2e %.2e)", HS, fault_name[f], eq, ev, eqd);
        }
    }
    return test_report();
}
