/* Device buffers of the GPU tests from host doubles and back, through a backend's copies: bf16
   (rounded to nearest even) or fp32 elements on the device; and the order a run repeated for its
   bits runs in on the emulated device. Include after prefixreuse.h, with setenv declared
   (_POSIX_C_SOURCE 200112L or later). */
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

/* The emulated device (test/gpu_emu.h) runs a launch's blocks, warps and lanes in the order
   PR_EMU_ORDER names, read at each launch; a GPU ignores it. A run repeated to compare its bits
   runs between gpu_order_flip() and gpu_order_restore(): on the emulator in the other order, so
   that a result which depends on the order threads run in (two writers of one element) differs
   there as it may on a GPU, where the repeat alone would give the same bits every time. */
static int gpu_order_reversed(void) {
    const char *v = getenv("PR_EMU_ORDER");
    return v && !strcmp(v, "reverse");
}
static int gpu_order_flip(void) {
    const int was = gpu_order_reversed();
    setenv("PR_EMU_ORDER", was ? "forward" : "reverse", 1);
    return was;
}
static void gpu_order_restore(int was) { setenv("PR_EMU_ORDER", was ? "reverse" : "forward", 1); }
#endif
