/* Tests for the trace reader, run from the repository root by `make test` and `make asan`
   (by hand: build/test_trace-float [-v] [data/sample.trace]):
   1. data/sample.trace against numbers printed by data/make_sample.py from the arrays it generated
      (not from the file), and a byte-exact round trip;
   2. a small file built here, then one broken field at a time: every failure must return an error
      whose message names the field, leave the caller's pr_trace byte-for-byte as it was, and leak
      nothing (the allocator below counts live blocks; ASan/valgrind check the rest);
   3. every truncation of the small file and of the sample, trailing bytes, huge counts;
   4. pr_group_validate on groups built in memory; failed allocations;
   5. version 2: the step table read and written back byte for byte, version 1 still read and
      written when a trace has no steps, malformed tables refused by the reader and the writer;
   6. prefix trees (pr_prefix_tree_build): a hand-built step against its tree drawn by hand, and
      random steps against the tree's invariants and, at min_shared 1, against the count of
      distinct prompt prefixes (a sort and longest common prefixes, independent of the tree). */
#include <stdlib.h>
#include <stdio.h>

#define TEST_COUNTING_ALLOCATOR
#include "harness.h"

#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"

static int verbose;   /* -v: print every error message the tests provoke */

/* ---------------------------------------------------------------- byte buffers */
typedef struct { unsigned char *b; size_t n, cap; } buf;
static void put(buf *s, const void *p, size_t n) {
    if (s->n + n > s->cap) {
        s->cap = (s->n + n) * 2 + 64;
        s->b = realloc(s->b, s->cap);
        if (!s->b) { printf("out of memory\n"); exit(2); }
    }
    memcpy(s->b + s->n, p, n);
    s->n += n;
}
static void put_u32(buf *s, uint32_t v) {
    unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16), (unsigned char)(v >> 24)};
    put(s, b, 4);
}
static void put_f32(buf *s, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    put_u32(s, u);
}
static void patch_u32(unsigned char *b, size_t off, uint32_t v) {
    b[off] = (unsigned char)v; b[off + 1] = (unsigned char)(v >> 8);
    b[off + 2] = (unsigned char)(v >> 16); b[off + 3] = (unsigned char)(v >> 24);
}
static void patch_f32(unsigned char *b, size_t off, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    patch_u32(b, off, u);
}

/* a scratch file of this process */
static const char *scratch_path(const char *name) {
    static char path[600];
    snprintf(path, sizeof path, "%s/pr_trace_test.%ld.%s", test_tmpdir(), pr__io_pid(), name);
    return path;
}

static unsigned char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    unsigned char *b;
    long n;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    b = malloc((size_t)n + 1);
    if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) { fclose(f); free(b); return NULL; }
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* ---------------------------------------------------------------- 1. the sample file */
/* From `python data/make_sample.py` (computed from the generated arrays, not from the file):
   P, G, suffix lengths, FNV-1a 64 of the prefix then suffix tokens, sum_j (j+1)*x_j left to right
   in double over advantages / old_logp / ref_logp (flattened per group), masked-token count. */
typedef struct {
    int P, G, lens[8];
    uint64_t hash;
    double adv, old, ref;
    int masked;
} expect_group;
static const expect_group sample_expect[4] = {
    {96, 8, {7, 32, 7, 1, 13, 17, 4, 38}, 0x25a8566175fe357aULL, 0x1.ceb1024000000p+2, -0x1.35df7b9400000p+15, -0x1.35f24b3d00000p+15, 103},
    {64, 4, {12, 2, 23, 17}, 0xf099ec7adfc31b9aULL, -0x1.bb676c0000000p+1, -0x1.fceaa3e380000p+12, -0x1.fcabd02700000p+12, 47},
    {120, 8, {2, 27, 7, 21, 39, 1, 24, 35}, 0x4833beaf9b9ebf29ULL, 0x1.ceb1024000000p+2, -0x1.0a2adc56b8000p+16, -0x1.0a3c64e818000p+16, 143},
    {48, 6, {5, 8, 20, 25, 37, 11}, 0xf6262c6b3bd3e852ULL, 0x0.0p+0, -0x1.eb2cd28ce0000p+14, -0x1.e8fe42aca0000p+14, 97},
};

static uint64_t fnv1a(uint64_t h, const int32_t *t, int64_t n) {
    for (int64_t j = 0; j < n; j++) h = (h ^ (uint64_t)(int64_t)t[j]) * 1099511628211ULL;
    return h;
}
static double wsum(const pr_real *x, int64_t n) {
    double s = 0;
    for (int64_t j = 0; j < n; j++) s += (double)(j + 1) * (double)x[j];
    return s;
}

static void test_sample(const char *path) {
    pr_trace t, t2;
    pr_error err;
    pr_status st = pr_trace_read(&t, path, &err);
    CHECK(st == PR_OK, "pr_trace_read(%s): %s", path, st ? err.message : "");
    if (st) return;
    CHECK(t.n_groups == 4 && t.vocab_size == 256 && t.has_ref == 1, "sample header: %d groups, vocab %d, has_ref %d",
          t.n_groups, t.vocab_size, t.has_ref);
    for (int k = 0; k < t.n_groups && k < 4; k++) {
        const pr_group *g = &t.groups[k];
        const expect_group *e = &sample_expect[k];
        int lens_ok = g->G == e->G, masked = 0;
        uint64_t h;
        CHECK(g->P == e->P && g->G == e->G, "group %d: P %d G %d, expected %d %d", k, g->P, g->G, e->P, e->G);
        if (!lens_ok) continue;
        for (int i = 0; i < g->G; i++)
            lens_ok &= g->suffix_len[i] == e->lens[i] && g->suffix_off[i + 1] - g->suffix_off[i] == e->lens[i];
        CHECK(lens_ok && g->suffix_off[0] == 0, "group %d: suffix lengths/offsets differ", k);
        int64_t N = g->suffix_off[g->G];
        h = fnv1a(fnv1a(1469598103934665603ULL, g->prefix, g->P), g->tokens, N);
        CHECK(h == e->hash, "group %d: token hash %016llx, expected %016llx", k, (unsigned long long)h,
              (unsigned long long)e->hash);
        CHECK(wsum(g->advantage, g->G) == e->adv, "group %d: advantage checksum %a, expected %a", k,
              wsum(g->advantage, g->G), e->adv);
        CHECK(wsum(g->old_logp, N) == e->old, "group %d: old_logp checksum %a, expected %a", k, wsum(g->old_logp, N), e->old);
        CHECK(g->ref_logp && wsum(g->ref_logp, N) == e->ref, "group %d: ref_logp checksum differs", k);
        for (int64_t j = 0; j < N; j++) masked += g->loss_mask[j];
        CHECK(masked == e->masked, "group %d: %d masked tokens, expected %d", k, masked, e->masked);
        st = pr_group_validate(g, t.vocab_size, &err);
        CHECK(st == PR_OK, "group %d: pr_group_validate: %s", k, st ? err.message : "");
    }
    {   /* byte-exact round trip, and pr_trace_parse on the same bytes gives the same trace */
        size_t len = 0;
        unsigned char *file = read_file(path, &len);
        void *sb = NULL, *sb2 = NULL;
        size_t sn = 0, sn2 = 0;
        st = pr_trace_serialize(&t, &sb, &sn, &err);
        CHECK(st == PR_OK && file && sn == len && memcmp(sb, file, len) == 0,
              "sample: pr_trace_serialize gives other bytes than the file (%s)", st ? err.message : "");
        st = file ? pr_trace_parse(&t2, file, len, &err) : PR_ERR_IO;
        CHECK(st == PR_OK, "pr_trace_parse(sample): %s", st ? err.message : "");
        if (st == PR_OK) {
            CHECK(!pr_trace_serialize(&t2, &sb2, &sn2, &err) && sn2 == sn && memcmp(sb2, sb, sn) == 0, "parse and read disagree");
            PR_FREE(sb2);
            pr_trace_free(&t2);
        }
        /* the fingerprint is FNV-1a 64 of the file's bytes (0x189b3324c3bb8a1 for data/sample.trace,
           by Python); one changed byte changes it */
        CHECK(t.fingerprint == 0x0189b3324c3bb8a1ULL, "sample: fingerprint %016llx", (unsigned long long)t.fingerprint);
        if (file && len > 100) {
            file[len - 1] ^= 1;   /* the last suffix token's loss_mask, 0 and 1 swapped: still a valid trace */
            st = pr_trace_parse(&t2, file, len, &err);
            CHECK(st == PR_OK && t2.fingerprint != t.fingerprint, "one bit flipped: the fingerprint changes (%s)", st ? err.message : "");
            if (st == PR_OK) pr_trace_free(&t2);
        }
        /* every proper prefix of the sample fails */
        if (file) {
            size_t bad = 0;
            for (size_t n = 0; n < len; n++) {
                unsigned char *cut = malloc(n ? n : 1);
                memcpy(cut, file, n);
                memset(&t2, 0x5a, sizeof t2);
                if (pr_trace_parse(&t2, cut, n, &err) != PR_ERR_FORMAT) bad++;
                free(cut);
            }
            CHECK(bad == 0, "sample: %zu of %zu truncations did not fail with PR_ERR_FORMAT", bad, len);
        }
        /* pr_trace_write: the file holds exactly the serialised bytes; invalid traces are refused */
        const char *tmp = scratch_path("write.trace");
        st = pr_trace_write(&t, tmp, &err);
        size_t wlen = 0;
        unsigned char *written = st ? NULL : read_file(tmp, &wlen);
        CHECK(!st && written && sb && wlen == sn && memcmp(written, sb, sn) == 0, "pr_trace_write: %s",
              st ? err.message : "the file differs from pr_trace_serialize's bytes");
        free(written);
        remove(tmp);
        PR_FREE(sb);
        free(file);
        pr_trace bad = t;
        bad.has_ref = !t.has_ref;
        CHECK(pr_trace_serialize(&bad, &sb, &sn, &err) == PR_ERR_ARG && strstr(err.message, "has_ref"),
              "a has_ref that contradicts the groups is refused: '%s'", err.message);
        bad = t;
        bad.vocab_size = 2;      /* every token id must be below it */
        /* the group's reason wrapped once in its place, whole (the reason is formatted from the
           message it is written into) */
        CHECK(pr_trace_serialize(&bad, &sb, &sn, &err) == PR_ERR_ARG && !strncmp(err.message, "group 0: invalid group: ", 24) &&
                  !strstr(err.message + 1, "group 0:"),
              "a token outside the vocabulary is refused: '%s'", err.message);
    }
    pr_trace_free(&t);
    CHECK(t.groups == NULL && t.n_groups == 0, "pr_trace_free leaves the trace zeroed");
    pr_trace_free(&t);   /* twice is harmless */
    pr_trace_free(NULL);
}

/* ---------------------------------------------------------------- 2. a small file, broken field by field */
/* vocab 10; group 0: P=3, G=2, S={1,2}; group 1: P=1, G=1, S={3}. Offsets of every field are kept. */
typedef struct {
    buf s;
    size_t P[2], G[2], prefix[2], len[2], adv[2], tok[2][2], old[2][2], ref[2][2], mask[2][2];
} small_file;

static small_file make_small(int has_ref) {
    static const int Ps[2] = {3, 1}, Gs[2] = {2, 1}, Ss[2][2] = {{1, 2}, {3, 0}};
    small_file f;
    int k, i, j;
    memset(&f, 0, sizeof f);
    put(&f.s, "PRTRACE\0", 8);
    put_u32(&f.s, 1);
    put_u32(&f.s, (uint32_t)has_ref);
    put_u32(&f.s, 2);
    put_u32(&f.s, 10);
    for (k = 0; k < 2; k++) {
        f.P[k] = f.s.n; put_u32(&f.s, (uint32_t)Ps[k]);
        f.G[k] = f.s.n; put_u32(&f.s, (uint32_t)Gs[k]);
        f.prefix[k] = f.s.n;
        for (j = 0; j < Ps[k]; j++) put_u32(&f.s, (uint32_t)(j + 1 + k));
        f.len[k] = f.s.n;
        for (i = 0; i < Gs[k]; i++) put_u32(&f.s, (uint32_t)Ss[k][i]);
        f.adv[k] = f.s.n;
        for (i = 0; i < Gs[k]; i++) put_f32(&f.s, i ? -0.5f : 0.5f);
        for (i = 0; i < Gs[k]; i++) {
            f.tok[k][i] = f.s.n;
            for (j = 0; j < Ss[k][i]; j++) put_u32(&f.s, (uint32_t)(9 - j));
            f.old[k][i] = f.s.n;
            for (j = 0; j < Ss[k][i]; j++) put_f32(&f.s, -1.0f - (float)j);
            if (has_ref) {
                f.ref[k][i] = f.s.n;
                for (j = 0; j < Ss[k][i]; j++) put_f32(&f.s, j ? -2.5f : -0.0f);
            }
            f.mask[k][i] = f.s.n;
            for (j = 0; j < Ss[k][i]; j++) { unsigned char m = (unsigned char)(j != 1); put(&f.s, &m, 1); }
        }
    }
    return f;
}

/* Parse bytes copied into an exactly-sized block (so ASan sees any over-read) into a trace
   filled with a sentinel; expect failure `want`, an untouched trace and a message containing `needle`. */
static void expect_fail(const char *what, const unsigned char *b, size_t n, pr_status want, const char *needle) {
    pr_trace t, sentinel;
    pr_error err;
    unsigned char *copy = malloc(n ? n : 1);
    long live = test_alloc_live;
    pr_status st;
    memcpy(copy, b, n);
    memset(&sentinel, 0xa5, sizeof sentinel);
    t = sentinel;
    err.status = PR_OK;
    err.message[0] = 0;
    st = pr_trace_parse(&t, copy, n, &err);
    CHECK(st == want, "%s: status %d, expected %d (%s)", what, (int)st, (int)want, err.message);
    if (verbose && strncmp(what, "truncated to", 12) != 0) printf("  %-36s %s\n", what, err.message);
    CHECK(memcmp(&t, &sentinel, sizeof t) == 0, "%s: the caller's trace was modified", what);
    CHECK(test_alloc_live == live, "%s: %ld blocks leaked", what, test_alloc_live - live);
    CHECK(st == PR_OK || (err.status == st && strstr(err.message, "<memory>") && (!needle || strstr(err.message, needle))),
          "%s: message \"%s\" lacks \"%s\"", what, err.message, needle ? needle : "<memory>");
    if (st == PR_OK) pr_trace_free(&t);
    free(copy);
}

static void test_small(void) {
    small_file f = make_small(1), nr = make_small(0);
    pr_trace t;
    pr_error err;
    pr_status st;
    unsigned char *b = malloc(f.s.n + 16);
    size_t n = f.s.n;
#define RESET() memcpy(b, f.s.b, n)

    st = pr_trace_parse(&t, f.s.b, n, &err);
    CHECK(st == PR_OK, "small file: %s", st ? err.message : "");
    if (st == PR_OK) {
        const pr_group *g0 = &t.groups[0], *g1 = &t.groups[1];
        CHECK(t.n_groups == 2 && t.vocab_size == 10 && t.has_ref == 1, "small header");
        CHECK(g0->P == 3 && g0->G == 2 && g0->prefix[0] == 1 && g0->prefix[2] == 3, "small group 0 prefix");
        CHECK(g0->suffix_len[0] == 1 && g0->suffix_len[1] == 2 && g0->suffix_off[0] == 0 && g0->suffix_off[1] == 1 &&
              g0->suffix_off[2] == 3, "small group 0 lengths/offsets");
        CHECK(g0->tokens[0] == 9 && g0->tokens[1] == 9 && g0->tokens[2] == 8, "small group 0 tokens");
        CHECK(g0->advantage[0] == 0.5 && g0->advantage[1] == -0.5, "small group 0 advantages");
        CHECK(g0->old_logp[0] == -1 && g0->old_logp[1] == -1 && g0->old_logp[2] == -2, "small group 0 old_logp");
        CHECK(g0->ref_logp[0] == 0 && g0->ref_logp[2] == -2.5, "small group 0 ref_logp (-0.0 accepted)");
        CHECK(g0->loss_mask[0] == 1 && g0->loss_mask[1] == 1 && g0->loss_mask[2] == 0, "small group 0 mask");
        CHECK(g1->P == 1 && g1->G == 1 && g1->prefix[0] == 2 && g1->suffix_off[1] == 3 && g1->tokens[2] == 7 &&
              g1->old_logp[2] == -3 && g1->loss_mask[1] == 0, "small group 1");
        pr_trace_free(&t);
    }
    st = pr_trace_parse(&t, nr.s.b, nr.s.n, NULL);
    CHECK(st == PR_OK && t.has_ref == 0 && t.groups[0].ref_logp == NULL && t.groups[1].ref_logp == NULL &&
          t.groups[1].old_logp[1] == -2, "file without reference log-probs");
    if (st == PR_OK) pr_trace_free(&t);

    /* header */
    RESET(); b[0] = 'X'; expect_fail("bad magic", b, n, PR_ERR_FORMAT, "magic");
    RESET(); patch_u32(b, 8, 3); expect_fail("version 3", b, n, PR_ERR_UNSUPPORTED, "version 3");
    RESET(); patch_u32(b, 8, 0); expect_fail("version 0", b, n, PR_ERR_UNSUPPORTED, "version 0");
    RESET(); patch_u32(b, 12, 5); expect_fail("unknown flag bit 2", b, n, PR_ERR_FORMAT, "flags");
    RESET(); patch_u32(b, 12, 3); expect_fail("flag bit 1 without prefix arrays", b, n, PR_ERR_FORMAT, "group 1");
    RESET(); patch_u32(b, 12, 0x80000001u); expect_fail("unknown flag bit 31", b, n, PR_ERR_FORMAT, "flags");
    RESET(); patch_u32(b, 12, 0); expect_fail("flag cleared: groups misframed", b, n, PR_ERR_FORMAT, "group 1");
    RESET(); patch_u32(b, 16, 0); expect_fail("zero groups", b, n, PR_ERR_FORMAT, "n_groups = 0");
    RESET(); patch_u32(b, 16, 1); expect_fail("one group declared, two present", b, n, PR_ERR_FORMAT, "trailing");
    RESET(); patch_u32(b, 16, 3); expect_fail("three groups declared", b, n, PR_ERR_FORMAT, "group 2: truncated");
    RESET(); patch_u32(b, 16, 0x7fffffffu); expect_fail("n_groups 2^31-1", b, n, PR_ERR_FORMAT, "group 2: truncated");
    RESET(); patch_u32(b, 16, 0x80000000u); expect_fail("n_groups 2^31", b, n, PR_ERR_FORMAT, "n_groups = 2147483648");
    RESET(); patch_u32(b, 16, 0xffffffffu); expect_fail("n_groups 2^32-1", b, n, PR_ERR_FORMAT, "n_groups");
    RESET(); patch_u32(b, 20, 0); expect_fail("zero vocab", b, n, PR_ERR_FORMAT, "vocab_size = 0");
    RESET(); patch_u32(b, 20, 0x80000000u); expect_fail("vocab 2^31", b, n, PR_ERR_FORMAT, "vocab_size");
    RESET(); patch_u32(b, 20, 9); expect_fail("vocab smaller than a token", b, n, PR_ERR_FORMAT, "group 0: suffix 0: tokens[0] = 9");

    /* counts */
    RESET(); patch_u32(b, f.P[0], 0); expect_fail("P = 0", b, n, PR_ERR_FORMAT, "group 0: P (prefix length) = 0");
    RESET(); patch_u32(b, f.P[1], 0); expect_fail("P = 0 in group 1", b, n, PR_ERR_FORMAT, "group 1: P (prefix length) = 0");
    RESET(); patch_u32(b, f.G[0], 0); expect_fail("G = 0", b, n, PR_ERR_FORMAT, "group 0: G (number of suffixes) = 0");
    RESET(); patch_u32(b, f.len[0] + 4, 0); expect_fail("S_1 = 0", b, n, PR_ERR_FORMAT, "group 0: suffix_len[1] = 0");
    RESET(); patch_u32(b, f.len[1], 0); expect_fail("S_0 = 0 in group 1", b, n, PR_ERR_FORMAT, "group 1: suffix_len[0] = 0");
    RESET(); patch_u32(b, f.P[0], 4); expect_fail("P one too large", b, n, PR_ERR_FORMAT, NULL);
    RESET(); patch_u32(b, f.G[0], 3); expect_fail("G one too large", b, n, PR_ERR_FORMAT, NULL);
    RESET(); patch_u32(b, f.len[0], 2); expect_fail("S_0 one too large", b, n, PR_ERR_FORMAT, NULL);
    RESET(); patch_u32(b, f.len[1], 2); expect_fail("S_0 of the last group one too small", b, n, PR_ERR_FORMAT, NULL);
    /* huge counts: rejected by the limit, or by the bytes left, before any allocation */
    RESET(); patch_u32(b, f.P[0], 0x80000000u); expect_fail("P = 2^31", b, n, PR_ERR_FORMAT, "P (prefix length) = 2147483648");
    RESET(); patch_u32(b, f.P[0], 0xffffffffu); expect_fail("P = 2^32-1", b, n, PR_ERR_FORMAT, "P (prefix length) = 4294967295");
    RESET(); patch_u32(b, f.P[0], (1u << 24) + 1); expect_fail("P = 2^24+1", b, n, PR_ERR_FORMAT, "16777217 (must be 1..16777216)");
    RESET(); patch_u32(b, f.P[0], 1u << 24); expect_fail("P = 2^24", b, n, PR_ERR_FORMAT, "truncated");
    RESET(); patch_u32(b, f.G[0], 0x80000000u); expect_fail("G = 2^31", b, n, PR_ERR_FORMAT, "G (number of suffixes) = 2147483648");
    RESET(); patch_u32(b, f.G[0], 1u << 24); expect_fail("G = 2^24", b, n, PR_ERR_FORMAT, "truncated");
    RESET(); patch_u32(b, f.len[0], 0x80000000u); expect_fail("S_0 = 2^31", b, n, PR_ERR_FORMAT, "suffix_len[0] = 2147483648");
    RESET(); patch_u32(b, f.len[0], 1u << 24); patch_u32(b, f.len[0] + 4, 1u << 24);
    expect_fail("S_0 = S_1 = 2^24", b, n, PR_ERR_FORMAT, "truncated");

    /* values */
    RESET(); patch_u32(b, f.prefix[0] + 4, 10); expect_fail("prefix token = vocab", b, n, PR_ERR_FORMAT, "group 0: prefix_tokens[1] = 10");
    RESET(); patch_u32(b, f.prefix[1], 0xffffffffu); expect_fail("prefix token -1", b, n, PR_ERR_FORMAT, "group 1: prefix_tokens[0] = -1");
    RESET(); patch_u32(b, f.tok[0][1] + 4, 10); expect_fail("suffix token = vocab", b, n, PR_ERR_FORMAT, "suffix 1: tokens[1] = 10");
    RESET(); patch_u32(b, f.tok[1][0] + 8, 0x80000000u);
    expect_fail("suffix token INT32_MIN", b, n, PR_ERR_FORMAT, "group 1: suffix 0: tokens[2] = -2147483648");
    RESET(); patch_f32(b, f.adv[0] + 4, NAN); expect_fail("NaN advantage", b, n, PR_ERR_FORMAT, "advantage[1]");
    RESET(); patch_f32(b, f.adv[1], INFINITY); expect_fail("inf advantage", b, n, PR_ERR_FORMAT, "group 1: advantage[0] = inf");
    RESET(); patch_f32(b, f.adv[0], -INFINITY); expect_fail("-inf advantage", b, n, PR_ERR_FORMAT, "advantage[0] = -inf");
    RESET(); patch_f32(b, f.old[0][1] + 4, 0.25f); expect_fail("positive old_logp", b, n, PR_ERR_FORMAT, "suffix 1: old_logp[1] = 0.25");
    RESET(); patch_f32(b, f.old[1][0], 1e-30f); expect_fail("tiny positive old_logp", b, n, PR_ERR_FORMAT, "old_logp[0]");
    RESET(); patch_f32(b, f.old[0][0], -INFINITY); expect_fail("-inf old_logp", b, n, PR_ERR_FORMAT, "old_logp[0] = -inf");
    RESET(); patch_f32(b, f.old[0][0], NAN); expect_fail("NaN old_logp", b, n, PR_ERR_FORMAT, "old_logp[0]");
    RESET(); patch_f32(b, f.ref[1][0] + 8, 2.0f); expect_fail("positive ref_logp", b, n, PR_ERR_FORMAT, "group 1: suffix 0: ref_logp[2] = 2");
    RESET(); patch_f32(b, f.ref[0][0], NAN); expect_fail("NaN ref_logp", b, n, PR_ERR_FORMAT, "ref_logp[0]");
    RESET(); b[f.mask[0][1] + 1] = 2; expect_fail("mask value 2", b, n, PR_ERR_FORMAT, "group 0: suffix 1: loss_mask[1] = 2");
    RESET(); b[f.mask[1][0]] = 255; expect_fail("mask value 255", b, n, PR_ERR_FORMAT, "loss_mask[0] = 255");

    /* truncated at every byte offset; trailing garbage */
    for (size_t k = 0; k < n; k++) {
        char what[64];
        snprintf(what, sizeof what, "truncated to %zu bytes", k);
        expect_fail(what, f.s.b, k, PR_ERR_FORMAT, k < 24 ? "too short" : "truncated");
    }
    RESET(); b[n] = 0; expect_fail("one trailing zero byte", b, n + 1, PR_ERR_FORMAT, "1 trailing byte(s)");
    RESET(); memset(b + n, 7, 16); expect_fail("16 trailing bytes", b, n + 16, PR_ERR_FORMAT, "16 trailing byte(s)");

    /* arguments */
    memset(&t, 0x33, sizeof t);
    CHECK(pr_trace_parse(NULL, f.s.b, n, &err) == PR_ERR_ARG, "NULL trace");
    CHECK(pr_trace_parse(&t, NULL, 5, &err) == PR_ERR_ARG && strstr(err.message, "NULL"), "NULL bytes");
    CHECK(pr_trace_parse(&t, NULL, 0, &err) == PR_ERR_FORMAT, "NULL bytes, length 0: too short");
    CHECK(pr_trace_read(&t, "/nonexistent/dir/x.trace", &err) == PR_ERR_IO && strstr(err.message, "/nonexistent/dir/x.trace"),
          "missing file: %s", err.message);
    CHECK(pr_trace_read(&t, ".", &err) == PR_ERR_IO && strstr(err.message, "is a folder"), "a folder: %s", err.message);
    CHECK(pr_trace_read(&t, NULL, NULL) == PR_ERR_ARG, "NULL path, NULL err");
    CHECK(t.groups == (void *)t.groups && ((unsigned char *)&t)[0] == 0x33, "failed calls leave the trace alone");

    /* a file whose name appears in read errors */
    {
        const char *tmp = scratch_path("named.trace");
        FILE *fp = fopen(tmp, "wb");
        CHECK(fp != NULL, "cannot create %s", tmp);
        if (fp) {
            RESET(); b[f.mask[0][0]] = 3;
            fwrite(b, 1, n, fp);
            fclose(fp);
            st = pr_trace_read(&t, tmp, &err);
            CHECK(st == PR_ERR_FORMAT && strstr(err.message, "named.trace: group 0: suffix 0: loss_mask[0] = 3"),
                  "file errors name the file: %s", err.message);
            remove(tmp);
        }
    }

    /* failed allocations: each one in turn, until the read succeeds */
    {
        const char *tmp = scratch_path("nomem.trace");
        FILE *fp = fopen(tmp, "wb");
        CHECK(fp != NULL, "cannot create %s", tmp);
        if (fp) {
            fwrite(f.s.b, 1, n, fp);
            fclose(fp);
            for (long k = 0; k < 10; k++) {
                pr_trace s;
                long live = test_alloc_live;
                memset(&s, 0x77, sizeof s);
                t = s;
                test_alloc_calls = 0;
                test_alloc_fail_at = k;
                st = pr_trace_read(&t, tmp, &err);
                test_alloc_fail_at = -1;
                if (st == PR_OK) {
                    CHECK(k == 2, "the read takes 2 allocations, succeeded when failing #%ld", k);
                    pr_trace_free(&t);
                    break;
                }
                CHECK(st == PR_ERR_NOMEM && memcmp(&t, &s, sizeof t) == 0 && test_alloc_live == live,
                      "allocation %ld failing: status %d, trace %s, %ld leaked", k, (int)st,
                      memcmp(&t, &s, sizeof t) ? "modified" : "untouched", test_alloc_live - live);
            }
            remove(tmp);
        }
    }
#undef RESET
    free(b);
    free(f.s.b);
    free(nr.s.b);
}

/* ---------------------------------------------------------------- 4. groups built in memory */
/* ---------------------------------------------------------------- 5. version 2: the step table */
/* The small file as version 2 with `n_steps` steps of the given group counts (written as given,
   valid or not) between the header and the groups. */
static buf make_v2(const small_file *f, uint32_t n_steps, const uint32_t *sizes, uint32_t n_sizes) {
    buf s = {NULL, 0, 0};
    put(&s, f->s.b, 24);
    patch_u32(s.b, 8, 2);
    put_u32(&s, n_steps);
    for (uint32_t k = 0; k < n_sizes; k++) put_u32(&s, sizes[k]);
    put(&s, f->s.b + 24, f->s.n - 24);
    return s;
}

/* Flag bit 1: every group record ends with prefix_mask, prefix_old_logp and prefix_ref_logp. */
static void test_prefix_loss_trace(void) {
    int32_t prefix[3] = {1, 2, 3}, prefix2[2] = {4, 5}, tokens[3] = {9, 9, 8};
    int lens[2] = {1, 2}, lens2[1] = {3};
    int64_t off[3] = {0, 1, 3}, off2[2] = {0, 3};
    pr_real adv[2] = {1, -1}, adv2[1] = {0.5}, old[3] = {-1, -2, -3}, ref[3] = {-1, -0.5, 0};
    uint8_t mask[3] = {1, 0, 1}, pmask[3] = {0, 1, 1};
    pr_real pold[3] = {-0.5, -1.5, -2.5}, pref[3] = {-1, -1.25, -2};
    pr_group g[2] = { {3, 2, prefix, lens, off, tokens, adv, old, ref, mask, pmask, pold, pref},
                      {2, 1, prefix2, lens2, off2, tokens, adv2, old, ref, mask, NULL, NULL, NULL} };
    pr_trace t = {2, 10, 1, g, 0, NULL, 0}, r;
    pr_error err;
    void *bytes = NULL;
    size_t n = 0;
    CHECK(!pr_trace_serialize(&t, &bytes, &n, &err), "serialize trained prefix tokens: %s", err.message);
    /* group 0: 8 + 12 + 16 + 13 * 3 + 9 * 3; group 1: 8 + 8 + 8 + 13 * 3 + 9 * 2 */
    const size_t tail0 = 24 + 8 + 12 + 16 + 39;    /* group 0's prefix arrays, after its suffixes */
    CHECK(bytes && n == 24 + (8 + 12 + 16 + 39 + 27) + (8 + 8 + 8 + 39 + 18) && ((unsigned char *)bytes)[12] == 3,
          "trained prefix tokens: %zu bytes, flags %u", n, bytes ? ((unsigned char *)bytes)[12] : 0);
    const unsigned char *b = bytes;
    CHECK(b && b[tail0] == 0 && b[tail0 + 1] == 1 && b[tail0 + 2] == 1, "prefix_mask after the suffixes");
    pr_status st = pr_trace_parse(&r, bytes, n, &err);
    CHECK(st == PR_OK, "parse trained prefix tokens: %s", st ? err.message : "");
    if (st == PR_OK) {
        const pr_group *a = &r.groups[0];
        CHECK(a->prefix_mask && a->prefix_mask[2] == 1 && a->prefix_old_logp[1] == -1.5 && a->prefix_ref_logp[2] == -2 &&
              !r.groups[1].prefix_mask && !r.groups[1].prefix_old_logp && !r.groups[1].prefix_ref_logp,
              "trained prefix tokens read back (a mask of zeros is none)");
        void *again = NULL;
        size_t n2 = 0;
        CHECK(!pr_trace_serialize(&r, &again, &n2, &err) && n2 == n && !memcmp(again, bytes, n), "trained prefix tokens round trip");
        PR_FREE(again);
        pr_trace_free(&r);
    }
    {   /* a mask of zeros is none to the writer too: its log-probs written as 0, flags bit 1 only
           where another group trains, and the file reads back */
        uint8_t zmask[2] = {0, 0};
        pr_real zold[2] = {-0.5, -0.25}, zref[2] = {-1, -1};
        pr_group gz[2] = { g[0], g[1] };
        gz[1].prefix_mask = zmask; gz[1].prefix_old_logp = zold; gz[1].prefix_ref_logp = zref;
        pr_trace tz = {2, 10, 1, gz, 0, NULL, 0}, rz;
        void *bz = NULL;
        size_t nz = 0;
        CHECK(!pr_trace_serialize(&tz, &bz, &nz, &err) && nz == n && !memcmp(bz, bytes, n),
              "a group's mask of zeros is written as no mask");
        PR_FREE(bz);
        tz.n_groups = 1; tz.groups = gz + 1;
        CHECK(!pr_trace_serialize(&tz, &bz, &nz, &err) && ((unsigned char *)bz)[12] == 1, "no group trains: flags bit 1 unset");
        st = bz ? pr_trace_parse(&rz, bz, nz, &err) : PR_ERR_ARG;
        CHECK(st == PR_OK && !rz.groups[0].prefix_mask, "a mask of zeros reads back as none: %s", st ? err.message : "");
        if (st == PR_OK) pr_trace_free(&rz);
        PR_FREE(bz);
    }
    unsigned char *c = malloc(n);
    memcpy(c, bytes, n);
    c[tail0] = 1;
    expect_fail("first prefix token trained", c, n, PR_ERR_FORMAT, "group 0: prefix_mask[0] = 1");
    memcpy(c, bytes, n);
    patch_f32(c, tail0 + 3 + 4, 0.5f);
    expect_fail("positive prefix_old_logp", c, n, PR_ERR_FORMAT, "group 0: prefix_old_logp[1] = 0.5");
    expect_fail("prefix arrays cut short", bytes, n - 1, PR_ERR_FORMAT, "group 1: truncated: prefix_mask");
    /* what no writer puts there, since reading would lose it: a context-only group's prefix log-probs
       other than 0 (group 1's are the file's last 16 bytes, old then ref), and flags bit 1 with
       no trained prefix token at all (group 0's arrays zeroed) */
    memcpy(c, bytes, n);
    patch_f32(c, n - 12, -1.0f);
    expect_fail("context-only prefix_old_logp", c, n, PR_ERR_FORMAT, "group 1: prefix_old_logp[1] = -1, but the group trains no");
    memcpy(c, bytes, n);
    patch_f32(c, n - 8, -0.0f);
    expect_fail("context-only prefix_ref_logp -0", c, n, PR_ERR_FORMAT, "group 1: prefix_ref_logp[0] = -0, but the group trains no");
    memcpy(c, bytes, n);
    memset(c + tail0, 0, 3 + 12 + 12);
    expect_fail("flags bit 1 with no trained prefix token", c, n, PR_ERR_FORMAT,
                "flags bit 1 (trained prefix tokens) is set, but no group trains a prefix token");
    free(c);
    PR_FREE(bytes);
}

/* data/multiturn.trace (written by data/make_multiturn.py): the C reader takes what the Python
   writer wrote, trained prefix tokens included, and writes the same bytes back. */
static void test_multiturn(const char *path) {
    pr_trace t;
    pr_error err;
    pr_status st = pr_trace_read(&t, path, &err);
    CHECK(st == PR_OK, "pr_trace_read(%s): %s", path, st ? err.message : "");
    if (st) return;
    int trained = 0, with = 0;
    for (int k = 0; k < t.n_groups; k++) {
        const pr_group *g = &t.groups[k];
        with += g->prefix_mask != NULL;
        for (int j = 0; g->prefix_mask && j < g->P; j++) trained += g->prefix_mask[j] * g->G;
    }
    CHECK(t.n_groups == 8 && t.n_steps == 2 && with == 6 && trained == 384,
          "%s: %d groups, %d steps, %d with trained prefix tokens, %d trained over all trajectories (the script prints 384)",
          path, t.n_groups, t.n_steps, with, trained);
    size_t len = 0;
    unsigned char *file = read_file(path, &len);
    void *sb = NULL;
    size_t sn = 0;
    st = pr_trace_serialize(&t, &sb, &sn, &err);
    CHECK(st == PR_OK && file && sn == len && !memcmp(sb, file, len), "%s: pr_trace_serialize gives other bytes than the file", path);
    PR_FREE(sb);
    free(file);
    pr_trace_free(&t);
}

static void test_steps(void) {
    small_file f = make_small(1);
    pr_trace t;
    pr_error err;
    static const uint32_t one_two[1] = {2}, two_ones[2] = {1, 1};
    /* two steps of one group, and one step of both: read, then written back byte for byte */
    for (int c = 0; c < 2; c++) {
        buf v2 = c ? make_v2(&f, 1, one_two, 1) : make_v2(&f, 2, two_ones, 2);
        pr_status st = pr_trace_parse(&t, v2.b, v2.n, &err);
        CHECK(st == PR_OK, "v2 (%d steps): %s", 2 - c, st ? err.message : "");
        if (st == PR_OK) {
            CHECK(t.n_groups == 2 && t.n_steps == 2 - c && t.step_off && t.step_off[0] == 0 && t.step_off[t.n_steps] == 2 &&
                  (c || t.step_off[1] == 1), "v2 step table: %d steps", t.n_steps);
            CHECK(t.groups[1].P == 1 && t.groups[1].tokens[2] == 7 && t.groups[0].ref_logp[2] == -2.5, "v2 groups as in v1");
            void *sb = NULL;
            size_t sn = 0;
            st = pr_trace_serialize(&t, &sb, &sn, &err);
            CHECK(!st && sn == v2.n && memcmp(sb, v2.b, sn) == 0, "v2 round trip: %s", st ? err.message : "other bytes");
            PR_FREE(sb);
            /* without its table the same trace is written as version 1, the original file */
            t.n_steps = 0;
            st = pr_trace_serialize(&t, &sb, &sn, &err);
            CHECK(!st && sn == f.s.n && memcmp(sb, f.s.b, sn) == 0, "no steps: version 1 bytes");
            PR_FREE(sb);
            pr_trace_free(&t);
        }
        /* every truncation of the v2 file fails (in the table too) */
        size_t bad = 0;
        for (size_t n = 0; n < v2.n; n++) {
            memset(&t, 0x5a, sizeof t);
            if (pr_trace_parse(&t, v2.b, n, &err) != PR_ERR_FORMAT) bad++;
        }
        CHECK(bad == 0, "v2: %zu truncations did not fail with PR_ERR_FORMAT", bad);
        free(v2.b);
    }
    /* version 1 is still read: no step table */
    CHECK(pr_trace_parse(&t, f.s.b, f.s.n, &err) == PR_OK && t.n_steps == 0 && t.step_off == NULL, "v1 read: no steps");
    /* malformed tables: counts checked before any allocation, the caller's trace untouched */
    static const uint32_t zero_two[2] = {0, 2}, three[1] = {3}, one[1] = {1}, big[1] = {0xffffffffu};
    buf m;
    m = make_v2(&f, 0, NULL, 0); expect_fail("v2: zero steps", m.b, m.n, PR_ERR_FORMAT, "n_steps = 0"); free(m.b);
    m = make_v2(&f, 3, NULL, 0); expect_fail("v2: more steps than groups", m.b, m.n, PR_ERR_FORMAT, "n_steps = 3"); free(m.b);
    m = make_v2(&f, 0xffffffffu, NULL, 0); expect_fail("v2: n_steps 2^32-1", m.b, m.n, PR_ERR_FORMAT, "n_steps"); free(m.b);
    m = make_v2(&f, 2, zero_two, 2); expect_fail("v2: an empty step", m.b, m.n, PR_ERR_FORMAT, "step 0 has 0 groups"); free(m.b);
    m = make_v2(&f, 1, three, 1); expect_fail("v2: a step past the groups", m.b, m.n, PR_ERR_FORMAT, "step 0 has 3 groups"); free(m.b);
    m = make_v2(&f, 1, big, 1); expect_fail("v2: a step of 2^32-1 groups", m.b, m.n, PR_ERR_FORMAT, "step 0 has 4294967295"); free(m.b);
    m = make_v2(&f, 1, one, 1); expect_fail("v2: steps short of the groups", m.b, m.n, PR_ERR_FORMAT, "hold 1 of the 2 groups"); free(m.b);
    /* the writer refuses a table that does not cover the groups in order */
    if (t.n_groups == 2) {
        int offs[3][3] = { {1, 2, 0}, {0, 0, 2}, {0, 1, 1} };
        const char *what[3] = { "not from group 0", "an empty step", "short of the last group" };
        for (int k = 0; k < 3; k++) {
            void *sb = NULL;
            size_t sn = 0;
            t.n_steps = k == 0 ? 1 : 2;
            t.step_off = offs[k];
            CHECK(pr_trace_serialize(&t, &sb, &sn, &err) == PR_ERR_ARG && strstr(err.message, "step") && !sb,
                  "serialize refuses a step table %s: '%s'", what[k], err.message);
        }
        t.n_steps = 3;
        CHECK(pr_trace_serialize(&t, &(void *){NULL}, &(size_t){0}, &err) == PR_ERR_ARG, "serialize refuses more steps than groups");
        t.n_steps = 0;
        t.step_off = NULL;
        pr_trace_free(&t);
    }
    free(f.s.b);
}

static void expect_invalid(const char *what, const pr_group *g, int vocab, const char *needle) {
    pr_error err;
    pr_status st = pr_group_validate(g, vocab, &err);
    CHECK(st == PR_ERR_ARG && strstr(err.message, needle), "%s: status %d, message \"%s\" (want \"%s\")", what,
          (int)st, st ? err.message : "", needle);
    if (verbose) printf("  %-36s %s\n", what, err.message);
}

static void test_validate(void) {
    int32_t prefix[2] = {0, 4}, tokens[3] = {1, 2, 3};
    int lens[2] = {1, 2};
    int64_t off[3] = {0, 1, 3};
    pr_real adv[2] = {1, -1}, old[3] = {-1, -2, -3}, ref[3] = {-1, -0.5, 0};
    uint8_t mask[3] = {1, 0, 1};
    pr_group ok = {2, 2, prefix, lens, off, tokens, adv, old, ref, mask, NULL, NULL, NULL}, g;
    pr_error err;
    pr_status st = pr_group_validate(&ok, 5, &err);
    CHECK(st == PR_OK, "valid in-memory group: %s", st ? err.message : "");
    g = ok; g.ref_logp = NULL;
    CHECK(pr_group_validate(&g, 5, NULL) == PR_OK, "ref_logp may be NULL");
    CHECK(pr_group_validate(NULL, 5, &err) == PR_ERR_ARG, "NULL group");
    expect_invalid("vocab 0", &ok, 0, "vocab_size = 0");
    expect_invalid("token = vocab", &ok, 4, "prefix_tokens[1] = 4");
    g = ok; g.P = 0; expect_invalid("P = 0", &g, 5, "P (prefix length) = 0");
    g = ok; g.P = -3; expect_invalid("P < 0", &g, 5, "P (prefix length) = -3");
    g = ok; g.G = 0; expect_invalid("G = 0", &g, 5, "G (number of suffixes) = 0");
    g = ok; g.G = PR_TRACE_MAX_COUNT + 1; expect_invalid("G too large", &g, 5, "G (number of suffixes) = 16777217");
    g = ok; g.tokens = NULL; expect_invalid("NULL tokens", &g, 5, "NULL array");
    g = ok; g.loss_mask = NULL; expect_invalid("NULL mask", &g, 5, "NULL array");
    {
        int bad_lens[2] = {1, 0};
        int64_t bad_off[3] = {0, 1, 4}, bad_off0[3] = {1, 2, 4};
        g = ok; g.suffix_len = bad_lens; expect_invalid("S = 0", &g, 5, "suffix_len[1] = 0");
        g = ok; g.suffix_off = bad_off; expect_invalid("offsets", &g, 5, "suffix_off[2] = 4");
        g = ok; g.suffix_off = bad_off0; expect_invalid("offset 0", &g, 5, "suffix_off[0] = 1");
    }
    {
        int32_t t2[3] = {1, -1, 3};
        pr_real a2[2] = {1, (pr_real)NAN}, o2[3] = {-1, (pr_real)INFINITY, -3}, r2[3] = {-1, -1, (pr_real)1e-20};
        uint8_t m2[3] = {1, 2, 1};
        g = ok; g.tokens = t2; expect_invalid("negative token", &g, 5, "suffix 1: tokens[0] = -1");
        g = ok; g.advantage = a2; expect_invalid("NaN advantage", &g, 5, "advantage[1]");
        g = ok; g.old_logp = o2; expect_invalid("inf old_logp", &g, 5, "suffix 1: old_logp[0] = inf");
        g = ok; g.ref_logp = r2; expect_invalid("positive ref_logp", &g, 5, "suffix 1: ref_logp[1]");
        g = ok; g.loss_mask = m2; expect_invalid("mask 2", &g, 5, "suffix 1: loss_mask[0] = 2");
    }
    {   /* trained prefix tokens */
        uint8_t pm[2] = {0, 1}, pm0[2] = {1, 1}, pm2[2] = {0, 2};
        pr_real po[2] = {-1, -2}, pr[2] = {-1, -1}, pbad[2] = {0, (pr_real)0.5};
        g = ok; g.prefix_mask = pm; g.prefix_old_logp = po; g.prefix_ref_logp = pr;
        CHECK(pr_group_validate(&g, 5, &err) == PR_OK, "a trained prefix token: %s", err.message);
        g.ref_logp = NULL; expect_invalid("prefix_ref_logp without ref_logp", &g, 5, "exactly when ref_logp");
        g = ok; g.prefix_mask = pm; g.prefix_old_logp = po; expect_invalid("no prefix_ref_logp", &g, 5, "exactly when ref_logp");
        g = ok; g.prefix_mask = pm; g.prefix_ref_logp = pr; expect_invalid("no prefix_old_logp", &g, 5, "needs prefix_old_logp");
        g = ok; g.prefix_old_logp = po; expect_invalid("prefix log-probs without a mask", &g, 5, "without prefix_mask");
        g = ok; g.prefix_mask = pm0; g.prefix_old_logp = po; g.prefix_ref_logp = pr;
        expect_invalid("first prefix token trained", &g, 5, "prefix_mask[0] = 1");
        g.prefix_mask = pm2; expect_invalid("prefix mask 2", &g, 5, "prefix_mask[1] = 2");
        g.prefix_mask = pm; g.prefix_old_logp = pbad; expect_invalid("positive prefix_old_logp", &g, 5, "prefix_old_logp[1]");
    }
}

/* ------------------------------------------------------------------ prefix trees */
typedef struct { pr_group g[64]; int32_t tok[64][64]; } tree_step;

static void tree_group(tree_step *s, int i, const int32_t *prefix, int P, int G) {
    memset(&s->g[i], 0, sizeof s->g[i]);
    memcpy(s->tok[i], prefix, sizeof(int32_t) * (size_t)P);
    s->g[i].P = P;
    s->g[i].G = G;
    s->g[i].prefix = s->tok[i];
}

/* Every group's path covers its prompt, contiguously from 0; every node's tokens agree in the groups
   below it, which are as many as it says; a node shared by several groups is min_shared long. */
static int tree_consistent(const pr_prefix_tree *t, const pr_group *g, int n, int min_shared) {
    int below[128] = { 0 };
    long sum = 0;
    for (int k = 0; k < t->n_nodes; k++) sum += t->nodes[k].len;
    if (sum != t->tokens_tree || t->n_nodes > 2 * n) return 0;
    for (int i = 0; i < n; i++) {
        int end = g[i].P;
        for (int k = t->group_node[i]; k >= 0; k = t->nodes[k].parent) {
            const pr_prefix_node *nd = &t->nodes[k];
            if (nd->start + nd->len != end || nd->len < 1) return 0;
            end = nd->start;
            below[k]++;
            for (int j = 0; j < n; j++) {            /* a group below k (k on its path) has k's tokens */
                int on = 0;
                for (int m = t->group_node[j]; m >= 0 && !on; m = t->nodes[m].parent) on = m == k;
                if (on && memcmp(g[j].prefix + nd->start, g[i].prefix + nd->start, sizeof(int32_t) * (size_t)nd->len)) return 0;
            }
        }
        if (end != 0) return 0;
    }
    for (int k = 0; k < t->n_nodes; k++)
        if (below[k] != t->nodes[k].groups_below || (below[k] > 1 && t->nodes[k].len < min_shared)) return 0;
    return 1;
}

static int cmp_prompts(const void *a, const void *b) {
    const pr_group *x = *(const pr_group *const *)a, *y = *(const pr_group *const *)b;
    for (int i = 0; i < x->P && i < y->P; i++) if (x->prefix[i] != y->prefix[i]) return x->prefix[i] < y->prefix[i] ? -1 : 1;
    return (x->P > y->P) - (x->P < y->P);
}

static void test_prefix_tree(void) {
    static tree_step s;
    int32_t p[64];
    for (int i = 0; i < 64; i++) p[i] = 100 + i;
    /* S = 1..10 shared by A, B, C, E; A = S + 20..39, E = A, B = A + 50..52, C = S + 60..64, D = 1 2 70..77 */
    int32_t a[33], c[15], d[10];
    for (int i = 0; i < 10; i++) a[i] = c[i] = 1 + i;
    for (int i = 0; i < 20; i++) a[10 + i] = 20 + i;
    for (int i = 0; i < 3; i++) a[30 + i] = 50 + i;
    for (int i = 0; i < 5; i++) c[10 + i] = 60 + i;
    d[0] = 1; d[1] = 2;
    for (int i = 0; i < 8; i++) d[2 + i] = 70 + i;
    tree_group(&s, 0, a, 30, 2);
    tree_group(&s, 1, a, 33, 3);
    tree_group(&s, 2, c, 15, 4);
    tree_group(&s, 3, d, 10, 5);
    tree_group(&s, 4, a, 30, 6);
    pr_prefix_tree t;
    pr_error err;
    CHECK(!pr_prefix_tree_build(&t, s.g, 5, 4, &err), "prefix tree: %s", err.message);
    /* nodes: [0,10) of A B C E; [10,30) of A B E, where A and E end; [30,33) B; [10,15) C; [0,10) D */
    CHECK(t.n_nodes == 5 && t.tokens_tree == 48 && t.tokens_groups == 118 && t.tokens_baseline == 449,
          "prefix tree, min 4: %d nodes, tokens %ld / %ld / %ld (want 5 nodes, 48 / 118 / 449)", t.n_nodes, t.tokens_tree,
          t.tokens_groups, t.tokens_baseline);
    CHECK(t.group_node[0] == t.group_node[4] && t.nodes[t.group_node[0]].start == 10 && t.nodes[t.group_node[0]].len == 20 &&
          t.nodes[t.group_node[0]].groups_below == 3 && t.nodes[t.group_node[1]].parent == t.group_node[0] &&
          t.nodes[t.group_node[3]].parent == -1 && t.nodes[t.group_node[3]].len == 10,
          "prefix tree, min 4: A and E end together at [10,30), B below it, D alone");
    CHECK(tree_consistent(&t, s.g, 5, 4), "prefix tree, min 4: inconsistent");
    pr_prefix_tree_free(&t);
    /* min 11: the 10 shared tokens are too few; A B E share 30, C and D keep their own */
    CHECK(!pr_prefix_tree_build(&t, s.g, 5, 11, &err) && t.n_nodes == 4 && t.tokens_tree == 58 && tree_consistent(&t, s.g, 5, 11),
          "prefix tree, min 11: %d nodes, %ld tokens (want 4, 58)", t.n_nodes, t.tokens_tree);
    pr_prefix_tree_free(&t);
    /* random steps: prompts drawn from a small alphabet, so that many share starts */
    uint64_t r = 7;
    int worst = 0;
    for (int trial = 0; trial < 300; trial++) {
        const int n = 1 + (int)(trial % 40), min_shared = 1 + trial % 3, alphabet = 2 + trial % 3;
        for (int i = 0; i < n; i++) {
            r = r * 6364136223846793005u + 1442695040888963407u;
            const int P = 1 + (int)((r >> 33) % 24);
            for (int k = 0; k < P; k++) {
                r = r * 6364136223846793005u + 1442695040888963407u;
                p[k] = (int32_t)((r >> 33) % (uint64_t)alphabet);
            }
            tree_group(&s, i, p, P, 1 + i % 3);
        }
        if (pr_prefix_tree_build(&t, s.g, n, min_shared, &err)) {
            CHECK(0, "prefix tree, trial %d: %s", trial, err.message);
            continue;
        }
        int ok = tree_consistent(&t, s.g, n, min_shared);
        if (min_shared == 1) {              /* a trie's edges: the distinct nonempty prefixes of the prompts */
            const pr_group *sorted[64];
            long distinct = 0;
            for (int i = 0; i < n; i++) sorted[i] = &s.g[i];
            qsort(sorted, (size_t)n, sizeof *sorted, cmp_prompts);
            for (int i = 0; i < n; i++) {
                int l = 0;
                while (i && l < sorted[i]->P && l < sorted[i - 1]->P && sorted[i]->prefix[l] == sorted[i - 1]->prefix[l]) l++;
                distinct += sorted[i]->P - l;
            }
            ok &= distinct == t.tokens_tree;
        }
        if (t.n_nodes > worst) worst = t.n_nodes;
        CHECK(ok, "prefix tree, trial %d (%d groups, min %d): inconsistent or wrong token count %ld", trial, n, min_shared, t.tokens_tree);
        pr_prefix_tree_free(&t);
    }
    CHECK(pr_prefix_tree_build(&t, s.g, 3, 0, &err) == PR_ERR_ARG && strstr(err.message, "min_shared 0"), "min_shared 0 refused");
    s.g[1].P = 0;
    CHECK(pr_prefix_tree_build(&t, s.g, 3, 1, &err) == PR_ERR_ARG && strstr(err.message, "group 1"), "a group without prefix refused");
    if (verbose) printf("prefix trees: up to %d nodes in the random steps\n", worst);
}

int main(int argc, char **argv) {
    const char *sample = "data/sample.trace";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-v") == 0) verbose = 1;
        else sample = argv[i];
    }
    test_sample(sample);
    test_small();
    test_steps();
    test_prefix_loss_trace();
    test_multiturn("data/multiturn.trace");
    test_validate();
    test_prefix_tree();
    CHECK(test_alloc_live == 0, "%ld blocks still allocated at exit", test_alloc_live);
    return test_report();
}
