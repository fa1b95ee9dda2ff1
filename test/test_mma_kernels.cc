/* The attention kernels themselves (prefixreuse_cuda.cu, compiled for the host with
   PR_CUDA_KERNEL_EMULATION), run on an emulated GPU block and compared, without a GPU, with the
   library's CPU attention in double precision (test/gpu_ref.c): the tensor-core kernels, also
   with the tile-level model of their algorithm (test/attn_model.c), which they must match far
   more closely; and the FFMA kernels, the backend's default and the GPU tests' reference.

   The emulated block is test/gpu_emu.h's (one fiber per thread, the warp-collective instructions
   from the PTX ISA, cp.async landing as late as the hardware allows, racecheck against the
   barriers), with every launch's outputs checked for one writer per element and the kernels'
   ldmatrix phases for bank conflicts. Not emulated: the timing of the real machine, and the
   approximate exp2/log2 (the host's are exact to an fp32 rounding).

   Checked, forward and backward, over shapes with prefixes 0, 1, 63, 64, 65 and 130, ragged
   packed and padded segments, GQA 1, 2 and 4, head dims 64 and 128, prefix dK/dV chunked (C > 1,
   with the in-order reduction kernel) and added directly (C = 1): out and lse, and the increments
   of dq, dk, dv, dkp, dvp over random starting contents, with test/test_gpu_attention.c's
   tolerances against the reference, and a quarter of its absolute part against the model (with
   one bf16 spacing for a flipped final rounding); no race in any kernel, no output element with
   two writers, no bank conflict. The fused backward (PR_CUDA_ATTENTION_MMA_ATOMIC: the dK/dV
   kernel also adding dS K into an fp32 dQ accumulator by atomics, then the dq_add kernel): its dq
   with the same tolerances against the reference and the model, its dk, dv, dkp, dvp bitwise the
   deterministic dK/dV kernel's, the stores of its dS tile race-checked like the copies. The FFMA
   kernels on the same inputs: the same tolerances for
   their bf16 outputs, 2e-5 (relative, and of the largest value) for their fp32 prefix dK/dV;
   their plain shared-memory accesses are not race-checked, their outputs are checked for one
   writer; at head dims 16 and 32 (model/tiny's and tiny-qwen3's, which the GPU tests and the smoke
   run train) they run alone. Negative controls, each of which must be caught: copies that
   land one wait_group late, ldmatrix ignoring .trans (by the values); the barriers that end a
   stage's reads skipped (as races in each of the four mma.sync kernels, whose values stay within
   tolerance on this machine, and in the wgmma forward), and those after a wait_group skipped (as
   races in all seven: in wgmma dQ and dK/dV that one barrier a stage also ends the other stage's
   reads); the dQ launch given one query tile twice (as elements with two writers); the fused
   kernel's barrier between its dS tile's stores and their reads skipped (as races in that kernel
   alone).
   The wgmma kernels (PR_CUDA_ATTENTION_WGMMA: forward, dQ, dK/dV on Hopper's warpgroup MMA) on the
   same inputs: every output bitwise the mma.sync kernels' (here both sum a k16 block's products
   exactly onto the accumulator), no race (a wgmma's shared-memory reads count for its whole
   warpgroup, from issue to wait), with the emulator's wgmma checks (test/gpu_emu.h: operands
   unchanged until the wait, accumulators unread before it, fence.proxy.async and wgmma.fence in
   place); negative controls: fence.proxy.async skipped or run after the barrier that publishes
   the copies, and wait_group retiring nothing, each seen by the machine. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "harness.h"
#include "xorshift.h"
#include "mma_emu.h"
extern "C" {
#include "attn_model.h"
#include "gpu_ref.h"
}

#define EMU_REPORT(...) CHECK(0, __VA_ARGS__)
#include "gpu_emu.h"

/* negative control: the dQ launch given one query tile twice */
static int fault_duplicate_tile;

#define PR_CUDA_HOST_EMULATION
#define PR_CUDA_KERNEL_EMULATION
#include "../prefixreuse_cuda.cu"


/* ================================================================ the attention on the emulator */
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static std::vector<double> draw(size_t n, double sd, bool normal, bool bf16_values) {
    std::vector<double> x(n ? n : 1);
    for (size_t i = 0; i < n; i++) {
        double y = sd * (normal ? test_gaussian(&rng) : test_uniform(&rng));
        x[i] = bf16_values ? emu_round_bf16(y) : (double)(float)y;
    }
    return x;
}
/* the launch's query tiles of `rows` rows (pr_att_query_tiles, counted then filled) */
static std::vector<pr_att_tile> query_tiles(int n_seg, const int *seg_off, int rows) {
    std::vector<pr_att_tile> t(pr_att_query_tiles(NULL, n_seg, seg_off, rows));
    pr_att_query_tiles(t.data(), n_seg, seg_off, rows);
    return t;
}
static std::vector<bf16> to_bf16(const std::vector<double> &x) {
    std::vector<bf16> y(x.size());
    for (size_t i = 0; i < x.size(); i++) y[i].bits = (uint16_t)pr_bf16_bits((float)x[i]);
    return y;
}
static std::vector<double> from_bf16(const std::vector<bf16> &x) {
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); i++) y[i] = bf16_value(x[i].bits);
    return y;
}
static double max_abs(const std::vector<double> &x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}
/* worst |(got - before) - want| / (atol + rtol |before + want|) over a tensor; NaN counts as infinite */
static double incr_ratio(const std::vector<double> &got, const std::vector<double> *before, const std::vector<double> &want,
                         size_t n, double atol, double rtol) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double s0 = before ? (*before)[i] : 0, inc = got[i] - s0;
        if (inc != inc) return INFINITY;
        double tol = atol + rtol * fabs(s0 + want[i]), r = fabs(inc - want[i]) / (tol > 0 ? tol : 1e-300);
        if (r > worst) worst = r;
    }
    return worst;
}

/* test_gpu_attention.c's tolerance: worst |inc - ref| / (2 u max|ref| + rtol |before + ref|) */
static double worst_ratio(const std::vector<double> &after, const std::vector<double> *before, const std::vector<double> &ref,
                          size_t n, bool fp32) {
    const double u = 1.0 / 256;
    return incr_ratio(after, before, ref, n, 2 * u * max_abs(ref, n), fp32 ? 4.0 / 4194304 : u);
}

/* The kernels beside the model, which runs the same blocked algorithm with the same roundings
   (bf16 P and dS, fp32 sums): they differ only by the order of fp32 sums (inside an mma, across the
   quad) and the bf16 roundings those flip. Worst |got - model| / (MODEL_TOL u max|ref| +
   rtol |before + model|), increments for the += outputs, rtol one bf16 spacing (2u: a final
   rounding that flips) or 4 fp32 units; ref is the double reference's increment (the scale), or
   the model's own output when NULL. */
#define MODEL_TOL 0.25
static double model_worst(const std::vector<double> &got, const std::vector<double> *before, const std::vector<double> &model,
                          const std::vector<double> *ref, size_t n, bool fp32) {
    const double u = 1.0 / 256;
    return incr_ratio(got, before, model, n, MODEL_TOL * u * max_abs(ref ? *ref : model, n), fp32 ? 4.0 / 4194304 : 2 * u);
}

struct shape { int n_prefix, n_seg, lens[6], NH, NKV, HS; };
/* per kernel (forward, dQ, dK/dV, the fused dK/dV): races seen, and the ldmatrix.x4 and mma.sync
   its warps executed; and the elements of dk, dv, dkp, dvp in which the fused backward's bits
   differ from the dK/dV kernel's */
enum { K_FWD, K_DQ, K_DKV, K_FUSED, K_FWD_WG, K_DQ_WG, K_DKV_WG, NK };
static const char *kname[NK] = { "forward", "dQ", "dK/dV", "fused dK/dV", "wgmma forward", "wgmma dQ", "wgmma dK/dV" };
/* ...and the elements of out, lse, dq, dk, dv, dkp, dvp in which the wgmma kernels' bits differ from the mma ones' */
struct kernel_stats { long races[NK], ldsm[NK], mma[NK], fused_differs, wg_differs; };
/* The elements of n whose bits differ between a and b (bf16 or float). */
template <typename X> static long count_differing(const X *a, const X *b, size_t n) {
    long d = 0;
    for (size_t i = 0; i < n; i++) d += memcmp(&a[i], &b[i], sizeof(X)) != 0;
    return d;
}
template <typename F>
static void launch_counted(kernel_stats *ks, int kernel, unsigned gx, unsigned gy, size_t smem, const std::vector<emu_out> &outs, F f,
                           unsigned threads = PR_MMA_THREADS) {
    emu_n_ldsm = emu_n_mma = emu_n_wgmma = 0;
    ks->races[kernel] = emu_launch(gx, gy, threads, smem, outs, f);
    ks->ldsm[kernel] = emu_n_ldsm, ks->mma[kernel] = emu_n_mma + emu_n_wgmma;
}
/* the tensors compared; dq_fused: the fused backward's dq (PR_CUDA_ATTENTION_MMA_ATOMIC) */
enum { T_OUT, T_LSE, T_DQ, T_DK, T_DV, T_DKP, T_DVP, T_DQ_FUSED, NT };
static const char *tname[NT] = { "out", "lse", "dq", "dk", "dv", "dkp", "dvp", "dq_fused" };
static bool shown(int t, int n_prefix) { return n_prefix || (t != T_DKP && t != T_DVP); }

/* worst |lse - ref| / (2e-5 (|ref| + 1)); NaN counts as infinite */
static double lse_ratio(const std::vector<float> &lse, const std::vector<double> &ref) {
    double worst = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        double r = fabs(lse[i] - ref[i]) / (2e-5 * (fabs(ref[i]) + 1));
        if (r != r) return INFINITY;
        if (r > worst) worst = r;
    }
    return worst;
}

#define FFMA_FP32_TOL 2e-5
/* The kernels' launches, as pr_cu_attention_{fwd,bwd}_mma and pr_cu_attention_{fwd,bwd}_hs make
   them, on the emulator: the worst error / tolerance per tensor of the tensor-core kernels against
   the reference (ratio) and the model (model_ratio), and of the FFMA kernels against the reference
   (ffma_ratio); each tensor-core kernel's races and instruction counts in ks. */
template <int HS>
static void run_shape(const shape &s, double ratio[NT], double model_ratio[NT], double ffma_ratio[NT], int backward,
                      kernel_stats *ks) {
    memset(ks, 0, sizeof *ks);
    for (int t = 0; t < NT; t++) ratio[t] = model_ratio[t] = ffma_ratio[t] = 0;
    std::vector<int> seg_off(s.n_seg + 1, 0);
    for (int i = 0; i < s.n_seg; i++) seg_off[i + 1] = seg_off[i] + s.lens[i];
    const int N = seg_off[s.n_seg], np = s.n_prefix, NH = s.NH, NKV = s.NKV, qd = NH * HS, kvd = NKV * HS;
    const size_t nq = (size_t)N * qd, nk = (size_t)N * kvd, npk = (size_t)(np ? np : 1) * kvd, nl = (size_t)N * NH;
    const double sd = sqrt(2.5);
    std::vector<double> q = draw(nq, sd, true, true), k = draw(nk, sd, true, true), kp = draw(npk, sd, true, true);
    std::vector<double> v = draw(nk, 1, false, true), vp = draw(npk, 1, false, true), dout = draw(nq, 1, false, true);
    std::vector<double> ro(nq), rl(nl);
    ref_attention_fwd(ro.data(), rl.data(), q.data(), k.data(), v.data(), np ? kp.data() : NULL, np ? vp.data() : NULL,
                      seg_off.data(), s.n_seg, np, NH, NKV, HS);
    std::vector<bf16> qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v), kpb = to_bf16(kp), vpb = to_bf16(vp), dob = to_bf16(dout);
    emu_inputs.clear();
    const std::vector<bf16> *ins[] = { &qb, &kb, &vb, &kpb, &vpb, &dob };
    for (const std::vector<bf16> *b : ins) emu_buffer_add(emu_inputs, b->data(), 2 * b->size());

    /* the tile-level model's inputs (test/attn_model.c) */
    std::vector<float> fq(q.begin(), q.end()), fk(k.begin(), k.end()), fv(v.begin(), v.end()), fkp(kp.begin(), kp.end()),
        fvp(vp.begin(), vp.end());
    am_layout alay = { s.n_seg, seg_off.data(), np };

    if constexpr (HS >= 64) {   /* the tensor-core kernels: head dims 64 and 128 */
        /* forward: grid (forward query tiles, NH) */
        const std::vector<pr_att_tile> ft = query_tiles(s.n_seg, seg_off.data(), PR_MMA_FWD_ROWS);
        const int nft = (int)ft.size();
        std::vector<bf16> out(nq);
        std::vector<float> lse(nl, NAN);
        for (bf16 &x : out) x.bits = 0xFFFF;
        launch_counted(ks, K_FWD, nft, NH, pr_mma_smem_bytes(HS, 0), { { "out", out.data(), nq, 2 }, { "lse", lse.data(), nl, 4 } }, [&] {
            pr_k_attention_fwd_mma<HS>(out.data(), lse.data(), qb.data(), kb.data(), vb.data(), np ? kpb.data() : NULL,
                                       np ? vpb.data() : NULL, ft.data(), np, NH, NKV);
        });
        /* the tile-level model (test/attn_model.c) on the same inputs */
        std::vector<float> mo(nq), ml(nl);
        CHECK(am_attention_fwd(mo.data(), ml.data(), fq.data(), fk.data(), fv.data(), np ? fkp.data() : NULL, np ? fvp.data() : NULL,
                               &alay, NH, NKV, HS, NULL) == 0, "model forward");
        model_ratio[T_OUT] = model_worst(from_bf16(out), NULL, std::vector<double>(mo.begin(), mo.end()), NULL, nq, false);
        model_ratio[T_LSE] = model_worst(std::vector<double>(lse.begin(), lse.end()), NULL, std::vector<double>(ml.begin(), ml.end()),
                                         NULL, nl, true);
        ratio[T_OUT] = worst_ratio(from_bf16(out), NULL, ro, nq, false);
        ratio[T_LSE] = lse_ratio(lse, rl);

        /* the wgmma forward on the same inputs: the same algorithm, and here the same arithmetic
           (a k16 block's products summed onto the accumulator, rounded once), so the same bits */
        std::vector<bf16> out_w(nq);
        std::vector<float> lse_w(nl, NAN);
        for (bf16 &x : out_w) x.bits = 0xFFFF;
        launch_counted(ks, K_FWD_WG, nft, NH, pr_mma_smem_bytes(HS, 0), { { "out", out_w.data(), nq, 2 }, { "lse", lse_w.data(), nl, 4 } }, [&] {
            pr_k_attention_fwd_wgmma<HS>(out_w.data(), lse_w.data(), qb.data(), kb.data(), vb.data(), np ? kpb.data() : NULL,
                                         np ? vpb.data() : NULL, ft.data(), np, NH, NKV);
        }, PR_WG_THREADS);
        ks->wg_differs += count_differing(out_w.data(), out.data(), nq) + count_differing(lse_w.data(), lse.data(), nl);
    }

    /* the FFMA kernels, the GPU tests' reference, on the same inputs: grid (64-row query tiles, NH) */
    const std::vector<pr_att_tile> qa = query_tiles(s.n_seg, seg_off.data(), PR_ATT_ROWS);
    const int nqa = (int)qa.size();
    std::vector<bf16> out_f(nq);
    std::vector<float> lse_f(nl, NAN);
    for (bf16 &x : out_f) x.bits = 0xFFFF;
    emu_launch(nqa, NH, PR_ATT_THREADS, pr_att_smem_bytes(HS, 0), { { "out", out_f.data(), nq, 2 }, { "lse", lse_f.data(), nl, 4 } }, [&] {
        pr_k_attention_fwd<HS>(out_f.data(), lse_f.data(), qb.data(), kb.data(), vb.data(), np ? kpb.data() : NULL,
                               np ? vpb.data() : NULL, qa.data(), np, NH, NKV);
    });
    ffma_ratio[T_OUT] = worst_ratio(from_bf16(out_f), NULL, ro, nq, false);
    ffma_ratio[T_LSE] = lse_ratio(lse_f, rl);
    if (!backward) return;

    /* backward from the reference forward in the GPU's formats: D, dQ, dK/dV, the chunk sum */
    std::vector<double> bo(nq), bl(nl);
    for (size_t i = 0; i < nq; i++) bo[i] = emu_round_bf16(ro[i]);
    for (size_t i = 0; i < nl; i++) bl[i] = (float)rl[i];
    const size_t n[5] = { nq, nk, nk, npk, npk };
    std::vector<double> ref[5], init[5];
    for (int t = 0; t < 5; t++) ref[t].assign(n[t], 0.0);
    ref_attention_bwd(ref[0].data(), ref[1].data(), ref[2].data(), np ? ref[3].data() : NULL, np ? ref[4].data() : NULL,
                      dout.data(), bo.data(), bl.data(), q.data(), k.data(), v.data(), np ? kp.data() : NULL,
                      np ? vp.data() : NULL, seg_off.data(), s.n_seg, np, NH, NKV, HS);
    for (int t = 0; t < 5; t++) {
        const double scale = 0.5 * max_abs(ref[t], n[t]);
        init[t] = draw(n[t], scale > 0 ? scale : 1, false, t < 3);
    }
    std::vector<bf16> ob = to_bf16(bo);
    std::vector<float> lsef(nl), D(nl);
    for (size_t i = 0; i < nl; i++) lsef[i] = (float)bl[i];
    for (size_t rh = 0; rh < nl; rh++) {               /* the rowdot kernel: D = dO . O in fp32 */
        float acc = 0;
        for (int d = 0; d < HS; d++) acc += bf16_value(dob[rh * HS + d].bits) * bf16_value(ob[rh * HS + d].bits);
        D[rh] = acc;
    }
    emu_buffer_add(emu_inputs, lsef.data(), 4 * lsef.size());
    emu_buffer_add(emu_inputs, D.data(), 4 * D.size());
    if constexpr (HS >= 64) {
        std::vector<bf16> dq = to_bf16(init[0]), dk = to_bf16(init[1]), dv = to_bf16(init[2]);
        std::vector<float> dkp(npk), dvp(npk);
        for (size_t i = 0; i < npk; i++) dkp[i] = (float)init[3][i], dvp[i] = (float)init[4][i];
        const std::vector<pr_att_tile> qt = query_tiles(s.n_seg, seg_off.data(), PR_MMA_ROWS);
        const int nqt = (int)qt.size();
        const int C = pr_mma_prefix_chunks(np, NKV, nqt);
        const int nkt = (int)pr_mma_key_tiles(NULL, qt.data(), nqt, np, C);
        std::vector<pr_att_ktile> kt(nkt);
        pr_mma_key_tiles(kt.data(), qt.data(), nqt, np, C);
        std::vector<float> part(C > 1 ? 2 * (size_t)C * npk : 1, NAN);
        std::vector<pr_att_tile> qt_dq = qt;              /* the planted fault: one tile twice */
        if (fault_duplicate_tile && nqt > 1) qt_dq[1] = qt_dq[0];
        launch_counted(ks, K_DQ, nqt, NH, pr_mma_smem_bytes(HS, 1), { { "dq", dq.data(), nq, 2 } }, [&] {
            pr_k_attention_bwd_dq_mma<HS>(dq.data(), dob.data(), lsef.data(), D.data(), qb.data(), kb.data(), vb.data(),
                                          np ? kpb.data() : NULL, np ? vpb.data() : NULL, qt_dq.data(), np, NH, NKV);
        });
        /* the wgmma dQ from the same start values: the same bits as the dQ kernel's */
        std::vector<bf16> dq_w = to_bf16(init[0]);
        launch_counted(ks, K_DQ_WG, nqt, NH, pr_mma_smem_bytes(HS, 1), { { "dq", dq_w.data(), nq, 2 } }, [&] {
            pr_k_attention_bwd_dq_wgmma<HS>(dq_w.data(), dob.data(), lsef.data(), D.data(), qb.data(), kb.data(), vb.data(),
                                            np ? kpb.data() : NULL, np ? vpb.data() : NULL, qt_dq.data(), np, NH, NKV);
        });
        ks->wg_differs += count_differing(dq_w.data(), dq.data(), nq);
        const std::vector<emu_out> dkv_outs = { { "dk", dk.data(), nk, 2 }, { "dv", dv.data(), nk, 2 }, { "dkp", dkp.data(), npk, 4 },
                                                { "dvp", dvp.data(), npk, 4 }, { "partials", part.data(), part.size(), 4 } };
        launch_counted(ks, K_DKV, nkt, NKV, pr_mma_smem_bytes(HS, 2), dkv_outs, [&] {
            pr_k_attention_bwd_dkv_mma<HS>(dk.data(), dv.data(), dkp.data(), dvp.data(), C > 1 ? part.data() : NULL, C, NULL, dob.data(),
                                           lsef.data(), D.data(), qb.data(), kb.data(), vb.data(), np ? kpb.data() : NULL,
                                           np ? vpb.data() : NULL, kt.data(), qt.data(), np, NH, NKV);
        });
        if (C > 1)
            emu_launch(4, 1, 128, 0, { { "dkp", dkp.data(), npk, 4 }, { "dvp", dvp.data(), npk, 4 } },
                       [&] { pr_k_attention_chunk_sum(dkp.data(), dvp.data(), part.data(), C, (size_t)np * kvd); });
        std::vector<double> dkpd(dkp.begin(), dkp.end()), dvpd(dvp.begin(), dvp.end());
        /* the wgmma dK/dV from the same start values, the same chunk sum after it: the same bits */
        {
            std::vector<bf16> dk_w = to_bf16(init[1]), dv_w = to_bf16(init[2]);
            std::vector<float> dkp_w(npk), dvp_w(npk), part_w(part.size(), NAN);
            for (size_t i = 0; i < npk; i++) dkp_w[i] = (float)init[3][i], dvp_w[i] = (float)init[4][i];
            std::vector<pr_att_ktile> pairs(2 * (size_t)nkt);   /* two key tiles a block (pr_wg_key_pairs) */
            const int nkb = (int)pr_wg_key_pairs(pairs.data(), kt.data(), nkt, np, C);
            launch_counted(ks, K_DKV_WG, nkb, NKV, pr_mma_smem_bytes(HS, 4),
                           { { "dk", dk_w.data(), nk, 2 }, { "dv", dv_w.data(), nk, 2 }, { "dkp", dkp_w.data(), npk, 4 },
                             { "dvp", dvp_w.data(), npk, 4 }, { "partials", part_w.data(), part_w.size(), 4 } }, [&] {
                pr_k_attention_bwd_dkv_wgmma<HS>(dk_w.data(), dv_w.data(), dkp_w.data(), dvp_w.data(), C > 1 ? part_w.data() : NULL, C, NULL,
                                                 dob.data(), lsef.data(), D.data(), qb.data(), kb.data(), vb.data(), np ? kpb.data() : NULL,
                                                 np ? vpb.data() : NULL, pairs.data(), qt.data(), np, NH, NKV);
            }, PR_WG_THREADS);
            if (C > 1)
                emu_launch(4, 1, 128, 0, { { "dkp", dkp_w.data(), npk, 4 }, { "dvp", dvp_w.data(), npk, 4 } },
                           [&] { pr_k_attention_chunk_sum(dkp_w.data(), dvp_w.data(), part_w.data(), C, (size_t)np * kvd); });
            ks->wg_differs += count_differing(dk_w.data(), dk.data(), nk) + count_differing(dv_w.data(), dv.data(), nk);
            if (np) ks->wg_differs += count_differing(dkp_w.data(), dkp.data(), npk) + count_differing(dvp_w.data(), dvp.data(), npk);
        }
        /* the model's backward from the same start values */
        std::vector<float> mg[5];
        for (int t = 0; t < 5; t++) mg[t].assign(init[t].begin(), init[t].end());
        std::vector<float> fdo(dout.begin(), dout.end()), fbo(bo.begin(), bo.end()), fbl(bl.begin(), bl.end());
        CHECK(am_attention_bwd(mg[0].data(), mg[1].data(), mg[2].data(), np ? mg[3].data() : NULL, np ? mg[4].data() : NULL,
                               fdo.data(), fbo.data(), fbl.data(), fq.data(), fk.data(), fv.data(), np ? fkp.data() : NULL,
                               np ? fvp.data() : NULL, &alay, NH, NKV, HS, NULL) == 0, "model backward");

        /* the fused backward (PR_CUDA_ATTENTION_MMA_ATOMIC) from the same start values, as
           pr_cu_attention_bwd_mma launches it: dq through the fp32 accumulator and the dq_add kernel;
           its dk, dv, dkp, dvp must be the dK/dV kernel's above, bit for bit */
        std::vector<bf16> dq_x = to_bf16(init[0]), dk_x = to_bf16(init[1]), dv_x = to_bf16(init[2]);
        std::vector<float> dkp_x(npk), dvp_x(npk), dq_acc(nq, 0.0f), part_x(part.size(), NAN);
        for (size_t i = 0; i < npk; i++) dkp_x[i] = (float)init[3][i], dvp_x[i] = (float)init[4][i];
        emu_accumulators.clear(), emu_buffer_add(emu_accumulators, dq_acc.data(), 4 * dq_acc.size());
        launch_counted(ks, K_FUSED, nkt, NKV, pr_mma_smem_bytes(HS, 3),
                       { { "dk", dk_x.data(), nk, 2 }, { "dv", dv_x.data(), nk, 2 }, { "dkp", dkp_x.data(), npk, 4 },
                         { "dvp", dvp_x.data(), npk, 4 }, { "partials", part_x.data(), part_x.size(), 4 } }, [&] {
            pr_k_attention_bwd_dkv_mma<HS, true>(dk_x.data(), dv_x.data(), dkp_x.data(), dvp_x.data(), C > 1 ? part_x.data() : NULL, C,
                                                 dq_acc.data(), dob.data(), lsef.data(), D.data(), qb.data(), kb.data(), vb.data(),
                                                 np ? kpb.data() : NULL, np ? vpb.data() : NULL, kt.data(), qt.data(), np, NH, NKV);
        });
        if (C > 1)
            emu_launch(4, 1, 128, 0, { { "dkp", dkp_x.data(), npk, 4 }, { "dvp", dvp_x.data(), npk, 4 } },
                       [&] { pr_k_attention_chunk_sum(dkp_x.data(), dvp_x.data(), part_x.data(), C, (size_t)np * kvd); });
        emu_launch(4, 1, 128, 0, { { "dq", dq_x.data(), nq, 2 } }, [&] { pr_k_attention_dq_add(dq_x.data(), dq_acc.data(), HS, nq); });
        ks->fused_differs = count_differing(dk_x.data(), dk.data(), nk) + count_differing(dv_x.data(), dv.data(), nk);
        if (np) ks->fused_differs += count_differing(dkp_x.data(), dkp.data(), npk) + count_differing(dvp_x.data(), dvp.data(), npk);

        const std::vector<double> got[5] = { from_bf16(dq), from_bf16(dk), from_bf16(dv), dkpd, dvpd };
        for (int t = 0; t < 5; t++) {
            if (t >= 3 && !np) { model_ratio[T_DQ + t] = 0; continue; }
            std::vector<double> minc(n[t]);
            for (size_t i = 0; i < n[t]; i++) minc[i] = mg[t][i] - init[t][i];
            model_ratio[T_DQ + t] = model_worst(got[t], &init[t], minc, &ref[t], n[t], t >= 3);
            if (t == 0) model_ratio[T_DQ_FUSED] = model_worst(from_bf16(dq_x), &init[0], minc, &ref[0], nq, false);
        }
        ratio[T_DQ_FUSED] = worst_ratio(from_bf16(dq_x), &init[0], ref[0], nq, false);
        ratio[T_DQ] = worst_ratio(from_bf16(dq), &init[0], ref[0], nq, false);
        ratio[T_DK] = worst_ratio(from_bf16(dk), &init[1], ref[1], nk, false);
        ratio[T_DV] = worst_ratio(from_bf16(dv), &init[2], ref[2], nk, false);
        ratio[T_DKP] = np ? worst_ratio(dkpd, &init[3], ref[3], npk, true) : 0;
        ratio[T_DVP] = np ? worst_ratio(dvpd, &init[4], ref[4], npk, true) : 0;
    }

    /* the FFMA backward from the same start values: dq blocks over the query tiles, dk/dv blocks over
       the prefix's key tiles and the own ones (pr_att_key_tiles) */
    std::vector<bf16> dq_f = to_bf16(init[0]), dk_f = to_bf16(init[1]), dv_f = to_bf16(init[2]);
    std::vector<float> dkp_f(npk), dvp_f(npk);
    for (size_t i = 0; i < npk; i++) dkp_f[i] = (float)init[3][i], dvp_f[i] = (float)init[4][i];
    const int nka = pr_att_key_tiles(NULL, qa.data(), nqa, np);
    std::vector<pr_att_tile> ka(nka);
    pr_att_key_tiles(ka.data(), qa.data(), nqa, np);
    emu_launch(nqa, NH, PR_ATT_THREADS, pr_att_smem_bytes(HS, 0), { { "dq", dq_f.data(), nq, 2 } }, [&] {
        pr_k_attention_bwd_dq<HS>(dq_f.data(), dob.data(), lsef.data(), D.data(), qb.data(), kb.data(), vb.data(),
                                  np ? kpb.data() : NULL, np ? vpb.data() : NULL, qa.data(), np, NH, NKV);
    });
    emu_launch(nka, NKV, PR_ATT_THREADS, pr_att_smem_bytes(HS, 1),
               { { "dk", dk_f.data(), nk, 2 }, { "dv", dv_f.data(), nk, 2 }, { "dkp", dkp_f.data(), npk, 4 }, { "dvp", dvp_f.data(), npk, 4 } },
               [&] {
                   pr_k_attention_bwd_dkv<HS>(dk_f.data(), dv_f.data(), dkp_f.data(), dvp_f.data(), dob.data(), lsef.data(), D.data(),
                                              qb.data(), kb.data(), vb.data(), np ? kpb.data() : NULL, np ? vpb.data() : NULL,
                                              ka.data(), N, NH, NKV);
               });
    ffma_ratio[T_DQ] = worst_ratio(from_bf16(dq_f), &init[0], ref[0], nq, false);
    ffma_ratio[T_DK] = worst_ratio(from_bf16(dk_f), &init[1], ref[1], nk, false);
    ffma_ratio[T_DV] = worst_ratio(from_bf16(dv_f), &init[2], ref[2], nk, false);
    /* their prefix dK/dV is fp32 throughout (no bf16 P or dS): a tolerance 400 times tighter */
    const std::vector<double> dkp_fd(dkp_f.begin(), dkp_f.end()), dvp_fd(dvp_f.begin(), dvp_f.end());
    ffma_ratio[T_DKP] = np ? incr_ratio(dkp_fd, &init[3], ref[3], npk, FFMA_FP32_TOL * max_abs(ref[3], npk), FFMA_FP32_TOL) : 0;
    ffma_ratio[T_DVP] = np ? incr_ratio(dvp_fd, &init[4], ref[4], npk, FFMA_FP32_TOL * max_abs(ref[4], npk), FFMA_FP32_TOL) : 0;
}

static void run(const shape &s, double ratio[NT], double model_ratio[NT], double ffma_ratio[NT], int backward, kernel_stats *ks) {
    switch (s.HS) {
    case 16: run_shape<16>(s, ratio, model_ratio, ffma_ratio, backward, ks); break;
    case 32: run_shape<32>(s, ratio, model_ratio, ffma_ratio, backward, ks); break;
    case 64: run_shape<64>(s, ratio, model_ratio, ffma_ratio, backward, ks); break;
    default: run_shape<128>(s, ratio, model_ratio, ffma_ratio, backward, ks);
    }
}

int main(void) {
    printf("tensor-core attention kernels on an emulated block, against the double CPU attention\n");
    {   /* the bitwise comparisons below see one flipped bit, and a zero's sign */
        const float a[3] = { 1.0f, 2.0f, 0.0f }, b[3] = { 1.0f, nextafterf(2.0f, 3.0f), -0.0f };
        CHECK(count_differing(a, a, 3) == 0 && count_differing(a, b, 3) == 2, "count_differing counts the elements whose bits differ");
    }
    {   /* the emulated shfl.sync.idx (the wgmma dK/dV's warpgroup index): each lane gets the value of
           the lane it names, over two warpgroups */
        std::vector<int> got(256, -1);
        emu_launch(1, 1, 256, 0, { { "got", got.data(), got.size(), 4 } }, [&] {
            const int t = (int)threadIdx.x;
            got[t] = __shfl_sync(0xffffffffu, 1000 * t, (7 * t) & 31);
        });
        int wrong = 0;
        for (int t = 0; t < 256; t++) wrong += got[t] != 1000 * ((t & ~31) + ((7 * t) & 31));
        CHECK(wrong == 0, "shfl.sync.idx: %d of 256 lanes read another lane than the one they named", wrong);
    }
    const shape shapes[] = {
        { 0, 1, { 1 }, 2, 2, 64 },                        /* S = 1 */
        { 0, 3, { 130, 1, 64 }, 2, 1, 128 },              /* causal, packed ragged, GQA 2 */
        { 1, 2, { 65, 65 }, 4, 1, 64 },                   /* P = 1, padded, GQA 4 */
        { 63, 3, { 1, 64, 70 }, 2, 1, 128 },              /* the prefix's tail tile, C > 1 */
        { 64, 2, { 63, 100 }, 2, 2, 64 },                 /* one whole prefix tile */
        { 65, 2, { 7, 128 }, 2, 1, 128 },
        { 130, 2, { 40, 65 }, 4, 4, 64 },                 /* three prefix tiles x 4 KV heads, C = 3 */
        { 130, 1, { 20 }, 2, 2, 64 },                     /* C = 1: added into dkp/dvp directly */
        /* the FFMA kernels alone (no tensor-core kernels at these head dims): model/tiny's 16, tiny-qwen3's 32 */
        { 65, 3, { 7, 70, 1 }, 4, 2, 16 },
        { 0, 2, { 130, 64 }, 4, 1, 32 },
        { 130, 2, { 40, 65 }, 4, 4, 32 },
    };
#if defined(__SANITIZE_ADDRESS__) || EMU_SANITIZED
    const size_t n_shapes = 4;                    /* under AddressSanitizer: slower (and the head dims 16, 32 last) */
#else
    const size_t n_shapes = sizeof shapes / sizeof *shapes;
#endif
    emu_conflicts = 0;
    for (size_t i = 0; i < n_shapes; i++) {
        const shape &s = shapes[i];
        double r[NT], mr[NT], fr[NT];
        kernel_stats ks;
        emu_errors = 0;
        emu_races = emu_multi_writers = 0;
        run(s, r, mr, fr, 1, &ks);
        char what[160];
        int len = snprintf(what, sizeof what, "P %d NH %d NKV %d HS %d, segments", s.n_prefix, s.NH, s.NKV, s.HS);
        for (int i = 0; i < s.n_seg; i++) len += snprintf(what + len, sizeof what - len, " %d", s.lens[i]);
        const bool mma = s.HS >= 64;
        if (mma) {
            printf("%-52s err/tol", what);
            for (int t = 0; t < NT; t++) if (shown(t, s.n_prefix)) printf(" %s %.2f", tname[t], r[t]);
            printf("\n%52s vs model", "");
            for (int t = 0; t < NT; t++) if (shown(t, s.n_prefix)) printf(" %s %.2f", tname[t], mr[t]);
            printf("\n%52s FFMA    ", "");
        } else {
            printf("%-52s FFMA    ", what);
        }
        for (int t = 0; t < NT; t++) if (shown(t, s.n_prefix) && t != T_DQ_FUSED) printf(" %s %.2f", tname[t], fr[t]);
        if (mma) {
            printf("\n%52s races", "");
            for (int k = 0; k < NK; k++) printf(" %s %ld", kname[k], ks.races[k]);
            printf(", ldmatrix.x4 per mma");
            for (int k = 0; k < K_FWD_WG; k++) printf(" %s %.3f", kname[k], ks.mma[k] ? (double)ks.ldsm[k] / ks.mma[k] : 0.0);
            printf(", wgmma forward %ld dQ %ld dK/dV %ld", ks.mma[K_FWD_WG], ks.mma[K_DQ_WG], ks.mma[K_DKV_WG]);
        }
        printf("\n");
        for (int t = 0; t < NT; t++) CHECK(mr[t] <= 1, "%s: %s off the model by %.2f x its tolerance", what, tname[t], mr[t]);
        CHECK(emu_errors == 0, "%s: %d errors on the emulated machine", what, emu_errors);
        for (int k = 0; k < NK; k++) CHECK(ks.races[k] == 0, "%s: %ld shared-memory races in the %s kernel", what, ks.races[k], kname[k]);
        CHECK(ks.fused_differs == 0, "%s: the fused backward's dk, dv, dkp, dvp differ from the dK/dV kernel's in %ld elements", what,
              ks.fused_differs);
        CHECK(emu_multi_writers == 0, "%s: %ld output elements written by two blocks of one launch", what, emu_multi_writers);
        CHECK(!mma || (ks.wg_differs == 0 && ks.mma[K_FWD_WG] > 0 && ks.mma[K_DQ_WG] > 0 && ks.mma[K_DKV_WG] > 0),
              "%s: the wgmma kernels' outputs differ from the mma kernels' in %ld elements", what, ks.wg_differs);
        for (int t = 0; t < NT; t++) CHECK(r[t] <= 1, "%s: %s off the reference by %.2f x the tolerance", what, tname[t], r[t]);
        for (int t = 0; t < NT; t++) CHECK(fr[t] <= 1, "%s: the FFMA kernels' %s off the reference by %.2f x the tolerance", what, tname[t], fr[t]);
    }
    printf("ldmatrix phases with bank conflicts in the kernels: %ld\n", emu_conflicts);
    CHECK(emu_conflicts == 0, "%ld ldmatrix phases of the kernels with bank conflicts", emu_conflicts);

    /* negative controls: the same kernels on a faulty machine must fail, each fault where it should */
    const shape ctl = { 65, 2, { 7, 70 }, 2, 1, 64 };
    static const char *fault_name[] = { "copies land a wait_group late", "ldmatrix ignores .trans",
                                        "the barriers that end a stage's reads skipped", "the barriers after a wait_group skipped",
                                        "the dQ launch given one query tile twice", "the barrier after the dS tile's stores skipped",
                                        "fence.proxy.async skipped", "wgmma.wait_group retiring nothing",
                                        "fence.proxy.async after the barrier instead of before" };
    for (int f = 0; f < 9; f++) {
        double r[NT], mr[NT], fr[NT];
        kernel_stats ks;
        emu_errors = 0;
        emu_races = emu_multi_writers = 0;
        fault_late_copies = f == 0, fault_ignore_trans = f == 1, fault_skip_barrier = f == 2 ? 1 : f == 3 ? 2 : f == 5 ? 3 : 0;
        fault_duplicate_tile = f == 4, fault_skip_proxy_fence = f == 6, fault_wgmma_unwaited = f == 7, fault_late_proxy_fence = f == 8;
        emu_quiet = true;
        run(ctl, r, mr, fr, f >= 2, &ks);
        emu_quiet = false;
        fault_late_copies = fault_ignore_trans = fault_skip_barrier = fault_duplicate_tile = fault_skip_proxy_fence = fault_wgmma_unwaited = fault_late_proxy_fence = 0;
        printf("planted fault '%s': out %.2f, lse %.2f x the tolerance, %d machine errors, races %ld %ld %ld %ld, %ld elements with two writers\n",
               fault_name[f], r[T_OUT], r[T_LSE], emu_errors, ks.races[K_FWD], ks.races[K_DQ], ks.races[K_DKV], ks.races[K_FUSED],
               emu_multi_writers);
        if (f < 2)
            CHECK(r[T_OUT] > 1 || r[T_LSE] > 1 || emu_errors, "planted fault '%s' not detected (out %.2f, lse %.2f)", fault_name[f],
                  r[T_OUT], r[T_LSE]);
        else if (f < 4)     /* wgmma dQ and dK/dV have one barrier a stage, after the wait: fault 3's alone */
            for (int k = 0; k < (f == 2 ? K_FWD_WG + 1 : NK); k++)
                CHECK(ks.races[k] > 0, "planted fault '%s': no race seen in the %s kernel", fault_name[f], kname[k]);
        else if (f == 4)
            CHECK(emu_multi_writers > 0, "planted fault '%s': no element seen written twice", fault_name[f]);
        else if (f == 5)
            CHECK(ks.races[K_FUSED] > 0 && ks.races[K_DKV] == 0, "planted fault '%s': races %ld in the fused kernel, %ld in dK/dV",
                  fault_name[f], ks.races[K_FUSED], ks.races[K_DKV]);
        else
            CHECK(emu_errors > 0, "planted fault '%s': the emulated machine saw nothing wrong", fault_name[f]);
    }
    return test_report();
}
