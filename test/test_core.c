/* Tests of the model math and the schedules: finite differences (double build), the independent
   oracle, baseline vs reuse over many shapes, the gKV hooks, bad input, determinism, checkpoints.
   Built twice by `make test`: float and double (PR_DOUBLE). */
#define _POSIX_C_SOURCE 200809L   /* mkdtemp, access, opendir */
#define PREFIXREUSE_IMPLEMENTATION
#define PR__GRAD_WIRE_MAX ((size_t)1 << 10)   /* a gradient sum in bf16 crosses several chunk boundaries */
#define PR__STAGE_REALS ((size_t)40)         /* host sums, pipeline doubles and padded KV gradients in several chunks */
#include <stdlib.h>
/* The library's allocations, with one that fails on demand (test_mesh_faults): on the thread that
   arms it, the allocation numbered alloc_fails_at from the arming (-1: none fails). alloc_largest:
   the thread's largest request since the test set it to 0. */
static _Thread_local long alloc_made, alloc_fails_at = -1;
static _Thread_local size_t alloc_largest;
static int alloc_fails(size_t n) {
    if (n > alloc_largest) alloc_largest = n;
    return alloc_fails_at >= 0 && alloc_made++ == alloc_fails_at;
}
/* Arms this thread's failing allocation: the one numbered `at` from now. */
static void alloc_fault_arm(long at) {
    alloc_made = 0;
    alloc_fails_at = at;
}
/* Disarms it; the allocations made since it was armed. */
static long alloc_fault_disarm(void) {
    alloc_fails_at = -1;
    return alloc_made;
}
static void *test_malloc(size_t n) { return alloc_fails(n) ? NULL : malloc(n); }
static void *test_realloc(void *p, size_t n) { return alloc_fails(n) ? NULL : realloc(p, n); }
#define PR_MALLOC(sz) test_malloc(sz)
#define PR_REALLOC(p, sz) test_realloc(p, sz)
#define PR_FREE(p) free(p)
#include "../prefixreuse.h"
#include "harness.h"

#include <math.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <pthread.h>
#include <unistd.h>

/* Removes a scratch folder made by a test, with its files and folders (two levels suffice here). */
static void remove_tree(const char *dir, int depth) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char path[1024];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (remove(path) != 0 && depth > 0) remove_tree(path, depth - 1);
    }
    closedir(d);
    remove(dir);
}

/* A scratch folder of the test's own, named prtest_<name>..., its path in dir (size bytes). */
static int make_scratch_dir(char *dir, size_t size, const char *name) {
    snprintf(dir, size, "%s/prtest_%sXXXXXX", test_tmpdir(), name);
    return mkdtemp(dir) != NULL;
}

#define IS_DOUBLE (sizeof(pr_real) == 8)

/* ------------------------------------------------------------------ fixtures */
static pr_config small_config(int qk_norm, int tied, int nkv) {
    pr_config c;
    memset(&c, 0, sizeof c);
    strcpy(c.model_type, qk_norm ? "qwen3" : "llama");
    c.vocab_size = 61;
    c.hidden_size = 24;
    c.intermediate_size = 40;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = nkv;
    c.head_dim = qk_norm ? 8 : 6;
    c.max_position_embeddings = 128;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 10000;
    c.rope_llama3 = !qk_norm;
    c.rope_factor = 8; c.rope_low_freq_factor = 1; c.rope_high_freq_factor = 4; c.rope_original_max_position = 16;
    c.qk_norm = qk_norm;
    c.tie_word_embeddings = tied;
    return c;
}

static uint64_t rng_state = 42;
static double urand(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (rng_state >> 11) / 9007199254740992.0;
}

/* Weights large enough that attention and SwiGLU are far from linear, norm weights away from 1. */
static pr_trainer *make_model_on(const pr_config *c, uint64_t seed, const pr_backend *be) {
    pr_trainer *tr;
    pr_error err;
    if (pr_trainer_create(&tr, c, be, &err) || pr_trainer_init_params(tr, seed, &err)) {
        printf("make_model: %s\n", err.message);
        exit(1);
    }
    size_t n = pr_trainer_param_count(tr);
    pr_real *p = malloc(sizeof(pr_real) * n);
    pr_trainer_get_params(tr, p, n, &err);
    rng_state = seed * 2654435761u + 1;
    for (int t = 0; t < pr_trainer_tensor_count(tr); t++) {
        const pr_tensor_info *ti = pr_trainer_tensor(tr, t);
        for (size_t i = 0; i < ti->numel; i++) {
            pr_real *x = &p[ti->offset + i];
            *x = ti->ndim == 2 ? *x * 12 : (pr_real)(1 + 0.2 * (urand() - 0.5));
        }
    }
    pr_trainer_set_params(tr, p, n, &err);
    free(p);
    return tr;
}
static pr_trainer *make_model(const pr_config *c, uint64_t seed) { return make_model_on(c, seed, pr_backend_cpu()); }

/* A group owning its arrays. */
typedef struct {
    pr_group g;
    int32_t prefix[512], tokens[4096];
    int len[64];
    int64_t off[65];
    pr_real adv[64], old[4096], ref[4096];
    uint8_t mask[4096];
    uint8_t pmask[512];               /* trained prefix tokens (train_prefix) */
    pr_real pold[512], pref[512];
} test_group;

static void make_group(test_group *t, int P, int G, const int *S, int V, uint64_t seed) {
    memset(t, 0, sizeof *t);
    rng_state = seed * 7919 + 3;
    for (int i = 0; i < P; i++) t->prefix[i] = (int32_t)(urand() * V);
    t->off[0] = 0;
    for (int i = 0; i < G; i++) {
        t->len[i] = S[i];
        t->off[i + 1] = t->off[i] + S[i];
        t->adv[i] = (pr_real)(2 * urand() - 1);
    }
    for (int64_t f = 0; f < t->off[G]; f++) {
        t->tokens[f] = (int32_t)(urand() * V);
        t->old[f] = (pr_real)(-log((double)V) + 1.2 * (urand() - 0.5));   /* ratios on both sides of the clip band */
        t->ref[f] = (pr_real)(t->old[f] - 0.3 * urand());
        t->mask[f] = urand() > 0.15;
    }
    pr_group *g = &t->g;
    g->P = P; g->G = G; g->prefix = t->prefix; g->suffix_len = t->len; g->suffix_off = t->off; g->tokens = t->tokens;
    g->advantage = t->adv; g->old_logp = t->old; g->ref_logp = t->ref; g->loss_mask = t->mask;
    g->prefix_mask = NULL; g->prefix_old_logp = g->prefix_ref_logp = NULL;
}

static pr_real *grads_of(pr_trainer *tr) {
    size_t n = pr_trainer_param_count(tr);
    pr_real *g = malloc(sizeof(pr_real) * n);
    pr_trainer_get_grads(tr, g, n, NULL);
    return g;
}
static pr_real *params_of(pr_trainer *tr) {
    size_t n = pr_trainer_param_count(tr);
    pr_real *p = malloc(sizeof(pr_real) * n);
    pr_trainer_get_params(tr, p, n, NULL);
    return p;
}

/* The build's tolerance. Double: normwise per tensor, max|a-b| <= 1e-10 max|b|. Float: the mixed
   test |a-b| <= atol + rtol |b| per element, atol scaled to the tensor (1e-4 of its largest entry). */
static int close_tensor(const pr_real *a, const pr_real *b, size_t n, double *worst) {
    double scale = 0, maxd = 0;
    int ok = 1;
    for (size_t i = 0; i < n; i++) if (fabs((double)b[i]) > scale) scale = fabs((double)b[i]);
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > maxd) maxd = d;
        if (IS_DOUBLE ? !(d <= 1e-10 * scale) : !(d <= 1e-4 * scale + 2e-4 * fabs((double)b[i]))) ok = 0;
    }
    *worst = scale > 0 ? maxd / scale : maxd;
    return ok;
}

/* Every tensor of two arenas within tolerance; names the first that is not. */
static int close_arenas(pr_trainer *tr, const pr_real *a, const pr_real *b, const char *what, const char *label) {
    for (int t = 0; t < pr_trainer_tensor_count(tr); t++) {
        const pr_tensor_info *ti = pr_trainer_tensor(tr, t);
        double w;
        if (!close_tensor(a + ti->offset, b + ti->offset, ti->numel, &w)) {
            printf("  %s: %s %s differs (max diff / max |ref| = %.3e)\n", label, what, ti->name, w);
            return 0;
        }
    }
    return 1;
}

/* ------------------------------------------------------------------ baseline vs reuse */
static void equivalence_case_moe(const pr_config *c, int P, int G, const int *S, int mb_base, int mb_reuse,
                                 pr_layout layout, pr_loss_norm norm, const pr_moe_opts *moe, const char *label) {
    test_group t;
    make_group(&t, P, G, S, c->vocab_size, (uint64_t)(P * 131 + G * 17 + mb_reuse));
    pr_trainer *a = make_model(c, 5), *b = make_model(c, 5);
    pr_error err;
    pr_step_opts oa = pr_step_opts_default(), ob;
    oa.loss.kl_coef = 0.05;
    oa.loss.norm = norm;
    if (moe) oa.moe = *moe;
    ob = oa;
    oa.schedule = PR_SCHEDULE_BASELINE; oa.microbatch = mb_base;
    ob.schedule = PR_SCHEDULE_REUSE; ob.microbatch = mb_reuse; ob.layout = layout;
    pr_step_stats sa, sb;
    pr_real la[4096], lb[4096];
    int ok = !pr_trainer_compute_grads(a, &t.g, &oa, &sa, la, &err) && !pr_trainer_compute_grads(b, &t.g, &ob, &sb, lb, &err);
    CHECK(ok, "%s: %s", label, err.message);
    if (!ok) { pr_trainer_destroy(a); pr_trainer_destroy(b); return; }
    double lw;
    CHECK(close_tensor(&(pr_real){ (pr_real)sb.loss }, &(pr_real){ (pr_real)sa.loss }, 1, &lw) &&
          (IS_DOUBLE ? fabs(sa.loss - sb.loss) <= 1e-10 * fabs(sa.loss) : 1),
          "%s: loss %.15g vs %.15g", label, sa.loss, sb.loss);
    CHECK(close_tensor(lb, la, (size_t)t.off[G], &lw), "%s: log-probs differ (%.3e)", label, lw);
    if (moe)
        CHECK(sa.aux_loss > 0 && fabs(sa.aux_loss - sb.aux_loss) <= (IS_DOUBLE ? 1e-10 : 1e-5) * sa.aux_loss,
              "%s: aux loss %.15g vs %.15g", label, sa.aux_loss, sb.aux_loss);
    pr_real *ga = grads_of(a), *gb = grads_of(b);
    CHECK(close_arenas(a, gb, ga, "gradient", label), "%s: gradients", label);
    pr_adamw_opts adam = pr_adamw_opts_default();
    adam.max_grad_norm = 0.5;   /* clipping active: the norm of both must agree too */
    ok = !pr_trainer_adamw_step(a, &adam, NULL, &err) && !pr_trainer_adamw_step(b, &adam, NULL, &err);
    CHECK(ok, "%s: adamw %s", label, err.message);
    pr_real *pa = params_of(a), *pb = params_of(b);
    CHECK(close_arenas(a, pb, pa, "parameter", label), "%s: parameters after AdamW", label);
    free(ga); free(gb); free(pa); free(pb);
    pr_trainer_destroy(a);
    pr_trainer_destroy(b);
}

static void equivalence_case(const pr_config *c, int P, int G, const int *S, int mb_base, int mb_reuse,
                             pr_layout layout, pr_loss_norm norm, const char *label) {
    equivalence_case_moe(c, P, G, S, mb_base, mb_reuse, layout, norm, NULL, label);
}

static void test_equivalence(void) {
    pr_config cfgs[3] = { small_config(0, 0, 2), small_config(1, 1, 1), small_config(0, 1, 4) };
    const int S8[8] = { 5, 1, 9, 3, 2, 7, 4, 6 };
    const int Gs[4] = { 1, 2, 3, 8 };
    int cases = 0;
    for (int ci = 0; ci < 3; ci++)
        for (int gi = 0; gi < 4; gi++) {
            int G = Gs[gi];
            int mbs[3] = { 1, 2, G };
            for (int mi = 0; mi < 3; mi++)
                for (int lay = 0; lay < 2; lay++) {
                    char label[160];
                    int P = 3 + 4 * gi + ci;
                    snprintf(label, sizeof label, "config %d, P %d, G %d, microbatch %d, %s", ci, P, G, mbs[mi], lay ? "packed" : "padded");
                    equivalence_case(&cfgs[ci], P, G, S8, mbs[(mi + 1) % 3], mbs[mi], (pr_layout)lay,
                                     (gi + mi) % 2 ? PR_NORM_SEQ_MEAN_TOKEN_MEAN : PR_NORM_TOKEN_MEAN, label);
                    cases++;
                }
        }
    /* edges: a one-token prefix, one-token suffixes, one trajectory */
    const int ones[4] = { 1, 1, 1, 1 }, mixed[3] = { 1, 12, 2 };
    equivalence_case(&cfgs[0], 1, 3, mixed, 1, 2, PR_LAYOUT_PACKED, PR_NORM_TOKEN_MEAN, "P=1");
    equivalence_case(&cfgs[1], 6, 4, ones, 4, 1, PR_LAYOUT_PADDED, PR_NORM_TOKEN_MEAN, "S=1 everywhere");
    equivalence_case(&cfgs[2], 1, 1, ones, 1, 1, PR_LAYOUT_PACKED, PR_NORM_SEQ_MEAN_TOKEN_MEAN, "P=1, S=1, G=1");
    printf("equivalence: %d shapes x layouts compared on loss, log-probs, gradients, parameters\n", cases + 3);
}

/* microbatch_tokens: the microbatches each schedule runs (pr_step_stats.microbatches) for budgets
   around one pass's rows (P + S_max whole, S_max in Phase B), under the trajectory limit too; a
   step under a budget is bit for bit the step with the count the budget gives (the count alone
   changes; test_equivalence compares the schedules at every count). */
static void test_microbatch_tokens(void) {
    pr_config c = small_config(0, 0, 2);
    const int S[6] = { 4, 7, 2, 5, 3, 6 }, P = 9, G = 6, smax = 7;
    const struct { int tokens, microbatch; } cases[] = { { 16, 0 }, { 15, 0 }, { 1, 0 }, { 48, 0 }, { 48, 4 }, { 1000, 0 }, { 0, 2 } };
    test_group t;
    make_group(&t, P, G, S, c.vocab_size, 404);
    pr_error err;
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++)
        for (int sched = 0; sched < 2; sched++) {
            const int rows = smax + (sched ? 0 : P), lim = cases[k].microbatch ? cases[k].microbatch : G;
            int mb = cases[k].tokens ? cases[k].tokens / rows : G;        /* the count, worked out here */
            if (mb < 1) mb = 1;
            if (mb > lim) mb = lim;
            pr_step_opts o = pr_step_opts_default(), e;
            o.schedule = sched ? PR_SCHEDULE_REUSE : PR_SCHEDULE_BASELINE;
            o.microbatch = cases[k].microbatch;
            o.microbatch_tokens = cases[k].tokens;
            e = o;
            e.microbatch_tokens = 0;
            e.microbatch = mb;
            CHECK(pr_step_microbatch(&t.g, &o) == mb, "pr_step_microbatch: %d, want %d", pr_step_microbatch(&t.g, &o), mb);
            pr_trainer *a = make_model(&c, 5), *b = make_model(&c, 5);
            pr_step_stats sa, sb;
            pr_real la[4096], lb[4096];
            int ok = !pr_trainer_compute_grads(a, &t.g, &o, &sa, la, &err) && !pr_trainer_compute_grads(b, &t.g, &e, &sb, lb, &err);
            CHECK(ok, "microbatch_tokens %d: %s", cases[k].tokens, err.message);
            if (ok) {
                CHECK(sa.microbatches == (G + mb - 1) / mb, "microbatch_tokens %d, microbatch %d, %s: %d microbatches, want %d",
                      cases[k].tokens, cases[k].microbatch, sched ? "reuse" : "baseline", sa.microbatches, (G + mb - 1) / mb);
                pr_real *ga = grads_of(a), *gb = grads_of(b);
                const size_t n = pr_trainer_param_count(a);
                CHECK(sa.loss == sb.loss && !memcmp(la, lb, sizeof(pr_real) * (size_t)t.off[G]) && !memcmp(ga, gb, sizeof(pr_real) * n),
                      "microbatch_tokens %d, %s: not the step of microbatch %d", cases[k].tokens, sched ? "reuse" : "baseline", mb);
                free(ga); free(gb);
            }
            pr_trainer_destroy(a);
            pr_trainer_destroy(b);
        }
    /* a pass whose rows times heads would overflow an int is refused before anything runs: 33
       whole sequences of a 2^24-token prefix (the baseline); reuse's passes hold 2^24 rows or 33 */
    pr_config big = c;
    big.max_position_embeddings = (1 << 24) + 1;
    pr_trainer *bt = make_model(&big, 5);
    int32_t *huge = calloc((size_t)1 << 24, sizeof(int32_t));
    int ones[33];
    for (int i = 0; i < 33; i++) ones[i] = 1;
    test_group h;
    make_group(&h, 1, 33, ones, c.vocab_size, 9);
    h.g.P = 1 << 24;
    h.g.prefix = huge;
    if (huge) {
        pr_step_opts o = pr_step_opts_default();
        o.schedule = PR_SCHEDULE_BASELINE;
        CHECK(pr_trainer_compute_grads(bt, &h.g, &o, NULL, NULL, &err) == PR_ERR_ARG && strstr(err.message, "is too large"),
              "33 sequences of 2^24 + 1 tokens in one microbatch: %s", err.message);
        o.microbatch_tokens = 1 << 25;        /* one sequence a microbatch, 2^24 + 1 rows: fits */
        CHECK(pr_step_microbatch(&h.g, &o) == 1, "a budget of 2^25 tokens takes one 2^24 + 1-token sequence");
    }
    free(huge);
    pr_trainer_destroy(bt);
    pr_trainer *a = make_model(&c, 5);
    pr_step_opts o = pr_step_opts_default();
    CHECK(pr_step_microbatch(NULL, &o) == 0 && pr_step_microbatch(&t.g, NULL) == 0, "pr_step_microbatch of NULL is 0");
    o.microbatch_tokens = -1;
    CHECK(pr_trainer_compute_grads(a, &t.g, &o, NULL, NULL, &err) == PR_ERR_ARG && strstr(err.message, "microbatch_tokens"),
          "a negative token budget is refused: %s", err.message);
    pr_trainer_destroy(a);
}

/* ------------------------------------------------------------------ hooks */
typedef struct {
    int captures, dkvs, injects, bad_shape, L, P, kvd;
    pr_real *sum_k, *sum_v;       /* per layer: running sum of the microbatch dK/dV */
    int injected_equal;
    double perturb;               /* finite differences: added to one cached K or V entry */
    int perturb_layer, perturb_index, perturb_v;
    pr_real *gk_seen, *gv_seen;   /* the injected cache, per layer */
} hook_log;

static void on_capture(void *u, int layer, void *k, void *v, int P, int kvd) {
    hook_log *h = u;
    h->captures++;
    if (P != h->P || kvd != h->kvd || layer < 0 || layer >= h->L) h->bad_shape++;
    if (h->perturb != 0 && layer == h->perturb_layer)
        ((pr_real *)(h->perturb_v ? v : k))[h->perturb_index] += (pr_real)h->perturb;
}
static void on_dkv(void *u, int layer, int mb, const void *dk, const void *dv, int P, int kvd) {
    hook_log *h = u;
    (void)mb;
    h->dkvs++;
    if (P != h->P || kvd != h->kvd) { h->bad_shape++; return; }
    for (int i = 0; i < P * kvd; i++) {
        h->sum_k[(size_t)layer * P * kvd + i] += ((const pr_real *)dk)[i];
        h->sum_v[(size_t)layer * P * kvd + i] += ((const pr_real *)dv)[i];
    }
}
static void on_inject(void *u, int layer, const void *gk, const void *gv, int P, int kvd) {
    hook_log *h = u;
    h->injects++;
    if (P != h->P || kvd != h->kvd) { h->bad_shape++; return; }
    size_t n = (size_t)P * kvd, o = (size_t)layer * n;
    if (memcmp(gk, h->sum_k + o, n * sizeof(pr_real)) || memcmp(gv, h->sum_v + o, n * sizeof(pr_real))) h->injected_equal = 0;
    memcpy(h->gk_seen + o, gk, n * sizeof(pr_real));
    memcpy(h->gv_seen + o, gv, n * sizeof(pr_real));
}

static void hook_log_init(hook_log *h, const pr_config *c, int P) {
    memset(h, 0, sizeof *h);
    h->L = c->num_hidden_layers; h->P = P; h->kvd = c->num_key_value_heads * c->head_dim;
    size_t n = (size_t)h->L * P * h->kvd;
    h->sum_k = calloc(n, sizeof(pr_real)); h->sum_v = calloc(n, sizeof(pr_real));
    h->gk_seen = calloc(n, sizeof(pr_real)); h->gv_seen = calloc(n, sizeof(pr_real));
    h->injected_equal = 1;
}
static void hook_log_free(hook_log *h) { free(h->sum_k); free(h->sum_v); free(h->gk_seen); free(h->gv_seen); }

static pr_step_opts hooked_opts(hook_log *h, int mb) {
    pr_step_opts o = pr_step_opts_default();
    o.microbatch = mb;
    o.loss.kl_coef = 0.05;
    o.hooks.user = h;
    o.hooks.on_kv_capture = on_capture;
    o.hooks.on_dkv = on_dkv;
    o.hooks.on_kv_inject = on_inject;
    return o;
}

static void test_hooks(void) {
    pr_config c = small_config(0, 0, 2);
    const int S[5] = { 4, 2, 6, 1, 3 };
    test_group t;
    make_group(&t, 9, 5, S, c.vocab_size, 11);
    pr_trainer *tr = make_model(&c, 3);
    hook_log h;
    hook_log_init(&h, &c, 9);
    pr_step_opts o = hooked_opts(&h, 2);     /* microbatches of 2, 2, 1 */
    pr_error err;
    CHECK(!pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err), "hooked step: %s", err.message);
    CHECK(h.captures == c.num_hidden_layers, "capture fired %d times, want %d", h.captures, c.num_hidden_layers);
    CHECK(h.dkvs == 3 * c.num_hidden_layers, "dK/dV hook fired %d times, want %d", h.dkvs, 3 * c.num_hidden_layers);
    CHECK(h.injects == c.num_hidden_layers, "inject fired %d times, want %d", h.injects, c.num_hidden_layers);
    CHECK(h.bad_shape == 0, "%d hook calls with unexpected shapes", h.bad_shape);
    CHECK(h.injected_equal, "the injected gK/gV differ from the sum of the per-microbatch dK/dV");
    double mx = 0;
    for (size_t i = 0; i < (size_t)h.L * h.P * h.kvd; i++) mx = fmax(mx, fabs((double)h.gk_seen[i]));
    CHECK(mx > 0, "the injected gK is all zeros: the suffixes sent nothing to the prefix");
    /* only on_dkv needs a microbatch's dK/dV apart from gK/gV: without it the step holds no scratch
       for them, two buffers of P x kv_dim reals less in every phase's peak, and the same gradients
       (to rounding: with it, each microbatch's sum joins gK/gV once) */
    pr_step_stats with, without;
    pr_real *g_with = NULL;
    CHECK(!pr_trainer_compute_grads(tr, &t.g, &o, &with, NULL, &err), "hooked step: %s", err.message);
    g_with = grads_of(tr);
    o.hooks.on_dkv = NULL;
    CHECK(!pr_trainer_compute_grads(tr, &t.g, &o, &without, NULL, &err), "step without on_dkv: %s", err.message);
    pr_real *g_without = grads_of(tr);
    const size_t scratch = 2 * (((size_t)h.P * h.kvd * sizeof(pr_real) + 255) / 256 * 256);
    for (int p = 0; p < 3; p++)
        CHECK(with.peak_bytes[p] - without.peak_bytes[p] == scratch, "phase %c's peak with on_dkv %zu, without %zu: "
              "want %zu less without", 'A' + p, with.peak_bytes[p], without.peak_bytes[p], scratch);
    CHECK(close_arenas(tr, g_without, g_with, "gradient", "without on_dkv"), "the gradients differ with and without on_dkv");
    free(g_with); free(g_without);
    /* the baseline has no prefix cache: no hook fires */
    hook_log_free(&h);
    hook_log_init(&h, &c, 9);
    o = hooked_opts(&h, 2);
    o.schedule = PR_SCHEDULE_BASELINE;
    CHECK(!pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err), "baseline with hooks: %s", err.message);
    CHECK(h.captures + h.dkvs + h.injects == 0, "hooks fired under the baseline schedule");
    hook_log_free(&h);

    /* negative control: the same comparison must see a cache that is off by 1e-3 in one entry */
    pr_trainer *base = make_model(&c, 3);
    o = pr_step_opts_default();
    o.schedule = PR_SCHEDULE_BASELINE;
    o.loss.kl_coef = 0.05;
    CHECK(!pr_trainer_compute_grads(base, &t.g, &o, NULL, NULL, &err), "%s", err.message);
    hook_log_init(&h, &c, 9);
    o = hooked_opts(&h, 2);
    h.perturb = 1e-3; h.perturb_layer = 0; h.perturb_index = 5;
    CHECK(!pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err), "%s", err.message);
    pr_real *ga = grads_of(base), *gb = grads_of(tr);
    printf("negative control (expect a reported difference):\n");
    CHECK(!close_arenas(tr, gb, ga, "gradient", "corrupted cache"), "a corrupted K/V cache went unnoticed by the comparison");
    free(ga); free(gb);
    hook_log_free(&h);
    pr_trainer_destroy(base);
    pr_trainer_destroy(tr);
}

/* ------------------------------------------------------------------ finite differences */
static double loss_at(pr_trainer *tr, const pr_group *g, const pr_step_opts *o) {
    pr_step_stats st;
    pr_error err;
    if (pr_trainer_compute_grads(tr, g, o, &st, NULL, &err)) { printf("loss_at: %s\n", err.message); exit(1); }
    return st.loss;
}

/* d(loss)/d(parameter) by central differences on sampled entries of every tensor, and
   d(loss)/d(cached prefix K/V) against the injected gK/gV (perturbing the cache in the capture hook). */
static void test_gradcheck(const pr_config *c, const char *label) {
    const int S[3] = { 5, 2, 4 };
    test_group t;
    make_group(&t, 6, 3, S, c->vocab_size, 23);
    pr_trainer *tr = make_model(c, 9);
    pr_step_opts o = pr_step_opts_default();
    o.loss.kl_coef = 0.05;
    o.microbatch = 2;
    pr_error err;
    CHECK(!pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err), "%s", err.message);
    size_t n = pr_trainer_param_count(tr);
    pr_real *g = grads_of(tr), *p = params_of(tr);
    int checked = 0, bad = 0;
    for (int ti = 0; ti < pr_trainer_tensor_count(tr); ti++) {
        const pr_tensor_info *info = pr_trainer_tensor(tr, ti);
        double scale = 0;
        size_t arg = 0;
        for (size_t i = 0; i < info->numel; i++)
            if (fabs((double)g[info->offset + i]) > scale) { scale = fabs((double)g[info->offset + i]); arg = i; }
        for (int k = 0; k < 6; k++) {
            size_t i = k == 0 ? arg : (size_t)(urand() * info->numel), at = info->offset + i;
            double h = 1e-5 * fmax(1.0, fabs((double)p[at]));
            pr_real keep = p[at];
            p[at] = keep + (pr_real)h; pr_trainer_set_params(tr, p, n, NULL);
            double lp = loss_at(tr, &t.g, &o);
            p[at] = keep - (pr_real)h; pr_trainer_set_params(tr, p, n, NULL);
            double lm = loss_at(tr, &t.g, &o);
            p[at] = keep;
            double fd = (lp - lm) / (2 * h), an = g[at];
            checked++;
            if (!(fabs(fd - an) <= 1e-6 * scale + 1e-6 * fabs(an))) {
                bad++;
                printf("  %s: %s[%zu] analytic %.10e finite difference %.10e\n", label, info->name, i, an, fd);
            }
        }
    }
    pr_trainer_set_params(tr, p, n, NULL);
    CHECK(bad == 0, "%s: %d of %d sampled parameter gradients disagree with finite differences", label, bad, checked);

    /* prefix K/V adjoints: the loss moves with the cached K/V only through the suffixes */
    hook_log h;
    hook_log_init(&h, c, t.g.P);
    pr_step_opts oh = hooked_opts(&h, 2);
    CHECK(!pr_trainer_compute_grads(tr, &t.g, &oh, NULL, NULL, &err), "%s", err.message);
    int kbad = 0, kchecked = 0;
    size_t per_layer = (size_t)h.P * h.kvd;
    for (int l = 0; l < h.L; l++)
        for (int which = 0; which < 2; which++)
            for (int k = 0; k < 5; k++) {
                hook_log hp;
                hook_log_init(&hp, c, t.g.P);
                pr_step_opts op = hooked_opts(&hp, 2);
                hp.perturb_layer = l; hp.perturb_v = which;
                hp.perturb_index = (int)(urand() * per_layer);
                double step = 1e-5;
                hp.perturb = step;
                double lp = loss_at(tr, &t.g, &op);
                hp.perturb = -step;
                double lm = loss_at(tr, &t.g, &op);
                double fd = (lp - lm) / (2 * step);
                double an = (which ? h.gv_seen : h.gk_seen)[(size_t)l * per_layer + hp.perturb_index];
                double scale = 0;
                for (size_t i = 0; i < per_layer; i++) scale = fmax(scale, fabs((double)(which ? h.gv_seen : h.gk_seen)[l * per_layer + i]));
                kchecked++;
                if (!(fabs(fd - an) <= 1e-6 * scale + 1e-6 * fabs(an))) {
                    kbad++;
                    printf("  %s: layer %d %s[%d] gKV %.10e finite difference %.10e\n", label, l, which ? "V" : "K", hp.perturb_index, an, fd);
                }
                hook_log_free(&hp);
            }
    CHECK(kbad == 0, "%s: %d of %d prefix K/V adjoints disagree with finite differences", label, kbad, kchecked);
    printf("gradcheck %s: %d parameter entries, %d prefix K/V entries\n", label, checked, kchecked);
    hook_log_free(&h);
    free(g); free(p);
    pr_trainer_destroy(tr);
}

/* ------------------------------------------------------------------ the independent oracle */
/* test/ref_*.safetensors hold weights, loss, log-probs and gradients computed by Hugging Face's
   model code in float64 (test/oracle/oracle.py) for group 0 of data/sample.trace. */
static void test_oracle(const char *config_dir, const char *ref_path, pr_loss_norm norm) {
    pr_error err;
    pr_config c;
    pr_trace trace;
    pr_checkpoint *ck;
    if (pr_config_load(&c, config_dir, &err) || pr_trace_read(&trace, "data/sample.trace", &err)) {
        CHECK(0, "oracle %s: %s", ref_path, err.message);
        return;
    }
    if (pr_checkpoint_open(&ck, ref_path, &err)) {
        CHECK(0, "oracle: %s", err.message);
        pr_trace_free(&trace);
        return;
    }
    const pr_group *g = &trace.groups[0];
    size_t ntok = (size_t)g->suffix_off[g->G];
    pr_real ref_loss, *ref_logp = malloc(sizeof(pr_real) * ntok), *logp = malloc(sizeof(pr_real) * ntok);
    const pr_st_tensor *tl = pr_checkpoint_find(ck, "oracle.loss"), *tp = pr_checkpoint_find(ck, "oracle.logprobs");
    CHECK(tl && tp && !pr_checkpoint_read(ck, tl, &ref_loss, 1, &err) && !pr_checkpoint_read(ck, tp, ref_logp, ntok, &err),
          "oracle %s: loss/log-probs missing or wrong size", ref_path);
    for (int sched = 0; sched < 2; sched++) {
        pr_trainer *tr;
        if (pr_trainer_create(&tr, &c, pr_backend_cpu(), &err) || pr_trainer_load(tr, ref_path, &err)) {
            CHECK(0, "oracle: %s", err.message);
            break;
        }
        pr_step_opts o = pr_step_opts_default();
        o.schedule = sched ? PR_SCHEDULE_REUSE : PR_SCHEDULE_BASELINE;
        o.microbatch = sched ? 3 : 2;
        o.layout = PR_LAYOUT_PACKED;
        o.loss.eps_low = 0.2; o.loss.eps_high = 0.28; o.loss.kl_coef = 0.04; o.loss.norm = norm;
        o.moe.scope = PR_AUX_SCOPE_GROUP;    /* the oracle's aux loss spans the group (MoE only) */
        pr_step_stats st;
        CHECK(!pr_trainer_compute_grads(tr, g, &o, &st, logp, &err), "oracle: %s", err.message);
        const double tol = IS_DOUBLE ? 1e-10 : 1e-5;
        CHECK(fabs(st.loss - ref_loss) <= tol * fabs((double)ref_loss), "oracle %s (%s): loss %.12g, oracle %.12g",
              ref_path, sched ? "reuse" : "baseline", st.loss, (double)ref_loss);
        double num = 0, den = 0;
        for (size_t i = 0; i < ntok; i++) { num += pow((double)logp[i] - ref_logp[i], 2); den += pow((double)ref_logp[i], 2); }
        CHECK(sqrt(num / den) <= tol, "oracle %s: log-probs relative error %.3e", ref_path, sqrt(num / den));
        pr_real *gr = grads_of(tr);
        int worst_t = -1;
        double worst = 0;
        for (int ti = 0; ti < pr_trainer_tensor_count(tr); ti++) {
            const pr_tensor_info *info = pr_trainer_tensor(tr, ti);
            char name[160];
            snprintf(name, sizeof name, "oracle.grad.%s", info->name);
            const pr_st_tensor *tg = pr_checkpoint_find(ck, name);
            pr_real *ref = malloc(sizeof(pr_real) * info->numel);
            if (!tg || pr_checkpoint_read(ck, tg, ref, info->numel, &err)) {
                CHECK(0, "oracle %s: %s missing", ref_path, name);
                free(ref);
                continue;
            }
            num = den = 0;
            for (size_t i = 0; i < info->numel; i++) {
                num += pow((double)gr[info->offset + i] - ref[i], 2);
                den += pow((double)ref[i], 2);
            }
            double rel = den > 0 ? sqrt(num / den) : sqrt(num);
            if (rel > worst) { worst = rel; worst_t = ti; }
            CHECK(rel <= tol, "oracle %s (%s): %s relative error %.3e", ref_path, sched ? "reuse" : "baseline", info->name, rel);
            free(ref);
        }
        printf("oracle %s (%s): loss %.10f vs %.10f, worst gradient %s at %.2e\n", ref_path, sched ? "reuse" : "baseline",
               st.loss, (double)ref_loss, worst_t >= 0 ? pr_trainer_tensor(tr, worst_t)->name : "-", worst);
        free(gr);
        pr_trainer_destroy(tr);
    }
    free(ref_logp);
    free(logp);
    pr_checkpoint_close(ck);
    pr_trace_free(&trace);
}

/* ------------------------------------------------------------------ bad input */
static void test_bad_input(void) {
    pr_config c = small_config(0, 0, 2);
    const int S[3] = { 3, 2, 4 };
    test_group t;
    make_group(&t, 5, 3, S, c.vocab_size, 31);
    pr_trainer *tr = make_model(&c, 13);
    pr_error err;
    pr_step_opts o = pr_step_opts_default();
    o.loss.kl_coef = 0.05;
    CHECK(!pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err), "valid step: %s", err.message);
    size_t n = pr_trainer_param_count(tr);
    pr_real *p0 = params_of(tr), *g0 = grads_of(tr);

    struct { const char *what; pr_status want; } cases[] = {
        { "G = 0", PR_ERR_ARG }, { "P = 0", PR_ERR_ARG }, { "empty suffix", PR_ERR_ARG },
        { "token id = vocab", PR_ERR_ARG }, { "negative token id", PR_ERR_ARG }, { "prefix token out of range", PR_ERR_ARG },
        { "over-long sequence", PR_ERR_ARG }, { "negative microbatch", PR_ERR_ARG }, { "unknown layout", PR_ERR_ARG },
        { "KL without reference log-probs", PR_ERR_ARG }, { "eps_low >= 1", PR_ERR_ARG }, { "NaN advantage", PR_ERR_ARG },
        { "NULL group", PR_ERR_ARG },
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        test_group b = t;
        /* re-point the copy's arrays at its own storage */
        pr_group *g = &b.g;
        g->prefix = b.prefix; g->suffix_len = b.len; g->suffix_off = b.off; g->tokens = b.tokens;
        g->advantage = b.adv; g->old_logp = b.old; g->ref_logp = b.ref; g->loss_mask = b.mask;
        pr_step_opts ob = o;
        switch (k) {
        case 0: g->G = 0; break;
        case 1: g->P = 0; break;
        case 2: b.len[1] = 0; b.off[2] = b.off[1]; b.off[3] = b.off[2] + b.len[2]; break;
        case 3: b.tokens[2] = c.vocab_size; break;
        case 4: b.tokens[0] = -1; break;
        case 5: b.prefix[4] = 1000; break;
        case 6: b.len[2] = 200; b.off[3] = b.off[2] + 200; break;   /* arrays are long enough */
        case 7: ob.microbatch = -1; break;
        case 8: ob.layout = (pr_layout)7; break;
        case 9: g->ref_logp = NULL; break;
        case 10: ob.loss.eps_low = 1.5; break;
        case 11: b.adv[1] = (pr_real)NAN; break;
        default: break;
        }
        memset(&err, 0, sizeof err);
        pr_status st = pr_trainer_compute_grads(tr, k == 12 ? NULL : g, &ob, NULL, NULL, &err);
        CHECK(st == cases[k].want && err.message[0], "%s: status %d (%s), want %d", cases[k].what, st, err.message, cases[k].want);
        pr_real *p1 = params_of(tr), *g1 = grads_of(tr);
        CHECK(!memcmp(p0, p1, n * sizeof(pr_real)) && !memcmp(g0, g1, n * sizeof(pr_real)),
              "%s: parameters or gradients changed by a refused call", cases[k].what);
        free(p1); free(g1);
    }

    /* AdamW settings out of range: refused before anything moves */
    struct { const char *what; double lr, wd, clip, eps, beta1; } bad_adam[] = {
        { "lr inf", INFINITY, 0, 0, 1e-8, 0.9 }, { "lr nan", NAN, 0, 0, 1e-8, 0.9 }, { "lr < 0", -1e-3, 0, 0, 1e-8, 0.9 },
        { "weight decay inf", 1e-3, INFINITY, 0, 1e-8, 0.9 }, { "weight decay < 0", 1e-3, -0.1, 0, 1e-8, 0.9 },
        { "clip nan", 1e-3, 0, NAN, 1e-8, 0.9 }, { "clip < 0", 1e-3, 0, -3, 1e-8, 0.9 }, { "eps 0", 1e-3, 0, 0, 0, 0.9 },
        { "eps inf", 1e-3, 0, 0, INFINITY, 0.9 }, { "beta1 1", 1e-3, 0, 0, 1e-8, 1.0 },
    };
    for (size_t k = 0; k < sizeof bad_adam / sizeof *bad_adam; k++) {
        pr_adamw_opts a = pr_adamw_opts_default();
        a.lr = bad_adam[k].lr; a.weight_decay = bad_adam[k].wd; a.max_grad_norm = bad_adam[k].clip;
        a.eps = bad_adam[k].eps; a.beta1 = bad_adam[k].beta1;
        memset(&err, 0, sizeof err);
        CHECK(pr_trainer_adamw_step(tr, &a, NULL, &err) == PR_ERR_ARG && err.message[0], "AdamW %s accepted", bad_adam[k].what);
        pr_real *p1 = params_of(tr), *g1 = grads_of(tr);
        CHECK(!memcmp(p0, p1, n * sizeof(pr_real)) && !memcmp(g0, g1, n * sizeof(pr_real)),
              "AdamW %s: parameters or gradients changed by a refused call", bad_adam[k].what);
        free(p1); free(g1);
    }

    /* a config that does not validate: no trainer, the out-pointer untouched */
    pr_config badc = c;
    badc.num_key_value_heads = 3;
    pr_trainer *sentinel = (pr_trainer *)&badc;
    CHECK(pr_trainer_create(&sentinel, &badc, pr_backend_cpu(), &err) == PR_ERR_CONFIG && sentinel == (pr_trainer *)&badc,
          "heads not divisible by KV heads accepted (%s)", err.message);
    /* wrong buffer sizes */
    CHECK(pr_trainer_set_params(tr, p0, n - 1, &err) == PR_ERR_ARG, "short parameter buffer accepted");

    /* bad calls, one a row: NULL trainers and buffers, counts that are not the model's. Each is
       refused with its status and a message naming the problem; nothing moves. */
    pr_real *buf = malloc(n * sizeof(pr_real));
    double load[4];
    pr_backend mb;
    struct { const char *what; pr_status want; const char *needle; } calls[] = {
        { "get_params NULL trainer", PR_ERR_ARG, "NULL trainer" }, { "get_params NULL buffer", PR_ERR_ARG, "NULL buffer" },
        { "set_params NULL trainer", PR_ERR_ARG, "NULL trainer" }, { "set_params NULL buffer", PR_ERR_ARG, "NULL buffer" },
        { "get_grads NULL trainer", PR_ERR_ARG, "NULL trainer" }, { "get_grads NULL buffer", PR_ERR_ARG, "NULL buffer" },
        { "get_params n + 1", PR_ERR_ARG, "the model has" }, { "get_grads n = 0", PR_ERR_ARG, "the model has" },
        { "set_full_params NULL", PR_ERR_ARG, "NULL" }, { "get_full NULL buffer", PR_ERR_ARG, "NULL" },
        { "init_params NULL trainer", PR_ERR_ARG, "NULL trainer" }, { "compute_grads NULL trainer", PR_ERR_ARG, "NULL trainer" },
        { "compute_grads NULL options", PR_ERR_ARG, "NULL" }, { "expert_load NULL trainer", PR_ERR_ARG, "NULL" },
        { "expert_load dense model", PR_ERR_ARG, "no experts" }, { "create NULL out", PR_ERR_ARG, "NULL" },
        { "create NULL config", PR_ERR_ARG, "NULL" }, { "create NULL backend", PR_ERR_ARG, "NULL" },
        { "create_mesh NULL mesh", PR_ERR_ARG, "NULL mesh" }, { "config_validate NULL", PR_ERR_ARG, "NULL" },
        { "compute_grads_dp NULL comm", PR_ERR_ARG, "NULL" }, { "mesh_init NULL", PR_ERR_ARG, "NULL" },
        { "comm_local_run NULL fn", PR_ERR_ARG, "fn NULL" }, { "comm_local_run 0 ranks", PR_ERR_ARG, "0 ranks" },
    };
    for (size_t k = 0; k < sizeof calls / sizeof *calls; k++) {
        pr_trainer *out = NULL;
        pr_status st = PR_OK;
        memset(&err, 0, sizeof err);
        for (size_t i = 0; i < n; i++) buf[i] = (pr_real)i;
        switch (k) {
        case 0: st = pr_trainer_get_params(NULL, buf, n, &err); break;
        case 1: st = pr_trainer_get_params(tr, NULL, n, &err); break;
        case 2: st = pr_trainer_set_params(NULL, buf, n, &err); break;
        case 3: st = pr_trainer_set_params(tr, NULL, n, &err); break;
        case 4: st = pr_trainer_get_grads(NULL, buf, n, &err); break;
        case 5: st = pr_trainer_get_grads(tr, NULL, n, &err); break;
        case 6: st = pr_trainer_get_params(tr, buf, n + 1, &err); break;
        case 7: st = pr_trainer_get_grads(tr, buf, 0, &err); break;
        case 8: st = pr_trainer_set_full_params(tr, NULL, n, &err); break;
        case 9: st = pr_trainer_get_full(tr, PR_ARENA_GRADS, NULL, n, &err); break;
        case 10: st = pr_trainer_init_params(NULL, 1, &err); break;
        case 11: st = pr_trainer_compute_grads(NULL, &t.g, &o, NULL, NULL, &err); break;
        case 12: st = pr_trainer_compute_grads(tr, &t.g, NULL, NULL, NULL, &err); break;
        case 13: st = pr_trainer_expert_load(NULL, 0, load, 4, &err); break;
        case 14: st = pr_trainer_expert_load(tr, 0, load, 4, &err); break;
        case 15: st = pr_trainer_create(NULL, &c, pr_backend_cpu(), &err); break;
        case 16: st = pr_trainer_create(&out, NULL, pr_backend_cpu(), &err); break;
        case 17: st = pr_trainer_create(&out, &c, NULL, &err); break;
        case 18: st = pr_trainer_create_mesh(&out, &c, pr_backend_cpu(), NULL, &err); break;
        case 19: st = pr_config_validate(NULL, &err); break;
        case 20: st = pr_trainer_compute_grads_dp(tr, NULL, &t.g, 1, &o, NULL, &err); break;
        case 21: st = pr_mesh_init(NULL, NULL, 1, 1, 1, 1, 1, &err); break;
#ifndef PR_NO_THREADS
        case 22: st = pr_comm_local_run(2, NULL, NULL, &err); break;
        case 23: st = pr_comm_local_run(0, NULL, NULL, &err); break;
#else
        case 22: case 23: st = calls[k].want; snprintf(err.message, sizeof err.message, "%s", calls[k].needle); break;
#endif
        default: break;
        }
        CHECK(st == calls[k].want && strstr(err.message, calls[k].needle), "%s: status %d (%s), want %d and \"%s\"",
              calls[k].what, st, err.message, calls[k].want, calls[k].needle);
        CHECK(out == NULL, "%s: a trainer came back", calls[k].what);
        pr_real *p1 = params_of(tr), *g1 = grads_of(tr);
        CHECK(!memcmp(p0, p1, n * sizeof(pr_real)) && !memcmp(g0, g1, n * sizeof(pr_real)),
              "%s: parameters or gradients changed by a refused call", calls[k].what);
        free(p1); free(g1);
    }
    /* the same failures with a NULL error record, and the neutral answers of the accessors */
    CHECK(pr_trainer_get_params(tr, NULL, n, NULL) == PR_ERR_ARG, "NULL buffer, NULL err");
    CHECK(pr_trainer_config(NULL) == NULL, "pr_trainer_config(NULL) is NULL");
    CHECK(pr_trainer_param_count(NULL) == 0 && pr_trainer_full_param_count(NULL) == 0 && pr_trainer_tensor_count(NULL) == 0,
          "counts of a NULL trainer are 0");
    CHECK(pr_trainer_tensor(NULL, 0) == NULL && pr_trainer_tensor(tr, -1) == NULL && pr_trainer_tensor(tr, 1 << 30) == NULL,
          "tensor of a NULL trainer or out of range is NULL");
    CHECK(pr_step_flops(NULL, &t.g, PR_SCHEDULE_REUSE) == 0 && pr_step_flops(&c, NULL, PR_SCHEDULE_REUSE) == 0, "flops of NULL are 0");
    CHECK(pr_backend_measure(NULL, &mb) == NULL && pr_backend_measure(pr_backend_cpu(), NULL) == NULL, "measure backend of NULL");
    double d_ll = 7;
    CHECK(isfinite(pr_grpo_token_loss(-1.0, -1.1, NULL, 0.5, NULL, NULL)), "token loss with NULL options and slope");
    pr_loss_opts lo = pr_step_opts_default().loss;
    CHECK(pr_grpo_token_loss(-1.0, -1.1, NULL, 0.5, NULL, &d_ll) == pr_grpo_token_loss(-1.0, -1.1, NULL, 0.5, &lo, NULL),
          "NULL options are the defaults");
    int owners[2] = { 5, 5 };
    pr_dp_place(&c, NULL, 2, 2, PR_SCHEDULE_REUSE, owners);
    CHECK(owners[0] == 0 && owners[1] == 0, "dp_place without groups: rank 0");
    pr_dp_place(&c, &t.g, 1, 2, PR_SCHEDULE_REUSE, NULL);   /* no owner array: nothing, no crash */
    pr_trainer_destroy(NULL);
    free(buf);

    /* configs whose implied sizes are impossible: refused by pr_trainer_create before anything is
       allocated or named, with the field, its value and the limit. The 10^8-layer config returns
       at once (it used to format a name for every tensor first). */
    struct { const char *what; pr_status want; const char *needle; } cfgs[] = {
        { "num_hidden_layers 100000000", PR_ERR_CONFIG, "num_hidden_layers = 100000000 is larger than the limit 1024" },
        { "vocab_size 50000000", PR_ERR_CONFIG, "vocab_size = 50000000 is larger than the limit 16777216" },
        { "hidden_size 4000000", PR_ERR_CONFIG, "hidden_size = 4000000 is larger than the limit 1048576" },
        { "intermediate_size INT_MAX", PR_ERR_CONFIG, "intermediate_size = 2147483647 is larger than the limit 1048576" },
        { "heads 1024 x head_dim 4096", PR_ERR_CONFIG, "head_dim = 4096 is larger than the limit 2048" },
        { "parameters over PR_MAX_PARAMS", PR_ERR_CONFIG, "more than the limit 1099511627776" },
        { "max_position_embeddings INT_MAX", PR_ERR_CONFIG, "max_position_embeddings = 2147483647" },
    };
    for (size_t k = 0; k < sizeof cfgs / sizeof *cfgs; k++) {
        pr_config b = c;
        switch (k) {
        case 0: b.num_hidden_layers = 100000000; break;
        case 1: b.vocab_size = 50000000; break;
        case 2: b.hidden_size = 4000000; break;
        case 3: b.intermediate_size = 2147483647; break;
        case 4: b.num_attention_heads = b.num_key_value_heads = 1024; b.head_dim = 4096; break;
        case 5: b.vocab_size = 1 << 24; b.hidden_size = 1 << 20; b.num_attention_heads = 1024; b.num_key_value_heads = 1024; break;
        case 6: b.max_position_embeddings = 2147483647; break;
        default: break;
        }
        pr_trainer *out = (pr_trainer *)&b;
        memset(&err, 0, sizeof err);
        struct timespec t0, t1;
        timespec_get(&t0, TIME_UTC);
        pr_status st = pr_trainer_create(&out, &b, pr_backend_cpu(), &err);
        timespec_get(&t1, TIME_UTC);
        CHECK(st == cfgs[k].want && strstr(err.message, cfgs[k].needle) && out == (pr_trainer *)&b,
              "config %s: status %d (%s), want %d and \"%s\"", cfgs[k].what, st, err.message, cfgs[k].want, cfgs[k].needle);
        if (k == 0)
            printf("note: a config of %d layers refused in %.3f ms: %s\n", b.num_hidden_layers,
                   (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6, err.message);
    }
    /* a checkpoint of another shape: refused, parameters untouched */
    char dir[256];
    CHECK(make_scratch_dir(dir, sizeof dir, "shape"), "a scratch folder under %s", test_tmpdir());
    pr_config other = c;
    other.intermediate_size = 44;
    pr_trainer *o2 = make_model(&other, 1);
    CHECK(!pr_trainer_save(o2, dir, PR_DT_F32, 0, &err), "save: %s", err.message);
    CHECK(pr_trainer_load(tr, dir, &err) == PR_ERR_ARG && strstr(err.message, "mlp"), "mismatched checkpoint accepted: %s", err.message);
    pr_real *p1 = params_of(tr);
    CHECK(!memcmp(p0, p1, n * sizeof(pr_real)), "a refused load changed the parameters");
    CHECK(pr_trainer_load(tr, "/nonexistent/checkpoint", &err) == PR_ERR_IO, "missing checkpoint: %s", err.message);
    free(p1);
    pr_trainer_destroy(o2);
    remove_tree(dir, 1);
    free(p0); free(g0);
    pr_trainer_destroy(tr);
}

/* ------------------------------------------------------------------ determinism and checkpoints */
static void test_determinism(void) {
    pr_config c = small_config(1, 0, 2);
    const int S[4] = { 3, 7, 1, 5 };
    test_group t;
    make_group(&t, 10, 4, S, c.vocab_size, 41);
    pr_trainer *tr = make_model(&c, 17);
    pr_step_opts o = pr_step_opts_default();
    o.microbatch = 3;
    pr_error err;
    pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err);
    pr_real *a = grads_of(tr);
    pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err);
    pr_real *b = grads_of(tr);
    CHECK(!memcmp(a, b, sizeof(pr_real) * pr_trainer_param_count(tr)), "two runs of the same step differ");
    free(a); free(b);
    pr_trainer_destroy(tr);
}

/* ------------------------------------------------------------------ MoE */
static pr_config moe_config(int norm_topk) {
    pr_config c = small_config(1, 0, 2);
    strcpy(c.model_type, "qwen3_moe");
    c.num_experts = 5;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 7;
    c.norm_topk_prob = norm_topk;
    c.router_aux_loss_coef = 0.3;     /* large, so that the aux term moves the gradients visibly */
    return c;
}

/* The largest per-tensor relative difference of two gradient arenas. */
static double worst_rel(pr_trainer *tr, const pr_real *a, const pr_real *b) {
    double worst = 0;
    for (int t = 0; t < pr_trainer_tensor_count(tr); t++) {
        const pr_tensor_info *ti = pr_trainer_tensor(tr, t);
        double num = 0, den = 0;
        for (size_t i = 0; i < ti->numel; i++) {
            double d = (double)a[ti->offset + i] - b[ti->offset + i];
            num += d * d;
            den += (double)b[ti->offset + i] * b[ti->offset + i];
        }
        if (den > 0 && sqrt(num / den) > worst) worst = sqrt(num / den);
    }
    return worst;
}

static void test_moe(void) {
    const int S[5] = { 6, 1, 9, 3, 4 };
    const int Gs[3] = { 1, 3, 5 };
    int cases = 0;
    for (int scope = 0; scope < 2; scope++)
        for (int gi = 0; gi < 3; gi++) {
            int G = Gs[gi], mbs[3] = { 1, 2, G };
            for (int mi = 0; mi < 3; mi++)
                for (int lay = 0; lay < 2; lay++) {
                    pr_config c = moe_config((gi + lay) % 2);
                    pr_moe_opts mo = { (pr_aux_scope)scope, 0 };
                    char label[160];
                    snprintf(label, sizeof label, "MoE %s scope, norm_topk %d, G %d, microbatch %d, %s",
                             scope ? "group" : "microbatch", c.norm_topk_prob, G, mbs[mi], lay ? "packed" : "padded");
                    equivalence_case_moe(&c, 4 + 3 * gi, G, S, mbs[mi], mbs[mi], (pr_layout)lay,
                                         mi % 2 ? PR_NORM_SEQ_MEAN_TOKEN_MEAN : PR_NORM_TOKEN_MEAN, &mo, label);
                    cases++;
                }
        }
    printf("MoE equivalence: %d cases (both aux scopes) on loss, aux loss, log-probs, gradients, parameters\n", cases);

    /* negative control: a prefix token counted once instead of m times must be seen */
    pr_config c = moe_config(1);
    test_group t;
    make_group(&t, 8, 3, S, c.vocab_size, 99);
    for (int scope = 0; scope < 2; scope++) {
        pr_trainer *a = make_model(&c, 5), *b = make_model(&c, 5);
        pr_step_opts oa = pr_step_opts_default(), ob;
        oa.microbatch = scope ? 1 : 2;   /* group: through the routing pre-pass; microbatch: m = 2, not 1 */
        oa.moe.scope = (pr_aux_scope)scope;
        oa.schedule = PR_SCHEDULE_BASELINE;
        ob = oa;
        ob.schedule = PR_SCHEDULE_REUSE;
        ob.moe.prefix_multiplicity = 1;
        pr_step_stats sa, sb;
        pr_error err;
        int ok = !pr_trainer_compute_grads(a, &t.g, &oa, &sa, NULL, &err) && !pr_trainer_compute_grads(b, &t.g, &ob, &sb, NULL, &err);
        pr_real *ga = grads_of(a), *gb = grads_of(b);
        double w = ok ? worst_rel(a, gb, ga) : 0;
        CHECK(ok && w > 1e-3 && fabs(sa.aux_loss - sb.aux_loss) > 1e-3 * sa.aux_loss,
              "negative control (%s scope): counting the prefix once stays within %.2e of the baseline (aux %.6g vs %.6g)",
              scope ? "group" : "microbatch", w, sa.aux_loss, sb.aux_loss);
        printf("MoE negative control (%s scope): prefix counted once -> worst gradient difference %.2e, aux %.6f vs %.6f\n",
               scope ? "group" : "microbatch", w, sa.aux_loss, sb.aux_loss);
        /* the expert load is logical: k choices for every token the baseline runs */
        double load[5], total_a = 0, total_b = 0;
        for (int l = 0; l < c.num_hidden_layers; l++) {
            pr_trainer_expert_load(a, l, load, 5, NULL);
            for (int e = 0; e < 5; e++) total_a += load[e];
            pr_trainer_expert_load(b, l, load, 5, NULL);
            for (int e = 0; e < 5; e++) total_b += load[e];
        }
        double tokens = (double)t.g.G * t.g.P + (double)t.g.suffix_off[t.g.G];
        CHECK(total_a == 2 * 2 * tokens && total_b == total_a, "expert load: %g and %g routings, expected %g", total_a, total_b,
              4 * tokens);
        free(ga); free(gb);
        pr_trainer_destroy(a);
        pr_trainer_destroy(b);
    }

    /* a router of zeros ties every expert: each token's k choices are the k lowest indices */
    {
        pr_trainer *tr = make_model(&c, 6);
        size_t n = pr_trainer_param_count(tr);
        pr_real *w = (pr_real *)malloc(sizeof(pr_real) * n);
        pr_trainer_get_params(tr, w, n, NULL);
        for (int i = 0; i < pr_trainer_tensor_count(tr); i++) {
            const pr_tensor_info *ti = pr_trainer_tensor(tr, i);
            if (strstr(ti->name, "mlp.gate.weight")) memset(w + ti->offset, 0, sizeof(pr_real) * ti->numel);
        }
        pr_trainer_set_params(tr, w, n, NULL);
        pr_step_opts o = pr_step_opts_default();
        pr_step_stats s;
        int ok = !pr_trainer_compute_grads(tr, &t.g, &o, &s, NULL, NULL);
        double tokens = (double)t.g.G * t.g.P + (double)t.g.suffix_off[t.g.G], load[5];
        for (int l = 0; ok && l < c.num_hidden_layers; l++) {
            pr_trainer_expert_load(tr, l, load, 5, NULL);
            ok = load[0] == tokens && load[1] == tokens && load[2] == 0 && load[3] == 0 && load[4] == 0;
        }
        CHECK(ok, "MoE ties: a zero router must send every token to experts 0 and 1");
        free(w);
        pr_trainer_destroy(tr);
    }

    /* The host's routing runs on every core: its bits are the same on any number of threads
       (13 experts: blocks of 8 and 5 in the routing sums; 3 threads, more than the blocks' 2).
       Loss, aux loss, both layers' expert load and gradients, both schedules and aux scopes, three
       draws: a sum split between threads changes the loss's last bits in about one case in four in
       the double build (in float the probabilities' sums in double are exact whatever the order). */
#ifdef _OPENMP
    {
        pr_config cm = moe_config(1);
        cm.num_experts = 13;
        cm.num_experts_per_tok = 3;
        const int S6[6] = { 17, 9, 30, 1, 22, 12 }, threads0 = omp_get_max_threads();
        int same = 0, steps = 0;
        for (int seed = 1; seed <= 3; seed++)
            for (int scope = 0; scope < 2; scope++)
                for (int sched = 0; sched < 2; sched++, steps++) {
                    test_group tm;
                    make_group(&tm, 40, 6, S6, cm.vocab_size, 100 + seed);
                    pr_real *g[2];
                    size_t n = 0;
                    double loss[2][2], load[2][2 * 13] = { { 0 } };
                    int ok = 1;
                    for (int i = 0; i < 2; i++) {
                        omp_set_num_threads(i ? 3 : 1);
                        pr_trainer *tr = make_model(&cm, seed);
                        pr_step_opts o = pr_step_opts_default();
                        o.microbatch = 2;
                        o.moe.scope = (pr_aux_scope)scope;
                        o.schedule = sched ? PR_SCHEDULE_REUSE : PR_SCHEDULE_BASELINE;
                        pr_step_stats s = { 0 };
                        ok = ok && !pr_trainer_compute_grads(tr, &tm.g, &o, &s, NULL, NULL) &&
                             !pr_trainer_expert_load(tr, 0, load[i], 13, NULL) && !pr_trainer_expert_load(tr, 1, load[i] + 13, 13, NULL);
                        loss[i][0] = s.loss;
                        loss[i][1] = s.aux_loss;
                        g[i] = grads_of(tr);
                        n = pr_trainer_param_count(tr);
                        pr_trainer_destroy(tr);
                    }
                    same += ok && !memcmp(loss[0], loss[1], sizeof loss[0]) && !memcmp(load[0], load[1], sizeof load[0]) &&
                            !memcmp(g[0], g[1], sizeof(pr_real) * n);
                    free(g[0]);
                    free(g[1]);
                }
        omp_set_num_threads(threads0);
        CHECK(same == steps, "MoE on 1 and 3 threads: %d of %d steps differ in their bits", steps - same, steps);
    }
#endif

    /* the preset round-trips through config.json (refused MoE configurations: test_io's table) */
    pr_config q, back;
    pr_error err;
    char dir[256], path[600];
    CHECK(make_scratch_dir(dir, sizeof dir, "moecfg"), "a scratch folder under %s", test_tmpdir());
    snprintf(path, sizeof path, "%s/config.json", dir);
    CHECK(!pr_config_load(&q, "model/qwen3-30b-a3b", &err) && q.num_experts == 128 && q.num_experts_per_tok == 8 &&
          q.moe_intermediate_size == 768 && q.norm_topk_prob == 1, "qwen3-30b-a3b preset: %s", err.message);
    CHECK(!pr_config_save(&q, path, &err) && !pr_config_load(&back, path, &err) && !memcmp(&q, &back, sizeof q),
          "MoE config round trip: %s", err.message);
    remove(path);
    rmdir(dir);
}

/* ------------------------------------------------------------------ data parallelism */
typedef struct {
    pr_trainer *tr[4];
    const pr_group *groups;
    int n;
    pr_step_opts opt;
    double loss[4];
    pr_step_stats stats[4];
    pr_real *grads0;
} dp_run;

static pr_status dp_rank(pr_comm *c, void *user, pr_error *err) {
    dp_run *d = user;
    pr_step_stats st;
    pr_status s = pr_trainer_compute_grads_dp(d->tr[c->rank], c, d->groups, d->n, &d->opt, &st, err);
    if (s) return s;
    d->loss[c->rank] = st.loss;
    d->stats[c->rank] = st;
    if (c->rank == 0 && (s = pr_trainer_get_grads(d->tr[0], d->grads0, pr_trainer_param_count(d->tr[0]), err))) return s;
    pr_adamw_opts adam = pr_adamw_opts_default();   /* clipping rescales the arena: gradients are read before */
    return pr_trainer_adamw_step(d->tr[c->rank], &adam, NULL, err);
}

/* A group split over dp ranks keeps its team from step to step over the mesh's dp communicator
   (an NCCL split sets up a whole communicator): through a step over another communicator, not
   where one rank has dropped its team (as after a failed step: every rank then splits again), and
   not when the step's group count changes. Each step's gradients and updated parameters equal,
   bit for bit, those of a trainer without a mesh stepping over the world, whose team is split
   anew every step. */
enum { TEAM_RANKS = 4, TEAM_STEPS = 6 };
static const int team_groups[TEAM_STEPS] = { 2, 2, 2, 2, 3, 1 };   /* groups a step: split in two (4 times), 1 1 2, all four */
typedef struct {
    const pr_config *c;
    const pr_group *groups;
    const pr_real *init;
    int through[TEAM_RANKS], kept[TEAM_RANKS], resplit[TEAM_RANKS], replaced[TEAM_RANKS], whole[TEAM_RANKS];
    int unmeshed_kept[TEAM_RANKS];
    size_t differ[TEAM_RANKS];
} team_run;

static pr_status team_rank(pr_comm *world, void *user, pr_error *err) {
    team_run *t = user;
    const int r = world->rank;
    pr_mesh mesh;
    pr_status s = pr_mesh_init(&mesh, world, TEAM_RANKS, 1, 1, 1, 1, err);
    if (s) return s;
    pr_trainer *a = NULL, *b = NULL;
    size_t n = 0;
    if (!(s = pr_trainer_create_mesh(&a, t->c, pr_backend_cpu(), &mesh, err)) && !(s = pr_trainer_create(&b, t->c, pr_backend_cpu(), err))) {
        n = pr_trainer_param_count(b);
        s = pr_trainer_set_full_params(a, t->init, n, err);
        if (!s) s = pr_trainer_set_params(b, t->init, n, err);
    }
    pr_real *va = malloc(sizeof(pr_real) * 2 * (n ? n : 1)), *vb = va ? va + n : NULL;
    if (!s && !va) s = pr__fail(err, PR_ERR_NOMEM, "team test: out of memory");
    pr_step_opts o = pr_step_opts_default();
    o.microbatch = 2;
    const pr_adamw_opts adam = pr_adamw_opts_default();
    size_t one_step = 0;                         /* a team's traffic after one step */
    for (int k = 0; k < TEAM_STEPS && !s; k++) {
        if (k == 3 && r == 1 && a->dp_team) {    /* rank 1 drops its team, as after a failed step */
            a->dp_team->destroy(a->dp_team);
            a->dp_team = NULL;
        }
        s = pr_trainer_compute_grads_dp(a, k == 1 ? world : mesh.dp_comm, t->groups, team_groups[k], &o, NULL, err);
        if (!s) s = pr_trainer_compute_grads_dp(b, world, t->groups, team_groups[k], &o, NULL, err);
        for (int what = 0; what < 2 && !s; what++) {     /* the gradients, then the parameters after AdamW */
            if (what && !(s = pr_trainer_adamw_step(a, &adam, NULL, err))) s = pr_trainer_adamw_step(b, &adam, NULL, err);
            if (!s) s = what ? pr_trainer_get_params(a, va, n, err) : pr_trainer_get_grads(a, va, n, err);
            if (!s) s = what ? pr_trainer_get_params(b, vb, n, err) : pr_trainer_get_grads(b, vb, n, err);
            if (!s) t->differ[r] += memcmp(va, vb, sizeof(pr_real) * n) != 0;
        }
        if (s || !a->dp_team) break;
        /* kept: the same team, its traffic counted on from the step before; split again: one step's */
        const size_t now = a->dp_team->bytes_sent;
        if (k == 0) one_step = now;
        if (k == 1) t->through[r] = now == one_step;
        if (k == 2) t->kept[r] = a->dp_team->size == 2 && now == 2 * one_step && one_step > 0;
        if (k == 3) t->resplit[r] = a->dp_team->size == 2 && now == one_step;
        if (k == 4) t->replaced[r] = a->dp_team_groups == 3 && a->dp_team->size == (r < 2 ? 1 : 2);
        if (k == 5) t->whole[r] = a->dp_team_groups == 1 && a->dp_team->size == TEAM_RANKS;
        t->unmeshed_kept[r] += b->dp_team != NULL;
    }
    free(va);
    pr_trainer_destroy(a);
    pr_trainer_destroy(b);
    pr_mesh_free(&mesh);
    return s;
}

static void test_dp_team_kept(void) {
    pr_config c = small_config(0, 0, 2);
    const int S[6] = { 4, 7, 2, 5, 3, 6 };
    static test_group tg[3];
    pr_group groups[3];
    for (int i = 0; i < 3; i++) {
        make_group(&tg[i], 5 + 3 * i, 3 + i % 2, S, c.vocab_size, 700 + i);
        groups[i] = tg[i].g;
    }
    pr_trainer *one = make_model(&c, 17);
    team_run t;
    memset(&t, 0, sizeof t);
    t.c = &c;
    t.groups = groups;
    t.init = params_of(one);
    pr_error err;
    CHECK(!pr_comm_local_run(TEAM_RANKS, team_rank, &t, &err), "dp teams kept: %s", err.message);
    for (int r = 0; r < TEAM_RANKS; r++) {
        CHECK(t.differ[r] == 0, "dp teams kept, rank %d: %zu of %d gradients or parameters differ from fresh teams'", r, t.differ[r],
              2 * TEAM_STEPS);
        CHECK(t.through[r], "dp teams kept, rank %d: a step over another communicator touched the kept team", r);
        CHECK(t.kept[r], "dp teams kept, rank %d: the third step of 2 groups did not keep the first one's team", r);
        CHECK(t.resplit[r], "dp teams kept, rank %d: with rank 1's team dropped, the step did not split a new one", r);
        CHECK(t.replaced[r], "dp teams kept, rank %d: a step of 3 groups did not get its own team", r);
        CHECK(t.whole[r], "dp teams kept, rank %d: a step of 1 group did not get a team of all ranks", r);
        CHECK(!t.unmeshed_kept[r], "dp teams kept, rank %d: a trainer without a mesh kept a team", r);
    }
    free((void *)t.init);
    pr_trainer_destroy(one);
}

static void test_dp(void) {
    pr_config c = small_config(0, 0, 2);
    const int S[6] = { 4, 7, 2, 5, 3, 6 };
    static test_group tg[5];
    pr_group groups[5];
    for (int i = 0; i < 5; i++) {
        make_group(&tg[i], 3 + 4 * i, 2 + i % 3, S, c.vocab_size, 500 + i);
        groups[i] = tg[i].g;
    }
    for (int sched = 0; sched < 2; sched++) {
        /* one rank alone: every group's gradients accumulated, then AdamW */
        pr_trainer *ref = make_model(&c, 5);
        pr_step_opts o = pr_step_opts_default();
        o.schedule = sched ? PR_SCHEDULE_REUSE : PR_SCHEDULE_BASELINE;
        o.microbatch = 2;
        pr_error err;
        double ref_loss = 0;
        for (int i = 0; i < 5; i++) {
            pr_step_stats st;
            o.accumulate = i > 0;
            CHECK(!pr_trainer_compute_grads(ref, &groups[i], &o, &st, NULL, &err), "dp reference: %s", err.message);
            ref_loss += st.loss;
        }
        o.accumulate = 0;
        pr_real *gref = grads_of(ref);
        pr_adamw_opts adam = pr_adamw_opts_default();
        pr_trainer_adamw_step(ref, &adam, NULL, &err);
        pr_real *pref = params_of(ref);
        for (int ranks = 2; ranks <= 3; ranks++) {
            dp_run d;
            memset(&d, 0, sizeof d);
            for (int r = 0; r < ranks; r++) d.tr[r] = make_model(&c, 5);
            d.groups = groups;
            d.grads0 = malloc(sizeof(pr_real) * pr_trainer_param_count(ref));
            d.n = 5;
            d.opt = o;
            pr_status st = pr_comm_local_run(ranks, dp_rank, &d, &err);
            CHECK(st == PR_OK, "dp %d ranks: %s", ranks, err.message);
            char label[64];
            snprintf(label, sizeof label, "dp %d ranks, %s", ranks, sched ? "reuse" : "baseline");
            double loss = 0;
            for (int r = 0; r < ranks; r++) loss += d.loss[r];
            CHECK(fabs(loss - ref_loss) <= (IS_DOUBLE ? 1e-12 : 1e-5) * fabs(ref_loss), "%s: loss %.15g vs %.15g", label, loss, ref_loss);
            pr_real *g0 = d.grads0, *p0 = params_of(d.tr[0]);
            CHECK(close_arenas(ref, g0, gref, "gradient", label), "%s: summed gradients vs one rank", label);
            CHECK(close_arenas(ref, p0, pref, "parameter", label), "%s: parameters after AdamW vs one rank", label);
            for (int r = 1; r < ranks; r++) {
                pr_real *pr = params_of(d.tr[r]);
                CHECK(!memcmp(pr, p0, sizeof(pr_real) * pr_trainer_param_count(ref)), "%s: rank %d's parameters differ from rank 0's", label, r);
                free(pr);
            }
            free(g0); free(p0);
            for (int r = 0; r < ranks; r++) pr_trainer_destroy(d.tr[r]);
        }
        free(gref); free(pref);
        pr_trainer_destroy(ref);
    }
    /* placement: charged by the schedule's FLOPs, costliest first onto the least loaded rank */
    int owner[5];
    pr_dp_place(&c, groups, 5, 2, PR_SCHEDULE_REUSE, owner);
    double load[2] = { 0, 0 };
    for (int i = 0; i < 5; i++) load[owner[i]] += pr_step_flops(&c, &groups[i], PR_SCHEDULE_REUSE);
    double most = 0;
    for (int i = 0; i < 5; i++) most = fmax(most, pr_step_flops(&c, &groups[i], PR_SCHEDULE_REUSE));
    CHECK(fabs(load[0] - load[1]) <= most, "dp placement: loads %.3g and %.3g differ by more than one group", load[0], load[1]);

    /* a malformed group (a negative suffix length, then no lengths at all) is refused over dp as it
       is on one rank, before the placement reads it; the placement itself places every group, also
       one whose lengths make its FLOPs negative */
    int len[3] = { 4, -40, 2 };
    pr_group bad[2] = { groups[0], groups[1] };
    bad[1].suffix_len = len;
    for (int v = 0; v < 2; v++) {
        if (v) bad[1].suffix_len = NULL;
        for (int ranks = 1; ranks <= 2; ranks++) {
            dp_run d;
            memset(&d, 0, sizeof d);
            for (int r = 0; r < ranks; r++) d.tr[r] = make_model(&c, 5);
            d.groups = bad;
            d.n = 2;
            d.opt = pr_step_opts_default();
            d.opt.schedule = PR_SCHEDULE_REUSE;
            pr_error err;
            pr_status st = pr_comm_local_run(ranks, dp_rank, &d, &err);
            CHECK(st == PR_ERR_ARG && strstr(err.message, "suffix_len"), "dp %d ranks, a group %s: status %d (%s)", ranks,
                  v ? "without suffix lengths" : "with a negative suffix length", st, err.message);
            for (int r = 0; r < ranks; r++) pr_trainer_destroy(d.tr[r]);
        }
    }
    bad[1].suffix_len = len;
    int placed[2] = { -1, -1 };
    pr_dp_place(&c, bad, 2, 2, PR_SCHEDULE_REUSE, placed);
    CHECK(pr_step_flops(&c, &bad[1], PR_SCHEDULE_REUSE) < 0 && placed[0] >= 0 && placed[0] < 2 && placed[1] >= 0 && placed[1] < 2,
          "dp placement of a negative-cost group: owners %d, %d", placed[0], placed[1]);
}

/* The step's diagnostics (pr_step_stats loss_tokens, kl_sum, clipped_tokens) against a formula of
   their own, from the log-probs the step returns: a token is clipped when its ratio left the band
   on the side its advantage pushes it. Both schedules; then over two dp ranks, with whole groups and
   with one group split over both, the ranks' sums add up to one rank's. */
static void test_step_metrics(void) {
    pr_config c = small_config(0, 0, 2);
    const int S[6] = { 4, 7, 2, 5, 3, 6 };
    static test_group tg[3];
    pr_group groups[3];
    for (int i = 0; i < 3; i++) {
        make_group(&tg[i], 5 + 3 * i, 3 + i, S, c.vocab_size, 610 + i);
        groups[i] = tg[i].g;
    }
    pr_step_opts o = pr_step_opts_default();
    o.loss.kl_coef = 0.05;
    o.microbatch = 2;
    pr_error err;
    pr_step_stats one[2][3];       /* each group alone on one rank, by schedule */
    long tok_all = 0, clip_all = 0;
    for (int i = 0; i < 3; i++)
        for (int sched = 0; sched < 2; sched++) {
            const pr_group *g = &groups[i];
            pr_trainer *tr = make_model(&c, 5);
            pr_real lp[4096];
            pr_step_stats st;
            o.schedule = sched ? PR_SCHEDULE_REUSE : PR_SCHEDULE_BASELINE;
            CHECK(!pr_trainer_compute_grads(tr, g, &o, &st, lp, &err), "metrics: %s", err.message);
            long tok = 0, clip = 0;
            double kl = 0;
            for (int t = 0; t < g->G; t++)
                for (int64_t f = g->suffix_off[t]; f < g->suffix_off[t + 1]; f++) {
                    if (!g->loss_mask[f]) continue;
                    const double r = exp((double)lp[f] - g->old_logp[f]), A = g->advantage[t], d = (double)g->ref_logp[f] - lp[f];
                    tok++;
                    clip += (A > 0 && r > 1 + o.loss.eps_high) || (A < 0 && r < 1 - o.loss.eps_low);
                    kl += exp(d) - d - 1;
                }
            CHECK(st.loss_tokens == tok && st.clipped_tokens == clip && fabs(st.kl_sum - kl) <= 1e-12 * kl,
                  "metrics, group %d, %s: tokens %ld clipped %ld kl %.17g, want %ld %ld %.17g", i, sched ? "reuse" : "baseline",
                  st.loss_tokens, st.clipped_tokens, st.kl_sum, tok, clip, kl);
            one[sched][i] = st;
            if (sched) {
                tok_all += tok;
                clip_all += clip;
            }
            pr_trainer_destroy(tr);
        }
    CHECK(clip_all > 0 && clip_all < tok_all && one[1][0].kl_sum > 0, "metrics: the groups need clipped and unclipped tokens (%ld of %ld)",
          clip_all, tok_all);
    for (int k = 0; k < 4; k++) {               /* 3 groups over 2 ranks; 1 group split over both; each schedule */
        const int n = k % 2 ? 1 : 3, sched = k / 2;
        o.schedule = sched ? PR_SCHEDULE_REUSE : PR_SCHEDULE_BASELINE;
        dp_run d;
        memset(&d, 0, sizeof d);
        for (int r = 0; r < 2; r++) d.tr[r] = make_model(&c, 5);
        d.groups = groups;
        d.n = n;
        d.opt = o;
        d.grads0 = malloc(sizeof(pr_real) * pr_trainer_param_count(d.tr[0]));
        CHECK(pr_comm_local_run(2, dp_rank, &d, &err) == PR_OK, "metrics over dp: %s", err.message);
        long tok = 0, clip = 0, want_tok = 0, want_clip = 0;
        double kl = 0, want_kl = 0;
        for (int r = 0; r < 2; r++) { tok += d.stats[r].loss_tokens; clip += d.stats[r].clipped_tokens; kl += d.stats[r].kl_sum; }
        for (int i = 0; i < n; i++) {
            want_tok += one[sched][i].loss_tokens;
            want_clip += one[sched][i].clipped_tokens;
            want_kl += one[sched][i].kl_sum;
        }
        CHECK(tok == want_tok && clip == want_clip && fabs(kl - want_kl) <= 1e-12 * want_kl,
              "metrics over dp, %d groups, %s: tokens %ld clipped %ld kl %.17g, want %ld %ld %.17g", n, sched ? "reuse" : "baseline", tok, clip, kl, want_tok, want_clip, want_kl);
        free(d.grads0);
        for (int r = 0; r < 2; r++) pr_trainer_destroy(d.tr[r]);
    }
}

/* ------------------------------------------------------------------ steps of several groups */
/* A step's loss by its mode's formula (README "The loss over a step"), from per-token losses
   pr_grpo_token_loss computes on the log-probs the step reported: the independent reference for
   the step-wide denominators. norm_len 0: the step's longest suffix. */
static double step_loss_by_formula(const pr_group *groups, int n, pr_real *const *logp, const pr_loss_opts *lo, long norm_len) {
    double T = 0, N = 0, L = (double)norm_len, sum = 0, seq_means = 0;
    for (int k = 0; k < n; k++) {
        const pr_group *g = &groups[k];
        N += g->G;
        for (int i = 0; i < g->G; i++) {
            double s_i = 0, n_i = 0;
            if (!norm_len && g->suffix_len[i] > L) L = g->suffix_len[i];
            for (int64_t f = g->suffix_off[i]; f < g->suffix_off[i + 1]; f++) {
                if (!g->loss_mask[f]) continue;
                s_i += pr_grpo_token_loss((double)logp[k][f], (double)g->old_logp[f], g->ref_logp ? &g->ref_logp[f] : NULL,
                                          (double)g->advantage[i], lo, NULL);
                n_i += 1;
            }
            T += n_i;
            sum += s_i;
            if (n_i > 0) seq_means += s_i / n_i;
        }
    }
    switch (lo->norm) {
    case PR_NORM_TOKEN_MEAN: return sum / T;
    case PR_NORM_SEQ_MEAN_TOKEN_MEAN: return seq_means / N;
    case PR_NORM_SEQ_MEAN_TOKEN_SUM: return sum / N;
    default: return sum / L;
    }
}

/* One step of n groups on one trainer, groups accumulated in order: its loss (summed), each group's
   log-probs into logp[k], its gradients. */
static pr_status run_step(pr_trainer *tr, const pr_group *groups, int n, pr_step_opts o, double *loss, pr_real **logp, pr_error *err) {
    *loss = 0;
    for (int k = 0; k < n; k++) {
        pr_step_stats st;
        o.accumulate = k > 0;
        pr_status s = pr_trainer_compute_grads(tr, &groups[k], &o, &st, logp ? logp[k] : NULL, err);
        if (s) return s;
        *loss += st.loss;
    }
    return PR_OK;
}

static void test_steps(void) {
    pr_config c = small_config(0, 0, 2);
    const int S[6] = { 4, 9, 1, 5, 3, 7 };
    static test_group tg[3];
    pr_group groups[3];
    const int P[3] = { 5, 2, 11 }, G[3] = { 3, 5, 2 };
    for (int k = 0; k < 3; k++) {
        make_group(&tg[k], P[k], G[k], S + k, c.vocab_size, 900 + k);
        groups[k] = tg[k].g;
    }
    for (int64_t f = tg[1].off[2]; f < tg[1].off[3]; f++) tg[1].mask[f] = 0;   /* a trajectory with no trained token */
    const double tol = IS_DOUBLE ? 1e-12 : 1e-5;
    pr_error err;
    for (int mode = 0; mode < 5; mode++) {
        const pr_loss_norm norm = (pr_loss_norm)(mode < 4 ? mode : PR_NORM_SEQ_MEAN_TOKEN_SUM_NORM);
        const long norm_len = mode == 4 ? 50 : 0;     /* sum-norm with the step's longest suffix, then a set length */
        char label[128];
        pr_step_opts base = pr_step_opts_default();
        base.loss.kl_coef = 0.05;
        base.loss.norm = norm;
        CHECK(!pr_step_loss_totals(groups, 3, norm_len, &base.loss.step, &err), "totals: %s", err.message);
        CHECK(base.loss.step.trajectories == 10 && base.loss.step.norm_len == (norm_len ? norm_len : 9),
              "totals: %lld trajectories, length %lld", (long long)base.loss.step.trajectories, (long long)base.loss.step.norm_len);
        base.schedule = PR_SCHEDULE_BASELINE;
        base.microbatch = 1;
        /* the baseline's step, and its loss against the formula on its own log-probs */
        pr_trainer *ref = make_model(&c, 5);
        pr_real lp[3][256], *logp[3] = { lp[0], lp[1], lp[2] };
        double ref_loss;
        CHECK(!run_step(ref, groups, 3, base, &ref_loss, logp, &err), "step baseline: %s", err.message);
        double formula = step_loss_by_formula(groups, 3, logp, &base.loss, norm_len);
        snprintf(label, sizeof label, "step of 3 groups, %s%s", pr_loss_norm_name(norm), norm_len ? " (length 50)" : "");
        CHECK(fabs(ref_loss - formula) <= tol * fabs(formula), "%s: baseline loss %.17g, the formula %.17g", label, ref_loss, formula);
        pr_real *gref = grads_of(ref);
        /* the reuse schedule, the same step cut into other microbatches and layouts */
        const int mbs[3] = { 1, 2, 0 };
        for (int m = 0; m < 3; m++) {
            pr_trainer *tr = make_model(&c, 5);
            pr_step_opts o = base;
            o.schedule = PR_SCHEDULE_REUSE;
            o.microbatch = mbs[m];
            o.layout = m == 1 ? PR_LAYOUT_PACKED : PR_LAYOUT_PADDED;
            pr_real rp[3][256], *rlogp[3] = { rp[0], rp[1], rp[2] };
            double loss;
            char l2[192];
            snprintf(l2, sizeof l2, "%s, reuse microbatch %d %s", label, mbs[m], m == 1 ? "packed" : "padded");
            CHECK(!run_step(tr, groups, 3, o, &loss, rlogp, &err), "%s: %s", l2, err.message);
            double f2 = step_loss_by_formula(groups, 3, rlogp, &o.loss, norm_len);
            CHECK(fabs(loss - ref_loss) <= tol * fabs(ref_loss) && fabs(loss - f2) <= tol * fabs(f2),
                  "%s: loss %.17g, baseline %.17g, formula %.17g", l2, loss, ref_loss, f2);
            pr_real *g = grads_of(tr);
            CHECK(close_arenas(tr, g, gref, "gradient", l2), "%s: gradients vs the baseline's step", l2);
            free(g);
            pr_trainer_destroy(tr);
        }
        /* over 2, 3 and 4 in-process DP ranks placing the step's groups (4: more ranks than groups,
           each group split over a team) */
        for (int ranks = 2; ranks <= 4; ranks++) {
            dp_run d;
            memset(&d, 0, sizeof d);
            for (int r = 0; r < ranks; r++) d.tr[r] = make_model(&c, 5);
            d.groups = groups;
            d.n = 3;
            d.opt = base;
            d.opt.schedule = PR_SCHEDULE_REUSE;
            d.opt.microbatch = 2;
            d.grads0 = malloc(sizeof(pr_real) * pr_trainer_param_count(ref));
            char l2[192];
            snprintf(l2, sizeof l2, "%s, dp %d", label, ranks);
            CHECK(!pr_comm_local_run(ranks, dp_rank, &d, &err), "%s: %s", l2, err.message);
            double loss = 0;
            for (int r = 0; r < ranks; r++) loss += d.loss[r];
            CHECK(fabs(loss - ref_loss) <= tol * fabs(ref_loss), "%s: loss %.17g vs %.17g", l2, loss, ref_loss);
            CHECK(close_arenas(ref, d.grads0, gref, "gradient", l2), "%s: summed gradients vs one rank", l2);
            free(d.grads0);
            for (int r = 0; r < ranks; r++) pr_trainer_destroy(d.tr[r]);
        }
        /* negative control: each group normalised alone is another loss (except where the modes
           coincide: sum-norm with every group's longest suffix equal to the step's is not the case here) */
        pr_step_opts alone = base;
        memset(&alone.loss.step, 0, sizeof alone.loss.step);
        double alone_loss;
        CHECK(!run_step(ref, groups, 3, alone, &alone_loss, NULL, &err), "groups alone: %s", err.message);
        CHECK(fabs(alone_loss - ref_loss) > 1e-3 * fabs(ref_loss), "%s: normalising each group alone gives the same loss %.17g: "
              "the test could not tell the step's denominators from the groups'", label, alone_loss);
        free(gref);
        pr_trainer_destroy(ref);
    }
    /* one group alone, no totals given: the group is its own step, the same numbers as totals over
       that one group, bit for bit, and the formula over the group */
    for (int mode = 0; mode < 4; mode++) {
        pr_step_opts o = pr_step_opts_default(), with;
        o.loss.norm = (pr_loss_norm)mode;
        o.schedule = PR_SCHEDULE_REUSE;
        o.microbatch = 2;
        with = o;
        CHECK(!pr_step_loss_totals(&groups[1], 1, 0, &with.loss.step, &err), "totals of one group: %s", err.message);
        pr_trainer *a = make_model(&c, 5), *b = make_model(&c, 5);
        pr_real lp[256], *logp[1] = { lp };
        double la = 0, lb = 0;
        CHECK(!run_step(a, &groups[1], 1, o, &la, logp, &err) && !run_step(b, &groups[1], 1, with, &lb, NULL, &err), "one group: %s",
              err.message);
        pr_real *ga = grads_of(a), *gb = grads_of(b);
        const double f = step_loss_by_formula(&groups[1], 1, logp, &o.loss, 0);
        CHECK(la == lb && !memcmp(ga, gb, sizeof(pr_real) * pr_trainer_param_count(a)) && fabs(la - f) <= tol * fabs(f),
              "one group, %s: no totals %.17g, its own totals %.17g, the formula %.17g", pr_loss_norm_name(o.loss.norm), la, lb, f);
        free(ga); free(gb);
        pr_trainer_destroy(a);
        pr_trainer_destroy(b);
    }
    /* refusals: an unknown mode, totals that cannot hold the group, bad arguments; names */
    pr_trainer *tr = make_model(&c, 5);
    pr_step_opts o = pr_step_opts_default();
    o.loss.norm = (pr_loss_norm)4;
    CHECK(pr_trainer_compute_grads(tr, &groups[0], &o, NULL, NULL, &err) == PR_ERR_ARG && strstr(err.message, "unknown loss aggregation mode 4"),
          "unknown mode: '%s'", err.message);
    o = pr_step_opts_default();
    o.loss.step.trajectories = 2;    /* group 0 alone has 3 */
    CHECK(pr_trainer_compute_grads(tr, &groups[0], &o, NULL, NULL, &err) == PR_ERR_ARG && strstr(err.message, "a step includes its groups"),
          "too few trajectories: '%s'", err.message);
    o.loss.step.trajectories = 0;
    o.loss.step.norm_len = -1;
    CHECK(pr_trainer_compute_grads(tr, &groups[0], &o, NULL, NULL, &err) == PR_ERR_ARG && strstr(err.message, ">= 0"),
          "negative length: '%s'", err.message);
    pr_step_norm sn;
    CHECK(pr_step_loss_totals(groups, 0, 0, &sn, &err) == PR_ERR_ARG && pr_step_loss_totals(NULL, 1, 0, &sn, &err) == PR_ERR_ARG &&
          pr_step_loss_totals(groups, 1, -2, &sn, &err) == PR_ERR_ARG, "pr_step_loss_totals refuses bad arguments");
    pr_loss_norm back;
    for (int m = 0; m < 4; m++)
        CHECK(!pr_loss_norm_parse(pr_loss_norm_name((pr_loss_norm)m), &back, &err) && back == (pr_loss_norm)m, "mode %d's name", m);
    CHECK(pr_loss_norm_name((pr_loss_norm)4) == NULL && pr_loss_norm_parse("seq-mean", &back, &err) == PR_ERR_ARG &&
          strstr(err.message, "seq-mean-token-sum-norm"), "unknown mode name: '%s'", err.message);
    pr_trainer_destroy(tr);
    printf("steps: 3 groups a step in the four modes, both schedules, 3 microbatch cuts, dp 2..4, against the formula\n");
}

/* ------------------------------------------------------------------ the device mesh */
/* One step on a mesh of in-process ranks against the single-rank full-sequence baseline: loss,
   the gathered gradients, and the gathered parameters after AdamW. */
typedef struct { int dp, pp, cp, tp, ep, mb, offload; } mesh_shape;

/* A rank's trainer on a mesh of shape sh under ZeRO stage zero, on the CPU backend, drawn with
   seed (0: as created). mesh_close frees whatever it made, wherever it failed. */
static pr_status mesh_open(pr_comm *world, mesh_shape sh, int zero, const pr_config *c, uint64_t seed, pr_mesh *mesh, pr_trainer **tr,
                           pr_error *err) {
    memset(mesh, 0, sizeof *mesh);
    *tr = NULL;
    pr_status s = pr_mesh_init(mesh, world, sh.dp, sh.pp, sh.cp, sh.tp, sh.ep, err);
    if (s) return s;
    mesh->zero = zero;
    if (!(s = pr_trainer_create_mesh(tr, c, pr_backend_cpu(), mesh, err)) && seed) s = pr_trainer_init_params(*tr, seed, err);
    return s;
}
static void mesh_close(pr_mesh *mesh, pr_trainer *tr) {
    pr_trainer_destroy(tr);
    pr_mesh_free(mesh);
}
static int mesh_size(mesh_shape s) { return s.dp * s.pp * s.cp * s.tp; }

typedef struct {
    const pr_config *c;
    mesh_shape shape;
    const pr_group *groups;
    int n;
    pr_step_opts opt;
    const pr_real *init;          /* the full model's starting parameters */
    int zero, steps;              /* ZeRO stage; AdamW steps (0: 1) */
    int bf16_grad_reduce;         /* the gradient sum over dp in bf16 */
    int tree;                     /* the groups as their prefix tree (nodes from 1 token) */
    double loss[32];
    pr_real *grads, *params;      /* gathered by world rank 0 */
    int victim;                   /* > 0: this world rank's step fails its allocation number fail_at */
    long fail_at, allocs;         /* (LONG_MAX: none fails); allocs: how many the step made */
} mesh_run;

static pr_status mesh_rank(pr_comm *world, void *user, pr_error *err) {
    mesh_run *m = user;
    pr_mesh mesh;
    pr_trainer *tr = NULL;
    pr_step_stats st;
    const mesh_shape sh = m->shape;
    pr_status s = pr_mesh_init(&mesh, world, sh.dp, sh.pp, sh.cp, sh.tp, sh.ep, err);
    if (s) return s;
    mesh.zero = m->zero;
    mesh.bf16_grad_reduce = m->bf16_grad_reduce;
    size_t n = 0;
    if (!(s = pr_trainer_create_mesh(&tr, m->c, pr_backend_cpu(), &mesh, err))) {
        n = pr_trainer_full_param_count(tr);
        s = pr_trainer_set_full_params(tr, m->init, n, err);
    }
    pr_real *grads = world->rank ? malloc(sizeof(pr_real) * n) : m->grads;   /* every rank gathers; rank 0 keeps */
    pr_real *params = world->rank ? malloc(sizeof(pr_real) * n) : m->params;
    pr_adamw_opts adam = pr_adamw_opts_default();
    pr_prefix_tree tree;
    memset(&tree, 0, sizeof tree);
    if (!s && m->tree) s = pr_prefix_tree_build(&tree, m->groups, m->n, 1, err);
    for (int k = 0; k < (m->steps ? m->steps : 1) && !s; k++) {
        const int victim = m->victim > 0 && world->rank == m->victim;
        if (victim) alloc_fault_arm(m->fail_at);
        if (m->tree)
            s = sh.dp > 1 ? pr_trainer_compute_grads_tree_dp(tr, mesh.dp_comm, m->groups, m->n, &tree, &m->opt, &st, err)
                          : pr_trainer_compute_grads_tree(tr, m->groups, m->n, &tree, &m->opt, &st, err);
        else
            s = sh.dp > 1 ? pr_trainer_compute_grads_dp(tr, mesh.dp_comm, m->groups, m->n, &m->opt, &st, err)
                          : pr_trainer_compute_grads(tr, &m->groups[0], &m->opt, &st, NULL, err);
        if (victim) m->allocs = alloc_fault_disarm();
        if (!s) {
            m->loss[world->rank] = st.loss;
            s = pr_trainer_get_full(tr, PR_ARENA_GRADS, grads, n, err);
        }
        if (!s) s = pr_trainer_adamw_step(tr, &adam, NULL, err);
    }
    if (!s) s = pr_trainer_get_full(tr, PR_ARENA_PARAMS, params, n, err);
    if (world->rank) {
        free(grads);
        free(params);
    }
    pr_prefix_tree_free(&tree);
    pr_trainer_destroy(tr);
    pr_mesh_free(&mesh);
    return s;
}

/* One row of a table of mesh_case runs. */
typedef struct {
    const pr_config *c;
    mesh_shape s;
    int groups;
    pr_moe_opts moe;
    pr_schedule sched;
    const char *name;
} mesh_spec;

static void mesh_compare(const pr_config *c, mesh_shape shape, const pr_group *groups, int n, pr_moe_opts moe,
                         pr_schedule sched, int tree, pr_layout layout, const char *label) {
    pr_trainer *ref = make_model(c, 5);
    pr_real *init = params_of(ref);
    pr_step_opts o = pr_step_opts_default();
    o.schedule = PR_SCHEDULE_BASELINE;
    o.microbatch = shape.mb;
    o.moe = moe;
    pr_error err;
    double ref_loss = 0;
    for (int i = 0; i < n; i++) {
        pr_step_stats st;
        o.accumulate = i > 0;
        CHECK(!pr_trainer_compute_grads(ref, &groups[i], &o, &st, NULL, &err), "%s: reference: %s", label, err.message);
        ref_loss += st.loss;
    }
    pr_real *gref = grads_of(ref);
    pr_adamw_opts adam = pr_adamw_opts_default();
    pr_trainer_adamw_step(ref, &adam, NULL, &err);
    pr_real *pref = params_of(ref);
    size_t np = pr_trainer_param_count(ref);
    mesh_run m;
    memset(&m, 0, sizeof m);
    m.c = c; m.shape = shape; m.groups = groups; m.n = n; m.init = init;
    m.opt = o;
    m.opt.schedule = sched;
    m.opt.accumulate = 0;
    m.opt.offload.enabled = shape.offload;
    m.opt.layout = layout;
    m.tree = tree;
    m.grads = malloc(sizeof(pr_real) * np);
    m.params = malloc(sizeof(pr_real) * np);
    pr_status st = pr_comm_local_run(mesh_size(shape), mesh_rank, &m, &err);
    CHECK(st == PR_OK, "%s: %s", label, err.message);
    if (st == PR_OK) {
        double loss = 0;
        for (int r = 0; r < mesh_size(shape); r += mesh_size(shape) / shape.dp) loss += m.loss[r];   /* one rank per dp replica */
        CHECK(fabs(loss - ref_loss) <= (IS_DOUBLE ? 1e-12 : 1e-5) * fabs(ref_loss), "%s: loss %.15g vs %.15g", label, loss, ref_loss);
        CHECK(close_arenas(ref, m.grads, gref, "gradient", label), "%s: gathered gradients vs one rank's baseline", label);
        CHECK(close_arenas(ref, m.params, pref, "parameter", label), "%s: parameters after AdamW vs one rank's baseline", label);
    }
    if (st == PR_OK && shape.offload) {     /* offload moves bytes, nothing else: the same mesh without it, bit for bit */
        mesh_run off = m;
        off.opt.offload.enabled = 0;
        off.grads = malloc(sizeof(pr_real) * np);
        off.params = malloc(sizeof(pr_real) * np);
        st = pr_comm_local_run(mesh_size(shape), mesh_rank, &off, &err);
        CHECK(st == PR_OK, "%s, offload off: %s", label, err.message);
        CHECK(st != PR_OK || (!memcmp(off.grads, m.grads, sizeof(pr_real) * np) && !memcmp(off.params, m.params, sizeof(pr_real) * np)),
              "%s: gradients or parameters after AdamW differ from offload off in some bit", label);
        free(off.grads); free(off.params);
    }
    free(m.grads); free(m.params); free(init); free(gref); free(pref);
    pr_trainer_destroy(ref);
}

static void mesh_case(const pr_config *c, mesh_shape shape, const pr_group *groups, int n, pr_moe_opts moe,
                      pr_schedule sched, const char *label) {
    mesh_compare(c, shape, groups, n, moe, sched, 0, PR_LAYOUT_PADDED, label);
}

/* ZeRO: the same mesh run with the AdamW state unsharded and sharded over dp, three steps: the
   gathered gradients and the parameters after every AdamW step are the same bits. */
static void zero_case(const pr_config *c, mesh_shape shape, const pr_group *groups, int n, pr_schedule sched, const char *label) {
    pr_trainer *ref = make_model(c, 5);
    pr_real *init = params_of(ref);
    size_t np = pr_trainer_param_count(ref);
    pr_real *out[3][2];
    for (int z = 0; z < 3; z++) {
        mesh_run m;
        pr_error err;
        memset(&m, 0, sizeof m);
        m.c = c; m.shape = shape; m.groups = groups; m.n = n; m.init = init;
        m.opt = pr_step_opts_default();
        m.opt.schedule = sched;
        m.opt.microbatch = shape.mb;
        m.zero = z;
        m.steps = 3;
        m.grads = out[z][0] = calloc(np, sizeof(pr_real));
        m.params = out[z][1] = calloc(np, sizeof(pr_real));
        pr_status st = pr_comm_local_run(mesh_size(shape), mesh_rank, &m, &err);
        CHECK(st == PR_OK, "%s zero %d: %s", label, z, err.message);
    }
    for (int z = 1; z < 3; z++) {
        CHECK(!memcmp(out[0][0], out[z][0], sizeof(pr_real) * np), "%s: zero %d gathered gradients differ from zero 0", label, z);
        CHECK(!memcmp(out[0][1], out[z][1], sizeof(pr_real) * np), "%s: zero %d parameters after AdamW differ from zero 0", label, z);
    }
    for (int z = 0; z < 3; z++) { free(out[z][0]); free(out[z][1]); }
    free(init);
    pr_trainer_destroy(ref);
}

/* pr_comm_measure with pr_backend_measure: a mesh that moves and computes nothing accounts memory
   exactly as the real mesh does. Per rank: the training state's bytes and each phase's peak equal
   those of the same step on the CPU backend over the in-process communicator. */
typedef struct {
    const pr_config *c;
    mesh_shape shape;
    int zero, measure;
    const pr_group *groups;
    int n;
    size_t state[8], peak[8][3];
} measure_job;

static pr_status measure_rank(pr_comm *world, void *user, pr_error *err) {
    measure_job *j = user;
    pr_comm *w = world;
    pr_backend storage;
    const pr_backend *be = j->measure ? pr_backend_measure(pr_backend_cpu(), &storage) : pr_backend_cpu();
    pr_status s = j->measure ? pr_comm_measure(&w, world, err) : PR_OK;
    if (s) return s;
    pr_mesh mesh;
    pr_trainer *tr = NULL;
    pr_step_stats st;
    const mesh_shape sh = j->shape;
    if (!(s = pr_mesh_init(&mesh, w, sh.dp, sh.pp, sh.cp, sh.tp, sh.ep, err))) {
        mesh.zero = j->zero;
        pr_step_opts o = pr_step_opts_default();
        o.schedule = PR_SCHEDULE_REUSE;
        o.microbatch = sh.mb;
        if (!(s = pr_trainer_create_mesh(&tr, j->c, be, &mesh, err)) && !j->measure) s = pr_trainer_init_params(tr, 3, err);
        if (!s) s = sh.dp > 1 ? pr_trainer_compute_grads_dp(tr, mesh.dp_comm, j->groups, j->n, &o, &st, err)
                              : pr_trainer_compute_grads(tr, &j->groups[0], &o, &st, NULL, err);
        if (!s) {
            j->state[world->rank] = pr_trainer_state_bytes(tr);
            memcpy(j->peak[world->rank], st.peak_bytes, sizeof st.peak_bytes);
        }
        pr_trainer_destroy(tr);
        pr_mesh_free(&mesh);
    }
    if (w != world) w->destroy(w);
    return s;
}

/* On a mesh with tp, the sums over the mesh run once a step: accumulating through
   pr_trainer_compute_grads is refused (pr_trainer_compute_grads_dp accumulates). */
static pr_status accumulate_rank(pr_comm *world, void *user, pr_error *err) {
    const pr_group *g = user;
    pr_mesh mesh;
    pr_trainer *tr = NULL;
    pr_config c = small_config(0, 0, 2);
    pr_status s = pr_mesh_init(&mesh, world, 1, 1, 1, 2, 1, err);
    if (s) return s;
    if (!(s = pr_trainer_create_mesh(&tr, &c, pr_backend_cpu(), &mesh, err)) && !(s = pr_trainer_init_params(tr, 3, err))) {
        pr_step_opts o = pr_step_opts_default();
        o.accumulate = 1;
        pr_error e;
        s = pr_trainer_compute_grads(tr, g, &o, NULL, NULL, &e) == PR_ERR_UNSUPPORTED && strstr(e.message, "pr_trainer_compute_grads_dp")
                ? PR_OK : pr__fail(err, PR_ERR_ARG, "accumulate on tp 2 was not refused: '%s'", e.message);
    }
    pr_trainer_destroy(tr);
    pr_mesh_free(&mesh);
    return s;
}

/* A rank's training state (pr_trainer_state_bytes) on dp 8, sized for the GPU (bf16 weights for the
   kernels) and for the CPU: unsharded every parameter whole; under ZeRO the master weights, m and v
   a 1/dp slice each, the gradients and the kernels' weights whole (padded to dp slices). */
typedef struct { int zero, gpu; size_t state[8], n[8], slice[8], pad[8]; } state_job;

static pr_status state_rank(pr_comm *world, void *user, pr_error *err) {
    state_job *j = user;
    pr_backend storage, sizes;
    const pr_backend *be = pr_backend_measure(j->gpu ? pr_backend_cuda_sizes(&sizes) : pr_backend_cpu(), &storage);
    pr_comm *w = NULL;
    pr_status s = pr_comm_measure(&w, world, err);
    if (s) return s;
    pr_config c = small_config(0, 0, 2);
    pr_mesh mesh;
    pr_trainer *tr = NULL;
    if (!(s = pr_mesh_init(&mesh, w, 8, 1, 1, 1, 1, err))) {
        mesh.zero = j->zero;
        if (!(s = pr_trainer_create_mesh(&tr, &c, be, &mesh, err))) {
            const int r = world->rank;
            j->state[r] = pr_trainer_state_bytes(tr);
            j->n[r] = pr_trainer_param_count(tr);
            j->slice[r] = tr->slice_cap;
            j->pad[r] = tr->n_pad;
        }
        pr_trainer_destroy(tr);
        pr_mesh_free(&mesh);
    }
    w->destroy(w);
    return s;
}

static void test_state_bytes(void) {
    for (int gpu = 0; gpu < 2; gpu++)
        for (int zero = 0; zero <= 2; zero++) {
            state_job j;
            pr_error err;
            memset(&j, 0, sizeof j);
            j.zero = zero;
            j.gpu = gpu;
            CHECK(pr_comm_local_run(8, state_rank, &j, &err) == PR_OK, "state bytes, zero %d: %s", zero, err.message);
            const size_t weight = gpu ? 2 : sizeof(pr_real), n = j.n[0];
            for (int r = 0; r < 8; r++) {
                const size_t want = zero ? sizeof(pr_real) * (j.pad[r] + 3 * j.slice[r]) + weight * j.pad[r]
                                         : (4 * sizeof(pr_real) + (gpu ? weight : 0)) * n;
                CHECK(j.state[r] == want && j.n[r] == n && (!zero || (j.pad[r] == 8 * j.slice[r] && 8 * j.slice[r] >= n)),
                      "%s sizes, zero %d, rank %d: %zu state bytes, expected %zu", gpu ? "GPU" : "CPU", zero, r, j.state[r], want);
            }
            /* fp32 state, bf16 kernel weights at dp 8: 18 bytes a parameter, and 4 + 2 + 12/8 = 7.5 sharded */
            const double per = (double)j.state[0] / (double)n;
            if (gpu && sizeof(pr_real) == 4)
                CHECK(zero ? per >= 7.5 && per < 7.6 : per == 18, "GPU sizes, zero %d: %.3f bytes a parameter", zero, per);
        }
}

static void test_measure_mesh(void) {
    const int S[6] = { 5, 1, 8, 3, 6, 2 };
    static test_group tg[2];
    pr_group groups[2];
    for (int i = 0; i < 2; i++) {
        make_group(&tg[i], 7 + 5 * i, 3 + i, S, 61, 950 + i);
        groups[i] = tg[i].g;
    }
    pr_error aerr;
    CHECK(pr_comm_local_run(2, accumulate_rank, &groups[0], &aerr) == PR_OK, "%s", aerr.message);
    pr_config llama = small_config(0, 0, 2), qwen = small_config(1, 1, 2);
    struct { const pr_config *c; mesh_shape sh; int zero; const char *label; } cases[] = {
        { &llama, { 2, 1, 1, 2, 1, 2, 0 }, 2, "dp 2 x tp 2, zero 2" },
        { &qwen, { 1, 2, 1, 2, 1, 1, 0 }, 0, "pp 2 x tp 2, qwen3 tied" },
        { &llama, { 1, 1, 2, 2, 1, 1, 0 }, 0, "cp 2 x tp 2" },
        { &llama, { 2, 1, 1, 4, 1, 2, 0 }, 1, "dp 2 x tp 4 (KV heads replicated), zero 1" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        measure_job j[2];
        pr_error err;
        for (int m = 0; m < 2; m++) {
            memset(&j[m], 0, sizeof j[m]);
            j[m].c = cases[k].c; j[m].shape = cases[k].sh; j[m].zero = cases[k].zero; j[m].measure = m;
            j[m].groups = groups; j[m].n = 2;
            CHECK(pr_comm_local_run(mesh_size(cases[k].sh), measure_rank, &j[m], &err) == PR_OK, "measured mesh %s%s: %s",
                  cases[k].label, m ? " (measured)" : "", err.message);
        }
        int same = 1;
        for (int r = 0; r < mesh_size(cases[k].sh); r++)
            same &= j[0].state[r] == j[1].state[r] && j[0].state[r] > 0 && !memcmp(j[0].peak[r], j[1].peak[r], sizeof j[0].peak[r]);
        CHECK(same && j[0].peak[0][1] > 0, "measured mesh %s: state bytes and phase peaks differ from the real mesh's (rank 0: %zu vs %zu; "
              "B %zu vs %zu)", cases[k].label, j[0].state[0], j[1].state[0], j[0].peak[0][1], j[1].peak[0][1]);
    }
}

static void test_zero(void) {
    const int S[8] = { 5, 1, 8, 3, 6, 2, 4, 7 };
    static test_group tg[8];
    pr_group groups[8];
    for (int i = 0; i < 8; i++) {
        make_group(&tg[i], 5 + i, 2 + i % 3, S + i % 4, 61, 900 + i);
        groups[i] = tg[i].g;
    }
    pr_config llama = small_config(0, 0, 4), qwen = small_config(1, 1, 4), moe = moe_config(1);
    qwen.num_hidden_layers = 4;
    moe.num_experts = 8;
    static const int dps[4] = { 2, 3, 4, 8 };
    char label[96];
    for (int k = 0; k < 4; k++)
        for (int sched = 0; sched < 2; sched++) {
            mesh_shape sh = { dps[k], 1, 1, 1, 1, 2, 0 };
            snprintf(label, sizeof label, "zero: dp %d, %s", dps[k], sched ? "reuse" : "baseline");
            zero_case(&llama, sh, groups, dps[k], sched ? PR_SCHEDULE_REUSE : PR_SCHEDULE_BASELINE, label);
        }
    mesh_shape mix = { 2, 2, 1, 2, 1, 1, 0 }, cpmix = { 2, 1, 2, 1, 1, 1, 0 }, split = { 4, 1, 1, 1, 1, 2, 0 }, ep = { 2, 1, 1, 2, 2, 2, 0 };
    zero_case(&qwen, mix, groups, 3, PR_SCHEDULE_REUSE, "zero: dp 2 x pp 2 x tp 2, qwen3, tied");
    zero_case(&llama, cpmix, groups, 2, PR_SCHEDULE_REUSE, "zero: dp 2 x cp 2");
    zero_case(&llama, split, groups, 2, PR_SCHEDULE_REUSE, "zero: dp 4, groups split over 2 ranks");
    zero_case(&moe, ep, groups, 2, PR_SCHEDULE_REUSE, "zero: MoE, dp 2 x tp 2 x ep 2");
    zero_case(&moe, (mesh_shape){ 3, 1, 1, 1, 1, 2, 0 }, groups, 4, PR_SCHEDULE_BASELINE, "zero: MoE, dp 3, baseline");
    printf("zero: stages 1 and 2 bitwise equal to stage 0 over dp 2, 3, 4, 8, both schedules, tp/cp/pp, split groups, MoE\n");
}

/* x rounded to bf16's 8 significant bits, to nearest, ties to even (nearbyint in the default
   rounding mode): from frexp, independent of the library's bit manipulation. */
static double round_bf16(double x) {
    int e;
    double m = frexp(x, &e);
    return x == 0 ? 0 : ldexp(nearbyint(ldexp(m, 8)), e - 8);
}

/* The gradient sum over dp in bf16. Its result is, bit for bit, each rank's own gradient rounded to
   bf16 and summed in rank order with a rounding after every add (the in-process communicator's
   bf16 sum, as a ring in bf16 would), computed here from one-rank runs of the groups pr_dp_place
   gives each rank: for the all-reduce and for ZeRO-2's reduce-scatter, through many chunks. It
   differs from the sum in reals by bf16's spacing, on a mesh with tp too. */
static void test_grad_reduce_bf16(void) {
    const int S[6] = { 4, 7, 2, 5, 3, 6 };
    static test_group tg[5];
    pr_group groups[5];
    for (int i = 0; i < 5; i++) {
        make_group(&tg[i], 3 + 4 * i, 2 + i % 3, S, 61, 700 + i);
        groups[i] = tg[i].g;
    }
    pr_config c = small_config(0, 0, 2);
    pr_trainer *ref = make_model(&c, 5);
    pr_real *init = params_of(ref);
    const size_t np = pr_trainer_param_count(ref);
    CHECK(np > 3 * ((size_t)1 << 10), "bf16 gradient sum: the model (%zu parameters) must span several chunks", np);
    pr_step_opts o = pr_step_opts_default();
    o.schedule = PR_SCHEDULE_REUSE;
    o.microbatch = 2;
    pr_error err;
    char label[96];
    for (int dp = 2; dp <= 3; dp++) {
        int owner[5];
        pr_dp_place(&c, groups, 5, dp, o.schedule, owner);
        double *expect = calloc(np, sizeof(double));
        for (int r = 0; r < dp; r++) {        /* rank r's own gradient, then into the bf16 sum in rank order */
            pr_trainer_set_params(ref, init, np, &err);
            pr_step_opts a = o;
            pr_real *local = calloc(np, sizeof(pr_real));
            int any = 0;
            for (int i = 0; i < 5; i++) {
                if (owner[i] != r) continue;
                a.accumulate = any++ > 0;
                CHECK(!pr_trainer_compute_grads(ref, &groups[i], &a, NULL, NULL, &err), "bf16 reference: %s", err.message);
            }
            if (any) pr_trainer_get_grads(ref, local, np, &err);
            for (size_t i = 0; i < np; i++) expect[i] = round_bf16((double)(float)(expect[i] + round_bf16((double)local[i])));
            free(local);
        }
        for (int zero = 0; zero <= 2; zero += 2) {
            mesh_run m;
            memset(&m, 0, sizeof m);
            m.c = &c; m.shape = (mesh_shape){ dp, 1, 1, 1, 1, 2, 0 }; m.groups = groups; m.n = 5; m.init = init;
            m.opt = o;
            m.zero = zero;
            m.bf16_grad_reduce = 1;
            m.grads = calloc(np, sizeof(pr_real));
            m.params = calloc(np, sizeof(pr_real));
            snprintf(label, sizeof label, "bf16 gradient sum: dp %d, zero %d", dp, zero);
            CHECK(pr_comm_local_run(dp, mesh_rank, &m, &err) == PR_OK, "%s: %s", label, err.message);
            long off = 0;
            for (size_t i = 0; i < np; i++) off += m.grads[i] != (pr_real)expect[i];
            CHECK(off == 0, "%s: %ld of %zu gradients differ from the bf16 sum of each rank's own", label, off, np);
            free(m.grads);
            free(m.params);
        }
        free(expect);
    }
    mesh_run bad;
    memset(&bad, 0, sizeof bad);
    bad.c = &c; bad.shape = (mesh_shape){ 2, 1, 1, 1, 1, 2, 0 }; bad.groups = groups; bad.n = 2; bad.init = init;
    bad.opt = o;
    bad.bf16_grad_reduce = 2;
    pr_status bs = pr_comm_local_run(2, mesh_rank, &bad, &err);
    CHECK(bs == PR_ERR_ARG && strstr(err.message, "bf16_grad_reduce 2"), "bf16 gradient sum: a setting of 2 is refused (%d: %s)",
          (int)bs, err.message);
    /* against the sum in reals, on dp 2 x tp 2: the difference is bf16's, relative L2 near 2^-9 */
    pr_real *out[2];
    for (int b = 0; b < 2; b++) {
        mesh_run m;
        memset(&m, 0, sizeof m);
        m.c = &c; m.shape = (mesh_shape){ 2, 1, 1, 2, 1, 2, 0 }; m.groups = groups; m.n = 5; m.init = init;
        m.opt = o;
        m.bf16_grad_reduce = b;
        m.grads = out[b] = calloc(np, sizeof(pr_real));
        m.params = calloc(np, sizeof(pr_real));
        CHECK(pr_comm_local_run(4, mesh_rank, &m, &err) == PR_OK, "bf16 gradient sum, dp 2 x tp 2: %s", err.message);
        free(m.params);
    }
    double dd = 0, bb = 0;
    for (size_t i = 0; i < np; i++) {
        dd += ((double)out[1][i] - out[0][i]) * ((double)out[1][i] - out[0][i]);
        bb += (double)out[0][i] * out[0][i];
    }
    const double rel = sqrt(dd / bb);
    CHECK(rel > 0x1p-14 && rel < 0x1p-7, "bf16 gradient sum, dp 2 x tp 2: relative L2 difference to the sum in reals %.3e, "
          "outside bf16's (2^-14, 2^-7)", rel);
    printf("bf16 gradient sum: bitwise each rank's bf16 gradient summed in bf16 (dp 2, 3; zero 0, 2); dp 2 x tp 2 vs reals: "
           "relative L2 %.2e\n", rel);
    free(out[0]); free(out[1]); free(init);
    pr_trainer_destroy(ref);
}

/* The CP cut (pr__cp_cut_of): every row of a segment held by exactly one rank, each rank's rows
   its two pieces in order in a block of `chunk` rows, and the causal attention's work even: the
   keys a rank's queries see, summed over its rows, at most 3/piece above the ranks' mean (where
   cp contiguous chunks would put the last rank at (2cp-1)/cp of it, 1.5 at cp 2). */
static void test_cp_cut(void) {
    static pr_trainer tr;
    pr_mesh mesh;
    memset(&mesh, 0, sizeof mesh);
    tr.mesh = &mesh;
    const int sizes[] = { 0, 1, 2, 3, 5, 7, 16, 31, 100, 257, 1000, 4096, 10000 }, cps[] = { 2, 3, 4, 8 };
    int bad_cover = 0, bad_block = 0;
    double worst = 0, contiguous = 0;
    for (size_t ci = 0; ci < sizeof cps / sizeof cps[0]; ci++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            const int cp = cps[ci], n = sizes[si];
            int *held = calloc((size_t)n + 1, sizeof(int));
            double keys[8], total = 0;
            mesh.cp = cp;
            for (int r = 0; r < cp; r++) {
                mesh.cp_rank = r;
                const pr__cp_cut k = pr__cp_cut_of(&tr, n);
                bad_block += k.chunk != 2 * k.piece || k.rows_a + k.rows_b > k.chunk || (k.rows_b > 0 && k.rows_a != k.piece) ||
                             k.rows_a < 0 || k.rows_b < 0;
                keys[r] = 0;
                for (int i = 0; i < k.rows_a; i++) held[k.a0 + i]++, keys[r] += k.a0 + i + 1;
                for (int i = 0; i < k.rows_b; i++) held[k.b0 + i]++, keys[r] += k.b0 + i + 1;
                total += keys[r];
            }
            for (int i = 0; i < n; i++) bad_cover += held[i] != 1;
            const int piece = (n + 2 * cp - 1) / (2 * cp);
            for (int r = 0; r < cp && piece >= 16; r++) {
                const double over = keys[r] / (total / cp) - 1;
                if (over * piece > worst) worst = over * piece;
            }
            if (n == 10000) {            /* the contiguous cut's last rank: its chunk's keys over the mean */
                const double c = ceil((double)n / cp), a = (cp - 1) * c;
                const double last = ((double)n * (n + 1) - a * (a + 1)) / 2 / (total / cp);
                if (last > contiguous) contiguous = last;
            }
            free(held);
        }
    CHECK(!bad_cover && !bad_block, "CP cut: %d rows not held exactly once, %d malformed blocks", bad_cover, bad_block);
    CHECK(worst <= 3.0, "CP cut: a rank's causal keys %.2f/piece above the mean (at most 3/piece expected)", worst);
    printf("CP cut: causal attention per rank within %.2f/piece of the mean (contiguous chunks: the last rank up to %.2fx it, 10k rows, cp 2..8)\n",
           worst, contiguous);
}

/* pr_mesh_init's sizes against a world of one rank: each at least 1, their product the world's
   (sizes whose product overflows 64 bits to the world's size too), ep 1 or tp. */
static pr_status mesh_sizes_rank(pr_comm *world, void *user, pr_error *err) {
    (void)user, (void)err;
    static const struct { int dp, pp, cp, tp, ep; pr_status want; const char *needle; } cases[] = {
        { 1, 1, 1, 1, 1, PR_OK, "" },
        { 0, 1, 1, 1, 1, PR_ERR_ARG, "must be >= 1" },
        { 2, 1, 1, 1, 1, PR_ERR_ARG, "is not the communicator's 1 ranks" },
        { 998724481, 1119412321, 33, 1, 1, PR_ERR_ARG, "is not the communicator's 1 ranks" },   /* 1 + 2^65 */
        { 65536, 65536, 65536, 65536, 1, PR_ERR_ARG, "is not the communicator's 1 ranks" },     /* 2^64 */
        { 1, 1, 1, 1, 2, PR_ERR_UNSUPPORTED, "ep must be 1 or tp" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        pr_mesh m;
        pr_error e;
        e.message[0] = 0;
        const pr_status st = pr_mesh_init(&m, world, cases[k].dp, cases[k].pp, cases[k].cp, cases[k].tp, cases[k].ep, &e);
        CHECK(st == cases[k].want && strstr(e.message, cases[k].needle), "mesh %d x %d x %d x %d, ep %d: status %d (%s), want %d", cases[k].dp,
              cases[k].pp, cases[k].cp, cases[k].tp, cases[k].ep, st, e.message, cases[k].want);
        if (!st) pr_mesh_free(&m);
    }
    return PR_OK;
}

/* The public API's refusals of malformed arguments (a probe of every public function found each;
   each case crashed, or returned PR_OK, before its check). Meshes on a world of one rank: */
static pr_status api_mesh_rank(pr_comm *world, void *user, pr_error *err) {
    (void)user, (void)err;
    pr_config c = small_config(0, 0, 2);
    pr_trainer *tr = NULL;
    pr_error e;
    pr_mesh m;
    CHECK(!pr_mesh_init(&m, world, 1, 1, 1, 1, 1, &e), "api: a mesh of one rank: %s", e.message);
    pr_mesh kept = m;
    CHECK(pr_mesh_init(&m, world, 0, 1, 1, 1, 1, &e) == PR_ERR_ARG && !memcmp(&m, &kept, sizeof m),
          "api: a refused pr_mesh_init leaves the caller's mesh (and its communicators) as it was");
    struct { const char *what, *needle; } cases[] = {
        { "zeroed", "no communicators" }, { "tp 0", "is not one of the world's" }, { "pp 0", "is not one of the world's" },
        { "tp_rank 5", "are not world rank 0's" }, { "zero 3", "zero 3" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        pr_mesh bad = m;
        if (k == 0) memset(&bad, 0, sizeof bad);
        if (k == 1) bad.tp = 0;
        if (k == 2) bad.pp = 0;
        if (k == 3) bad.tp_rank = 5;
        if (k == 4) bad.zero = 3;
        e.message[0] = 0;
        const pr_status st = pr_trainer_create_mesh(&tr, &c, pr_backend_cpu(), &bad, &e);
        CHECK(st == PR_ERR_ARG && !tr && strstr(e.message, cases[k].needle), "api: a mesh %s: status %d (%s)", cases[k].what, st,
              e.message);
    }
    pr_mesh_free(&m);
    return PR_OK;
}

typedef struct {
    const pr_group *groups;
    int n;
    pr_status st;
    pr_prefix_tree tree;
} api_tree_run;
static void *api_tree_build(void *user) {
    api_tree_run *r = user;
    pr_error e;
    r->st = pr_prefix_tree_build(&r->tree, r->groups, r->n, 1, &e);
    return NULL;
}

static void test_api_refusals(void) {
    pr_config c = small_config(0, 0, 2);
    pr_error e;
    {
        pr_error me;
        CHECK(!pr_comm_local_run(1, api_mesh_rank, NULL, &me), "api meshes: %s", me.message);
    }
    /* a group's shape, before pr_step_loss_totals reads its loss mask */
    const int S[3] = { 3, 2, 4 };
    test_group t;
    make_group(&t, 5, 3, S, c.vocab_size, 41);
    pr_step_norm nt;
    CHECK(!pr_step_loss_totals(&t.g, 1, 0, &nt, &e) && nt.tokens > 0, "api: loss totals of a valid group: %s", e.message);
    t.off[3] = 4096;                      /* past the loss mask's 9 entries */
    CHECK(pr_step_loss_totals(&t.g, 1, 0, &nt, &e) == PR_ERR_ARG && strstr(e.message, "suffix_off[3]"),
          "api: loss totals with suffix_off past the suffixes: %s", e.message);
    t.off[3] = 9;
    t.len[0] = -100;
    CHECK(pr_step_loss_totals(&t.g, 1, 0, &nt, &e) == PR_ERR_ARG, "api: loss totals with a negative suffix length");
    t.len[0] = 3;
    /* placements and FLOPs of nothing, or of a group without lengths */
    int owner[2] = { 7, 7 };
    CHECK(!pr_dp_place(&c, &t.g, -3, 2, PR_SCHEDULE_REUSE, owner) && owner[0] == 7, "api: pr_dp_place of -3 groups places none");
    pr_step_phase_flops(&c, &t.g, PR_SCHEDULE_REUSE, NULL);   /* nothing to write */
    pr_group nolen = t.g;
    nolen.suffix_len = NULL;
    double f[3] = { 1, 1, 1 };
    pr_step_phase_flops(&c, &nolen, PR_SCHEDULE_REUSE, f);
    CHECK(f[0] == 0 && f[1] == 0 && f[2] == 0 && pr_step_flops(&c, &nolen, PR_SCHEDULE_BASELINE) == 0,
          "api: FLOPs of a group without suffix lengths are zeros");
    /* a backend of sizes only: refused, not called */
    pr_backend sizes;
    pr_trainer *tr = NULL;
    CHECK(pr_trainer_create(&tr, &c, pr_backend_cuda_sizes(&sizes), &e) == PR_ERR_ARG && !tr && strstr(e.message, "no alloc kernel"),
          "api: a trainer on a backend without kernels: %s", e.message);
    /* an arena that is neither */
    tr = make_model(&c, 43);
    const size_t n = pr_trainer_param_count(tr);
    pr_real *buf = malloc(sizeof(pr_real) * n);
    CHECK(pr_trainer_get_full(tr, (pr_arena_kind)7, buf, n, &e) == PR_ERR_ARG, "api: pr_trainer_get_full of arena 7");
    /* a state the load would refuse, or JSON could not hold, is not written; infinity is */
    char dir[] = "/tmp/pr_api_state_XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "api: a temporary folder");
    pr_train_state st = { 0, 0, 1, pr_adamw_opts_default(), 0 };
    CHECK(!pr_trainer_save_state(tr, dir, &st, NULL, &e), "api: a valid state: %s", e.message);
    for (int k = 0; k < 4; k++) {
        pr_train_state bad = st;
        if (k == 0) bad.adamw.lr = NAN;
        if (k == 1) bad.adamw.eps = INFINITY;
        if (k == 2) bad.adamw.beta1 = -5;
        if (k == 3) bad.next_group = -1;
        CHECK(pr_trainer_save_state(tr, dir, &bad, NULL, &e) == PR_ERR_ARG, "api: save_state refuses bad setting %d", k);
    }
    pr_train_state back;
    CHECK(!pr_train_state_read(dir, NULL, 0, &back, &e) && back.adamw.lr == st.adamw.lr, "api: the valid state stays: %s", e.message);
    st.adamw.max_grad_norm = INFINITY;
    CHECK(!pr_trainer_save_state(tr, dir, &st, NULL, &e) && !pr_train_state_read(dir, NULL, 0, &back, &e) &&
          isinf(back.adamw.max_grad_norm) && back.adamw.max_grad_norm > 0, "api: max_grad_norm infinity saved and read back: %s", e.message);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "api: %s", cmd);
    free(buf);
    pr_trainer_destroy(tr);
    /* a chain of nested prefixes (group k's: the first k + 1 tokens of one run) on a small stack:
       the placement's depth is the chain's, 10,000 */
    enum { CHAIN = 10000 };
    pr_group *chain = calloc(CHAIN, sizeof *chain);
    int32_t *run = malloc(sizeof(int32_t) * CHAIN);
    for (int k = 0; k < CHAIN; k++) run[k] = k % 50;
    for (int k = 0; k < CHAIN; k++) chain[k].P = k + 1, chain[k].G = 1, chain[k].prefix = run;
    api_tree_run r = { chain, CHAIN, PR_ERR_ARG, { 0 } };
    pthread_attr_t attr;
    pthread_t th;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    CHECK(!pthread_create(&th, &attr, api_tree_build, &r) && !pthread_join(th, NULL), "api: the tree's thread");
    pthread_attr_destroy(&attr);
    CHECK(r.st == PR_OK && r.tree.n_nodes == CHAIN && r.tree.group_node[CHAIN - 1] == CHAIN - 1,
          "api: a tree of %d nested prefixes on 256 KiB of stack: status %d, %d nodes", CHAIN, r.st, r.tree.n_nodes);
    pr_prefix_tree_free(&r.tree);
    free(run);
    free(chain);
}

static void test_mesh(void) {
    const int S[6] = { 5, 1, 8, 3, 6, 2 };
    static test_group tg[3];
    pr_group groups[3];
    {
        pr_error e;
        CHECK(!pr_comm_local_run(1, mesh_sizes_rank, NULL, &e), "mesh sizes: %s", e.message);
    }
    for (int i = 0; i < 3; i++) {
        make_group(&tg[i], 7 + 2 * i, 3 + i % 2, S + i, 61, 700 + i);
        groups[i] = tg[i].g;
    }
    const pr_moe_opts mb_scope = { PR_AUX_SCOPE_MICROBATCH, 0 }, group_scope = { PR_AUX_SCOPE_GROUP, 0 };
    pr_config llama = small_config(0, 0, 4), qwen = small_config(1, 1, 4);
    pr_config llama4 = llama, qwen3l = qwen;   /* deeper: pipeline stages of one and two layers */
    llama4.num_hidden_layers = 4;
    qwen3l.num_hidden_layers = 3;
    pr_config moe = moe_config(1);
    moe.num_key_value_heads = 4;
    moe.num_experts = 8;
    moe.moe_intermediate_size = 8;
    /* shapes: dp, pp, cp, tp, ep, microbatch, offload */
    const mesh_spec cases[] = {
        { &llama, { 1, 1, 1, 2, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama tp 2" },
        { &qwen, { 1, 1, 1, 4, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 tp 4 (tied, q/k norms)" },
        { &llama, { 1, 1, 2, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama cp 2" },
        { &qwen, { 1, 1, 3, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 cp 3 (uneven pieces, empty ones)" },
        { &llama, { 1, 1, 2, 1, 1, 1, 1 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama cp 2, offload on" },
        { &qwen, { 1, 1, 3, 1, 1, 1, 1 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 cp 3 (uneven pieces, empty ones), offload on" },
        { &llama, { 1, 1, 2, 2, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama tp 2 cp 2" },
        { &llama, { 1, 1, 2, 2, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_BASELINE, "llama tp 2 cp 2, baseline schedule" },
        { &llama, { 1, 1, 2, 4, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama pp 1 tp 4 cp 2 (Table 3)" },
        { &moe, { 1, 1, 1, 2, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "MoE tp 2 (expert columns sharded)" },
        { &moe, { 1, 1, 1, 2, 2, 1, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, "MoE tp 2 ep 2, group scope" },
        { &moe, { 1, 1, 2, 4, 4, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "MoE pp 1 tp 4 cp 2 ep 4 (Table 3), microbatch scope" },
        { &moe, { 1, 1, 2, 4, 4, 1, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, "MoE pp 1 tp 4 cp 2 ep 4 (Table 3), group scope" },
        { &moe, { 1, 1, 2, 2, 2, 1, 1 }, 1, group_scope, PR_SCHEDULE_REUSE, "MoE tp 2 cp 2 ep 2, group scope, offload on" },
        { &llama, { 1, 2, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama pp 2" },
        { &llama, { 1, 2, 1, 1, 1, 2, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama pp 2, microbatches of 2 (rows differ between them)" },
        { &llama4, { 1, 2, 1, 1, 1, 1, 1 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama pp 2, offload on" },
        { &llama, { 1, 2, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_BASELINE, "llama pp 2, baseline schedule" },
        { &qwen3l, { 1, 2, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 pp 2 (tied embedding on both ends, 1 + 2 layers)" },
        { &llama4, { 1, 3, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama pp 3 (a middle stage)" },
        { &llama4, { 1, 4, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama pp 4 (more stages than microbatches)" },
        { &qwen, { 1, 2, 2, 2, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 pp 2 tp 2 cp 2 (tied)" },
        { &qwen, { 1, 2, 2, 2, 1, 1, 1 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 pp 2 tp 2 cp 2 (tied), offload on" },
        { &llama, { 1, 2, 2, 4, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama pp 2 tp 4 cp 2 (Table 3)" },
        { &moe, { 1, 2, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "MoE pp 2, microbatch scope" },
        { &moe, { 1, 2, 1, 2, 2, 1, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, "MoE pp 2 tp 2 ep 2, group scope (routing pre-pass)" },
        { &moe, { 1, 2, 2, 4, 4, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "MoE pp 2 tp 4 cp 2 ep 4 (Table 3), microbatch scope" },
        { &moe, { 1, 2, 2, 4, 4, 1, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, "MoE pp 2 tp 4 cp 2 ep 4 (Table 3), group scope" },
        { &llama, { 2, 1, 1, 2, 1, 1, 0 }, 3, mb_scope, PR_SCHEDULE_REUSE, "llama dp 2 tp 2, whole groups" },
        { &llama, { 2, 1, 2, 1, 1, 1, 0 }, 3, mb_scope, PR_SCHEDULE_REUSE, "llama dp 2 cp 2, whole groups" },
        { &qwen, { 2, 2, 1, 2, 1, 1, 0 }, 3, mb_scope, PR_SCHEDULE_REUSE, "qwen3 dp 2 pp 2 tp 2, whole groups" },
        { &llama, { 2, 1, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama dp 2, one group split (K/V replicated)" },
        { &llama, { 2, 1, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_BASELINE, "llama dp 2, one group split, baseline schedule" },
        { &llama, { 2, 1, 1, 1, 1, 1, 1 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama dp 2, one group split, offload on" },
        { &qwen, { 3, 1, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 dp 3, one group split (a trajectory each)" },
        { &llama, { 4, 1, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama dp 4, one group of 3 (the owner runs none)" },
        { &llama, { 4, 1, 1, 1, 1, 2, 0 }, 2, mb_scope, PR_SCHEDULE_REUSE, "llama dp 4, two groups split in two" },
        { &moe, { 2, 1, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "MoE dp 2, one group split, microbatch scope" },
        { &moe, { 2, 1, 1, 1, 1, 1, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, "MoE dp 2, one group split, group scope" },
        { &qwen, { 2, 2, 2, 2, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 dp 2 pp 2 cp 2 tp 2, one group split" },
        { &moe, { 2, 2, 1, 2, 2, 1, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, "MoE dp 2 pp 2 tp 2 ep 2, one group split, group scope" },
    };
    const int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) mesh_case(cases[i].c, cases[i].s, groups, cases[i].groups, cases[i].moe, cases[i].sched, cases[i].name);
    /* CP over microbatches of several trajectories: each one cut in pieces, gathered in turn */
    const struct { const pr_config *c; mesh_shape s; int groups; pr_moe_opts moe; pr_schedule sched; pr_layout layout; const char *name; } cp_mb[] = {
        { &llama, { 1, 1, 2, 1, 1, 2, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, PR_LAYOUT_PADDED, "llama cp 2, microbatch 2, padded" },
        { &qwen, { 1, 1, 3, 1, 1, 3, 1 }, 1, mb_scope, PR_SCHEDULE_REUSE, PR_LAYOUT_PACKED, "qwen3 cp 3, microbatch 3, packed, offload on" },
        { &llama, { 1, 1, 2, 2, 1, 0, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, PR_LAYOUT_PACKED, "llama tp 2 cp 2, one microbatch, packed" },
        { &llama, { 1, 1, 2, 2, 1, 0, 0 }, 1, mb_scope, PR_SCHEDULE_BASELINE, PR_LAYOUT_PADDED, "llama tp 2 cp 2, one microbatch, baseline schedule" },
        { &moe, { 1, 1, 2, 2, 2, 2, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, PR_LAYOUT_PACKED, "MoE tp 2 cp 2 ep 2, microbatch 2, packed, group scope" },
        { &qwen, { 1, 2, 2, 1, 1, 2, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, PR_LAYOUT_PADDED, "qwen3 pp 2 cp 2, microbatch 2" },
        { &llama, { 2, 1, 2, 1, 1, 2, 0 }, 3, mb_scope, PR_SCHEDULE_REUSE, PR_LAYOUT_PACKED, "llama dp 2 cp 2, microbatch 2, packed, whole groups" },
    };
    const int n_cp_mb = (int)(sizeof cp_mb / sizeof cp_mb[0]);
    for (int i = 0; i < n_cp_mb; i++)
        mesh_compare(cp_mb[i].c, cp_mb[i].s, groups, cp_mb[i].groups, cp_mb[i].moe, cp_mb[i].sched, 0, cp_mb[i].layout, cp_mb[i].name);
    /* a prefix shorter than the CP ranks: one rank of each stage holds none of it (under offload
       not even a buffer) and still meets every exchange between the stages */
    static test_group one_token;
    make_group(&one_token, 1, 3, S, 61, 710);
    mesh_compare(&llama4, (mesh_shape){ 1, 2, 2, 1, 1, 1, 1 }, &one_token.g, 1, mb_scope, PR_SCHEDULE_REUSE, 0, PR_LAYOUT_PACKED,
                 "llama pp 2 cp 2, a one-token prefix, offload on");
    printf("mesh: %d layouts vs the single-rank baseline (loss, gathered gradients, parameters after AdamW)\n", n + n_cp_mb + 1);
    /* what a split group replicates to each peer: the prefix K/V, a fraction of its activation stack */
    pr_trainer *tr = make_model(&llama, 5);
    pr_step_opts o = pr_step_opts_default();
    pr_step_stats st;
    pr_error err;
    CHECK(!pr_trainer_compute_grads(tr, &groups[0], &o, &st, NULL, &err), "payload step: %s", err.message);
    size_t kv = 2 * (size_t)llama.num_hidden_layers * (size_t)groups[0].P * (size_t)(llama.num_key_value_heads * llama.head_dim) *
                sizeof(pr_real);
    CHECK(st.prefix_kv_bytes == kv && st.prefix_stack_bytes > 2 * kv, "prefix K/V %zu bytes (expected %zu), activation stack %zu",
          st.prefix_kv_bytes, kv, st.prefix_stack_bytes);
    pr_trainer_destroy(tr);
}

/* A rank whose allocation fails in the middle of a step on a mesh: its peers, waiting in
   collectives it skips, fail too instead of hanging, nothing leaks (the sanitizer build), and
   the run reports the failing rank's own error. Each layout's step is first counted, then made to
   fail at allocations spread over it. Some allocations may fail without failing the step (the
   CPU GEMM then multiplies unpacked). */
static void test_mesh_faults(void) {
    const int S[4] = { 5, 1, 8, 3 };
    static test_group tg[2];
    pr_group groups[2];
    for (int i = 0; i < 2; i++) {
        make_group(&tg[i], 7 + 2 * i, 3, S + i, 61, 900 + i);
        groups[i] = tg[i].g;
    }
    pr_config llama = small_config(0, 0, 4), moe = moe_config(1);
    moe.num_key_value_heads = 4;
    moe.num_experts = 8;
    moe.moe_intermediate_size = 8;
    const struct { const pr_config *c; mesh_shape s; int groups, tree, victim; const char *name; } cases[] = {
        { &llama, { 1, 1, 1, 2, 1, 1, 0 }, 1, 0, 1, "tp 2" },
        { &llama, { 1, 1, 2, 1, 1, 1, 0 }, 1, 0, 1, "cp 2" },
        { &llama, { 1, 1, 2, 1, 1, 1, 1 }, 1, 0, 1, "cp 2, offload on" },
        { &llama, { 1, 2, 1, 1, 1, 1, 0 }, 1, 0, 1, "pp 2, the last stage fails" },
        { &llama, { 1, 2, 1, 1, 1, 2, 1 }, 1, 0, 1, "pp 2, microbatches of 2, offload on" },
        { &llama, { 2, 1, 1, 1, 1, 1, 0 }, 1, 0, 1, "dp 2, one group split" },
        { &llama, { 2, 1, 1, 2, 1, 1, 0 }, 2, 0, 3, "dp 2 tp 2, whole groups" },
        { &llama, { 2, 1, 1, 2, 1, 1, 0 }, 2, 1, 2, "dp 2 tp 2, a prefix tree" },
        { &moe, { 1, 2, 1, 2, 2, 1, 0 }, 1, 0, 2, "MoE pp 2 tp 2 ep 2" },
        { &llama, { 1, 2, 2, 2, 1, 1, 0 }, 1, 0, 5, "pp 2 tp 2 cp 2" },
    };
    const pr_config *models[2] = { &llama, &moe };
    pr_trainer *ref[2];                           /* the tensors' table, for comparing arenas */
    pr_real *init[2], *grads[2], *want, *params[2];      /* rank 0 gathers grads and params */
    for (int c = 0; c < 2; c++) {
        ref[c] = make_model(models[c], 5);
        init[c] = params_of(ref[c]);
        grads[c] = malloc(sizeof(pr_real) * pr_trainer_param_count(ref[c]));
        params[c] = malloc(sizeof(pr_real) * pr_trainer_param_count(ref[c]));
    }
    const size_t most = pr_trainer_param_count(ref[0]) > pr_trainer_param_count(ref[1]) ? pr_trainer_param_count(ref[0])
                                                                                         : pr_trainer_param_count(ref[1]);
    want = malloc(sizeof(pr_real) * most);
    int runs = 0, failed = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int moe_case = cases[i].c == &moe;
        mesh_run m;
        memset(&m, 0, sizeof m);
        m.c = cases[i].c; m.shape = cases[i].s; m.groups = groups; m.n = cases[i].groups; m.init = init[moe_case];
        m.tree = cases[i].tree;
        m.grads = grads[moe_case];
        m.params = params[moe_case];
        m.opt = pr_step_opts_default();
        m.opt.microbatch = cases[i].s.mb;
        m.opt.offload.enabled = cases[i].s.offload;
        m.victim = cases[i].victim;
        m.fail_at = LONG_MAX;
        pr_error err;
        pr_status st = pr_comm_local_run(mesh_size(m.shape), mesh_rank, &m, &err);
        const long total = m.allocs;
        CHECK(st == PR_OK && total > 0, "%s: the counting run: %s (%ld allocations)", cases[i].name, st ? err.message : "", total);
        if (st || total <= 0) continue;
        memcpy(want, m.grads, sizeof(pr_real) * pr_trainer_param_count(ref[moe_case]));
        char cause[32];
        snprintf(cause, sizeof cause, "rank %d: ", m.victim);
        for (long k = 0, step = total / 24 + 1; k < total; k += k < 4 ? 1 : step) {
            m.fail_at = k;
            st = pr_comm_local_run(mesh_size(m.shape), mesh_rank, &m, &err);
            runs++;
            failed += st != PR_OK;
            CHECK(st == PR_OK || (st == PR_ERR_NOMEM && !strncmp(err.message, cause, strlen(cause))),
                  "%s, allocation %ld of %ld fails: the run says %d '%s' (want rank %d's own failure)", cases[i].name, k, total, (int)st,
                  err.message, m.victim);
            if (!st) CHECK(close_arenas(ref[moe_case], m.grads, want, "gradient", cases[i].name),
                           "%s, allocation %ld of %ld fails: the step went on, with other gradients", cases[i].name, k, total);
        }
    }
    CHECK(failed > runs / 4, "mesh faults: only %d of %d runs failed", failed, runs);
    printf("mesh faults: %d runs with an allocation failing mid-step on one rank (%d failed, the rest went on without it: a GEMM's "
           "packing buffer), %zu layouts\n", runs, failed, sizeof cases / sizeof cases[0]);
    for (int c = 0; c < 2; c++) {
        free(init[c]);
        free(grads[c]);
        free(params[c]);
        pr_trainer_destroy(ref[c]);
    }
    free(want);
}

/* ---- TP above the KV heads: each KV head replicated on tp / KV heads ranks */
/* One reuse step and AdamW on a mesh, each rank's arenas kept; then the training state saved and
   loaded into a new trainer on the same mesh, which must get back this rank's shard. */
static int same_state(pr_trainer *a, pr_trainer *b);
typedef struct {
    const pr_config *c;
    mesh_shape shape;
    const pr_group *g;
    const pr_real *init;
    const char *dir;
    pr_real *arena[16][4];        /* each rank's parameters, gradients, AdamW m and v after the step */
    size_t n;                     /* the local arena's length (the same on every TP rank) */
    size_t kv_off[8][16], kv_numel[16];
    int n_kv;                     /* the local k/v projections' places in each rank's arena (a vocabulary
                                     slice of its own before them) */
    int reload_same[16];
} kvrep_run;

static pr_status kvrep_rank(pr_comm *world, void *user, pr_error *err) {
    kvrep_run *m = user;
    const int r = world->rank;
    pr_mesh mesh;
    pr_trainer *tr, *back = NULL;
    pr_step_opts o = pr_step_opts_default();
    pr_adamw_opts adam = pr_adamw_opts_default();
    pr_train_state state = { 0, 1, 5, adam, 0 };
    pr_status s = mesh_open(world, m->shape, 0, m->c, 0, &mesh, &tr, err);
    if (!s) s = pr_trainer_set_full_params(tr, m->init, pr_trainer_full_param_count(tr), err);
    if (!s) s = pr_trainer_compute_grads(tr, m->g, &o, NULL, NULL, err);
    const size_t n = tr ? tr->n_params : 0;
    for (int k = 0; k < 4; k++) m->arena[r][k] = malloc(sizeof(pr_real) * n);
    if (!s) memcpy(m->arena[r][1], tr->grads, sizeof(pr_real) * n);     /* before clipping rescales them */
    if (!s) s = pr_trainer_adamw_step(tr, &adam, NULL, err);
    if (!s) {
        memcpy(m->arena[r][0], tr->params, sizeof(pr_real) * n);
        memcpy(m->arena[r][2], tr->adam_m, sizeof(pr_real) * n);
        memcpy(m->arena[r][3], tr->adam_v, sizeof(pr_real) * n);
    }
    if (!s) {
        int kv = 0;
        for (int t = 0; t < tr->n_tensors; t++)
            if (strstr(tr->tensors[t].name, "k_proj") || strstr(tr->tensors[t].name, "v_proj")) {
                m->kv_off[r][kv] = tr->tensors[t].offset;
                m->kv_numel[kv++] = tr->tensors[t].numel;
            }
        if (r == 0) m->n_kv = kv;
    }
    if (!s) s = pr_trainer_save_state(tr, m->dir, &state, NULL, err);
    if (!s) s = world->barrier(world, err);                          /* world rank 0 has written it */
    if (!s) s = pr_trainer_create_mesh(&back, m->c, pr_backend_cpu(), &mesh, err);
    if (!s) s = pr_trainer_load_state(back, m->dir, NULL, err);
    if (!s) m->reload_same[r] = same_state(tr, back);     /* the state is in the build's precision: exact */
    pr_trainer_destroy(back);
    mesh_close(&mesh, tr);
    return s;
}

/* The replicas of each KV head hold the same bits after a step (parameters, gradients, m, v), the
   ranks of different KV heads do not, and a saved state (one copy of each KV head) loads back into
   every replica. */
static void kvrep_replicas_case(const pr_config *c, mesh_shape shape, const pr_group *g, const char *label) {
    pr_trainer *one = make_model(c, 5);
    pr_real *init = params_of(one);
    char dir[256];
    CHECK(make_scratch_dir(dir, sizeof dir, "kvrep"), "a scratch folder under %s", test_tmpdir());
    kvrep_run m;
    memset(&m, 0, sizeof m);
    m.c = c; m.shape = shape; m.g = g; m.init = init; m.dir = dir;
    pr_error err;
    const int ranks = mesh_size(shape), rep = shape.tp / c->num_key_value_heads;
    pr_status st = pr_comm_local_run(ranks, kvrep_rank, &m, &err);
    CHECK(st == PR_OK, "%s: %s", label, err.message);
    if (st == PR_OK) {
        int same = 1, distinct = 1, reloaded = 1;
        for (int r = 0; r < ranks; r++) {
            reloaded &= m.reload_same[r];
            for (int k = 0; k < 4; k++)
                for (int t = 0; t < m.n_kv; t++) {
                    const size_t bytes = sizeof(pr_real) * m.kv_numel[t];
                    const pr_real *mine = m.arena[r][k] + m.kv_off[r][t], *before = r ? m.arena[r - 1][k] + m.kv_off[r - 1][t] : NULL;
                    if (r % rep) same &= !memcmp(mine, before, bytes);
                    else if (r && k == 0) distinct &= memcmp(mine, before, bytes) != 0;
                }
        }
        CHECK(m.n_kv > 0 && same, "%s: the replicas of a KV head differ (parameters, gradients or AdamW moments)", label);
        CHECK(distinct, "%s: ranks of different KV heads hold equal k/v weights", label);
        CHECK(reloaded, "%s: a saved state loaded back into the mesh differs from the shard saved", label);
        /* the state holds each KV head once: a single rank reads the model the mesh gathers */
        pr_trainer *whole = make_model(c, 6);
        pr_trainer *ref = make_model(c, 5);
        pr_step_opts o = pr_step_opts_default();
        pr_adamw_opts adam = pr_adamw_opts_default();
        CHECK(!pr_trainer_load_state(whole, dir, NULL, &err), "%s: the saved state on one rank: %s", label, err.message);
        CHECK(!pr_trainer_compute_grads(ref, g, &o, NULL, NULL, &err) && !pr_trainer_adamw_step(ref, &adam, NULL, &err), "%s: %s",
              label, err.message);
        pr_real *pw = params_of(whole), *pref = params_of(ref);
        CHECK(close_arenas(ref, pw, pref, "saved parameter", label), "%s: the saved model vs one rank's step", label);
        free(pw); free(pref);
        pr_trainer_destroy(whole);
        pr_trainer_destroy(ref);
    }
    for (int r = 0; r < ranks; r++)
        for (int k = 0; k < 4; k++) free(m.arena[r][k]);
    free(init);
    pr_trainer_destroy(one);
    remove_tree(dir, 1);
}

typedef struct { const pr_config *c; int tp; pr_status st[8]; pr_error err[8]; } kvrep_refusal;
static pr_status kvrep_refuse_rank(pr_comm *world, void *user, pr_error *err) {
    kvrep_refusal *f = user;
    pr_mesh mesh;
    pr_trainer *tr = NULL;
    pr_status s = pr_mesh_init(&mesh, world, 1, 1, 1, f->tp, 1, err);
    if (s) return s;
    f->st[world->rank] = pr_trainer_create_mesh(&tr, f->c, pr_backend_cpu(), &mesh, &f->err[world->rank]);
    pr_trainer_destroy(tr);
    pr_mesh_free(&mesh);
    return PR_OK;
}

/* The loss head in chunks on an uneven vocabulary split (61 rows over tp 2: 30 and 31): a chunk
   size of 60 logits gives each slice a different row count, yet every TP rank must run the same
   chunks, as each is a collective. Loss and gradients against one rank with the same chunks. */
typedef struct { const pr_config *c; const pr_backend *be; const pr_group *g; const pr_real *init; double loss[2];
                 pr_real *grads; size_t n; } head_chunk_run;
static pr_status head_chunk_rank(pr_comm *world, void *user, pr_error *err) {
    head_chunk_run *h = user;
    pr_mesh mesh;
    pr_trainer *tr = NULL;
    pr_status s = pr_mesh_init(&mesh, world, 1, 1, 1, 2, 1, err);
    if (s) return s;
    pr_step_opts o = pr_step_opts_default();
    pr_step_stats st;
    if (!(s = pr_trainer_create_mesh(&tr, h->c, h->be, &mesh, err))) s = pr_trainer_set_full_params(tr, h->init, h->n, err);
    if (!s) s = pr_trainer_compute_grads(tr, h->g, &o, &st, NULL, err);
    if (!s) h->loss[world->rank] = st.loss;
    pr_real *grads = world->rank ? malloc(sizeof(pr_real) * h->n) : h->grads;      /* every rank gathers; rank 0 keeps */
    if (!s) s = pr_trainer_get_full(tr, PR_ARENA_GRADS, grads, h->n, err);
    if (world->rank) free(grads);
    pr_trainer_destroy(tr);
    pr_mesh_free(&mesh);
    return s;
}
static void test_head_chunks_uneven_vocab(void) {
    pr_config c = small_config(0, 0, 2);
    static test_group tg;
    const int S[3] = { 6, 4, 7 };
    make_group(&tg, 9, 3, S, c.vocab_size, 1401);
    pr_backend be = *pr_backend_cpu();
    be.logit_chunk = 60;
    pr_trainer *one = make_model_on(&c, 5, &be);
    pr_real *init = params_of(one);
    pr_step_opts o = pr_step_opts_default();
    pr_step_stats st;
    pr_error err;
    CHECK(c.vocab_size == 61 && !pr_trainer_compute_grads(one, &tg.g, &o, &st, NULL, &err), "head chunks: one rank: %s", err.message);
    head_chunk_run h = { &c, &be, &tg.g, init, { 0, 0 }, NULL, pr_trainer_param_count(one) };
    h.grads = malloc(sizeof(pr_real) * h.n);
    pr_real *ref = malloc(sizeof(pr_real) * h.n);
    CHECK(!pr_trainer_get_grads(one, ref, h.n, &err), "head chunks: %s", err.message);
    pr_status rs = pr_comm_local_run(2, head_chunk_rank, &h, &err);
    CHECK(rs == PR_OK, "head chunks on tp 2: %s", err.message);
    if (rs == PR_OK) {
        const double tol = sizeof(pr_real) == 8 ? 1e-12 : 1e-6;
        CHECK(fabs(h.loss[0] - st.loss) <= tol * fabs(st.loss) && h.loss[1] == h.loss[0], "head chunks on tp 2: loss %.17g, %.17g vs %.17g",
              h.loss[0], h.loss[1], st.loss);
        CHECK(close_arenas(one, h.grads, ref, "gradient", "head chunks"), "head chunks on tp 2: the gradients differ from one rank's");
    }
    printf("loss head: chunks of 60 logits over a vocabulary of 61 split 30/31 over tp 2 vs one rank\n");
    free(h.grads); free(ref); free(init);
    pr_trainer_destroy(one);
}

static void test_kv_replication(void) {
    const int S[6] = { 5, 1, 8, 3, 6, 2 };
    static test_group tg[2];
    pr_group groups[2];
    for (int i = 0; i < 2; i++) {
        make_group(&tg[i], 7 + 2 * i, 3 + i, S + i, 61, 1300 + i);
        groups[i] = tg[i].g;
    }
    const pr_moe_opts mb_scope = { PR_AUX_SCOPE_MICROBATCH, 0 }, group_scope = { PR_AUX_SCOPE_GROUP, 0 };
    pr_config llama = small_config(0, 0, 2), qwen = small_config(1, 1, 1), moe = moe_config(1);
    llama.num_attention_heads = 8;     /* 2 KV heads: tp 4 and 8 replicate each on 2 and 4 ranks */
    moe.num_experts = 8;
    moe.moe_intermediate_size = 8;
    /* shapes: dp, pp, cp, tp, ep, microbatch, offload */
    const mesh_spec cases[] = {
        { &llama, { 1, 1, 1, 4, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "kv replicated: llama 2 KV heads, tp 4" },
        { &llama, { 1, 1, 1, 4, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_BASELINE, "kv replicated: llama 2 KV heads, tp 4, baseline" },
        { &llama, { 1, 1, 1, 8, 1, 2, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "kv replicated: llama 2 KV heads, tp 8" },
        { &llama, { 1, 1, 1, 8, 1, 2, 0 }, 1, mb_scope, PR_SCHEDULE_BASELINE, "kv replicated: llama 2 KV heads, tp 8, baseline" },
        { &qwen, { 1, 1, 1, 2, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "kv replicated: qwen3 1 KV head, tp 2 (tied, q/k norms)" },
        { &qwen, { 1, 1, 1, 4, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "kv replicated: qwen3 1 KV head, tp 4" },
        { &qwen, { 1, 1, 1, 4, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_BASELINE, "kv replicated: qwen3 1 KV head, tp 4, baseline" },
        { &moe, { 1, 1, 1, 4, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "kv replicated: MoE 2 KV heads, tp 4 (expert columns)" },
        { &moe, { 1, 1, 1, 4, 4, 1, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, "kv replicated: MoE 2 KV heads, tp 4 ep 4, group scope" },
        { &qwen, { 1, 2, 2, 2, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "kv replicated: qwen3 1 KV head, pp 2 cp 2 tp 2" },
        { &llama, { 2, 1, 1, 4, 1, 1, 0 }, 2, mb_scope, PR_SCHEDULE_REUSE, "kv replicated: llama 2 KV heads, dp 2 tp 4" },
        { &llama, { 2, 1, 1, 4, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "kv replicated: llama 2 KV heads, dp 2 tp 4, one group split" },
    };
    const int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) mesh_case(cases[i].c, cases[i].s, groups, cases[i].groups, cases[i].moe, cases[i].sched, cases[i].name);
    zero_case(&llama, (mesh_shape){ 2, 1, 1, 4, 1, 1, 0 }, groups, 2, PR_SCHEDULE_REUSE, "kv replicated: zero, dp 2 tp 4");
    kvrep_replicas_case(&llama, (mesh_shape){ 1, 1, 1, 8, 1, 1, 0 }, &groups[0], "kv replicas: llama tp 8");
    kvrep_replicas_case(&moe, (mesh_shape){ 1, 1, 1, 4, 4, 1, 0 }, &groups[1], "kv replicas: MoE tp 4 ep 4");
    /* tp neither dividing the KV heads nor a multiple of them: refused on every rank */
    pr_config odd = small_config(0, 0, 4);
    odd.num_attention_heads = 12;
    kvrep_refusal f;
    memset(&f, 0, sizeof f);
    f.c = &odd;
    f.tp = 6;
    pr_error err;
    CHECK(pr_comm_local_run(6, kvrep_refuse_rank, &f, &err) == PR_OK, "refusal run: %s", err.message);
    for (int r = 0; r < 6; r++)
        CHECK(f.st[r] == PR_ERR_UNSUPPORTED && strstr(f.err[r].message, "tp 6 must divide the KV heads (4) or be a multiple of them"),
              "tp 6 over 4 KV heads, rank %d: %s '%s'", r, pr_status_name(f.st[r]), f.st[r] ? f.err[r].message : "");
    /* fewer vocabulary rows than TP ranks: a rank would hold no slice of the embedding */
    pr_config few = small_config(0, 0, 2);
    few.num_attention_heads = 8;
    few.vocab_size = 3;
    memset(&f, 0, sizeof f);
    f.c = &few;
    f.tp = 4;
    CHECK(pr_comm_local_run(4, kvrep_refuse_rank, &f, &err) == PR_OK, "refusal run: %s", err.message);
    for (int r = 0; r < 4; r++)
        CHECK(f.st[r] == PR_ERR_UNSUPPORTED && strstr(f.err[r].message, "tp 4 is larger than the vocabulary (3)"),
              "tp 4 over a vocabulary of 3, rank %d: %s '%s'", r, pr_status_name(f.st[r]), f.st[r] ? f.err[r].message : "");
    /* the shipped Qwen3-30B-A3B (4 KV heads) shards at tp 8 ep 8: 4 query heads and 1 KV head, 16 experts and
       151,936 / 8 vocabulary rows a rank */
    pr_config big, local;
    pr_mesh eight;
    memset(&eight, 0, sizeof eight);
    eight.dp = eight.pp = eight.cp = 1;
    eight.tp = eight.ep = 8;
    eight.tp_rank = 5;
    int layer0, expert0, n_experts;
    CHECK(!pr_config_load(&big, "model/qwen3-30b-a3b", &err) &&
          !pr__shard_config(&big, &eight, &local, &layer0, &expert0, &n_experts, &err) && local.num_attention_heads == 4 &&
          local.num_key_value_heads == 1 && n_experts == 16 && expert0 == 80 && local.vocab_size == 18992 &&
          pr__vocab0(big.vocab_size, 8, 5) == 94960, "qwen3-30b-a3b at tp 8: %s", err.message);
    /* an uneven split: 61 rows over tp 4 as 15, 15, 15, 16 */
    const int v0[5] = { 0, 15, 30, 45, 61 };
    for (int r = 0; r <= 4; r++) CHECK(pr__vocab0(61, 4, r) == v0[r], "vocabulary 61 over tp 4: rank %d starts at %d", r, pr__vocab0(61, 4, r));
    printf("kv replication: %d layouts with tp above the KV heads vs the single-rank baseline, ZeRO, replicas bitwise equal, "
           "state round trip, qwen3-30b-a3b at tp 8, tp 6 over 4 KV heads and tp 4 over a vocabulary of 3 refused\n", n);
}

/* ---- offload of the prefix's dormant state */
/* The CPU backend with copies that really are late: copy_async only queues, and the queue runs (in
   order, as one copy stream would) up to the last copy with a tag when copy_wait names it, or all
   of it at sync. A schedule that reads a block before waiting for it, or overwrites a slot whose
   outgoing copy is still queued, computes on stale data and fails the bitwise comparison. */
typedef struct { void *dst; const void *src; size_t bytes; int tag; } late_copy;
typedef struct { pr_backend be; late_copy q[256]; int n, max_queued; } late_backend;

static void late_run_through(late_backend *lb, int last) {
    for (int i = 0; i <= last; i++) memcpy(lb->q[i].dst, lb->q[i].src, lb->q[i].bytes);
    memmove(lb->q, lb->q + last + 1, sizeof(late_copy) * (size_t)(lb->n - last - 1));
    lb->n -= last + 1;
}
static void late_copy_async(const pr_backend *be, void *dst, const void *src, size_t bytes, int tag) {
    late_backend *lb = (late_backend *)be->ctx;
    if (lb->n == 256) late_run_through(lb, 0);
    late_copy c = { dst, src, bytes, tag };
    lb->q[lb->n++] = c;
    if (lb->n > lb->max_queued) lb->max_queued = lb->n;
}
static void late_copy_wait(const pr_backend *be, int tag) {
    late_backend *lb = (late_backend *)be->ctx;
    int last = -1;
    for (int i = 0; i < lb->n; i++) if (lb->q[i].tag == tag) last = i;
    if (last >= 0) late_run_through(lb, last);
}
static void late_sync(const pr_backend *be) {
    late_backend *lb = (late_backend *)be->ctx;
    if (lb->n) late_run_through(lb, lb->n - 1);
}
static void late_backend_init(late_backend *lb) {
    memset(lb, 0, sizeof *lb);
    lb->be = *pr_backend_cpu();
    lb->be.name = "cpu, late copies";
    lb->be.ctx = lb;
    lb->be.copy_async = late_copy_async;
    lb->be.copy_wait = late_copy_wait;
    lb->be.sync = late_sync;
}

static size_t offload_param_count(const pr_config *c) {
    pr_trainer *tr;
    pr_error err;
    if (pr_trainer_create(&tr, c, pr_backend_cpu(), &err)) return 0;
    size_t n = pr_trainer_param_count(tr);
    pr_trainer_destroy(tr);
    return n;
}
typedef struct { pr_real *grads, *params; pr_step_stats st; pr_status status; } step_result;

/* One reuse step and one AdamW step from the same weights every time. */
static step_result reuse_step(const pr_config *c, const pr_group *g, int mb, pr_layout layout, pr_offload_opts off,
                              const pr_backend *be) {
    step_result r;
    memset(&r, 0, sizeof r);
    pr_trainer *tr = make_model_on(c, 23, be);
    pr_step_opts o = pr_step_opts_default();
    o.microbatch = mb;
    o.layout = layout;
    o.loss.kl_coef = 0.05;
    o.offload = off;
    pr_adamw_opts a = pr_adamw_opts_default();
    pr_error err;
    r.status = pr_trainer_compute_grads(tr, g, &o, &r.st, NULL, &err);
    if (!r.status) r.status = pr_trainer_adamw_step(tr, &a, NULL, &err);
    if (r.status) printf("reuse_step: %s\n", err.message);
    r.grads = grads_of(tr);
    r.params = params_of(tr);
    pr_trainer_destroy(tr);
    return r;
}

static void test_offload(void) {
    const int S[5] = { 4, 9, 1, 6, 3 };
    for (int qk = 0; qk < 2; qk++) {
        pr_config c = small_config(qk, qk, 2);
        c.num_hidden_layers = 4;                 /* more layers than the two device slots */
        const int L = c.num_hidden_layers;
        test_group t;
        make_group(&t, 21, 5, S, c.vocab_size, 77 + qk);
        for (int lay = 0; lay < 2; lay++) {
            pr_offload_opts none;
            memset(&none, 0, sizeof none);
            step_result ref = reuse_step(&c, &t.g, 2, (pr_layout)lay, none, pr_backend_cpu());
            const pr_offload_stats *rs = &ref.st.offload;
            CHECK(ref.status == PR_OK && rs->dormant_bytes == (size_t)L * rs->block_bytes && rs->block_bytes > 0,
                  "offload off still reports the dormant footprint (%zu bytes, %zu a layer)", rs->dormant_bytes, rs->block_bytes);
            struct { const char *name; pr_offload_opts o; int fallbacks, refused; } cases[4];
            memset(cases, 0, sizeof cases);
            cases[0].name = "pool sized from the footprint"; cases[0].o.enabled = 1;
            cases[1].name = "pool exactly the footprint"; cases[1].o.enabled = 1; cases[1].o.pool_bytes = rs->dormant_bytes;
            cases[2].name = "pool one block"; cases[2].o.enabled = 1; cases[2].o.pool_bytes = rs->block_bytes;
            cases[2].fallbacks = L - 1;
            cases[3].name = "budget refuses every prefetch"; cases[3].o.enabled = 1; cases[3].o.device_budget = 1;
            cases[3].refused = L;
            static late_backend late;
            late_backend_init(&late);
            for (int k = 0; k < 8; k++) {
                /* each case on the CPU backend, then again with late copies */
                const pr_backend *be = k < 4 ? pr_backend_cpu() : &late.be;
                step_result r = reuse_step(&c, &t.g, 2, (pr_layout)lay, cases[k % 4].o, be);
                const pr_offload_stats *os = &r.st.offload;
                CHECK(r.status == PR_OK, "offload (%s): step failed", cases[k % 4].name);
                CHECK(!memcmp(r.grads, ref.grads, sizeof(pr_real) * offload_param_count(&c)) &&
                      !memcmp(r.params, ref.params, sizeof(pr_real) * offload_param_count(&c)),
                      "offload (%s, %s, %s): gradients or updated parameters differ from offload off in some bit",
                      cases[k % 4].name, qk ? "qwen3" : "llama", lay ? "packed" : "padded");
                CHECK(os->offloaded_bytes == rs->dormant_bytes && os->loaded_bytes == rs->dormant_bytes,
                      "offload (%s): %zu bytes out, %zu back, footprint %zu", cases[k % 4].name, os->offloaded_bytes,
                      os->loaded_bytes, rs->dormant_bytes);
                CHECK(os->prefetches + os->demand_loads == L, "offload (%s): %d prefetched + %d loaded at use != %d layers",
                      cases[k % 4].name, os->prefetches, os->demand_loads, L);
                CHECK(os->pool_fallbacks == cases[k % 4].fallbacks, "offload (%s): %d pool fallbacks, expected %d", cases[k % 4].name,
                      os->pool_fallbacks, cases[k % 4].fallbacks);
                CHECK(os->prefetches_refused == cases[k % 4].refused && (cases[k % 4].refused ? os->demand_loads == L : os->demand_loads == 0),
                      "offload (%s): %d refused, %d loaded at use", cases[k % 4].name, os->prefetches_refused, os->demand_loads);
                /* Phase B holds no block at all: the saving is the whole footprint (at least footprint
                   minus the two device slots, the bound the design promises) */
                size_t saved = ref.st.peak_bytes[PR_PHASE_B] - r.st.peak_bytes[PR_PHASE_B];
                CHECK(r.st.peak_bytes[PR_PHASE_B] < ref.st.peak_bytes[PR_PHASE_B] && saved >= rs->dormant_bytes - 2 * rs->block_bytes,
                      "offload (%s): Phase-B peak %zu vs %zu without, saving %zu < footprint %zu - 2 blocks", cases[k % 4].name,
                      r.st.peak_bytes[PR_PHASE_B], ref.st.peak_bytes[PR_PHASE_B], saved, rs->dormant_bytes);
                CHECK(r.st.peak_bytes[PR_PHASE_A] < ref.st.peak_bytes[PR_PHASE_A],
                      "offload (%s): Phase-A peak %zu not below %zu (two slots for %d layers)", cases[k % 4].name,
                      r.st.peak_bytes[PR_PHASE_A], ref.st.peak_bytes[PR_PHASE_A], L);
                free(r.grads); free(r.params);
            }
            CHECK(late.max_queued >= 2, "late copies: at most %d copy queued at once, the overlap is not exercised", late.max_queued);
            free(ref.grads); free(ref.params);
        }
    }
    /* offload belongs to the reuse schedule: asking it of the baseline is refused before anything runs */
    pr_config c = small_config(0, 0, 2);
    const int S2[2] = { 3, 2 };
    test_group t;
    make_group(&t, 5, 2, S2, c.vocab_size, 5);
    pr_trainer *tr = make_model(&c, 3);
    pr_step_opts o = pr_step_opts_default();
    o.schedule = PR_SCHEDULE_BASELINE;
    o.offload.enabled = 1;
    pr_error err;
    CHECK(pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err) == PR_ERR_ARG && strstr(err.message, "reuse"),
          "offload with the baseline schedule is refused: '%s'", err.message);
    pr_trainer_destroy(tr);
}

/* ---- activation memory: which chunk a request takes */
/* The CPU backend with its device tier capped, each device allocation recorded (address and size),
   so a test sees what the arenas hold and what they gave back. */
typedef struct { pr_backend be; size_t held, cap; void *ptr[64]; size_t size[64]; int n; } capped_backend;

static void *capped_alloc(const pr_backend *be, size_t bytes, pr_tier tier) {
    capped_backend *cb = (capped_backend *)be->ctx;
    if (tier == PR_TIER_DEVICE && (cb->held + bytes > cb->cap || cb->n == 64)) return NULL;
    void *p = pr_backend_cpu()->alloc(pr_backend_cpu(), bytes, tier);
    if (p && tier == PR_TIER_DEVICE) {
        cb->ptr[cb->n] = p;
        cb->size[cb->n++] = bytes;
        cb->held += bytes;
    }
    return p;
}
static void capped_release(const pr_backend *be, void *p, pr_tier tier) {
    capped_backend *cb = (capped_backend *)be->ctx;
    for (int i = 0; tier == PR_TIER_DEVICE && i < cb->n; i++)
        if (cb->ptr[i] == p) {
            cb->held -= cb->size[i];
            cb->ptr[i] = cb->ptr[--cb->n];
            cb->size[i] = cb->size[cb->n];
            break;
        }
    pr_backend_cpu()->release(pr_backend_cpu(), p, tier);
}
static int capped_holds(const capped_backend *cb, const void *p) {
    const uintptr_t a = (uintptr_t)p;
    for (int i = 0; i < cb->n; i++)
        if ((uintptr_t)cb->ptr[i] <= a && a - (uintptr_t)cb->ptr[i] < cb->size[i]) return 1;
    return 0;
}

static void test_arena_spares(void) {
    capped_backend cb;
    memset(&cb, 0, sizeof cb);
    cb.be = *pr_backend_cpu();
    cb.be.name = "cpu, capped device memory";
    cb.be.ctx = &cb;
    cb.be.alloc = capped_alloc;
    cb.be.release = capped_release;
    cb.cap = SIZE_MAX;
    pr_config c = small_config(0, 0, 2);
    pr_trainer *tr = make_model_on(&c, 3, &cb.be);
    if (!tr) { CHECK(0, "arena spares: no trainer"); return; }
    const size_t MiB = (size_t)1 << 20, block = 3 * PR__CHUNK_BYTES;    /* a layer's block: more than a chunk */
    const size_t state = cb.held;                                            /* the trainer's own device memory */
    pr__arena pass = { 0 }, next = { 0 }, live = { 0 };
    /* one pass: a block, then a small tensor in a chunk of its own */
    pr__elems(tr, &pass, block, 1);
    pr__elems(tr, &pass, MiB, 1);
    const size_t held = cb.held;
    pr__arena_reset(tr, &pass);
    /* the next asks in the other order: the small tensor takes the small spare, the block the big one */
    pr__elems(tr, &next, MiB, 1);
    void *b = pr__elems(tr, &next, block, 1);
    CHECK(b && !tr->alloc_failed && cb.held == held, "arena spares: the next pass took %.0f MiB more than the %.0f MiB held before",
          (double)(cb.held - held) / MiB, (double)held / MiB);
    /* a tensor that lives on, then a request no spare fits and the device has no room for: the
       spares go back, the request is served, the live tensor stays where it was */
    unsigned char *kept = pr__elems(tr, &live, MiB, 1);
    if (kept) memset(kept, 0x5a, MiB);
    pr__arena_reset(tr, &next);
    size_t spare = 0;
    for (const pr__chunk *k = tr->spare; k; k = k->next) spare += k->cap;
    const size_t want_bytes = block + 2 * PR__CHUNK_BYTES, room = want_bytes - spare / 2;   /* room alone is short of it */
    cb.cap = cb.held + room;
    void *wide = pr__elems(tr, &live, want_bytes, 1);
    int kept_intact = kept && capped_holds(&cb, kept);
    for (size_t i = 0; kept_intact && i < MiB; i++) kept_intact = kept[i] == 0x5a;
    CHECK(wide && !tr->alloc_failed && cb.held <= cb.cap && !tr->spare && kept_intact,
          "arena spares: a request past the device's room with %.0f MiB of spares: %s, %.0f of %.0f MiB held, spares %s, "
          "the live tensor %s", (double)spare / MiB, wide ? "served" : "refused", (double)cb.held / MiB,
          (double)cb.cap / MiB, tr->spare ? "kept" : "given back", kept_intact ? "intact" : "lost");
    /* with nothing spare to give back, it still fails as it did, and the error says what was live
       and what the chunks held */
    tr->alloc_failed = 0;
    CHECK(!pr__elems(tr, &live, 4 * block, 1) && tr->alloc_failed, "arena spares: a request past the cap with no spares was served");
    CHECK(tr->chunk_bytes == cb.held - state, "arena spares: the trainer counts %zu bytes of chunks, the device holds %zu", tr->chunk_bytes,
          cb.held - state);
    pr_error err;
    char want[96];
    snprintf(want, sizeof want, "(%.0f MiB live; %.0f MiB in chunks, 0 MiB in offload slots)", (double)(MiB + want_bytes) / MiB,
             (double)(cb.held - state) / MiB);
    CHECK(pr__act_nomem(tr, &err, "for a pass of", 7) == PR_ERR_NOMEM && strstr(err.message, "for a pass of 7 rows") &&
          strstr(err.message, want), "arena spares: the error reads '%s', not with '%s'", err.message, want);
    pr__arena_reset(tr, &live);
    tr->alloc_failed = 0;
    /* a step's stats: the chunks held at its end, which hold every peak's tensors */
    cb.cap = SIZE_MAX;
    static test_group t;
    const int S[3] = { 5, 9, 2 };
    make_group(&t, 12, 3, S, c.vocab_size, 4);
    pr_step_opts o = pr_step_opts_default();
    pr_step_stats st;
    const pr_status ss = pr_trainer_compute_grads(tr, &t.g, &o, &st, NULL, &err);
    size_t peak = 0;
    for (int p = 0; p < 3; p++) if (st.peak_bytes[p] > peak) peak = st.peak_bytes[p];
    CHECK(ss == PR_OK && st.chunk_bytes == cb.held - state && st.chunk_bytes >= peak && peak > 0,
          "arena spares: a step's stats say %zu bytes of chunks (the device holds %zu for them), peak %zu: %s", st.chunk_bytes,
          cb.held - state, peak, ss ? err.message : "");
    pr_trainer_destroy(tr);
    CHECK(cb.n == 0 && cb.held == 0, "arena spares: %d device allocations (%zu bytes) outlived the trainer", cb.n, cb.held);
}

static void test_checkpoints(void) {
    pr_config c = small_config(1, 1, 2);
    pr_trainer *a = make_model(&c, 21), *b;
    pr_error err;
    size_t n = pr_trainer_param_count(a);
    char dir[256], path[700];
    CHECK(make_scratch_dir(dir, sizeof dir, "ckpt"), "a scratch folder under %s", test_tmpdir());
    CHECK(pr_trainer_create(&b, &c, pr_backend_cpu(), &err) == PR_OK, "%s", err.message);
    pr_real *pa = params_of(a), *pb;

    /* fp32, then load: bitwise (double build: fp32 rounding of each weight) */
    CHECK(!pr_trainer_save(a, dir, PR_DT_F32, 0, &err), "save: %s", err.message);
    CHECK(!pr_trainer_load(b, dir, &err), "load: %s", err.message);
    pb = params_of(b);
    int same = 1;
    for (size_t i = 0; i < n; i++) if (pb[i] != (pr_real)(float)pa[i]) same = 0;
    CHECK(same, "fp32 checkpoint round trip changed parameters");
    free(pb);
    pr_config back;
    snprintf(path, sizeof path, "%s/config.json", dir);
    CHECK(!pr_config_load(&back, path, &err) && back.qk_norm == c.qk_norm && back.tie_word_embeddings == 1 &&
          back.num_key_value_heads == c.num_key_value_heads && back.head_dim == c.head_dim, "config.json round trip: %s", err.message);

    /* bf16: within half a bf16 ulp */
    CHECK(!pr_trainer_save(a, dir, PR_DT_BF16, 0, &err), "save bf16: %s", err.message);
    CHECK(!pr_trainer_load(b, dir, &err), "load bf16: %s", err.message);
    pb = params_of(b);
    int within = 1;
    for (size_t i = 0; i < n; i++) if (!(fabs((double)pb[i] - pa[i]) <= fabs((double)pa[i]) * (1.0 / 256))) within = 0;
    CHECK(within, "bf16 checkpoint round trip off by more than half an ulp");
    free(pb);

    /* sharded through model.safetensors.index.json */
    char sdir[600];
    snprintf(sdir, sizeof sdir, "%s/sharded", dir);
    CHECK(!pr_trainer_save(a, sdir, PR_DT_F32, 4096, &err), "sharded save: %s", err.message);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", sdir);
    CHECK(access(path, F_OK) == 0, "no index file for a sharded save");
    CHECK(!pr_trainer_load(b, sdir, &err), "sharded load: %s", err.message);
    pb = params_of(b);
    same = 1;
    for (size_t i = 0; i < n; i++) if (pb[i] != (pr_real)(float)pa[i]) same = 0;
    CHECK(same, "sharded round trip changed parameters");
    free(pb);

    /* gradients under their parameter names */
    const int S[2] = { 3, 2 };
    test_group t;
    make_group(&t, 4, 2, S, c.vocab_size, 3);
    pr_step_opts o = pr_step_opts_default();
    CHECK(!pr_trainer_compute_grads(a, &t.g, &o, NULL, NULL, &err), "%s", err.message);
    snprintf(path, sizeof path, "%s/grads.safetensors", dir);
    CHECK(!pr_trainer_save_grads(a, path, &err), "save grads: %s", err.message);
    pr_checkpoint *ck;
    pr_real *ga = grads_of(a), *buf = malloc(sizeof(pr_real) * n);
    CHECK(!pr_checkpoint_open(&ck, path, &err), "open grads: %s", err.message);
    same = 1;
    for (int ti = 0; ti < pr_trainer_tensor_count(a); ti++) {
        const pr_tensor_info *info = pr_trainer_tensor(a, ti);
        const pr_st_tensor *st = pr_checkpoint_find(ck, info->name);
        if (!st || pr_checkpoint_read(ck, st, buf, info->numel, &err) || memcmp(buf, ga + info->offset, info->numel * sizeof(pr_real)))
            same = 0;
    }
    CHECK(same, "saved gradients differ from the trainer's");
    pr_checkpoint_close(ck);
    free(ga); free(buf); free(pa);
    pr_trainer_destroy(a);
    pr_trainer_destroy(b);
    remove_tree(dir, 1);
}

/* A well-formed checkpoint of another model is refused by naming the tensor and both shapes (or the
   tensor the model lacks), as a bad argument, not a malformed file; the trainer keeps its weights. */
static void test_other_shape(void) {
    const pr_config base = small_config(1, 1, 2);
    static const struct { const char *what; int field; int value; const char *needle; } rows[] = {
        { "hidden size", 0, 32, "model.embed_tokens.weight has shape [61, 32], the model's is [61, 24]" },
        { "MLP width", 1, 48, "mlp.gate_proj.weight has shape [48, 24], the model's is [40, 24]" },
        { "vocabulary", 2, 70, "model.embed_tokens.weight has shape [70, 24], the model's is [61, 24]" },
        { "KV heads", 3, 1, "self_attn.k_proj.weight has shape [8, 24], the model's is [16, 24]" },
        { "more layers", 4, 3, "model.layers.2." },
        { "fewer layers", 4, 1, "model.layers.1." },
        { "query heads", 5, 2, "self_attn.q_proj.weight has shape [16, 24], the model's is [32, 24]" },
    };
    pr_trainer *b = make_model(&base, 5);
    size_t n = pr_trainer_param_count(b);
    pr_real *before = params_of(b);
    char dir[256];
    CHECK(make_scratch_dir(dir, sizeof dir, "shape"), "a scratch folder under %s", test_tmpdir());
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        pr_config c = base;
        int *f[] = { &c.hidden_size, &c.intermediate_size, &c.vocab_size, &c.num_key_value_heads, &c.num_hidden_layers,
                     &c.num_attention_heads };
        *f[rows[r].field] = rows[r].value;
        pr_trainer *a = make_model(&c, 9);
        pr_error err;
        char sub[600];
        snprintf(sub, sizeof sub, "%s/%zu", dir, r);
        CHECK(!pr_trainer_save(a, sub, PR_DT_F32, 0, &err), "save %s: %s", rows[r].what, err.message);
        pr_status st = pr_trainer_load(b, sub, &err);
        CHECK(st == PR_ERR_ARG && strstr(err.message, rows[r].needle), "%s: status %s, '%s' (want '%s')", rows[r].what,
              pr_status_name(st), err.message, rows[r].needle);
        pr_trainer_destroy(a);
    }
    {   /* a Hugging Face file's extra tensor: passed over in one of the model's layers (a buffer),
           refused in a layer past its last, also one whose number is past int's range */
        const int nt = pr_trainer_tensor_count(b);
        pr_st_entry *en = calloc((size_t)nt + 1, sizeof *en);
        static const pr_real extra[2] = { 1, 2 };
        static const struct { const char *name; pr_status want; } cases[] = {
            { "model.layers.1.self_attn.rotary_emb.inv_freq", PR_OK },
            { "model.layers.2.self_attn.rotary_emb.inv_freq", PR_ERR_ARG },
            { "model.layers.99999999999999999999.self_attn.rotary_emb.inv_freq", PR_ERR_ARG },   /* atoi: -1 here */
        };
        for (int i = 0; i < nt; i++) {
            const pr_tensor_info *ti = pr_trainer_tensor(b, i);
            en[i].name = ti->name;
            en[i].data = before + ti->offset;
            en[i].ndim = ti->ndim;
            en[i].shape[0] = ti->shape[0];
            en[i].shape[1] = ti->shape[1];
        }
        for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
            pr_error err;
            char sub[600];
            snprintf(sub, sizeof sub, "%s/extra-%zu", dir, k);
            en[nt].name = cases[k].name;
            en[nt].data = extra;
            en[nt].ndim = 1;
            en[nt].shape[0] = 2;
            CHECK(!pr_checkpoint_save(sub, en, nt + 1, IS_DOUBLE ? PR_DT_F64 : PR_DT_F32, 0, &err), "save with %s: %s", cases[k].name, err.message);
            const pr_status st = pr_trainer_load(b, sub, &err);
            CHECK(st == cases[k].want && (!st || strstr(err.message, cases[k].name)), "extra tensor %s: status %s, '%s'", cases[k].name,
                  pr_status_name(st), st ? err.message : "");
        }
        free(en);
    }
    pr_real *after = params_of(b);
    CHECK(!memcmp(before, after, sizeof(pr_real) * n), "a refused checkpoint left the weights alone");
    free(before); free(after);
    pr_trainer_destroy(b);
    remove_tree(dir, 1);
}

/* One GRPO step and AdamW on a trainer. */
static void train_step(pr_trainer *tr, const pr_group *g) {
    pr_step_opts o = pr_step_opts_default();
    pr_adamw_opts a = pr_adamw_opts_default();
    pr_error err;
    CHECK(!pr_trainer_compute_grads(tr, g, &o, NULL, NULL, &err) && !pr_trainer_adamw_step(tr, &a, NULL, &err), "step: %s", err.message);
}

static int same_state(pr_trainer *a, pr_trainer *b) {
    size_t bytes = sizeof(pr_real) * a->n_params;
    return a->adam_step == b->adam_step && !memcmp(a->params, b->params, bytes) && !memcmp(a->adam_m, b->adam_m, bytes) &&
           !memcmp(a->adam_v, b->adam_v, bytes);
}

static void rewrite_file(const char *path, const char *from, const char *to) {
    FILE *f = fopen(path, "rb");
    static char buf[1 << 18], out[1 << 18];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    char *at = strstr(buf, from);
    if (!at) { snprintf(out, sizeof out, "%s", buf); }
    else snprintf(out, sizeof out, "%.*s%s%s", (int)(at - buf), buf, to, at + strlen(from));
    f = fopen(path, "wb");
    if (f) { fputs(out, f); fclose(f); }
}

/* The training state: saved and loaded, a trainer goes on bit for bit as the one that never stopped;
   every refusal names its reason and leaves the trainer as it was. */
static void test_train_state(void) {
    pr_config c = small_config(1, 0, 2);
    const int S[3] = { 3, 5, 2 };
    test_group t;
    make_group(&t, 5, 3, S, c.vocab_size, 11);
    pr_trainer *a = make_model(&c, 31), *b = make_model(&c, 77);
    pr_error err;
    char dir[256], sd[600], path[700], path2[700];
    CHECK(make_scratch_dir(dir, sizeof dir, "state"), "a scratch folder under %s", test_tmpdir());
    snprintf(sd, sizeof sd, "%s/run", dir);
    train_step(a, &t.g);
    train_step(a, &t.g);
    pr_train_state s = { 0, 7, 1234, pr_adamw_opts_default(), 0xfedcba9876543210ULL }, back;
    CHECK(!pr_trainer_save_state(a, sd, &s, NULL, &err), "save state: %s", err.message);
    snprintf(path, sizeof path, "%s/latest", sd);
    CHECK(access(path, F_OK) == 0, "latest written");
    memset(&back, 0, sizeof back);
    CHECK(!pr_trainer_load_state(b, sd, &back, &err), "load state: %s", err.message);
    CHECK(same_state(a, b), "parameters, m, v and step come back bit for bit");
    CHECK(back.step == 2 && back.next_group == 7 && back.seed == 1234 && back.adamw.lr == s.adamw.lr &&
          back.adamw.beta1 == s.adamw.beta1 && back.adamw.eps == s.adamw.eps && back.data_fingerprint == s.data_fingerprint,
          "the run's position, settings and data fingerprint come back");
    train_step(a, &t.g);
    train_step(b, &t.g);
    CHECK(same_state(a, b), "the resumed trainer's next step is the same bits");
    {   /* the record alone: the folder latest names, the values the load gave */
        char folder[700], small[8] = "keep";
        pr_train_state rec;
        memset(&rec, 0, sizeof rec);
        snprintf(path, sizeof path, "%s/step-00000002", sd);
        CHECK(!pr_train_state_read(sd, folder, sizeof folder, &rec, &err) && !strcmp(folder, path) && rec.step == 2 &&
              rec.next_group == 7 && rec.seed == 1234 && rec.data_fingerprint == s.data_fingerprint,
              "pr_train_state_read: folder %s, step %ld (%s)", folder, rec.step, err.message);
        CHECK(!pr_train_state_read(path, NULL, 0, NULL, &err), "a state folder, nothing asked for: %s", err.message);
        rec.step = -5;
        CHECK(pr_train_state_read(sd, small, sizeof small, &rec, &err) == PR_ERR_ARG && strstr(err.message, "does not fit") &&
              !strcmp(small, "keep") && rec.step == -5, "a folder buffer too small: refused, nothing written (%s)", err.message);
        CHECK(pr_train_state_read(dir, folder, sizeof folder, &rec, &err) == PR_ERR_IO && strstr(err.message, "holds no training state") &&
              rec.step == -5, "no state: %s", err.message);
    }

    /* a second save replaces the first: latest moves, the old folder goes */
    CHECK(!pr_trainer_save_state(a, sd, &s, NULL, &err), "second save: %s", err.message);
    snprintf(path, sizeof path, "%s/step-00000002", sd);
    snprintf(path2, sizeof path2, "%s/step-00000003/optimizer.safetensors", sd);
    CHECK(access(path, F_OK) != 0 && access(path2, F_OK) == 0, "the previous state folder is removed once latest moved");
    CHECK(!pr_trainer_save_state(a, sd, &s, NULL, &err), "same step again: %s", err.message);
    snprintf(path, sizeof path, "%s/step-00000003.1", sd);
    CHECK(access(path, F_OK) == 0, "a state of the same step gets a fresh folder");
    CHECK(!pr_trainer_load_state(b, path, NULL, &err) && same_state(a, b), "a state folder loads directly: %s", err.message);

    /* refusals: the trainer keeps what it had */
    train_step(b, &t.g);
    pr_trainer *keep = make_model(&c, 1);
    CHECK(!pr_trainer_load_state(keep, path, NULL, &err), "%s", err.message);
    train_step(keep, &t.g);
    snprintf(path, sizeof path, "%s/nowhere/run", dir);
    pr_status st = pr_trainer_save_state(a, path, &s, NULL, &err);
    CHECK(st == PR_ERR_IO && strstr(err.message, "does not exist"), "missing parent: %s", err.message);
    snprintf(path, sizeof path, "%s/nowhere", dir);
    CHECK(access(path, F_OK) != 0, "no parent created");
    pr_config other = c;
    other.intermediate_size = 48;
    pr_trainer *o = make_model(&other, 3);
    st = pr_trainer_load_state(o, sd, NULL, &err);
    CHECK(st == PR_ERR_ARG && strstr(err.message, "intermediate_size is 40, this trainer's model has 48"), "other shape: %s", err.message);
    pr_trainer_destroy(o);
    snprintf(path, sizeof path, "%s/step-00000003.1/trainer_state.json", sd);
    const char *own = IS_DOUBLE ? "\"F64\"" : "\"F32\"", *other_real = IS_DOUBLE ? "\"F32\"" : "\"F64\"";
    const struct { const char *from, *to; pr_status want; const char *says; } edits[] = {
        { "\"version\": 1", "\"version\": 3", PR_ERR_UNSUPPORTED, "version 3 is newer; this build reads versions 1 to 2" },
        { "\"version\": 1", "\"version\": 0", PR_ERR_FORMAT, "version" },
        { "prefixreuse-train-state", "something-else", PR_ERR_FORMAT, "not a prefixreuse training state" },
        { own, other_real, PR_ERR_UNSUPPORTED, "same precision" },
        { "fedcba9876543210", "FEDCBA9876543210", PR_ERR_FORMAT, "data_fingerprint" },
        { "\"fedcba9876543210\"", "-1.5", PR_ERR_FORMAT, "data_fingerprint" },
        { "\"step\": 3,", "\"step\": 9223372036854775807,", PR_ERR_FORMAT, "\"step\" and \"next_group\" must be integers >= 0" },
        { "\"next_group\": 7,", "\"next_group\": -1,", PR_ERR_FORMAT, "\"step\" and \"next_group\" must be integers >= 0" },
        { "\"seed\": \"1234\"", "\"seed\": \"18446744073709551616\"", PR_ERR_FORMAT, "at most 2^64 - 1" },   /* 2^64 */
        { "\"seed\": \"1234\"", "\"seed\": \"\"", PR_ERR_FORMAT, "string of decimal digits" },
    };
    for (size_t k = 0; k < sizeof edits / sizeof *edits; k++) {   /* each edit refused, then undone */
        rewrite_file(path, edits[k].from, edits[k].to);
        st = pr_trainer_load_state(b, sd, NULL, &err);
        CHECK(st == edits[k].want && strstr(err.message, edits[k].says), "trainer_state.json with %s for %s: status %d, %s", edits[k].to,
              edits[k].from, st, err.message);
        rewrite_file(path, edits[k].to, edits[k].from);
    }
    rewrite_file(path, "\"seed\": \"1234\"", "\"seed\": \"18446744073709551615\"");   /* the largest seed */
    memset(&back, 0, sizeof back);
    CHECK(!pr_train_state_read(sd, NULL, 0, &back, &err) && back.seed == UINT64_MAX, "a seed of 2^64 - 1 is read: %s", err.message);
    rewrite_file(path, "\"seed\": \"18446744073709551615\"", "\"seed\": \"1234\"");
    rewrite_file(path, ",\n  \"data_fingerprint\": \"fedcba9876543210\"", "");   /* a state written without one */
    pr_trainer *fresh = make_model(&c, 5);
    memset(&back, 0, sizeof back);
    back.data_fingerprint = 1;
    CHECK(!pr_trainer_load_state(fresh, sd, &back, &err) && back.data_fingerprint == 0, "a state without a fingerprint loads, as 0: %s",
          err.message);
    pr_trainer_destroy(fresh);
    snprintf(path, sizeof path, "%s/step-00000003.1/optimizer.safetensors", sd);
    snprintf(path2, sizeof path2, "%s/step-00000003.1/optimizer.hidden", sd);
    CHECK(rename(path, path2) == 0, "rename");
    st = pr_trainer_load_state(b, sd, NULL, &err);
    CHECK(st == PR_ERR_IO && strstr(err.message, "optimizer.safetensors"), "missing optimizer file: %s", err.message);
    CHECK(rename(path2, path) == 0, "rename back");
    snprintf(path, sizeof path, "%s/latest", sd);
    rewrite_file(path, "step", "../step");
    st = pr_trainer_load_state(b, sd, NULL, &err);
    CHECK(st == PR_ERR_FORMAT && strstr(err.message, "does not name a state folder"), "a latest that leaves the folder: %s", err.message);
    st = pr_trainer_load_state(b, dir, NULL, &err);
    CHECK(st == PR_ERR_IO && strstr(err.message, "holds no training state") && strstr(err.message, "latest"), "a folder without a state: %s",
          err.message);
    CHECK(same_state(b, keep), "every refused load left the trainer as it was");
    pr_trainer_destroy(keep);
    pr_trainer_destroy(a);
    pr_trainer_destroy(b);
    remove_tree(dir, 2);
}

/* ------------------------------------------------------------------ activation recompute */
/* One step and one AdamW step from the same weights; the gradients and parameters afterwards,
   the stats, and every layer's expert load (MoE). */
typedef struct { pr_real *grads, *params; double load[64]; pr_step_stats st; pr_status status; } recompute_result;

static recompute_result recompute_step(const pr_config *c, const pr_group *g, const pr_step_opts *o) {
    recompute_result r;
    memset(&r, 0, sizeof r);
    pr_trainer *tr = make_model(c, 29);
    pr_adamw_opts adam = pr_adamw_opts_default();
    pr_error err;
    r.status = pr_trainer_compute_grads(tr, g, o, &r.st, NULL, &err);
    if (r.status) printf("recompute_step: %s\n", err.message);
    for (int l = 0; !r.status && c->num_experts && l < c->num_hidden_layers; l++)
        pr_trainer_expert_load(tr, l, r.load + l * c->num_experts, c->num_experts, NULL);
    r.grads = grads_of(tr);
    if (!r.status) r.status = pr_trainer_adamw_step(tr, &adam, NULL, &err);
    r.params = params_of(tr);
    pr_trainer_destroy(tr);
    return r;
}

/* The same bits as recompute none: gradients, updated parameters, loss, aux loss, expert load,
   rows and FLOPs (recompute's own work is not counted in them). */
static int recompute_same(const pr_config *c, const recompute_result *a, const recompute_result *b) {
    const size_t n = offload_param_count(c);
    return a->status == PR_OK && b->status == PR_OK && !memcmp(a->grads, b->grads, sizeof(pr_real) * n) &&
           !memcmp(a->params, b->params, sizeof(pr_real) * n) && !memcmp(a->load, b->load, sizeof a->load) &&
           !memcmp(&a->st.loss, &b->st.loss, sizeof(double)) && !memcmp(&a->st.aux_loss, &b->st.aux_loss, sizeof(double)) &&
           a->st.rows == b->st.rows && a->st.flops == b->st.flops;
}
static void recompute_free(recompute_result *r) { free(r->grads); free(r->params); }

static void test_recompute(void) {
    const int S[5] = { 4, 9, 1, 6, 3 };
    static const char *mode[3] = { "none", "prefix", "all" };
    pr_config cfgs[4] = { small_config(0, 0, 2), small_config(1, 1, 2), moe_config(1), moe_config(0) };
    cfgs[0].num_hidden_layers = 3;
    int cases = 0;
    for (int ci = 0; ci < 4; ci++) {
        const pr_config *c = &cfgs[ci];
        test_group t;
        make_group(&t, 13, 5, S, c->vocab_size, 301 + ci);
        for (int sched = 0; sched < 2; sched++)
            for (int lay = 0; lay < 2; lay++)
                for (int mi = 0; mi < 3; mi++)
                    for (int off = 0; off < 2; off++) {
                        static const int mbs[3] = { 1, 2, 0 };
                        if ((off || lay) && !sched) continue;          /* offload and the layout belong to reuse */
                        pr_step_opts o = pr_step_opts_default();
                        o.schedule = sched ? PR_SCHEDULE_REUSE : PR_SCHEDULE_BASELINE;
                        o.layout = (pr_layout)lay;
                        o.microbatch = mbs[mi];
                        o.loss.kl_coef = 0.05;
                        o.offload.enabled = off;
                        o.moe.scope = (pr_aux_scope)(ci == 3);
                        recompute_result r[3];
                        for (int m = 0; m < 3; m++) {
                            o.recompute = (pr_recompute)m;
                            r[m] = recompute_step(c, &t.g, &o);
                        }
                        for (int m = 1; m < 3; m++)
                            CHECK(recompute_same(c, &r[0], &r[m]), "recompute %s (%s, %s, %s, microbatch %d, offload %s): gradients, "
                                  "parameters or stats differ from recompute none in some bit", mode[m], c->model_type,
                                  sched ? "reuse" : "baseline", lay ? "packed" : "padded", mbs[mi], off ? "on" : "off");
                        /* what the passes hold: per phase, the counted peaks */
                        const size_t *p0 = r[0].st.peak_bytes, *p1 = r[1].st.peak_bytes, *p2 = r[2].st.peak_bytes;
                        if (sched && !off) {
                            /* Phase B holds the prefix's inputs instead of its blocks, the microbatches alike */
                            const size_t L = (size_t)c->num_hidden_layers, blk = r[0].st.offload.block_bytes, in = r[1].st.offload.block_bytes;
                            CHECK(in < blk && r[2].st.offload.block_bytes == in && p0[PR_PHASE_B] - p1[PR_PHASE_B] == L * (blk - in),
                                  "recompute prefix (%s): Phase-B peak %zu vs %zu, expected %zu less (%zu layers, block %zu, input %zu)",
                                  c->model_type, p1[PR_PHASE_B], p0[PR_PHASE_B], L * (blk - in), L, blk, in);
                            CHECK(p1[PR_PHASE_A] < p0[PR_PHASE_A] && p1[PR_PHASE_C] < p0[PR_PHASE_C],
                                  "recompute prefix (%s): Phase A/C peaks %zu/%zu not below %zu/%zu", c->model_type, p1[PR_PHASE_A],
                                  p1[PR_PHASE_C], p0[PR_PHASE_A], p0[PR_PHASE_C]);
                            CHECK(p2[PR_PHASE_B] < p1[PR_PHASE_B] && p2[PR_PHASE_A] == p1[PR_PHASE_A] && p2[PR_PHASE_C] == p1[PR_PHASE_C],
                                  "recompute all (%s): Phase-B peak %zu not below prefix's %zu, or Phase A/C changed", c->model_type,
                                  p2[PR_PHASE_B], p1[PR_PHASE_B]);
                        }
                        if (!sched)
                            CHECK(p1[PR_PHASE_B] == p0[PR_PHASE_B] && p2[PR_PHASE_B] < p0[PR_PHASE_B],
                                  "recompute (%s, baseline): peaks %zu (prefix) and %zu (all) vs %zu", c->model_type,
                                  p1[PR_PHASE_B], p2[PR_PHASE_B], p0[PR_PHASE_B]);
                        if (off)    /* with offload, what moves is the inputs */
                            CHECK(r[1].st.offload.offloaded_bytes == r[1].st.offload.dormant_bytes &&
                                  r[1].st.offload.dormant_bytes < r[0].st.offload.dormant_bytes,
                                  "recompute with offload: %zu bytes moved of %zu dormant (%zu without recompute)",
                                  r[1].st.offload.offloaded_bytes, r[1].st.offload.dormant_bytes, r[0].st.offload.dormant_bytes);
                        for (int m = 0; m < 3; m++) recompute_free(&r[m]);
                        cases++;
                    }
    }
    printf("recompute: prefix and all bitwise equal to none in %d cases (both schedules, padded and packed, microbatches "
           "1/2/G, offload, dense and MoE in both aux scopes); Phase-B peak lower by the blocks less the inputs\n", cases);

    /* a hook that rewrites the cache: the rebuilt forward must leave the cache as Phase B read it */
    {
        const pr_config *c = &cfgs[1];
        test_group t;
        make_group(&t, 9, 3, S, c->vocab_size, 17);
        recompute_result r[3];
        for (int m = 0; m < 3; m++) {
            hook_log h;
            hook_log_init(&h, c, 9);
            pr_step_opts o = hooked_opts(&h, 2);
            h.perturb = 1e-2; h.perturb_layer = 1; h.perturb_index = 3;
            o.recompute = (pr_recompute)m;
            r[m] = recompute_step(c, &t.g, &o);
            CHECK(h.captures == c->num_hidden_layers && h.injects == c->num_hidden_layers,
                  "recompute %s: capture fired %d times, inject %d (want %d each)", mode[m], h.captures, h.injects, c->num_hidden_layers);
            hook_log_free(&h);
        }
        for (int m = 1; m < 3; m++)
            CHECK(recompute_same(c, &r[0], &r[m]), "recompute %s with a cache-rewriting hook differs from none", mode[m]);
        /* negative control: the rewrite does move the result, so the comparison above can see one lost */
        pr_step_opts plain = pr_step_opts_default();
        plain.microbatch = 2;
        plain.loss.kl_coef = 0.05;
        recompute_result u = recompute_step(c, &t.g, &plain);
        CHECK(!recompute_same(c, &r[0], &u), "negative control: a rewritten cache leaves the gradients as they were");
        recompute_free(&u);
        for (int m = 0; m < 3; m++) recompute_free(&r[m]);
    }

    /* meshes of in-process ranks: the gathered gradients and parameters, bitwise, over the modes */
    static test_group tg[2];
    pr_group groups[2];
    for (int i = 0; i < 2; i++) {
        make_group(&tg[i], 7 + 2 * i, 3 + i, S + i, 61, 760 + i);
        groups[i] = tg[i].g;
    }
    pr_config llama = small_config(0, 0, 4), qwen = small_config(1, 1, 4), moe = moe_config(1);
    llama.num_hidden_layers = 4;
    moe.num_key_value_heads = 4;
    moe.num_experts = 8;
    const pr_moe_opts mb_scope = { PR_AUX_SCOPE_MICROBATCH, 0 }, group_scope = { PR_AUX_SCOPE_GROUP, 0 };
    struct { const pr_config *c; mesh_shape s; int groups; pr_moe_opts moe; pr_schedule sched; const char *name; } mc[] = {
        { &llama, { 1, 1, 1, 2, 1, 2, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama tp 2" },
        { &qwen, { 1, 1, 3, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 cp 3" },
        { &qwen, { 1, 1, 3, 1, 1, 1, 1 }, 1, mb_scope, PR_SCHEDULE_REUSE, "qwen3 cp 3, offload on" },
        { &llama, { 1, 1, 2, 2, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_BASELINE, "llama tp 2 cp 2, baseline" },
        { &llama, { 1, 2, 1, 1, 1, 2, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama pp 2, microbatches of 2" },
        { &llama, { 1, 2, 1, 1, 1, 1, 1 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama pp 2, offload on" },
        { &llama, { 2, 1, 1, 1, 1, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "llama dp 2, one group split" },
        { &qwen, { 2, 1, 1, 2, 1, 1, 0 }, 2, mb_scope, PR_SCHEDULE_REUSE, "qwen3 dp 2 tp 2, whole groups" },
        { &moe, { 1, 1, 1, 2, 2, 1, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, "MoE tp 2 ep 2, group scope" },
        { &moe, { 1, 2, 2, 2, 2, 1, 0 }, 1, mb_scope, PR_SCHEDULE_REUSE, "MoE pp 2 cp 2 tp 2 ep 2, microbatch scope" },
        { &moe, { 2, 1, 1, 1, 1, 1, 0 }, 1, group_scope, PR_SCHEDULE_REUSE, "MoE dp 2, one group split, group scope" },
    };
    const int n_mc = (int)(sizeof mc / sizeof mc[0]);
    for (int i = 0; i < n_mc; i++) {
        pr_trainer *ref = make_model(mc[i].c, 5);
        pr_real *init = params_of(ref);
        const size_t np = pr_trainer_param_count(ref);
        pr_real *out[3][2];
        for (int m = 0; m < 3; m++) {
            mesh_run run;
            pr_error err;
            memset(&run, 0, sizeof run);
            run.c = mc[i].c; run.shape = mc[i].s; run.groups = groups; run.n = mc[i].groups; run.init = init;
            run.opt = pr_step_opts_default();
            run.opt.schedule = mc[i].sched;
            run.opt.microbatch = mc[i].s.mb;
            run.opt.moe = mc[i].moe;
            run.opt.offload.enabled = mc[i].s.offload;
            run.opt.recompute = (pr_recompute)m;
            run.zero = m == 2;          /* ZeRO stage 1 under recompute all: the same bits as well */
            run.grads = out[m][0] = calloc(np, sizeof(pr_real));
            run.params = out[m][1] = calloc(np, sizeof(pr_real));
            pr_status st = pr_comm_local_run(mesh_size(mc[i].s), mesh_rank, &run, &err);
            CHECK(st == PR_OK, "recompute %s, %s: %s", mode[m], mc[i].name, err.message);
        }
        for (int m = 1; m < 3; m++)
            CHECK(!memcmp(out[0][0], out[m][0], sizeof(pr_real) * np) && !memcmp(out[0][1], out[m][1], sizeof(pr_real) * np),
                  "recompute %s, %s: gathered gradients or parameters differ from recompute none", mode[m], mc[i].name);
        for (int m = 0; m < 3; m++) { free(out[m][0]); free(out[m][1]); }
        free(init);
        pr_trainer_destroy(ref);
    }
    printf("recompute: %d meshes (tp, cp, pp, dp whole and split groups, EP, offload, ZeRO) bitwise equal over the modes\n", n_mc);

    /* an unknown mode is refused before anything is touched */
    pr_config c = small_config(0, 0, 2);
    test_group t;
    make_group(&t, 5, 2, S, c.vocab_size, 5);
    pr_trainer *tr = make_model(&c, 3);
    pr_step_opts o = pr_step_opts_default();
    pr_error err;
    CHECK(!pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err), "valid step: %s", err.message);
    pr_real *g0 = grads_of(tr), *p0 = params_of(tr);
    o.recompute = (pr_recompute)3;
    CHECK(pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err) == PR_ERR_ARG && strstr(err.message, "recompute"),
          "recompute mode 3 is refused: '%s'", err.message);
    o.recompute = (pr_recompute)-1;
    CHECK(pr_trainer_compute_grads(tr, &t.g, &o, NULL, NULL, &err) == PR_ERR_ARG, "recompute mode -1 is refused: '%s'", err.message);
    pr_real *g1 = grads_of(tr), *p1 = params_of(tr);
    const size_t n = pr_trainer_param_count(tr);
    CHECK(!memcmp(g0, g1, sizeof(pr_real) * n) && !memcmp(p0, p1, sizeof(pr_real) * n), "a refused recompute mode changed the trainer");
    free(g0); free(p0); free(g1); free(p1);
    pr_trainer_destroy(tr);
}

/* A mesh's (or one rank's) run for the training state across meshes: from a start (init, or a
   state's full parameters, m, v and step count, or a saved state), steps, an optional save, the
   full arenas gathered, more steps, gathered again. */
typedef struct {
    const pr_config *c;
    mesh_shape shape;             /* dp 0: one rank, no mesh */
    int zero;
    const pr_group *groups;
    int n;
    const pr_real *init;          /* start from these parameters, */
    pr_real *const *set;          /* or from these parameters, m and v after 2 steps, */
    const char *load;             /* or from this saved state */
    const char *save;             /* saved after steps_before */
    int steps_before, steps_after;
    pr_real *full[3], *after[3];  /* parameters, m, v after steps_before (and the save or load), then at the end */
    size_t n_full;
} rstate_run;

static pr_status rstate_step(pr_trainer *tr, pr_mesh *mesh, const rstate_run *m, pr_error *err) {
    pr_step_opts o = pr_step_opts_default();
    pr_adamw_opts adam = pr_adamw_opts_default();
    pr_status s = mesh && mesh->dp > 1 ? pr_trainer_compute_grads_dp(tr, mesh->dp_comm, m->groups, m->n, &o, NULL, err)
                                       : pr_trainer_compute_grads(tr, &m->groups[0], &o, NULL, NULL, err);
    return s ? s : pr_trainer_adamw_step(tr, &adam, NULL, err);
}

static pr_status rstate_body(pr_trainer *tr, pr_mesh *mesh, rstate_run *m, int keep, pr_error *err) {
    const size_t n = mesh ? pr_trainer_full_param_count(tr) : pr_trainer_param_count(tr);
    const pr_real *arena[3] = { tr->params, tr->adam_m, tr->adam_v };
    pr_status s = PR_OK;
    if (m->load) s = pr_trainer_load_state(tr, m->load, NULL, err);
    else if (m->set) {
        pr_real *local;
        s = pr__full_scratch(tr, &local, err);
        for (int k = 0; k < 3 && !s; k++) pr__set_full_arena(tr, (pr_real *)arena[k], m->set[k], local);
        free(local);
        tr->adam_step = 2;
    } else s = pr_trainer_set_full_params(tr, m->init, n, err);
    for (int k = 0; k < m->steps_before && !s; k++) s = rstate_step(tr, mesh, m, err);
    pr_train_state state = { 0, 3, 5, pr_adamw_opts_default(), 0 };
    if (!s && m->save) s = pr_trainer_save_state(tr, m->save, &state, NULL, err);
    for (int phase = 0; phase < 2 && !s; phase++) {
        for (int k = 0; k < (phase ? m->steps_after : 0) && !s; k++) s = rstate_step(tr, mesh, m, err);
        for (int k = 0; k < 3 && !s; k++) {     /* every rank gathers, the first keeps */
            pr_real *dst = malloc(sizeof(pr_real) * n);
            s = pr__get_full_arena(tr, arena[k], dst, PR_OK, err);
            if (keep) (phase ? m->after : m->full)[k] = dst;
            else free(dst);
        }
    }
    if (keep) m->n_full = n;
    return s;
}

static pr_status rstate_rank(pr_comm *world, void *user, pr_error *err) {
    rstate_run *m = user;
    pr_mesh mesh;
    pr_trainer *tr;
    pr_status s = mesh_open(world, m->shape, m->zero, m->c, 0, &mesh, &tr, err);
    if (!s) s = rstate_body(tr, &mesh, m, world->rank == 0, err);
    mesh_close(&mesh, tr);
    return s;
}

static int rstate_go(rstate_run *m, const char *label) {
    pr_error err;
    pr_status st;
    if (m->shape.dp) st = pr_comm_local_run(mesh_size(m->shape), rstate_rank, m, &err);
    else {
        pr_trainer *tr = make_model(m->c, 1);
        st = rstate_body(tr, NULL, m, 1, &err);
        pr_trainer_destroy(tr);
    }
    CHECK(st == PR_OK, "%s: %s", label, err.message);
    return st == PR_OK;
}

static void rstate_free(rstate_run *m) {
    for (int k = 0; k < 3; k++) { free(m->full[k]); free(m->after[k]); }
}

static int rstate_same(pr_real *const *a, pr_real *const *b, size_t n) {
    int same = 1;
    for (int k = 0; k < 3; k++) same &= !memcmp(a[k], b[k], sizeof(pr_real) * n);
    return same;
}

/* Trainer creation on a dp 2 x tp 2 mesh with one of the victim rank's allocations failing, each
   in turn: every rank fails or none does, the victim with its own message, the others naming it;
   none is left waiting (the in-process ranks would end a wait with "has left", which fails the
   check on the message). */
typedef struct { const pr_config *c; int victim; long fail_at, made; pr_status status[4]; char said[4][512]; } create_fault_run;
static pr_status create_fault_rank(pr_comm *world, void *user, pr_error *err) {
    create_fault_run *m = user;
    pr_mesh mesh;
    pr_trainer *tr = NULL;
    pr_status s = pr_mesh_init(&mesh, world, 2, 1, 1, 2, 1, err);
    if (s) return s;
    const int me = world->rank;
    pr_error e;
    if (me == m->victim) alloc_fault_arm(m->fail_at);
    m->status[me] = pr_trainer_create_mesh(&tr, m->c, pr_backend_cpu(), &mesh, &e);
    if (me == m->victim) m->made = alloc_fault_disarm();
    snprintf(m->said[me], sizeof m->said[me], "%s", m->status[me] ? e.message : "");
    if (!m->status[me] && !tr) m->status[me] = PR_ERR_ARG;     /* success without a trainer: counted as a failure */
    pr_trainer_destroy(tr);
    pr_mesh_free(&mesh);
    return PR_OK;
}

static void test_create_faults(void) {
    pr_config c = small_config(1, 0, 2);
    pr_error err;
    for (int victim = 0; victim < 4; victim += 3) {
        create_fault_run m;
        memset(&m, 0, sizeof m);
        m.c = &c;
        m.victim = victim;
        m.fail_at = LONG_MAX;
        CHECK(pr_comm_local_run(4, create_fault_rank, &m, &err) == PR_OK && !m.status[0] && !m.status[3], "creation on dp 2 x tp 2: %s",
              err.message);
        const long total = m.made;
        int failed = 0;
        char told[64], scratch[64];     /* the agreement's message, or the collective's own on its scratch */
        snprintf(told, sizeof told, "world rank %d failed (status 5", victim);
        snprintf(scratch, sizeof scratch, "rank %d is out of memory: every rank fails the call", victim);
        for (long k = 0; k < total; k++) {
            m.fail_at = k;
            CHECK(pr_comm_local_run(4, create_fault_rank, &m, &err) == PR_OK, "%s", err.message);
            failed += m.status[victim] != PR_OK;
            int alike = 1;
            for (int r = 0; r < 4; r++) {
                alike &= (m.status[r] != PR_OK) == (m.status[victim] != PR_OK);
                if (r != victim && m.status[r])
                    alike &= (strstr(m.said[r], told) && strstr(m.said[r], "no rank keeps a trainer")) || strstr(m.said[r], scratch);
            }
            CHECK(alike && (!m.status[victim] || strstr(m.said[victim], "out of") || strstr(m.said[victim], "cannot allocate")),
                  "creation, allocation %ld of %ld failing on rank %d: statuses %d %d %d %d, victim '%s', rank %d '%s'", k, total, victim,
                  m.status[0], m.status[1], m.status[2], m.status[3], m.said[victim], victim ? 0 : 1, m.said[victim ? 0 : 1]);
        }
        CHECK(failed == total, "creation: %d of the victim's %ld allocations failed it", failed, total);
        printf("trainer creation on dp 2 x tp 2: each of world rank %d's %ld allocations failing in turn fails it on every rank\n", victim,
               total);
    }
}

/* A state loading on a dp 2 mesh with one of rank 0's allocations failing, each in turn, for a
   version-1 state (one rank's: each rank reads the full tensors and keeps its part) and a
   version-2 one (saved on the mesh: each rank reads its pieces). The ranks agree before any takes
   the state: a load that fails on rank 0 fails on rank 1 too, with rank 0's status, and both keep
   their parameters, m and v as they were. The version-2 save, with rank 0's allocations failing
   in turn the same way, fails on both ranks alike and leaves no temporary folder. */
typedef struct { const pr_config *c; const char *dir; int save; long fail_at, made; int status[2], changed[2]; char said[512]; } load_fault_run;
static pr_status load_fault_rank(pr_comm *world, void *user, pr_error *err) {
    load_fault_run *m = user;
    pr_mesh mesh;
    pr_trainer *tr = NULL;
    pr_status s = pr_mesh_init(&mesh, world, 2, 1, 1, 1, 1, err);
    if (s) return s;
    if (!(s = pr_trainer_create_mesh(&tr, m->c, pr_backend_cpu(), &mesh, err)) && !(s = pr_trainer_init_params(tr, m->save ? 5 : 7, err))) {
        const int me = world->rank;
        if (m->save) {
            pr_train_state state = { 0, 3, 5, pr_adamw_opts_default(), 0 };
            pr_error e;
            if (me == 0) alloc_fault_arm(m->fail_at);
            m->status[me] = pr_trainer_save_state(tr, m->dir, &state, NULL, &e);
            if (me == 0) m->made = alloc_fault_disarm();
            else snprintf(m->said, sizeof m->said, "%s", m->status[me] ? e.message : "");
            pr_trainer_destroy(tr);
            pr_mesh_free(&mesh);
            return s;
        }
        const pr_real *arena[3] = { tr->params, tr->adam_m, tr->adam_v };
        const size_t len[3] = { tr->n_params, tr->slice_n, tr->slice_n };
        pr_real *was[3];
        for (int k = 0; k < 3; k++) {
            was[k] = malloc(sizeof(pr_real) * len[k]);
            memcpy(was[k], arena[k], sizeof(pr_real) * len[k]);
        }
        if (me == 0) alloc_fault_arm(m->fail_at);
        pr_error e;
        const pr_status ld = pr_trainer_load_state(tr, m->dir, NULL, &e);
        if (me == 0) m->made = alloc_fault_disarm();
        else snprintf(m->said, sizeof m->said, "%s", ld ? e.message : "");
        m->status[me] = ld;
        m->changed[me] = 0;
        for (int k = 0; k < 3; k++) m->changed[me] |= memcmp(was[k], arena[k], sizeof(pr_real) * len[k]) != 0;
        for (int k = 0; k < 3; k++) free(was[k]);
    }
    pr_trainer_destroy(tr);
    pr_mesh_free(&mesh);
    return s;
}

static void test_load_faults(void) {
    pr_config c = small_config(1, 0, 2);
    for (int version = 1; version <= 2; version++) {
        char dir[256];
        pr_error err;
        CHECK(make_scratch_dir(dir, sizeof dir, "loadfault"), "a scratch folder under %s", test_tmpdir());
        load_fault_run m;
        memset(&m, 0, sizeof m);
        m.c = &c;
        m.dir = dir;
        m.fail_at = LONG_MAX;
        if (version == 1) {
            pr_trainer *one = make_model(&c, 5);
            pr_train_state state = { 0, 3, 5, pr_adamw_opts_default(), 0 };
            CHECK(!pr_trainer_save_state(one, dir, &state, NULL, &err), "save: %s", err.message);
            pr_trainer_destroy(one);
        } else {
            m.save = 1;
            CHECK(pr_comm_local_run(2, load_fault_rank, &m, &err) == PR_OK && !m.status[0] && !m.status[1], "save on dp 2: %s %d %d",
                  err.message, m.status[0], m.status[1]);
            const long total = m.made;
            int failed = 0;
            for (long k = 0; k < total; k++) {
                m.fail_at = k;
                CHECK(pr_comm_local_run(2, load_fault_rank, &m, &err) == PR_OK, "%s", err.message);
                failed += m.status[0] != PR_OK;
                int stray = 0;
                DIR *d = opendir(dir);
                for (struct dirent *e; d && (e = readdir(d));) stray |= strstr(e->d_name, ".tmp.") != NULL;
                if (d) closedir(d);
                CHECK(m.status[0] == m.status[1] && !stray, "save on dp 2, allocation %ld of %ld fails on rank 0: status %d and %d ('%s')%s", k,
                      total, m.status[0], m.status[1], m.said, stray ? ", a temporary folder left" : "");
            }
            CHECK(failed > 0, "save on dp 2: no failing allocation failed it");
            printf("a version-2 save on dp 2: each of its %ld allocations failing in turn on rank 0 (%d failed the save on both ranks)\n",
                   total, failed);
            m.save = 0;
            m.fail_at = LONG_MAX;
        }
        CHECK(pr_comm_local_run(2, load_fault_rank, &m, &err) == PR_OK && !m.status[0] && !m.status[1] && m.changed[0] && m.changed[1],
              "a version-%d state on dp 2: %s (status %d, %d)", version, err.message, m.status[0], m.status[1]);
        const long total = m.made;
        int failed = 0, agreed = 1;
        for (long k = 0; k < total; k++) {
            m.fail_at = k;
            CHECK(pr_comm_local_run(2, load_fault_rank, &m, &err) == PR_OK, "%s", err.message);
            failed += m.status[0] != PR_OK;
            const int told = strstr(m.said, "world rank 0 failed (status 5; its own error says why): no rank takes the state") ||
                             strstr(m.said, "rank 0 is out of memory: every rank fails the call");   /* the agreement's own scratch */
            const int fine = m.status[0] == m.status[1] && (m.status[0] ? m.status[0] == PR_ERR_NOMEM && told && !m.changed[0] && !m.changed[1]
                                                                         : m.changed[0] && m.changed[1]);
            if (!fine) {
                agreed = 0;
                CHECK(0, "version-%d state on dp 2, allocation %ld of %ld fails on rank 0: status %d and %d, rank 0 %s, rank 1 %s ('%s')",
                      version, k, total, m.status[0], m.status[1], m.changed[0] ? "changed" : "kept", m.changed[1] ? "changed" : "kept", m.said);
            }
        }
        CHECK(failed > 0 && agreed, "version-%d state on dp 2: %d of %ld failing allocations failed the load", version, failed, total);
        printf("a version-%d state on dp 2: each of its %ld allocations failing in turn on rank 0 (%d failed the load on both ranks)\n",
               version, total, failed);
        remove_tree(dir, 2);
    }
}

/* pr_trainer_get_full and pr_trainer_save on meshes with one of one rank's allocations failing,
   each in turn on each rank: a rank either fails or holds exactly the copy of a run without the
   fault (a peer whose host memory failed joins the sums with zeros, so its tp and pp peers must
   fail with it, not return its shard as zeros), each rank told of it naming the victim's world
   rank; a save (in several files, over an older checkpoint) fails on every rank or on none, and
   the folder then holds the new parameters or, after a failure, the older ones: never a mix.
   The first 8 allocations each, then 12 spread over the rest; every rank a victim of the gathers,
   the first and the last of the saves. */
typedef struct {
    const pr_config *c;
    mesh_shape shape;
    int zero, victim, save;
    long fail_at, made;
    const char *dir;
    pr_real *want;               /* the full parameters (rank 0 of the run without a fault fills it) */
    int status[8], wrong[8];
    char said[8][512];
} gather_fault_run;
static pr_status gather_fault_rank(pr_comm *world, void *user, pr_error *err) {
    gather_fault_run *m = user;
    const int me = world->rank;
    pr_mesh mesh;
    pr_trainer *tr;
    pr_status s = mesh_open(world, m->shape, m->zero, m->c, 7, &mesh, &tr, err);
    if (!s) {
        const size_t n = pr_trainer_full_param_count(tr);
        pr_real *got = calloc(n, sizeof(pr_real));
        pr_error e;
        if (me == m->victim) alloc_fault_arm(m->fail_at);
        m->status[me] = m->save ? pr_trainer_save(tr, m->dir, sizeof(pr_real) == 8 ? PR_DT_F64 : PR_DT_F32, n * sizeof(pr_real) / 4, &e) : pr_trainer_get_full(tr, PR_ARENA_PARAMS, got, n, &e);
        if (me == m->victim) m->made = alloc_fault_disarm();
        snprintf(m->said[me], sizeof m->said[me], "%s", m->status[me] ? e.message : "");
        if (!m->want && me == 0) {
            m->want = got;
            got = NULL;
        } else m->wrong[me] = !m->save && m->want && memcmp(got, m->want, sizeof(pr_real) * n) != 0;
        free(got);
    }
    mesh_close(&mesh, tr);
    return s;
}

/* The seeded initialisation on meshes, each rank drawing only its shard: bitwise one rank's. A
   Hugging Face checkpoint (pr_trainer_save of one trainer, in several files) loading on meshes:
   each rank checks the whole and reads only its shard's rows and columns of each tensor, in the
   file's dtype (the build's precision, and bf16), and the parameters gathered after are bitwise
   those one rank loads from the same files. On tp 4 no allocation of the load holds half the
   model, and saving it again (pr_trainer_save: world rank 0 writes the files as the ranks
   assemble them, a chunk at a time) gives the same checkpoint with no allocation of half the
   model on any rank, nor in one rank's save; one rank's version-1 state of the same parameters
   loads there too, under half the model at once. With one of rank 1's allocations failing (each
   of the first 8, then 8 spread), the load fails on every rank, none taking the checkpoint. */
typedef struct {
    const pr_config *c;
    mesh_shape shape;
    int zero;
    const char *dir, *save;      /* save: where the ranks save the model again after the load (NULL: not) */
    const char *state;           /* a version-1 state (one rank's) of the same parameters, loaded after (NULL: not) */
    const pr_real *want;         /* the parameters one rank loads */
    const pr_real *drawn;        /* the parameters one rank draws with seed 3 */
    long fail_at, made;
    pr_status status[8], saved[8], state_st[8];
    int same[8], kept[8], same_draw[8], state_same[8];
    size_t largest[8], save_largest[8], state_largest[8];
    char said[512];
} mload_run;
static pr_status mload_rank(pr_comm *world, void *user, pr_error *err) {
    mload_run *m = user;
    const int me = world->rank;
    pr_mesh mesh;
    pr_trainer *tr;
    pr_status s = mesh_open(world, m->shape, m->zero, m->c, 3, &mesh, &tr, err);
    if (!s) {
        const size_t n = pr_trainer_full_param_count(tr);
        pr_real *before = malloc(sizeof(pr_real) * n), *after = malloc(sizeof(pr_real) * n);
        s = pr_trainer_get_full(tr, PR_ARENA_PARAMS, before, n, err);
        m->same_draw[me] = !s && !memcmp(before, m->drawn, sizeof(pr_real) * n);
        pr_error e;
        alloc_largest = 0;
        if (me == 1) alloc_fault_arm(m->fail_at);
        m->status[me] = pr_trainer_load(tr, m->dir, &e);
        m->largest[me] = alloc_largest;
        if (me == 1) m->made = alloc_fault_disarm();
        if (me == 0) snprintf(m->said, sizeof m->said, "%s", m->status[me] ? e.message : "");
        if (!s) s = pr_trainer_get_full(tr, PR_ARENA_PARAMS, after, n, err);
        m->same[me] = !s && !memcmp(after, m->want, sizeof(pr_real) * n);
        m->kept[me] = !s && !memcmp(after, before, sizeof(pr_real) * n);
        if (m->save) {
            alloc_largest = 0;
            m->saved[me] = pr_trainer_save(tr, m->save, sizeof(pr_real) == 8 ? PR_DT_F64 : PR_DT_F32, 0, &e);
            m->save_largest[me] = alloc_largest;
        }
        if (m->state && !s && !(s = pr_trainer_init_params(tr, 3, err))) {     /* drawn again, then the state's taken */
            alloc_largest = 0;
            m->state_st[me] = pr_trainer_load_state(tr, m->state, NULL, &e);
            m->state_largest[me] = alloc_largest;
            s = pr_trainer_get_full(tr, PR_ARENA_PARAMS, after, n, err);
            m->state_same[me] = !s && !memcmp(after, m->want, sizeof(pr_real) * n);
        }
        free(before);
        free(after);
    }
    mesh_close(&mesh, tr);
    return s;
}

static void test_mesh_load(void) {
    pr_config small = small_config(1, 0, 2), wide = small_config(0, 0, 2), moe = moe_config(1);
    wide.vocab_size = 1024;              /* a model of 1.7M parameters: its shards well above the reader's 1 MiB buffer */
    wide.hidden_size = 256;
    wide.intermediate_size = 512;
    wide.head_dim = 64;
    moe.num_experts = 4;
    moe.moe_intermediate_size = 8;
    moe.tie_word_embeddings = 1;
    const struct { const pr_config *c; mesh_shape s; int zero; const char *name; } cases[6] = {
        { &wide, { 1, 1, 1, 4, 1, 0, 0 }, 0, "tp 4 (KV heads replicated)" },
        { &small, { 1, 1, 1, 2, 1, 0, 0 }, 0, "tp 2" },
        { &small, { 1, 2, 1, 1, 1, 0, 0 }, 0, "pp 2" },
        { &small, { 2, 1, 1, 2, 1, 0, 0 }, 1, "dp 2 x tp 2, zero 1" },
        { &small, { 1, 2, 1, 2, 1, 0, 0 }, 0, "pp 2 x tp 2" },
        { &moe, { 1, 2, 1, 2, 2, 0, 0 }, 0, "MoE, tied: pp 2 x tp 2 x ep 2" },
    };
    char dir[256], again[300];
    CHECK(make_scratch_dir(dir, sizeof dir, "meshload"), "a scratch folder under %s", test_tmpdir());
    int loads = 0;
    for (int i = 0; i < 6; i++)
        for (int bf = 0; bf < 2; bf++) {
            pr_error err;
            pr_trainer *one = make_model(cases[i].c, 41);
            const size_t n = pr_trainer_param_count(one);
            const pr_dtype dt = bf ? PR_DT_BF16 : sizeof(pr_real) == 8 ? PR_DT_F64 : PR_DT_F32;
            alloc_largest = 0;
            CHECK(!pr_trainer_save(one, dir, dt, n * sizeof(pr_real) / 5, &err), "%s: save: %s", cases[i].name, err.message);
            CHECK(i > 0 || alloc_largest < n * sizeof(pr_real) / 2, "%s: one rank's save took %zu bytes at once, the model is %zu", cases[i].name,
                  alloc_largest, n * sizeof(pr_real));
            char state_dir[300];
            snprintf(state_dir, sizeof state_dir, "%s/state", dir);
            pr_train_state one_state = { 0, 3, 5, pr_adamw_opts_default(), 0 };
            if (i == 0 && !bf) CHECK(!pr_trainer_save_state(one, state_dir, &one_state, NULL, &err), "%s: save_state: %s", cases[i].name, err.message);
            pr_trainer_destroy(one);
            pr_trainer *ref = make_model(cases[i].c, 5);
            pr_real *want = malloc(sizeof(pr_real) * n);
            CHECK(!pr_trainer_load(ref, dir, &err) && !pr_trainer_get_params(ref, want, n, &err), "%s: one rank loads: %s", cases[i].name,
                  err.message);
            pr_real *drawn = malloc(sizeof(pr_real) * n);      /* the same trainer, drawn again */
            CHECK(!pr_trainer_init_params(ref, 3, &err) && !pr_trainer_get_params(ref, drawn, n, &err), "%s: one rank draws: %s",
                  cases[i].name, err.message);
            pr_trainer_destroy(ref);
            mload_run m;
            memset(&m, 0, sizeof m);
            m.c = cases[i].c;
            m.shape = cases[i].s;
            m.zero = cases[i].zero;
            m.dir = dir;
            m.want = want;
            m.drawn = drawn;
            m.fail_at = -1;
            snprintf(again, sizeof again, "%s/again", dir);
            m.save = i == 0 ? again : NULL;
            m.state = i == 0 && !bf ? state_dir : NULL;
            const int W = mesh_size(m.shape);
            CHECK(pr_comm_local_run(W, mload_rank, &m, &err) == PR_OK, "%s: %s", cases[i].name, err.message);
            for (int r = 0; r < W; r++) {
                CHECK(m.status[r] == PR_OK && m.same[r], "%s, %s: rank %d: status %d, parameters %s (%s)", cases[i].name, bf ? "bf16" : "reals", r,
                      m.status[r], m.same[r] ? "the same" : "differ", m.said);
                CHECK(m.same_draw[r], "%s: rank %d drew other parameters than one rank with the same seed", cases[i].name, r);
                if (i == 0)
                    CHECK(m.largest[r] < n * sizeof(pr_real) / 2 && m.saved[r] == PR_OK && m.save_largest[r] < n * sizeof(pr_real) / 2,
                          "%s: rank %d took %zu bytes at once to load, %zu to save (status %d), the model is %zu", cases[i].name, r, m.largest[r],
                          m.save_largest[r], m.saved[r], n * sizeof(pr_real));
                if (m.state)
                    CHECK(m.state_st[r] == PR_OK && m.state_same[r] && m.state_largest[r] < n * sizeof(pr_real) / 2,
                          "%s: rank %d, one rank's state (version 1): status %d, parameters %s, %zu bytes at once (the model is %zu)", cases[i].name,
                          r, m.state_st[r], m.state_same[r] ? "the same" : "differ", m.state_largest[r], n * sizeof(pr_real));
            }
            if (m.save) {            /* the model saved again by the mesh: what one rank loads from it */
                pr_trainer *back = make_model(cases[i].c, 5);
                pr_real *got = malloc(sizeof(pr_real) * n);
                CHECK(!pr_trainer_load(back, again, &err) && !pr_trainer_get_params(back, got, n, &err) && !memcmp(got, want, sizeof(pr_real) * n),
                      "%s: the model the mesh saved again differs: %s", cases[i].name, err.message);
                free(got);
                pr_trainer_destroy(back);
                remove_tree(again, 1);
                m.save = NULL;
            }
            loads++;
            if (i == 4 && !bf) {          /* one rank's allocations failing */
                m.fail_at = LONG_MAX;
                CHECK(pr_comm_local_run(W, mload_rank, &m, &err) == PR_OK, "%s", err.message);
                const long total = m.made;
                int failed = 0;
                for (long k = 0; k < total; k += k < 8 ? 1 : (total + 7) / 8) {
                    m.fail_at = k;
                    CHECK(pr_comm_local_run(W, mload_rank, &m, &err) == PR_OK, "%s", err.message);
                    failed += m.status[1] != PR_OK;
                    for (int r = 0; r < W; r++)
                        CHECK(m.status[r] == m.status[1] && (m.status[r] ? m.kept[r] : m.same[r]),
                              "%s, allocation %ld of %ld failing on rank 1: rank %d says %d and %s ('%s')", cases[i].name, k, total, r,
                              m.status[r], m.kept[r] ? "kept its parameters" : m.same[r] ? "took the checkpoint" : "holds other parameters",
                              m.said);
                }
                CHECK(failed > 0, "%s: no failing allocation failed the load", cases[i].name);
            }
            free(want);
            free(drawn);
            remove_tree(dir, 2);
            CHECK(make_scratch_dir(dir, sizeof dir, "meshload"), "a scratch folder under %s", test_tmpdir());
        }
    printf("a checkpoint in several files (reals and bf16) loading on tp 4 (KV heads replicated), tp 2, pp 2, dp 2 x tp 2 (zero 1), "
           "pp 2 x tp 2 and a tied MoE pp 2 x tp 2 x ep 2: %d loads (and seeded draws) bitwise those of one rank, each rank reading its shard (on tp 4 "
           "under half the model at once, as one rank's version-1 state, and saved again with under half of it on every rank); one rank's allocations failing fail "
           "every rank\n", loads);
    remove_tree(dir, 1);
}

/* Whether a rank's failure message leads to the victim v: it names world rank v, or a collective
   that failed on every rank alike (each names its own; the starved rank by its number in that
   group), or a world rank whose own message says that. */
static int gather_fault_named(const gather_fault_run *m, const char *said, int v) {
    static const char *const collective = "is out of memory: every rank fails the call";
    const char *at = strstr(said, "world rank ");
    int q;
    if (strstr(said, collective)) return 1;
    if (!at || sscanf(at, "world rank %d failed", &q) != 1 || q < 0 || q >= 8) return 0;
    return q == v || strstr(m->said[q], collective) != NULL;
}

static void test_gather_faults(void) {
    pr_config c = small_config(1, 0, 2);
    const struct { mesh_shape s; int zero; } meshes[3] = { { { 1, 2, 1, 2, 1, 0, 0 }, 0 }, { { 2, 1, 1, 2, 1, 0, 0 }, 1 },
                                                            { { 2, 2, 1, 1, 1, 0, 0 }, 0 } };
    char dir[256];
    CHECK(make_scratch_dir(dir, sizeof dir, "gatherfault"), "a scratch folder under %s", test_tmpdir());
    int runs = 0, failed = 0;
    pr_trainer *older = make_model(&c, 2);             /* what the folder holds before each save */
    const size_t n_old = pr_trainer_param_count(older);
    pr_real *old_params = calloc(n_old, sizeof(pr_real)), *p = calloc(n_old, sizeof(pr_real));
    pr_error err;
    CHECK(!pr_trainer_get_params(older, old_params, n_old, &err), "%s", err.message);
    for (int i = 0; i < 3; i++) {
        const int W = mesh_size(meshes[i].s);
        gather_fault_run m;
        memset(&m, 0, sizeof m);
        m.c = &c;
        m.shape = meshes[i].s;
        m.zero = meshes[i].zero;
        m.dir = dir;
        m.victim = -1;
        m.fail_at = LONG_MAX;
        CHECK(pr_comm_local_run(W, gather_fault_rank, &m, &err) == PR_OK && m.want, "mesh %d: %s", i, err.message);
        if (!m.want) continue;
        for (int save = 0; save < 2; save++)
            for (int v = 0; v < W; v += save ? W - 1 : 1) {     /* a save (its fsyncs are slow): the first rank and the last */
                m.save = save;
                m.victim = v;
                m.fail_at = LONG_MAX;
                CHECK(pr_comm_local_run(W, gather_fault_rank, &m, &err) == PR_OK, "%s", err.message);
                const long total = m.made;
                /* the first 8, then 12 spread over the rest (most are the collectives' scratch, each alike) */
                for (long k = 0; k < total; k += k < 8 ? 1 : (total + 11) / 12) {
                    m.fail_at = k;
                    memset(m.status, 0, sizeof m.status);
                    memset(m.wrong, 0, sizeof m.wrong);
                    if (save)
                        CHECK(!pr_trainer_save(older, dir, sizeof(pr_real) == 8 ? PR_DT_F64 : PR_DT_F32, n_old * sizeof(pr_real) / 4, &err),
                              "the older checkpoint: %s", err.message);
                    CHECK(pr_comm_local_run(W, gather_fault_rank, &m, &err) == PR_OK, "%s", err.message);
                    runs++;
                    failed += m.status[v] != PR_OK;
                    for (int r = 0; r < W; r++) {
                        const char *what = save ? "pr_trainer_save" : "pr_trainer_get_full";
                        CHECK(m.status[r] || !m.wrong[r], "mesh %d, %s, allocation %ld of %ld failing on rank %d: rank %d returns another copy", i,
                              what, k, total, v, r);
                        CHECK(!save || m.status[r] == m.status[0], "mesh %d, a save with allocation %ld failing on rank %d: rank %d returns %d, rank 0 %d",
                              i, k, v, r, m.status[r], m.status[0]);
                        CHECK(!m.status[r] || r == v || gather_fault_named(&m, m.said[r], v), "mesh %d, %s, allocation %ld failing on rank %d: rank %d does not name it: %s",
                              i, what, k, v, r, m.said[r]);
                    }
                    if (save) {     /* the folder: the new parameters after a save that succeeded, else those or the older ones */
                        pr_trainer *one = make_model(&c, 1);
                        const int loaded = !pr_trainer_load(one, dir, &err) && !pr_trainer_get_params(one, p, n_old, &err);
                        const int is_new = loaded && !memcmp(p, m.want, sizeof(pr_real) * n_old),
                                  is_old = loaded && !memcmp(p, old_params, sizeof(pr_real) * n_old);
                        CHECK(is_new || (m.status[0] && is_old), "mesh %d, allocation %ld failing on rank %d (save status %d): the folder holds %s", i,
                              k, v, m.status[0], !loaded ? "no checkpoint" : is_old ? "the older checkpoint" : "neither checkpoint");
                        pr_trainer_destroy(one);
                    }
                }
            }
        free(m.want);
    }
    pr_trainer_destroy(older);
    free(old_params);
    free(p);
    CHECK(failed > 0, "no failing allocation failed a gather");
    printf("gathers and saves on tp 2 x pp 2, dp 2 x tp 2 (zero 1), dp 2 x pp 2: %d runs with one allocation failing on one rank "
           "(%d failed it), no rank returning another copy\n", runs, failed);
    remove_tree(dir, 2);
}

/* A state saved on a mesh is one file per rank (each rank its own pieces, one copy of each) and an
   index; it loads on the same mesh, on meshes of other shapes and on one rank: parameters, m and v
   come back bit for bit, and the next step is the bits of the run that never stopped (on the same
   mesh) or of a trainer given the same state by hand (elsewhere). Refused: a missing rank file, an
   index with a hole, another model. */
typedef struct { mesh_shape shape; int zero; } rstate_mesh;
static void rstate_case(const pr_config *c, rstate_mesh from, const rstate_mesh *to, int n_to, const pr_group *groups, int n,
                        const char *name) {
    char dir[256], path[700], label[160];
    CHECK(make_scratch_dir(dir, sizeof dir, "rstate"), "a scratch folder under %s", test_tmpdir());
    pr_trainer *one = make_model(c, 41);
    pr_real *init = params_of(one);
    rstate_run src = { c, from.shape, from.zero, groups, n, init, NULL, NULL, dir, 2, 1, { 0 }, { 0 }, 0 };
    snprintf(label, sizeof label, "%s: save", name);
    if (!rstate_go(&src, label)) goto out;
    const int W = mesh_size(from.shape);
    snprintf(path, sizeof path, "%s/step-00000002/rank-%d-of-%d.safetensors", dir, W - 1, W);
    CHECK(access(path, F_OK) == 0, "%s: the last rank's file %s", name, path);
    snprintf(path, sizeof path, "%s/step-00000002/model.safetensors", dir);
    CHECK(access(path, F_OK) != 0, "%s: no whole-model file on a mesh", name);
    for (int t = 0; t < n_to; t++) {
        const rstate_mesh m = to[t];
        const int same_mesh = !memcmp(&m, &from, sizeof m);
        if (m.shape.dp) snprintf(label, sizeof label, "%s: load on dp %d pp %d tp %d ep %d zero %d", name, m.shape.dp, m.shape.pp, m.shape.tp, m.shape.ep, m.zero);
        else snprintf(label, sizeof label, "%s: load on one rank", name);
        rstate_run back = { c, m.shape, m.zero, groups, n, NULL, NULL, dir, NULL, 0, 1, { 0 }, { 0 }, 0 };
        if (rstate_go(&back, label)) {
            CHECK(back.n_full == src.n_full && rstate_same(back.full, src.full, src.n_full), "%s: parameters, m or v differ from those saved", label);
            if (same_mesh) CHECK(rstate_same(back.after, src.after, src.n_full), "%s: the next step differs from the run that never stopped", label);
            else {
                rstate_run ref = { c, m.shape, m.zero, groups, n, NULL, src.full, NULL, NULL, 0, 1, { 0 }, { 0 }, 0 };
                if (rstate_go(&ref, label))
                    CHECK(rstate_same(back.after, ref.after, src.n_full), "%s: the next step differs from a trainer given the state", label);
                rstate_free(&ref);
            }
        }
        rstate_free(&back);
    }
out:
    rstate_free(&src);
    free(init);
    pr_trainer_destroy(one);
    if (strcmp(name, "dp 2 x tp 2, zero 2")) remove_tree(dir, 2);
    else {       /* the refusals, on one rank; the trainer keeps what it had */
        pr_error err;
        pr_trainer *keep = make_model(c, 3), *before = make_model(c, 3);
        char path2[700];
        snprintf(path, sizeof path, "%s/step-00000002/rank-1-of-4.safetensors", dir);
        snprintf(path2, sizeof path2, "%s/step-00000002/rank-1.hidden", dir);
        CHECK(rename(path, path2) == 0, "rename");
        pr_status st = pr_trainer_load_state(keep, dir, NULL, &err);
        CHECK(st == PR_ERR_IO && strstr(err.message, "rank-1-of-4.safetensors"), "a missing rank file: %s", err.message);
        CHECK(rename(path2, path) == 0, "rename back");
        {   /* a "files" entry that opens as two files (a folder of shards), whose pieces could be read from the wrong one */
            static const pr_real w[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
            const pr_st_entry two[2] = { { "a", w, 1, { 8 } }, { "b", w, 1, { 8 } } };
            snprintf(path2, sizeof path2, "%s/step-00000002/shards", dir);
            CHECK(!pr_checkpoint_save(path2, two, 2, PR_DT_F32, 40, &err), "two shards: %s", err.message);
            snprintf(path, sizeof path, "%s/step-00000002/state_index.json", dir);
            rewrite_file(path, "\"rank-1-of-4.safetensors\"", "\"shards\"");
            st = pr_trainer_load_state(keep, dir, NULL, &err);
            CHECK(st == PR_ERR_FORMAT && strstr(err.message, "\"files\" entry 1 (shards) is 2 files, not one .safetensors file") &&
                      same_state(keep, before),
                  "a files entry of two shards: %s", err.message);
            rewrite_file(path, "\"shards\"", "\"rank-1-of-4.safetensors\"");
            remove_tree(path2, 1);
        }
        snprintf(path, sizeof path, "%s/step-00000002/state_index.json", dir);
        rewrite_file(path, "\"kind\": \"exp_avg\", \"file\": \"rank-1-of-4", "\"kind\": \"exp_avg_sq\", \"file\": \"rank-1-of-4");
        st = pr_trainer_load_state(keep, dir, NULL, &err);
        CHECK(st == PR_ERR_ARG && strstr(err.message, "its exp_avg pieces hold"), "a piece missing from the index: %s", err.message);
        rewrite_file(path, "\"kind\": \"exp_avg_sq\", \"file\": \"rank-1-of-4", "\"kind\": \"exp_avg\", \"file\": \"rank-1-of-4");
        const char *q = "\"key\": \"model.layers.0.self_attn.q_proj.weight\", \"rows\": [";
        snprintf(path2, sizeof path2, "%s0, 12]", q);
        snprintf(label, sizeof label, "%s12, 24]", q);
        rewrite_file(path, path2, label);
        st = pr_trainer_load_state(keep, dir, NULL, &err);
        CHECK(st == PR_ERR_ARG && strstr(err.message, "model.layers.0.self_attn.q_proj.weight: its param pieces cover 0 of the 24 elements"),
              "a hole in the pieces: %s", err.message);
        rewrite_file(path, label, path2);
        /* both tp pieces of o_proj's columns on the second half: every row has the right count of
           elements, half of them twice and half none */
        const char *o = "\"key\": \"model.layers.0.self_attn.o_proj.weight\", \"rows\": [0, 24], \"cols\": [";
        snprintf(path2, sizeof path2, "%s0, 12]", o);
        snprintf(label, sizeof label, "%s12, 24]", o);
        rewrite_file(path, path2, label);
        st = pr_trainer_load_state(keep, dir, NULL, &err);
        CHECK(st == PR_ERR_ARG && strstr(err.message, "o_proj.weight: two of its param pieces give row 0, column 12 (an overlap)") &&
                  same_state(keep, before),
              "an overlap and a hole in one row: %s", err.message);
        rewrite_file(path, label, path2);
        pr_config other = *c;
        other.intermediate_size = 48;
        pr_trainer *om = make_model(&other, 3);
        st = pr_trainer_load_state(om, dir, NULL, &err);
        CHECK(st == PR_ERR_ARG && strstr(err.message, "intermediate_size is 40, this trainer's model has 48"), "another model: %s", err.message);
        pr_trainer_destroy(om);
        CHECK(same_state(keep, before), "every refused load left the trainer as it was");
        CHECK(!pr_trainer_load_state(keep, dir, NULL, &err), "the restored state loads: %s", err.message);
        pr_trainer_destroy(keep);
        pr_trainer_destroy(before);
        remove_tree(dir, 2);
    }
}

static void test_rank_state(void) {
    const int S[4] = { 4, 2, 6, 3 };
    static test_group tg[2];
    pr_group groups[2];
    for (int i = 0; i < 2; i++) {
        make_group(&tg[i], 5 + i, 3, S + i, 61, 700 + i);
        groups[i] = tg[i].g;
    }
    pr_config llama = small_config(0, 0, 2), moe = moe_config(1);
    moe.num_experts = 4;
    moe.moe_intermediate_size = 8;     /* tp 2 without ep divides it */
    moe.tie_word_embeddings = 1;
    const rstate_mesh dp2tp2 = { { 2, 1, 1, 2, 1, 0, 0 }, 2 };
    const rstate_mesh to1[5] = { dp2tp2, { { 4, 1, 1, 1, 1, 0, 0 }, 0 }, { { 1, 1, 1, 4, 1, 0, 0 }, 0 },
                                 { { 2, 2, 1, 1, 1, 0, 0 }, 2 }, { { 0, 0, 0, 0, 0, 0, 0 }, 0 } };
    rstate_case(&llama, dp2tp2, to1, 5, groups, 2, "dp 2 x tp 2, zero 2");
    const rstate_mesh ep = { { 2, 2, 1, 2, 2, 0, 0 }, 1 };
    const rstate_mesh to2[4] = { ep, { { 1, 1, 1, 2, 1, 0, 0 }, 0 }, { { 2, 1, 1, 2, 2, 0, 0 }, 2 }, { { 0, 0, 0, 0, 0, 0, 0 }, 0 } };
    rstate_case(&moe, ep, to2, 4, groups, 2, "MoE, tied: dp 2 x pp 2 x tp 2 x ep 2, zero 1");
    printf("per-rank training state: saved on dp 2 x tp 2 (zero 2) and MoE dp 2 x pp 2 x tp 2 x ep 2 (zero 1); loaded bitwise on "
           "the same, on dp 4, tp 4 (KV heads replicated), dp 2 x pp 2, tp 2 and one rank; the next step bitwise; refusals\n");
}

/* ------------------------------------------------------------------ prefix trees */
/* Groups whose prefixes are chains of shared segments: segment k's tokens are seg[k]. */
static void tree_prefixes(test_group *tg, int n, const int chains[][6], const int *seg_len, const int32_t seg[][16]) {
    for (int k = 0; k < n; k++) {
        int P = 0;
        for (int j = 0; j < 6 && chains[k][j] >= 0; j++) {
            memcpy(tg[k].prefix + P, seg[chains[k][j]], sizeof(int32_t) * (size_t)seg_len[chains[k][j]]);
            P += seg_len[chains[k][j]];
        }
        tg[k].g.P = P;
    }
}

/* One tree step against the groups one by one on full sequences: loss, gradients, parameters after
   AdamW, FLOPs and (MoE) the expert load, the tree's being the sum of the groups'. With offload on,
   also against the same tree with offload off, bit for bit. */
static void tree_case(const pr_config *c, const pr_group *groups, int n, const pr_step_opts *o, int min_shared,
                      const char *what) {
    const double tol = IS_DOUBLE ? 1e-12 : 1e-5;
    const int E = c->num_experts, L = c->num_hidden_layers;
    pr_error err;
    pr_prefix_tree tree;
    CHECK(!pr_prefix_tree_build(&tree, groups, n, min_shared, &err), "tree build: %s", err.message);
    char label[256];
    snprintf(label, sizeof label, "tree (%s; %d nodes, min_shared %d)", what, tree.n_nodes, min_shared);
    pr_trainer *ref = make_model(c, 8), *tr = make_model(c, 8);
    pr_step_opts ob = *o;
    ob.schedule = PR_SCHEDULE_BASELINE;
    ob.recompute = PR_RECOMPUTE_NONE;
    ob.offload.enabled = 0;
    double ref_loss = 0, load_ref[64] = { 0 }, load[64] = { 0 };
    for (int k = 0; k < n; k++) {
        pr_step_stats one;
        ob.accumulate = k > 0;
        CHECK(!pr_trainer_compute_grads(ref, &groups[k], &ob, &one, NULL, &err), "%s: baseline: %s", label, err.message);
        ref_loss += one.loss;
        for (int l = 0; l < L && E; l++) {
            CHECK(!pr_trainer_expert_load(ref, l, load, E, &err), "%s", err.message);
            for (int e = 0; e < E; e++) load_ref[l * E + e] += load[e];
        }
    }
    pr_step_stats st;
    CHECK(!pr_trainer_compute_grads_tree(tr, groups, n, &tree, o, &st, &err), "%s: %s", label, err.message);
    CHECK(fabs(st.loss - ref_loss) <= tol * fabs(ref_loss), "%s: loss %.17g, baseline %.17g", label, st.loss, ref_loss);
    pr_real *g = grads_of(tr), *gr = grads_of(ref);
    CHECK(close_arenas(tr, g, gr, "gradient", label), "%s: gradients vs the groups' full sequences", label);
    for (int l = 0; l < L && E; l++) {
        CHECK(!pr_trainer_expert_load(tr, l, load, E, &err), "%s", err.message);
        for (int e = 0; e < E; e++)
            CHECK(load[e] == load_ref[l * E + e], "%s: layer %d expert %d load %g, the groups' %g", label, l, e, load[e],
                  load_ref[l * E + e]);
    }
    if (o->offload.enabled) {      /* offload moves bytes, nothing else */
        pr_trainer *off = make_model(c, 8);
        pr_step_opts oo = *o;
        oo.offload.enabled = 0;
        pr_step_stats so;
        CHECK(!pr_trainer_compute_grads_tree(off, groups, n, &tree, &oo, &so, &err), "%s: %s", label, err.message);
        pr_real *go = grads_of(off);
        CHECK(!memcmp(g, go, sizeof(pr_real) * pr_trainer_param_count(tr)) && st.loss == so.loss,
              "%s: offload on and off differ", label);
        const pr_offload_stats *os = &st.offload;
        CHECK(os->offloaded_bytes == os->loaded_bytes && os->offloaded_bytes >= os->dormant_bytes && os->dormant_bytes > 0 &&
              (o->offload.pool_bytes ? os->pool_fallbacks > 0 : os->pool_fallbacks == 0) && so.offload.dormant_bytes == os->dormant_bytes,
              "%s: offload moved %zu bytes out, %zu in, the deepest chain %zu, %d fallbacks", label, os->offloaded_bytes,
              os->loaded_bytes, os->dormant_bytes, os->pool_fallbacks);
        free(go);
        pr_trainer_destroy(off);
    }
    /* one AdamW step on each: the updated parameters agree too */
    pr_adamw_opts ao = pr_adamw_opts_default();
    CHECK(!pr_trainer_adamw_step(tr, &ao, NULL, &err) && !pr_trainer_adamw_step(ref, &ao, NULL, &err), "%s: %s", label, err.message);
    pr_real *p = params_of(tr), *pref = params_of(ref);
    CHECK(close_arenas(tr, p, pref, "parameter", label), "%s: parameters after AdamW", label);
    double fl = 0;
    for (int k = 0; k < n; k++) fl += pr_step_flops(c, &groups[k], PR_SCHEDULE_REUSE);
    CHECK(st.flops == pr_tree_flops(c, groups, n, &tree) && (tree.tokens_tree < tree.tokens_groups) == (st.flops < fl),
          "%s: flops %.6g, the tree's %.6g, the groups' %.6g", label, st.flops, pr_tree_flops(c, groups, n, &tree), fl);
    free(g); free(gr); free(p); free(pref);
    pr_trainer_destroy(tr);
    pr_trainer_destroy(ref);
    pr_prefix_tree_free(&tree);
}

/* Trains the prefix of t from position j0 on, but for positions gap0 .. gap1-1 (a tool's output):
   a shared turn of a multi-turn rollout. */
static void train_prefix(test_group *t, int j0, int gap0, int gap1, uint64_t seed) {
    const int V = 96;
    rng_state = seed;
    for (int j = 0; j < t->g.P; j++) {
        t->pmask[j] = j >= j0 && !(j >= gap0 && j < gap1);
        t->pold[j] = (pr_real)(-log((double)V) + 1.2 * (urand() - 0.5));
        t->pref[j] = (pr_real)(t->pold[j] - 0.3 * urand());
    }
    t->g.prefix_mask = t->pmask;
    t->g.prefix_old_logp = t->pold;
    t->g.prefix_ref_logp = t->g.ref_logp ? t->pref : NULL;
}

/* The same trajectories with prefix tokens j0.. moved to the head of every suffix, where the
   suffix loss trains them: the independent form of a group whose prefix trains from j0. */
static void unroll_prefix(const test_group *t, test_group *u, int j0) {
    const pr_group *g = &t->g;
    const int P = g->P, G = g->G, H = P - j0;
    memset(u, 0, sizeof *u);
    memcpy(u->prefix, t->prefix, sizeof(int32_t) * (size_t)j0);
    for (int i = 0; i < G; i++) {
        const int64_t o = u->off[i], src = g->suffix_off[i];
        u->len[i] = H + g->suffix_len[i];
        u->off[i + 1] = o + u->len[i];
        u->adv[i] = g->advantage[i];
        for (int j = 0; j < H; j++) {
            u->tokens[o + j] = t->prefix[j0 + j];
            u->old[o + j] = t->pold[j0 + j];
            u->ref[o + j] = t->pref[j0 + j];
            u->mask[o + j] = t->pmask[j0 + j];
        }
        for (int j = 0; j < g->suffix_len[i]; j++) {
            u->tokens[o + H + j] = g->tokens[src + j];
            u->old[o + H + j] = g->old_logp[src + j];
            u->ref[o + H + j] = g->ref_logp ? g->ref_logp[src + j] : 0;
            u->mask[o + H + j] = g->loss_mask[src + j];
        }
    }
    pr_group *w = &u->g;
    w->P = j0; w->G = G; w->prefix = u->prefix; w->suffix_len = u->len; w->suffix_off = u->off; w->tokens = u->tokens;
    w->advantage = u->adv; w->old_logp = u->old; w->ref_logp = g->ref_logp ? u->ref : NULL; w->loss_mask = u->mask;
}

/* pr_step_phase_flops against a count made row by row: every row's matmuls (2 FLOPs a weight
   forward, 4 backward), every (query, key) pair it attends (4 x head dim x heads forward, 8
   backward), every loss row's head (2CV forward, 4CV backward), each in the phase that runs it. */
static void test_phase_flops(void) {
    pr_config c = small_config(0, 0, 2);
    const double C = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
    const double qd = (double)c.num_attention_heads * c.head_dim, kvd = (double)c.num_key_value_heads * c.head_dim;
    const double row_fwd = 2 * L * (C * qd + 2 * C * kvd + qd * C + 3 * C * c.intermediate_size);
    const double pair_fwd = 4 * L * qd, head_fwd = 2 * C * V;
    const int S[4] = { 3, 1, 6, 2 }, P = 7, G = 4;
    static test_group t;
    for (int trained = 0; trained < 2; trained++) {
        make_group(&t, P, G, S, c.vocab_size, 77);
        int n_trained = 0;                   /* prefix tokens j >= 1 with a loss (row j - 1 predicts them) */
        if (trained) {
            train_prefix(&t, 2, 4, 5, 9);
            for (int j = 1; j < P; j++) n_trained += t.pmask[j];
        }
        double want[2][3] = { { 0 } };       /* [baseline, reuse][phase] */
        for (int i = 0; i < G; i++) {
            for (int r = 0; r < P + S[i]; r++) want[0][PR_PHASE_B] += 3 * (row_fwd + (r + 1) * pair_fwd);
            for (int r = P; r < P + S[i]; r++) want[1][PR_PHASE_B] += 3 * (row_fwd + (r + 1) * pair_fwd);
            /* loss rows: the last prefix row and the trained prefix tokens' (the prefix's), then the suffix's but its last */
            want[0][PR_PHASE_B] += 3 * head_fwd * (1 + n_trained + S[i] - 1);
            want[1][PR_PHASE_C] += 3 * head_fwd;
            want[1][PR_PHASE_B] += 3 * head_fwd * (S[i] - 1);
        }
        want[1][PR_PHASE_C] += 3 * head_fwd * n_trained;   /* reuse: a trained prefix token's head once for all G */
        for (int r = 0; r < P; r++) {
            want[1][PR_PHASE_A] += row_fwd + (r + 1) * pair_fwd;
            want[1][PR_PHASE_C] += 2 * (row_fwd + (r + 1) * pair_fwd);
        }
        for (int sched = 0; sched < 2; sched++) {
            const pr_schedule sc = sched ? PR_SCHEDULE_REUSE : PR_SCHEDULE_BASELINE;
            double f[3];
            pr_step_phase_flops(&c, &t.g, sc, f);
            for (int ph = 0; ph < 3; ph++)
                CHECK(fabs(f[ph] - want[sched][ph]) <= 1e-12 * want[sched][PR_PHASE_B], "phase flops %s, trained %d, phase %c: %.17g, counted %.17g",
                      sched ? "reuse" : "baseline", trained, 'A' + ph, f[ph], want[sched][ph]);
            CHECK(fabs(pr_step_flops(&c, &t.g, sc) - (f[0] + f[1] + f[2])) <= 1e-12 * pr_step_flops(&c, &t.g, sc),
                  "pr_step_flops is the phases' sum (%s)", sched ? "reuse" : "baseline");
        }
    }
    double f[3] = { 1, 1, 1 };
    pr_step_phase_flops(NULL, &t.g, PR_SCHEDULE_REUSE, f);
    CHECK(f[0] == 0 && f[1] == 0 && f[2] == 0, "phase flops of a NULL config are 0");
}

/* The CPU backend, counting the rows the loss head runs (its logit_stats calls). */
typedef struct { pr_backend be; long rows; } head_count_backend;
static void head_count_logit_stats(const pr_backend *be, double *stats, const void *logits, const int32_t *target, int M, int V) {
    ((head_count_backend *)be->ctx)->rows += M;
    pr_backend_cpu()->logit_stats(be, stats, logits, target, M, V);
}

/* The head's rows of one step of group g: reuse runs a trained prefix token's once for all G
   trajectories (they share its logits and its target), the baseline once a sequence. */
static void check_head_rows(const pr_config *c, const pr_group *g, pr_schedule schedule, const char *label) {
    head_count_backend hc;
    hc.be = *pr_backend_cpu();
    hc.be.ctx = &hc;
    hc.be.logit_stats = head_count_logit_stats;
    hc.rows = 0;
    long trained = 0, suffix = 0;
    for (int j = 1; j < g->P; j++) trained += g->prefix_mask[j];
    for (int i = 0; i < g->G; i++) suffix += g->suffix_len[i] - 1;
    const long want = suffix + g->G + (schedule == PR_SCHEDULE_REUSE ? trained : g->G * trained);
    pr_trainer *tr = make_model_on(c, 9, &hc.be);
    pr_step_opts o = pr_step_opts_default();
    o.schedule = schedule;
    pr_step_stats st;
    pr_error err;
    CHECK(!pr_trainer_compute_grads(tr, g, &o, &st, NULL, &err) && hc.rows == want,
          "%s: the loss head ran %ld rows, %ld expected (G %d, %ld trained prefix tokens)", label, hc.rows, want, g->G, trained);
    pr_trainer_destroy(tr);
}

/* Trained prefix tokens (multi-turn): a group whose prefix trains a turn, through both schedules,
   the tree and meshes, against the same trajectories with that turn unrolled into every suffix. */
static void test_prefix_loss(void) {
    pr_config c = small_config(1, 0, 2);
    const double tol = IS_DOUBLE ? 1e-12 : 1e-5;
    const int S[6] = { 4, 9, 1, 6, 2, 5 }, j0 = 5;
    static test_group t, u;
    make_group(&t, 14, 3, S, c.vocab_size, 77);
    train_prefix(&t, j0, 8, 10, 78);
    unroll_prefix(&t, &u, j0);
    pr_error err;
    pr_step_norm nt = { 0, 0, 0 }, nu = { 0, 0, 0 };
    CHECK(!pr_step_loss_totals(&t.g, 1, 0, &nt, &err) && !pr_step_loss_totals(&u.g, 1, 0, &nu, &err) &&
          nt.tokens == nu.tokens && nt.trajectories == nu.trajectories && nt.norm_len == nu.norm_len,
          "prefix loss totals: %lld tokens, %lld trajectories, length %lld; unrolled %lld, %lld, %lld", (long long)nt.tokens,
          (long long)nt.trajectories, (long long)nt.norm_len, (long long)nu.tokens, (long long)nu.trajectories, (long long)nu.norm_len);
    int cases = 0;
    for (int v = 0; v < 8; v++) {
        pr_step_opts o = pr_step_opts_default();
        o.loss.kl_coef = 0.05;
        o.loss.norm = (pr_loss_norm)(v % 4);
        pr_step_opts ou = o;
        ou.schedule = PR_SCHEDULE_BASELINE;
        pr_trainer *ref = make_model(&c, 9), *tr = make_model(&c, 9);
        pr_step_stats su, st;
        pr_real lu[4096], lt[4096];
        CHECK(!pr_trainer_compute_grads(ref, &u.g, &ou, &su, lu, &err), "unrolled: %s", err.message);
        o.schedule = v < 2 ? PR_SCHEDULE_BASELINE : PR_SCHEDULE_REUSE;
        o.microbatch = v % 3;
        o.layout = v % 2 ? PR_LAYOUT_PACKED : PR_LAYOUT_PADDED;
        o.recompute = (pr_recompute)(v % 3);
        o.offload.enabled = v >= 5;
        char label[160];
        snprintf(label, sizeof label, "trained prefix tokens: %s, %s, microbatch %d %s, recompute %d, offload %s",
                 v < 2 ? "baseline" : "reuse", pr_loss_norm_name(o.loss.norm), o.microbatch, v % 2 ? "packed" : "padded",
                 v % 3, v >= 5 ? "on" : "off");
        CHECK(!pr_trainer_compute_grads(tr, &t.g, &o, &st, lt, &err), "%s: %s", label, err.message);
        CHECK(fabs(st.loss - su.loss) <= tol * fabs(su.loss), "%s: loss %.17g, unrolled %.17g", label, st.loss, su.loss);
        CHECK(st.loss_tokens == su.loss_tokens && st.clipped_tokens == su.clipped_tokens &&
              fabs(st.kl_sum - su.kl_sum) <= tol * su.kl_sum,
              "%s: %ld loss tokens, %ld clipped, KL %.9g; unrolled %ld, %ld, %.9g", label, (long)st.loss_tokens,
              (long)st.clipped_tokens, st.kl_sum, (long)su.loss_tokens, (long)su.clipped_tokens, su.kl_sum);
        pr_real *g = grads_of(tr), *gu = grads_of(ref);
        CHECK(close_arenas(tr, g, gu, "gradient", label), "%s: gradients vs the unrolled group", label);
        int lp_ok = 1;                 /* the suffix tokens' log-probs, where the unrolled suffixes have them */
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < S[i]; j++) {
                const double a = lt[t.off[i] + j], b = lu[u.off[i] + (14 - j0) + j];
                lp_ok &= fabs(a - b) <= (IS_DOUBLE ? 1e-12 : 1e-5) * (1 + fabs(b));
            }
        CHECK(lp_ok, "%s: log-probs of the suffix tokens", label);
        free(g); free(gu);
        pr_trainer_destroy(tr);
        pr_trainer_destroy(ref);
        cases++;
    }
    check_head_rows(&c, &t.g, PR_SCHEDULE_REUSE, "trained prefix tokens, reuse");
    check_head_rows(&c, &t.g, PR_SCHEDULE_BASELINE, "trained prefix tokens, baseline");
    /* one group on meshes: CP chunks holding trained rows, a group split over dp, stages */
    const pr_moe_opts moe = { PR_AUX_SCOPE_MICROBATCH, 0 };
    mesh_compare(&c, (mesh_shape){ 1, 1, 2, 1, 1, 1, 0 }, &t.g, 1, moe, PR_SCHEDULE_REUSE, 0, PR_LAYOUT_PADDED, "trained prefix tokens on cp 2");
    mesh_compare(&c, (mesh_shape){ 1, 1, 3, 1, 1, 2, 1 }, &t.g, 1, moe, PR_SCHEDULE_REUSE, 0, PR_LAYOUT_PACKED, "trained prefix tokens on cp 3, microbatch 2, packed, offload");
    mesh_compare(&c, (mesh_shape){ 2, 1, 1, 1, 1, 1, 0 }, &t.g, 1, moe, PR_SCHEDULE_REUSE, 0, PR_LAYOUT_PADDED,
                 "trained prefix tokens, the group split over dp 2");
    mesh_compare(&c, (mesh_shape){ 1, 2, 1, 2, 1, 1, 1 }, &t.g, 1, moe, PR_SCHEDULE_REUSE, 0, PR_LAYOUT_PADDED,
                 "trained prefix tokens on pp 2 x tp 2, offload");

    /* a multi-turn step as its prefix tree: a system prompt; a trained first turn and a tool's
       output, shared by three groups, two of which branch there and one goes on to a second turn */
    enum { SYS = 6, T1 = 5, TOOL = 3, T2 = 4, TOOL2 = 2, OTHER = 4 };
    static test_group tg[4], tu[4];
    int32_t seg[6][8];
    rng_state = 515;
    for (int k = 0; k < 6; k++)
        for (int i = 0; i < 8; i++) seg[k][i] = (int32_t)(urand() * c.vocab_size);
    const int chain[4][6] = { { 0, 1, 2, -1 }, { 0, 1, 2, 3, 4, -1 }, { 0, 5, -1 }, { 0, 1, 2, -1 } };
    const int seg_len[6] = { SYS, T1, TOOL, T2, TOOL2, OTHER }, G[4] = { 2, 3, 2, 1 };
    pr_group groups[4], unrolled[4];
    for (int k = 0; k < 4; k++) {
        make_group(&tg[k], 1, G[k], S + k, c.vocab_size, 600 + k);
        int P = 0;
        for (int j = 0; chain[k][j] >= 0; j++) {
            memcpy(tg[k].prefix + P, seg[chain[k][j]], sizeof(int32_t) * (size_t)seg_len[chain[k][j]]);
            P += seg_len[chain[k][j]];
        }
        tg[k].g.P = P;
        if (k != 2) {
            train_prefix(&tg[k], SYS, SYS + T1, SYS + T1 + TOOL, 610 + k);
            for (int j = SYS + T1 + TOOL + T2; j < P; j++) tg[k].pmask[j] = 0;    /* the second tool's output */
            unroll_prefix(&tg[k], &tu[k], SYS);
        } else {
            tu[k] = tg[k];
            pr_group *w = &tu[k].g;
            w->prefix = tu[k].prefix; w->suffix_len = tu[k].len; w->suffix_off = tu[k].off; w->tokens = tu[k].tokens;
            w->advantage = tu[k].adv; w->old_logp = tu[k].old; w->ref_logp = tu[k].ref; w->loss_mask = tu[k].mask;
        }
        groups[k] = tg[k].g;
        unrolled[k] = tu[k].g;
    }
    pr_prefix_tree tree;
    CHECK(!pr_prefix_tree_build(&tree, groups, 4, 1, &err) && tree.n_nodes == 4, "multi-turn tree: %d nodes", tree.n_nodes);
    for (int v = 0; v < 4; v++) {
        pr_step_opts o = pr_step_opts_default();
        o.loss.kl_coef = 0.05;
        o.loss.norm = (pr_loss_norm)v;
        CHECK(!pr_step_loss_totals(groups, 4, 0, &o.loss.step, &err) && !pr_step_loss_totals(unrolled, 4, 0, &nu, &err) &&
              o.loss.step.tokens == nu.tokens && o.loss.step.norm_len == nu.norm_len, "multi-turn step totals");
        pr_step_opts ou = o;
        ou.schedule = PR_SCHEDULE_BASELINE;
        o.microbatch = v % 3;
        o.recompute = (pr_recompute)(v % 3);
        o.offload.enabled = v >= 2;
        char label[128];
        snprintf(label, sizeof label, "multi-turn tree: %s, microbatch %d, recompute %d, offload %s", pr_loss_norm_name(o.loss.norm),
                 o.microbatch, v % 3, v >= 2 ? "on" : "off");
        pr_trainer *ref = make_model(&c, 11), *tr = make_model(&c, 11);
        double ref_loss = 0;
        CHECK(!run_step(ref, unrolled, 4, ou, &ref_loss, NULL, &err), "%s: unrolled: %s", label, err.message);
        pr_step_stats st;
        CHECK(!pr_trainer_compute_grads_tree(tr, groups, 4, &tree, &o, &st, &err), "%s: %s", label, err.message);
        CHECK(fabs(st.loss - ref_loss) <= tol * fabs(ref_loss), "%s: loss %.17g, unrolled %.17g", label, st.loss, ref_loss);
        pr_real *g = grads_of(tr), *gu = grads_of(ref);
        CHECK(close_arenas(tr, g, gu, "gradient", label), "%s: gradients vs the unrolled groups", label);
        free(g); free(gu);
        pr_trainer_destroy(tr);
        pr_trainer_destroy(ref);
        cases++;
    }
    pr_prefix_tree_free(&tree);
    mesh_compare(&c, (mesh_shape){ 2, 1, 1, 2, 1, 1, 0 }, groups, 4, moe, PR_SCHEDULE_REUSE, 1, PR_LAYOUT_PADDED, "multi-turn tree on dp 2 x tp 2");
    printf("trained prefix tokens: %d cases against the same turns unrolled into every suffix, 4 meshes\n", cases);
}

/* One rank's dp tree step, for the refusals of test_trees. */
typedef struct { pr_trainer *tr; const pr_group *groups; int n; const pr_prefix_tree *tree; } tree_dp_run;
static pr_status tree_dp_rank(pr_comm *dp, void *user, pr_error *err) {
    const tree_dp_run *r = user;
    pr_step_opts o = pr_step_opts_default();
    pr_step_stats st;
    return pr_trainer_compute_grads_tree_dp(r->tr, dp, r->groups, r->n, r->tree, &o, &st, err);
}
/* The same with a run a rank (user: an array of them). */
static pr_status tree_dp_two_ranks(pr_comm *dp, void *user, pr_error *err) {
    return tree_dp_rank(dp, (tree_dp_run *)user + dp->rank, err);
}

static void test_trees(void) {
    pr_config c = small_config(1, 0, 2), m = moe_config(1), m8 = m;
    m8.num_experts = 8;                 /* EP 2 divides them */
    const int S[8] = { 4, 9, 1, 5, 3, 7, 2, 6 };
    enum { NSEG = 9 };
    const int seg_len[NSEG] = { 6, 3, 2, 3, 5, 2, 4, 1, 7 };
    int32_t seg[NSEG][16];
    rng_state = 4242;
    for (int k = 0; k < NSEG; k++)
        for (int i = 0; i < 16; i++) seg[k][i] = (int32_t)(urand() * c.vocab_size);
    /* shapes: a shared system prompt over 4 groups; depth 4 with a group ending inside another's
       path, two groups on the same prefix, a short branch and a second root; one group alone */
    const int flat[4][6] = { { 0, 1, -1 }, { 0, 4, -1 }, { 0, 7, -1 }, { 0, 6, -1 } };
    const int deep[6][6] = { { 0, 1, 2, 3, -1 }, { 0, 1, 2, -1 }, { 0, 1, 4, -1 }, { 0, 5, -1 }, { 0, 1, 2, -1 }, { 8, 6, -1 } };
    const int alone[1][6] = { { 8, 2, -1 } };
    struct { const char *name; int n; const int (*chains)[6]; } shapes[3] = {
        { "system prompt over 4 groups", 4, flat }, { "depth 4, unbalanced, two roots", 6, deep }, { "one group", 1, alone } };
    static test_group tg[6];
    pr_group groups[6];
    int cases = 0, moe_cases = 0, mesh_cases = 0;
    pr_error err;
    for (int sh = 0; sh < 3; sh++) {
        const int n = shapes[sh].n;
        for (int k = 0; k < n; k++) make_group(&tg[k], 1, 1 + k % 3, S + k, c.vocab_size, 300 + 17 * sh + k);
        tree_prefixes(tg, n, shapes[sh].chains, seg_len, seg);
        for (int k = 0; k < n; k++) groups[k] = tg[k].g;
        for (int v = 0; v < 6; v++) {
            const int min_shared = v % 2 ? 3 : 1, mb = v % 3 == 0 ? 1 : v % 3 == 1 ? 2 : 0;
            pr_step_opts o = pr_step_opts_default();
            o.loss.kl_coef = 0.05;
            o.loss.norm = (pr_loss_norm)(v % 4);
            o.microbatch = mb;
            o.layout = v % 2 ? PR_LAYOUT_PACKED : PR_LAYOUT_PADDED;
            o.recompute = (pr_recompute)(v % 3);
            o.offload.enabled = v >= 3;
            o.offload.pool_bytes = v == 4 ? 1500 : 0;     /* a pool too small: some blocks on their own */
            CHECK(!pr_step_loss_totals(groups, n, 0, &o.loss.step, &err), "tree totals: %s", err.message);
            char what[192];
            snprintf(what, sizeof what, "%s, %s, microbatch %d %s, recompute %d, offload %s", shapes[sh].name,
                     pr_loss_norm_name(o.loss.norm), mb, v % 2 ? "packed" : "padded", v % 3,
                     v < 3 ? "off" : v == 4 ? "on, small pool" : "on");
            tree_case(&c, groups, n, &o, min_shared, what);
            cases++;
            /* MoE: each node's routing in the aux loss of every group below it, both scopes */
            if (sh == 2 || v > 3) continue;
            o.moe.scope = (pr_aux_scope)(v % 2);
            snprintf(what, sizeof what, "MoE %s scope, %s, microbatch %d, recompute %d, offload %s", v % 2 ? "group" : "microbatch",
                     shapes[sh].name, mb, v % 3, v == 3 ? "on" : "off");
            tree_case(&m, groups, n, &o, min_shared, what);
            moe_cases++;
        }
        /* on meshes of in-process ranks: subtrees placed over dp, tp inside every node, stages, every
           node's rows and every suffix cut into 2 cp pieces (3: uneven, a rank without rows of a node) */
        const pr_moe_opts group_scope = { PR_AUX_SCOPE_GROUP, 0 };
        const pr_moe_opts micro_scope = { PR_AUX_SCOPE_MICROBATCH, 0 };
        const struct { const pr_config *c; mesh_shape s; pr_moe_opts moe; const char *name; } meshes[2][8] = {
            { { &c, { 2, 1, 1, 1, 1, 2, 1 }, group_scope, "dp 2, offload" },
              { &m8, { 2, 1, 1, 2, 2, 2, 0 }, group_scope, "MoE dp 2 x tp 2 x ep 2" },
              { &c, { 4, 1, 1, 1, 1, 0, 0 }, group_scope, "dp 4, a group a rank" }, { &c, { 1, 2, 1, 1, 1, 2, 0 }, group_scope, "pp 2" },
              { &m, { 1, 2, 1, 1, 1, 1, 0 }, group_scope, "MoE pp 2, group scope" }, { &c, { 1, 1, 2, 1, 1, 2, 0 }, group_scope, "cp 2, microbatch 2" },
              { &c, { 2, 1, 2, 2, 1, 1, 0 }, group_scope, "dp 2 x cp 2 x tp 2" },
              { &m, { 1, 1, 2, 1, 1, 1, 0 }, group_scope, "MoE cp 2, group scope" } },
            { { &c, { 3, 1, 1, 1, 1, 1, 0 }, group_scope, "dp 3" }, { &c, { 1, 1, 1, 2, 1, 2, 1 }, group_scope, "tp 2, offload" },
              { &c, { 2, 1, 1, 2, 1, 0, 0 }, group_scope, "dp 2 x tp 2" },
              { &c, { 2, 2, 1, 2, 1, 1, 1 }, group_scope, "dp 2 x pp 2 x tp 2, offload" },
              { &m8, { 1, 2, 1, 2, 2, 2, 0 }, micro_scope, "MoE pp 2 x tp 2 x ep 2, microbatch scope" },
              { &c, { 1, 1, 3, 1, 1, 1, 1 }, group_scope, "cp 3, offload" },
              { &c, { 1, 2, 2, 1, 1, 2, 1 }, group_scope, "pp 2 x cp 2, microbatch 2, offload" },
              { &m8, { 1, 1, 2, 2, 2, 1, 0 }, micro_scope, "MoE cp 2 x tp 2 x ep 2, microbatch scope" } } };
        for (int ranks = 1; ranks <= n; ranks++) {    /* the placement: every rank gets a group */
            pr_prefix_tree t;
            int owner[6], count[6] = { 0 };
            CHECK(!pr_prefix_tree_build(&t, groups, n, 1, &err), "%s", err.message);
            pr_tree_place(&c, groups, n, &t, ranks, owner);
            for (int k = 0; k < n; k++) if (owner[k] >= 0 && owner[k] < ranks) count[owner[k]]++;
            for (int r = 0; r < ranks; r++) CHECK(count[r] > 0, "tree placement of %d groups on %d ranks: rank %d has none", n, ranks, r);
            pr_prefix_tree_free(&t);
        }
        for (int i = 0; i < 8 && sh < 2; i++) {
            char label[160];
            snprintf(label, sizeof label, "tree (%s) on %s", shapes[sh].name, meshes[sh][i].name);
            mesh_compare(meshes[sh][i].c, meshes[sh][i].s, groups, n, meshes[sh][i].moe, PR_SCHEDULE_REUSE, 1, PR_LAYOUT_PADDED, label);
            mesh_cases++;
        }
    }
    /* what the mesh refuses: fewer groups than dp ranks */
    const mesh_shape refused[1] = { { 4, 1, 1, 1, 1, 0, 0 } };
    const char *why[1] = { "at least one a rank" };
    for (int i = 0; i < 1; i++) {
        pr_trainer *ref = make_model(&c, 5);
        mesh_run mr;
        memset(&mr, 0, sizeof mr);
        mr.c = &c; mr.shape = refused[i]; mr.groups = groups; mr.n = 2; mr.tree = 1;
        pr_real *init = params_of(ref);
        mr.init = init;
        mr.opt = pr_step_opts_default();
        mr.grads = malloc(sizeof(pr_real) * pr_trainer_param_count(ref));
        mr.params = malloc(sizeof(pr_real) * pr_trainer_param_count(ref));
        CHECK(pr_comm_local_run(mesh_size(refused[i]), mesh_rank, &mr, &err) != PR_OK && strstr(err.message, why[i]),
              "tree refused on a mesh: %s", err.message);
        free(init); free(mr.grads); free(mr.params);
        pr_trainer_destroy(ref);
    }
    printf("prefix trees: %d cases (3 shapes x loss modes, layouts, microbatches, recompute, offload), %d MoE cases and %d on "
           "meshes against the full sequences\n", cases, moe_cases, mesh_cases);

    /* refused: another tree's groups, the baseline schedule */
    pr_prefix_tree tree;
    CHECK(!pr_prefix_tree_build(&tree, groups, 1, 1, &err), "%s", err.message);
    pr_trainer *tr = make_model(&c, 8);
    pr_step_opts o = pr_step_opts_default();
    CHECK(pr_trainer_compute_grads_tree(tr, groups, 2, &tree, &o, NULL, &err) == PR_ERR_ARG && strstr(err.message, "built for 1"),
          "tree of other groups: %s", err.message);
    pr_prefix_tree two;
    memcpy(tg[1].prefix, tg[0].prefix, sizeof(int32_t) * (size_t)tg[0].g.P);
    tg[1].g.P = tg[0].g.P;
    groups[1] = tg[1].g;
    CHECK(!pr_prefix_tree_build(&two, groups, 2, 1, &err) && two.n_nodes == 1, "%s", err.message);
    tg[1].prefix[0] = (tg[1].prefix[0] + 1) % c.vocab_size;    /* the shared node's tokens no longer those of group 1 */
    CHECK(pr_trainer_compute_grads_tree(tr, groups, 2, &two, &o, NULL, &err) == PR_ERR_ARG && strstr(err.message, "not its tokens"),
          "tree of other tokens: %s", err.message);
    pr_prefix_tree_free(&two);
    /* a malformed tree (its group ending past the nodes or before them, a node that does not
       continue its parent) is refused by every entry point before anything follows its nodes */
    for (int bad = 0; bad < 3; bad++) {
        const int node = tree.group_node[0], parent = tree.nodes[0].parent;
        if (bad < 2) tree.group_node[0] = bad ? -1 : tree.n_nodes;
        else tree.nodes[0].parent = 0;
        CHECK(pr_trainer_compute_grads_tree(tr, groups, 1, &tree, &o, NULL, &err) == PR_ERR_ARG && strstr(err.message, "prefix tree"),
              "malformed tree %d: %s", bad, err.message);
        tree_dp_run run = { tr, groups, 1, &tree };
        CHECK(pr_comm_local_run(1, tree_dp_rank, &run, &err) == PR_ERR_ARG && strstr(err.message, "prefix tree"),
              "malformed tree %d over dp: %s", bad, err.message);
        for (int ranks = 1; ranks <= 2; ranks++) {
            int owner[1] = { -1 };
            CHECK(pr_tree_place(&c, groups, 1, &tree, ranks, owner) == PR_ERR_ARG && owner[0] == 0, "malformed tree %d placed on %d ranks",
                  bad, ranks);
        }
        tree.group_node[0] = node;
        tree.nodes[0].parent = parent;
    }
    /* a malformed group (no suffix lengths) is refused over dp before the tree's placement reads
       it: two groups on one prefix over two ranks */
    {
        pr_group two_groups[2] = { groups[0], groups[0] };
        pr_prefix_tree shared;
        CHECK(!pr_prefix_tree_build(&shared, two_groups, 2, 1, &err), "%s", err.message);
        two_groups[1].suffix_len = NULL;
        pr_trainer *peer = make_model(&c, 8);
        tree_dp_run runs[2] = { { tr, two_groups, 2, &shared }, { peer, two_groups, 2, &shared } };
        CHECK(pr_comm_local_run(2, tree_dp_two_ranks, runs, &err) == PR_ERR_ARG && strstr(err.message, "suffix_len"),
              "a group without suffix lengths in a tree over dp 2: %s", err.message);
        pr_trainer_destroy(peer);
        pr_prefix_tree_free(&shared);
    }
    o.schedule = PR_SCHEDULE_BASELINE;
    CHECK(pr_trainer_compute_grads_tree(tr, groups, 1, &tree, &o, NULL, &err) == PR_ERR_ARG, "tree baseline: %s", err.message);
    pr_trainer_destroy(tr);
    pr_prefix_tree_free(&tree);
}

int main(void) {
    printf("test_core (%s build)\n", IS_DOUBLE ? "double" : "float");
    test_equivalence();
    test_microbatch_tokens();
    test_hooks();
    test_bad_input();
    test_determinism();
    test_offload();
    test_arena_spares();
    test_moe();
    test_dp();
    test_dp_team_kept();
    test_steps();
    test_trees();
    test_prefix_loss();
    test_cp_cut();
    test_mesh();
    test_api_refusals();
    test_mesh_faults();
    test_create_faults();
    test_load_faults();
    test_gather_faults();
    test_mesh_load();
    test_kv_replication();
    test_head_chunks_uneven_vocab();
    test_zero();
    test_grad_reduce_bf16();
    test_step_metrics();
    test_phase_flops();
    test_measure_mesh();
    test_state_bytes();
    test_checkpoints();
    test_other_shape();
    test_train_state();
    test_recompute();
    test_rank_state();
    if (IS_DOUBLE) {
        pr_config l = small_config(0, 0, 2), q = small_config(1, 1, 1), m = moe_config(1);
        test_gradcheck(&l, "llama");
        test_gradcheck(&q, "qwen3");
        test_gradcheck(&m, "qwen3-moe");
    }
    test_oracle("model/tiny", "test/ref_tiny.safetensors", PR_NORM_TOKEN_MEAN);
    test_oracle("model/tiny-qwen3", "test/ref_tiny-qwen3.safetensors", PR_NORM_SEQ_MEAN_TOKEN_MEAN);
    test_oracle("model/tiny-moe", "test/ref_tiny-moe.safetensors", PR_NORM_TOKEN_MEAN);
    return test_report();
}
