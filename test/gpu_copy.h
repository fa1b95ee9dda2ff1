/* Device buffers of the GPU tests from host doubles and back, through a backend's copies: bf16
   (rounded to nearest even) or fp32 elements on the device. Include after prefixreuse.h. */
#ifndef PR_GPU_COPY_H
#define PR_GPU_COPY_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void *gpu_upload(const pr_backend *be, const double *x, size_t n, int bf16) {
    const size_t elem = bf16 ? 2 : 4;
    char *h = (char *)malloc(elem * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        if (bf16) { uint16_t b = pr_f32_to_bf16((float)x[i]); memcpy(h + 2 * i, &b, 2); }
        else { float f = (float)x[i]; memcpy(h + 4 * i, &f, 4); }
    }
    void *d = be->alloc(be, elem * (n ? n : 1), PR_TIER_DEVICE);
    be->copy(be, d, h, elem * n);
    be->sync(be);
    free(h);
    return d;
}

/* n elements of `elem` bytes, every bit set (NaN): an output a kernel forgets to write fails. */
static void *gpu_poison(const pr_backend *be, size_t n, size_t elem) {
    void *h = malloc(elem * (n ? n : 1));
    memset(h, 0xFF, elem * n);
    void *d = be->alloc(be, elem * (n ? n : 1), PR_TIER_DEVICE);
    be->copy(be, d, h, elem * n);
    be->sync(be);
    free(h);
    return d;
}

static double *gpu_download(const pr_backend *be, const void *d, size_t n, int bf16) {
    const size_t elem = bf16 ? 2 : 4;
    char *h = (char *)malloc(elem * (n ? n : 1));
    be->copy(be, h, d, elem * n);
    be->sync(be);
    double *x = (double *)malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        if (bf16) { uint16_t b; memcpy(&b, h + 2 * i, 2); x[i] = pr_bf16_to_f32(b); }
        else { float f; memcpy(&f, h + 4 * i, 4); x[i] = f; }
    }
    free(h);
    return x;
}
#endif
