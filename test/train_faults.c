/* train with one of the library's allocations failing, for test/fuzz_check.py --faults: the
   allocation numbered PR_FAIL_ALLOC (from 0, counted over the whole process, every in-process
   rank's thread together) returns NULL, as an exhausted heap would. With PR_COUNT_ALLOCS set, the
   count is printed to stderr at exit ("allocations: N"), so that a run without a failure says how
   many there are to choose from. Built from train.c as it is, with the allocation macros the
   header lets a program supply. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

static atomic_long allocs_made;
static long fail_at = -2;                     /* -2: PR_FAIL_ALLOC not read yet; -1: none fails */

static void print_count(void) { fprintf(stderr, "allocations: %ld\n", atomic_load(&allocs_made)); }

/* The first allocation runs on the main thread, before any rank's thread exists: the settings are
   read there. */
static int fails_now(void) {
    if (fail_at == -2) {
        const char *at = getenv("PR_FAIL_ALLOC");
        fail_at = at ? atol(at) : -1;
        if (getenv("PR_COUNT_ALLOCS")) atexit(print_count);
    }
    return atomic_fetch_add(&allocs_made, 1) == fail_at;
}
static void *faulty_malloc(size_t n) { return fails_now() ? NULL : malloc(n); }
static void *faulty_realloc(void *p, size_t n) { return fails_now() ? NULL : realloc(p, n); }

#define PR_MALLOC(sz) faulty_malloc(sz)
#define PR_REALLOC(p, sz) faulty_realloc(p, sz)
#define PR_FREE(p) free(p)
#include "../train.c"
