/* nccl_emu.h — an emulated NCCL for the emulated device (test/cuda_emu.h): the ranks of a world
   are processes on this host, one per emulated GPU, as train_cuda runs on a real node (RANK,
   WORLD_SIZE, LOCAL_RANK, --nccl-id). It gives the NCCL communicator in prefixreuse_cuda.cu and
   train_cuda's launch path their first run with more than one rank, which one lent GPU cannot.

   What NCCL's documentation defines, and no more:
     - a communicator's members meet in a POSIX shared-memory segment named by the unique id (a
       split's segment by its parent's name, the split's number and the colour); the last member
       to attach removes the name (a member that finds the segment's size or its own rank taken
       removes it too), so a finished or failed launch leaves nothing behind;
     - every pair of ranks (a rank with itself too) has a one-way mailbox of EMU_NCCL_CHUNK bytes:
       a send waits for it to be empty and fills it, a receive waits for it to be full and drains
       it, chunk by chunk, so messages of any size pass in order; each chunk carries its message's
       size, and a receive of another size faults (NCCL matches a send with one receive);
     - a send ends only once its receive has drained the last chunk, whatever its size ("blocking
       for the GPU": a program that needs a send to end before its peer receives deadlocks here,
       as it may on NCCL), and a message of 0 bytes is one empty chunk, paired with its receive as
       NCCL pairs it; an empty collective is discarded, as NCCL discards it;
     - collectives and the sends and receives between ncclGroupStart and ncclGroupEnd are queued
       on the stream like kernels and run when the stream does; a group's operations progress
       together (an all-to-all does not wait for one peer before serving the next);
     - all-gather and reduce-scatter are sends and receives to and from every rank; a sum adds the
       ranks' contributions in rank order on every rank, in the type's own arithmetic (bf16 rounded
       after each addition, as a ring's steps round), so every rank holds the same bits;
     - buffers outside the device's allocations are refused (ncclInvalidArgument, the CUDA context
       unharmed), and so are a collective's send and receive buffers that overlap other than in
       place as NCCL defines it (all-reduce: the same buffer; all-gather: send at recv + rank x
       count; reduce-scatter: recv at send + rank x count), which NCCL does not check and works
       through as they lie; counts that do not match between a send and its receive, and a rank
       that never comes (EMU_NCCL_WAIT_S without progress), are device faults;
     - ncclCommDestroy and ncclCommSplit first run the work queued on every stream, as NCCL
       finishes a communicator's operations before either;
     - an operation whose peers have not come leaves cudaStreamQuery not ready (each query moves
       what it can); ncclCommAbort ends the communicator's queued operations where they stand,
       their buffers as far as they got, and frees it;
     - a member whose process has ended without destroying the communicator (killed, or exited
       on an error) makes ncclCommGetAsyncError report ncclRemoteError to the others, as NCCL's
       network transports report a peer's closed connection; a stopped process is no error (only
       a timeout finds it), nor one that destroyed the communicator before it ended;
     - non-blocking communicators (ncclConfig_t.blocking = 0, or NCCL_COMM_BLOCKING, which NCCL
       lets override the configuration, set to 0 or 1): ncclCommInitRankConfig returns
       ncclInProgress at once, and ncclCommGetAsyncError reports ncclInProgress until every member
       has come, with no limit of its own (ncclCommAbort ends the wait, and leaves no segment
       behind); a call returns ncclInProgress and its operation reaches the stream only once
       ncclCommGetAsyncError has said ncclSuccess, which it says at its second look (a program that
       waits for the stream before then would find it done without the operation: here such a
       wait is a device fault, test/cuda_emu.h's `held`); a call on a communicator still in
       progress is refused (ncclInvalidArgument, as NCCL's "use before the previous operation
       returned ncclSuccess"), and so is its destroy; ncclCommSplit of a
       non-blocking parent sets *newcomm to NULL and returns ncclSuccess (as NCCL's source does;
       its documentation says ncclInProgress), and the parent reports ncclInProgress until the
       members of the new communicator have all come, when *newcomm is set (a new communicator is
       blocking or not as its configuration says, or as its parent where the configuration is
       NULL); a split that fails, or whose parent is aborted, still sets *newcomm, to the
       communicator it was making or to one that reports the failure, for the caller to abort, as
       NCCL's thread does at its end.
   Not emulated: the ring and tree algorithms' own summation orders, reductions other than the sum.
   test/test_cuda_emu.cc checks these rules on worlds of two and three processes. */
#ifndef PR_NCCL_EMU_H
#define PR_NCCL_EMU_H
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <string>

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;
typedef enum { ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9 } ncclDataType_t;
typedef enum { ncclSum = 0 } ncclRedOp_t;
#define NCCL_UNIQUE_ID_BYTES 128
#define NCCL_SPLIT_NOCOLOR -1
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
/* A configuration: the blocking attribute alone. */
#define NCCL_CONFIG_UNDEF_INT INT_MIN
typedef struct { int blocking; } ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER { NCCL_CONFIG_UNDEF_INT }

enum { EMU_NCCL_CHUNK = 64 << 10, EMU_NCCL_MAX_RANKS = 64, EMU_NCCL_WAIT_S = 300 };

/* The shared segment: a header, then size x size mailboxes, mailbox (from, to) at from * size + to.
   Its fields are accessed with atomics only where another process writes them. */
struct emu_nccl_box { uint32_t full; uint32_t pad; uint64_t bytes, message; unsigned char data[EMU_NCCL_CHUNK]; };
struct emu_nccl_shm {
    uint32_t size, attached, joined[EMU_NCCL_MAX_RANKS];
    int32_t pid[EMU_NCCL_MAX_RANKS];            /* each member's process; 0 once it destroyed the communicator */
    emu_nccl_box box[1];
};
/* One side of a message: `bytes` from or into buf, moved chunk by chunk (`chunks` of them so far). */
struct emu_nccl_p2p { bool send; int peer; unsigned char *buf; size_t bytes, moved, chunks; bool done; };
struct emu_nccl_split_job;
struct ncclComm {
    emu_nccl_shm *shm;
    size_t map_bytes;
    int rank, size, splits;
    bool aborted;                               /* ncclCommAbort: its queued operations end at once */
    bool blocking;
    bool joining;                               /* non-blocking: not every member has come yet */
    ncclResult_t async;                         /* what ncclCommGetAsyncError reports, once a member's process ended */
    double looked;                              /* when the members' processes were last looked at */
    std::string name;
    /* non-blocking: the operations of the last call and their stream, queued at its second look
       (each counted in its stream's `held` meanwhile) */
    std::vector<std::pair<cudaStream_t, std::function<bool(bool)>>> deferred;
    int deferred_looks;
    std::shared_ptr<emu_nccl_split_job> split;  /* non-blocking: a split under way */
};
typedef struct ncclComm *ncclComm_t;

static inline const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result";
}

static size_t emu_nccl_map_bytes(int size) { return offsetof(emu_nccl_shm, box) + sizeof(emu_nccl_box) * (size_t)size * (size_t)size; }

/* Waiting for another process: yields, then sleeps a little between looks (a waiting rank leaves
   the cores to the ranks that compute), and after EMU_NCCL_WAIT_S without progress gives up. */
static double emu_nccl_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
struct emu_nccl_wait {
    double since = emu_nccl_now();
    unsigned idle = 0;
    void progressed(void) { since = emu_nccl_now(), idle = 0; }
    bool expired(void) {
        if (idle++ < 1000) sched_yield();
        else {
            const struct timespec nap = { 0, 50000 };
            nanosleep(&nap, NULL);
        }
        return emu_nccl_now() - since > EMU_NCCL_WAIT_S;
    }
};

static ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    static unsigned count;
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "/pr-nccl-emu-%ld-%u-%ld", (long)getpid(), count++, (long)t.tv_nsec);
    return ncclSuccess;
}

/* Whether blocking, as NCCL decides it: NCCL_COMM_BLOCKING set to 0 or 1 (strtoll's reading)
   first, then the configuration, else `inherit`. 0 where the configuration's value is neither
   0 nor 1 (NCCL refuses it). */
static int emu_nccl_blocking(const ncclConfig_t *config, bool inherit, bool *blocking) {
    const char *env = getenv("NCCL_COMM_BLOCKING");
    const long long forced = env && *env ? strtoll(env, NULL, 0) : -1;
    if (config && config->blocking != NCCL_CONFIG_UNDEF_INT && config->blocking != 0 && config->blocking != 1) return 0;
    *blocking = forced == 0 || forced == 1 ? forced == 1 : config && config->blocking != NCCL_CONFIG_UNDEF_INT ? config->blocking == 1 : inherit;
    return 1;
}

static bool emu_nccl_all_came(const ncclComm *c) { return __atomic_load_n(&c->shm->attached, __ATOMIC_ACQUIRE) >= (uint32_t)c->size; }

/* Opens (or creates) the segment `name` for a communicator of `size` and takes rank's place in it;
   the last to attach removes the name. A blocking communicator then waits for all of its
   members; a non-blocking one returns ncclInProgress with *out set (ncclCommGetAsyncError
   reports ncclSuccess once they have all come). */
static ncclResult_t emu_nccl_attach(ncclComm_t *out, const std::string &name, int size, int rank, bool blocking) {
    if (size < 1 || size > EMU_NCCL_MAX_RANKS || rank < 0 || rank >= size || name.size() > 200) return ncclInvalidArgument;
    const size_t bytes = emu_nccl_map_bytes(size);
    int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd < 0) return ncclSystemError;
    struct stat sb;
    void *p = MAP_FAILED;                       /* a new segment is sized once; one of another size is not ours */
    if (fstat(fd, &sb) == 0 && ((size_t)sb.st_size == bytes || (sb.st_size == 0 && ftruncate(fd, (off_t)bytes) == 0)))
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(name.c_str());
        return ncclInvalidUsage;
    }
    emu_nccl_shm *shm = (emu_nccl_shm *)p;
    uint32_t expect = 0, free_slot = 0;
    __atomic_compare_exchange_n(&shm->size, &expect, (uint32_t)size, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    ncclResult_t r = ncclSuccess;
    if (__atomic_load_n(&shm->size, __ATOMIC_ACQUIRE) != (uint32_t)size) r = ncclInvalidUsage;   /* members disagree on the size */
    else if (!__atomic_compare_exchange_n(&shm->joined[rank], &free_slot, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        r = ncclInvalidUsage;                   /* two members with one rank */
    else {
        __atomic_store_n(&shm->pid[rank], (int32_t)getpid(), __ATOMIC_RELEASE);
        if (__atomic_add_fetch(&shm->attached, 1, __ATOMIC_ACQ_REL) == (uint32_t)size) shm_unlink(name.c_str());
    }
    emu_nccl_wait w;
    while (r == ncclSuccess && blocking && __atomic_load_n(&shm->attached, __ATOMIC_ACQUIRE) < (uint32_t)size)
        if (w.expired()) r = ncclSystemError;
    if (r != ncclSuccess) {
        shm_unlink(name.c_str());
        munmap(p, bytes);
        return r;
    }
    ncclComm *c = new ncclComm;
    c->shm = shm;
    c->map_bytes = bytes;
    c->rank = rank;
    c->size = size;
    c->splits = 0;
    c->aborted = false;
    c->blocking = blocking;
    c->joining = !blocking;
    c->async = ncclSuccess;
    c->looked = 0.0;
    c->name = name;
    c->deferred_looks = 0;
    *out = c;
    return blocking ? ncclSuccess : ncclInProgress;
}

/* Whether a call on c must be refused: a non-blocking communicator whose last call is still in
   progress (NCCL's ncclCommEnsureReady). */
static bool emu_nccl_busy(const ncclComm *c) {
    if (!c->joining && c->deferred.empty() && !c->split) return false;
    fprintf(stderr, "emulated NCCL: a communicator used before its previous operation returned ncclSuccess\n");
    return true;
}

static ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
    bool blocking = true;
    if (!emu_nccl_blocking(config, true, &blocking)) return ncclInvalidArgument;
    id.internal[NCCL_UNIQUE_ID_BYTES - 1] = 0;
    if (id.internal[0] != '/') return ncclInvalidArgument;
    return emu_nccl_attach(comm, id.internal, nranks, rank, blocking);
}
static inline ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, nranks, id, rank, NULL);
}
static ncclResult_t ncclCommUserRank(const ncclComm_t c, int *rank) { *rank = c->rank; return ncclSuccess; }
static ncclResult_t ncclCommCount(const ncclComm_t c, int *count) { *count = c->size; return ncclSuccess; }
static void emu_nccl_free(ncclComm_t c) {
    for (auto &d : c->deferred)                 /* an abort drops a call not yet queued */
        if (emu_known_stream(d.first)) d.first->held--;
    if (c->shm) {
        if (!c->aborted) __atomic_store_n(&c->shm->pid[c->rank], 0, __ATOMIC_RELEASE);   /* it left in order */
        if (!emu_nccl_all_came(c)) shm_unlink(c->name.c_str());   /* an aborted wait for the members: no segment left behind */
        munmap(c->shm, c->map_bytes);
    }
    delete c;
}
static ncclResult_t ncclCommDestroy(ncclComm_t c) {
    if (c && emu_nccl_busy(c)) return ncclInvalidArgument;
    emu_run_all();
    if (c) emu_nccl_free(c);
    return ncclSuccess;
}
/* A split under way on a non-blocking parent: the members' colours and keys going round the parent,
   then this member's place in the new communicator while the others come. */
struct emu_nccl_split_job {
    int color, key, index;
    bool blocking;                              /* the new communicator's */
    ncclComm_t *out;
    int mine[2];
    std::vector<int> all;
    std::vector<emu_nccl_p2p> ops;
    ncclComm_t child = NULL;
};
/* The end of a split that failed (r) or whose parent is aborted: *newcomm gets the communicator it
   was making, or one that reports r where it had none yet, for the caller to abort. */
static void emu_nccl_split_fail(ncclComm_t c, ncclResult_t r) {
    emu_nccl_split_job &j = *c->split;
    if (j.color != NCCL_SPLIT_NOCOLOR) {
        ncclComm_t made = j.child ? j.child : new ncclComm();   /* no segment: a communicator in name only */
        made->async = r;
        *j.out = made;
    }
    c->split.reset();
}
/* Its queued operations end where they stand (the streams go on past them), then it is freed; a
   split under way ends with it, and a wait for the members too. */
static ncclResult_t ncclCommAbort(ncclComm_t c) {
    if (!c) return ncclSuccess;
    c->aborted = true;
    if (c->split) emu_nccl_split_fail(c, ncclInternalError);
    emu_run_all();
    emu_nccl_free(c);
    return ncclSuccess;
}
/* Whether process pid has ended: gone, or a zombie its parent has not reaped yet (Linux's /proc;
   the state follows the command's name, which may hold spaces and parentheses). */
static bool emu_nccl_process_ended(int pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return errno == ENOENT;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *end = strrchr(buf, ')');
    return end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}
static void emu_nccl_split_step(ncclComm_t c);
/* The members' processes are looked at every 10 ms at most: pr_nccl_wait asks between naps of 20 us.
   On a non-blocking communicator: ncclInProgress while its members come, while a split of it is
   under way, and at the first look after a call, whose operations reach the stream at the second. */
static ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *r) {
    if (!c || !r) return ncclInvalidArgument;
    const double now = emu_nccl_now();
    if (c->async == ncclSuccess && now - c->looked >= 0.01) {
        c->looked = now;
        for (int q = 0; q < c->size; q++) {
            const int pid = __atomic_load_n(&c->shm->pid[q], __ATOMIC_ACQUIRE);
            if (q != c->rank && pid > 0 && emu_nccl_process_ended(pid)) c->async = ncclRemoteError;
        }
    }
    if (c->async == ncclSuccess && c->joining) c->joining = !emu_nccl_all_came(c);
    if (c->async == ncclSuccess && c->split) emu_nccl_split_step(c);
    if (c->async == ncclSuccess && !c->deferred.empty() && c->deferred_looks++ > 0) {
        for (auto &d : c->deferred) {
            d.first->held--;
            emu_enqueue_resumable(d.first, d.second);
        }
        c->deferred.clear();
        c->deferred_looks = 0;
    }
    *r = c->async != ncclSuccess ? c->async : c->joining || c->split || !c->deferred.empty() ? ncclInProgress : ncclSuccess;
    return ncclSuccess;
}

/* ================================================================ point to point */
/* A message's chunks: at least one, so that a message of 0 bytes still meets its receive. */
static size_t emu_nccl_chunks(size_t bytes) { return bytes ? (bytes + EMU_NCCL_CHUNK - 1) / EMU_NCCL_CHUNK : 1; }

/* Moves what it can of ops, all of them at once: a send or receive starts only after the earlier
   ones in ops to or from the same peer. `block`: until every one is done (or the communicator
   is aborted, or the wait gives up with a device fault); else in one pass. */
enum emu_nccl_state { EMU_NCCL_PENDING, EMU_NCCL_DONE, EMU_NCCL_FAILED };
static emu_nccl_state emu_nccl_progress(ncclComm_t c, std::vector<emu_nccl_p2p> &ops, const char *what, bool block) {
    emu_nccl_wait w;
    for (;;) {
        if (c->aborted) return EMU_NCCL_FAILED;
        bool pending = false;
        for (size_t k = 0; k < ops.size(); k++) {
            emu_nccl_p2p &o = ops[k];
            bool earlier = false;
            for (size_t i = 0; i < k && !earlier; i++) earlier = ops[i].send == o.send && ops[i].peer == o.peer && !ops[i].done;
            if (o.done || earlier) {
                pending |= !o.done;
                continue;
            }
            emu_nccl_box *b = &c->shm->box[o.send ? c->rank * c->size + o.peer : o.peer * c->size + c->rank];
            const bool all_sent = o.send && o.chunks == emu_nccl_chunks(o.bytes);
            if (all_sent) {                     /* only this rank fills the box: empty again, its last chunk was taken */
                if (__atomic_load_n(&b->full, __ATOMIC_ACQUIRE) == 0u) o.done = true, w.progressed();
            } else if (__atomic_load_n(&b->full, __ATOMIC_ACQUIRE) == (o.send ? 0u : 1u)) {
                if (o.send) {
                    const size_t n = o.bytes - o.moved < (size_t)EMU_NCCL_CHUNK ? o.bytes - o.moved : (size_t)EMU_NCCL_CHUNK;
                    if (n) memcpy(b->data, o.buf + o.moved, n);   /* an empty message's buffer may be NULL */
                    b->bytes = n;
                    b->message = o.bytes;
                    o.moved += n;
                } else {
                    if (b->message != o.bytes) {
                        emu_device_fault("%s: rank %d receives %llu bytes from rank %d, a message of %llu", what, c->rank,
                                         (unsigned long long)o.bytes, o.peer, (unsigned long long)b->message);
                        return EMU_NCCL_FAILED;
                    }
                    if (b->bytes) memcpy(o.buf + o.moved, b->data, b->bytes);
                    o.moved += b->bytes;
                }
                o.chunks++;
                o.done = !o.send && o.chunks == emu_nccl_chunks(o.bytes);
                __atomic_store_n(&b->full, o.send ? 1u : 0u, __ATOMIC_RELEASE);
                w.progressed();
            }
            pending |= !o.done;
        }
        if (!pending) return EMU_NCCL_DONE;
        if (!block) return EMU_NCCL_PENDING;
        if (w.expired()) {
            emu_device_fault("%s: rank %d of %d waited %d s for its peers (a rank that never came, or sends and receives that "
                             "do not match)", what, c->rank, c->size, (int)EMU_NCCL_WAIT_S);
            return EMU_NCCL_FAILED;
        }
    }
}

/* ================================================================ queued operations */
static size_t emu_nccl_type_bytes(ncclDataType_t t) { return t == ncclFloat64 ? 8 : t == ncclFloat32 ? 4 : 2; }
static bool emu_nccl_type_ok(ncclDataType_t t) { return t == ncclFloat32 || t == ncclFloat64 || t == ncclBfloat16; }

/* One addition in the type's own arithmetic: bf16 rounds each sum, as a ring's steps do. */
static double emu_nccl_add(double a, double b) { return a + b; }
static float emu_nccl_add(float a, float b) { return a + b; }
static bf16 emu_nccl_add(bf16 a, bf16 b) { return __float2bfloat16(__bfloat162float(a) + __bfloat162float(b)); }
template <typename T>
static void emu_nccl_sum_as(T *dst, const T *parts, int ranks, size_t n) {
    for (size_t i = 0; i < n; i++) {
        T s = parts[i];
        for (int q = 1; q < ranks; q++) s = emu_nccl_add(s, parts[(size_t)q * n + i]);
        dst[i] = s;
    }
}
/* dst[i] = the sum over the ranks' blocks of parts (n values each, rank after rank), in rank order */
static void emu_nccl_sum(void *dst, const unsigned char *parts, int ranks, size_t n, ncclDataType_t t) {
    if (t == ncclFloat64) emu_nccl_sum_as((double *)dst, (const double *)parts, ranks, n);
    else if (t == ncclFloat32) emu_nccl_sum_as((float *)dst, (const float *)parts, ranks, n);
    else emu_nccl_sum_as((bf16 *)dst, (const bf16 *)parts, ranks, n);
}

/* The group being gathered by ncclGroupStart ... ncclGroupEnd (depth > 0), and its stream. */
static struct { int depth; ncclComm_t comm; cudaStream_t stream; std::vector<emu_nccl_p2p> ops; } emu_nccl_group;

static ncclResult_t emu_nccl_check(const char *what, ncclComm_t c, const void *buf, size_t bytes, cudaStream_t s) {
    if (!c || !emu_known_stream(s) || emu_nccl_busy(c)) return ncclInvalidArgument;
    if (bytes && !emu_is_device(buf, bytes)) {
        fprintf(stderr, "emulated NCCL: %s: %zu bytes at %p are not inside one device allocation\n", what, bytes, buf);
        return ncclInvalidArgument;
    }
    return ncclSuccess;
}

/* A collective's send bytes at send and recv bytes at recv: apart, or in place exactly as NCCL
   defines it: the smaller buffer, inner, at `at` inside the other. */
static ncclResult_t emu_nccl_alias(const char *what, const void *send, size_t send_bytes, const void *recv, size_t recv_bytes,
                                   const void *inner, const void *at) {
    const uintptr_t s0 = (uintptr_t)send, r0 = (uintptr_t)recv;
    if (s0 + send_bytes <= r0 || r0 + recv_bytes <= s0 || inner == at) return ncclSuccess;
    fprintf(stderr, "emulated NCCL: %s: the send buffer %p and the receive buffer %p overlap, not in place\n", what, send, recv);
    return ncclInvalidArgument;
}

/* op queued on s behind what is queued there, or, on a non-blocking communicator, once the call
   has been looked at twice (ncclCommGetAsyncError): what the call returns. */
static ncclResult_t emu_nccl_enqueue(ncclComm_t c, cudaStream_t s, std::function<bool(bool)> op) {
    if (c->blocking) {
        emu_enqueue_resumable(s, op);
        return ncclSuccess;
    }
    s->held++;
    c->deferred.push_back({ s, op });
    return ncclInProgress;
}

/* Sends and receives in ops, queued on s as one operation (or added to the open group). */
static ncclResult_t emu_nccl_queue(ncclComm_t c, cudaStream_t s, const std::vector<emu_nccl_p2p> &ops, const char *what) {
    if (emu_nccl_group.depth > 0) {
        if (emu_nccl_group.ops.empty()) emu_nccl_group.comm = c, emu_nccl_group.stream = s;
        if (c != emu_nccl_group.comm || s != emu_nccl_group.stream) return ncclInvalidUsage;
        emu_nccl_group.ops.insert(emu_nccl_group.ops.end(), ops.begin(), ops.end());
        return ncclSuccess;
    }
    std::string w = what;
    std::shared_ptr<std::vector<emu_nccl_p2p>> todo = std::make_shared<std::vector<emu_nccl_p2p>>(ops);
    return emu_nccl_enqueue(c, s, [c, todo, w](bool block) {
        if (emu_sticky || emu_nccl_progress(c, *todo, w.c_str(), block) != EMU_NCCL_PENDING) {
            std::vector<emu_nccl_p2p>().swap(*todo);    /* the stream keeps its finished operations: not their state */
            return true;
        }
        return false;
    });
}

static ncclResult_t ncclGroupStart(void) {
    emu_nccl_group.depth++;
    return ncclSuccess;
}
static ncclResult_t ncclGroupEnd(void) {
    if (emu_nccl_group.depth == 0) return ncclInvalidUsage;
    if (--emu_nccl_group.depth > 0 || emu_nccl_group.ops.empty()) return ncclSuccess;
    std::vector<emu_nccl_p2p> ops;
    ops.swap(emu_nccl_group.ops);
    return emu_nccl_queue(emu_nccl_group.comm, emu_nccl_group.stream, ops, "ncclGroupEnd");
}

static ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
    if (!emu_nccl_type_ok(t) || !c || peer < 0 || peer >= c->size) return ncclInvalidArgument;
    const size_t bytes = count * emu_nccl_type_bytes(t);
    ncclResult_t r = emu_nccl_check("ncclSend", c, buf, bytes, s);
    if (r != ncclSuccess) return r;
    return emu_nccl_queue(c, s, { { true, peer, (unsigned char *)buf, bytes, 0, 0, false } }, "ncclSend");
}
static ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
    if (!emu_nccl_type_ok(t) || !c || peer < 0 || peer >= c->size) return ncclInvalidArgument;
    const size_t bytes = count * emu_nccl_type_bytes(t);
    ncclResult_t r = emu_nccl_check("ncclRecv", c, buf, bytes, s);
    if (r != ncclSuccess) return r;
    return emu_nccl_queue(c, s, { { false, peer, (unsigned char *)buf, bytes, 0, 0, false } }, "ncclRecv");
}

/* What collectives and the split are made of: block q of send (block bytes each, or the whole of
   send to every rank when `same` is set) goes to rank q, and rank q's block lands at recv + q * block. */
static std::vector<emu_nccl_p2p> emu_nccl_exchange(ncclComm_t c, const void *send, size_t block, bool same, unsigned char *recv) {
    std::vector<emu_nccl_p2p> ops;
    for (int q = 0; q < c->size; q++) {
        ops.push_back({ true, q, (unsigned char *)send + (same ? 0 : (size_t)q * block), block, 0, 0, false });
        ops.push_back({ false, q, recv + (size_t)q * block, block, 0, 0, false });
    }
    return ops;
}

/* A collective: the exchange into parts (the ranks' blocks, rank after rank), then finish(parts)
   writes the result. Queued on s behind what is queued there; not part of a group. */
static ncclResult_t emu_nccl_collective(const char *what, ncclComm_t c, cudaStream_t s, const void *send, size_t block_bytes,
                                        bool same, std::function<void(const unsigned char *)> finish) {
    if (emu_nccl_group.depth > 0) return ncclInvalidUsage;   /* not used by the backend inside a group */
    if (block_bytes == 0) return ncclSuccess;   /* empty: discarded, its peers' calls or none */
    struct state { std::vector<unsigned char> parts; std::vector<emu_nccl_p2p> ops; };
    std::shared_ptr<state> st = std::make_shared<state>();
    std::string w = what;
    return emu_nccl_enqueue(c, s, [c, send, block_bytes, same, finish, w, st](bool block) {
        if (emu_sticky) return true;
        if (st->ops.empty()) {                  /* send is read when the operation runs, not when it is queued */
            st->parts.resize((size_t)c->size * block_bytes);
            st->ops = emu_nccl_exchange(c, send, block_bytes, same, st->parts.data());
        }
        const emu_nccl_state r = emu_nccl_progress(c, st->ops, w.c_str(), block);
        if (r == EMU_NCCL_PENDING) return false;
        if (r == EMU_NCCL_DONE) finish(st->parts.data());
        std::vector<unsigned char>().swap(st->parts);   /* the stream keeps its finished operations: not their state */
        std::vector<emu_nccl_p2p>().swap(st->ops);
        return true;
    });
}

static ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                                  cudaStream_t s) {
    if (!emu_nccl_type_ok(t) || op != ncclSum) return ncclInvalidArgument;
    const size_t bytes = count * emu_nccl_type_bytes(t);
    ncclResult_t r = emu_nccl_check("ncclAllReduce", c, send, bytes, s);
    if (r == ncclSuccess) r = emu_nccl_check("ncclAllReduce", c, recv, bytes, s);
    if (r == ncclSuccess) r = emu_nccl_alias("ncclAllReduce", send, bytes, recv, bytes, send, recv);
    if (r != ncclSuccess) return r;
    const int ranks = c->size;
    return emu_nccl_collective("ncclAllReduce", c, s, send, bytes, true,
                               [recv, ranks, count, t](const unsigned char *parts) { emu_nccl_sum(recv, parts, ranks, count, t); });
}
static ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t, ncclComm_t c, cudaStream_t s) {
    if (!emu_nccl_type_ok(t)) return ncclInvalidArgument;
    const size_t bytes = count * emu_nccl_type_bytes(t);
    ncclResult_t r = emu_nccl_check("ncclAllGather", c, send, bytes, s);
    if (r == ncclSuccess) r = emu_nccl_check("ncclAllGather", c, recv, bytes * (size_t)c->size, s);
    if (r == ncclSuccess)
        r = emu_nccl_alias("ncclAllGather", send, bytes, recv, bytes * (size_t)c->size, send,
                           (const unsigned char *)recv + (size_t)c->rank * bytes);
    if (r != ncclSuccess) return r;
    const size_t all = bytes * (size_t)c->size;
    return emu_nccl_collective("ncclAllGather", c, s, send, bytes, true, [recv, all](const unsigned char *parts) { memcpy(recv, parts, all); });
}
static ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                                      cudaStream_t s) {
    if (!emu_nccl_type_ok(t) || op != ncclSum) return ncclInvalidArgument;
    const size_t bytes = count * emu_nccl_type_bytes(t);
    ncclResult_t r = emu_nccl_check("ncclReduceScatter", c, send, bytes * (size_t)c->size, s);
    if (r == ncclSuccess) r = emu_nccl_check("ncclReduceScatter", c, recv, bytes, s);
    if (r == ncclSuccess)
        r = emu_nccl_alias("ncclReduceScatter", send, bytes * (size_t)c->size, recv, bytes, recv,
                           (const unsigned char *)send + (size_t)c->rank * bytes);
    if (r != ncclSuccess) return r;
    const int ranks = c->size;
    return emu_nccl_collective("ncclReduceScatter", c, s, send, bytes, false,
                               [recv, ranks, count, t](const unsigned char *parts) { emu_nccl_sum(recv, parts, ranks, count, t); });
}

/* The new communicator's segment and this member's rank there, from every member's colour and key
   (all): those of this colour, ranked by key, then by rank in c. */
static ncclResult_t emu_nccl_split_attach(ncclComm_t c, const emu_nccl_split_job &j, ncclComm_t *out) {
    int rank = 0, size = 0;
    for (int q = 0; q < c->size; q++) {
        if (j.all[2 * (size_t)q] != j.color) continue;
        size++;
        const int k = j.all[2 * (size_t)q + 1];
        rank += k < j.key || (k == j.key && q < c->rank);
    }
    const std::string name = c->name + "-s" + std::to_string(j.index) + "c" + std::to_string(j.color);
    const ncclResult_t r = emu_nccl_attach(out, name, size, rank, c->blocking);   /* the parent's way of waiting */
    if (r == ncclSuccess || r == ncclInProgress) (*out)->blocking = j.blocking;
    return r;
}
/* A look at a non-blocking parent's split: the exchange moved on, then the new communicator's
   members counted; done, *out is set and the parent's split cleared. */
static void emu_nccl_split_step(ncclComm_t c) {
    emu_nccl_split_job &j = *c->split;
    if (!j.ops.empty()) {
        const emu_nccl_state st = emu_nccl_progress(c, j.ops, "ncclCommSplit", false);
        if (st == EMU_NCCL_PENDING) return;
        j.ops.clear();
        if (st == EMU_NCCL_FAILED) {
            c->async = ncclSystemError;
            emu_nccl_split_fail(c, c->async);
            return;
        }
        if (j.color != NCCL_SPLIT_NOCOLOR) {
            const ncclResult_t r = emu_nccl_split_attach(c, j, &j.child);
            if (r != ncclSuccess && r != ncclInProgress) {
                j.child = NULL;
                c->async = r;
                emu_nccl_split_fail(c, r);
                return;
            }
            j.child->joining = false;           /* it is the parent that reports the wait */
        }
    }
    if (j.child && !emu_nccl_all_came(j.child)) return;
    *j.out = j.child;
    j.child = NULL;
    c->split.reset();
}
/* Every member calls it, in the same order as its other splits of c: the members' colours and keys
   go round, and those of this colour attach to their own segment. On a blocking parent all of it
   before the call returns; on a non-blocking one, *out NULL (and ncclSuccess, as NCCL returns),
   the parent's looks carrying it on (emu_nccl_split_step). */
static ncclResult_t ncclCommSplit(ncclComm_t c, int color, int key, ncclComm_t *out, ncclConfig_t *config) {
    if (!c || !out || emu_nccl_busy(c)) return ncclInvalidArgument;
    std::shared_ptr<emu_nccl_split_job> j = std::make_shared<emu_nccl_split_job>();
    if (!emu_nccl_blocking(config, c->blocking, &j->blocking)) return ncclInvalidArgument;
    emu_run_all();
    j->color = color;
    j->key = key;
    j->index = c->splits++;
    j->out = out;
    j->mine[0] = color;
    j->mine[1] = key;
    j->all.resize(2 * (size_t)c->size);
    j->ops = emu_nccl_exchange(c, j->mine, sizeof j->mine, true, (unsigned char *)j->all.data());
    *out = NULL;
    if (!c->blocking) {
        c->split = j;
        return ncclSuccess;
    }
    if (emu_nccl_progress(c, j->ops, "ncclCommSplit", true) != EMU_NCCL_DONE) return ncclSystemError;
    if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
    return emu_nccl_split_attach(c, *j, out);   /* a blocking parent's: it waits for the members */
}
#endif
