/* train with one of the library's allocations failing, for test/fuzz_check.py --faults: with
   PR_FAIL_ALLOC=T:K in the environment, allocation K (from 0) of thread T returns NULL, as an
   exhausted heap would. Allocations are counted thread by thread, so that the same T:K fails the
   same allocation in every run, whatever the threads' timing: thread 0 is the main thread, thread
   T > 0 the T-th that the library starts (pr_comm_local_run starts one a rank, in rank order,
   from the calling thread). With PR_COUNT_ALLOCS set, the counts are printed to stderr at exit,
   one a thread ("allocations: N0 N1 ..."), so that a run without a failure says what there is to
   choose from. Built from train.c as it is, with the allocation macros the header lets a program
   supply, and the header's thread start (C11 thrd_create) wrapped to number the threads. */
#ifdef __cplusplus
#error "train_faults.c numbers the threads the header starts with C11 thrd_create: build it as C"
#endif
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <threads.h>

/* The main thread and one a rank (train takes at most 256, and starts them once); threads numbered
   past the last slot would share it, their counts then depending on timing. */
#define MAX_THREADS 257
static atomic_long allocs_made[MAX_THREADS];
static atomic_int threads_started;
static _Thread_local int thread_no;          /* 0: the main thread */
static int fail_thread = -1;
static long fail_at = -2;                     /* -2: PR_FAIL_ALLOC not read yet; -1: none fails */

static void print_counts(void) {
    int n = atomic_load(&threads_started) + 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    fprintf(stderr, "allocations:");
    for (int t = 0; t < n; t++) fprintf(stderr, " %ld", atomic_load(&allocs_made[t]));
    fputc('\n', stderr);
}

/* The first allocation runs on the main thread, before any rank's thread exists: the settings are
   read there. */
static int fails_now(void) {
    if (fail_at == -2) {
        const char *at = getenv("PR_FAIL_ALLOC");
        fail_at = -1;
        if (at && sscanf(at, "%d:%ld", &fail_thread, &fail_at) != 2) {
            fprintf(stderr, "train_faults: PR_FAIL_ALLOC is '%s', not THREAD:ALLOCATION\n", at);
            exit(2);
        }
        if (getenv("PR_COUNT_ALLOCS")) atexit(print_counts);
    }
    const int t = thread_no < MAX_THREADS ? thread_no : MAX_THREADS - 1;
    return atomic_fetch_add(&allocs_made[t], 1) == fail_at && t == fail_thread;
}
static void *faulty_malloc(size_t n) { return fails_now() ? NULL : malloc(n); }
static void *faulty_realloc(void *p, size_t n) { return fails_now() ? NULL : realloc(p, n); }

/* A started thread takes its number before it runs the library's function. */
typedef struct {
    thrd_start_t fn;
    void *arg;
    int no;
} numbered_start;
static int run_numbered(void *p) {
    const numbered_start s = *(numbered_start *)p;
    free(p);
    thread_no = s.no;
    return s.fn(s.arg);
}
static int numbered_thrd_create(thrd_t *t, thrd_start_t fn, void *arg) {
    numbered_start *s = (numbered_start *)malloc(sizeof *s);
    if (!s) return thrd_nomem;
    s->fn = fn;
    s->arg = arg;
    s->no = atomic_fetch_add(&threads_started, 1) + 1;
    const int rc = thrd_create(t, run_numbered, s);
    if (rc != thrd_success) free(s);
    return rc;
}

#define PR_MALLOC(sz) faulty_malloc(sz)
#define PR_REALLOC(p, sz) faulty_realloc(p, sz)
#define PR_FREE(p) free(p)
#define thrd_create(t, fn, arg) numbered_thrd_create(t, fn, arg)
#include "../train.c"
