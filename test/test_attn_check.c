/* The GPU attention test's comparison (test/attn_check.h), checked on the CPU: a plain scalar
   attention stands in for the kernel, the double CPU backend (test/gpu_ref.c) is the reference,
   and each of the test's shapes is run as test_gpu runs it (same inputs, same start values, same
   error measures, the kernel's outputs rounded to the precision the GPU stores them in).
     - Without a fault, every shape passes (which also checks the scalar attention itself).
     - With each planted fault, every shape where the fault changes the result fails.
   For each fault the table also shows how many shapes the comparison used before would have
   caught: q, k drawn at scale 1, += outputs starting in (-1, 1), error ||got - ref|| / ||ref||. */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "gpu_ref.h"
#include "attn_check.h"
#include "harness.h"

enum {
    F_NONE,
    F_OVERWRITE,          /* dk written (=) instead of added into (+=) */
    F_NO_DK,              /* dk (own keys) never written */
    F_NO_PREFIX_GRAD,     /* dkp, dvp never written */
    F_DROP_PREFIX_ROW,    /* the last prefix key's dkp, dvp row left out */
    F_FIRST_SEGMENT_ONLY, /* dkp, dvp summed over the first segment's rows only */
    F_CAUSAL_PLUS_ONE,    /* backward: each row also sees the next key of its segment */
    F_GQA_HEAD,           /* backward: query head h reads and writes KV head h % NKV, not h / (NH/NKV) */
    F_FWD_CAUSAL_PLUS_ONE,/* forward: each row also sees the next key of its segment */
    N_FAULTS
};
static const char *const fault_name[N_FAULTS] = {
    "none", "dk overwritten, not added", "dk not added", "no prefix dK/dV", "last prefix row dropped", "prefix grads of segment 0 only",
    "bwd mask one key late", "bwd GQA head h % NKV", "fwd mask one key late",
};

/* Does the fault change the result of case c? */
static int fault_visible(int f, const att_case *c) {
    int longest = 0;
    for (int s = 0; s < c->n_seg; s++) if (c->lens[s] > longest) longest = c->lens[s];
    switch (f) {
    case F_NONE: return 0;
    case F_NO_DK: return longest > 1 || c->n_prefix > 0;     /* one key alone has ds = 0 */
    case F_NO_PREFIX_GRAD: case F_DROP_PREFIX_ROW: return c->n_prefix > 0;
    case F_FIRST_SEGMENT_ONLY: return c->n_prefix > 0 && c->n_seg > 1;
    case F_CAUSAL_PLUS_ONE: case F_FWD_CAUSAL_PLUS_ONE: return longest > 1;
    case F_GQA_HEAD: return c->NKV > 1 && c->NH / c->NKV > 1;
    default: return 1;
    }
}

static double dot(const double *a, const double *b, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
/* Row j of the keys row r of segment [seg0, seg1) may see: the prefix (j < np), then its segment. */
static const double *key_row(const double *pre, const double *own, int j, int np, int seg0, int kvd, int hk) {
    return j < np ? pre + (size_t)j * kvd + hk : own + (size_t)(seg0 + j - np) * kvd + hk;
}
static int n_keys(int r, int seg0, int seg1, int np, int late) {
    int last = r + (late && r + 1 < seg1);
    return np + last - seg0 + 1;
}

/* out (N,NH*HS) rounded to bf16, lse (N,NH) to fp32, as the kernel stores them. */
static void scalar_fwd(double *out, double *lse, const att_problem *p, int fault) {
    const att_case *c = p->c;
    const int HS = c->HS, qd = c->NH * HS, kvd = c->NKV * HS, group = c->NH / c->NKV, np = p->np;
    const double scale = 1.0 / sqrt((double)HS);
    double *w = malloc(sizeof(double) * (size_t)(np + p->N));
    for (int s = 0; s < c->n_seg; s++)
        for (int r = p->seg_off[s]; r < p->seg_off[s + 1]; r++)
            for (int h = 0; h < c->NH; h++) {
                const double *qr = p->q + (size_t)r * qd + (size_t)h * HS;
                int hk = h / group * HS, nk = n_keys(r, p->seg_off[s], p->seg_off[s + 1], np, fault == F_FWD_CAUSAL_PLUS_ONE);
                double m = -INFINITY, sum = 0;
                for (int j = 0; j < nk; j++) {
                    w[j] = dot(qr, key_row(p->kp, p->k, j, np, p->seg_off[s], kvd, hk), HS) * scale;
                    if (w[j] > m) m = w[j];
                }
                for (int j = 0; j < nk; j++) sum += w[j] = exp(w[j] - m);
                double *o = out + (size_t)r * qd + (size_t)h * HS;
                for (int i = 0; i < HS; i++) o[i] = 0;
                for (int j = 0; j < nk; j++) {
                    const double *vj = key_row(p->vp, p->v, j, np, p->seg_off[s], kvd, hk);
                    for (int i = 0; i < HS; i++) o[i] += w[j] / sum * vj[i];
                }
                for (int i = 0; i < HS; i++) o[i] = att_round(o[i], 1);
                lse[(size_t)r * c->NH + h] = (float)(m + log(sum));
            }
    free(w);
}

/* d[g] += the gradients (from p->init), rounded as the kernel stores them. */
static void scalar_bwd(double *const d[ATT_N_GRADS], const double *out, const double *lse, const att_problem *p, int fault) {
    const att_case *c = p->c;
    const int HS = c->HS, qd = c->NH * HS, kvd = c->NKV * HS, group = c->NH / c->NKV, np = p->np;
    const double scale = 1.0 / sqrt((double)HS);
    for (int g = 0; g < ATT_N_GRADS; g++) memcpy(d[g], p->init[g], sizeof(double) * p->n[g]);
    if (fault == F_OVERWRITE) memset(d[ATT_DK], 0, sizeof(double) * p->n[ATT_DK]);
    for (int s = 0; s < c->n_seg; s++) {
        int seg0 = p->seg_off[s], seg1 = p->seg_off[s + 1];
        for (int r = seg0; r < seg1; r++)
            for (int h = 0; h < c->NH; h++) {
                size_t qo = (size_t)r * qd + (size_t)h * HS;
                const double *qr = p->q + qo, *dor = p->dout + qo;
                int hk = (fault == F_GQA_HEAD ? h % c->NKV : h / group) * HS;
                int nk = n_keys(r, seg0, seg1, np, fault == F_CAUSAL_PLUS_ONE);
                double D = dot(dor, out + qo, HS), l = lse[(size_t)r * c->NH + h];
                for (int j = 0; j < nk; j++) {
                    const double *kj = key_row(p->kp, p->k, j, np, seg0, kvd, hk);
                    const double *vj = key_row(p->vp, p->v, j, np, seg0, kvd, hk);
                    double pj = exp(dot(qr, kj, HS) * scale - l), dsj = pj * (dot(dor, vj, HS) - D) * scale;
                    int skip = j < np && (fault == F_NO_PREFIX_GRAD || (fault == F_DROP_PREFIX_ROW && j == np - 1) ||
                                          (fault == F_FIRST_SEGMENT_ONLY && s > 0));
                    if (!skip) {
                        double *dkj = (double *)key_row(d[ATT_DKP], d[ATT_DK], j, np, seg0, kvd, hk);
                        double *dvj = (double *)key_row(d[ATT_DVP], d[ATT_DV], j, np, seg0, kvd, hk);
                        double dk_on = fault == F_NO_DK && j >= np ? 0 : 1;
                        for (int i = 0; i < HS; i++) { dvj[i] += pj * dor[i]; dkj[i] += dk_on * dsj * qr[i]; }
                    }
                    for (int i = 0; i < HS; i++) d[ATT_DQ][qo + i] += dsj * kj[i];
                }
            }
    }
    for (int g = 0; g < ATT_N_GRADS; g++)
        for (size_t i = 0; i < p->n[g]; i++) d[g][i] = att_round(d[g][i], att_grad_bf16(g));
}

/* Case c run as test_gpu runs it, with every fault in turn (old = the comparison used before):
   worst[f] = the largest error of the fault's run, in units of ATT_TOL's scale (NaN wins). */
static void run_case(int index, int old, double worst[N_FAULTS]) {
    const att_case *c = &att_cases[index];
    att_problem p;
    att_problem_init(&p, c, old ? 1.0 : ATT_QK_SCALE, (uint64_t)index);
    for (int f = 0; f < N_FAULTS; f++) worst[f] = 0;
    size_t nl = (size_t)p.N * c->NH;
    double *ro = malloc(sizeof(double) * p.nq), *rl = malloc(sizeof(double) * nl);
    double *go = malloc(sizeof(double) * p.nq), *gl = malloc(sizeof(double) * nl);
    double *got[ATT_N_GRADS], err[ATT_N_GRADS];
    for (int g = 0; g < ATT_N_GRADS; g++) got[g] = malloc(sizeof(double) * p.n[g]);
    ref_attention_fwd(ro, rl, p.q, p.k, p.v, p.np ? p.kp : NULL, p.np ? p.vp : NULL, p.seg_off, c->n_seg, p.np, c->NH,
                      c->NKV, c->HS);
    for (int f = 0; f < N_FAULTS; f++) {
        if (f != F_NONE && f != F_FWD_CAUSAL_PLUS_ONE) continue;
        scalar_fwd(go, gl, &p, f);
        double e = rel_err(gl, rl, nl) / ATT_TOL_LSE * ATT_TOL;            /* lse in units of ATT_TOL */
        worst[f] = rel_err(go, ro, p.nq);
        if (!(worst[f] >= e)) worst[f] = e;
    }
    /* the backward from the unfaulted forward's outputs (go, gl hold the faulted one's now) */
    scalar_fwd(go, gl, &p, F_NONE);
    att_problem_reference(&p, go, gl, old ? 1.0 : 0);
    for (int f = 0; f < N_FAULTS; f++) {
        if (f == F_FWD_CAUSAL_PLUS_ONE) continue;
        scalar_bwd(got, go, gl, &p, f);
        if (old)
            for (int g = 0; g < ATT_N_GRADS; g++) err[g] = g >= ATT_DKP && !p.np ? 0 : rel_err(got[g], p.ref[g], p.n[g]);
        else
            att_grad_errors(&p, got, err);
        for (int g = 0; g < ATT_N_GRADS; g++) if (!(err[g] <= worst[f])) worst[f] = err[g];
    }
    for (int g = 0; g < ATT_N_GRADS; g++) free(got[g]);
    free(ro); free(rl); free(go); free(gl);
    att_problem_free(&p);
}

/* test_gpu --cases: the list parser */
static void test_parse_cases(void) {
    int sel[ATT_N_CASES] = { 0 }, n = 0;
    CHECK(att_parse_cases("0,3,8-10", sel), "--cases 0,3,8-10 refused");
    for (int i = 0; i < ATT_N_CASES; i++) n += sel[i];
    CHECK(n == 5 && sel[0] && sel[3] && sel[8] && sel[10], "--cases 0,3,8-10 selects %d cases", n);
    const char *bad[] = { "", "x", "1,", "3-1", "-1", "99", "2-99", "1;2" };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) CHECK(!att_parse_cases(bad[i], sel), "--cases '%s' accepted", bad[i]);
}

int main(void) {
    test_parse_cases();
    double e[ATT_N_CASES][N_FAULTS], e_old[ATT_N_CASES][N_FAULTS];
    /* the cases are independent (each its own random stream): two at a time */
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1)
#endif
    for (int t = 0; t < 2 * ATT_N_CASES; t++) run_case(t / 2, t % 2, t % 2 ? e_old[t / 2] : e[t / 2]);
    /* per fault: the shapes it shows in, how many of them fail now and before, and the smallest
       error over them in units of the tolerance (without a fault: the largest) */
    printf("%-32s %7s %7s %9s %14s %9s\n", "fault", "visible", "caught", "min/tol", "caught before", "min/tol");
    for (int f = 0; f < N_FAULTS; f++) {
        int visible = 0, caught = 0, caught_old = 0;
        double m = f == F_NONE ? 0 : INFINITY, m_old = m;
        for (int i = 0; i < ATT_N_CASES; i++) {
            const att_case *c = &att_cases[i];
            char name[160];
            att_case_name(c, name, sizeof name);
            int fails = !(e[i][f] <= ATT_TOL), fails_old = !(e_old[i][f] <= ATT_TOL);
            if (f == F_NONE) {
                CHECK(!fails, "case %d (%s) without a fault: error %.3e > %.0e", i, name, e[i][f], ATT_TOL);
                CHECK(!fails_old, "case %d (%s) without a fault, old comparison: error %.3e > %.0e", i, name, e_old[i][f], ATT_TOL);
                m = fmax(m, e[i][f]); m_old = fmax(m_old, e_old[i][f]);
            } else if (fault_visible(f, c)) {
                visible++;
                caught += fails;
                caught_old += fails_old;
                m = fmin(m, e[i][f]); m_old = fmin(m_old, e_old[i][f]);
                CHECK(fails, "case %d (%s) with fault '%s' passes: error %.3e", i, name, fault_name[f], e[i][f]);
            }
        }
        if (f == F_NONE) printf("%-32s %7s %7s %9.3f %14s %9.3f\n", "none (largest error/tol)", "-", "-", m / ATT_TOL, "-", m_old / ATT_TOL);
        else printf("%-32s %7d %7d %9.3g %14d %9.3g\n", fault_name[f], visible, caught, m / ATT_TOL, caught_old, m_old / ATT_TOL);
    }
    return test_report();
}
