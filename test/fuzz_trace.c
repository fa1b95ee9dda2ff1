/* Fuzz harness for pr_trace_parse.
   libFuzzer: `make fuzz` (clang -fsanitize=fuzzer,address,undefined, seeded with data/sample.trace)
   Plain program that replays files (crash reproducers, a corpus):
     cc -std=c11 -g -O1 -DPR_FUZZ_MAIN -fsanitize=address,undefined test/fuzz_trace.c -o replay -lm
     ./replay FILE...
   Properties checked on every input, beyond "no crash, no leak, no over-read":
     - failure: a status other than PR_OK, a message naming "<memory>", the caller's trace untouched;
     - success: every group passes pr_group_validate, and writing the trace back out gives exactly the
       input bytes (the reader accepts only what a writer would produce, and loses nothing). */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"

#define FUZZ_ASSERT(c)                                                          \
    do {                                                                        \
        if (!(c)) {                                                             \
            fprintf(stderr, "%s:%d: property failed: %s\n", __FILE__, __LINE__, #c); \
            abort();                                                            \
        }                                                                       \
    } while (0)

static void put_u32(unsigned char **p, uint32_t v) {
    (*p)[0] = (unsigned char)v; (*p)[1] = (unsigned char)(v >> 8);
    (*p)[2] = (unsigned char)(v >> 16); (*p)[3] = (unsigned char)(v >> 24);
    *p += 4;
}
static void put_f32(unsigned char **p, pr_real x) {
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    put_u32(p, u);
}

/* Re-serialise t into out (capacity cap); returns the length, or cap + 1 if it would not fit. */
static size_t serialise(const pr_trace *t, unsigned char *out, size_t cap) {
    unsigned char *p = out, *end = out + cap;
    int k, i;
    if (cap < 24) return cap + 1;
    memcpy(p, "PRTRACE", 8);
    p += 8;
    put_u32(&p, 1);
    put_u32(&p, (uint32_t)t->has_ref);
    put_u32(&p, (uint32_t)t->n_groups);
    put_u32(&p, (uint32_t)t->vocab_size);
    for (k = 0; k < t->n_groups; k++) {
        const pr_group *g = &t->groups[k];
        const int64_t N = g->suffix_off[g->G];
        if ((size_t)(end - p) < 8 + 4 * (size_t)g->P + 8 * (size_t)g->G + (size_t)N * (t->has_ref ? 13 : 9))
            return cap + 1;
        put_u32(&p, (uint32_t)g->P);
        put_u32(&p, (uint32_t)g->G);
        for (i = 0; i < g->P; i++) put_u32(&p, (uint32_t)g->prefix[i]);
        for (i = 0; i < g->G; i++) put_u32(&p, (uint32_t)g->suffix_len[i]);
        for (i = 0; i < g->G; i++) put_f32(&p, g->advantage[i]);
        for (i = 0; i < g->G; i++) {
            const int64_t o = g->suffix_off[i], S = g->suffix_len[i];
            int64_t j;
            for (j = 0; j < S; j++) put_u32(&p, (uint32_t)g->tokens[o + j]);
            for (j = 0; j < S; j++) put_f32(&p, g->old_logp[o + j]);
            if (t->has_ref)
                for (j = 0; j < S; j++) put_f32(&p, g->ref_logp[o + j]);
            memcpy(p, g->loss_mask + o, (size_t)S);
            p += S;
        }
    }
    return (size_t)(p - out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pr_trace t, sentinel;
    pr_error err;
    pr_status st;
    memset(&sentinel, 0xa5, sizeof sentinel);
    t = sentinel;
    err.message[0] = 0;
    st = pr_trace_parse(&t, data, size, &err);
    if (st != PR_OK) {
        FUZZ_ASSERT(memcmp(&t, &sentinel, sizeof t) == 0);
        FUZZ_ASSERT(err.status == st && strstr(err.message, "<memory>") != NULL);
        return 0;
    }
    FUZZ_ASSERT(t.n_groups >= 1 && t.vocab_size >= 1 && t.groups != NULL);
    for (int k = 0; k < t.n_groups; k++) {
        FUZZ_ASSERT(pr_group_validate(&t.groups[k], t.vocab_size, &err) == PR_OK);
        FUZZ_ASSERT((t.groups[k].ref_logp != NULL) == (t.has_ref != 0));
    }
    {
        unsigned char *out = malloc(size + 1);
        FUZZ_ASSERT(out != NULL);
        FUZZ_ASSERT(serialise(&t, out, size) == size && memcmp(out, data, size) == 0);
        free(out);
    }
    pr_trace_free(&t);
    return 0;
}

#ifdef PR_FUZZ_MAIN
int main(int argc, char **argv) {
    int i, n = 0;
    for (i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        unsigned char *b = NULL;
        size_t len = 0, cap = 0, got;
        if (!f) { fprintf(stderr, "%s: cannot open\n", argv[i]); return 2; }
        do {   /* read the whole file into an exactly-sized block, so ASan sees any over-read */
            if (len == cap) {
                cap = cap ? 2 * cap : 4096;
                b = realloc(b, cap);
                if (!b) { fclose(f); fprintf(stderr, "out of memory\n"); return 2; }
            }
            got = fread(b + len, 1, cap - len, f);
            len += got;
        } while (got);
        fclose(f);
        {
            unsigned char *exact = malloc(len ? len : 1);
            if (!exact) { free(b); return 2; }
            memcpy(exact, b, len);
            free(b);
            LLVMFuzzerTestOneInput(exact, len);
            free(exact);
        }
        n++;
    }
    printf("replayed %d file(s): no property failed\n", n);
    return 0;
}
#endif
