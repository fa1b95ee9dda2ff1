/* A minimal test harness: CHECK records a pass or a failure with its location; the program ends
   with the line "N passed, N failed" and a nonzero status when anything failed. */
#ifndef PR_TEST_HARNESS_H
#define PR_TEST_HARNESS_H
#include <stdio.h>
#include <stdlib.h>

static int test_passed, test_failed;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (cond) test_passed++;                                                \
        else {                                                                  \
            test_failed++;                                                      \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                         \
            printf(__VA_ARGS__);                                                \
            printf("\n");                                                       \
        }                                                                       \
    } while (0)

#ifdef TEST_COUNTING_ALLOCATOR
/* A counting allocator that can fail one call, the test_alloc_fail_at-th since test_alloc_calls
   was last reset: it drives every out-of-memory path, and test_alloc_live shows whether each one
   freed what it took. Define TEST_COUNTING_ALLOCATOR and include this before prefixreuse.h. */
static long test_alloc_calls, test_alloc_fail_at = -1, test_alloc_live;
static void *test_malloc(size_t n) {
    if (test_alloc_calls++ == test_alloc_fail_at) return NULL;
    void *p = malloc(n);
    if (p) test_alloc_live++;
    return p;
}
static void *test_realloc(void *old, size_t n) {
    if (test_alloc_calls++ == test_alloc_fail_at) return NULL;
    void *p = realloc(old, n);
    if (p && !old) test_alloc_live++;
    return p;
}
static void test_free(void *p) {
    if (p) test_alloc_live--;
    free(p);
}
#define PR_MALLOC(sz) test_malloc(sz)
#define PR_REALLOC(p, sz) test_realloc(p, sz)
#define PR_FREE(p) test_free(p)
#endif

/* Where a test makes its scratch files: $TMPDIR, else /tmp. The suite runs its programs at once, so
   each names its files after its pid or makes its own folder there (mkdtemp). */
static inline const char *test_tmpdir(void) {
    const char *dir = getenv("TMPDIR");
    return dir && dir[0] ? dir : "/tmp";
}

static int test_report(void) {
    printf("%d passed, %d failed\n", test_passed, test_failed);
    return test_failed ? 1 : 0;
}
#endif
