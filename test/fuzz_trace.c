/* Fuzz harness for pr_trace_parse.
   libFuzzer: `make fuzz` (clang -fsanitize=fuzzer,address,undefined, seeded with data/sample.trace)
   Plain program that replays files (crash reproducers, a corpus):
     cc -std=c11 -g -O1 -DPR_FUZZ_MAIN -fsanitize=address,undefined test/fuzz_trace.c -o replay -lm
     ./replay FILE...
   Properties checked on every input, beyond "no crash, no leak, no over-read":
     - failure: a status other than PR_OK, a message naming "<memory>", the caller's trace untouched;
     - success: every group passes pr_group_validate, a version-2 step table covers the groups
       in order, and writing the trace back out gives exactly the
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
    FUZZ_ASSERT(t.n_steps >= 0 && t.n_steps <= t.n_groups && (t.n_steps == 0) == (t.step_off == NULL));
    for (int k = 0; k < t.n_steps; k++)   /* a version-2 step table covers the groups in order */
        FUZZ_ASSERT((k || t.step_off[0] == 0) && t.step_off[k + 1] > t.step_off[k] &&
                    (k < t.n_steps - 1 || t.step_off[k + 1] == t.n_groups));
    for (int k = 0; k < t.n_groups; k++) {
        FUZZ_ASSERT(pr_group_validate(&t.groups[k], t.vocab_size, &err) == PR_OK);
        FUZZ_ASSERT((t.groups[k].ref_logp != NULL) == (t.has_ref != 0));
    }
    {   /* what parses serialises back to the same bytes */
        void *out = NULL;
        size_t n = 0;
        FUZZ_ASSERT(pr_trace_serialize(&t, &out, &n, &err) == PR_OK && n == size && memcmp(out, data, size) == 0);
        PR_FREE(out);
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
