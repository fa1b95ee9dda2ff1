/* The in-process communicator: every collective against the same computation done serially, on
   1 to 4 ranks and every element type; send/recv around a ring, and send_recv both ways round it
   at once (every rank sending first, which plain sends could not do); split into the rows and columns of
   a 2 x 2 mesh with collectives inside each; every rank ending with the same bits; bad arguments;
   calls that could never return (ranks whose calls differ, a peer that has returned, every rank
   waiting on another across two communicators) failing on every rank instead of hanging; a rank
   out of memory for a collective's scratch failing that call on every rank, the next one fine. */
#include <stdatomic.h>
#include <stdlib.h>

/* While a thread's `starved` is set, its allocations fail. */
static _Thread_local int starved;
static void *test_malloc(size_t n) { return starved ? NULL : malloc(n); }
static void *test_realloc(void *p, size_t n) { return starved ? NULL : realloc(p, n); }
#define PR_MALLOC(sz) test_malloc(sz)
#define PR_REALLOC(p, sz) test_realloc(p, sz)
#define PR_FREE(p) free(p)

#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include "harness.h"

#include <math.h>
#include <string.h>
#include <threads.h>
#include <time.h>

#define N 37                      /* elements per rank: not a multiple of anything */
#define MAXR 4

/* What every rank reports back, checked on the main thread (CHECK is not thread-safe). */
typedef struct {
    int size;
    double reduce[MAXR][N], gather[MAXR][MAXR * N], scatter[MAXR][N], a2a[MAXR][MAXR * N], ring[MAXR][N], fwd[MAXR][N], back[MAXR][N];
    float reduce_f32[MAXR][N];
    uint16_t reduce_bf16[MAXR][N];
    double row_sum[MAXR], col_sum[MAXR];
    int row_rank[MAXR], col_rank[MAXR], row_size[MAXR];
    int bad_peer[MAXR];
    size_t sent[MAXR];
} results;

/* Rank r's input element i of block b: distinct everywhere, exact in binary. */
static double value(int r, int b, int i) { return r * 1000 + b * 100 + i + 0.25; }

static pr_status rank_main(pr_comm *c, void *user, pr_error *err) {
    results *res = user;
    const int r = c->rank, R = c->size;
    double in[MAXR * N], out[MAXR * N];
    pr_status st;
    /* all_reduce, in place, three types */
    for (int i = 0; i < N; i++) res->reduce[r][i] = value(r, 0, i);
    if ((st = c->all_reduce(c, res->reduce[r], N, PR_COMM_F64, err))) return st;
    for (int i = 0; i < N; i++) res->reduce_f32[r][i] = (float)(value(r, 0, i) * 1.1);
    if ((st = c->all_reduce(c, res->reduce_f32[r], N, PR_COMM_F32, err))) return st;
    for (int i = 0; i < N; i++) res->reduce_bf16[r][i] = pr_f32_to_bf16((float)(r + 1) * 0.5f + (float)i);
    if ((st = c->all_reduce(c, res->reduce_bf16[r], N, PR_COMM_BF16, err))) return st;
    /* all_gather */
    for (int i = 0; i < N; i++) in[i] = value(r, 1, i);
    if ((st = c->all_gather(c, res->gather[r], in, N, PR_COMM_F64, err))) return st;
    /* reduce_scatter and all_to_all over R blocks */
    for (int b = 0; b < R; b++)
        for (int i = 0; i < N; i++) in[b * N + i] = value(r, b, i);
    if ((st = c->reduce_scatter(c, res->scatter[r], in, N, PR_COMM_F64, err))) return st;
    if ((st = c->all_to_all(c, res->a2a[r], in, N, PR_COMM_F64, err))) return st;
    /* a ring: even ranks send first, odd ranks receive first (no deadlock at any size) */
    if (R > 1) {
        int next = (r + 1) % R, prev = (r + R - 1) % R;
        for (int i = 0; i < N; i++) out[i] = value(r, 2, i);
        if (r % 2 == 0) {
            if ((st = c->send(c, out, N, PR_COMM_F64, next, err)) || (st = c->recv(c, res->ring[r], N, PR_COMM_F64, prev, err))) return st;
        } else {
            if ((st = c->recv(c, res->ring[r], N, PR_COMM_F64, prev, err)) || (st = c->send(c, out, N, PR_COMM_F64, next, err))) return st;
        }
        /* every rank at once: forward round the ring, then backward, each a send_recv */
        for (int i = 0; i < N; i++) in[i] = value(r, 4, i);
        if ((st = c->send_recv(c, in, N, next, res->fwd[r], N, prev, PR_COMM_F64, err))) return st;
        if ((st = c->send_recv(c, in, N, prev, res->back[r], N, next, PR_COMM_F64, err))) return st;
    }
    /* bad arguments come back as errors, and nobody waits on them */
    pr_error e2;
    res->bad_peer[r] = c->send(c, out, N, PR_COMM_F64, R + 3, &e2) == PR_ERR_ARG &&
                       c->recv(c, out, N, PR_COMM_F64, r, &e2) == PR_ERR_ARG &&
                       c->send_recv(c, out, N, r, in, N, -1, PR_COMM_F64, &e2) == PR_ERR_ARG &&
                       c->all_reduce(c, out, N, (pr_comm_type)9, &e2) == PR_ERR_ARG;
    if ((st = c->barrier(c, err))) return st;
    /* a 2 x 2 mesh: rows (color r / 2) and columns (color r % 2, keyed backwards) */
    if (R == 4) {
        pr_comm *row, *col;
        if ((st = c->split(c, r / 2, r, &row, err))) return st;
        if ((st = c->split(c, r % 2, -r, &col, err))) { row->destroy(row); return st; }
        double x = value(r, 3, 0), y = x;
        st = row->all_reduce(row, &x, 1, PR_COMM_F64, err);
        if (!st) st = col->all_reduce(col, &y, 1, PR_COMM_F64, err);
        res->row_sum[r] = x;
        res->col_sum[r] = y;
        res->row_rank[r] = row->rank;
        res->col_rank[r] = col->rank;
        res->row_size[r] = row->size;
        row->destroy(row);
        col->destroy(col);
        if (st) return st;
    }
    res->sent[r] = c->bytes_sent;
    return PR_OK;
}

static void check_size(int R) {
    results *res = calloc(1, sizeof *res);
    res->size = R;
    pr_error err;
    pr_status st = pr_comm_local_run(R, rank_main, res, &err);
    CHECK(st == PR_OK, "%d ranks: %s", R, st ? err.message : "");
    if (st) { free(res); return; }
    int reduce = 1, gather = 1, scatter = 1, a2a = 1, ring = 1, same = 1, f32 = 1, bf16 = 1;
    for (int r = 0; r < R; r++) {
        for (int i = 0; i < N; i++) {
            double want = 0;
            float wf = 0, wb = 0;
            for (int q = 0; q < R; q++) {
                want += value(q, 0, i);
                wf = wf + (float)(value(q, 0, i) * 1.1);                     /* rank order, float adds */
                wb = pr_bf16_to_f32(pr_f32_to_bf16(wb + pr_bf16_to_f32(pr_f32_to_bf16((float)(q + 1) * 0.5f + (float)i))));
            }
            reduce &= res->reduce[r][i] == want;
            f32 &= res->reduce_f32[r][i] == wf;
            bf16 &= pr_bf16_to_f32(res->reduce_bf16[r][i]) == wb;
            double ws = 0;
            for (int q = 0; q < R; q++) ws += value(q, r, i);
            scatter &= res->scatter[r][i] == ws;
            if (R > 1) ring &= res->ring[r][i] == value((r + R - 1) % R, 2, i) &&
                               res->fwd[r][i] == value((r + R - 1) % R, 4, i) && res->back[r][i] == value((r + 1) % R, 4, i);
        }
        for (int q = 0; q < R; q++)
            for (int i = 0; i < N; i++) {
                gather &= res->gather[r][q * N + i] == value(q, 1, i);
                a2a &= res->a2a[r][q * N + i] == value(q, r, i);
            }
        same &= !memcmp(res->reduce_f32[r], res->reduce_f32[0], sizeof res->reduce_f32[0]) &&
                !memcmp(res->reduce_bf16[r], res->reduce_bf16[0], sizeof res->reduce_bf16[0]);
        CHECK(res->bad_peer[r], "%d ranks: rank %d: a bad peer or type was not refused", R, r);
        CHECK(R > 1 ? res->sent[r] > 0 : res->sent[r] == 0, "%d ranks: rank %d counted %zu bytes sent", R, r, res->sent[r]);
    }
    CHECK(reduce && f32 && bf16, "%d ranks: all_reduce (f64 %d, f32 %d, bf16 %d)", R, reduce, f32, bf16);
    CHECK(same, "%d ranks: ranks ended with different bits", R);
    CHECK(gather, "%d ranks: all_gather", R);
    CHECK(scatter, "%d ranks: reduce_scatter", R);
    CHECK(a2a, "%d ranks: all_to_all", R);
    CHECK(ring, "%d ranks: send/recv and send_recv rings", R);
    if (R == 4) {
        for (int r = 0; r < 4; r++) {
            int mate = r ^ 1, other = r ^ 2;        /* same row: r^1; same column: r^2 */
            CHECK(res->row_sum[r] == value(r, 3, 0) + value(mate, 3, 0), "split rows: rank %d sum %.2f", r, res->row_sum[r]);
            CHECK(res->col_sum[r] == value(r, 3, 0) + value(other, 3, 0), "split columns: rank %d sum %.2f", r, res->col_sum[r]);
            CHECK(res->row_size[r] == 2 && res->row_rank[r] == r % 2, "split rows: rank %d is %d of %d", r, res->row_rank[r], res->row_size[r]);
            CHECK(res->col_rank[r] == (r < 2 ? 1 : 0), "split columns keyed backwards: rank %d is %d", r, res->col_rank[r]);
        }
    }
    free(res);
}

/* A rank that fails reports itself; the others finish. */
static pr_status failing(pr_comm *c, void *user, pr_error *err) {
    (void)user;
    if (c->rank == 1) {
        err->status = PR_ERR_IO;
        snprintf(err->message, sizeof err->message, "disk on fire");
        return PR_ERR_IO;
    }
    return PR_OK;
}

/* Each rank's outcome in a run whose calls cannot all return. */
typedef struct {
    pr_status st[MAXR];
    char msg[MAXR][512];
} outcome;

static pr_status record(outcome *o, pr_comm *c, pr_status st, const pr_error *err) {
    o->st[c->rank] = st;
    snprintf(o->msg[c->rank], sizeof o->msg[0], "%s", st ? err->message : "");
    return st;
}
/* An all_reduce of N on rank 0 and of N + 5 on the others: no rank may read past a buffer. */
static pr_status sizes_differ(pr_comm *c, void *user, pr_error *err) {
    double buf[N + 5] = { 0 };
    return record(user, c, c->all_reduce(c, buf, c->rank ? N + 5 : N, PR_COMM_F64, err), err);
}
static pr_status ops_differ(pr_comm *c, void *user, pr_error *err) {
    double in[N] = { 0 }, out[MAXR * N];
    return record(user, c, c->rank ? c->all_reduce(c, in, N, PR_COMM_F64, err) : c->all_gather(c, out, in, N, PR_COMM_F64, err), err);
}
/* Rank 1 fails on its own and returns; the others meet at a barrier it never comes to. */
static pr_status one_leaves(pr_comm *c, void *user, pr_error *err) {
    if (c->rank == 1) {
        err->status = PR_ERR_IO;
        snprintf(err->message, sizeof err->message, "disk on fire");
        return record(user, c, PR_ERR_IO, err);
    }
    return record(user, c, c->barrier(c, err), err);
}
/* Rank 1 fails at once; the others go on through three calls, each failing as rank 1 left, and
   return the second's failure (as a step keeps the failure of one of its collectives, not always
   the first or the last the communicator raised): the run still names rank 1's own. */
static pr_status keeps_middle(pr_comm *c, void *user, pr_error *err) {
    if (c->rank == 1) {
        err->status = PR_ERR_IO;
        snprintf(err->message, sizeof err->message, "disk on fire");
        return record(user, c, PR_ERR_IO, err);
    }
    double x[N] = { 0 };
    pr_error e[3];
    c->all_reduce(c, x, N, PR_COMM_F64, &e[0]);
    const pr_status st = c->barrier(c, &e[1]);
    c->all_reduce(c, x, N, PR_COMM_F64, &e[2]);
    *err = e[1];
    return record(user, c, st, err);
}
/* All three meet an all_reduce whose sizes differ (the communicator finds it on each); rank 1
   returns that failure, ranks 0 and 2 go on to a barrier and are told rank 1 left: the run names
   the calls that differ, not the later failure the others return. */
static pr_status echo_after_fault(pr_comm *c, void *user, pr_error *err) {
    double x[N + 5] = { 0 };
    pr_error first;
    const pr_status st = c->all_reduce(c, x, c->rank == 1 ? N + 5 : N, PR_COMM_F64, &first);
    if (c->rank == 1) {
        *err = first;
        return record(user, c, st, err);
    }
    return record(user, c, c->barrier(c, err), err);
}
/* Rank 0 is first told (rank 2 leaves the barrier it waits in), then finds a fault itself: ranks 1
   and 2 meet in an all_reduce of {1, 2} whose sizes differ, rank 2 returns that, rank 0 leaves the
   world's barrier told that rank 2 left and meets rank 1 in an all_reduce of {0, 1} whose sizes
   differ too, which both return. Every failing rank was told or found something, so the run names
   the first rank that returned a fault the communicator found, rank 0's, though its first failure
   was an echo (with only its first failure judged, the run would name rank 2's). */
static pr_status told_then_found(pr_comm *c, void *user, pr_error *err) {
    pr_comm *low = NULL, *high = NULL;
    pr_status st = c->split(c, c->rank < 2 ? 0 : 1, c->rank, &low, err);
    if (!st) st = c->split(c, c->rank > 0 ? 0 : 1, c->rank, &high, err);
    if (st) {
        if (low) low->destroy(low);
        return record(user, c, st, err);
    }
    double x[N + 5] = { 0 };
    pr_error told;
    if (c->rank == 0) {
        c->barrier(c, &told);
        st = low->all_reduce(low, x, N, PR_COMM_F64, err);
    } else {
        st = high->all_reduce(high, x, c->rank == 1 ? N : N + 5, PR_COMM_F64, err);
        if (c->rank == 1) st = low->all_reduce(low, x, N + 5, PR_COMM_F64, err);
    }
    low->destroy(low);
    high->destroy(high);
    return record(user, c, st, err);
}
static pr_status send_to_leaver(pr_comm *c, void *user, pr_error *err) {
    double x[N] = { 0 };
    return record(user, c, c->rank ? PR_OK : c->send(c, x, N, PR_COMM_F64, 1, err), err);
}
/* Rank 0 waits to receive from rank 1 on the run's communicator while rank 1 waits for rank 0 in
   an all_reduce of another: each waits for the other, so one of them must fail. */
static pr_status crossed(pr_comm *c, void *user, pr_error *err) {
    pr_comm *sub;
    pr_status st = c->split(c, 0, c->rank, &sub, err);
    if (st) return record(user, c, st, err);
    double x[N] = { 0 };
    st = c->rank ? sub->all_reduce(sub, x, N, PR_COMM_F64, err) : c->recv(c, x, N, PR_COMM_F64, 1, err);
    sub->destroy(sub);
    return record(user, c, st, err);
}

/* Ranks 1 and 2 each wait for the other, rank 0 for rank 1: whichever finds that every rank waits
   returns, and the ranks waiting for it are told it left. */
static pr_status chained(pr_comm *c, void *user, pr_error *err) {
    double x[N] = { 0 };
    const pr_status st = c->recv(c, x, N, PR_COMM_F64, c->rank == 1 ? 2 : 1, err);
    return record(user, c, st, err);
}

/* Rank 0 returns at once without failing, skipping the recv rank 1 waits in, while ranks 2 and 3
   wait for each other: the run names rank 0's leaving, the fault, before the wait the others
   then find. */
static pr_status left_early(pr_comm *c, void *user, pr_error *err) {
    if (c->rank == 0) return record(user, c, PR_OK, err);
    double x[N] = { 0 };
    const pr_status st = c->recv(c, x, N, PR_COMM_F64, c->rank == 1 ? 0 : 5 - c->rank, err);
    return record(user, c, st, err);
}

/* Rank 1 gives up an all_reduce (every rank waits: rank 0 in a recv from it), then sends rank 0
   what it waits for and calls an all_reduce of the same shape again, while rank 0, its recv done,
   makes its first: the two calls must not be taken for one. */
typedef struct {
    atomic_int in_recv;
    pr_status first[2], second[2];
    char msg[2][512];
} gave_up;
static pr_status give_up_and_retry(pr_comm *c, void *user, pr_error *err) {
    gave_up *g = user;
    pr_comm *sub;
    pr_status st = c->split(c, 0, c->rank, &sub, err);
    if (st) return st;
    double x[N] = { 0 };
    pr_error e;
    e.message[0] = 0;
    if (c->rank == 0) {
        atomic_store(&g->in_recv, 1);
        g->first[0] = c->recv(c, x, N, PR_COMM_F64, 1, &e);
        g->second[0] = sub->all_reduce(sub, x, N, PR_COMM_F64, &e);
    } else {
        while (!atomic_load(&g->in_recv)) thrd_yield();
        thrd_sleep(&(struct timespec){ .tv_nsec = 50000000 }, NULL);   /* rank 0 is waiting in its recv by now */
        g->first[1] = sub->all_reduce(sub, x, N, PR_COMM_F64, &e);
        pr_status sent = c->send(c, x, N, PR_COMM_F64, 0, &e);
        g->second[1] = sent ? sent : sub->all_reduce(sub, x, N, PR_COMM_F64, &e);
    }
    snprintf(g->msg[c->rank], sizeof g->msg[0], "%s", e.message);
    sub->destroy(sub);
    return PR_OK;
}
/* One rank out of memory for a call's scratch, each in turn (in split the leader of its group,
   which makes the group's world, or another member, which joins it): all_reduce, reduce_scatter
   and split fail on every rank (a rank that went on alone would reach a different call than its
   peers, or none), and each call made again with memory succeeds on every rank with the right
   result. */
typedef struct {
    int victim;
    pr_status st[3][MAXR], again[3][MAXR];
    char msg[3][MAXR][512];
    double sum[MAXR], part[MAXR], sub_sum[MAXR];
} starving;
static pr_status starve_rank(pr_comm *c, void *user, pr_error *err) {
    starving *o = user;
    const int r = c->rank, R = c->size;
    double in[MAXR] = { 0 }, x;
    pr_comm *sub = NULL;
    for (int op = 0; op < 3; op++)
        for (int pass = 0; pass < 2; pass++) {
            pr_error e;
            pr_status st;
            x = value(r, op, pass);
            for (int i = 0; i < R; i++) in[i] = value(r, op, i);
            starved = pass == 0 && r == o->victim;
            if (op == 0) st = c->all_reduce(c, &x, 1, PR_COMM_F64, &e);
            else if (op == 1) st = c->reduce_scatter(c, &x, in, 1, PR_COMM_F64, &e);
            else st = c->split(c, r % 2, r, &sub, &e);
            starved = 0;
            (pass ? o->again : o->st)[op][r] = st;
            if (!pass) snprintf(o->msg[op][r], sizeof o->msg[0][0], "%s", st ? e.message : "");
            if (pass && !st && op == 0) o->sum[r] = x;
            if (pass && !st && op == 1) o->part[r] = x;
        }
    if (!sub) return pr__fail(err, PR_ERR_ARG, "rank %d: no communicator from the split", r);
    x = r;
    pr_status st = sub->all_reduce(sub, &x, 1, PR_COMM_F64, err);
    o->sub_sum[r] = x;
    sub->destroy(sub);
    return st;
}
static void check_starved(void) {
    static const char *const op_name[3] = { "all_reduce", "reduce_scatter", "split" };
    for (int R = 2; R <= MAXR; R++)
        for (int v = 0; v < R; v++) {
            starving o;
            memset(&o, 0, sizeof o);
            o.victim = v;
            pr_error err;
            char peers_say[64];
            snprintf(peers_say, sizeof peers_say, "rank %d is out of memory: every rank fails the call", v);
            CHECK(pr_comm_local_run(R, starve_rank, &o, &err) == PR_OK, "%d ranks, rank %d starved: %s", R, v, err.message);
            for (int op = 0; op < 3; op++)
                for (int r = 0; r < R; r++) {
                    const char *says = r == v ? "out of memory on this rank" : peers_say;
                    CHECK(o.st[op][r] == PR_ERR_NOMEM && strstr(o.msg[op][r], op_name[op]) && strstr(o.msg[op][r], says),
                          "%d ranks, %s with rank %d out of memory: rank %d says %d '%s'", R, op_name[op], v, r, (int)o.st[op][r], o.msg[op][r]);
                    CHECK(o.again[op][r] == PR_OK, "%d ranks, %s again: rank %d fails (%d)", R, op_name[op], r, (int)o.again[op][r]);
                }
            for (int r = 0; r < R; r++) {
                double sum = 0, part = 0, sub_sum = 0;
                for (int q = 0; q < R; q++) {
                    sum += value(q, 0, 1);
                    part += value(q, 1, r);
                    if (q % 2 == r % 2) sub_sum += q;
                }
                CHECK(o.sum[r] == sum && o.part[r] == part && o.sub_sum[r] == sub_sum,
                      "%d ranks, rank %d after the failures: all_reduce %g (%g), reduce_scatter %g (%g), in its split %g (%g)", R, r, o.sum[r],
                      sum, o.part[r], part, o.sub_sum[r], sub_sum);
            }
        }
}

/* A split communicator kept past the run's end and destroyed after it. */
static pr_status keep_split(pr_comm *c, void *user, pr_error *err) {
    pr_comm **kept = user;
    return c->split(c, c->rank % 2, c->rank, &kept[c->rank], err);
}

static void check_faults(void) {
    static const struct {
        const char *name;
        pr_status (*fn)(pr_comm *, void *, pr_error *);
        int ranks;
        pr_status want;
        const char *says;          /* in the run's message */
        const char *peers_say;     /* in every failing rank's message but the cause's (NULL: the run's) */
    } cases[] = {
        { "sizes differ", sizes_differ, 3, PR_ERR_ARG, "all_reduce of 37 f64 (its call 1 on this communicator), rank 1 all_reduce of 42 f64", NULL },
        { "operations differ", ops_differ, 2, PR_ERR_ARG, "rank 0 all_gather of 37 f64 (its call 1 on this communicator), rank 1 all_reduce", NULL },
        { "a rank leaves", one_leaves, 3, PR_ERR_IO, "rank 1: disk on fire", "has left the communicator" },
        { "a rank leaves, the others keep a later call's failure", keeps_middle, 3, PR_ERR_IO, "rank 1: disk on fire",
          "barrier: rank" },
        { "the calls differ, then a rank leaves", echo_after_fault, 3, PR_ERR_ARG, "rank 1: all_reduce: the ranks' calls differ",
          "has left the communicator" },
        { "a rank first told, then finding a fault", told_then_found, 3, PR_ERR_ARG,
          "rank 0: all_reduce: the ranks' calls differ", "the ranks' calls differ" },
        { "send to a rank that left", send_to_leaver, 2, PR_ERR_ARG, "send: rank 1 has left the communicator", NULL },
        /* one finds that every rank waits, the other is told it left: the run names the finding */
        { "each waits for the other", crossed, 2, PR_ERR_ARG, "every rank waits for another", NULL },
        { "a chain onto two that wait for each other", chained, 3, PR_ERR_ARG, "every rank waits for another", NULL },
        { "a rank returns early, two wait for each other", left_early, 4, PR_ERR_ARG, "rank 1: recv: rank 0 has left", NULL },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int rep = 0; rep < 20; rep++) {    /* the threads' order differs run to run */
            outcome o;
            memset(&o, 0, sizeof o);
            pr_error err;
            pr_status st = pr_comm_local_run(cases[k].ranks, cases[k].fn, &o, &err);
            int fine = st == cases[k].want && strstr(err.message, cases[k].says);
            for (int r = 0; r < cases[k].ranks && fine; r++) {
                if (cases[k].fn == send_to_leaver && r == 1) continue;     /* the one that leaves succeeds */
                if (cases[k].fn == left_early && r == 0) continue;
                if (cases[k].peers_say && r == 1) continue;                /* the cause */
                /* where the ranks wait for each other, one found it and the others were told it left */
                const int waits = cases[k].fn == crossed || cases[k].fn == chained || cases[k].fn == left_early;
                fine = o.st[r] != PR_OK && (waits || strstr(o.msg[r], cases[k].peers_say ? cases[k].peers_say : cases[k].says));
            }
            CHECK(fine, "%s (run %d): the run says %d '%s'; rank 0 '%s', rank 1 '%s', rank 2 '%s', rank 3 '%s'", cases[k].name, rep,
                  (int)st, err.message, o.msg[0], o.msg[1], o.msg[2], o.msg[3]);
            if (!fine) break;
        }
    int ordered = 0;
    for (int tries = 0; tries < 10 && !ordered; tries++) {
        gave_up g;
        memset(&g, 0, sizeof g);
        pr_error err;
        CHECK(pr_comm_local_run(2, give_up_and_retry, &g, &err) == PR_OK, "give up and retry: %s", err.message);
        ordered = g.first[0] == PR_OK && g.first[1] != PR_OK;      /* else rank 0's recv was the one given up: again */
        if (ordered)
            CHECK(g.second[0] != PR_OK && g.second[1] != PR_OK && strstr(g.msg[0], "(its call 1 on this communicator)") && strstr(g.msg[0], "(its call 2)"),
                  "a call given up and one of the same shape after it were taken for one: %d %d '%s'", (int)g.second[0], (int)g.second[1],
                  g.msg[0]);
    }
    CHECK(ordered, "give up and retry: rank 1 never was the one to give up");
    pr_comm *kept[4] = { NULL, NULL, NULL, NULL };
    pr_error err;
    CHECK(pr_comm_local_run(4, keep_split, kept, &err) == PR_OK, "kept split: %s", err.message);
    for (int r = 0; r < 4; r++)
        if (kept[r]) kept[r]->destroy(kept[r]);       /* after the run (the sanitizer build sees any use after free) */
}

int main(void) {
    printf("test_comm (%s build)\n", sizeof(pr_real) == 8 ? "double" : "float");
    for (int R = 1; R <= MAXR; R++)
        for (int rep = 0; rep < 10; rep++) check_size(R);      /* ten times: no run may find a wait where there is none */
    pr_error err;
    CHECK(pr_comm_local_run(3, failing, NULL, &err) == PR_ERR_IO && strstr(err.message, "rank 1") && strstr(err.message, "fire"),
          "a failing rank is reported: '%s'", err.message);
    check_faults();
    check_starved();
    CHECK(pr_comm_local_run(0, failing, NULL, &err) == PR_ERR_ARG, "zero ranks refused");
    return test_report();
}
