/* Tests of the JSON reader, configs, safetensors read/write, sharding, number conversions and a
   list of malformed inputs that must fail cleanly. Built and run by `make test` (float and double)
   and `make asan`; also clean under valgrind --leak-check=full.
   run:   build/test_io-float [model-folder]   (default: model, then ../model; needs llama3-8b, qwen3-8b, tiny)
   Last line: "N passed, N failed"; exit status 1 on any failure. */
#include <stdlib.h>

#define TEST_COUNTING_ALLOCATOR
#include "harness.h"
#include <errno.h>

/* The library's renames, refused once g_renames_left more have run (-1: never): a save interrupted
   part way through putting its files in place. */
static int g_renames_left = -1;
static int test_rename(const char *from, const char *to) {
    if (g_renames_left == 0) {
        errno = EIO;
        return -1;
    }
    if (g_renames_left > 0) g_renames_left--;
    return rename(from, to);
}
#define rename(from, to) test_rename(from, to)

#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"

#include <float.h>

static pr_status g_st; /* the status of the last OK(...) call */
#define OK(call) ((g_st = (call)) == PR_OK)
static char g_tmp[256];      /* scratch folder, removed at the end */
static char g_models[256];   /* the project's model/ folder */


/* A failing call must return `want`, set err->status to it and leave a message that contains
   `needle` (the file name or the field at fault). */
static void expect_fail(pr_status got, pr_status want, const pr_error *e, const char *needle, const char *what, int line) {
    int ok = got == want && e->status == want && e->message[0] && (!needle || strstr(e->message, needle));
    if (ok) { test_passed++; return; }
    test_failed++;
    printf("FAIL line %d (%s): status %d (want %d), message: %s\n", line, what, (int)got, (int)want, e->message);
}
#define EXPECT_FAIL(call, want, needle, what)            \
    do {                                                 \
        pr_error e_;                                     \
        memset(&e_, 0, sizeof e_);                       \
        pr_status s_ = (call);                           \
        expect_fail(s_, want, &e_, needle, what, __LINE__); \
    } while (0)
/* `call` uses a pr_error named e_ */

static char *tmp_path(const char *name) {
    static char buf[8][512]; /* rotating: a few paths may be alive at once */
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_tmp, name);
    return buf[k];
}

static int write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

static int file_exists(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

/* Reads a whole file into a malloc'd buffer. */
static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, len = 0;
    unsigned char *p = malloc(cap);
    for (;;) {
        size_t got = fread(p + len, 1, cap - len, f);
        len += got;
        if (len < cap) break;
        cap *= 2;
        p = realloc(p, cap);
    }
    fclose(f);
    *n = len;
    return p;
}

/* A safetensors file from a header text and raw data bytes. */
static int make_st(const char *path, const char *header, const void *data, size_t ndata) {
    size_t h = strlen(header);
    unsigned char *buf = malloc(8 + h + ndata + 1);
    pr__put_u64(buf, (uint64_t)h);
    memcpy(buf + 8, header, h);
    if (ndata) memcpy(buf + 8 + h, data, ndata);
    int ok = write_bytes(path, buf, 8 + h + ndata);
    free(buf);
    return ok;
}

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---------------------------------------------------------------- JSON */
static void test_json(void) {
    pr_error err;
    pr__json *j;
    const char *doc = " {\"a\": [1, -2, 3.5e2, 9007199254740993, -9223372036854775808, 1e400],"
                      " \"s\": \"q\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\\u0000x\","
                      " \"t\": true, \"f\": false, \"n\": null, \"o\": {\"k\": {}}, \"d\": 1, \"d\": 2} ";
    CHECK(pr__json_parse(&j, doc, strlen(doc), "doc", 0, &err) == PR_OK, "parse: %s", err.message);
    if (j) {
        const pr__json *a = pr__json_get(j, "a"), *s = pr__json_get(j, "s"), *e = pr__json_first(a);
        int64_t i;
        CHECK(j->type == PR__JSON_OBJECT && j->count == 8, "root object of 8 members");
        CHECK(a && a->type == PR__JSON_ARRAY && a->count == 6, "array of 6");
        CHECK(pr__json_int(e, &i) && i == 1, "1");
        e = pr__json_next(e);
        CHECK(pr__json_int(e, &i) && i == -2, "-2");
        e = pr__json_next(e);
        CHECK(e->num == 350.0 && pr__json_int(e, &i) && i == 350, "3.5e2 is integral");
        e = pr__json_next(e);
        CHECK(pr__json_int(e, &i) && i == 9007199254740993LL, "2^53+1 exact");
        e = pr__json_next(e);
        CHECK(pr__json_int(e, &i) && i == INT64_MIN, "INT64_MIN exact");
        e = pr__json_next(e);
        CHECK(!pr__json_int(e, &i) && isinf(e->num), "1e400 is inf, not an integer");
        CHECK(s && s->type == PR__JSON_STRING && s->count == 17 &&
                  memcmp(s->str, "q\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80\0x", 17) == 0,
              "escapes decode, \\u to UTF-8 incl. a surrogate pair and \\u0000");
        CHECK(pr__json_get(j, "t")->type == PR__JSON_TRUE && pr__json_get(j, "f")->type == PR__JSON_FALSE &&
                  pr__json_get(j, "n")->type == PR__JSON_NULL, "literals");
        CHECK(pr__json_get(pr__json_get(j, "o"), "k")->type == PR__JSON_OBJECT, "nested lookup");
        CHECK(pr__json_int(pr__json_get(j, "d"), &i) && i == 2, "duplicate key: last wins");
        CHECK(pr__json_get(j, "zz") == NULL && pr__json_get(a, "x") == NULL, "missing key, non-object");
        PR_FREE(j);
    }
    /* depth limit: 64 nested arrays parse, 65 do not */
    char deep[200];
    memset(deep, '[', 64);
    memset(deep + 64, ']', 64);
    CHECK(OK(pr__json_parse(&j, deep, 128, "deep", 0, &err)), "64 levels");
    if (!g_st) PR_FREE(j);
    memset(deep, '[', 65);
    memset(deep + 65, ']', 65);
    EXPECT_FAIL(pr__json_parse(&j, deep, 130, "deep", 0, &e_), PR_ERR_FORMAT, "deeper than 64", "65 levels");
    struct { const char *text, *needle; } bad[] = {
        {"", "byte 0: unexpected end"}, {"{", "byte 1"}, {"{\"a\" 1}", "byte 5: expected ':'"}, {"[1,]", "byte 3"},
        {"{\"a\":1,}", "byte 7: expected a string key"}, {"01", "byte 1: text after"}, {"-", "bad number"}, {"1.", "after '.'"},
        {"1e+", "exponent"}, {"tru", "unexpected character"}, {"\"abc", "unterminated string"}, {"\"a\tb\"", "control character"},
        {"\"\\x\"", "invalid escape"}, {"\"\\u12\"", "four hex digits"}, {"\"\\udc00\"", "lone low surrogate"},
        {"\"\\ud800x\"", "without a low surrogate"}, {"[1 2]", "expected ',' or ']'"}, {"{\"a\":1 \"b\":2}", "expected ',' or '}'"},
        {"NaN", "unexpected character"}, {"[1] [2]", "byte 4: text after"}, {"\"\\", "unterminated escape"}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        j = (pr__json *)&err; /* must stay untouched on failure */
        EXPECT_FAIL(pr__json_parse(&j, bad[k].text, strlen(bad[k].text), "doc", 0, &e_), PR_ERR_FORMAT, bad[k].needle, bad[k].text);
        CHECK(j == (pr__json *)&err, "output untouched on failure (%s)", bad[k].text);
    }
    /* text need not be NUL-terminated: parse a prefix of a longer buffer */
    CHECK(OK(pr__json_parse(&j, "123456", 3, "doc", 0, &err)) && j->ival == 123, "length-bounded number");
    if (!g_st) PR_FREE(j);
}

/* ---------------------------------------------------------------- number conversions */
static void test_conversions(void) {
    struct { uint32_t in; uint16_t out; const char *what; } bf[] = {
        {0x3f800000u, 0x3f80, "1.0"}, {0x3f808000u, 0x3f80, "1+2^-8 tie -> even (down)"},
        {0x3f818000u, 0x3f82, "1+3*2^-8 tie -> even (up)"}, {0x3f808001u, 0x3f81, "just above a tie"},
        {0x3f807fffu, 0x3f80, "just below a tie"}, {0xbf808000u, 0xbf80, "-(1+2^-8) tie"},
        {0x7f7fffffu, 0x7f80, "FLT_MAX rounds to inf"}, {0x7f7f7fffu, 0x7f7f, "largest below the inf tie"},
        {0x7f800000u, 0x7f80, "inf"}, {0xff800000u, 0xff80, "-inf"}, {0x80000000u, 0x8000, "-0"},
        {0x00010000u, 0x0001, "float subnormal"}, {0x00008000u, 0x0000, "subnormal tie -> 0"},
        {0x7fc00000u, 0x7fc0, "quiet NaN"}, {0xffc00001u, 0xffc0, "negative NaN"}};
    for (size_t k = 0; k < sizeof bf / sizeof bf[0]; k++)
        CHECK(pr_f32_to_bf16(u2f(bf[k].in)) == bf[k].out, "bf16 %s: got %04x want %04x", bf[k].what,
              pr_f32_to_bf16(u2f(bf[k].in)), bf[k].out);
    /* a signalling NaN whose payload sits in the low bits must not truncate to inf */
    uint16_t snan = pr_f32_to_bf16(u2f(0x7f800001u));
    CHECK((snan & 0x7f80) == 0x7f80 && (snan & 0x7f), "sNaN stays NaN: %04x", snan);
    CHECK(f2u(pr_bf16_to_f32(0x3f81)) == 0x3f810000u && pr_bf16_to_f32(0xc000) == -2.0f, "bf16 -> f32");

    struct { uint16_t h; float f; const char *what; } hf[] = {
        {0x0001, 5.9604644775390625e-08f, "smallest subnormal 2^-24"}, {0x0002, 1.1920928955078125e-07f, "2 * 2^-24"},
        {0x03ff, 6.097555160522461e-05f, "largest subnormal"}, {0x0400, 6.103515625e-05f, "smallest normal"},
        {0x3c00, 1.0f, "1"}, {0xc000, -2.0f, "-2"}, {0x7bff, 65504.0f, "max"}, {0x3555, 0.333251953125f, "1/3"},
        {0x8001, -5.9604644775390625e-08f, "negative subnormal"}, {0x0000, 0.0f, "0"}};
    for (size_t k = 0; k < sizeof hf / sizeof hf[0]; k++) {
        CHECK(pr_f16_to_f32(hf[k].h) == hf[k].f, "f16 read %s: got %.9g", hf[k].what, pr_f16_to_f32(hf[k].h));
        CHECK(pr_f32_to_f16(hf[k].f) == hf[k].h, "f16 write %s: got %04x", hf[k].what, pr_f32_to_f16(hf[k].f));
    }
    CHECK(f2u(pr_f16_to_f32(0x8000)) == 0x80000000u, "f16 -0");
    CHECK(isinf(pr_f16_to_f32(0x7c00)) && pr_f16_to_f32(0xfc00) < 0 && isinf(pr_f16_to_f32(0xfc00)), "f16 inf");
    CHECK(isnan(pr_f16_to_f32(0x7e00)) && isnan(pr_f16_to_f32(0x7c01)), "f16 NaN");
    struct { float f; uint16_t h; const char *what; } fh[] = {
        {65519.0f, 0x7bff, "65519 -> max"}, {65520.0f, 0x7c00, "65520 tie -> inf"}, {1e6f, 0x7c00, "overflow"},
        {2.98023223876953125e-08f, 0x0000, "2^-25 tie -> 0"}, {2.9802326e-08f, 0x0001, "just above 2^-25"},
        {8.940696716308594e-08f, 0x0002, "1.5 * 2^-24 tie -> 2"}, {1.4901161193847656e-07f, 0x0002, "2.5 * 2^-24 tie -> 2"},
        {1.00048828125f, 0x3c00, "1+2^-11 tie -> even"}, {1.00146484375f, 0x3c02, "1+3*2^-11 tie -> even"},
        {0.1f, 0x2e66, "0.1"}, {6.1035156e-05f, 0x0400, "2^-14"}, {6.102e-05f, 0x0400, "rounds up into the normals"}};
    for (size_t k = 0; k < sizeof fh / sizeof fh[0]; k++)
        CHECK(pr_f32_to_f16(fh[k].f) == fh[k].h, "f16 %s: got %04x want %04x", fh[k].what, pr_f32_to_f16(fh[k].f), fh[k].h);
    CHECK((pr_f32_to_f16(u2f(0x7f800001u)) & 0x7fff) > 0x7c00, "f16 sNaN stays NaN");
    /* exhaustive: every f16 value reads and writes back to itself (NaNs to a NaN) */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = pr_f16_to_f32((uint16_t)h);
        uint16_t back = pr_f32_to_f16(f);
        if (isnan(f) ? (back & 0x7fff) <= 0x7c00 : back != h) bad++;
    }
    CHECK(bad == 0, "f16 round trip of all 65536 values: %d bad", bad);
    bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = pr_bf16_to_f32((uint16_t)h);
        if (!isnan(f) && pr_f32_to_bf16(f) != h) bad++;
    }
    CHECK(bad == 0, "bf16 round trip of all values: %d bad", bad);
#ifdef PR_DOUBLE
    /* double -> bf16 must round once: 1 + 2^-8 + 2^-30 is above the tie, so it rounds up */
    CHECK(pr__f32bits_to_bf16(pr__real_to_f32bits_odd(1.0 + 1.0 / 256 + 1.0 / 1073741824.0)) == 0x3f81, "no double rounding to bf16");
    CHECK(pr__f32bits_to_bf16(pr__real_to_f32bits_odd(1.0 + 1.0 / 256)) == 0x3f80, "exact tie stays a tie");
    CHECK(pr__f32bits_to_f16(pr__real_to_f32bits_odd(1.0 + 1.0 / 2048 + 1e-12)) == 0x3c01, "no double rounding to f16");
    CHECK(pr__f32bits_to_bf16(pr__real_to_f32bits_odd(1e300)) == 0x7f80, "huge double -> inf");
    CHECK(pr__f32bits_to_bf16(pr__real_to_f32bits_odd(-1e-300)) == 0x8000, "tiny double -> -0");
#endif
}

/* ---------------------------------------------------------------- safetensors round trips */
static void test_roundtrip(void) {
    pr_error err;
    pr_real a[6] = {1, -2, 3.5f, 0.1f, -1e-3f, 65504}, s[1] = {42}, b[4];
    float bv[] = {1.0f, 1.00390625f, 1.01171875f, u2f(0x3f808001u), INFINITY, -INFINITY, NAN, -0.0f, 3.4e38f, 1e-40f};
    enum { NB = sizeof bv / sizeof bv[0] };
    pr_real bf[NB], got[NB], none[1];
    for (int k = 0; k < NB; k++) bf[k] = (pr_real)bv[k];
    for (int k = 0; k < 4; k++) b[k] = (pr_real)(k + 1) / 3;
    pr_st_entry en[] = {
        {"model.embed_tokens.weight", a, 2, {2, 3, 0, 0}}, {"scalar", s, 0, {0, 0, 0, 0}},
        {"empty", NULL, 2, {0, 5, 0, 0}}, {"b", b, 4, {1, 2, 1, 2}}, {"special", bf, 1, {NB, 0, 0, 0}}};
    int n = (int)(sizeof en / sizeof en[0]);
    pr_dtype dts[] = {PR_DT_F32, PR_DT_F64, PR_DT_BF16, PR_DT_F16};
    for (int d = 0; d < 4; d++) {
        char *path = tmp_path(d == 0 ? "rt_f32.safetensors" : d == 1 ? "rt_f64.safetensors" : d == 2 ? "rt_bf16.safetensors" : "rt_f16.safetensors");
        const char *dn = pr__dtype_name(dts[d]);
        pr_status st = pr_safetensors_write(path, en, n, dts[d], "{\"format\": \"pt\", \"note\": \"a \\\"quoted\\\" \\u00e9\"}", &err);
        CHECK(st == PR_OK, "%s write: %s", dn, err.message);
        char tmpname[600];
        snprintf(tmpname, sizeof tmpname, "%s.tmp.%ld", path, pr__io_pid());
        CHECK(!file_exists(tmpname), "%s: no temporary file left", dn);
        size_t fsz;
        unsigned char *raw = slurp(path, &fsz);
        uint64_t hl = raw ? pr__get_u64(raw) : 1;
        CHECK(raw && hl % 8 == 0 && 8 + hl <= fsz && raw[8] == '{', "%s: header length %llu is a multiple of 8", dn, (unsigned long long)hl);
        if (raw) {
            int tail_ok = 1;
            size_t last = 8 + (size_t)hl - 1;
            while (raw[last] == ' ') last--;
            tail_ok = raw[last] == '}';
            CHECK(tail_ok, "%s: header padded with spaces after the closing brace", dn);
            free(raw);
        }
        pr_checkpoint *ck = NULL;
        st = pr_checkpoint_open(&ck, path, &err);
        CHECK(st == PR_OK, "%s open: %s", dn, err.message);
        if (st) continue;
        CHECK(pr_checkpoint_count(ck) == n, "%s count", dn);
        for (int i = 1; i < pr_checkpoint_count(ck); i++)
            CHECK(strcmp(pr_checkpoint_tensor(ck, i - 1)->name, pr_checkpoint_tensor(ck, i)->name) < 0, "sorted by name");
        CHECK(pr_checkpoint_tensor(ck, -1) == NULL && pr_checkpoint_tensor(ck, n) == NULL, "tensor index bounds");
        const pr_st_tensor *t = pr_checkpoint_find(ck, "model.embed_tokens.weight");
        CHECK(t && t->dtype == dts[d] && t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 3 && t->file == 0, "%s find/shape", dn);
        CHECK(pr_checkpoint_find(ck, "nope") == NULL && pr_checkpoint_find(ck, "") == NULL, "find missing");
        pr_real r[6] = {0};
        if (t) CHECK(pr_checkpoint_read(ck, t, r, 6, &err) == PR_OK, "%s read: %s", dn, err.message);
        int same = 1;
        for (int k = 0; k < 6; k++) {
            pr_real want = a[k];
            if (dts[d] == PR_DT_BF16) want = (pr_real)pr_bf16_to_f32(pr_f32_to_bf16((float)a[k]));
            if (dts[d] == PR_DT_F16) want = (pr_real)pr_f16_to_f32(pr_f32_to_f16((float)a[k]));
            if (dts[d] == PR_DT_F32) want = (pr_real)(float)a[k];
            same &= r[k] == want;
        }
        CHECK(same, "%s values round trip", dn);
        t = pr_checkpoint_find(ck, "scalar");
        CHECK(t && t->ndim == 0 && t->end - t->begin == (uint64_t)pr__dtype_size(dts[d]), "%s scalar", dn);
        if (t) CHECK(pr_checkpoint_read(ck, t, r, 1, &err) == PR_OK && r[0] == 42, "%s scalar value", dn);
        t = pr_checkpoint_find(ck, "empty");
        CHECK(t && t->begin == t->end && pr_checkpoint_read(ck, t, none, 0, &err) == PR_OK, "%s empty tensor", dn);
        t = pr_checkpoint_find(ck, "b");
        if (t) CHECK(t->ndim == 4 && pr_checkpoint_read(ck, t, r, 4, &err) == PR_OK && (dts[d] != PR_DT_F64 || r[3] == b[3]), "%s 4-d", dn);
        t = pr_checkpoint_find(ck, "special");
        if (t && pr_checkpoint_read(ck, t, got, NB, &err) == PR_OK) {
            int ok = 1;
            for (int k = 0; k < NB; k++) {
                float want = bv[k];
                if (dts[d] == PR_DT_BF16) want = pr_bf16_to_f32(pr_f32_to_bf16(bv[k]));
                if (dts[d] == PR_DT_F16) want = pr_f16_to_f32(pr_f32_to_f16(bv[k]));
                ok &= isnan(want) ? isnan((double)got[k]) : (double)got[k] == (double)want && !signbit((double)got[k]) == !signbit(want);
            }
            CHECK(ok, "%s special values (ties, inf, NaN, -0, subnormal)", dn);
            if (dts[d] == PR_DT_BF16)
                CHECK(got[0] == 1 && got[1] == 1 && got[2] == 1.015625f && got[3] == 1.0078125f && isinf((double)got[8]) &&
                          isnan((double)got[6]) && got[4] > 0 && isinf((double)got[4]),
                      "bf16 chosen values: ties to even, above-tie rounds up, 3.4e38 -> inf, NaN stays NaN");
        } else CHECK(0, "%s special read: %s", dn, err.message);
        /* caller errors: wrong count, foreign record; dst untouched */
        pr_real guard[6] = {7, 7, 7, 7, 7, 7};
        t = pr_checkpoint_find(ck, "model.embed_tokens.weight");
        EXPECT_FAIL(pr_checkpoint_read(ck, t, guard, 5, &e_), PR_ERR_ARG, "6 elements", "count mismatch");
        pr_st_tensor fake = *t;
        fake.file = 3;
        EXPECT_FAIL(pr_checkpoint_read(ck, &fake, guard, 6, &e_), PR_ERR_ARG, "does not belong", "foreign record");
        fake = *t;
        fake.end += 4;
        EXPECT_FAIL(pr_checkpoint_read(ck, &fake, guard, 6, &e_), PR_ERR_ARG, "inconsistent", "edited record");
        EXPECT_FAIL(pr_checkpoint_read(ck, NULL, guard, 6, &e_), PR_ERR_ARG, "NULL", "NULL record");
        CHECK(guard[0] == 7 && guard[5] == 7, "dst untouched on argument errors");
        pr_checkpoint_close(ck);
    }
    /* the exact bytes of a small file, as Python's safetensors would frame them (header padded) */
    pr_real two[2] = {1, -2};
    pr_st_entry one = {"a", two, 1, {2, 0, 0, 0}};
    char *p = tmp_path("exact.safetensors");
    CHECK(pr_safetensors_write(p, &one, 1, PR_DT_F32, NULL, &err) == PR_OK, "exact write");
    size_t fsz;
    unsigned char *raw = slurp(p, &fsz);
    const char *hdr = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}   "; /* 53 + 3 spaces */
    unsigned char want[8 + 56 + 8] = {56, 0, 0, 0, 0, 0, 0, 0};
    memcpy(want + 8, hdr, 56);
    memcpy(want + 64, "\x00\x00\x80\x3f\x00\x00\x00\xc0", 8);
    CHECK(raw && fsz == sizeof want && memcmp(raw, want, sizeof want) == 0, "exact bytes of a one-tensor file");
    free(raw);
    /* an empty checkpoint is valid */
    p = tmp_path("empty.safetensors");
    pr_checkpoint *ck;
    CHECK(pr_safetensors_write(p, NULL, 0, PR_DT_F32, "{}", &err) == PR_OK, "write no tensors");
    CHECK(OK(pr_checkpoint_open(&ck, p, &err)) && pr_checkpoint_count(ck) == 0, "open no tensors: %s", err.message);
    if (!g_st) pr_checkpoint_close(ck);
    pr_checkpoint_close(NULL);
}

/* A tensor past 4 GiB in a sparse file: offsets must be 64-bit all the way. */
static void test_large_offset(void) {
    pr_error err;
    char *p = tmp_path("big.safetensors");
    const uint64_t big = (uint64_t)1200000000 * 4; /* 4.8 GB of F32 zeros (a hole) */
    char hdr[200];
    snprintf(hdr, sizeof hdr, "{\"big\":{\"dtype\":\"F32\",\"shape\":[1200000000],\"data_offsets\":[0,%llu]},"
             "\"tail\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[%llu,%llu]}}",
             (unsigned long long)big, (unsigned long long)big, (unsigned long long)big + 8);
    size_t hl = strlen(hdr);
    unsigned char len8[8], tail[8];
    pr__put_u64(len8, hl);
    pr__put_u32(tail, f2u(3.0f));
    pr__put_u32(tail + 4, f2u(-4.0f));
    FILE *f = fopen(p, "wb");
    int ok = f && fwrite(len8, 1, 8, f) == 8 && fwrite(hdr, 1, hl, f) == hl && pr__io_seek(f, 8 + hl + big) && fwrite(tail, 1, 8, f) == 8;
    if (f && fclose(f) != 0) ok = 0;
    if (!ok) {
        printf("note: cannot make a sparse 4.8 GB file here; large-offset test skipped\n");
        remove(p);
        return;
    }
    pr_checkpoint *ck;
    CHECK(OK(pr_checkpoint_open(&ck, p, &err)), "open big: %s", err.message);
    if (g_st) { remove(p); return; }
    const pr_st_tensor *t = pr_checkpoint_find(ck, "tail");
    pr_real r[2] = {0, 0};
    CHECK(t && t->begin == big && pr_checkpoint_read(ck, t, r, 2, &err) == PR_OK && r[0] == 3 && r[1] == -4,
          "tensor past 4 GiB reads back: %s", err.message);
    pr_checkpoint_close(ck);
    remove(p);
}

/* ---------------------------------------------------------------- sharded checkpoints */
/* Which save the checkpoint in dir holds: 0 when it does not open, 1 or 2 when every tensor holds
   data[i][k] + that number's offset (0 and 1000), -1 for anything else (a mix of the two). */
static int checkpoint_holds(const char *dir, const char (*names)[32], const pr_real (*data)[40], const int *sizes, int nt) {
    pr_checkpoint *ck;
    pr_error err;
    if (pr_checkpoint_open(&ck, dir, &err)) return 0;
    int which = pr_checkpoint_count(ck) == nt ? -2 : -1;     /* -2: not yet known */
    for (int i = 0; i < nt && which != -1; i++) {
        const pr_st_tensor *t = pr_checkpoint_find(ck, names[i]);
        pr_real r[40];
        if (!t || pr_checkpoint_read(ck, t, r, (size_t)sizes[i], &err)) { which = -1; break; }
        for (int k = 0; k < sizes[i] && which != -1; k++) {
            const int w = r[k] == data[i][k] ? 1 : r[k] == data[i][k] + 1000 ? 2 : -1;
            which = which == -2 || which == w ? w : -1;
        }
    }
    pr_checkpoint_close(ck);
    return which;
}

/* Checks that dir holds none of the shards model-0000s-of-0000N.safetensors. */
static void check_no_shards(const char *dir, int of, const char *what) {
    for (int s = 1; s <= of; s++) {
        char q[600];
        snprintf(q, sizeof q, "%s/model-%05d-of-%05d.safetensors", dir, s, of);
        CHECK(!file_exists(q), "%s: shard %d of %d removed", what, s, of);
    }
}
/* Adds d to every value of the test's tensors (1000: the second save's values, checkpoint_holds' 2). */
static void add_to_values(pr_real (*data)[40], int nt, pr_real d) {
    for (int i = 0; i < nt; i++)
        for (int k = 0; k < 40; k++) data[i][k] += d;
}

static void test_sharded(void) {
    pr_error err;
    enum { NT = 7 };
    static pr_real data[NT][40];
    char names[NT][32];
    pr_st_entry en[NT];
    int sizes[NT] = {10, 10, 10, 40, 5, 5, 1}; /* F32 bytes: 40 40 40 160 20 20 4; limit 100 */
    for (int i = 0; i < NT; i++) {
        snprintf(names[i], sizeof names[i], "model.layers.%d.w", NT - i); /* not in sorted order */
        for (int k = 0; k < 40; k++) data[i][k] = (pr_real)(i * 100 + k);
        en[i].name = names[i];
        en[i].data = data[i];
        en[i].ndim = 1;
        en[i].shape[0] = sizes[i];
    }
    /* the folder asked for is created, the folders above it never */
    char nested[512], p[600];
    snprintf(nested, sizeof nested, "%s", tmp_path("ck_parent/dir"));
    EXPECT_FAIL(pr_checkpoint_save(nested, en, NT, PR_DT_F32, 100, &e_), PR_ERR_IO, "does not exist", "missing parent refused");
    CHECK(!file_exists(tmp_path("ck_parent")), "no parent folder created");
    char *dir = tmp_path("ck_dir");
    char dirc[512];
    snprintf(dirc, sizeof dirc, "%s", dir);
    pr_status st = pr_checkpoint_save(dirc, en, NT, PR_DT_F32, 100, &err);
    CHECK(st == PR_OK, "sharded save: %s", err.message);
    /* greedy in entry order: [40 40] [40] [160] [20 20 4] -> 4 shards */
    for (int s = 1; s <= 4; s++) {
        snprintf(p, sizeof p, "%s/model-%05d-of-00004.safetensors", dirc, s);
        CHECK(file_exists(p), "shard %d exists", s);
    }
    snprintf(p, sizeof p, "%s/model.safetensors", dirc);
    CHECK(!file_exists(p), "no single file next to shards");
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dirc);
    size_t n;
    char *ix = (char *)slurp(p, &n);
    pr__json *j = NULL;
    CHECK(ix && pr__json_parse(&j, ix, n, p, 0, &err) == PR_OK, "index parses");
    if (j) {
        int64_t total = 0;
        const pr__json *wm = pr__json_get(j, "weight_map");
        CHECK(pr__json_int(pr__json_get(pr__json_get(j, "metadata"), "total_size"), &total) && total == 324, "total_size %lld", (long long)total);
        CHECK(wm && wm->count == NT, "weight_map has every tensor");
        const pr__json *w4 = pr__json_get(wm, "model.layers.4.w");
        CHECK(w4 && strcmp(w4->str, "model-00003-of-00004.safetensors") == 0, "the big tensor has its own shard");
        PR_FREE(j);
    }
    free(ix);
    const char *how[2] = {dirc, p};
    for (int w = 0; w < 2; w++) { /* through the folder and through the index path */
        pr_checkpoint *ck;
        st = pr_checkpoint_open(&ck, how[w], &err);
        CHECK(st == PR_OK, "open sharded via %s: %s", how[w], err.message);
        if (st) continue;
        CHECK(pr_checkpoint_count(ck) == NT, "all tensors indexed");
        int ok = 1, files = 0;
        for (int i = 0; i < NT; i++) {
            const pr_st_tensor *t = pr_checkpoint_find(ck, names[i]);
            pr_real r[40];
            ok &= t && pr_checkpoint_read(ck, t, r, (size_t)sizes[i], &err) == PR_OK && r[0] == data[i][0] && r[sizes[i] - 1] == data[i][sizes[i] - 1];
            if (t && t->file + 1 > files) files = t->file + 1;
        }
        CHECK(ok && files == 4, "every tensor reads back from its shard");
        pr_checkpoint_close(ck);
    }
    /* saving unsharded into the same folder removes the stale index and the shards it named, and
       the other way round */
    CHECK(pr_checkpoint_save(dirc, en, NT, PR_DT_BF16, 0, &err) == PR_OK, "single save: %s", err.message);
    CHECK(!file_exists(p), "stale index removed");
    check_no_shards(dirc, 4, "stale after a save in one file");
    pr_checkpoint *ck;
    CHECK(OK(pr_checkpoint_open(&ck, dirc, &err)) && pr_checkpoint_count(ck) == NT && ck->n_files == 1, "single file opens");
    if (!g_st) pr_checkpoint_close(ck);
    CHECK(pr_checkpoint_save(dirc, en, NT, PR_DT_F32, 200, &err) == PR_OK && file_exists(p), "re-shard");
    snprintf(p, sizeof p, "%s/model.safetensors", dirc);
    CHECK(!file_exists(p), "stale single file removed");
    CHECK(OK(pr_checkpoint_open(&ck, dirc, &err)) && ck->n_files == 3, "3 shards at limit 200: %s", err.message);
    if (!g_st) pr_checkpoint_close(ck);

    /* A save interrupted while it puts its files in place (here its third rename refused) never
       leaves a loadable mix of two checkpoints. Over 3 shards, the 4 new ones replace none of them
       by name: the previous checkpoint stays whole, and the new shards placed are not left behind. */
    add_to_values(data, NT, 1000);
    g_renames_left = 2;
    EXPECT_FAIL(pr_checkpoint_save(dirc, en, NT, PR_DT_F32, 100, &e_), PR_ERR_IO, "cannot rename", "third rename refused");
    g_renames_left = -1;
    add_to_values(data, NT, -1000);
    CHECK(checkpoint_holds(dirc, names, data, sizes, NT) == 1, "an interrupted 4-shard save leaves the 3-shard one whole");
    check_no_shards(dirc, 4, "the interrupted save's");
    /* over 4 shards, the new ones replace the previous by name: the folder keeps no index, so no mix loads */
    CHECK(pr_checkpoint_save(dirc, en, NT, PR_DT_F32, 100, &err) == PR_OK, "4 shards again: %s", err.message);
    check_no_shards(dirc, 3, "stale after a save in 4");
    CHECK(checkpoint_holds(dirc, names, data, sizes, NT) == 1, "the 4-shard save reads back");
    add_to_values(data, NT, 1000);
    g_renames_left = 2;
    EXPECT_FAIL(pr_checkpoint_save(dirc, en, NT, PR_DT_F32, 100, &e_), PR_ERR_IO, "cannot rename", "third rename refused");
    g_renames_left = -1;
    CHECK(checkpoint_holds(dirc, names, data, sizes, NT) == 0, "an interrupted save over its own shard names loads nothing");
    /* the two shards it placed are removed; the third, whose rename was refused, is the previous
       save's file, and stays */
    for (int s = 1; s <= 4; s++) {
        snprintf(p, sizeof p, "%s/model-%05d-of-00004.safetensors", dirc, s);
        CHECK(file_exists(p) == (s > 2), "after the refused third rename, shard %d %s", s, s > 2 ? "the previous save's, kept" : "removed");
    }
    st = pr_checkpoint_save(dirc, en, NT, PR_DT_F32, 100, &err);
    add_to_values(data, NT, -1000);
    CHECK(st == PR_OK && checkpoint_holds(dirc, names, data, sizes, NT) == 2, "saved again whole: %s", st ? err.message : "");

    /* save errors: nothing written */
    pr_st_entry dup[2] = {en[0], en[0]};
    char *d2 = tmp_path("ck_dup");
    EXPECT_FAIL(pr_checkpoint_save(d2, dup, 2, PR_DT_F32, 0, &e_), PR_ERR_ARG, "duplicate tensor name", "duplicate entries");
    snprintf(p, sizeof p, "%s/model.safetensors", d2);
    CHECK(!file_exists(p), "no file after a refused save");
    char *file_not_dir = tmp_path("plainfile");
    write_bytes(file_not_dir, "x", 1);
    EXPECT_FAIL(pr_checkpoint_save(file_not_dir, en, NT, PR_DT_F32, 0, &e_), PR_ERR_IO, "not a folder", "folder is a file");
    EXPECT_FAIL(pr_checkpoint_save(d2, en, NT, (pr_dtype)9, 0, &e_), PR_ERR_ARG, "dtype", "bad dtype");
}

/* ---------------------------------------------------------------- malformed safetensors */
static void test_malformed(void) {
    unsigned char zeros[64] = {0};
    char *p = tmp_path("bad.safetensors");
    struct { const char *hdr; size_t ndata; pr_status want; const char *needle; } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, PR_ERR_FORMAT, "run past"},      /* offsets out of range */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, PR_ERR_FORMAT, "need 12 bytes"},  /* wrong byte count */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, PR_ERR_FORMAT, "begin <= end"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,9]}}", 8, PR_ERR_FORMAT, "[begin, end]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}}", 8, PR_ERR_FORMAT, "begin <= end"},
        {"{\"a\":{\"dtype\":\"F13\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, PR_ERR_FORMAT, "unknown dtype \"F13\""},
        {"{\"a\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, PR_ERR_UNSUPPORTED, "dtype I64"},
        {"{\"a\":{\"dtype\":3,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, PR_ERR_FORMAT, "\"dtype\" must be a string"},
        {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, PR_ERR_FORMAT, "dtype"},
        {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, PR_ERR_FORMAT, "shape"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, PR_ERR_FORMAT, ">= 0"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 8, PR_ERR_FORMAT, ">= 0"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,8]}}", 8, PR_ERR_FORMAT, "overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", 8, PR_ERR_UNSUPPORTED, "9 dimensions"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, PR_ERR_FORMAT, "duplicate tensor name a"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, PR_ERR_FORMAT, "overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, PR_ERR_FORMAT, "4 unused bytes before tensor a"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, PR_ERR_FORMAT, "4 bytes of data after"},
        {"{\"__metadata__\":{\"x\":1}}", 0, PR_ERR_FORMAT, "__metadata__ values must be strings"},
        {"{\"__metadata__\":[]}", 0, PR_ERR_FORMAT, "__metadata__ must be an object"},
        {"{\"a\":[1]}", 0, PR_ERR_FORMAT, "not an object"},
        {"{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0, PR_ERR_FORMAT, "NUL"},
        {"[]", 0, PR_ERR_FORMAT, "not a JSON object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, PR_ERR_FORMAT, "bad JSON at byte 61"}, /* unclosed: 8 + 53 */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],}}", 8, PR_ERR_FORMAT, "bad JSON"},
        {"{} x", 0, PR_ERR_FORMAT, "text after"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        make_st(p, cases[k].hdr, zeros, cases[k].ndata);
        pr_checkpoint *ck = (pr_checkpoint *)zeros; /* sentinel: must not be written */
        EXPECT_FAIL(pr_checkpoint_open(&ck, p, &e_), cases[k].want, cases[k].needle, cases[k].hdr);
        CHECK(ck == (pr_checkpoint *)zeros, "output untouched (%s)", cases[k].hdr);
    }
    /* a 256-byte name does not fit pr_st_tensor */
    char longhdr[512];
    char name[300];
    memset(name, 'n', 256);
    name[256] = 0;
    snprintf(longhdr, sizeof longhdr, "{\"%s\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", name);
    make_st(p, longhdr, zeros, 0);
    pr_checkpoint *ck;
    EXPECT_FAIL(pr_checkpoint_open(&ck, p, &e_), PR_ERR_UNSUPPORTED, "longer than 255", "long name");
    name[255] = 0; /* 255 bytes is fine */
    snprintf(longhdr, sizeof longhdr, "{\"%s\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", name);
    make_st(p, longhdr, zeros, 0);
    pr_error err;
    CHECK(OK(pr_checkpoint_open(&ck, p, &err)) && pr_checkpoint_find(ck, name), "255-byte name: %s", err.message);
    if (!g_st) pr_checkpoint_close(ck);

    /* framing errors */
    write_bytes(p, "\x10\x00\x00", 3);
    EXPECT_FAIL(pr_checkpoint_open(&ck, p, &e_), PR_ERR_FORMAT, "too short", "truncated to 3 bytes");
    unsigned char frame[16] = {0xff, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    write_bytes(p, frame, 10);
    EXPECT_FAIL(pr_checkpoint_open(&ck, p, &e_), PR_ERR_FORMAT, "runs past the end", "header length past EOF");
    memset(frame, 0xff, 8);
    write_bytes(p, frame, 10);
    EXPECT_FAIL(pr_checkpoint_open(&ck, p, &e_), PR_ERR_FORMAT, "runs past the end", "header length 2^64-1");
    memset(frame, 0, 8);
    write_bytes(p, frame, 8);
    EXPECT_FAIL(pr_checkpoint_open(&ck, p, &e_), PR_ERR_FORMAT, "too short for a JSON object", "header length 0");
    /* a header claiming more than 100 MB, in a file that really is that long (sparse) */
    {
        FILE *f = fopen(p, "wb");
        unsigned char l8[8];
        pr__put_u64(l8, 100000001u);
        int ok = f && fwrite(l8, 1, 8, f) == 8 && pr__io_seek(f, 100000100u) && fwrite("x", 1, 1, f) == 1;
        if (f) fclose(f);
        if (ok) EXPECT_FAIL(pr_checkpoint_open(&ck, p, &e_), PR_ERR_FORMAT, "100 MB", "header over 100 MB");
    }
    /* a file truncated after a valid header: the data is shorter than the offsets claim */
    const char *good = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    make_st(p, good, zeros, 8);
    size_t n;
    unsigned char *whole = slurp(p, &n);
    write_bytes(p, whole, n - 3);
    EXPECT_FAIL(pr_checkpoint_open(&ck, p, &e_), PR_ERR_FORMAT, "run past", "truncated data");
    write_bytes(p, whole, 20);
    EXPECT_FAIL(pr_checkpoint_open(&ck, p, &e_), PR_ERR_FORMAT, "runs past the end", "truncated header");
    /* the file shrinks between open and read: an error, and dst untouched */
    write_bytes(p, whole, n);
    CHECK(OK(pr_checkpoint_open(&ck, p, &err)), "open before truncation");
    if (!g_st) {
        write_bytes(p, whole, n - 4);
        pr_real dst[2] = {5, 5};
        EXPECT_FAIL(pr_checkpoint_read(ck, pr_checkpoint_find(ck, "a"), dst, 2, &e_), PR_ERR_FORMAT, "shrank", "file shrank");
        CHECK(dst[0] == 5 && dst[1] == 5, "dst untouched when the file shrank");
        remove(p);
        EXPECT_FAIL(pr_checkpoint_read(ck, pr_checkpoint_find(ck, "a"), dst, 2, &e_), PR_ERR_IO, "bad.safetensors", "file removed");
        pr_checkpoint_close(ck);
    }
    free(whole);
    EXPECT_FAIL(pr_checkpoint_open(&ck, tmp_path("does-not-exist.safetensors"), &e_), PR_ERR_IO, "does-not-exist", "missing file");
    char *empty_dir = tmp_path("emptydir");
    pr__mkdir_one(empty_dir, NULL);
    EXPECT_FAIL(pr_checkpoint_open(&ck, empty_dir, &e_), PR_ERR_IO, "neither model.safetensors", "folder without checkpoint");
    EXPECT_FAIL(pr_checkpoint_open(NULL, p, &e_), PR_ERR_ARG, "NULL", "NULL out");
}

/* Index files pointing at shards that are missing, wrong or hostile. */
static void test_bad_index(void) {
    char *dir = tmp_path("badix");
    char ip[600], sp[600], sp2[600];
    pr__mkdir_one(dir, NULL);
    snprintf(ip, sizeof ip, "%s/model.safetensors.index.json", dir);
    snprintf(sp, sizeof sp, "%s/s1.safetensors", dir);
    snprintf(sp2, sizeof sp2, "%s/s2.safetensors", dir);
    unsigned char zeros[16] = {0};
    make_st(sp, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", zeros, 8);
    make_st(sp2, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", zeros, 8);
    struct { const char *ix; pr_status want; const char *needle; } cases[] = {
        {"{\"weight_map\":{\"a\":\"s1.safetensors\",\"c\":\"missing.safetensors\"}}", PR_ERR_IO, "missing.safetensors", },
        {"{\"weight_map\":{\"a\":\"s1.safetensors\",\"b\":\"s2.safetensors\"}}", PR_ERR_FORMAT, "tensor a is in both"},
        {"{\"weight_map\":{\"a\":\"s1.safetensors\",\"zz\":\"s1.safetensors\"}}", PR_ERR_FORMAT, "puts zz in s1.safetensors"},
        {"{\"weight_map\":{\"a\":\"../s1.safetensors\"}}", PR_ERR_FORMAT, "same folder"},
        {"{\"weight_map\":{\"a\":\"/etc/passwd\"}}", PR_ERR_FORMAT, "same folder"},
        {"{\"weight_map\":{\"a\":7}}", PR_ERR_FORMAT, "same folder"},
        {"{\"weight_map\":{}}", PR_ERR_FORMAT, "non-empty"},
        {"{\"metadata\":{}}", PR_ERR_FORMAT, "weight_map"},
        {"{\"weight_map\":{\"a\":\"s1.safetensors\"", PR_ERR_FORMAT, "bad JSON"},
        {"[]", PR_ERR_FORMAT, "weight_map"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        write_bytes(ip, cases[k].ix, strlen(cases[k].ix));
        pr_checkpoint *ck = NULL;
        EXPECT_FAIL(pr_checkpoint_open(&ck, dir, &e_), cases[k].want, cases[k].needle, cases[k].ix);
        CHECK(ck == NULL, "no checkpoint on failure");
    }
    /* a good index with a tensor the map does not list: accepted, like transformers */
    const char *ok = "{\"metadata\":{\"total_size\":16},\"weight_map\":{\"a\":\"s1.safetensors\"}}";
    write_bytes(ip, ok, strlen(ok));
    pr_error err;
    pr_checkpoint *ck;
    CHECK(OK(pr_checkpoint_open(&ck, dir, &err)) && pr_checkpoint_count(ck) == 1, "index ok: %s", err.message);
    if (!g_st) pr_checkpoint_close(ck);
}

/* ---------------------------------------------------------------- writer argument errors */
static void test_write_errors(void) {
    pr_real d[4] = {1, 2, 3, 4};
    char *p = tmp_path("w.safetensors");
    pr_st_entry ok = {"x", d, 1, {4, 0, 0, 0}};
    struct { pr_st_entry e; const char *needle; } bad[] = {
        {{NULL, d, 1, {4, 0, 0, 0}}, "name"}, {{"", d, 1, {4, 0, 0, 0}}, "name"}, {{"__metadata__", d, 1, {4, 0, 0, 0}}, "name"},
        {{"x", d, 5, {4, 0, 0, 0}}, "ndim 5"}, {{"x", d, -1, {4, 0, 0, 0}}, "ndim -1"}, {{"x", d, 1, {-4, 0, 0, 0}}, "negative"},
        {{"x", NULL, 1, {4, 0, 0, 0}}, "no data"}, {{"x", d, 4, {INT64_MAX, INT64_MAX, 2, 2}}, "overflowing"}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        EXPECT_FAIL(pr_safetensors_write(p, &bad[k].e, 1, PR_DT_F32, NULL, &e_), PR_ERR_ARG, bad[k].needle, bad[k].needle);
        CHECK(!file_exists(p), "nothing written (%s)", bad[k].needle);
    }
    const char *metas[] = {"[]", "{\"a\":1}", "{\"a\":", "\"s\"", "{\"a\":{}}"};
    for (size_t k = 0; k < sizeof metas / sizeof metas[0]; k++) {
        EXPECT_FAIL(pr_safetensors_write(p, &ok, 1, PR_DT_F32, metas[k], &e_), PR_ERR_ARG, NULL, metas[k]);
        CHECK(!file_exists(p), "nothing written (meta %s)", metas[k]);
    }
    EXPECT_FAIL(pr_safetensors_write(p, &ok, -1, PR_DT_F32, NULL, &e_), PR_ERR_ARG, "n = -1", "negative n");
    EXPECT_FAIL(pr_safetensors_write(p, &ok, 1, PR_DT_F32 + 17, NULL, &e_), PR_ERR_ARG, "dtype", "bad dtype");
    EXPECT_FAIL(pr_safetensors_write(NULL, &ok, 1, PR_DT_F32, NULL, &e_), PR_ERR_ARG, "NULL", "NULL path");
    char *nodir = tmp_path("no/such/dir/w.safetensors");
    EXPECT_FAIL(pr_safetensors_write(nodir, &ok, 1, PR_DT_F32, NULL, &e_), PR_ERR_IO, "no/such/dir", "missing folder");
    /* names that need escaping survive the round trip */
    pr_st_entry odd = {"we\"ird\\name\n\x01/\xc3\xa9", d, 1, {4, 0, 0, 0}};
    pr_error err;
    pr_checkpoint *ck;
    CHECK(pr_safetensors_write(p, &odd, 1, PR_DT_F32, NULL, &err) == PR_OK, "escaped name write");
    CHECK(OK(pr_checkpoint_open(&ck, p, &err)) && pr_checkpoint_find(ck, odd.name), "escaped name reads back: %s", err.message);
    if (!g_st) pr_checkpoint_close(ck);
    /* a NULL error pointer is allowed everywhere */
    CHECK(pr_safetensors_write(p, &bad[0].e, 1, PR_DT_F32, NULL, NULL) == PR_ERR_ARG, "NULL err ok");
    CHECK(pr_checkpoint_open(&ck, tmp_path("nope"), NULL) == PR_ERR_IO, "NULL err ok (open)");
}

/* ---------------------------------------------------------------- configs */
static int cfg_equal(const pr_config *a, const pr_config *b) {
    return strcmp(a->model_type, b->model_type) == 0 && a->vocab_size == b->vocab_size && a->hidden_size == b->hidden_size &&
           a->intermediate_size == b->intermediate_size && a->num_hidden_layers == b->num_hidden_layers &&
           a->num_attention_heads == b->num_attention_heads && a->num_key_value_heads == b->num_key_value_heads &&
           a->head_dim == b->head_dim && a->max_position_embeddings == b->max_position_embeddings &&
           a->rms_norm_eps == b->rms_norm_eps && a->rope_theta == b->rope_theta && a->rope_llama3 == b->rope_llama3 &&
           a->rope_factor == b->rope_factor && a->rope_low_freq_factor == b->rope_low_freq_factor &&
           a->rope_high_freq_factor == b->rope_high_freq_factor && a->rope_original_max_position == b->rope_original_max_position &&
           a->tie_word_embeddings == b->tie_word_embeddings && a->qk_norm == b->qk_norm;
}

static void check_save_roundtrip(const pr_config *c, const char *what) {
    pr_error err;
    pr_config back;
    char *p = tmp_path("cfg_rt.json");
    CHECK(pr_config_save(c, p, &err) == PR_OK, "%s save: %s", what, err.message);
    CHECK(pr_config_load(&back, p, &err) == PR_OK, "%s reload: %s", what, err.message);
    CHECK(cfg_equal(c, &back), "%s: saved config reads back to the same struct", what);
}

static void test_config(void) {
    pr_error err;
    pr_config c, d;
    char p[600];
    snprintf(p, sizeof p, "%s/llama3-8b", g_models);
    CHECK(OK(pr_config_load(&c, p, &err)), "llama3-8b: %s", err.message);
    if (!g_st) {
        CHECK(strcmp(c.model_type, "llama") == 0 && c.vocab_size == 128256 && c.hidden_size == 4096 && c.intermediate_size == 14336 &&
                  c.num_hidden_layers == 32 && c.num_attention_heads == 32 && c.num_key_value_heads == 8 && c.head_dim == 128 &&
                  c.max_position_embeddings == 131072 && c.rms_norm_eps == 1e-5 && c.rope_theta == 500000.0 && c.rope_llama3 == 1 &&
                  c.rope_factor == 8.0 && c.rope_low_freq_factor == 1.0 && c.rope_high_freq_factor == 4.0 &&
                  c.rope_original_max_position == 8192 && c.tie_word_embeddings == 0 && c.qk_norm == 0,
              "llama3-8b fields");
        check_save_roundtrip(&c, "llama3-8b");
    }
    snprintf(p, sizeof p, "%s/qwen3-8b/config.json", g_models); /* a file path works too */
    CHECK(OK(pr_config_load(&c, p, &err)), "qwen3-8b: %s", err.message);
    if (!g_st) {
        CHECK(strcmp(c.model_type, "qwen3") == 0 && c.vocab_size == 151936 && c.hidden_size == 4096 && c.intermediate_size == 12288 &&
                  c.num_hidden_layers == 36 && c.num_attention_heads == 32 && c.num_key_value_heads == 8 && c.head_dim == 128 &&
                  c.max_position_embeddings == 40960 && c.rms_norm_eps == 1e-6 && c.rope_theta == 1000000.0 && c.rope_llama3 == 0 &&
                  c.tie_word_embeddings == 0 && c.qk_norm == 1,
              "qwen3-8b fields");
        check_save_roundtrip(&c, "qwen3-8b");
    }
    const char *tiny[] = {"tiny", "tiny-qwen3"};
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof p, "%s/%s", g_models, tiny[k]);
        CHECK(OK(pr_config_load(&c, p, &err)), "%s: %s", tiny[k], err.message);
        if (!g_st) check_save_roundtrip(&c, tiny[k]);
    }
    snprintf(p, sizeof p, "%s/tiny-qwen3", g_models);
    if (pr_config_load(&c, p, &err) == PR_OK) CHECK(c.tie_word_embeddings == 1 && c.head_dim == 32 && c.num_key_value_heads == 1, "tiny-qwen3 fields");

    /* defaults (transformers' own) from a minimal config */
    const char *minimal = "{\"model_type\":\"llama\",\"vocab_size\":100,\"hidden_size\":64,\"intermediate_size\":128,"
                          "\"num_hidden_layers\":2,\"num_attention_heads\":4}";
    CHECK(pr_config_parse(&c, minimal, strlen(minimal), &err) == PR_OK, "minimal: %s", err.message);
    CHECK(c.head_dim == 16 && c.num_key_value_heads == 4 && c.max_position_embeddings == 2048 && c.rms_norm_eps == 1e-6 &&
              c.rope_theta == 10000.0 && c.tie_word_embeddings == 0 && c.rope_llama3 == 0 && c.qk_norm == 0,
          "llama defaults");
    check_save_roundtrip(&c, "minimal llama");
    const char *minq = "{\"model_type\":\"qwen3\",\"vocab_size\":100,\"hidden_size\":64,\"intermediate_size\":128,"
                       "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":null,\"head_dim\":null}";
    CHECK(pr_config_parse(&c, minq, strlen(minq), &err) == PR_OK && c.head_dim == 128 && c.max_position_embeddings == 32768 &&
              c.num_key_value_heads == 4 && c.qk_norm == 1, "qwen3 defaults: %s", err.message);
    /* spellings: older "type", transformers 5 rope_parameters, "default" rope, float-written integers */
    const char *older = "{\"model_type\":\"llama\",\"vocab_size\":100,\"hidden_size\":64,\"intermediate_size\":128.0,"
                        "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"rope_scaling\":{\"type\":\"llama3\",\"factor\":2,"
                        "\"low_freq_factor\":1,\"high_freq_factor\":4,\"original_max_position_embeddings\":512}}";
    CHECK(pr_config_parse(&c, older, strlen(older), &err) == PR_OK && c.rope_llama3 && c.rope_factor == 2 && c.intermediate_size == 128,
          "rope_scaling.type: %s", err.message);
    const char *v5 = "{\"model_type\":\"llama\",\"vocab_size\":100,\"hidden_size\":64,\"intermediate_size\":128,"
                     "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"rope_parameters\":{\"rope_type\":\"llama3\","
                     "\"rope_theta\":500000.0,\"factor\":8.0,\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,"
                     "\"original_max_position_embeddings\":8192}}";
    CHECK(pr_config_parse(&c, v5, strlen(v5), &err) == PR_OK && c.rope_llama3 && c.rope_theta == 500000.0 &&
              c.rope_original_max_position == 8192, "rope_parameters: %s", err.message);
    const char *dflt = "{\"model_type\":\"qwen3\",\"vocab_size\":100,\"hidden_size\":64,\"intermediate_size\":128,"
                       "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":1e6}}";
    CHECK(pr_config_parse(&c, dflt, strlen(dflt), &err) == PR_OK && !c.rope_llama3 && c.rope_theta == 1e6, "default rope: %s", err.message);

    /* malformed configs: each gives its own code, names the field, and leaves the output alone */
#define BASE "\"vocab_size\":100,\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2"
    struct { const char *json; pr_status want; const char *needle; } bad[] = {
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"num_key_value_heads\":3}", PR_ERR_CONFIG, "not a multiple of num_key_value_heads 3"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}}", PR_ERR_UNSUPPORTED, "\"yarn\""},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,\"high_freq_factor\":4,\"original_max_position_embeddings\":8}}", PR_ERR_CONFIG, "low_freq_factor"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":4,\"high_freq_factor\":4,\"original_max_position_embeddings\":8}}", PR_ERR_CONFIG, "high_freq_factor > low_freq_factor"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":0.5,\"low_freq_factor\":1,\"high_freq_factor\":4,\"original_max_position_embeddings\":8}}", PR_ERR_CONFIG, "factor"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"rope_scaling\":{\"factor\":8}}", PR_ERR_CONFIG, "no rope_type"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"rope_scaling\":\"llama3\"}", PR_ERR_CONFIG, "rope_scaling must be an object"},
        {"{\"model_type\":\"mistral\"," BASE ",\"num_attention_heads\":4}", PR_ERR_UNSUPPORTED, "\"mistral\""},
        {"{" BASE ",\"num_attention_heads\":4}", PR_ERR_CONFIG, "model_type"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"hidden_act\":\"gelu\"}", PR_ERR_UNSUPPORTED, "gelu"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"attention_bias\":true}", PR_ERR_UNSUPPORTED, "attention_bias"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"mlp_bias\":true}", PR_ERR_UNSUPPORTED, "mlp_bias"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"mlp_bias\":0}", PR_ERR_CONFIG, "true or false"},
        {"{\"model_type\":\"qwen3\"," BASE ",\"num_attention_heads\":4,\"use_sliding_window\":true}", PR_ERR_UNSUPPORTED, "use_sliding_window"},
        {"{\"model_type\":\"qwen3\"," BASE ",\"num_attention_heads\":4,\"layer_types\":[\"full_attention\",\"sliding_attention\"]}", PR_ERR_UNSUPPORTED, "layer_types[1]"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"attention_dropout\":0.1}", PR_ERR_UNSUPPORTED, "attention_dropout"},
        {"{\"model_type\":\"llama\",\"vocab_size\":\"100\",\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":4}", PR_ERR_CONFIG, "vocab_size\" must be an integer, not a string"},
        {"{\"model_type\":\"llama\",\"vocab_size\":100.5,\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":4}", PR_ERR_CONFIG, "vocab_size"},
        {"{\"model_type\":\"llama\",\"vocab_size\":1e12,\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":4}", PR_ERR_CONFIG, "vocab_size"},
        {"{\"model_type\":\"llama\",\"vocab_size\":-1,\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":4}", PR_ERR_CONFIG, "vocab_size = -1 must be positive"},
        {"{\"model_type\":\"llama\"," BASE "}", PR_ERR_CONFIG, "num_attention_heads\" is missing"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":0}", PR_ERR_CONFIG, "num_attention_heads = 0"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":5}", PR_ERR_CONFIG, "no head_dim"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"head_dim\":15}", PR_ERR_CONFIG, "head_dim 15 must be even"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"rms_norm_eps\":0}", PR_ERR_CONFIG, "rms_norm_eps"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"rope_theta\":-1}", PR_ERR_CONFIG, "rope_theta"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"rope_theta\":1e999}", PR_ERR_CONFIG, "rope_theta"},
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,\"max_position_embeddings\":0}", PR_ERR_CONFIG, "max_position_embeddings"},
        {"{\"model_type\":\"llama\",\"vocab_size\":2000000000,\"hidden_size\":2000000000,\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":2}", PR_ERR_CONFIG, "vocab_size = 2000000000 is larger than the limit 16777216"},
        {"{\"model_type\":\"llama\",\"vocab_size\":100,\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2000000000,\"num_attention_heads\":2,\"head_dim\":2000000000}", PR_ERR_CONFIG, "num_hidden_layers = 2000000000 is larger than the limit 1024"},
        /* sizes the config implies, refused before anything is sized: each names the field, its value and the limit */
#define SIZES(v, h, f, l, nh, more) "{\"model_type\":\"llama\",\"vocab_size\":" #v ",\"hidden_size\":" #h ",\"intermediate_size\":" #f \
                                    ",\"num_hidden_layers\":" #l ",\"num_attention_heads\":" #nh more "}"
        {SIZES(100, 64, 128, 100000000, 4, ""), PR_ERR_CONFIG, "num_hidden_layers = 100000000 is larger than the limit 1024"},
        {SIZES(100, 64, 128, 1025, 4, ""), PR_ERR_CONFIG, "num_hidden_layers = 1025 is larger than the limit 1024"},
        {SIZES(20000000, 64, 128, 2, 4, ""), PR_ERR_CONFIG, "vocab_size = 20000000 is larger than the limit 16777216"},
        {SIZES(100, 2097152, 128, 2, 4, ""), PR_ERR_CONFIG, "hidden_size = 2097152 is larger than the limit 1048576"},
        {SIZES(100, 64, 3000000, 2, 4, ""), PR_ERR_CONFIG, "intermediate_size = 3000000 is larger than the limit 1048576"},
        {SIZES(100, 4096, 128, 2, 2048, ""), PR_ERR_CONFIG, "num_attention_heads = 2048 is larger than the limit 1024"},
        {SIZES(100, 64, 128, 2, 4, ",\"num_key_value_heads\":4096"), PR_ERR_CONFIG, "num_key_value_heads = 4096 is larger than the limit 1024"},
        {SIZES(100, 64, 128, 2, 4, ",\"head_dim\":4096"), PR_ERR_CONFIG, "head_dim = 4096 is larger than the limit 2048"},
        {SIZES(100, 64, 128, 2, 4, ",\"max_position_embeddings\":100000000"), PR_ERR_CONFIG, "max_position_embeddings = 100000000 is larger than the limit 67108864"},
        /* each field within its limit, the product not: 2^24 x 2^20 embedding rows alone */
        {SIZES(16777216, 1048576, 128, 2, 1024, ""), PR_ERR_CONFIG, "parameters, more than the limit 1099511627776 (PR_MAX_PARAMS)"},
        {SIZES(1000, 1048576, 1048576, 1024, 1024, ",\"head_dim\":2048"), PR_ERR_CONFIG, "more than the limit 1099511627776"},
        {"{\"model_type\":\"qwen3_moe\"," BASE ",\"num_attention_heads\":4,\"num_experts\":100000,\"num_experts_per_tok\":2,\"moe_intermediate_size\":8}", PR_ERR_CONFIG, "num_experts (100000) <= 65536"},
        {"{\"model_type\":\"qwen3_moe\"," BASE ",\"num_attention_heads\":4,\"num_experts\":4,\"num_experts_per_tok\":2,\"moe_intermediate_size\":2000000}", PR_ERR_CONFIG, "moe_intermediate_size = 2000000 is larger than the limit 1048576"},
#undef SIZES
        {"{\"model_type\":\"llama\"," BASE ",\"num_attention_heads\":4,}", PR_ERR_FORMAT, "bad JSON at byte"},
        {"[1,2]", PR_ERR_CONFIG, "JSON object"},
        {"", PR_ERR_FORMAT, "unexpected end"},
        /* MoE: routing coupled to the batch, and layouts the trainer does not run */
#define MOE "{\"model_type\":\"qwen3_moe\"," BASE ",\"num_attention_heads\":4,\"num_experts\":4,\"num_experts_per_tok\":2,\"moe_intermediate_size\":8"
        {MOE ",\"capacity_factor\":1.25}", PR_ERR_UNSUPPORTED, "capacity_factor"},
        {MOE ",\"moe_token_dropping\":true}", PR_ERR_UNSUPPORTED, "moe_token_dropping"},
        {MOE ",\"router_type\":\"expert_choice\"}", PR_ERR_UNSUPPORTED, "expert choice"},
        {MOE ",\"decoder_sparse_step\":2}", PR_ERR_UNSUPPORTED, "decoder_sparse_step 2"},
        {MOE ",\"mlp_only_layers\":[0]}", PR_ERR_UNSUPPORTED, "mlp_only_layers"},
        {MOE ",\"num_experts_per_tok\":5}", PR_ERR_CONFIG, "num_experts_per_tok"},
        {"{\"model_type\":\"qwen3_moe\"," BASE ",\"num_attention_heads\":4}", PR_ERR_CONFIG, "num_experts"},
#undef MOE
    };
#undef BASE
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        memset(&d, 0xab, sizeof d);
        pr_config before = d;
        EXPECT_FAIL(pr_config_parse(&d, bad[k].json, strlen(bad[k].json), &e_), bad[k].want, bad[k].needle, bad[k].json);
        CHECK(memcmp(&d, &before, sizeof d) == 0, "config untouched on failure (%s)", bad[k].needle);
    }
    /* validate on hand-built structs */
    pr_config v;
    CHECK(pr_config_parse(&v, minimal, strlen(minimal), &err) == PR_OK, "base");
    d = v; d.qk_norm = 1;
    EXPECT_FAIL(pr_config_validate(&d, &e_), PR_ERR_CONFIG, "qk_norm must be 0", "llama with qk_norm");
    d = v; memcpy(d.model_type, "llamallamallamallamallamallamalla", 32);
    EXPECT_FAIL(pr_config_validate(&d, &e_), PR_ERR_CONFIG, "terminated", "unterminated model_type");
    d = v; d.num_experts = -4;   /* a dense model has exactly none (the fuzzer found -4 accepted) */
    EXPECT_FAIL(pr_config_validate(&d, &e_), PR_ERR_CONFIG, "num_experts -4 does not fit model_type llama", "negative experts");
    d = v; d.rms_norm_eps = NAN;
    EXPECT_FAIL(pr_config_validate(&d, &e_), PR_ERR_CONFIG, "rms_norm_eps", "NaN eps");
    d = v; d.rope_llama3 = 1; d.rope_factor = 8; d.rope_low_freq_factor = 1; d.rope_high_freq_factor = 4; d.rope_original_max_position = 0;
    EXPECT_FAIL(pr_config_validate(&d, &e_), PR_ERR_CONFIG, "original_max_position_embeddings", "llama3 without original");
    d.rope_original_max_position = 64;
    CHECK(pr_config_validate(&d, &err) == PR_OK, "llama3 ok: %s", err.message);
    check_save_roundtrip(&d, "hand-built llama3");
    d = v; d.rms_norm_eps = 1.0 / 3; d.rope_theta = 123456.789;
    check_save_roundtrip(&d, "awkward doubles");
    EXPECT_FAIL(pr_config_validate(NULL, &e_), PR_ERR_ARG, "NULL", "NULL config");
    /* save refuses invalid configs and writes nothing */
    d = v; d.head_dim = 7;
    char *sp = tmp_path("refused_config.json");
    EXPECT_FAIL(pr_config_save(&d, sp, &e_), PR_ERR_CONFIG, "head_dim 7", "save invalid");
    CHECK(!file_exists(sp), "no file from a refused save");
    EXPECT_FAIL(pr_config_save(&v, tmp_path("no/such/dir/config.json"), &e_), PR_ERR_IO, "no/such/dir", "save into a missing folder");
    /* load errors name the file */
    EXPECT_FAIL(pr_config_load(&d, tmp_path("nothing-here"), &e_), PR_ERR_IO, "nothing-here", "missing config");
    EXPECT_FAIL(pr_config_load(&d, tmp_path("emptydir"), &e_), PR_ERR_IO, "emptydir/config.json", "folder without config.json");
    char *bj = tmp_path("badcfg.json");
    const char *bjt = "{\"model_type\": \"llama\",\n \"vocab_size\": 12,,}";
    write_bytes(bj, bjt, strlen(bjt));
    EXPECT_FAIL(pr_config_load(&d, bj, &e_), PR_ERR_FORMAT, "badcfg.json: bad JSON at byte 42", "bad JSON file with offset");
    CHECK(pr_config_parse(&d, NULL, 0, NULL) == PR_ERR_FORMAT, "NULL text, NULL err");
}

/* ---------------------------------------------------------------- out of memory everywhere */
static char g_sweep_dir[512];
static pr_status op_config(void) {
    pr_config c;
    char p[600];
    snprintf(p, sizeof p, "%s/llama3-8b", g_models);
    pr_status st = pr_config_load(&c, p, NULL);
    if (!st) st = pr_config_save(&c, tmp_path("sweep_config.json"), NULL);
    return st;
}
static pr_status op_save(void) {
    static pr_real d[3][8];
    pr_st_entry en[3] = {{"x", d[0], 1, {8, 0, 0, 0}}, {"y", d[1], 2, {2, 4, 0, 0}}, {"z", d[2], 1, {8, 0, 0, 0}}};
    pr_status st = pr_checkpoint_save(g_sweep_dir, en, 3, PR_DT_BF16, 20, NULL); /* 3 shards + index */
    if (!st) st = pr_safetensors_write(tmp_path("sweep.safetensors"), en, 3, PR_DT_F32, "{\"k\":\"v\"}", NULL);
    return st;
}
static pr_status op_open(void) {
    pr_checkpoint *ck;
    pr_real r[8];
    pr_status st = pr_checkpoint_open(&ck, g_sweep_dir, NULL);
    if (st) return st;
    st = pr_checkpoint_read(ck, pr_checkpoint_find(ck, "y"), r, 8, NULL);
    pr_checkpoint_close(ck);
    if (!st) st = pr_checkpoint_open(&ck, tmp_path("sweep.safetensors"), NULL);
    if (!st) pr_checkpoint_close(ck);
    return st;
}
static void sweep(const char *what, pr_status (*op)(void)) {
    long k;
    for (k = 0; k < 100000; k++) {
        long live = test_alloc_live;
        test_alloc_calls = 0;
        test_alloc_fail_at = k;
        pr_status st = op();
        int injected = test_alloc_calls > k;
        test_alloc_fail_at = -1;
        if (test_alloc_live != live) { CHECK(0, "%s: failing allocation %ld leaks %ld blocks", what, k, test_alloc_live - live); return; }
        if (!injected) { CHECK(st == PR_OK, "%s: succeeds when no allocation fails (%d)", what, (int)st); break; }
        if (st != PR_ERR_NOMEM) { CHECK(0, "%s: failing allocation %ld gives status %d, not PR_ERR_NOMEM", what, k, (int)st); return; }
    }
    CHECK(k > 3, "%s: swept %ld allocation sites", what, k);
    printf("note: %s: out-of-memory at each of its %ld allocations fails cleanly\n", what, k);
}
static void test_out_of_memory(void) {
    snprintf(g_sweep_dir, sizeof g_sweep_dir, "%s", tmp_path("sweep_ck"));
    CHECK(op_save() == PR_OK, "sweep setup");
    sweep("config load+save", op_config);
    sweep("safetensors save (sharded, single)", op_save);
    sweep("checkpoint open+read (sharded, single)", op_open);
    CHECK(test_alloc_live == 0, "no live allocations after the sweep: %ld", test_alloc_live);
}

int main(int argc, char **argv) {
    snprintf(g_tmp, sizeof g_tmp, "%s/pr_io_test.%ld", test_tmpdir(), pr__io_pid());
    if (pr__mkdir_one(g_tmp, NULL) != PR_OK) { printf("cannot create %s\n0 passed, 1 failed\n", g_tmp); return 1; }
    const char *cands[] = {argc > 1 ? argv[1] : "model", "model", "../model", "../../model"};
    for (int k = 0; k < 4; k++) {
        char p[400];
        snprintf(p, sizeof p, "%s/llama3-8b/config.json", cands[k]);
        if (file_exists(p)) { snprintf(g_models, sizeof g_models, "%s", cands[k]); break; }
    }
    if (!g_models[0]) { printf("FAIL: no model folder with llama3-8b found (pass it as argv[1])\n"); test_failed++; }
    test_json();
    test_conversions();
    test_roundtrip();
    test_large_offset();
    test_sharded();
    test_malformed();
    test_bad_index();
    test_write_errors();
    if (g_models[0]) test_config();
    if (g_models[0]) test_out_of_memory();
    CHECK(test_alloc_live == 0, "every library allocation freed: %ld live", test_alloc_live);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd) != 0) printf("note: could not remove %s\n", g_tmp);
    return test_report();
}
