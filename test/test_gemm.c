/* Tests for the header's GEMM (pr__gemm) against an independent triple loop: every transpose,
   odd sizes, strides, beta, the out-of-memory fallback, and bitwise determinism across thread
   counts. Run by `make test`; built with -DPR_USE_CBLAS -lopenblas it checks the BLAS route. */
#include <stdlib.h>

/* An allocator that can be told to fail, to exercise the no-memory fallback. */
static int fail_alloc;
#define PR_MALLOC(sz) (fail_alloc ? NULL : malloc(sz))
#define PR_REALLOC(p, sz) realloc(p, sz)
#define PR_FREE(p) free(p)
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "xorshift.h"

/* The yardstick: the triple loop, summed in long double (on x86, wider than the header's sums;
   at least not the header's own fallback loop over again), rounded once. */
static void reference_gemm(int ta, int tb, int M, int N, int K,
                           const pr_real *A, int lda, const pr_real *B, int ldb,
                           pr_real beta, pr_real *C, int ldc) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            long double s = beta == 0 ? 0 : (long double)beta * C[(size_t)i * ldc + j];
            for (int k = 0; k < K; k++)
                s += (long double)(ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k]) *
                     (tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j]);
            C[(size_t)i * ldc + j] = (pr_real)s;
        }
}



static int passed, failed;

static uint64_t rng = 88172645463325252ULL;
static pr_real rnd(void) { return (pr_real)test_uniform(&rng); }

static void check(int ok, const char *what, int ta, int tb, int M, int N, int K, double beta) {
    if (ok) { passed++; return; }
    failed++;
    if (failed <= 20)
        printf("FAIL %s: ta=%d tb=%d M=%d N=%d K=%d beta=%g\n", what, ta, tb, M, N, K, beta);
}

/* Allocate op(X) stored with padded stride; returns the stride via *ld. */
static pr_real *make(int rows, int cols, int pad, int *ld) {
    pr_real *x;
    size_t i, n;
    *ld = cols + pad;
    n = (size_t)rows * *ld + 1;
    x = malloc(n * sizeof *x);
    if (!x) { printf("out of memory\n"); exit(2); }
    for (i = 0; i < n; i++) x[i] = rnd();
    return x;
}

static void run_case(int ta, int tb, int M, int N, int K, pr_real beta, int pad) {
    int lda, ldb, ldc, i, j, k, ok = 1;
    /* Stored shapes: A is (M,K) or (K,M); B is (K,N) or (N,K). */
    pr_real *A = ta ? make(K, M, pad, &lda) : make(M, K, pad, &lda);
    pr_real *B = tb ? make(N, K, pad + 1, &ldb) : make(K, N, pad + 1, &ldb);
    pr_real *C0 = make(M, N, pad + 2, &ldc), *C = malloc(((size_t)M * ldc + 1) * sizeof *C),
            *R = malloc(((size_t)M * ldc + 1) * sizeof *R);
    const double eps = sizeof(pr_real) == 4 ? 1.2e-7 : 2.3e-16;
    if (!C || !R) { printf("out of memory\n"); exit(2); }
    if (beta == 0 && (pad & 1)) /* overwriting must not read C: NaNs there must vanish */
        for (i = 0; i < M; i++)
            for (j = 0; j < N; j++) C0[(size_t)i * ldc + j] = (pr_real)NAN;
    memcpy(C, C0, ((size_t)M * ldc + 1) * sizeof *C);
    memcpy(R, C0, ((size_t)M * ldc + 1) * sizeof *R);
    pr__gemm(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    reference_gemm(ta, tb, M, N, K, A, lda, B, ldb, beta, R, ldc);
    for (i = 0; i < M && ok; i++)
        for (j = 0; j < ldc && ok; j++) {
            size_t p = (size_t)i * ldc + j;
            if (j >= N) { ok = C[p] == C0[p]; continue; } /* padding must be untouched */
            {
                /* Both results err by at most ~K*eps*sum|a*b| (+ |C0| term). */
                double mag = beta != 0 ? fabs((double)beta * C0[p]) : 0;
                for (k = 0; k < K; k++)
                    mag += fabs((double)(ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k]) *
                                (double)(tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j]));
                ok = fabs((double)C[p] - (double)R[p]) <= 2.0 * (K + 2) * eps * mag + 1e-300;
            }
        }
    ok = ok && C[(size_t)M * ldc] == C0[(size_t)M * ldc];
    check(ok, "accuracy", ta, tb, M, N, K, beta);
#if defined(_OPENMP) && !defined(PR_USE_CBLAS) /* BLAS promises no such thing */
    {   /* Bitwise identical under 1 and 2 threads. */
        int nt = omp_get_max_threads();
        memcpy(R, C0, ((size_t)M * ldc + 1) * sizeof *R);
        omp_set_num_threads(1);
        pr__gemm(ta, tb, M, N, K, A, lda, B, ldb, beta, R, ldc);
        omp_set_num_threads(2);
        memcpy(C, C0, ((size_t)M * ldc + 1) * sizeof *C);
        pr__gemm(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
        omp_set_num_threads(nt);
        check(memcmp(C, R, ((size_t)M * ldc + 1) * sizeof *C) == 0, "determinism", ta, tb, M, N, K, beta);
    }
#endif
#ifndef PR_USE_CBLAS
    {   /* Without memory for its packing buffers, the same bits (on the stack, one thread). */
        const int was = fail_alloc;
        memcpy(C, C0, ((size_t)M * ldc + 1) * sizeof *C);
        memcpy(R, C0, ((size_t)M * ldc + 1) * sizeof *R);
        fail_alloc = 0;
        pr__gemm(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
        fail_alloc = 1;
        pr__gemm(ta, tb, M, N, K, A, lda, B, ldb, beta, R, ldc);
        fail_alloc = was;
        check(memcmp(C, R, ((size_t)M * ldc + 1) * sizeof *C) == 0, "out-of-memory bits", ta, tb, M, N, K, beta);
    }
#endif
    free(A); free(B); free(C0); free(C); free(R);
}

/* Results for one element must not depend on M or N: compare a row of a big
   product against the same row computed alone. */
static void run_shape_independence(int ta, int tb, int M, int N, int K) {
    int lda, ldb, ldc, j, i0 = M / 2;
    pr_real *A = ta ? make(K, M, 0, &lda) : make(M, K, 0, &lda);
    pr_real *B = tb ? make(N, K, 0, &ldb) : make(K, N, 0, &ldb);
    pr_real *C = make(M, N, 0, &ldc), *row = malloc(N * sizeof *row);
    if (!row) { printf("out of memory\n"); exit(2); }
    pr__gemm(ta, tb, M, N, K, A, lda, B, ldb, 0, C, ldc);
    /* Row i0 alone: op(A) restricted to one row. */
    pr__gemm(ta, tb, 1, N, K, ta ? A + i0 : A + (size_t)i0 * lda, lda, B, ldb, 0, row, N);
    for (j = 0; j < N && C[(size_t)i0 * ldc + j] == row[j]; j++) {}
    check(j == N, "shape independence", ta, tb, M, N, K, 0);
    free(A); free(B); free(C); free(row);
}

int main(void) {
    static const int sizes[] = {1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 33, 64, 97, 129, 200, 257, 300};
    const int ns = (int)(sizeof sizes / sizeof *sizes);
    int ta, tb, i, n = 0;
    (void)pr__fail; (void)pr__mul_size;
    for (ta = 0; ta < 2; ta++)
        for (tb = 0; tb < 2; tb++) {
            /* Dense sweep over small odd shapes. */
            for (i = 0; i < ns; i++) {
                int M = sizes[i], N = sizes[(i * 7 + 3) % ns], K = sizes[(i * 5 + 1) % ns];
                run_case(ta, tb, M, N, K, 0, 0);
                run_case(ta, tb, M, N, K, 1, 3);
                run_case(ta, tb, N, K, M, 1, 0);
                run_case(ta, tb, K, M, N, 0, 5);
            }
            /* Degenerate dimensions. */
            run_case(ta, tb, 1, 1, 1, 0, 0);
            run_case(ta, tb, 1, 300, 77, 1, 1);
            run_case(ta, tb, 300, 1, 77, 0, 1);
            run_case(ta, tb, 37, 41, 1, 1, 2);
            run_case(ta, tb, 37, 41, 0, 1, 2);
            run_case(ta, tb, 37, 41, 0, 0, 2);
            run_case(ta, tb, 50, 70, 90, (pr_real)0.5, 1);
            run_case(ta, tb, 50, 70, 0, (pr_real)-2, 0);
            /* Larger than one block in every dimension (exercises MC/NC/KC edges). */
            run_case(ta, tb, 211, 2100, 530, 1, 1);
            run_case(ta, tb, 403, 67, 1000, 0, 0);
            for (i = 0; i < 20; i++, n++) {
                int M = 1 + (int)((rnd() + 1) * 150), N = 1 + (int)((rnd() + 1) * 150),
                    K = (int)((rnd() + 1) * 150);
                run_case(ta, tb, M, N, K, (pr_real)(n & 1), n % 4);
            }
            fail_alloc = 1;
            run_case(ta, tb, 67, 45, 300, 0, 1);
            run_case(ta, tb, 13, 301, 29, 1, 0);
            fail_alloc = 0;
#ifndef PR_USE_CBLAS /* BLAS switches kernels (gemv, ...) by shape */
            run_shape_independence(ta, tb, 301, 203, 517);
            run_shape_independence(ta, tb, 29, 1100, 260);
#else
            (void)run_shape_independence;
#endif
        }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
