/* train — GRPO steps over a trace with the baseline or the prefix-reuse schedule, and the tools
   that compare the two: --check (equivalence after one AdamW step) and --bench (speed-up against
   the FLOP-count bound). `./train --help` lists every flag. */
#define PREFIXREUSE_IMPLEMENTATION
#include "prefixreuse.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* train_cuda (make cuda) is this file built with PR_CUDA: the same driver on the CUDA backend. */
#ifdef PR_CUDA
#define PEAK_DEFAULT 989.0           /* H100/H200 SXM dense bf16 TFLOP/s */
#define PEAK_DEFAULT_TEXT "989, H100/H200 bf16"
#else
#define PEAK_DEFAULT 0.0
#define PEAK_DEFAULT_TEXT "0"
#endif

typedef struct {
    const char *config, *trace, *init, *save, *save_grads;
    const char *save_state, *resume, *loss_log;   /* training state: README "Training state" */
    int new_trace;                   /* --new-trace: resume at the first group of a trace other than the state's */
    pr_train_state resumed;          /* --resume's record (pr_train_state_read), read before anything is built */
    const char *log;                 /* --log: one JSON line a step */
    int replay;                      /* --replay N: steps of the drift replay (0: none) */
    int prefix_tree;                 /* --prefix-tree MIN: report the steps' prefix trees (0: none) */
    int tree, tree_min;              /* --schedule tree: each step's groups as their prefix tree, nodes of tree_min+ tokens */
    const char *tree_min_given, *nccl_given;   /* the flag, where one was given: refused where nothing reads it */
    int save_every;                  /* steps between state saves (0: only at the end) */
    long fault_kill_bytes;           /* tests: the process kills itself once a state save has written this many bytes */
    pr_step_opts step;
    pr_adamw_opts adam;
    int steps, check, bench, save_bf16, config_given;   /* bench: 0 none, 1 speed, 2 memory, 3 capacity */
    uint64_t save_shard_bytes;       /* --save-shard-size: the saved checkpoint's shards at most this (0: one file) */
    int save_shard_given;
    double bench_budget_mib;
    int bench_gpu_sizes;             /* --bench memory, capacity: the CUDA backend's sizes (pr_backend_cuda_sizes) */
    uint64_t seed;
    int bench_total, bench_reps, layers;
    int bench_system;                /* --bench tree: the shared system prompt's tokens (0: half the prompt) */
    int bench_groups[8], n_bench_groups;
    double bench_splits[8];          /* --bench speed and memory: the prefix's share of each trajectory */
    int n_bench_splits, bench_splits_given;
    double peak_tflops;
    int dp, pp, cp, tp, ep;          /* the device mesh; all 1: one rank */
    int zero;                        /* sharded AdamW state over dp: 0, 1 or 2 (pr_mesh.zero) */
    int grad_reduce_bf16;            /* the gradient sum over dp in bf16 (pr_mesh.bf16_grad_reduce) */
    int groups_per_step;             /* 0: the trace's steps (version 2), else dp groups; N: N consecutive groups a step */
    long loss_norm_len;              /* seq-mean-token-sum-norm's length (0: the step's longest suffix) */
    const char *nccl_id;
    int nccl_timeout;                /* seconds a rank waits for its peers (pr_comm_nccl_create) */
    int attention;                   /* train_cuda: PR_CUDA_ATTENTION_AUTO (default), _FFMA, _MMA, _MMA_ATOMIC or _WGMMA */
    int profile;                     /* train_cuda --bench: each timed run's time per backend operation */
} options;

/* --attention's words, indexed by the PR_CUDA_ATTENTION_ kinds. */
static const char *const attention_names[] = { "ffma", "mma", "mma-atomic", "wgmma", "auto" };

#define MAX_STEP_GROUPS 65536          /* --groups-per-step */

static int mesh_ranks(const options *o) { return o->dp * o->pp * o->cp * o->tp; }
static int on_mesh(const options *o) { return mesh_ranks(o) > 1 || o->ep > 1; }
/* The prefix tokens of --bench-splits' split i. */
static long split_prefix(const options *o, int i) { return lround(o->bench_total * o->bench_splits[i]); }

static void usage(FILE *f) {
    fprintf(f,
        "usage: train [flags]\n"
        "GRPO steps over a trace of prompt groups, cycling through the trace: one AdamW step a trace step (a\n"
        "version-2 trace's step table), or --groups-per-step N consecutive groups (default dp, 1 on one rank).\n"
        "With no flags: the tiny preset, data/sample.trace, the reuse schedule.\n"
        "\n"
        "model and data\n"
        "  --config PATH          model folder holding config.json, or a config.json (default model/tiny)\n"
        "  --trace PATH           GRPO trace (default data/sample.trace; format in data/README.md)\n"
        "  --init DIR             start from a safetensors checkpoint (file, folder or sharded folder);\n"
        "                         a folder's config.json is the model's config unless --config is given\n"
        "  --seed N               seed of the deterministic initialisation when --init is absent (default 1234)\n"
        "  --layers N             keep only the first N layers of the model (benchmarks of large shapes)\n"
        "schedule\n"
        "  --schedule S           baseline | reuse | tree (default reuse). tree: each optimizer step's groups\n"
        "                         as their prefix tree (README \"Prefix trees\"), on one rank or any mesh\n"
        "  --tree-min N           --schedule tree: a run shared by two or more groups becomes a node from\n"
        "                         N tokens (default 16)\n"
        "  --microbatch N         trajectories per microbatch, 0 = the whole group (default 0)\n"
        "  --microbatch-tokens N  and no more than keep a microbatch's rows within N tokens (at least one\n"
        "                         trajectory): whole sequences full-sequence, suffixes alone in Phase B, so\n"
        "                         reuse runs several suffixes where the baseline runs one sequence (default 0: no limit)\n"
        "  --layout L             padded | packed: the reuse schedule's Phase-B layout (default padded)\n"
        "  --aux-scope S          MoE load-balancing loss scope: microbatch | group (default microbatch)\n"
        "  --prefix-multiplicity N  MoE: count each prefix token N times in the aux loss instead of the\n"
        "                         scope's (0, the default, is the accounting that matches the baseline)\n"
        "  --offload on|off       move the prefix's dormant saved tensors to pinned host memory between\n"
        "                         Phase A and Phase C (reuse schedule; default off)\n"
        "  --offload-pool MIB     host staging pool size; default: the dormant footprint + 1/16\n"
        "  --device-budget MIB    prefetch a block only while live device memory stays within this (default: no limit)\n"
        "  --recompute R          none | prefix | all: activation recompute (default none). prefix: Phase A keeps\n"
        "                         each layer's input and K/V cache, Phase C runs the layer's forward again before\n"
        "                         its backward; all: the suffix microbatches and the baseline too. Bitwise the\n"
        "                         same results\n"
        "loss and optimizer\n"
        "  --eps-low X            clip range below 1 (default 0.2)\n"
        "  --eps-high X           clip range above 1 (default 0.28)\n"
        "  --kl-coef X            weight of the KL term to the reference log-probs (default 0)\n"
        "  --loss-norm M          how a step's token losses aggregate (README \"The loss over a step\"): token-mean |\n"
        "                         seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (default token-mean);\n"
        "                         every denominator spans the whole step\n"
        "  --loss-norm-len N      seq-mean-token-sum-norm's constant length (default: the step's longest suffix)\n"
        "  --lr X                 AdamW learning rate (default 1e-3)\n"
        "  --weight-decay X       AdamW decoupled weight decay on matrices (default 0.01)\n"
        "  --clip X               global gradient-norm clip, 0 = off (default 1.0)\n"
        "parallelism (a mesh of dp x pp x cp x tp ranks; README \"Parallelism\")\n"
        "  --dp N --cp N --tp N   data, context and tensor parallel sizes (default 1); a step's groups are placed\n"
        "                         over the dp ranks by their cost; fewer groups than dp split each over a team of\n"
        "                         ranks, which get its prefix K/V from the first of them; tp divides the heads,\n"
        "                         and divides the KV heads or is a multiple of them (each KV head then\n"
        "                         replicated on tp / KV heads ranks); each of dp, pp, cp, tp at most 64, the mesh\n"
        "                         at most 256 ranks\n"
        "  --ep N                 expert parallelism inside the TP group: 1 or the tp size (default 1)\n"
        "  --pp N                 pipeline stages: the layers split into N stages, microbatches in the 1F1B order\n"
        "  --zero 0|1|2           shard the AdamW state over dp (README \"Training state\"): 1 keeps m and v of\n"
        "                         a 1/dp slice per rank and all-gathers the updated weights, 2 also reduce-scatters\n"
        "                         the gradients; bitwise the same results as 0 (default 0)\n"
        "  --grad-reduce fp32|bf16  the gradient sum over dp in the build's reals (fp32; default) or in bf16,\n"
        "                         half the bytes (README \"Training state\"); --check reports its difference to fp32\n"
        "                         the CPU build runs the ranks as threads of this process; train_cuda runs one\n"
        "                         process per GPU (RANK, WORLD_SIZE, LOCAL_RANK from the environment)\n"
        "  --nccl-id PATH|tcp://HOST:PORT  train_cuda: how the ranks get rank 0's NCCL id: a file rank 0 writes\n"
        "                         (replaced each launch; on a filesystem every node sees), or over TCP: rank 0\n"
        "                         listens on PORT and the others connect to HOST:PORT, no shared filesystem needed\n"
        "  --nccl-timeout S       train_cuda: how long a rank waits for its peers, for the id, for NCCL's set-up\n"
        "                         and for each exchange, before it gives up with an error (default 600)\n"
        "  --attention K          train_cuda's kernels at head dims 64 and 128: auto (default: wgmma where it runs,\n"
        "                         else mma, else ffma) | ffma (CUDA cores, the reference) | mma (tensor cores, sm_80+,\n"
        "                         ~25x ffma on an H100) | wgmma (mma's kernels on Hopper's warpgroup MMA: compute\n"
        "                         capability 9.0, sm_90a code; ~1.6x mma) | mma-atomic (mma with a backward that adds\n"
        "                         dQ by atomics: not bitwise reproducible; to measure what determinism costs)\n"
        "run\n"
        "  --steps N              optimizer steps (default 8)\n"
        "  --groups-per-step N    N consecutive groups a step (wrapping at the trace's end), instead of a version-2\n"
        "                         trace's steps; default for a version-1 trace: dp (--dp-groups N: the same);\n"
        "                         at most 65536\n"
        "  --save DIR             write config.json + model.safetensors to DIR at the end (atomic; a checkpoint\n"
        "                         already there is replaced, its shard files included)\n"
        "  --save-bf16            store the saved checkpoint in bf16 instead of fp32\n"
        "  --save-shard-size SIZE split the saved checkpoint into files of at most SIZE (5GB, 500MB, 2GiB; B, KB,\n"
        "                         MB, GB, TB by 1000, KiB ... TiB by 1024; a larger tensor gets a file of its own)\n"
        "                         with model.safetensors.index.json, as transformers saves; 0: one file (default)\n"
        "  --save-grads FILE      write the last step's raw gradients (before clipping and the AdamW step;\n"
        "                         Hugging Face names) as safetensors\n"
        "  --save-state DIR       write the training state (parameters, AdamW moments and step, the trace\n"
        "                         position) into DIR at the end, atomically; DIR/latest names the current one\n"
        "  --save-every N         also every N steps (with --save-state)\n"
        "  --resume DIR           go on from a training state (DIR as given to --save-state, or one state\n"
        "                         folder): --steps N more steps, bit-identical to a run that never stopped;\n"
        "                         the trace must be the one the state was on (its fingerprint is saved)\n"
        "  --new-trace            with --resume: the trace is new data (fresh rollouts): keep the weights and\n"
        "                         AdamW state, start at the trace's first group\n"
        "  --loss-log FILE        append one line a step: step, loss and grad norm as exact hex floats\n"
        "  --fault-kill-after-bytes N  tests only: kill this process (SIGKILL) once a state save has written\n"
        "                         N bytes, to show that an interrupted save leaves the previous state loadable\n"
        "comparisons\n"
        "  --check                from the same weights and each group of the trace, run both schedules\n"
        "                         and one AdamW step; compare gradients and updated parameters with\n"
        "                         |a-b| <= atol + rtol*|b|; exit 0 only on PASS\n"
        "  --replay N             from the same weights, N steps of the full-sequence schedule and of the reuse\n"
        "                         schedule, each with its own AdamW trajectory; after each step both losses and\n"
        "                         gradient norms and the parameter drift between them, beside the floor: the\n"
        "                         drift of the full-sequence schedule against itself with each microbatch's\n"
        "                         trajectories reversed; exit 0 only when the reuse drift stays within 10x the\n"
        "                         floor at every step. train_cuda (bf16 activations): drift and floor are reuse's\n"
        "                         and the full-sequence run's distance from the full-sequence schedule on the CPU\n"
        "                         (fp32), within 2x\n"
        "  --prefix-tree MIN      report, for each optimizer step of the trace, the prefix tree its groups form\n"
        "                         (runs of at least MIN tokens shared by two or more groups become nodes) and the\n"
        "                         prefix tokens each way runs: full-sequence, each group once, each node once\n"
        "  --log FILE             write one JSON line a step to FILE (replaced): a training run's loss, KL, clip\n"
        "                         fraction, gradient norm, phase times, tokens per second and peak memory; or\n"
        "                         --replay's losses, gradient norms, drift and floor\n"
        "  --bench [KIND]         speed (default): baseline and reuse timed side by side over prefix/suffix\n"
        "                         splits and group sizes at a fixed total length, against the FLOP-count bound\n"
        "                         (the GEMM micro-benchmark is `make bench-gemm`);\n"
        "                         memory: per-phase peak device memory of baseline and reuse, with offload\n"
        "                         and recompute, at the same splits; capacity: under --bench-budget, the longest\n"
        "                         total length each of them can train (shapes only: nothing is computed)\n"
        "                         tree: a step of n groups (each --bench-groups value, G 8) whose prompts open\n"
        "                         with one system prompt, one by one and as their prefix tree, against the bound\n"
        "  --bench-budget MIB     device memory a rank for --bench capacity, training state included (default 64);\n"
        "                         capacity takes the mesh flags (--dp --tp --pp --cp --ep --zero): every rank sized\n"
        "  --bench-sizes K        --bench memory, capacity: build (this build's element sizes, default) | gpu (the\n"
        "                         CUDA backend's: bf16 activations and weights), from any build; memory then\n"
        "                         runs on the measuring backend (no kernel: the peaks and chunks, no times)\n"
        "  --bench-total N        total tokens per trajectory in the speed sweep (default 1024)\n"
        "  --bench-system N       --bench tree: tokens of the system prompt every group's prompt opens with, at\n"
        "                         most the prompt (5/6 of --bench-total; default half of it)\n"
        "  --bench-reps N         timed repetitions per cell, best kept (default 2)\n"
        "  --bench-groups LIST    group sizes of the speed sweep, comma-separated (default 4,8); --bench tree:\n"
        "                         the numbers of groups a step\n"
        "  --profile              train_cuda --bench (speed): after each cell, where its timed steps' GPU time\n"
        "                         went, per backend operation (GEMMs by shape), and how long the GPU waited\n"
        "                         for the host between them; the timed steps are the profiled ones (about a\n"
        "                         microsecond an operation slower)\n"
        "  --bench-splits LIST    --bench speed and memory: the prefix's share of --bench-total at each split,\n"
        "                         fractions in (0, 1), comma-separated (default the paper's 2k/10k ... 10k/2k\n"
        "                         at 12k: 0.16667,0.5,0.66667,0.83333)\n"
        "  --peak-tflops X        peak rate for the MFU columns, 0 = no MFU (default " PEAK_DEFAULT_TEXT ")\n"
        "  -h, --help             this text\n");
}

/* A finite number (inf and nan are refused: every numeric flag is a finite setting) */
static int parse_double(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !isfinite(v)) return 0;
    *out = v;
    return 1;
}
/* MiB as a byte count that fits a size_t */
static int parse_mib(const char *s, size_t *bytes) {
    double d;
    if (!parse_double(s, &d) || !(d > 0) || d * 1048576.0 >= 0x1p63) return 0;
    *bytes = (size_t)(d * 1048576.0);
    return 1;
}
/* A byte count: a number (not negative) and a unit from the table, none meaning bytes */
static int parse_bytes(const char *s, uint64_t *bytes) {
    static const struct { const char *unit; double scale; } units[] = {
        {"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
        {"KiB", 0x1p10}, {"MiB", 0x1p20}, {"GiB", 0x1p30}, {"TiB", 0x1p40} };
    char *end;
    const double v = strtod(s, &end);
    if (end == s || !isfinite(v) || v < 0) return 0;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (!strcmp(end, units[i].unit) && v * units[i].scale < 0x1p63) {
            *bytes = (uint64_t)(v * units[i].scale);
            return 1;
        }
    return 0;
}
/* A count in decimal digits alone (no sign, no space) that fits 64 bits. */
static int parse_u64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    const unsigned long long v = strtoull(s, &end, 10);
    if (!isdigit((unsigned char)*s) || *end || errno == ERANGE) return 0;
    *out = v;
    return 1;
}

static int parse_int(const char *s, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < -2147483647L || v > 2147483647L) return 0;
    *out = (int)v;
    return 1;
}

/* A comma-separated list of at most cap items, each read by item(token, i, out); refused when empty
   or when an item is. */
static int parse_list(const char *s, int cap, int *n, int (*item)(const char *tok, int i, void *out), void *out) {
    char buf[256];
    if (strlen(s) >= sizeof buf) return 0;
    strcpy(buf, s);
    *n = 0;
    for (char *tok = buf, *comma;; tok = comma + 1) {
        comma = strchr(tok, ',');
        if (comma) *comma = 0;
        if (*n == cap || !*tok || !item(tok, *n, out)) return 0;
        (*n)++;
        if (!comma) return 1;
    }
}
static int positive_int_item(const char *tok, int i, void *out) { return parse_int(tok, (int *)out + i) && ((int *)out)[i] >= 1; }
static int fraction_item(const char *tok, int i, void *out) {
    double *f = (double *)out + i;
    return parse_double(tok, f) && *f > 0 && *f < 1;
}

static int parse_args(int argc, char **argv, options *o) {
    memset(o, 0, sizeof *o);
    o->config = "model/tiny";
    o->trace = "data/sample.trace";
    o->step = pr_step_opts_default();
    o->adam = pr_adamw_opts_default();
    o->steps = 8;
    o->tree_min = 16;
    o->seed = 1234;
    o->nccl_timeout = 600;
    o->bench_total = 1024;
    o->bench_reps = 2;
    o->bench_groups[0] = 4;
    o->bench_groups[1] = 8;
    o->n_bench_groups = 2;
    const double paper_splits[] = { 1.0 / 6, 1.0 / 2, 2.0 / 3, 5.0 / 6 };   /* 2k/10k ... 10k/2k at 12k */
    o->n_bench_splits = (int)(sizeof paper_splits / sizeof *paper_splits);
    memcpy(o->bench_splits, paper_splits, sizeof paper_splits);
    o->peak_tflops = PEAK_DEFAULT;
    o->bench_budget_mib = 64;
    o->dp = o->pp = o->cp = o->tp = o->ep = 1;
    o->attention = PR_CUDA_ATTENTION_AUTO;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int missing = i + 1 >= argc;      /* known only once the flag is: an unknown flag is named as such */
        const char *v = missing ? "" : argv[i + 1];
        int ok = 1, takes = 1;
        double d;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); exit(0); }
        else if (!strcmp(a, "--check")) { o->check = 1; takes = 0; }
        else if (!strcmp(a, "--save-bf16")) { o->save_bf16 = 1; takes = 0; }
        else if (!strcmp(a, "--new-trace")) { o->new_trace = 1; takes = 0; }
        else if (!strcmp(a, "--profile")) { o->profile = 1; takes = 0; }
        else if (!strcmp(a, "--bench")) {
            o->bench = 1;
            takes = 0;
            if (!strcmp(v, "speed")) takes = 1;
            else if (!strcmp(v, "memory")) { o->bench = 2; takes = 1; }
            else if (!strcmp(v, "capacity")) { o->bench = 3; takes = 1; }
            else if (!strcmp(v, "tree")) { o->bench = 4; takes = 1; }
            else if (v[0] && v[0] != '-') { ok = 0; takes = 1; }   /* no flag: a misspelt kind, not a flag of its own */
        }
        else if (!strcmp(a, "--config")) { o->config = v; o->config_given = 1; }
        else if (!strcmp(a, "--trace")) o->trace = v;
        else if (!strcmp(a, "--init")) o->init = v;
        else if (!strcmp(a, "--save")) o->save = v;
        else if (!strcmp(a, "--save-shard-size")) { ok = parse_bytes(v, &o->save_shard_bytes); o->save_shard_given = 1; }
        else if (!strcmp(a, "--save-grads")) o->save_grads = v;
        else if (!strcmp(a, "--save-state")) o->save_state = v;
        else if (!strcmp(a, "--resume")) o->resume = v;
        else if (!strcmp(a, "--loss-log")) o->loss_log = v;
        else if (!strcmp(a, "--log")) o->log = v;
        else if (!strcmp(a, "--replay")) ok = parse_int(v, &o->replay) && o->replay >= 1;
        else if (!strcmp(a, "--prefix-tree")) ok = parse_int(v, &o->prefix_tree) && o->prefix_tree >= 1;
        else if (!strcmp(a, "--save-every")) ok = parse_int(v, &o->save_every) && o->save_every >= 1;
        else if (!strcmp(a, "--fault-kill-after-bytes")) {
            uint64_t n = 0;
            ok = parse_u64(v, &n) && n <= (uint64_t)LONG_MAX;
            o->fault_kill_bytes = (long)n;
        }
        else if (!strcmp(a, "--seed")) ok = parse_u64(v, &o->seed);
        else if (!strcmp(a, "--steps")) ok = parse_int(v, &o->steps) && o->steps >= 0;
        else if (!strcmp(a, "--microbatch")) ok = parse_int(v, &o->step.microbatch) && o->step.microbatch >= 0;
        else if (!strcmp(a, "--microbatch-tokens")) ok = parse_int(v, &o->step.microbatch_tokens) && o->step.microbatch_tokens >= 0;
        else if (!strcmp(a, "--bench-total")) ok = parse_int(v, &o->bench_total) && o->bench_total >= 12;
        else if (!strcmp(a, "--bench-reps")) ok = parse_int(v, &o->bench_reps) && o->bench_reps >= 1;
        else if (!strcmp(a, "--bench-system")) ok = parse_int(v, &o->bench_system) && o->bench_system >= 1;
        else if (!strcmp(a, "--layers")) ok = parse_int(v, &o->layers) && o->layers >= 1;
        else if (!strcmp(a, "--dp")) ok = parse_int(v, &o->dp) && o->dp >= 1 && o->dp <= 64;
        else if (!strcmp(a, "--groups-per-step") || !strcmp(a, "--dp-groups"))
            ok = parse_int(v, &o->groups_per_step) && o->groups_per_step >= 1 && o->groups_per_step <= MAX_STEP_GROUPS;
        else if (!strcmp(a, "--loss-norm-len")) { char *e; o->loss_norm_len = strtol(v, &e, 10); ok = isdigit((unsigned char)*v) && !*e && o->loss_norm_len >= 1; }
        else if (!strcmp(a, "--pp")) ok = parse_int(v, &o->pp) && o->pp >= 1 && o->pp <= 64;
        else if (!strcmp(a, "--cp")) ok = parse_int(v, &o->cp) && o->cp >= 1 && o->cp <= 64;
        else if (!strcmp(a, "--tp")) ok = parse_int(v, &o->tp) && o->tp >= 1 && o->tp <= 64;
        else if (!strcmp(a, "--ep")) ok = parse_int(v, &o->ep) && o->ep >= 1 && o->ep <= 64;
        else if (!strcmp(a, "--nccl-id")) { o->nccl_id = v; o->nccl_given = a; }
        else if (!strcmp(a, "--nccl-timeout")) { ok = parse_int(v, &o->nccl_timeout) && o->nccl_timeout >= 1; o->nccl_given = a; }
        else if (!strcmp(a, "--attention")) {
            o->attention = -1;
            for (int k = 0; k <= PR_CUDA_ATTENTION_AUTO; k++)
                if (!strcmp(v, attention_names[k])) o->attention = k;
            ok = o->attention >= 0;
        }
        else if (!strcmp(a, "--zero")) ok = parse_int(v, &o->zero) && o->zero >= 0 && o->zero <= 2;
        else if (!strcmp(a, "--grad-reduce")) {
            if (!strcmp(v, "fp32")) o->grad_reduce_bf16 = 0;
            else if (!strcmp(v, "bf16")) o->grad_reduce_bf16 = 1;
            else ok = 0;
        }
        else if (!strcmp(a, "--aux-scope")) {
            if (!strcmp(v, "microbatch")) o->step.moe.scope = PR_AUX_SCOPE_MICROBATCH;
            else if (!strcmp(v, "group")) o->step.moe.scope = PR_AUX_SCOPE_GROUP;
            else ok = 0;
        }
        else if (!strcmp(a, "--prefix-multiplicity")) ok = parse_int(v, &o->step.moe.prefix_multiplicity) && o->step.moe.prefix_multiplicity >= 0;
        else if (!strcmp(a, "--offload")) {
            if (!strcmp(v, "on")) o->step.offload.enabled = 1;
            else if (!strcmp(v, "off")) o->step.offload.enabled = 0;
            else ok = 0;
        }
        else if (!strcmp(a, "--recompute")) {
            if (!strcmp(v, "none")) o->step.recompute = PR_RECOMPUTE_NONE;
            else if (!strcmp(v, "prefix")) o->step.recompute = PR_RECOMPUTE_PREFIX;
            else if (!strcmp(v, "all")) o->step.recompute = PR_RECOMPUTE_ALL;
            else ok = 0;
        }
        else if (!strcmp(a, "--offload-pool")) ok = parse_mib(v, &o->step.offload.pool_bytes);
        else if (!strcmp(a, "--device-budget")) ok = parse_mib(v, &o->step.offload.device_budget);
        else if (!strcmp(a, "--bench-budget")) ok = parse_double(v, &o->bench_budget_mib) && o->bench_budget_mib > 0;
        else if (!strcmp(a, "--bench-sizes")) {
            if (!strcmp(v, "gpu")) o->bench_gpu_sizes = 1;
            else if (!strcmp(v, "build")) o->bench_gpu_sizes = 0;
            else ok = 0;
        }
        else if (!strcmp(a, "--bench-groups")) ok = parse_list(v, 8, &o->n_bench_groups, positive_int_item, o->bench_groups);
        else if (!strcmp(a, "--bench-splits")) {
            ok = parse_list(v, 8, &o->n_bench_splits, fraction_item, o->bench_splits);
            o->bench_splits_given = 1;
        }
        else if (!strcmp(a, "--peak-tflops")) { ok = parse_double(v, &d) && d >= 0; o->peak_tflops = d; }
        else if (!strcmp(a, "--schedule")) {
            if (!strcmp(v, "baseline")) o->step.schedule = PR_SCHEDULE_BASELINE;
            else if (!strcmp(v, "reuse")) o->step.schedule = PR_SCHEDULE_REUSE;
            else if (!strcmp(v, "tree")) o->step.schedule = PR_SCHEDULE_REUSE, o->tree = 1;
            else ok = 0;
        }
        else if (!strcmp(a, "--tree-min")) { ok = parse_int(v, &o->tree_min) && o->tree_min >= 1; o->tree_min_given = a; }
        else if (!strcmp(a, "--layout")) {
            if (!strcmp(v, "padded")) o->step.layout = PR_LAYOUT_PADDED;
            else if (!strcmp(v, "packed")) o->step.layout = PR_LAYOUT_PACKED;
            else ok = 0;
        }
        else if (!strcmp(a, "--loss-norm")) ok = !pr_loss_norm_parse(v, &o->step.loss.norm, NULL);
        else if (!strcmp(a, "--eps-low")) { ok = parse_double(v, &d) && d >= 0 && d < 1; o->step.loss.eps_low = d; }
        else if (!strcmp(a, "--eps-high")) { ok = parse_double(v, &d) && d >= 0; o->step.loss.eps_high = d; }
        else if (!strcmp(a, "--kl-coef")) { ok = parse_double(v, &d) && d >= 0; o->step.loss.kl_coef = d; }
        else if (!strcmp(a, "--lr")) { ok = parse_double(v, &d) && d >= 0; o->adam.lr = d; }
        else if (!strcmp(a, "--weight-decay")) { ok = parse_double(v, &d) && d >= 0; o->adam.weight_decay = d; }
        else if (!strcmp(a, "--clip")) { ok = parse_double(v, &d) && d >= 0; o->adam.max_grad_norm = d; }
        else { fprintf(stderr, "train: unknown flag %s (see --help)\n", a); return 0; }
        if (takes && missing) { fprintf(stderr, "train: %s needs a value (see --help)\n", a); return 0; }
        if (!ok) { fprintf(stderr, "train: bad value '%s' for %s (see --help)\n", v, a); return 0; }
        i += takes;
    }
    if (o->save_grads && (o->steps < 1 || o->check || o->bench)) {
        fprintf(stderr, "train: --save-grads writes a training step's gradients: it needs --steps >= 1, without --check or --bench\n");
        return 0;
    }
    if ((o->save || o->save_state || o->resume || o->loss_log) && (o->check || o->bench)) {
        fprintf(stderr, "train: --save, --save-state, --resume and --loss-log belong to a training run, not --check or --bench\n");
        return 0;
    }
    if (o->check && o->bench) { fprintf(stderr, "train: --check and --bench are two runs: give one\n"); return 0; }
    if (o->loss_norm_len && o->step.loss.norm != PR_NORM_SEQ_MEAN_TOKEN_SUM_NORM) {
        fprintf(stderr, "train: --loss-norm-len is seq-mean-token-sum-norm's length: give --loss-norm seq-mean-token-sum-norm\n");
        return 0;
    }
    if (o->replay && (o->check || o->bench || on_mesh(o) || o->save_state || o->resume || o->save || o->save_grads)) {
        fprintf(stderr, "train: --replay runs its own three trainers on one rank: without --check, --bench, mesh flags, or saves\n");
        return 0;
    }
    if (o->tree && (o->bench || o->replay || o->prefix_tree)) {
        fprintf(stderr, "train: --schedule tree trains or checks on one rank or a mesh: without --bench, --replay or --prefix-tree\n");
        return 0;
    }
    if (o->prefix_tree && (o->check || o->bench || o->replay || on_mesh(o))) {
        fprintf(stderr, "train: --prefix-tree reports on the trace: without --check, --bench, --replay or mesh flags\n");
        return 0;
    }
    if (o->log && (o->check || o->bench)) { fprintf(stderr, "train: --log FILE writes the steps of a training run or of --replay\n"); return 0; }
    if (o->check && o->attention == PR_CUDA_ATTENTION_MMA_ATOMIC) {
        fprintf(stderr, "train: --check compares bits, which --attention mma-atomic does not reproduce: use mma or ffma\n");
        return 0;
    }
    if (o->resume && o->init) { fprintf(stderr, "train: --resume and --init both say where the weights come from: give one\n"); return 0; }
    if (o->new_trace && !o->resume) { fprintf(stderr, "train: --new-trace says where a --resume starts: it needs --resume DIR\n"); return 0; }
    if (o->save_every && !o->save_state) { fprintf(stderr, "train: --save-every needs --save-state DIR\n"); return 0; }
    if ((o->save_shard_given || o->save_bf16) && !o->save) {
        fprintf(stderr, "train: %s needs --save DIR\n", o->save_bf16 ? "--save-bf16" : "--save-shard-size");
        return 0;
    }
    if (o->grad_reduce_bf16 && o->dp < 2) {
        fprintf(stderr, "train: --grad-reduce bf16 changes the gradient sum over dp: it needs --dp 2 or more\n");
        return 0;
    }
    if (mesh_ranks(o) > 256) { fprintf(stderr, "train: a mesh of %d ranks is more than 256\n", mesh_ranks(o)); return 0; }
    if (on_mesh(o) && o->bench && o->bench != 3) {
        fprintf(stderr, "train: --bench speed and memory run on one rank (drop the mesh flags; --bench capacity takes them)\n");
        return 0;
    }
    if (o->bench_gpu_sizes && o->bench != 2 && o->bench != 3) {
        fprintf(stderr, "train: --bench-sizes belongs to --bench memory and --bench capacity\n");
        return 0;
    }
    if (o->profile && o->bench != 1) { fprintf(stderr, "train: --profile belongs to --bench (speed)\n"); return 0; }
    if (o->bench_splits_given && o->bench != 1 && o->bench != 2) {
        fprintf(stderr, "train: --bench-splits belongs to --bench (speed) and --bench memory\n");
        return 0;
    }
    if (o->tree_min_given && !o->tree) { fprintf(stderr, "train: --tree-min sets --schedule tree's smallest shared node: it needs that schedule\n"); return 0; }
    if ((o->step.offload.pool_bytes || o->step.offload.device_budget) && !o->step.offload.enabled && o->bench != 2 && o->bench != 3) {
        fprintf(stderr, "train: %s sets up the prefix's offload: it needs --offload on (or --bench memory or capacity, whose rows offload)\n",
                o->step.offload.pool_bytes ? "--offload-pool" : "--device-budget");
        return 0;
    }
#ifndef PR_CUDA
    if (o->profile) { fprintf(stderr, "train: --profile times the CUDA backend's operations: it is train_cuda's (make cuda)\n"); return 0; }
    if (o->nccl_given) {
        fprintf(stderr, "train: %s connects train_cuda's processes (make cuda), not this build's\n", o->nccl_given);
        return 0;
    }
#ifdef PR_NO_THREADS
    if (on_mesh(o)) { fprintf(stderr, "train: a mesh's ranks run as threads, which this build leaves out (compiled with PR_NO_THREADS)\n"); return 0; }
#endif
#else
    if (o->nccl_given && !on_mesh(o)) { fprintf(stderr, "train: %s connects a mesh's processes: give the mesh (--dp, --tp, ...)\n", o->nccl_given); return 0; }
    if (o->nccl_given && o->bench) {
        fprintf(stderr, "train: %s connects a training run's processes; --bench capacity runs its mesh's ranks as threads\n", o->nccl_given);
        return 0;
    }
#endif
    for (int i = 0; (o->bench == 1 || o->bench == 2) && i < o->n_bench_splits; i++) {
        const long P = split_prefix(o, i);
        if (P < 1 || P >= o->bench_total) {
            fprintf(stderr, "train: --bench-splits %g of --bench-total %d is a prefix of %ld tokens: a split needs a token on each side\n",
                    o->bench_splits[i], o->bench_total, P);
            return 0;
        }
    }
    if (o->pp > 1 && o->step.microbatch == 0 && !o->step.microbatch_tokens) o->step.microbatch = 1;   /* one microbatch would leave the stages in turn idle */
    return 1;
}

static int fail(const pr_error *err) {
    fprintf(stderr, "train: %s\n", err->message);
    return 1;
}

static const pr_backend *backend(pr_error *err);

/* train_cuda: the attention kernels --attention chose; the CPU build has one kind (ffma and auto refer to it). */
static pr_status select_attention(const options *o, pr_error *err) {
#ifdef PR_CUDA
    const pr_backend *be = backend(err);
    if (!be) return err->status;
    return pr_backend_cuda_set_attention(be, o->attention, err);
#else
    if (o->attention == PR_CUDA_ATTENTION_FFMA || o->attention == PR_CUDA_ATTENTION_AUTO) return PR_OK;
    err->status = PR_ERR_UNSUPPORTED;
    snprintf(err->message, sizeof err->message, "--attention mma, mma-atomic, wgmma: the tensor-core kernels are train_cuda's (make cuda)");
    return err->status;
#endif
}

/* The backend of this build: the CPU's, or one CUDA backend for the whole run, created on first use
   and destroyed as main returns (backend_release). Its device: LOCAL_RANK (one process per GPU,
   each seeing them all), else 0; and 0 where CUDA_VISIBLE_DEVICES names one device, the launcher
   having given this process its GPU alone (Slurm's --gpus-per-task=1, say). */
#ifdef PR_CUDA
static const pr_backend *cuda_backend;
static int own_device(void) {
    const char *visible = getenv("CUDA_VISIBLE_DEVICES"), *local = getenv("LOCAL_RANK");
    if (visible && visible[0] && !strchr(visible, ',')) return 0;
    return local ? atoi(local) : 0;
}
#endif
static const pr_backend *backend(pr_error *err) {
#ifdef PR_CUDA
    if (!cuda_backend && pr_backend_cuda_create(&cuda_backend, own_device(), err)) return NULL;
    return cuda_backend;
#else
    (void)err;
    return pr_backend_cpu();
#endif
}
/* Gives the device memory back, so that a leak check at exit sees only what really leaked. */
static void backend_release(void) {
#ifdef PR_CUDA
    if (cuda_backend) pr_backend_cuda_destroy(cuda_backend);
    cuda_backend = NULL;
#endif
}

/* Activations narrower than the parameters: the GPU's bf16 */
static int bf16_activations(void) {
    pr_error err;
    const pr_backend *be = backend(&err);
    return be && be->act_bytes == 2;
}

/* The microbatch options, for header lines: "4", "all G", "4, at most 12288 tokens". */
static const char *microbatch_label(const pr_step_opts *s) {
    static char label[64];
    if (!s->microbatch_tokens) snprintf(label, sizeof label, s->microbatch ? "%d" : "all G", s->microbatch);
    else if (!s->microbatch) snprintf(label, sizeof label, "of at most %d tokens", s->microbatch_tokens);
    else snprintf(label, sizeof label, "%d, at most %d tokens", s->microbatch, s->microbatch_tokens);
    return label;
}

/* A token budget may cut a group into microbatches of different counts in the two schedules (the
   baseline's hold whole sequences); a MoE aux loss of the microbatch scope then differs between
   them, so the comparisons (--check, --replay) refuse that. */
static int same_microbatches(const options *o, const pr_config *cfg, const pr_trace *trace) {
    if (!cfg->num_experts || o->step.moe.scope != PR_AUX_SCOPE_MICROBATCH || !o->step.microbatch_tokens) return 1;
    pr_step_opts b = o->step, r = o->step;
    b.schedule = PR_SCHEDULE_BASELINE;
    r.schedule = PR_SCHEDULE_REUSE;
    for (int i = 0; i < trace->n_groups; i++) {
        const int nb = pr_step_microbatch(&trace->groups[i], &b), nr = pr_step_microbatch(&trace->groups[i], &r);
        if (nb != nr) {
            fprintf(stderr, "train: --microbatch-tokens %d cuts group %d into microbatches of %d trajectories full-sequence and %d "
                    "with reuse, and the MoE aux loss of --aux-scope microbatch depends on them: compare with --aux-scope group, "
                    "or with --microbatch alone\n", o->step.microbatch_tokens, i, nb, nr);
            return 0;
        }
    }
    return 1;
}

/* The run's arithmetic, for header lines. */
static const char *precision_label(void) {
    return bf16_activations() ? "bf16 activations, fp32 parameters" : sizeof(pr_real) == 8 ? "double precision" : "float precision";
}

/* The benchmarks' header: the precision, the backend and, on the GPU, the attention kernels at
   head dims 64 and 128 (what --attention auto chose). */
static const char *run_label(void) {
    static char label[128];
    pr_error err;
    const pr_backend *be = backend(&err);
    const char *precision = precision_label();
#ifdef PR_CUDA
    const int kind = be ? pr_backend_cuda_attention(be) : -1;
    snprintf(label, sizeof label, "%s, cuda backend, %s attention", precision,
             kind >= 0 && kind < PR_CUDA_ATTENTION_AUTO ? attention_names[kind] : "?");
#else
    snprintf(label, sizeof label, "%s, %s backend", precision, be ? be->name : "?");
#endif
    return label;
}

/* What pr_trainer_state_bytes counts: the master weights, gradients, AdamW m and v, and the weights
   the kernels read where those are a copy of their own (bf16 on the GPU; under ZeRO, whose master
   weights are a slice). */
static const char *state_parts(int zero, int bf16) {
    if (zero) return bf16 ? "fp32 master weights, AdamW m and v sharded over dp; gradients, bf16 weights"
                          : "master weights, AdamW m and v sharded over dp; gradients, the weights the kernels read";
    return bf16 ? "fp32 master weights, gradients, AdamW m and v; bf16 weights" : "weights, gradients, AdamW m and v";
}

/* A trainer on backend be (this build's when NULL), initialised from --init or the seed. */
static int make_trainer_on(const options *o, const pr_config *cfg, const pr_backend *be, pr_trainer **tr, pr_error *err) {
    if (!be && !(be = backend(err))) return 0;
    if (pr_trainer_create(tr, cfg, be, err)) return 0;
    if (o->init ? pr_trainer_load(*tr, o->init, err) : pr_trainer_init_params(*tr, o->seed, err)) {
        pr_trainer_destroy(*tr);
        *tr = NULL;                  /* the caller may destroy what it holds */
        return 0;
    }
    return 1;
}
static int make_trainer(const options *o, const pr_config *cfg, pr_trainer **tr, pr_error *err) {
    return make_trainer_on(o, cfg, NULL, tr, err);
}

/* ------------------------------------------------------------------ training state */
/* --fault-kill-after-bytes: the save's progress hook ends the process where it stands, as a crash
   or an out-of-memory kill would, with files half written. */
static void kill_after(void *user, uint64_t bytes) {
    const options *o = user;
    if (bytes < (uint64_t)o->fault_kill_bytes) return;
    fflush(stdout);
#ifdef SIGKILL
    raise(SIGKILL);
#endif
    abort();
}

/* Where the run starts: step 0 at the trace's first group, or where --resume's state left off
   (its trace checked by resumed_trace_fits before anything was built), or with --new-trace at the
   trace's first group. The run's AdamW settings are the command line's; a state that ran with
   others gets a note. */
static pr_status start_state(const options *o, const pr_trace *t, pr_trainer *tr, pr_train_state *s, int lead, pr_error *err) {
    memset(s, 0, sizeof *s);
    s->seed = o->seed;
    s->adamw = o->adam;
    s->data_fingerprint = t->fingerprint;
    if (!o->resume) return PR_OK;
    pr_status st = pr_trainer_load_state(tr, o->resume, s, err);
    if (st) return st;
    const uint64_t was = s->data_fingerprint;
    if (o->new_trace) s->next_group = 0;
    s->data_fingerprint = t->fingerprint;
    if (!lead) return PR_OK;
    printf("resumed %s: %ld steps taken, next group %ld%s (seed %llu)\n", o->resume, s->step, s->next_group,
           o->new_trace ? " (--new-trace: this trace's first)" : "", (unsigned long long)s->seed);
    if (!was && !o->new_trace)
        fprintf(stderr, "train: note: %s records no trace fingerprint; going on at its position in %s\n", o->resume, o->trace);
    const pr_adamw_opts *a = &s->adamw, *b = &o->adam;
    if (a->lr != b->lr || a->beta1 != b->beta1 || a->beta2 != b->beta2 || a->eps != b->eps || a->weight_decay != b->weight_decay ||
        a->max_grad_norm != b->max_grad_norm)
        fprintf(stderr, "train: note: the state ran with lr %g, weight decay %g, clip %g; going on with lr %g, weight decay %g, clip %g\n",
                a->lr, a->weight_decay, a->max_grad_norm, b->lr, b->weight_decay, b->max_grad_norm);
    s->adamw = o->adam;
    return PR_OK;
}

/* --save-state, every --save-every steps and at the end (collective on a mesh). */
static pr_status save_state(const options *o, pr_trainer *tr, const pr_train_state *s, int lead, pr_error *err) {
    pr_save_opts so = { o->fault_kill_bytes ? kill_after : NULL, (void *)o };
    pr_status st = pr_trainer_save_state(tr, o->save_state, s, &so, err);
    if (!st && lead) printf("saved state %s (%ld steps, next group %ld)\n", o->save_state, s->step, s->next_group);
    return st;
}

static int save_due(const options *o, int k) {
    return o->save_state && ((o->save_every && (k + 1) % o->save_every == 0) || k == o->steps - 1);
}

/* A number for a JSON line: JSON has no NaN or infinity, so those are null. */
static void json_num(FILE *f, const char *key, double x, const char *after) {
    if (isfinite(x)) fprintf(f, "\"%s\": %.17g%s", key, x, after);
    else fprintf(f, "\"%s\": null%s", key, after);
}

/* A group's tokens as a schedule runs them: the baseline the prefix once per trajectory. */
static long group_tokens(const pr_group *g, pr_schedule s) {
    long suffix = (long)g->suffix_off[g->G];
    return s == PR_SCHEDULE_BASELINE ? suffix + (long)g->P * g->G : suffix + g->P;
}

/* A training step as --log writes it: the step's sums over its groups (and dp ranks), the phase
   times and peaks of this process's first rank. */
typedef struct {
    long step, first_group;
    int groups;
    double loss, grad_norm, seconds[3];
    pr_step_stats sums;          /* loss_tokens, kl_sum, clipped_tokens over the step */
    long tokens;                 /* the step's trajectory tokens, prefix counted per trajectory */
    size_t peak[3];
} step_record;

static void log_json_step(FILE *f, const step_record *r) {
    if (!f) return;
    const double n = r->sums.loss_tokens ? (double)r->sums.loss_tokens : NAN, t = r->seconds[0] + r->seconds[1] + r->seconds[2];
    fprintf(f, "{\"step\": %ld, \"first_group\": %ld, \"groups\": %d, ", r->step, r->first_group, r->groups);
    json_num(f, "loss", r->loss, ", ");
    json_num(f, "kl", r->sums.kl_sum / n, ", ");
    json_num(f, "clip_fraction", (double)r->sums.clipped_tokens / n, ", ");
    json_num(f, "grad_norm", r->grad_norm, ", ");
    fprintf(f, "\"loss_tokens\": %ld, ", r->sums.loss_tokens);
    json_num(f, "seconds_a", r->seconds[0], ", ");
    json_num(f, "seconds_b", r->seconds[1], ", ");
    json_num(f, "seconds_c", r->seconds[2], ", ");
    json_num(f, "tokens_per_s", t > 0 ? r->tokens / t : NAN, ", ");
    json_num(f, "peak_mib_a", r->peak[0] / 1048576.0, ", ");
    json_num(f, "peak_mib_b", r->peak[1] / 1048576.0, ", ");
    json_num(f, "peak_mib_c", r->peak[2] / 1048576.0, "}\n");
    fflush(f);
}

/* Progress of a long run: steps done of all, and the time left at the pace so far. */
static void print_progress(int done, int all, time_t start) {
    const double elapsed = difftime(time(NULL), start);
    printf("  [%d/%d", done, all);
    if (elapsed >= 1 && done < all) printf(", %.0f s left", elapsed / done * (all - done));
    printf("]\n");
    fflush(stdout);                  /* a log file shows each step as it ends */
}

/* --loss-log: exact values, so that two runs can be compared byte for byte; each line out as its
   step ends, so that a run that dies keeps its steps'. */
static void log_step(FILE *f, long step, double loss, double gnorm) {
    if (!f) return;
    fprintf(f, "step %ld loss %a grad-norm %a\n", step, loss, gnorm);
    fflush(f);
}

static pr_status set_error(pr_error *err, pr_status st, const char *msg) {
    err->status = st;
    snprintf(err->message, sizeof err->message, "%s", msg);
    return st;
}

/* The file of a run's --loss-log or --log (flag): *f opened with mode, or an error naming it and why. */
static pr_status open_run_file(const char *flag, const char *path, const char *mode, FILE **f, pr_error *err) {
    if ((*f = fopen(path, mode))) return PR_OK;
    err->status = PR_ERR_IO;
    snprintf(err->message, sizeof err->message, "%s %s: cannot open: %s", flag, path, strerror(errno));
    return PR_ERR_IO;
}

/* ------------------------------------------------------------------ steps */
/* The run's optimizer steps: a version-2 trace's own, or --groups-per-step N (default dp for a
   version-1 trace) consecutive groups, wrapping at the trace's end. A step is named by its trace
   position, the index of its first group counted from the run's start (pr_train_state.next_group:
   it keeps growing as the run cycles through the trace), so a resumed run goes on at a step. */
static int cut_steps(const options *o, const pr_trace *t) { return o->groups_per_step || !t->n_steps; }

/* The most groups a step of this run holds: the size of the caller's batch. */
static int max_step_groups(const options *o, const pr_trace *t) {
    int n = o->groups_per_step ? o->groups_per_step : o->dp;
    if (cut_steps(o, t)) return n;
    n = 1;
    for (int s = 0; s < t->n_steps; s++) if (t->step_off[s + 1] - t->step_off[s] > n) n = t->step_off[s + 1] - t->step_off[s];
    return n;
}

/* The groups of the step at trace position pos into batch, and the options it runs with: the run's,
   with the step's loss denominators over all its groups (pr_step_loss_totals). Returns the number
   of groups, or 0 with err set (a position that starts no step of the trace's table). */
static int step_at(const options *o, const pr_trace *t, long pos, pr_group *batch, pr_step_opts *opts, pr_error *err) {
    const int ng = t->n_groups, g0 = (int)(pos % ng);
    int n = 0;
    if (cut_steps(o, t)) {
        n = o->groups_per_step ? o->groups_per_step : o->dp;
        for (int k = 0; k < n; k++) batch[k] = t->groups[(g0 + k) % ng];
    } else {
        for (int s = 0; s < t->n_steps && !n; s++)
            if (t->step_off[s] == g0) n = t->step_off[s + 1] - g0;
        for (int k = 0; k < n; k++) batch[k] = t->groups[g0 + k];
        if (!n) {
            err->status = PR_ERR_ARG;
            snprintf(err->message, sizeof err->message, "trace position %ld (group %d) starts no step of %s's step table: "
                     "resume with the --groups-per-step the state was saved with", pos, g0, o->trace);
            return 0;
        }
    }
    *opts = o->step;
    return pr_step_loss_totals(batch, n, o->loss_norm_len, &opts->loss.step, err) ? 0 : n;
}

/* "its 3 steps" or "2 groups a step", and the loss mode, for the run's header line. */
static void print_steps(const options *o, const pr_trace *t) {
    if (cut_steps(o, t)) printf("steps: %d group%s a step", max_step_groups(o, t), max_step_groups(o, t) > 1 ? "s" : "");
    else printf("steps: the trace's %d (version 2)", t->n_steps);
    printf(", loss %s over the step", pr_loss_norm_name(o->step.loss.norm));
    if (o->step.loss.norm == PR_NORM_SEQ_MEAN_TOKEN_SUM_NORM) {
        if (o->loss_norm_len) printf(" (length %ld)", o->loss_norm_len);
        else printf(" (length: the step's longest suffix)");
    }
    printf("\n");
}

/* The block copies' throughput, both directions together. */
static double copy_gbps(const pr_offload_stats *s) {
    return (s->offloaded_bytes + s->loaded_bytes) / s->copy_seconds / 1e9;
}

static void print_offload(const char *indent, const pr_offload_stats *s) {
    printf("%soffload: dormant %.2f MiB (%.2f MiB a layer), pool %.2f MiB, out %.2f MiB, back %.2f MiB; "
           "%d prefetched, %d loaded at use, %d prefetches refused by the budget, %d pool fallbacks",
           indent, s->dormant_bytes / 1048576.0, s->block_bytes / 1048576.0, s->pool_bytes / 1048576.0,
           s->offloaded_bytes / 1048576.0, s->loaded_bytes / 1048576.0, s->prefetches, s->demand_loads,
           s->prefetches_refused, s->pool_fallbacks);
    if (s->copy_seconds > 0)
        printf("; copies %.2f ms on the copy queue (%.1f GB/s)", 1e3 * s->copy_seconds, copy_gbps(s));
    printf("\n");
}

/* ------------------------------------------------------------------ the mesh */

/* One rank's account of its run: time per phase, summed over steps, and the payload bytes each of
   its communicators put on the wire. */
typedef struct { double seconds[3]; size_t sent[4]; int coord[4]; size_t kv_bytes, stack_bytes, state_bytes, params; } rank_report;

/* What every rank of a mesh run does. check: one step over `groups` with `opts` (the reuse
   schedule), the gathered gradients and updated parameters left in grads/params; otherwise
   o->steps training steps over the trace. */
typedef struct {
    const options *o;
    const pr_config *cfg;
    const pr_trace *trace;
    int check;
    const pr_group *groups;
    int n;
    pr_step_opts opts;
    pr_real *grads, *params;     /* check: rank 0's gathered copies (full model) */
    double loss;
    long clipped;                /* check: the step's tokens whose clipped PPO term was taken */
    double *load;                /* check, MoE: the step's expert loads (layers x experts), summed over the mesh */
    int has_rank0;               /* check: rank 0 ran in this process, which holds its copies (with
                                    train_cuda, one process a rank: only one process does) */
    int split;                   /* a step had fewer groups than dp ranks: its groups were split */
    rank_report rep[256];
} mesh_job;

/* x[0..n) summed over c, through backend memory as collectives need. */
static pr_status sum_over_n(pr_comm *c, const pr_backend *be, double *x, size_t n, pr_error *err) {
    pr_real *h = malloc(sizeof(pr_real) * n), *d = be->alloc(be, sizeof(pr_real) * n, PR_TIER_DEVICE);
    pr_status st = !h ? set_error(err, PR_ERR_NOMEM, "out of host memory") : !d ? set_error(err, PR_ERR_NOMEM, "out of device memory") : PR_OK;
    if (!st) {
        for (size_t i = 0; i < n; i++) h[i] = (pr_real)x[i];
        be->upload_reals(be, d, h, n);
        st = c->all_reduce(c, d, n, PR_COMM_REAL, err);
        be->download_reals(be, h, d, n);
        for (size_t i = 0; i < n; i++) x[i] = h[i];
    }
    if (d) be->release(be, d, PR_TIER_DEVICE);
    free(h);
    return st;
}
static pr_status sum_over(pr_comm *c, const pr_backend *be, double *x, pr_error *err) { return sum_over_n(c, be, x, 1, err); }

/* MoE: adds the trainer's expert loads of its last compute_grads call (logical tokens per expert,
   each layer it holds) into load, (layers x experts) of the whole model. Two runs of the same step route
   alike exactly when these agree (bar flips that cancel): the check's routing report. */
static pr_status add_expert_loads(const pr_trainer *tr, const pr_config *cfg, double *load, pr_error *err) {
    const int E = cfg->num_experts;
    if (!E) return PR_OK;
    double *row = malloc(sizeof(double) * (size_t)E);
    if (!row) return set_error(err, PR_ERR_NOMEM, "out of host memory");
    for (int l = 0; l < cfg->num_hidden_layers; l++)
        if (!pr_trainer_expert_load(tr, l, row, E, NULL))     /* fails for layers another pp stage holds */
            for (int e = 0; e < E; e++) load[(size_t)l * E + e] += row[e];
    free(row);
    return PR_OK;
}

/* One optimizer step's groups over the mesh's dp ranks: placed whole or split (pr_trainer_compute_grads_dp),
   or with --schedule tree as subtrees of their prefix tree. */
static pr_status mesh_step_groups(const options *o, pr_trainer *tr, pr_comm *dp, const pr_group *batch, int nb,
                                  const pr_step_opts *so, pr_step_stats *ss, pr_error *err) {
    /* a tree places whole groups, one a rank at least: fewer are split over teams, which the reuse
       schedule runs (README "Prefix trees") */
    if (!o->tree || so->schedule != PR_SCHEDULE_REUSE || nb < dp->size) return pr_trainer_compute_grads_dp(tr, dp, batch, nb, so, ss, err);
    pr_prefix_tree t;
    memset(&t, 0, sizeof t);
    pr_status st = pr_prefix_tree_build(&t, batch, nb, o->tree_min, err);
    if (!st) st = pr_trainer_compute_grads_tree_dp(tr, dp, batch, nb, &t, so, ss, err);
    pr_prefix_tree_free(&t);
    return st;
}

static pr_status mesh_rank(pr_comm *world, void *user, pr_error *err) {
    mesh_job *j = user;
    const options *o = j->o;
    const pr_backend *be = backend(err);
    pr_mesh m;
    pr_trainer *tr = NULL;
    if (!be) return err->status;
    pr_status st = pr_mesh_init(&m, world, o->dp, o->pp, o->cp, o->tp, o->ep, err);
    if (st) return st;
    m.zero = o->zero;
    m.bf16_grad_reduce = o->grad_reduce_bf16;
    if (!(st = pr_trainer_create_mesh(&tr, j->cfg, be, &m, err)))
        st = o->init ? pr_trainer_load(tr, o->init, err) : pr_trainer_init_params(tr, o->seed, err);
    rank_report *r = &j->rep[world->rank < 256 ? world->rank : 255];
    const int lead = world->rank == 0;
    if (!st) {
        r->state_bytes = pr_trainer_state_bytes(tr);
        r->params = pr_trainer_param_count(tr);
    }
    const size_t n = st ? 0 : pr_trainer_full_param_count(tr);
    pr_step_stats ss;
    memset(&ss, 0, sizeof ss);
    if (!st && j->check) {
        pr_step_opts reuse = j->opts;
        reuse.schedule = PR_SCHEDULE_REUSE;
        pr_real *g = lead ? j->grads : malloc(sizeof(pr_real) * n), *p = lead ? j->params : malloc(sizeof(pr_real) * n);
        if (!g || !p) st = set_error(err, PR_ERR_NOMEM, "out of host memory");
        if (!st) st = mesh_step_groups(o, tr, m.dp_comm, j->groups, j->n, &reuse, &ss, err);
        if (!st) st = pr_trainer_get_full(tr, PR_ARENA_GRADS, g, n, err);
        if (!st) st = pr_trainer_adamw_step(tr, &o->adam, NULL, err);
        if (!st) st = pr_trainer_get_full(tr, PR_ARENA_PARAMS, p, n, err);
        double clipped = (double)ss.clipped_tokens;
        if (!st) st = sum_over(m.dp_comm, be, &ss.loss, err);
        if (!st) st = sum_over(m.dp_comm, be, &clipped, err);
        if (!st && j->load) {                 /* each dp rank routed its groups, each pp stage its layers (pp_comm: one rank without pp) */
            const size_t nl = (size_t)j->cfg->num_hidden_layers * (size_t)j->cfg->num_experts;
            double *load = calloc(nl, sizeof(double));
            if (!load) st = set_error(err, PR_ERR_NOMEM, "out of host memory");
            if (!st) st = add_expert_loads(tr, j->cfg, load, err);
            if (!st) st = sum_over_n(m.dp_comm, be, load, nl, err);
            if (!st) st = sum_over_n(m.pp_comm, be, load, nl, err);
            if (!st && lead) memcpy(j->load, load, sizeof(double) * nl);
            free(load);
        }
        if (!st && lead) j->loss = ss.loss, j->clipped = lround(clipped), j->has_rank0 = 1;
        for (int k = 0; !st && k < 3; k++) r->seconds[k] += ss.seconds[k];
        r->kv_bytes = ss.prefix_kv_bytes;
        r->stack_bytes = ss.prefix_stack_bytes;
        if (!lead) { free(g); free(p); }
    }
    pr_train_state ts;
    if (!st && !j->check) st = start_state(o, j->trace, tr, &ts, lead, err);
    FILE *log = NULL, *json = NULL;
    if (!st && !j->check && lead && o->loss_log) st = open_run_file("--loss-log", o->loss_log, "a", &log, err);
    if (!st && !j->check && lead && o->log) st = open_run_file("--log", o->log, "w", &json, err);
    const time_t start = time(NULL);
    pr_group *batch = malloc(sizeof(pr_group) * (size_t)max_step_groups(o, j->trace));
    if (!st && !j->check && !batch) st = set_error(err, PR_ERR_NOMEM, "out of host memory");
    for (int k = 0; !st && !j->check && k < o->steps; k++) {
        double gnorm;
        pr_step_opts so;
        const int ng = j->trace->n_groups;
        const long step = ts.step, pos = ts.next_group;
        const int nb = step_at(o, j->trace, pos, batch, &so, err);
        if (!nb) { st = err->status; break; }
        if (lead && nb < o->dp) j->split = 1;
        st = mesh_step_groups(o, tr, m.dp_comm, batch, nb, &so, &ss, err);
        if (!st && k == o->steps - 1 && o->save_grads) st = pr_trainer_save_grads(tr, o->save_grads, err);
        if (!st) st = pr_trainer_adamw_step(tr, &o->adam, &gnorm, err);
        /* the step's sums over dp: its loss and the diagnostics' counts */
        double tok = (double)ss.loss_tokens, clip = (double)ss.clipped_tokens;
        if (!st) st = sum_over(m.dp_comm, be, &ss.loss, err);
        if (!st) st = sum_over(m.dp_comm, be, &ss.kl_sum, err);
        if (!st) st = sum_over(m.dp_comm, be, &tok, err);
        if (!st) st = sum_over(m.dp_comm, be, &clip, err);
        if (st) break;
        ss.loss_tokens = lround(tok);
        ss.clipped_tokens = lround(clip);
        ts.step++;
        ts.next_group += nb;
        for (int q = 0; q < 3; q++) r->seconds[q] += ss.seconds[q];
        r->kv_bytes = ss.prefix_kv_bytes;
        r->stack_bytes = ss.prefix_stack_bytes;
        if (lead) {
            printf("step %3ld  groups %ld..%ld  loss %+.6f  grad-norm %.4f  rank 0: A %7.1f ms  B %7.1f ms  C %7.1f ms", step,
                   pos % ng, (pos + nb - 1) % ng, ss.loss, gnorm, 1e3 * ss.seconds[0], 1e3 * ss.seconds[1], 1e3 * ss.seconds[2]);
            print_progress(k + 1, o->steps, start);
            if (o->step.offload.enabled) print_offload("          rank 0 ", &ss.offload);
            log_step(log, step, ss.loss, gnorm);
            long tokens = 0;
            for (int b = 0; b < nb; b++) tokens += group_tokens(&batch[b], PR_SCHEDULE_BASELINE);
            step_record rec = { step, pos % ng, nb, ss.loss, gnorm, { ss.seconds[0], ss.seconds[1], ss.seconds[2] }, ss, tokens,
                                { ss.peak_bytes[0], ss.peak_bytes[1], ss.peak_bytes[2] } };
            log_json_step(json, &rec);
        }
        if (save_due(o, k)) st = save_state(o, tr, &ts, lead, err);
    }
    if (log) fclose(log);
    if (json && fclose(json) && !st) st = set_error(err, PR_ERR_IO, "writing the --log file failed");
    free(batch);
    if (!st && !j->check && o->steps == 0 && o->save_state) st = save_state(o, tr, &ts, lead, err);
    if (!st && !j->check && o->save && !(st = pr_trainer_save(tr, o->save, o->save_bf16 ? PR_DT_BF16 : PR_DT_F32, o->save_shard_bytes, err)) && lead)
        printf("saved %s\n", o->save);
    pr_comm *dims[4] = { m.dp_comm, m.pp_comm, m.cp_comm, m.tp_comm };
    const int coord[4] = { m.dp_rank, m.pp_rank, m.cp_rank, m.tp_rank };
    for (int k = 0; k < 4; k++) {
        r->sent[k] = dims[k] ? dims[k]->bytes_sent : 0;
        r->coord[k] = coord[k];
    }
    pr_trainer_destroy(tr);
    pr_mesh_free(&m);
    return st;
}

/* Runs the job on every rank: threads of this process on the CPU build; with train_cuda this
   process is one rank of an NCCL world (RANK, WORLD_SIZE from the launcher). */
static pr_status mesh_run(mesh_job *j, pr_error *err) {
#ifdef PR_CUDA
    const char *rank = getenv("RANK"), *size = getenv("WORLD_SIZE");
    if (!rank || !size || !j->o->nccl_id)
        return set_error(err, PR_ERR_ARG, "train_cuda on a mesh: one process per GPU with RANK, WORLD_SIZE (and LOCAL_RANK) set, and --nccl-id PATH or tcp://HOST:PORT");
    const pr_backend *be = backend(err);           /* first: it selects this rank's GPU (LOCAL_RANK) */
    if (!be) return err->status;
    pr_comm *world;
    pr_status st = pr_comm_nccl_create(&world, be, atoi(rank), atoi(size), j->o->nccl_id, j->o->nccl_timeout, err);
    if (st) return st;
    st = mesh_rank(world, j, err);
    world->destroy(world);
    return st;
#elif defined(PR_NO_THREADS)
    (void)j;                                       /* refused in parse_args */
    (void)mesh_rank;
    return set_error(err, PR_ERR_UNSUPPORTED, "this build has no in-process ranks (compiled with PR_NO_THREADS)");
#else
    return pr_comm_local_run(mesh_ranks(j->o), mesh_rank, j, err);
#endif
}

static void print_mesh(const options *o) {
    printf("mesh: dp %d x pp %d x cp %d x tp %d = %d ranks, ep %d, zero %d%s%s\n", o->dp, o->pp, o->cp, o->tp, mesh_ranks(o), o->ep,
           o->zero, o->grad_reduce_bf16 ? ", gradient sum over dp in bf16" : "",
#ifdef PR_CUDA
           ", NCCL, one process per GPU"
#else
           ", in-process ranks (threads)"
#endif
    );
}

/* Per rank: phase times and the bytes each dimension's collectives sent (this process's ranks). */
static void print_rank_reports(const options *o, const mesh_job *j) {
#ifdef PR_CUDA
    const char *me = getenv("RANK");
    int r0 = me ? atoi(me) : 0, r1 = r0 + 1;
#else
    int r0 = 0, r1 = mesh_ranks(o) < 256 ? mesh_ranks(o) : 256;
#endif
    for (int r = r0; r < r1; r++) {
        const rank_report *p = &j->rep[r];
        printf("  rank %2d (dp %d pp %d cp %d tp %d): A %8.1f ms  B %8.1f ms  C %8.1f ms; sent dp %.3f MiB, pp %.3f MiB, cp %.3f MiB, "
               "tp %.3f MiB\n", r, p->coord[0], p->coord[1], p->coord[2], p->coord[3], 1e3 * p->seconds[0], 1e3 * p->seconds[1],
               1e3 * p->seconds[2], p->sent[0] / 1048576.0, p->sent[1] / 1048576.0, p->sent[2] / 1048576.0, p->sent[3] / 1048576.0);
    }
    const rank_report *s = &j->rep[r0];
    if (s->params)
        printf("  training state on rank %d: %.2f MiB for %zu parameters, %.2f bytes a parameter (%s)\n",
               r0, s->state_bytes / 1048576.0, s->params, (double)s->state_bytes / (double)s->params,
               state_parts(o->zero, bf16_activations()));
    const rank_report *p = &j->rep[r0];
    if (j->split && o->step.schedule == PR_SCHEDULE_REUSE && p->kv_bytes)
        printf("  split groups: each peer gets rank %d's prefix K/V, %.3f MiB; the prefix's whole activation stack would be "
               "%.3f MiB (%.1fx)\n", r0, p->kv_bytes / 1048576.0, (p->kv_bytes + p->stack_bytes) / 1048576.0,
               (double)(p->kv_bytes + p->stack_bytes) / p->kv_bytes);
}

/* MoE: the aux term and, per layer, how evenly the step's logical tokens (load: layers x experts,
   add_expert_loads) spread over the experts. */
static void print_routing(const pr_config *cfg, const double *load, const pr_step_stats *st) {
    printf("          MoE: aux loss %.6f%s; expert load (max/mean, min/mean) per layer:", st->aux_loss,
           st->routing_prepass ? " (after a routing pre-pass)" : "");
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        const double *row = load + (size_t)l * cfg->num_experts;
        double sum = 0, mx = 0, mn = INFINITY;
        for (int e = 0; e < cfg->num_experts; e++) { sum += row[e]; mx = fmax(mx, row[e]); mn = fmin(mn, row[e]); }
        double mean = sum / cfg->num_experts;
        if (l < 8 || l == cfg->num_hidden_layers - 1) printf(" %d:%.2f/%.2f", l, mx / mean, mn / mean);
        else if (l == 8) printf(" ...");
    }
    printf("\n");
}

static int run_training_mesh(const options *o, const pr_config *cfg, const pr_trace *trace) {
    static mesh_job j;
    pr_error err;
    memset(&j, 0, sizeof j);
    j.o = o; j.cfg = cfg; j.trace = trace;
    print_mesh(o);
    printf("trace %s: %d groups; schedule %s, microbatch %s, layout %s, %s\n", o->trace, trace->n_groups,
           o->tree ? "tree" : o->step.schedule == PR_SCHEDULE_REUSE ? "reuse" : "baseline", microbatch_label(&o->step),
           o->step.layout == PR_LAYOUT_PACKED ? "packed" : "padded", precision_label());
    print_steps(o, trace);
    if (mesh_run(&j, &err)) return fail(&err);
    print_rank_reports(o, &j);
    return 0;
}

/* One optimizer step's groups into the gradient arena: one by one in trace order, accumulating, or
   with --schedule tree as their prefix tree. *sum: the step's stats. */
/* One optimizer step's groups on one rank; load (MoE, optional): the step's expert loads added in
   (add_expert_loads). */
static pr_status step_groups(const options *o, pr_trainer *tr, const pr_group *batch, int nb, pr_step_opts so, pr_step_stats *sum,
                             double *load, pr_error *err) {
    memset(sum, 0, sizeof *sum);
    if (o->tree && so.schedule == PR_SCHEDULE_REUSE) {
        pr_prefix_tree t;
        memset(&t, 0, sizeof t);
        pr_status st = pr_prefix_tree_build(&t, batch, nb, o->tree_min, err);
        if (!st) st = pr_trainer_compute_grads_tree(tr, batch, nb, &t, &so, sum, err);
        pr_prefix_tree_free(&t);
        if (!st && load) st = add_expert_loads(tr, pr_trainer_config(tr), load, err);
        return st;
    }
    for (int b = 0; b < nb; b++) {
        pr_step_stats st;
        so.accumulate = b > 0;
        pr_status s = pr_trainer_compute_grads(tr, &batch[b], &so, &st, NULL, err);
        if (s) return s;
        if (load && (s = add_expert_loads(tr, pr_trainer_config(tr), load, err))) return s;
        pr_step_stats_add(sum, &st);
    }
    return PR_OK;
}

static int run_training(const options *o, const pr_config *cfg, const pr_trace *trace) {
    pr_error err;
    pr_trainer *tr;
    if (on_mesh(o)) return run_training_mesh(o, cfg, trace);
    if (!make_trainer(o, cfg, &tr, &err)) return fail(&err);
    char mlp[96];
    /* MoE's routing runs on the host's threads (prefixreuse.h 6.1) */
#ifdef _OPENMP
    const int host_threads = omp_get_max_threads();
    const char *no_openmp = "";
#else
    const int host_threads = 1;
    const char *no_openmp = " (built without OpenMP)";
#endif
    if (cfg->num_experts)
        snprintf(mlp, sizeof mlp, "%d experts (top %d) x %d, routed on %d host thread%s%s", cfg->num_experts,
                 cfg->num_experts_per_tok, cfg->moe_intermediate_size, host_threads, host_threads > 1 ? "s" : "", no_openmp);
    else
        snprintf(mlp, sizeof mlp, "%d", cfg->intermediate_size);
    printf("model %s: %d layers, hidden %d, %d/%d heads x %d, MLP %s, vocabulary %d, %.2f M parameters (%.1f MiB with gradients and AdamW state)\n",
           cfg->model_type, cfg->num_hidden_layers, cfg->hidden_size, cfg->num_attention_heads, cfg->num_key_value_heads,
           cfg->head_dim, mlp, cfg->vocab_size, pr_trainer_param_count(tr) / 1e6,
           4.0 * sizeof(pr_real) * pr_trainer_param_count(tr) / 1048576.0);
    static const char *recompute_name[3] = { "none", "prefix", "all" };
    printf("trace %s: %d groups; schedule %s, microbatch %s, layout %s, offload %s, recompute %s, %s\n", o->trace,
           trace->n_groups, o->tree ? "tree" : o->step.schedule == PR_SCHEDULE_REUSE ? "reuse" : "baseline", microbatch_label(&o->step),
           o->step.layout == PR_LAYOUT_PACKED ? "packed" : "padded", o->step.offload.enabled ? "on" : "off",
           recompute_name[o->step.recompute], precision_label());
    print_steps(o, trace);
    pr_train_state ts;
    FILE *log = NULL, *json = NULL;
    pr_group *batch = malloc(sizeof(pr_group) * (size_t)max_step_groups(o, trace));
    const size_t nl = (size_t)cfg->num_hidden_layers * (size_t)cfg->num_experts;   /* MoE: the step's expert loads */
    double *load = nl ? malloc(sizeof(double) * nl) : NULL;
    if (!batch || (nl && !load)) set_error(&err, PR_ERR_NOMEM, "out of host memory");
    if (!batch || (nl && !load) || start_state(o, trace, tr, &ts, 1, &err) ||
        (o->loss_log && open_run_file("--loss-log", o->loss_log, "a", &log, &err)) ||
        (o->log && open_run_file("--log", o->log, "w", &json, &err)))
        goto stop;
    const time_t start = time(NULL);
    for (int k = 0; k < o->steps; k++) {
        const long step = ts.step, pos = ts.next_group;
        pr_step_opts so;
        pr_step_stats sum;
        double gnorm;
        long tokens = 0;
        const int nb = step_at(o, trace, pos, batch, &so, &err);
        /* the step: its groups' gradients, then one AdamW step */
        if (load) memset(load, 0, sizeof(double) * nl);
        int failed = !nb || step_groups(o, tr, batch, nb, so, &sum, load, &err) != PR_OK;
        for (int b = 0; b < nb; b++) tokens += group_tokens(&batch[b], PR_SCHEDULE_BASELINE);
        if (failed || (k == o->steps - 1 && o->save_grads && pr_trainer_save_grads(tr, o->save_grads, &err)) ||
            pr_trainer_adamw_step(tr, &o->adam, &gnorm, &err))
            goto stop;
        ts.step++;
        ts.next_group += nb;
        const long gi = pos % trace->n_groups;
        double total = sum.seconds[0] + sum.seconds[1] + sum.seconds[2];
        if (nb == 1) printf("step %3ld  group %ld (P %d, G %d)", step, gi, batch[0].P, batch[0].G);
        else printf("step %3ld  groups %ld..%ld", step, gi, (pos + nb - 1) % trace->n_groups);
        printf("  loss %+.6f  grad-norm %.4f  A %7.1f ms  B %7.1f ms  C %7.1f ms  %8.0f tok/s  peak A/B/C %.1f/%.1f/%.1f MiB",
               sum.loss, gnorm, 1e3 * sum.seconds[0], 1e3 * sum.seconds[1], 1e3 * sum.seconds[2], tokens / total,
               sum.peak_bytes[0] / 1048576.0, sum.peak_bytes[1] / 1048576.0, sum.peak_bytes[2] / 1048576.0);
        print_progress(k + 1, o->steps, start);
        log_step(log, step, sum.loss, gnorm);
        step_record rec = { step, gi, nb, sum.loss, gnorm, { sum.seconds[0], sum.seconds[1], sum.seconds[2] }, sum, tokens,
                            { sum.peak_bytes[0], sum.peak_bytes[1], sum.peak_bytes[2] } };
        log_json_step(json, &rec);
        if (o->step.offload.enabled) print_offload("          ", &sum.offload);
        if (load) print_routing(cfg, load, &sum);
        if (save_due(o, k) && save_state(o, tr, &ts, 1, &err)) goto stop;
    }
    if (log) fclose(log);
    int rc = 0;
    if (json && fclose(json)) rc = 1, fprintf(stderr, "train: writing --log %s failed\n", o->log);
    free(batch);
    free(load);
    if (o->steps == 0 && o->save_state && save_state(o, tr, &ts, 1, &err)) rc = fail(&err);
    if (o->save) {
        if (pr_trainer_save(tr, o->save, o->save_bf16 ? PR_DT_BF16 : PR_DT_F32, o->save_shard_bytes, &err)) rc = fail(&err);
        else printf("saved %s\n", o->save);
    }
    pr_trainer_destroy(tr);
    return rc;
stop:                       /* a failure before or during the steps: what is open closed, the error told */
    if (log) fclose(log);
    if (json) fclose(json);
    free(batch);
    free(load);
    pr_trainer_destroy(tr);
    return fail(&err);
}

/* ------------------------------------------------------------------ --check */
/* A step of fewer groups than dp ranks splits group i over ranks i*dp/n .. (i+1)*dp/n - 1, each
   rank cutting its share of the trajectories into microbatches of its own (README "Split groups").
   A share that starts off a microbatch boundary of one rank's cut makes other microbatches, and
   the MoE aux loss of --aux-scope microbatch is then another sum than the one-rank baseline's that
   --check compares with: refused, as same_microbatches refuses a token budget's differing cuts. */
static int split_microbatches_match(const options *o, const pr_config *cfg, const pr_trace *trace) {
    if (!cfg->num_experts || o->step.moe.scope != PR_AUX_SCOPE_MICROBATCH || o->dp < 2) return 1;
    pr_group *batch = malloc(sizeof(pr_group) * (size_t)max_step_groups(o, trace));
    if (!batch) { fprintf(stderr, "train: out of memory\n"); return 0; }
    pr_step_opts r = o->step;
    r.schedule = PR_SCHEDULE_REUSE;
    int match = 1;
    for (int gi = 0, nb = 0; gi < trace->n_groups && match; gi += nb) {
        pr_step_opts so;
        pr_error err;
        if (!(nb = step_at(o, trace, gi, batch, &so, &err))) {
            fprintf(stderr, "train: %s\n", err.message);
            match = 0;
            break;
        }
        for (int i = 0; i < nb && nb < o->dp && match; i++) {
            const int t = (i + 1) * o->dp / nb - i * o->dp / nb, G = batch[i].G, mb = pr_step_microbatch(&batch[i], &r);
            for (int k = 1; k < t && match; k++)
                if ((k * G / t) % mb) {
                    fprintf(stderr, "train: the step at group %d splits its group %d (G %d) over %d dp ranks, whose shares "
                            "cut other microbatches than one rank's of %d trajectories, and the MoE aux loss of --aux-scope "
                            "microbatch depends on them: compare with --aux-scope group, or with as many groups a step as "
                            "--dp\n", gi, (gi + i) % trace->n_groups, G, t, mb);
                    match = 0;
                }
        }
    }
    free(batch);
    return match;
}

typedef struct { double max_abs, max_rel; long bad; } diff;

/* The mixed test |a-b| <= atol + rtol*|b| (+ allow[i] when given), per element; atol_at[i]
   instead of atol when given. max_rel is over the elements where b is not 0 (in bf16 a gradient
   exactly 0 in one schedule can be a rounding's worth off it in the other). */
static diff compare_at(const pr_real *a, const pr_real *b, size_t n, double atol, const double *atol_at, double rtol,
                       const double *allow) {
    diff d = { 0, 0, 0 };
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - b[i]);
        if (e > d.max_abs) d.max_abs = e;
        if (b[i] != 0 && e / fabs((double)b[i]) > d.max_rel) d.max_rel = e / fabs((double)b[i]);   /* over b != 0 */
        if (!(e <= (atol_at ? atol_at[i] : atol) + rtol * fabs((double)b[i]) + (allow ? allow[i] : 0))) d.bad++;
    }
    return d;
}
static diff compare(const pr_real *a, const pr_real *b, size_t n, double atol, double rtol, const double *allow) {
    return compare_at(a, b, n, atol, NULL, rtol, allow);
}
/* ||a - b|| / ||b||: the size of a difference against the whole vector's, where an element's
   relative difference is dominated by entries near zero. */
static double rel_l2(const pr_real *a, const pr_real *b, size_t n) {
    double dd = 0, bb = 0;
    for (size_t i = 0; i < n; i++) {
        double e = (double)a[i] - b[i];
        dd += e * e;
        bb += (double)b[i] * b[i];
    }
    return bb > 0 ? sqrt(dd / bb) : sqrt(dd);
}
static void worst_of(diff *w, diff d) {
    if (d.max_abs > w->max_abs) w->max_abs = d.max_abs;
    if (d.max_rel > w->max_rel) w->max_rel = d.max_rel;
    w->bad += d.bad;
}

/* The reuse step (its nb groups accumulated) once more with offload off and no recompute, from the
   same weights: the number of gradient and updated-parameter values whose bits differ from
   grads/params (offload or recompute on), or -1 on error. */
static long plain_bitwise_diffs(const options *o, const pr_config *cfg, const pr_group *groups, int nb, const pr_step_opts *with,
                                const pr_real *grads, const pr_real *params, size_t n) {
    pr_error err;
    pr_trainer *tr;
    pr_step_opts without = *with;
    without.offload.enabled = 0;
    without.recompute = PR_RECOMPUTE_NONE;
    if (!make_trainer(o, cfg, &tr, &err)) return fail(&err), -1;
    pr_real *ga = malloc(sizeof(pr_real) * n), *pa = malloc(sizeof(pr_real) * n);
    long diffs = -1;
    int failed = !ga || !pa;
    if (failed) fprintf(stderr, "train: out of memory\n");
    pr_step_stats sum;
    if (!failed && step_groups(o, tr, groups, nb, without, &sum, NULL, &err)) failed = fail(&err);
    if (!failed && (pr_trainer_get_grads(tr, ga, n, &err) || pr_trainer_adamw_step(tr, &o->adam, NULL, &err) ||
                    pr_trainer_get_params(tr, pa, n, &err)))
        failed = fail(&err);
    if (!failed) {
        diffs = 0;
        for (size_t i = 0; i < n; i++) diffs += memcmp(&ga[i], &grads[i], sizeof(pr_real)) != 0;
        for (size_t i = 0; i < n; i++) diffs += memcmp(&pa[i], &params[i], sizeof(pr_real)) != 0;
    }
    free(ga);
    free(pa);
    pr_trainer_destroy(tr);
    return diffs;
}

/* The gradient tensors with elements outside their tolerance, to say where a failed check failed. */
static void print_tensors_out(const pr_trainer *tr, const pr_real *a, const pr_real *b, const double *atol_at, double rtol) {
    for (int t = 0; t < pr_trainer_tensor_count(tr); t++) {
        const pr_tensor_info *ti = pr_trainer_tensor(tr, t);
        diff d = compare_at(a + ti->offset, b + ti->offset, ti->numel, 0, atol_at + ti->offset, rtol, NULL);
        if (d.bad) printf("    %-48s %8ld of %8zu gradients out, max abs %.2e (atol %.1e)\n", ti->name, d.bad, ti->numel, d.max_abs,
                          atol_at[ti->offset]);
    }
}

/* MoE: where the two runs' expert loads differ, a router logit within rounding of a tie took
   another expert in one run only (the objective's own discontinuity, as a clipped PPO ratio is):
   the layers, and how many routings moved at least (half the loads' differences). Returns the
   count of such layers: the check fails on any, since the two schedules then computed different
   functions; where no tie can flip (double precision) a difference means the loads' own
   accounting is wrong. */
static int print_routing_flips(const pr_config *cfg, const double *base, const double *other, const char *name) {
    const int E = cfg->num_experts;
    int layers = 0;
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        double moved = 0;
        for (int e = 0; e < E; e++) moved += fabs(base[(size_t)l * E + e] - other[(size_t)l * E + e]);
        if (moved == 0) continue;
        if (!layers++) printf("    expert loads differ from %s's (in low precision a router logit within rounding of a tie takes "
                              "another expert in one run only, and the gradient terms of its tokens go with it; in double, the "
                              "loads' accounting is wrong); routings moved:", name);
        printf(" layer %d %.0f", l, moved / 2);
    }
    if (layers) printf("\n");
    return layers;
}

static int run_check(const options *o, const pr_config *cfg, const pr_trace *trace) {
    /* Tolerances from the precision of the build, fixed before any run: a few thousand ulps of
       accumulated reordering for float, the same reasoning at double's 2^-52. With bf16
       activations every GEMM output and saved tensor is rounded at bf16's spacing, 2^-8 relative:
       rtol is twice that. A gradient element is a sum over tokens whose terms carry that rounding
       while the sum may cancel, so its error follows the size of the terms, not of the element:
       atol is two bf16 spacings (2^-6) at the scale of the tensor's largest baseline gradient.
       That is the mixed test of the paper's bf16 runs, applied per tensor; one global atol (2^-7
       times the root mean square of all gradients) fails the baseline itself against the double
       build on the emulated device (make test-gpu-emu), where the rounding is the GPU's and the
       sums are exact. The loss is compared with 2^-7 times that root mean square. */
    const int bf16 = bf16_activations();
    const double rtol = bf16 ? 0x1p-7 : sizeof(pr_real) == 8 ? 1e-10 : 2e-4;
    double atol = sizeof(pr_real) == 8 ? 1e-13 : 1e-6;
    const pr_adamw_opts adam = o->adam;
    pr_step_opts ob = o->step, orr = o->step;
    ob.schedule = PR_SCHEDULE_BASELINE;
    ob.offload.enabled = 0;
    orr.schedule = PR_SCHEDULE_REUSE;
    long plain_diffs = 0;           /* bits that differ from a reuse step without offload and recompute */
    const int vs_plain = !on_mesh(o) && (orr.offload.enabled || orr.recompute != PR_RECOMPUTE_NONE);
    static const char *recompute_name[3] = { "none", "prefix", "all" };
    if (!same_microbatches(o, cfg, trace) || !split_microbatches_match(o, cfg, trace)) return 1;
    printf("check: baseline (microbatch %s, padded) vs %s (the same, %s), recompute %s, %s, atol %s rtol %.1e\n",
           microbatch_label(&o->step), o->tree ? "tree" : "reuse", o->step.layout == PR_LAYOUT_PACKED ? "packed" : "padded",
           recompute_name[o->step.recompute], precision_label(),
           bf16 ? "2^-6 x max|gradient| of each tensor" : sizeof(pr_real) == 8 ? "1e-13" : "1e-06", rtol);
    diff worst_g = { 0, 0, 0 }, worst_p = { 0, 0, 0 }, wire_g = { 0, 0, 0 }, wire_p = { 0, 0, 0 };
    double worst_loss = 0, wire_l2_g = 0, wire_l2_p = 0;
    long load_layers = 0;           /* MoE: (step, layer) pairs whose expert loads differ between the runs */
    int rc = 0;
    /* every step of the trace, once: the baseline on one rank accumulating the step's groups,
       against the reuse schedule doing the same on one rank or on the mesh */
    if (on_mesh(o)) print_mesh(o);
    print_steps(o, trace);
    static mesh_job j;
    pr_group *batch = malloc(sizeof(pr_group) * (size_t)max_step_groups(o, trace));
    if (!batch) { fprintf(stderr, "train: out of memory\n"); return 1; }
    for (int gi = 0, nb = 0; gi < trace->n_groups && !rc; gi += nb) {
        pr_error err;
        pr_step_opts so;
        pr_trainer *base = NULL, *reuse = NULL;
        pr_step_stats sb, sr;
        double gnorm;
        if (!(nb = step_at(o, trace, gi, batch, &so, &err)) || !make_trainer(o, cfg, &base, &err) ||
            (!on_mesh(o) && !make_trainer(o, cfg, &reuse, &err))) {
            pr_trainer_destroy(base);
            free(batch);
            return fail(&err);
        }
        const pr_group *g = &batch[0];
        ob.loss.step = orr.loss.step = so.loss.step;
        size_t n = pr_trainer_param_count(base);
        pr_real *ga = malloc(sizeof(pr_real) * n), *gb = malloc(sizeof(pr_real) * n);
        pr_real *pa = malloc(sizeof(pr_real) * n), *pb = malloc(sizeof(pr_real) * n);
        double *allow = malloc(sizeof(double) * n), *atol_at = malloc(sizeof(double) * n);
        const size_t nl = (size_t)cfg->num_hidden_layers * (size_t)cfg->num_experts;   /* MoE: expert loads, each run's */
        double *load_b = nl ? calloc(nl, sizeof(double)) : NULL, *load_r = nl ? calloc(nl, sizeof(double)) : NULL;
        int failed = !ga || !gb || !pa || !pb || !allow || !atol_at || (nl && (!load_b || !load_r));
        if (failed) fprintf(stderr, "train: out of memory\n");
        memset(&sb, 0, sizeof sb);
        sr = sb;
        for (int k = 0; k < nb && !failed; k++) {
            pr_step_stats s1;
            ob.accumulate = k > 0;
            if (pr_trainer_compute_grads(base, &batch[k], &ob, &s1, NULL, &err)) failed = fail(&err);
            else {
                pr_step_stats_add(&sb, &s1);
                if (load_b && add_expert_loads(base, cfg, load_b, &err)) failed = fail(&err);
            }
        }
        if (!failed && (pr_trainer_get_grads(base, ga, n, &err) || pr_trainer_adamw_step(base, &adam, &gnorm, &err) ||
                        pr_trainer_get_params(base, pa, n, &err)))
            failed = fail(&err);
        if (!failed && on_mesh(o)) {
            memset(&j, 0, sizeof j);
            j.o = o; j.cfg = cfg; j.trace = trace; j.check = 1; j.groups = batch; j.n = nb; j.opts = orr; j.grads = gb; j.params = pb;
            j.load = load_r;
            j.split = nb < o->dp;
            /* The schedules are compared with the sum over dp in reals, as always; a bf16 sum runs the
               same mesh step once more and its own difference is reported beside. */
            options reals = *o;
            reals.grad_reduce_bf16 = 0;
            j.o = &reals;
            if (mesh_run(&j, &err)) failed = fail(&err);
            sr.loss = j.loss;
            sr.clipped_tokens = j.clipped;
            if (!failed && o->grad_reduce_bf16) {
                pr_real *gw = malloc(sizeof(pr_real) * n), *pw = malloc(sizeof(pr_real) * n);
                j.o = o; j.grads = gw; j.params = pw;
                if (!gw || !pw) failed = 1, fprintf(stderr, "train: out of memory\n");
                else if (mesh_run(&j, &err)) failed = fail(&err);
                else if (j.has_rank0) {
                    worst_of(&wire_g, compare(gw, gb, n, 0, 0, NULL));
                    worst_of(&wire_p, compare(pw, pb, n, 0, 0, NULL));
                    wire_l2_g = fmax(wire_l2_g, rel_l2(gw, gb, n));
                    wire_l2_p = fmax(wire_l2_p, rel_l2(pw, pb, n));
                }
                free(gw);
                free(pw);
            }
        } else if (!failed) {
            if (step_groups(o, reuse, batch, nb, orr, &sr, load_r, &err)) failed = fail(&err);
            if (!failed && (pr_trainer_get_grads(reuse, gb, n, &err) || pr_trainer_adamw_step(reuse, &adam, NULL, &err) ||
                            pr_trainer_get_params(reuse, pb, n, &err)))
                failed = fail(&err);
        }
        if (failed) rc = 1;
        else if (!on_mesh(o) || j.has_rank0) {
            double atol_max = atol;
            for (size_t i = 0; i < n; i++) atol_at[i] = atol;
            if (bf16) {
                double ss = 0;
                for (size_t i = 0; i < n; i++) ss += (double)ga[i] * ga[i];
                atol = 0x1p-7 * sqrt(ss / (double)n);
                atol_max = 0;
                for (int t = 0; t < pr_trainer_tensor_count(base); t++) {
                    const pr_tensor_info *ti = pr_trainer_tensor(base, t);
                    double m = 0;
                    for (size_t i = ti->offset; i < ti->offset + ti->numel && i < n; i++) m = fmax(m, fabs((double)ga[i]));
                    for (size_t i = ti->offset; i < ti->offset + ti->numel && i < n; i++) atol_at[i] = 0x1p-6 * m;
                    atol_max = fmax(atol_max, 0x1p-6 * m);
                }
            }
            /* A gradient inside its tolerance moves the first AdamW step g/(|g|+eps) by at most
               lr * tol_g / (|g|+eps), the slope of that map, and never by more than 2 lr: below the
               gradient's own noise floor a step's sign is noise in either schedule. */
            double c = adam.max_grad_norm > 0 && gnorm > adam.max_grad_norm ? adam.max_grad_norm / gnorm : 1.0;
            for (size_t i = 0; i < n; i++) {
                double gi_abs = c * fabs((double)ga[i]), tol_g = c * (atol_at[i] + rtol * fabs((double)ga[i]));
                allow[i] = adam.lr * fmin(2.0, tol_g / (gi_abs + adam.eps));
            }
            diff dg = compare_at(gb, ga, n, 0, atol_at, rtol, NULL), dp = compare_at(pb, pa, n, 0, atol_at, rtol, allow);
            double dl = fabs(sb.loss - sr.loss);
            if (nb > 1) printf("  step of groups %d..%d (%lld trajectories)", gi, (gi + nb - 1) % trace->n_groups, (long long)so.loss.step.trajectories);
            else printf("  group %d (P %3d, G %2d)", gi, g->P, g->G);
            printf(": loss %+.9f vs %+.9f  grads max abs %.2e rel %.2e (%ld out)  params max abs %.2e rel %.2e (%ld out)  atol up to %.1e\n",
                   sb.loss, sr.loss, dg.max_abs, dg.max_rel, dg.bad, dp.max_abs, dp.max_rel, dp.bad, atol_max);
            if (sb.clipped_tokens != sr.clipped_tokens)      /* the objective's own step, not the schedule's */
                printf("    clipped tokens: baseline %ld, %s %ld: a ratio within rounding of 1 - eps-low or 1 + eps-high "
                       "clips in one run only, and that token's gradient terms go with it\n", sb.clipped_tokens,
                       o->tree ? "tree" : "reuse", sr.clipped_tokens);
            if (load_b) load_layers += print_routing_flips(cfg, load_b, load_r, o->tree ? "tree" : "reuse");
            if (dg.bad) print_tensors_out(base, gb, ga, atol_at, rtol);
            if (!(dl <= atol + rtol * fabs(sb.loss))) dg.bad++;
            worst_of(&worst_g, dg);
            worst_of(&worst_p, dp);
            worst_loss = fmax(worst_loss, dl);
            if (vs_plain) {
                long d = plain_bitwise_diffs(o, cfg, batch, nb, &orr, gb, pb, n);
                if (d < 0) rc = 1;
                else plain_diffs += d;
            }
        }
        free(ga); free(gb); free(pa); free(pb); free(allow); free(atol_at); free(load_b); free(load_r);
        pr_trainer_destroy(base);
        pr_trainer_destroy(reuse);
    }
    free(batch);
    if (rc) return rc;
    if (on_mesh(o)) print_rank_reports(o, &j);
    if (on_mesh(o) && !j.has_rank0) {
        printf("check: this process ran its rank of the mesh; the process of rank 0 compares\n");
        return 0;
    }
    int pass = worst_g.bad == 0 && worst_p.bad == 0 && plain_diffs == 0 && load_layers == 0;
    if (o->grad_reduce_bf16)
        printf("check: the gradient sum over dp in bf16 vs in %s (reuse): gradients max abs %.2e, relative L2 %.2e; "
               "parameters after AdamW max abs %.2e, relative L2 %.2e\n", sizeof(pr_real) == 8 ? "double" : "fp32",
               wire_g.max_abs, wire_l2_g, wire_p.max_abs, wire_l2_p);
    if (vs_plain)
        printf("check: %s with offload %s, recompute %s vs neither: %ld gradient and parameter values differ in any bit\n",
               o->tree ? "tree" : "reuse", orr.offload.enabled ? "on" : "off", recompute_name[orr.recompute], plain_diffs);
    printf("check: %s loss |diff| %.2e; gradients max abs %.2e max rel %.2e; parameters after AdamW max abs %.2e max rel %.2e; %ld elements outside atol + rtol %.1e (parameters: + the AdamW slope times the gradient tolerance)\n",
           pass ? "PASS" : "FAIL", worst_loss, worst_g.max_abs, worst_g.max_rel, worst_p.max_abs, worst_p.max_rel,
           worst_g.bad + worst_p.bad, rtol);
    if (load_layers) printf("check: the expert loads differ in %ld layer%s of the steps (above)\n", load_layers, load_layers > 1 ? "s" : "");
    return pass ? 0 : 1;
}

/* ------------------------------------------------------------------ --prefix-tree */
/* Each optimizer step's prefix tree (pr_prefix_tree_build) and what running its nodes once would
   save over running each group's prompt once, the level the reuse schedule shares. */
static int run_prefix_tree(const options *o, const pr_trace *trace) {
    pr_error err;
    pr_group *batch = malloc(sizeof(pr_group) * (size_t)max_step_groups(o, trace));
    if (!batch) { fprintf(stderr, "train: out of memory\n"); return 1; }
    printf("prefix trees of %s (runs of %d or more tokens shared by two or more groups become nodes)\n", o->trace, o->prefix_tree);
    print_steps(o, trace);
    printf("%5s %7s %6s %7s %16s %13s %12s %9s\n", "step", "groups", "nodes", "shared", "full-sequence", "each group", "each node",
           "saved");
    long pos = 0, all[3] = { 0, 0, 0 };
    int steps = 0, rc = 0;
    do {                                        /* the trace's groups once, step by step */
        pr_step_opts so;
        pr_prefix_tree t;
        memset(&t, 0, sizeof t);
        const int nb = step_at(o, trace, pos, batch, &so, &err);
        if (!nb || pr_prefix_tree_build(&t, batch, nb, o->prefix_tree, &err)) {
            rc = fail(&err);
            break;
        }
        int shared = 0;
        for (int i = 0; i < t.n_nodes; i++) shared += t.nodes[i].groups_below > 1;
        printf("%5d %7d %6d %7d %16ld %13ld %12ld %8.1f%%\n", steps, nb, t.n_nodes, shared, t.tokens_baseline, t.tokens_groups,
               t.tokens_tree, 100.0 * (double)(t.tokens_groups - t.tokens_tree) / (double)t.tokens_groups);
        all[0] += t.tokens_baseline;
        all[1] += t.tokens_groups;
        all[2] += t.tokens_tree;
        pr_prefix_tree_free(&t);
        pos += nb;
        steps++;
    } while (pos < trace->n_groups);
    if (!rc)
        printf("all %d steps: prefix tokens full-sequence %ld, each group once %ld, each node once %ld: the tree runs %.1f%% fewer "
               "prefix tokens than the reuse schedule (which runs %.1f%% fewer than full-sequence); --schedule tree runs them\n",
               steps, all[0], all[1], all[2], 100.0 * (double)(all[1] - all[2]) / (double)all[1],
               100.0 * (double)(all[0] - all[1]) / (double)all[0]);
    free(batch);
    return rc;
}

/* ------------------------------------------------------------------ --replay */
/* One of the replay's runs: its trainer and schedule, and its last step's loss and gradient norm. */
typedef struct {
    pr_trainer *tr;
    pr_schedule schedule;
    double loss, gnorm;
    pr_real *params;
} replay_run;

typedef struct { double max_abs, rel_l2; } drift;
static drift drift_of(const pr_real *a, const pr_real *b, size_t n) {
    drift d = { 0, rel_l2(a, b, n) };
    for (size_t i = 0; i < n; i++) d.max_abs = fmax(d.max_abs, fabs((double)a[i] - b[i]));
    return d;
}

/* A group with its trajectories reordered so that every microbatch of `mb` (0: all G) holds the same
   trajectories in reverse order; with microbatches of one, the microbatches run in reverse. The
   loss and every gradient are the same sums in another order: the floor's run. */
typedef struct {
    pr_group g;
    int *len;
    int64_t *off;
    int32_t *tokens;
    pr_real *adv, *old, *ref;
    uint8_t *mask;
} reordered_group;

/* Safe to call again: reorder_group's failure frees what it took, and run_replay frees every group. */
static void reordered_free(reordered_group *r) {
    free(r->len); free(r->off); free(r->tokens); free(r->adv); free(r->old); free(r->ref); free(r->mask);
    memset(r, 0, sizeof *r);
}

static int reorder_group(reordered_group *r, const pr_group *g, int mb) {
    const int G = g->G, m = mb == 0 || mb > G ? G : mb;
    const size_t T = (size_t)g->suffix_off[G];
    memset(r, 0, sizeof *r);
    r->len = malloc(sizeof(int) * G);
    r->off = malloc(sizeof(int64_t) * (G + 1));
    r->tokens = malloc(sizeof(int32_t) * T);
    r->adv = malloc(sizeof(pr_real) * G);
    r->old = malloc(sizeof(pr_real) * T);
    r->ref = g->ref_logp ? malloc(sizeof(pr_real) * T) : NULL;
    r->mask = malloc(T);
    if (!r->len || !r->off || !r->tokens || !r->adv || !r->old || (g->ref_logp && !r->ref) || !r->mask) {
        reordered_free(r);
        return 0;
    }
    r->off[0] = 0;
    for (int i = 0; i < G; i++) {
        const int b = i / m * m, e = b + m < G ? b + m : G;
        const int from = m == 1 ? G - 1 - i : b + e - 1 - i;
        const size_t at = (size_t)r->off[i], src = (size_t)g->suffix_off[from], n = (size_t)g->suffix_len[from];
        r->len[i] = g->suffix_len[from];
        r->off[i + 1] = r->off[i] + r->len[i];
        r->adv[i] = g->advantage[from];
        memcpy(r->tokens + at, g->tokens + src, sizeof(int32_t) * n);
        memcpy(r->old + at, g->old_logp + src, sizeof(pr_real) * n);
        if (r->ref) memcpy(r->ref + at, g->ref_logp + src, sizeof(pr_real) * n);
        memcpy(r->mask + at, g->loss_mask + src, n);
    }
    r->g = *g;
    r->g.suffix_len = r->len; r->g.suffix_off = r->off; r->g.tokens = r->tokens;
    r->g.advantage = r->adv; r->g.old_logp = r->old; r->g.ref_logp = r->ref; r->g.loss_mask = r->mask;
    return 1;
}

/* The replay's verdict: the reuse drift stays within a margin of the floor at every step. Both are
   sums of roundings of the same size, so they grow alike; 10x leaves room for the luck of single
   elements. The absolute term covers a floor that is exactly 0 (a step whose split changes no sum). */
#define REPLAY_MARGIN 10.0
/* With narrow activations the reuse and full-sequence runs round alike everything they compute
   alike, so reuse strays from the wide reference about as far as the baseline does (0.77-1.26x
   on the emulated device, tiny over 60 steps and the MoE preset over 24); twice leaves room for
   reuse's own roundings (independent ones of the same size would give 1.4x). What moves the
   trajectory less than bf16 itself does is below this check's resolution: --check's one step
   and the CPU build's replay see it. */
#define REPLAY_MARGIN_NARROW 2.0
#define REPLAY_FLOOR_MIN (sizeof(pr_real) == 8 ? 1e-15 : 1e-9)

/* --replay N: three runs from the same weights over the same N steps (one trace group a step,
   cycling), each with its own AdamW trajectory: the full-sequence schedule (the reference), the
   reuse schedule, and the full-sequence schedule on the trajectories reordered (reorder_group). The
   last differs from the first only in the order its sums run in, so its drift is the floor
   ordinary arithmetic sets: reuse is as good as the baseline when its drift stays at that floor.
   (Another microbatch split would not do: it changes a microbatch-scope MoE aux loss.)
   With activations narrower than the parameters (bf16 on the GPU) reordering moves only the wide
   sums while reuse rounds its activations differently, so the third run is instead the
   full-sequence schedule on the CPU backend, activations as wide as the parameters: the
   reference. The drift is then reuse's from it, the floor the full-sequence run's: reuse is as
   good as the baseline when it strays from the wide trajectory no further than the baseline does. */
static int run_replay(const options *o, const pr_config *cfg, const pr_trace *trace) {
    replay_run run[3];
    pr_error err;
    const int narrow = bf16_activations();
    if (!same_microbatches(o, cfg, trace)) return 1;
    memset(run, 0, sizeof run);      /* 0 full-sequence, 1 reuse, 2 the floor's: reordered, or on the CPU when narrow */
    run[0].schedule = run[2].schedule = PR_SCHEDULE_BASELINE;
    run[1].schedule = PR_SCHEDULE_REUSE;
    FILE *log = NULL;
    size_t n = 0;
    int rc = 0;
    reordered_group *floor_groups = narrow ? NULL : calloc((size_t)trace->n_groups, sizeof *floor_groups);
    if (!narrow && !floor_groups) rc = 1;
    pr_step_opts full = o->step;
    full.schedule = PR_SCHEDULE_BASELINE;
    for (int i = 0; !narrow && i < trace->n_groups && !rc; i++)
        if (!reorder_group(&floor_groups[i], &trace->groups[i], pr_step_microbatch(&trace->groups[i], &full))) rc = 1;
    if (rc) fprintf(stderr, "train: out of memory\n");
    for (int r = 0; r < 3 && !rc; r++) {
        if (!make_trainer_on(o, cfg, narrow && r == 2 ? pr_backend_cpu() : NULL, &run[r].tr, &err)) rc = fail(&err);
        else if (!(run[r].params = malloc(sizeof(pr_real) * (n = pr_trainer_param_count(run[r].tr))))) {
            fprintf(stderr, "train: out of memory\n");
            rc = 1;
        }
    }
    if (!rc && o->log && !(log = fopen(o->log, "w"))) {
        fprintf(stderr, "train: cannot open --log %s\n", o->log);
        rc = 1;
    }
    if (!rc)
        printf("replay: %d steps over %s (%d groups); full-sequence vs reuse (%s), microbatch %s; %s; "
               "%s parameters\n",
               o->replay, o->trace, trace->n_groups, o->step.layout == PR_LAYOUT_PACKED ? "packed" : "padded", microbatch_label(&o->step),
               narrow ? "bf16 activations: drift = reuse's and floor = full-sequence's from the reference, the full-sequence "
                        "schedule on the CPU in the parameters' precision"
                      : "drift = reuse's from full-sequence; floor = full-sequence with each microbatch's trajectories reversed",
               sizeof(pr_real) == 8 ? "double" : "float");
    if (!rc) {
        print_steps(o, trace);
        printf("%5s %14s %14s %10s %10s %11s %11s %11s %11s\n", "step", "loss full", "loss reuse", "gnorm full", "gnorm reuse",
               "drift max", "drift relL2", "floor max", "floor relL2");
    }
    drift worst = { 0, 0 }, worst_floor = { 0, 0 };
    const double margin = narrow ? REPLAY_MARGIN_NARROW : REPLAY_MARGIN;
    const int ref_run = narrow ? 2 : 0, floor_run = narrow ? 0 : 2;     /* what both drifts are measured from; the floor's */
    int over = 0;                /* steps whose reuse drift is past margin times the floor */
    pr_group *batch = rc ? NULL : malloc(sizeof(pr_group) * (size_t)max_step_groups(o, trace));
    if (!rc && !batch) rc = 1, fprintf(stderr, "train: out of memory\n");
    long pos = 0;
    for (int k = 0; k < o->replay && !rc; k++) {
        pr_step_opts so;
        const int nb = step_at(o, trace, pos, batch, &so, &err);
        if (!nb) rc = fail(&err);
        for (int r = 0; r < 3 && !rc; r++) {        /* each run: the step's groups accumulated, one AdamW step */
            pr_step_opts ro = so;
            ro.schedule = run[r].schedule;
            ro.offload.enabled = run[r].schedule == PR_SCHEDULE_REUSE && o->step.offload.enabled;
            run[r].loss = 0;
            for (int b = 0; b < nb && !rc; b++) {
                pr_step_stats st;
                ro.accumulate = b > 0;
                const pr_group *g = r == 2 && !narrow ? &floor_groups[(pos + b) % trace->n_groups].g : &batch[b];
                if (pr_trainer_compute_grads(run[r].tr, g, &ro, &st, NULL, &err))
                    rc = fail(&err);
                else run[r].loss += st.loss;
            }
            if (!rc && (pr_trainer_adamw_step(run[r].tr, &o->adam, &run[r].gnorm, &err) ||
                        pr_trainer_get_params(run[r].tr, run[r].params, n, &err)))
                rc = fail(&err);
        }
        if (rc) break;
        drift d = drift_of(run[1].params, run[ref_run].params, n), f = drift_of(run[floor_run].params, run[ref_run].params, n);
        worst.max_abs = fmax(worst.max_abs, d.max_abs);
        worst.rel_l2 = fmax(worst.rel_l2, d.rel_l2);
        worst_floor.max_abs = fmax(worst_floor.max_abs, f.max_abs);
        worst_floor.rel_l2 = fmax(worst_floor.rel_l2, f.rel_l2);
        over += !(d.rel_l2 <= margin * f.rel_l2 + REPLAY_FLOOR_MIN);
        printf("%5d %+14.9f %+14.9f %10.6f %11.6f %11.3e %11.3e %11.3e %11.3e\n", k, run[0].loss, run[1].loss, run[0].gnorm,
               run[1].gnorm, d.max_abs, d.rel_l2, f.max_abs, f.rel_l2);
        if (log) {
            fprintf(log, "{\"step\": %d, \"first_group\": %ld, \"groups\": %d, ", k, pos % trace->n_groups, nb);
            json_num(log, "loss_full", run[0].loss, ", ");
            json_num(log, "loss_reuse", run[1].loss, ", ");
            json_num(log, "loss_floor", run[2].loss, ", ");
            json_num(log, "grad_norm_full", run[0].gnorm, ", ");
            json_num(log, "grad_norm_reuse", run[1].gnorm, ", ");
            json_num(log, "grad_norm_floor", run[2].gnorm, ", ");
            json_num(log, "drift_max_abs", d.max_abs, ", ");
            json_num(log, "drift_rel_l2", d.rel_l2, ", ");
            json_num(log, "floor_max_abs", f.max_abs, ", ");
            json_num(log, "floor_rel_l2", f.rel_l2, "}\n");
        }
        fflush(stdout);
        pos += nb;
    }
    free(batch);
    if (!rc) {
        printf("replay: worst over %d steps: reuse drift max abs %.3e, relative L2 %.3e; floor max abs %.3e, relative L2 %.3e "
               "(reuse / floor: %.2f)\n", o->replay, worst.max_abs, worst.rel_l2, worst_floor.max_abs, worst_floor.rel_l2,
               worst_floor.rel_l2 > 0 ? worst.rel_l2 / worst_floor.rel_l2 : (worst.rel_l2 > 0 ? INFINITY : 1.0));
        printf("replay: %s: %d of %d steps with the reuse drift (relative L2) above %g x the floor + %g\n", over ? "FAIL" : "PASS",
               over, o->replay, margin, REPLAY_FLOOR_MIN);
        rc = over > 0;
    }
    if (log && fclose(log) && !rc) {
        fprintf(stderr, "train: writing --log %s failed\n", o->log);
        rc = 1;
    }
    for (int r = 0; r < 3; r++) {
        pr_trainer_destroy(run[r].tr);
        free(run[r].params);
    }
    for (int i = 0; floor_groups && i < trace->n_groups; i++) reordered_free(&floor_groups[i]);
    free(floor_groups);
    return rc;
}

/* ------------------------------------------------------------------ --bench */
/* A synthetic group: G suffixes of S tokens after a P-token prefix, random tokens and log-probs. */
typedef struct {
    pr_group g;
    int32_t *prefix, *tokens;
    int *len;
    int64_t *off;
    pr_real *adv, *old;
    uint8_t *mask;
} synth_group;

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17;
    return *s;
}

/* Safe to call again: synth's failure frees what it took, and some callers free after it. */
static void synth_free(synth_group *sg) {
    free(sg->prefix); free(sg->tokens); free(sg->len); free(sg->off); free(sg->adv); free(sg->old); free(sg->mask);
    memset(sg, 0, sizeof *sg);
}

static int synth(synth_group *sg, int P, int S, int G, int V, uint64_t seed) {
    memset(sg, 0, sizeof *sg);
    size_t n = (size_t)S * G;
    sg->prefix = malloc(sizeof(int32_t) * P); sg->tokens = malloc(sizeof(int32_t) * n);
    sg->len = malloc(sizeof(int) * G); sg->off = malloc(sizeof(int64_t) * (G + 1));
    sg->adv = malloc(sizeof(pr_real) * G); sg->old = malloc(sizeof(pr_real) * n); sg->mask = malloc(n);
    if (!sg->prefix || !sg->tokens || !sg->len || !sg->off || !sg->adv || !sg->old || !sg->mask) {
        synth_free(sg);
        return 0;
    }
    uint64_t s = seed | 1;
    for (int i = 0; i < P; i++) sg->prefix[i] = (int32_t)(rng_next(&s) % (uint64_t)V);
    for (size_t i = 0; i < n; i++) {
        sg->tokens[i] = (int32_t)(rng_next(&s) % (uint64_t)V);
        sg->old[i] = (pr_real)(-log((double)V) - 0.3 * (double)(rng_next(&s) % 1000) / 1000.0);
        sg->mask[i] = 1;
    }
    for (int i = 0; i < G; i++) { sg->len[i] = S; sg->off[i] = (int64_t)i * S; sg->adv[i] = (pr_real)((i % 2) ? 1 : -1); }
    sg->off[G] = (int64_t)n;
    pr_group *g = &sg->g;
    g->P = P; g->G = G; g->prefix = sg->prefix; g->suffix_len = sg->len; g->suffix_off = sg->off; g->tokens = sg->tokens;
    g->advantage = sg->adv; g->old_logp = sg->old; g->ref_logp = NULL; g->loss_mask = sg->mask;
    g->prefix_mask = NULL; g->prefix_old_logp = g->prefix_ref_logp = NULL;
    return 1;
}

/* Best wall time of reps runs of one schedule on the group; *sum: all of them; phase (or NULL):
   the best run's time in each phase. */
static int time_step(pr_trainer *tr, const pr_group *g, const pr_step_opts *o, int reps, double *best, double *sum, double *phase,
                     pr_error *err) {
    *best = INFINITY;
    *sum = 0;
    for (int r = 0; r < reps; r++) {
        pr_step_stats st;
        if (pr_trainer_compute_grads(tr, g, o, &st, NULL, err)) return 0;
        double t = st.seconds[0] + st.seconds[1] + st.seconds[2];
        *sum += t;
        if (t < *best) {
            *best = t;
            if (phase) memcpy(phase, st.seconds, sizeof st.seconds);
        }
    }
    return 1;
}

/* --profile: time_step with the backend's operation profile on, then where a step's time went: each
   operation, the longest first, and the time between operations. */
static int time_step_profiled(const options *o, pr_trainer *tr, const pr_group *g, const pr_step_opts *so, const char *what,
                              double *best, double *phase, pr_error *err) {
    double sum;
#ifdef PR_CUDA
    const pr_backend *be = o->profile ? backend(err) : NULL;
    if (be && pr_backend_cuda_profile(be, 1, err)) return 0;
    const pr_cuda_gemm_counts gemms = pr_backend_cuda_gemm_counts(be);
#endif
    if (!time_step(tr, g, so, o->bench_reps, best, &sum, phase, err)) return 0;
#ifdef PR_CUDA
    if (!be) return 1;
    pr_backend_cuda_profile(be, 0, err);
    pr_cuda_op_time rows[PR_CUDA_PROFILE_OPS];
    int complete;
    int n = pr_backend_cuda_profile_read(be, rows, PR_CUDA_PROFILE_OPS, &complete);
    if (n > PR_CUDA_PROFILE_OPS) n = PR_CUDA_PROFILE_OPS;
    const double step = sum / o->bench_reps;
    double in_ops = 0;
    for (int i = 0; i < n; i++) in_ops += rows[i].seconds / o->bench_reps;
    printf("  profile %s %d/%d G%d: %.4f s a step (the mean of %d), %d operations%s\n", what, g->P, g->suffix_len[0], g->G,
           step, o->bench_reps, n, complete ? "" : " (some untimed: the sums are short)");
    for (int i = 0; i < n; i++)
        printf("    %5.1f%% %9.2f ms %7.1f calls  %s\n", 100 * rows[i].seconds / o->bench_reps / step, 1e3 * rows[i].seconds / o->bench_reps,
               (double)rows[i].calls / o->bench_reps, rows[i].name);
    printf("    %5.1f%% %9.2f ms %13s  between operations (the GPU waiting for the host)\n", 100 * (step - in_ops) / step,
           1e3 * (step - in_ops), "");
    const pr_cuda_gemm_counts now = pr_backend_cuda_gemm_counts(be);
    printf("    GEMMs: %.1f a step, %.1f of new shapes (each a query of cuBLASLt's heuristic), %.1f evicting another\n",
           (double)(now.lookups - gemms.lookups) / o->bench_reps, (double)(now.queries - gemms.queries) / o->bench_reps,
           (double)(now.evictions - gemms.evictions) / o->bench_reps);
    fflush(stdout);
#else
    (void)what;
#endif
    return 1;
}

/* Under a --bench row: the reuse step's phases, each one's time and FLOP rate, and the time it
   takes beyond its FLOPs at the baseline's rate, as a share of the step. Those shares add up to
   1 - ratio: where the step falls short of the speed-up bound. */
static void print_phases(const options *o, const pr_config *cfg, const pr_group *g, const double *phase, double step,
                         double base_rate) {
    double f[3];
    pr_step_phase_flops(cfg, g, PR_SCHEDULE_REUSE, f);
    printf("%17s", "reuse A/B/C:");
    for (int p = 0; p < 3; p++) printf("%s %.4f s", p ? "," : "", phase[p]);
    printf(";");
    for (int p = 0; p < 3; p++) {
        printf("%s %.2f", p ? " /" : "", phase[p] > 0 ? f[p] / phase[p] / 1e9 : 0);
        if (o->peak_tflops > 0 && phase[p] > 0) printf(" (%.1f%%)", 100 * f[p] / phase[p] / (o->peak_tflops * 1e12));
    }
    printf(" GF/s; beyond the baseline's rate:");
    for (int p = 0; p < 3; p++) printf("%s %+.1f%%", p ? " /" : "", 100 * (phase[p] - f[p] / base_rate) / step);
    printf(" of the step\n");
}

static int run_bench_speed(const options *o, const pr_config *cfg) {
    const int T = o->bench_total;
    int heavy = 0;                   /* the most prefix-heavy split */
    for (int fi = 1; fi < o->n_bench_splits; fi++)
        if (o->bench_splits[fi] > o->bench_splits[heavy]) heavy = fi;
    pr_error err;
    pr_trainer *tr;
    if (!make_trainer(o, cfg, &tr, &err)) return fail(&err);
    const int mfu = o->peak_tflops > 0;
    printf("bench: %s, %d layers, hidden %d, total %d tokens per trajectory, best of %d, microbatch %s, %s\n",
           cfg->model_type, cfg->num_hidden_layers, cfg->hidden_size, T, o->bench_reps, microbatch_label(&o->step), run_label());
    printf("%-11s %3s %12s %12s %9s %9s %9s %10s %10s%s\n", "split P/S", "G", "baseline s", "reuse s", "speedup", "bound",
           "ratio", "base GF/s", "reuse GF/s", mfu ? "  base MFU reuse MFU" : "");
    double sum_ratio = 0, heavy_ratio = 0;
    int cells = 0;
    for (int fi = 0; fi < o->n_bench_splits; fi++)
        for (int gi = 0; gi < o->n_bench_groups; gi++) {
            int P = (int)split_prefix(o, fi), S = T - P, G = o->bench_groups[gi];
            synth_group sg;
            if (!synth(&sg, P, S, G, cfg->vocab_size, 77 + fi * 10 + gi)) {
                fprintf(stderr, "train: out of memory\n");
                pr_trainer_destroy(tr);
                return 1;
            }
            pr_step_opts ob = o->step, orr = o->step;
            ob.schedule = PR_SCHEDULE_BASELINE;
            orr.schedule = PR_SCHEDULE_REUSE;
            double tb, trr, sum, phase[3];
            /* one untimed run of each warms the arenas, then the two alternate */
            if (!time_step(tr, &sg.g, &ob, 1, &tb, &sum, NULL, &err) || !time_step(tr, &sg.g, &orr, 1, &trr, &sum, NULL, &err) ||
                !time_step_profiled(o, tr, &sg.g, &ob, "baseline", &tb, NULL, &err) ||
                !time_step_profiled(o, tr, &sg.g, &orr, "reuse", &trr, phase, &err)) {
                synth_free(&sg);
                pr_trainer_destroy(tr);
                return fail(&err);
            }
            double fb = pr_step_flops(cfg, &sg.g, PR_SCHEDULE_BASELINE), fr = pr_step_flops(cfg, &sg.g, PR_SCHEDULE_REUSE);
            double speedup = tb / trr, bound = fb / fr, ratio = speedup / bound;
            printf("%5d/%-5d %3d %12.3f %12.3f %8.2fx %8.2fx %9.3f %10.2f %10.2f", P, S, G, tb, trr, speedup, bound, ratio,
                   fb / tb / 1e9, fr / trr / 1e9);
            if (mfu) printf(" %9.1f%% %8.1f%%", 100 * fb / tb / (o->peak_tflops * 1e12), 100 * fr / trr / (o->peak_tflops * 1e12));
            printf("\n");
            print_phases(o, cfg, &sg.g, phase, trr, fb / tb);
            fflush(stdout);
            sum_ratio += ratio;
            cells++;
            if (fi == heavy && G == 8) heavy_ratio = ratio;
            synth_free(&sg);
        }
    pr_trainer_destroy(tr);
    printf("bench: mean measured/bound %.3f over %d cells", sum_ratio / cells, cells);
    if (heavy_ratio > 0) printf("; most prefix-heavy split at G=8: %.3f of the bound", heavy_ratio);
    printf("\n");
    return 0;
}

/* ------------------------------------------------------------------ --bench tree */
/* Best wall time of reps runs of one step of n groups: one by one (tree 0), or as their tree;
   *ac: that run's Phases A and C (the prefix passes). */
static int time_groups(const options *o, pr_trainer *tr, const pr_group *groups, int n, pr_step_opts so, int tree, double *best,
                       double *ac, pr_error *err) {
    options ot = *o;
    ot.tree = tree;
    ot.tree_min = 1;
    *best = INFINITY;
    for (int r = 0; r < o->bench_reps; r++) {
        pr_step_stats st;
        if (step_groups(&ot, tr, groups, n, so, &st, NULL, err)) return 0;
        double t = st.seconds[0] + st.seconds[1] + st.seconds[2];
        if (t < *best) *best = t, *ac = st.seconds[0] + st.seconds[2];
    }
    return 1;
}

/* A step of n groups (n = each --bench-groups value), G = 8 each, whose prompts (5/6 of a
   trajectory of --bench-total tokens) all open with the same system prompt (--bench-system tokens,
   half the prompt by default):
   one by one full-sequence, one by one with reuse, and as their prefix tree, timed, beside the
   FLOP bound of each ratio (pr_step_flops, pr_tree_flops). */
static int run_bench_tree(const options *o, const pr_config *cfg) {
    const int T = o->bench_total, S = T / 6, P = T - S, sys = o->bench_system ? o->bench_system : P / 2, G = 8;
    pr_error err;
    pr_trainer *tr;
    if (sys > P) {
        fprintf(stderr, "train: --bench-system %d: the system prompt is part of a prompt of %d tokens (5/6 of --bench-total %d)\n",
                sys, P, T);
        return 1;
    }
    if (!make_trainer(o, cfg, &tr, &err)) return fail(&err);
    printf("bench tree: %s, %d layers, hidden %d; each group G %d of %d-token trajectories, prompt %d (a system prompt of %d shared "
           "by every group, then %d of its own), suffix %d; best of %d, %s\n", cfg->model_type, cfg->num_hidden_layers,
           cfg->hidden_size, G, T, P, sys, P - sys, S, o->bench_reps, run_label());
    printf("%6s %11s %9s %9s %13s %8s %7s %14s %8s %7s %11s %10s\n", "groups", "baseline s", "reuse s", "tree s", "tree/reuse",
           "bound", "ratio", "tree/baseline", "bound", "ratio", "reuse A+C", "tree A+C");
    int rc = 0;
    for (int gi = 0; gi < o->n_bench_groups && !rc; gi++) {
        const int n = o->bench_groups[gi];
        synth_group *sg = calloc((size_t)n, sizeof *sg);
        pr_group *groups = malloc(sizeof(pr_group) * (size_t)n);
        int ok = sg && groups;
        for (int k = 0; ok && k < n; k++) {
            ok = synth(&sg[k], P, S, G, cfg->vocab_size, 500 + 31 * k);
            if (ok) memcpy(sg[k].prefix, sg[0].prefix, sizeof(int32_t) * (size_t)sys);
            if (ok) groups[k] = sg[k].g;
        }
        pr_prefix_tree t;
        memset(&t, 0, sizeof t);
        pr_step_opts ob = o->step, orr;
        ob.schedule = PR_SCHEDULE_BASELINE;
        double tb, trr, tt, acb, acr, act;
        if (!ok) set_error(&err, PR_ERR_NOMEM, "out of host memory");
        else ok = !pr_step_loss_totals(groups, n, 0, &ob.loss.step, &err);   /* the step's denominators, for every way */
        orr = ob;
        orr.schedule = PR_SCHEDULE_REUSE;
        if (!ok || pr_prefix_tree_build(&t, groups, n, 1, &err) ||
            !time_groups(o, tr, groups, n, ob, 0, &tb, &acb, &err) || !time_groups(o, tr, groups, n, orr, 0, &trr, &acr, &err) ||
            !time_groups(o, tr, groups, n, orr, 1, &tt, &act, &err)) {
            rc = fail(&err);
        } else {
            double fb = 0, fr = 0, ft = pr_tree_flops(cfg, groups, n, &t);
            for (int k = 0; k < n; k++) {
                fb += pr_step_flops(cfg, &groups[k], PR_SCHEDULE_BASELINE);
                fr += pr_step_flops(cfg, &groups[k], PR_SCHEDULE_REUSE);
            }
            printf("%6d %11.3f %9.3f %9.3f %12.2fx %7.2fx %7.3f %13.2fx %7.2fx %7.3f %11.3f %10.3f\n", n, tb, trr, tt, trr / tt,
                   fr / ft, (trr / tt) / (fr / ft), tb / tt, fb / ft, (tb / tt) / (fb / ft), acr, act);
            fflush(stdout);
        }
        pr_prefix_tree_free(&t);
        for (int k = 0; sg && k < n; k++) synth_free(&sg[k]);
        free(sg);
        free(groups);
    }
    pr_trainer_destroy(tr);
    return rc;
}

/* ------------------------------------------------------------------ --bench memory, --bench capacity */
/* The ways a step can run, as the memory tables compare them. Recompute on the baseline is
   --recompute all (prefix leaves the baseline as it is); "reuse+recompute" is prefix, the
   suffix microbatches keeping what they keep without it. */
typedef struct { const char *name; pr_schedule schedule; int offload; pr_recompute recompute; } mem_variant;
static const mem_variant mem_variants[] = {
    { "baseline", PR_SCHEDULE_BASELINE, 0, PR_RECOMPUTE_NONE },
    { "baseline+recompute", PR_SCHEDULE_BASELINE, 0, PR_RECOMPUTE_ALL },
    { "reuse", PR_SCHEDULE_REUSE, 0, PR_RECOMPUTE_NONE },
    { "reuse+offload", PR_SCHEDULE_REUSE, 1, PR_RECOMPUTE_NONE },
    { "reuse+recompute", PR_SCHEDULE_REUSE, 0, PR_RECOMPUTE_PREFIX },
    { "reuse+recompute-all", PR_SCHEDULE_REUSE, 0, PR_RECOMPUTE_ALL },
    { "reuse+recompute+offload", PR_SCHEDULE_REUSE, 1, PR_RECOMPUTE_PREFIX },
};
#define MEM_REUSE 2                 /* the row the others' Phase-B savings are measured from */
#define N_MEM_VARIANTS (int)(sizeof mem_variants / sizeof *mem_variants)

static pr_step_opts variant_opts(const options *o, const mem_variant *v) {
    pr_step_opts s = o->step;
    s.schedule = v->schedule;
    s.offload.enabled = v->offload;
    s.recompute = v->recompute;
    if (s.microbatch == 0 && !s.microbatch_tokens) s.microbatch = 1;   /* the paper's Phase B: one trajectory at a time */
    return s;
}

static double mib(size_t b) { return b / 1048576.0; }
/* A step's highest per-phase peak of live device memory. */
static size_t step_peak(const pr_step_stats *st) {
    size_t peak = 0;
    for (int p = 0; p < 3; p++) if (st->peak_bytes[p] > peak) peak = st->peak_bytes[p];
    return peak;
}


/* Per-phase peak device memory of each variant at the speed sweep's splits, measured by the
   allocator on one real step each, with the step's time (offload's end-to-end cost). */
static int run_bench_memory(const options *o, const pr_config *cfg) {
    const int T = o->bench_total, G = o->bench_groups[o->n_bench_groups - 1];
    pr_error err;
    pr_trainer *tr;
    pr_backend sizes, storage;        /* --bench-sizes gpu: the CUDA backend's sizes, counted, nothing run */
    const pr_backend *be = o->bench_gpu_sizes ? pr_backend_measure(pr_backend_cuda_sizes(&sizes), &storage) : NULL;
    if (!make_trainer_on(o, cfg, be, &tr, &err)) return fail(&err);
    pr_step_opts probe = variant_opts(o, &mem_variants[0]);
    printf("bench memory: %s, %d layers, hidden %d, %d tokens per trajectory, G %d, microbatch %s, %s; peak live\n"
           "device memory per phase (activations, K/V cache, gK/gV, offload slots; parameters and optimizer state\n"
           "excluded); each variant's second step (the first allocates what the next ones reuse)\n",
           cfg->model_type, cfg->num_hidden_layers, cfg->hidden_size, T, G, microbatch_label(&probe),
           be ? "the CUDA backend's sizes, counted by the measuring backend (no kernel runs: no times)" : run_label());
    printf("%-11s %-23s %10s %10s %10s %9s %12s %14s %9s %7s\n", "split P/S", "schedule", "A MiB", "B MiB", "C MiB", "step s",
           "dormant MiB", "B saved MiB", "copies ms", "GB/s");
    for (int fi = 0; fi < o->n_bench_splits; fi++) {
        int P = (int)split_prefix(o, fi), S = T - P;
        synth_group sg;
        if (!synth(&sg, P, S, G, cfg->vocab_size, 91 + fi)) {
            fprintf(stderr, "train: out of memory\n");
            pr_trainer_destroy(tr);
            return 1;
        }
        size_t reuse_b = 0, largest = 0, chunks = 0;
        for (int v = 0; v < N_MEM_VARIANTS; v++) {
            pr_step_opts so = variant_opts(o, &mem_variants[v]);
            pr_step_stats st;
            /* twice, the second reported: the first allocates what later steps reuse (offload's
               pinned host pool, grown to the longest prefix so far), which training pays once */
            if (pr_trainer_compute_grads(tr, &sg.g, &so, &st, NULL, &err) ||
                pr_trainer_compute_grads(tr, &sg.g, &so, &st, NULL, &err)) {
                synth_free(&sg);
                pr_trainer_destroy(tr);
                return fail(&err);
            }
            if (v == MEM_REUSE) reuse_b = st.peak_bytes[PR_PHASE_B];
            if (step_peak(&st) > largest) largest = step_peak(&st);
            chunks = st.chunk_bytes;
            printf("%5d/%-5d %-23s %10.2f %10.2f %10.2f", P, S, mem_variants[v].name, mib(st.peak_bytes[0]), mib(st.peak_bytes[1]),
                   mib(st.peak_bytes[2]));
            if (be) printf(" %9s", "-");             /* the measuring backend runs no kernel: no time to show */
            else printf(" %9.3f", st.seconds[0] + st.seconds[1] + st.seconds[2]);
            if (v > MEM_REUSE) printf(" %12.2f %14.2f", mib(st.offload.dormant_bytes), mib(reuse_b) - mib(st.peak_bytes[PR_PHASE_B]));
            if (mem_variants[v].offload && st.offload.copy_seconds > 0)     /* beside the compute: the step time says what they cost */
                printf(" %9.2f %7.1f", 1e3 * st.offload.copy_seconds, copy_gbps(&st.offload));
            printf("\n");
            fflush(stdout);          /* a run stopped by a time limit keeps the rows it has */
        }
        /* what reusing chunks across the variants costs: the device memory behind the peaks */
        printf("%5d/%-5d the arenas' chunks after these rows: %.2f MiB; the largest peak above: %.2f MiB\n", P, S, mib(chunks),
               mib(largest));
        synth_free(&sg);
    }
    pr_trainer_destroy(tr);
    return 0;
}

/* --bench capacity: the measuring backend on every rank of the mesh (one rank without mesh flags),
   over a measuring communicator, so a mesh of any size sizes itself in seconds. A rank's need is
   its training state (pr_trainer_state_bytes: master weights, gradients, AdamW m and v, sharded as
   the mesh and ZeRO shard them, and the weights the kernels read: bf16 when sizing for the GPU), and
   the highest per-phase peak of a step; a length fits when it fits on every rank. */
typedef struct {
    const options *o;
    const pr_config *cfg;
    const pr_backend *like;      /* the element sizes */
    size_t state[256], params[256];
} capacity_job;

/* Every rank's need, the largest on every rank: the ranks' sizes meet here through the world
   communicator (real, its buffers host memory); alone, the need itself. A rank that failed gives
   -1, so that every rank stops together (none is left waiting in the next search step). */
static pr_status most_over(pr_comm *world, double *x, pr_error *err) {
    if (!world) return PR_OK;
    double all[256];
    pr_status st = world->all_gather(world, all, x, 1, PR_COMM_F64, err);
    for (int r = 0; !st && r < world->size; r++) {
        if (all[r] < 0) return set_error(err, PR_ERR_UNSUPPORTED, "another rank's capacity step failed");
        if (all[r] > *x) *x = all[r];
    }
    return st;
}

/* The need at total length T (prefix 5/6, the paper's 10k/2k), the most over the ranks. */
static pr_status step_need(pr_trainer *tr, pr_comm *world, const pr_mesh *m, const capacity_job *j, const mem_variant *v, int T,
                           double *need, pr_error *err) {
    const options *o = j->o;
    const int P = (int)lround(T * 5.0 / 6), S = T - P, G = o->bench_groups[o->n_bench_groups - 1], dp = m ? m->dp : 1;
    synth_group sg;
    pr_group batch[256];
    if (!synth(&sg, P, S, G, j->cfg->vocab_size, 5)) {
        synth_free(&sg);
        return set_error(err, PR_ERR_NOMEM, "out of host memory");
    }
    for (int b = 0; b < dp; b++) batch[b] = sg.g;      /* a group per dp rank: every rank runs one */
    pr_step_opts so = variant_opts(o, v);
    pr_step_stats st;
    pr_status s = dp > 1 ? pr_trainer_compute_grads_dp(tr, m->dp_comm, batch, dp, &so, &st, err)
                         : pr_trainer_compute_grads(tr, &sg.g, &so, &st, NULL, err);
    synth_free(&sg);
    *need = s ? -1 : (double)pr_trainer_state_bytes(tr) + (double)step_peak(&st);
    pr_error other;
    pr_status ms = most_over(world, need, s ? &other : err);
    return s ? s : ms;
}

/* One rank of the capacity search (world NULL: one rank, no mesh). For each variant the longest
   trajectory whose step fits the budget on every rank: doubling, then bisection to 64 tokens, up to
   the model's max_position_embeddings. Rank 0 prints. */
static pr_status capacity_rank(pr_comm *world, void *user, pr_error *err) {
    capacity_job *j = user;
    const options *o = j->o;
    const pr_config *cfg = j->cfg;
    pr_backend storage;
    const pr_backend *be = pr_backend_measure(j->like, &storage);
    pr_comm *mw = NULL;
    pr_mesh m;
    pr_trainer *tr = NULL;
    pr_status st = world ? pr_comm_measure(&mw, world, err) : PR_OK;
    if (!st && world && !(st = pr_mesh_init(&m, mw, o->dp, o->pp, o->cp, o->tp, o->ep, err))) {
        m.zero = o->zero;
        m.bf16_grad_reduce = o->grad_reduce_bf16;
        if ((st = pr_trainer_create_mesh(&tr, cfg, be, &m, err))) pr_mesh_free(&m);
    } else if (!st && !world) {
        st = pr_trainer_create(&tr, cfg, be, err);    /* no weights: nothing reads them */
    }
    if (st) {
        if (mw) mw->destroy(mw);
        return st;
    }
    const int me = world ? world->rank : 0, lead = me == 0;
    j->state[me] = pr_trainer_state_bytes(tr);
    j->params[me] = pr_trainer_param_count(tr);
    const double budget = o->bench_budget_mib * 1048576;
    for (int v = 0; v < N_MEM_VARIANTS && !st; v++) {
        const int limit = cfg->max_position_embeddings;
        int lo = 0, hi = 64;
        double need = 0, need_lo = 0;
        while (hi <= limit) {                         /* double until the step no longer fits */
            if ((st = step_need(tr, world, world ? &m : NULL, j, &mem_variants[v], hi, &need, err))) break;
            if (need > budget) break;
            lo = hi;
            need_lo = need;
            hi *= 2;
        }
        if (hi > limit) hi = limit + 1;               /* past the position limit counts as not fitting */
        while (!st && hi - lo > 64) {                 /* then halve the gap */
            int mid = (lo + hi) / 2 / 64 * 64;
            if (mid <= lo) break;
            if ((st = step_need(tr, world, world ? &m : NULL, j, &mem_variants[v], mid, &need, err))) break;
            if (need <= budget) { lo = mid; need_lo = need; }
            else hi = mid;
        }
        if (st || !lead) continue;
        if (lo == 0) printf("%-23s %12s\n", mem_variants[v].name, "none fits");
        else {
            char split[32];
            snprintf(split, sizeof split, "%ld/%ld", lround(lo * 5.0 / 6), lo - lround(lo * 5.0 / 6));
            printf("%-23s %12d %12s %14.1f%s\n", mem_variants[v].name, lo, split, need_lo / 1048576,
                   lo + 64 > limit ? "  (the model's position limit)" : "");
        }
        fflush(stdout);
    }
    pr_trainer_destroy(tr);
    if (world) pr_mesh_free(&m);
    if (mw) mw->destroy(mw);
    return st;
}

static int run_bench_capacity(const options *o, const pr_config *cfg) {
    pr_error err;
    pr_backend sizes;
    static capacity_job j;
    memset(&j, 0, sizeof j);
    j.o = o;
    j.cfg = cfg;
    j.like = o->bench_gpu_sizes ? pr_backend_cuda_sizes(&sizes) : backend(&err);
    if (!j.like) return fail(&err);
    const int ranks = mesh_ranks(o);
    printf("bench capacity: %s, %d layers, hidden %d, budget %.0f MiB a rank (training state included), %s sizes (%zu-byte "
           "activations%s), G %d, prefix 5/6 of each trajectory; sizes from the allocator, nothing computed\n",
           cfg->model_type, cfg->num_hidden_layers, cfg->hidden_size, o->bench_budget_mib, j.like->name, j.like->act_bytes,
           j.like->act_bytes == 2 ? ", bf16 weights" : "", o->bench_groups[o->n_bench_groups - 1]);
    if (on_mesh(o))
        printf("mesh: dp %d x pp %d x cp %d x tp %d = %d ranks, ep %d, zero %d, each sized on a measuring communicator\n", o->dp,
               o->pp, o->cp, o->tp, ranks, o->ep, o->zero);
    printf("%-23s %12s %12s %14s\n", "schedule", "max tokens", "prefix/suffix", "need MiB");
    fflush(stdout);
    pr_status st;
#ifdef PR_NO_THREADS
    st = on_mesh(o) ? set_error(&err, PR_ERR_UNSUPPORTED, "this build has no in-process ranks (compiled with PR_NO_THREADS)")
                    : capacity_rank(NULL, &j, &err);
#else
    st = on_mesh(o) ? pr_comm_local_run(ranks, capacity_rank, &j, &err) : capacity_rank(NULL, &j, &err);
#endif
    if (st) return fail(&err);
    printf("training state on rank 0: %.1f MiB, %.2f bytes a parameter of its %zu (%s)\n", mib(j.state[0]),
           (double)j.state[0] / (double)j.params[0], j.params[0], state_parts(o->zero, j.like->act_bytes == 2));
    return 0;
}

/* A state's position counts groups of the trace it was on: another trace (the fingerprints
   differ) is refused unless --new-trace says it is new data. Checked before any trainer or rank
   exists, so every process of a mesh refuses alike and a long load is not spent on it. */
static int resumed_trace_fits(const options *o, const pr_trace *t) {
    const pr_train_state *r = &o->resumed;
    if (!o->resume || o->new_trace || !r->data_fingerprint || r->data_fingerprint == t->fingerprint) return 1;
    fprintf(stderr, "train: %s was saved on another trace (fingerprint %016llx; %s's is %016llx), and its position, group %ld, counts "
            "that trace's groups: resume with its trace, or add --new-trace to start at this trace's first group\n", o->resume,
            (unsigned long long)r->data_fingerprint, o->trace, (unsigned long long)t->fingerprint, r->next_group);
    return 0;
}

/* The jobs on a trace: prefix trees, the check, the replay, or training. */
static int run_on_trace(const options *o, const pr_config *cfg) {
    pr_error err;
    pr_trace trace;
    if (pr_trace_read(&trace, o->trace, &err)) return fail(&err);
    int rc = 1;
    if (trace.vocab_size > cfg->vocab_size)
        fprintf(stderr, "train: trace %s has vocabulary %d, the model only %d\n", o->trace, trace.vocab_size, cfg->vocab_size);
    else if (resumed_trace_fits(o, &trace))
        rc = o->prefix_tree ? run_prefix_tree(o, &trace)
             : o->check     ? run_check(o, cfg, &trace)
             : o->replay    ? run_replay(o, cfg, &trace)
                            : run_training(o, cfg, &trace);
    pr_trace_free(&trace);
    return rc;
}

/* Where a run will write, checked before it trains, so that a long run is not lost to a typo in a
   path: the folder above each output must exist, and a folder output (--save, --save-state) must
   not be a file, nor a file output (--save-grads) a folder. 1 when all can be written. */
static int outputs_writable(const options *o) {
    const struct { const char *flag, *path; int folder; } out[] = {
        {"--save", o->save, 1}, {"--save-state", o->save_state, 1}, {"--save-grads", o->save_grads, 0} };
    for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) {
        char parent[4096];
        struct stat sb;
        if (!out[i].path) continue;
        size_t n = strlen(out[i].path);
        if (n >= sizeof parent) { fprintf(stderr, "train: %s %s: the path is too long\n", out[i].flag, out[i].path); return 0; }
        memcpy(parent, out[i].path, n + 1);
        while (n > 1 && parent[n - 1] == '/') parent[--n] = 0;          /* "dir/" names dir */
        char *slash = strrchr(parent, '/');
        if (!slash) strcpy(parent, ".");
        else slash[slash == parent] = 0;                                 /* "/x": the parent is "/" */
        const int exists = stat(parent, &sb) == 0;
        if (!exists || !S_ISDIR(sb.st_mode)) {
            fprintf(stderr, "train: %s %s: the folder above it, %s, %s\n", out[i].flag, out[i].path, parent,
                    exists ? "is not a folder" : "does not exist (folders above the one asked for are not created)");
            return 0;
        }
        if (stat(out[i].path, &sb) == 0 && (S_ISDIR(sb.st_mode) != 0) != out[i].folder) {
            fprintf(stderr, "train: %s %s: %s\n", out[i].flag, out[i].path, out[i].folder ? "exists and is not a folder" : "is a folder");
            return 0;
        }
    }
    return 1;
}

int main(int argc, char **argv) {
    options o;
    if (!parse_args(argc, argv, &o)) return 2;
    if (!outputs_writable(&o)) return 1;
    pr_error err;
    pr_config cfg;
    char init_config[4096];
    snprintf(init_config, sizeof init_config, "%s/config.json", o.init ? o.init : "");
    if (o.resume) {              /* the model of the state --resume names */
        char folder[4000];
        if (pr_train_state_read(o.resume, folder, sizeof folder, &o.resumed, &err)) return fail(&err);
        snprintf(init_config, sizeof init_config, "%s/config.json", folder);
    }
    FILE *probe = (o.init || o.resume) && !o.config_given ? fopen(init_config, "r") : NULL;
    if (probe) { fclose(probe); o.config = init_config; }
    if (pr_config_load(&cfg, o.config, &err) || select_attention(&o, &err)) return fail(&err);
    if (o.layers > cfg.num_hidden_layers) {
        fprintf(stderr, "train: --layers %d: the model %s has %d layers\n", o.layers, o.config, cfg.num_hidden_layers);
        return 2;
    }
    if (o.layers) cfg.num_hidden_layers = o.layers;
    int rc = o.bench == 1 ? run_bench_speed(&o, &cfg)
             : o.bench == 2 ? run_bench_memory(&o, &cfg)
             : o.bench == 3 ? run_bench_capacity(&o, &cfg)
             : o.bench == 4 ? run_bench_tree(&o, &cfg)
                            : run_on_trace(&o, &cfg);
    backend_release();
    return rc;
}
