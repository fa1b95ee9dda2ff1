/* gpu_emu.h — an emulated GPU block on the host, for running the CUDA backend's kernels without a
   GPU: test/test_mma_kernels.cc (the attention kernels against the double reference) and
   test/cuda_emu.cc (the whole backend, host code included, under the GPU tests). Include
   harness.h and mma_emu.h first, and define EMU_REPORT(...) (printf-style): how a fault the
   emulated machine sees is reported.

   The emulated block: one fiber per thread, run in turn until each reaches a synchronisation
   point. __syncthreads releases when every thread has arrived, at the same call site. A warp-collective instruction
   (ldmatrix, mma.sync, shfl) executes when all 32 lanes of the warp have arrived at it, through
   mma_emu.h's emulation written from the PTX ISA; lanes of one warp arriving at different ones is
   reported as divergence, threads that never meet as a deadlock. cp.async copies land only when
   the issuing thread's cp.async.wait_group lets their group complete (the latest moment the
   hardware allows), zero-filled when asked; their sources are checked against emu_inputs and their
   destinations, like every ldmatrix address, against the launch's dynamic shared memory, which
   starts filled with NaN bytes. Blocks run one after another. Races are checked against the
   barriers (see "racecheck" below): between warps whatever order the fibers run in; within one
   warp only a read that runs after another lane's store to the word is flagged, so there the
   lanes' order (PR_EMU_ORDER below) can change what is seen.
   PR_EMU_ORDER=reverse in the environment runs the blocks of a launch, the warps of a block and
   the lanes of a warp each in reverse order: a kernel whose result depends on that order (two
   threads adding into one element, which on a GPU also lose each other's updates) then gives
   other bits than the forward order, which a comparison of the two runs shows. It is read at
   every launch (test/cuda_emu.h's: when the host issues it), so a program can run a launch again
   in the other order (test/gpu_copy.h). */
#ifndef PR_GPU_EMU_H
#define PR_GPU_EMU_H
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <functional>
#include <vector>

/* ================================================================ the CUDA built-ins on the host */
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
typedef struct pr_emu_bf16 { uint16_t bits; } bf16;
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct float2 { float x, y; };
static inline float2 make_float2(float x, float y) { float2 r = { x, y }; return r; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
/* a product rounded alone, never fused into an fma (a call the compiler cannot contract) */
static inline __attribute__((noinline)) float __fmul_rn(float a, float b) { return a * b; }
static inline int min(int a, int b) { return a < b ? a : b; }
#define __expf(x) expf(x)                 /* glibc declares its own __expf */
static inline float __bfloat162float(bf16 x) { return bf16_value(x.bits); }
static inline bf16 __float2bfloat16(float x) {
    bf16 r;
    r.bits = emu_bf16_bits(emu_round_bf16(x));
    return r;
}

#define EMU_SMEM_MAX (232 * 1024)
__attribute__((aligned(128))) unsigned char pr_dyn_smem[EMU_SMEM_MAX];

enum { T_RUN, T_BAR, T_WARP, T_WG, T_DONE };
enum { WG_FENCE, WG_MMA, WG_COMMIT, WG_WAIT };
enum { OP_LDSM, OP_LDSM_T, OP_MMA, OP_SHFL, OP_SHFL_IDX, OP_VOTE_ANY };
struct emu_copy { uint32_t dst; const void *src; int bytes; bool fill; };
/* Switching between fibers: on x86-64 a plain switch of the callee-saved registers and the stack
   pointer, without glibc's signal-mask system call (the emulation makes tens of millions of
   switches); elsewhere, or with EMU_UCONTEXT, ucontext. Under AddressSanitizer each switch is told
   to it (__sanitizer_start/finish_switch_fiber), as it must be for any stack it did not make; its
   swapcontext interceptor would instead clear the whole new stack's shadow at every switch. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_SANITIZED 1
#endif
#endif
#if !defined(EMU_SANITIZED) && defined(__SANITIZE_ADDRESS__)
#define EMU_SANITIZED 1
#endif
#ifndef EMU_SANITIZED
#define EMU_SANITIZED 0
#endif
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
#define EMU_FAST_SWITCH 1
extern "C" void emu_switch(void **save_sp, void *load_sp);
__asm__(".text\n.globl emu_switch\n.type emu_switch,@function\nemu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
        ".size emu_switch, .-emu_switch\n");
#else
#define EMU_FAST_SWITCH 0
#endif
#if EMU_FAST_SWITCH && EMU_SANITIZED
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
struct emu_thread {
#if EMU_FAST_SWITCH
    void *sp;                                    /* its stack pointer while switched out */
    char *stack;                                 /* its stack's lowest byte, and its size */
    size_t stack_size;
    void *fake_stack;                            /* AddressSanitizer's, while switched out */
#else
    ucontext_t ctx;
#endif
    dim3 idx;
    int state, op;
    uint32_t addr, *regs;                        /* ldmatrix */
    float *d;                                    /* mma */
    const uint32_t *a;
    uint32_t b0, b1;
    double val;                                  /* shfl: a float or a double, exactly */
    int mask;
    std::vector<emu_copy> open;                  /* cp.async: the group being issued, and the committed ones */
    std::vector<std::vector<emu_copy>> groups;
    bool waited;                                 /* a wait_group since the last barrier (planted faults) */
    bool stored;                                 /* a shared-memory store since the last barrier (planted faults) */
    bool fence_due;                              /* a fence.proxy.async deferred past the next barrier (planted fault) */
    const char *bar_file;                        /* the __syncthreads it waits at */
    int bar_line;
    int wg_op;                                   /* a warpgroup instruction (WG_*) and its operands */
    uint64_t wg_da, wg_db;                       /* wgmma: descriptors (wg_a NULL: A from shared memory) */
    const uint32_t *wg_a;
    float *wg_d;
    int wg_n, wg_wait;                           /* wgmma: N; wait_group: N */
    std::vector<uint32_t> unfenced;              /* shared words its landed copies and stores wrote, not yet fenced for wgmma */
};
static std::vector<emu_thread> emu_threads;
static std::vector<char> emu_stacks;
#if EMU_FAST_SWITCH
static void *emu_sched_sp;
#if EMU_SANITIZED
static const void *emu_sched_stack;              /* the scheduler's stack, as AddressSanitizer gives it */
static size_t emu_sched_stack_size;
#endif
#else
static ucontext_t emu_sched;
#endif
static emu_thread *emu_cur;
static dim3 emu_block, emu_grid, emu_bdim;
static std::function<void()> *emu_body;
static size_t emu_smem_bytes;
static int emu_errors;                           /* divergence, deadlock, bad addresses */
/* negative controls: copies land a wait_group late; ldmatrix ignores .trans; barriers skipped (1:
   those not right after a wait_group, which end a stage's reads; 2: those right after one, which
   publish its copies; 3: those right after a shared-memory store, which publish the fused
   backward's dS tile) */
static int fault_late_copies, fault_ignore_trans, fault_skip_barrier;
/* ... and for wgmma: fence.proxy.async skipped, or run after the barrier that follows it; wait_group
   retiring nothing (results read before they land) */
static int fault_skip_proxy_fence, fault_late_proxy_fence, fault_wgmma_unwaited;
/* Where the kernels may read by cp.async (emu_inputs) and add by atomics (emu_accumulators): sets
   of buffers, kept sorted by address. */
struct emu_buffer { const char *p; size_t bytes; };
static std::vector<emu_buffer> emu_inputs, emu_accumulators;
static bool emu_buffer_before(const emu_buffer &a, const emu_buffer &b) { return a.p < b.p; }
static void emu_buffer_add(std::vector<emu_buffer> &set, const void *p, size_t bytes) {
    emu_buffer b = { (const char *)p, bytes };
    set.insert(std::upper_bound(set.begin(), set.end(), b, emu_buffer_before), b);
}
static inline void emu_buffer_remove(std::vector<emu_buffer> &set, const void *p) {
    for (size_t i = 0; i < set.size(); i++)
        if (set[i].p == (const char *)p) { set.erase(set.begin() + (long)i); return; }
}
/* [p, p + bytes) inside one buffer of the set */
static bool emu_within(const std::vector<emu_buffer> &set, const void *p, size_t bytes) {
    emu_buffer key = { (const char *)p, 0 };
    std::vector<emu_buffer>::const_iterator it = std::upper_bound(set.begin(), set.end(), key, emu_buffer_before);
    if (it == set.begin()) return false;
    --it;
    return (const char *)p + bytes <= it->p + it->bytes;
}

#define threadIdx (emu_cur->idx)
#define blockIdx emu_block
#define gridDim emu_grid
#define blockDim emu_bdim

/* A fault the machine saw, counted in `count`; the first few are reported as failures, unless a
   negative control planted it (emu_quiet), which then checks the counts. */
static bool emu_quiet;
#define EMU_FAULT(count, ...)                          \
    do {                                               \
        if ((count)++ < 3 && !emu_quiet) EMU_REPORT(__VA_ARGS__); \
    } while (0)
static void emu_error(const char *what) {
    EMU_FAULT(emu_errors, "emulated block (%u, %u) thread %u: %s", emu_block.x, emu_block.y, emu_cur ? emu_cur->idx.x : 0, what);
}

/* ---------------------------------------------------------------- racecheck
   Shared memory is checked word by word (4 bytes) against the barriers, whatever order the fibers
   happen to run in: an epoch is the stretch between two releases of __syncthreads, and the warps
   of one epoch may interleave in any way. A cp.async is in flight from its issue until its
   issuing thread's wait_group completes it; its data may be read by that thread after the wait,
   by anyone else only in a later epoch. Flagged: a read of a word while a copy into it is in
   flight, or in the epoch its copy completed by another thread (a missing barrier after a wait);
   a copy into a word another warp read in the same epoch (a missing barrier before a stage is
   refilled), or into a word whose earlier copy is in flight or completed in this epoch by another
   thread. A plain store (pr_sts_b32) completes at once: it races a copy in flight or completed in
   this epoch by another thread, another thread's store in this epoch, and another warp's read in
   this epoch; a read of it by another thread (or by ldmatrix) in the same epoch is flagged as for
   a copy. ldmatrix reads for its whole warp, pr_lds_f32 for its thread. */
/* unfenced: written (landed, or stored) and not yet fenced for wgmma by its writer; stale: a barrier
   published it unfenced (a fence after the barrier comes too late for the other threads' wgmma) */
struct emu_word { int writer, landed, read_epoch; uint32_t readers; bool unfenced, stale; };   /* writer -1: none; landed -1: in flight */
static std::vector<emu_word> emu_shadow(EMU_SMEM_MAX / 4);
static int emu_epoch;
static long emu_races;
static void emu_race(const char *what, uint32_t word, int copier) {
    char by[48] = "";
    if (copier >= 0) snprintf(by, sizeof by, " (the write is thread %d's)", copier);
    EMU_FAULT(emu_races, "race in block (%u, %u), thread %u, shared byte %u: %s%s", emu_block.x, emu_block.y,
              emu_cur ? emu_cur->idx.x : 0, 4 * word, what, by);
}
static void emu_shadow_reset(size_t bytes) {
    for (size_t w = 0; w < bytes / 4; w++) emu_shadow[w] = emu_word{ -1, -1, -1, 0, false, false };
    emu_epoch = 0;
}
/* bytes at addr read by warp `warp`: by one thread of it (`thread`), or by all of it (-1) */
static void emu_shadow_read(uint32_t addr, int bytes, int warp, int thread) {
    for (uint32_t w = addr / 4; w < (addr + bytes) / 4; w++) {
        emu_word &x = emu_shadow[w];
        if (x.writer >= 0 && x.landed < 0) emu_race("read while a cp.async into it is in flight", w, x.writer);
        else if (x.writer >= 0 && x.landed == emu_epoch && x.writer != thread)
            emu_race("read in the epoch its cp.async completed or its store ran, no barrier between", w, x.writer);
        if (x.read_epoch != emu_epoch) x.read_epoch = emu_epoch, x.readers = 0;
        x.readers |= 1u << warp;
    }
}
/* bytes at addr written by the current thread: by a cp.async it issues (in flight until its wait
   completes it), or by a plain store (complete at once) */
static void emu_shadow_write(uint32_t addr, int bytes, bool async) {
    const int me = (int)emu_cur->idx.x;
    const char *what = async ? "cp.async" : "store";
    char why[96];
    for (uint32_t w = addr / 4; w < (addr + bytes) / 4; w++) {
        emu_word &x = emu_shadow[w];
        if (x.writer >= 0 && x.landed < 0) {
            snprintf(why, sizeof why, "%s into a word a cp.async has in flight", what);
            emu_race(why, w, x.writer);
        } else if (x.writer >= 0 && x.landed == emu_epoch && x.writer != me) {
            snprintf(why, sizeof why, "%s into a word another thread wrote in this epoch", what);
            emu_race(why, w, x.writer);
        }
        if (x.read_epoch == emu_epoch && (x.readers & ~(1u << (me / 32)))) {
            snprintf(why, sizeof why, "%s into a word another warp read in this epoch, no barrier between", what);
            emu_race(why, w, -1);
        }
        x.writer = me, x.landed = async ? -1 : emu_epoch;
        if (!async) x.unfenced = true, x.stale = false, emu_cur->unfenced.push_back(w);
    }
}
static void emu_shadow_land(uint32_t addr, int bytes) {
    for (uint32_t w = addr / 4; w < (addr + bytes) / 4; w++) {
        emu_shadow[w].landed = emu_epoch, emu_shadow[w].unfenced = true, emu_shadow[w].stale = false;
        emu_cur->unfenced.push_back(w);
    }
}

/* From the running fiber to the scheduler; `ending`: never to be resumed. */
static void emu_to_scheduler(bool ending = false) {
    (void)ending;                                /* read only under AddressSanitizer */
#if EMU_FAST_SWITCH
#if EMU_SANITIZED
    __sanitizer_start_switch_fiber(ending ? NULL : &emu_cur->fake_stack, emu_sched_stack, emu_sched_stack_size);
#endif
    emu_switch(&emu_cur->sp, emu_sched_sp);
#if EMU_SANITIZED
    __sanitizer_finish_switch_fiber(emu_cur->fake_stack, NULL, NULL);     /* emu_cur: this fiber again */
#endif
#else
    swapcontext(&emu_cur->ctx, &emu_sched);
#endif
}
static void emu_to_fiber(emu_thread *t) {
    emu_cur = t;
#if EMU_FAST_SWITCH
#if EMU_SANITIZED
    void *fake_stack;
    __sanitizer_start_switch_fiber(&fake_stack, t->stack, t->stack_size);
#endif
    emu_switch(&emu_sched_sp, t->sp);
#if EMU_SANITIZED
    __sanitizer_finish_switch_fiber(fake_stack, NULL, NULL);
#endif
#else
    swapcontext(&emu_sched, &t->ctx);
#endif
}
static void emu_yield(int state) {
    emu_cur->state = state;
    emu_to_scheduler();
}
static void emu_proxy_fence(void);
/* A call site's file and line: the threads of a block must wait at the same __syncthreads (CUDA
   leaves a barrier reached at different ones undefined; a GPU may release it, or hang). */
#define __syncthreads() emu_syncthreads(__FILE__, __LINE__)
static void emu_syncthreads(const char *file, int line) {
    emu_cur->bar_file = file, emu_cur->bar_line = line;
    const bool after_wait = emu_cur->waited, after_store = emu_cur->stored;
    emu_cur->waited = emu_cur->stored = false;
    if ((fault_skip_barrier == 1 && !after_wait) || (fault_skip_barrier == 2 && after_wait) || (fault_skip_barrier == 3 && after_store))
        return;
    emu_yield(T_BAR);
    if (emu_cur->fence_due) emu_cur->fence_due = false, emu_proxy_fence();
}

static uint32_t pr_smem_u32(const void *p) { return (uint32_t)((const unsigned char *)p - pr_dyn_smem); }
static inline void pr_ldsm_x4(uint32_t r[4], uint32_t addr) {
    emu_cur->op = OP_LDSM, emu_cur->addr = addr, emu_cur->regs = r;
    emu_yield(T_WARP);
}
static inline void pr_ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
    emu_cur->op = OP_LDSM_T, emu_cur->addr = addr, emu_cur->regs = r;
    emu_yield(T_WARP);
}
static inline void pr_mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    emu_cur->op = OP_MMA, emu_cur->d = d, emu_cur->a = a, emu_cur->b0 = b0, emu_cur->b1 = b1;
    emu_yield(T_WARP);
}
template <typename T> static T emu_shfl_xor(T v, int mask) {
    emu_cur->op = OP_SHFL, emu_cur->val = v, emu_cur->mask = mask;
    emu_yield(T_WARP);
    return (T)emu_cur->val;
}
/* only full warps here: every kernel shuffles with all 32 lanes */
template <typename T> static T __shfl_xor_sync(unsigned members, T v, int mask) {
    if (members != 0xffffffffu) emu_error("a shuffle with a partial member mask");
    return emu_shfl_xor(v, mask);
}
/* shfl.sync.idx: lane src's value, in every lane */
template <typename T> static T __shfl_sync(unsigned members, T v, int src) {
    if (members != 0xffffffffu) emu_error("a shuffle with a partial member mask");
    emu_cur->op = OP_SHFL_IDX, emu_cur->val = v, emu_cur->mask = src;
    emu_yield(T_WARP);
    return (T)emu_cur->val;
}
/* vote.any: whether the predicate holds in any lane of the (full) warp, for every lane */
static inline int __any_sync(unsigned members, int pred) {
    if (members != 0xffffffffu) emu_error("a vote with a partial member mask");
    emu_cur->op = OP_VOTE_ANY, emu_cur->val = pred != 0;
    emu_yield(T_WARP);
    return emu_cur->val != 0;
}
static void emu_cp_async(uint32_t dst, const void *src, int bytes, bool fill) {
    emu_copy c = { dst, src, bytes, fill };
    if ((size_t)dst + bytes <= emu_smem_bytes) emu_shadow_write(dst, bytes, true);   /* outside: reported when it lands */
    emu_cur->open.push_back(c);
}
static inline void pr_cp_async16(uint32_t dst, const void *src, bool fill) { emu_cp_async(dst, src, 16, fill); }
static inline void pr_cp_async4(uint32_t dst, const void *src, bool fill) { emu_cp_async(dst, src, 4, fill); }
static inline void pr_cp_async_commit(void) {
    emu_cur->groups.push_back(emu_cur->open);
    emu_cur->open.clear();
}
static inline void emu_land(const std::vector<emu_copy> &g) {
    for (const emu_copy &c : g) {
        if (c.dst % c.bytes || c.dst + c.bytes > emu_smem_bytes) { emu_error("cp.async destination outside shared memory"); continue; }
        if (!emu_within(emu_inputs, c.src, c.bytes) || (uintptr_t)c.src % c.bytes) { emu_error("cp.async source outside the inputs or misaligned"); continue; }
        if (c.fill) memcpy(pr_dyn_smem + c.dst, c.src, c.bytes);
        else memset(pr_dyn_smem + c.dst, 0, c.bytes);
        emu_shadow_land(c.dst, c.bytes);
    }
}
/* cp.async.wait_group N: all but the newest N committed groups complete (one more stays pending
   under the planted fault). */
template <int N> static void pr_cp_async_wait(void) {
    const size_t keep = N + (fault_late_copies ? 1 : 0);
    emu_cur->waited = true;
    while (emu_cur->groups.size() > keep) {
        emu_land(emu_cur->groups.front());
        emu_cur->groups.erase(emu_cur->groups.begin());
    }
}
static inline float pr_lds_f32(const float *p) {
    const uint32_t a = pr_smem_u32(p);
    if (a % 4 || (size_t)a + 4 > emu_smem_bytes) {
        emu_error("shared-memory load misaligned or outside the launch's");
        return NAN;
    }
    emu_shadow_read(a, 4, (int)emu_cur->idx.x / 32, (int)emu_cur->idx.x);
    return *p;
}
static inline void pr_sts_b32(uint32_t addr, uint32_t v) {
    if (addr % 4 || (size_t)addr + 4 > emu_smem_bytes) {
        emu_error("shared-memory store misaligned or outside the launch's");
        return;
    }
    emu_shadow_write(addr, 4, false);
    emu_cur->stored = true;
    memcpy(pr_dyn_smem + addr, &v, 4);
}
/* The fused backward's atomics: blocks run one after another here, so a plain add; the target must
   lie in one of emu_accumulators. */
static inline void pr_red_add_f32(float *p, float v) {
    if (!emu_within(emu_accumulators, p, 4) || (uintptr_t)p % 4) {
        emu_error("atomic add outside the accumulator or misaligned");
        return;
    }
    *p += v;
}

/* ---------------------------------------------------------------- warpgroups (wgmma, sm_90a)
   A warpgroup is 4 consecutive warps; its instructions (wgmma.fence, mma_async, commit_group,
   wait_group) execute when all 128 threads have arrived at the same one, like the warp-collective
   ones, through wgmma_emu.h's reading of the PTX ISA's layouts (descriptors, swizzle, fragments).
   An mma_async is computed when issued from its operands as they are then, in mma.sync's
   arithmetic (each k16 block's 16 products summed exactly onto the accumulator, rounded once to
   fp32), and its result held back: its accumulators read NaN until the wait_group that retires
   its group writes them, so a kernel reading them early sees NaN; at that wait its shared-memory
   operands and A registers must still hold what they held at issue (a stage refilled, or P
   rewritten, under a wgmma in flight is reported). Checked too: the words a wgmma reads were
   fenced (fence.proxy.async) by the thread whose copy or store wrote them, after it landed; a
   wgmma.fence came before the first mma_async after a wait_group. */
#include "wgmma_emu.h"
static void emu_proxy_fence(void) {
    for (uint32_t w : emu_cur->unfenced)
        if (emu_shadow[w].writer == (int)emu_cur->idx.x && emu_shadow[w].landed >= 0) emu_shadow[w].unfenced = false;
    emu_cur->unfenced.clear();
}
static inline void pr_fence_proxy_async(void) {
    if (fault_skip_proxy_fence) return;
    if (fault_late_proxy_fence) { emu_cur->fence_due = true; return; }
    emu_proxy_fence();
}
static void emu_wg_yield(int op) {
    emu_cur->wg_op = op;
    emu_yield(T_WG);
}
static inline void pr_wg_fence(void) { emu_wg_yield(WG_FENCE); }
static inline void pr_wg_commit(void) { emu_wg_yield(WG_COMMIT); }
template <int N> static inline void pr_wg_wait(void) {
    emu_cur->wg_wait = N;
    emu_wg_yield(WG_WAIT);
}
static inline void __trap(void) { emu_error("trap"); }
template <int N> static inline void pr_wg_hold(float *) {}
template <int N> static inline void pr_wg_hold(uint32_t *) {}
static void emu_wg_mma(float *d, int n, const uint32_t *a, uint64_t da, uint64_t db) {
    emu_cur->wg_d = d, emu_cur->wg_n = n, emu_cur->wg_a = a, emu_cur->wg_da = da, emu_cur->wg_db = db;
    emu_wg_yield(WG_MMA);
}
static inline void pr_wg_ss64(float d[32], uint64_t da, uint64_t db) { emu_wg_mma(d, 64, NULL, da, db); }
template <int N> static inline void pr_wg_rs(float *d, const uint32_t a[4], uint64_t db) { emu_wg_mma(d, N, a, 0, db); }

/* A warpgroup's mma_async in flight: per thread its accumulators, their value once retired, and
   its A registers; the shared-memory elements it read, with their values. */
struct emu_wg_mma_op {
    int group;                                    /* commit_group count at issue: retired by a wait that covers it */
    float *d[128];
    std::vector<float> result[128];
    const uint32_t *a[128];
    uint32_t a_val[128][4];
    std::vector<uint32_t> addr;
    std::vector<uint16_t> val;
};
struct emu_wg_state { std::vector<emu_wg_mma_op> ops; int commits; bool fenced; };
static emu_wg_state emu_wgs[32];
static long emu_n_wgmma;                          /* mma_async executed, per warpgroup */

static bool emu_wg_read(emu_wg_mma_op &op, uint64_t desc, int mn, int k, int mn_major, double *v) {
    const uint32_t a = emu_wgmma_smem_addr(desc, mn, k, mn_major, 2);
    if (a == EMU_WGMMA_BAD || a % 2 || (size_t)a + 2 > emu_smem_bytes) { emu_error("wgmma operand outside shared memory"); return false; }
    if (emu_shadow[a / 4].unfenced || emu_shadow[a / 4].stale) {
        emu_error("wgmma reads shared memory its writer did not fence (fence.proxy.async) after it landed and before the barrier");
        return false;
    }
    uint16_t bits;
    memcpy(&bits, pr_dyn_smem + a, 2);
    op.addr.push_back(a), op.val.push_back(bits);
    *v = bf16_value(bits);
    return true;
}
/* Writes back what the retired ops computed, checking their operands held still. */
static void emu_wg_retire(emu_thread *t, emu_wg_state &s, int upto) {
    for (size_t i = 0; i < s.ops.size();) {
        emu_wg_mma_op &op = s.ops[i];
        if (op.group >= upto) { i++; continue; }
        for (size_t e = 0; e < op.addr.size(); e++) {
            uint16_t now;
            memcpy(&now, pr_dyn_smem + op.addr[e], 2);
            if (now != op.val[e]) { emu_cur = t; emu_error("shared memory under a wgmma in flight changed before its wait_group"); break; }
        }
        bool later = false;                       /* a later op in flight on the same accumulators writes them */
        for (size_t j = i + 1; j < s.ops.size(); j++) later = later || s.ops[j].d[0] == op.d[0];
        for (int l = 0; l < 128; l++) {
            if (op.a[l] && memcmp(op.a[l], op.a_val[l], sizeof op.a_val[l])) { emu_cur = &t[l]; emu_error("A registers of a wgmma in flight changed before its wait_group"); }
            if (!later) memcpy(op.d[l], op.result[l].data(), sizeof(float) * op.result[l].size());
        }
        s.ops.erase(s.ops.begin() + (long)i);
    }
}
static void emu_wg_op(emu_thread *t, int wgi) {   /* t[0..127], all arrived at a warpgroup instruction */
    emu_wg_state &s = emu_wgs[wgi];
    const int op = t[0].wg_op;
    for (int l = 1; l < 128; l++)
        if (t[l].wg_op != op || (op == WG_WAIT && t[l].wg_wait != t[0].wg_wait) ||
            (op == WG_MMA && (t[l].wg_da != t[0].wg_da || t[l].wg_db != t[0].wg_db || t[l].wg_n != t[0].wg_n || !t[l].wg_a != !t[0].wg_a))) {
            emu_cur = &t[l];
            emu_error("threads of a warpgroup at different instructions or operands");
            return;
        }
    emu_cur = &t[0];
    if (op == WG_FENCE) s.fenced = true;
    else if (op == WG_COMMIT) s.commits++;
    else if (op == WG_WAIT) {
        if (!fault_wgmma_unwaited) emu_wg_retire(t, s, s.commits - t[0].wg_wait);
        s.fenced = false;
    } else {
        if (!s.fenced) { emu_error("wgmma.mma_async without a wgmma.fence since the last wait_group"); return; }
        const int n = t[0].wg_n;
        emu_wg_mma_op x;
        x.group = s.commits;
        double A[64][16], B[256][16];
        for (int r = 0; r < 64; r++)
            for (int k = 0; k < 16 && !t[0].wg_a; k++)
                if (!emu_wg_read(x, t[0].wg_da, r, k, 0, &A[r][k])) return;
        for (int l = 0; l < 128; l++) {
            x.d[l] = t[l].wg_d, x.a[l] = t[l].wg_a;
            if (!t[l].wg_a) continue;
            memcpy(x.a_val[l], t[l].wg_a, sizeof x.a_val[l]);
            for (int i = 0; i < 8; i++) {
                int r, c;
                emu_wgmma_a_coord(l, i, &r, &c);
                A[r][c] = bf16_value((uint16_t)(x.a_val[l][i / 2] >> (16 * (i % 2))));
            }
        }
        for (int c = 0; c < n; c++)
            for (int k = 0; k < 16; k++)
                if (!emu_wg_read(x, t[0].wg_db, c, k, t[0].wg_a ? 1 : 0, &B[c][k])) return;
        for (size_t e = 0; e < x.addr.size(); e++)           /* read for all four warps, asynchronously */
            for (int w = 0; w < 4; w++) emu_shadow_read(x.addr[e] & ~3u, 4, (int)t[0].idx.x / 32 + w, -1);
        const emu_wg_mma_op *prev = NULL;         /* the accumulators' input: the last op in flight on them, or the registers */
        for (const emu_wg_mma_op &o : s.ops)
            if (o.d[0] == x.d[0]) prev = &o;
        for (int l = 0; l < 128; l++) {
            x.result[l].resize(n / 2);
            for (int i = 0; i < n / 2; i++) {
                int r, c;
                emu_wgmma_d_coord(l, i, &r, &c);
                double acc = prev ? prev->result[l][i] : x.d[l][i];
                for (int k = 0; k < 16; k++) acc += A[r][k] * B[c][k];
                x.result[l][i] = (float)acc;
            }
            for (int i = 0; i < n / 2; i++) x.d[l][i] = NAN;
        }
        s.ops.push_back(std::move(x));
        emu_n_wgmma++;
    }
    for (int l = 0; l < 128; l++) t[l].state = T_RUN;
}

/* ================================================================ the block scheduler */
static long emu_n_ldsm, emu_n_mma;             /* ldmatrix.x4 and mma.sync executed, per warp */
static void emu_warp_op(emu_thread *lane) {   /* lane[0..31], all arrived at the same op */
    const int op = lane[0].op;
    for (int l = 1; l < 32; l++)
        if (lane[l].op != op) { emu_cur = &lane[l]; emu_error("lanes of a warp at different instructions"); return; }
    if (op == OP_LDSM || op == OP_LDSM_T) {
        uint32_t addr[32], out[32][4];
        for (int l = 0; l < 32; l++) addr[l] = lane[l].addr;
        for (int l = 0; l < 32; l++)
            if ((size_t)addr[l] + 16 > emu_smem_bytes) { emu_cur = &lane[l]; emu_error("ldmatrix address outside shared memory"); return; }
        emu_cur = &lane[0];
        for (int l = 0; l < 32; l++) emu_shadow_read(addr[l], 16, (int)lane[0].idx.x / 32, -1);
        emu_n_ldsm++;
        emu_ldmatrix(out, (const uint16_t *)pr_dyn_smem, emu_smem_bytes / 2, addr, 4, op == OP_LDSM_T && !fault_ignore_trans);
        for (int l = 0; l < 32; l++) memcpy(lane[l].regs, out[l], sizeof out[l]);
    } else if (op == OP_MMA) {
        uint32_t a[32][4], b[32][2];
        float c[32][4], d[32][4];
        for (int l = 0; l < 32; l++) {
            memcpy(a[l], lane[l].a, sizeof a[l]);
            b[l][0] = lane[l].b0, b[l][1] = lane[l].b1;
            memcpy(c[l], lane[l].d, sizeof c[l]);
        }
        emu_mma(d, a, b, c);
        emu_n_mma++;
        for (int l = 0; l < 32; l++) memcpy(lane[l].d, d[l], sizeof d[l]);
    } else if (op == OP_VOTE_ANY) {
        bool any = false;
        for (int l = 0; l < 32; l++) any = any || lane[l].val != 0;
        for (int l = 0; l < 32; l++) lane[l].val = any;
    } else {
        double v[32];
        for (int l = 0; l < 32; l++) v[l] = lane[l].val;
        for (int l = 0; l < 32; l++) lane[l].val = v[op == OP_SHFL ? l ^ lane[l].mask : lane[l].mask & 31];   /* shfl.sync.bfly, .idx */
    }
    for (int l = 0; l < 32; l++) lane[l].state = T_RUN;
}

static void emu_fiber(void) {
#if EMU_FAST_SWITCH && EMU_SANITIZED
    __sanitizer_finish_switch_fiber(NULL, &emu_sched_stack, &emu_sched_stack_size);   /* the first switch in */
#endif
    (*emu_body)();
    size_t pending = emu_cur->open.size();
    for (const std::vector<emu_copy> &g : emu_cur->groups) pending += g.size();
    if (pending) emu_error("the thread ends with cp.async copies it never waited for");
    if (emu_cur->idx.x % 128 == 0 && !emu_wgs[emu_cur->idx.x / 128].ops.empty()) emu_error("the warpgroup ends with a wgmma it never waited for");
    emu_cur->state = T_DONE;
    emu_to_scheduler(true);
    abort();                                     /* never resumed */
}

/* The order blocks, warps and lanes run in: the running launch's, from PR_EMU_ORDER (see the top). */
static bool emu_reversed;
static bool emu_order_env(void) {
    static bool warned;
    const char *v = getenv("PR_EMU_ORDER");
    const bool reversed = v && !strcmp(v, "reverse");
    if (v && !reversed && strcmp(v, "forward") && !warned) {
        warned = true;
        fprintf(stderr, "emulated device: PR_EMU_ORDER=%s is neither forward nor reverse; running forward\n", v);
    }
    return reversed;
}
/* The i-th of n in the launch's order. */
static unsigned emu_nth(unsigned i, unsigned n) { return emu_reversed ? n - 1 - i : i; }

/* Runs one block of `threads` threads (a multiple of 32) to its end. */
static void emu_run_block(unsigned threads) {
    const size_t stack = 128 * 1024;
    emu_threads.resize(threads);
    /* grown, never shrunk: a resize back up would zero the stacks again (a 1024-thread block's
       128 MiB at every launch that follows a smaller block's) */
    if (emu_stacks.size() < stack * threads) {
        emu_stacks.clear();                      /* nothing copied: the old stacks hold dead frames (poisoned, under the sanitizer) */
        emu_stacks.resize(stack * threads);
    }
    for (unsigned t = 0; t < threads; t++) {
        emu_thread &e = emu_threads[t];
        /* each stack's top a cache line further down than the last one's: tops a whole stack apart
           would all fall in the same cache sets, and the lanes of a warp, run in turn, evict each other */
        const size_t size = stack - 64 * (t % 64);
        e.idx.x = t, e.idx.y = e.idx.z = 0;
        e.state = T_RUN;
        e.open.clear();
        e.groups.clear();
        e.waited = e.stored = false;
        e.unfenced.clear();
        e.fence_due = false;
#if EMU_FAST_SWITCH
        /* the first switch pops six zero registers and returns into emu_fiber, which then sees the
           stack as a called function does (rsp = 8 mod 16) */
        e.stack = emu_stacks.data() + stack * t, e.stack_size = size;
        e.fake_stack = NULL;
        uintptr_t top = ((uintptr_t)(e.stack + size) & ~(uintptr_t)15) - 8;
        void **sp = (void **)top;
        *--sp = (void *)emu_fiber;
        for (int r = 0; r < 6; r++) *--sp = NULL;
        e.sp = sp;
#else
        getcontext(&e.ctx);
        e.ctx.uc_stack.ss_sp = emu_stacks.data() + stack * t;
        e.ctx.uc_stack.ss_size = size;
        e.ctx.uc_link = &emu_sched;
        makecontext(&e.ctx, emu_fiber, 0);
#endif
    }
    for (unsigned g = 0; g < threads / 128; g++) emu_wgs[g].ops.clear(), emu_wgs[g].commits = 0, emu_wgs[g].fenced = false;
    /* Each warp in turn runs until its lanes wait at a barrier or end (warps may interleave in any
       way between barriers; racecheck between warps does not depend on the order chosen), then the barrier
       releases. */
    for (;;) {
        for (unsigned wi = 0; wi < threads / 32; wi++) {
            emu_thread *lane = &emu_threads[32 * emu_nth(wi, threads / 32)];
            for (;;) {
                for (unsigned li = 0; li < 32; li++) {
                    emu_thread *t = &lane[emu_nth(li, 32)];
                    if (t->state == T_RUN) emu_to_fiber(t);
                }
                int at = 0;
                for (int l = 0; l < 32; l++) at += lane[l].state == T_WARP;
                if (!at) break;
                if (at < 32) { emu_cur = lane; emu_error("warp divergence at a warp-collective instruction"); return; }
                const int errors = emu_errors;
                emu_warp_op(lane);
                if (emu_errors != errors) return;
            }
        }
        bool moved = false;                       /* warpgroups all of whose threads wait at a warpgroup instruction */
        for (unsigned g = 0; g < threads / 128; g++) {
            emu_thread *t = &emu_threads[128 * g];
            int at = 0;
            for (int l = 0; l < 128; l++) at += t[l].state == T_WG;
            if (at < 128) continue;
            const int errors = emu_errors;
            emu_wg_op(t, (int)g);
            if (emu_errors != errors) return;
            moved = true;
        }
        if (moved) continue;
        unsigned bar = 0, done = 0;
        for (unsigned t = 0; t < threads; t++) bar += emu_threads[t].state == T_BAR, done += emu_threads[t].state == T_DONE;
        if (done == threads) return;
        if (bar == threads) {
            for (unsigned t = 1; t < threads; t++)
                if (emu_threads[t].bar_line != emu_threads[0].bar_line || strcmp(emu_threads[t].bar_file, emu_threads[0].bar_file)) {
                    char what[400];
                    snprintf(what, sizeof what, "threads of a block wait at different __syncthreads: %s:%d and thread 0 at %s:%d",
                             emu_threads[t].bar_file, emu_threads[t].bar_line, emu_threads[0].bar_file, emu_threads[0].bar_line);
                    emu_cur = &emu_threads[t];
                    emu_error(what);
                    return;
                }
            for (unsigned t = 0; t < threads; t++) {      /* what this barrier publishes unfenced stays so */
                for (uint32_t w : emu_threads[t].unfenced)
                    if (emu_shadow[w].unfenced) emu_shadow[w].stale = true;
                emu_threads[t].unfenced.clear();
            }
            emu_epoch++;
            for (unsigned t = 0; t < threads; t++) emu_threads[t].state = T_RUN;
            continue;
        }
        emu_cur = &emu_threads[0];
        emu_error("deadlock: threads at a barrier while others have ended");
        return;
    }
}

/* One writer: each element of a launch's outputs changed by at most one of its blocks, the claim
   the kernels' determinism rests on (blocks run one after another here, so two writers of one
   element would both be seen, where on the GPU one could lose the other's update). */
struct emu_out { const char *name; void *p; size_t n, elem; };
static long emu_multi_writers;

/* Runs the grid, blocks one after another, each from NaN-filled shared memory, in the order
   `reversed` says (by default the environment's now); returns the races its blocks showed. */
template <typename F>
static long emu_launch(unsigned gx, unsigned gy, unsigned threads, size_t smem, const std::vector<emu_out> &outs, F f,
                       bool reversed = emu_order_env()) {
    std::function<void()> body = f;
    emu_body = &body;
    emu_smem_bytes = smem;
    if (smem > EMU_SMEM_MAX) { emu_error("dynamic shared memory over the emulator's"); return 0; }
    emu_grid.x = gx, emu_grid.y = gy, emu_grid.z = 1;
    emu_bdim.x = threads, emu_bdim.y = emu_bdim.z = 1;
    const long races0 = emu_races;
    emu_reversed = reversed;
    std::vector<std::vector<long>> owner(outs.size());
    std::vector<std::vector<unsigned char>> before(outs.size());
    for (size_t o = 0; o < outs.size(); o++) owner[o].assign(outs[o].n, -1);
    for (unsigned yi = 0; yi < gy && emu_errors == 0; yi++)
        for (unsigned xi = 0; xi < gx && emu_errors == 0; xi++) {
            const unsigned x = emu_nth(xi, gx), y = emu_nth(yi, gy);
            emu_block.x = x, emu_block.y = y, emu_block.z = 0;
            memset(pr_dyn_smem, 0xFF, smem);
            emu_shadow_reset(smem);
            for (size_t o = 0; o < outs.size(); o++) {
                const unsigned char *p = (const unsigned char *)outs[o].p;
                before[o].assign(p, p + outs[o].n * outs[o].elem);
            }
            emu_run_block(threads);
#if EMU_FAST_SWITCH && EMU_SANITIZED
            /* The frames still on a fiber's stack when its block ends (a finished thread's last
               switch; a whole kernel's where a fault cut the block short) keep their poisoned
               shadow, where the next block's fibers start afresh. */
            for (unsigned t = 0; t < threads; t++) {
                const emu_thread &e = emu_threads[t];
                __asan_unpoison_memory_region(e.sp, (size_t)(e.stack + e.stack_size - (char *)e.sp));
            }
#endif
            const long id = (long)y * gx + x;
            for (size_t o = 0; o < outs.size(); o++) {
                const size_t el = outs[o].elem;
                const unsigned char *p = (const unsigned char *)outs[o].p;
                for (size_t i = 0; i < outs[o].n; i++) {
                    if (!memcmp(p + i * el, &before[o][i * el], el)) continue;
                    if (owner[o][i] >= 0 && owner[o][i] != id)
                        EMU_FAULT(emu_multi_writers, "blocks %ld and %ld of one launch both write element %zu of %s", owner[o][i], id, i, outs[o].name);
                    owner[o][i] = id;
                }
            }
        }
    return emu_races - races0;
}

#endif
