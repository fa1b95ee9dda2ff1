/* compare_st A B TOL: every tensor of safetensors file B against the same-named tensor of A, by
   ||a - b|| / ||b||; one line per tensor over TOL, then "N passed, N failed" (one check per tensor).
   make test-gpu compares the GPU's gradients (A) with the CPU double build's (B). */
#define PR_DOUBLE
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "harness.h"

#include <math.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: compare_st A.safetensors B.safetensors TOL\n");
        return 2;
    }
    double tol = atof(argv[3]), worst = 0;
    pr_error err;
    pr_checkpoint *a, *b;
    if (pr_checkpoint_open(&a, argv[1], &err)) { fprintf(stderr, "compare_st: %s\n", err.message); return 2; }
    if (pr_checkpoint_open(&b, argv[2], &err)) { fprintf(stderr, "compare_st: %s\n", err.message); pr_checkpoint_close(a); return 2; }
    const char *worst_name = "";
    for (int i = 0; i < pr_checkpoint_count(b); i++) {
        const pr_st_tensor *tb = pr_checkpoint_tensor(b, i), *ta = pr_checkpoint_find(a, tb->name);
        size_t n = 1;
        for (int d = 0; d < tb->ndim; d++) n *= (size_t)tb->shape[d];
        double *xa = malloc(sizeof(double) * n), *xb = malloc(sizeof(double) * n);
        int ok = ta && xa && xb && !pr_checkpoint_read(a, ta, xa, n, &err) && !pr_checkpoint_read(b, tb, xb, n, &err);
        double num = 0, den = 0;
        for (size_t j = 0; ok && j < n; j++) { num += (xa[j] - xb[j]) * (xa[j] - xb[j]); den += xb[j] * xb[j]; }
        double e = ok ? (den > 0 ? sqrt(num / den) : sqrt(num)) : INFINITY;
        CHECK(e <= tol, "%s: relative error %.3e > %.1e%s", tb->name, e, tol, ta ? "" : " (missing in A)");
        if (!(e <= worst)) { worst = e; worst_name = tb->name; }
        free(xa);
        free(xb);
    }
    printf("compare_st: %d tensors, worst relative error %.3e (%s), limit %.1e\n", pr_checkpoint_count(b), worst, worst_name, tol);
    pr_checkpoint_close(a);
    pr_checkpoint_close(b);
    return test_report();
}
