/* prefixreuse.h — shared-prefix reuse for GRPO training of Llama-family models, in one header.

   In GRPO a prompt (the prefix, P tokens) is sampled G times. The ordinary trainer runs every
   trajectory [prefix ; suffix_i] through the model, so the prefix is computed G times forward and
   backward. This library runs it once per group:

     Phase A  prefix forward once; every layer publishes its post-RoPE K/V (the reuse cache)
              and keeps the rest of its saved tensors for Phase C.
     Phase B  suffix microbatches (any split of the G suffixes, padded or packed) read the cached
              prefix K/V and add the prefix-side gradients dK/dV into one accumulator per layer (gK/gV).
     Phase C  prefix backward once, with gK/gV injected into every layer's prefix attention.

   Prefix backward is a vector-Jacobian product on a fixed forward trace, so it is linear in its
   incoming adjoints: one backward on the summed gK/gV equals the sum of G separate backwards.
   The two schedules agree exactly over the reals; only the order of the sums differs. On the
   sample trace `./train --check` finds, in the double build, the losses 1e-16 apart and the worst
   gradient element 5e-11 apart relative to its size, the worst updated parameter 1e-12 (float
   build: 6e-17 for the loss, which is summed in double, and 2e-2 for the worst gradient element).

   USAGE
     #define PREFIXREUSE_IMPLEMENTATION   (in exactly one C file)
     #include "prefixreuse.h"

     Options, defined before the include:
       PR_DOUBLE        every real number is a double (exact-equivalence checks)
       PR_USE_CBLAS     route GEMMs to the system CBLAS (link e.g. -lopenblas)
       PRDEF            storage class of the public functions (e.g. `static`: the implementation
                        then raises no unused-function warnings for what the file does not call)
       PR_MALLOC/PR_REALLOC/PR_FREE   allocator, all three or none
       PR_NO_THREADS    leaves out the in-process ranks (pr_comm_local_run)
     OpenMP (-fopenmp) parallelises the GEMM and attention loops when enabled.

   LANGUAGES
     The implementation compiles warning-free (-Wall -Wextra, gcc and clang) as:
       C11 and later    the default; the in-process ranks use C11 <threads.h>
       C++17 and later  g++ and clang++; the in-process ranks use POSIX threads (link -pthread);
                        the declarations sit in extern "C", so a C++ and a C translation unit mix
       C99              with PR_NO_THREADS (C99 has no threads); phase timings are then processor
                        time (clock()), not wall time. Without PR_NO_THREADS a C99 build stops at
                        an #error that says so.
     The CUDA backend (prefixreuse_cuda.cu) is C++17 for nvcc.

   EXAMPLE (the body of a main; CI compiles and runs it)
     pr_error err; pr_config cfg; pr_trace trace = {0}; pr_trainer *tr = NULL;
     if (pr_config_load(&cfg, "model/tiny", &err) ||
         pr_trace_read(&trace, "data/sample.trace", &err) ||
         pr_trainer_create(&tr, &cfg, pr_backend_cpu(), &err) ||
         pr_trainer_init_params(tr, 1234, &err)) {
         fprintf(stderr, "%s\n", err.message);
         pr_trainer_destroy(tr);                     // NULL and a zeroed trace: no-ops
         pr_trace_free(&trace);
         return 1;
     }
     pr_step_opts opt = pr_step_opts_default();      // reuse schedule, padded, all G at once
     pr_step_stats st;
     pr_adamw_opts adam = pr_adamw_opts_default();
     pr_status status = pr_trainer_compute_grads(tr, &trace.groups[0], &opt, &st, NULL, &err);
     if (!status) status = pr_trainer_adamw_step(tr, &adam, NULL, &err);
     if (status) fprintf(stderr, "%s\n", err.message);
     else printf("group 0: loss %f\n", st.loss);
     pr_trainer_destroy(tr);
     pr_trace_free(&trace);
     return status ? 1 : 0;

   CONTENTS
     The public API comes first, in the order its types need, then the implementation in reading
     order. A part's number heads its banners in both.
     1. Basics: reals, status and error messages; the GEMM
     2. Backend interface (GEMM, attention with a prefix K/V region, norms, RoPE, loss, optimizer,
        memory tiers, asynchronous copies); the CPU backend and the measuring backend, with the
        CUDA backend's sizes for planning (the CUDA backend is in prefixreuse_cuda.cu)
     3. The model: the trainer's data, forward declarations, parameters, activation memory, a
        pass, one layer forward and backward, batches and the GRPO loss head
     4. The schedules: Phase A, Phase B, Phase C, the step (reuse or baseline; its token weights
        from an optimizer step's loss denominators, pr_step_loss_totals), AdamW (over this
        rank's slice of the arena: all of it, or 1/dp under ZeRO; the gradient norm in fixed pieces;
        the weights the kernels read refreshed from the master weights)
     5. Offload of the prefix's dormant state
     6. MoE: routing, dispatch to the experts (EP), the sparse MLP, the load-balancing loss
     7. The parallel layer: the communicator, the device mesh, collectives inside a step, sharded
        parameters (TP, EP, PP), context parallelism, pipeline stages, groups split across DP
        ranks, data parallelism (ZeRO: master weights and AdamW state sharded over dp, pr_mesh.zero), in-process
        ranks (NCCL is in prefixreuse_cuda.cu), a measuring communicator; the gradient sum over dp in
        bf16 on request
     8. File formats: platform i/o, JSON, model configuration (Hugging Face config.json: Llama 3,
        Qwen3, Qwen3-MoE), safetensors checkpoints (Hugging Face names, sharded through an index),
        GRPO traces (data/README.md has the format), a trainer's checkpoints and its training state
        (pr_trainer_save_state / pr_trainer_load_state: exact resume, saved atomically), the
        prefix tree of a step's groups (pr_prefix_tree_build: sharing beyond one level, which
        pr_trainer_compute_grads_tree runs, 4.5)
     The API declares 8 before 2 (the backend and the trainer take a pr_config, the trainer a
     pr_group and a pr_dtype), and declares 3 to 6 together under "3-6. Trainer".

   READING GUIDE: the schedule, in the order to read it
     3.6  pr__layer_forward               one layer over the rows of a pass (in Phase B attending
          pr__layer_backward              to the cached prefix K/V too), and its backward (the K/V
                                          gradients it writes named in a pr__kv_grads)
     4.1  pr__phase_a_prefix_forward      Phase A: the prefix forward once; every layer's K/V
                                          stays as the cache (hook on_kv_capture)
     4.2  pr__phase_b_suffix_microbatches Phase B: each suffix microbatch forward and backward
                                          (pr__mb_forward, pr__mb_backward) against the cache,
                                          its prefix dK/dV added into gK/gV (hook on_dkv); with
                                          no prefix state, the baseline
     4.3  pr__phase_c_prefix_backward     Phase C: the prefix backward once, gK/gV injected into
                                          every layer's attention backward (hook on_kv_inject)
     4.4  pr__compute_grads               the driver, one named step each: pr__validate_step,
                                          pr__step_begin (token weights, log-probs, MoE sums),
                                          pr__step_reuse (A, B, C) or pr__step_baseline,
                                          pr__step_reduce (the sums over the mesh), pr__step_end
                                          (the stats)
     4.5  pr_trainer_compute_grads_tree   prefix trees: pr__tree_node_run runs a node's forward (Phase
                                          A over its rows of the path), its subtrees, the Phase B
                                          of the groups ending at it, and its backward (Phase C)
   Where the rest hooks in (3.2 declares every such call):
     offload (5)   Phase A parks each layer's block after its forward (pr__offload_block); Phase C
                   loads it back before its backward (pr__load_block, pr__prefetch_block)
     recompute     a pass that keeps only each layer's input (pr__keep, pr_recompute) runs the
                   layer's forward again at the start of its backward (pr__layer_rebuild, 3.6)
     MoE (6)       pr__moe_forward and pr__moe_backward inside the layer; the load-balancing loss's
                   routing sums in Phase A and pr__mb_forward, its gradient in pr__mb_backward and
                   Phase C, and in the group scope pr__routing_prepass at Phase B's start
     parallel (7)  inside the layer pr__tp_sum and the CP attention (pr__attention_fwd/_bwd);
                   pr__batch_make cuts a batch to its CP block; pipeline stages hand rows on with
                   pr__pp_send/pr__pp_recv (Phase A, C) and pr__pp_prev/pr__pp_next (Phase B); a group split
                   across DP ranks shares the cache and gathers gK/gV (pr__split_share_kv,
                   pr__split_reduce_gkv); pr__mesh_sync_grads ends the step;
                   pr_trainer_compute_grads_dp runs steps over whole or split groups,
                   pr_trainer_compute_grads_tree_dp over subtrees (pr_tree_place)

   Conventions: public names pr_, private pr__. Every public function returns pr_status and fills
   a pr_error (may be NULL) with a readable reason; nothing aborts or exits. On failure the
   caller's buffers are left as they were.
   Dimension legend used in shape comments: N rows (tokens) of a pass, C hidden, NH query heads,
   NKV key/value heads, HS head dim, F MLP width, V vocabulary, P prefix rows, L layers. */
#ifndef PREFIXREUSE_H
#define PREFIXREUSE_H

#include <stddef.h>
#include <stdint.h>

#ifndef PRDEF
#define PRDEF extern
#else
#define PR__PRDEF_GIVEN          /* e.g. static: see the start of the implementation */
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- 1. Basics */
#ifdef PR_DOUBLE
typedef double pr_real;
#else
typedef float pr_real;
#endif

typedef enum {
    PR_OK = 0,
    PR_ERR_ARG,         /* a bad argument: shapes, counts, ranges */
    PR_ERR_IO,          /* a file could not be opened, read, written or renamed */
    PR_ERR_FORMAT,      /* a file's contents are malformed */
    PR_ERR_CONFIG,      /* a model configuration does not validate */
    PR_ERR_NOMEM,       /* an allocation failed or a size overflowed */
    PR_ERR_UNSUPPORTED, /* valid input asking for something not implemented */
    PR_ERR_DEVICE       /* the accelerator failed: a launch, a copy, a library call, a fault */
} pr_status;

typedef struct {
    pr_status status;
    char message[512];
} pr_error;

PRDEF const char *pr_status_name(pr_status s);


/* ---------------------------------------------------------------- 8. File formats: model configuration */
/* The fields of a Hugging Face LlamaConfig / Qwen3Config / Qwen3MoeConfig that decide the math. */
typedef struct {
    char model_type[32];          /* "llama", "qwen3" or "qwen3_moe" */
    int vocab_size, hidden_size, intermediate_size, num_hidden_layers;
    int num_attention_heads, num_key_value_heads, head_dim;  /* head_dim defaults to hidden/heads */
    int max_position_embeddings;
    double rms_norm_eps, rope_theta;
    int rope_llama3;              /* 1 when rope_scaling.rope_type (or "type") == "llama3" */
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;  /* 0 unless rope_llama3 */
    int rope_original_max_position;   /* rope_scaling.original_max_position_embeddings */
    int tie_word_embeddings;
    int qk_norm;                  /* 1 for the Qwen3 types: per-head RMSNorm on q and k */
    /* Qwen3-MoE (num_experts 0: a dense MLP). Every layer's MLP is the sparse block: a softmax
       router over num_experts, the top num_experts_per_tok experts (SwiGLU, moe_intermediate_size)
       weighted by their probabilities, renormalised over the top-k when norm_topk_prob. */
    int num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob;
    double router_aux_loss_coef;  /* weight of the Switch-style load-balancing loss */
} pr_config;

/* Parse config.json text (len bytes, no terminator needed) and validate it. cfg is written only on
   success. Unsupported features (other model types, biases, non-SiLU activations, rope types other
   than llama3, sliding windows, attention dropout) give PR_ERR_UNSUPPORTED. */
PRDEF pr_status pr_config_parse(pr_config *cfg, const char *json, size_t len, pr_error *err);
/* path: a folder holding config.json, or the path of a config.json. */
PRDEF pr_status pr_config_load(pr_config *cfg, const char *path, pr_error *err);
/* Checks every field, then the sizes the config implies, before any caller allocates or names
   anything: each count within its limit below (PR_ERR_CONFIG naming the field, its value and the
   limit), head counts times head_dim within int, the parameter count within PR_MAX_PARAMS, and
   the arena (parameters, gradients, two AdamW moments) within size_t. */
PRDEF pr_status pr_config_validate(const pr_config *cfg, pr_error *err);
/* The limits: far above every released Llama/Qwen model, low enough that a pass's row counts
   times these widths stay inside the int and size_t arithmetic of the code. */
#define PR_MAX_LAYERS     1024              /* num_hidden_layers */
#define PR_MAX_HEADS      1024              /* num_attention_heads, num_key_value_heads */
#define PR_MAX_HEAD_DIM   2048              /* head_dim */
#define PR_MAX_WIDTH      (1 << 20)         /* hidden_size, intermediate_size, moe_intermediate_size */
#define PR_MAX_VOCAB      (1 << 24)         /* vocab_size */
#define PR_MAX_POSITIONS  (1 << 26)         /* max_position_embeddings, rope original_max_position */
#define PR_MAX_EXPERTS    65536             /* num_experts */
#define PR_MAX_PARAMS     (1ull << 40)      /* the parameter count (about 1.1e12) */
/* Writes a Hugging Face style config.json that pr_config_parse reads back to the same struct;
   atomically (temporary file, fsync, rename). */
PRDEF pr_status pr_config_save(const pr_config *cfg, const char *path, pr_error *err);

/* ---------------------------------------------------------------- 8. File formats: safetensors */
typedef enum { PR_DT_F32, PR_DT_F16, PR_DT_BF16, PR_DT_F64 } pr_dtype;

/* One tensor of an opened checkpoint. begin/end are byte offsets into the data buffer of shard
   `file` (the buffer starts after the 8-byte length and the JSON header). */
typedef struct {
    char name[256];
    pr_dtype dtype;
    int ndim;
    int64_t shape[8];
    uint64_t begin, end;
    int file;
} pr_st_tensor;

typedef struct pr_checkpoint pr_checkpoint;

/* path: a .safetensors file; a folder with model.safetensors or model.safetensors.index.json (the
   single file wins when both exist, as in transformers); or the path of an index .json. Every shard
   is opened and its header validated and indexed; tensor names must be unique across shards. */
PRDEF pr_status pr_checkpoint_open(pr_checkpoint **ck, const char *path, pr_error *err);
PRDEF const pr_st_tensor *pr_checkpoint_find(const pr_checkpoint *ck, const char *name);  /* NULL if absent */
/* Converts F32/F16/BF16/F64 to pr_real. count must equal the tensor's element count. dst is written
   only after every check passed; a read error part way (device error, file truncated meanwhile)
   leaves dst partly written. Opens the shard per call, so concurrent reads are safe. */
PRDEF pr_status pr_checkpoint_read(const pr_checkpoint *ck, const pr_st_tensor *t, pr_real *dst, size_t count, pr_error *err);
PRDEF int pr_checkpoint_count(const pr_checkpoint *ck);                      /* tensors, sorted by name */
PRDEF const pr_st_tensor *pr_checkpoint_tensor(const pr_checkpoint *ck, int i);
PRDEF void pr_checkpoint_close(pr_checkpoint *ck);

/* Scalar conversions used by the reader and writer, for other code that stages 16-bit data:
   round to nearest even, overflow to inf, NaN stays NaN. */
PRDEF uint16_t pr_f32_to_bf16(float x);
PRDEF float pr_bf16_to_f32(uint16_t h);
PRDEF uint16_t pr_f32_to_f16(float x);
PRDEF float pr_f16_to_f32(uint16_t h);

/* One tensor to write: shape has ndim (0..4) entries; data holds prod(shape) reals. */
typedef struct { const char *name; const pr_real *data; int ndim; int64_t shape[4]; } pr_st_entry;

/* Writes one .safetensors file in dtype F32, BF16 or F16 (round to nearest even; NaN stays NaN) or
   F64. metadata: NULL or a JSON object of string values, stored as "__metadata__". The header is
   padded with spaces to a multiple of 8. Written to "<path>.tmp.<pid>", then fflush, fsync, rename;
   the temporary file is removed on failure. */
PRDEF pr_status pr_safetensors_write(const char *path, const pr_st_entry *entries, int n, pr_dtype dtype,
                                     const char *metadata_json_object_or_null, pr_error *err);
/* Writes a Hugging Face checkpoint folder (created if missing; its parent must exist): model.safetensors when all tensor
   data fits in max_shard_bytes (0 = no limit), else model-00001-of-0000N.safetensors ... and
   model.safetensors.index.json, written last. Shards are filled in entry order; a tensor larger than
   the limit gets a shard of its own. Every file is written atomically, and the shards are put in
   place only once all of them are written (a save that fails before leaves the folder as it was);
   a stale single file or index of the other layout is removed so that readers cannot pick it up,
   and so are the shards the previous index named that this save does not write over. Where the new
   shards replace the previous ones by name, the previous index is removed before they are placed:
   a save interrupted while placing them leaves no index, so nothing loads, never a mix of two. */
PRDEF pr_status pr_checkpoint_save(const char *dir, const pr_st_entry *entries, int n, pr_dtype dtype,
                                   uint64_t max_shard_bytes, pr_error *err);


/* ---------------------------------------------------------------- 8. File formats: GRPO traces
   One prompt group: a prefix (P tokens) shared by G sampled suffixes (S_i tokens each).
   The per-token arrays hold the suffixes one after another: token j of suffix i is entry
   suffix_off[i] + j. old_logp/ref_logp of that token are its log-probabilities under the rollout
   and reference policies given everything before it; suffix token 0 is predicted from the last
   prefix position. loss_mask is 1 where the token contributes to the loss.
   A multi-turn group may train tokens of its prefix too (a turn every trajectory shares, after
   which they branch): prefix_mask is 1 at those positions, and each trajectory's loss counts them
   with its own advantage, as if the prefix were repeated at the head of every suffix. A
   trajectory's length (PR_NORM_SEQ_MEAN_TOKEN_SUM_NORM) then runs from the first trained prefix
   token. NULL prefix_mask: the prefix is context only.
   Field rules (pr_trace_parse and pr_group_validate check the same ones):
     1 <= P, G, S_i <= 2^24;  suffix_off[0] = 0, suffix_off[i+1] = suffix_off[i] + suffix_len[i];
     every token id in [0, vocab_size);  advantages finite;  log-probs finite and <= 0;
     ref_logp NULL or fully given;  loss_mask entries 0 or 1;  prefix_mask NULL or entries 0 or 1
     with prefix_mask[0] = 0, prefix_old_logp given with it, prefix_ref_logp given with it exactly
     when ref_logp is. */
#define PR_TRACE_MAX_COUNT (1 << 24)   /* largest P, G and S_i */

typedef struct {
    int P;                 /* prefix tokens */
    int G;                 /* suffixes */
    int32_t *prefix;       /* (P) */
    int *suffix_len;       /* (G) */
    int64_t *suffix_off;   /* (G+1) offsets of each suffix in the flattened per-token arrays */
    int32_t *tokens;       /* (suffix_off[G]) suffix tokens, suffix after suffix */
    pr_real *advantage;    /* (G) */
    pr_real *old_logp;     /* (suffix_off[G]) */
    pr_real *ref_logp;     /* (suffix_off[G]) or NULL */
    uint8_t *loss_mask;    /* (suffix_off[G]) */
    uint8_t *prefix_mask;      /* (P) or NULL: 1 where a prefix token is trained in every trajectory */
    pr_real *prefix_old_logp;  /* (P) with prefix_mask, else NULL */
    pr_real *prefix_ref_logp;  /* (P) with prefix_mask and ref_logp, else NULL */
} pr_group;

/* Optimizer steps: a version-2 file says which groups form each step, consecutive groups in file
   order; one step accumulates all its groups' gradients (pr_step_loss_totals, pr_loss_norm). */
typedef struct {
    int n_groups;
    int vocab_size;
    int has_ref;           /* every group carries ref_logp */
    pr_group *groups;      /* (n_groups) */
    int n_steps;           /* 0: no step table (a version-1 file: each group its own step, or as the caller cuts them) */
    int *step_off;         /* (n_steps+1) step s is groups step_off[s] .. step_off[s+1]-1; NULL when n_steps is 0 */
    uint64_t fingerprint;  /* FNV-1a (64-bit) of the bytes parsed: which trace a saved run was on; 0 for a trace the caller built */
} pr_trace;

/* Read a trace file, format version 1 or 2 (pr_trace_parse on its bytes; messages name the file). */
PRDEF pr_status pr_trace_read(pr_trace *trace, const char *path, pr_error *err);
/* Parse a trace held in memory. Everything is checked before *trace is written: on failure
   *trace is untouched and nothing is allocated. On success the whole trace (the groups array
   and every group's arrays) lives in one allocation that pr_trace_free releases. */
PRDEF pr_status pr_trace_parse(pr_trace *trace, const void *bytes, size_t len, pr_error *err);
/* Free what pr_trace_read/pr_trace_parse allocated and zero *trace (NULL or zeroed: no-op).
   Not for traces whose groups the caller built. */
PRDEF void pr_trace_free(pr_trace *trace);
/* Check a group (e.g. one built in memory by the caller) against the field rules above. */
PRDEF pr_status pr_group_validate(const pr_group *g, int vocab_size, pr_error *err);
/* The bytes of a trace, the inverse of pr_trace_parse (reals stored as float32, as the format
   has them): format version 2 with its step table when n_steps > 0, else version 1; flag bit 1
   and every group's prefix arrays when any group trains prefix tokens. Every group
   is validated first; ref_logp must be present in every group exactly when has_ref; the step
   table must start at 0, give every step at least one group and end at n_groups. *bytes is
   allocated with PR_MALLOC; release it with PR_FREE. */
PRDEF pr_status pr_trace_serialize(const pr_trace *trace, void **bytes, size_t *len, pr_error *err);
/* pr_trace_serialize to a file, atomically (temporary file, fsync, rename). */
PRDEF pr_status pr_trace_write(const pr_trace *trace, const char *path, pr_error *err);

/* The prefix tree of a step's groups: groups whose prompts begin with the same tokens (a system
   prompt, a tool schema, few-shot examples) share them. A node is a run of prefix positions
   start .. start+len-1 whose tokens are the same in every group below it; a group's prefix is
   the runs on the path from a root to its node. A run shared by two or more groups becomes a node
   of its own when it is at least min_shared tokens long; a shorter one stays in each group's own
   node (not worth a pass of its own). pr_trainer_compute_grads_tree runs a step as its tree,
   each node once. */
typedef struct {
    int parent;            /* -1: a root */
    int start, len;
    int groups_below;      /* groups whose prefix runs through this node */
} pr_prefix_node;
typedef struct {
    int n_nodes;
    pr_prefix_node *nodes; /* (n_nodes) parents before children */
    int n_groups;
    int *group_node;       /* (n_groups) the node each group's prefix ends at */
    long tokens_baseline;  /* prefix tokens the full-sequence schedule runs: sum of G * P */
    long tokens_groups;    /* each group's prefix once (the reuse schedule): sum of P */
    long tokens_tree;      /* each node once: sum of the node lengths */
} pr_prefix_tree;
/* Builds the tree of groups[0..n-1] (min_shared >= 1). On failure *tree is untouched. */
PRDEF pr_status pr_prefix_tree_build(pr_prefix_tree *tree, const pr_group *groups, int n, int min_shared, pr_error *err);
PRDEF void pr_prefix_tree_free(pr_prefix_tree *tree);   /* NULL or zeroed: nothing */


/* ---------------------------------------------------------------- 2. Backend interface */
/* Where a buffer lives. DEVICE is the compute memory (host RAM for the CPU backend); HOST is
   pinned host memory, the offload tier. */
typedef enum { PR_TIER_DEVICE = 0, PR_TIER_HOST = 1 } pr_tier;
#define PR_COPY_TAGS 8    /* names a backend's asynchronous copies can carry (copy_async) */

/* The rows of one pass through the model: n_seg sequences ("segments"), segment s occupying rows
   seg_off[s] .. seg_off[s+1]-1. Row r of segment s sits at RoPE position pos0 + (r - seg_off[s]).
   Every segment attends to all n_prefix rows of the shared prefix K/V (0: none), then causally to
   its own rows, never to another segment. Padded batches are segments of equal length whose tail
   rows are padding (causal masking keeps padding from touching real rows).
       baseline microbatch   n_prefix 0, pos0 0, segments = full [prefix ; suffix] sequences
       Phase A / Phase C     n_prefix 0, pos0 0, one segment = the prefix
       Phase B microbatch    n_prefix P, pos0 P, segments = suffixes (padded or packed) */
typedef struct {
    int n_seg;
    const int *seg_off;   /* (n_seg+1), host memory */
    int pos0;
    int n_prefix;
} pr_seq_layout;

/* GRPO loss settings. Per token: r = exp(logp - old_logp),
   l = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) + kl_coef * (exp(ref-logp) - (ref-logp) - 1).
   The loss of an optimizer step aggregates the masked token losses l of all its groups (the
   "batch" of verl's agg_loss, whose modes these are) over step-wide denominators: T masked tokens,
   N trajectories, a constant length L (pr_step_norm), with n_i the masked tokens of trajectory i:
     token-mean               sum_i sum_t l / T
     seq-mean-token-mean      sum_i (sum_t l / n_i) / N     (a trajectory with n_i = 0 adds 0)
     seq-mean-token-sum       sum_i sum_t l / N
     seq-mean-token-sum-norm  sum_i sum_t l / L             (Dr. GRPO; verl divides by the padded
                                                             response length, not by N)
   N counts every trajectory of the step, also one whose tokens are all masked (verl leaves those
   out of its sequence count). Every denominator is known before any forward: each token's share
   of the loss is fixed, so the loss adds up over groups, suffixes and microbatches in any order. */
typedef enum {
    PR_NORM_TOKEN_MEAN = 0,
    PR_NORM_SEQ_MEAN_TOKEN_MEAN = 1,
    PR_NORM_SEQ_MEAN_TOKEN_SUM = 2,
    PR_NORM_SEQ_MEAN_TOKEN_SUM_NORM = 3
} pr_loss_norm;
/* The step-wide denominators. A field left 0 takes the value of the group being computed alone
   (its masked tokens, its G, its longest suffix): a group called with none given is its own step,
   as a single group always was. pr_step_loss_totals fills all three for a step of groups. */
typedef struct {
    int64_t tokens;          /* T: masked suffix tokens of the step */
    int64_t trajectories;    /* N: trajectories (suffixes) of the step */
    int64_t norm_len;        /* L: seq-mean-token-sum-norm's constant length */
} pr_step_norm;
typedef struct {
    double eps_low, eps_high;
    double kl_coef;                  /* 0: no KL term (reference log-probs not needed) */
    pr_loss_norm norm;
    pr_step_norm step;               /* zero: the group alone is the step */
} pr_loss_opts;

/* The denominators of a step of n groups (every group of the step, on every DP rank): T and N
   counted, L = norm_len, or with norm_len 0 the step's longest suffix. PR_ERR_ARG for NULL
   arguments, n < 1, a negative norm_len or a group whose shape pr_group_validate refuses (P, G,
   the suffix lengths and offsets; suffix_len, suffix_off and loss_mask present; the loss mask is
   the one array read). */
PRDEF pr_status pr_step_loss_totals(const pr_group *groups, int n, int64_t norm_len, pr_step_norm *out, pr_error *err);
/* The name of a mode as train and verl spell it ("seq-mean-token-sum-norm"); NULL for an unknown
   value. pr_loss_norm_parse is its inverse: PR_ERR_ARG, naming the four, for an unknown name. */
PRDEF const char *pr_loss_norm_name(pr_loss_norm norm);
PRDEF pr_status pr_loss_norm_parse(const char *name, pr_loss_norm *norm, pr_error *err);

/* One token's GRPO loss and d(loss)/d(logp), the formula above: the trainer's loss head uses it.
   ref_logp may be NULL (no KL term); opt NULL: the defaults of pr_step_opts_default; dloss_dlogp
   may be NULL (not written). */
PRDEF double pr_grpo_token_loss(double logp, double old_logp, const pr_real *ref_logp, double advantage,
                                const pr_loss_opts *opt, double *dloss_dlogp);

/* The kernels the schedule needs. Buffers named `void *` hold activations in the backend's
   element type (act_bytes each; pr_real on the CPU, bf16 on the GPU), and so do the weights the
   kernels read (`const void *w`): the trainer keeps the model's weights in that type, converted
   with reals_to_acts from the master weights whenever those change. `pr_real *` are master
   weights and gradients. Every backward ADDS into its gradient outputs (dinp, dw, dq, ...);
   callers zero them first. One exception: swiglu_bwd writes its output, whose one caller has
   nothing there to add to (so no zeroing pass goes over the MLP's widest gradient). */
typedef struct pr_backend pr_backend;
struct pr_backend {
    const char *name;
    size_t act_bytes;        /* activation element: sizeof(pr_real) on the CPU, 2 (bf16) on the GPU */
    size_t stat_bytes;       /* per-row statistics (RMSNorm rstd, attention lse): at least fp32, since
                                the backward rebuilds every probability from them */
    size_t logit_chunk;      /* logits the loss head holds at once (elements): bounds its memory */
    void *ctx;
    /* Optional (NULL: accept every model). Refuses a model the backend cannot run, at trainer creation. */
    pr_status (*check_config)(const pr_backend *be, const pr_config *cfg, pr_error *err);
    /* Optional. Kernels return nothing, so a backend keeps its first failure (a failed launch, a
       device fault) and hands it over here; the trainer asks after every step. */
    pr_status (*take_error)(const pr_backend *be, pr_error *err);
    /* Optional. Bytes the device could still allocate: offload issues a prefetch only when this
       keeps a safety margin (NULL: only the step's own budget decides). */
    size_t (*device_free)(const pr_backend *be);
    /* Optional pair (NULL: offload uses `copy`). copy_async queues a copy behind all compute issued
       so far, on a queue of its own, so that it runs beside the compute issued after it; tag
       (0..PR_COPY_TAGS-1) names it. copy_wait makes the compute issued next wait for the last copy
       queued with that tag. */
    void (*copy_async)(const pr_backend *be, void *dst, const void *src, size_t bytes, int tag);
    void (*copy_wait)(const pr_backend *be, int tag);
    /* Optional (NULL: copies untimed). Seconds the copies queued by copy_async since the last call
       took on their queue, each from its start to its end (waits for them); < 0: not measured. */
    double (*copy_seconds)(const pr_backend *be);
    /* memory */
    void *(*alloc)(const pr_backend *be, size_t bytes, pr_tier tier);
    void (*release)(const pr_backend *be, void *p, pr_tier tier);
    void (*zero)(const pr_backend *be, void *p, size_t bytes);
    void (*copy)(const pr_backend *be, void *dst, const void *src, size_t bytes);   /* any tiers */
    void (*upload_reals)(const pr_backend *be, pr_real *dst, const pr_real *host, size_t n);
    void (*download_reals)(const pr_backend *be, pr_real *host, const pr_real *src, size_t n);
    void (*sync)(const pr_backend *be);
    /* out (N,OC) = inp (N,C) @ w^T, w (OC,C) */
    void (*matmul_fwd)(const pr_backend *be, void *out, const void *inp, const void *w, int N, int C, int OC);
    /* dinp (N,C) += dout @ w;  dw (OC,C) += dout^T @ inp */
    void (*matmul_bwd)(const pr_backend *be, void *dinp, pr_real *dw, const void *dout, const void *inp,
                       const void *w, int N, int C, int OC);
    /* out (N,C) = inp / rms(inp) * w; rstd (N) saved */
    void (*rmsnorm_fwd)(const pr_backend *be, void *out, void *rstd, const void *inp, const void *w, int N, int C, double eps);
    void (*rmsnorm_bwd)(const pr_backend *be, void *dinp, pr_real *dw, const void *dout, const void *inp,
                        const void *w, const void *rstd, int N, int C);
    /* in place on x (N, heads*HS), rotate-half pairing (see the CPU kernel) at the layout's positions */
    void (*rope_fwd)(const pr_backend *be, void *x, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq);
    void (*rope_bwd)(const pr_backend *be, void *dx, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq);
    /* out (N,NH*HS), lse (N,NH) from q (N,NH*HS), own k,v (N,NKV*HS), prefix kp,vp (n_prefix,NKV*HS) */
    void (*attention_fwd)(const pr_backend *be, void *out, void *lse, const void *q, const void *k, const void *v,
                          const void *kp, const void *vp, const pr_seq_layout *lay, int NH, int NKV, int HS);
    /* Adds into dq, dk, dv (activations) and dkp, dvp (n_prefix,NKV*HS): the prefix rows' dK/dV,
       summed over every query row of every segment. Those are gradient accumulators in pr_real
       (fp32 on the GPU), as the schedule's gK/gV are: the sum over G suffixes is never rounded to
       the activations' precision. */
    void (*attention_bwd)(const pr_backend *be, void *dq, void *dk, void *dv, pr_real *dkp, pr_real *dvp,
                          const void *dout, const void *out, const void *lse, const void *q, const void *k,
                          const void *v, const void *kp, const void *vp, const pr_seq_layout *lay,
                          int NH, int NKV, int HS);
    /* h (rows,F) = silu(gate) * up, where each row of gu (rows,2F) holds the row's gate and then
       its up: the output of one GEMM by the gate and up projections stacked. dgu (rows,2F) = the
       gradients of both halves (written, not added). */
    void (*swiglu_fwd)(const pr_backend *be, void *h, const void *gu, int rows, int F);
    void (*swiglu_bwd)(const pr_backend *be, void *dgu, const void *dh, const void *gu, int rows, int F);
    /* tokens: host memory, ids into emb's rows; a token < 0 (its row on another TP rank's slice of
       the vocabulary): a zero row forward, nothing backward */
    void (*embed_fwd)(const pr_backend *be, void *out, const int32_t *tokens, const void *emb, int N, int C);
    void (*embed_bwd)(const pr_backend *be, pr_real *demb, const void *dout, const int32_t *tokens, int N, int C);
    void (*add)(const pr_backend *be, void *y, const void *x, size_t n);                 /* y += x */
    /* n elements between activations and reals, and y += x on reals (gK/gV, the CP region's
       gradient): on the CPU, where activations are reals, copies and an add. */
    void (*acts_to_reals)(const pr_backend *be, pr_real *dst, const void *src, size_t n);
    void (*reals_to_acts)(const pr_backend *be, void *dst, const pr_real *src, size_t n);
    void (*add_reals)(const pr_backend *be, pr_real *y, const pr_real *x, size_t n);
    /* n reals to bf16 (round to nearest even) and back: a gradient sum over dp in bf16
       (pr_mesh.bf16_grad_reduce) sends and receives these. */
    void (*reals_to_bf16)(const pr_backend *be, uint16_t *dst, const pr_real *src, size_t n);
    void (*bf16_to_reals)(const pr_backend *be, pr_real *dst, const uint16_t *src, size_t n);
    /* dst row m = w[m] * src row rows[m];  dst row rows[m] += w[m] * src row m. rows and w: host;
       w NULL: all 1. A scatter's rows may repeat (the loss head's last prefix row, an MoE token's
       experts): a row's additions are summed in m order, the same every run; a row < 0 is skipped. */
    void (*gather_rows)(const pr_backend *be, void *dst, const void *src, const int *rows, const pr_real *w, int M, int C);
    void (*scatter_add_rows)(const pr_backend *be, void *dst, const void *src, const int *rows, const pr_real *w, int M, int C);
    /* The loss head's two passes over logits (M,V): V columns of the vocabulary, all of it or this
       TP rank's slice; target (host, M): a column, or < 0 where the row's target is on another
       rank's slice. logit_stats writes each row's max z, sum exp(z - max) and z[target] (0 for a
       target < 0) to stats (host, M x 3); the trainer combines the slices' statistics into each
       row's log-sum-exp and its loss slope coef (host, M), and logit_grad replaces the logits by
       d(loss)/d(logits) = coef (onehot(target) - exp(z - lse)). */
    void (*logit_stats)(const pr_backend *be, double *stats, const void *logits, const int32_t *target, int M, int V);
    void (*logit_grad)(const pr_backend *be, void *logits, const double *lse, const double *coef, const int32_t *target,
                       int M, int V);
    /* MoE routing runs on the host (a softmax and a top-k over N x E values); these move its
       inputs and outputs and apply its weights. Activations to/from host reals: */
    void (*upload_acts)(const pr_backend *be, void *dst, const pr_real *host, size_t n);
    void (*download_acts)(const pr_backend *be, pr_real *host, const void *src, size_t n);
    /* out[m] = a row m . b row m (out: host, M) */
    void (*row_dots)(const pr_backend *be, pr_real *out, const void *a, const void *b, int M, int C);
    /* optimizer pieces, on parameter-typed arrays */
    double (*sum_squares)(const pr_backend *be, const pr_real *x, size_t n);
    void (*scale)(const pr_backend *be, pr_real *x, size_t n, double s);
    void (*adamw)(const pr_backend *be, pr_real *p, const pr_real *g, pr_real *m, pr_real *v, size_t n,
                  double lr, double beta1, double beta2, double eps, double weight_decay, long step);
};

/* The CPU backend: pr_real everywhere, OpenMP when compiled with it. */
PRDEF const pr_backend *pr_backend_cpu(void);

/* A backend that sizes without computing, for memory planning: it takes the element sizes and
   logit chunk of `like` (any backend), every allocation succeeds at a placeholder address that
   nothing may read, and every kernel returns at once (log-probs come back as those of all-zero
   logits). The trainer's memory accounting (per-phase peaks, offload statistics) runs exactly as
   it would on `like`, at any model size, in milliseconds. Activations read back to the host are a fixed pseudo-random
   pattern, so that MoE routing spreads tokens evenly. Fills *storage and returns it (NULL if either
   is NULL). On a mesh, pair it with pr_comm_measure. */
PRDEF const pr_backend *pr_backend_measure(const pr_backend *like, pr_backend *storage);

/* The CUDA backend's sizes, to plan its memory from any build: bf16 activations, fp32 statistics,
   PR_CUDA_LOGIT_CHUNK logits at a time. Fills *storage with a backend that has those sizes and no
   kernels, a `like` for pr_backend_measure and nothing else (NULL if storage is NULL). */
#define PR_CUDA_LOGIT_CHUNK ((size_t)256 << 20)   /* 512 MiB of bf16 logits: 2k rows of a 128k vocabulary */
PRDEF const pr_backend *pr_backend_cuda_sizes(pr_backend *storage);

/* The CUDA backend (bf16 activations, fp32 master weights, statistics and optimizer state), defined
   in prefixreuse_cuda.cu: link that file to use it (float build only). One backend drives one device
   on one stream; destroy it after every trainer that uses it. */
pr_status pr_backend_cuda_create(const pr_backend **be, int device, pr_error *err);
void pr_backend_cuda_destroy(const pr_backend *be);
/* The CUDA backend's attention kernels for head dims 64 and 128 (16 and 32 always run the FFMA
   kernels): PR_CUDA_ATTENTION_FFMA, the CUDA-core kernels, the reference; PR_CUDA_ATTENTION_MMA,
   the tensor-core kernels (bf16 mma.sync, compute capability 8.0 or later and 99,328 bytes of
   shared memory a block: PR_ERR_UNSUPPORTED below); PR_CUDA_ATTENTION_MMA_ATOMIC, the same forward
   and FlashAttention-2's fused backward (107,520 bytes: not on GPUs of 99 KiB a block), which adds
   dQ with fp32 atomics instead of running a dQ kernel: dq is not bitwise reproducible (dk, dv, dkp,
   dvp are MMA's, bit for bit); it exists to measure what the deterministic backward costs (on an
   H100 and an H200 it is the slower of the two); PR_CUDA_ATTENTION_WGMMA, MMA's kernels (forward,
   dQ, dK/dV) on Hopper's warpgroup MMA (wgmma; compute capability 9.0, a build with sm_90a code,
   the Makefile's default, and 132,096 bytes: PR_ERR_UNSUPPORTED elsewhere), the same algorithm,
   bitwise MMA's results.
   PR_CUDA_ATTENTION_AUTO, the default of a new backend, picks the fastest deterministic kind this
   GPU and build run: WGMMA, else MMA, else FFMA. All but FFMA pass test/test_gpu_attention.c and
   compute-sanitizer's memcheck and racecheck on an H100 (bench/RESULTS.md; WGMMA's dK/dV in its
   present form, two key tiles a block, on the emulated device only so far).
   pr_backend_cuda_attention tells the kind in use (never AUTO; -1 without a backend). */
#define PR_CUDA_ATTENTION_FFMA 0
#define PR_CUDA_ATTENTION_MMA 1
#define PR_CUDA_ATTENTION_MMA_ATOMIC 2
#define PR_CUDA_ATTENTION_WGMMA 3
#define PR_CUDA_ATTENTION_AUTO 4
pr_status pr_backend_cuda_set_attention(const pr_backend *be, int kind, pr_error *err);
int pr_backend_cuda_attention(const pr_backend *be);
/* The CUDA backend's operation profile, to see where a step's time goes. While it is on, every
   operation the trainer asks of the backend (a GEMM, attention, a norm, a conversion, a copy) is
   bracketed by two events on the stream, and its calls and time are summed by name; a GEMM's name
   carries its sizes, in x out ("matmul_fwd 4096x14336"). An operation's time runs from its start
   to its end on the stream, so it includes the operation's own host work (staging its arguments,
   converting on the host) where the stream waits for it, and an operation that returns a result
   to the host (a download, the loss head's statistics) counts until the host has it. Time between
   operations is the GPU waiting for the host between them (or for a collective, which the profile
   does not bracket); offload's block copies run beside the operations and have their own timer
   (pr_offload_stats.copy_seconds), and "copy_wait" is the stream waiting for one to land. The
   events cost about a microsecond an operation, and every 8,192 operations the host waits for the
   stream to read them. pr_backend_cuda_profile(be, 1) clears the sums and starts, (be, 0) stops.
   pr_backend_cuda_profile_read waits for the stream, fills up to cap rows, the longest first, and
   returns the number of rows it has (distinct operations, at most PR_CUDA_PROFILE_OPS), which may
   exceed cap; *complete is 0 when some operation went untimed (no events could be had, a record
   failed, the table of names was full) or a time could not be read. */
#define PR_CUDA_PROFILE_OPS 64     /* distinct operations the profile keeps */
#define PR_CUDA_OP_NAME 48         /* an operation's name with its shape, the terminating zero included */
typedef struct {
    char name[PR_CUDA_OP_NAME];
    long calls;
    double seconds;
} pr_cuda_op_time;
pr_status pr_backend_cuda_profile(const pr_backend *be, int on, pr_error *err);
int pr_backend_cuda_profile_read(const pr_backend *be, pr_cuda_op_time *rows, int cap, int *complete);

/* The GEMMs' algorithm cache since the backend's creation: GEMMs looked up, the misses among them
   (each a query of cuBLASLt's heuristic, tens of microseconds of host time), and the misses that
   pushed out another shape (the cache holds 4,096, 8 a set by a hash of the shape, the least
   recently used giving way). After a warm-up a dense model's steps ask nothing; MoE's experts ask
   for every new row count. All zero without a backend. */
typedef struct {
    long lookups, queries, evictions;
} pr_cuda_gemm_counts;
pr_cuda_gemm_counts pr_backend_cuda_gemm_counts(const pr_backend *be);

/* ---------------------------------------------------------------- 3-6. Trainer: model 3, schedules and hooks 4, offload 5, MoE 6 */
/* One parameter tensor: its Hugging Face name, shape and place in the parameter arena. */
typedef struct {
    char name[96];
    int ndim;
    int64_t shape[2];
    size_t offset, numel;
    int decay;              /* AdamW weight decay applies (matrices yes, norm weights no) */
} pr_tensor_info;

/* gKV hooks: the public seam of the schedule. Pointers are backend memory (host memory for the
   CPU backend), valid only during the call; k/v rows are (P, NKV*HS), post-RoPE, activations;
   dK/dV and gK/gV are pr_real (fp32 on the GPU). Under CP, P is this rank's rows of the prefix:
   its two pieces, r and 2cp-1-r of 2 cp (pr_mesh), one after the other, not one run of rows. */
typedef struct {
    void *user;
    /* Phase A: layer `layer` published its prefix K/V. The hook may rewrite them in place (a
       distributed exchange does): Phase B reads whatever the cache holds when it starts. */
    void (*on_kv_capture)(void *user, int layer, void *k, void *v, int P, int kv_dim);
    /* Phase B: microbatch `mb` produced these prefix dK/dV for `layer` (about to be added to gK/gV);
       set, the step holds them apart in two more buffers of P x kv_dim reals */
    void (*on_dkv)(void *user, int layer, int mb, const void *dk, const void *dv, int P, int kv_dim);
    /* Phase C: the accumulated gK/gV are injected into `layer`'s prefix backward */
    void (*on_kv_inject)(void *user, int layer, const void *gk, const void *gv, int P, int kv_dim);
} pr_hooks;

typedef enum { PR_SCHEDULE_BASELINE = 0, PR_SCHEDULE_REUSE = 1 } pr_schedule;
typedef enum { PR_LAYOUT_PADDED = 0, PR_LAYOUT_PACKED = 1 } pr_layout;

/* Offload of the prefix's dormant state (reuse schedule only). A layer's saved tensors other than
   its K/V (its "block": norm inputs and statistics, projection inputs, attention output and
   softmax statistics, MLP intermediates, the layer's input) are needed by Phase C and by nothing
   in Phase B. With offload on, each block moves to the HOST tier right after its layer's Phase-A
   forward and returns before its Phase-C backward (prefetched one layer ahead when the budget
   allows, loaded at its use when not), so Phase B holds only the K/V cache and gK/gV of the
   prefix. With recompute (pr_recompute) the block is the layer's input alone, the rest being
   rebuilt in Phase C: offload then moves the inputs. Results are bitwise the same with offload
   on or off. */
typedef struct {
    int enabled;
    size_t pool_bytes;       /* host staging pool; 0: sized at first use to the dormant footprint + 1/16.
                                Blocks that do not fit get their own host allocation (counted) */
    size_t device_budget;    /* a prefetch is issued only if live device bytes plus one block stay within
                                this (0: no limit) and the backend's free memory keeps its margin */
} pr_offload_opts;

typedef struct {
    size_t dormant_bytes;    /* the prefix's dormant footprint, all layers (reported with offload off too) */
    size_t block_bytes;      /* one layer's share */
    size_t pool_bytes;       /* the host pool's capacity */
    size_t offloaded_bytes, loaded_bytes;
    size_t host_peak_bytes;  /* pool plus any fallback allocations */
    int prefetches;          /* blocks loaded one layer ahead of their backward */
    int demand_loads;        /* blocks loaded at their use: the first, and every refused prefetch */
    int prefetches_refused;  /* by the device budget */
    int pool_fallbacks;      /* blocks the pool had no room for */
    double copy_seconds;     /* the block copies' time on the backend's copy queue, summed: they run
                                beside the compute, so the step's time with and without offload says
                                what they cost it (0 where the backend does not time its copies, -1
                                where some went untimed) */
} pr_offload_stats;

/* MoE load-balancing loss (Switch style, as Qwen3-MoE computes it over every layer's routing
   together): aux = E * sum_e f_e * P_e, f_e the fraction of (layer, token) routings that chose
   expert e among their top-k, P_e the mean router probability of e; the step's loss gains
   router_aux_loss_coef * aux. The scope is the set of tokens one aux loss is computed over in the
   full-sequence baseline: MICROBATCH, each microbatch (the step adds the mean over microbatches);
   GROUP, the whole prompt group. Under reuse a prefix token, computed once, stands for its copies
   in that scope: it counts m times (m = the microbatch's trajectories, or G), in the routing
   fractions, in the probability mass and in its gradient. The group scope needs every token's
   routing before any backward: with more than one microbatch a forward-only routing pass runs
   first (one more forward of the microbatches). */
typedef enum { PR_AUX_SCOPE_MICROBATCH = 0, PR_AUX_SCOPE_GROUP = 1 } pr_aux_scope;
typedef struct {
    pr_aux_scope scope;
    int prefix_multiplicity; /* 0: the scope's m (the accounting that matches the baseline); > 0 counts
                                every prefix token that many times instead (1: a negative control) */
} pr_moe_opts;

/* Activation recompute: which passes keep only each layer's input between its forward and its
   backward, and run the layer's forward again from it right before the layer's backward to
   rebuild the rest of its block (see pr_offload_opts) for that backward alone. PREFIX: the
   prefix pass (Phase A keeps every layer's input and K/V cache; Phase C rebuilds). ALL: the
   suffix microbatches and the baseline's passes too (they keep the inputs alone; their own K/V
   are rebuilt as well). The rebuilt forward computes what the first computed, bit for bit on
   the CPU backend: gradients and updates are the same with recompute on or off. It writes
   neither the K/V cache (attention backward still reads the cache, as Phase B did) nor the
   next layer's input, fires no hook and adds nothing to the MoE routing statistics or expert
   load, which are taken from the first forward. Its extra work (one more forward of each
   recomputed pass) is not in pr_step_stats.flops or rows, which count the model's work. */
typedef enum { PR_RECOMPUTE_NONE = 0, PR_RECOMPUTE_PREFIX = 1, PR_RECOMPUTE_ALL = 2 } pr_recompute;

typedef struct {
    pr_schedule schedule;
    int microbatch;          /* trajectories per microbatch; 0 = all G in one */
    /* > 0: no more trajectories a microbatch than keep its rows within this many tokens (at least
       one): count x the rows a pass of the schedule runs for the longest trajectory, P + S_max for
       the baseline, S_max for Phase B (the paper's suffix wave: the same memory holds several
       suffixes where it holds one whole sequence). With microbatch > 0 both limits hold. */
    int microbatch_tokens;
    pr_layout layout;        /* Phase B layout (the baseline always pads) */
    pr_loss_opts loss;
    pr_hooks hooks;
    pr_offload_opts offload;
    pr_moe_opts moe;
    pr_recompute recompute;  /* NONE (default), PREFIX or ALL */
    int accumulate;          /* 1: add this group's gradients to the arena instead of replacing them */
} pr_step_opts;

enum { PR_PHASE_A = 0, PR_PHASE_B = 1, PR_PHASE_C = 2 };
typedef struct {
    double loss;
    double seconds[3];       /* wall time of Phase A, B, C (the baseline reports all of it as B) */
    size_t peak_bytes[3];    /* peak activation bytes live (device tier) during each phase */
    size_t chunk_bytes;      /* device memory the activation arenas' chunks hold at the step's end, spare
                                chunks included: the peaks above plus what reuse of chunks wastes */
    pr_offload_stats offload;
    double aux_loss;         /* MoE: the load-balancing term included in loss (coefficient applied) */
    int routing_prepass;     /* MoE: 1 when a forward-only routing pass ran first (group scope) */
    long rows;               /* token rows run through the model (padding included) */
    long loss_tokens;        /* tokens with a nonzero loss weight */
    /* Diagnostics over those tokens, as sums (divide by loss_tokens, after adding up a step's groups
       and its dp ranks): the KL estimate the loss uses, exp(ref-logp) - (ref-logp) - 1 (0 without
       reference log-probs), and the tokens whose clipped term is the one taken (the clip fraction's
       count; their policy-gradient slope is 0). */
    double kl_sum;
    long clipped_tokens;
    int microbatches;
    double flops;            /* model FLOPs of the step (pr_step_flops) */
    /* Reuse: this rank's prefix K/V cache over its layers, the state a group split across DP ranks
       replicates to each peer; and the prefix's activation stack besides (every layer's other
       saved tensors, under recompute its input alone, and the final residual), which stays on
       the rank that runs Phase A and C. */
    size_t prefix_kv_bytes, prefix_stack_bytes;
} pr_step_stats;

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    double max_grad_norm;    /* global-norm clipping; 0: off (inf: never clips) */
} pr_adamw_opts;

typedef struct pr_trainer pr_trainer;

PRDEF pr_step_opts pr_step_opts_default(void);
PRDEF pr_adamw_opts pr_adamw_opts_default(void);

/* The config is validated (pr_config_validate: every size it implies within the limits above)
   before anything is allocated. */
PRDEF pr_status pr_trainer_create(pr_trainer **tr, const pr_config *cfg, const pr_backend *be, pr_error *err);
/* Destroy also releases the team a group split over dp ranks kept (pr_trainer_compute_grads_dp):
   on a mesh, every rank destroys its trainer. NULL: nothing. */
PRDEF void pr_trainer_destroy(pr_trainer *tr);
/* The accessors take NULL and answer neutrally: pr_trainer_config NULL, the counts 0,
   pr_trainer_tensor NULL (also for i out of range). */
PRDEF const pr_config *pr_trainer_config(const pr_trainer *tr);
/* Deterministic initialisation: N(0, 0.02) matrices and embeddings, norm weights 1; AdamW state
   zeroed. Each value is drawn from its index in the full model, so a mesh's rank draws only its
   shard's values, the bits one rank draws. Collective over the world on a mesh: a rank without
   the memory to draw fails every rank, each keeping what it had. */
PRDEF pr_status pr_trainer_init_params(pr_trainer *tr, uint64_t seed, pr_error *err);
/* Parameters from a safetensors file or folder (sharded through model.safetensors.index.json).
   On a mesh each rank checks the whole checkpoint (every tensor of the full model, of its shape)
   and reads only its shard's rows and columns of each tensor: its host memory is its shard, not
   the model. Collective over the world there: the ranks agree before any takes the weights, so a
   load that fails on one rank fails on all, each keeping what it had. */
PRDEF pr_status pr_trainer_load(pr_trainer *tr, const char *path, pr_error *err);
/* config.json + model.safetensors (sharded above max_shard_bytes, 0 = never) into dir, as
   pr_checkpoint_save writes them. dir is created when missing, its parent is not: a path with a missing folder above
   dir is refused (PR_ERR_IO), so a typo cannot scatter folders. The values go to the files as
   they are assembled, a chunk at a time, so that no copy of the whole model is made (on the
   host: the trainer without a mesh downloads a chunk at a time). On a mesh, collective over the
   world: world rank 0 writes; the others give their shards to each chunk, and a file whose chunks
   are not whole (a rank failed during the gather) is abandoned before it is committed. Every rank
   fails or none does: a rank that failed returns its own status, the others the status of the
   first that did, their message naming its world rank (rank 0's write, or a rank's part of the
   gather). */
PRDEF pr_status pr_trainer_save(pr_trainer *tr, const char *dir, pr_dtype dtype, uint64_t max_shard_bytes, pr_error *err);
/* The gradients of the last step under the parameters' names ("model.layers.0.mlp.up_proj.weight"),
   on a mesh written as pr_trainer_save writes the model. */
PRDEF pr_status pr_trainer_save_grads(pr_trainer *tr, const char *path, pr_error *err);

/* Training state: everything a run needs to go on exactly where it stopped. The trainer holds the
   parameters, AdamW's m and v and its step count (the bias correction); the caller's run loop holds
   the rest: its place in the trace and the settings it ran with. Nothing random runs after the
   initialisation (the trace is replayed in order, the schedules are deterministic), so the seed is
   the run's only RNG state, kept for the record. */
typedef struct {
    long step;               /* AdamW steps taken (save: ignored, the trainer's count is written) */
    long next_group;         /* the trace position: index of the next group the run loop takes */
    uint64_t seed;           /* the initialisation seed */
    pr_adamw_opts adamw;     /* the AdamW settings the steps ran with */
    uint64_t data_fingerprint; /* the caller's name for the data next_group counts in (train: its trace's
                                  pr_trace.fingerprint), so that a resume can tell other data; 0: none */
} pr_train_state;

/* Optional settings of a save (NULL: none). on_write is called after every block written with the
   bytes this save has written so far: a progress report, and the fault-injection point of the
   tests, which kill the process there to show that an interrupted save loses nothing. */
typedef struct {
    void (*on_write)(void *user, uint64_t bytes);
    void *user;
} pr_save_opts;

#define PR_TRAIN_STATE_VERSION 2     /* the newest layout: 1 one rank's full tensors, 2 per-rank pieces */
/* Saves the training state into dir (created when missing, its parent is not):
     dir/latest                    one line, the name of the current state folder
     dir/step-00000004/            one complete state, named after its step count:
         config.json               the full model's configuration
         trainer_state.json        format, version, step, next_group, seed, AdamW settings, and
                                   data_fingerprint (16 hex digits) when it is not 0
     one rank (no mesh, or a mesh of one), version 1:
         model.safetensors         fp32 parameters, Hugging Face names (what pr_trainer_load reads)
         optimizer.safetensors     fp32 AdamW moments: "exp_avg.<name>" (m), "exp_avg_sq.<name>" (v)
     a mesh of W > 1 ranks, version 2, each rank writing only what it holds:
         rank-<r>-of-<W>.safetensors  rank r's pieces, 1-D: "<name>" its parameter shard,
                                   "exp_avg.<name>", "exp_avg_sq.<name>" m and v (under ZeRO each
                                   of the three its slice)
         state_index.json          the mesh; per full tensor its shape and pieces: kind (param,
                                   exp_avg, exp_avg_sq), file, key, the rank's rectangle of the
                                   full tensor (rows, cols [first, end)) and the elements
                                   [first, end) of it, row-major, the key holds (a ZeRO slice may
                                   cut a tensor)
   Values held alike by several ranks are written by the lowest (dp and cp ranks, a KV head
   replicated over tp, the tied embedding's copy on the last stage). A state folder is written as
   step-N.tmp.<pid> (rank 0's pid, sent to every rank) and renamed into place once every file is on
   disk; then `latest` is replaced atomically, and only then the previous state folder is removed.
   A process (or one rank) killed at any point leaves `latest` naming a complete state (at worst a
   stray *.tmp.* folder). Collective over the world on a mesh. Refused before anything is written:
   a negative next_group, AdamW settings pr_trainer_adamw_step refuses (a max_grad_norm of infinity,
   which never clips, is written as 1e999 and reads back as infinity). */
PRDEF pr_status pr_trainer_save_state(pr_trainer *tr, const char *dir, const pr_train_state *state, const pr_save_opts *opts,
                                      pr_error *err);
/* Loads a state saved by pr_trainer_save_state: dir is the folder given to the save (its `latest`
   is followed) or one state folder. Parameters, m, v and the step count replace the trainer's;
   *state (optional) gets the rest. Everything is read and checked before the trainer is touched:
   another format or version, a missing file or tensor, a tensor of another shape (named, with
   both shapes), or a version-2 index whose pieces miss a part of a tensor (named) is refused and
   the trainer is left as it was. A version-2 state loads on any mesh (or one rank): each rank
   reads from the files only the pieces over its own shard and slice. A version-1 state on a
   mesh: each rank checks every tensor and reads only its shard's rows and columns of each (as
   pr_trainer_load). On a mesh, collective over the
   world: the ranks agree before any takes the state, so that one rank's failure (its part
   unreadable, out of memory) fails the load on every rank, each keeping what it had; the others'
   message names the first world rank that failed and its status, which they return. */
PRDEF pr_status pr_trainer_load_state(pr_trainer *tr, const char *dir, pr_train_state *state, pr_error *err);
/* A state's record alone, without its tensors (e.g. to check its data_fingerprint before a long
   load): dir as pr_trainer_load_state takes it. folder (optional, cap bytes) gets the state
   folder's path, whose config.json is the model's; *state (optional) trainer_state.json's values,
   checked as the load checks them. Nothing is written on failure. Any rank, no collective. */
PRDEF pr_status pr_train_state_read(const char *dir, char *folder, size_t cap, pr_train_state *state, pr_error *err);

PRDEF int pr_trainer_tensor_count(const pr_trainer *tr);
PRDEF const pr_tensor_info *pr_trainer_tensor(const pr_trainer *tr, int i);
PRDEF size_t pr_trainer_param_count(const pr_trainer *tr);
/* Bytes this rank holds for training state: the fp32 master weights and AdamW's m and v (a 1/dp
   slice each under ZeRO), the gradients (whole, padded under ZeRO), and the weights the kernels
   read where they are a copy of their own (whole: bf16 on the GPU, 2 bytes a parameter; on the CPU
   only under ZeRO). Divided by pr_trainer_param_count: 16 on the CPU (4 each), 4 + 4 + 12/dp on it
   under ZeRO; on the GPU 18, and 2 + 4 + 12/dp under ZeRO (7.5 at dp 8). 0 for a NULL trainer. */
PRDEF size_t pr_trainer_state_bytes(const pr_trainer *tr);
/* Host copies of the whole arena (n = pr_trainer_param_count reals). A NULL trainer or buffer or
   another n is PR_ERR_ARG, and nothing is copied. Under ZeRO a rank holds a slice of the master
   weights: get_params is PR_ERR_UNSUPPORTED there (pr_trainer_get_full gathers them), and
   set_params takes the slice and the whole copy the kernels read. */
PRDEF pr_status pr_trainer_get_params(const pr_trainer *tr, pr_real *dst, size_t n, pr_error *err);
PRDEF pr_status pr_trainer_set_params(pr_trainer *tr, const pr_real *src, size_t n, pr_error *err);
PRDEF pr_status pr_trainer_get_grads(const pr_trainer *tr, pr_real *dst, size_t n, pr_error *err);

/* The gradient of the group's GRPO loss w.r.t. every parameter, by either schedule; overwrites
   the gradient arena (adds to it with opt->accumulate: a step of several groups, each with the
   step's denominators in opt->loss.step, is their sum). logp (optional, g->suffix_off[G] reals)
   receives every suffix token's log-prob. The group and options are validated before anything
   is touched. On a mesh with tp, cp or pp above 1 a step's sums over the mesh run once, after its
   last group: accumulate there with pr_trainer_compute_grads_dp (opt->accumulate is refused). */
PRDEF pr_status pr_trainer_compute_grads(pr_trainer *tr, const pr_group *g, const pr_step_opts *opt,
                                         pr_step_stats *stats, pr_real *logp, pr_error *err);
/* One group's stats into a step's: loss, flops, rows, loss_tokens, kl_sum, clipped_tokens and the
   phase times added, the phase peaks the larger; every other field becomes the group's (the last
   group's). Start *step zeroed. */
PRDEF void pr_step_stats_add(pr_step_stats *step, const pr_step_stats *group);
/* MoE: the load of each expert of `layer` over the groups of the last pr_trainer_compute_grads*
   call: the logical tokens routed to it (a prefix token counts G times), n = num_experts values.
   Under the _dp calls, this rank's groups (or its share of a split group): their sum over dp is
   the step's. On a pipeline, a layer of this rank's stage. */
PRDEF pr_status pr_trainer_expert_load(const pr_trainer *tr, int layer, double *load, int n, pr_error *err);
/* Global-norm clipping then AdamW on the gradient arena; grad_norm (optional) gets the pre-clip norm.
   Under ZeRO (pr_mesh.zero) each dp rank clips and updates its slice of the master weights and
   the weights the kernels read are all-gathered over dp (in their own type: bf16 on the GPU),
   bitwise as without; collective over the mesh. */
PRDEF pr_status pr_trainer_adamw_step(pr_trainer *tr, const pr_adamw_opts *opt, double *grad_norm, pr_error *err);

/* The trajectories per microbatch a step with these options runs on the group (the last
   microbatch may hold fewer): opt->microbatch (0: all G), and under opt->microbatch_tokens no more
   than fit. 0 for a NULL group or options. */
PRDEF int pr_step_microbatch(const pr_group *g, const pr_step_opts *opt);

/* Model FLOPs one step of a schedule performs on a group (matmuls, attention, loss head; forward
   and backward), the measure the speed-up bound is computed from. 0 for a NULL config, group or
   suffix_len. */
PRDEF double pr_step_flops(const pr_config *cfg, const pr_group *g, pr_schedule schedule);
/* The same FLOPs by the phase that performs them (flops[PR_PHASE_A/B/C], pr_step_stats.seconds'
   phases): with reuse, A is the prefix forward; B the suffixes forward and backward with the loss
   rows they hold (each suffix's rows but the last); C the prefix backward with the loss rows of
   the prefix (the last prefix row, which predicts every suffix's first token, and each trained
   prefix token once for all G trajectories). The baseline's all fall in B. Zeros for a NULL
   config, group or suffix_len; nothing written for a NULL flops. */
PRDEF void pr_step_phase_flops(const pr_config *cfg, const pr_group *g, pr_schedule schedule, double flops[3]);

/* A step of n groups whose prefixes share tokens, run as their prefix tree (pr_prefix_tree_build
   over the same groups): every node forward once, top-down, attending to the nodes above it; the
   suffixes of each group as Phase B microbatches against its whole prefix; every node backward
   once, bottom-up, with the gK/gV of everything below it. The gradients (added to the arena when
   opt->accumulate) and the stats equal those of the groups stepped one by one with
   pr_trainer_compute_grads and the same options, step totals included (opt->loss.step: 0 takes
   each group's own), but for the expert load (pr_trainer_expert_load), which is the whole step's
   (the sum of the groups' loads), and the offload stats, which cover every node (dormant_bytes:
   the deepest chain of nodes, whose blocks rest at once). MoE and offload as in
   pr_trainer_compute_grads. The reuse schedule; on a mesh, TP, CP and PP run inside the tree (with
   tp, cp or pp, opt->accumulate is refused: see pr_trainer_compute_grads_tree_dp). */
PRDEF pr_status pr_trainer_compute_grads_tree(pr_trainer *tr, const pr_group *groups, int n, const pr_prefix_tree *tree,
                                              const pr_step_opts *opt, pr_step_stats *stats, pr_error *err);
/* Model FLOPs of that step: each group's suffixes as pr_step_flops counts them, each node once. */
PRDEF double pr_tree_flops(const pr_config *cfg, const pr_group *groups, int n, const pr_prefix_tree *tree);

/* ---------------------------------------------------------------- 7. The parallel layer: communicator, DP, device mesh */
/* The collectives the parallel layouts need, over a group of ranks. Every rank of a communicator
   calls each collective in the same order with the same n and type (as with MPI or NCCL). Over
   NCCL a rank that does not blocks the others; the in-process ranks (pr_comm_local_run) find it
   and fail the calls instead (see there). Sums run in rank order, so every rank gets the same bits.
   Buffers are backend memory of the implementation (host memory in-process, device memory for
   NCCL). n counts elements of `type`. */
typedef enum { PR_COMM_F32 = 0, PR_COMM_F64 = 1, PR_COMM_BF16 = 2 } pr_comm_type;
#define PR_COMM_REAL (sizeof(pr_real) == 8 ? PR_COMM_F64 : PR_COMM_F32)

typedef struct pr_comm pr_comm;
struct pr_comm {
    int rank, size;
    const char *name;
    void *ctx;
    size_t bytes_sent;       /* payload bytes this rank has put on the wire so far (reported by train; 0 alone) */
    /* buf (n) summed over the ranks, in place */
    pr_status (*all_reduce)(pr_comm *c, void *buf, size_t n, pr_comm_type type, pr_error *err);
    /* out (size*n) = every rank's in (n), in rank order */
    pr_status (*all_gather)(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type type, pr_error *err);
    /* out (n) = block `rank` of the sum over ranks of in (size*n) */
    pr_status (*reduce_scatter)(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type type, pr_error *err);
    /* block j (n) of in (size*n) goes to rank j; block i of out (size*n) comes from rank i */
    pr_status (*all_to_all)(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type type, pr_error *err);
    pr_status (*send)(pr_comm *c, const void *buf, size_t n, pr_comm_type type, int peer, pr_error *err);
    pr_status (*recv)(pr_comm *c, void *buf, size_t n, pr_comm_type type, int peer, pr_error *err);
    /* send (n_send) to rank `to` and recv (n_recv) from rank `from` as one operation: two ranks
       that exchange with each other this way do not wait on each other (a pipeline's 1F1B steady
       state), where a send and a recv in either order could */
    pr_status (*send_recv)(pr_comm *c, const void *send, size_t n_send, int to, void *recv, size_t n_recv, int from,
                           pr_comm_type type, pr_error *err);
    pr_status (*barrier)(pr_comm *c, pr_error *err);
    /* The ranks that pass the same color (>= 0) form a new communicator, ordered by (key, rank):
       the sub-groups of one mesh dimension. Collective over c. */
    pr_status (*split)(pr_comm *c, int color, int key, pr_comm **sub, pr_error *err);
    void (*destroy)(pr_comm *c);
};

/* A communicator for the measuring backend on a mesh (pr_backend_measure): the ranks of `inner`,
   and its split, so that a mesh forms exactly as on inner; every collective moves nothing (its
   buffers are the measuring backend's placeholders) and returns at once, and bytes_sent stays 0.
   Its sub-communicators are measuring ones too. Destroying it leaves inner alone. */
PRDEF pr_status pr_comm_measure(pr_comm **out, pr_comm *inner, pr_error *err);

/* Data parallelism over whole prompt groups. pr_dp_place assigns each of n groups to one of
   `ranks` ranks, largest first onto the least loaded, by the FLOPs of `schedule` (so the reuse
   schedule charges each prefix once): every rank computes the same placement. It reads each
   group's P, G, suffix_len and prefix_mask (groups as pr_group_validate takes them; a group whose
   lengths make no positive cost counts as none, and every group is placed). owner NULL or n < 1:
   nothing; cfg or groups NULL, or ranks < 1: every group on rank 0. PR_ERR_NOMEM when its
   scratch memory could not be had: owner then holds every group on rank 0, a placement the other
   ranks do not share, which a caller over dp must take as this rank's failure. */
PRDEF pr_status pr_dp_place(const pr_config *cfg, const pr_group *groups, int n, int ranks, pr_schedule schedule, int *owner);
/* Every rank of dp calls it with the same groups: the rank's trainer accumulates the gradients of
   the groups placed on it, then the gradient arenas are summed over dp, so every rank ends with
   the sum over all groups (what one rank would accumulate alone), ready for the same AdamW step.
   With fewer groups than ranks, each group is split over a team of consecutive ranks, each
   running an equal share of its trajectories: under reuse the team's first rank runs Phase A and
   C and sends each peer the prefix K/V (pr_step_stats.prefix_kv_bytes; the activation stack,
   prefix_stack_bytes, stays), and the peers' gK/gV come back to it after Phase B. Over the
   trainer's mesh's dp communicator the teams are kept for the next step of as many groups
   (pr_trainer_destroy releases them); over another, they are split anew every step.
   The groups are one optimizer step: give opt->loss.step the step's denominators
   (pr_step_loss_totals over all n groups) so that the summed loss is the step's aggregate; left
   zero, each group is normalised alone, as if it were a step of its own.
   *stats: this rank's groups' stats added up by pr_step_stats_add (a rank with no group gets
   zeros; in a team, each rank its share); sum them over dp for the whole step's. */
PRDEF pr_status pr_trainer_compute_grads_dp(pr_trainer *tr, pr_comm *dp, const pr_group *groups, int n,
                                            const pr_step_opts *opt, pr_step_stats *stats, pr_error *err);
/* Prefix trees over dp: pr_tree_place keeps subtrees together, the groups taken in the tree's
   depth-first order and cut into `ranks` runs of about equal FLOPs (each run at least one group;
   n >= ranks), so that a node is shared on one rank where the cut allows. owner NULL: nothing.
   pr_trainer_compute_grads_tree_dp is pr_trainer_compute_grads_dp for a step of n >= dp->size
   groups whose prefix tree is `tree`: each rank runs the tree of the groups placed on it (the
   tree cut down to their nodes), then the gradients are summed over dp. A node whose groups sit
   on two ranks runs on both: the result is exact whatever the placement. pr_tree_place returns
   PR_ERR_NOMEM as pr_dp_place does, and PR_ERR_ARG (everything on rank 0) for a tree that is not
   the groups' (nodes that do not continue their parents, a group's prefix not ending at its node)
   whatever `ranks`; cfg, groups or tree NULL, or ranks < 2: every group on rank 0. */
PRDEF pr_status pr_tree_place(const pr_config *cfg, const pr_group *groups, int n, const pr_prefix_tree *tree, int ranks, int *owner);
PRDEF pr_status pr_trainer_compute_grads_tree_dp(pr_trainer *tr, pr_comm *dp, const pr_group *groups, int n,
                                                 const pr_prefix_tree *tree, const pr_step_opts *opt, pr_step_stats *stats,
                                                 pr_error *err);

/* A device mesh (dp, pp, cp, tp, ep) over a world communicator. Rank order puts tp fastest:
   rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i. Each dimension gets its sub-communicator
   (the ranks that differ only in that coordinate). EP runs inside the TP group (ep is 1 or tp):
   the TP group's ranks hold the same rows, each dispatches its 1/ep share of them to the experts'
   owners by all-to-all, as under sequence parallelism.
   - TP: attention heads and MLP columns sharded (column-parallel q/k/v/gate/up, row-parallel
     o/down, an all-reduce after each); every rank caches its own head shard of the prefix K/V.
     tp must divide the query heads, and divide the KV heads or be a multiple of them: above
     them each KV head is replicated on tp / KV heads ranks, as in Megatron (each holds the KV
     head its query heads share under GQA, and the replicas' k/v gradients are summed). The
     embedding and the LM head are split by vocabulary rows (Megatron's vocabulary-parallel
     layers): each rank looks up its slice's tokens and a sum over tp completes the rows; the
     logits stay in slices, the log-sum-exp combines the slices' maxima and sums, and the head's
     d(input) is summed over tp.
   - CP: each sequence of a pass (the prefix in Phase A/C, each trajectory of a Phase-B or
     baseline microbatch) cut into 2 cp row pieces, rank r holding pieces r and 2cp-1-r, so that
     the causal attention's work is even over the ranks (Llama 3's split); attention all-gathers
     the K/V (in Phase B the prefix K/V blocks once, then each sequence's in turn) into row order
     and reduce-scatters their gradients back to the owners.
   - PP: the layers split into pp stages (the first embeds, the last runs the loss head). Phase A
     and Phase C run stage by stage (the prefix's rows handed on, its gradient handed back); a
     stage starts Phase B as soon as its own Phase A is done, its K/V cache never leaving it, and
     the microbatches run through the stages in the 1F1B order.
   - DP: whole prompt groups per rank (pr_trainer_compute_grads_dp over mesh->dp); with fewer
     groups than DP ranks each group is split over a team, its prefix K/V replicated. */
typedef struct {
    int dp, pp, cp, tp, ep;
    int dp_rank, pp_rank, cp_rank, tp_rank;
    pr_comm *world, *dp_comm, *pp_comm, *cp_comm, *tp_comm;
    pr_comm *ends_comm;      /* the pipeline's first and last stage (a tied embedding lives on both); alone elsewhere */
    /* Sharded training state over the dp ranks (ZeRO), set after pr_mesh_init (which makes it 0)
       and before pr_trainer_create_mesh. 0: every dp rank holds all of its arena's master weights
       and AdamW state. 1: the arena is cut into dp slices; each rank keeps the master weights, m
       and v of its slice only, clips and updates that slice, and the updated weights are
       all-gathered over dp into the whole copy the kernels read (bf16 on the GPU, where a rank
       then holds 2 + 4 + 12/dp bytes a parameter: 7.5 at dp 8). 2: as 1, and the
       step's gradient sum over dp is a reduce-scatter, so that after it a rank holds the summed
       gradient of its slice only (pr_trainer_get_full gathers the rest). The gradient buffer is
       still whole, for the step's accumulation: stage 2 saves traffic here, not memory. Results
       are bitwise those of stage 0 (the norm is summed over the same pieces in the same order). */
    int zero;
    /* The step's gradient sum over dp in bf16 (set like zero; 0: in reals, the default). Each rank's
       gradients are rounded to bf16, summed in bf16 and widened back: half the bytes on the wire,
       at bf16's precision, 2^-8 relative per rounding (Megatron's grad_reduce_in_fp32=False,
       FSDP's reduce_dtype=bfloat16). Only the sum over dp changes; TP, CP and the pipeline's
       sums stay in reals. The wire buffer, at most 2^22 elements, is taken at trainer creation. */
    int bf16_grad_reduce;
} pr_mesh;
/* Collective over world. On failure nothing is left allocated. */
PRDEF pr_status pr_mesh_init(pr_mesh *mesh, pr_comm *world, int dp, int pp, int cp, int tp, int ep, pr_error *err);
PRDEF void pr_mesh_free(pr_mesh *mesh);

/* A trainer for this rank's shard of cfg on the mesh (kept by pointer: it must outlive the
   trainer). Parameter names are the full model's; shapes are the shard's. Every step and AdamW
   call is collective over the mesh; gradients are summed over cp (and the q/k-norm gradients over
   tp) inside pr_trainer_compute_grads, so every rank ends a step with its shard of the full
   model's gradient. Requires heads, KV heads, intermediate (or, without EP, the expert
   intermediate) size divisible by tp, and experts by ep. With cp > 1 each sequence of a pass
   (each trajectory of a microbatch) is cut into 2 cp pieces, two of them a rank. Collective over
   the world: every rank keeps its trainer or none does. A rank that cannot create its own (out of
   memory for a larger shard, say) fails with its own message, the others with the status of the
   first that failed, naming its world rank; none is left waiting in a later collective. */
PRDEF pr_status pr_trainer_create_mesh(pr_trainer **tr, const pr_config *cfg, const pr_backend *be, const pr_mesh *mesh,
                                       pr_error *err);
/* The full model's parameter count, and whole-model copies in the unsharded trainer's layout:
   set takes this rank's slices of src; get assembles dst (parameters or gradients) on every
   rank (collective over tp and pp, and over dp under ZeRO for the parameters, whose master weights
   each rank holds a slice of, and after a ZeRO-2 step, whose reduce-scatter left each rank its
   slice of the summed gradient). Without a mesh they are get/set_params and
   get_grads. A rank of a gather that fails (its host memory) makes every rank of its tp x pp
   group fail with it (statuses go round tp, then pp, each rank told naming the world rank where
   the failure began), rather than return a copy without its shard. The count of a NULL trainer
   is 0. */
typedef enum { PR_ARENA_PARAMS = 0, PR_ARENA_GRADS = 1 } pr_arena_kind;
PRDEF size_t pr_trainer_full_param_count(const pr_trainer *tr);
PRDEF pr_status pr_trainer_set_full_params(pr_trainer *tr, const pr_real *src, size_t n, pr_error *err);
PRDEF pr_status pr_trainer_get_full(pr_trainer *tr, pr_arena_kind which, pr_real *dst, size_t n, pr_error *err);

/* In-process ranks: runs fn on n threads, each with its rank of one communicator over shared
   memory, and waits for all. A call that could never return fails instead of waiting (PR_ERR_ARG,
   naming the ranks by their thread's rank here): a collective whose ranks made different calls
   (before any buffer is read), a wait for a rank that has returned or destroyed that
   communicator, and a wait while every rank of the run waits with none able to go on, as when a
   rank that failed skips a collective its peers are in. Returns the first failing rank's status,
   its message prefixed with the rank; a failure of its own before those the communicator raised
   because of it, and of those, the fault it found in the calls (a peer that returned without
   failing and left it waiting in a call included) before a failing peer's leaving. Its threads
   are C11 <threads.h> in C, POSIX threads in C++; PR_NO_THREADS leaves it out (and is what a C99
   build needs). */
#ifndef PR_NO_THREADS
PRDEF pr_status pr_comm_local_run(int n, pr_status (*fn)(pr_comm *comm, void *user, pr_error *err), void *user,
                                  pr_error *err);
#endif

/* NCCL, defined in prefixreuse_cuda.cu (link it, and NCCL): one process per GPU. The communicator
   is bound to `be`, a CUDA backend: it runs on the backend's device and queues every collective on
   the backend's stream, so collectives are ordered after the kernels that write their buffers;
   each call waits for its own completion. The ranks get rank 0's unique id in one of two ways:
   - id_path a file: rank 0 removes a file left there, writes a fresh id (atomically) and removes
     it again once every rank has joined, or once its own set-up has failed; the other ranks wait
     up to timeout_s seconds for a file no older than a minute before their call (a shared
     filesystem for several nodes);
   - id_path "tcp://HOST:PORT" (HOST a name or address, "[...]" for IPv6), no shared filesystem
     needed: rank 0 listens on PORT on every interface; the others connect to HOST:PORT, again
     until rank 0 listens, for up to timeout_s, and say their world size, rank and launch (the
     first set of PR_NCCL_LAUNCH, SLURM_JOB_ID and TORCHELASTIC_RUN_ID, or none). Rank 0 holds
     one connection a rank (raising its soft limit on open files where that is too low; a rank
     that hangs up frees its place) and hands out the id only once every rank has come, so no rank
     enters NCCL's init without the whole world. After timeout_s it fails naming the ranks that did
     not come, and the ranks it held fail too (PR_ERR_IO). A rank of another launch (an earlier
     launch's process still calling) or world size, or a second one with a rank already held,
     fails at once and takes no place (PR_ERR_ARG). Rank 0 closes the port before its init (a
     relaunch may take it at once); if the id does not reach a held rank, rank 0 fails (PR_ERR_IO)
     rather than enter an init that rank will not join.
   Buffers are device memory.
   NCCL's sums are deterministic for a fixed topology but not in rank order. A build without NCCL
   (PR_NO_NCCL) returns PR_ERR_UNSUPPORTED.
   A call whose operation is not complete after timeout_s seconds (a peer that stopped or hangs, or
   ranks whose calls differ; the clock counts the work queued before it on the stream too), or that
   fails (NCCL's asynchronous errors included, and a call or split NCCL refuses: the peers have
   queued theirs, and NCCL pairs the ranks' calls by their order alone), aborts its NCCL
   communicator and returns PR_ERR_DEVICE; from then on every call of the communicators of that
   world (the one created here and all split from it) fails at once with that reason, and their
   destroy aborts rather than waits. The reason is also printed on stderr just before the abort
   (the one thing this library prints), since the abort itself may wait: within a node, until the
   peers' processes end or abort too (an NCCL maintainer's word, NVIDIA/nccl#863).
   NCCL's init is watched too: it runs in NCCL's thread (a non-blocking communicator that does
   nothing else) and fails after timeout_s (PR_ERR_DEVICE, "the world did not come together")
   where a rank never comes, rank 0's id file removed; so are the splits of the world, which are
   that communicator's. The world and its splits are blocking communicators, unless
   NCCL_COMM_BLOCKING=0 (which NCCL lets override the configuration) makes them non-blocking:
   then each call also waits, within the same limit, for NCCL's thread to queue its operation.
   (NCCL_COMM_BLOCKING=1 makes that first communicator blocking too: its init and splits then
   wait without limit.)
   Other waits on the host have no limit: a split of a communicator other than the world, and
   the connections NCCL makes inside a call: at the first operation with a peer and, by default
   (NCCL_RUNTIME_CONNECT=1), at an algorithm's first use, which can come mid-run when a message
   size first picks it (NCCL_RUNTIME_CONNECT=0 makes every connection when a communicator is set
   up, watched where that is, at the memory of all the algorithms' buffers, which the watching
   communicator then holds too). A launcher should still end the job when one rank exits with an
   error. An argument a call refuses (a type, a peer, a split color below 0)
   aborts the communicator like a failure. */
pr_status pr_comm_nccl_create(pr_comm **comm, const pr_backend *be, int rank, int size, const char *id_path, int timeout_s,
                              pr_error *err);

#ifdef __cplusplus
}
#endif
#endif /* PREFIXREUSE_H */

/* ============================================================================================ */
#ifdef PREFIXREUSE_IMPLEMENTATION

#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* PRDEF given (static, as stb's static builds do): the public functions this translation unit
   does not call are not warnings. */
#if defined(PR__PRDEF_GIVEN) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#define PR__POP_DIAGNOSTICS
#endif

#if defined(PR_MALLOC) && defined(PR_REALLOC) && defined(PR_FREE)
#elif !defined(PR_MALLOC) && !defined(PR_REALLOC) && !defined(PR_FREE)
#define PR_MALLOC(sz) malloc(sz)
#define PR_REALLOC(p, sz) realloc(p, sz)
#define PR_FREE(p) free(p)
#else
#error "prefixreuse.h: define all of PR_MALLOC, PR_REALLOC and PR_FREE, or none"
#endif


/* ================================================================ 1. BASICS */
/* ---------------------------------------------------------------- 1.1 Status, errors, sizes, time */
PRDEF const char *pr_status_name(pr_status s) {
    switch (s) {
    case PR_OK: return "ok";
    case PR_ERR_ARG: return "bad argument";
    case PR_ERR_IO: return "i/o error";
    case PR_ERR_FORMAT: return "malformed file";
    case PR_ERR_CONFIG: return "invalid configuration";
    case PR_ERR_NOMEM: return "out of memory";
    case PR_ERR_UNSUPPORTED: return "unsupported";
    case PR_ERR_DEVICE: return "device error";
    }
    return "unknown status";
}

/* Formatted into a buffer of its own first: an argument may be err->message itself (a message
   wrapped in its context), which vsnprintf must not read while it writes it. */
static pr_status pr__fail(pr_error *err, pr_status code, const char *fmt, ...) {
    if (err) {
        char m[sizeof err->message];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m, sizeof m, fmt, ap);
        va_end(ap);
        err->status = code;
        memcpy(err->message, m, strlen(m) + 1);   /* the message and its end, as vsnprintf wrote it there before */
    }
    return code;
}

/* Overflow-checked size arithmetic: 0 on overflow. */
static int pr__mul_size(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return 0;
    *out = a * b;
    return 1;
}

/* FNV-1a, 64-bit: a trace's fingerprint, the in-process communicator's record of the failures it
   raised. */
static uint64_t pr__fnv1a64(const unsigned char *p, size_t n) {
    uint64_t h = 14695981039346656037ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

/* Elapsed seconds: the monotonic clock where <time.h> shows it (POSIX feature macros), which no
   clock adjustment moves; else timespec_get (C11, C++17), the settable wall clock. A C99 build
   has only clock(), processor time: its phase timings then add up the time of every thread. */
#if defined(CLOCK_MONOTONIC) && !defined(_WIN32)
static double pr__now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#elif (defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L) || (defined(__cplusplus) && __cplusplus >= 201703L)
static double pr__now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#else
static double pr__now(void) { return (double)clock() / CLOCKS_PER_SEC; }
#endif

/* ---------------------------------------------------------------- 1.2 GEMM */
#ifdef PR_USE_CBLAS
#include <cblas.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* GCC in ISO mode (-std=c99) defaults to -ffp-contract=off, which would split every multiply-add
   of the hot loops (the GEMM's tile, the CPU attention's) into two instructions and halve their
   throughput; PR__FUSED opts a function back in. Clang fuses "acc += a*b" by default. Fusing is a
   per-binary property, so it does not affect determinism across thread counts. */
#if defined(__GNUC__) && !defined(__clang__)
#define PR__FUSED __attribute__((optimize("fp-contract=fast")))
#else
#define PR__FUSED
#endif

#ifndef PR_USE_CBLAS


/* Tuning knobs (PR_GEMM_*) may be predefined; changing KC changes result bits. */
#if defined(__GNUC__) || defined(__clang__)
#  define PR__GEMM_VEC 1
#  ifndef PR_GEMM_VBYTES
#    if defined(__AVX512F__)
#      define PR_GEMM_VBYTES 64
#    elif defined(__AVX__)
#      define PR_GEMM_VBYTES 32
#    else
#      define PR_GEMM_VBYTES 16
#    endif
#  endif
typedef pr_real pr__vreal __attribute__((vector_size(PR_GEMM_VBYTES)));
#  define PR__VLEN (PR_GEMM_VBYTES / (int)sizeof(pr_real))
#else
#  define PR__GEMM_VEC 0
#  define PR__VLEN (16 / (int)sizeof(pr_real))
#endif

#ifndef PR_GEMM_MR                     /* tile height: MR*NV accumulators + NV + 1 registers */
#  if defined(__AVX512F__) || defined(__aarch64__)
#    define PR_GEMM_MR 8               /* 32 vector registers */
#  else
#    define PR_GEMM_MR 6               /* 16 vector registers */
#  endif
#endif
#ifndef PR_GEMM_KC
#define PR_GEMM_KC 256                 /* K block: a B panel (KC x NR) stays in L1 */
#endif
#ifndef PR_GEMM_MC
#define PR_GEMM_MC 192                 /* M block: packed A (MC x KC) stays in L2 */
#endif
#ifndef PR_GEMM_NC
#define PR_GEMM_NC 2048                /* N block: packed B (KC x NC) stays in L3 */
#endif
#define PR__NV 2                       /* vectors per tile row */
#define PR__NR (PR__NV * PR__VLEN)
#define PR__MR PR_GEMM_MR
#define PR__KC PR_GEMM_KC
#define PR__MC (PR_GEMM_MC / PR__MR * PR__MR) /* whole tiles only */
#define PR__NC (PR_GEMM_NC / PR__NR * PR__NR)

/* Pack rows [0,n) x k [0,kc) of op(X) into W-wide panels P[panel][k][0..W), zero-padded.
   rk=1: element (r,k) is X[r*ld+k];  rk=0: it is X[k*ld+r]. */
static void pr__gemm_pack(pr_real *P, const pr_real *X, int ld, int rk, int n, int kc, int W) {
    int p, r, k;
    for (p = 0; p < n; p += W, P += (size_t)W * kc) {
        int w = n - p < W ? n - p : W;
        if (rk) {
            for (r = 0; r < w; r++) {
                const pr_real *x = X + (size_t)(p + r) * ld;
                for (k = 0; k < kc; k++) P[(size_t)k * W + r] = x[k];
            }
        } else {
            for (k = 0; k < kc; k++) {
                const pr_real *x = X + (size_t)k * ld + p;
                for (r = 0; r < w; r++) P[(size_t)k * W + r] = x[r];
            }
        }
        for (k = 0; w < W && k < kc; k++)
            for (r = w; r < W; r++) P[(size_t)k * W + r] = 0;
    }
}

/* Tile c[0..m) x [0..n) (stride ldc) = (acc ? c : 0) + sum_k pa[k] (x) pb[k]. */
PR__FUSED static void pr__gemm_kernel(int kc, const pr_real *pa, const pr_real *pb,
                            pr_real *c, int ldc, int m, int n, int acc) {
    pr_real t[PR__MR * PR__NR];
    int i, j, k;
#if PR__GEMM_VEC
    pr__vreal s[PR__MR][PR__NV], bv[PR__NV];
    for (i = 0; i < PR__MR; i++)
        for (j = 0; j < PR__NV; j++) s[i][j] = (pr__vreal){0};
    for (k = 0; k < kc; k++, pa += PR__MR, pb += PR__NR) {
        for (j = 0; j < PR__NV; j++) memcpy(&bv[j], pb + j * PR__VLEN, sizeof bv[j]);
#if defined(__GNUC__)
#pragma GCC unroll 16
#endif
        for (i = 0; i < PR__MR; i++)
            for (j = 0; j < PR__NV; j++) s[i][j] += pa[i] * bv[j];
    }
    if (m == PR__MR && n == PR__NR) { /* full tile: stay in vector registers */
        for (i = 0; i < PR__MR; i++, c += ldc)
            for (j = 0; j < PR__NV; j++) {
                pr__vreal v = s[i][j];
                if (acc) {
                    pr__vreal old;
                    memcpy(&old, c + j * PR__VLEN, sizeof old);
                    v = old + v;
                }
                memcpy(c + j * PR__VLEN, &v, sizeof v);
            }
        return;
    }
    for (i = 0; i < PR__MR; i++)
        for (j = 0; j < PR__NV; j++) memcpy(t + i * PR__NR + j * PR__VLEN, &s[i][j], sizeof s[i][j]);
#else
    for (i = 0; i < PR__MR * PR__NR; i++) t[i] = 0;
    for (k = 0; k < kc; k++, pa += PR__MR, pb += PR__NR)
        for (i = 0; i < PR__MR; i++)
            for (j = 0; j < PR__NR; j++) t[i * PR__NR + j] += pa[i] * pb[j];
#endif
    for (i = 0; i < m; i++, c += ldc)
        for (j = 0; j < n; j++) c[j] = acc ? c[j] + t[i * PR__NR + j] : t[i * PR__NR + j];
}

/* One thread's share: rows [m0,m1) x cols [n0,n1) of C, with private buffers pa (MC_ x KC reals)
   and pb (NC_ x KC), MC_ and NC_ whole tiles. An element of C is summed alike whatever the block
   sizes and the share (over k in blocks of KC, in order, by the same tile kernel): only KC changes
   its bits. */
static void pr__gemm_part(int ta, int tb, int m0, int m1, int n0, int n1, int K,
                          const pr_real *A, int lda, const pr_real *B, int ldb,
                          pr_real beta, pr_real *C, int ldc, pr_real *pa, pr_real *pb, int MC_, int NC_) {
    int jc, pc, ic, jr, ir;
    for (jc = n0; jc < n1; jc += NC_) {
        int nc = n1 - jc < NC_ ? n1 - jc : NC_;
        for (pc = 0; pc < K; pc += PR__KC) {
            int kc = K - pc < PR__KC ? K - pc : PR__KC;
            pr__gemm_pack(pb, tb ? B + (size_t)jc * ldb + pc : B + (size_t)pc * ldb + jc,
                          ldb, tb, nc, kc, PR__NR);
            for (ic = m0; ic < m1; ic += MC_) {
                int mc = m1 - ic < MC_ ? m1 - ic : MC_;
                pr__gemm_pack(pa, ta ? A + (size_t)pc * lda + ic : A + (size_t)ic * lda + pc,
                              lda, !ta, mc, kc, PR__MR);
                for (jr = 0; jr < nc; jr += PR__NR)
                    for (ir = 0; ir < mc; ir += PR__MR)
                        pr__gemm_kernel(kc, pa + (size_t)ir * kc, pb + (size_t)jr * kc,
                                        C + (size_t)(ic + ir) * ldc + jc + jr, ldc,
                                        mc - ir < PR__MR ? mc - ir : PR__MR,
                                        nc - jr < PR__NR ? nc - jr : PR__NR, pc > 0 || beta != 0);
            }
        }
    }
}
#endif /* !PR_USE_CBLAS */

static void pr__gemm(int ta, int tb, int M, int N, int K,
                     const pr_real *A, int lda, const pr_real *B, int ldb,
                     pr_real beta, pr_real *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    /* C = beta*C up front unless beta is 0 or 1, so kernels only overwrite or add.
       With K == 0 that is the whole answer (and BLAS would reject lda < 1 then). */
    if (K <= 0 || (beta != 0 && beta != 1)) {
        int i, j;
        for (i = 0; i < M; i++)
            for (j = 0; j < N; j++)
                C[(size_t)i * ldc + j] = beta == 0 ? 0 : beta * C[(size_t)i * ldc + j];
        if (K <= 0) return;
        beta = 1;
    }
#ifdef PR_USE_CBLAS
#ifdef PR_DOUBLE
    cblas_dgemm(
#else
    cblas_sgemm(
#endif
        CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
        M, N, K, 1, A, lda, B, ldb, beta, C, ldc);
#else
    {
        /* Per-thread buffers no bigger than the problem needs (small calls stay off
           mmap), rounded up to whole 64-byte lines so every slice stays aligned. */
        const size_t line = 64 / sizeof(pr_real);
        const size_t kc = K < PR__KC ? K : PR__KC;
        const size_t mc = M < PR__MC ? (M + PR__MR - 1) / PR__MR * PR__MR : PR__MC;
        const size_t nc = N < PR__NC ? (N + PR__NR - 1) / PR__NR * PR__NR : PR__NC;
        const size_t sa = (mc * kc + line - 1) / line * line;
        const size_t sb = (nc * kc + line - 1) / line * line;
        int nt = 1;
        char *raw;
        pr_real *buf;
#ifdef _OPENMP
        /* Threads only pay off once each gets a few tiles' work. */
        if ((double)M * N * K > 1e6) nt = omp_get_max_threads();
#endif
        raw = (char *)PR_MALLOC((sa + sb) * nt * sizeof(pr_real) + 64);
        if (!raw) {
            /* Never abort, and give the same bits: one thread, a tile's worth of packing on the
               stack (under 50 KB with the default KC), the same sums in the same order. */
            pr_real pa[PR__MR * PR__KC], pb[PR__NR * PR__KC];
            pr__gemm_part(ta, tb, 0, M, 0, N, K, A, lda, B, ldb, beta, C, ldc, pa, pb, PR__MR, PR__NR);
            return;
        }
        buf = (pr_real *)(raw + (64 - (uintptr_t)raw % 64) % 64);
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
        {
            int t = 0, T = 1;
            /* Split the wider of M, N into whole tiles, contiguous per thread. */
            int splitn = (N + PR__NR - 1) / PR__NR >= (M + PR__MR - 1) / PR__MR;
            int unit = splitn ? PR__NR : PR__MR, len = splitn ? N : M;
            int tiles = (len + unit - 1) / unit, lo, hi;
#ifdef _OPENMP
            t = omp_get_thread_num();
            T = omp_get_num_threads();
#endif
            lo = (int)((long long)tiles * t / T) * unit;
            hi = (int)((long long)tiles * (t + 1) / T) * unit;
            if (hi > len) hi = len;
            if (lo < hi)
                pr__gemm_part(ta, tb, splitn ? 0 : lo, splitn ? M : hi, splitn ? lo : 0,
                              splitn ? hi : N, K, A, lda, B, ldb, beta, C, ldc,
                              buf + (size_t)t * (sa + sb), buf + (size_t)t * (sa + sb) + sa, PR__MC, PR__NC);
        }
        PR_FREE(raw);
    }
#endif
}


/* ================================================================ 2. THE BACKEND */
/* ---------------------------------------------------------------- 2.1 The CPU backend */
/* Activations are pr_real; the casts below are the CPU reading of the backend's `void *`. */
#define PR__R(p) ((pr_real *)(p))
#define PR__CR(p) ((const pr_real *)(p))

static void *pr__cpu_alloc(const pr_backend *be, size_t bytes, pr_tier tier) {
    (void)be; (void)tier;
    return PR_MALLOC(bytes ? bytes : 1);
}
static void pr__cpu_release(const pr_backend *be, void *p, pr_tier tier) { (void)be; (void)tier; PR_FREE(p); }
static void pr__cpu_zero(const pr_backend *be, void *p, size_t bytes) { (void)be; memset(p, 0, bytes); }
static void pr__cpu_copy(const pr_backend *be, void *dst, const void *src, size_t bytes) { (void)be; memcpy(dst, src, bytes); }
static void pr__cpu_upload(const pr_backend *be, pr_real *dst, const pr_real *host, size_t n) { (void)be; memcpy(dst, host, n * sizeof(pr_real)); }
static void pr__cpu_download(const pr_backend *be, pr_real *host, const pr_real *src, size_t n) { (void)be; memcpy(host, src, n * sizeof(pr_real)); }
static void pr__cpu_sync(const pr_backend *be) { (void)be; }

static void pr__cpu_matmul_fwd(const pr_backend *be, void *out, const void *inp, const void *w, int N, int C, int OC) {
    (void)be;
    pr__gemm(0, 1, N, OC, C, PR__CR(inp), C, PR__CR(w), C, 0, PR__R(out), OC);   /* out = inp @ w^T */
}

static void pr__cpu_matmul_bwd(const pr_backend *be, void *dinp, pr_real *dw, const void *dout, const void *inp,
                               const void *w, int N, int C, int OC) {
    (void)be;
    if (dinp) pr__gemm(0, 0, N, C, OC, PR__CR(dout), OC, PR__CR(w), C, 1, PR__R(dinp), C);   /* dinp += dout @ w */
    pr__gemm(1, 0, OC, C, N, PR__CR(dout), OC, PR__CR(inp), C, 1, dw, C);            /* dw += dout^T @ inp */
}

/* forward: out = x * rstd * w,  rstd = 1/sqrt(mean(x^2) + eps) */
static void pr__cpu_rmsnorm_fwd(const pr_backend *be, void *out_, void *rstd_, const void *inp_, const void *w_,
                                int N, int C, double eps) {
    (void)be;
    pr_real *out = PR__R(out_), *rstd = PR__R(rstd_);
    const pr_real *inp = PR__CR(inp_), *w = PR__CR(w_);
    for (int n = 0; n < N; n++) {
        const pr_real *x = inp + (size_t)n * C;
        double ss = 0;
        for (int i = 0; i < C; i++) ss += (double)x[i] * x[i];
        double r = 1.0 / sqrt(ss / C + eps);
        pr_real *o = out + (size_t)n * C;
        for (int i = 0; i < C; i++) o[i] = (pr_real)(x[i] * r) * w[i];
        rstd[n] = (pr_real)r;
    }
}

/* backward of out_i = x_i * r * w_i with r = (mean(x^2)+eps)^(-1/2):
   dx_i = r * (dout_i w_i - x_i * r^2 * mean_j(dout_j w_j x_j)),  dw_i += dout_i * x_i * r */
static void pr__cpu_rmsnorm_bwd(const pr_backend *be, void *dinp_, pr_real *dw, const void *dout_, const void *inp_,
                                const void *w_, const void *rstd_, int N, int C) {
    (void)be;
    pr_real *dinp = PR__R(dinp_);
    const pr_real *dout = PR__CR(dout_), *inp = PR__CR(inp_), *rstd = PR__CR(rstd_), *w = PR__CR(w_);
    for (int n = 0; n < N; n++) {
        const pr_real *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
        double r = rstd[n], dot = 0;
        for (int i = 0; i < C; i++) dot += (double)dy[i] * w[i] * x[i];
        double k = r * r * r * dot / C;
        pr_real *dx = dinp + (size_t)n * C;
        for (int i = 0; i < C; i++) {
            dx[i] += (pr_real)(r * dy[i] * w[i] - k * x[i]);
            dw[i] += (pr_real)(dy[i] * x[i] * r);
        }
    }
}

/* RoPE, Hugging Face rotate-half pairing: within a head of HS values, element i (i < HS/2) is
   rotated together with element i + HS/2 by angle pos * inv_freq[i]:
       [ x0 x1 .. x(h-1) | xh .. x(2h-1) ]   pairs (x0,xh), (x1,xh+1), ...   ([ccss], not [cscs])
       y_i = x_i cos - x_{i+h} sin,   y_{i+h} = x_{i+h} cos + x_i sin
   The backward is the rotation by -angle. */
static void pr__cpu_rope(void *x_, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq, double sign) {
    pr_real *x = PR__R(x_);
    int half = HS / 2;
    for (int s = 0; s < lay->n_seg; s++)
        for (int r = lay->seg_off[s]; r < lay->seg_off[s + 1]; r++) {
            double pos = lay->pos0 + (r - lay->seg_off[s]);
            for (int i = 0; i < half; i++) {
                double ang = pos * inv_freq[i];
                pr_real c = (pr_real)cos(ang), sn = (pr_real)(sign * sin(ang));
                for (int h = 0; h < heads; h++) {
                    pr_real *v = x + ((size_t)r * heads + h) * HS;
                    pr_real a = v[i], b = v[i + half];
                    v[i] = a * c - b * sn;
                    v[i + half] = b * c + a * sn;
                }
            }
        }
}
static void pr__cpu_rope_fwd(const pr_backend *be, void *x, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq) {
    (void)be; pr__cpu_rope(x, lay, heads, HS, inv_freq, 1.0);
}
static void pr__cpu_rope_bwd(const pr_backend *be, void *dx, const pr_seq_layout *lay, int heads, int HS, const pr_real *inv_freq) {
    (void)be; pr__cpu_rope(dx, lay, heads, HS, inv_freq, -1.0);
}

/* exp at the build's precision: expf is about twice as fast as exp on the float build's hot loops. */
#ifdef PR_DOUBLE
#define PR__EXP(x) exp(x)
#else
#define PR__EXP(x) expf(x)
#endif

/* Eight independent partial sums: the compiler may keep them in one vector register (a single
   running sum is a dependency chain it must not reorder). The order is fixed, so results do not
   depend on the caller or the thread. */
static pr_real pr__dot(const pr_real *a, const pr_real *b, int n) {
    pr_real part[8] = { 0, 0, 0, 0, 0, 0, 0, 0 }, s = 0;
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) part[k] += a[i + k] * b[i + k];
    for (; i < n; i++) s += a[i] * b[i];
    return s + (((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7])));
}
static void pr__axpy(pr_real *y, pr_real a, const pr_real *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* The keys a query row sees: the n_prefix shared rows (kp), then its own segment's rows up to and
   including itself (k). Key j < n_prefix is kp row j; key j >= n_prefix is k row seg0 + j - n_prefix. */
#define PR__KEY(kp, k, j, np, seg0, kvd, hk) \
    ((j) < (np) ? (kp) + (size_t)(j) * (kvd) + (hk) : (k) + (size_t)((seg0) + (j) - (np)) * (kvd) + (hk))

/* The CPU attention takes the query rows of one head PR__ATT_BQ at a time, the lanes of a block,
   against PR__ATT_BK keys at a time, in stack memory only (tiles of PR__ATT_DC x PR__ATT_BQ and
   PR__ATT_BK x PR__ATT_BQ reals). Every product runs across the lanes or across the head dim, in
   loops of fixed length that vectorise with no horizontal sum: the lanes' queries (and output
   gradients) are copied transposed, so that a key's scores with the lanes are independent sums,
   and the lanes' outputs (and dq) are summed in a transposed tile too. A head dim of at most
   PR__ATT_DC stays in those tiles through all the key blocks of its lanes (resident); a larger one
   passes through them a chunk at a time, the same sums in the same order. A lane's arithmetic never
   depends on the other lanes of its block, and every sum into a row of dq, dk or dv adds in a fixed
   order (keys ascending for a query row; segments, query heads, query rows ascending for a key
   row), so results do not depend on the threads. */
#define PR__ATT_BQ 16
#define PR__ATT_BK 64
#define PR__ATT_DC 128
/* Keys, or head-dim values, a kernel keeps in registers at once: eight independent sums (of a
   vector of lanes each), enough to hide the latency of the FMA they wait on, with the operands
   beside them still in registers. The kernels sum a whole group in registers only where they copy
   its accumulators in and out whole: GCC keeps an array it partly copies in memory, and a group
   summed through memory runs at the speed of store-to-load forwarding. */
#define PR__ATT_T 8
#if defined(__GNUC__)
#define PR__PRAGMA(x) _Pragma(#x)
#define PR__UNROLL(n) PR__PRAGMA(GCC unroll n)   /* n expanded first: the pragma itself expands no macro */
#else
#define PR__UNROLL(n)
#endif

#ifdef PR_DOUBLE
typedef uint64_t pr__real_bits;
#else
typedef uint32_t pr__real_bits;
#endif

/* y[i] = exp(x[i]) for the PR__ATT_BQ lanes, in loops that vectorise (over local arrays, which
   cannot alias): x = k ln2 + r with |r| <= ln2/2, exp(r) by its Taylor series to the degree whose
   first dropped term is under a tenth of an ulp, 2^k written into the exponent bits. Adding
   1.5 * 2^(mantissa bits) rounds x/ln2 to the nearest integer k and leaves k in the low bits of the
   sum, so no float-to-integer conversion is needed. x below lo gives 0 (exp(-inf) among them), above
   hi infinity: there e^x nears the smallest and the largest normal number. NaN stays NaN. */
static void pr__exp_lanes(pr_real *y, const pr_real *x) {
#ifdef PR_DOUBLE
    const double lo = -708, hi = 709, magic = 6755399441055744.0 /* 1.5 * 2^52 */, log2e = 1.4426950408889634,
                 ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
    const pr_real inv_fact[] = { 1, 1, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040, 1.0 / 40320,
                                 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800 };
    const int degree = 13, mant = 52;
    const pr__real_bits bias = 1023;
#else
    const float lo = -87, hi = 88, magic = 12582912.0f /* 1.5 * 2^23 */, log2e = 1.44269504f,
                ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;   /* ln2_hi has 9 bits: k ln2_hi is exact */
    const pr_real inv_fact[] = { 1, 1, 1.0f / 2, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040 };
    const int degree = 7, mant = 23;
    const pr__real_bits bias = 127;
#endif
    pr_real xs[PR__ATT_BQ], z[PR__ATT_BQ], r[PR__ATT_BQ], p[PR__ATT_BQ], e[PR__ATT_BQ];
    memcpy(xs, x, sizeof xs);
    for (int i = 0; i < PR__ATT_BQ; i++) {
        const pr_real c = xs[i] > lo ? (xs[i] < hi ? xs[i] : hi) : lo, kf = (z[i] = c * log2e + magic) - magic;
        r[i] = (c - kf * ln2_hi) - kf * ln2_lo;
        p[i] = inv_fact[degree];
    }
    for (int n = degree - 1; n >= 0; n--)    /* Horner */
        for (int i = 0; i < PR__ATT_BQ; i++) p[i] = p[i] * r[i] + inv_fact[n];
    for (int i = 0; i < PR__ATT_BQ; i++) {
        pr__real_bits zb;
        pr_real two_k;
        memcpy(&zb, &z[i], sizeof zb);
        zb = (zb + bias) << mant;
        memcpy(&two_k, &zb, sizeof two_k);
        e[i] = xs[i] < lo ? 0 : xs[i] <= hi ? p[i] * two_k : xs[i] > hi ? (pr_real)INFINITY : xs[i];
    }
    memcpy(y, e, sizeof e);
}

/* tile[d][i] = x_i[c0 + d], x_i = x + i ldx, for d < dc and every lane: zero in the lanes i >= nr
   (the PR__ATT_DC x PR__ATT_BQ tile's rows past dc are never read). */
static void pr__att_gather(pr_real *tile, const pr_real *x, size_t ldx, int nr, int c0, int dc) {
    for (int d = 0; d < dc; d++)
        for (int i = 0; i < PR__ATT_BQ; i++) tile[d * PR__ATT_BQ + i] = i < nr ? x[i * ldx + c0 + d] : 0;
}
/* x_i[c0 + d] = tile[d][i] for lanes i < nr and d < dc. */
static void pr__att_scatter(pr_real *x, size_t ldx, int nr, const pr_real *tile, int c0, int dc) {
    for (int i = 0; i < nr; i++)
        for (int d = 0; d < dc; d++) x[i * ldx + c0 + d] = tile[d * PR__ATT_BQ + i];
}

/* t[j][i] += sum over d < dc of xt[d][i] y_j[c0 + d], for keys j < nj (rows y[j]) and all lanes:
   the score dots of a block against one head-dim chunk of the lanes, transposed in xt, PR__ATT_T
   keys at a time so that their sums run side by side. Rows of t past nj get key nj - 1's sums (t
   holds PR__ATT_BK rows, a multiple of PR__ATT_T). */
PR__FUSED static void pr__att_dots(pr_real *t, const pr_real *xt, const pr_real *const *y, int nj, int c0, int dc) {
    for (int j = 0; j < nj; j += PR__ATT_T) {
        const pr_real *yj[PR__ATT_T];
        for (int u = 0; u < PR__ATT_T; u++) yj[u] = y[j + u < nj ? j + u : nj - 1] + c0;
        pr_real acc[PR__ATT_T][PR__ATT_BQ];
        memcpy(acc, t + (size_t)j * PR__ATT_BQ, sizeof acc);
        for (int d = 0; d < dc; d++) {
            const pr_real *xd = xt + d * PR__ATT_BQ;
            PR__UNROLL(PR__ATT_T)
            for (int u = 0; u < PR__ATT_T; u++) {
                const pr_real yu = yj[u][d];
                for (int i = 0; i < PR__ATT_BQ; i++) acc[u][i] += xd[i] * yu;
            }
        }
        memcpy(t + (size_t)j * PR__ATT_BQ, acc, sizeof acc);
    }
}

/* at[u][i] += sum over keys j < nj (in order) of w[j][i] y_j[off + u], for PR__ATT_T head-dim values
   u and all lanes: pr__att_into_lanes's sums, in registers through the keys. */
PR__FUSED static void pr__att_lanes_group(pr_real *at, const pr_real *w, const pr_real *const *y, int off, int nj) {
    pr_real acc[PR__ATT_T][PR__ATT_BQ];
    memcpy(acc, at, sizeof acc);
    for (int j = 0; j < nj; j++) {
        const pr_real *wj = w + (size_t)j * PR__ATT_BQ, *yj = y[j] + off;
        PR__UNROLL(PR__ATT_T)
        for (int u = 0; u < PR__ATT_T; u++) {
            const pr_real yu = yj[u];
            for (int i = 0; i < PR__ATT_BQ; i++) acc[u][i] += wj[i] * yu;
        }
    }
    memcpy(at, acc, sizeof acc);
}
/* at[d][i] += sum over keys j < nj (in order) of w[j][i] y_j[c0 + d], for d < dc and all lanes:
   into one head-dim chunk of the lanes' rows, transposed in at (the output P V of the forward,
   dq += dS K). PR__ATT_T head-dim values at a time; a head dim that is not a multiple of it ends
   one value at a time, by the same sums. */
PR__FUSED static void pr__att_into_lanes(pr_real *at, const pr_real *w, const pr_real *const *y, int nj, int c0, int dc) {
    int d = 0;
    for (; d + PR__ATT_T <= dc; d += PR__ATT_T) pr__att_lanes_group(at + (size_t)d * PR__ATT_BQ, w, y, c0 + d, nj);
    for (; d < dc; d++)
        for (int j = 0; j < nj; j++)
            for (int i = 0; i < PR__ATT_BQ; i++) at[d * PR__ATT_BQ + i] += w[j * PR__ATT_BQ + i] * y[j][c0 + d];
}

/* rows[u][e] += sum over lanes i < nr (in order) of w[u][i] xs[i][e], for PR__ATT_T rows of
   PR__ATT_BQ values: pr__att_into_keys's sums, in registers through the lanes. */
PR__FUSED static void pr__att_keys_group(pr_real *rows, const pr_real *w, const pr_real *xs, int nr) {
    pr_real acc[PR__ATT_T][PR__ATT_BQ];
    memcpy(acc, rows, sizeof acc);
    for (int i = 0; i < nr; i++) {
        const pr_real *xi = xs + i * PR__ATT_BQ;
        PR__UNROLL(PR__ATT_T)
        for (int u = 0; u < PR__ATT_T; u++) {
            const pr_real wu = w[u * PR__ATT_BQ + i];
            for (int e = 0; e < PR__ATT_BQ; e++) acc[u][e] += wu * xi[e];
        }
    }
    memcpy(rows, acc, sizeof acc);
}
/* dst[e] = src[e] for e < n, zero up to PR__ATT_BQ (n at most that): a whole row by a copy of fixed
   size, which compiles to vector moves (a copy of n elements may become a slow string move). */
static void pr__att_copy_row(pr_real *dst, const pr_real *src, int n) {
    if (n == PR__ATT_BQ) memcpy(dst, src, sizeof(pr_real) * PR__ATT_BQ);
    else
        for (int e = 0; e < PR__ATT_BQ; e++) dst[e] = e < n ? src[e] : 0;
}
/* Key row z_j (j < nj) gets, for each d, sum over lanes i < nr (in order) of w[j][i] x_i[d], with
   x_i = x + i ldx: dv += P^T dO and dk += dS^T Q. PR__ATT_BQ head-dim values at a time, the lanes'
   values copied into xs (zero past the head dim), then PR__ATT_T keys at a time through rows (a
   short last group repeats key j's row, its sums dropped). w's rows past nj are read, never used. */
static void pr__att_into_keys(pr_real *const *z, int nj, const pr_real *w, const pr_real *x, size_t ldx, int nr, int HS) {
    pr_real xs[PR__ATT_BQ][PR__ATT_BQ], rows[PR__ATT_T][PR__ATT_BQ];
    for (int d0 = 0; d0 < HS; d0 += PR__ATT_BQ) {
        const int nd = HS - d0 < PR__ATT_BQ ? HS - d0 : PR__ATT_BQ;
        for (int i = 0; i < nr; i++) pr__att_copy_row(xs[i], x + i * ldx + d0, nd);
        for (int j = 0; j < nj; j += PR__ATT_T) {
            const int nu = nj - j < PR__ATT_T ? nj - j : PR__ATT_T;
            for (int u = 0; u < PR__ATT_T; u++) pr__att_copy_row(rows[u], z[u < nu ? j + u : j] + d0, nd);
            pr__att_keys_group(rows[0], w + (size_t)j * PR__ATT_BQ, xs[0], nr);
            for (int u = 0; u < nu; u++) {   /* a whole row by a fixed-size copy, as pr__att_copy_row */
                if (nd == PR__ATT_BQ) memcpy(z[j + u] + d0, rows[u], sizeof rows[u]);
                else memcpy(z[j + u] + d0, rows[u], sizeof(pr_real) * nd);
            }
        }
    }
}

/* t[j][i] = x_i.y_j for keys j < nj and all lanes: pr__att_dots over the head-dim chunks, xt
   built per chunk here, or (resident: the head dim is one chunk) by the caller once for every key
   block of the lanes. */
static void pr__att_products(pr_real *t, pr_real *xt, int resident, const pr_real *x, size_t ldx, int nr,
                             const pr_real *const *y, int nj, int HS) {
    memset(t, 0, sizeof(pr_real) * PR__ATT_BK * PR__ATT_BQ);
    for (int c0 = 0; c0 < HS; c0 += PR__ATT_DC) {
        const int dc = HS - c0 < PR__ATT_DC ? HS - c0 : PR__ATT_DC;
        if (!resident) pr__att_gather(xt, x, ldx, nr, c0, dc);
        pr__att_dots(t, xt, y, nj, c0, dc);
    }
}

/* The lanes' rows x_i += sum over keys j of w[j][i] y_j, after x_i *= rescale[i] (rescale NULL:
   none): pr__att_into_lanes over the head-dim chunks, through at, which holds them transposed:
   gathered and scattered back per chunk here, or (resident) by the caller around all key blocks. */
static void pr__att_lanes_update(pr_real *at, int resident, pr_real *x, size_t ldx, int nr, const pr_real *rescale,
                                 const pr_real *w, const pr_real *const *y, int nj, int HS) {
    for (int c0 = 0; c0 < HS; c0 += PR__ATT_DC) {
        const int dc = HS - c0 < PR__ATT_DC ? HS - c0 : PR__ATT_DC;
        if (!resident) pr__att_gather(at, x, ldx, nr, c0, dc);
        if (rescale)
            for (int d = 0; d < dc; d++)
                for (int i = 0; i < PR__ATT_BQ; i++) at[d * PR__ATT_BQ + i] *= rescale[i];
        pr__att_into_lanes(at, w, y, nj, c0, dc);
        if (!resident) pr__att_scatter(x, ldx, nr, at, c0, dc);
    }
}

/* The block's scores against keys j0 .. j0 + nj - 1 (rows krow): t[j][i] = scale q_i.k_j, and -inf
   where the key lies past lane i's last key, last0 + i. */
static void pr__att_scores(pr_real *t, pr_real *qt, int resident, const pr_real *q, size_t ldq, int nr,
                           const pr_real *const *krow, int j0, int nj, int last0, pr_real scale, int HS) {
    pr__att_products(t, qt, resident, q, ldq, nr, krow, nj, HS);
    for (int j = 0; j < nj; j++)
        for (int i = 0; i < PR__ATT_BQ; i++) {
            pr_real *s = t + (size_t)j * PR__ATT_BQ + i;
            *s = j0 + j > last0 + i ? (pr_real)-INFINITY : *s * scale;
        }
}

/* Attention forward: o = softmax(scale q k^T) v over the keys each query row sees, an online
   softmax over key blocks (a lane's running maximum m and sum l; its output rescaled when m grows),
   no score matrix beyond one block's. Query head h reads key/value head h / (NH/NKV) (GQA). lse
   keeps each row's log-sum-exp so that the backward can rebuild every probability. Parallel over
   (segment, head): no two tasks write the same output. */
static void pr__cpu_attention_fwd(const pr_backend *be, void *out_, void *lse_, const void *q_, const void *k_, const void *v_,
                                  const void *kp_, const void *vp_, const pr_seq_layout *lay, int NH, int NKV, int HS) {
    (void)be;
    pr_real *out = PR__R(out_), *lse = PR__R(lse_);
    const pr_real *q = PR__CR(q_), *k = PR__CR(k_), *v = PR__CR(v_), *kp = PR__CR(kp_), *vp = PR__CR(vp_);
    const int np = lay->n_prefix, qd = NH * HS, kvd = NKV * HS, group = NH / NKV;
    const pr_real scale = (pr_real)(1.0 / sqrt((double)HS));
    const int tasks = lay->n_seg * NH;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1)
#endif
    for (int task = 0; task < tasks; task++) {
        const int s = task / NH, h = task % NH, hk = (h / group) * HS;
        const int seg0 = lay->seg_off[s], seg1 = lay->seg_off[s + 1];
        pr_real qt[PR__ATT_DC * PR__ATT_BQ], ot[PR__ATT_DC * PR__ATT_BQ], t[PR__ATT_BK * PR__ATT_BQ];
        pr_real m[PR__ATT_BQ], l[PR__ATT_BQ], mnew[PR__ATT_BQ], c[PR__ATT_BQ], x[PR__ATT_BQ];
        const pr_real *krow[PR__ATT_BK], *vrow[PR__ATT_BK];
        const int resident = HS <= PR__ATT_DC;
        for (int r0 = seg0; r0 < seg1; r0 += PR__ATT_BQ) {
            const int nr = seg1 - r0 < PR__ATT_BQ ? seg1 - r0 : PR__ATT_BQ;
            const int last0 = np + r0 - seg0, nk = last0 + nr;   /* lane i's last key is last0 + i */
            const pr_real *q0 = q + (size_t)r0 * qd + (size_t)h * HS;
            pr_real *o0 = out + (size_t)r0 * qd + (size_t)h * HS;
            for (int i = 0; i < PR__ATT_BQ; i++) m[i] = (pr_real)-INFINITY, l[i] = 0;
            if (resident) {
                pr__att_gather(qt, q0, qd, nr, 0, HS);
                memset(ot, 0, sizeof(pr_real) * HS * PR__ATT_BQ);
            } else
                for (int i = 0; i < nr; i++) memset(o0 + (size_t)i * qd, 0, sizeof(pr_real) * HS);
            for (int j0 = 0; j0 < nk; j0 += PR__ATT_BK) {
                const int nj = nk - j0 < PR__ATT_BK ? nk - j0 : PR__ATT_BK;
                for (int j = 0; j < nj; j++) {
                    krow[j] = PR__KEY(kp, k, j0 + j, np, seg0, kvd, hk);
                    vrow[j] = PR__KEY(vp, v, j0 + j, np, seg0, kvd, hk);
                }
                pr__att_scores(t, qt, resident, q0, qd, nr, krow, j0, nj, last0, scale, HS);
                memcpy(mnew, m, sizeof mnew);
                for (int j = 0; j < nj; j++)
                    for (int i = 0; i < PR__ATT_BQ; i++) mnew[i] = t[j * PR__ATT_BQ + i] > mnew[i] ? t[j * PR__ATT_BQ + i] : mnew[i];
                for (int i = 0; i < PR__ATT_BQ; i++) x[i] = m[i] - mnew[i];
                pr__exp_lanes(c, x);             /* the old sum's and output's rescaling; 0 at the first block */
                for (int i = 0; i < PR__ATT_BQ; i++) l[i] *= c[i];
                for (int j = 0; j < nj; j++) {   /* t becomes the block's probabilities under mnew */
                    pr_real *tj = t + (size_t)j * PR__ATT_BQ;
                    for (int i = 0; i < PR__ATT_BQ; i++) x[i] = tj[i] - mnew[i];
                    pr__exp_lanes(tj, x);
                    for (int i = 0; i < PR__ATT_BQ; i++) l[i] += tj[i];
                }
                pr__att_lanes_update(ot, resident, o0, qd, nr, c, t, vrow, nj, HS);
                memcpy(m, mnew, sizeof m);
            }
            if (resident) pr__att_scatter(o0, qd, nr, ot, 0, HS);
            for (int i = 0; i < nr; i++)
                for (int d = 0; d < HS; d++) o0[(size_t)i * qd + d] /= l[i];
            for (int i = 0; i < nr; i++) lse[(size_t)(r0 + i) * NH + h] = m[i] + (pr_real)log(l[i]);
        }
    }
}

/* Attention backward (quoting the forward: o = sum_j p_j v_j, p_j = exp(s_j - lse), s_j = q.k_j * scale):
     dv_j += p_j do;   dp_j = do.v_j;   ds_j = p_j (dp_j - D) with D = do.o;
     dq += scale ds_j k_j;   dk_j += scale ds_j q.
   Keys in the prefix region send dk/dv to dkp/dvp: summed over every query row of every segment,
   this is the prefix-side gradient the reuse schedule accumulates into gK/gV. Parallel over KV
   heads only, so that each dk/dv/dkp/dvp row has one writer and a fixed summation order: for a
   key row, segments, then the query heads of its group, then query rows, each ascending. */
static void pr__cpu_attention_bwd(const pr_backend *be, void *dq_, void *dk_, void *dv_, pr_real *dkp, pr_real *dvp,
                                  const void *dout_, const void *out_, const void *lse_, const void *q_, const void *k_,
                                  const void *v_, const void *kp_, const void *vp_, const pr_seq_layout *lay,
                                  int NH, int NKV, int HS) {
    (void)be;
    pr_real *dq = PR__R(dq_), *dk = PR__R(dk_), *dv = PR__R(dv_);
    const pr_real *dout = PR__CR(dout_), *out = PR__CR(out_), *lse = PR__CR(lse_);
    const pr_real *q = PR__CR(q_), *k = PR__CR(k_), *v = PR__CR(v_), *kp = PR__CR(kp_), *vp = PR__CR(vp_);
    const int np = lay->n_prefix, qd = NH * HS, kvd = NKV * HS, group = NH / NKV;
    const pr_real scale = (pr_real)(1.0 / sqrt((double)HS));
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1)
#endif
    for (int kh = 0; kh < NKV; kh++) {
        const int hk = kh * HS, resident = HS <= PR__ATT_DC;
        pr_real qt[PR__ATT_DC * PR__ATT_BQ], dot[PR__ATT_DC * PR__ATT_BQ], dqt[PR__ATT_DC * PR__ATT_BQ];
        pr_real p[PR__ATT_BK * PR__ATT_BQ], ds[PR__ATT_BK * PR__ATT_BQ], L[PR__ATT_BQ], D[PR__ATT_BQ], x[PR__ATT_BQ];
        const pr_real *krow[PR__ATT_BK], *vrow[PR__ATT_BK];
        pr_real *dkrow[PR__ATT_BK], *dvrow[PR__ATT_BK];
        for (int s = 0; s < lay->n_seg; s++) {
            const int seg0 = lay->seg_off[s], seg1 = lay->seg_off[s + 1];
            for (int h = kh * group; h < (kh + 1) * group; h++)
                for (int r0 = seg0; r0 < seg1; r0 += PR__ATT_BQ) {
                    const int nr = seg1 - r0 < PR__ATT_BQ ? seg1 - r0 : PR__ATT_BQ;
                    const int last0 = np + r0 - seg0, nk = last0 + nr;
                    const size_t qo = (size_t)r0 * qd + (size_t)h * HS;
                    for (int i = 0; i < PR__ATT_BQ; i++) {
                        L[i] = i < nr ? lse[(size_t)(r0 + i) * NH + h] : 0;
                        D[i] = i < nr ? pr__dot(dout + qo + (size_t)i * qd, out + qo + (size_t)i * qd, HS) : 0;
                    }
                    if (resident) {
                        pr__att_gather(qt, q + qo, qd, nr, 0, HS);
                        pr__att_gather(dot, dout + qo, qd, nr, 0, HS);
                        pr__att_gather(dqt, dq + qo, qd, nr, 0, HS);
                    }
                    for (int j0 = 0; j0 < nk; j0 += PR__ATT_BK) {
                        const int nj = nk - j0 < PR__ATT_BK ? nk - j0 : PR__ATT_BK;
                        for (int j = 0; j < nj; j++) {
                            krow[j] = PR__KEY(kp, k, j0 + j, np, seg0, kvd, hk);
                            vrow[j] = PR__KEY(vp, v, j0 + j, np, seg0, kvd, hk);
                            dkrow[j] = PR__KEY(dkp, dk, j0 + j, np, seg0, kvd, hk);
                            dvrow[j] = PR__KEY(dvp, dv, j0 + j, np, seg0, kvd, hk);
                        }
                        pr__att_scores(p, qt, resident, q + qo, qd, nr, krow, j0, nj, last0, scale, HS);
                        pr__att_products(ds, dot, resident, dout + qo, qd, nr, vrow, nj, HS);   /* dp = do.v */
                        for (int j = 0; j < nj; j++) {   /* p, and ds from dp */
                            pr_real *pj = p + (size_t)j * PR__ATT_BQ, *dsj = ds + (size_t)j * PR__ATT_BQ;
                            for (int i = 0; i < PR__ATT_BQ; i++) x[i] = pj[i] - L[i];
                            pr__exp_lanes(pj, x);
                            for (int i = 0; i < PR__ATT_BQ; i++) dsj[i] = pj[i] * (dsj[i] - D[i]) * scale;
                        }
                        pr__att_into_keys(dvrow, nj, p, dout + qo, qd, nr, HS);
                        pr__att_into_keys(dkrow, nj, ds, q + qo, qd, nr, HS);
                        pr__att_lanes_update(dqt, resident, dq + qo, qd, nr, NULL, ds, krow, nj, HS);
                    }
                    if (resident) pr__att_scatter(dq + qo, qd, nr, dqt, 0, HS);
                }
        }
    }
}

/* h = silu(g) * u,  silu(g) = g * sigmoid(g); a row's g and u are its two halves of gu */
static void pr__cpu_swiglu_fwd(const pr_backend *be, void *h_, const void *gu_, int rows, int F) {
    (void)be;
    pr_real *h = PR__R(h_);
    const pr_real *gu = PR__CR(gu_);
    for (size_t r = 0; r < (size_t)rows; r++)
        for (size_t j = 0; j < (size_t)F; j++) {
            const pr_real g = gu[2 * F * r + j], u = gu[2 * F * r + F + j];
            double sg = 1.0 / (1.0 + PR__EXP(-g));
            h[F * r + j] = (pr_real)(g * sg * u);
        }
}
/* dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  du = dh * silu(g) */
static void pr__cpu_swiglu_bwd(const pr_backend *be, void *dgu_, const void *dh_, const void *gu_, int rows, int F) {
    (void)be;
    pr_real *dgu = PR__R(dgu_);
    const pr_real *dh = PR__CR(dh_), *gu = PR__CR(gu_);
    for (size_t r = 0; r < (size_t)rows; r++)
        for (size_t j = 0; j < (size_t)F; j++) {
            const size_t gi = 2 * F * r + j, ui = gi + F;
            const pr_real g = gu[gi], u = gu[ui], d = dh[F * r + j];
            double sg = 1.0 / (1.0 + PR__EXP(-g));
            dgu[gi] = (pr_real)(d * u * sg * (1.0 + g * (1.0 - sg)));
            dgu[ui] = (pr_real)(d * g * sg);
        }
}

static void pr__cpu_embed_fwd(const pr_backend *be, void *out, const int32_t *tokens, const void *emb, int N, int C) {
    (void)be;
    for (int n = 0; n < N; n++) {
        pr_real *o = PR__R(out) + (size_t)n * C;
        if (tokens[n] >= 0) memcpy(o, PR__CR(emb) + (size_t)tokens[n] * C, sizeof(pr_real) * C);
        else memset(o, 0, sizeof(pr_real) * C);
    }
}
static void pr__cpu_embed_bwd(const pr_backend *be, pr_real *demb, const void *dout, const int32_t *tokens, int N, int C) {
    (void)be;
    for (int n = 0; n < N; n++)
        if (tokens[n] >= 0) pr__axpy(demb + (size_t)tokens[n] * C, 1, PR__CR(dout) + (size_t)n * C, C);
}

static void pr__cpu_add(const pr_backend *be, void *y, const void *x, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) PR__R(y)[i] += PR__CR(x)[i];
}
static void pr__cpu_add_reals(const pr_backend *be, pr_real *y, const pr_real *x, size_t n) { pr__cpu_add(be, y, x, n); }
/* Activations are reals here: a copy either way. */
static void pr__cpu_acts_to_reals(const pr_backend *be, pr_real *dst, const void *src, size_t n) {
    (void)be;
    memcpy(dst, src, n * sizeof(pr_real));
}
static void pr__cpu_reals_to_acts(const pr_backend *be, void *dst, const pr_real *src, size_t n) {
    (void)be;
    memcpy(dst, src, n * sizeof(pr_real));
}
static uint32_t pr__real_to_f32bits_odd(pr_real x);
static uint16_t pr__f32bits_to_bf16(uint32_t u);
static void pr__cpu_reals_to_bf16(const pr_backend *be, uint16_t *dst, const pr_real *src, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) dst[i] = pr__f32bits_to_bf16(pr__real_to_f32bits_odd(src[i]));
}
static void pr__cpu_bf16_to_reals(const pr_backend *be, pr_real *dst, const uint16_t *src, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) dst[i] = (pr_real)pr_bf16_to_f32(src[i]);
}
static void pr__cpu_gather_rows(const pr_backend *be, void *dst, const void *src, const int *rows, const pr_real *w, int M, int C) {
    (void)be;
    for (int m = 0; m < M; m++) {
        pr_real *d = PR__R(dst) + (size_t)m * C;
        const pr_real *x = PR__CR(src) + (size_t)rows[m] * C;
        if (w) for (int i = 0; i < C; i++) d[i] = w[m] * x[i];
        else memcpy(d, x, sizeof(pr_real) * C);
    }
}
static void pr__cpu_scatter_add_rows(const pr_backend *be, void *dst, const void *src, const int *rows, const pr_real *w, int M, int C) {
    (void)be;
    for (int m = 0; m < M; m++)
        if (rows[m] >= 0) pr__axpy(PR__R(dst) + (size_t)rows[m] * C, w ? w[m] : 1, PR__CR(src) + (size_t)m * C, C);
}

static void pr__cpu_upload_acts(const pr_backend *be, void *dst, const pr_real *host, size_t n) { (void)be; memcpy(dst, host, n * sizeof(pr_real)); }
static void pr__cpu_download_acts(const pr_backend *be, pr_real *host, const void *src, size_t n) { (void)be; memcpy(host, src, n * sizeof(pr_real)); }
static void pr__cpu_row_dots(const pr_backend *be, pr_real *out, const void *a, const void *b, int M, int C) {
    (void)be;
    for (int m = 0; m < M; m++) out[m] = pr__dot(PR__CR(a) + (size_t)m * C, PR__CR(b) + (size_t)m * C, C);
}

/* The GRPO token loss and its derivative in logp.
   r = exp(logp - old);  pg = -min(r A, clip(r, 1-eps_low, 1+eps_high) A)
   kl = exp(ref - logp) - (ref - logp) - 1   (k3 estimator, >= 0)
   The min picks the clipped term only when it is smaller; there its slope in logp is 0. */
/* -min(r A, clip(r) A) and whether the clipped term is the one taken (then its slope in logp is 0:
   the token counts in the clip fraction). */
static double pr__ppo_surrogate(double logp, double old, double adv, const pr_loss_opts *o, int *clipped) {
    double r = exp(logp - old);
    double rc = r < 1 - o->eps_low ? 1 - o->eps_low : (r > 1 + o->eps_high ? 1 + o->eps_high : r);
    double unclipped = r * adv, clip = rc * adv;
    *clipped = unclipped > clip;
    return *clipped ? -clip : -unclipped;
}

PRDEF double pr_grpo_token_loss(double logp, double old, const pr_real *ref, double adv, const pr_loss_opts *o,
                                double *dloss_dlogp) {
    pr_step_opts def;
    if (!o) {
        def = pr_step_opts_default();
        o = &def.loss;
    }
    int clipped;
    double loss = pr__ppo_surrogate(logp, old, adv, o, &clipped), d = clipped ? 0 : loss;
    if (ref && o->kl_coef != 0) {
        double delta = (double)*ref - logp, e = exp(delta);
        loss += o->kl_coef * (e - delta - 1);
        d += o->kl_coef * (1 - e);
    }
    if (dloss_dlogp) *dloss_dlogp = d;
    return loss;
}

static void pr__cpu_logit_stats(const pr_backend *be, double *stats, const void *logits, const int32_t *target, int M, int V) {
    (void)be;
    for (int m = 0; m < M; m++) {
        const pr_real *z = PR__CR(logits) + (size_t)m * V;
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < V; i++) if (z[i] > mx) mx = z[i];
        for (int i = 0; i < V; i++) sum += PR__EXP((pr_real)(z[i] - mx));
        stats[3 * m] = mx;
        stats[3 * m + 1] = sum;
        stats[3 * m + 2] = target[m] >= 0 ? z[target[m]] : 0;
    }
}
static void pr__cpu_logit_grad(const pr_backend *be, void *logits, const double *lse, const double *coef, const int32_t *target,
                               int M, int V) {
    (void)be;
    for (int m = 0; m < M; m++) {
        pr_real *z = PR__R(logits) + (size_t)m * V;
        for (int i = 0; i < V; i++) z[i] = (pr_real)(-coef[m] * PR__EXP((pr_real)(z[i] - lse[m])));
        if (target[m] >= 0) z[target[m]] += (pr_real)coef[m];
    }
}

static double pr__cpu_sum_squares(const pr_backend *be, const pr_real *x, size_t n) {
    (void)be;
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return s;
}
static void pr__cpu_scale(const pr_backend *be, pr_real *x, size_t n, double s) {
    (void)be;
    for (size_t i = 0; i < n; i++) x[i] = (pr_real)(x[i] * s);
}
/* AdamW (decoupled weight decay, bias-corrected moments), one tensor */
static void pr__cpu_adamw(const pr_backend *be, pr_real *p, const pr_real *g, pr_real *m, pr_real *v, size_t n,
                          double lr, double b1, double b2, double eps, double wd, long step) {
    (void)be;
    double c1 = 1 - pow(b1, (double)step), c2 = 1 - pow(b2, (double)step);
    for (size_t i = 0; i < n; i++) {
        m[i] = (pr_real)(b1 * m[i] + (1 - b1) * g[i]);
        v[i] = (pr_real)(b2 * v[i] + (1 - b2) * (double)g[i] * g[i]);
        double mh = m[i] / c1, vh = v[i] / c2;
        p[i] = (pr_real)(p[i] - lr * (mh / (sqrt(vh) + eps) + wd * p[i]));
    }
}

#define PR__MEASURE_ADDRESS 4096   /* the measuring backend's placeholder: aligned, never dereferenced */

/* Every field in declaration order, so that C++ (20, and 17 as the compilers' extension) takes
   the designators too; the optional slots the CPU does without are NULL. */
static const pr_backend pr__cpu_backend = {
    .name = "cpu", .act_bytes = sizeof(pr_real), .stat_bytes = sizeof(pr_real), .logit_chunk = (size_t)4 << 20,
    .ctx = NULL, .check_config = NULL, .take_error = NULL, .device_free = NULL,
    .copy_async = NULL, .copy_wait = NULL, .copy_seconds = NULL,
    .alloc = pr__cpu_alloc, .release = pr__cpu_release, .zero = pr__cpu_zero, .copy = pr__cpu_copy,
    .upload_reals = pr__cpu_upload, .download_reals = pr__cpu_download, .sync = pr__cpu_sync,
    .matmul_fwd = pr__cpu_matmul_fwd, .matmul_bwd = pr__cpu_matmul_bwd,
    .rmsnorm_fwd = pr__cpu_rmsnorm_fwd, .rmsnorm_bwd = pr__cpu_rmsnorm_bwd,
    .rope_fwd = pr__cpu_rope_fwd, .rope_bwd = pr__cpu_rope_bwd,
    .attention_fwd = pr__cpu_attention_fwd, .attention_bwd = pr__cpu_attention_bwd,
    .swiglu_fwd = pr__cpu_swiglu_fwd, .swiglu_bwd = pr__cpu_swiglu_bwd,
    .embed_fwd = pr__cpu_embed_fwd, .embed_bwd = pr__cpu_embed_bwd,
    .add = pr__cpu_add, .acts_to_reals = pr__cpu_acts_to_reals, .reals_to_acts = pr__cpu_reals_to_acts,
    .add_reals = pr__cpu_add_reals, .reals_to_bf16 = pr__cpu_reals_to_bf16,
    .bf16_to_reals = pr__cpu_bf16_to_reals, .gather_rows = pr__cpu_gather_rows, .scatter_add_rows = pr__cpu_scatter_add_rows,
    .logit_stats = pr__cpu_logit_stats, .logit_grad = pr__cpu_logit_grad,
    .upload_acts = pr__cpu_upload_acts, .download_acts = pr__cpu_download_acts,
    .row_dots = pr__cpu_row_dots,
    .sum_squares = pr__cpu_sum_squares, .scale = pr__cpu_scale, .adamw = pr__cpu_adamw,
};

PRDEF const pr_backend *pr_backend_cpu(void) { return &pr__cpu_backend; }

/* ---------------------------------------------------------------- 2.2 The measuring backend: no memory, no arithmetic */
static void *pr__measure_alloc(const pr_backend *be, size_t bytes, pr_tier tier) {
    (void)be; (void)bytes; (void)tier;
    return (void *)(uintptr_t)PR__MEASURE_ADDRESS;
}
static void pr__measure_release(const pr_backend *be, void *p, pr_tier tier) { (void)be; (void)p; (void)tier; }
static void pr__measure_bytes(const pr_backend *be, void *p, size_t bytes) { (void)be; (void)p; (void)bytes; }
static void pr__measure_copy(const pr_backend *be, void *dst, const void *src, size_t bytes) { (void)be; (void)dst; (void)src; (void)bytes; }
static void pr__measure_reals(const pr_backend *be, pr_real *dst, const pr_real *src, size_t n) { (void)be; (void)dst; (void)src; (void)n; }
static void pr__measure_download(const pr_backend *be, pr_real *host, const pr_real *src, size_t n) {
    (void)be; (void)src;
    memset(host, 0, n * sizeof(pr_real));
}
static void pr__measure_sync(const pr_backend *be) { (void)be; }
static void pr__measure_matmul_fwd(const pr_backend *be, void *o, const void *i, const void *w, int N, int C, int OC) {
    (void)be; (void)o; (void)i; (void)w; (void)N; (void)C; (void)OC;
}
static void pr__measure_matmul_bwd(const pr_backend *be, void *di, pr_real *dw, const void *d, const void *i, const void *w,
                                   int N, int C, int OC) {
    (void)be; (void)di; (void)dw; (void)d; (void)i; (void)w; (void)N; (void)C; (void)OC;
}
static void pr__measure_rmsnorm_fwd(const pr_backend *be, void *o, void *r, const void *i, const void *w, int N, int C, double e) {
    (void)be; (void)o; (void)r; (void)i; (void)w; (void)N; (void)C; (void)e;
}
static void pr__measure_rmsnorm_bwd(const pr_backend *be, void *di, pr_real *dw, const void *d, const void *i, const void *w,
                                    const void *r, int N, int C) {
    (void)be; (void)di; (void)dw; (void)d; (void)i; (void)w; (void)r; (void)N; (void)C;
}
static void pr__measure_rope(const pr_backend *be, void *x, const pr_seq_layout *l, int h, int HS, const pr_real *f) {
    (void)be; (void)x; (void)l; (void)h; (void)HS; (void)f;
}
static void pr__measure_attention_fwd(const pr_backend *be, void *o, void *lse, const void *q, const void *k, const void *v,
                                      const void *kp, const void *vp, const pr_seq_layout *l, int NH, int NKV, int HS) {
    (void)be; (void)o; (void)lse; (void)q; (void)k; (void)v; (void)kp; (void)vp; (void)l; (void)NH; (void)NKV; (void)HS;
}
static void pr__measure_attention_bwd(const pr_backend *be, void *dq, void *dk, void *dv, pr_real *dkp, pr_real *dvp, const void *d,
                                      const void *o, const void *lse, const void *q, const void *k, const void *v,
                                      const void *kp, const void *vp, const pr_seq_layout *l, int NH, int NKV, int HS) {
    (void)be; (void)dq; (void)dk; (void)dv; (void)dkp; (void)dvp; (void)d; (void)o; (void)lse; (void)q; (void)k; (void)v;
    (void)kp; (void)vp; (void)l; (void)NH; (void)NKV; (void)HS;
}
static void pr__measure_swiglu_fwd(const pr_backend *be, void *h, const void *gu, int rows, int F) {
    (void)be; (void)h; (void)gu; (void)rows; (void)F;
}
static void pr__measure_swiglu_bwd(const pr_backend *be, void *dgu, const void *dh, const void *gu, int rows, int F) {
    (void)be; (void)dgu; (void)dh; (void)gu; (void)rows; (void)F;
}
static void pr__measure_embed_fwd(const pr_backend *be, void *o, const int32_t *t, const void *e, int N, int C) {
    (void)be; (void)o; (void)t; (void)e; (void)N; (void)C;
}
static void pr__measure_embed_bwd(const pr_backend *be, pr_real *de, const void *d, const int32_t *t, int N, int C) {
    (void)be; (void)de; (void)d; (void)t; (void)N; (void)C;
}
static void pr__measure_add(const pr_backend *be, void *y, const void *x, size_t n) { (void)be; (void)y; (void)x; (void)n; }
static void pr__measure_add_reals(const pr_backend *be, pr_real *y, const pr_real *x, size_t n) { (void)be; (void)y; (void)x; (void)n; }
static void pr__measure_acts_to_reals(const pr_backend *be, pr_real *dst, const void *src, size_t n) {
    (void)be; (void)dst; (void)src; (void)n;
}
static void pr__measure_to_bf16(const pr_backend *be, uint16_t *dst, const pr_real *src, size_t n) {
    (void)be; (void)dst; (void)src; (void)n;
}
static void pr__measure_from_bf16(const pr_backend *be, pr_real *dst, const uint16_t *src, size_t n) {
    (void)be; (void)dst; (void)src; (void)n;
}
static void pr__measure_rows(const pr_backend *be, void *dst, const void *src, const int *rows, const pr_real *w, int M, int C) {
    (void)be; (void)dst; (void)src; (void)rows; (void)w; (void)M; (void)C;
}
/* every row's logits 0 with its target among them: log-probs of -log V come back */
static void pr__measure_logit_stats(const pr_backend *be, double *stats, const void *z, const int32_t *t, int M, int V) {
    (void)be; (void)z; (void)t;
    for (int m = 0; m < M; m++) { stats[3 * m] = 0; stats[3 * m + 1] = V; stats[3 * m + 2] = 0; }
}
static void pr__measure_logit_grad(const pr_backend *be, void *z, const double *lse, const double *c, const int32_t *t,
                                   int M, int V) {
    (void)be; (void)z; (void)lse; (void)c; (void)t; (void)M; (void)V;
}
static void pr__measure_upload_acts(const pr_backend *be, void *dst, const pr_real *host, size_t n) { (void)be; (void)dst; (void)host; (void)n; }
/* Activations read back to the host are a fixed pseudo-random pattern in [-1, 1): what the host
   decides from them (MoE routing) then spreads tokens over the experts evenly, as a trained
   router's load-balancing loss keeps them on average. Zeros would send every token to the same k
   experts, and under EP all of them to one rank. */
static void pr__measure_download_acts(const pr_backend *be, pr_real *host, const void *src, size_t n) {
    (void)be; (void)src;
    uint64_t x = 0x9e3779b97f4a7c15u;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        host[i] = (pr_real)((double)(x >> 11) * 0x1p-52 - 1);
    }
}
static void pr__measure_row_dots(const pr_backend *be, pr_real *out, const void *a, const void *b, int M, int C) {
    (void)be; (void)a; (void)b; (void)C;
    memset(out, 0, sizeof(pr_real) * (size_t)M);
}
static double pr__measure_sum_squares(const pr_backend *be, const pr_real *x, size_t n) { (void)be; (void)x; (void)n; return 0; }
static void pr__measure_scale(const pr_backend *be, pr_real *x, size_t n, double s) { (void)be; (void)x; (void)n; (void)s; }
static void pr__measure_adamw(const pr_backend *be, pr_real *p, const pr_real *g, pr_real *m, pr_real *v, size_t n, double lr,
                              double b1, double b2, double eps, double wd, long step) {
    (void)be; (void)p; (void)g; (void)m; (void)v; (void)n; (void)lr; (void)b1; (void)b2; (void)eps; (void)wd; (void)step;
}

PRDEF const pr_backend *pr_backend_cuda_sizes(pr_backend *be) {
    if (!be) return NULL;
    memset(be, 0, sizeof *be);
    be->name = "cuda (sizes)";
    be->act_bytes = 2;
    be->stat_bytes = 4;
    be->logit_chunk = PR_CUDA_LOGIT_CHUNK;
    return be;
}

PRDEF const pr_backend *pr_backend_measure(const pr_backend *like, pr_backend *be) {
    if (!like || !be) return NULL;
    memset(be, 0, sizeof *be);
    be->name = "measure";
    be->act_bytes = like->act_bytes;
    be->stat_bytes = like->stat_bytes;
    be->logit_chunk = like->logit_chunk;
    be->check_config = like->check_config;
    be->alloc = pr__measure_alloc; be->release = pr__measure_release; be->zero = pr__measure_bytes;
    be->copy = pr__measure_copy; be->upload_reals = pr__measure_reals; be->download_reals = pr__measure_download;
    be->sync = pr__measure_sync;
    be->matmul_fwd = pr__measure_matmul_fwd; be->matmul_bwd = pr__measure_matmul_bwd;
    be->rmsnorm_fwd = pr__measure_rmsnorm_fwd; be->rmsnorm_bwd = pr__measure_rmsnorm_bwd;
    be->rope_fwd = pr__measure_rope; be->rope_bwd = pr__measure_rope;
    be->attention_fwd = pr__measure_attention_fwd; be->attention_bwd = pr__measure_attention_bwd;
    be->swiglu_fwd = pr__measure_swiglu_fwd; be->swiglu_bwd = pr__measure_swiglu_bwd;
    be->embed_fwd = pr__measure_embed_fwd; be->embed_bwd = pr__measure_embed_bwd;
    be->add = pr__measure_add; be->add_reals = pr__measure_add_reals;
    be->acts_to_reals = pr__measure_acts_to_reals; be->reals_to_acts = pr__measure_upload_acts;
    be->reals_to_bf16 = pr__measure_to_bf16; be->bf16_to_reals = pr__measure_from_bf16;
    be->gather_rows = pr__measure_rows; be->scatter_add_rows = pr__measure_rows;
    be->logit_stats = pr__measure_logit_stats; be->logit_grad = pr__measure_logit_grad;
    be->sum_squares = pr__measure_sum_squares; be->scale = pr__measure_scale;
    be->adamw = pr__measure_adamw;
    be->upload_acts = pr__measure_upload_acts; be->download_acts = pr__measure_download_acts;
    be->row_dots = pr__measure_row_dots;
    return be;
}


/* ================================================================ 3. THE MODEL */
/* ---------------------------------------------------------------- 3.1 The data: the trainer, a pass, a batch, a step's state */
/* Offsets (in reals) of one layer's tensors in the parameter arena; the gradient, AdamW-moment
   arenas use the same offsets. qn/kn exist only with per-head q/k norms (Qwen3). wgu: the gate
   projection (F,C) and right after it the up projection (F,C), which the MLP multiplies by as one
   (2F,C) matrix: one GEMM, not two. */
/* MoE layers have no wgu/wd but a router (E,C) and E experts, expert e's gate (Fm,C), up (Fm,C)
   and down (C,Fm) stored one after the other from `experts` on (its gate and up as one matrix too). */
typedef struct { size_t ln1, wq, wk, wv, qn, kn, wo, ln2, wgu, wd, router, experts; } pr__layer_off;
typedef struct { pr_real *ln1, *wq, *wk, *wv, *qn, *kn, *wo, *ln2, *wgu, *wd, *router, *experts; } pr__layer_g;
/* The same tensors in the weights the kernels read (pr_trainer.weights, the activations' type). */
typedef struct { const void *ln1, *wq, *wk, *wv, *qn, *kn, *wo, *ln2, *wgu, *wd, *router, *experts; } pr__layer_w;

/* Activation memory: a bump allocator over backend chunks that are kept across resets, so a
   phase that runs many microbatches allocates once (unless the device runs short: then the chunks
   no arena holds go back). Every byte handed out is counted in the trainer's live total, from
   which each phase's peak is read. */
typedef struct pr__chunk { struct pr__chunk *next; char *mem; size_t cap, used; } pr__chunk;

/* Offload's device slots: a layer computing (or being backpropagated), the next one receiving its
   input (or being prefetched), and one whose copy may still be in flight. */
#define PR__SLOTS 3
typedef struct { pr__chunk *head, *tail; size_t used; } pr__arena;

/* Where one of a sharded trainer's tensors sits in the full model: rows row0.. and columns col0..
   of the full tensor at full_off (full_rows x full_cols). `elsewhere`: another rank of the TP and PP
   groups holds the same values (the lowest TP rank of those holding a tensor whole or a
   replicated KV head's rows keeps it; the first stage of the embedding tied to the last stage's
   LM head), so this copy is left out of norms and gathers; `tp_partial`: its gradient is a
   partial sum over the TP ranks holding the same rows (the q/k norms, shared by heads on every
   rank; a replicated KV head's k/v projections, shared by its query heads on several ranks). */
typedef struct { size_t full_off; int64_t full_rows, full_cols, row0, col0; unsigned char elsewhere, tp_partial; } pr__shard;

struct pr_trainer {
    pr_config cfg;                         /* this rank's shard of the model (all of it without a mesh) */
    pr_config model;                       /* the full model */
    const pr_mesh *mesh;                   /* NULL: one rank */
    int layer0;                            /* PP: the full model's index of this stage's first layer */
    int has_embed, has_head;               /* PP: the embedding (first stage, and the last if tied), final norm and LM head (last) */
    int expert0, n_experts;                /* MoE: the experts this rank holds, expert0 .. expert0+n_experts-1 */
    int vocab0;                            /* TP: the vocabulary rows this rank holds, vocab0 .. vocab0+cfg.vocab_size-1 */
    size_t n_full;                         /* the full model's parameter count */
    pr__shard *shard;                      /* (n_tensors) mesh only */
    pr_status comm_st;                     /* the step's first failed collective, its message in comm_err */
    pr_error comm_err;
    const pr_backend *be;
    int n_tensors;
    pr_tensor_info *tensors;
    size_t n_params;
    pr_real *arena;                        /* master weights, AdamW m and v (slice_cap each), gradients (n_pad) */
    pr_real *params, *grads, *adam_m, *adam_v;
    /* ZeRO (mesh->zero > 0 and dp > 1): the arena in dp slices of slice_cap reals (whole units, the
       pieces the gradient norm is summed over), this rank's [slice_lo, slice_lo + slice_n); the
       gradients and the weights padded to n_pad = dp * slice_cap for the collectives. Without it:
       one slice, the whole arena. The master weights (params), m and v hold this rank's slice:
       params[i] is parameter slice_lo + i. */
    int zero;                              /* the stage in effect: 0 unless sharded */
    size_t unit, n_pad, slice_cap, slice_lo, slice_n;
    int grads_scattered;                   /* stage 2: only this rank's slice of grads holds the sum */
    pr_comm *dp_team;                      /* a group split over dp ranks: this rank's team, kept for the next
                                              step of dp_team_groups groups (pr__dp_team) */
    int dp_team_groups;
    /* (n_pad) The weights the kernels read, the whole model's, in the backend's activation type:
       the master weights themselves where they are that type and whole (the CPU without ZeRO),
       else a copy of its own (own_weights) that the trainer refreshes from them whenever they
       change (pr__weights_take, pr__weights_publish). */
    void *weights;
    int own_weights;
    size_t off_embed, off_norm, off_lm_head;
    pr__layer_off *layer_off;              /* (L) */
    pr_real *inv_freq;                     /* (HS/2) RoPE frequencies, llama3 scaling applied */
    long adam_step;
    pr__arena prefix_arena;                /* Phase A..C: prefix saved tensors, K/V cache, gK/gV */
    pr__arena step_arena;                  /* Phase A's collective buffers, Phase C's backward scratch */
    pr__arena *mb_arena;                   /* the microbatches in flight through this stage (Phase B, baseline) */
    int n_mb_arena;                        /* pp + 1: as many as 1F1B keeps in flight */
    pr__chunk *spare;                      /* chunks no arena holds now: reused before new memory is taken */
    size_t live_bytes, phase_peak[3];      /* device tier: what the arenas and offload slots hold */
    size_t chunk_bytes;                    /* device tier: the arenas' chunks and the spares, used or not */
    uint16_t *grad_wire;                   /* pr_mesh.bf16_grad_reduce: the gradients' bf16 chunks on the wire */
    size_t grad_wire_n;
    pr_real *stage;                        /* backend memory (PR__STAGE_REALS) that host values and a padded
                                              gradient pass through to a collective, in chunks */
    pr_real *stage_host;                   /* host reals (PR__STAGE_REALS) host doubles are converted in */
    double *norm_pieces;                   /* host (pr__norm_pieces_cap x dp under ZeRO) the gradient norm's pieces */
    double *norm_pieces_dev;               /* their device twin, gathered over dp (under ZeRO only) */
    void *pool;                            /* HOST tier: the offload staging pool, kept across steps */
    size_t pool_cap;
    char *slot[PR__SLOTS];                 /* device slots a dormant block is computed or loaded into */
    size_t slot_cap[PR__SLOTS];
    unsigned char slot_copying[PR__SLOTS]; /* a copy into or out of the slot may still be running */
    int phase;
    int alloc_failed;
    double *expert_load;                   /* (L,E) MoE: the last compute_grads call's logical tokens per expert */
};

/* The tensors a layer's backward reads, saved by its forward (shapes for N rows). */
typedef struct {
    void *ln1, *ln1_rstd;     /* (N,C) (N) */
    void *q_pre, *k_pre;      /* (N,NH*HS) (N,NKV*HS) projections before the q/k norms (Qwen3 only) */
    void *q_rstd, *k_rstd;    /* (N*NH) (N*NKV) (Qwen3 only) */
    void *q, *k, *v;          /* (N,NH*HS) (N,NKV*HS) (N,NKV*HS) post-norm, post-RoPE: k, v are the K/V cache */
    void *att, *lse;          /* (N,NH*HS) (N,NH) */
    void *x_mid;              /* (N,C) residual after attention */
    void *ln2, *ln2_rstd;     /* (N,C) (N) */
    void *gu, *h;             /* (N,2F) each row's gate then its up, (N,F); MoE: (N*k, 2Fm),
                                 (N*k, Fm), the routed rows grouped by expert */
    void *ye;                 /* MoE: (N*k, C) each routed row's expert output, before its weight */
    void *router;             /* MoE: (N, E) router logits (read once, on the host) */
} pr__layer_acts;

/* One MoE layer's routing of one pass, decided on the host and kept for its backward. */
typedef struct {
    pr_real *prob;            /* (N,E) the router's softmax (computed in double, kept in pr_real: at
                                 48 layers of 128 experts it is the largest host buffer of a pass) */
    double *wsum;             /* (N) sum of the top-k probabilities: the renormaliser (1 without norm_topk_prob) */
    int *start;               /* (E+1) expert e owns slots start[e] .. start[e+1]-1 */
    int *row;                 /* (N*k) each slot's row, slots grouped by expert, rows ascending within one */
    pr_real *w;               /* (N*k) each slot's combine weight */
    pr_real *dw;              /* (N*k) backward: d(loss)/d(weight) */
} pr__route;

/* What a pass keeps of each layer from its forward to its backward: the whole block and K/V;
   under recompute the layer's input and K/V (the prefix pass: its K/V are the cache), or the
   input alone (a microbatch), every layer's other tensors then sharing one region that the
   layer's forward fills again before its backward (pr__layer_rebuild). */
typedef enum { PR__KEEP_ALL = 0, PR__KEEP_INPUT_KV, PR__KEEP_INPUT } pr__keep;

/* One prefix pass's rows in a path: all of them (every CP rank's), the rows of one CP block (all
   of them without CP), and this rank's. */
typedef struct { int rows, chunk, own; } pr__kv_seg;

/* CP: how a segment of n rows is cut over the cp ranks. It is split into 2 cp pieces of `piece`
   rows (the last ones short or empty); rank r holds piece r (rows_a rows, from row a0) and piece
   2cp-1-r (rows_b, from b0). Under the causal mask every rank's queries then see about as many
   keys as another's; contiguous chunks would give the last rank (2cp-1)/cp of the mean. A rank's
   rows are its two pieces one after the other, in a block of `chunk` = 2 piece rows (piece B
   from row `piece`: rows_b > 0 only when piece A is whole). Without CP: all n rows, one piece. */
typedef struct { int n, piece, chunk, a0, rows_a, b0, rows_b; } pr__cp_cut;
static int pr__cp_own(const pr__cp_cut *k) { return k->rows_a + k->rows_b; }   /* this rank's rows */
/* The rows of a piece of `piece` rows from row `at` that lie before row n (0 from n on). */
static size_t pr__piece_rows(size_t n, size_t at, size_t piece) { return at >= n ? 0 : n - at < piece ? n - at : piece; }

/* The K/V a pass attends to ahead of its own rows, and where their gradients gather: the group's
   prefix in Phase B, or in a prefix tree every node from the root down to the pass. The path is a
   stack of segments, one a prefix pass (a group's prefix; a tree's nodes down to the one in hand),
   pushed before its Phase A and popped after its Phase C. Each layer's rows are one buffer into
   which each prefix pass writes its own K/V in place, after the segments above it, so a pass
   reads all the rows above it as one region and sends their dK/dV back as one. Under CP a rank
   holds its block of each segment, a whole block's room in the K/V buffers so that it can be
   gathered, and its own rows of gK/gV. */
typedef struct {
    int own, kv;              /* the segments' rows: this rank's, and in the K/V buffers */
    pr__kv_seg *seg;          /* (max_seg) */
    int n_seg, max_seg;
    void **k, **v;            /* (L) the K/V cache, NKV*HS acts a row */
    pr_real **gk, **gv;       /* (L) their accumulated dK/dV, in reals: the G suffixes' sums are never
                                 rounded to the activations' precision */
    pr_real *dk_mb, *dv_mb;   /* scratch over the path's rows, one layer: a pass's own dK/dV for the
                                 on_dkv hook; a peer's gK/gV in a split group's reduction (NULL
                                 in a step with neither) */
} pr__kv_path;

/* A batch of rows: the layout, the tokens (host), each layer's saved tensors, and the residual
   stream res[0..L] (res[0] the embeddings, res[l+1] the output of layer l). */
typedef struct {
    pr_seq_layout lay;
    int N;
    pr__keep keep;
    const int32_t *tokens;
    const uint8_t *real;      /* (N) 1 for a token row, 0 for padding (MoE statistics skip padding) */
    pr__layer_acts *acts;     /* (L) host array of pointers into the arena */
    void **res;               /* (L+1) */
    pr__route *route;         /* (L) MoE only */
    const double *aux_g;      /* MoE: d(aux loss)/d(router probability) per expert for each real row */
    /* CP: the pass holds this rank's block of each of its lay.n_seg segments (cp_cut[j], from
       row cp_off[j]: piece A, then piece B), each piece laid out by pr__cp_piece; its own K/V
       hold cp_kv_rows rows so that every block can be gathered; cp_chunk: the largest block.
       pre: the path whose first pre_seg segments (cp_pre_rows rows) the pass reads ahead of its
       own rows (NULL: none). */
    const pr__cp_cut *cp_cut;
    const int *cp_off;
    int cp_chunk, cp_kv_rows, cp_pre_rows, pre_seg;
    const pr__kv_path *pre;
    void *kreg, *vreg;                   /* CP: gathered attention region */
    pr_real *dkreg, *dvreg;              /* CP: its gradient (reals, as the prefix dK/dV are) */
    pr_real *pad, *shard;                /* CP: a reduce-scatter's input and output */
    void *ep_send, *ep_recv;             /* EP: all-to-all blocks */
} pr__pass;

/* Scratch for one backward, shared by every layer of it (MoE: dh and dgu hold N*k routed rows,
   dye and dxe the routed rows' C-wide gradients, dlogit the router's). Under recompute the
   rebuilt forward writes its output to fwd_out, and on a pass that keeps its K/V its K/V to
   fwd_k/fwd_v, so that what the pass keeps stays as it is. */
typedef struct {
    void *dres, *dln, *dq, *dk, *dv, *dq_pre, *dk_pre, *datt, *dh, *dgu, *dye, *dxe, *dlogit;
    void *fwd_out, *fwd_k, *fwd_v;
} pr__bwd_scratch;

/* The K/V gradients one layer's attention backward writes: this pass's own rows always, the
   cached prefix's in Phase B. pr__kv_own gives the own part with no prefix (Phase C, baseline). */
typedef struct {
    void *dk, *dv;               /* (N, NKV*HS) acts: the pass's own dK/dV, added into; they already
                                    hold what must be injected (gK/gV in Phase C, zeros otherwise) */
    const void *kp, *vp;         /* (P, NKV*HS) the cached prefix K/V the pass attends to, or NULL */
    pr_real *dkp, *dvp;          /* (P, NKV*HS) where the cached prefix's dK/dV go (under CP its shard's), or NULL */
} pr__kv_grads;

static pr__kv_grads pr__kv_own(void *dk, void *dv) {
    pr__kv_grads kv;
    memset(&kv, 0, sizeof kv);
    kv.dk = dk;
    kv.dv = dv;
    return kv;
}

/* Which rows of a pass predict which tokens, with what the loss needs for each. The head runs M
   (row, target) pairs; pair m stands for the loss slots first[m] .. first[m+1]-1, the tokens it
   predicts: one, or for a trained prefix token every trajectory's copy of it (the same logits,
   the same target), so that the prefix's head runs once and not G times. */
typedef struct {
    int M, n_slots;
    int *row;           /* row of the pass whose final hidden state predicts the target */
    int32_t *target;
    int *first;         /* (M + 1) */
    /* a slot's: index of its token in the group's loss slots (pr__loss_slots), what its loss needs */
    long *flat;
    pr_real *old_logp, *ref_logp, *advantage, *weight;
} pr__head_plan;

/* The host side of one pass: layout, tokens, and its loss rows. */
typedef struct {
    pr_seq_layout lay;
    int *seg_off;
    int32_t *tokens;
    uint8_t *real;            /* (N) 1 for a token row, 0 for padding */
    int N, n_traj;            /* rows; trajectories whose rows these are */
    pr__cp_cut *cp_cut;       /* CP: each segment's cut (NULL without CP) */
    int *cp_off;              /* CP: (n_seg+1) where each segment's block starts among the rows */
    int cp_chunk, cp_kv_rows; /* CP: the largest block; the rows the K/V need to send every block */
    pr__head_plan head;
} pr__batch;

typedef enum {
    PR__BATCH_FULL,          /* baseline: whole [prefix ; suffix] sequences, padded to the longest */
    PR__BATCH_SUFFIX,        /* Phase B: suffixes after the cached prefix, padded or packed */
    PR__BATCH_PREFIX         /* Phase A/C: the prefix once; its loss rows are each suffix's first token */
} pr__batch_kind;

/* The offload of one step's prefix blocks (see pr_offload_opts). */
typedef struct {
    int on;
    size_t block;             /* bytes of one layer's block */
    void **host;              /* (L) where each block rests between its Phase-A forward and Phase-C backward */
    unsigned char *own;       /* (L) 1: a host allocation of its own, the pool being full */
    size_t pool_used, own_live;
    int slot_layer[PR__SLOTS];     /* the layer each device slot holds for this pass, -1 free */
    pr_offload_stats st;
} pr__offload;

/* A prefix pass (Phase A's, or a prefix tree node's) from its forward to its backward: rows
   start .. start+len-1 of the path (pr__kv_path) it writes its K/V into, the last segment there. */
typedef struct {
    int start, len;
    int own_above;            /* the rows above it this rank holds (all of them without CP) */
    pr__arena *a;             /* the memory its pass lives in */
    pr__batch batch;          /* its rows as one segment, with the loss rows of the suffixes' first tokens */
    pr__pass pass;            /* its saved tensors; pass.acts[l].k/v are its rows of the path's K/V */
    pr__offload off;
    int copies;               /* the trajectories its rows stand for: the group's G (a tree node: its groups') */
    double *route_sums;       /* MoE: its routing sums (2E+1) over the stages up to this one (Phase A) */
    const double *aux_c;      /* MoE: the aux gradient per expert its router takes in Phase C (NULL: none) */
    const pr__offload *below; /* offload: a pass whose blocks rest in the pool under its own (a node's parent) */
    size_t pool_stack;        /* offload, the first pass: bytes that will rest in the pool at once (0: its own) */
} pr__prefix_state;

/* One step's MoE load-balancing bookkeeping (see pr_moe_opts). Routing sums run over MoE layers
   and real rows, laid out as count[E] (routings to e), prob[E] (router probability of e), M
   (routings in all): 2E+1 values, one vector to travel between pipeline stages. */
typedef struct {
    int on, E, B, G, reuse, prepass;
    double coef;
    const pr_moe_opts *opt;
    double *pre;                           /* the prefix pass's sums, each row once (reuse) */
    double *own;                           /* scratch: one stage's sums of one pass */
    double *F, M_tot;                      /* group scope: the group's routing fractions, and M */
    double *prob_tot;                      /* group scope: probability mass of the passes run so far */
    double *c;                             /* aux gradient per expert for each prefix row (Phase C) */
    double aux;                            /* the loss term so far, coefficient applied (last stage) */
} pr__moe_acc;

typedef struct {
    const pr_group *g;
    const pr_step_opts *opt;
    const pr_real *tok_weight;   /* (n_tok) each loss slot's share of the loss */
    pr_real *logp;               /* (n_tok) */
    pr_real *user_logp;          /* the caller's buffer for the suffix tokens' log-probs, or NULL */
    double loss;
    long rows;
    pr__moe_acc moe;
    /* The trajectories this rank runs, t0 .. t1-1 (all G unless the group is split across DP
       ranks). team: the DP ranks sharing the group, or NULL; its rank 0 (the owner) runs Phase A
       and C, replicates the prefix K/V to the others and gets their gK/gV back. */
    int t0, t1;
    pr_comm *team;
    int mb;                      /* trajectories per microbatch */
    int owner;                   /* 1 on the rank that runs Phases A and C (rank 0 of a team) */
    long n_tok;                  /* the group's loss slots (pr__loss_slots) */
    /* What pr__step_begin allocated (NULL: nothing, or the caller's log-probs buffer) */
    pr_real *mem_tok_weight, *mem_logp;
    double *mem_moe;
} pr__step_ctx;

/* Forward, loss and backward of one microbatch, written as the pieces a pipeline interleaves.
   Each microbatch in flight has its own arena (1F1B keeps up to pp + 1), its backward scratch,
   and with MoE its routing sums (forward) and aux gradient (backward). */
typedef struct {
    pr__batch b;
    pr__pass p;
    pr__bwd_scratch s;
    pr__arena *a;
    int index;
    double *sums, *g;           /* MoE: (2E+1), (E) */
} pr__mb;

/* ---------------------------------------------------------------- 3.2 Forward declarations: the calls into sections 5 to 7 */
/* The model (3) and the schedules (4) come before the offload (5), MoE (6) and parallel (7)
   code they call, and C wants a function declared before its first call. These are those calls:
   the seams where the three enter a step, in the order of their definitions. On one rank, with a
   dense model and offload off, none of them does more than the plain step needs. */

/* 5. Offload: Phase A parks each layer's block on the host, Phase C brings it back */
static int pr__slot_of(const pr__offload *o, int layer);
static void pr__slot_wait(pr_trainer *tr, int s);
static pr_status pr__slot_take(pr_trainer *tr, pr__offload *o, pr__pass *ps, int layer, pr_error *err);
static pr_status pr__offload_block(pr_trainer *tr, pr__offload *o, int l, pr_error *err);
static pr_status pr__load_block(pr_trainer *tr, pr__offload *o, pr__pass *ps, int l, pr_error *err);
static pr_status pr__prefetch_block(pr_trainer *tr, pr__offload *o, pr__pass *ps, int l, size_t budget, pr_error *err);
static void pr__block_done(pr_trainer *tr, pr__offload *o, int l);
static pr_status pr__offload_begin(pr_trainer *tr, pr__offload *o, const pr_offload_opts *opt, const pr__pass *ps, int P,
                                   const pr__offload *below, size_t stack, pr_error *err);
static void pr__offload_end(pr_trainer *tr, pr__offload *o);

/* 6. MoE: the sparse MLP inside the layer, the load-balancing loss around the phases */
static void pr__moe_forward(pr_trainer *tr, pr__pass *ps, int l, const pr__layer_w *w, void *y);
static void pr__moe_backward(pr_trainer *tr, pr__pass *ps, int l, pr__bwd_scratch *s, const pr__layer_w *w,
                             const pr__layer_g *g);
static void pr__moe_stage_sums(pr_trainer *tr, pr__moe_acc *m, const pr__pass *ps, double *sums, double load_mult);
static void pr__moe_mb_grad(pr__moe_acc *m, const double *sums, int n, double *g);
static void pr__moe_take_grad(pr__moe_acc *m, const double *g, int n);
static void pr__moe_group_aux(pr__moe_acc *m);
static pr_status pr__routing_prepass(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path, pr_error *err);

/* 7. The parallel layer: the mesh's sizes and sums, sharded parameters, CP attention and
   batches, pipeline exchanges, groups split across DP ranks */
static pr_comm_type pr__act_type(const pr_trainer *tr);
static void pr__comm_done(pr_trainer *tr, pr_status st, pr_error *e);
static int pr__tp(const pr_trainer *tr);
static int pr__cp(const pr_trainer *tr);
static int pr__ep(const pr_trainer *tr);
static int pr__pp(const pr_trainer *tr);
static int pr__first_stage(const pr_trainer *tr);
static int pr__last_stage(const pr_trainer *tr);
static void pr__tp_sum(pr_trainer *tr, void *x, size_t n);
static int pr__vocab0(int V, int tp, int r);
static void pr__sum_host(pr_trainer *tr, pr_comm *c, pr_real *x, size_t n);
static void pr__sum_doubles(pr_trainer *tr, pr_comm *c, double *x, size_t n);
static pr_status pr__shard_config(const pr_config *cfg, const pr_mesh *m, pr_config *local, int *layer0, int *expert0,
                                  int *n_experts, pr_error *err);
static pr_status pr__build_shards(pr_trainer *tr, pr_error *err);
static void pr__mesh_sync_grads(pr_trainer *tr);
static pr_comm_type pr__act_type(const pr_trainer *tr);
static void pr__attention_fwd(pr_trainer *tr, pr__pass *ps, pr__layer_acts *a, const void *kp, const void *vp);
static void pr__attention_bwd(pr_trainer *tr, pr__pass *ps, pr__bwd_scratch *s, pr__layer_acts *a, const pr__kv_grads *kv);
static pr_status pr__batch_make(pr_trainer *tr, pr__batch *b, const pr_group *g, const pr_real *tok_weight, int i0, int n,
                                pr__batch_kind kind, int packed, pr_error *err);
static pr_status pr__pass_comm_alloc(pr_trainer *tr, pr__arena *a, pr__pass *ps, pr_error *err);
static pr__cp_cut pr__cp_cut_of(const pr_trainer *tr, int n);
static int pr__cp_piece(const pr__pass *ps, int j, int half, pr_seq_layout *lay, int seg_off[2]);
static void pr__pp_send(pr_trainer *tr, int peer, const void *rows, int n, const double *d, size_t nd);
static void pr__pp_recv(pr_trainer *tr, int peer, void *rows, int n, double *d, size_t nd);
static void pr__pp_prev(pr_trainer *tr, pr__mb *back, pr__mb *in);
static void pr__pp_next(pr_trainer *tr, pr__mb *out, pr__mb *back);
static void pr__split_share_kv(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path);
static void pr__split_reduce_gkv(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path);

/* ---------------------------------------------------------------- 3.3 Parameters: layout, creation, access, initialisation */
static pr__layer_g pr__layer_grads(pr_trainer *tr, int l) {
    const pr__layer_off *o = &tr->layer_off[l];
    pr_real *base = tr->grads;
    pr__layer_g g;
    g.ln1 = base + o->ln1; g.wq = base + o->wq; g.wk = base + o->wk; g.wv = base + o->wv;
    g.qn = tr->cfg.qk_norm ? base + o->qn : NULL; g.kn = tr->cfg.qk_norm ? base + o->kn : NULL;
    g.wo = base + o->wo; g.ln2 = base + o->ln2; g.wgu = base + o->wgu; g.wd = base + o->wd;
    g.router = base + o->router; g.experts = base + o->experts;
    return g;
}
/* `elems` elements of the activations' type past base, read-only (the weights the kernels read, a
   cached K/V); the weight at arena offset `off` as the kernels read it. */
static const void *pr__cact_at(const pr_trainer *tr, const void *base, size_t elems) {
    return (const char *)base + elems * tr->be->act_bytes;
}
static const void *pr__weight(const pr_trainer *tr, size_t off) { return pr__cact_at(tr, tr->weights, off); }
static pr__layer_w pr__layer_weights(const pr_trainer *tr, int l) {
    const pr__layer_off *o = &tr->layer_off[l];
    pr__layer_w w;
    w.ln1 = pr__weight(tr, o->ln1); w.wq = pr__weight(tr, o->wq); w.wk = pr__weight(tr, o->wk); w.wv = pr__weight(tr, o->wv);
    w.qn = tr->cfg.qk_norm ? pr__weight(tr, o->qn) : NULL; w.kn = tr->cfg.qk_norm ? pr__weight(tr, o->kn) : NULL;
    w.wo = pr__weight(tr, o->wo); w.ln2 = pr__weight(tr, o->ln2);
    w.wgu = pr__weight(tr, o->wgu); w.wd = pr__weight(tr, o->wd);
    w.router = pr__weight(tr, o->router); w.experts = pr__weight(tr, o->experts);
    return w;
}
static size_t pr__lm_head_off(const pr_trainer *tr) { return tr->cfg.tie_word_embeddings ? tr->off_embed : tr->off_lm_head; }

/* Appends one tensor to the table (table may be NULL to count) and returns its offset. */
static size_t pr__add_tensor(pr_tensor_info *table, int *count, size_t *total, const char *name,
                             int64_t rows, int64_t cols, int decay) {
    size_t off = *total, numel = (size_t)rows * (size_t)(cols ? cols : 1);
    if (table) {
        pr_tensor_info *t = &table[*count];
        snprintf(t->name, sizeof t->name, "%s", name);
        t->ndim = cols ? 2 : 1;
        t->shape[0] = rows; t->shape[1] = cols;
        t->offset = off; t->numel = numel; t->decay = decay;
    }
    (*count)++;
    *total += numel;
    return off;
}

/* The Hugging Face tensor list of a Llama / Qwen3 model, in arena order. */
static void pr__build_layout(pr_trainer *tr, pr_tensor_info *table, int *count, size_t *total) {
    const pr_config *c = &tr->cfg;
    int64_t C = c->hidden_size, F = c->intermediate_size, V = c->vocab_size;
    int64_t qd = (int64_t)c->num_attention_heads * c->head_dim, kvd = (int64_t)c->num_key_value_heads * c->head_dim;
    char nm[96];
    *count = 0; *total = 0;
    if (tr->has_embed) tr->off_embed = pr__add_tensor(table, count, total, "model.embed_tokens.weight", V, C, 1);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        pr__layer_off o;
        memset(&o, 0, sizeof o);
#define PR__T(field, suffix, r, cl, d) \
        (snprintf(nm, sizeof nm, "model.layers.%d.%s", tr->layer0 + l, suffix), o.field = pr__add_tensor(table, count, total, nm, r, cl, d))
        PR__T(ln1, "input_layernorm.weight", C, 0, 0);
        PR__T(wq, "self_attn.q_proj.weight", qd, C, 1);
        PR__T(wk, "self_attn.k_proj.weight", kvd, C, 1);
        PR__T(wv, "self_attn.v_proj.weight", kvd, C, 1);
        if (c->qk_norm) {
            PR__T(qn, "self_attn.q_norm.weight", c->head_dim, 0, 0);
            PR__T(kn, "self_attn.k_norm.weight", c->head_dim, 0, 0);
        }
        PR__T(wo, "self_attn.o_proj.weight", C, qd, 1);
        PR__T(ln2, "post_attention_layernorm.weight", C, 0, 0);
        if (c->num_experts) {
            int64_t Fm = c->moe_intermediate_size;
            PR__T(router, "mlp.gate.weight", c->num_experts, C, 1);
            for (int e = tr->expert0; e < tr->expert0 + tr->n_experts; e++) {
                size_t first;
                snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.%d.gate_proj.weight", tr->layer0 + l, e);
                first = pr__add_tensor(table, count, total, nm, Fm, C, 1);
                snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.%d.up_proj.weight", tr->layer0 + l, e);
                pr__add_tensor(table, count, total, nm, Fm, C, 1);
                snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.%d.down_proj.weight", tr->layer0 + l, e);
                pr__add_tensor(table, count, total, nm, C, Fm, 1);
                if (e == tr->expert0) o.experts = first;
            }
        } else {
            PR__T(wgu, "mlp.gate_proj.weight", F, C, 1);     /* the up projection right after it */
            snprintf(nm, sizeof nm, "model.layers.%d.mlp.up_proj.weight", tr->layer0 + l);
            pr__add_tensor(table, count, total, nm, F, C, 1);
            PR__T(wd, "mlp.down_proj.weight", C, F, 1);
        }
#undef PR__T
        if (tr->layer_off) tr->layer_off[l] = o;
    }
    if (!tr->has_head) return;
    tr->off_norm = pr__add_tensor(table, count, total, "model.norm.weight", C, 0, 0);
    if (!c->tie_word_embeddings) tr->off_lm_head = pr__add_tensor(table, count, total, "lm_head.weight", V, C, 1);
}

/* The full model's tensor table (what an unsharded trainer of it holds); NULL without memory.
   total (may be NULL): its parameter count. */
static pr_tensor_info *pr__full_table(const pr_trainer *tr, int *count, size_t *total) {
    size_t unused;
    if (!total) total = &unused;
    pr_trainer full;
    memset(&full, 0, sizeof full);
    full.cfg = tr->model;
    full.has_embed = full.has_head = 1;
    full.n_experts = tr->model.num_experts;
    pr__build_layout(&full, NULL, count, total);
    pr_tensor_info *ft = (pr_tensor_info *)PR_MALLOC(sizeof(pr_tensor_info) * (size_t)*count);
    if (ft) pr__build_layout(&full, ft, count, total);
    return ft;
}

/* inv_freq[i] = theta^(-2i/HS), then Llama 3's scaling when configured: wavelengths longer than
   original/low_freq_factor are slowed by `factor`, shorter than original/high_freq_factor kept,
   and the band between interpolated smoothly (Hugging Face's _compute_llama3_parameters). */
static void pr__rope_frequencies(const pr_config *c, pr_real *inv_freq) {
    const double pi = 3.14159265358979323846;
    int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        double f = pow(c->rope_theta, -(2.0 * i) / c->head_dim);
        if (c->rope_llama3) {
            double old = c->rope_original_max_position, wavelen = 2 * pi / f;
            double low_wl = old / c->rope_low_freq_factor, high_wl = old / c->rope_high_freq_factor;
            if (wavelen > low_wl) f = f / c->rope_factor;
            else if (wavelen >= high_wl) {
                double smooth = (old / wavelen - c->rope_low_freq_factor) / (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1 - smooth) * f / c->rope_factor + smooth * f;
            }
        }
        inv_freq[i] = (pr_real)f;
    }
}

#define PR__MAX_HEAD_DIM PR_MAX_HEAD_DIM   /* bounds the host copy of the RoPE frequencies */

/* The gradient norm's pieces a slice can hold (pr__grad_pieces): its units, and one more for each
   tensor that starts inside one. */
static size_t pr__norm_pieces_cap(const pr_trainer *tr) { return tr->slice_cap / tr->unit + (size_t)tr->n_tensors + 1; }

/* The master weights' and AdamW state's slices (ZeRO). The arena is cut into units of `unit` reals (a power of two
   that depends on the arena's size only, so that every stage cuts the same way), the units dealt
   out in dp contiguous runs of equal length (the last ones shorter, or empty). */
static void pr__plan_slices(pr_trainer *tr, int zero, int dp, int rank) {
    const size_t n = tr->n_params;
    size_t unit = 256;
    while (unit < ((size_t)1 << 22) && unit * 4096 < n) unit *= 2;
    tr->unit = unit;
    tr->zero = zero;
    if (!zero) {
        tr->n_pad = tr->slice_cap = tr->slice_n = n;
        tr->slice_lo = 0;
        return;
    }
    const size_t units = (n + unit - 1) / unit, per = (units + (size_t)dp - 1) / (size_t)dp;
    tr->slice_cap = per * unit;
    tr->n_pad = tr->slice_cap * (size_t)dp;
    tr->slice_lo = (size_t)rank * tr->slice_cap < n ? (size_t)rank * tr->slice_cap : n;
    tr->slice_n = n - tr->slice_lo < tr->slice_cap ? n - tr->slice_lo : tr->slice_cap;
}

/* The staging buffers' reals (backend memory and host, taken at trainer creation): host values and
   padded gradient rows cross to the collectives through them, in chunks. */
#ifndef PR__STAGE_REALS                    /* the tests make it small, to cross chunk boundaries */
#define PR__STAGE_REALS ((size_t)1 << 20)
#endif
/* An agreement moves two reals a rank, a gather's chunk a real of count beside its values: */
typedef char pr__stage_reals_at_least_2[PR__STAGE_REALS >= 2 ? 1 : -1];

/* The gradient sum over dp in bf16 moves chunks of at most 2^22 elements (8 MiB): a chunk of the
   arena for an all-reduce; under ZeRO-2 a chunk of every rank's slice, packed rank after rank, and
   the block the reduce-scatter returns. The chunk, and the wire buffer's elements: */
#ifndef PR__GRAD_WIRE_MAX                  /* the tests make it small, to cross chunk boundaries */
#define PR__GRAD_WIRE_MAX ((size_t)1 << 22)
#endif
static size_t pr__grad_wire_chunk(const pr_trainer *tr, int dp) {
    const size_t most = tr->zero == 2 ? PR__GRAD_WIRE_MAX / (size_t)(dp + 1) : PR__GRAD_WIRE_MAX;
    const size_t whole = tr->zero == 2 ? tr->slice_cap : tr->n_params;
    return whole < most ? (whole ? whole : 1) : most;
}
static size_t pr__grad_wire_size(const pr_trainer *tr, int dp) {
    return pr__grad_wire_chunk(tr, dp) * (tr->zero == 2 ? (size_t)(dp + 1) : 1);
}

/* The first kernel the backend lacks of those a trainer may call (every member but the optional
   ones); NULL: none. A backend of sizes alone (pr_backend_cuda_sizes) has none of them. */
static const char *pr__backend_missing(const pr_backend *be) {
#define PR__NEEDS(f) if (!be->f) return #f;
    PR__NEEDS(alloc) PR__NEEDS(release) PR__NEEDS(zero) PR__NEEDS(copy) PR__NEEDS(upload_reals) PR__NEEDS(download_reals)
    PR__NEEDS(sync) PR__NEEDS(matmul_fwd) PR__NEEDS(matmul_bwd) PR__NEEDS(rmsnorm_fwd) PR__NEEDS(rmsnorm_bwd) PR__NEEDS(rope_fwd)
    PR__NEEDS(rope_bwd) PR__NEEDS(attention_fwd) PR__NEEDS(attention_bwd) PR__NEEDS(swiglu_fwd) PR__NEEDS(swiglu_bwd)
    PR__NEEDS(embed_fwd) PR__NEEDS(embed_bwd) PR__NEEDS(add) PR__NEEDS(acts_to_reals) PR__NEEDS(reals_to_acts)
    PR__NEEDS(add_reals) PR__NEEDS(reals_to_bf16) PR__NEEDS(bf16_to_reals) PR__NEEDS(gather_rows) PR__NEEDS(scatter_add_rows)
    PR__NEEDS(logit_stats) PR__NEEDS(logit_grad) PR__NEEDS(upload_acts) PR__NEEDS(download_acts) PR__NEEDS(row_dots)
    PR__NEEDS(sum_squares) PR__NEEDS(scale) PR__NEEDS(adamw)
#undef PR__NEEDS
    return NULL;
}

static pr_status pr__trainer_new(pr_trainer **out, const pr_config *cfg, const pr_backend *be, const pr_mesh *mesh,
                                 pr_error *err) {
    if (!out || !cfg || !be) return pr__fail(err, PR_ERR_ARG, "pr_trainer_create: NULL argument");
    const char *missing = pr__backend_missing(be);
    if (missing)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_create: backend %s has no %s kernel (a backend of sizes only, for "
                        "pr_backend_measure?)", be->name ? be->name : "(unnamed)", missing);
    pr_config local;
    int layer0 = 0, expert0 = 0, n_experts = 0;     /* set by pr__shard_config when it succeeds */
    pr_status st = pr_config_validate(cfg, err);
    if (!st) st = pr__shard_config(cfg, mesh, &local, &layer0, &expert0, &n_experts, err);
    if (!st && be->check_config) st = be->check_config(be, &local, err);
    if (!st && mesh && (size_t)mesh->dp > PR__STAGE_REALS)      /* a gather moves a piece of every dp rank's slice at once */
        st = pr__fail(err, PR_ERR_UNSUPPORTED, "dp %d is more than the staging buffers' %zu reals", mesh->dp, (size_t)PR__STAGE_REALS);
    if (st) return st;
    if (cfg->head_dim > PR__MAX_HEAD_DIM)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "head_dim %d is larger than %d", cfg->head_dim, PR__MAX_HEAD_DIM);
    pr_trainer *tr = (pr_trainer *)PR_MALLOC(sizeof *tr);
    if (!tr) return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: out of memory");
    memset(tr, 0, sizeof *tr);
    tr->cfg = local;
    tr->model = *cfg;
    tr->mesh = mesh;
    tr->layer0 = layer0;
    tr->has_embed = !mesh || mesh->pp_rank == 0 || (cfg->tie_word_embeddings && mesh->pp_rank == mesh->pp - 1);
    tr->has_head = !mesh || mesh->pp_rank == mesh->pp - 1;
    tr->expert0 = expert0;
    tr->n_experts = n_experts;
    tr->vocab0 = mesh ? pr__vocab0(cfg->vocab_size, mesh->tp, mesh->tp_rank) : 0;
    tr->be = be;
    int count; size_t total;
    pr__build_layout(tr, NULL, &count, &total);           /* sizes only */
    size_t arena_bytes;
    tr->tensors = (pr_tensor_info *)PR_MALLOC(sizeof(pr_tensor_info) * (size_t)count);
    tr->layer_off = (pr__layer_off *)PR_MALLOC(sizeof(pr__layer_off) * (size_t)cfg->num_hidden_layers);
    tr->n_mb_arena = (mesh ? mesh->pp : 1) + 1;
    tr->mb_arena = (pr__arena *)PR_MALLOC(sizeof(pr__arena) * (size_t)tr->n_mb_arena);
    if (tr->mb_arena) memset(tr->mb_arena, 0, sizeof(pr__arena) * (size_t)tr->n_mb_arena);
    if (!tr->tensors || !tr->layer_off || !tr->mb_arena) {
        pr_trainer_destroy(tr);
        return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: out of memory");
    }
    pr__build_layout(tr, tr->tensors, &tr->n_tensors, &tr->n_params);
    tr->n_full = tr->n_params;
    if (mesh && (mesh->zero < 0 || mesh->zero > 2)) {
        pr_trainer_destroy(tr);
        return pr__fail(err, PR_ERR_ARG, "mesh zero stage %d: 0, 1 or 2", mesh->zero);
    }
    if (mesh && mesh->bf16_grad_reduce != 0 && mesh->bf16_grad_reduce != 1) {
        pr_trainer_destroy(tr);
        return pr__fail(err, PR_ERR_ARG, "mesh bf16_grad_reduce %d: 0 or 1", mesh->bf16_grad_reduce);
    }
    pr__plan_slices(tr, mesh && mesh->dp > 1 ? mesh->zero : 0, mesh ? mesh->dp : 1, mesh ? mesh->dp_rank : 0);
    size_t reals = tr->n_pad + 3 * tr->slice_cap, weight_bytes = 0;
    /* the kernels read the masters themselves where those are the activations' type and whole */
    tr->own_weights = be->act_bytes != sizeof(pr_real) || tr->zero;
    if (reals < tr->n_pad || !pr__mul_size(reals, sizeof(pr_real), &arena_bytes) ||
        (tr->own_weights && !pr__mul_size(tr->n_pad, be->act_bytes, &weight_bytes))) {
        pr_trainer_destroy(tr);
        return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: the parameter arena's size overflows");
    }
    if (mesh && (st = pr__build_shards(tr, err))) {
        pr_trainer_destroy(tr);
        return st;
    }
    tr->arena = (pr_real *)be->alloc(be, arena_bytes, PR_TIER_DEVICE);
    if (tr->own_weights) tr->weights = be->alloc(be, weight_bytes, PR_TIER_DEVICE);
    tr->inv_freq = (pr_real *)be->alloc(be, sizeof(pr_real) * (size_t)(cfg->head_dim / 2), PR_TIER_DEVICE);
    if (!tr->arena || (tr->own_weights && !tr->weights) || !tr->inv_freq) {
        const size_t n_params = tr->n_params, bytes = arena_bytes + weight_bytes;
        pr_trainer_destroy(tr);
        return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: cannot allocate %.2f GiB (%zu bytes) for %zu parameters, their "
                        "gradients and AdamW state", (double)bytes / (1 << 30), bytes, n_params);
    }
    /* taken now, so that no rank leaves a collective for want of memory mid-step (any trainer may
       step over a dp communicator: pr_trainer_compute_grads_dp) */
    tr->stage = (pr_real *)be->alloc(be, sizeof(pr_real) * PR__STAGE_REALS, PR_TIER_DEVICE);
    tr->stage_host = (pr_real *)PR_MALLOC(sizeof(pr_real) * PR__STAGE_REALS);
    const size_t pieces = pr__norm_pieces_cap(tr) * (size_t)(tr->zero ? mesh->dp : 1);
    tr->norm_pieces = (double *)PR_MALLOC(sizeof(double) * pieces);
    tr->norm_pieces_dev = tr->zero ? (double *)be->alloc(be, sizeof(double) * pieces, PR_TIER_DEVICE) : NULL;
    if (!tr->stage || !tr->stage_host || !tr->norm_pieces || (tr->zero && !tr->norm_pieces_dev)) {
        pr_trainer_destroy(tr);
        return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: out of memory for the collectives' staging buffers");
    }
    if (mesh && mesh->bf16_grad_reduce && mesh->dp > 1) {
        tr->grad_wire_n = pr__grad_wire_size(tr, mesh->dp);
        tr->grad_wire = (uint16_t *)be->alloc(be, sizeof(uint16_t) * tr->grad_wire_n, PR_TIER_DEVICE);
        if (!tr->grad_wire) {
            pr_trainer_destroy(tr);
            return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: out of memory for the bf16 gradient buffer");
        }
    }
    if (cfg->num_experts) {
        tr->expert_load = (double *)PR_MALLOC(sizeof(double) * (size_t)cfg->num_hidden_layers * (size_t)cfg->num_experts);
        if (!tr->expert_load) {
            pr_trainer_destroy(tr);
            return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_create: out of memory");
        }
        memset(tr->expert_load, 0, sizeof(double) * (size_t)cfg->num_hidden_layers * (size_t)cfg->num_experts);
    }
    tr->params = tr->arena;
    tr->grads = tr->params + tr->slice_cap;
    tr->adam_m = tr->grads + tr->n_pad;
    tr->adam_v = tr->adam_m + tr->slice_cap;
    be->zero(be, tr->arena, arena_bytes);
    if (tr->own_weights) be->zero(be, tr->weights, weight_bytes);     /* the padding past the model stays zero */
    else tr->weights = tr->params;
    pr_real host_freq[PR__MAX_HEAD_DIM / 2];
    pr__rope_frequencies(cfg, host_freq);
    be->upload_reals(be, tr->inv_freq, host_freq, (size_t)(cfg->head_dim / 2));
    *out = tr;
    return PR_OK;
}

PRDEF pr_status pr_trainer_create(pr_trainer **out, const pr_config *cfg, const pr_backend *be, pr_error *err) {
    return pr__trainer_new(out, cfg, be, NULL, err);
}

static void pr__chunks_free(pr_trainer *tr, pr__chunk *c) {
    for (pr__chunk *n; c; c = n) {
        n = c->next;
        tr->chunk_bytes -= c->cap;
        tr->be->release(tr->be, c->mem, PR_TIER_DEVICE);
        PR_FREE(c);
    }
}

/* A device allocation of `bytes`, else NULL. Where the device has no room, the spare chunks (each
   too small for the caller, or it would have taken one) go back to the backend first, after the
   device's queued work, so that no kernel or copy still reads one. */
static void *pr__device_alloc(pr_trainer *tr, size_t bytes) {
    void *p = tr->be->alloc(tr->be, bytes, PR_TIER_DEVICE);
    if (!p && tr->spare) {
        tr->be->sync(tr->be);
        pr__chunks_free(tr, tr->spare);
        tr->spare = NULL;
        p = tr->be->alloc(tr->be, bytes, PR_TIER_DEVICE);
    }
    return p;
}

PRDEF void pr_trainer_destroy(pr_trainer *tr) {
    if (!tr) return;
    pr__chunks_free(tr, tr->prefix_arena.head);
    pr__chunks_free(tr, tr->step_arena.head);
    for (int i = 0; tr->mb_arena && i < tr->n_mb_arena; i++) pr__chunks_free(tr, tr->mb_arena[i].head);
    PR_FREE(tr->mb_arena);
    pr__chunks_free(tr, tr->spare);
    if (tr->pool) tr->be->release(tr->be, tr->pool, PR_TIER_HOST);
    for (int i = 0; i < PR__SLOTS; i++) if (tr->slot[i]) tr->be->release(tr->be, tr->slot[i], PR_TIER_DEVICE);
    if (tr->own_weights && tr->weights) tr->be->release(tr->be, tr->weights, PR_TIER_DEVICE);
    if (tr->arena) tr->be->release(tr->be, tr->arena, PR_TIER_DEVICE);
    if (tr->inv_freq) tr->be->release(tr->be, tr->inv_freq, PR_TIER_DEVICE);
    if (tr->stage) tr->be->release(tr->be, tr->stage, PR_TIER_DEVICE);
    PR_FREE(tr->stage_host);
    PR_FREE(tr->norm_pieces);
    if (tr->norm_pieces_dev) tr->be->release(tr->be, tr->norm_pieces_dev, PR_TIER_DEVICE);
    if (tr->grad_wire) tr->be->release(tr->be, tr->grad_wire, PR_TIER_DEVICE);
    PR_FREE(tr->tensors);
    PR_FREE(tr->layer_off);
    PR_FREE(tr->expert_load);
    PR_FREE(tr->shard);
    if (tr->dp_team) tr->dp_team->destroy(tr->dp_team);
    PR_FREE(tr);
}

PRDEF const pr_config *pr_trainer_config(const pr_trainer *tr) { return tr ? &tr->model : NULL; }
PRDEF int pr_trainer_tensor_count(const pr_trainer *tr) { return tr ? tr->n_tensors : 0; }
PRDEF const pr_tensor_info *pr_trainer_tensor(const pr_trainer *tr, int i) {
    return tr && i >= 0 && i < tr->n_tensors ? &tr->tensors[i] : NULL;
}
PRDEF size_t pr_trainer_param_count(const pr_trainer *tr) { return tr ? tr->n_params : 0; }
PRDEF size_t pr_trainer_state_bytes(const pr_trainer *tr) {
    if (!tr) return 0;
    const size_t weights = tr->own_weights ? tr->be->act_bytes * tr->n_pad : 0;
    return sizeof(pr_real) * (tr->n_pad + 3 * tr->slice_cap) + weights;
}

/* The master weights from a host copy of this rank's whole arena (n_params reals): they take
   their slice, and a separate copy of the weights the kernels read takes all of it. */
static void pr__weights_take(pr_trainer *tr, const pr_real *local) {
    tr->be->upload_reals(tr->be, tr->params, local + tr->slice_lo, tr->slice_n);
    if (tr->own_weights) tr->be->upload_acts(tr->be, tr->weights, local, tr->n_params);
}

/* After an update of the masters: this rank's slice into the weights the kernels read, then under
   ZeRO every rank's slice to every rank (in the activations' type: half the bytes of fp32 on the
   GPU). Collective over dp under ZeRO. */
static pr_status pr__weights_publish(pr_trainer *tr, pr_error *err) {
    if (!tr->own_weights) return PR_OK;
    const pr_backend *be = tr->be;
    be->reals_to_acts(be, (char *)tr->weights + tr->slice_lo * be->act_bytes, tr->params, tr->slice_n);
    if (!tr->zero) return PR_OK;
    pr_comm *c = tr->mesh->dp_comm;
    void *mine = (char *)tr->weights + (size_t)tr->mesh->dp_rank * tr->slice_cap * be->act_bytes;
    return c->all_gather(c, tr->weights, mine, tr->slice_cap, pr__act_type(tr), err);
}

/* A whole-arena copy's arguments: a trainer, a buffer, and the arena's count. */
static pr_status pr__check_count(const pr_trainer *tr, const void *buf, size_t n, const char *fn, pr_error *err) {
    if (!tr || !buf) return pr__fail(err, PR_ERR_ARG, "%s: NULL %s", fn, tr ? "buffer" : "trainer");
    if (n != tr->n_params)
        return pr__fail(err, PR_ERR_ARG, "%s: buffer holds %zu reals, the model has %zu parameters", fn, n, tr->n_params);
    return PR_OK;
}
PRDEF pr_status pr_trainer_get_params(const pr_trainer *tr, pr_real *dst, size_t n, pr_error *err) {
    pr_status st = pr__check_count(tr, dst, n, "pr_trainer_get_params", err);
    if (!st && tr->zero)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "pr_trainer_get_params: under ZeRO a rank holds a 1/%d slice of the master weights; "
                        "pr_trainer_get_full gathers them", tr->mesh->dp);
    if (!st) tr->be->download_reals(tr->be, dst, tr->params, n);
    return st;
}
PRDEF pr_status pr_trainer_set_params(pr_trainer *tr, const pr_real *src, size_t n, pr_error *err) {
    pr_status st = pr__check_count(tr, src, n, "pr_trainer_set_params", err);
    if (!st) pr__weights_take(tr, src);
    return st;
}
PRDEF pr_status pr_trainer_get_grads(const pr_trainer *tr, pr_real *dst, size_t n, pr_error *err) {
    pr_status st = pr__check_count(tr, dst, n, "pr_trainer_get_grads", err);
    if (!st) tr->be->download_reals(tr->be, dst, tr->grads, n);
    return st;
}

/* splitmix64 drives a Box-Muller normal: the same seed gives the same weights on every machine. */
#define PR__SPLITMIX_STEP 0x9E3779B97F4A7C15ull
static uint64_t pr__splitmix(uint64_t *s) {
    uint64_t z = (*s += PR__SPLITMIX_STEP);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double pr__normal(uint64_t *s) {
    double u1 = ((pr__splitmix(s) >> 11) + 1.0) / 9007199254740993.0;   /* (0,1] */
    double u2 = (pr__splitmix(s) >> 11) / 9007199254740992.0;
    return sqrt(-2 * log(u1)) * cos(2 * 3.14159265358979323846 * u2);
}

/* Local tensor i's rectangle in its full tensor: rows [r[0], r[1]), columns [r[2], r[3]). */
static void pr__shard_rect(const pr_trainer *tr, int i, int64_t r[4]) {
    const pr_tensor_info *t = &tr->tensors[i];
    r[0] = tr->mesh ? tr->shard[i].row0 : 0;
    r[1] = r[0] + t->shape[0];
    r[2] = tr->mesh ? tr->shard[i].col0 : 0;
    r[3] = r[2] + (t->ndim == 2 ? t->shape[1] : 1);
}

static pr_status pr__ranks_agree(pr_trainer *tr, pr_comm *c, pr_status st, int *origin, const char *fn, const char *then, pr_error *err);

PRDEF pr_status pr_trainer_init_params(pr_trainer *tr, uint64_t seed, pr_error *err) {
    if (!tr) return pr__fail(err, PR_ERR_ARG, "pr_trainer_init_params: NULL trainer");
    /* drawn over the full model, so every mesh shard holds its part of the same weights */
    int count = tr->n_tensors;
    pr_tensor_info *table = tr->mesh ? pr__full_table(tr, &count, NULL) : tr->tensors;
    pr_real *host = (pr_real *)PR_MALLOC(sizeof(pr_real) * (tr->n_params + 1));
    pr_status st = !host || !table ? pr__fail(err, PR_ERR_NOMEM, "pr_trainer_init_params: out of memory") : PR_OK;
    /* on a mesh every rank draws or none does: a rank gone from here would leave its peers waiting
       in their first step's collectives */
    if (tr->mesh) st = pr__ranks_agree(tr, tr->mesh->world, st, NULL, "pr_trainer_init_params", "no rank draws its weights", err);
    if (st) {
        PR_FREE(host);
        if (tr->mesh) PR_FREE(table);
        return st;
    }
    /* One stream over the full model's matrices in table order, two draws per value. splitmix64's
       state after k draws is seed + k * its increment, so each value starts from its own state, set
       by its index in the full tensor: a rank draws only the values of its shard, and the loop runs
       in parallel, with the bits of the serial one. */
    uint64_t drawn = 0;
    for (int j = 0, i = 0; j < count; j++) {
        const pr_tensor_info *ft = &table[j];
        const uint64_t base = seed + drawn * PR__SPLITMIX_STEP;
        if (ft->ndim == 2) drawn += 2 * ft->numel;
        if (i == tr->n_tensors || strcmp(tr->tensors[i].name, ft->name)) continue;     /* the local tensors: a subsequence */
        int64_t r[4];
        pr__shard_rect(tr, i, r);
        const long long n = (long long)tr->tensors[i].numel, cols = r[3] - r[2], full_cols = ft->ndim == 2 ? ft->shape[1] : 1;
        pr_real *dst = host + tr->tensors[i++].offset;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (long long e = 0; e < n; e++) {
            const uint64_t at = (uint64_t)((r[0] + e / cols) * full_cols + r[2] + e % cols);
            uint64_t s = base + 2 * at * PR__SPLITMIX_STEP;
            dst[e] = ft->ndim == 2 ? (pr_real)(0.02 * pr__normal(&s)) : (pr_real)1;
        }
    }
    pr__weights_take(tr, host);
    PR_FREE(host);
    if (tr->mesh) PR_FREE(table);
    tr->be->zero(tr->be, tr->grads, (tr->n_pad + 2 * tr->slice_cap) * sizeof(pr_real));
    tr->grads_scattered = 0;
    tr->adam_step = 0;
    return PR_OK;
}

/* ---------------------------------------------------------------- 3.4 Activation memory */
#define PR__CHUNK_BYTES ((size_t)16 << 20)
#define PR__ALIGN 256

/* n elements of elem_bytes each from arena a. Returns NULL and sets alloc_failed
   when memory runs out, so the schedule finishes its straight-line code and reports one error.
   A new chunk comes from the smallest spare that fits. The first that fits let a small tensor take
   a layer's block, whose next request then took new memory: `train_cuda --bench` with seven
   Llama3-8B layers held 36,709 MiB of chunks for 26,171 MiB of live tensors that way and ran out
   of an H100's memory (26,523 MiB with the smallest fit). */
static void *pr__elems(pr_trainer *tr, pr__arena *a, size_t n, size_t elem_bytes) {
    size_t bytes;
    if (!pr__mul_size(n ? n : 1, elem_bytes, &bytes) || bytes > SIZE_MAX - PR__ALIGN) {
        tr->alloc_failed = 1;
        return NULL;
    }
    bytes = (bytes + PR__ALIGN - 1) / PR__ALIGN * PR__ALIGN;
    pr__chunk *c = a->tail;
    if (!c || c->cap - c->used < bytes) {
        pr__chunk **spare = NULL;
        for (pr__chunk **s = &tr->spare; *s; s = &(*s)->next)
            if ((*s)->cap >= bytes && (!spare || (*s)->cap < (*spare)->cap)) spare = s;
        if (spare) {
            c = *spare;
            *spare = c->next;
        } else {
            c = (pr__chunk *)PR_MALLOC(sizeof *c);
            size_t cap = bytes > PR__CHUNK_BYTES ? bytes : PR__CHUNK_BYTES;
            char *mem = c ? (char *)pr__device_alloc(tr, cap) : NULL;
            if (!mem) {
                PR_FREE(c);
                tr->alloc_failed = 1;
                return NULL;
            }
            c->mem = mem;
            c->cap = cap;
            tr->chunk_bytes += cap;
        }
        c->used = 0;
        c->next = NULL;
        if (a->tail) a->tail->next = c;
        else a->head = c;
        a->tail = c;
    }
    void *p = c->mem + c->used;
    c->used += bytes;
    a->used += bytes;
    tr->live_bytes += bytes;
    if (tr->live_bytes > tr->phase_peak[tr->phase]) tr->phase_peak[tr->phase] = tr->live_bytes;
    return p;
}

static void *pr__act(pr_trainer *tr, pr__arena *a, size_t n) { return pr__elems(tr, a, n, tr->be->act_bytes); }
static void *pr__stat(pr_trainer *tr, pr__arena *a, size_t n) { return pr__elems(tr, a, n, tr->be->stat_bytes); }
static void *pr__stat_at(const pr_trainer *tr, void *base, size_t elems) { return (char *)base + elems * tr->be->stat_bytes; }
static pr_real *pr__reals(pr_trainer *tr, pr__arena *a, size_t n) { return (pr_real *)pr__elems(tr, a, n, sizeof(pr_real)); }
/* An activation pointer `elems` elements on. */
static void *pr__act_at(const pr_trainer *tr, void *base, size_t elems) { return (char *)base + elems * tr->be->act_bytes; }

/* Everything in the arena is dead; its chunks go back to the spares, for any arena to reuse. */
static void pr__arena_reset(pr_trainer *tr, pr__arena *a) {
    if (a->tail) {
        a->tail->next = tr->spare;
        tr->spare = a->head;
    }
    a->head = a->tail = NULL;
    tr->live_bytes -= a->used;
    a->used = 0;
}

/* Activation memory ran out: what was live (offload's slots included) beside what the chunks and
   the slots held tells a full device from a fragmented one. */
static pr_status pr__act_nomem(const pr_trainer *tr, pr_error *err, const char *what, int rows) {
    size_t slots = 0;
    for (int s = 0; s < PR__SLOTS; s++) slots += tr->slot_cap[s];
    return pr__fail(err, PR_ERR_NOMEM, "out of activation memory %s %d rows (%.0f MiB live; %.0f MiB in chunks, %.0f MiB in offload slots)",
                    what, rows, (double)tr->live_bytes / 1048576.0, (double)tr->chunk_bytes / 1048576.0, (double)slots / 1048576.0);
}

static void pr__enter_phase(pr_trainer *tr, int phase) {
    tr->phase = phase;
    if (tr->live_bytes > tr->phase_peak[phase]) tr->phase_peak[phase] = tr->live_bytes;
}

/* ---------------------------------------------------------------- 3.5 A pass: every layer's saved tensors, the backward's scratch */
/* The next `count` elements of `elem` bytes in a block being laid out from `base` (NULL: sizes only). */
static void *pr__carve(char *base, size_t *off, size_t count, size_t elem) {
    void *p = base ? base + *off : NULL;
    *off += (count * elem + PR__ALIGN - 1) / PR__ALIGN * PR__ALIGN;
    return p;
}

/* Lays out the part of a layer's block (below) that the layer's forward computes from its input,
   for n rows, at base: everything its backward reads besides its input and its K/V. Returns its
   bytes; base NULL only measures. */
static size_t pr__layer_rebuilt(const pr_trainer *tr, char *base, size_t n, pr__layer_acts *x) {
    const pr_config *c = &tr->cfg;
    const size_t C = c->hidden_size, F = c->intermediate_size, NH = c->num_attention_heads, NKV = c->num_key_value_heads;
    const size_t qd = NH * c->head_dim, kvd = NKV * c->head_dim, A = tr->be->act_bytes, S = tr->be->stat_bytes;
    pr__layer_acts t;
    if (!x) x = &t;
    size_t off = 0;
    x->ln1 = pr__carve(base, &off, n * C, A); x->ln1_rstd = pr__carve(base, &off, n, S);
    if (c->qk_norm) {
        x->q_pre = pr__carve(base, &off, n * qd, A); x->k_pre = pr__carve(base, &off, n * kvd, A);
        x->q_rstd = pr__carve(base, &off, n * NH, S); x->k_rstd = pr__carve(base, &off, n * NKV, S);
    } else {
        x->q_pre = x->k_pre = x->q_rstd = x->k_rstd = NULL;
    }
    x->q = pr__carve(base, &off, n * qd, A);
    x->att = pr__carve(base, &off, n * qd, A); x->lse = pr__carve(base, &off, n * NH, S);
    x->x_mid = pr__carve(base, &off, n * C, A);
    x->ln2 = pr__carve(base, &off, n * C, A); x->ln2_rstd = pr__carve(base, &off, n, S);
    if (c->num_experts) {
        const size_t slots = n * (size_t)c->num_experts_per_tok, Fm = c->moe_intermediate_size;
        x->gu = pr__carve(base, &off, slots * 2 * Fm, A); x->h = pr__carve(base, &off, slots * Fm, A);
        x->ye = pr__carve(base, &off, slots * C, A);
        x->router = pr__carve(base, &off, n * (size_t)c->num_experts, A);
    } else {
        x->gu = pr__carve(base, &off, n * 2 * F, A); x->h = pr__carve(base, &off, n * F, A);
        x->ye = x->router = NULL;
    }
    return off;
}

/* Lays out one layer's saved tensors for n rows, all but its K and V, in one block at base: the
   layer's input (the residual stream entering it) and, when `whole`, everything its backward
   reads besides K/V (without: the input alone, what a pass under recompute keeps). A block moves
   between memory tiers as a unit (the prefix's dormant state). Returns its bytes; base NULL only
   measures. */
static size_t pr__layer_block(const pr_trainer *tr, char *base, size_t n, int whole, pr__layer_acts *x, void **res_in) {
    size_t off = 0;
    void *in = pr__carve(base, &off, n * (size_t)tr->cfg.hidden_size, tr->be->act_bytes);
    if (res_in) *res_in = in;
    if (whole) off += pr__layer_rebuilt(tr, base ? base + off : NULL, n, x);
    return off;
}

/* A pass of N rows: every layer's block (unless `blocks` is 0: the offloading prefix pass places
   them itself), every layer's K and V (unless it keeps the input alone; a prefix pass's are its
   rows of `path`, from row `row`), and the final residual res[L]. Under recompute the region the
   blocks' other tensors share comes from pr__pass_rebuilt_alloc. */
static pr_status pr__pass_alloc(pr_trainer *tr, pr__arena *a, pr__pass *ps, int N, int blocks, const pr__kv_path *path,
                                int row, pr_error *err) {
    const pr_config *c = &tr->cfg;
    const size_t n = (size_t)N, kvd = (size_t)c->num_key_value_heads * c->head_dim;
    const size_t n_kv = ps->cp_kv_rows > N ? (size_t)ps->cp_kv_rows : n;
    const int L = c->num_hidden_layers;
    ps->N = N;
    ps->acts = (pr__layer_acts *)PR_MALLOC(sizeof(pr__layer_acts) * (size_t)L);
    ps->res = (void **)PR_MALLOC(sizeof(void *) * (size_t)(L + 1));
    if (!ps->acts || !ps->res) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for a pass of %d rows", N);
    memset(ps->acts, 0, sizeof(pr__layer_acts) * (size_t)L);
    memset(ps->res, 0, sizeof(void *) * (size_t)(L + 1));
    const int whole = ps->keep == PR__KEEP_ALL;
    const size_t block = pr__layer_block(tr, NULL, n, whole, NULL, NULL);
    for (int l = 0; l < L; l++) {
        pr__layer_acts *x = &ps->acts[l];
        char *b = blocks ? (char *)pr__elems(tr, a, block, 1) : NULL;
        if (b) pr__layer_block(tr, b, n, whole, x, &ps->res[l]);
        if (path) {
            x->k = pr__act_at(tr, path->k[l], (size_t)row * kvd);
            x->v = pr__act_at(tr, path->v[l], (size_t)row * kvd);
        } else if (ps->keep != PR__KEEP_INPUT) {
            x->k = pr__act(tr, a, n_kv * kvd);
            x->v = pr__act(tr, a, n_kv * kvd);
        }
    }
    ps->res[L] = pr__act(tr, a, n * c->hidden_size);
    if (tr->alloc_failed) return pr__act_nomem(tr, err, "for a pass of", N);
    if (c->num_experts) {        /* the routing tables, host memory, one block per layer */
        const size_t E = (size_t)c->num_experts, slots = n * (size_t)c->num_experts_per_tok;
        ps->route = (pr__route *)PR_MALLOC(sizeof(pr__route) * (size_t)L);
        if (!ps->route) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for a pass of %d rows", N);
        memset(ps->route, 0, sizeof(pr__route) * (size_t)L);
        for (int l = 0; l < L; l++) {
            pr__route *rt = &ps->route[l];
            char *m = (char *)PR_MALLOC(sizeof(double) * n + sizeof(pr_real) * (n * E + 2 * slots) + sizeof(int) * (E + 1 + slots));
            if (!m) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for the routing of %d rows", N);
            rt->wsum = (double *)m;
            rt->prob = (pr_real *)(rt->wsum + n);
            rt->w = rt->prob + n * E;
            rt->dw = rt->w + slots;
            rt->start = (int *)(rt->dw + slots);
            rt->row = rt->start + E + 1;
        }
    }
    return PR_OK;
}

/* Recompute: the one region from arena a that every layer of the pass writes its rebuilt
   tensors to (its forward fills it, its backward reads it, one layer at a time); with K/V when
   the pass keeps none. */
static pr_status pr__pass_rebuilt_alloc(pr_trainer *tr, pr__arena *a, pr__pass *ps, pr_error *err) {
    const pr_config *c = &tr->cfg;
    const size_t n = (size_t)ps->N, kvd = (size_t)c->num_key_value_heads * c->head_dim;
    const size_t n_kv = ps->cp_kv_rows > ps->N ? (size_t)ps->cp_kv_rows : n;
    pr__layer_acts shared;
    memset(&shared, 0, sizeof shared);
    char *b = (char *)pr__elems(tr, a, pr__layer_rebuilt(tr, NULL, n, NULL), 1);
    if (b) pr__layer_rebuilt(tr, b, n, &shared);
    if (ps->keep == PR__KEEP_INPUT) {
        shared.k = pr__act(tr, a, n_kv * kvd);
        shared.v = pr__act(tr, a, n_kv * kvd);
    }
    if (tr->alloc_failed) return pr__act_nomem(tr, err, "to recompute a pass of", ps->N);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        pr__layer_acts *x = &ps->acts[l];
        void *k = x->k, *v = x->v;
        *x = shared;
        if (ps->keep == PR__KEEP_INPUT_KV) { x->k = k; x->v = v; }
    }
    return PR_OK;
}

static void pr__pass_free_host(pr__pass *ps, int L) {
    if (ps->route)
        for (int l = 0; l < L; l++) PR_FREE(ps->route[l].wsum);   /* one allocation per layer, from wsum */
    PR_FREE(ps->route);
    PR_FREE(ps->acts);
    PR_FREE(ps->res);
    ps->route = NULL;
    ps->acts = NULL;
    ps->res = NULL;
}

/* The scratch for the backward of pass ps (allocated, its rows known). */
static pr_status pr__bwd_scratch_alloc(pr_trainer *tr, pr__arena *a, pr__bwd_scratch *s, const pr__pass *ps, pr_error *err) {
    const pr_config *c = &tr->cfg;
    const int N = ps->N;
    size_t n = (size_t)N, C = c->hidden_size, F = c->intermediate_size;
    size_t qd = (size_t)c->num_attention_heads * c->head_dim, kvd = (size_t)c->num_key_value_heads * c->head_dim;
    memset(s, 0, sizeof *s);
    s->dres = pr__act(tr, a, n * C); s->dln = pr__act(tr, a, n * C);
    s->dq = pr__act(tr, a, n * qd); s->dk = pr__act(tr, a, n * kvd); s->dv = pr__act(tr, a, n * kvd);
    if (c->qk_norm) { s->dq_pre = pr__act(tr, a, n * qd); s->dk_pre = pr__act(tr, a, n * kvd); }
    s->datt = pr__act(tr, a, n * qd);
    size_t hidden = n * F;
    if (c->num_experts) {
        const size_t slots = n * (size_t)c->num_experts_per_tok;
        hidden = slots * (size_t)c->moe_intermediate_size;
        s->dye = pr__act(tr, a, slots * C); s->dxe = pr__act(tr, a, slots * C);
        s->dlogit = pr__act(tr, a, n * (size_t)c->num_experts);
    }
    s->dh = pr__act(tr, a, hidden); s->dgu = pr__act(tr, a, 2 * hidden);
    if (ps->keep != PR__KEEP_ALL) s->fwd_out = pr__act(tr, a, n * C);
    if (ps->keep == PR__KEEP_INPUT_KV) {
        const size_t n_kv = ps->cp_kv_rows > N ? (size_t)ps->cp_kv_rows : n;
        s->fwd_k = pr__act(tr, a, n_kv * kvd);
        s->fwd_v = pr__act(tr, a, n_kv * kvd);
    }
    if (tr->alloc_failed) return pr__act_nomem(tr, err, "for a backward of", N);
    return PR_OK;
}

static void pr__zero_acts(pr_trainer *tr, void *p, size_t n) { tr->be->zero(tr->be, p, n * tr->be->act_bytes); }


/* ---------------------------------------------------------------- 3.6 One layer, forward and backward */
/* RoPE over the pass's rows, forward or (bwd) backward: under CP each piece at its own positions. */
static void pr__rope(pr_trainer *tr, const pr__pass *ps, void *x, int heads, int bwd) {
    const pr_backend *be = tr->be;
    const int HS = tr->cfg.head_dim;
    void (*rope)(const pr_backend *, void *, const pr_seq_layout *, int, int, const pr_real *) = bwd ? be->rope_bwd : be->rope_fwd;
    if (!ps->cp_cut) {
        rope(be, x, &ps->lay, heads, HS, tr->inv_freq);
        return;
    }
    for (int j = 0; j < ps->lay.n_seg; j++)
        for (int half = 0; half < 2; half++) {
            pr_seq_layout lay;
            int off[2];
            const int row = pr__cp_piece(ps, j, half, &lay, off);
            if (off[1]) rope(be, pr__act_at(tr, x, (size_t)row * heads * HS), &lay, heads, HS, tr->inv_freq);
        }
}

/* Layer l forward over the pass's rows; kp/vp are the cached prefix K/V (Phase B) or NULL. */
static void pr__layer_forward(pr_trainer *tr, pr__pass *ps, int l, const void *kp, const void *vp) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int N = ps->N, C = c->hidden_size, F = c->intermediate_size, NH = c->num_attention_heads;
    const int NKV = c->num_key_value_heads, HS = c->head_dim, qd = NH * HS, kvd = NKV * HS;
    pr__layer_w w = pr__layer_weights(tr, l);
    pr__layer_acts *a = &ps->acts[l];
    const void *x = ps->res[l];
    void *y = ps->res[l + 1];

    be->rmsnorm_fwd(be, a->ln1, a->ln1_rstd, x, w.ln1, N, C, c->rms_norm_eps);
    if (c->qk_norm) {            /* Qwen3: RMSNorm over each head's HS values, before RoPE */
        be->matmul_fwd(be, a->q_pre, a->ln1, w.wq, N, C, qd);
        be->matmul_fwd(be, a->k_pre, a->ln1, w.wk, N, C, kvd);
        be->rmsnorm_fwd(be, a->q, a->q_rstd, a->q_pre, w.qn, N * NH, HS, c->rms_norm_eps);
        be->rmsnorm_fwd(be, a->k, a->k_rstd, a->k_pre, w.kn, N * NKV, HS, c->rms_norm_eps);
    } else {
        be->matmul_fwd(be, a->q, a->ln1, w.wq, N, C, qd);
        be->matmul_fwd(be, a->k, a->ln1, w.wk, N, C, kvd);
    }
    be->matmul_fwd(be, a->v, a->ln1, w.wv, N, C, kvd);
    pr__rope(tr, ps, a->q, NH, 0);
    pr__rope(tr, ps, a->k, NKV, 0);
    pr__attention_fwd(tr, ps, a, kp, vp);
    be->matmul_fwd(be, a->x_mid, a->att, w.wo, N, qd, C);      /* x_mid = x + att @ wo^T */
    pr__tp_sum(tr, a->x_mid, (size_t)N * C);                    /* row-parallel: the heads' shares */
    be->add(be, a->x_mid, x, (size_t)N * C);
    be->rmsnorm_fwd(be, a->ln2, a->ln2_rstd, a->x_mid, w.ln2, N, C, c->rms_norm_eps);
    if (c->num_experts) {
        pr__moe_forward(tr, ps, l, &w, y);                     /* y = x_mid + sum_k w_k expert_k(ln2) */
    } else {
        be->matmul_fwd(be, a->gu, a->ln2, w.wgu, N, C, 2 * F);  /* [gate | up] = ln2 @ [wg; wu]^T */
        be->swiglu_fwd(be, a->h, a->gu, N, F);
        be->matmul_fwd(be, y, a->h, w.wd, N, F, C);            /* y = x_mid + h @ wd^T */
    }
    pr__tp_sum(tr, y, (size_t)N * C);                           /* the columns' (or experts') shares */
    be->add(be, y, a->x_mid, (size_t)N * C);
}

/* Recompute: layer l's forward once more from its kept input, rebuilding the tensors its backward
   reads in the pass's shared region. It is the same forward on the same input, so what it writes
   equals, bit for bit, what the first forward wrote. Its output goes to scratch (the next layer's
   input stays as kept) and so do its K/V on a pass that keeps them: the prefix's K/V cache, which
   a hook may have rewritten, stays what Phase B read and what the backward reads, while the
   attention forward sees the K/V the first forward saw. No hook fires, and the MoE routing
   statistics, gathered after a pass's forward and not in the layer, are not counted again. The
   collectives inside (TP sums, the CP region's gathers, EP's all-to-alls) run as in the first
   forward, on every rank alike, since every rank rebuilds the same layer at the same point. */
static void pr__layer_rebuild(pr_trainer *tr, pr__pass *ps, int l, pr__bwd_scratch *s, const void *kp, const void *vp) {
    pr__layer_acts *a = &ps->acts[l];
    void *k = a->k, *v = a->v, *out = ps->res[l + 1];
    if (ps->keep == PR__KEEP_INPUT_KV) { a->k = s->fwd_k; a->v = s->fwd_v; }
    ps->res[l + 1] = s->fwd_out;
    pr__layer_forward(tr, ps, l, kp, vp);
    a->k = k; a->v = v; ps->res[l + 1] = out;
}

/* Layer l backward. On entry s->dres holds d(layer output); on return d(layer input). kv: the
   K/V gradients the attention backward writes (the pass's own, holding whatever must be injected,
   and in Phase B the cached prefix's). A pass under recompute first rebuilds the layer's saved
   tensors. */
static void pr__layer_backward(pr_trainer *tr, pr__pass *ps, int l, pr__bwd_scratch *s, const pr__kv_grads *kv) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int N = ps->N, C = c->hidden_size, F = c->intermediate_size, NH = c->num_attention_heads;
    const int NKV = c->num_key_value_heads, HS = c->head_dim, qd = NH * HS, kvd = NKV * HS;
    pr__layer_w w = pr__layer_weights(tr, l);
    pr__layer_g g = pr__layer_grads(tr, l);
    pr__layer_acts *a = &ps->acts[l];
    const size_t nC = (size_t)N * C, nF = (size_t)N * F;

    if (ps->keep != PR__KEEP_ALL) pr__layer_rebuild(tr, ps, l, s, kv->kp, kv->vp);
    if (c->num_experts) {
        pr__moe_backward(tr, ps, l, s, &w, &g);                /* s->dln = d(ln2) */
    } else {
        /* y = x_mid + h @ wd^T  (the residual passes dres through unchanged) */
        pr__zero_acts(tr, s->dh, nF);
        be->matmul_bwd(be, s->dh, g.wd, s->dres, a->h, w.wd, N, F, C);
        /* h = silu(gate) * up */
        be->swiglu_bwd(be, s->dgu, s->dh, a->gu, N, F);
        /* [gate | up] = ln2 @ [wg; wu]^T */
        pr__zero_acts(tr, s->dln, nC);
        be->matmul_bwd(be, s->dln, g.wgu, s->dgu, a->ln2, w.wgu, N, C, 2 * F);
        pr__tp_sum(tr, s->dln, nC);                             /* column-parallel: the inputs' shares */
    }
    /* ln2 = rmsnorm(x_mid): dres becomes d(x_mid) */
    be->rmsnorm_bwd(be, s->dres, g.ln2, s->dln, a->x_mid, w.ln2, a->ln2_rstd, N, C);
    /* x_mid = x + att @ wo^T */
    pr__zero_acts(tr, s->datt, (size_t)N * qd);
    be->matmul_bwd(be, s->datt, g.wo, s->dres, a->att, w.wo, N, qd, C);
    /* att = attention(q, [kp; k], [vp; v]) */
    pr__zero_acts(tr, s->dq, (size_t)N * qd);
    pr__attention_bwd(tr, ps, s, a, kv);
    /* q, k = rope(...) */
    void *dk = kv->dk, *dv = kv->dv;
    pr__rope(tr, ps, s->dq, NH, 1);
    pr__rope(tr, ps, dk, NKV, 1);
    void *dq = s->dq, *dkk = dk;
    if (c->qk_norm) {            /* q = q_norm(q_pre), k = k_norm(k_pre) */
        pr__zero_acts(tr, s->dq_pre, (size_t)N * qd);
        pr__zero_acts(tr, s->dk_pre, (size_t)N * kvd);
        be->rmsnorm_bwd(be, s->dq_pre, g.qn, s->dq, a->q_pre, w.qn, a->q_rstd, N * NH, HS);
        be->rmsnorm_bwd(be, s->dk_pre, g.kn, dk, a->k_pre, w.kn, a->k_rstd, N * NKV, HS);
        dq = s->dq_pre;
        dkk = s->dk_pre;
    }
    /* q_pre/k/v = ln1 @ w^T */
    pr__zero_acts(tr, s->dln, nC);
    be->matmul_bwd(be, s->dln, g.wq, dq, a->ln1, w.wq, N, C, qd);
    be->matmul_bwd(be, s->dln, g.wk, dkk, a->ln1, w.wk, N, C, kvd);
    be->matmul_bwd(be, s->dln, g.wv, dv, a->ln1, w.wv, N, C, kvd);
    pr__tp_sum(tr, s->dln, nC);
    /* ln1 = rmsnorm(x): dres becomes d(x) */
    be->rmsnorm_bwd(be, s->dres, g.ln1, s->dln, ps->res[l], w.ln1, a->ln1_rstd, N, C);
}

/* ---------------------------------------------------------------- 3.7 Batches and the loss head */
static void pr__batch_free(pr__batch *b) {
    PR_FREE(b->seg_off); PR_FREE(b->tokens); PR_FREE(b->real); PR_FREE(b->cp_cut); PR_FREE(b->cp_off);
    PR_FREE(b->head.row); PR_FREE(b->head.first); PR_FREE(b->head.flat); PR_FREE(b->head.target);
    PR_FREE(b->head.old_logp); PR_FREE(b->head.ref_logp); PR_FREE(b->head.advantage); PR_FREE(b->head.weight);
    memset(b, 0, sizeof *b);
}

/* Trained prefix tokens among positions j0 .. j1-1 (none without a prefix mask). */
static int pr__prefix_trained(const pr_group *g, int j0, int j1) {
    int n = 0;
    for (int j = j0 < 1 ? 1 : j0; g->prefix_mask && j < j1 && j < g->P; j++) n += g->prefix_mask[j];
    return n;
}

/* A group's loss slots: its suffix tokens as the flat arrays hold them, then with a prefix mask
   every trajectory's copy of the prefix (slot suffix_off[G] + i*P + j: token j for trajectory i). */
static long pr__loss_slots(const pr_group *g) {
    return (long)g->suffix_off[g->G] + (g->prefix_mask ? (long)g->G * g->P : 0);
}

/* A new (row, target) pair of the head, with no slot yet. */
static void pr__head_pair(pr__head_plan *h, int row, int32_t target) {
    h->row[h->M] = row;
    h->target[h->M] = target;
    h->M++;
    h->first[h->M] = h->n_slots;
}

/* A loss slot of the last pair: loss slot f, with its trajectory's advantage. */
static void pr__head_slot(pr__head_plan *h, const pr_real *tok_weight, long f, pr_real old_logp, const pr_real *ref_logp, pr_real adv) {
    const int k = h->n_slots++;
    h->flat[k] = f;
    h->old_logp[k] = old_logp;
    if (h->ref_logp) h->ref_logp[k] = *ref_logp;
    h->advantage[k] = adv;
    h->weight[k] = tok_weight[f];
    h->first[h->M] = h->n_slots;
}

/* Token j of suffix i, predicted by `row`: a pair of its own. */
static void pr__head_push(pr__head_plan *h, const pr_group *g, const pr_real *tok_weight, int row, int i, int j) {
    const long f = (long)g->suffix_off[i] + j;
    pr__head_pair(h, row, g->tokens[f]);
    pr__head_slot(h, tok_weight, f, g->old_logp[f], g->ref_logp ? g->ref_logp + f : NULL, g->advantage[i]);
}

/* Trained prefix token j (prefix_mask) for trajectories i0 .. i1-1, predicted by `row`: their loss
   slots, under one pair (a prefix batch holds every trajectory's, a full sequence its own). */
static void pr__head_push_prefix(pr__head_plan *h, const pr_group *g, const pr_real *tok_weight, int row, int i0, int i1, int j) {
    pr__head_pair(h, row, g->prefix[j]);
    for (int i = i0; i < i1; i++)
        pr__head_slot(h, tok_weight, (long)g->suffix_off[g->G] + (long)i * g->P + j, g->prefix_old_logp[j],
                      g->prefix_ref_logp ? g->prefix_ref_logp + j : NULL, g->advantage[i]);
}

/* Trajectories i0 .. i0+n-1 of group g as one batch of the given kind; for PR__BATCH_PREFIX
   prefix rows i0 .. i0+n-1 instead (the whole prefix, or one node of a prefix tree).
   Token j of suffix i is predicted by the row just before it: the last prefix row for j = 0
   (which the prefix batch that ends the prefix owns under reuse), else the row of suffix token j-1.
   A trained prefix token j is predicted by prefix row j-1, once for every trajectory: in the
   batch that holds that row (the prefix batch, for all G; a full sequence, for its own). */
static pr_status pr__batch_build(pr__batch *b, const pr_group *g, const pr_real *tok_weight, int i0, int n,
                                 pr__batch_kind kind, int packed, pr_error *err) {
    const int P = g->P, ends = kind == PR__BATCH_PREFIX && i0 + n == P;
    int smax = 0;
    long sum = 0;
    for (int i = i0; kind != PR__BATCH_PREFIX && i < i0 + n; i++) {
        if (g->suffix_len[i] > smax) smax = g->suffix_len[i];
        sum += g->suffix_len[i];
    }
    memset(b, 0, sizeof *b);
    int nseg = kind == PR__BATCH_PREFIX ? 1 : n;
    long rows = kind == PR__BATCH_PREFIX ? n : kind == PR__BATCH_FULL ? (long)n * (P + smax) : packed ? sum : (long)n * smax;
    const long trained = kind == PR__BATCH_PREFIX ? pr__prefix_trained(g, i0 + 1, i0 + n + 1)
                       : kind == PR__BATCH_FULL ? pr__prefix_trained(g, 0, P) : 0;
    long mrows = kind == PR__BATCH_PREFIX ? (ends ? g->G : 0) + g->G * trained : kind == PR__BATCH_FULL ? sum + n * trained
               : sum - n;              /* loss slots; the pairs are as many or fewer */
    b->N = (int)rows;
    b->n_traj = kind == PR__BATCH_PREFIX ? g->G : n;
    b->seg_off = (int *)PR_MALLOC(sizeof(int) * (size_t)(nseg + 1));
    b->tokens = (int32_t *)PR_MALLOC(sizeof(int32_t) * (size_t)rows);
    b->real = (uint8_t *)PR_MALLOC((size_t)(rows > 0 ? rows : 1));
    size_t mr = (size_t)(mrows > 0 ? mrows : 1);
    b->head.row = (int *)PR_MALLOC(sizeof(int) * mr);
    b->head.first = (int *)PR_MALLOC(sizeof(int) * (mr + 1));
    b->head.flat = (long *)PR_MALLOC(sizeof(long) * mr);
    b->head.target = (int32_t *)PR_MALLOC(sizeof(int32_t) * mr);
    b->head.old_logp = (pr_real *)PR_MALLOC(sizeof(pr_real) * mr);
    b->head.ref_logp = g->ref_logp ? (pr_real *)PR_MALLOC(sizeof(pr_real) * mr) : NULL;
    b->head.advantage = (pr_real *)PR_MALLOC(sizeof(pr_real) * mr);
    b->head.weight = (pr_real *)PR_MALLOC(sizeof(pr_real) * mr);
    if (!b->seg_off || !b->tokens || !b->real || !b->head.row || !b->head.first || !b->head.flat || !b->head.target || !b->head.old_logp ||
        (g->ref_logp && !b->head.ref_logp) || !b->head.advantage || !b->head.weight) {
        pr__batch_free(b);
        return pr__fail(err, PR_ERR_NOMEM, "out of host memory for a batch of %ld rows", rows);
    }
    b->head.first[0] = 0;
    b->lay.n_seg = nseg;
    b->lay.seg_off = b->seg_off;
    b->lay.pos0 = kind == PR__BATCH_SUFFIX ? P : kind == PR__BATCH_PREFIX ? i0 : 0;
    b->lay.n_prefix = b->lay.pos0 * (kind != PR__BATCH_FULL);
    if (kind == PR__BATCH_PREFIX) {
        b->seg_off[0] = 0; b->seg_off[1] = n;
        memcpy(b->tokens, g->prefix + i0, sizeof(int32_t) * (size_t)n);
        memset(b->real, 1, (size_t)n);
        for (int j = i0 + 1; trained && j <= i0 + n && j < P; j++)
            if (g->prefix_mask[j]) pr__head_push_prefix(&b->head, g, tok_weight, j - 1 - i0, 0, g->G, j);
        for (int i = 0; ends && i < g->G; i++) pr__head_push(&b->head, g, tok_weight, n - 1, i, 0);
        return PR_OK;
    }
    int off = 0;
    for (int s = 0; s < n; s++) {
        int i = i0 + s, S = g->suffix_len[i];
        int len = kind == PR__BATCH_FULL ? P + smax : packed ? S : smax;
        const int32_t *suf = g->tokens + g->suffix_off[i];
        int32_t *t = b->tokens + off;
        b->seg_off[s] = off;
        if (kind == PR__BATCH_FULL) {
            memcpy(t, g->prefix, sizeof(int32_t) * (size_t)P);
            t += P;
        }
        memcpy(t, suf, sizeof(int32_t) * (size_t)S);
        int used = (int)(t - (b->tokens + off)) + S;
        for (int r = used; r < len; r++) b->tokens[off + r] = 0;   /* padding */
        memset(b->real + off, 1, (size_t)used);
        memset(b->real + off + used, 0, (size_t)(len - used));
        for (int j = 1; trained && kind == PR__BATCH_FULL && j < P; j++)
            if (g->prefix_mask[j]) pr__head_push_prefix(&b->head, g, tok_weight, off + j - 1, i, i + 1, j);
        if (kind == PR__BATCH_FULL)
            for (int j = 0; j < S; j++) pr__head_push(&b->head, g, tok_weight, off + P - 1 + j, i, j);
        else
            for (int j = 1; j < S; j++) pr__head_push(&b->head, g, tok_weight, off + j - 1, i, j);
        off += len;
    }
    b->seg_off[n] = off;
    return PR_OK;
}

/* A pass's host view of a batch; path: the cached K/V above it, its first n_seg segments, that the
   pass reads (Phase B; a prefix pass below others), or NULL. */
static void pr__pass_init(pr_trainer *tr, pr__pass *p, const pr__batch *b, const pr__kv_path *path, int n_seg) {
    memset(p, 0, sizeof *p);
    p->lay = b->lay;
    p->tokens = b->tokens;
    p->real = b->real;
    p->cp_cut = b->cp_cut;
    p->cp_off = b->cp_off;
    p->cp_chunk = b->cp_chunk;
    p->cp_kv_rows = b->cp_kv_rows;
    if (path && n_seg && pr__cp(tr) > 1) {
        p->pre = path;
        p->pre_seg = n_seg;
        for (int i = 0; i < n_seg; i++) p->cp_pre_rows += path->seg[i].rows;
    }
}

/* Each row's log-sum-exp over the whole vocabulary and its target's logit, from the statistics
   (max, sum, z[target]) of n rows' logits over this rank's columns. Under TP each rank holds a
   slice of the vocabulary: the slices' pairs are gathered (each rank's in its own place of a sum
   over tp, so that every rank combines the same numbers in the same order) and the target's logit
   comes from the slice that has it (the others add 0). One slice combines to its own numbers
   bitwise. `gathered`: (2 tp + 1) n doubles. */
static void pr__head_lse(pr_trainer *tr, const double *stats, double *gathered, int n, double *lse, double *zt) {
    const int tp = pr__tp(tr);
    const size_t N = (size_t)n, r = tp > 1 ? (size_t)tr->mesh->tp_rank : 0;
    memset(gathered, 0, sizeof(double) * (2 * (size_t)tp + 1) * N);
    for (size_t m = 0; m < N; m++) {
        gathered[2 * r * N + m] = stats[3 * m];
        gathered[(2 * r + 1) * N + m] = stats[3 * m + 1];
        gathered[2 * (size_t)tp * N + m] = stats[3 * m + 2];
    }
    if (tp > 1) pr__sum_doubles(tr, tr->mesh->tp_comm, gathered, (2 * (size_t)tp + 1) * N);
    for (size_t m = 0; m < N; m++) {
        double mx = -INFINITY, sum = 0;
        for (size_t k = 0; k < (size_t)tp; k++) if (gathered[2 * k * N + m] > mx) mx = gathered[2 * k * N + m];
        for (size_t k = 0; k < (size_t)tp; k++) sum += gathered[(2 * k + 1) * N + m] * exp(gathered[2 * k * N + m] - mx);
        lse[m] = mx + log(sum);
        zt[m] = gathered[2 * (size_t)tp * N + m];
    }
}

/* The pass's embeddings into res[0]. Under TP each rank looks up the tokens of its vocabulary
   slice (zero rows for the others), and a sum over tp completes every row. */
static void pr__embed(pr_trainer *tr, pr__pass *p) {
    tr->be->embed_fwd(tr->be, p->res[0], p->tokens, pr__weight(tr, tr->off_embed), p->N, tr->cfg.hidden_size);
    pr__tp_sum(tr, p->res[0], (size_t)p->N * tr->cfg.hidden_size);
}

/* Final norm, LM head and GRPO loss for the plan's rows of x_final, fused with their backward:
   the loss of a row depends on nothing but that row's log-prob, so d(loss)/d(x_final) is known at
   once and is added into dx_final. Rows go through in chunks that bound the logits' memory. Under
   TP the LM head is split by vocabulary rows: each rank's logits are its slice's, the log-sum-exp
   is combined over the slices, and d(loss)/d(x) is summed over them. */
static pr_status pr__head(pr_trainer *tr, pr__arena *a, const void *x_final, void *dx_final, const pr__head_plan *hp,
                          const pr_loss_opts *lo, pr_real *logp_flat, double *loss, pr_error *err) {
    const pr_backend *be = tr->be;
    const int C = tr->cfg.hidden_size, V = tr->cfg.vocab_size, tp = pr__tp(tr);
    if (hp->M == 0) return PR_OK;
    /* rows a chunk, alike on every TP rank (each chunk is a collective): sized by the largest slice */
    const int v_max = (int)(((int64_t)tr->model.vocab_size + tp - 1) / tp);
    int ch = (int)(be->logit_chunk / (size_t)v_max);
    if (ch < 1) ch = 1;
    if (ch > hp->M) ch = hp->M;
    void *xr = pr__act(tr, a, (size_t)ch * C), *xn = pr__act(tr, a, (size_t)ch * C), *rstd = pr__stat(tr, a, (size_t)ch);
    void *logits = pr__act(tr, a, (size_t)ch * V), *dxn = pr__act(tr, a, (size_t)ch * C), *dxr = pr__act(tr, a, (size_t)ch * C);
    /* per row: the statistics, their gathering over tp, the log-sum-exp, the target's logit, the slope */
    double *host = (double *)PR_MALLOC(sizeof(double) * (size_t)ch * (3 + 2 * (size_t)tp + 1 + 3));
    if (tr->alloc_failed || !host) {
        PR_FREE(host);
        return pr__fail(err, PR_ERR_NOMEM, "out of memory for the loss head (%d rows x vocabulary %d)", ch, V);
    }
    double *stats = host, *gathered = stats + 3 * (size_t)ch, *lse = gathered + (2 * (size_t)tp + 1) * ch;
    double *zt = lse + ch, *coef = zt + ch;
    const void *wn = pr__weight(tr, tr->off_norm), *wh = pr__weight(tr, pr__lm_head_off(tr));
    pr_real *gn = tr->grads + tr->off_norm, *gh = tr->grads + pr__lm_head_off(tr);
    for (int m0 = 0; m0 < hp->M; m0 += ch) {
        int n = hp->M - m0 < ch ? hp->M - m0 : ch;
        be->gather_rows(be, xr, x_final, hp->row + m0, NULL, n, C);
        be->rmsnorm_fwd(be, xn, rstd, xr, wn, n, C, tr->cfg.rms_norm_eps);
        be->matmul_fwd(be, logits, xn, wh, n, C, V);
        be->logit_stats(be, stats, logits, hp->target + m0, n, V);
        pr__head_lse(tr, stats, gathered, n, lse, zt);
        double total = 0;
        for (int m = 0; m < n; m++) {          /* a pair's slope: the sum of its slots' */
            const double lp = zt[m] - lse[m];
            coef[m] = 0;
            for (int k = hp->first[m0 + m]; k < hp->first[m0 + m + 1]; k++) {
                double dl, l = pr_grpo_token_loss(lp, hp->old_logp[k], hp->ref_logp ? hp->ref_logp + k : NULL, hp->advantage[k], lo, &dl);
                total += hp->weight[k] * l;
                coef[m] += hp->weight[k] * dl;
                if (logp_flat) logp_flat[hp->flat[k]] = (pr_real)lp;
            }
        }
        *loss += total;
        be->logit_grad(be, logits, lse, coef, hp->target + m0, n, V);      /* logits now hold dlogits */
        pr__zero_acts(tr, dxn, (size_t)n * C);
        be->matmul_bwd(be, dxn, gh, logits, xn, wh, n, C, V);
        pr__tp_sum(tr, dxn, (size_t)n * C);
        pr__zero_acts(tr, dxr, (size_t)n * C);
        be->rmsnorm_bwd(be, dxr, gn, dxn, xr, wn, rstd, n, C);
        be->scatter_add_rows(be, dx_final, dxr, hp->row + m0, NULL, n, C);
    }
    PR_FREE(host);
    return PR_OK;
}


/* ================================================================ 4. THE SCHEDULES */
/* ---------------------------------------------------------------- 4.1 Phase A: the prefix forward, once */
/* The path's memory, for up to max_seg segments of up to `own` rows of this rank and kv_rows rows
   in the K/V buffers: the K/V cache, gK/gV (zeroed: a prefix pass's backward zeroes its rows
   again once it has read them, for the next node on those rows) and one pass's dK/dV, from the
   prefix arena. No segment yet. */
/* scratch: dk_mb/dv_mb too, for an on_dkv hook or a split group's owner, who receives its peers' gK/gV
   there (no other step reads them). */
static pr_status pr__path_alloc(pr_trainer *tr, pr__kv_path *path, int own, int kv_rows, int max_seg, int scratch, pr_error *err) {
    const pr_config *c = &tr->cfg;
    const int L = c->num_hidden_layers;
    const size_t kvd = (size_t)c->num_key_value_heads * c->head_dim;
    memset(path, 0, sizeof *path);
    path->max_seg = max_seg;
    void **m = (void **)PR_MALLOC(sizeof(void *) * 4 * (size_t)L);
    path->seg = (pr__kv_seg *)PR_MALLOC(sizeof(pr__kv_seg) * (size_t)max_seg);
    if (!m || !path->seg) {
        PR_FREE(m);
        PR_FREE(path->seg);
        path->seg = NULL;
        return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
    }
    path->k = m; path->v = m + L; path->gk = (pr_real **)(m + 2 * L); path->gv = (pr_real **)(m + 3 * L);
    for (int l = 0; l < L; l++) {
        path->k[l] = pr__act(tr, &tr->prefix_arena, (size_t)kv_rows * kvd);
        path->v[l] = pr__act(tr, &tr->prefix_arena, (size_t)kv_rows * kvd);
        path->gk[l] = pr__reals(tr, &tr->prefix_arena, (size_t)own * kvd);
        path->gv[l] = pr__reals(tr, &tr->prefix_arena, (size_t)own * kvd);
        if (path->gk[l] && path->gv[l]) {
            tr->be->zero(tr->be, path->gk[l], (size_t)own * kvd * sizeof(pr_real));
            tr->be->zero(tr->be, path->gv[l], (size_t)own * kvd * sizeof(pr_real));
        }
    }
    if (scratch) {
        path->dk_mb = pr__reals(tr, &tr->prefix_arena, (size_t)own * kvd);
        path->dv_mb = pr__reals(tr, &tr->prefix_arena, (size_t)own * kvd);
    }
    if (tr->alloc_failed) return pr__act_nomem(tr, err, "for the K/V cache and gK/gV of", own);
    return PR_OK;
}

static void pr__path_free(pr__kv_path *path) {
    PR_FREE(path->k);     /* the four arrays are one allocation; the buffers are the prefix arena's */
    PR_FREE(path->seg);
    memset(path, 0, sizeof *path);
}

/* A prefix pass of `rows` rows joins the path (before its Phase A), and leaves it (after its
   Phase C). Its chunk and this rank's rows of it as pr__batch_make cuts it. */
static void pr__path_push(pr_trainer *tr, pr__kv_path *path, int rows) {
    pr__kv_seg *sg = &path->seg[path->n_seg++];
    const pr__cp_cut k = pr__cp_cut_of(tr, rows);
    sg->rows = rows;
    sg->own = pr__cp_own(&k);
    sg->chunk = k.chunk;
    path->own += sg->own;
    path->kv += sg->chunk;
}
static void pr__path_pop(pr__kv_path *path) {
    const pr__kv_seg *sg = &path->seg[--path->n_seg];
    path->own -= sg->own;
    path->kv -= sg->chunk;
}

/* A prefix pass's memory: its batch (rows start .. start+len-1 of group g's prefix, with the loss
   rows of the suffixes' first tokens when it ends the prefix), its pass in ps->a with every
   layer's saved tensors (under recompute the layers' inputs, and for the forward alone the
   region their other tensors share), and its K/V placed in the path, in its segment (the last,
   after the segments above it). */
static pr_status pr__prefix_alloc(pr_trainer *tr, pr__step_ctx *cx, pr__prefix_state *ps, pr__kv_path *path, int start,
                                  int len, pr_error *err) {
    pr_status st = pr__batch_make(tr, &ps->batch, cx->g, cx->tok_weight, start, len, PR__BATCH_PREFIX, 0, err);
    if (st) return st;
    const int P = ps->batch.N;        /* the rows this rank holds (all of them without CP) */
    const pr__kv_seg *mine = &path->seg[path->n_seg - 1];
    ps->start = start;
    ps->len = len;
    ps->own_above = path->own - mine->own;
    pr__pass_init(tr, &ps->pass, &ps->batch, path, path->n_seg - 1);
    ps->pass.keep = cx->opt->recompute == PR_RECOMPUTE_NONE ? PR__KEEP_ALL : PR__KEEP_INPUT_KV;
    pr__offload *o = &ps->off;
    st = pr__offload_begin(tr, o, &cx->opt->offload, &ps->pass, P, ps->below, ps->pool_stack, err);
    if (!st) st = pr__pass_alloc(tr, ps->a, &ps->pass, P, !o->on, path, path->kv - mine->chunk, err);
    if (!st) st = pr__pass_comm_alloc(tr, &tr->step_arena, &ps->pass, err);     /* released when the forward ends */
    if (!st && ps->pass.keep != PR__KEEP_ALL) st = pr__pass_rebuilt_alloc(tr, &tr->step_arena, &ps->pass, err);
    if (!st && o->on) st = pr__slot_take(tr, o, &ps->pass, 0, err);
    if (st) return st;
    return PR_OK;
}

/* Phase A: the prefix forward once, through this stage's layers (its input from the previous
   stage, its output on to the next), attending to the path's rows above it (in a prefix tree
   its ancestors'; none for a group's prefix). Its saved tensors stay in ps->a until Phase C
   (under recompute only each layer's input: the rest is rebuilt there); each layer's k/v rows
   are its part of the K/V cache that Phase B reads. */
static pr_status pr__phase_a_prefix_forward(pr_trainer *tr, pr__step_ctx *cx, pr__prefix_state *ps, pr__kv_path *path,
                                            int start, int len, pr_error *err) {
    const pr_config *c = &tr->cfg;
    const int L = c->num_hidden_layers, kvd = c->num_key_value_heads * c->head_dim;
    const size_t E = (size_t)c->num_experts;
    const pr_hooks *h = &cx->opt->hooks;
    pr_status st = pr__prefix_alloc(tr, cx, ps, path, start, len, err);
    if (st) return st;
    const int P = ps->pass.N;
    pr__offload *o = &ps->off;
    if (cx->moe.on && !(ps->route_sums = (double *)PR_MALLOC(sizeof(double) * (2 * E + 1))))
        return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
    if (ps->route_sums) memset(ps->route_sums, 0, sizeof(double) * (2 * E + 1));
    if (pr__first_stage(tr)) pr__embed(tr, &ps->pass);
    else pr__pp_recv(tr, tr->mesh->pp_rank - 1, ps->pass.res[0], P, ps->route_sums, E ? 2 * E + 1 : 0);
    for (int l = 0; l < L; l++) {
        if (o->on && l + 1 < L && (st = pr__slot_take(tr, o, &ps->pass, l + 1, err))) return st;  /* receives res[l+1] */
        pr__layer_forward(tr, &ps->pass, l, start ? path->k[l] : NULL, start ? path->v[l] : NULL);
        if (h->on_kv_capture) h->on_kv_capture(h->user, tr->layer0 + l, ps->pass.acts[l].k, ps->pass.acts[l].v, P, kvd);
        if (o->on && (st = pr__offload_block(tr, o, l, err))) return st;
    }
    if (tr->alloc_failed) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for the MoE routing of %d prefix rows", P);
    if (cx->moe.on) {                /* the pass's sums through this stage, on to the next; its group's from them */
        pr__moe_stage_sums(tr, &cx->moe, &ps->pass, ps->route_sums, (double)ps->copies);
        for (size_t i = 0; i <= 2 * E; i++) cx->moe.pre[i] += ps->route_sums[i];
    }
    if (!pr__last_stage(tr)) pr__pp_send(tr, tr->mesh->pp_rank + 1, ps->pass.res[L], P, ps->route_sums, E ? 2 * E + 1 : 0);
    pr__arena_reset(tr, &tr->step_arena);           /* the collectives' buffers, recompute's shared region */
    ps->pass.kreg = ps->pass.vreg = ps->pass.dkreg = ps->pass.dvreg = ps->pass.pad = ps->pass.shard = NULL;
    ps->pass.ep_send = ps->pass.ep_recv = NULL;
    cx->rows += P;
    return PR_OK;
}

/* ---------------------------------------------------------------- 4.2 Phase B: the suffix microbatches (and the baseline) */
/* A backward's view of the `own` rows of path above it at layer l: their K/V read, their dK/dV
   added (attention_bwd adds into dkp/dvp) straight into gK/gV, or with `apart` into the path's
   dk_mb/dv_mb, zeroed here, for a hook to see them alone before they join gK/gV. On the GPU the
   two give the same bits (the kernels add each element's sum once); straight in spares a zeroing
   and an addition over the prefix's rows a layer and a microbatch. */
static void pr__kv_above(pr_trainer *tr, pr__kv_grads *kv, const pr__kv_path *path, int l, int own, int apart) {
    kv->kp = path->k[l]; kv->vp = path->v[l];
    kv->dkp = path->gk[l]; kv->dvp = path->gv[l];
    if (!apart) return;
    const size_t n = (size_t)own * tr->cfg.num_key_value_heads * tr->cfg.head_dim;
    tr->be->zero(tr->be, path->dk_mb, n * sizeof(pr_real));
    tr->be->zero(tr->be, path->dv_mb, n * sizeof(pr_real));
    kv->dkp = path->dk_mb; kv->dvp = path->dv_mb;
}

static void pr__mb_close(pr_trainer *tr, pr__mb *m) {
    pr__pass_free_host(&m->p, tr->cfg.num_hidden_layers);
    pr__batch_free(&m->b);
    if (m->a) pr__arena_reset(tr, m->a);
    PR_FREE(m->sums);
    m->sums = m->g = NULL;
    m->a = NULL;
}

/* Microbatch i (trajectories t0 + i*mb ..) of the step: its batch and memory. path: the cached
   prefix (Phase B), or NULL (the baseline's whole sequences). backward 0: forward only. */
static pr_status pr__mb_open(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path, pr__mb *m, int i, int mb, int backward,
                             pr_error *err) {
    const int i0 = cx->t0 + i * mb, E = tr->cfg.num_experts;
    memset(m, 0, sizeof *m);
    m->index = i;
    pr_status st = pr__batch_make(tr, &m->b, cx->g, cx->tok_weight, i0, i0 + mb <= cx->t1 ? mb : cx->t1 - i0,
                                  path ? PR__BATCH_SUFFIX : PR__BATCH_FULL, path && cx->opt->layout == PR_LAYOUT_PACKED, err);
    if (st) return st;
    m->a = &tr->mb_arena[i % tr->n_mb_arena];
    pr__pass_init(tr, &m->p, &m->b, path, path ? path->n_seg : 0);
    m->p.keep = cx->opt->recompute == PR_RECOMPUTE_ALL ? PR__KEEP_INPUT : PR__KEEP_ALL;
    st = pr__pass_alloc(tr, m->a, &m->p, m->b.N, 1, NULL, 0, err);
    if (!st && m->p.keep != PR__KEEP_ALL) st = pr__pass_rebuilt_alloc(tr, m->a, &m->p, err);
    if (!st) st = pr__pass_comm_alloc(tr, m->a, &m->p, err);
    if (!st && backward) st = pr__bwd_scratch_alloc(tr, m->a, &m->s, &m->p, err);
    if (!st && E) {
        m->sums = (double *)PR_MALLOC(sizeof(double) * (3 * (size_t)E + 1));
        if (!m->sums) return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
        memset(m->sums, 0, sizeof(double) * (3 * (size_t)E + 1));
        m->g = m->sums + 2 * E + 1;
    }
    return st;
}

/* This stage's layers forward (the first stage embeds; other stages' input has been received);
   in a training pass (train 1) the last stage then runs the loss head, whose gradient starts the
   backward, and with MoE works out the microbatch's aux gradient. */
static pr_status pr__mb_forward(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path, pr__mb *m, int train, pr_error *err) {
    const int L = tr->cfg.num_hidden_layers, C = tr->cfg.hidden_size;
    pr__pass *p = &m->p;
    if (pr__first_stage(tr)) pr__embed(tr, p);
    for (int l = 0; l < L; l++)
        pr__layer_forward(tr, p, l, path ? path->k[l] : NULL, path ? path->v[l] : NULL);
    if (tr->alloc_failed) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for the MoE routing of %d rows", p->N);
    if (cx->moe.on) {
        pr__moe_stage_sums(tr, &cx->moe, p, m->sums, train ? 1.0 : 0);   /* a pre-pass leaves the load to the real pass */
        if (train && pr__last_stage(tr)) pr__moe_mb_grad(&cx->moe, m->sums, m->b.n_traj, m->g);
    }
    if (!train || !pr__last_stage(tr)) return PR_OK;
    pr__zero_acts(tr, m->s.dres, (size_t)p->N * C);
    return pr__head(tr, m->a, p->res[L], m->s.dres, &m->b.head, &cx->opt->loss, cx->logp, &cx->loss, err);
}

/* This stage's layers backward from m->s.dres (the head's gradient, or the next stage's). With
   a path (Phase B) attention also reads the cached prefix K/V, and the prefix dK/dV this
   microbatch produces are handed to the hook and added into gK/gV. */
static pr_status pr__mb_backward(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path, pr__mb *m, pr_error *err) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int L = c->num_hidden_layers, kvd = c->num_key_value_heads * c->head_dim;
    const int Pl = path ? path->own : 0;           /* the prefix rows this rank holds (its CP shard) */
    const size_t kv_n = (size_t)Pl * kvd, kvn_own = (size_t)m->p.N * kvd;
    const pr_hooks *h = &cx->opt->hooks;
    pr__pass *p = &m->p;
    pr__bwd_scratch *s = &m->s;
    if (cx->moe.on) {
        pr__moe_take_grad(&cx->moe, m->g, m->b.n_traj);
        p->aux_g = m->g;
    }
    for (int l = L - 1; l >= 0; l--) {
        pr__zero_acts(tr, s->dk, kvn_own);
        pr__zero_acts(tr, s->dv, kvn_own);
        pr__kv_grads kv = pr__kv_own(s->dk, s->dv);
        if (path) pr__kv_above(tr, &kv, path, l, Pl, h->on_dkv != NULL);   /* the cached prefix: its K/V read, its dK/dV to gK/gV */
        pr__layer_backward(tr, p, l, s, &kv);
        if (path && h->on_dkv) {              /* the hook sees this microbatch's dK/dV, then they join gK/gV */
            h->on_dkv(h->user, tr->layer0 + l, m->index, path->dk_mb, path->dv_mb, Pl, kvd);
            be->add_reals(be, path->gk[l], path->dk_mb, kv_n);
            be->add_reals(be, path->gv[l], path->dv_mb, kv_n);
        }
    }
    if (pr__first_stage(tr)) be->embed_bwd(be, tr->grads + tr->off_embed, s->dres, p->tokens, p->N, c->hidden_size);
    cx->rows += p->N;
    if (tr->alloc_failed) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for the MoE backward of %d rows", p->N);
    return PR_OK;
}

/* Phase B (path: the cached prefix) or the baseline (path NULL): every microbatch through this stage
   in the 1F1B order. A stage first runs `warm` forwards (as many as the stages after it need to
   fill up), then one forward and one backward in turn, then the backwards left; its neighbours
   keep the same order, so each exchange meets its partner: a forward's output goes on as the
   gradient for the oldest microbatch comes back, that backward's input gradient goes back as
   the next microbatch's input comes in. With one stage: forward, backward, microbatch by
   microbatch. In the MoE group scope the routing pre-pass runs first when the group's routing
   spans microbatches. Returns the number of microbatches in *n_mb. */
static pr_status pr__phase_b_suffix_microbatches(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path, int *n_mb,
                                                 pr_error *err) {
    const int mb = cx->mb;
    if (cx->moe.prepass) {
        pr_status st = pr__routing_prepass(tr, cx, path, err);
        if (st) return st;
    }
    const int pp = pr__pp(tr), n = (cx->t1 - cx->t0 + mb - 1) / mb, stage = tr->mesh ? tr->mesh->pp_rank : 0;
    const int warm = pp - stage - 1 < n ? pp - stage - 1 : n;
    pr__mb *ring = (pr__mb *)PR_MALLOC(sizeof(pr__mb) * (size_t)(pp + 1));
    if (!ring) return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
    memset(ring, 0, sizeof(pr__mb) * (size_t)(pp + 1));
#define PR__MB(i) (&ring[(i) % (pp + 1)])
    pr_status st = PR_OK;
    int f = 0;                   /* the next microbatch to run forward */
    for (; f < warm && !st; f++) {
        st = pr__mb_open(tr, cx, path, PR__MB(f), f, mb, 1, err);
        if (st) break;
        pr__pp_prev(tr, NULL, PR__MB(f));
        st = pr__mb_forward(tr, cx, path, PR__MB(f), 1, err);
        pr__pp_next(tr, PR__MB(f), NULL);
    }
    if (!st && f < n && !(st = pr__mb_open(tr, cx, path, PR__MB(f), f, mb, 1, err))) pr__pp_prev(tr, NULL, PR__MB(f));
    for (int b = 0; b < n && !st; b++) {
        if (f < n) {
            st = pr__mb_forward(tr, cx, path, PR__MB(f), 1, err);
            pr__pp_next(tr, PR__MB(f), PR__MB(b));
            f++;
        } else {
            pr__pp_next(tr, NULL, PR__MB(b));
        }
        if (!st) st = pr__mb_backward(tr, cx, path, PR__MB(b), err);
        if (!st && f < n && !(st = pr__mb_open(tr, cx, path, PR__MB(f), f, mb, 1, err))) pr__pp_prev(tr, PR__MB(b), PR__MB(f));
        else if (!st) pr__pp_prev(tr, PR__MB(b), NULL);
        pr__mb_close(tr, PR__MB(b));
    }
    for (int i = 0; i <= pp; i++) pr__mb_close(tr, &ring[i]);    /* after a failure: what is still open */
#undef PR__MB
    PR_FREE(ring);
    *n_mb = n;
    return st;
}

/* ---------------------------------------------------------------- 4.3 Phase C: the prefix backward, once */
/* Phase C: the prefix backward once, through this stage's layers (from the next stage's
   gradient, on to the previous). The first token of every suffix is predicted from the last
   prefix row, and a trained prefix token (prefix_mask) from the row before it, so their loss
   enters here directly: the last stage's head, for each of the n_heads groups with loss rows in
   this pass (heads[0] the group its batch was made from; in a tree also the other groups whose
   prefix ends with the node, or that train tokens of it). Everything else the suffixes (in a
   tree, also the nodes below) ask of the prefix arrives through its rows of gK/gV, which become
   the starting dK/dV of each layer's attention backward. A tree node also attends to the rows
   above it: their dK/dV join the path's gK/gV, for those nodes' own backward later. */
static pr_status pr__phase_c_prefix_backward(pr_trainer *tr, pr__step_ctx *cx, pr__prefix_state *ps, pr__kv_path *path,
                                             pr__step_ctx *const *heads, int n_heads, pr_error *err) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int L = c->num_hidden_layers, P = ps->pass.N, C = c->hidden_size, kvd = c->num_key_value_heads * c->head_dim;
    const size_t above = (size_t)ps->own_above * kvd, own = (size_t)P * kvd;
    const pr_hooks *h = &cx->opt->hooks;
    const size_t budget = cx->opt->offload.device_budget;
    pr__offload *o = &ps->off;
    ps->pass.aux_g = ps->aux_c;           /* each prefix row stands for its copies */
    pr__bwd_scratch s;
    pr_status st = pr__bwd_scratch_alloc(tr, &tr->step_arena, &s, &ps->pass, err);
    if (!st) st = pr__pass_comm_alloc(tr, &tr->step_arena, &ps->pass, err);
    if (!st && ps->pass.keep != PR__KEEP_ALL) st = pr__pass_rebuilt_alloc(tr, &tr->step_arena, &ps->pass, err);
    if (!st && o->on) st = pr__prefetch_block(tr, o, &ps->pass, L - 1, budget, err);   /* overlaps the head */
    if (st) return st;
    pr__zero_acts(tr, s.dres, (size_t)P * C);
    for (int k = 0; pr__last_stage(tr) && k < n_heads && !st; k++) {
        pr__step_ctx *e = heads[k];
        pr__batch own_rows;           /* another group: the same rows, its own loss rows */
        memset(&own_rows, 0, sizeof own_rows);
        if (k) st = pr__batch_make(tr, &own_rows, e->g, e->tok_weight, ps->start, ps->len, PR__BATCH_PREFIX, 0, err);
        if (!st) st = pr__head(tr, &tr->step_arena, ps->pass.res[L], s.dres, k ? &own_rows.head : &ps->batch.head,
                               &e->opt->loss, e->logp, &e->loss, err);
        pr__batch_free(&own_rows);
    }
    if (!pr__last_stage(tr)) pr__pp_recv(tr, tr->mesh->pp_rank + 1, s.dres, P, NULL, 0);
    if (st) return st;
    for (int l = L - 1; l >= 0; l--) {
        if (o->on) {
            if (pr__slot_of(o, l) < 0) {
                o->st.demand_loads++;
                if ((st = pr__load_block(tr, o, &ps->pass, l, err))) return st;
            }
            pr__slot_wait(tr, pr__slot_of(o, l));    /* block l is in before its backward starts */
            if ((st = pr__prefetch_block(tr, o, &ps->pass, l - 1, budget, err))) return st;
        }
        pr_real *gk = path->gk[l] + above, *gv = path->gv[l] + above;
        if (h->on_kv_inject) h->on_kv_inject(h->user, tr->layer0 + l, gk, gv, P, kvd);
        be->reals_to_acts(be, s.dk, gk, own);     /* the injection: the prefix's own dK/dV start here */
        be->reals_to_acts(be, s.dv, gv, own);
        be->zero(be, gk, own * sizeof(pr_real));
        be->zero(be, gv, own * sizeof(pr_real));
        pr__kv_grads kv = pr__kv_own(s.dk, s.dv);
        if (ps->start) pr__kv_above(tr, &kv, path, l, ps->own_above, 0);   /* the rows above: their dK/dV into their gK/gV */
        pr__layer_backward(tr, &ps->pass, l, &s, &kv);
        if (o->on) pr__block_done(tr, o, l);
    }
    if (tr->alloc_failed) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for the MoE backward of %d prefix rows", P);
    if (pr__first_stage(tr)) be->embed_bwd(be, tr->grads + tr->off_embed, s.dres, ps->pass.tokens, P, C);
    else pr__pp_send(tr, tr->mesh->pp_rank - 1, s.dres, P, NULL, 0);
    return PR_OK;
}

/* ---------------------------------------------------------------- 4.4 The step: checks, loss weights, the driver, FLOPs */
PRDEF pr_step_opts pr_step_opts_default(void) {
    pr_step_opts o;
    memset(&o, 0, sizeof o);
    o.schedule = PR_SCHEDULE_REUSE;
    o.microbatch = 0;
    o.layout = PR_LAYOUT_PADDED;
    o.loss.eps_low = 0.2;
    o.loss.eps_high = 0.28;
    o.loss.kl_coef = 0.0;
    o.loss.norm = PR_NORM_TOKEN_MEAN;
    return o;
}

/* ---- the loss's denominators: a group's own, a step's, the modes' names */
static pr_status pr__group_shape(const pr_group *g, pr_status code, const char *where, pr_error *err);
/* One group's totals (its masked tokens, its G, its longest suffix): the step it is alone. */
static pr_step_norm pr__group_totals(const pr_group *g) {
    pr_step_norm t = { 0, g->G, 0 };
    int first = 0;                       /* the first trained prefix token: where a trajectory's length starts */
    while (g->prefix_mask && first < g->P && !g->prefix_mask[first]) first++;
    const int lead = g->prefix_mask && first < g->P ? g->P - first : 0;
    for (int64_t f = 0; f < g->suffix_off[g->G]; f++) t.tokens += g->loss_mask[f];
    t.tokens += (int64_t)g->G * pr__prefix_trained(g, 0, g->P);
    for (int i = 0; i < g->G; i++) if (lead + g->suffix_len[i] > t.norm_len) t.norm_len = lead + g->suffix_len[i];
    return t;
}

PRDEF pr_status pr_step_loss_totals(const pr_group *groups, int n, int64_t norm_len, pr_step_norm *out, pr_error *err) {
    if (!groups || !out || n < 1 || norm_len < 0)
        return pr__fail(err, PR_ERR_ARG, "pr_step_loss_totals: NULL argument, %d groups or norm_len %lld (need >= 1 groups, "
                        "norm_len >= 0)", n, (long long)norm_len);
    pr_step_norm t = { 0, 0, 0 };
    for (int k = 0; k < n; k++) {
        const pr_group *g = &groups[k];
        char where[48];
        snprintf(where, sizeof where, "pr_step_loss_totals: group %d", k);
        const pr_status st = pr__group_shape(g, PR_ERR_ARG, where, err);
        if (st) return st;
        const pr_step_norm own = pr__group_totals(g);
        t.tokens += own.tokens;
        t.trajectories += own.trajectories;
        if (own.norm_len > t.norm_len) t.norm_len = own.norm_len;
    }
    if (norm_len) t.norm_len = norm_len;
    *out = t;
    return PR_OK;
}

static const char *const pr__loss_norm_names[4] = { "token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                                    "seq-mean-token-sum-norm" };
PRDEF const char *pr_loss_norm_name(pr_loss_norm norm) {
    return (int)norm >= 0 && (int)norm < 4 ? pr__loss_norm_names[norm] : NULL;
}
PRDEF pr_status pr_loss_norm_parse(const char *name, pr_loss_norm *norm, pr_error *err) {
    for (int k = 0; name && norm && k < 4; k++)
        if (!strcmp(name, pr__loss_norm_names[k])) { *norm = (pr_loss_norm)k; return PR_OK; }
    return pr__fail(err, PR_ERR_ARG, "unknown loss aggregation mode '%s' (token-mean, seq-mean-token-mean, seq-mean-token-sum "
                    "or seq-mean-token-sum-norm)", name ? name : "(null)");
}

static int pr__longest_suffix(const pr_group *g) {
    int smax = 0;
    for (int i = 0; i < g->G; i++) if (g->suffix_len[i] > smax) smax = g->suffix_len[i];
    return smax;
}

PRDEF int pr_step_microbatch(const pr_group *g, const pr_step_opts *o) {
    if (!g || !o || g->G < 1) return 0;
    int mb = o->microbatch <= 0 || o->microbatch > g->G ? g->G : o->microbatch;
    if (o->microbatch_tokens > 0) {
        const int smax = pr__longest_suffix(g);
        const long rows = (long)smax + (o->schedule == PR_SCHEDULE_BASELINE ? g->P : 0);
        const long fit = rows > 0 ? o->microbatch_tokens / rows : mb;
        if (fit < mb) mb = fit < 1 ? 1 : (int)fit;
    }
    return mb;
}

static pr_status pr__validate_step(const pr_trainer *tr, const pr_group *g, const pr_step_opts *o, pr_error *err) {
    if (!g || !o) return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads: NULL group or options");
    pr_status st = pr_group_validate(g, tr->model.vocab_size, err);
    if (st) return st;
    const int smax = pr__longest_suffix(g);
    if ((long)g->P + smax > tr->cfg.max_position_embeddings)
        return pr__fail(err, PR_ERR_ARG, "prefix %d + longest suffix %d tokens exceed max_position_embeddings %d",
                        g->P, smax, tr->cfg.max_position_embeddings);
    if (o->schedule != PR_SCHEDULE_BASELINE && o->schedule != PR_SCHEDULE_REUSE)
        return pr__fail(err, PR_ERR_ARG, "unknown schedule %d", (int)o->schedule);
    if (o->layout != PR_LAYOUT_PADDED && o->layout != PR_LAYOUT_PACKED)
        return pr__fail(err, PR_ERR_ARG, "unknown layout %d", (int)o->layout);
    if (o->microbatch < 0) return pr__fail(err, PR_ERR_ARG, "microbatch must be >= 1 (or 0 for the whole group), got %d", o->microbatch);
    if (o->microbatch_tokens < 0)
        return pr__fail(err, PR_ERR_ARG, "microbatch_tokens must be >= 1 (or 0 for no token limit), got %d", o->microbatch_tokens);
    if ((o->moe.scope != PR_AUX_SCOPE_MICROBATCH && o->moe.scope != PR_AUX_SCOPE_GROUP) || o->moe.prefix_multiplicity < 0)
        return pr__fail(err, PR_ERR_ARG, "MoE options: unknown aux-loss scope %d or negative prefix multiplicity %d",
                        (int)o->moe.scope, o->moe.prefix_multiplicity);
    if (o->recompute != PR_RECOMPUTE_NONE && o->recompute != PR_RECOMPUTE_PREFIX && o->recompute != PR_RECOMPUTE_ALL)
        return pr__fail(err, PR_ERR_ARG, "unknown recompute mode %d (none %d, prefix %d, all %d)", (int)o->recompute,
                        PR_RECOMPUTE_NONE, PR_RECOMPUTE_PREFIX, PR_RECOMPUTE_ALL);
    if (o->offload.enabled && o->schedule != PR_SCHEDULE_REUSE)
        return pr__fail(err, PR_ERR_ARG, "offload moves the reuse schedule's prefix state: it needs the reuse schedule");
    int mb = pr_step_microbatch(g, o);
    /* a pass's rows, times any per-row count, must fit an int: the baseline's microbatch of whole
       sequences; with reuse the prefix's pass or a microbatch of suffixes, whichever is longer */
    const double whole = (double)mb * ((double)g->P + smax), waves = (double)mb * smax;
    const double rows = o->schedule == PR_SCHEDULE_BASELINE ? whole : waves > g->P ? waves : g->P;
    const int per_row = tr->cfg.num_attention_heads > tr->cfg.num_experts_per_tok ? tr->cfg.num_attention_heads
                                                                                    : tr->cfg.num_experts_per_tok;
    if (rows * tr->cfg.intermediate_size > 4e18 || rows > 2e9 || rows * per_row > INT_MAX)
        return pr__fail(err, PR_ERR_ARG, "a pass of %.0f rows (microbatch %d, prefix %d, longest suffix %d) is too large: rows "
                        "times %d heads or experts must be at most %d", rows, mb, g->P, smax, per_row, INT_MAX);
    const pr_loss_opts *lo = &o->loss;
    if (!(lo->eps_low >= 0 && lo->eps_low < 1) || !(lo->eps_high >= 0 && lo->eps_high < 1e6))
        return pr__fail(err, PR_ERR_ARG, "clip range eps_low %g / eps_high %g out of range (eps_low in [0,1), eps_high >= 0)",
                        lo->eps_low, lo->eps_high);
    if (!(lo->kl_coef >= 0 && lo->kl_coef < 1e6)) return pr__fail(err, PR_ERR_ARG, "kl_coef %g must be >= 0", lo->kl_coef);
    if (lo->kl_coef > 0 && !g->ref_logp) return pr__fail(err, PR_ERR_ARG, "kl_coef %g needs reference log-probs, the group has none", lo->kl_coef);
    if (!pr_loss_norm_name(lo->norm))
        return pr__fail(err, PR_ERR_ARG, "unknown loss aggregation mode %d (token-mean 0, seq-mean-token-mean 1, "
                        "seq-mean-token-sum 2, seq-mean-token-sum-norm 3)", (int)lo->norm);
    const pr_step_norm own = pr__group_totals(g), *sn = &lo->step;
    if (sn->tokens < 0 || sn->trajectories < 0 || sn->norm_len < 0)
        return pr__fail(err, PR_ERR_ARG, "step totals must be >= 0 (0: the group's own), got %lld tokens, %lld trajectories, "
                        "length %lld", (long long)sn->tokens, (long long)sn->trajectories, (long long)sn->norm_len);
    if ((sn->tokens && sn->tokens < own.tokens) || (sn->trajectories && sn->trajectories < own.trajectories))
        return pr__fail(err, PR_ERR_ARG, "step totals of %lld masked tokens and %lld trajectories are fewer than this group's "
                        "own %lld and %lld: a step includes its groups", (long long)sn->tokens, (long long)sn->trajectories,
                        (long long)own.tokens, (long long)own.trajectories);
    return PR_OK;
}

/* Each suffix token's share of the loss, mask / denominator with the step-wide denominators of
   pr_loss_norm (those left 0 taken from this group alone). All are known before any forward runs,
   which is what lets the loss split over groups, suffixes and microbatches. */
static void pr__token_weights(const pr_group *g, const pr_loss_opts *lo, pr_real *w) {
    const pr_step_norm own = pr__group_totals(g);
    const double T = (double)(lo->step.tokens ? lo->step.tokens : own.tokens);
    const double N = (double)(lo->step.trajectories ? lo->step.trajectories : own.trajectories);
    const double L = (double)(lo->step.norm_len ? lo->step.norm_len : own.norm_len);
    const long base = (long)g->suffix_off[g->G];
    const int trained = pr__prefix_trained(g, 0, g->P);
    for (int i = 0; i < g->G; i++) {
        long n_i = trained;
        for (long f = g->suffix_off[i]; f < g->suffix_off[i + 1]; f++) n_i += g->loss_mask[f];
        double denom = lo->norm == PR_NORM_TOKEN_MEAN ? T : lo->norm == PR_NORM_SEQ_MEAN_TOKEN_MEAN ? N * (double)n_i
                     : lo->norm == PR_NORM_SEQ_MEAN_TOKEN_SUM ? N : L;
        for (long f = g->suffix_off[i]; f < g->suffix_off[i + 1]; f++)
            w[f] = g->loss_mask[f] ? (pr_real)(1.0 / denom) : 0;
        for (int j = 0; g->prefix_mask && j < g->P; j++)
            w[base + (long)i * g->P + j] = g->prefix_mask[j] ? (pr_real)(1.0 / denom) : 0;
    }
}

/* The step's own memory, from pr__step_begin to pr__step_end (NULL-safe). */
static void pr__step_free(pr__step_ctx *cx) {
    PR_FREE(cx->mem_tok_weight);
    PR_FREE(cx->mem_logp);
    PR_FREE(cx->mem_moe);
    cx->mem_tok_weight = cx->mem_logp = NULL;
    cx->mem_moe = NULL;
}

/* Step 2, weights: the context of one group's step (its trajectories on this rank, the token
   weights, the log-probs, the MoE sums), the gradients zeroed unless accumulating, the backend's
   weights prepared. logp: the caller's buffer for the log-probs, or NULL. */
static pr_status pr__step_begin(pr_trainer *tr, pr__step_ctx *cx, const pr_group *g, const pr_step_opts *opt, pr_real *logp,
                                pr_comm *team, pr_error *err) {
    const pr_backend *be = tr->be;
    const int G = g->G, mb = pr_step_microbatch(g, opt);
    const int t = team ? team->size : 1, k = team ? team->rank : 0;
    int B = 0;                   /* the group's microbatches, over the team */
    for (int j = 0; j < t; j++) B += ((j + 1) * G / t - j * G / t + mb - 1) / mb;
    memset(cx, 0, sizeof *cx);
    cx->n_tok = pr__loss_slots(g);
    cx->mem_tok_weight = (pr_real *)PR_MALLOC(sizeof(pr_real) * (size_t)cx->n_tok);
    if (!logp || g->prefix_mask) cx->mem_logp = (pr_real *)PR_MALLOC(sizeof(pr_real) * (size_t)cx->n_tok);
    pr_real *lp = cx->mem_logp ? cx->mem_logp : logp;      /* the caller's gets the suffix tokens' at the end */
    cx->user_logp = logp;
    if (!cx->mem_tok_weight || !lp) {
        pr__step_free(cx);
        return pr__fail(err, PR_ERR_NOMEM, "out of host memory for %ld loss tokens", cx->n_tok);
    }
    pr__token_weights(g, &opt->loss, cx->mem_tok_weight);
    if (pr__cp(tr) > 1 || pr__pp(tr) > 1 || team)   /* each CP block fills its tokens, the last stage all, a team member its share */
        memset(lp, 0, sizeof(pr_real) * (size_t)cx->n_tok);
    tr->comm_st = PR_OK;
    cx->g = g; cx->opt = opt; cx->tok_weight = cx->mem_tok_weight; cx->logp = lp;
    cx->t0 = k * G / t; cx->t1 = (k + 1) * G / t; cx->team = team;
    cx->mb = mb; cx->owner = !team || team->rank == 0;
    pr__moe_acc *moe = &cx->moe;
    if (tr->cfg.num_experts) {
        const int E = tr->cfg.num_experts;
        const size_t n_sums = 2 * (size_t)E + 1;
        cx->mem_moe = (double *)PR_MALLOC(sizeof(double) * (2 * n_sums + 3 * (size_t)E));
        if (!cx->mem_moe) {
            pr__step_free(cx);
            return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
        }
        memset(cx->mem_moe, 0, sizeof(double) * (2 * n_sums + 3 * (size_t)E));
        moe->on = 1; moe->E = E; moe->G = G; moe->B = B; moe->opt = &opt->moe;
        moe->coef = tr->cfg.router_aux_loss_coef;
        moe->reuse = opt->schedule == PR_SCHEDULE_REUSE;
        moe->prepass = opt->moe.scope == PR_AUX_SCOPE_GROUP && (B > 1 || team);   /* a team's ranks need the group's routing */
        moe->pre = cx->mem_moe; moe->own = moe->pre + n_sums; moe->F = moe->own + n_sums;
        moe->prob_tot = moe->F + E; moe->c = moe->prob_tot + E;
    }
    memset(tr->phase_peak, 0, sizeof tr->phase_peak);
    tr->alloc_failed = 0;
    if (!opt->accumulate) {
        be->zero(be, tr->grads, tr->n_params * sizeof(pr_real));
        tr->grads_scattered = 0;
    }
    return PR_OK;
}

/* Step 3, the schedule without reuse: every trajectory whole, as Phase B's microbatches with no
   prefix state. */
static pr_status pr__step_baseline(pr_trainer *tr, pr__step_ctx *cx, pr_step_stats *s, pr_error *err) {
    const pr_backend *be = tr->be;
    double t0 = pr__now();
    pr__enter_phase(tr, PR_PHASE_B);
    pr_status st = pr__phase_b_suffix_microbatches(tr, cx, NULL, &s->microbatches, err);
    be->sync(be);
    s->seconds[PR_PHASE_B] = pr__now() - t0;
    return st;
}

/* Step 3, the reuse schedule: Phase A (the owner of a split group; its peers only make room for
   the cache it shares), Phase B, Phase C (the owner, after the peers' gK/gV came back), each
   timed; then the prefix state's sizes and its memory given back. */
static pr_status pr__step_reuse(pr_trainer *tr, pr__step_ctx *cx, pr_step_stats *s, pr_error *err) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int P = cx->g->P;
    const pr__cp_cut cut = pr__cp_cut_of(tr, P);
    const int own = pr__cp_own(&cut), chunk = cut.chunk;
    pr__kv_path path;       /* one segment: the group's prefix */
    pr__prefix_state ps;
    memset(&ps, 0, sizeof ps);
    ps.a = &tr->prefix_arena;
    ps.copies = cx->g->G;
    ps.aux_c = cx->moe.on ? cx->moe.c : NULL;
    double t0 = pr__now();
    pr__enter_phase(tr, PR_PHASE_A);
    pr_status st = pr__path_alloc(tr, &path, own, chunk, 1, cx->opt->hooks.on_dkv || (cx->team && cx->owner), err);
    if (!st) pr__path_push(tr, &path, P);
    if (!st && cx->owner) st = pr__phase_a_prefix_forward(tr, cx, &ps, &path, 0, P, err);
    if (!st && cx->team) pr__split_share_kv(tr, cx, &path);
    be->sync(be);
    double t1 = pr__now();
    pr__enter_phase(tr, PR_PHASE_B);
    if (!st) st = pr__phase_b_suffix_microbatches(tr, cx, &path, &s->microbatches, err);
    if (!st && cx->team) pr__split_reduce_gkv(tr, cx, &path);
    be->sync(be);
    double t2 = pr__now();
    pr__enter_phase(tr, PR_PHASE_C);
    if (!st && cx->owner) st = pr__phase_c_prefix_backward(tr, cx, &ps, &path, &cx, 1, err);
    be->sync(be);
    double t3 = pr__now();
    s->seconds[PR_PHASE_A] = t1 - t0; s->seconds[PR_PHASE_B] = t2 - t1; s->seconds[PR_PHASE_C] = t3 - t2;
    const size_t L = (size_t)c->num_hidden_layers;
    s->prefix_kv_bytes = L * 2 * (size_t)path.kv * (size_t)c->num_key_value_heads * c->head_dim * be->act_bytes;
    s->prefix_stack_bytes = L * pr__layer_block(tr, NULL, (size_t)own, cx->opt->recompute == PR_RECOMPUTE_NONE, NULL, NULL) +
                            (size_t)own * c->hidden_size * be->act_bytes;
    pr__offload_end(tr, &ps.off);
    s->offload = ps.off.st;
    pr__pass_free_host(&ps.pass, c->num_hidden_layers);
    pr__batch_free(&ps.batch);
    PR_FREE(ps.route_sums);
    pr__path_free(&path);
    pr__arena_reset(tr, &tr->step_arena);
    pr__arena_reset(tr, &tr->prefix_arena);
    return st;
}

/* Step 4, the sums over the mesh: a split group's routing totals over its team and the group's
   aux term; the CP blocks' shares of the loss, log-probs and rows (the expert load's once a call,
   pr__load_end); the last stage's loss, aux term and log-probs for every stage; the gradients
   over the mesh. */
static void pr__step_reduce(pr_trainer *tr, pr__step_ctx *cx) {
    pr__moe_acc *moe = &cx->moe;
    const size_t n_tok = (size_t)cx->n_tok;
    if (cx->team && moe->on && cx->opt->moe.scope == PR_AUX_SCOPE_GROUP) pr__sum_doubles(tr, cx->team, moe->prob_tot, (size_t)moe->E);
    if (pr__last_stage(tr) && cx->owner) pr__moe_group_aux(moe);   /* the group's aux term, counted once */
    if (pr__cp(tr) > 1) {
        pr_comm *cp = tr->mesh->cp_comm;
        double r = (double)cx->rows;
        pr__sum_doubles(tr, cp, &cx->loss, 1);
        pr__sum_doubles(tr, cp, &r, 1);
        cx->rows = (long)r;
        pr__sum_host(tr, cp, cx->logp, n_tok);
    }
    if (pr__pp(tr) > 1) {
        pr_comm *pp = tr->mesh->pp_comm;
        pr__sum_doubles(tr, pp, &cx->loss, 1);
        pr__sum_doubles(tr, pp, &moe->aux, 1);
        pr__sum_host(tr, pp, cx->logp, n_tok);
    }
    /* a team's ranks computed disjoint log-probs (the owner every suffix's first token, each rank
       the rest of its own trajectories): their sum is the group's on every rank */
    if (cx->team) pr__sum_host(tr, cx->team, cx->logp, n_tok);
    if (!cx->opt->accumulate) pr__mesh_sync_grads(tr);
}

/* A loss slot's share of the stats: clipped or not, its KL to the reference. */
static void pr__slot_stats(pr_step_stats *s, const pr__step_ctx *cx, long f, double old_logp, const pr_real *ref_logp,
                           double advantage) {
    if (cx->tok_weight[f] == 0) return;
    int clipped;
    pr__ppo_surrogate(cx->logp[f], old_logp, advantage, &cx->opt->loss, &clipped);
    s->clipped_tokens += clipped;
    if (ref_logp) {
        const double delta = (double)*ref_logp - cx->logp[f];
        s->kl_sum += exp(delta) - delta - 1;
    }
}

/* Step 5, the stats: the step's status (the schedule's, else the backend's, the collectives',
   an allocation's), and on success the loss, rows, peaks and FLOPs in *stats (may be NULL). The
   step's memory is given back either way. */
static pr_status pr__step_end(pr_trainer *tr, pr__step_ctx *cx, pr_step_stats *s, pr_status st, pr_step_stats *stats,
                              pr_error *err) {
    const pr_backend *be = tr->be;
    const pr_group *g = cx->g;
    const long base = (long)g->suffix_off[g->G];
    for (long f = 0; cx->owner && f < cx->n_tok; f++) s->loss_tokens += cx->tok_weight[f] != 0;
    for (int i = 0; cx->owner && !st && i < g->G; i++) {    /* counted once for a team, as loss_tokens */
        for (long f = g->suffix_off[i]; f < g->suffix_off[i + 1]; f++)
            pr__slot_stats(s, cx, f, g->old_logp[f], g->ref_logp ? g->ref_logp + f : NULL, g->advantage[i]);
        for (int j = 0; g->prefix_mask && j < g->P; j++)
            pr__slot_stats(s, cx, base + (long)i * g->P + j, g->prefix_old_logp[j],
                           g->prefix_ref_logp ? g->prefix_ref_logp + j : NULL, g->advantage[i]);
    }
    if (cx->user_logp && cx->user_logp != cx->logp) memcpy(cx->user_logp, cx->logp, sizeof(pr_real) * (size_t)base);
    s->aux_loss = cx->moe.aux;
    s->routing_prepass = cx->moe.prepass;
    pr__step_free(cx);
    if (!st && be->take_error) st = be->take_error(be, err);
    if (!st && tr->comm_st) st = pr__fail(err, tr->comm_st, "%s", tr->comm_err.message);
    if (!st && tr->alloc_failed) st = pr__fail(err, PR_ERR_NOMEM, "out of memory for the step's collectives");
    if (st) return st;
    s->loss = cx->loss + s->aux_loss;
    s->rows = cx->rows;
    memcpy(s->peak_bytes, tr->phase_peak, sizeof s->peak_bytes);
    s->chunk_bytes = tr->chunk_bytes;
    s->flops = cx->owner ? pr_step_flops(&tr->model, cx->g, cx->opt->schedule) : 0;
    if (stats) *stats = *s;
    return PR_OK;
}

/* MoE: the expert load covers the groups of one pr_trainer_compute_grads* call, added up as
   they route: cleared at the call's start, and summed over cp (each cp rank routed its block's
   rows) once at its end, after the last group. */
static void pr__load_begin(pr_trainer *tr) {
    if (tr && tr->expert_load) memset(tr->expert_load, 0, sizeof(double) * (size_t)tr->cfg.num_hidden_layers * (size_t)tr->cfg.num_experts);
}
static void pr__load_end(pr_trainer *tr) {
    if (tr && tr->expert_load && pr__cp(tr) > 1)
        pr__sum_doubles(tr, tr->mesh->cp_comm, tr->expert_load, (size_t)tr->cfg.num_hidden_layers * (size_t)tr->cfg.num_experts);
}
/* The same at the end of a call without dp: the step's status, or the sum's failure after it (a
   step that returned PR_OK left no failed collective behind). */
static pr_status pr__load_end_call(pr_trainer *tr, pr_status st, pr_error *err) {
    if (!tr) return st;
    pr__load_end(tr);
    if (!st && tr->comm_st) return pr__fail(err, tr->comm_st, "%s", tr->comm_err.message);
    return st;
}

/* One group's step; team: the DP ranks it is split across (see pr__step_ctx), or NULL. */
static pr_status pr__compute_grads(pr_trainer *tr, const pr_group *g, const pr_step_opts *opt, pr_step_stats *stats,
                                   pr_real *logp, pr_comm *team, pr_error *err) {
    if (!tr) return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads: NULL trainer");
    pr_status st = pr__validate_step(tr, g, opt, err);          /* 1. the group and the options */
    if (st) return st;
    pr__step_ctx cx;
    if ((st = pr__step_begin(tr, &cx, g, opt, logp, team, err))) return st;   /* 2. weights, buffers */
    pr_step_stats s;
    memset(&s, 0, sizeof s);
    if (opt->schedule == PR_SCHEDULE_BASELINE) st = pr__step_baseline(tr, &cx, &s, err);   /* 3. the schedule */
    else st = pr__step_reuse(tr, &cx, &s, err);
    pr__step_reduce(tr, &cx);                                   /* 4. the sums over the mesh */
    return pr__step_end(tr, &cx, &s, st, stats, err);           /* 5. the stats */
}

PRDEF void pr_step_stats_add(pr_step_stats *step, const pr_step_stats *group) {
    if (!step || !group) return;
    pr_step_stats s = *group;
    s.loss += step->loss;
    s.flops += step->flops;
    s.rows += step->rows;
    s.loss_tokens += step->loss_tokens;
    s.kl_sum += step->kl_sum;
    s.clipped_tokens += step->clipped_tokens;
    for (int p = 0; p < 3; p++) {
        s.seconds[p] += step->seconds[p];
        if (step->peak_bytes[p] > s.peak_bytes[p]) s.peak_bytes[p] = step->peak_bytes[p];
    }
    if (step->chunk_bytes > s.chunk_bytes) s.chunk_bytes = step->chunk_bytes;
    *step = s;
}

PRDEF pr_status pr_trainer_compute_grads(pr_trainer *tr, const pr_group *g, const pr_step_opts *opt,
                                         pr_step_stats *stats, pr_real *logp, pr_error *err) {
    if (tr && opt && opt->accumulate && (pr__tp(tr) > 1 || pr__cp(tr) > 1 || pr__pp(tr) > 1))
        return pr__fail(err, PR_ERR_UNSUPPORTED, "pr_trainer_compute_grads: on a mesh with tp, cp or pp, a step of several "
                        "groups accumulates through pr_trainer_compute_grads_dp (its sums over the mesh run once, after the "
                        "last group)");
    pr__load_begin(tr);
    return pr__load_end_call(tr, pr__compute_grads(tr, g, opt, stats, logp, NULL, err), err);
}

/* FLOPs a token costs through the layers (its matmuls), and a (query, key) pair in attention. */
static void pr__flop_rates(const pr_config *c, double *per_token, double *per_pair) {
    double C = c->hidden_size, F = c->intermediate_size;
    double qd = (double)c->num_attention_heads * c->head_dim, kvd = (double)c->num_key_value_heads * c->head_dim;
    double mlp = c->num_experts ? C * c->num_experts + (double)c->num_experts_per_tok * 3 * C * c->moe_intermediate_size
                                : 3 * C * F;              /* MoE: router, then k experts per token */
    *per_token = 6 * (C * qd + 2 * C * kvd + qd * C + mlp) * c->num_hidden_layers;   /* fwd 2x, bwd 4x */
    *per_pair = 12 * qd * c->num_hidden_layers;          /* QK^T and PV: fwd 4*HS*NH, bwd 8*HS*NH */
}

PRDEF void pr_step_phase_flops(const pr_config *c, const pr_group *g, pr_schedule schedule, double flops[3]) {
    if (!flops) return;
    flops[PR_PHASE_A] = flops[PR_PHASE_B] = flops[PR_PHASE_C] = 0;
    if (!c || !g || !g->suffix_len) return;
    double C = c->hidden_size, V = c->vocab_size, per_token, per_pair;
    pr__flop_rates(c, &per_token, &per_pair);
    const double head_row = 6 * C * V, P = g->P;
    /* trained prefix tokens: a head row each under reuse, G under the baseline */
    const double trained = pr__prefix_trained(g, 0, g->P);
    double tokens = 0, pairs = 0, suffix_rows = 0;
    for (int i = 0; i < g->G; i++) {
        double S = g->suffix_len[i], T = P + S;
        suffix_rows += S - 1;
        if (schedule == PR_SCHEDULE_BASELINE) { tokens += T; pairs += T * (T + 1) / 2; }
        else { tokens += S; pairs += S * P + S * (S + 1) / 2; }
    }
    flops[PR_PHASE_B] = tokens * per_token + pairs * per_pair + suffix_rows * head_row;
    if (schedule == PR_SCHEDULE_BASELINE) {        /* each sequence's last prefix row and its trained prefix tokens */
        flops[PR_PHASE_B] += g->G * (1 + trained) * head_row;
        return;
    }
    /* the prefix's loss rows: its last row once a suffix (each its own first token), each trained
       prefix token once for all G (pr__head_push_prefix) */
    const double prefix = P * per_token + P * (P + 1) / 2 * per_pair;   /* forward 1/3 of it, backward 2/3 */
    flops[PR_PHASE_A] = prefix / 3;
    flops[PR_PHASE_C] = prefix - prefix / 3 + (g->G + trained) * head_row;
}

PRDEF double pr_step_flops(const pr_config *c, const pr_group *g, pr_schedule schedule) {
    double f[3];
    pr_step_phase_flops(c, g, schedule, f);
    return f[PR_PHASE_A] + f[PR_PHASE_B] + f[PR_PHASE_C];
}

/* ---------------------------------------------------------------- 4.5 Prefix trees */
/* A step's groups whose prefixes share tokens (pr_prefix_tree_build): the reuse schedule with the
   prefix cut into the tree's nodes. Each node is a prefix pass over its rows of the path
   (pr__kv_path): forward once, top-down, attending to the nodes above it; then its children's
   subtrees, and the suffixes of the groups whose prefix ends at it, as Phase B against the whole
   path; then its backward once, with the gK/gV of everything below it injected, its own dK/dV of
   the rows above added into theirs. A group alone is the tree of one node: pr__step_reuse.
   A node's rows stand for every trajectory below it: its expert load counts them all, its
   routing sums join the aux loss of each group below, and its router takes the sum of their aux
   gradients. Under offload a node's blocks rest in the host pool after its parent's, from its
   forward to its backward; the pool holds the deepest chain of nodes at once. */
typedef struct {
    const pr_prefix_tree *tree;
    pr__step_ctx *cx;            /* (n_groups) each group's step */
    int *first_child, *next_sibling, *first_end, *next_end, *from;   /* (n_nodes), ends (n_groups) */
    int *copies;                 /* (n_nodes) the trajectories below each node */
    pr__step_ctx **heads;        /* (n_groups) scratch: the groups with loss rows in one node */
    double *aux_c;               /* (num_experts) MoE scratch: a node's aux gradient */
    size_t pool_stack;           /* offload: the dormant bytes of the deepest chain of nodes */
    pr__kv_path path;
    pr_step_stats *s;
} pr__tree_run;

/* 1 when group k's prefix runs through node. */
static int pr__tree_below(const pr_prefix_tree *tree, int node, int k) {
    for (int i = tree->group_node[k]; i >= node; i = tree->nodes[i].parent)
        if (i == node) return 1;
    return 0;
}

/* Copy times add up while every part was measured; one unmeasured part (-1) makes the sum unmeasured. */
static double pr__seconds_add(double a, double b) { return a < 0 || b < 0 ? -1 : a + b; }

static void pr__offload_stats_add(pr_offload_stats *sum, const pr_offload_stats *o) {
    if (o->block_bytes > sum->block_bytes) sum->block_bytes = o->block_bytes;
    if (o->host_peak_bytes > sum->host_peak_bytes) sum->host_peak_bytes = o->host_peak_bytes;
    sum->pool_bytes = o->pool_bytes;
    sum->offloaded_bytes += o->offloaded_bytes;
    sum->loaded_bytes += o->loaded_bytes;
    sum->prefetches += o->prefetches;
    sum->demand_loads += o->demand_loads;
    sum->prefetches_refused += o->prefetches_refused;
    sum->pool_fallbacks += o->pool_fallbacks;
    sum->copy_seconds = pr__seconds_add(sum->copy_seconds, o->copy_seconds);
}

static pr_status pr__tree_node_run(pr_trainer *tr, pr__tree_run *t, int node, const pr__offload *below, pr_error *err) {
    const pr_backend *be = tr->be;
    const pr_prefix_tree *tree = t->tree;
    const pr_prefix_node *nd = &tree->nodes[node];
    pr__step_ctx *cx = &t->cx[t->from[node]];     /* the group the node's rows are read from */
    const int E = tr->cfg.num_experts;
    pr__arena a;
    memset(&a, 0, sizeof a);
    pr__prefix_state ps;
    memset(&ps, 0, sizeof ps);
    ps.a = &a;
    ps.copies = t->copies[node];
    ps.below = below;
    ps.pool_stack = t->pool_stack;
    double t0 = pr__now();
    pr__enter_phase(tr, PR_PHASE_A);
    pr__path_push(tr, &t->path, nd->len);
    pr_status st = pr__phase_a_prefix_forward(tr, cx, &ps, &t->path, nd->start, nd->len, err);
    for (int k = 0; k < tree->n_groups && cx->moe.on && !st; k++)    /* the node's routing sums: every group's below */
        if (&t->cx[k] != cx && pr__tree_below(tree, node, k))
            for (int i = 0; i <= 2 * E; i++) t->cx[k].moe.pre[i] += ps.route_sums[i];
    be->sync(be);
    t->s->seconds[PR_PHASE_A] += pr__now() - t0;
    for (int c = t->first_child[node]; c >= 0 && !st; c = t->next_sibling[c]) st = pr__tree_node_run(tr, t, c, &ps.off, err);
    int n_heads = 0;             /* the groups with loss rows in the node: its batch's group first */
    t->heads[n_heads++] = cx;
    for (int k = t->first_end[node]; k >= 0 && !st; k = t->next_end[k]) {
        int n_mb = 0;
        t0 = pr__now();
        pr__enter_phase(tr, PR_PHASE_B);
        st = pr__phase_b_suffix_microbatches(tr, &t->cx[k], &t->path, &n_mb, err);
        be->sync(be);
        t->s->seconds[PR_PHASE_B] += pr__now() - t0;
        t->s->microbatches += n_mb;
        if (&t->cx[k] != cx) t->heads[n_heads++] = &t->cx[k];
    }
    for (int k = 0; k < tree->n_groups; k++)       /* groups passing through that train tokens of it */
        if (&t->cx[k] != cx && tree->group_node[k] != node && pr__prefix_trained(t->cx[k].g, nd->start + 1,
                                                                                   nd->start + nd->len + 1) &&
            pr__tree_below(tree, node, k))
            t->heads[n_heads++] = &t->cx[k];
    if (cx->moe.on) {                             /* every group below has its aux gradient now */
        memset(t->aux_c, 0, sizeof(double) * (size_t)E);
        for (int k = 0; k < tree->n_groups; k++)
            if (pr__tree_below(tree, node, k))
                for (int e = 0; e < E; e++) t->aux_c[e] += t->cx[k].moe.c[e];
        ps.aux_c = t->aux_c;
    }
    t0 = pr__now();
    pr__enter_phase(tr, PR_PHASE_C);
    if (!st) st = pr__phase_c_prefix_backward(tr, cx, &ps, &t->path, t->heads, n_heads, err);
    be->sync(be);
    t->s->seconds[PR_PHASE_C] += pr__now() - t0;
    pr__path_pop(&t->path);
    pr__offload_end(tr, &ps.off);
    pr__offload_stats_add(&t->s->offload, &ps.off.st);
    PR_FREE(ps.route_sums);
    pr__pass_free_host(&ps.pass, tr->cfg.num_hidden_layers);
    pr__batch_free(&ps.batch);
    pr__arena_reset(tr, &a);
    pr__arena_reset(tr, &tr->step_arena);
    return st;
}

/* The tree against the groups: every group's prefix is the chain of nodes from a root down to
   group_node, each node's tokens the same in every group through it. */
static pr_status pr__tree_check(const pr_prefix_tree *tree, const pr_group *groups, int n, pr_error *err) {
    if (tree->n_groups != n || tree->n_nodes < 1 || !tree->nodes || !tree->group_node)
        return pr__fail(err, PR_ERR_ARG, "prefix tree: built for %d groups, given %d", tree->n_groups, n);
    for (int i = 0; i < tree->n_nodes; i++) {
        const pr_prefix_node *nd = &tree->nodes[i];
        if (nd->parent < -1 || nd->parent >= i || nd->len < 1 || nd->start != (nd->parent < 0 ? 0 : tree->nodes[nd->parent].start +
                                                                                                    tree->nodes[nd->parent].len))
            return pr__fail(err, PR_ERR_ARG, "prefix tree: node %d (parent %d, rows %d..%d) does not continue its parent", i,
                            nd->parent, nd->start, nd->start + nd->len);
    }
    for (int k = 0; k < n; k++) {
        int node = tree->group_node[k];
        if (node < 0 || node >= tree->n_nodes || tree->nodes[node].start + tree->nodes[node].len != groups[k].P)
            return pr__fail(err, PR_ERR_ARG, "prefix tree: group %d's prefix of %d tokens does not end at its node %d", k,
                            groups[k].P, node);
    }
    return PR_OK;
}

/* The tree step on this rank: its groups' gradients, summed over the mesh (TP, PP) when
   opt->accumulate is 0 (pr_trainer_compute_grads_tree_dp accumulates, then sums once). */
static pr_status pr__compute_grads_tree(pr_trainer *tr, const pr_group *groups, int n, const pr_prefix_tree *tree,
                                        const pr_step_opts *opt, pr_step_stats *stats, pr_error *err) {
    if (!tr || !groups || n < 1 || !tree || !opt)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads_tree: NULL argument or no groups");
    if (opt->schedule != PR_SCHEDULE_REUSE)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads_tree: a prefix tree runs the reuse schedule");
    pr_status st = pr__tree_check(tree, groups, n, err);
    for (int k = 0; k < n && !st; k++) {
        if ((st = pr__validate_step(tr, &groups[k], opt, err))) st = pr__fail(err, st, "group %d: %s", k, err ? err->message : "");
    }
    if (st) return st;
    const int N = tree->n_nodes;
    pr__tree_run t;
    memset(&t, 0, sizeof t);
    t.tree = tree;
    t.cx = (pr__step_ctx *)PR_MALLOC(sizeof(pr__step_ctx) * (size_t)n);
    pr_step_opts *o = (pr_step_opts *)PR_MALLOC(sizeof(pr_step_opts) * (size_t)n);
    int *idx = (int *)PR_MALLOC(sizeof(int) * (5 * (size_t)N + 2 * (size_t)n));
    t.heads = (pr__step_ctx **)PR_MALLOC(sizeof(pr__step_ctx *) * (size_t)n);
    size_t *stack = (size_t *)PR_MALLOC(sizeof(size_t) * 4 * (size_t)N);
    t.aux_c = (double *)PR_MALLOC(sizeof(double) * ((size_t)tr->cfg.num_experts + 1));
    if (!t.cx || !o || !idx || !t.heads || !stack || !t.aux_c) {
        PR_FREE(t.cx); PR_FREE(o); PR_FREE(idx); PR_FREE(t.heads); PR_FREE(stack); PR_FREE(t.aux_c);
        return pr__fail(err, PR_ERR_NOMEM, "out of host memory for a tree of %d nodes", N);
    }
    t.first_child = idx; t.next_sibling = idx + N; t.first_end = idx + 2 * N; t.from = idx + 3 * N;
    t.copies = idx + 4 * N; t.next_end = idx + 5 * N;
    for (int i = 0; i < N; i++) t.first_child[i] = t.next_sibling[i] = t.first_end[i] = t.from[i] = -1;
    /* the trajectories below each node; down to it the dormant bytes and the path's rows: this rank's,
       in the K/V buffers, and its segments */
    size_t *own = stack + N, *kv = stack + 2 * (size_t)N, *depth = stack + 3 * (size_t)N, own_cap = 0, kv_cap = 0, depth_cap = 0;
    for (int i = 0; i < N; i++) {
        const int up = tree->nodes[i].parent;
        const pr__cp_cut cut = pr__cp_cut_of(tr, tree->nodes[i].len);
        t.copies[i] = 0;
        for (int k = 0; k < n; k++) t.copies[i] += pr__tree_below(tree, i, k) ? groups[k].G : 0;
        stack[i] = (size_t)tr->cfg.num_hidden_layers *
                   pr__layer_block(tr, NULL, (size_t)tree->nodes[i].len, opt->recompute == PR_RECOMPUTE_NONE, NULL, NULL);
        own[i] = (size_t)pr__cp_own(&cut);
        kv[i] = (size_t)cut.chunk;
        depth[i] = 1;
        if (up >= 0) stack[i] += stack[up], own[i] += own[up], kv[i] += kv[up], depth[i] += depth[up];
        if (stack[i] > t.pool_stack) t.pool_stack = stack[i];
        if (own[i] > own_cap) own_cap = own[i];
        if (kv[i] > kv_cap) kv_cap = kv[i];
        if (depth[i] > depth_cap) depth_cap = depth[i];
    }
    PR_FREE(stack);
    for (int i = N - 1; i >= 0; i--)             /* children in node order */
        if (tree->nodes[i].parent >= 0) {
            t.next_sibling[i] = t.first_child[tree->nodes[i].parent];
            t.first_child[tree->nodes[i].parent] = i;
        }
    for (int k = n - 1; k >= 0; k--) {           /* ending groups in group order; a node's rows from the first */
        t.next_end[k] = t.first_end[tree->group_node[k]];
        t.first_end[tree->group_node[k]] = k;
        for (int i = tree->group_node[k]; i >= 0; i = tree->nodes[i].parent) t.from[i] = k;
    }
    for (int i = 0; i < N; i++)                  /* a node that ends groups is read from the first of them */
        if (t.first_end[i] >= 0) t.from[i] = t.first_end[i];
    for (int k = 0; k < n && !st; k++)
        for (int i = tree->group_node[k]; i >= 0 && !st; i = tree->nodes[i].parent) {
            const pr_prefix_node *nd = &tree->nodes[i];
            if (t.from[i] < 0 || memcmp(groups[k].prefix + nd->start, groups[t.from[i]].prefix + nd->start,
                                        sizeof(int32_t) * (size_t)nd->len))
                st = pr__fail(err, PR_ERR_ARG, "prefix tree: groups %d and %d share node %d but not its tokens", t.from[i], k, i);
        }
    pr_step_stats s;
    memset(&s, 0, sizeof s);
    t.s = &s;
    int begun = 0;
    for (int i = 0; i < N && !st; i++)
        if (t.from[i] < 0) st = pr__fail(err, PR_ERR_ARG, "prefix tree: node %d has no group below it", i);
    for (int k = 0; k < n && !st; k++) {    /* the first group's step zeroes the gradients; the rest add */
        o[k] = *opt;
        o[k].accumulate = opt->accumulate || k > 0;
        st = pr__step_begin(tr, &t.cx[k], &groups[k], &o[k], NULL, NULL, err);
        begun += !st;              /* a failed begin gave its memory back itself */
    }
    if (!st) st = pr__path_alloc(tr, &t.path, (int)own_cap, (int)kv_cap, (int)depth_cap, opt->hooks.on_dkv != NULL, err);
    for (int i = 0; i < N && !st; i++)
        if (tree->nodes[i].parent < 0) st = pr__tree_node_run(tr, &t, i, NULL, err);
    s.prefix_kv_bytes = (size_t)tr->cfg.num_hidden_layers * 2 * kv_cap * tr->cfg.num_key_value_heads *
                        tr->cfg.head_dim * tr->be->act_bytes;
    pr__path_free(&t.path);
    pr__arena_reset(tr, &tr->prefix_arena);
    pr_step_stats total;
    memset(&total, 0, sizeof total);
    for (int k = 0; k < begun; k++) {            /* each group's sums and stats; the step's status from the first failure */
        pr_step_stats one;
        pr_error e;
        memset(&one, 0, sizeof one);
        pr__step_reduce(tr, &t.cx[k]);
        pr_status sk = pr__step_end(tr, &t.cx[k], &one, st, &one, st ? &e : err);
        if (!st && sk) st = sk;
        if (!st) pr_step_stats_add(&total, &one);
    }
    PR_FREE(t.cx); PR_FREE(o); PR_FREE(idx); PR_FREE(t.heads); PR_FREE(t.aux_c);
    if (st) return st;
    memcpy(total.seconds, s.seconds, sizeof s.seconds);
    total.microbatches = s.microbatches;
    total.offload = s.offload;
    total.offload.dormant_bytes = t.pool_stack;
    total.prefix_kv_bytes = s.prefix_kv_bytes;
    total.flops = pr_tree_flops(&tr->model, groups, n, tree);
    if (stats) *stats = total;
    return PR_OK;
}

PRDEF pr_status pr_trainer_compute_grads_tree(pr_trainer *tr, const pr_group *groups, int n, const pr_prefix_tree *tree,
                                              const pr_step_opts *opt, pr_step_stats *stats, pr_error *err) {
    if (tr && opt && opt->accumulate && (pr__tp(tr) > 1 || pr__cp(tr) > 1 || pr__pp(tr) > 1))
        return pr__fail(err, PR_ERR_UNSUPPORTED, "pr_trainer_compute_grads_tree: on a mesh with tp, cp or pp, a step accumulates "
                        "through pr_trainer_compute_grads_tree_dp (its sums over the mesh run once, after the last group)");
    pr__load_begin(tr);
    return pr__load_end_call(tr, pr__compute_grads_tree(tr, groups, n, tree, opt, stats, err), err);
}

PRDEF double pr_tree_flops(const pr_config *c, const pr_group *groups, int n, const pr_prefix_tree *tree) {
    if (!c || !groups || !tree || tree->n_groups != n) return 0;
    double per_token, per_pair, f = 0;
    pr__flop_rates(c, &per_token, &per_pair);
    for (int k = 0; k < n; k++) {                 /* each group with its own prefix, less that prefix ... */
        const double P = groups[k].P;
        f += pr_step_flops(c, &groups[k], PR_SCHEDULE_REUSE) - P * per_token - P * (P + 1) / 2 * per_pair;
    }
    for (int i = 0; i < tree->n_nodes; i++) {     /* ... and each node once, attending to the rows above it */
        const double s = tree->nodes[i].start, len = tree->nodes[i].len;
        f += len * per_token + (len * s + len * (len + 1) / 2) * per_pair;
    }
    return f;
}

/* ---------------------------------------------------------------- 4.6 AdamW */
PRDEF pr_adamw_opts pr_adamw_opts_default(void) {
    pr_adamw_opts o;
    o.lr = 1e-3; o.beta1 = 0.9; o.beta2 = 0.999; o.eps = 1e-8; o.weight_decay = 0.01; o.max_grad_norm = 1.0;
    return o;
}

/* The squared norm of the full model's gradient. The arena is summed in pieces, each a tensor's
   part of one unit (a tensor held on several ranks counted on one), every piece's sum of squares
   added in arena order: sharded, each rank sums the pieces of its slice, the pieces are gathered
   over dp (padded with zeros, which add nothing), and the same additions run in the same order,
   so every stage gets the same bits. Then the sums of the TP and PP shards. */
static size_t pr__grad_pieces(pr_trainer *tr, size_t lo, size_t hi, double *piece) {
    const pr_backend *be = tr->be;
    size_t k = 0;
    for (int t = 0; t < tr->n_tensors; t++) {
        const pr_tensor_info *ti = &tr->tensors[t];
        if (tr->mesh && tr->shard[t].elsewhere) continue;
        size_t a = ti->offset > lo ? ti->offset : lo, b = ti->offset + ti->numel < hi ? ti->offset + ti->numel : hi;
        while (a < b) {
            size_t e = (a / tr->unit + 1) * tr->unit;
            if (e > b) e = b;
            if (piece) piece[k] = be->sum_squares(be, tr->grads + a, e - a);
            k++;
            a = e;
        }
    }
    return k;
}

/* Its buffers were taken with the trainer: a rank short of memory here would leave its dp peers
   waiting in the gather, or meeting its next call of the same shape. */
static double pr__grad_sum_squares(pr_trainer *tr) {
    const pr_backend *be = tr->be;
    const int R = tr->zero ? tr->mesh->dp : 1;
    const size_t cap = pr__norm_pieces_cap(tr);
    double *piece = tr->norm_pieces, *dev = tr->norm_pieces_dev, sq = 0;
    const size_t mine = (size_t)(R > 1 ? tr->mesh->dp_rank : 0) * cap;
    memset(piece, 0, sizeof(double) * cap * (size_t)R);
    pr__grad_pieces(tr, tr->slice_lo, tr->slice_lo + tr->slice_n, piece + mine);
    if (R > 1) {
        pr_comm *c = tr->mesh->dp_comm;
        pr_error e;
        be->copy(be, dev + mine, piece + mine, sizeof(double) * cap);
        pr__comm_done(tr, c->all_gather(c, dev, dev + mine, cap, PR_COMM_F64, &e), &e);
        be->copy(be, piece, dev, sizeof(double) * cap * (size_t)R);
        be->sync(be);
    }
    for (size_t k = 0; k < cap * (size_t)R; k++) sq += piece[k];
    if (tr->mesh) {
        pr__sum_doubles(tr, tr->mesh->tp_comm, &sq, 1);
        pr__sum_doubles(tr, tr->mesh->pp_comm, &sq, 1);
    }
    return sq;
}

/* AdamW's settings in range: what a step runs with and a saved state records. */
static pr_status pr__adamw_check(const pr_adamw_opts *o, pr_error *err) {
    if (!(o->lr >= 0 && isfinite(o->lr)) || !(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) ||
        !(o->eps > 0 && isfinite(o->eps)) || !(o->weight_decay >= 0 && isfinite(o->weight_decay)) || !(o->max_grad_norm >= 0))
        return pr__fail(err, PR_ERR_ARG,
                        "AdamW settings out of range (lr %g, betas %g %g, eps %g, weight decay %g, max grad norm %g): lr, eps and "
                        "weight decay finite, betas in [0,1), eps > 0, max grad norm >= 0",
                        o->lr, o->beta1, o->beta2, o->eps, o->weight_decay, o->max_grad_norm);
    return PR_OK;
}

PRDEF pr_status pr_trainer_adamw_step(pr_trainer *tr, const pr_adamw_opts *o, double *grad_norm, pr_error *err) {
    if (!tr || !o) return pr__fail(err, PR_ERR_ARG, "pr_trainer_adamw_step: NULL argument");
    const pr_status ost = pr__adamw_check(o, err);
    if (ost) return ost;
    const pr_backend *be = tr->be;
    const size_t lo = tr->slice_lo, hi = tr->slice_lo + tr->slice_n;
    tr->comm_st = PR_OK;
    double norm = sqrt(pr__grad_sum_squares(tr));
    pr_status st = be->take_error ? be->take_error(be, err) : PR_OK;
    if (!st && tr->comm_st) st = pr__fail(err, tr->comm_st, "%s", tr->comm_err.message);
    if (st) return st;
    if (!isfinite(norm)) return pr__fail(err, PR_ERR_ARG, "gradient norm is %g: parameters left unchanged", norm);
    /* this rank's slice (all of the arena unless sharded): clip, then AdamW tensor by tensor, a
       tensor cut by the slice's ends updated over its part, with its own weight decay */
    if (o->max_grad_norm > 0 && norm > o->max_grad_norm) be->scale(be, tr->grads + lo, tr->slice_n, o->max_grad_norm / norm);
    tr->adam_step++;
    for (int t = 0; t < tr->n_tensors; t++) {
        const pr_tensor_info *ti = &tr->tensors[t];
        size_t a = ti->offset > lo ? ti->offset : lo, b = ti->offset + ti->numel < hi ? ti->offset + ti->numel : hi;
        if (a >= b) continue;
        be->adamw(be, tr->params + (a - lo), tr->grads + a, tr->adam_m + (a - lo), tr->adam_v + (a - lo), b - a, o->lr,
                  o->beta1, o->beta2, o->eps, ti->decay ? o->weight_decay : 0.0, tr->adam_step);
    }
    if ((st = pr__weights_publish(tr, err))) return st;
    if (grad_norm) *grad_norm = norm;
    return be->take_error ? be->take_error(be, err) : PR_OK;
}


/* ================================================================ 5. OFFLOAD: device slots, the host pool, moves between them */
#define PR__DEVICE_MARGIN ((size_t)256 << 20)   /* free device memory a prefetch must leave */

static void pr__live_add(pr_trainer *tr, size_t bytes) {
    tr->live_bytes += bytes;
    if (tr->live_bytes > tr->phase_peak[tr->phase]) tr->phase_peak[tr->phase] = tr->live_bytes;
}
static int pr__slot_of(const pr__offload *o, int layer) {
    for (int s = 0; s < PR__SLOTS; s++) if (o->slot_layer[s] == layer) return s;
    return -1;
}
/* A free slot, preferring one no copy is still reading. */
static int pr__slot_free(const pr_trainer *tr, const pr__offload *o) {
    int any = -1;
    for (int s = 0; s < PR__SLOTS; s++)
        if (o->slot_layer[s] < 0) {
            if (!tr->slot_copying[s]) return s;
            if (any < 0) any = s;
        }
    return any;
}
/* A block copy into or out of slot s, on the backend's copy queue when it has one (tagged with
   the slot); pr__slot_wait makes the compute issued next wait for it. */
static void pr__block_copy(pr_trainer *tr, pr__offload *o, int s, void *dst, const void *src) {
    if (tr->be->copy_async) {
        tr->be->copy_async(tr->be, dst, src, o->block, s);
        tr->slot_copying[s] = 1;
    } else {
        tr->be->copy(tr->be, dst, src, o->block);
    }
}
static void pr__slot_wait(pr_trainer *tr, int s) {
    if (!tr->slot_copying[s]) return;
    tr->be->copy_wait(tr->be, s);
    tr->slot_copying[s] = 0;
}

/* Puts layer's block in a free device slot (kept across steps, counted live while held) and points
   the pass's tensors of that layer into it. */
static pr_status pr__slot_take(pr_trainer *tr, pr__offload *o, pr__pass *ps, int layer, pr_error *err) {
    int s = pr__slot_free(tr, o);
    if (s < 0) return pr__fail(err, PR_ERR_ARG, "offload: no free device slot for layer %d", layer);   /* a schedule bug */
    pr__slot_wait(tr, s);                           /* the block that left it is out before it is overwritten */
    if (!tr->slot[s] || tr->slot_cap[s] < o->block) {   /* a block of no rows gets a slot too: its tensors point somewhere */
        if (tr->slot[s]) tr->be->release(tr->be, tr->slot[s], PR_TIER_DEVICE);
        tr->slot[s] = (char *)pr__device_alloc(tr, o->block);
        tr->slot_cap[s] = tr->slot[s] ? o->block : 0;
        if (!tr->slot[s]) return pr__fail(err, PR_ERR_NOMEM, "out of device memory for an offload slot of %zu bytes", o->block);
    }
    o->slot_layer[s] = layer;
    pr__live_add(tr, o->block);
    pr__layer_block(tr, tr->slot[s], (size_t)ps->N, ps->keep == PR__KEEP_ALL, &ps->acts[layer], &ps->res[layer]);
    return PR_OK;
}
static void pr__slot_give(pr_trainer *tr, pr__offload *o, int layer) {
    int s = pr__slot_of(o, layer);
    if (s < 0) return;
    o->slot_layer[s] = -1;
    tr->live_bytes -= o->block;
}

/* Phase A, after layer l's forward: its block goes to the pool (or, when full, to a host
   allocation of its own) and its slot is free for layer l+2. */
static pr_status pr__offload_block(pr_trainer *tr, pr__offload *o, int l, pr_error *err) {
    const pr_backend *be = tr->be;
    if (o->pool_used + o->block <= tr->pool_cap) {
        o->host[l] = (char *)tr->pool + o->pool_used;
        o->pool_used += o->block;
    } else {
        o->host[l] = be->alloc(be, o->block, PR_TIER_HOST);
        if (!o->host[l]) return pr__fail(err, PR_ERR_NOMEM, "out of host memory to offload a %zu-byte block", o->block);
        o->own[l] = 1;
        o->own_live += o->block;
        o->st.pool_fallbacks++;
        if (tr->pool_cap + o->own_live > o->st.host_peak_bytes) o->st.host_peak_bytes = tr->pool_cap + o->own_live;
    }
    int s = pr__slot_of(o, l);
    pr__block_copy(tr, o, s, o->host[l], tr->slot[s]);
    o->st.offloaded_bytes += o->block;
    pr__slot_give(tr, o, l);
    return PR_OK;
}

/* Phase C: layer l's block back into a device slot (on the copy queue: compute joins it before
   the layer's backward reads the block). */
static pr_status pr__load_block(pr_trainer *tr, pr__offload *o, pr__pass *ps, int l, pr_error *err) {
    pr_status st = pr__slot_take(tr, o, ps, l, err);
    if (st) return st;
    int s = pr__slot_of(o, l);
    pr__block_copy(tr, o, s, tr->slot[s], o->host[l]);
    o->st.loaded_bytes += o->block;
    return PR_OK;
}

/* Prefetches layer l's block when a slot is free and the budget allows; counts a refusal. */
static pr_status pr__prefetch_block(pr_trainer *tr, pr__offload *o, pr__pass *ps, int l, size_t budget, pr_error *err) {
    const pr_backend *be = tr->be;
    if (l < 0 || pr__slot_of(o, l) >= 0 || pr__slot_free(tr, o) < 0) return PR_OK;
    int fits = (!budget || tr->live_bytes + o->block <= budget) &&
               (!be->device_free || be->device_free(be) >= o->block + PR__DEVICE_MARGIN);
    if (!fits) {
        o->st.prefetches_refused++;
        return PR_OK;
    }
    o->st.prefetches++;
    return pr__load_block(tr, o, ps, l, err);
}

/* Phase C, after layer l's backward: its slot and host space are done with. */
static void pr__block_done(pr_trainer *tr, pr__offload *o, int l) {
    pr__slot_give(tr, o, l);
    if (o->own[l]) {
        tr->be->release(tr->be, o->host[l], PR_TIER_HOST);
        o->own[l] = 0;
        o->own_live -= o->block;
    }
    o->host[l] = NULL;
}

/* Sets up the offload of the P rows of prefix pass ps (whose blocks are its layers' inputs alone
   under recompute): the block size, the bookkeeping and the host pool. A first pass (below NULL)
   starts the pool empty, creating or resizing it to the request, or to `stack` bytes (0: its own
   blocks) and a sixteenth. A pass stacked on another (a prefix tree node on its parent, whose
   blocks wait in the pool for their own backward) puts its blocks after below's and leaves the
   pool as it is. With offload off only the footprint is recorded, for the stats. */
static pr_status pr__offload_begin(pr_trainer *tr, pr__offload *o, const pr_offload_opts *opt, const pr__pass *ps, int P,
                                   const pr__offload *below, size_t stack, pr_error *err) {
    const int L = tr->cfg.num_hidden_layers;
    memset(o, 0, sizeof *o);
    for (int s = 0; s < PR__SLOTS; s++) o->slot_layer[s] = -1;
    o->block = pr__layer_block(tr, NULL, (size_t)P, ps->keep == PR__KEEP_ALL, NULL, NULL);
    o->st.block_bytes = o->block;
    o->st.dormant_bytes = o->block * (size_t)L;
    if (!opt->enabled) return PR_OK;
    o->host = (void **)PR_MALLOC(sizeof(void *) * (size_t)L);
    o->own = (unsigned char *)PR_MALLOC((size_t)L);
    if (!o->host || !o->own) return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
    o->on = 1;                                /* pr__offload_end walks host and own from here on */
    memset(o->host, 0, sizeof(void *) * (size_t)L);
    memset(o->own, 0, (size_t)L);
    if (!stack) stack = o->st.dormant_bytes;
    size_t want = opt->pool_bytes ? opt->pool_bytes : stack + stack / 16;
    int resize = !tr->pool || (opt->pool_bytes ? tr->pool_cap != want : tr->pool_cap < stack);   /* a pool even for no rows */
    if (below) o->pool_used = below->pool_used;
    else if (resize) {
        if (tr->pool) tr->be->release(tr->be, tr->pool, PR_TIER_HOST);
        tr->pool = tr->be->alloc(tr->be, want, PR_TIER_HOST);
        tr->pool_cap = tr->pool ? want : 0;       /* no pool: every block falls back, still correct */
    }
    o->st.pool_bytes = tr->pool_cap;
    o->st.host_peak_bytes = tr->pool_cap;
    return PR_OK;
}

/* Waits for the copies still queued, releases whatever an interrupted step still holds, then the
   bookkeeping. */
static void pr__offload_end(pr_trainer *tr, pr__offload *o) {
    if (o->on) {
        for (int s = 0; s < PR__SLOTS; s++) pr__slot_wait(tr, s);
        tr->be->sync(tr->be);
        if (tr->be->copy_async && tr->be->copy_seconds)
            o->st.copy_seconds = pr__seconds_add(o->st.copy_seconds, tr->be->copy_seconds(tr->be));
        for (int l = 0; l < tr->cfg.num_hidden_layers; l++) pr__block_done(tr, o, l);
    }
    PR_FREE(o->host);
    PR_FREE(o->own);
    o->host = NULL;
    o->own = NULL;
}


/* ================================================================ 6. MOE */
/* ---------------------------------------------------------------- 6.1 Routing on the host */
/* The host's routing work is N x E for every MoE layer of every pass, on every rank alike (at
   Qwen3-30B-A3B's 128 experts and 12k rows, 1.5 million exponentials a layer and pass,
   milliseconds on one core while a GPU waits for it): its loops run on every core, each row (or
   expert) by one thread in the serial order, so the bits do not depend on the thread count. */
static int pr__host_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
static int pr__host_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Softmax over the router logits in double, the top-k per row (ties to the lower expert index),
   their weights (renormalised with norm_topk_prob), and the slots grouped by expert. */
static void pr__moe_route(pr_trainer *tr, pr__route *rt, const void *logits, int N) {
    const pr_config *c = &tr->cfg;
    const int E = c->num_experts, k = c->num_experts_per_tok, nt = pr__host_threads();
    pr_real *z = (pr_real *)PR_MALLOC(sizeof(pr_real) * (size_t)N * E);
    /* a row's softmax (one row a thread at a time), then each row's top-k probabilities (in
       double, for the weights) */
    double *pd = (double *)PR_MALLOC(sizeof(double) * ((size_t)E * nt + (size_t)N * k)), *dsel = pd ? pd + (size_t)E * nt : NULL;
    int *sel = (int *)PR_MALLOC(sizeof(int) * ((size_t)N * k + E)), *fill = sel ? sel + (size_t)N * k : NULL;
    if (!z || !pd || !sel) {
        PR_FREE(z);
        PR_FREE(pd);
        PR_FREE(sel);
        tr->alloc_failed = 1;
        return;
    }
    tr->be->download_acts(tr->be, z, logits, (size_t)N * E);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
    for (int r = 0; r < N; r++) {
        const pr_real *zr = z + (size_t)r * E;
        double *p = pd + (size_t)E * pr__host_thread(), mx = -INFINITY, sum = 0;
        for (int e = 0; e < E; e++) if (zr[e] > mx) mx = zr[e];
        for (int e = 0; e < E; e++) sum += p[e] = exp((double)zr[e] - mx);
        for (int e = 0; e < E; e++) p[e] /= sum;
        /* top k in one pass: sr stays sorted by descending p; a later expert passes an earlier one
           only when strictly larger, so ties go to the lower index */
        int *sr = sel + (size_t)r * k, n = 0;
        for (int e = 0; e < E; e++) {
            if (n == k && !(p[e] > p[sr[k - 1]])) continue;
            int i = n < k ? n++ : k - 1;
            for (; i > 0 && p[e] > p[sr[i - 1]]; i--) sr[i] = sr[i - 1];
            sr[i] = e;
        }
        double top = 0;
        for (int j = 0; j < k; j++) top += p[sr[j]];
        rt->wsum[r] = c->norm_topk_prob ? top : 1.0;
        for (int j = 0; j < k; j++) dsel[(size_t)r * k + j] = p[sr[j]];
        for (int e = 0; e < E; e++) rt->prob[(size_t)r * E + e] = (pr_real)p[e];
    }
    memset(rt->start, 0, sizeof(int) * (size_t)(E + 1));
    for (size_t j = 0; j < (size_t)N * k; j++) rt->start[sel[j] + 1]++;
    for (int e = 0; e < E; e++) rt->start[e + 1] += rt->start[e];
    memcpy(fill, rt->start, sizeof(int) * (size_t)E);
    for (int r = 0; r < N; r++)            /* rows ascending, so each expert's slots are in row order */
        for (int j = 0; j < k; j++) {
            int e = sel[(size_t)r * k + j], slot = fill[e]++;
            rt->row[slot] = r;
            rt->w[slot] = (pr_real)(dsel[(size_t)r * k + j] / rt->wsum[r]);
        }
    PR_FREE(z);
    PR_FREE(pd);
    PR_FREE(sel);
}

/* ---------------------------------------------------------------- 6.2 Dispatch to the experts and back (EP) */
/* EP: the slots (routed rows) of this rank's experts. Slots are grouped by expert, rows
   ascending within one, so this rank's are global slots slot0 .. slot0+n_slots-1. Under EP
   (ep > 1, inside the TP group, whose ranks hold the same rows) rank q dispatches the slots of
   its share of the rows, rows q*N/ep .. (q+1)*N/ep - 1, to the experts' owners by all-to-all,
   and gets their outputs back the same way; without EP the slots are gathered locally. */
typedef struct {
    int ep, me, ne;            /* EP ranks, this rank, experts per rank */
    int slot0, n_slots;
    int nmax;                  /* the largest block one rank sends another, in rows */
    int *mem;                  /* the int arrays below, one allocation */
    int *send_n, *recv_n;      /* (ep) rows sent to / received from each rank */
    int *seg;                  /* (ep * ne) rows from source q for local expert e */
    int *send_row;             /* (ep * nmax) by destination: the rows this rank sends */
    pr_real *send_w;           /* (ep * nmax) their combine weights */
} pr__ep_plan;

static void pr__ep_plan_free(pr__ep_plan *p) {
    PR_FREE(p->mem);
    PR_FREE(p->send_w);
    memset(p, 0, sizeof *p);
}

/* The rank of the EP group whose share of N rows holds row r. */
static int pr__ep_source(int r, int N, int ep) {
    int q = (int)((long)r * ep / N);
    while (q > 0 && (long)q * N / ep > r) q--;
    while (q + 1 < ep && (long)(q + 1) * N / ep <= r) q++;
    return q;
}

/* Every rank knows the whole routing (the TP group's rows and router are the same), so each can
   count what every other sends: no sizes need exchanging. Returns 0 without host memory. */
static int pr__ep_plan_build(pr_trainer *tr, const pr__route *rt, int N, pr__ep_plan *p) {
    const int E = tr->cfg.num_experts, ep = pr__ep(tr);
    memset(p, 0, sizeof *p);
    p->ep = ep;
    p->me = ep > 1 ? tr->mesh->tp_rank : 0;
    p->ne = tr->n_experts;
    p->slot0 = rt->start[tr->expert0];
    p->n_slots = rt->start[tr->expert0 + tr->n_experts] - p->slot0;
    if (ep == 1) return 1;
    int *cnt = (int *)PR_MALLOC(sizeof(int) * (size_t)(ep * ep));
    if (!cnt) return 0;
    memset(cnt, 0, sizeof(int) * (size_t)(ep * ep));
    for (int e = 0; e < E; e++)
        for (int j = rt->start[e]; j < rt->start[e + 1]; j++) cnt[pr__ep_source(rt->row[j], N, ep) * ep + e / p->ne]++;
    for (int i = 0; i < ep * ep; i++) if (cnt[i] > p->nmax) p->nmax = cnt[i];
    const size_t nm = (size_t)(p->nmax ? p->nmax : 1);
    p->mem = (int *)PR_MALLOC(sizeof(int) * (2 * (size_t)ep + (size_t)ep * p->ne + ep * nm));
    p->send_w = (pr_real *)PR_MALLOC(sizeof(pr_real) * ep * nm);
    if (!p->mem || !p->send_w) {
        PR_FREE(cnt);
        pr__ep_plan_free(p);
        return 0;
    }
    p->send_n = p->mem;
    p->recv_n = p->send_n + ep;
    p->seg = p->recv_n + ep;
    p->send_row = p->seg + ep * p->ne;
    memset(p->mem, 0, sizeof(int) * (2 * (size_t)ep + (size_t)ep * p->ne));
    for (int q = 0; q < ep; q++) p->recv_n[q] = cnt[q * ep + p->me];
    PR_FREE(cnt);
    for (int e = 0; e < E; e++)
        for (int j = rt->start[e]; j < rt->start[e + 1]; j++) {
            const int q = pr__ep_source(rt->row[j], N, ep), o = e / p->ne;
            if (o == p->me) p->seg[q * p->ne + (e - tr->expert0)]++;
            if (q != p->me) continue;
            const int k = p->send_n[o]++;
            p->send_row[(size_t)o * nm + k] = rt->row[j];
            p->send_w[(size_t)o * nm + k] = rt->w[j];
        }
    return 1;
}

/* Between slot order (x, this rank's experts' slots) and per-source blocks of nmax rows (blocks),
   where block q holds source q's rows expert by expert: to_blocks 1 copies x into the blocks. */
static void pr__ep_reorder(pr_trainer *tr, const pr__ep_plan *p, void *x, void *blocks, int to_blocks) {
    const pr_backend *be = tr->be;
    const size_t C = (size_t)tr->cfg.hidden_size, A = be->act_bytes, blk = (size_t)p->nmax * C;
    size_t at = 0;
    for (int le = 0; le < p->ne; le++)
        for (int q = 0; q < p->ep; q++) {
            size_t n = (size_t)p->seg[q * p->ne + le], from = 0;
            for (int k = 0; k < le; k++) from += (size_t)p->seg[q * p->ne + k];
            void *xs = pr__act_at(tr, x, at * C), *bs = pr__act_at(tr, blocks, q * blk + from * C);
            if (n) be->copy(be, to_blocks ? bs : xs, to_blocks ? xs : bs, n * C * A);
            at += n;
        }
}

/* x (n_slots, C) = the rows of src (N, C) this rank's experts take, in slot order; weighted by
   their combine weights when `weighted`. */
static void pr__ep_dispatch(pr_trainer *tr, pr__pass *ps, const pr__route *rt, const pr__ep_plan *p, void *x,
                            const void *src, int weighted) {
    const pr_backend *be = tr->be;
    const size_t C = (size_t)tr->cfg.hidden_size;
    if (p->ep == 1) {
        be->gather_rows(be, x, src, rt->row + p->slot0, weighted ? rt->w + p->slot0 : NULL, p->n_slots, (int)C);
        return;
    }
    const size_t blk = (size_t)p->nmax * C;
    for (int o = 0; o < p->ep; o++)
        be->gather_rows(be, pr__act_at(tr, ps->ep_send, o * blk), src, p->send_row + (size_t)o * p->nmax,
                        weighted ? p->send_w + (size_t)o * p->nmax : NULL, p->send_n[o], (int)C);
    pr_error e;
    pr_comm *c = tr->mesh->tp_comm;
    pr__comm_done(tr, c->all_to_all(c, ps->ep_recv, ps->ep_send, blk, pr__act_type(tr), &e), &e);
    pr__ep_reorder(tr, p, x, ps->ep_recv, 0);
}

/* dst (N, C) += the outputs y (n_slots, C) of this rank's experts... back at the rows they came
   from: under EP each rank adds those of its own share of rows (the TP sum that follows completes
   every row). Weighted by the combine weights when `weighted`. */
static void pr__ep_combine(pr_trainer *tr, pr__pass *ps, const pr__route *rt, const pr__ep_plan *p, void *dst,
                           const void *y, int weighted) {
    const pr_backend *be = tr->be;
    const size_t C = (size_t)tr->cfg.hidden_size;
    if (p->ep == 1) {
        be->scatter_add_rows(be, dst, y, rt->row + p->slot0, weighted ? rt->w + p->slot0 : NULL, p->n_slots, (int)C);
        return;
    }
    const size_t blk = (size_t)p->nmax * C;
    pr__ep_reorder(tr, p, (void *)y, ps->ep_send, 1);
    pr_error e;
    pr_comm *c = tr->mesh->tp_comm;
    pr__comm_done(tr, c->all_to_all(c, ps->ep_recv, ps->ep_send, blk, pr__act_type(tr), &e), &e);
    for (int o = 0; o < p->ep; o++)
        be->scatter_add_rows(be, dst, pr__act_at(tr, ps->ep_recv, o * blk), p->send_row + (size_t)o * p->nmax,
                             weighted ? p->send_w + (size_t)o * p->nmax : NULL, p->send_n[o], (int)C);
}

/* ---------------------------------------------------------------- 6.3 The sparse MLP: a loop of GEMMs over each expert's rows */
/* Local expert le's rows: how many (0: it has none this pass), and in *off the first one's place
   among this rank's slots. */
static int pr__expert_rows(const pr_trainer *tr, const pr__route *rt, const pr__ep_plan *p, int le, int *off) {
    const int e = tr->expert0 + le;
    *off = rt->start[e] - p->slot0;
    return rt->start[e + 1] - rt->start[e];
}

/* The sparse MLP of layer l: y = sum over each row's top-k experts of weight * expert(ln2 row).
   The rows gathered into ye, slot by slot (an expert's rows one after another); each expert's
   gate and up GEMM (one, by the two stacked); SwiGLU over all the rows at once (elementwise: one
   launch, not one an expert); each expert's down GEMM into ye (the gathered rows no longer
   needed); then a weighted scatter-add into y, experts in order. */
static void pr__moe_forward(pr_trainer *tr, pr__pass *ps, int l, const pr__layer_w *w, void *y) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int N = ps->N, C = c->hidden_size, E = c->num_experts, Fm = c->moe_intermediate_size;
    pr__layer_acts *a = &ps->acts[l];
    pr__route *rt = &ps->route[l];
    pr__ep_plan p;
    be->matmul_fwd(be, a->router, a->ln2, w->router, N, C, E);
    pr__moe_route(tr, rt, a->router, N);
    pr__zero_acts(tr, y, (size_t)N * C);
    if (tr->alloc_failed) return;
    if (!pr__ep_plan_build(tr, rt, N, &p)) {
        tr->alloc_failed = 1;
        return;
    }
    pr__ep_dispatch(tr, ps, rt, &p, a->ye, a->ln2, 0);         /* ye: the experts' inputs, slot by slot */
    /* the GEMMs expert by expert; the elementwise SwiGLU once over every expert's rows */
    for (int le = 0, off, M; le < tr->n_experts; le++) {
        if (!(M = pr__expert_rows(tr, rt, &p, le, &off))) continue;
        const void *wgu = pr__cact_at(tr, w->experts, (size_t)le * 3 * Fm * C);
        be->matmul_fwd(be, pr__act_at(tr, a->gu, (size_t)off * 2 * Fm), pr__act_at(tr, a->ye, (size_t)off * C), wgu, M, C,
                       2 * Fm);
    }
    be->swiglu_fwd(be, a->h, a->gu, p.n_slots, Fm);
    for (int le = 0, off, M; le < tr->n_experts; le++) {
        if (!(M = pr__expert_rows(tr, rt, &p, le, &off))) continue;
        const void *wd = pr__cact_at(tr, w->experts, ((size_t)le * 3 + 2) * Fm * C);
        /* ye: now the experts' outputs (every expert's inputs were read above) */
        be->matmul_fwd(be, pr__act_at(tr, a->ye, (size_t)off * C), pr__act_at(tr, a->h, (size_t)off * Fm), wd, M, Fm, C);
    }
    pr__ep_combine(tr, ps, rt, &p, y, a->ye, 1);
    pr__ep_plan_free(&p);
}

/* Backward of the sparse MLP: d(ln2) into s->dln from d(y) in s->dres. Each slot's weight gets
   d/dw = dy . ye; the experts see dy scaled by their weight. On the host the weights' gradients
   go back through the renormalisation and, with the load-balancing loss's own gradient
   (ps->aux_g, per expert, for every real row), through the router's softmax. Under TP/EP a rank
   holds part of every slot's output (column shards) or all of some slots' (its experts): the
   weight gradients and d(ln2) are summed over the TP group before the router's share, which
   every rank computes alike, is added. */
static void pr__moe_backward(pr_trainer *tr, pr__pass *ps, int l, pr__bwd_scratch *s, const pr__layer_w *w,
                             const pr__layer_g *g) {
    const pr_backend *be = tr->be;
    const pr_config *c = &tr->cfg;
    const int N = ps->N, C = c->hidden_size, E = c->num_experts, Fm = c->moe_intermediate_size;
    pr__layer_acts *a = &ps->acts[l];
    pr__route *rt = &ps->route[l];
    pr__ep_plan p;
    pr__zero_acts(tr, s->dln, (size_t)N * C);
    if (!pr__ep_plan_build(tr, rt, N, &p)) {
        tr->alloc_failed = 1;
        return;
    }
    const int slots = rt->start[E];
    memset(rt->dw, 0, sizeof(pr_real) * (size_t)slots);
    pr__ep_dispatch(tr, ps, rt, &p, s->dye, s->dres, 0);
    be->row_dots(be, rt->dw + p.slot0, s->dye, a->ye, p.n_slots, C);
    pr__ep_dispatch(tr, ps, rt, &p, s->dye, s->dres, 1);       /* the experts' share of dy */
    /* the products below add into dh and dxe, each zeroed once for every expert's rows
       (slot by slot, one expert's after another's); the GEMMs run expert by expert, the
       elementwise SwiGLU backward (which writes dgu) once over all the rows */
    pr__zero_acts(tr, s->dh, (size_t)p.n_slots * Fm);
    for (int le = 0, off, M; le < tr->n_experts; le++) {
        if (!(M = pr__expert_rows(tr, rt, &p, le, &off))) continue;
        const size_t wo = ((size_t)le * 3 + 2) * Fm * C;       /* the down projection's weight */
        be->matmul_bwd(be, pr__act_at(tr, s->dh, (size_t)off * Fm), g->experts + wo, pr__act_at(tr, s->dye, (size_t)off * C),
                       pr__act_at(tr, a->h, (size_t)off * Fm), pr__cact_at(tr, w->experts, wo), M, Fm, C);
    }
    be->swiglu_bwd(be, s->dgu, s->dh, a->gu, p.n_slots, Fm);
    pr__ep_dispatch(tr, ps, rt, &p, s->dye, a->ln2, 0);        /* dy's room: the experts' inputs again */
    pr__zero_acts(tr, s->dxe, (size_t)p.n_slots * C);
    for (int le = 0, off, M; le < tr->n_experts; le++) {
        if (!(M = pr__expert_rows(tr, rt, &p, le, &off))) continue;
        const size_t eo = (size_t)le * 3 * Fm * C;                 /* the gate and up projections' weight */
        be->matmul_bwd(be, pr__act_at(tr, s->dxe, (size_t)off * C), g->experts + eo, pr__act_at(tr, s->dgu, (size_t)off * 2 * Fm),
                       pr__act_at(tr, s->dye, (size_t)off * C), pr__cact_at(tr, w->experts, eo), M, C, 2 * Fm);
    }
    pr__ep_combine(tr, ps, rt, &p, s->dln, s->dxe, 0);
    pr__ep_plan_free(&p);
    pr__tp_sum(tr, s->dln, (size_t)N * C);
    if (pr__tp(tr) > 1) pr__sum_host(tr, tr->mesh->tp_comm, rt->dw, (size_t)slots);
    /* host: d(prob) from the weights (w_j = p_j / S, S the top-k sum when renormalised:
       dp_j = (dw_j - sum_i dw_i w_i) / S) plus the aux gradient, then the softmax backward */
    double *dp = (double *)PR_MALLOC(sizeof(double) * ((size_t)N * E + N));
    pr_real *dz = (pr_real *)PR_MALLOC(sizeof(pr_real) * (size_t)N * E);
    if (!dp || !dz) {
        PR_FREE(dp);
        PR_FREE(dz);
        tr->alloc_failed = 1;
        return;
    }
    double *D = dp + (size_t)N * E;
    memset(dp, 0, sizeof(double) * ((size_t)N * E + N));
    if (c->norm_topk_prob)
        for (int j = 0; j < slots; j++) D[rt->row[j]] += (double)rt->dw[j] * rt->w[j];
    for (int e = 0; e < E; e++)
        for (int j = rt->start[e]; j < rt->start[e + 1]; j++) {
            int r = rt->row[j];
            dp[(size_t)r * E + e] += ((double)rt->dw[j] - D[r]) / rt->wsum[r];
        }
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int r = 0; r < N; r++) {
        const pr_real *prob = rt->prob + (size_t)r * E;
        double *dpr = dp + (size_t)r * E, dot = 0;
        if (ps->aux_g && ps->real[r])
            for (int e = 0; e < E; e++) dpr[e] += ps->aux_g[e];
        for (int e = 0; e < E; e++) dot += prob[e] * dpr[e];
        for (int e = 0; e < E; e++) dz[(size_t)r * E + e] = (pr_real)(prob[e] * (dpr[e] - dot));
    }
    be->upload_acts(be, s->dlogit, dz, (size_t)N * E);
    be->matmul_bwd(be, s->dln, g->router, s->dlogit, a->ln2, w->router, N, C, E);
    PR_FREE(dp);
    PR_FREE(dz);
}

/* ---------------------------------------------------------------- 6.4 The load-balancing loss */
/* How many times a prefix token counts in a scope that holds n trajectories. */
static double pr__prefix_mult(const pr__moe_acc *m, int n) {
    return m->opt->prefix_multiplicity > 0 ? m->opt->prefix_multiplicity : n;
}

/* Adds a pass's routing sums (this rank's MoE layers, real rows) to sums; its load, times
   load_mult, to the trainer's per-layer expert load. */
static void pr__route_sums(pr_trainer *tr, const pr__pass *ps, double *sums, double load_mult) {
    const int E = tr->cfg.num_experts, L = tr->cfg.num_hidden_layers;
    for (int l = 0; l < L; l++) {
        const pr__route *rt = &ps->route[l];
        for (int e = 0; e < E; e++)
            for (int j = rt->start[e]; j < rt->start[e + 1]; j++)
                if (ps->real[rt->row[j]]) {
                    sums[e] += 1;
                    if (load_mult > 0) tr->expert_load[(size_t)l * E + e] += load_mult;
                }
        /* each expert's sum over the rows in row order, by the thread of its block of 8 experts */
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (int e0 = 0; e0 < E; e0 += 8) {
            const int n = E - e0 < 8 ? E - e0 : 8;
            double s[8];
            for (int i = 0; i < n; i++) s[i] = sums[E + e0 + i];
            for (int r = 0; r < ps->N; r++)
                if (ps->real[r])
                    for (int i = 0; i < n; i++) s[i] += rt->prob[(size_t)r * E + e0 + i];
            for (int i = 0; i < n; i++) sums[E + e0 + i] = s[i];
        }
        for (int r = 0; r < ps->N; r++)
            if (ps->real[r]) sums[2 * E] += 1;
    }
}

/* This stage's routing sums of a pass, made whole over the CP blocks, added to sums (which hold
   the earlier stages'). */
static void pr__moe_stage_sums(pr_trainer *tr, pr__moe_acc *m, const pr__pass *ps, double *sums, double load_mult) {
    const size_t n = 2 * (size_t)m->E + 1;
    memset(m->own, 0, sizeof(double) * n);
    pr__route_sums(tr, ps, m->own, load_mult);
    if (pr__cp(tr) > 1) pr__sum_doubles(tr, tr->mesh->cp_comm, m->own, n);
    for (size_t i = 0; i < n; i++) sums[i] += m->own[i];
}

/* Last stage, after the forward of one microbatch of n trajectories (suffixes under reuse, whole
   sequences in the baseline) whose sums now cover every layer: its aux gradient per expert g and,
   for the microbatch scope, its aux loss. */
static void pr__moe_mb_grad(pr__moe_acc *m, const double *sums, int n, double *g) {
    const int E = m->E;
    double M = sums[2 * E];
    if (m->opt->scope == PR_AUX_SCOPE_MICROBATCH) {
        double pm = m->reuse ? pr__prefix_mult(m, n) : 0, aux = 0, w = m->coef / m->B;
        M += pm * m->pre[2 * E];
        for (int e = 0; e < E; e++) {
            double f = (sums[e] + pm * m->pre[e]) / M, P = (sums[E + e] + pm * m->pre[E + e]) / M;
            aux += f * P;
            g[e] = w * E * f / M;
        }
        m->aux += w * E * aux;
        return;
    }
    if (!m->prepass) {           /* one microbatch holds the whole group: its routing is the group's */
        double pm = m->reuse ? pr__prefix_mult(m, m->G) : 0;
        m->M_tot = M + pm * m->pre[2 * E];
        for (int e = 0; e < E; e++) m->F[e] = (sums[e] + pm * m->pre[e]) / m->M_tot;
    }
    for (int e = 0; e < E; e++) {
        m->prob_tot[e] += sums[E + e];
        g[e] = m->coef * E * m->F[e] / m->M_tot;
    }
}

/* Every stage, as a microbatch's backward starts: the prefix's share of its aux gradient (each
   prefix row stands for the copies the scope counts). In the group scope every microbatch has
   the group's gradient, which the prefix takes once: each microbatch adds its trajectories'
   fraction of it, so that the shares of a group split across ranks add up too. */
static void pr__moe_take_grad(pr__moe_acc *m, const double *g, int n) {
    const int micro = m->opt->scope == PR_AUX_SCOPE_MICROBATCH;
    const double w = !m->reuse ? 0 : micro ? pr__prefix_mult(m, n) : pr__prefix_mult(m, m->G) * n / m->G;
    for (int e = 0; e < m->E; e++) m->c[e] += g[e] * w;
}

/* The group scope's aux loss, once every pass has run (last stage). */
static void pr__moe_group_aux(pr__moe_acc *m) {
    if (!m->on || m->opt->scope != PR_AUX_SCOPE_GROUP) return;
    double pm = m->reuse ? pr__prefix_mult(m, m->G) : 0, aux = 0;
    for (int e = 0; e < m->E; e++) aux += m->F[e] * (m->prob_tot[e] + pm * m->pre[m->E + e]) / m->M_tot;
    m->aux = m->coef * m->E * aux;
}

/* The group scope's routing pre-pass: every microbatch forward only, through the stages in turn,
   for the routing fractions the backward needs before any microbatch may run it. path: the cached
   prefix under reuse (read as in Phase B), or NULL for the baseline's whole sequences. */
static pr_status pr__routing_prepass(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path, pr_error *err) {
    const int mb = cx->mb;
    pr__moe_acc *m = &cx->moe;
    const int G = cx->g->G, E = m->E;
    double *tot = (double *)PR_MALLOC(sizeof(double) * (2 * (size_t)E + 1));
    if (!tot) return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
    memset(tot, 0, sizeof(double) * (2 * (size_t)E + 1));
    pr_status st = PR_OK;
    for (int i = 0; cx->t0 + i * mb < cx->t1 && !st; i++) {
        pr__mb x;
        st = pr__mb_open(tr, cx, path, &x, i, mb, 0, err);
        if (!st) {
            pr__pp_prev(tr, NULL, &x);
            st = pr__mb_forward(tr, cx, path, &x, 0, err);
            pr__pp_next(tr, &x, NULL);
            for (int k = 0; k <= 2 * E; k++) tot[k] += x.sums[k];
        }
        pr__mb_close(tr, &x);
    }
    if (!st && cx->team) pr__sum_doubles(tr, cx->team, tot, 2 * (size_t)E + 1);   /* the team's trajectories make the group */
    if (!st && pr__last_stage(tr)) {     /* the last stage's sums cover every layer */
        double pm = path ? pr__prefix_mult(m, G) : 0;
        m->M_tot = tot[2 * E] + pm * m->pre[2 * E];
        for (int e = 0; e < E; e++) m->F[e] = (tot[e] + pm * m->pre[e]) / m->M_tot;
    }
    PR_FREE(tot);
    return st;
}

PRDEF pr_status pr_trainer_expert_load(const pr_trainer *tr, int layer, double *load, int n, pr_error *err) {
    if (!tr || !load) return pr__fail(err, PR_ERR_ARG, "pr_trainer_expert_load: NULL argument");
    if (!tr->cfg.num_experts) return pr__fail(err, PR_ERR_ARG, "pr_trainer_expert_load: the model has no experts");
    const int l = layer - tr->layer0;
    if (l < 0 || l >= tr->cfg.num_hidden_layers || n != tr->cfg.num_experts)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_expert_load: layer %d (this rank holds %d..%d), %d values for %d experts",
                        layer, tr->layer0, tr->layer0 + tr->cfg.num_hidden_layers - 1, n, tr->cfg.num_experts);
    memcpy(load, tr->expert_load + (size_t)l * n, sizeof(double) * (size_t)n);
    return PR_OK;
}


/* ================================================================ 7. THE PARALLEL LAYER */
/* ---------------------------------------------------------------- 7.1 The device mesh */
PRDEF void pr_mesh_free(pr_mesh *m) {
    if (!m) return;
    pr_comm **c[5] = { &m->dp_comm, &m->pp_comm, &m->cp_comm, &m->tp_comm, &m->ends_comm };
    for (int i = 0; i < 5; i++)
        if (*c[i]) {
            (*c[i])->destroy(*c[i]);
            *c[i] = NULL;
        }
}

/* The ranks of a mesh of these sizes (each at least 1), multiplied only while the product stays
   within the world's size (then past it: no overflow). */
static long long pr__mesh_ranks(int dp, int pp, int cp, int tp, int world_size) {
    const int dims[4] = { dp, pp, cp, tp };
    long long ranks = 1;
    for (int i = 0; i < 4 && ranks <= world_size; i++) ranks *= dims[i];
    return ranks;
}

PRDEF pr_status pr_mesh_init(pr_mesh *m, pr_comm *world, int dp, int pp, int cp, int tp, int ep, pr_error *err) {
    if (!m || !world) return pr__fail(err, PR_ERR_ARG, "pr_mesh_init: NULL argument");
    if (dp < 1 || pp < 1 || cp < 1 || tp < 1 || ep < 1)
        return pr__fail(err, PR_ERR_ARG, "mesh sizes must be >= 1 (dp %d, pp %d, cp %d, tp %d, ep %d)", dp, pp, cp, tp, ep);
    if (pr__mesh_ranks(dp, pp, cp, tp, world->size) != world->size)
        return pr__fail(err, PR_ERR_ARG, "mesh dp %d x pp %d x cp %d x tp %d is not the communicator's %d ranks", dp, pp, cp, tp,
                        world->size);
    if (ep != 1 && ep != tp)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "ep %d: expert parallelism runs inside the TP group, so ep must be 1 or tp (%d)", ep, tp);
    memset(m, 0, sizeof *m);              /* only now: a refused call leaves the caller's mesh as it was */
    const int r = world->rank;
    m->dp = dp; m->pp = pp; m->cp = cp; m->tp = tp; m->ep = ep;
    m->world = world;
    m->tp_rank = r % tp;
    m->cp_rank = r / tp % cp;
    m->pp_rank = r / (tp * cp) % pp;
    m->dp_rank = r / (tp * cp * pp);
    /* each dimension's group: the ranks equal in every other coordinate (color), ordered by its own */
    const int others = r - m->tp_rank;
    pr_status st = world->split(world, others, m->tp_rank, &m->tp_comm, err);
    if (!st) st = world->split(world, r - m->cp_rank * tp, m->cp_rank, &m->cp_comm, err);
    if (!st) st = world->split(world, r - m->pp_rank * tp * cp, m->pp_rank, &m->pp_comm, err);
    const int end = m->pp_rank == 0 || m->pp_rank == pp - 1;
    if (!st) st = world->split(world, end ? r - m->pp_rank * tp * cp : world->size + r, m->pp_rank, &m->ends_comm, err);
    if (!st) st = world->split(world, r - m->dp_rank * tp * cp * pp, m->dp_rank, &m->dp_comm, err);
    if (st) pr_mesh_free(m);
    return st;
}

static pr_status pr__ranks_agree(pr_trainer *tr, pr_comm *c, pr_status st, int *origin, const char *fn, const char *then, pr_error *err);
/* A rank that could not create its trainer takes part in the agreement through staging buffers of
   its own, as large as the agreement uses (two reals a rank of the world, in chunks of at most
   PR__STAGE_REALS): a few bytes where the trainer's would be megabytes. If even those fail it
   returns at once, and its peers, already in the agreement's sum, wait for it there: in-process
   ranks see it leave, NCCL's peers wait for their timeout. */
static pr_status pr__create_failed_agree(const pr_backend *be, const pr_mesh *mesh, pr_status st, pr_error *err) {
    pr_trainer shell;
    memset(&shell, 0, sizeof shell);
    shell.be = be;
    shell.mesh = mesh;
    const size_t reals = 2 * (size_t)mesh->world->size < PR__STAGE_REALS ? 2 * (size_t)mesh->world->size : PR__STAGE_REALS;
    shell.stage = (pr_real *)be->alloc(be, sizeof(pr_real) * reals, PR_TIER_DEVICE);
    shell.stage_host = (pr_real *)PR_MALLOC(sizeof(pr_real) * reals);
    if (shell.stage && shell.stage_host) st = pr__ranks_agree(&shell, mesh->world, st, NULL, "pr_trainer_create_mesh", "", err);
    if (shell.stage) be->release(be, shell.stage, PR_TIER_DEVICE);
    PR_FREE(shell.stage_host);
    return st;
}

/* A mesh as pr_mesh_init leaves it: its communicators there, its sizes those of the world, this
   rank's coordinates inside them and those of its world rank, ep 1 or tp, zero 0..2. Checked before
   any rank takes part in a collective of it. */
static pr_status pr__mesh_check(const pr_mesh *m, pr_error *err) {
    if (!m->world || !m->dp_comm || !m->pp_comm || !m->cp_comm || !m->tp_comm || !m->ends_comm)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_create_mesh: the mesh has no communicators (not one pr_mesh_init made, or one it refused)");
    if (m->dp < 1 || m->pp < 1 || m->cp < 1 || m->tp < 1 || (m->ep != 1 && m->ep != m->tp) ||
        pr__mesh_ranks(m->dp, m->pp, m->cp, m->tp, m->world->size) != m->world->size)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_create_mesh: mesh dp %d x pp %d x cp %d x tp %d (ep %d) is not one of the "
                        "world's %d ranks", m->dp, m->pp, m->cp, m->tp, m->ep, m->world->size);
    if (m->dp_rank < 0 || m->dp_rank >= m->dp || m->pp_rank < 0 || m->pp_rank >= m->pp || m->cp_rank < 0 || m->cp_rank >= m->cp ||
        m->tp_rank < 0 || m->tp_rank >= m->tp ||
        ((m->dp_rank * m->pp + m->pp_rank) * m->cp + m->cp_rank) * m->tp + m->tp_rank != m->world->rank)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_create_mesh: coordinates dp %d pp %d cp %d tp %d are not world rank %d's",
                        m->dp_rank, m->pp_rank, m->cp_rank, m->tp_rank, m->world->rank);
    if (m->zero < 0 || m->zero > 2 || (m->bf16_grad_reduce != 0 && m->bf16_grad_reduce != 1))
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_create_mesh: zero %d (0, 1 or 2) or bf16_grad_reduce %d (0 or 1)", m->zero,
                        m->bf16_grad_reduce);
    return PR_OK;
}

PRDEF pr_status pr_trainer_create_mesh(pr_trainer **out, const pr_config *cfg, const pr_backend *be, const pr_mesh *mesh,
                                       pr_error *err) {
    if (!out || !mesh) return pr__fail(err, PR_ERR_ARG, "pr_trainer_create_mesh: NULL %s", out ? "mesh" : "argument");
    pr_status mst = pr__mesh_check(mesh, err);
    if (mst) return mst;
    pr_trainer *tr = NULL;
    pr_status st = pr__trainer_new(&tr, cfg, be, mesh, err);
    if (st && be && mesh->world->size > 1) return pr__create_failed_agree(be, mesh, st, err);
    if (!st) st = pr__ranks_agree(tr, mesh->world, st, NULL, "pr_trainer_create_mesh", "no rank keeps a trainer", err);
    if (st) pr_trainer_destroy(tr);
    else *out = tr;
    return st;
}

/* ---------------------------------------------------------------- 7.2 Collectives inside a step */
/* The mesh's collectives inside a step. A failure is kept (the first one, reported when the
   step ends) and later collectives still run, so no peer is left waiting. */
static pr_comm_type pr__act_type(const pr_trainer *tr) {
    return tr->be->act_bytes == 8 ? PR_COMM_F64 : tr->be->act_bytes == 4 ? PR_COMM_F32 : PR_COMM_BF16;
}
static void pr__comm_done(pr_trainer *tr, pr_status st, pr_error *e) {
    if (st && !tr->comm_st) {
        tr->comm_st = st;
        tr->comm_err = *e;
    }
}
static int pr__tp(const pr_trainer *tr) { return tr->mesh ? tr->mesh->tp : 1; }
static int pr__cp(const pr_trainer *tr) { return tr->mesh ? tr->mesh->cp : 1; }
static int pr__ep(const pr_trainer *tr) { return tr->mesh ? tr->mesh->ep : 1; }
static int pr__pp(const pr_trainer *tr) { return tr->mesh ? tr->mesh->pp : 1; }
static int pr__first_stage(const pr_trainer *tr) { return !tr->mesh || tr->mesh->pp_rank == 0; }
static int pr__last_stage(const pr_trainer *tr) { return !tr->mesh || tr->mesh->pp_rank == tr->mesh->pp - 1; }

/* Activations (n elements) summed over the TP group: the row-parallel projections' partial outputs. */
static void pr__tp_sum(pr_trainer *tr, void *x, size_t n) {
    if (pr__tp(tr) == 1) return;
    pr_error e;
    pr_comm *c = tr->mesh->tp_comm;
    pr__comm_done(tr, c->all_reduce(c, x, n, pr__act_type(tr), &e), &e);
}

/* Host values summed over c, through the staging buffer (a collective's buffers are backend
   memory), PR__STAGE_REALS at a time: every rank runs the same chunks. */
static void pr__sum_host(pr_trainer *tr, pr_comm *c, pr_real *x, size_t n) {
    if (c->size == 1) return;
    pr_error e;
    for (size_t a = 0; a < n; a += PR__STAGE_REALS) {
        const size_t k = n - a < PR__STAGE_REALS ? n - a : PR__STAGE_REALS;
        tr->be->upload_reals(tr->be, tr->stage, x + a, k);
        pr__comm_done(tr, c->all_reduce(c, tr->stage, k, PR_COMM_REAL, &e), &e);
        tr->be->download_reals(tr->be, x + a, tr->stage, k);
    }
}
/* The same for host doubles, each chunk converted to reals in the host staging buffer. */
static void pr__sum_doubles(pr_trainer *tr, pr_comm *c, double *x, size_t n) {
    if (c->size == 1) return;
    pr_real *h = tr->stage_host;
    for (size_t a = 0; a < n; a += PR__STAGE_REALS) {
        const size_t k = n - a < PR__STAGE_REALS ? n - a : PR__STAGE_REALS;
        for (size_t i = 0; i < k; i++) h[i] = (pr_real)x[a + i];
        pr__sum_host(tr, c, h, k);
        for (size_t i = 0; i < k; i++) x[a + i] = h[i];
    }
}

/* Every rank of c goes on or none does: each rank's status st goes round with the world rank whose
   failure it is, two reals a rank through the staging buffers (nothing to allocate, so no rank can
   fail alone here). A rank whose st failed keeps its message; the others fail with the status of
   the first rank of c that did, naming the world rank it came from and saying what follows
   (`then`): a failure told over c, not their own. origin (NULL: st is always this rank's own)
   carries a told failure's world rank into a later agreement over another group, so that a rank
   two groups away still names the rank where it began: -1 before, set when this rank is told. */
static void pr__comm_told(pr_comm *c, const pr_error *e);
static pr_status pr__ranks_agree(pr_trainer *tr, pr_comm *c, pr_status st, int *origin, const char *fn, const char *then, pr_error *err) {
    if (c->size == 1) return st;
    pr_real *h = tr->stage_host;
    const size_t R = (size_t)c->size, me = (size_t)c->rank, per = PR__STAGE_REALS / 2;
    const int from = origin && *origin >= 0 ? *origin : tr->mesh->world->rank;
    int failed = -1;
    pr_status said = PR_OK;
    for (size_t a = 0; a < R; a += per) {
        const size_t k = R - a < per ? R - a : per;
        for (size_t i = 0; i < k; i++) {
            h[2 * i] = a + i == me ? (pr_real)st : 0;
            h[2 * i + 1] = a + i == me && st ? (pr_real)(from + 1) : 0;
        }
        tr->be->upload_reals(tr->be, tr->stage, h, 2 * k);
        pr_error e;
        const pr_status cs = c->all_reduce(c, tr->stage, 2 * k, PR_COMM_REAL, &e);
        if (cs) {                              /* a collective fails on every rank alike */
            if (!st && err) *err = e;
            return st ? st : cs;
        }
        tr->be->download_reals(tr->be, h, tr->stage, 2 * k);
        for (size_t i = 0; i < k && failed < 0; i++)
            if (h[2 * i] != 0) said = (pr_status)h[2 * i], failed = (int)h[2 * i + 1] - 1;
    }
    if (!st && failed >= 0) {
        pr_error e;
        st = pr__fail(&e, said, "%s: world rank %d failed (status %d; its own error says why): %s", fn, failed, (int)said, then);
        pr__comm_told(c, &e);
        if (origin) *origin = failed;
        if (err) *err = e;
    }
    return st;
}

/* ---------------------------------------------------------------- 7.3 Sharded parameters and gradients (TP, EP, PP) */
/* The first vocabulary row of TP rank r's slice (r = tp: the vocabulary's end): the embedding and
   the LM head are split by rows, as even a split as there is. */
static int pr__vocab0(int V, int tp, int r) { return (int)((int64_t)r * V / tp); }
/* Token t as a row of this rank's slice, -1 when another rank's slice holds it. */
static int32_t pr__vocab_row(const pr_trainer *tr, int32_t t) {
    return t >= tr->vocab0 && t < tr->vocab0 + tr->cfg.vocab_size ? t - tr->vocab0 : -1;
}

/* This rank's shard of cfg on the mesh: heads, KV heads and MLP columns divided by tp; under EP
   the experts divided by ep (each whole), otherwise each expert's columns divided by tp; under PP
   the stage's layers, layer0 .. layer0 + num_hidden_layers - 1 (as even a split as there is). */
static pr_status pr__shard_config(const pr_config *cfg, const pr_mesh *m, pr_config *local, int *layer0, int *expert0,
                                  int *n_experts, pr_error *err) {
    *local = *cfg;
    *layer0 = 0;
    *expert0 = 0;
    *n_experts = cfg->num_experts;
    if (!m) return PR_OK;
    const int tp = m->tp, ep = m->ep, pp = m->pp, L = cfg->num_hidden_layers;
    if (pp > L) return pr__fail(err, PR_ERR_UNSUPPORTED, "pp %d: more pipeline stages than the model's %d layers", pp, L);
    *layer0 = (int)((long)m->pp_rank * L / pp);
    local->num_hidden_layers = (int)((long)(m->pp_rank + 1) * L / pp) - *layer0;
    const int NH = cfg->num_attention_heads, NKV = cfg->num_key_value_heads;
    if (NH % tp) return pr__fail(err, PR_ERR_UNSUPPORTED, "tp %d must divide the attention heads (%d)", tp, NH);
    if (NKV % tp && tp % NKV)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "tp %d must divide the KV heads (%d) or be a multiple of them (each KV head "
                        "replicated on tp / KV heads ranks)", tp, NKV);
    local->num_attention_heads /= tp;
    local->num_key_value_heads = NKV >= tp ? NKV / tp : 1;    /* above the KV heads: the one its query heads share */
    if (cfg->vocab_size < tp)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "tp %d is larger than the vocabulary (%d): each TP rank holds a slice of "
                        "the embedding's and the LM head's rows", tp, cfg->vocab_size);
    local->vocab_size = pr__vocab0(cfg->vocab_size, tp, m->tp_rank + 1) - pr__vocab0(cfg->vocab_size, tp, m->tp_rank);
    if (cfg->num_experts) {
        if (ep > 1 && cfg->num_experts % ep)
            return pr__fail(err, PR_ERR_UNSUPPORTED, "ep %d must divide the %d experts", ep, cfg->num_experts);
        if (ep == 1 && cfg->moe_intermediate_size % tp)
            return pr__fail(err, PR_ERR_UNSUPPORTED, "tp %d must divide moe_intermediate_size %d", tp, cfg->moe_intermediate_size);
        if (ep > 1) {
            *n_experts = cfg->num_experts / ep;
            *expert0 = m->tp_rank * *n_experts;
        } else {
            local->moe_intermediate_size /= tp;
        }
    } else {
        if (ep > 1) return pr__fail(err, PR_ERR_ARG, "ep %d asks for experts, the model has none", ep);
        if (cfg->intermediate_size % tp)
            return pr__fail(err, PR_ERR_UNSUPPORTED, "tp %d must divide intermediate_size %d", tp, cfg->intermediate_size);
        local->intermediate_size /= tp;
    }
    return PR_OK;
}

/* The shard table: each local tensor's place in the full model's layout. Names are shared, and the
   local tensors are a subsequence of the full list, so one walk pairs them. */
static pr_status pr__build_shards(pr_trainer *tr, pr_error *err) {
    int count;
    pr_tensor_info *ft = pr__full_table(tr, &count, &tr->n_full);
    tr->shard = (pr__shard *)PR_MALLOC(sizeof(pr__shard) * (size_t)tr->n_tensors);
    if (!ft || !tr->shard) {
        PR_FREE(ft);
        return pr__fail(err, PR_ERR_NOMEM, "out of host memory for the shard table");
    }
    const int tp_rank = tr->mesh->tp_rank, tp = tr->mesh->tp, ep = tr->mesh->ep;
    const int tied_copy = tr->model.tie_word_embeddings && tr->has_embed && tr->has_head && tr->mesh->pp > 1;
    int j = 0;
    for (int i = 0; i < tr->n_tensors; i++) {
        const pr_tensor_info *t = &tr->tensors[i];
        while (j < count && strcmp(ft[j].name, t->name)) j++;
        if (j == count) {          /* cannot happen: both lists come from one builder */
            PR_FREE(ft);
            return pr__fail(err, PR_ERR_ARG, "shard table: %s is not in the full model", t->name);
        }
        pr__shard *sh = &tr->shard[i];
        const int64_t fc = ft[j].ndim == 2 ? ft[j].shape[1] : 1, lc = t->ndim == 2 ? t->shape[1] : 1;
        sh->full_off = ft[j].offset;
        sh->full_rows = ft[j].shape[0];
        sh->full_cols = fc;
        /* the TP ranks holding these same values: all of them for a whole tensor, tp / KV heads for
           a replicated KV head's rows, one for a column shard, a slice of the vocabulary
           or an expert of EP */
        const int64_t row_blocks = ft[j].shape[0] / t->shape[0];
        const int vocab_rows = !strcmp(t->name, "model.embed_tokens.weight") || !strcmp(t->name, "lm_head.weight");
        const int distinct = lc < fc || vocab_rows || (ep > 1 && strstr(t->name, ".mlp.experts."));
        const int replicas = distinct ? 1 : tp / (int)row_blocks;
        sh->row0 = vocab_rows ? tr->vocab0 : row_blocks > 1 ? tp_rank / replicas * t->shape[0] : 0;
        sh->col0 = lc < fc ? tp_rank * lc : 0;
        sh->elsewhere = tp_rank % replicas || (tied_copy && i == 0);    /* the embedding comes first */
        /* gradients from this rank's heads only: the q/k norms (shared by all heads) and a
           replicated KV head's projections (shared by its query heads on tp / KV heads ranks) */
        sh->tp_partial = replicas > 1 && (strstr(t->name, "q_norm.weight") || strstr(t->name, "k_norm.weight") ||
                                          strstr(t->name, "k_proj.weight") || strstr(t->name, "v_proj.weight"));
    }
    PR_FREE(ft);
    return PR_OK;
}

PRDEF size_t pr_trainer_full_param_count(const pr_trainer *tr) { return tr ? tr->n_full : 0; }

/* This rank's shard of a full-model host vector into a host copy of its arena. */
static void pr__shard_copy(const pr_trainer *tr, const pr_real *full, pr_real *local) {
    for (int i = 0; i < tr->n_tensors; i++) {
        const pr_tensor_info *t = &tr->tensors[i];
        const pr__shard *sh = &tr->shard[i];
        const int64_t rows = t->shape[0], cols = t->ndim == 2 ? t->shape[1] : 1;
        for (int64_t r = 0; r < rows; r++)
            memcpy(local + t->offset + (size_t)r * (size_t)cols, full + sh->full_off + (size_t)(sh->row0 + r) * (size_t)sh->full_cols + (size_t)sh->col0,
                   sizeof(pr_real) * (size_t)cols);
    }
}

/* Elements [a, a + k) of the full-model vector that this rank writes from local, a host copy of its
   arena, into out (k reals, left alone where another rank's): a tensor held elsewhere too is left
   to its one writer, so that a sum over tp and pp assembles the vector. Only the rows that meet
   the range are visited: a chunk at a time, a model of any size is assembled without a full-model
   buffer. */
static void pr__shard_chunk(const pr_trainer *tr, const pr_real *local, size_t a, size_t k, pr_real *out) {
    const size_t b = a + k;
    for (int i = 0; i < tr->n_tensors; i++) {
        const pr_tensor_info *t = &tr->tensors[i];
        const pr__shard *sh = &tr->shard[i];
        const size_t cols = t->ndim == 2 ? (size_t)t->shape[1] : 1, fc = (size_t)sh->full_cols;
        const size_t base = sh->full_off + (size_t)sh->row0 * fc + (size_t)sh->col0;      /* row 0's first element */
        if (sh->elsewhere || base >= b || sh->full_off + (size_t)(sh->full_rows * sh->full_cols) <= a) continue;
        size_t r = a > base + cols ? (a - base - cols) / fc : 0;             /* the first row that may meet [a, b) */
        for (; r < (size_t)t->shape[0] && base + r * fc < b; r++) {
            const size_t p = base + r * fc, lo = p > a ? p : a, hi = p + cols < b ? p + cols : b;
            if (lo < hi) memcpy(out + (lo - a), local + t->offset + r * cols + (lo - p), sizeof(pr_real) * (hi - lo));
        }
    }
}

/* The host scratch pr__set_full_arena needs on a mesh (n_params reals, zeroed; NULL and nothing to
   free without one): taken before the first arena changes, so that setting several cannot fail
   halfway. */
static pr_status pr__full_scratch(const pr_trainer *tr, pr_real **local, pr_error *err) {
    *local = tr->mesh ? (pr_real *)PR_MALLOC(sizeof(pr_real) * tr->n_params) : NULL;
    if (tr->mesh && !*local) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for %zu reals", tr->n_params);
    if (*local) memset(*local, 0, sizeof(pr_real) * tr->n_params);
    return PR_OK;
}
/* This rank's part of a full-model host vector (n_full reals) into one of its arenas (the master
   weights, with the weights the kernels read, m or v: each holds this rank's slice), by way of
   local (pr__full_scratch). */
static void pr__set_full_arena(pr_trainer *tr, pr_real *arena, const pr_real *src, pr_real *local) {
    if (tr->mesh) pr__shard_copy(tr, src, local);
    const pr_real *mine = tr->mesh ? local : src;
    if (arena == tr->params) pr__weights_take(tr, mine);
    else tr->be->upload_reals(tr->be, arena, mine + tr->slice_lo, tr->slice_n);
}

PRDEF pr_status pr_trainer_set_full_params(pr_trainer *tr, const pr_real *src, size_t n, pr_error *err) {
    if (!tr || !src) return pr__fail(err, PR_ERR_ARG, "pr_trainer_set_full_params: NULL argument");
    if (!tr->mesh) return pr_trainer_set_params(tr, src, n, err);
    if (n != tr->n_full)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_set_full_params: buffer holds %zu reals, the model has %zu", n, tr->n_full);
    pr_real *local;
    pr_status st = pr__full_scratch(tr, &local, err);
    if (!st) pr__set_full_arena(tr, tr->params, src, local);
    PR_FREE(local);
    return st;
}

static pr_status pr__get_full_arena(pr_trainer *tr, const pr_real *arena, pr_real *dst, pr_status st, pr_error *err);

PRDEF pr_status pr_trainer_get_full(pr_trainer *tr, pr_arena_kind which, pr_real *dst, size_t n, pr_error *err) {
    if (!tr || !dst) return pr__fail(err, PR_ERR_ARG, "pr_trainer_get_full: NULL argument");
    if (which != PR_ARENA_PARAMS && which != PR_ARENA_GRADS)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_get_full: arena %d is neither PR_ARENA_PARAMS nor PR_ARENA_GRADS", (int)which);
    const pr_real *arena = which == PR_ARENA_GRADS ? tr->grads : tr->params;
    if (!tr->mesh) {
        pr_status st = pr__check_count(tr, dst, n, "pr_trainer_get_full", err);
        if (!st) tr->be->download_reals(tr->be, dst, arena, n);
        return st;
    }
    if (n != tr->n_full) return pr__fail(err, PR_ERR_ARG, "pr_trainer_get_full: buffer holds %zu reals, the model has %zu", n, tr->n_full);
    return pr__get_full_arena(tr, arena, dst, PR_OK, err);
}

/* The full model's vector of one of this rank's arenas (parameters, gradients, m or v), assembled
   a chunk at a time on every rank: collective over tp and pp, and under ZeRO over dp for the
   master weights, the moments and a scattered gradient. The device holds no more than the staging
   buffer, through which every collective runs in chunks alike on every rank, and the host this
   rank's arena (its shard) and the chunk the caller keeps, so that a model of any size is
   assembled, into a full copy (pr__get_full_arena) or straight into a file (pr__export_*).
   Without a mesh a chunk is a download. A rank that has failed (st) still joins every collective,
   with zeros, and its tp and pp peers fail with it, since their sums hold its zeros: the statuses
   go round tp, then pp, when the gather ends. Each chunk carries one more real, the number of its
   tp x pp ranks that have failed so far, so that a rank keeping chunks knows as each arrives
   whether it is whole. */
typedef struct {
    const pr_real *arena;
    const char *fn;                        /* the public function, for messages */
    pr_real *local;                        /* mesh: this rank's arena, whole, on the host */
    pr_status st;                          /* this rank's first failure (its message in the caller's err) */
    size_t next;                           /* the first element of the next chunk */
} pr__gather;
#define PR__GATHER_CHUNK (PR__STAGE_REALS - 1)   /* a chunk's elements: the staging buffer less the count */

static void pr__gather_begin(pr_trainer *tr, const pr_real *arena, const char *fn, pr__gather *g, pr_status st, pr_error *err) {
    const pr_backend *be = tr->be;
    memset(g, 0, sizeof *g);
    g->arena = arena;
    g->fn = fn;
    g->st = st;
    if (!tr->mesh) return;
    pr_comm *dp = tr->mesh->dp_comm;
    const int D = tr->mesh->dp, me = tr->mesh->dp_rank;
    pr_status cs;
    if (tr->zero && arena == tr->grads && tr->grads_scattered) {     /* every slice's sum, in place */
        cs = dp->all_gather(dp, tr->grads, tr->grads + (size_t)me * tr->slice_cap, tr->slice_cap, PR_COMM_REAL, g->st ? NULL : err);
        if (!g->st) g->st = cs;
        if (!cs) tr->grads_scattered = 0;
    }
    g->local = (pr_real *)PR_MALLOC(sizeof(pr_real) * tr->n_pad);
    if (!g->local && !g->st) g->st = pr__fail(err, PR_ERR_NOMEM, "%s: out of host memory for %zu reals (this rank's arena)", fn, tr->n_pad);
    if (!tr->zero || arena == tr->grads) {
        if (g->local) be->download_reals(be, g->local, arena, tr->n_params);
        return;
    }
    const size_t k = PR__STAGE_REALS / (size_t)D;  /* the master weights or a moment: every rank's slice, a chunk of each at a time */
    for (size_t a = 0; a < tr->slice_cap; a += k) {
        const size_t m = tr->slice_cap - a < k ? tr->slice_cap - a : k;
        be->copy(be, tr->stage + (size_t)me * m, arena + a, sizeof(pr_real) * m);
        cs = dp->all_gather(dp, tr->stage, tr->stage + (size_t)me * m, m, PR_COMM_REAL, g->st ? NULL : err);
        if (!g->st) g->st = cs;
        for (int r = 0; g->local && r < D; r++)
            be->download_reals(be, g->local + (size_t)r * tr->slice_cap + a, tr->stage + (size_t)r * m, m);
    }
}

/* The next chunk, its elements [g->next, g->next + k) of the n_full, into dst (NULL: this rank
   gives its shard and keeps nothing; its host staging buffer holds the chunk). Returns the chunk's
   size, and in *whole whether no rank of the tp x pp group had failed by its end (with dst NULL:
   whether this rank had not). */
static size_t pr__gather_chunk(pr_trainer *tr, pr__gather *g, pr_real *dst, int *whole, pr_error *err) {
    const pr_backend *be = tr->be;
    const size_t a = g->next, k = tr->n_full - a < PR__GATHER_CHUNK ? tr->n_full - a : PR__GATHER_CHUNK;
    g->next += k;
    *whole = !g->st;
    if (!tr->mesh) {
        if (!g->st && dst) be->download_reals(be, dst, g->arena + a, k);
        return k;
    }
    pr_comm *sum_over[2] = { tr->mesh->tp_comm, tr->mesh->pp_comm };
    pr_real *chunk = tr->stage_host, failed = 1;     /* counted failed unless the download says otherwise */
    memset(chunk, 0, sizeof(pr_real) * (k + 1));
    if (!g->st) pr__shard_chunk(tr, g->local, a, k, chunk);
    chunk[k] = g->st != PR_OK;
    be->upload_reals(be, tr->stage, chunk, k + 1);
    for (int i = 0; i < 2; i++) {
        const pr_status cs = sum_over[i]->all_reduce(sum_over[i], tr->stage, k + 1, PR_COMM_REAL, g->st ? NULL : err);
        if (cs && !g->st) g->st = cs;
        if (cs && i == 0) {                /* what the tp sum left is not this rank's to hand on: zeros, counted */
            memset(chunk, 0, sizeof(pr_real) * (k + 1));
            chunk[k] = 1;
            be->upload_reals(be, tr->stage, chunk, k + 1);
        }
    }
    if (dst) {
        be->download_reals(be, dst, tr->stage, k);
        be->download_reals(be, &failed, tr->stage + k, 1);
        *whole = !g->st && failed == 0;
    }
    return k;
}

/* Every rank of the tp x pp group fails or none does (origin: as pr__ranks_agree's, for the
   caller's next agreement; NULL: the caller has none). */
static pr_status pr__gather_end(pr_trainer *tr, pr__gather *g, int *origin, pr_error *err) {
    int told_of = -1;                      /* carried from the tp agreement to the pp one */
    if (!origin) origin = &told_of;
    PR_FREE(g->local);
    g->local = NULL;
    if (!tr->mesh) return g->st;
    pr_comm *sum_over[2] = { tr->mesh->tp_comm, tr->mesh->pp_comm };
    pr_status st = g->st;
    for (int i = 0; i < 2; i++) st = pr__ranks_agree(tr, sum_over[i], st, origin, g->fn, "the copy is not whole", err);
    return st;
}

/* The whole vector into dst (NULL: this rank's shard given, nothing kept), st the caller's failure so far. */
static pr_status pr__get_full_arena(pr_trainer *tr, const pr_real *arena, pr_real *dst, pr_status st, pr_error *err) {
    pr__gather g;
    int whole;
    pr__gather_begin(tr, arena, "pr_trainer_get_full", &g, st, err);
    while (g.next < tr->n_full) {
        const size_t a = g.next;
        pr__gather_chunk(tr, &g, dst ? dst + a : NULL, &whole, err);
    }
    return pr__gather_end(tr, &g, NULL, err);
}

/* A tp_partial tensor's gradient summed over the TP ranks holding its rows. A tensor every rank
   holds whole (the q/k norms) is summed in place. A replicated KV head's rows go to their place in
   a zero tensor of the full shape, summed over the whole TP group: every other rank adds zeros
   there, so the rows get the sum over their replicas, the same bits on each. */
static void pr__sum_partial_grad(pr_trainer *tr, int t) {
    const pr_tensor_info *ti = &tr->tensors[t];
    const pr__shard *sh = &tr->shard[t];
    pr_comm *c = tr->mesh->tp_comm;
    pr_real *g = tr->grads + ti->offset, *pad = tr->stage;
    pr_error e;
    const size_t full = (size_t)(sh->full_rows * sh->full_cols), at = (size_t)(sh->row0 * sh->full_cols), end = at + ti->numel;
    if (full == ti->numel) {
        pr__comm_done(tr, c->all_reduce(c, g, full, PR_COMM_REAL, &e), &e);
        return;
    }
    for (size_t a = 0; a < full; a += PR__STAGE_REALS) {    /* the full tensor through the staging buffer */
        const size_t k = full - a < PR__STAGE_REALS ? full - a : PR__STAGE_REALS;
        const size_t lo = at > a ? at : a, hi = end < a + k ? end : a + k;    /* this rank's rows in the chunk */
        tr->be->zero(tr->be, pad, sizeof(pr_real) * k);
        if (lo < hi) tr->be->copy(tr->be, pad + (lo - a), g + (lo - at), sizeof(pr_real) * (hi - lo));
        pr__comm_done(tr, c->all_reduce(c, pad, k, PR_COMM_REAL, &e), &e);
        if (lo < hi) tr->be->copy(tr->be, g + (lo - at), pad + (lo - a), sizeof(pr_real) * (hi - lo));
    }
}

/* A mesh step's gradients made whole on every rank: the partial sums over tp of the weights that
   serve heads on several TP ranks (the q/k norms, a replicated KV head's projections), every
   gradient over cp (each block's rows gave a share), and a tied embedding's over the pipeline's
   ends (the first stage's embedding and the last stage's LM head are one tensor). Collective; a
   failure is kept in comm_st. */
static void pr__mesh_sync_grads(pr_trainer *tr) {
    if (!tr->mesh) return;
    pr_error e;
    if (pr__tp(tr) > 1)
        for (int t = 0; t < tr->n_tensors; t++)
            if (tr->shard[t].tp_partial) pr__sum_partial_grad(tr, t);
    if (pr__cp(tr) > 1) {
        pr_comm *c = tr->mesh->cp_comm;
        pr__comm_done(tr, c->all_reduce(c, tr->grads, tr->n_params, PR_COMM_REAL, &e), &e);
    }
    if (pr__pp(tr) > 1 && tr->model.tie_word_embeddings && tr->has_embed) {
        pr_comm *c = tr->mesh->ends_comm;
        const size_t n = (size_t)tr->cfg.vocab_size * tr->cfg.hidden_size;
        pr__comm_done(tr, c->all_reduce(c, tr->grads + tr->off_embed, n, PR_COMM_REAL, &e), &e);
    }
}

/* ---------------------------------------------------------------- 7.4 Context parallelism */
/* CP attention. The segments a pass reads (the cached path above it: a group's prefix in Phase B,
   a tree's nodes, whose blocks the ranks hold alike) are gathered into one region once a layer,
   each segment's rows in their order; then each of the pass's own sequences in turn, after them.
   Each of a sequence's two pieces runs the two-region attention unchanged: its queries see the
   region up to their own piece whole, in front of their own causal rows. The backward returns
   the region's dK/dV to the rows' owners by reduce-scatter, each sequence's before the next one
   takes its place, the path's once at the end. */

/* The region row where piece k of a segment of `chunk`-row blocks lands: q's block holds pieces q
   and 2cp-1-q. */
static size_t pr__cp_piece_row(int k, size_t chunk) { return (size_t)k * (chunk / 2); }

/* The ranks' blocks of a segment of `rows` rows (own: this rank's, `chunk` rows), gathered into
   dst in row order: the first pieces (0 .. cp-1) straight into place, the second ones (2cp-1 down
   to cp) by way of ps->pad. Rows past the segment's hold spare or stale rows: no query sees them. */
static void pr__cp_gather_rows(pr_trainer *tr, pr__pass *ps, void *dst, const void *own, int rows, size_t chunk) {
    const size_t kvd = (size_t)tr->cfg.num_key_value_heads * tr->cfg.head_dim, piece = chunk / 2;
    const pr_comm_type t = pr__act_type(tr);
    const pr_backend *be = tr->be;
    pr_comm *c = tr->mesh->cp_comm;
    pr_error e;
    pr__comm_done(tr, c->all_gather(c, dst, own, piece * kvd, t, &e), &e);
    pr__comm_done(tr, c->all_gather(c, ps->pad, pr__cact_at(tr, own, piece * kvd), piece * kvd, t, &e), &e);
    for (int q = 0; q < c->size; q++) {
        const size_t at = pr__cp_piece_row(2 * c->size - 1 - q, chunk), n = pr__piece_rows((size_t)rows, at, piece);
        if (n) be->copy(be, pr__act_at(tr, dst, at * kvd), pr__act_at(tr, ps->pad, (size_t)q * piece * kvd), n * kvd * be->act_bytes);
    }
}

/* The path's segments, in order, into the region's first cp_pre_rows rows (each one's spare rows
   are the next one's room, the last one's the pass's). */
static void pr__cp_gather_path(pr_trainer *tr, pr__pass *ps, const void *kp, const void *vp) {
    const size_t kvd = (size_t)tr->cfg.num_key_value_heads * tr->cfg.head_dim;
    size_t row = 0, kv_row = 0;
    for (int i = 0; i < ps->pre_seg; i++) {
        const pr__kv_seg *sg = &ps->pre->seg[i];
        pr__cp_gather_rows(tr, ps, pr__act_at(tr, ps->kreg, row * kvd), pr__cact_at(tr, kp, kv_row * kvd), sg->rows, (size_t)sg->chunk);
        pr__cp_gather_rows(tr, ps, pr__act_at(tr, ps->vreg, row * kvd), pr__cact_at(tr, vp, kv_row * kvd), sg->rows, (size_t)sg->chunk);
        row += (size_t)sg->rows;
        kv_row += (size_t)sg->chunk;
    }
}
/* The pass's segment j, after the path: each segment in turn takes the same place. */
static void pr__cp_gather_seg(pr_trainer *tr, pr__pass *ps, const pr__layer_acts *a, int j) {
    const size_t kvd = (size_t)tr->cfg.num_key_value_heads * tr->cfg.head_dim, at = (size_t)ps->cp_pre_rows * kvd;
    const size_t own = (size_t)ps->cp_off[j] * kvd, chunk = (size_t)ps->cp_cut[j].chunk;
    pr__cp_gather_rows(tr, ps, pr__act_at(tr, ps->kreg, at), pr__cact_at(tr, a->k, own), ps->cp_cut[j].n, chunk);
    pr__cp_gather_rows(tr, ps, pr__act_at(tr, ps->vreg, at), pr__cact_at(tr, a->v, own), ps->cp_cut[j].n, chunk);
}

/* Piece `half` (0: A, 1: B) of the pass's segment j: its layout (its rows' offsets in seg_off,
   seg_off[1] its rows), its position and its visible region moved on to the piece's first row.
   Returns the piece's first row among the pass's rows. */
static int pr__cp_piece(const pr__pass *ps, int j, int half, pr_seq_layout *lay, int seg_off[2]) {
    const pr__cp_cut *k = &ps->cp_cut[j];
    const int at = half ? k->b0 : k->a0;
    *lay = ps->lay;
    lay->n_seg = 1;
    lay->seg_off = seg_off;
    lay->pos0 += at;
    lay->n_prefix += at;
    seg_off[0] = 0;
    seg_off[1] = half ? k->rows_b : k->rows_a;
    return ps->cp_off[j] + (half ? k->rows_a : 0);
}

static void pr__attention_fwd(pr_trainer *tr, pr__pass *ps, pr__layer_acts *a, const void *kp, const void *vp) {
    const pr_config *c = &tr->cfg;
    const pr_backend *be = tr->be;
    const int NH = c->num_attention_heads, NKV = c->num_key_value_heads, HS = c->head_dim;
    if (!ps->kreg) {
        be->attention_fwd(be, a->att, a->lse, a->q, a->k, a->v, kp, vp, &ps->lay, NH, NKV, HS);
        return;
    }
    pr__cp_gather_path(tr, ps, kp, vp);
    for (int j = 0; j < ps->lay.n_seg; j++) {
        pr__cp_gather_seg(tr, ps, a, j);
        for (int half = 0; half < 2; half++) {   /* piece B sees more of the region (piece A among it) */
            pr_seq_layout lay;
            int off[2];
            const size_t r = (size_t)pr__cp_piece(ps, j, half, &lay, off), rq = r * NH * HS, rk = r * NKV * HS;
            if (!off[1]) continue;
            const int np = lay.n_prefix;
            be->attention_fwd(be, pr__act_at(tr, a->att, rq), pr__stat_at(tr, a->lse, r * NH), pr__cact_at(tr, a->q, rq),
                              pr__cact_at(tr, a->k, rk), pr__cact_at(tr, a->v, rk), np ? ps->kreg : NULL, np ? ps->vreg : NULL,
                              &lay, NH, NKV, HS);
        }
    }
}

/* Sends a segment's region gradient back to the ranks that hold its rows: for each rank, the rows
   of its two pieces among the first `vis` rows of the segment's gradient (g from region row
   `from`; the rows past them no query saw), and into this rank's own block its n_own rows (own,
   activations, or NULL) added. Returns the sum over the ranks of this rank's block, `chunk` rows
   of reals (ps->shard). */
static const pr_real *pr__cp_return(pr_trainer *tr, pr__pass *ps, const pr_real *g, size_t from, size_t vis,
                                    const void *own, size_t n_own, size_t chunk) {
    const size_t kvd = (size_t)tr->cfg.num_key_value_heads * tr->cfg.head_dim, piece = chunk / 2;
    pr_comm *c = tr->mesh->cp_comm;
    const pr_backend *be = tr->be;
    pr_error e;
    be->zero(be, ps->pad, (size_t)c->size * chunk * kvd * sizeof(pr_real));
    if (n_own) be->acts_to_reals(be, ps->pad + (size_t)c->rank * chunk * kvd, own, n_own * kvd);
    for (int q = 0; q < c->size; q++)
        for (int half = 0; half < 2; half++) {
            const size_t at = pr__cp_piece_row(half ? 2 * c->size - 1 - q : q, chunk), n = pr__piece_rows(vis, at, piece) * kvd;
            if (!n) continue;
            pr_real *to = ps->pad + ((size_t)q * chunk + (size_t)half * piece) * kvd;
            const pr_real *src = g + (from + at) * kvd;
            if (q == c->rank) be->add_reals(be, to, src, n);   /* its own rows: what the pass's own keys got too */
            else be->copy(be, to, src, n * sizeof(pr_real));
        }
    pr__comm_done(tr, c->reduce_scatter(c, ps->shard, ps->pad, chunk * kvd, PR_COMM_REAL, &e), &e);
    return ps->shard;
}

/* kv: the own rows' gradient buffers (holding what must be injected) and the cached path's shard
   (its segments' rows on this rank one after another). The region is gathered again rather than
   kept from the forward: keeping every layer's would hold the whole unsharded K/V. */
static void pr__attention_bwd(pr_trainer *tr, pr__pass *ps, pr__bwd_scratch *s, pr__layer_acts *a, const pr__kv_grads *kv) {
    const pr_config *c = &tr->cfg;
    const pr_backend *be = tr->be;
    const int NH = c->num_attention_heads, NKV = c->num_key_value_heads, HS = c->head_dim;
    void *dk = kv->dk, *dv = kv->dv;
    const void *kp = kv->kp, *vp = kv->vp;
    pr_real *dkp = kv->dkp, *dvp = kv->dvp;
    if (!ps->kreg) {
        be->attention_bwd(be, s->dq, dk, dv, dkp, dvp, s->datt, a->att, a->lse, a->q, a->k, a->v, kp, vp, &ps->lay, NH, NKV, HS);
        return;
    }
    const size_t kvd = (size_t)NKV * HS, pre = (size_t)ps->cp_pre_rows, N = (size_t)ps->N;
    pr__cp_gather_path(tr, ps, kp, vp);
    be->zero(be, ps->dkreg, pre * kvd * sizeof(pr_real));    /* the path's rows: summed over every segment */
    be->zero(be, ps->dvreg, pre * kvd * sizeof(pr_real));
    for (int j = 0; j < ps->lay.n_seg; j++) {
        const pr__cp_cut *k = &ps->cp_cut[j];
        const size_t own = (size_t)pr__cp_own(k), at = (size_t)ps->cp_off[j] * kvd;
        /* the segment's rows its queries saw: those before piece B when it has rows, else before
           piece A; a rank without rows of it had no queries, returns nothing but joins the collectives */
        const size_t vis = own ? (size_t)(k->rows_b ? k->b0 : k->a0) : 0;
        pr__cp_gather_seg(tr, ps, a, j);
        be->zero(be, ps->dkreg + pre * kvd, vis * kvd * sizeof(pr_real));
        be->zero(be, ps->dvreg + pre * kvd, vis * kvd * sizeof(pr_real));
        for (int half = 0; half < 2; half++) {
            pr_seq_layout lay;
            int off[2];
            const size_t r = (size_t)pr__cp_piece(ps, j, half, &lay, off), rq = r * NH * HS, rk = r * kvd;
            if (!off[1]) continue;
            const int np = lay.n_prefix;
            be->attention_bwd(be, pr__act_at(tr, s->dq, rq), pr__act_at(tr, dk, rk), pr__act_at(tr, dv, rk), np ? ps->dkreg : NULL,
                              np ? ps->dvreg : NULL, pr__cact_at(tr, s->datt, rq), pr__cact_at(tr, a->att, rq),
                              pr__stat_at(tr, a->lse, r * NH), pr__cact_at(tr, a->q, rq), pr__cact_at(tr, a->k, rk),
                              pr__cact_at(tr, a->v, rk), np ? ps->kreg : NULL, np ? ps->vreg : NULL, &lay, NH, NKV, HS);
        }
        void *dkj = pr__act_at(tr, dk, at), *dvj = pr__act_at(tr, dv, at);
        be->reals_to_acts(be, dkj, pr__cp_return(tr, ps, ps->dkreg, pre, vis, dkj, own, (size_t)k->chunk), own * kvd);
        be->reals_to_acts(be, dvj, pr__cp_return(tr, ps, ps->dvreg, pre, vis, dvj, own, (size_t)k->chunk), own * kvd);
    }
    size_t row = 0, own = 0;    /* the cached path: each segment's gradient added into its shards' owners' */
    for (int i = 0; i < ps->pre_seg; i++) {
        const pr__kv_seg *sg = &ps->pre->seg[i];
        const size_t n = N ? (size_t)sg->rows : 0, elems = (size_t)sg->own * kvd;
        be->add_reals(be, dkp + own * kvd, pr__cp_return(tr, ps, ps->dkreg, row, n, NULL, 0, (size_t)sg->chunk), elems);
        be->add_reals(be, dvp + own * kvd, pr__cp_return(tr, ps, ps->dvreg, row, n, NULL, 0, (size_t)sg->chunk), elems);
        row += (size_t)sg->rows;
        own += (size_t)sg->own;
    }
}

static pr__cp_cut pr__cp_cut_of(const pr_trainer *tr, int n) {
    pr__cp_cut k = { n, n, n, 0, n, n, 0 };
    const int cp = pr__cp(tr);
    if (cp == 1) return k;
    k.piece = (int)(((long)n + 2 * cp - 1) / (2 * cp));
    k.chunk = 2 * k.piece;
    k.a0 = tr->mesh->cp_rank * k.piece;
    k.b0 = (2 * cp - 1 - tr->mesh->cp_rank) * k.piece;
    k.rows_a = (int)pr__piece_rows((size_t)n, (size_t)k.a0, (size_t)k.piece);
    k.rows_b = (int)pr__piece_rows((size_t)n, (size_t)k.b0, (size_t)k.piece);
    return k;
}

/* A batch as pr__batch_build makes it; under CP only this rank's block of each segment (its two
   pieces, pr__cp_cut), the segments' blocks one after another, the loss rows re-indexed. */
static pr_status pr__batch_make(pr_trainer *tr, pr__batch *b, const pr_group *g, const pr_real *tok_weight, int i0, int n,
                                pr__batch_kind kind, int packed, pr_error *err) {
    pr_status st = pr__batch_build(b, g, tok_weight, i0, n, kind, packed, err);
    if (st) return st;
    if (pr__tp(tr) > 1) {      /* tokens and targets as rows of this rank's vocabulary slice, -1 off it */
        for (int r = 0; r < b->N; r++) b->tokens[r] = pr__vocab_row(tr, b->tokens[r]);
        for (int m = 0; m < b->head.M; m++) b->head.target[m] = pr__vocab_row(tr, b->head.target[m]);
    }
    if (pr__cp(tr) == 1) return PR_OK;
    const int ns = b->lay.n_seg;
    b->cp_cut = (pr__cp_cut *)PR_MALLOC(sizeof(pr__cp_cut) * (size_t)ns);
    b->cp_off = (int *)PR_MALLOC(sizeof(int) * (size_t)(ns + 1));
    if (!b->cp_cut || !b->cp_off) return pr__fail(err, PR_ERR_NOMEM, "out of host memory for a batch's CP cut");
    b->cp_off[0] = 0;
    for (int j = 0; j < ns; j++) {  /* each block moves down to where the ones before it end: never past its own rows */
        const pr__cp_cut k = b->cp_cut[j] = pr__cp_cut_of(tr, b->seg_off[j + 1] - b->seg_off[j]);
        const int o = b->cp_off[j], src = b->seg_off[j];
        memmove(b->tokens + o, b->tokens + src + k.a0, sizeof(int32_t) * (size_t)k.rows_a);
        memmove(b->real + o, b->real + src + k.a0, (size_t)k.rows_a);
        memmove(b->tokens + o + k.rows_a, b->tokens + src + k.b0, sizeof(int32_t) * (size_t)k.rows_b);
        memmove(b->real + o + k.rows_a, b->real + src + k.b0, (size_t)k.rows_b);
        b->cp_off[j + 1] = o + pr__cp_own(&k);
        if (k.chunk > b->cp_chunk) b->cp_chunk = k.chunk;
        if (o + k.chunk > b->cp_kv_rows) b->cp_kv_rows = o + k.chunk;
    }
    pr__head_plan *h = &b->head;
    int m = 0, s = 0;
    for (int i = 0, j = 0, next = h->first[0]; i < h->M; i++) {
        const int r = h->row[i], from = next, e = h->first[i + 1];   /* pair i's slots, read before first[m <= i] is written */
        next = e;
        while (j > 0 && r < b->seg_off[j]) j--;            /* the segment that holds row r */
        while (j + 1 < ns && r >= b->seg_off[j + 1]) j++;
        const pr__cp_cut *k = &b->cp_cut[j];
        const int x = r - b->seg_off[j];
        const int in_a = x >= k->a0 && x < k->a0 + k->rows_a, in_b = x >= k->b0 && x < k->b0 + k->rows_b;
        if (!in_a && !in_b) continue;
        h->row[m] = b->cp_off[j] + (in_a ? x - k->a0 : k->rows_a + x - k->b0);
        h->target[m] = h->target[i];
        h->first[m] = s;
        for (int q = from; q < e; q++, s++) {
            h->flat[s] = h->flat[q];
            h->old_logp[s] = h->old_logp[q];
            if (h->ref_logp) h->ref_logp[s] = h->ref_logp[q];
            h->advantage[s] = h->advantage[q];
            h->weight[s] = h->weight[q];
        }
        m++;
    }
    h->M = m;
    h->n_slots = s;
    h->first[m] = s;
    b->N = b->cp_off[ns];
    return PR_OK;
}

/* The buffers a pass's collectives use, from arena a: the CP region, its gradient and a
   reduce-scatter's blocks; the EP all-to-all blocks. */
static pr_status pr__pass_comm_alloc(pr_trainer *tr, pr__arena *a, pr__pass *ps, pr_error *err) {
    const pr_config *c = &tr->cfg;
    const size_t kvd = (size_t)c->num_key_value_heads * c->head_dim;
    const size_t cp = (size_t)pr__cp(tr), ep = (size_t)pr__ep(tr);
    if (cp > 1) {
        /* the region: every gather's rows from where it starts (the path's segments, then each
           of the pass's); a reduce-scatter's blocks, and a gather's second pieces: the largest block */
        size_t region = (size_t)ps->cp_pre_rows + cp * (size_t)ps->cp_chunk, big = (size_t)ps->cp_chunk, row = 0;
        for (int i = 0; i < ps->pre_seg; i++) {
            const pr__kv_seg *sg = &ps->pre->seg[i];
            if (row + cp * (size_t)sg->chunk > region) region = row + cp * (size_t)sg->chunk;
            if ((size_t)sg->chunk > big) big = (size_t)sg->chunk;
            row += (size_t)sg->rows;
        }
        ps->kreg = pr__act(tr, a, region * kvd); ps->vreg = pr__act(tr, a, region * kvd);
        ps->dkreg = pr__reals(tr, a, region * kvd); ps->dvreg = pr__reals(tr, a, region * kvd);
        ps->pad = pr__reals(tr, a, cp * big * kvd); ps->shard = pr__reals(tr, a, big * kvd);
    }
    if (ep > 1 && c->num_experts) {
        const size_t blk = ((size_t)ps->N + ep - 1) / ep * (size_t)c->num_experts_per_tok * (size_t)c->hidden_size;
        ps->ep_send = pr__act(tr, a, ep * blk);
        ps->ep_recv = pr__act(tr, a, ep * blk);
    }
    if (tr->alloc_failed) return pr__act_nomem(tr, err, "for the collectives of a pass of", ps->N);
    return PR_OK;
}

/* ---------------------------------------------------------------- 7.5 Pipeline stages */
/* Pipeline stages. A stage runs its own layers; the first embeds, the last runs the loss
   head. Between neighbours travel, forward, a pass's output rows (with MoE its routing sums so
   far) and, backward, the gradient of its input rows (with MoE its aux gradient). */

/* One exchange of activations with rank `peer` of c, in the directions `dir` names: n_out elements
   of out sent (PR__SEND), n_in received into in (PR__RECV), or both. Both sides make the same call
   with the roles swapped, so a send meets its recv and a send_recv its send_recv. The direction
   is the caller's, never read from the buffers: a pass may hold no rows on this rank (a CP block
   of a prefix shorter than the ranks) and then no buffer either, and its peer still waits for the
   call. */
enum { PR__SEND = 1, PR__RECV = 2 };
static void pr__p2p_acts(pr_trainer *tr, pr_comm *c, int peer, int dir, const void *out, size_t n_out, void *in, size_t n_in) {
    pr_error e;
    pr_status st = PR_OK;
    if (dir == (PR__SEND | PR__RECV)) st = c->send_recv(c, out, n_out, peer, in, n_in, peer, pr__act_type(tr), &e);
    else if (dir == PR__SEND) st = c->send(c, out, n_out, pr__act_type(tr), peer, &e);
    else if (dir == PR__RECV) st = c->recv(c, in, n_in, pr__act_type(tr), peer, &e);
    pr__comm_done(tr, st, &e);
}
/* The same for host doubles (nd_out, nd_in of them, as dir says), through the staging buffers,
   half of each a way: the peer sends what this rank receives, so both run the same rounds. */
static void pr__p2p_doubles(pr_trainer *tr, pr_comm *c, int peer, int dir, const double *d_out, size_t nd_out, double *d_in,
                            size_t nd_in) {
    const size_t no = dir & PR__SEND ? nd_out : 0, ni = dir & PR__RECV ? nd_in : 0, half = PR__STAGE_REALS / 2;
    pr_real *host = tr->stage_host, *dev = tr->stage;
    for (size_t a = 0; a < no || a < ni; a += half) {
        const size_t o = a < no ? (no - a < half ? no - a : half) : 0, i = a < ni ? (ni - a < half ? ni - a : half) : 0;
        pr_error e;
        pr_status st;
        for (size_t j = 0; j < o; j++) host[j] = (pr_real)d_out[a + j];
        tr->be->upload_reals(tr->be, dev, host, o);
        if (o && i) st = c->send_recv(c, dev, o, peer, dev + half, i, peer, PR_COMM_REAL, &e);
        else if (o) st = c->send(c, dev, o, PR_COMM_REAL, peer, &e);
        else st = c->recv(c, dev + half, i, PR_COMM_REAL, peer, &e);
        pr__comm_done(tr, st, &e);
        tr->be->download_reals(tr->be, host + half, dev + half, i);
        for (size_t j = 0; j < i; j++) d_in[a + j] = host[half + j];
    }
}
/* One exchange with the neighbouring stage `peer`: rows of the residual stream out and/or in (dir),
   then host doubles (MoE routing sums or aux gradients; none without experts) the same way. */
static void pr__pp_swap(pr_trainer *tr, int peer, int dir, const void *out, int out_rows, void *in, int in_rows,
                        const double *d_out, size_t nd_out, double *d_in, size_t nd_in) {
    const size_t C = (size_t)tr->cfg.hidden_size;
    pr__p2p_acts(tr, tr->mesh->pp_comm, peer, dir, out, (size_t)out_rows * C, in, (size_t)in_rows * C);
    pr__p2p_doubles(tr, tr->mesh->pp_comm, peer, dir, d_out, nd_out, d_in, nd_in);
}
/* Its one-way halves, as Phases A and C use them: n rows (and nd doubles, d may be NULL). */
static void pr__pp_send(pr_trainer *tr, int peer, const void *rows, int n, const double *d, size_t nd) {
    pr__pp_swap(tr, peer, PR__SEND, rows, n, NULL, 0, d, nd, NULL, 0);
}
static void pr__pp_recv(pr_trainer *tr, int peer, void *rows, int n, double *d, size_t nd) {
    pr__pp_swap(tr, peer, PR__RECV, NULL, 0, rows, n, NULL, 0, d, nd);
}

/* The microbatch's input from the previous stage, with the previous one's gradient going back
   (either may be NULL); nothing on the first stage. */
static void pr__pp_prev(pr_trainer *tr, pr__mb *back, pr__mb *in) {
    if (pr__first_stage(tr) || (!back && !in)) return;
    const size_t E = (size_t)tr->cfg.num_experts;
    pr__pp_swap(tr, tr->mesh->pp_rank - 1, (back ? PR__SEND : 0) | (in ? PR__RECV : 0), back ? back->s.dres : NULL,
                back ? back->p.N : 0, in ? in->p.res[0] : NULL, in ? in->p.N : 0, back ? back->g : NULL, E,
                in ? in->sums : NULL, E ? 2 * E + 1 : 0);
}
/* The microbatch's output to the next stage, with a gradient coming back (either may be NULL);
   nothing on the last stage. */
static void pr__pp_next(pr_trainer *tr, pr__mb *out, pr__mb *back) {
    if (pr__last_stage(tr) || (!out && !back)) return;
    const size_t E = (size_t)tr->cfg.num_experts, L = (size_t)tr->cfg.num_hidden_layers;
    pr__pp_swap(tr, tr->mesh->pp_rank + 1, (out ? PR__SEND : 0) | (back ? PR__RECV : 0), out ? out->p.res[L] : NULL,
                out ? out->p.N : 0, back ? back->s.dres : NULL, back ? back->p.N : 0, out ? out->sums : NULL,
                E ? 2 * E + 1 : 0, back ? back->g : NULL, E);
}

/* ---------------------------------------------------------------- 7.6 Groups split across DP ranks */
/* n reals sent to `peer` (out) or received from it (in): a split group's gK/gV, which stay in
   reals on their way to the group's first rank. */
static void pr__send_or_recv_reals(pr_trainer *tr, pr_comm *c, int peer, int send, const pr_real *out, pr_real *in, size_t n) {
    pr_error e;
    pr__comm_done(tr, send ? c->send(c, out, n, PR_COMM_REAL, peer, &e) : c->recv(c, in, n, PR_COMM_REAL, peer, &e), &e);
}

/* A group split across DP ranks, after Phase A: the owner sends every layer's K/V (and with MoE
   the prefix's routing sums) to each peer, the compact state Phase B reads; the prefix's
   activation stack stays with the owner. The K/V buffers hold the CP block's rows. */
static void pr__split_share_kv(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path) {
    pr_comm *t = cx->team;
    const pr_config *c = &tr->cfg;
    const size_t n = (size_t)path->kv * c->num_key_value_heads * c->head_dim;
    const size_t ns = cx->moe.on ? 2 * (size_t)cx->moe.E + 1 : 0;
    for (int peer = 1; peer < t->size; peer++) {
        if (t->rank && t->rank != peer) continue;
        const int other = t->rank ? 0 : peer, send = !t->rank;
        for (int l = 0; l < c->num_hidden_layers; l++) {
            pr__p2p_acts(tr, t, other, send ? PR__SEND : PR__RECV, path->k[l], n, path->k[l], n);
            pr__p2p_acts(tr, t, other, send ? PR__SEND : PR__RECV, path->v[l], n, path->v[l], n);
        }
        if (ns) pr__p2p_doubles(tr, t, other, send ? PR__SEND : PR__RECV, cx->moe.pre, ns, cx->moe.pre, ns);
    }
}

/* ... and after Phase B: each peer's gK/gV (and with MoE the prefix's aux gradient) go back to
   the owner, who adds them to its own before Phase C. */
static void pr__split_reduce_gkv(pr_trainer *tr, pr__step_ctx *cx, const pr__kv_path *path) {
    pr_comm *t = cx->team;
    const pr_config *c = &tr->cfg;
    const size_t n = (size_t)path->own * c->num_key_value_heads * c->head_dim, E = cx->moe.on ? (size_t)cx->moe.E : 0;
    double *peer_c = E ? (double *)PR_MALLOC(sizeof(double) * E) : NULL;
    if (E && !peer_c) {
        tr->alloc_failed = 1;
        return;
    }
    for (int peer = 1; peer < t->size; peer++) {
        if (t->rank && t->rank != peer) continue;
        const int other = t->rank ? 0 : peer, send = t->rank != 0;
        for (int l = 0; l < c->num_hidden_layers; l++) {
            pr__send_or_recv_reals(tr, t, other, send, path->gk[l], path->dk_mb, n);
            pr__send_or_recv_reals(tr, t, other, send, path->gv[l], path->dv_mb, n);
            if (!send) {
                tr->be->add_reals(tr->be, path->gk[l], path->dk_mb, n);
                tr->be->add_reals(tr->be, path->gv[l], path->dv_mb, n);
            }
        }
        if (E) {
            pr__p2p_doubles(tr, t, other, send ? PR__SEND : PR__RECV, cx->moe.c, E, peer_c, E);
            for (size_t e = 0; !send && e < E; e++) cx->moe.c[e] += peer_c[e];
        }
    }
    PR_FREE(peer_c);
}

/* ---------------------------------------------------------------- 7.7 Data parallelism */
PRDEF pr_status pr_dp_place(const pr_config *cfg, const pr_group *groups, int n, int ranks, pr_schedule schedule, int *owner) {
    if (!owner || n < 1) return PR_OK;
    double *load = (double *)PR_MALLOC(sizeof(double) * (size_t)(ranks > 0 ? ranks : 1));
    char *done = (char *)PR_MALLOC((size_t)(n > 0 ? n : 1));
    if (!load || !done || ranks < 1 || !cfg || !groups) {   /* everything on rank 0 */
        for (int i = 0; i < n; i++) owner[i] = 0;
        PR_FREE(load);
        PR_FREE(done);
        return ranks < 1 || !cfg || !groups ? PR_OK : PR_ERR_NOMEM;
    }
    for (int r = 0; r < ranks; r++) load[r] = 0;
    memset(done, 0, (size_t)n);
    for (int k = 0; k < n; k++) {              /* the costliest group left, onto the least loaded rank */
        int best = -1;
        double cost = -1;
        for (int i = 0; i < n; i++) {
            double f = done[i] ? -1 : pr_step_flops(cfg, &groups[i], schedule);
            if (!(f > 0)) f = 0;                 /* a malformed group's (negative or NaN) */
            if (!done[i] && (best < 0 || f > cost)) { cost = f; best = i; }
        }
        int to = 0;
        for (int r = 1; r < ranks; r++) if (load[r] < load[to]) to = r;
        owner[best] = to;
        load[to] += cost;
        done[best] = 1;
    }
    PR_FREE(load);
    PR_FREE(done);
    return PR_OK;
}

/* What a placement reads of the groups (their FLOPs), checked before it reads it: alike on every
   rank, so that all fail alike. The rest is checked where a group runs (pr__validate_step). */
static pr_status pr__groups_placeable(const pr_group *groups, int n, const char *fn, pr_error *err) {
    for (int k = 0; k < n; k++) {
        const pr_group *g = &groups[k];
        if (g->P < 1 || g->G < 1 || !g->suffix_len)
            return pr__fail(err, PR_ERR_ARG, "%s: group %d: P %d, G %d, suffix_len %s (pr_group_validate has the rules)", fn, k,
                            g->P, g->G, g->suffix_len ? "given" : "NULL");
        for (int i = 0; i < g->G; i++)
            if (g->suffix_len[i] < 1)
                return pr__fail(err, PR_ERR_ARG, "%s: group %d: suffix_len[%d] = %d (must be >= 1)", fn, k, i, g->suffix_len[i]);
    }
    return PR_OK;
}

/* The step's gradient sum over dp: the whole sum on every rank (all-reduce), or under ZeRO-2 the
   sum of the rank's own slice (reduce-scatter). In reals, or with pr_mesh.bf16_grad_reduce in bf16
   chunks through the wire buffer. Every rank makes every call, even after a failure. */
static pr_status pr__dp_sum_grads(pr_trainer *tr, pr_comm *dp, pr_error *err) {
    const pr_backend *be = tr->be;
    const int R = dp->size;
    pr_real *own = tr->zero == 2 ? tr->grads + (size_t)tr->mesh->dp_rank * tr->slice_cap : NULL;
    if (tr->zero == 2) tr->grads_scattered = 1;
    if (R == 1) return PR_OK;               /* a sum over one rank: nothing to add, nothing to round */
    if (!tr->grad_wire) {
        if (own) return dp->reduce_scatter(dp, own, tr->grads, tr->slice_cap, PR_COMM_REAL, err);
        return R > 1 ? dp->all_reduce(dp, tr->grads, tr->n_params, PR_COMM_REAL, err) : PR_OK;
    }
    const size_t c = pr__grad_wire_chunk(tr, R), whole = own ? tr->slice_cap : tr->n_params;
    uint16_t *got = own ? tr->grad_wire + (size_t)R * c : tr->grad_wire;
    pr_status st = PR_OK;
    for (size_t at = 0; at < whole; at += c) {
        const size_t k = whole - at < c ? whole - at : c;
        pr_status s;
        if (own) {                /* block r: this chunk of rank r's slice; the reduce-scatter returns our own */
            for (int r = 0; r < R; r++)
                be->reals_to_bf16(be, tr->grad_wire + (size_t)r * k, tr->grads + (size_t)r * tr->slice_cap + at, k);
            s = dp->reduce_scatter(dp, got, tr->grad_wire, k, PR_COMM_BF16, st ? NULL : err);
        } else {
            be->reals_to_bf16(be, tr->grad_wire, tr->grads + at, k);
            s = dp->all_reduce(dp, tr->grad_wire, k, PR_COMM_BF16, st ? NULL : err);
        }
        if (!st) st = s;
        be->bf16_to_reals(be, (own ? own : tr->grads) + at, got, k);
    }
    return st;
}

/* A dp step's start: the gradients at zero (its groups accumulate) ... */
static void pr__dp_step_begin(pr_trainer *tr) {
    pr__load_begin(tr);
    tr->comm_st = PR_OK;
    tr->be->zero(tr->be, tr->grads, tr->n_params * sizeof(pr_real));
    tr->grads_scattered = 0;
}

/* ... and its end, after this rank's groups (status st): the sums over the mesh and over dp.
   Every rank reaches the collectives, even after a local failure, so that none is left waiting;
   a failed rank's sum is discarded by its own status. */
static pr_status pr__dp_step_end(pr_trainer *tr, pr_comm *dp, pr_status st, const pr_step_stats *sum, pr_step_stats *stats,
                                 pr_error *err) {
    pr__load_end(tr);
    pr__mesh_sync_grads(tr);
    pr_status cs = pr__dp_sum_grads(tr, dp, st ? NULL : err);
    if (st) return st;
    if (cs) return cs;
    if (tr->comm_st) return pr__fail(err, tr->comm_st, "%s", tr->comm_err.message);
    if (stats) *stats = *sum;
    return PR_OK;
}

/* The team of dp ranks that group gi of a step of n groups (fewer than the ranks) is split over.
   Over the mesh's dp communicator the team is kept for the next step of as many groups: an NCCL
   split sets up a whole communicator, too slow to repeat every step. It is kept only where every
   rank still holds its own (a rank drops its team after a failed step, whose meetings it may have
   left half done), which one sum over dp tells them all alike: else all split again together,
   as a lone split would meet nobody. Over another communicator, which the trainer cannot tell
   alive from one step to the next, the team is this step's alone. */
static pr_status pr__dp_team(pr_trainer *tr, pr_comm *dp, int n, int gi, pr_comm **team, pr_error *err) {
    const int keep = tr->mesh && dp == tr->mesh->dp_comm;
    if (keep) {
        pr_real holding = tr->dp_team && tr->dp_team_groups == n;
        pr__sum_host(tr, dp, &holding, 1);
        if (holding == dp->size) {
            *team = tr->dp_team;
            return PR_OK;
        }
        if (tr->dp_team) tr->dp_team->destroy(tr->dp_team);
        tr->dp_team = NULL;
    }
    pr_status st = dp->split(dp, gi, dp->rank, team, err);
    if (!st && keep) {
        tr->dp_team = *team;
        tr->dp_team_groups = n;
    }
    return st;
}

PRDEF pr_status pr_trainer_compute_grads_dp(pr_trainer *tr, pr_comm *dp, const pr_group *groups, int n,
                                            const pr_step_opts *opt, pr_step_stats *stats, pr_error *err) {
    if (!tr || !dp || !groups || !opt || n < 1) return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads_dp: NULL argument or no groups");
    if (tr->zero && dp != tr->mesh->dp_comm)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads_dp: a trainer with sharded state (zero %d) steps over its mesh's dp communicator", tr->zero);
    const int R = dp->size;
    pr_status st = pr__groups_placeable(groups, n, "pr_trainer_compute_grads_dp", err);   /* every rank meets at the end */
    int *place = !st && n >= R ? (int *)PR_MALLOC(sizeof(int) * (size_t)n) : NULL;    /* whole groups: each one's rank */
    if (!st && n >= R && (!place || pr_dp_place(&tr->model, groups, n, R, opt->schedule, place)))
        st = pr__fail(err, PR_ERR_NOMEM, "out of host memory to place %d groups", n);
    pr__dp_step_begin(tr);
    pr_step_opts o = *opt;
    pr_step_stats s, sum;
    memset(&sum, 0, sizeof sum);
    o.accumulate = 1;
    if (!st && n < R) {        /* fewer groups than ranks: group i split over ranks i*R/n .. (i+1)*R/n - 1 */
        int gi = 0;
        while (gi + 1 < n && (long)(gi + 1) * R / n <= dp->rank) gi++;
        pr_comm *team = NULL;
        st = pr__dp_team(tr, dp, n, gi, &team, err);
        if (!st) {
            const size_t sent = team->bytes_sent;
            st = pr__compute_grads(tr, &groups[gi], &o, &sum, NULL, team->size > 1 ? team : NULL, err);
            dp->bytes_sent += team->bytes_sent - sent;     /* the team's traffic is the dp dimension's */
            if (team == tr->dp_team && (st || tr->comm_st)) tr->dp_team = NULL;   /* failed: not kept (pr__dp_team) */
            if (team != tr->dp_team) team->destroy(team);
        }
    }
    for (int i = 0; place && i < n && !st; i++) {
        if (place[i] != dp->rank) continue;
        st = pr__compute_grads(tr, &groups[i], &o, &s, NULL, NULL, err);
        if (!st) pr_step_stats_add(&sum, &s);
    }
    PR_FREE(place);
    return pr__dp_step_end(tr, dp, st, &sum, stats, err);
}

PRDEF pr_status pr_tree_place(const pr_config *cfg, const pr_group *groups, int n, const pr_prefix_tree *tree, int ranks, int *owner) {
    if (!owner) return PR_OK;
    for (int k = 0; k < n; k++) owner[k] = 0;
    if (!cfg || !groups || !tree) return PR_OK;
    if (pr__tree_check(tree, groups, n, NULL)) return PR_ERR_ARG;   /* its nodes and groups are followed below */
    if (ranks < 2) return PR_OK;
    const int N = tree->n_nodes;
    int *depth = (int *)PR_MALLOC(sizeof(int) * ((size_t)N + 2 * (size_t)n));
    int *order = depth ? depth + N : NULL, *chain = NULL, D = 0;
    for (int i = 0; depth && i < N; i++) {
        depth[i] = tree->nodes[i].parent < 0 ? 1 : depth[tree->nodes[i].parent] + 1;
        if (depth[i] > D) D = depth[i];
    }
    if (depth) chain = (int *)PR_MALLOC(sizeof(int) * (size_t)n * (size_t)(D + 1));
    if (!chain) {                              /* everything on rank 0 */
        PR_FREE(depth);
        return PR_ERR_NOMEM;
    }
    for (int k = 0; k < n; k++) {              /* each group's nodes from its root, -1 after its own */
        int *ck = chain + (size_t)k * (D + 1), node = tree->group_node[k];
        for (int j = 0; j <= D; j++) ck[j] = -1;
        for (int i = node; i >= 0; i = tree->nodes[i].parent) ck[depth[i] - 1] = i;
        order[k] = k;
    }
    for (int a = 1; a < n; a++) {              /* depth-first order: by chain, then group (insertion sort) */
        const int k = order[a], *y = chain + (size_t)k * (D + 1);
        int b = a;
        while (b > 0) {
            const int *x = chain + (size_t)order[b - 1] * (D + 1);
            int j = 0;
            while (j <= D && x[j] == y[j]) j++;
            if (j > D || x[j] < y[j]) break;
            order[b] = order[b - 1];
            b--;
        }
        order[b] = k;
    }
    double total = 0, acc = 0;
    for (int k = 0; k < n; k++) total += pr_step_flops(cfg, &groups[k], PR_SCHEDULE_REUSE);
    for (int j = 0, r = 0, have = 0; j < n; j++) {     /* contiguous runs; every rank left gets a group */
        const double f = pr_step_flops(cfg, &groups[order[j]], PR_SCHEDULE_REUSE);
        if (have && r + 1 < ranks && (n - j <= ranks - 1 - r || acc + f / 2 > total * (r + 1) / ranks)) {
            r++;
            have = 0;
        }
        owner[order[j]] = r;
        have++;
        acc += f;
    }
    PR_FREE(chain);
    PR_FREE(depth);
    return PR_OK;
}

/* The tree cut down to the groups `owner` places on `rank`: their nodes in the same order,
   members[0..m-1] the groups' indices. */
static pr_status pr__tree_restrict(const pr_prefix_tree *tree, const pr_group *groups, const int *owner, int rank,
                                   pr_prefix_tree *sub, int *members, int *m, pr_error *err) {
    const int N = tree->n_nodes, n = tree->n_groups;
    memset(sub, 0, sizeof *sub);
    int *map = (int *)PR_MALLOC(sizeof(int) * (size_t)N);
    if (!map) return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
    for (int i = 0; i < N; i++) map[i] = -1;
    *m = 0;
    for (int k = 0; k < n; k++)
        if (owner[k] == rank) {
            members[(*m)++] = k;
            for (int i = tree->group_node[k]; i >= 0; i = tree->nodes[i].parent) map[i] = 0;
        }
    for (int i = 0; i < N; i++) if (map[i] == 0) map[i] = sub->n_nodes++;
    sub->nodes = (pr_prefix_node *)PR_MALLOC(sizeof(pr_prefix_node) * (size_t)(sub->n_nodes ? sub->n_nodes : 1));
    sub->group_node = (int *)PR_MALLOC(sizeof(int) * (size_t)(*m ? *m : 1));
    if (!sub->nodes || !sub->group_node) {
        PR_FREE(map);
        pr_prefix_tree_free(sub);
        return pr__fail(err, PR_ERR_NOMEM, "out of host memory");
    }
    for (int i = 0; i < N; i++)
        if (map[i] >= 0) {
            pr_prefix_node *d = &sub->nodes[map[i]];
            *d = tree->nodes[i];
            d->parent = d->parent < 0 ? -1 : map[d->parent];
            d->groups_below = 0;
            sub->tokens_tree += d->len;
        }
    sub->n_groups = *m;
    for (int j = 0; j < *m; j++) {
        const pr_group *g = &groups[members[j]];
        sub->group_node[j] = map[tree->group_node[members[j]]];
        for (int i = sub->group_node[j]; i >= 0; i = sub->nodes[i].parent) sub->nodes[i].groups_below++;
        sub->tokens_baseline += (long)g->G * g->P;
        sub->tokens_groups += g->P;
    }
    PR_FREE(map);
    return PR_OK;
}

PRDEF pr_status pr_trainer_compute_grads_tree_dp(pr_trainer *tr, pr_comm *dp, const pr_group *groups, int n,
                                                 const pr_prefix_tree *tree, const pr_step_opts *opt, pr_step_stats *stats,
                                                 pr_error *err) {
    if (!tr || !dp || !groups || !tree || !opt || n < 1)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads_tree_dp: NULL argument or no groups");
    if (tr->zero && dp != tr->mesh->dp_comm)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads_tree_dp: a trainer with sharded state (zero %d) steps over "
                        "its mesh's dp communicator", tr->zero);
    const int R = dp->size;
    if (n < R)
        return pr__fail(err, PR_ERR_ARG, "pr_trainer_compute_grads_tree_dp: %d groups over %d dp ranks: a tree step places whole "
                        "groups, at least one a rank (pr_trainer_compute_grads_dp splits groups)", n, R);
    /* the groups and the tree checked before the placement follows them (alike on every rank) */
    pr_status st = pr__groups_placeable(groups, n, "pr_trainer_compute_grads_tree_dp", err);
    if (!st) st = pr__tree_check(tree, groups, n, err);
    if (st) return st;
    int *owner = (int *)PR_MALLOC(sizeof(int) * 2 * (size_t)n);
    pr_group *mine = (pr_group *)PR_MALLOC(sizeof(pr_group) * (size_t)n);
    pr_prefix_tree sub;
    memset(&sub, 0, sizeof sub);
    int m = 0;
    st = owner && mine ? PR_OK : pr__fail(err, PR_ERR_NOMEM, "out of host memory");
    if (!st && pr_tree_place(&tr->model, groups, n, tree, R, owner))
        st = pr__fail(err, PR_ERR_NOMEM, "out of host memory to place %d groups", n);
    if (!st) {
        st = pr__tree_restrict(tree, groups, owner, dp->rank, &sub, owner + n, &m, err);
    }
    for (int j = 0; j < m && !st; j++) mine[j] = groups[owner[n + j]];
    pr__dp_step_begin(tr);
    pr_step_opts o = *opt;
    o.accumulate = 1;
    pr_step_stats s;
    memset(&s, 0, sizeof s);
    if (!st) st = pr__compute_grads_tree(tr, mine, m, &sub, &o, &s, err);
    pr_prefix_tree_free(&sub);
    PR_FREE(owner);
    PR_FREE(mine);
    return pr__dp_step_end(tr, dp, st, &s, stats, err);
}

/* ---------------------------------------------------------------- 7.8 The measuring communicator */
typedef struct { pr_comm *inner; int owns; } pr__measure_comm;

static pr_status pr__mc_move(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type t, pr_error *err) {
    (void)c; (void)out; (void)in; (void)n; (void)t; (void)err;
    return PR_OK;
}
static pr_status pr__mc_reduce(pr_comm *c, void *buf, size_t n, pr_comm_type t, pr_error *err) {
    (void)c; (void)buf; (void)n; (void)t; (void)err;
    return PR_OK;
}
static pr_status pr__mc_send(pr_comm *c, const void *buf, size_t n, pr_comm_type t, int peer, pr_error *err) {
    (void)c; (void)buf; (void)n; (void)t; (void)peer; (void)err;
    return PR_OK;
}
static pr_status pr__mc_recv(pr_comm *c, void *buf, size_t n, pr_comm_type t, int peer, pr_error *err) {
    (void)c; (void)buf; (void)n; (void)t; (void)peer; (void)err;
    return PR_OK;
}
static pr_status pr__mc_send_recv(pr_comm *c, const void *s, size_t ns, int to, void *r, size_t nr, int from, pr_comm_type t,
                                  pr_error *err) {
    (void)c; (void)s; (void)ns; (void)to; (void)r; (void)nr; (void)from; (void)t; (void)err;
    return PR_OK;
}
static pr_status pr__mc_barrier(pr_comm *c, pr_error *err) { (void)c; (void)err; return PR_OK; }
static void pr__mc_destroy(pr_comm *c) {
    if (!c) return;
    pr__measure_comm *m = (pr__measure_comm *)c->ctx;
    if (m->owns) m->inner->destroy(m->inner);
    PR_FREE(m);
    PR_FREE(c);
}
static pr_status pr__mc_wrap(pr_comm **out, pr_comm *inner, int owns, pr_error *err);
static pr_status pr__mc_split(pr_comm *c, int color, int key, pr_comm **sub, pr_error *err) {
    pr_comm *inner_sub = NULL;
    pr__measure_comm *m = (pr__measure_comm *)c->ctx;
    pr_status st = m->inner->split(m->inner, color, key, &inner_sub, err);
    if (!st && (st = pr__mc_wrap(sub, inner_sub, 1, err))) inner_sub->destroy(inner_sub);
    return st;
}
static pr_status pr__mc_wrap(pr_comm **out, pr_comm *inner, int owns, pr_error *err) {
    pr_comm *c = (pr_comm *)PR_MALLOC(sizeof *c);
    pr__measure_comm *m = (pr__measure_comm *)PR_MALLOC(sizeof *m);
    if (!c || !m) {
        PR_FREE(c);
        PR_FREE(m);
        return pr__fail(err, PR_ERR_NOMEM, "pr_comm_measure: out of memory");
    }
    memset(c, 0, sizeof *c);
    m->inner = inner;
    m->owns = owns;
    c->rank = inner->rank;
    c->size = inner->size;
    c->name = "measure";
    c->ctx = m;
    c->all_reduce = pr__mc_reduce;
    c->all_gather = pr__mc_move;
    c->reduce_scatter = pr__mc_move;
    c->all_to_all = pr__mc_move;
    c->send = pr__mc_send;
    c->recv = pr__mc_recv;
    c->send_recv = pr__mc_send_recv;
    c->barrier = pr__mc_barrier;
    c->split = pr__mc_split;
    c->destroy = pr__mc_destroy;
    *out = c;
    return PR_OK;
}
PRDEF pr_status pr_comm_measure(pr_comm **out, pr_comm *inner, pr_error *err) {
    if (!out || !inner) return pr__fail(err, PR_ERR_ARG, "pr_comm_measure: NULL argument");
    return pr__mc_wrap(out, inner, 0, err);
}

/* ---------------------------------------------------------------- 7.9 In-process ranks: the communicator over threads */
#ifndef PR_NO_THREADS
/* The threads behind the ranks: C11 <threads.h> in C, POSIX threads in C++ (whose standard has no
   <threads.h>; every C++ toolchain on Linux and macOS has <pthread.h>). The communicator uses
   these few calls only. */
#if defined(__cplusplus)
#include <pthread.h>
#include <sched.h>
typedef pthread_mutex_t pr__mtx;
typedef pthread_cond_t pr__cnd;
typedef pthread_t pr__thrd;
typedef void *pr__thrd_result;
static int pr__mtx_init(pr__mtx *m) { return pthread_mutex_init(m, NULL) == 0; }
static void pr__mtx_destroy(pr__mtx *m) { pthread_mutex_destroy(m); }
static void pr__mtx_lock(pr__mtx *m) { pthread_mutex_lock(m); }
static void pr__mtx_unlock(pr__mtx *m) { pthread_mutex_unlock(m); }
static int pr__cnd_init(pr__cnd *c) { return pthread_cond_init(c, NULL) == 0; }
static void pr__cnd_destroy(pr__cnd *c) { pthread_cond_destroy(c); }
static void pr__cnd_wait(pr__cnd *c, pr__mtx *m) { pthread_cond_wait(c, m); }
static void pr__cnd_broadcast(pr__cnd *c) { pthread_cond_broadcast(c); }
static int pr__thrd_create(pr__thrd *t, pr__thrd_result (*fn)(void *), void *arg) { return pthread_create(t, NULL, fn, arg) == 0; }
static void pr__thrd_join(pr__thrd t) { pthread_join(t, NULL); }
static void pr__thrd_yield(void) { sched_yield(); }
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L && !defined(__STDC_NO_THREADS__)
#include <threads.h>
typedef mtx_t pr__mtx;
typedef cnd_t pr__cnd;
typedef thrd_t pr__thrd;
typedef int pr__thrd_result;
static int pr__mtx_init(pr__mtx *m) { return mtx_init(m, mtx_plain) == thrd_success; }
static void pr__mtx_destroy(pr__mtx *m) { mtx_destroy(m); }
static void pr__mtx_lock(pr__mtx *m) { mtx_lock(m); }
static void pr__mtx_unlock(pr__mtx *m) { mtx_unlock(m); }
static int pr__cnd_init(pr__cnd *c) { return cnd_init(c) == thrd_success; }
static void pr__cnd_destroy(pr__cnd *c) { cnd_destroy(c); }
static void pr__cnd_wait(pr__cnd *c, pr__mtx *m) { cnd_wait(c, m); }
static void pr__cnd_broadcast(pr__cnd *c) { cnd_broadcast(c); }
static int pr__thrd_create(pr__thrd *t, pr__thrd_result (*fn)(void *), void *arg) { return thrd_create(t, fn, arg) == thrd_success; }
static void pr__thrd_join(pr__thrd t) { thrd_join(t, NULL); }
static void pr__thrd_yield(void) { thrd_yield(); }
#else
#error "prefixreuse.h: the in-process ranks (pr_comm_local_run) need C11 <threads.h> or C++; compile as C11 or later, or define PR_NO_THREADS to leave them out"
#endif

static size_t pr__comm_elem(pr_comm_type t) { return t == PR_COMM_F64 ? 8 : t == PR_COMM_F32 ? 4 : 2; }

static double pr__comm_get(const void *p, size_t i, pr_comm_type t) {
    if (t == PR_COMM_F64) return ((const double *)p)[i];
    if (t == PR_COMM_F32) return ((const float *)p)[i];
    return pr_bf16_to_f32(((const uint16_t *)p)[i]);
}
static void pr__comm_put(void *p, size_t i, pr_comm_type t, double v) {
    if (t == PR_COMM_F64) ((double *)p)[i] = v;
    else if (t == PR_COMM_F32) ((float *)p)[i] = (float)v;
    else ((uint16_t *)p)[i] = pr_f32_to_bf16((float)v);
}

/* One pr_comm_local_run: the lock and condition that all its communicators share (the ranks'
   first one and every split of it), and what each of its threads waits for. With them a wait
   that cannot end fails instead of hanging: one for a rank that has left (its function returned,
   or it destroyed the communicator), and one in a run whose every thread waits with none able to
   wake another, as when a rank that failed skips a collective its peers are in. A collective
   also checks that every rank made the same call (operation, count, type, and its number on the
   communicator) before it reads another rank's buffer. */
enum { PR__RUNNING = 0, PR__DONE, PR__AT_BARRIER, PR__BOX_EMPTY, PR__BOX_FULL };
/* How many of the latest failures the communicator raised on a thread it remembers (a step's
   collectives after its first failure are a few). */
#define PR__RAISED_KEPT 16
struct pr__world;
typedef struct {
    int kind;                      /* running, done (its function returned), or what it waits for */
    struct pr__world *w;
    unsigned gen;                  /* PR__AT_BARRIER: the generation of the barrier it arrived at */
    size_t box;                    /* PR__BOX_*: the mailbox */
    int peer;                      /* PR__BOX_*: the rank of w that would end the wait */
    const char *what;              /* the call, for messages */
} pr__wait;

typedef struct {
    pr__mtx mu;
    pr__cnd cv;
    unsigned epoch;                /* counts the changes a waiter may be waiting for (pr__run_wake) */
    int refs;                      /* its worlds, and pr_comm_local_run until it returns */
    int gate;                      /* 0 wait, 1 go, -1 give up (a thread failed to start) */
    int threads, waiting, done;    /* threads; of them, those in a recorded wait and those returned */
    pr__wait *wait;                /* (threads) */
    pr_error *said;                /* (threads) the first failure the communicator raised on each */
    uint64_t *raised;              /* (threads x PR__RAISED_KEPT) a ring of the latest it raised on
                                      each, hashed, with its echo flag (pr__raised_entry): a rank goes
                                      on to its step's other collectives after a failure, and may
                                      return a later one's */
    unsigned *raised_n;            /* (threads) how many it raised on each */
    unsigned char *echo;           /* (threads) 1 where that failure passes on another rank's (it left
                                      failing, it told, it ran out of memory), 0 where the communicator
                                      found a fault in the calls themselves (all waiting, calls or sizes
                                      that differ, a rank that returned without failing and left a peer
                                      waiting in a call it skipped) */
    unsigned char *returned_ok;    /* (threads) its function returned PR_OK */
} pr__run;

/* The run's waits, with its lock held. A change any waiter may wait for counts an epoch and wakes
   them all. A waiter first gives up its core a few times, looking again after each, before it
   sleeps: the peer it waits for mostly arrives within a few yields, and a sleep and wake of the
   ranks' threads at every collective cost far more than the collective when the ranks outnumber
   the cores (a barrier of four ranks on two cores: ten times as long). It returns on a change or a
   spurious wake; its caller looks again at what it waits for. */
#define PR__RUN_YIELDS 100
static void pr__run_wake(pr__run *run) {
    run->epoch++;
    pr__cnd_broadcast(&run->cv);
}
static void pr__run_sleep(pr__run *run) {
    const unsigned epoch = run->epoch;
    for (int i = 0; i < PR__RUN_YIELDS && run->epoch == epoch; i++) {
        pr__mtx_unlock(&run->mu);
        pr__thrd_yield();
        pr__mtx_lock(&run->mu);
    }
    if (run->epoch == epoch) pr__cnd_wait(&run->cv, &run->mu);
}

/* A collective's call, compared across the ranks before any buffer is read. `seq` numbers the
   rank's meetings on the communicator, so that a rank that gave up a meeting and comes with its
   next call, of the same shape, is not taken for the call its peers wait in. `ready`: the rank
   holds the scratch its part needs, taken before the meeting; a rank without it makes every rank
   fail the call, so that a collective succeeds or fails on all of its ranks alike. */
typedef struct {
    const char *op;
    size_t n;
    pr_comm_type type;
    unsigned long seq;
    int ready;
} pr__call;

/* What the ranks of one communicator share: a barrier, a slot per rank to publish a pointer and
   its call in, and a mailbox per ordered pair of ranks for send/recv. */
typedef struct pr__world {
    int size, refs;
    pr__run *run;
    int arrived;
    unsigned gen;
    const void **slot;             /* (size) */
    pr__call *call;                /* (size) */
    int *color, *key;              /* (size) split's exchange */
    struct pr__world **made;       /* (size) split: the sub-world a group leader made */
    int *thread;                   /* (size) each rank's thread of the run */
    int *left;                     /* (size) the rank has destroyed its communicator */
    const void **mail;             /* (size*size) [from*size + to] */
    size_t *mail_bytes;
    int *mail_full;
} pr__world;

typedef struct {
    pr_comm c;
    pr__world *w;
    int thread;                    /* the rank's thread of the run */
    unsigned long meetings;        /* pr__call.seq */
} pr__local;

/* The run's memory: its arrays and itself (its lock and condition destroyed first where made). */
static void pr__run_free_memory(pr__run *run) {
    PR_FREE(run->wait);
    PR_FREE(run->said);
    PR_FREE(run->raised);
    PR_FREE(run->raised_n);
    PR_FREE(run->echo);
    PR_FREE(run);
}
static void pr__run_free(pr__run *run) {
    pr__cnd_destroy(&run->cv);
    pr__mtx_destroy(&run->mu);
    pr__run_free_memory(run);
}
/* Drops a reference to the run, with its lock held; frees it (after the unlock) when the last goes. */
static void pr__run_unlock_release(pr__run *run) {
    const int last = --run->refs == 0;
    pr__mtx_unlock(&run->mu);
    if (last) pr__run_free(run);
}
static void pr__world_free(pr__world *w) {
    PR_FREE(w->slot); PR_FREE(w->call); PR_FREE(w->color); PR_FREE(w->key); PR_FREE(w->made);
    PR_FREE(w->thread); PR_FREE(w->left); PR_FREE(w->mail); PR_FREE(w->mail_bytes); PR_FREE(w->mail_full);
    PR_FREE(w);
}
static pr__world *pr__world_new(int size, pr__run *run) {
    pr__world *w = (pr__world *)PR_MALLOC(sizeof *w);
    if (!w) return NULL;
    memset(w, 0, sizeof *w);
    size_t n = (size_t)size, nn = n * n;
    w->size = size;
    w->refs = size;
    w->run = run;
    w->slot = (const void **)PR_MALLOC(sizeof(void *) * n);
    w->call = (pr__call *)PR_MALLOC(sizeof(pr__call) * n);
    w->color = (int *)PR_MALLOC(sizeof(int) * n);
    w->key = (int *)PR_MALLOC(sizeof(int) * n);
    w->made = (pr__world **)PR_MALLOC(sizeof(pr__world *) * n);
    w->thread = (int *)PR_MALLOC(sizeof(int) * n);
    w->left = (int *)PR_MALLOC(sizeof(int) * n);
    w->mail = (const void **)PR_MALLOC(sizeof(void *) * nn);
    w->mail_bytes = (size_t *)PR_MALLOC(sizeof(size_t) * nn);
    w->mail_full = (int *)PR_MALLOC(sizeof(int) * nn);
    if (!w->slot || !w->call || !w->color || !w->key || !w->made || !w->thread || !w->left || !w->mail || !w->mail_bytes ||
        !w->mail_full) {
        pr__world_free(w);
        return NULL;
    }
    memset(w->made, 0, sizeof(pr__world *) * n);
    memset(w->left, 0, sizeof(int) * n);
    memset(w->mail_full, 0, sizeof(int) * nn);
    for (int r = 0; r < size; r++) w->thread[r] = r;     /* a run's first world; a split's members write theirs */
    pr__mtx_lock(&run->mu);                   /* a world outlives pr_comm_local_run if fn keeps it */
    run->refs++;
    pr__mtx_unlock(&run->mu);
    return w;
}
/* A rank is done with its communicator: waits on it end (pr__wait_lost), the last frees it. */
static void pr__world_leave(pr__world *w, int rank) {
    pr__run *run = w->run;
    pr__mtx_lock(&run->mu);
    w->left[rank] = 1;
    pr__run_wake(run);
    if (--w->refs) {
        pr__mtx_unlock(&run->mu);
        return;
    }
    pr__world_free(w);
    pr__run_unlock_release(run);
}

static pr__world *pr__lw(pr_comm *c) { return ((pr__local *)c)->w; }

static int pr__rank_gone(const pr__world *w, int r) { return w->left[r] || w->run->wait[w->thread[r]].kind == PR__DONE; }
/* Whether the condition a wait is for holds (a thread not waiting has nothing to wait for). */
static int pr__wait_over(const pr__wait *x) {
    if (x->kind == PR__AT_BARRIER) return x->w->gen != x->gen;
    if (x->kind == PR__BOX_EMPTY) return !x->w->mail_full[x->box];
    if (x->kind == PR__BOX_FULL) return x->w->mail_full[x->box];
    return 1;
}
/* The rank of x->w whose leaving means the wait can never end, or -1. A rank that has left is
   at no barrier of its world, so one that is gone keeps every barrier there from opening. */
static int pr__wait_lost(const pr__wait *x) {
    if (x->kind != PR__AT_BARRIER) return pr__rank_gone(x->w, x->peer) ? x->peer : -1;
    for (int r = 0; r < x->w->size; r++)
        if (pr__rank_gone(x->w, r)) return r;
    return -1;
}
/* Every thread of the run that has not returned waits, and none of the waits can end or fail:
   nothing that any thread could do would wake one. */
static int pr__run_stuck(const pr__run *run) {
    if (run->waiting + run->done < run->threads) return 0;
    for (int t = 0; t < run->threads; t++) {
        const pr__wait *x = &run->wait[t];
        if (x->kind == PR__DONE) continue;
        if (x->kind == PR__RUNNING || pr__wait_over(x) || pr__wait_lost(x) >= 0) return 0;
    }
    return 1;
}

/* A raised failure as the ring keeps it: its hash shifted up, its echo flag in the low bit. */
static uint64_t pr__raised_entry(pr_status st, const char *message, int echo) {
    const unsigned char status = (unsigned char)st;
    const uint64_t h = pr__fnv1a64(&status, 1) ^ pr__fnv1a64((const unsigned char *)message, strlen(message));
    return h << 1 | (uint64_t)(echo != 0);
}
/* The echo flag of the failure a thread returned (st, message) where it is one of the latest the
   communicator raised on it; -1 where it is none of them. */
static int pr__raised_lately(const pr__run *run, int t, pr_status st, const char *message) {
    const uint64_t h = pr__raised_entry(st, message, 0);
    const unsigned n = run->raised_n[t] < PR__RAISED_KEPT ? run->raised_n[t] : PR__RAISED_KEPT;
    for (unsigned i = 0; i < n; i++) {
        const uint64_t e = run->raised[(size_t)t * PR__RAISED_KEPT + i];
        if ((e | 1) == (h | 1)) return (int)(e & 1);
    }
    return -1;
}
/* A failure the communicator raises (a rank gone, every thread waiting, calls that differ; echo:
   one that passes on another rank's). The thread's first is kept, and the latest few hashed, so
   that pr_comm_local_run can tell them from the failure that caused them. */
static pr_status pr__comm_fail(const pr__local *l, pr_error *err, const pr_error *e, int echo) {
    pr__run *run = l->w->run;                          /* its own thread's entries: no lock */
    pr_error *said = &run->said[l->thread];
    if (!said->status) {
        *said = *e;
        run->echo[l->thread] = (unsigned char)echo;
    }
    run->raised[(size_t)l->thread * PR__RAISED_KEPT + run->raised_n[l->thread] % PR__RAISED_KEPT] = pr__raised_entry(e->status, e->message, echo);
    run->raised_n[l->thread]++;
    if (err) *err = *e;
    return e->status;
}

/* Waits, with the run's lock held, until x's condition holds; fails instead when it cannot. */
static pr_status pr__wait_for(const pr__local *l, pr__wait x, pr_error *err) {
    pr__run *run = l->w->run;
    pr__wait *me = &run->wait[l->thread];
    *me = x;
    run->waiting++;
    pr_error e;
    e.status = PR_OK;
    int lost = -1;
    while (!pr__wait_over(me)) {
        lost = pr__wait_lost(me);
        if (lost >= 0) {
            pr__fail(&e, PR_ERR_ARG, "%s: rank %d has left the communicator", x.what, x.w->thread[lost]);
            break;
        }
        if (pr__run_stuck(run)) {
            int at = snprintf(e.message, sizeof e.message, "%s: every rank waits for another, so none can go on (a rank skipped, "
                              "added or reordered a call):", x.what);
            for (int t = 0; t < run->threads && at > 0 && (size_t)at < sizeof e.message; t++) {
                const pr__wait *y = &run->wait[t];
                if (y->kind == PR__DONE) continue;
                if (y->kind == PR__AT_BARRIER)
                    at += snprintf(e.message + at, sizeof e.message - (size_t)at, " rank %d in %s;", t, y->what);
                else
                    at += snprintf(e.message + at, sizeof e.message - (size_t)at, " rank %d in %s %s rank %d;", t, y->what,
                                   y->kind == PR__BOX_FULL ? "from" : "to", y->w->thread[y->peer]);
            }
            e.status = PR_ERR_ARG;
            break;
        }
        pr__run_sleep(run);
    }
    me->kind = PR__RUNNING;
    run->waiting--;
    /* a peer that left failing is its own failure's echo here; one that returned fine skipped the call */
    return e.status ? pr__comm_fail(l, err, &e, lost >= 0 && !run->returned_ok[x.w->thread[lost]]) : PR_OK;
}

static void pr__barrier_open(pr__world *w) {
    w->arrived = 0;
    w->gen++;
    pr__run_wake(w->run);
}
/* A collective's second half, after its meeting: every rank is inside the same call and comes
   here without waiting on anything else, so this barrier cannot fail. */
static void pr__world_sync(pr__world *w) {
    pr__mtx_lock(&w->run->mu);
    const unsigned gen = w->gen;
    if (++w->arrived == w->size)
        pr__barrier_open(w);
    else
        while (gen == w->gen) pr__run_sleep(w->run);
    pr__mtx_unlock(&w->run->mu);
}
/* A collective's meeting: the rank publishes its buffer and its call, waits for every rank and
   checks that all made the same call. After it, each rank reads the others' slots and then
   calls pr__world_sync; on calls that differ the ranks sync here and fail alike. */
static pr_status pr__meet(pr_comm *c, const char *op, const void *slot, size_t n, pr_comm_type t, int ready, pr_error *err) {
    pr__local *l = (pr__local *)c;
    pr__world *w = l->w;
    pr__mtx_lock(&w->run->mu);
    w->slot[c->rank] = slot;
    w->call[c->rank].op = op;
    w->call[c->rank].n = n;
    w->call[c->rank].type = t;
    w->call[c->rank].seq = l->meetings++;
    w->call[c->rank].ready = ready;
    pr_status st = PR_OK;
    if (++w->arrived == w->size) {
        pr__barrier_open(w);
    } else {
        pr__wait x = { PR__AT_BARRIER, w, w->gen, 0, -1, op };
        if ((st = pr__wait_for(l, x, err))) w->arrived--;      /* it leaves the barrier it could not pass */
    }
    pr__mtx_unlock(&w->run->mu);
    if (st) return st;
    static const char *type_name[] = { "f32", "f64", "bf16" };
    const pr__call *a = &w->call[0];
    for (int r = 1; r < w->size && !st; r++) {
        const pr__call *b = &w->call[r];
        if (strcmp(a->op, b->op) || a->n != b->n || a->type != b->type || a->seq != b->seq) {
            pr_error e;
            pr__fail(&e, PR_ERR_ARG,
                     "%s: the ranks' calls differ: rank %d %s of %zu %s (its call %lu on this communicator), rank %d %s of %zu %s (its call %lu)",
                     op, w->thread[0], a->op, a->n, type_name[a->type], a->seq + 1, w->thread[r], b->op, b->n, type_name[b->type],
                     b->seq + 1);
            st = pr__comm_fail(l, err, &e, 0);
        }
    }
    for (int r = 0; r < w->size && !st; r++) {
        if (w->call[r].ready) continue;
        if (r == c->rank) st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory on this rank", op);
        else {                                /* the peers' failure is the communicator's, not their own */
            pr_error e;
            pr__fail(&e, PR_ERR_NOMEM, "%s: rank %d is out of memory: every rank fails the call", op, w->thread[r]);
            st = pr__comm_fail(l, err, &e, 1);
        }
    }
    if (st) pr__world_sync(w);
    return st;
}

static pr_status pr__comm_check(pr_comm *c, size_t n, pr_comm_type t, size_t blocks, pr_error *err) {
    size_t bytes;
    if (t != PR_COMM_F32 && t != PR_COMM_F64 && t != PR_COMM_BF16) return pr__fail(err, PR_ERR_ARG, "communicator: unknown type %d", (int)t);
    if (!pr__mul_size(n, pr__comm_elem(t), &bytes) || !pr__mul_size(bytes, blocks, &bytes))
        return pr__fail(err, PR_ERR_ARG, "communicator: %zu x %zu elements overflow", blocks, n);
    (void)c;
    return PR_OK;
}

/* out[i] = sum over ranks r (in order) of block `blk` of rank r's published buffer, in acc (n) */
static void pr__comm_sum(pr__world *w, void *out, size_t n, pr_comm_type t, size_t blk, double *acc) {
    for (size_t i = 0; i < n; i++) acc[i] = 0;
    for (int r = 0; r < w->size; r++)
        for (size_t i = 0; i < n; i++) {
            double x = pr__comm_get(w->slot[r], blk * n + i, t);
            /* the sum rounds to the type after every add, as a ring of the type would */
            acc[i] = t == PR_COMM_F64 ? acc[i] + x : t == PR_COMM_F32 ? (double)(float)(acc[i] + x)
                                                                     : (double)pr_bf16_to_f32(pr_f32_to_bf16((float)(acc[i] + x)));
        }
    for (size_t i = 0; i < n; i++) pr__comm_put(out, i, t, acc[i]);
}
/* The scratch of a sum over n elements: its accumulator, then `extra` bytes (NULL: out of memory). */
static double *pr__comm_sum_scratch(size_t n, size_t extra) {
    size_t bytes;
    if (!pr__mul_size(n, sizeof(double), &bytes) || bytes + extra < bytes) return NULL;
    return (double *)PR_MALLOC(bytes + extra ? bytes + extra : 1);
}

static pr_status pr__local_all_reduce(pr_comm *c, void *buf, size_t n, pr_comm_type t, pr_error *err) {
    pr_status st = pr__comm_check(c, n, t, 1, err);
    if (st) return st;
    pr__world *w = pr__lw(c);
    const size_t bytes = n * pr__comm_elem(t);
    double *acc = pr__comm_sum_scratch(n, bytes);            /* the sum is written aside: the peers read buf until all are done */
    if (!(st = pr__meet(c, "all_reduce", buf, n, t, acc != NULL, err))) {
        void *sum = acc + n;
        pr__comm_sum(w, sum, n, t, 0, acc);
        pr__world_sync(w);                    /* every rank has read every buffer */
        memcpy(buf, sum, bytes);
        if (c->size > 1) c->bytes_sent += bytes;    /* alone, a rank sends nothing */
    }
    PR_FREE(acc);
    return st;
}
static pr_status pr__local_all_gather(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type t, pr_error *err) {
    pr_status st = pr__comm_check(c, n, t, (size_t)c->size, err);
    if (st || (st = pr__meet(c, "all_gather", in, n, t, 1, err))) return st;
    pr__world *w = pr__lw(c);
    size_t bytes = n * pr__comm_elem(t);
    for (int r = 0; r < w->size; r++) memcpy((char *)out + (size_t)r * bytes, w->slot[r], bytes);
    pr__world_sync(w);
    if (c->size > 1) c->bytes_sent += bytes;    /* alone, a rank sends nothing */
    return PR_OK;
}
static pr_status pr__local_reduce_scatter(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type t, pr_error *err) {
    pr_status st = pr__comm_check(c, n, t, (size_t)c->size, err);
    if (st) return st;
    double *acc = pr__comm_sum_scratch(n, 0);
    if (!(st = pr__meet(c, "reduce_scatter", in, n, t, acc != NULL, err))) {
        pr__world *w = pr__lw(c);
        pr__comm_sum(w, out, n, t, (size_t)c->rank, acc);
        pr__world_sync(w);
        c->bytes_sent += n * pr__comm_elem(t) * (size_t)(c->size - 1);
    }
    PR_FREE(acc);
    return st;
}
static pr_status pr__local_all_to_all(pr_comm *c, void *out, const void *in, size_t n, pr_comm_type t, pr_error *err) {
    pr_status st = pr__comm_check(c, n, t, (size_t)c->size, err);
    if (st || (st = pr__meet(c, "all_to_all", in, n, t, 1, err))) return st;
    pr__world *w = pr__lw(c);
    size_t bytes = n * pr__comm_elem(t);
    for (int r = 0; r < w->size; r++)
        memcpy((char *)out + (size_t)r * bytes, (const char *)w->slot[r] + (size_t)c->rank * bytes, bytes);
    pr__world_sync(w);
    c->bytes_sent += bytes * (size_t)(c->size - 1);
    return PR_OK;
}
/* A rendezvous: the sender posts its buffer, then waits until the receiver has copied it. */
static pr_status pr__local_peer(pr_comm *c, size_t n, pr_comm_type t, int peer, const char *what, pr_error *err) {
    pr_status st = pr__comm_check(c, n, t, 1, err);
    if (!st && (peer < 0 || peer >= c->size || peer == c->rank))
        st = pr__fail(err, PR_ERR_ARG, "%s: peer %d is not another rank of %d", what, peer, c->size);
    return st;
}
static size_t pr__box(const pr_comm *c, int from, int to) { return (size_t)from * (size_t)c->size + (size_t)to; }
/* Takes the run's lock and waits until a mailbox is empty or full (kind); the lock stays held. */
static pr_status pr__box_wait(const pr__local *l, int kind, size_t box, int peer, const char *what, pr_error *err) {
    pr__mtx_lock(&l->w->run->mu);
    pr__wait x = { kind, l->w, 0, box, peer, what };
    return pr__wait_for(l, x, err);
}
static pr_status pr__local_post(pr_comm *c, const void *buf, size_t n, pr_comm_type t, int peer, const char *what, pr_error *err) {
    const pr__local *l = (const pr__local *)c;
    pr__world *w = l->w;
    const size_t box = pr__box(c, c->rank, peer);
    pr_status st = pr__box_wait(l, PR__BOX_EMPTY, box, peer, what, err);
    if (!st) {
        w->mail[box] = buf;
        w->mail_bytes[box] = n * pr__comm_elem(t);
        w->mail_full[box] = 1;
        pr__run_wake(w->run);
    }
    pr__mtx_unlock(&w->run->mu);
    if (!st) c->bytes_sent += n * pr__comm_elem(t);
    return st;
}
static pr_status pr__local_wait_taken(pr_comm *c, int peer, const char *what, pr_error *err) {
    const pr__local *l = (const pr__local *)c;
    pr__world *w = l->w;
    const size_t box = pr__box(c, c->rank, peer);
    pr_status st = pr__box_wait(l, PR__BOX_EMPTY, box, peer, what, err);
    if (st) w->mail_full[box] = 0;            /* withdrawn: the caller's buffer is its own again */
    pr__mtx_unlock(&w->run->mu);
    return st;
}
static pr_status pr__local_take(pr_comm *c, void *buf, size_t n, pr_comm_type t, int peer, const char *what, pr_error *err) {
    const pr__local *l = (const pr__local *)c;
    pr__world *w = l->w;
    const size_t box = pr__box(c, peer, c->rank), bytes = n * pr__comm_elem(t);
    pr_status st = pr__box_wait(l, PR__BOX_FULL, box, peer, what, err);
    size_t got = bytes;
    if (!st) {
        got = w->mail_bytes[box];
        if (got == bytes) memcpy(buf, w->mail[box], bytes);
        w->mail_full[box] = 0;                /* the sender goes on either way: no rank is left waiting */
        pr__run_wake(w->run);
    }
    pr__mtx_unlock(&w->run->mu);
    if (!st && got != bytes) {
        pr_error e;
        pr__fail(&e, PR_ERR_ARG, "%s: rank %d sent %zu bytes, %zu expected", what, w->thread[peer], got, bytes);
        st = pr__comm_fail(l, err, &e, 0);
    }
    return st;
}
static pr_status pr__local_send(pr_comm *c, const void *buf, size_t n, pr_comm_type t, int peer, pr_error *err) {
    pr_status st = pr__local_peer(c, n, t, peer, "send", err);
    if (!st) st = pr__local_post(c, buf, n, t, peer, "send", err);
    return st ? st : pr__local_wait_taken(c, peer, "send", err);
}
static pr_status pr__local_recv(pr_comm *c, void *buf, size_t n, pr_comm_type t, int peer, pr_error *err) {
    pr_status st = pr__local_peer(c, n, t, peer, "recv", err);
    return st ? st : pr__local_take(c, buf, n, t, peer, "recv", err);
}
static pr_status pr__local_send_recv(pr_comm *c, const void *send, size_t n_send, int to, void *recv, size_t n_recv, int from,
                                     pr_comm_type t, pr_error *err) {
    pr_status st = pr__local_peer(c, n_send, t, to, "send_recv", err);
    if (!st) st = pr__local_peer(c, n_recv, t, from, "send_recv", err);
    if (!st) st = pr__local_post(c, send, n_send, t, to, "send_recv", err);
    if (st) return st;
    st = pr__local_take(c, recv, n_recv, t, from, "send_recv", err);
    pr_status sent = pr__local_wait_taken(c, to, "send_recv", st ? NULL : err);
    return st ? st : sent;
}
static pr_status pr__local_barrier(pr_comm *c, pr_error *err) {
    pr_status st = pr__meet(c, "barrier", NULL, 0, PR_COMM_F64, 1, err);
    if (!st) pr__world_sync(pr__lw(c));
    return st;
}

static pr_comm *pr__local_comm_new(pr__world *w, int rank, int thread);
static void pr__local_destroy(pr_comm *c) {
    if (!c) return;
    pr__world_leave(pr__lw(c), c->rank);
    PR_FREE(c);
}
/* A failure a peer told this rank over c, as the communicator's own are kept: pr_comm_local_run
   then reports the rank whose failure it was, not the ranks that were told. */
static void pr__comm_told(pr_comm *c, const pr_error *e) {
    if (c->destroy == pr__local_destroy) {
        pr_error tmp;
        pr__comm_fail((const pr__local *)c->ctx, &tmp, e, 1);
    }
}

static pr_status pr__local_split(pr_comm *c, int color, int key, pr_comm **sub, pr_error *err) {
    const pr__local *l = (const pr__local *)c;
    pr__world *w = l->w;
    w->color[c->rank] = color;
    w->key[c->rank] = key;
    pr_status st = pr__meet(c, "split", NULL, 0, PR_COMM_F64, 1, err);
    if (st) return st;
    /* my group, in (key, rank) order: my rank in it, its size, its leader */
    int size = 0, me = 0, leader = -1;
    for (int r = 0; r < w->size; r++) {
        if (w->color[r] != color) continue;
        if (leader < 0 || w->key[r] < w->key[leader] || (w->key[r] == w->key[leader] && r < leader)) leader = r;
        size++;
        if (w->key[r] < key || (w->key[r] == key && r < c->rank)) me++;
    }
    w->made[c->rank] = NULL;
    if (c->rank == leader) w->made[c->rank] = pr__world_new(size, w->run);
    pr__world_sync(w);
    pr__world *nw = w->made[leader];
    pr_comm *nc = nw ? pr__local_comm_new(nw, me, l->thread) : NULL;
    if (nw) nw->thread[me] = l->thread;
    /* every member has taken the leader's world; a rank without its communicator fails them all */
    if ((st = pr__meet(c, "split", NULL, 0, PR_COMM_F64, nc != NULL, err))) {
        if (nc) pr__local_destroy(nc);
        else if (nw) pr__world_leave(nw, me);
        return st;
    }
    pr__world_sync(w);
    *sub = nc;
    return PR_OK;
}

static pr_comm *pr__local_comm_new(pr__world *w, int rank, int thread) {
    pr__local *l = (pr__local *)PR_MALLOC(sizeof *l);
    if (!l) return NULL;
    memset(l, 0, sizeof *l);
    l->w = w;
    l->thread = thread;
    pr_comm *c = &l->c;
    c->rank = rank;
    c->size = w->size;
    c->name = "in-process";
    c->ctx = l;
    c->all_reduce = pr__local_all_reduce;
    c->all_gather = pr__local_all_gather;
    c->reduce_scatter = pr__local_reduce_scatter;
    c->all_to_all = pr__local_all_to_all;
    c->send = pr__local_send;
    c->recv = pr__local_recv;
    c->send_recv = pr__local_send_recv;
    c->barrier = pr__local_barrier;
    c->split = pr__local_split;
    c->destroy = pr__local_destroy;
    return c;
}

typedef struct {
    pr_comm *comm;
    pr_status (*fn)(pr_comm *, void *, pr_error *);
    void *user;
    pr_status st;
    pr_error err;
} pr__rank_run;

/* A rank starts only once every rank's thread exists: otherwise its first collective could wait
   for a rank that never comes. When it returns, waits for it end. */
static pr__thrd_result pr__rank_main(void *arg) {
    pr__rank_run *r = (pr__rank_run *)arg;
    const pr__local *l = (const pr__local *)r->comm;
    pr__run *run = l->w->run;
    pr__mtx_lock(&run->mu);
    while (run->gate == 0) pr__run_sleep(run);
    int go = run->gate > 0;
    pr__mtx_unlock(&run->mu);
    r->err.status = PR_OK;
    r->err.message[0] = 0;
    r->st = go ? r->fn(r->comm, r->user, &r->err) : PR_OK;
    pr__mtx_lock(&run->mu);
    run->wait[l->thread].kind = PR__DONE;
    run->returned_ok[l->thread] = r->st == PR_OK;
    run->done++;
    pr__run_wake(run);
    pr__mtx_unlock(&run->mu);
    return 0;
}

static pr__run *pr__run_new(int threads) {
    pr__run *run = (pr__run *)PR_MALLOC(sizeof *run);
    if (!run) return NULL;
    memset(run, 0, sizeof *run);
    run->threads = threads;
    run->refs = 1;
    run->wait = (pr__wait *)PR_MALLOC(sizeof(pr__wait) * (size_t)threads);
    run->said = (pr_error *)PR_MALLOC(sizeof(pr_error) * (size_t)threads);
    run->raised = (uint64_t *)PR_MALLOC(sizeof(uint64_t) * PR__RAISED_KEPT * (size_t)threads);
    run->raised_n = (unsigned *)PR_MALLOC(sizeof(unsigned) * (size_t)threads);
    run->echo = (unsigned char *)PR_MALLOC(2 * (size_t)threads);
    run->returned_ok = run->echo ? run->echo + threads : NULL;
    int mu = run->wait && run->said && run->raised && run->raised_n && run->echo && pr__mtx_init(&run->mu);
    if (!mu || !pr__cnd_init(&run->cv)) {
        if (mu) pr__mtx_destroy(&run->mu);
        pr__run_free_memory(run);
        return NULL;
    }
    memset(run->wait, 0, sizeof(pr__wait) * (size_t)threads);       /* PR__RUNNING */
    memset(run->said, 0, sizeof(pr_error) * (size_t)threads);       /* PR_OK */
    memset(run->raised_n, 0, sizeof(unsigned) * (size_t)threads);
    memset(run->echo, 0, 2 * (size_t)threads);
    return run;
}

PRDEF pr_status pr_comm_local_run(int n, pr_status (*fn)(pr_comm *comm, void *user, pr_error *err), void *user,
                                  pr_error *err) {
    if (n < 1 || n > 4096 || !fn) return pr__fail(err, PR_ERR_ARG, "pr_comm_local_run: %d ranks (1..4096), fn %s", n, fn ? "set" : "NULL");
    pr__run *run = pr__run_new(n);
    pr__world *w = run ? pr__world_new(n, run) : NULL;
    pr__rank_run *runs = (pr__rank_run *)PR_MALLOC(sizeof(pr__rank_run) * (size_t)n);
    pr__thrd *th = (pr__thrd *)PR_MALLOC(sizeof(pr__thrd) * (size_t)n);
    int made = 0;
    if (w && runs && th) {
        memset(runs, 0, sizeof(pr__rank_run) * (size_t)n);
        for (; made < n; made++)
            if (!(runs[made].comm = pr__local_comm_new(w, made, made))) break;
    }
    if (!w || !runs || !th || made < n) {
        for (int r = 0; r < made; r++) PR_FREE(runs[r].comm);
        if (w) pr__world_free(w);             /* no thread ever ran: nothing else holds either */
        if (run) pr__run_free(run);
        PR_FREE(runs);
        PR_FREE(th);
        return pr__fail(err, PR_ERR_NOMEM, "pr_comm_local_run: out of memory for %d ranks", n);
    }
    int started = 0;
    for (; started < n; started++) {
        runs[started].fn = fn;
        runs[started].user = user;
        if (!pr__thrd_create(&th[started], pr__rank_main, &runs[started])) break;
    }
    pr__mtx_lock(&run->mu);
    run->gate = started == n ? 1 : -1;
    pr__run_wake(run);
    pr__mtx_unlock(&run->mu);
    for (int r = 0; r < started; r++) pr__thrd_join(th[r]);
    pr_status st = started < n ? pr__fail(err, PR_ERR_NOMEM, "pr_comm_local_run: could not start %d threads", n) : PR_OK;
    /* The failing rank to report: the first whose failure is its own, not one the communicator
       raised on it because a peer had failed and left the collective it waited in: surely so where
       the communicator failed none of its calls (untold), else where it returned none of the
       failures the communicator raised on it (neither its first nor one of the latest: a rank goes
       on to its step's other collectives after one, and may return a later one's); else the first
       that returned the fault the communicator found in the calls (it names them), not one that
       was told. */
    int first = -1, untold = -1, cause = -1, found = -1;
    for (int r = 0; r < n && !st; r++) {
        if (!runs[r].st) continue;
        if (first < 0) first = r;
        const int first_raised = runs[r].st == run->said[r].status && !strcmp(runs[r].err.message, run->said[r].message);
        const int lately = pr__raised_lately(run, r, runs[r].st, runs[r].err.message);
        const int raised = first_raised || lately >= 0;
        if (untold < 0 && !run->said[r].status) untold = r;
        if (cause < 0 && !raised) cause = r;
        if (found < 0 && ((first_raised && !run->echo[r]) || lately == 0)) found = r;
    }
    if (first >= 0) {
        const int r = untold >= 0 ? untold : cause >= 0 ? cause : found >= 0 ? found : first;
        st = pr__fail(err, runs[r].st, "rank %d: %s", r, runs[r].err.message);
    }
    for (int r = 0; r < n; r++) runs[r].comm->destroy(runs[r].comm);
    pr__mtx_lock(&run->mu);
    pr__run_unlock_release(run);              /* freed here unless fn kept a split communicator */
    PR_FREE(runs);
    PR_FREE(th);
    return st;
}
#else
static void pr__comm_told(pr_comm *c, const pr_error *e) {
    (void)c;
    (void)e;
}
#endif /* PR_NO_THREADS */


/* ================================================================ 8. FILE FORMATS */
/* ---------------------------------------------------------------- 8.1 Platform i/o */
#include <errno.h>
#include <limits.h>
#include <locale.h>
#include <sys/types.h>
#include <sys/stat.h>
#if defined(_WIN32)
#include <direct.h>
#include <fcntl.h>
#include <io.h>
#include <process.h>
#else
#include <fcntl.h>
#include <unistd.h>
#endif

/* Strict ISO modes (gcc -std=c99) hide fseeko and fileno even on POSIX systems, so the code below
   uses only what stays visible there (stat, open, fsync, mkdir, getpid) and falls back to fseek
   with a long offset, which is 64-bit on every LP64 system, when fseeko is hidden. */
#if !defined(_WIN32) && ((defined(_POSIX_C_SOURCE) && _POSIX_C_SOURCE >= 200112L) || defined(__APPLE__))
#define PR__HAVE_FSEEKO 1
#endif

static int pr__io_seek(FILE *f, uint64_t off) {
#if defined(_WIN32)
    if (off > (uint64_t)INT64_MAX) return 0;
    return _fseeki64(f, (__int64)off, SEEK_SET) == 0;
#elif defined(PR__HAVE_FSEEKO)
    /* off_t is 32-bit on 32-bit systems built without _FILE_OFFSET_BITS=64 */
    if (sizeof(off_t) < 8 && off > 0x7fffffffu) return 0;
    if (off > (uint64_t)INT64_MAX) return 0;
    return fseeko(f, (off_t)off, SEEK_SET) == 0;
#else
    if (off > (uint64_t)LONG_MAX) return 0;
    return fseek(f, (long)off, SEEK_SET) == 0;
#endif
}

/* Returns 1 and fills size/is_dir when path exists. */
static int pr__io_stat(const char *path, uint64_t *size, int *is_dir) {
#if defined(_WIN32)
    struct __stat64 s;
    if (_stat64(path, &s) != 0) return 0;
    *is_dir = (s.st_mode & _S_IFDIR) != 0;
#else
    struct stat s;
    if (stat(path, &s) != 0) return 0;
    *is_dir = S_ISDIR(s.st_mode) ? 1 : 0;
#endif
    *size = s.st_size < 0 ? 0 : (uint64_t)s.st_size;
    return 1;
}

/* Flush a closed file's data to the disk before it is renamed into place, so that a crash cannot
   leave a renamed but empty file. fsync through a fresh descriptor: stdio's is hidden in strict ISO
   mode, and POSIX syncs the file, not the descriptor. */
static int pr__io_sync_path(const char *path) {
#if defined(_WIN32)
    int fd = _open(path, _O_RDWR | _O_BINARY);
    if (fd < 0) return 0;
    int ok = _commit(fd) == 0;
    _close(fd);
    return ok;
#else
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    int ok = fsync(fd) == 0;
    close(fd);
    return ok;
#endif
}

/* Best effort: make the rename of `path` durable by syncing its folder. Some file systems refuse
   fsync on folders; that is fine. No allocation, so that it cannot fail after the file is in place. */
static void pr__io_sync_parent(const char *path) {
#if !defined(_WIN32)
    char dir[4096];
    const char *slash = strrchr(path, '/');
    size_t n = !slash ? 1 : slash == path ? 1 : (size_t)(slash - path);
    if (n >= sizeof dir) return;
    memcpy(dir, slash ? path : ".", n);
    dir[n] = 0;
    int fd = open(dir, O_RDONLY);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
#else
    (void)path;
#endif
}

static int pr__io_rename(const char *from, const char *to) {
#if defined(_WIN32)
    remove(to); /* Windows rename does not replace; the window without `to` is the price of C's API */
#endif
    return rename(from, to) == 0;
}

static int pr__io_mkdir(const char *path) {
#if defined(_WIN32)
    return _mkdir(path) == 0 || errno == EEXIST;
#else
    return mkdir(path, 0777) == 0 || errno == EEXIST;
#endif
}

static long pr__io_pid(void) {
#if defined(_WIN32)
    return (long)_getpid();
#else
    return (long)getpid();
#endif
}

/* ---------------------------------------------------------------- 8.2 Small helpers */
static int pr__u64_mul(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

static int pr__u64_add(uint64_t a, uint64_t b, uint64_t *out) {
    if (b > UINT64_MAX - a) return 0;
    *out = a + b;
    return 1;
}

/* "dir/name" in a fresh allocation (NULL when out of memory). */
static char *pr__path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    int slash = a > 0 && dir[a - 1] != '/' && dir[a - 1] != '\\';
    if (a > SIZE_MAX - b - 2) return NULL;
    char *p = (char *)PR_MALLOC(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    if (slash) p[a++] = '/';
    memcpy(p + a, name, b + 1);
    return p;
}

static char *pr__strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = (char *)PR_MALLOC(n);
    if (p) memcpy(p, s, n);
    return p;
}

/* The folder part of a file path ("." when there is none). */
static char *pr__path_dir(const char *path) {
    const char *slash = strrchr(path, '/');
#if defined(_WIN32)
    const char *bs = strrchr(path, '\\');
    if (bs && (!slash || bs > slash)) slash = bs;
#endif
    if (!slash) return pr__strdup(".");
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    char *p = (char *)PR_MALLOC(n + 1);
    if (!p) return NULL;
    memcpy(p, path, n);
    p[n] = 0;
    return p;
}

/* A growing byte buffer. Allocation failures latch `failed`, so that writers can append freely and
   check once at the end. */
typedef struct {
    char *p;
    size_t len, cap;
    int failed;
} pr__buf;

static void pr__buf_add(pr__buf *b, const void *data, size_t n) {
    if (b->failed) return;
    if (n > SIZE_MAX - b->len - 1) { b->failed = 1; return; }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) {
            if (cap > SIZE_MAX / 2) { cap = b->len + n + 1; break; }
            cap *= 2;
        }
        char *q = (char *)PR_REALLOC(b->p, cap);
        if (!q) { b->failed = 1; return; }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0; /* always a C string, for snprintf-free inspection */
}

static void pr__buf_str(pr__buf *b, const char *s) { pr__buf_add(b, s, strlen(s)); }

static void pr__buf_u64(pr__buf *b, uint64_t v) {
    char tmp[24];
    int i = (int)sizeof tmp;
    do { tmp[--i] = (char)('0' + v % 10); v /= 10; } while (v);
    pr__buf_add(b, tmp + i, sizeof tmp - (size_t)i);
}

static void pr__buf_i64(pr__buf *b, int64_t v) {
    if (v < 0) {
        pr__buf_add(b, "-", 1);
        pr__buf_u64(b, (uint64_t)(-(v + 1)) + 1); /* no overflow at INT64_MIN */
    } else {
        pr__buf_u64(b, (uint64_t)v);
    }
}

/* A JSON string literal: quotes, backslash and control characters escaped; other bytes as is. */
static void pr__buf_json_str(pr__buf *b, const char *s, size_t n) {
    static const char hex[] = "0123456789abcdef";
    pr__buf_add(b, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        pr__buf_add(b, s + run, i - run);
        run = i + 1;
        char esc[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
        if (c == '"' || c == '\\') { esc[1] = (char)c; pr__buf_add(b, esc, 2); }
        else if (c == '\n') pr__buf_add(b, "\\n", 2);
        else if (c == '\t') pr__buf_add(b, "\\t", 2);
        else if (c == '\r') pr__buf_add(b, "\\r", 2);
        else pr__buf_add(b, esc, 6);
    }
    pr__buf_add(b, s + run, n - run);
    pr__buf_add(b, "\"", 1);
}

/* strtod on C-locale text. strtod follows LC_NUMERIC, so in a host program that switched to a
   locale with a decimal comma, "1.5" would stop at the '.'; retry with the locale's separator. */
static double pr__strtod_c(const char *s) {
    char *end;
    double v = strtod(s, &end);
    if (*end == 0) return v;
    const char *dp = localeconv()->decimal_point;
    size_t dpn = dp ? strlen(dp) : 0, n = strlen(s);
    if (dpn == 0 || dpn > 8 || n > 400) return v;
    char tmp[480];
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '.') { memcpy(tmp + j, dp, dpn); j += dpn; }
        else tmp[j++] = s[i];
    }
    tmp[j] = 0;
    return strtod(tmp, NULL);
}

/* The shortest of %.15g/%.16g/%.17g that reads back to exactly v, always with a '.' (never the
   locale's comma) and with ".0" added to integral values so that Python reads a float back. */
static void pr__fmt_double(char out[40], double v) {
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(out, 40, "%.*g", prec, v);
        /* %g writes the locale's decimal separator; JSON needs '.' */
        const char *dp = localeconv()->decimal_point;
        char *at = dp && dp[0] && strcmp(dp, ".") != 0 ? strstr(out, dp) : NULL;
        if (at) {
            size_t k = strlen(dp);
            *at = '.';
            memmove(at + 1, at + k, strlen(at + k) + 1);
        }
        if (pr__strtod_c(out) == v) break;
    }
    if (!strchr(out, '.') && !strchr(out, 'e') && !strchr(out, 'n') && !strchr(out, 'i')) strcat(out, ".0");
}

/* ---------------------------------------------------------------- 8.3 Number formats */
/* Conversions between float and the 16-bit formats, all round-to-nearest-even, NaN kept NaN. */
PRDEF float pr_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t pr__f32bits_to_bf16(uint32_t u) {
    /* NaN: keep sign and top payload, force the quiet bit so that truncation cannot turn it into inf */
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1); /* ties to even; carries into the exponent give inf on overflow */
    return (uint16_t)(u >> 16);
}

PRDEF uint16_t pr_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return pr__f32bits_to_bf16(u);
}

PRDEF float pr_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);   /* inf, NaN (payload kept) */
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13); /* rebias 15 -> 127 */
    else if (!man) u = sign;                                  /* +-0 */
    else {                                                    /* subnormal: man * 2^-24, normalise */
        exp = 113;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t pr__f32bits_to_f16(uint32_t u) {
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* quiet NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (a >= 0x38800000u) {                                   /* a normal half (>= 2^-14) */
        uint32_t r = a - 0x38000000u;                         /* rebias 127 -> 15 */
        r += 0xfffu + ((r >> 13) & 1);
        return (uint16_t)(sign | (r >> 13));
    }
    uint32_t e = a >> 23;                                     /* below 2^-14: a half subnormal */
    if (e < 102) return sign;                                 /* below 2^-25: rounds to zero */
    uint32_t m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e; /* value = m * 2^(e-150), units 2^-24 */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;          /* q == 0x400 is the smallest normal */
    return (uint16_t)(sign | q);
}

PRDEF uint16_t pr_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return pr__f32bits_to_f16(u);
}

/* The float bits of a pr_real for a later 16-bit rounding. From double, round to odd: a plain
   double->float->16-bit rounding rounds twice and can land on the wrong side of a tie
   (1 + 2^-8 + 2^-30 would become 1 in bf16). Truncating and setting the last bit when inexact
   keeps enough information for the second rounding to be correct. */
static uint32_t pr__real_to_f32bits_odd(pr_real x) {
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    double d = (double)x;
    if (d == d && (double)f != d) {
        if (fabs((double)f) > fabs(d)) u -= 1; /* step toward zero: the bits are sign-magnitude */
        u |= 1;
    }
    return u;
}

static uint32_t pr__get_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t pr__get_u64(const unsigned char *p) { return (uint64_t)pr__get_u32(p) | (uint64_t)pr__get_u32(p + 4) << 32; }
static float pr__get_f32(const unsigned char *p) {   /* IEEE binary32, little-endian */
    uint32_t u = pr__get_u32(p);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
typedef char pr__f32_is_4_bytes[sizeof(float) == 4 ? 1 : -1];
static void pr__put_u16(unsigned char *p, uint16_t v) { p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); }
static void pr__put_u32(unsigned char *p, uint32_t v) { pr__put_u16(p, (uint16_t)v); pr__put_u16(p + 2, (uint16_t)(v >> 16)); }
static void pr__put_u64(unsigned char *p, uint64_t v) { pr__put_u32(p, (uint32_t)v); pr__put_u32(p + 4, (uint32_t)(v >> 32)); }

/* ---------------------------------------------------------------- 8.4 JSON reader */
/* A parsed document is one allocation: an array of nodes in document order, followed by the
   decoded strings. A container's children follow it; node->skip (the size of its subtree) jumps
   to the next sibling. The text is parsed twice, first to count nodes and string bytes, then to fill
   the exactly sized block, so that no intermediate growth or pointer fixing is needed. */
enum { PR__JSON_NULL, PR__JSON_FALSE, PR__JSON_TRUE, PR__JSON_NUMBER, PR__JSON_STRING, PR__JSON_ARRAY, PR__JSON_OBJECT };
#define PR__JSON_MAX_DEPTH 64
#define PR__JSON_MAX_TEXT ((size_t)0x7fffffff) /* node fields are 32-bit */

typedef struct {
    unsigned char type;
    unsigned char is_int; /* a number written without fraction or exponent that fits int64: ival is exact */
    uint32_t skip;        /* nodes in this subtree, itself included */
    uint32_t count;       /* arrays and objects: children; strings: bytes (may hold \u0000) */
    uint32_t offset;      /* byte offset of the value in the text, for messages */
    uint32_t key_len;
    const char *key;      /* members of an object: the decoded key (NUL-terminated); else NULL */
    const char *str;      /* strings: the decoded value (NUL-terminated) */
    double num;
    int64_t ival;
} pr__json;

typedef struct {
    const unsigned char *s;
    size_t n, pos, base;  /* base: added to offsets in messages (the text's place in its file) */
    pr__json *nodes;      /* NULL in the counting pass */
    size_t n_nodes;
    char *pool;
    size_t n_pool;
    const char *what;
    pr_error *err;
} pr__jp;

static pr_status pr__jp_fail(pr__jp *p, size_t at, const char *msg) {
    if (!p->nodes) /* the filling pass cannot fail where the counting pass did not */
        pr__fail(p->err, PR_ERR_FORMAT, "%s: bad JSON at byte %zu: %s", p->what, p->base + at, msg);
    return PR_ERR_FORMAT;
}

static void pr__jp_ws(pr__jp *p) {
    while (p->pos < p->n) {
        unsigned char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static int pr__jp_hex4(pr__jp *p, size_t at, uint32_t *out) {
    if (at + 4 > p->n) return 0;
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned char c = p->s[at + (size_t)i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* At an opening quote. Decodes into the pool (filling pass) or only measures (counting pass).
   Bytes >= 0x80 pass through unchecked: names are only ever compared byte for byte. */
static pr_status pr__jp_string(pr__jp *p, const char **out, uint32_t *out_len) {
    char *dst = p->nodes ? p->pool + p->n_pool : NULL;
    size_t len = 0, start = p->pos;
    p->pos++;
    for (;;) {
        if (p->pos >= p->n) return pr__jp_fail(p, start, "unterminated string");
        unsigned char c = p->s[p->pos];
        if (c == '"') { p->pos++; break; }
        if (c < 0x20) return pr__jp_fail(p, p->pos, "control character inside a string");
        if (c != '\\') {
            if (dst) dst[len] = (char)c;
            len++;
            p->pos++;
            continue;
        }
        size_t at = p->pos;
        if (at + 1 >= p->n) return pr__jp_fail(p, at, "unterminated escape");
        c = p->s[at + 1];
        p->pos += 2;
        unsigned char one;
        switch (c) {
        case '"': case '\\': case '/': one = c; break;
        case 'b': one = '\b'; break;
        case 'f': one = '\f'; break;
        case 'n': one = '\n'; break;
        case 'r': one = '\r'; break;
        case 't': one = '\t'; break;
        case 'u': {
            uint32_t cp, lo;
            if (!pr__jp_hex4(p, p->pos, &cp)) return pr__jp_fail(p, at, "\\u needs four hex digits");
            p->pos += 4;
            if (cp >= 0xdc00 && cp < 0xe000) return pr__jp_fail(p, at, "lone low surrogate");
            if (cp >= 0xd800 && cp < 0xdc00) { /* a high surrogate needs its low half */
                if (p->pos + 6 > p->n || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u' ||
                    !pr__jp_hex4(p, p->pos + 2, &lo) || lo < 0xdc00 || lo >= 0xe000)
                    return pr__jp_fail(p, at, "high surrogate without a low surrogate");
                p->pos += 6;
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            unsigned char u8[4];
            size_t k;
            if (cp < 0x80) { u8[0] = (unsigned char)cp; k = 1; }
            else if (cp < 0x800) { u8[0] = (unsigned char)(0xc0 | cp >> 6); u8[1] = (unsigned char)(0x80 | (cp & 0x3f)); k = 2; }
            else if (cp < 0x10000) {
                u8[0] = (unsigned char)(0xe0 | cp >> 12); u8[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
                u8[2] = (unsigned char)(0x80 | (cp & 0x3f)); k = 3;
            } else {
                u8[0] = (unsigned char)(0xf0 | cp >> 18); u8[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
                u8[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f)); u8[3] = (unsigned char)(0x80 | (cp & 0x3f)); k = 4;
            }
            /* every encoding is no longer than its escape, so the pool bound (text length) holds */
            if (dst) memcpy(dst + len, u8, k);
            len += k;
            continue;
        }
        default: return pr__jp_fail(p, at, "invalid escape");
        }
        if (dst) dst[len] = (char)one;
        len++;
    }
    if (dst) dst[len] = 0;
    p->n_pool += len + 1;
    *out = dst;
    *out_len = (uint32_t)len;
    return PR_OK;
}

static pr_status pr__jp_number(pr__jp *p, pr__json *node) {
    size_t start = p->pos, n = p->n;
    const unsigned char *s = p->s;
    int is_int = 1;
    if (s[p->pos] == '-') p->pos++;
    if (p->pos >= n || s[p->pos] < '0' || s[p->pos] > '9') return pr__jp_fail(p, start, "bad number");
    if (s[p->pos] == '0') p->pos++;
    else while (p->pos < n && s[p->pos] >= '0' && s[p->pos] <= '9') p->pos++;
    if (p->pos < n && s[p->pos] == '.') {
        is_int = 0;
        p->pos++;
        if (p->pos >= n || s[p->pos] < '0' || s[p->pos] > '9') return pr__jp_fail(p, start, "bad number: no digit after '.'");
        while (p->pos < n && s[p->pos] >= '0' && s[p->pos] <= '9') p->pos++;
    }
    if (p->pos < n && (s[p->pos] == 'e' || s[p->pos] == 'E')) {
        is_int = 0;
        p->pos++;
        if (p->pos < n && (s[p->pos] == '+' || s[p->pos] == '-')) p->pos++;
        if (p->pos >= n || s[p->pos] < '0' || s[p->pos] > '9') return pr__jp_fail(p, start, "bad number: no digit in the exponent");
        while (p->pos < n && s[p->pos] >= '0' && s[p->pos] <= '9') p->pos++;
    }
    size_t len = p->pos - start;
    if (len > 400) return pr__jp_fail(p, start, "number longer than 400 characters");
    if (!node) return PR_OK;
    char buf[408];
    memcpy(buf, s + start, len);
    buf[len] = 0;
    node->num = pr__strtod_c(buf);
    if (is_int) { /* exact integers: offsets and shapes may pass 2^53 */
        int neg = buf[0] == '-';
        uint64_t limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX, v = 0;
        for (const char *c = buf + neg; *c && is_int; c++) {
            uint64_t d = (uint64_t)(*c - '0');
            if (v > (limit - d) / 10) is_int = 0;
            else v = v * 10 + d;
        }
        if (is_int) node->ival = neg ? (v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v) : (int64_t)v;
    }
    node->is_int = (unsigned char)is_int;
    return PR_OK;
}

static int pr__jp_lit(pr__jp *p, const char *word) {
    size_t k = strlen(word);
    if (p->n - p->pos < k || memcmp(p->s + p->pos, word, k) != 0) return 0;
    p->pos += k;
    return 1;
}

static pr_status pr__jp_value(pr__jp *p, int depth, const char *key, uint32_t key_len) {
    pr__jp_ws(p);
    if (p->pos >= p->n) return pr__jp_fail(p, p->pos, "unexpected end of text");
    size_t idx = p->n_nodes++;
    pr__json *node = p->nodes ? &p->nodes[idx] : NULL;
    if (node) {
        memset(node, 0, sizeof *node);
        node->offset = (uint32_t)p->pos;
        node->key = key;
        node->key_len = key_len;
    }
    pr_status st = PR_OK;
    size_t count = 0, at = p->pos;
    unsigned char c = p->s[p->pos];
    unsigned char type;
    if (c == '{' || c == '[') {
        unsigned char close = c == '{' ? '}' : ']';
        type = c == '{' ? PR__JSON_OBJECT : PR__JSON_ARRAY;
        if (depth >= PR__JSON_MAX_DEPTH) return pr__jp_fail(p, at, "nested deeper than 64 levels");
        p->pos++;
        pr__jp_ws(p);
        if (p->pos < p->n && p->s[p->pos] == close) p->pos++;
        else for (;;) {
            const char *k = NULL;
            uint32_t kn = 0;
            if (type == PR__JSON_OBJECT) {
                pr__jp_ws(p);
                if (p->pos >= p->n || p->s[p->pos] != '"') return pr__jp_fail(p, p->pos, "expected a string key");
                if ((st = pr__jp_string(p, &k, &kn)) != PR_OK) return st;
                pr__jp_ws(p);
                if (p->pos >= p->n || p->s[p->pos] != ':') return pr__jp_fail(p, p->pos, "expected ':' after a key");
                p->pos++;
            }
            if ((st = pr__jp_value(p, depth + 1, k, kn)) != PR_OK) return st;
            count++;
            pr__jp_ws(p);
            if (p->pos < p->n && p->s[p->pos] == ',') { p->pos++; continue; }
            if (p->pos < p->n && p->s[p->pos] == close) { p->pos++; break; }
            return pr__jp_fail(p, p->pos, type == PR__JSON_OBJECT ? "expected ',' or '}'" : "expected ',' or ']'");
        }
    } else if (c == '"') {
        const char *s;
        uint32_t n;
        type = PR__JSON_STRING;
        if ((st = pr__jp_string(p, &s, &n)) != PR_OK) return st;
        if (node) node->str = s;
        count = n;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
        type = PR__JSON_NUMBER;
        if ((st = pr__jp_number(p, node)) != PR_OK) return st;
    } else if (pr__jp_lit(p, "true")) type = PR__JSON_TRUE;
    else if (pr__jp_lit(p, "false")) type = PR__JSON_FALSE;
    else if (pr__jp_lit(p, "null")) type = PR__JSON_NULL;
    else return pr__jp_fail(p, at, "unexpected character");
    if (node) {
        node->type = type;
        node->count = (uint32_t)count;
        node->skip = (uint32_t)(p->n_nodes - idx);
    }
    return PR_OK;
}

/* Parses len bytes of text (no terminator needed). `what` names the source in messages; `base` is
   added to the byte offsets reported. On success *out is one block, freed with PR_FREE. */
static pr_status pr__json_parse(pr__json **out, const char *text, size_t len, const char *what, size_t base, pr_error *err) {
    if (len > PR__JSON_MAX_TEXT) return pr__fail(err, PR_ERR_FORMAT, "%s: JSON text of %zu bytes is too large", what, len);
    pr__jp p;
    memset(&p, 0, sizeof p);
    p.s = (const unsigned char *)text;
    p.n = len;
    p.base = base;
    p.what = what;
    p.err = err;
    pr_status st = pr__jp_value(&p, 0, NULL, 0);
    if (st) return st;
    pr__jp_ws(&p);
    if (p.pos != p.n) return pr__jp_fail(&p, p.pos, "text after the JSON value");
    size_t nodes_bytes, total;
    if (!pr__mul_size(p.n_nodes, sizeof(pr__json), &nodes_bytes) || nodes_bytes > SIZE_MAX - p.n_pool)
        return pr__fail(err, PR_ERR_NOMEM, "%s: JSON document too large", what);
    total = nodes_bytes + p.n_pool;
    pr__json *nodes = (pr__json *)PR_MALLOC(total);
    if (!nodes) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory for a JSON document of %zu bytes", what, len);
    size_t n_nodes = p.n_nodes;
    p.nodes = nodes;
    p.pool = (char *)(nodes + n_nodes);
    p.n_nodes = p.n_pool = p.pos = 0;
    st = pr__jp_value(&p, 0, NULL, 0);
    if (st) { /* cannot happen: same text, same walk; never leak if it did */
        PR_FREE(nodes);
        return pr__fail(err, PR_ERR_FORMAT, "%s: JSON reader inconsistency", what);
    }
    *out = nodes;
    return PR_OK;
}

static const pr__json *pr__json_first(const pr__json *v) {
    return v && (v->type == PR__JSON_ARRAY || v->type == PR__JSON_OBJECT) && v->count ? v + 1 : NULL;
}
static const pr__json *pr__json_next(const pr__json *child) { return child + child->skip; }

/* The member `key` of an object, or NULL. With duplicate keys the last one wins, as in Python's
   json module that wrote and reads these files in transformers. */
static const pr__json *pr__json_get(const pr__json *obj, const char *key) {
    if (!obj || obj->type != PR__JSON_OBJECT) return NULL;
    size_t n = strlen(key);
    const pr__json *found = NULL, *c = pr__json_first(obj);
    for (uint32_t i = 0; i < obj->count; i++, c = pr__json_next(c))
        if (c->key_len == n && memcmp(c->key, key, n) == 0) found = c;
    return found;
}

/* An integral number: exact for integer literals, also accepted as a float with an integral
   value below 2^53 (e.g. 4096.0) since some writers emit those. */
static int pr__json_int(const pr__json *v, int64_t *out) {
    if (!v || v->type != PR__JSON_NUMBER) return 0;
    if (v->is_int) { *out = v->ival; return 1; }
    if (fabs(v->num) <= 9007199254740992.0 && v->num == (double)(int64_t)v->num) { *out = (int64_t)v->num; return 1; }
    return 0;
}

static const char *pr__json_type_name(const pr__json *v) {
    static const char *const names[] = {"null", "false", "true", "a number", "a string", "an array", "an object"};
    return v ? names[v->type] : "missing";
}

/* ---------------------------------------------------------------- 8.5 Model configuration */
static pr_status pr__cfg_check(const pr_config *c, const char *what, pr_error *err) {
    if (!memchr(c->model_type, 0, sizeof c->model_type)) return pr__fail(err, PR_ERR_CONFIG, "%s: model_type is not a terminated string", what);
    int moe = strcmp(c->model_type, "qwen3_moe") == 0, qwen3 = moe || strcmp(c->model_type, "qwen3") == 0;
    if (!qwen3 && strcmp(c->model_type, "llama") != 0)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: model_type \"%s\" is not supported (llama, qwen3, qwen3_moe)", what, c->model_type);
    if (moe ? c->num_experts <= 0 : c->num_experts != 0)
        return pr__fail(err, PR_ERR_CONFIG, "%s: num_experts %d does not fit model_type %s (experts exactly for qwen3_moe)", what,
                        c->num_experts, c->model_type);
    if (moe && (c->num_experts_per_tok < 1 || c->num_experts_per_tok > c->num_experts || c->moe_intermediate_size <= 0 ||
                (c->norm_topk_prob != 0 && c->norm_topk_prob != 1) || !(c->router_aux_loss_coef >= 0) ||
                !isfinite(c->router_aux_loss_coef) || c->num_experts > PR_MAX_EXPERTS))
        return pr__fail(err, PR_ERR_CONFIG, "%s: MoE needs 1 <= num_experts_per_tok (%d) <= num_experts (%d) <= 65536, "
                        "moe_intermediate_size > 0 (%d) and router_aux_loss_coef >= 0 (%g)", what, c->num_experts_per_tok,
                        c->num_experts, c->moe_intermediate_size, c->router_aux_loss_coef);
    struct { const char *name; int v; } pos[] = {
        {"vocab_size", c->vocab_size}, {"hidden_size", c->hidden_size}, {"intermediate_size", c->intermediate_size},
        {"num_hidden_layers", c->num_hidden_layers}, {"num_attention_heads", c->num_attention_heads},
        {"num_key_value_heads", c->num_key_value_heads}, {"head_dim", c->head_dim},
        {"max_position_embeddings", c->max_position_embeddings}};
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v <= 0) return pr__fail(err, PR_ERR_CONFIG, "%s: %s = %d must be positive", what, pos[i].name, pos[i].v);
    /* Upper limits, before any size is computed from them (see PR_MAX_LAYERS and the rest). */
    struct { const char *name; int v; long long max; } lim[] = {
        {"num_hidden_layers", c->num_hidden_layers, PR_MAX_LAYERS}, {"vocab_size", c->vocab_size, PR_MAX_VOCAB},
        {"hidden_size", c->hidden_size, PR_MAX_WIDTH}, {"intermediate_size", c->intermediate_size, PR_MAX_WIDTH},
        {"moe_intermediate_size", c->moe_intermediate_size, PR_MAX_WIDTH},
        {"num_attention_heads", c->num_attention_heads, PR_MAX_HEADS}, {"num_key_value_heads", c->num_key_value_heads, PR_MAX_HEADS},
        {"head_dim", c->head_dim, PR_MAX_HEAD_DIM}, {"max_position_embeddings", c->max_position_embeddings, PR_MAX_POSITIONS},
        {"rope_scaling original_max_position_embeddings", c->rope_original_max_position, PR_MAX_POSITIONS}};
    for (size_t i = 0; i < sizeof lim / sizeof lim[0]; i++)
        if (lim[i].v > lim[i].max)
            return pr__fail(err, PR_ERR_CONFIG, "%s: %s = %d is larger than the limit %lld", what, lim[i].name, lim[i].v, lim[i].max);
    if (c->num_attention_heads % c->num_key_value_heads)
        return pr__fail(err, PR_ERR_CONFIG, "%s: num_attention_heads %d is not a multiple of num_key_value_heads %d", what,
                        c->num_attention_heads, c->num_key_value_heads);
    if (c->head_dim % 2) return pr__fail(err, PR_ERR_CONFIG, "%s: head_dim %d must be even (RoPE rotates pairs)", what, c->head_dim);
    if (!(c->rms_norm_eps > 0) || !isfinite(c->rms_norm_eps))
        return pr__fail(err, PR_ERR_CONFIG, "%s: rms_norm_eps %g must be positive and finite", what, c->rms_norm_eps);
    if (!(c->rope_theta > 0) || !isfinite(c->rope_theta))
        return pr__fail(err, PR_ERR_CONFIG, "%s: rope_theta %g must be positive and finite", what, c->rope_theta);
    if (c->rope_llama3 != 0 && c->rope_llama3 != 1) return pr__fail(err, PR_ERR_CONFIG, "%s: rope_llama3 must be 0 or 1", what);
    if (c->tie_word_embeddings != 0 && c->tie_word_embeddings != 1) return pr__fail(err, PR_ERR_CONFIG, "%s: tie_word_embeddings must be 0 or 1", what);
    if (c->qk_norm != qwen3) /* it follows model_type: config.json has no field of its own for it */
        return pr__fail(err, PR_ERR_CONFIG, "%s: qk_norm must be %d for model_type %s", what, qwen3, c->model_type);
    if (c->rope_llama3) {
        if (!(c->rope_factor >= 1) || !isfinite(c->rope_factor))
            return pr__fail(err, PR_ERR_CONFIG, "%s: rope_scaling factor %g must be at least 1", what, c->rope_factor);
        if (!(c->rope_low_freq_factor > 0) || !(c->rope_high_freq_factor > c->rope_low_freq_factor) || !isfinite(c->rope_high_freq_factor))
            return pr__fail(err, PR_ERR_CONFIG, "%s: rope_scaling needs high_freq_factor > low_freq_factor > 0 (got %g, %g)", what,
                            c->rope_high_freq_factor, c->rope_low_freq_factor);
        if (c->rope_original_max_position <= 0)
            return pr__fail(err, PR_ERR_CONFIG, "%s: rope_scaling original_max_position_embeddings %d must be positive", what,
                            c->rope_original_max_position);
    }
    /* Parameter count in 64 bits, with room for parameters, gradients and two AdamW moments in
       double: the trainer sizes its arena from this without further overflow worries. */
    uint64_t V = (uint64_t)c->vocab_size, C = (uint64_t)c->hidden_size, F = (uint64_t)c->intermediate_size;
    uint64_t L = (uint64_t)c->num_hidden_layers, HS = (uint64_t)c->head_dim;
    uint64_t qdim = (uint64_t)c->num_attention_heads * HS, kvdim = (uint64_t)c->num_key_value_heads * HS;
    uint64_t emb, layer = 0, t, total;
    int ok = qdim <= INT_MAX && kvdim <= INT_MAX && pr__u64_mul(V, C, &emb);
    ok = ok && pr__u64_mul(C, 2 * qdim + 2 * kvdim, &t) && pr__u64_add(layer, t, &layer); /* q, k, v, o */
    if (moe) {                                                                             /* router, experts */
        uint64_t E = (uint64_t)c->num_experts, Fm = (uint64_t)c->moe_intermediate_size, per;
        ok = ok && pr__u64_mul(C, E, &t) && pr__u64_add(layer, t, &layer);
        ok = ok && pr__u64_mul(C, 3 * Fm, &per) && pr__u64_mul(per, E, &t) && pr__u64_add(layer, t, &layer);
    } else {
        ok = ok && pr__u64_mul(C, 3 * F, &t) && pr__u64_add(layer, t, &layer);            /* gate, up, down */
    }
    ok = ok && pr__u64_add(layer, 2 * C + (qwen3 ? 2 * HS : 0), &layer);                   /* norms */
    ok = ok && pr__u64_mul(layer, L, &total) && pr__u64_add(total, emb, &total) && pr__u64_add(total, C, &total);
    ok = ok && (c->tie_word_embeddings || pr__u64_add(total, emb, &total));
    if (!ok || total > PR_MAX_PARAMS)
        return pr__fail(err, PR_ERR_CONFIG, "%s: %s%.4g parameters, more than the limit %llu (PR_MAX_PARAMS)", what,
                        ok ? "" : "over ", ok ? (double)total : 1.8e19, (unsigned long long)PR_MAX_PARAMS);
    if (total > (uint64_t)(SIZE_MAX / 32))   /* parameters, gradients and two moments, up to 8 bytes each */
        return pr__fail(err, PR_ERR_CONFIG, "%s: %llu parameters need %.4g bytes of parameters, gradients and AdamW state, "
                        "more than this machine's size_t holds (%zu)", what, (unsigned long long)total, (double)total * 32,
                        (size_t)SIZE_MAX);
    return PR_OK;
}

PRDEF pr_status pr_config_validate(const pr_config *cfg, pr_error *err) {
    if (!cfg) return pr__fail(err, PR_ERR_ARG, "pr_config_validate: NULL config");
    return pr__cfg_check(cfg, "config", err);
}

/* Field readers: an absent or null optional field takes its default. */
static pr_status pr__cfg_int(const pr__json *o, const char *key, int required, int def, int *out, const char *what, pr_error *err) {
    const pr__json *v = pr__json_get(o, key);
    int64_t i;
    if (!v || v->type == PR__JSON_NULL) {
        if (required) return pr__fail(err, PR_ERR_CONFIG, "%s: required field \"%s\" is missing", what, key);
        *out = def;
        return PR_OK;
    }
    if (!pr__json_int(v, &i)) return pr__fail(err, PR_ERR_CONFIG, "%s: \"%s\" must be an integer, not %s", what, key, pr__json_type_name(v));
    if (i < INT_MIN || i > INT_MAX) return pr__fail(err, PR_ERR_CONFIG, "%s: \"%s\" = %lld is out of range", what, key, (long long)i);
    *out = (int)i;
    return PR_OK;
}

static pr_status pr__cfg_num(const pr__json *o, const char *key, int required, double def, double *out, const char *what, pr_error *err) {
    const pr__json *v = pr__json_get(o, key);
    if (!v || v->type == PR__JSON_NULL) {
        if (required) return pr__fail(err, PR_ERR_CONFIG, "%s: required field \"%s\" is missing", what, key);
        *out = def;
        return PR_OK;
    }
    if (v->type != PR__JSON_NUMBER) return pr__fail(err, PR_ERR_CONFIG, "%s: \"%s\" must be a number, not %s", what, key, pr__json_type_name(v));
    *out = v->num;
    return PR_OK;
}

static pr_status pr__cfg_bool(const pr__json *o, const char *key, int def, int *out, const char *what, pr_error *err) {
    const pr__json *v = pr__json_get(o, key);
    if (!v || v->type == PR__JSON_NULL) { *out = def; return PR_OK; }
    if (v->type != PR__JSON_TRUE && v->type != PR__JSON_FALSE)
        return pr__fail(err, PR_ERR_CONFIG, "%s: \"%s\" must be true or false, not %s", what, key, pr__json_type_name(v));
    *out = v->type == PR__JSON_TRUE;
    return PR_OK;
}

/* An optional string field: NULL when absent or null. */
static pr_status pr__cfg_str(const pr__json *o, const char *key, const char **out, const char *what, pr_error *err) {
    const pr__json *v = pr__json_get(o, key);
    *out = NULL;
    if (!v || v->type == PR__JSON_NULL) return PR_OK;
    if (v->type != PR__JSON_STRING) return pr__fail(err, PR_ERR_CONFIG, "%s: \"%s\" must be a string, not %s", what, key, pr__json_type_name(v));
    *out = v->str;
    return PR_OK;
}

/* rope_scaling (transformers 4.x) or rope_parameters (5.x, which also carries rope_theta). */
static pr_status pr__cfg_rope(pr_config *c, const pr__json *root, const char *what, pr_error *err) {
    pr_status st;
    const pr__json *rs = pr__json_get(root, "rope_scaling"), *rp = pr__json_get(root, "rope_parameters");
    if ((st = pr__cfg_num(root, "rope_theta", 0, 10000.0, &c->rope_theta, what, err))) return st;
    if (rp && rp->type != PR__JSON_NULL) {
        if (rp->type != PR__JSON_OBJECT) return pr__fail(err, PR_ERR_CONFIG, "%s: rope_parameters must be an object, not %s", what, pr__json_type_name(rp));
        if ((st = pr__cfg_num(rp, "rope_theta", 0, c->rope_theta, &c->rope_theta, what, err))) return st;
    }
    const pr__json *sc = rs && rs->type != PR__JSON_NULL ? rs : rp && rp->type != PR__JSON_NULL ? rp : NULL;
    const char *field = sc == rs ? "rope_scaling" : "rope_parameters";
    if (!sc) return PR_OK;
    if (sc->type != PR__JSON_OBJECT) return pr__fail(err, PR_ERR_CONFIG, "%s: %s must be an object or null, not %s", what, field, pr__json_type_name(sc));
    const char *type;
    if ((st = pr__cfg_str(sc, "rope_type", &type, what, err))) return st;
    if (!type && (st = pr__cfg_str(sc, "type", &type, what, err))) return st; /* the older spelling */
    if (!type) return pr__fail(err, PR_ERR_CONFIG, "%s: %s has no rope_type", what, field);
    if (strcmp(type, "default") == 0) return PR_OK; /* plain RoPE */
    if (strcmp(type, "llama3") != 0)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: %s rope_type \"%s\" is not supported (only llama3)", what, field, type);
    c->rope_llama3 = 1;
    if ((st = pr__cfg_num(sc, "factor", 1, 0, &c->rope_factor, what, err)) ||
        (st = pr__cfg_num(sc, "low_freq_factor", 1, 0, &c->rope_low_freq_factor, what, err)) ||
        (st = pr__cfg_num(sc, "high_freq_factor", 1, 0, &c->rope_high_freq_factor, what, err)) ||
        (st = pr__cfg_int(sc, "original_max_position_embeddings", 1, 0, &c->rope_original_max_position, what, err)))
        return st;
    return PR_OK;
}

/* Qwen3-MoE's fields, and the routing modes refused: a prefix computed once cannot reproduce
   routing that depends on the other tokens of a batch (capacity limits, token dropping, experts
   choosing tokens), since each of its G copies would be routed differently. */
static pr_status pr__cfg_moe(pr_config *c, const pr__json *root, const char *what, pr_error *err) {
    pr_status st;
    static const char *const coupled[] = {"capacity_factor", "expert_capacity", "moe_capacity_factor", "train_capacity_factor",
                                          "eval_capacity_factor", "moe_token_dropping", "drop_tokens", "moe_expert_capacity"};
    for (size_t i = 0; i < sizeof coupled / sizeof *coupled; i++) {
        const pr__json *v = pr__json_get(root, coupled[i]);
        if (v && v->type != PR__JSON_NULL && v->type != PR__JSON_FALSE)
            return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: \"%s\" makes routing depend on the whole batch (capacity / token "
                            "dropping); a prefix computed once cannot reproduce its G copies' routing, so it is refused", what, coupled[i]);
    }
    const char *router;
    static const char *const router_keys[] = {"router_type", "moe_router_type", "routing_type"};
    for (size_t i = 0; i < 3; i++) {
        if ((st = pr__cfg_str(root, router_keys[i], &router, what, err))) return st;
        if (router && strcmp(router, "token_choice") != 0 && strcmp(router, "topk") != 0)
            return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: %s \"%.32s\" routes by batch (expert choice); a prefix computed once "
                            "cannot reproduce its G copies' routing, so it is refused (token-choice top-k only)", what, router_keys[i], router);
    }
    int step, shared;
    if ((st = pr__cfg_int(root, "decoder_sparse_step", 0, 1, &step, what, err)) ||
        (st = pr__cfg_int(root, "shared_expert_intermediate_size", 0, 0, &shared, what, err)))
        return st;
    if (step != 1) return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: decoder_sparse_step %d: only every layer sparse (1) is supported", what, step);
    if (shared) return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: shared experts are not supported", what);
    const pr__json *dense = pr__json_get(root, "mlp_only_layers");
    if (dense && dense->type != PR__JSON_NULL && !(dense->type == PR__JSON_ARRAY && dense->count == 0))
        return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: mlp_only_layers: dense layers inside a MoE model are not supported", what);
    if ((st = pr__cfg_int(root, "num_experts", 1, 0, &c->num_experts, what, err)) ||
        (st = pr__cfg_int(root, "num_experts_per_tok", 1, 0, &c->num_experts_per_tok, what, err)) ||
        (st = pr__cfg_int(root, "moe_intermediate_size", 1, 0, &c->moe_intermediate_size, what, err)) ||
        (st = pr__cfg_bool(root, "norm_topk_prob", 0, &c->norm_topk_prob, what, err)) ||
        (st = pr__cfg_num(root, "router_aux_loss_coef", 0, 0.001, &c->router_aux_loss_coef, what, err)))
        return st;
    return PR_OK;
}

static pr_status pr__cfg_from_json(pr_config *out, const pr__json *root, const char *what, pr_error *err) {
    pr_config c;
    pr_status st;
    const char *s;
    memset(&c, 0, sizeof c);
    if (root->type != PR__JSON_OBJECT) return pr__fail(err, PR_ERR_CONFIG, "%s: a config must be a JSON object, not %s", what, pr__json_type_name(root));
    if ((st = pr__cfg_str(root, "model_type", &s, what, err))) return st;
    if (!s) return pr__fail(err, PR_ERR_CONFIG, "%s: required field \"model_type\" is missing", what);
    if (strcmp(s, "llama") != 0 && strcmp(s, "qwen3") != 0 && strcmp(s, "qwen3_moe") != 0)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: model_type \"%.64s\" is not supported (llama, qwen3, qwen3_moe)", what, s);
    strcpy(c.model_type, s);
    int moe = strcmp(s, "qwen3_moe") == 0, qwen3 = moe || strcmp(s, "qwen3") == 0, b;
    c.qk_norm = qwen3;
    if (moe && (st = pr__cfg_moe(&c, root, what, err))) return st;

    /* Features whose math this library does not implement: refuse rather than train something else. */
    if ((st = pr__cfg_str(root, "hidden_act", &s, what, err))) return st;
    if (s && strcmp(s, "silu") != 0) return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: hidden_act \"%.64s\" is not supported (only silu)", what, s);
    static const char *const no_bias[] = {"attention_bias", "mlp_bias", "use_sliding_window"};
    for (int i = 0; i < 3; i++) {
        if ((st = pr__cfg_bool(root, no_bias[i], 0, &b, what, err))) return st;
        if (b) return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: %s = true is not supported", what, no_bias[i]);
    }
    double drop;
    if ((st = pr__cfg_num(root, "attention_dropout", 0, 0.0, &drop, what, err))) return st;
    if (drop != 0) return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: attention_dropout %g is not supported (only 0)", what, drop);
    const pr__json *lt = pr__json_get(root, "layer_types"), *e;
    if (lt && lt->type == PR__JSON_ARRAY) {
        e = pr__json_first(lt);
        for (uint32_t i = 0; i < lt->count; i++, e = pr__json_next(e))
            if (e->type != PR__JSON_STRING || strcmp(e->str, "full_attention") != 0)
                return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: layer_types[%u] is not \"full_attention\" (sliding windows are not supported)", what, i);
    }

    if ((st = pr__cfg_int(root, "vocab_size", 1, 0, &c.vocab_size, what, err)) ||
        (st = pr__cfg_int(root, "hidden_size", 1, 0, &c.hidden_size, what, err)) ||
        (st = pr__cfg_int(root, "intermediate_size", 1, 0, &c.intermediate_size, what, err)) ||
        (st = pr__cfg_int(root, "num_hidden_layers", 1, 0, &c.num_hidden_layers, what, err)) ||
        (st = pr__cfg_int(root, "num_attention_heads", 1, 0, &c.num_attention_heads, what, err)) ||
        (st = pr__cfg_int(root, "num_key_value_heads", 0, c.num_attention_heads, &c.num_key_value_heads, what, err)) ||
        /* transformers' defaults: LlamaConfig 2048 positions, Qwen3Config 32768 */
        (st = pr__cfg_int(root, "max_position_embeddings", 0, qwen3 ? 32768 : 2048, &c.max_position_embeddings, what, err)) ||
        (st = pr__cfg_num(root, "rms_norm_eps", 0, 1e-6, &c.rms_norm_eps, what, err)) ||
        (st = pr__cfg_bool(root, "tie_word_embeddings", 0, &c.tie_word_embeddings, what, err)) ||
        (st = pr__cfg_rope(&c, root, what, err)))
        return st;
    /* head_dim: LlamaConfig falls back to hidden/heads, Qwen3Config to 128 */
    int def_hd = qwen3 ? 128 : (c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0) ? c.hidden_size / c.num_attention_heads : 0;
    if ((st = pr__cfg_int(root, "head_dim", 0, def_hd, &c.head_dim, what, err))) return st;
    if (c.head_dim == 0 && def_hd == 0 && c.num_attention_heads > 0)
        return pr__fail(err, PR_ERR_CONFIG, "%s: no head_dim and hidden_size %d is not a multiple of num_attention_heads %d", what,
                        c.hidden_size, c.num_attention_heads);
    if ((st = pr__cfg_check(&c, what, err))) return st;
    *out = c;
    return PR_OK;
}

static pr_status pr__config_parse_named(pr_config *cfg, const char *json, size_t len, const char *what, pr_error *err) {
    pr__json *root = NULL;
    pr_status st = pr__json_parse(&root, json, len, what, 0, err);
    if (st) return st;
    st = pr__cfg_from_json(cfg, root, what, err);
    PR_FREE(root);
    return st;
}

PRDEF pr_status pr_config_parse(pr_config *cfg, const char *json, size_t len, pr_error *err) {
    if (!cfg || (!json && len)) return pr__fail(err, PR_ERR_ARG, "pr_config_parse: NULL argument");
    return pr__config_parse_named(cfg, json ? json : "", len, "config", err);
}

/* Reads a whole (small) file, refusing more than max bytes. */
static pr_status pr__read_small_file(const char *path, size_t max, char **out, size_t *out_len, pr_error *err) {
    uint64_t size;
    int is_dir;
    if (!pr__io_stat(path, &size, &is_dir)) return pr__fail(err, PR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (is_dir) return pr__fail(err, PR_ERR_IO, "%s: is a folder, not a file", path);
    if (size > max) return pr__fail(err, PR_ERR_FORMAT, "%s: %llu bytes is more than the %zu this reader accepts", path, (unsigned long long)size, max);
    FILE *f = fopen(path, "rb");
    if (!f) return pr__fail(err, PR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char *buf = (char *)PR_MALLOC((size_t)size + 1);
    if (!buf) { fclose(f); return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path); }
    size_t got = fread(buf, 1, (size_t)size + 1, f); /* one more than expected: notices growth */
    int bad = ferror(f);
    fclose(f);
    if (bad || got != (size_t)size) {
        PR_FREE(buf);
        return pr__fail(err, PR_ERR_IO, "%s: read %zu bytes, expected %llu", path, got, (unsigned long long)size);
    }
    buf[got] = 0;
    *out = buf;
    *out_len = got;
    return PR_OK;
}

/* A JSON file of at most max bytes, parsed into *root (set only on success). */
static pr_status pr__read_json_file(const char *path, size_t max, pr__json **root, pr_error *err) {
    char *text;
    size_t len;
    pr_status st = pr__read_small_file(path, max, &text, &len, err);
    if (st) return st;
    st = pr__json_parse(root, text, len, path, 0, err);
    PR_FREE(text);
    return st;
}

PRDEF pr_status pr_config_load(pr_config *cfg, const char *path, pr_error *err) {
    if (!cfg || !path) return pr__fail(err, PR_ERR_ARG, "pr_config_load: NULL argument");
    uint64_t size;
    int is_dir = 0;
    char *file = NULL, *text = NULL;
    size_t len = 0;
    if (pr__io_stat(path, &size, &is_dir) && is_dir) {
        file = pr__path_join(path, "config.json");
        if (!file) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path);
    }
    const char *name = file ? file : path;
    pr_status st = pr__read_small_file(name, (size_t)16 << 20, &text, &len, err);
    if (!st) {
        st = pr__config_parse_named(cfg, text, len, name, err);
        PR_FREE(text);
    }
    PR_FREE(file);
    return st;
}

/* One `  "key": value,` line of config.json. */
static void pr__buf_int_field(pr__buf *b, const char *key, int64_t v) {
    pr__buf_str(b, "  \"");
    pr__buf_str(b, key);
    pr__buf_str(b, "\": ");
    pr__buf_i64(b, v);
    pr__buf_str(b, ",\n");
}

/* The text of config.json, Hugging Face style. */
static pr_status pr__config_json(const pr_config *c, pr__buf *b, const char *what, pr_error *err) {
    pr_status st = pr__cfg_check(c, what, err);
    if (st) return st;
    int qwen3 = c->qk_norm, moe = c->num_experts > 0;
    char num[40];
    struct { const char *k; int v; } ints[] = {
        {"vocab_size", c->vocab_size}, {"hidden_size", c->hidden_size}, {"intermediate_size", c->intermediate_size},
        {"num_hidden_layers", c->num_hidden_layers}, {"num_attention_heads", c->num_attention_heads},
        {"num_key_value_heads", c->num_key_value_heads}, {"head_dim", c->head_dim},
        {"max_position_embeddings", c->max_position_embeddings}};
    pr__buf_str(b, moe     ? "{\n  \"architectures\": [\"Qwen3MoeForCausalLM\"],\n  \"model_type\": \"qwen3_moe\",\n"
                   : qwen3 ? "{\n  \"architectures\": [\"Qwen3ForCausalLM\"],\n  \"model_type\": \"qwen3\",\n"
                           : "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n");
    if (moe) {
        struct { const char *k; int v; } m[] = {{"num_experts", c->num_experts}, {"num_experts_per_tok", c->num_experts_per_tok},
                                                {"moe_intermediate_size", c->moe_intermediate_size}, {"decoder_sparse_step", 1}};
        for (size_t i = 0; i < sizeof m / sizeof m[0]; i++) pr__buf_int_field(b, m[i].k, m[i].v);
        pr__buf_str(b, c->norm_topk_prob ? "  \"norm_topk_prob\": true,\n" : "  \"norm_topk_prob\": false,\n");
        pr__buf_str(b, "  \"mlp_only_layers\": [],\n  \"router_aux_loss_coef\": ");
        pr__fmt_double(num, c->router_aux_loss_coef);
        pr__buf_str(b, num);
        pr__buf_str(b, ",\n");
    }
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) pr__buf_int_field(b, ints[i].k, ints[i].v);
    pr__buf_str(b, "  \"hidden_act\": \"silu\",\n  \"rms_norm_eps\": ");
    pr__fmt_double(num, c->rms_norm_eps);
    pr__buf_str(b, num);
    pr__buf_str(b, ",\n  \"rope_theta\": ");
    pr__fmt_double(num, c->rope_theta);
    pr__buf_str(b, num);
    if (c->rope_llama3) {
        pr__buf_str(b, ",\n  \"rope_scaling\": {\n    \"factor\": ");
        pr__fmt_double(num, c->rope_factor);
        pr__buf_str(b, num);
        pr__buf_str(b, ",\n    \"low_freq_factor\": ");
        pr__fmt_double(num, c->rope_low_freq_factor);
        pr__buf_str(b, num);
        pr__buf_str(b, ",\n    \"high_freq_factor\": ");
        pr__fmt_double(num, c->rope_high_freq_factor);
        pr__buf_str(b, num);
        pr__buf_str(b, ",\n    \"original_max_position_embeddings\": ");
        pr__buf_i64(b, c->rope_original_max_position);
        pr__buf_str(b, ",\n    \"rope_type\": \"llama3\"\n  }");
    } else {
        pr__buf_str(b, ",\n  \"rope_scaling\": null");
    }
    pr__buf_str(b, c->tie_word_embeddings ? ",\n  \"tie_word_embeddings\": true" : ",\n  \"tie_word_embeddings\": false");
    pr__buf_str(b, ",\n  \"attention_bias\": false,\n  \"attention_dropout\": 0.0");
    pr__buf_str(b, qwen3 ? ",\n  \"use_sliding_window\": false" : ",\n  \"mlp_bias\": false");
    pr__buf_str(b, ",\n  \"torch_dtype\": \"float32\"\n}\n");
    if (b->failed) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", what);
    return PR_OK;
}

/* ---------------------------------------------------------------- 8.6 Atomic files */
/* Every file goes to "<path>.tmp.<pid>" first and is renamed over path only once complete and on
   disk, so a reader never sees a half-written file and a crash leaves the old one intact. */
typedef struct {
    const pr_save_opts *opts;  /* the save's on_write hook (NULL: none) */
    uint64_t bytes;            /* bytes the save has written so far, over all its files */
} pr__progress;

typedef struct {
    FILE *f;
    char *tmp;
    const char *path;
    pr__progress *progress;    /* NULL: none */
} pr__atomic;

static pr_status pr__atomic_open(pr__atomic *a, const char *path, pr_error *err) {
    size_t n = strlen(path);
    a->path = path;
    a->f = NULL;
    a->progress = NULL;
    a->tmp = n < SIZE_MAX - 32 ? (char *)PR_MALLOC(n + 32) : NULL;
    if (!a->tmp) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path);
    snprintf(a->tmp, n + 32, "%s.tmp.%ld", path, pr__io_pid());
    a->f = fopen(a->tmp, "wb");
    if (!a->f) {
        pr_status st = pr__fail(err, PR_ERR_IO, "%s: cannot create %s: %s", path, a->tmp, strerror(errno));
        PR_FREE(a->tmp);
        a->tmp = NULL;
        return st;
    }
    return PR_OK;
}

static pr_status pr__atomic_write(pr__atomic *a, const void *p, size_t n, pr_error *err) {
    if (n && fwrite(p, 1, n, a->f) != n) return pr__fail(err, PR_ERR_IO, "%s: write failed: %s", a->tmp, strerror(errno));
    if (a->progress && a->progress->opts && a->progress->opts->on_write) {
        a->progress->bytes += n;
        a->progress->opts->on_write(a->progress->opts->user, a->progress->bytes);
    }
    return PR_OK;
}

static void pr__atomic_abort(pr__atomic *a) {
    if (a->f) fclose(a->f);
    if (a->tmp) { remove(a->tmp); PR_FREE(a->tmp); }
    a->f = NULL;
    a->tmp = NULL;
}

/* The temporary file complete and on disk, not yet in place (pr__atomic_place): a save of several
   files places them only once all are written. */
static pr_status pr__atomic_finish(pr__atomic *a, pr_error *err) {
    pr_status st = PR_OK;
    int e = 0;
    if (fflush(a->f) != 0 || ferror(a->f)) { e = errno; st = PR_ERR_IO; }
    if (fclose(a->f) != 0 && !st) { e = errno; st = PR_ERR_IO; }
    a->f = NULL;
    if (st) pr__fail(err, st, "%s: write failed: %s", a->tmp, strerror(e));
    else if (!pr__io_sync_path(a->tmp)) st = pr__fail(err, PR_ERR_IO, "%s: fsync failed: %s", a->tmp, strerror(errno));
    if (st) pr__atomic_abort(a);
    return st;
}
static pr_status pr__atomic_place(pr__atomic *a, pr_error *err) {
    if (!pr__io_rename(a->tmp, a->path)) {
        pr_status st = pr__fail(err, PR_ERR_IO, "%s: cannot rename %s into place: %s", a->path, a->tmp, strerror(errno));
        pr__atomic_abort(a);
        return st;
    }
    PR_FREE(a->tmp);
    a->tmp = NULL;
    pr__io_sync_parent(a->path);
    return PR_OK;
}
static pr_status pr__atomic_commit(pr__atomic *a, pr_error *err) {
    pr_status st = pr__atomic_finish(a, err);
    return st ? st : pr__atomic_place(a, err);
}

static pr_status pr__write_file_progress(const char *path, const void *data, size_t n, pr__progress *progress, pr_error *err) {
    pr__atomic a;
    pr_status st = pr__atomic_open(&a, path, err);
    if (st) return st;
    a.progress = progress;
    if ((st = pr__atomic_write(&a, data, n, err))) { pr__atomic_abort(&a); return st; }
    return pr__atomic_commit(&a, err);
}

static pr_status pr__write_file_atomic(const char *path, const void *data, size_t n, pr_error *err) {
    return pr__write_file_progress(path, data, n, NULL, err);
}

PRDEF pr_status pr_config_save(const pr_config *cfg, const char *path, pr_error *err) {
    if (!cfg || !path) return pr__fail(err, PR_ERR_ARG, "pr_config_save: NULL argument");
    pr__buf b = {NULL, 0, 0, 0};
    pr_status st = pr__config_json(cfg, &b, path, err);
    if (!st) st = pr__write_file_atomic(path, b.p, b.len, err);
    PR_FREE(b.p);
    return st;
}

/* ---------------------------------------------------------------- 8.7 safetensors reading */
/* Every dtype the format defines at 8 bits or more; `ours` < 0: known but not read here. */
static const struct { const char *name; int bytes; int ours; } pr__st_dtypes[] = {
    {"F32", 4, PR_DT_F32}, {"F16", 2, PR_DT_F16}, {"BF16", 2, PR_DT_BF16}, {"F64", 8, PR_DT_F64},
    {"I64", 8, -1}, {"I32", 4, -1}, {"I16", 2, -1}, {"I8", 1, -1}, {"U64", 8, -1}, {"U32", 4, -1},
    {"U16", 2, -1}, {"U8", 1, -1}, {"BOOL", 1, -1}, {"F8_E4M3", 1, -1}, {"F8_E5M2", 1, -1}, {"F8_E8M0", 1, -1}};

static int pr__dtype_size(pr_dtype d) { return d == PR_DT_F64 ? 8 : d == PR_DT_F32 ? 4 : 2; }
static const char *pr__dtype_name(pr_dtype d) {
    return d == PR_DT_F32 ? "F32" : d == PR_DT_F16 ? "F16" : d == PR_DT_BF16 ? "BF16" : d == PR_DT_F64 ? "F64" : "?";
}
static int pr__dtype_valid(pr_dtype d) { return d == PR_DT_F32 || d == PR_DT_F16 || d == PR_DT_BF16 || d == PR_DT_F64; }

#define PR__ST_MAX_HEADER 100000000u /* the format's own limit on the header length */

static int pr__st_cmp_name(const void *a, const void *b) {
    return strcmp(((const pr_st_tensor *)a)->name, ((const pr_st_tensor *)b)->name);
}

static int pr__st_cmp_range(const void *a, const void *b) {
    const pr_st_tensor *x = *(const pr_st_tensor *const *)a, *y = *(const pr_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Element count of a shape; 0 on overflow of uint64 (with *ok cleared). */
static uint64_t pr__st_numel(const int64_t *shape, int ndim, int *ok) {
    uint64_t n = 1;
    *ok = 1;
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 0 || !pr__u64_mul(n, (uint64_t)shape[d], &n)) { *ok = 0; return 0; }
    return n;
}

/* Validates one tensor entry of a header and fills *t. */
static pr_status pr__st_tensor_from_json(pr_st_tensor *t, const pr__json *m, uint64_t data_size, const char *what, pr_error *err) {
    const char *name = m->key;
    const pr__json *dt = pr__json_get(m, "dtype"), *sh = pr__json_get(m, "shape"), *off = pr__json_get(m, "data_offsets"), *e;
    if (m->key_len >= sizeof t->name) return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: tensor name of %u bytes is longer than 255", what, m->key_len);
    if (strlen(name) != m->key_len) return pr__fail(err, PR_ERR_FORMAT, "%s: tensor name \"%s\" holds a NUL character", what, name);
    if (m->type != PR__JSON_OBJECT) return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s is %s, not an object", what, name, pr__json_type_name(m));
    if (!dt || dt->type != PR__JSON_STRING) return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s: \"dtype\" must be a string", what, name);
    if (!sh || sh->type != PR__JSON_ARRAY) return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s: \"shape\" must be an array", what, name);
    if (!off || off->type != PR__JSON_ARRAY || off->count != 2)
        return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s: \"data_offsets\" must be an array [begin, end]", what, name);
    memset(t, 0, sizeof *t);
    memcpy(t->name, name, m->key_len + 1);
    size_t k, nd = sizeof pr__st_dtypes / sizeof pr__st_dtypes[0];
    for (k = 0; k < nd && strcmp(dt->str, pr__st_dtypes[k].name) != 0; k++) {}
    if (k == nd) return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s has unknown dtype \"%.32s\"", what, name, dt->str);
    if (pr__st_dtypes[k].ours < 0)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: tensor %s has dtype %s; only F32, F16, BF16 and F64 are read", what, name, dt->str);
    t->dtype = (pr_dtype)pr__st_dtypes[k].ours;
    if (sh->count > 8) return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: tensor %s has %u dimensions, more than 8", what, name, sh->count);
    t->ndim = (int)sh->count;
    e = pr__json_first(sh);
    for (int d = 0; d < t->ndim; d++, e = pr__json_next(e))
        if (!pr__json_int(e, &t->shape[d]) || t->shape[d] < 0)
            return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s: shape entries must be integers >= 0", what, name);
    int64_t b, en;
    e = pr__json_first(off);
    if (!pr__json_int(e, &b) || !pr__json_int(pr__json_next(e), &en) || b < 0 || en < b)
        return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s: data_offsets must be integers 0 <= begin <= end", what, name);
    t->begin = (uint64_t)b;
    t->end = (uint64_t)en;
    if (t->end > data_size)
        return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s: data_offsets [%llu, %llu] run past the %llu bytes of data", what, name,
                        (unsigned long long)t->begin, (unsigned long long)t->end, (unsigned long long)data_size);
    int ok;
    uint64_t numel = pr__st_numel(t->shape, t->ndim, &ok), bytes;
    if (!ok || !pr__u64_mul(numel, (uint64_t)pr__st_dtypes[k].bytes, &bytes))
        return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s: the shape's size overflows", what, name);
    if (bytes != t->end - t->begin)
        return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s: %llu elements of %s need %llu bytes, data_offsets give %llu", what, name,
                        (unsigned long long)numel, dt->str, (unsigned long long)bytes, (unsigned long long)(t->end - t->begin));
    return PR_OK;
}

/* Parses and validates a safetensors JSON header (n bytes) describing data_size bytes of data.
   On success *out holds *out_n tensors sorted by name (names unique), each with .file = file.
   The data buffer must be covered exactly, tensor after tensor, as the format requires. */
static pr_status pr__st_parse_header(pr_st_tensor **out, int *out_n, const char *hdr, size_t n, uint64_t data_size, int file,
                                     const char *what, pr_error *err) {
    pr__json *root;
    pr_status st = pr__json_parse(&root, hdr, n, what, 8, err);
    if (st) return st;
    pr_st_tensor *ts = NULL, **order = NULL, t;
    size_t nt = 0, cap = 0;
    uint64_t at = 0;             /* the layout check's position */
    const pr__json *m;
    if (root->type != PR__JSON_OBJECT) { st = pr__fail(err, PR_ERR_FORMAT, "%s: the header is %s, not a JSON object", what, pr__json_type_name(root)); goto done; }
    m = pr__json_first(root);
    for (uint32_t i = 0; i < root->count; i++, m = pr__json_next(m)) {
        if (m->key_len == 12 && memcmp(m->key, "__metadata__", 12) == 0) {
            const pr__json *v = pr__json_first(m);
            if (m->type != PR__JSON_OBJECT) { st = pr__fail(err, PR_ERR_FORMAT, "%s: __metadata__ must be an object", what); goto done; }
            for (uint32_t j = 0; j < m->count; j++, v = pr__json_next(v))
                if (v->type != PR__JSON_STRING) { st = pr__fail(err, PR_ERR_FORMAT, "%s: __metadata__ values must be strings", what); goto done; }
            continue;
        }
        if ((st = pr__st_tensor_from_json(&t, m, data_size, what, err))) goto done;
        t.file = file;
        if (nt == cap) { /* grown as entries validate, so memory follows real tensors, not claims */
            size_t bytes;
            cap = cap ? 2 * cap : 16;
            pr_st_tensor *q = pr__mul_size(cap, sizeof *ts, &bytes) ? (pr_st_tensor *)PR_REALLOC(ts, bytes) : NULL;
            if (!q) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory for %zu tensors", what, cap); goto done; }
            ts = q;
        }
        ts[nt++] = t;
    }
    if (nt > INT_MAX) { st = pr__fail(err, PR_ERR_UNSUPPORTED, "%s: too many tensors", what); goto done; }
    if (nt > 1) qsort(ts, nt, sizeof *ts, pr__st_cmp_name);
    for (size_t i = 1; i < nt; i++)
        if (strcmp(ts[i - 1].name, ts[i].name) == 0) { st = pr__fail(err, PR_ERR_FORMAT, "%s: duplicate tensor name %s", what, ts[i].name); goto done; }
    /* layout: sorted by offset, each tensor starts where the previous ended, the last ends at the end */
    order = (pr_st_tensor **)PR_MALLOC(sizeof(pr_st_tensor *) * (nt ? nt : 1));
    if (!order) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", what); goto done; }
    for (size_t i = 0; i < nt; i++) order[i] = &ts[i];
    if (nt > 1) qsort(order, nt, sizeof *order, pr__st_cmp_range);
    for (size_t i = 0; i < nt; i++) {
        if (order[i]->begin < at) { st = pr__fail(err, PR_ERR_FORMAT, "%s: tensors %s and %s overlap", what, order[i - 1]->name, order[i]->name); goto done; }
        if (order[i]->begin > at) {
            st = pr__fail(err, PR_ERR_FORMAT, "%s: %llu unused bytes before tensor %s", what, (unsigned long long)(order[i]->begin - at), order[i]->name);
            goto done;
        }
        at = order[i]->end;
    }
    if (at != data_size) { st = pr__fail(err, PR_ERR_FORMAT, "%s: %llu bytes of data after the last tensor", what, (unsigned long long)(data_size - at)); goto done; }
    if (!ts && !(ts = (pr_st_tensor *)PR_MALLOC(sizeof *ts))) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", what); goto done; }
done:
    PR_FREE(order);
    PR_FREE(root);
    if (st) { PR_FREE(ts); return st; }
    *out = ts;
    *out_n = (int)nt;
    return PR_OK;
}

/* Checks the 8-byte header length against the file size (at least 8); *hlen on success. */
static pr_status pr__st_check_prefix(uint64_t *hlen, const unsigned char len8[8], uint64_t file_size, const char *what, pr_error *err) {
    uint64_t n = pr__get_u64(len8);
    if (n > file_size - 8)
        return pr__fail(err, PR_ERR_FORMAT, "%s: header length %llu runs past the end of the %llu-byte file", what,
                        (unsigned long long)n, (unsigned long long)file_size);
    if (n > PR__ST_MAX_HEADER) return pr__fail(err, PR_ERR_FORMAT, "%s: header length %llu exceeds the format's limit of 100 MB", what, (unsigned long long)n);
    if (n < 2) return pr__fail(err, PR_ERR_FORMAT, "%s: header length %llu is too short for a JSON object", what, (unsigned long long)n);
    *hlen = n;
    return PR_OK;
}

/* Opens one .safetensors file and indexes its header. */
static pr_status pr__st_open_file(const char *path, int file, pr_st_tensor **ts, int *nt, uint64_t *data_start, uint64_t *data_size, pr_error *err) {
    uint64_t size, hlen = 0;
    int is_dir;
    unsigned char len8[8];
    if (!pr__io_stat(path, &size, &is_dir)) return pr__fail(err, PR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (is_dir) return pr__fail(err, PR_ERR_IO, "%s: is a folder without model.safetensors or model.safetensors.index.json", path);
    if (size < 8) return pr__fail(err, PR_ERR_FORMAT, "%s: %llu bytes is too short for a safetensors file", path, (unsigned long long)size);
    FILE *f = fopen(path, "rb");
    if (!f) return pr__fail(err, PR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    pr_status st;
    char *hdr = NULL;
    if (fread(len8, 1, 8, f) != 8) { st = pr__fail(err, PR_ERR_IO, "%s: cannot read the header length", path); goto done; }
    if ((st = pr__st_check_prefix(&hlen, len8, size, path, err))) goto done;
    hdr = (char *)PR_MALLOC((size_t)hlen);
    if (!hdr) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory for a %llu-byte header", path, (unsigned long long)hlen); goto done; }
    if (fread(hdr, 1, (size_t)hlen, f) != (size_t)hlen) { st = pr__fail(err, PR_ERR_IO, "%s: the file ended inside its header", path); goto done; }
    st = pr__st_parse_header(ts, nt, hdr, (size_t)hlen, size - 8 - hlen, file, path, err);
    if (!st) {
        *data_start = 8 + hlen;
        *data_size = size - 8 - hlen;
    }
done:
    PR_FREE(hdr);
    fclose(f);
    return st;
}

struct pr_checkpoint {
    int n_files;
    char **paths;          /* (n_files) shard paths */
    uint64_t *data_start;  /* (n_files) file offset of each data buffer: 8 + header length */
    uint64_t *data_size;   /* (n_files) bytes of each data buffer */
    int n;
    pr_st_tensor *tensors; /* (n) sorted by name, unique across shards */
};

PRDEF void pr_checkpoint_close(pr_checkpoint *ck) {
    if (!ck) return;
    for (int i = 0; i < ck->n_files; i++) PR_FREE(ck->paths[i]);
    PR_FREE(ck->paths);
    PR_FREE(ck->data_start);
    PR_FREE(ck->data_size);
    PR_FREE(ck->tensors);
    PR_FREE(ck);
}

static int pr__cmp_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* A shard name from an index must be a plain file name next to the index. */
static int pr__st_plain_name(const char *s, size_t n) {
    if (n == 0 || strlen(s) != n || strcmp(s, ".") == 0 || strcmp(s, "..") == 0) return 0;
    return !strchr(s, '/') && !strchr(s, '\\');
}

/* Fills ck->paths from an index's weight_map; *map is the parsed index (kept for the cross-check). */
static pr_status pr__st_index_files(pr_checkpoint *ck, const pr__json *root, const char *dir, const char *what, pr_error *err) {
    const pr__json *wm = pr__json_get(root, "weight_map"), *e;
    if (root->type != PR__JSON_OBJECT || !wm || wm->type != PR__JSON_OBJECT || wm->count == 0)
        return pr__fail(err, PR_ERR_FORMAT, "%s: an index needs a non-empty object \"weight_map\"", what);
    const char **names = (const char **)PR_MALLOC(sizeof(char *) * (wm->count ? wm->count : 1));
    if (!names) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", what);
    size_t k = 0;
    pr_status st = PR_OK;
    e = pr__json_first(wm);
    for (uint32_t i = 0; i < wm->count; i++, e = pr__json_next(e)) {
        if (e->type != PR__JSON_STRING || !pr__st_plain_name(e->str, e->count)) {
            st = pr__fail(err, PR_ERR_FORMAT, "%s: weight_map entry %.255s must name a shard file in the same folder", what, e->key);
            break;
        }
        names[k++] = e->str;
    }
    if (!st && k > 1) qsort(names, k, sizeof *names, pr__cmp_str);
    size_t u = 0;
    for (size_t i = 0; !st && i < k; i++)
        if (u == 0 || strcmp(names[u - 1], names[i]) != 0) names[u++] = names[i];
    if (!st && u > INT_MAX) st = pr__fail(err, PR_ERR_UNSUPPORTED, "%s: too many shards", what);
    if (!st) {
        ck->paths = (char **)PR_MALLOC(sizeof(char *) * (u ? u : 1));
        if (!ck->paths) st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", what);
    }
    for (size_t i = 0; !st && i < u; i++) {
        ck->paths[i] = pr__path_join(dir, names[i]);
        if (!ck->paths[i]) st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", what);
        else ck->n_files++;
    }
    PR_FREE(names);
    return st;
}

/* Opens ck's files (ck->paths set) and merges their tensors. */
static pr_status pr__st_open_all(pr_checkpoint *ck, pr_error *err) {
    int nf = ck->n_files;
    size_t total = 0;
    pr_status st = PR_OK;
    pr_st_tensor **per = (pr_st_tensor **)PR_MALLOC(sizeof(pr_st_tensor *) * (size_t)(nf ? nf : 1));
    int *cnt = (int *)PR_MALLOC(sizeof(int) * (size_t)(nf ? nf : 1));
    ck->data_start = (uint64_t *)PR_MALLOC(sizeof(uint64_t) * (size_t)(nf ? nf : 1));
    ck->data_size = (uint64_t *)PR_MALLOC(sizeof(uint64_t) * (size_t)(nf ? nf : 1));
    if (!per || !cnt || !ck->data_start || !ck->data_size) {
        PR_FREE(per);
        PR_FREE(cnt);
        return pr__fail(err, PR_ERR_NOMEM, "out of memory opening %s", nf ? ck->paths[0] : "a checkpoint");
    }
    int opened = 0;
    for (; opened < nf && !st; opened++) {
        st = pr__st_open_file(ck->paths[opened], opened, &per[opened], &cnt[opened], &ck->data_start[opened], &ck->data_size[opened], err);
        if (st) break;
        total += (size_t)cnt[opened];
    }
    if (!st && total > INT_MAX) st = pr__fail(err, PR_ERR_UNSUPPORTED, "%s: too many tensors", ck->paths[0]);
    if (!st) {
        ck->tensors = (pr_st_tensor *)PR_MALLOC(sizeof(pr_st_tensor) * (total ? total : 1));
        if (!ck->tensors) st = pr__fail(err, PR_ERR_NOMEM, "out of memory for %zu tensors", total);
    }
    if (!st) {
        size_t at = 0;
        for (int i = 0; i < nf; i++) {
            if (cnt[i]) memcpy(ck->tensors + at, per[i], sizeof(pr_st_tensor) * (size_t)cnt[i]);
            at += (size_t)cnt[i];
        }
        ck->n = (int)total;
        if (total > 1) qsort(ck->tensors, total, sizeof(pr_st_tensor), pr__st_cmp_name);
        for (size_t i = 1; i < total && !st; i++)
            if (strcmp(ck->tensors[i - 1].name, ck->tensors[i].name) == 0)
                st = pr__fail(err, PR_ERR_FORMAT, "tensor %s is in both %s and %s", ck->tensors[i].name,
                              ck->paths[ck->tensors[i - 1].file], ck->paths[ck->tensors[i].file]);
    }
    for (int i = 0; i < opened; i++) PR_FREE(per[i]);
    PR_FREE(per);
    PR_FREE(cnt);
    return st;
}

static int pr__st_cmp_key(const void *key, const void *t) { return strcmp((const char *)key, ((const pr_st_tensor *)t)->name); }

PRDEF const pr_st_tensor *pr_checkpoint_find(const pr_checkpoint *ck, const char *name) {
    if (!ck || !name || ck->n == 0) return NULL;
    return (const pr_st_tensor *)bsearch(name, ck->tensors, (size_t)ck->n, sizeof(pr_st_tensor), pr__st_cmp_key);
}

/* Every weight_map entry must name a tensor held by the shard it points to. */
static pr_status pr__st_check_map(const pr_checkpoint *ck, const pr__json *root, const char *dir, const char *what, pr_error *err) {
    const pr__json *wm = pr__json_get(root, "weight_map"), *e = pr__json_first(wm);
    for (uint32_t i = 0; i < wm->count; i++, e = pr__json_next(e)) {
        const pr_st_tensor *t = strlen(e->key) == e->key_len ? pr_checkpoint_find(ck, e->key) : NULL;
        char *want = t ? pr__path_join(dir, e->str) : NULL;
        if (t && !want) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", what);
        int same = want && strcmp(want, ck->paths[t->file]) == 0;
        PR_FREE(want);
        if (!same) return pr__fail(err, PR_ERR_FORMAT, "%s: weight_map puts %.255s in %s, which does not hold it", what, e->key, e->str);
    }
    return PR_OK;
}

static int pr__ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

PRDEF pr_status pr_checkpoint_open(pr_checkpoint **out, const char *path, pr_error *err) {
    if (!out || !path) return pr__fail(err, PR_ERR_ARG, "pr_checkpoint_open: NULL argument");
    uint64_t size;
    int is_dir = 0;
    char *single = NULL, *index = NULL, *dir = NULL;
    pr__json *root = NULL;
    pr_status st = PR_OK;
    pr_checkpoint *ck = (pr_checkpoint *)PR_MALLOC(sizeof *ck);
    if (!ck) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path);
    memset(ck, 0, sizeof *ck);
    if (!pr__io_stat(path, &size, &is_dir)) { PR_FREE(ck); return pr__fail(err, PR_ERR_IO, "%s: cannot open: %s", path, strerror(errno)); }
    if (is_dir) {
        single = pr__path_join(path, "model.safetensors");
        index = pr__path_join(path, "model.safetensors.index.json");
        if (!single || !index) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path); goto done; }
        if (pr__io_stat(single, &size, &is_dir)) { PR_FREE(index); index = NULL; }
        else if (!pr__io_stat(index, &size, &is_dir)) {
            st = pr__fail(err, PR_ERR_IO, "%s: folder has neither model.safetensors nor model.safetensors.index.json", path);
            goto done;
        }
    } else if (pr__ends_with(path, ".json")) {
        index = pr__strdup(path);
        if (!index) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path); goto done; }
    } else {
        single = pr__strdup(path);
        if (!single) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path); goto done; }
    }
    if (index) { /* sharded */
        if ((st = pr__read_json_file(index, (size_t)256 << 20, &root, err))) goto done;
        dir = pr__path_dir(index);
        if (!dir) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", index); goto done; }
        if ((st = pr__st_index_files(ck, root, dir, index, err))) goto done;
        if ((st = pr__st_open_all(ck, err))) goto done;
        st = pr__st_check_map(ck, root, dir, index, err);
    } else {
        ck->paths = (char **)PR_MALLOC(sizeof(char *));
        if (!ck->paths) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path); goto done; }
        ck->paths[0] = single;
        ck->n_files = 1;
        single = NULL;
        st = pr__st_open_all(ck, err);
    }
done:
    PR_FREE(single);
    PR_FREE(index);
    PR_FREE(dir);
    PR_FREE(root);
    if (st) { pr_checkpoint_close(ck); return st; }
    *out = ck;
    return PR_OK;
}

PRDEF int pr_checkpoint_count(const pr_checkpoint *ck) { return ck ? ck->n : 0; }

PRDEF const pr_st_tensor *pr_checkpoint_tensor(const pr_checkpoint *ck, int i) {
    return ck && i >= 0 && i < ck->n ? &ck->tensors[i] : NULL;
}

/* Little-endian bytes of dtype to reals (byte by byte, so big-endian hosts read the same values). */
static void pr__st_convert(pr_real *dst, const unsigned char *src, size_t n, pr_dtype dt) {
    size_t i;
    switch (dt) {
    case PR_DT_F32:
        for (i = 0; i < n; i++) dst[i] = (pr_real)pr__get_f32(src + 4 * i);
        break;
    case PR_DT_BF16:
        for (i = 0; i < n; i++) dst[i] = (pr_real)pr_bf16_to_f32((uint16_t)(src[2 * i] | src[2 * i + 1] << 8));
        break;
    case PR_DT_F16:
        for (i = 0; i < n; i++) dst[i] = (pr_real)pr_f16_to_f32((uint16_t)(src[2 * i] | src[2 * i + 1] << 8));
        break;
    case PR_DT_F64:
        for (i = 0; i < n; i++) {
            uint64_t u = pr__get_u64(src + 8 * i);
            double d;
            memcpy(&d, &u, 8);
            dst[i] = (pr_real)d;
        }
        break;
    }
}

/* Checks a tensor record as if it came from a file (t may be a caller's copy); *numel: its elements. */
static pr_status pr__checkpoint_record(const pr_checkpoint *ck, const pr_st_tensor *t, uint64_t *numel, pr_error *err) {
    if (t->file < 0 || t->file >= ck->n_files || !pr__dtype_valid(t->dtype) || t->ndim < 0 || t->ndim > 8 || !memchr(t->name, 0, sizeof t->name))
        return pr__fail(err, PR_ERR_ARG, "pr_checkpoint_read: the tensor record does not belong to this checkpoint");
    int ok;
    uint64_t bytes;
    *numel = pr__st_numel(t->shape, t->ndim, &ok);
    if (!ok || !pr__u64_mul(*numel, (uint64_t)pr__dtype_size(t->dtype), &bytes) || t->end < t->begin || bytes != t->end - t->begin ||
        t->end > ck->data_size[t->file])
        return pr__fail(err, PR_ERR_ARG, "%s: tensor %s: its record is inconsistent", ck->paths[t->file], t->name);
    return PR_OK;
}

/* Rows [r[0], r[1]) and columns [r[2], r[3]) of tensor t (its first dimension the rows, the rest
   the columns; the caller checks the bounds) into dst, row-major: a shard of a tensor read without
   the rest of it, each row's columns at their offset (whole rows in one run). */
static pr_status pr__checkpoint_read_rect(const pr_checkpoint *ck, const pr_st_tensor *t, const int64_t r[4], pr_real *dst, pr_error *err) {
    uint64_t numel = 0, end_in_file, size;
    pr_status st = pr__checkpoint_record(ck, t, &numel, err);
    const int64_t rows = t->ndim ? t->shape[0] : 1;
    if (st || r[0] >= r[1] || r[2] >= r[3] || rows <= 0) return st;
    const char *path = ck->paths[t->file];
    const uint64_t cols = numel / (uint64_t)rows;
    const int es = pr__dtype_size(t->dtype);
    int is_dir;
    end_in_file = ck->data_start[t->file] + t->end;
    if (!pr__io_stat(path, &size, &is_dir)) return pr__fail(err, PR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (size < end_in_file) return pr__fail(err, PR_ERR_FORMAT, "%s: the file shrank to %llu bytes since it was opened", path, (unsigned long long)size);
    FILE *f = fopen(path, "rb");
    if (!f) return pr__fail(err, PR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    const size_t chunk = (size_t)1 << 20; /* a multiple of every element size */
    unsigned char *buf = (unsigned char *)PR_MALLOC(chunk);
    if (!buf) st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path);
    const int whole_rows = r[2] == 0 && (uint64_t)r[3] == cols;
    for (int64_t row = r[0]; !st && row < r[1]; row = whole_rows ? r[1] : row + 1) {
        const uint64_t at = ck->data_start[t->file] + t->begin + ((uint64_t)row * cols + (uint64_t)r[2]) * (uint64_t)es;
        const uint64_t run = (whole_rows ? (uint64_t)(r[1] - r[0]) * cols : (uint64_t)(r[3] - r[2])) * (uint64_t)es;
        if (!pr__io_seek(f, at)) st = pr__fail(err, PR_ERR_IO, "%s: cannot seek to byte %llu of tensor %s", path, (unsigned long long)at, t->name);
        for (uint64_t done = 0; !st && done < run;) {
            size_t now = run - done < chunk ? (size_t)(run - done) : chunk;
            if (fread(buf, 1, now, f) != now) st = pr__fail(err, PR_ERR_IO, "%s: read error in tensor %s", path, t->name);
            else pr__st_convert(dst + (size_t)(done / (uint64_t)es), buf, now / (size_t)es, t->dtype);
            done += now;
        }
        dst += run / (uint64_t)es;
    }
    PR_FREE(buf);
    fclose(f);
    return st;
}

PRDEF pr_status pr_checkpoint_read(const pr_checkpoint *ck, const pr_st_tensor *t, pr_real *dst, size_t count, pr_error *err) {
    if (!ck || !t || (!dst && count)) return pr__fail(err, PR_ERR_ARG, "pr_checkpoint_read: NULL argument");
    uint64_t numel;
    pr_status st = pr__checkpoint_record(ck, t, &numel, err);
    if (st) return st;
    if (numel != (uint64_t)count)
        return pr__fail(err, PR_ERR_ARG, "%s: tensor %s has %llu elements, the buffer holds %zu", ck->paths[t->file], t->name,
                        (unsigned long long)numel, count);
    const int64_t rows = t->ndim ? t->shape[0] : 1, whole[4] = { 0, rows, 0, rows > 0 ? (int64_t)(numel / (uint64_t)rows) : 0 };
    return pr__checkpoint_read_rect(ck, t, whole, dst, err);
}

/* ---------------------------------------------------------------- 8.8 safetensors writing */
/* Checks entries before anything is written: shapes, sizes, unique names. */
/* streamed: the values come from a pr__st_source, so the entries need no data. */
static pr_status pr__st_check_entries(const pr_st_entry *en, int n, pr_dtype dtype, const char *what, uint64_t *bytes_out, int streamed,
                                      pr_error *err) {
    if (n < 0 || (n > 0 && !en)) return pr__fail(err, PR_ERR_ARG, "%s: bad entry list (n = %d)", what, n);
    if (!pr__dtype_valid(dtype)) return pr__fail(err, PR_ERR_ARG, "%s: unknown dtype %d", what, (int)dtype);
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        const pr_st_entry *e = &en[i];
        if (!e->name || !e->name[0] || strlen(e->name) > 255 || strcmp(e->name, "__metadata__") == 0)
            return pr__fail(err, PR_ERR_ARG, "%s: entry %d needs a name of 1..255 bytes other than __metadata__", what, i);
        if (e->ndim < 0 || e->ndim > 4) return pr__fail(err, PR_ERR_ARG, "%s: tensor %s has ndim %d (0..4)", what, e->name, e->ndim);
        int ok;
        uint64_t numel = pr__st_numel(e->shape, e->ndim, &ok), b;
        if (!ok || !pr__u64_mul(numel, (uint64_t)pr__dtype_size(dtype), &b) || numel > SIZE_MAX || !pr__u64_add(total, b, &total))
            return pr__fail(err, PR_ERR_ARG, "%s: tensor %s has a negative or overflowing shape", what, e->name);
        if (numel && !e->data && !streamed) return pr__fail(err, PR_ERR_ARG, "%s: tensor %s has no data", what, e->name);
        if (bytes_out) bytes_out[i] = b;
    }
    if (n > 1) {
        const char **names = (const char **)PR_MALLOC(sizeof(char *) * (size_t)n);
        if (!names) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", what);
        for (int i = 0; i < n; i++) names[i] = en[i].name;
        qsort(names, (size_t)n, sizeof *names, pr__cmp_str);
        for (int i = 1; i < n; i++)
            if (strcmp(names[i - 1], names[i]) == 0) {
                pr_status st = pr__fail(err, PR_ERR_ARG, "%s: duplicate tensor name %s", what, names[i]);
                PR_FREE(names);
                return st;
            }
        PR_FREE(names);
    }
    return PR_OK;
}

/* Converts n reals to little-endian dtype bytes. */
static void pr__st_encode(unsigned char *dst, const pr_real *src, size_t n, pr_dtype dt) {
    size_t i;
    switch (dt) {
    case PR_DT_F32:
        for (i = 0; i < n; i++) {
            float f = (float)src[i];
            uint32_t u;
            memcpy(&u, &f, 4);
            pr__put_u32(dst + 4 * i, u);
        }
        break;
    case PR_DT_BF16:
        for (i = 0; i < n; i++) pr__put_u16(dst + 2 * i, pr__f32bits_to_bf16(pr__real_to_f32bits_odd(src[i])));
        break;
    case PR_DT_F16:
        for (i = 0; i < n; i++) pr__put_u16(dst + 2 * i, pr__f32bits_to_f16(pr__real_to_f32bits_odd(src[i])));
        break;
    case PR_DT_F64:
        for (i = 0; i < n; i++) {
            double d = (double)src[i];
            uint64_t u;
            memcpy(&u, &d, 8);
            pr__put_u64(dst + 8 * i, u);
        }
        break;
    }
}

/* Where pr__st_write takes the values of a file's tensors when they are not in the entries' data:
   read points *p at the next of entry e's values, from element `from`, and sets *got to how many it
   has there (at least 1, at most want). A file's values are asked for in order, entry by entry. */
typedef struct pr__st_source {
    pr_status (*read)(struct pr__st_source *src, const pr_st_entry *e, size_t from, size_t want, const pr_real **p, size_t *got,
                      pr_error *err);
} pr__st_source;

/* Writes the file; entries already checked, meta NULL or a parsed object of strings, src NULL or
   where the values come from. kept NULL: the file is put in place; else it is left written under
   its temporary name in *kept, for the caller to place (pr__atomic_place) or abort. */
static pr_status pr__st_write(const char *path, const pr_st_entry *en, int n, pr_dtype dtype, const pr__json *meta,
                              pr__st_source *src, pr__progress *progress, pr__atomic *kept, pr_error *err) {
    pr__buf h = {NULL, 0, 0, 0};
    uint64_t off = 0;
    int es = pr__dtype_size(dtype);
    pr__buf_str(&h, "{");
    if (meta) {
        const pr__json *v = pr__json_first(meta);
        pr__buf_str(&h, "\"__metadata__\":{");
        for (uint32_t i = 0; i < meta->count; i++, v = pr__json_next(v)) {
            if (i) pr__buf_str(&h, ",");
            pr__buf_json_str(&h, v->key, v->key_len);
            pr__buf_str(&h, ":");
            pr__buf_json_str(&h, v->str, v->count);
        }
        pr__buf_str(&h, "}");
    }
    for (int i = 0; i < n; i++) {
        int ok;
        uint64_t bytes = pr__st_numel(en[i].shape, en[i].ndim, &ok) * (uint64_t)es;
        if (i || meta) pr__buf_str(&h, ",");
        pr__buf_json_str(&h, en[i].name, strlen(en[i].name));
        pr__buf_str(&h, ":{\"dtype\":\"");
        pr__buf_str(&h, pr__dtype_name(dtype));
        pr__buf_str(&h, "\",\"shape\":[");
        for (int d = 0; d < en[i].ndim; d++) {
            if (d) pr__buf_str(&h, ",");
            pr__buf_i64(&h, en[i].shape[d]);
        }
        pr__buf_str(&h, "],\"data_offsets\":[");
        pr__buf_u64(&h, off);
        pr__buf_str(&h, ",");
        pr__buf_u64(&h, off + bytes);
        pr__buf_str(&h, "]}");
        off += bytes;
    }
    pr__buf_str(&h, "}");
    while (!h.failed && h.len % 8) pr__buf_str(&h, " "); /* keeps the data 8-byte aligned for mmap readers */
    if (h.failed) { PR_FREE(h.p); return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory for the header", path); }
    if (h.len > PR__ST_MAX_HEADER) { PR_FREE(h.p); return pr__fail(err, PR_ERR_ARG, "%s: header of %zu bytes exceeds the format's 100 MB limit", path, h.len); }

    pr__atomic a;
    pr_status st = pr__atomic_open(&a, path, err);
    if (st) { PR_FREE(h.p); return st; }
    a.progress = progress;
    const size_t chunk_elems = 1 << 16;
    unsigned char len8[8], *buf = (unsigned char *)PR_MALLOC(chunk_elems * 8);
    pr__put_u64(len8, (uint64_t)h.len);
    if (!buf) st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path);
    if (!st) st = pr__atomic_write(&a, len8, 8, err);
    if (!st) st = pr__atomic_write(&a, h.p, h.len, err);
    for (int i = 0; i < n && !st; i++) {
        int ok;
        size_t numel = (size_t)pr__st_numel(en[i].shape, en[i].ndim, &ok);
        for (size_t done = 0; done < numel && !st;) {
            size_t now = numel - done < chunk_elems ? numel - done : chunk_elems;
            const pr_real *values = src ? NULL : en[i].data + done;
            if (src && (st = src->read(src, &en[i], done, now, &values, &now, err))) break;
            pr__st_encode(buf, values, now, dtype);
            st = pr__atomic_write(&a, buf, now * (size_t)es, err);
            done += now;
        }
    }
    PR_FREE(buf);
    PR_FREE(h.p);
    if (st) { pr__atomic_abort(&a); return st; }
    if (!kept) return pr__atomic_commit(&a, err);
    *kept = a;
    return pr__atomic_finish(kept, err);
}

/* Parses user metadata: NULL, or a JSON object whose values are all strings (the format's rule). */
static pr_status pr__st_parse_meta(pr__json **out, const char *meta, const char *path, pr_error *err) {
    *out = NULL;
    if (!meta) return PR_OK;
    pr__json *m;
    pr_status st = pr__json_parse(&m, meta, strlen(meta), "safetensors metadata", 0, err);
    if (st == PR_ERR_FORMAT) { /* the caller's argument, not a file, is malformed */
        if (err) err->status = PR_ERR_ARG;
        return PR_ERR_ARG;
    }
    if (st) return st;
    const pr__json *v = pr__json_first(m);
    int ok = m->type == PR__JSON_OBJECT;
    for (uint32_t i = 0; ok && i < m->count; i++, v = pr__json_next(v)) ok = v->type == PR__JSON_STRING;
    if (!ok) { PR_FREE(m); return pr__fail(err, PR_ERR_ARG, "%s: metadata must be a JSON object of string values", path); }
    *out = m;
    return PR_OK;
}

/* pr_safetensors_write, the values from src when it is not NULL. */
static pr_status pr__safetensors_write(const char *path, const pr_st_entry *entries, int n, pr_dtype dtype, const char *metadata,
                                       pr__st_source *src, pr_error *err) {
    if (!path) return pr__fail(err, PR_ERR_ARG, "pr_safetensors_write: NULL path");
    pr_status st = pr__st_check_entries(entries, n, dtype, path, NULL, src != NULL, err);
    if (st) return st;
    pr__json *meta;
    if ((st = pr__st_parse_meta(&meta, metadata, path, err))) return st;
    st = pr__st_write(path, entries, n, dtype, meta, src, NULL, NULL, err);
    PR_FREE(meta);
    return st;
}
PRDEF pr_status pr_safetensors_write(const char *path, const pr_st_entry *entries, int n, pr_dtype dtype,
                                     const char *metadata_json_object_or_null, pr_error *err) {
    return pr__safetensors_write(path, entries, n, dtype, metadata_json_object_or_null, NULL, err);
}

static int pr__st_cmp_entry(const void *a, const void *b) {
    return strcmp((*(const pr_st_entry *const *)a)->name, (*(const pr_st_entry *const *)b)->name);
}

/* Creates the folder dir itself when missing (never its parents: a missing parent is an error that
   names it), and checks that what is there is a folder. */
static pr_status pr__mkdir_one(const char *dir, pr_error *err) {
    uint64_t size;
    int is_dir = 0;
    if (!pr__io_mkdir(dir)) {
        int e = errno;
        if (e == ENOENT) {
            char *parent = pr__path_dir(dir);
            pr_status st = pr__fail(err, PR_ERR_IO, "%s: cannot create the folder: its parent %s does not exist (folders above the "
                                    "one asked for are not created)", dir, parent ? parent : "");
            PR_FREE(parent);
            return st;
        }
        return pr__fail(err, PR_ERR_IO, "%s: cannot create the folder: %s", dir, strerror(e));
    }
    if (!pr__io_stat(dir, &size, &is_dir) || !is_dir) return pr__fail(err, PR_ERR_IO, "%s: exists and is not a folder", dir);
    return PR_OK;
}

/* Removes dir/name if it exists: a file of the other layout that readers might prefer. */
static pr_status pr__remove_stale(const char *dir, const char *name, pr_error *err) {
    char *p = pr__path_join(dir, name);
    uint64_t size;
    int is_dir;
    if (!p) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", dir);
    pr_status st = PR_OK;
    if (pr__io_stat(p, &size, &is_dir) && remove(p) != 0) st = pr__fail(err, PR_ERR_IO, "%s: cannot remove the stale %s: %s", dir, name, strerror(errno));
    PR_FREE(p);
    return st;
}

/* The folder's present index, parsed (*root NULL where there is none, or none that reads: only
   running out of memory fails), for the shard files it names: a save removes those its own files
   do not replace. */
static pr_status pr__old_index(const char *dir, pr__json **root, pr_error *err) {
    char *path = pr__path_join(dir, "model.safetensors.index.json");
    uint64_t size;
    int is_dir;
    pr_error e;
    pr_status st = PR_OK;
    *root = NULL;
    if (!path) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", dir);
    if (pr__io_stat(path, &size, &is_dir) && !is_dir) st = pr__read_json_file(path, (size_t)256 << 20, root, &e);
    PR_FREE(path);
    if (st != PR_ERR_NOMEM) return PR_OK;
    if (err) *err = e;
    return st;
}

/* Whether name is shard s of n_shards, model-SSSSS-of-NNNNN.safetensors, for some s in 1..n_shards. */
static int pr__is_shard_of(const char *name, int n_shards) {
    char tail[32];
    snprintf(tail, sizeof tail, "-of-%05d.safetensors", n_shards);
    if (n_shards < 2 || strlen(name) != 11 + strlen(tail) || strncmp(name, "model-", 6) || strcmp(name + 11, tail)) return 0;
    int s = 0;
    for (int i = 6; i < 11; i++) {
        if (name[i] < '0' || name[i] > '9') return 0;
        s = 10 * s + (name[i] - '0');
    }
    return s >= 1 && s <= n_shards;
}

/* The previous index's files that a save of n_shards files (1: model.safetensors) writes over
   (replaced) or leaves (stale), one by one: where stale is set, each stale file is removed (as
   transformers' own save does, so that a re-sharded folder holds one checkpoint, not the remains of
   the last); returns whether any is replaced. */
static int pr__old_shards(const char *dir, const pr__json *old, int n_shards, int remove_stale, pr_status *st, pr_error *err) {
    const pr__json *wm = old ? pr__json_get(old, "weight_map") : NULL;
    int replaced = 0;
    if (!wm || wm->type != PR__JSON_OBJECT) return 0;
    const pr__json *e = pr__json_first(wm);
    for (uint32_t i = 0; i < wm->count && !*st; i++, e = pr__json_next(e)) {
        if (e->type != PR__JSON_STRING || !pr__st_plain_name(e->str, e->count) || !pr__ends_with(e->str, ".safetensors")) continue;
        if (pr__is_shard_of(e->str, n_shards) || !strcmp(e->str, "model.safetensors")) replaced = 1;
        else if (remove_stale) *st = pr__remove_stale(dir, e->str, err);   /* a second entry for a removed file finds none */
    }
    return replaced;
}

/* pr_checkpoint_save, the values from src when it is not NULL. */
static pr_status pr__checkpoint_save(const char *dir, const pr_st_entry *entries, int n, pr_dtype dtype, uint64_t max_shard_bytes,
                                     pr__st_source *src, pr_error *err) {
    if (!dir || !dir[0]) return pr__fail(err, PR_ERR_ARG, "pr_checkpoint_save: NULL or empty folder");
    uint64_t *bytes = (uint64_t *)PR_MALLOC(sizeof(uint64_t) * (size_t)(n > 0 ? n : 1));
    int *shard = (int *)PR_MALLOC(sizeof(int) * (size_t)(n > 0 ? n : 1));
    const pr_st_entry **sorted = NULL;
    pr__buf ix = {NULL, 0, 0, 0};
    char *file = NULL, **shard_file = NULL;
    pr__atomic *kept = NULL;               /* the shards written, placed only once every one is */
    pr__json *meta = NULL, *old = NULL;    /* old: the folder's previous index */
    pr_status st = PR_OK;
    int n_shards = 1, written = 0, placed = 0, indexed = 0;
    uint64_t in_shard = 0, total = 0;
    if (!bytes || !shard) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", dir); goto done; }
    if ((st = pr__st_check_entries(entries, n, dtype, dir, bytes, src != NULL, err))) goto done;
    /* shards in entry order: a new one when the next tensor would pass the limit */
    for (int i = 0; i < n; i++) {
        /* in_shard can exceed the limit after an oversized tensor: test before subtracting */
        if (max_shard_bytes && in_shard > 0 && (in_shard >= max_shard_bytes || bytes[i] > max_shard_bytes - in_shard)) {
            n_shards++;
            in_shard = 0;
        }
        in_shard += bytes[i];
        total += bytes[i];
        shard[i] = n_shards - 1;
    }
    if (n_shards > 99999) { st = pr__fail(err, PR_ERR_ARG, "%s: %d shards are more than the 99999 the naming allows", dir, n_shards); goto done; }
    if ((st = pr__mkdir_one(dir, err))) goto done;
    if ((st = pr__old_index(dir, &old, err))) goto done;
    if ((st = pr__st_parse_meta(&meta, "{\"format\":\"pt\"}", dir, err))) goto done; /* transformers refuses files without it */
    if (n_shards == 1) {
        if (!(file = pr__path_join(dir, "model.safetensors"))) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", dir); goto done; }
        if ((st = pr__st_write(file, entries, n, dtype, meta, src, NULL, NULL, err))) goto done;
        if (!(st = pr__remove_stale(dir, "model.safetensors.index.json", err))) pr__old_shards(dir, old, 1, 1, &st, err);
        goto done;
    }
    char name[64];
    kept = (pr__atomic *)PR_MALLOC(sizeof(pr__atomic) * (size_t)n_shards);
    shard_file = (char **)PR_MALLOC(sizeof(char *) * (size_t)n_shards);
    if (!kept || !shard_file) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", dir); goto done; }
    for (int s = 0, first = 0; s < n_shards; s++, written++) {
        int last = first;
        while (last < n && shard[last] == s) last++;
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        if (!(shard_file[s] = pr__path_join(dir, name))) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", dir); goto done; }
        if ((st = pr__st_write(shard_file[s], entries + first, last - first, dtype, meta, src, NULL, &kept[s], err))) {
            PR_FREE(shard_file[s]);
            goto done;
        }
        first = last;
    }
    /* the index, names sorted as transformers writes them */
    sorted = (const pr_st_entry **)PR_MALLOC(sizeof(pr_st_entry *) * (size_t)n);
    if (!sorted) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", dir); goto done; }
    for (int i = 0; i < n; i++) sorted[i] = &entries[i];
    qsort(sorted, (size_t)n, sizeof *sorted, pr__st_cmp_entry);
    pr__buf_str(&ix, "{\n  \"metadata\": {\n    \"total_size\": ");
    pr__buf_u64(&ix, total);
    pr__buf_str(&ix, "\n  },\n  \"weight_map\": {");
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", shard[sorted[i] - entries] + 1, n_shards);
        pr__buf_str(&ix, i ? ",\n    " : "\n    ");
        pr__buf_json_str(&ix, sorted[i]->name, strlen(sorted[i]->name));
        pr__buf_str(&ix, ": \"");
        pr__buf_str(&ix, name);
        pr__buf_str(&ix, "\"");
    }
    pr__buf_str(&ix, "\n  }\n}\n");
    if (ix.failed) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory for the index", dir); goto done; }
    if (!(file = pr__path_join(dir, "model.safetensors.index.json"))) { st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", dir); goto done; }
    /* Where placing the shards replaces some of the previous index's by name (or that index is not
       read), the index goes first, so that an interruption part way (a crash, a refused rename)
       leaves a folder without an index, which no reader loads, rather than a loadable mix of two
       checkpoints. Otherwise the new index's rename replaces it at once. */
    if ((!old || pr__old_shards(dir, old, n_shards, 0, &st, err)) && (st = pr__remove_stale(dir, "model.safetensors.index.json", err)))
        goto done;
    /* placed counts only the shards in place: a failed rename has removed its own temporary file,
       and the file of that name is not this save's */
    while (placed < written && !(st = pr__atomic_place(&kept[placed], err))) placed++;
    if (st) goto done;
    if ((st = pr__write_file_atomic(file, ix.p, ix.len, err))) goto done;
    indexed = 1;
    if (!(st = pr__remove_stale(dir, "model.safetensors", err))) pr__old_shards(dir, old, n_shards, 1, &st, err);
done:
    for (int s = 0; s < written; s++) {                 /* a failed save's shards are removed, unless its index is in place */
        if (s >= placed) pr__atomic_abort(&kept[s]);
        else if (st && !indexed) remove(shard_file[s]);
        PR_FREE(shard_file[s]);
    }
    PR_FREE(kept);
    PR_FREE(shard_file);
    PR_FREE(bytes);
    PR_FREE(shard);
    PR_FREE(sorted);
    PR_FREE(ix.p);
    PR_FREE(file);
    PR_FREE(meta);
    PR_FREE(old);
    return st;
}

PRDEF pr_status pr_checkpoint_save(const char *dir, const pr_st_entry *entries, int n, pr_dtype dtype, uint64_t max_shard_bytes, pr_error *err) {
    return pr__checkpoint_save(dir, entries, n, dtype, max_shard_bytes, NULL, err);
}

/* ---------------------------------------------------------------- 8.9 GRPO traces */
#include <errno.h>
#include <limits.h>

/* Little-endian readers (on top of pr__get_u32): the format fixes the byte order, the host's does not matter. */
static int32_t pr__le_i32(const unsigned char *p) {
    uint32_t u = pr__get_u32(p);
    return u <= (uint32_t)INT32_MAX ? (int32_t)u : (int32_t)((int64_t)u - 4294967296LL);
}

/* The rules for one value, shared by the file reader and pr_group_validate. `where` names the
   group ("FILE: group 3" or "invalid group"); code is the status to return. */
static pr_status pr__trace_count(pr_error *err, pr_status code, const char *where, const char *field,
                                 long long value) {
    if (value >= 1 && value <= PR_TRACE_MAX_COUNT) return PR_OK;
    return pr__fail(err, code, "%s: %s = %lld (must be 1..%d)", where, field, value, PR_TRACE_MAX_COUNT);
}

static pr_status pr__trace_tokens(pr_error *err, pr_status code, const char *where, int suffix,
                                  const int32_t *t, int64_t n, int vocab_size) {
    for (int64_t j = 0; j < n; j++)
        if (t[j] < 0 || t[j] >= vocab_size) {
            char field[48];
            if (suffix < 0) snprintf(field, sizeof field, "prefix_tokens[%lld]", (long long)j);
            else snprintf(field, sizeof field, "suffix %d: tokens[%lld]", suffix, (long long)j);
            return pr__fail(err, code, "%s: %s = %ld is outside the vocabulary [0, %d)", where, field,
                            (long)t[j], vocab_size);
        }
    return PR_OK;
}

/* logp: log-probs must also be <= 0 (written so that NaN fails too). */
static pr_status pr__trace_reals(pr_error *err, pr_status code, const char *where, int suffix,
                                 const char *name, const pr_real *x, int64_t n, int logp) {
    for (int64_t j = 0; j < n; j++)
        if (!isfinite(x[j]) || (logp && !(x[j] <= 0))) {
            char field[48];
            if (suffix < 0) snprintf(field, sizeof field, "%s[%lld]", name, (long long)j);
            else snprintf(field, sizeof field, "suffix %d: %s[%lld]", suffix, name, (long long)j);
            return pr__fail(err, code, "%s: %s = %g (%s)", where, field, (double)x[j],
                            logp ? "log-probs must be finite and <= 0" : "must be finite");
        }
    return PR_OK;
}

/* A group's shape: P, G and the suffix lengths in range, suffix_off their running sums, P plus the
   longest suffix an int, and the arrays that hold the shape there (suffix_len, suffix_off,
   loss_mask): what a reader of the loss mask alone relies on. */
static pr_status pr__group_shape(const pr_group *g, pr_status code, const char *where, pr_error *err) {
    pr_status st;
    int smax = 0;
    if (!g) return pr__fail(err, PR_ERR_ARG, "%s: NULL group", where);
    if ((st = pr__trace_count(err, code, where, "P (prefix length)", g->P)) ||
        (st = pr__trace_count(err, code, where, "G (number of suffixes)", g->G)))
        return st;
    if (!g->suffix_len || !g->suffix_off || !g->loss_mask) return pr__fail(err, code, "%s: NULL array (only ref_logp may be NULL)", where);
    if (g->suffix_off[0] != 0)
        return pr__fail(err, code, "%s: suffix_off[0] = %lld (must be 0)", where, (long long)g->suffix_off[0]);
    for (int i = 0; i < g->G; i++) {
        char field[32];
        snprintf(field, sizeof field, "suffix_len[%d]", i);
        if ((st = pr__trace_count(err, code, where, field, g->suffix_len[i]))) return st;
        if (g->suffix_off[i + 1] != g->suffix_off[i] + g->suffix_len[i])
            return pr__fail(err, code, "%s: suffix_off[%d] = %lld, expected suffix_off[%d] + suffix_len[%d] = %lld",
                            where, i + 1, (long long)g->suffix_off[i + 1], i, i,
                            (long long)(g->suffix_off[i] + g->suffix_len[i]));
        if (g->suffix_len[i] > smax) smax = g->suffix_len[i];
    }
    if (g->P > INT_MAX - smax)
        return pr__fail(err, code, "%s: P %d + longest suffix %d does not fit an int", where, g->P, smax);
    return PR_OK;
}

static pr_status pr__group_check(const pr_group *g, int vocab_size, pr_status code, const char *where,
                                 pr_error *err) {
    pr_status st;
    int i;
    if (!g) return pr__fail(err, PR_ERR_ARG, "%s: NULL group", where);
    if (vocab_size < 1) return pr__fail(err, code, "%s: vocab_size = %d (must be >= 1)", where, vocab_size);
    if ((st = pr__group_shape(g, code, where, err))) return st;
    if (!g->prefix || !g->tokens || !g->advantage || !g->old_logp) return pr__fail(err, code, "%s: NULL array (only ref_logp may be NULL)", where);
    if ((st = pr__trace_tokens(err, code, where, -1, g->prefix, g->P, vocab_size)) ||
        (st = pr__trace_reals(err, code, where, -1, "advantage", g->advantage, g->G, 0)))
        return st;
    for (i = 0; i < g->G; i++) {
        const int64_t o = g->suffix_off[i], S = g->suffix_len[i];
        if ((st = pr__trace_tokens(err, code, where, i, g->tokens + o, S, vocab_size)) ||
            (st = pr__trace_reals(err, code, where, i, "old_logp", g->old_logp + o, S, 1)) ||
            (g->ref_logp && (st = pr__trace_reals(err, code, where, i, "ref_logp", g->ref_logp + o, S, 1))))
            return st;
        for (int64_t j = 0; j < S; j++)
            if (g->loss_mask[o + j] > 1)
                return pr__fail(err, code, "%s: suffix %d: loss_mask[%lld] = %u (must be 0 or 1)", where, i,
                                (long long)j, (unsigned)g->loss_mask[o + j]);
    }
    if (!g->prefix_mask) {
        if (g->prefix_old_logp || g->prefix_ref_logp)
            return pr__fail(err, code, "%s: prefix_old_logp or prefix_ref_logp without prefix_mask", where);
        return PR_OK;
    }
    if (!g->prefix_old_logp || !g->prefix_ref_logp != !g->ref_logp)
        return pr__fail(err, code, "%s: prefix_mask needs prefix_old_logp, and prefix_ref_logp exactly when ref_logp is given",
                        where);
    if (g->prefix_mask[0])
        return pr__fail(err, code, "%s: prefix_mask[0] = %u (the first token has nothing to predict it: must be 0)", where,
                        (unsigned)g->prefix_mask[0]);
    for (i = 1; i < g->P; i++)
        if (g->prefix_mask[i] > 1)
            return pr__fail(err, code, "%s: prefix_mask[%d] = %u (must be 0 or 1)", where, i, (unsigned)g->prefix_mask[i]);
    if ((st = pr__trace_reals(err, code, where, -1, "prefix_old_logp", g->prefix_old_logp, g->P, 1)) ||
        (g->prefix_ref_logp && (st = pr__trace_reals(err, code, where, -1, "prefix_ref_logp", g->prefix_ref_logp, g->P, 1))))
        return st;
    return PR_OK;
}

PRDEF pr_status pr_group_validate(const pr_group *g, int vocab_size, pr_error *err) {
    return pr__group_check(g, vocab_size, PR_ERR_ARG, "invalid group", err);
}

/* Reserve n elements of `elem` bytes at offset *used of the trace block, rounded up to 8 bytes so
   that every array is aligned for int64_t and double; with a block, return their address in *at.
   0 if the size overflows. */
static int pr__trace_take(unsigned char *block, size_t *used, size_t n, size_t elem, void **at) {
    size_t bytes;
    if (!pr__mul_size(n, elem, &bytes) || bytes > SIZE_MAX - 7 || (bytes + 7) / 8 * 8 > SIZE_MAX - *used) return 0;
    if (block) *at = block + *used;
    *used += (bytes + 7) / 8 * 8;
    return 1;
}

/* Walk the groups of a trace whose header has been checked. Two passes over the same code:
   with block == NULL it checks the structure (counts, limits, sizes against the bytes left) and
   adds the block size to *used; with the block it carves the arrays from it and fills them. */
static pr_status pr__trace_walk(const unsigned char *buf, size_t len, const char *name, const pr_trace *t,
                                int prefix_loss, unsigned char *block, size_t *used, int **step_off, pr_error *err) {
    const size_t per_tok = 4 + 4 + (t->has_ref ? 4 : 0) + 1;   /* token, old_logp, [ref_logp], mask */
    const size_t per_prefix_tok = prefix_loss ? 1 + 4 + (t->has_ref ? 4 : 0) : 0;   /* flag bit 1: mask, old, [ref] */
    size_t pos = t->n_steps ? 28 + 4 * (size_t)t->n_steps : 24;   /* after the header and the step table */
    pr_group *groups = NULL;
    void *at[11] = {0};  /* addresses from pr__trace_take (filling pass only) */
    pr_status st;
    if (!pr__trace_take(block, used, (size_t)t->n_groups, sizeof(pr_group), &at[0]) ||
        !pr__trace_take(block, used, t->n_steps ? (size_t)t->n_steps + 1 : 0, sizeof(int), &at[1]))
        goto too_big;
    if (block) {
        groups = (pr_group *)at[0];
        *step_off = t->n_steps ? (int *)at[1] : NULL;
        for (int k = 0; k < t->n_steps; k++) {
            if (!k) (*step_off)[0] = 0;
            (*step_off)[k + 1] = (*step_off)[k] + (int)pr__get_u32(buf + 28 + 4 * (size_t)k);
        }
    }
    for (int gi = 0; gi < t->n_groups; gi++) {
        char where[320];
        uint32_t P, G, i;
        uint64_t need, N = 0;
        const unsigned char *lens, *p;
        snprintf(where, sizeof where, "%s: group %d", name, gi);
        if (len - pos < 8)
            return pr__fail(err, PR_ERR_FORMAT, "%s: truncated: P and G need 8 bytes at offset %zu, %zu left",
                            where, pos, len - pos);
        P = pr__get_u32(buf + pos);
        G = pr__get_u32(buf + pos + 4);
        pos += 8;
        if ((st = pr__trace_count(err, PR_ERR_FORMAT, where, "P (prefix length)", P)) ||
            (st = pr__trace_count(err, PR_ERR_FORMAT, where, "G (number of suffixes)", G)))
            return st;
        need = 4 * (uint64_t)P + 8 * (uint64_t)G;   /* prefix_tokens, suffix_len, advantage */
        const uint64_t tail = (uint64_t)P * per_prefix_tok;     /* after the suffixes: the trained prefix tokens */
        if (need > len - pos)
            return pr__fail(err, PR_ERR_FORMAT, "%s: truncated: prefix_tokens[%u], suffix_len[%u] and advantage[%u] "
                            "need %llu bytes at offset %zu, %zu left", where, P, G, G, (unsigned long long)need,
                            pos, len - pos);
        lens = buf + pos + 4 * (size_t)P;
        for (i = 0; i < G; i++) {
            char field[32];
            uint32_t S = pr__get_u32(lens + 4 * (size_t)i);
            snprintf(field, sizeof field, "suffix_len[%u]", i);
            if ((st = pr__trace_count(err, PR_ERR_FORMAT, where, field, S))) return st;
            N += S;
        }
        /* P, S_i <= 2^24, so P + max S_i fits an int; pr__group_check says so again. */
        if (N * per_tok > len - pos - need)
            return pr__fail(err, PR_ERR_FORMAT, "%s: truncated: %llu suffix tokens need %llu bytes at offset %llu, "
                            "%llu left", where, (unsigned long long)N, (unsigned long long)(N * per_tok),
                            (unsigned long long)(pos + need), (unsigned long long)(len - pos - need));
        if (tail > len - pos - need - N * per_tok)
            return pr__fail(err, PR_ERR_FORMAT, "%s: truncated: prefix_mask, prefix_old_logp%s need %llu bytes at offset "
                            "%llu, %llu left", where, t->has_ref ? " and prefix_ref_logp" : "", (unsigned long long)tail,
                            (unsigned long long)(pos + need + N * per_tok), (unsigned long long)(len - pos - need - N * per_tok));
        if (!pr__trace_take(block, used, (size_t)G + 1, sizeof(int64_t), &at[0]) ||   /* suffix_off */
            !pr__trace_take(block, used, G, sizeof(pr_real), &at[1]) ||                /* advantage */
            !pr__trace_take(block, used, (size_t)N, sizeof(pr_real), &at[2]) ||        /* old_logp */
            !pr__trace_take(block, used, t->has_ref ? (size_t)N : 0, sizeof(pr_real), &at[3]) ||
            !pr__trace_take(block, used, P, sizeof(int32_t), &at[4]) ||                /* prefix */
            !pr__trace_take(block, used, (size_t)N, sizeof(int32_t), &at[5]) ||        /* tokens */
            !pr__trace_take(block, used, G, sizeof(int), &at[6]) ||                    /* suffix_len */
            !pr__trace_take(block, used, (size_t)N, 1, &at[7]) ||                      /* loss_mask */
            !pr__trace_take(block, used, prefix_loss ? P : 0, 1, &at[8]) ||            /* prefix_mask */
            !pr__trace_take(block, used, prefix_loss ? P : 0, sizeof(pr_real), &at[9]) ||
            !pr__trace_take(block, used, prefix_loss && t->has_ref ? P : 0, sizeof(pr_real), &at[10]))
            goto too_big;
        if (block) {
            pr_group *g = &groups[gi];
            g->P = (int)P;
            g->G = (int)G;
            g->suffix_off = (int64_t *)at[0];
            g->advantage = (pr_real *)at[1];
            g->old_logp = (pr_real *)at[2];
            g->ref_logp = t->has_ref ? (pr_real *)at[3] : NULL;
            g->prefix = (int32_t *)at[4];
            g->tokens = (int32_t *)at[5];
            g->suffix_len = (int *)at[6];
            g->loss_mask = (uint8_t *)at[7];
            g->prefix_mask = NULL;
            g->prefix_old_logp = g->prefix_ref_logp = NULL;
            p = buf + pos;
            for (i = 0; i < P; i++) g->prefix[i] = pr__le_i32(p + 4 * (size_t)i);
            p = lens + 4 * (size_t)G;
            g->suffix_off[0] = 0;
            for (i = 0; i < G; i++) {
                g->suffix_len[i] = (int)pr__get_u32(lens + 4 * (size_t)i);
                g->suffix_off[i + 1] = g->suffix_off[i] + g->suffix_len[i];
                g->advantage[i] = (pr_real)pr__get_f32(p + 4 * (size_t)i);
            }
            p += 4 * (size_t)G;
            for (i = 0; i < G; i++) {   /* tokens[S], old_logp[S], ref_logp[S] if flagged, loss_mask[S] */
                const size_t S = (size_t)g->suffix_len[i], o = (size_t)g->suffix_off[i];
                size_t j;
                for (j = 0; j < S; j++) g->tokens[o + j] = pr__le_i32(p + 4 * j);
                p += 4 * S;
                for (j = 0; j < S; j++) g->old_logp[o + j] = (pr_real)pr__get_f32(p + 4 * j);
                p += 4 * S;
                if (t->has_ref) {
                    for (j = 0; j < S; j++) g->ref_logp[o + j] = (pr_real)pr__get_f32(p + 4 * j);
                    p += 4 * S;
                }
                memcpy(g->loss_mask + o, p, S);
                p += S;
            }
            int trained = 0;
            for (i = 0; prefix_loss && i < P; i++) trained |= p[i];
            if (trained) {                /* a mask of zeros is no mask: the prefix is context only */
                g->prefix_mask = (uint8_t *)at[8];
                g->prefix_old_logp = (pr_real *)at[9];
                g->prefix_ref_logp = t->has_ref ? (pr_real *)at[10] : NULL;
                memcpy(g->prefix_mask, p, P);
                for (i = 0; i < P; i++) g->prefix_old_logp[i] = (pr_real)pr__get_f32(p + P + 4 * (size_t)i);
                for (i = 0; t->has_ref && i < P; i++) g->prefix_ref_logp[i] = (pr_real)pr__get_f32(p + 5 * (size_t)P + 4 * (size_t)i);
            }
            if ((st = pr__group_check(g, t->vocab_size, PR_ERR_FORMAT, where, err))) return st;
            /* and its prefix log-probs are a writer's zeros, since reading drops them */
            for (i = 0; prefix_loss && !trained && i < P * (t->has_ref ? 2u : 1u); i++)
                if (pr__get_u32(p + P + 4 * (size_t)i))
                    return pr__fail(err, PR_ERR_FORMAT, "%s: %s[%u] = %g, but the group trains no prefix token (a writer "
                                    "puts 0 there)", where, i < P ? "prefix_old_logp" : "prefix_ref_logp", i % P,
                                    (double)pr__get_f32(p + P + 4 * (size_t)i));
        }
        pos += (size_t)need + (size_t)(N * per_tok) + (size_t)tail;
    }
    if (pos != len)
        return pr__fail(err, PR_ERR_FORMAT, "%s: %zu trailing byte(s) after the last group (at offset %zu)",
                        name, len - pos, pos);
    return PR_OK;
too_big:
    return pr__fail(err, PR_ERR_NOMEM, "%s: the trace does not fit in memory (size overflow)", name);
}

/* Version 2's step table, after the header: u32 n_steps, then each step's group count. The counts
   are read and checked here, before anything is sized from them: 1 <= n_steps <= n_groups, every
   step at least one group, together exactly n_groups. */
static pr_status pr__trace_steps_check(const unsigned char *buf, size_t len, const char *name, uint32_t n_groups, int *n_steps,
                                       pr_error *err) {
    if (len - 24 < 4)
        return pr__fail(err, PR_ERR_FORMAT, "%s: truncated: the step table's n_steps needs 4 bytes at offset 24, %zu left", name, len - 24);
    const uint32_t n = pr__get_u32(buf + 24);
    if (n < 1 || n > n_groups)
        return pr__fail(err, PR_ERR_FORMAT, "%s: n_steps = %u (must be 1..n_groups = %u)", name, n, n_groups);
    if ((len - 28) / 4 < n)
        return pr__fail(err, PR_ERR_FORMAT, "%s: truncated: the step table's %u group counts need %llu bytes at offset 28, %zu left",
                        name, n, 4ull * n, len - 28);
    uint64_t covered = 0;
    for (uint32_t k = 0; k < n; k++) {
        const uint32_t c = pr__get_u32(buf + 28 + 4 * (size_t)k);
        if (c < 1 || c > n_groups - covered)
            return pr__fail(err, PR_ERR_FORMAT, "%s: step %u has %u groups (every step 1 or more, the steps together exactly "
                            "n_groups = %u; %llu left for it)", name, k, c, n_groups, (unsigned long long)(n_groups - covered));
        covered += c;
    }
    if (covered != n_groups)
        return pr__fail(err, PR_ERR_FORMAT, "%s: the steps hold %llu of the %u groups (they must cover every group once, in order)",
                        name, (unsigned long long)covered, n_groups);
    *n_steps = (int)n;
    return PR_OK;
}

static pr_status pr__trace_parse_named(pr_trace *trace, const unsigned char *buf, size_t len, const char *name,
                                       pr_error *err) {
    static const unsigned char magic[8] = {'P', 'R', 'T', 'R', 'A', 'C', 'E', 0};
    pr_trace t;
    uint32_t version, flags, n_groups, vocab;
    size_t used = 0;
    unsigned char *block;
    pr_status st;
    if (len < 24)
        return pr__fail(err, PR_ERR_FORMAT, "%s: %zu bytes, too short for the 24-byte trace header", name, len);
    if (memcmp(buf, magic, 8) != 0)
        return pr__fail(err, PR_ERR_FORMAT, "%s: not a prefixreuse trace (bad magic)", name);
    version = pr__get_u32(buf + 8);
    flags = pr__get_u32(buf + 12);
    n_groups = pr__get_u32(buf + 16);
    vocab = pr__get_u32(buf + 20);
    if (version != 1 && version != 2)
        return pr__fail(err, PR_ERR_UNSUPPORTED, "%s: trace format version %u is not supported (this reader "
                        "knows versions 1 and 2)", name, version);
    if (flags & ~3u)
        return pr__fail(err, PR_ERR_FORMAT, "%s: flags = 0x%x has unknown bits 0x%x (only bit 0, reference "
                        "log-probs, and bit 1, trained prefix tokens, are defined)", name, flags, flags & ~3u);
    if (n_groups < 1 || n_groups > INT_MAX)
        return pr__fail(err, PR_ERR_FORMAT, "%s: n_groups = %u (must be 1..%d)", name, n_groups, INT_MAX);
    if (vocab < 1 || vocab > INT_MAX)
        return pr__fail(err, PR_ERR_FORMAT, "%s: vocab_size = %u (must be 1..%d)", name, vocab, INT_MAX);
    t.n_groups = (int)n_groups;
    t.vocab_size = (int)vocab;
    t.has_ref = (int)(flags & 1u);
    t.groups = NULL;
    t.n_steps = 0;
    t.step_off = NULL;
    t.fingerprint = pr__fnv1a64(buf, len);
    if (version == 2 && (st = pr__trace_steps_check(buf, len, name, n_groups, &t.n_steps, err))) return st;
    const int prefix_loss = (int)((flags >> 1) & 1u);
    if ((st = pr__trace_walk(buf, len, name, &t, prefix_loss, NULL, &used, NULL, err))) return st;   /* check, size */
    block = (unsigned char *)PR_MALLOC(used);
    if (!block)
        return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory allocating %zu bytes for the trace", name, used);
    used = 0;
    if ((st = pr__trace_walk(buf, len, name, &t, prefix_loss, block, &used, &t.step_off, err))) {   /* fill, check values */
        PR_FREE(block);
        return st;
    }
    int any_trained = 0;          /* a group read with a prefix mask trains a prefix token */
    for (int k = 0; k < t.n_groups; k++) any_trained |= ((const pr_group *)(void *)block)[k].prefix_mask != NULL;
    if (prefix_loss && !any_trained) {
        PR_FREE(block);
        return pr__fail(err, PR_ERR_FORMAT, "%s: flags bit 1 (trained prefix tokens) is set, but no group trains a prefix token "
                        "(a writer sets it only when one does)", name);
    }
    t.groups = (pr_group *)(void *)block;
    *trace = t;
    return PR_OK;
}

PRDEF pr_status pr_trace_parse(pr_trace *trace, const void *bytes, size_t len, pr_error *err) {
    if (!trace || (!bytes && len))
        return pr__fail(err, PR_ERR_ARG, "pr_trace_parse: NULL %s", trace ? "bytes" : "trace");
    return pr__trace_parse_named(trace, bytes ? (const unsigned char *)bytes : (const unsigned char *)"", len,
                                 "<memory>", err);
}

static void pr__buf_le32(pr__buf *b, uint32_t v) {
    unsigned char x[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16), (unsigned char)(v >> 24)};
    pr__buf_add(b, x, 4);
}
static void pr__buf_f32(pr__buf *b, pr_real r) {
    float f = (float)r;
    uint32_t u;
    memcpy(&u, &f, 4);
    pr__buf_le32(b, u);
}

PRDEF pr_status pr_trace_serialize(const pr_trace *t, void **bytes, size_t *len, pr_error *err) {
    if (!t || !bytes || !len) return pr__fail(err, PR_ERR_ARG, "pr_trace_serialize: NULL argument");
    if (t->n_groups < 1 || !t->groups || t->vocab_size < 1)
        return pr__fail(err, PR_ERR_ARG, "pr_trace_serialize: a trace needs at least one group and a vocabulary (%d groups, vocabulary %d)",
                        t->n_groups, t->vocab_size);
    for (int k = 0; k < t->n_groups; k++) {
        pr_status st = pr_group_validate(&t->groups[k], t->vocab_size, err);
        if (st) return pr__fail(err, st, "group %d: %s", k, err ? err->message : "invalid");
        if ((t->groups[k].ref_logp != NULL) != (t->has_ref != 0))
            return pr__fail(err, PR_ERR_ARG, "group %d %s reference log-probs but the trace's has_ref is %d", k,
                            t->groups[k].ref_logp ? "has" : "lacks", t->has_ref);
    }
    if (t->n_steps < 0 || t->n_steps > t->n_groups || (t->n_steps && !t->step_off))
        return pr__fail(err, PR_ERR_ARG, "pr_trace_serialize: %d steps for %d groups%s", t->n_steps, t->n_groups,
                        t->n_steps && !t->step_off ? " and no step_off" : "");
    for (int k = 0; k < t->n_steps; k++)
        if ((k == 0 && t->step_off[0] != 0) || t->step_off[k + 1] <= t->step_off[k] ||
            (k == t->n_steps - 1 && t->step_off[k + 1] != t->n_groups))
            return pr__fail(err, PR_ERR_ARG, "pr_trace_serialize: step %d spans groups %d..%d: the steps must run from group 0 to "
                            "%d, each holding at least one group", k, t->step_off[k], t->step_off[k + 1] - 1, t->n_groups - 1);
    int prefix_loss = 0;          /* as a reader takes it: a mask of zeros is none, its log-probs written as 0 */
    for (int k = 0; k < t->n_groups; k++) prefix_loss |= pr__prefix_trained(&t->groups[k], 0, t->groups[k].P) > 0;
    pr__buf b = {NULL, 0, 0, 0};
    pr__buf_add(&b, "PRTRACE\0", 8);
    pr__buf_le32(&b, t->n_steps ? 2 : 1);
    pr__buf_le32(&b, (t->has_ref ? 1u : 0u) | (prefix_loss ? 2u : 0u));
    pr__buf_le32(&b, (uint32_t)t->n_groups);
    pr__buf_le32(&b, (uint32_t)t->vocab_size);
    if (t->n_steps) pr__buf_le32(&b, (uint32_t)t->n_steps);
    for (int k = 0; k < t->n_steps; k++) pr__buf_le32(&b, (uint32_t)(t->step_off[k + 1] - t->step_off[k]));
    for (int k = 0; k < t->n_groups; k++) {
        const pr_group *g = &t->groups[k];
        pr__buf_le32(&b, (uint32_t)g->P);
        pr__buf_le32(&b, (uint32_t)g->G);
        for (int i = 0; i < g->P; i++) pr__buf_le32(&b, (uint32_t)g->prefix[i]);
        for (int i = 0; i < g->G; i++) pr__buf_le32(&b, (uint32_t)g->suffix_len[i]);
        for (int i = 0; i < g->G; i++) pr__buf_f32(&b, g->advantage[i]);
        for (int i = 0; i < g->G; i++) {
            const int64_t o = g->suffix_off[i], S = g->suffix_len[i];
            for (int64_t j = 0; j < S; j++) pr__buf_le32(&b, (uint32_t)g->tokens[o + j]);
            for (int64_t j = 0; j < S; j++) pr__buf_f32(&b, g->old_logp[o + j]);
            if (g->ref_logp)
                for (int64_t j = 0; j < S; j++) pr__buf_f32(&b, g->ref_logp[o + j]);
            pr__buf_add(&b, g->loss_mask + o, (size_t)S);
        }
        static const uint8_t context_only = 0;
        const int trained = pr__prefix_trained(g, 0, g->P) > 0;
        for (int i = 0; prefix_loss && i < g->P; i++) pr__buf_add(&b, trained ? &g->prefix_mask[i] : &context_only, 1);
        for (int i = 0; prefix_loss && i < g->P; i++) pr__buf_f32(&b, trained ? g->prefix_old_logp[i] : 0);
        for (int i = 0; prefix_loss && t->has_ref && i < g->P; i++) pr__buf_f32(&b, trained ? g->prefix_ref_logp[i] : 0);
    }
    if (b.failed) {
        PR_FREE(b.p);
        return pr__fail(err, PR_ERR_NOMEM, "pr_trace_serialize: out of memory");
    }
    *bytes = b.p;
    *len = b.len;
    return PR_OK;
}

PRDEF pr_status pr_trace_write(const pr_trace *t, const char *path, pr_error *err) {
    if (!path) return pr__fail(err, PR_ERR_ARG, "pr_trace_write: NULL path");
    void *bytes;
    size_t len;
    pr_status st = pr_trace_serialize(t, &bytes, &len, err);
    if (st) return st;
    st = pr__write_file_atomic(path, bytes, len, err);
    PR_FREE(bytes);
    return st;
}

PRDEF pr_status pr_trace_read(pr_trace *trace, const char *path, pr_error *err) {
    FILE *f;
    unsigned char *buf = NULL;
    size_t len = 0, cap = 0;
    pr_status st;
    uint64_t size;
    int is_dir;
    if (!trace || !path) return pr__fail(err, PR_ERR_ARG, "pr_trace_read: NULL %s", trace ? "path" : "trace");
    if (pr__io_stat(path, &size, &is_dir) && is_dir) return pr__fail(err, PR_ERR_IO, "%s: is a folder, not a trace file", path);
    f = fopen(path, "rb");
    if (!f) return pr__fail(err, PR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    for (;;) {   /* read to the end, doubling the buffer: no reliance on ftell for the size */
        size_t got;
        if (len == cap) {
            unsigned char *nb;
            size_t ncap = cap ? cap * 2 : 1 << 16;
            if (ncap < cap || !(nb = (unsigned char *)PR_REALLOC(buf, ncap))) {
                PR_FREE(buf);
                fclose(f);
                return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory reading the file (%zu bytes so far)", path, len);
            }
            buf = nb;
            cap = ncap;
        }
        got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        PR_FREE(buf);
        fclose(f);
        return pr__fail(err, PR_ERR_IO, "%s: read error after %zu bytes", path, len);
    }
    fclose(f);
    st = pr__trace_parse_named(trace, buf, len, path, err);
    PR_FREE(buf);
    return st;
}

PRDEF void pr_trace_free(pr_trace *trace) {
    if (!trace) return;
    PR_FREE(trace->groups);   /* the groups array heads the one block holding everything */
    memset(trace, 0, sizeof *trace);
}

/* ---------------------------------------------------------------- 8.10 A trainer's checkpoints */
/* The full model's tensor table (the trainer's own without a mesh; a copy to free on a mesh). */
static pr_tensor_info *pr__table_of(pr_trainer *tr, int *count) {
    *count = tr->n_tensors;
    return tr->mesh ? pr__full_table(tr, count, NULL) : tr->tensors;
}

static void pr__shape_text(char *out, size_t cap, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(out, cap, "[");
    for (int d = 0; d < ndim && k < cap; d++) k += (size_t)snprintf(out + k, cap - k, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (k < cap) snprintf(out + k, cap - k, "]");
}

/* The layer index of a name "model.layers.<i>.", or -1. */
static int pr__layer_of(const char *name) {
    if (strncmp(name, "model.layers.", 13) || name[13] < '0' || name[13] > '9') return -1;
    long long v = 0;                      /* a number past int's range is a layer past any model's last */
    for (const char *c = name + 13; *c >= '0' && *c <= '9' && v <= INT_MAX; c++) v = 10 * v + (*c - '0');
    return v > INT_MAX ? INT_MAX : (int)v;
}

/* Checks that ck holds every tensor of the table, named prefix + its name, before any is read. A
   checkpoint of another model is refused by name: a tensor missing, one of another shape (both
   shapes given), a layer past the model's last. Other tensors are passed over (Hugging Face files
   may carry buffers such as rotary_emb.inv_freq) unless `exact`, for the trainer's own files, which
   hold nothing else. */
static pr_status pr__check_tensors(pr_checkpoint *ck, const char *path, const char *prefix, const pr_tensor_info *table, int count,
                                   int n_layers, int exact, pr_error *err) {
    char name[400];
    for (int i = 0; i < count; i++) {
        const pr_tensor_info *ti = &table[i];
        snprintf(name, sizeof name, "%s%s", prefix, ti->name);
        const pr_st_tensor *t = pr_checkpoint_find(ck, name);
        if (!t) return pr__fail(err, PR_ERR_ARG, "%s: tensor %s is missing (a checkpoint of another model?)", path, name);
        int same = t->ndim == ti->ndim;
        for (int d = 0; same && d < ti->ndim; d++) same = t->shape[d] == ti->shape[d];
        if (!same) {
            char have[128], want[128];
            pr__shape_text(have, sizeof have, t->ndim, t->shape);
            pr__shape_text(want, sizeof want, ti->ndim, ti->shape);
            return pr__fail(err, PR_ERR_ARG, "%s: tensor %s has shape %s, the model's is %s (a checkpoint of another shape)", path, name,
                            have, want);
        }
    }
    const size_t plen = strlen(prefix);
    for (int k = 0; k < pr_checkpoint_count(ck); k++) {    /* every table name was found: the rest is extra */
        const char *nm = pr_checkpoint_tensor(ck, k)->name;
        int known = 0;
        if (!exact && (strncmp(nm, prefix, plen) || pr__layer_of(nm + plen) < n_layers)) continue;
        for (int i = 0; i < count && !known; i++) {
            snprintf(name, sizeof name, "%s%s", prefix, table[i].name);
            known = !strcmp(name, nm);
        }
        if (!known) return pr__fail(err, PR_ERR_ARG, "%s: holds tensor %s, which the model does not have (a checkpoint of another model)", path, nm);
    }
    return PR_OK;
}

/* This rank's part of the tensors named prefix + each name in ck (checked first: pr__check_tensors
   against the full model's table, so a checkpoint of another model is refused whatever the mesh)
   into local (n_params reals, the layout of the rank's arena): on a mesh only its shard's
   rectangle of each tensor is read, without one the whole of each. *count: the full model's
   tensors. */
static pr_status pr__read_local(pr_trainer *tr, pr_checkpoint *ck, const char *path, const char *prefix, int exact, pr_real *local,
                                int *count, pr_error *err) {
    pr_tensor_info *ft = pr__table_of(tr, count);
    char name[400];
    pr_status st = ft ? pr__check_tensors(ck, path, prefix, ft, *count, tr->model.num_hidden_layers, exact, err)
                      : pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path);
    for (int i = 0; i < tr->n_tensors && !st; i++) {
        int64_t r[4];
        pr__shard_rect(tr, i, r);
        snprintf(name, sizeof name, "%s%s", prefix, tr->tensors[i].name);
        st = pr__checkpoint_read_rect(ck, pr_checkpoint_find(ck, name), r, local + tr->tensors[i].offset, err);
    }
    if (tr->mesh) PR_FREE(ft);
    return st;
}

PRDEF pr_status pr_trainer_load(pr_trainer *tr, const char *path, pr_error *err) {
    if (!tr) return pr__fail(err, PR_ERR_ARG, "pr_trainer_load: NULL argument");
    /* one rank: the whole model; a mesh's rank: its shard, then every rank of the world agrees */
    pr_real *host = (pr_real *)PR_MALLOC(sizeof(pr_real) * (tr->n_params + 1));
    pr_checkpoint *ck = NULL;
    pr_status st = !path ? pr__fail(err, PR_ERR_ARG, "pr_trainer_load: NULL argument")
                   : !host ? pr__fail(err, PR_ERR_NOMEM, "pr_trainer_load: out of memory for %zu reals", tr->n_params)
                           : pr_checkpoint_open(&ck, path, err);
    int count;
    if (!st) st = pr__read_local(tr, ck, path, "", 0, host, &count, err);
    if (ck) pr_checkpoint_close(ck);
    if (tr->mesh) st = pr__ranks_agree(tr, tr->mesh->world, st, NULL, "pr_trainer_load", "no rank takes the checkpoint", err);
    if (!st) pr__weights_take(tr, host);
    PR_FREE(host);
    return st;
}

/* The full model's parameters, gradients or moments written as safetensors while they are
   assembled (pr__gather), so that no rank holds a copy of the whole: world rank 0 (the trainer
   without a mesh) names the entries (prefix + the tensor's name, the full model's shapes) and
   each file's values are read from the gather as it goes, a chunk at a time; the other ranks give
   their shards to the same chunks (pr__export_end). The entries of up to 3 arenas follow one
   another (a state's parameters, m and v, on one rank); on a mesh of several ranks an export
   holds one, its values asked for in order. A file whose values are not whole (a rank failed
   during the gather, or the device) is abandoned before it is committed, and a checkpoint's shards
   are put in place only once all are written: what is in place holds the model. */
#define PR__NAME_CAP 128   /* a tensor name (under 96) with a prefix */
typedef struct {
    pr__st_source src;                     /* first: what pr__st_write reads through */
    pr_trainer *tr;
    const char *fn;
    const pr_real *arena[3];
    int n;                                 /* tensors an arena */
    pr_tensor_info *table;                 /* (n) the full model's */
    pr_st_entry *entries;                  /* (n arenas x n) NULL on the ranks that only give */
    char *names;
    pr_real *window;                       /* (PR__GATHER_CHUNK) the chunk read from: elements [w0, w0 + wk) */
    size_t w0, wk;
    pr__gather g;                          /* of arena[at] */
    int at;
    int told;                              /* a read failed for another rank's failure: its agreement says why */
} pr__export;

static pr_status pr__export_read(pr__st_source *src, const pr_st_entry *e, size_t from, size_t want, const pr_real **p, size_t *got,
                                 pr_error *err) {
    pr__export *x = (pr__export *)src;
    pr_trainer *tr = x->tr;
    const int j = (int)(e - x->entries);
    const size_t off = (size_t)x->table[j % x->n].offset + from;
    if (j / x->n != x->at) {               /* the next arena: only on one rank, where no peer follows the chunks */
        pr_status st = pr__gather_end(tr, &x->g, NULL, err);
        if (st) return st;
        pr__gather_begin(tr, x->arena[j / x->n], x->fn, &x->g, PR_OK, err);
        x->at = j / x->n;
        x->w0 = x->wk = 0;
    }
    if (off < x->w0) return pr__fail(err, PR_ERR_ARG, "%s: the values were asked for out of order", x->fn);
    while (x->w0 + x->wk <= off) {
        int whole;
        if (x->g.next >= tr->n_full) return pr__fail(err, PR_ERR_ARG, "%s: a value past the model's end was asked for", x->fn);
        x->w0 = x->g.next;
        x->wk = pr__gather_chunk(tr, &x->g, x->window, &whole, err);
        if (!x->g.st && tr->be->take_error) x->g.st = tr->be->take_error(tr->be, err);   /* a device fault: not written */
        if (x->g.st) return x->g.st;
        if (!whole) {
            x->told = 1;
            return pr__fail(err, PR_ERR_IO, "%s: another rank failed during the gather", x->fn);
        }
    }
    *p = x->window + (off - x->w0);
    *got = x->w0 + x->wk - off < want ? x->w0 + x->wk - off : want;
    return PR_OK;
}

/* Collective where the gather is: every rank starts arena[0]'s gather, joining it even when it
   has failed; the writer (world rank 0) also names its entries. The writer writes only when this
   succeeds; every rank then ends with pr__export_end, whatever happened. */
static pr_status pr__export_begin(pr_trainer *tr, const pr_real *const *arena, const char *const *prefix, int n_arenas, const char *fn,
                                  pr__export *x, pr_error *err) {
    memset(x, 0, sizeof *x);
    x->src.read = pr__export_read;
    x->tr = tr;
    x->fn = fn;
    for (int b = 0; b < n_arenas; b++) x->arena[b] = arena[b];
    pr_status st = PR_OK;
    if (!tr->mesh || !tr->mesh->world->rank) {
        x->table = pr__table_of(tr, &x->n);
        const size_t count = (size_t)n_arenas * (size_t)x->n;
        x->entries = x->table ? (pr_st_entry *)PR_MALLOC(sizeof(pr_st_entry) * count) : NULL;
        x->names = x->table ? (char *)PR_MALLOC((size_t)PR__NAME_CAP * count) : NULL;
        x->window = (pr_real *)PR_MALLOC(sizeof(pr_real) * PR__GATHER_CHUNK);
        if (!x->entries || !x->names || !x->window) st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", fn);
        for (size_t i = 0; !st && i < count; i++) {
            const pr_tensor_info *ti = &x->table[i % (size_t)x->n];
            pr_st_entry *e = &x->entries[i];
            char *name = x->names + (size_t)PR__NAME_CAP * i;
            snprintf(name, PR__NAME_CAP, "%s%s", prefix[i / (size_t)x->n], ti->name);
            memset(e, 0, sizeof *e);
            e->name = name;
            e->ndim = ti->ndim;
            e->shape[0] = ti->shape[0];
            e->shape[1] = ti->shape[1];
        }
    }
    pr__gather_begin(tr, arena[0], fn, &x->g, st, st ? NULL : err);
    return x->g.st;
}

/* The chunks the writer did not read (all of them on the others), the gather's agreement over
   tp and pp, and what the export held freed. st: the write's status on the writer. */
static pr_status pr__export_end(pr_trainer *tr, pr__export *x, pr_status st, int *origin, pr_error *err) {
    while (x->g.next < tr->n_full) {
        int whole;
        pr__gather_chunk(tr, &x->g, NULL, &whole, st ? NULL : err);
    }
    const int keep = st && !x->told;       /* the writer's own failure keeps its message */
    const pr_status gst = pr__gather_end(tr, &x->g, keep ? NULL : origin, keep ? NULL : err);
    if (gst && !keep) st = gst;
    PR_FREE(x->window);
    PR_FREE(x->entries);
    PR_FREE(x->names);
    if (tr->mesh) PR_FREE(x->table);
    return st;
}

/* The end of an export: on a mesh every rank returns what world rank 0's write returned (or the
   first failure of the gathers before it), the others naming the rank where it began. */
static pr_status pr__export_done(pr_trainer *tr, pr_status st, int *origin, const char *fn, pr_error *err) {
    return tr->mesh ? pr__ranks_agree(tr, tr->mesh->world, st, origin, fn, "every rank fails the save", err) : st;
}

PRDEF pr_status pr_trainer_save(pr_trainer *tr, const char *dir, pr_dtype dtype, uint64_t max_shard_bytes, pr_error *err) {
    if (!tr || !dir) return pr__fail(err, PR_ERR_ARG, "pr_trainer_save: NULL argument");
    static const char *const prefix[1] = { "" };
    const pr_real *arena[1] = { tr->params };
    pr__export x;
    int origin = -1;
    pr_status st = pr__export_begin(tr, arena, prefix, 1, "pr_trainer_save", &x, err);
    if (!st && x.entries) {
        st = pr__checkpoint_save(dir, x.entries, x.n, dtype, max_shard_bytes, &x.src, err);
        if (!st) {
            char path[4096];
            snprintf(path, sizeof path, "%s/config.json", dir);
            st = pr_config_save(&tr->model, path, err);
        }
    }
    st = pr__export_end(tr, &x, st, &origin, err);
    return pr__export_done(tr, st, &origin, "pr_trainer_save", err);
}

PRDEF pr_status pr_trainer_save_grads(pr_trainer *tr, const char *path, pr_error *err) {
    if (!tr || !path) return pr__fail(err, PR_ERR_ARG, "pr_trainer_save_grads: NULL argument");
    static const char *const prefix[1] = { "" };
    const pr_real *arena[1] = { tr->grads };
    pr__export x;
    int origin = -1;
    pr_status st = pr__export_begin(tr, arena, prefix, 1, "pr_trainer_save_grads", &x, err);
    if (!st && x.entries)
        st = pr__safetensors_write(path, x.entries, x.n, sizeof(pr_real) == 8 ? PR_DT_F64 : PR_DT_F32, "{\"content\": \"gradients\"}",
                                   &x.src, err);
    st = pr__export_end(tr, &x, st, &origin, err);
    return pr__export_done(tr, st, &origin, "pr_trainer_save_grads", err);
}

/* ---- training state: a folder of complete states and a pointer to the current one */
#define PR__STATE_FORMAT "prefixreuse-train-state"
#define PR__STATE_REAL (sizeof(pr_real) == 8 ? PR_DT_F64 : PR_DT_F32)   /* exact: the build's own precision */
static const char *const pr__state_files[] = { "config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json",
                                                 "state_index.json" };

/* The model dimensions a state must agree on, compared before any tensor: a state of another model
   is refused by naming the first field that differs. */
static pr_status pr__state_same_model(const pr_config *have, const pr_config *want, const char *path, pr_error *err) {
    static const struct { const char *name; size_t off; } fields[] = {
        { "vocab_size", offsetof(pr_config, vocab_size) }, { "hidden_size", offsetof(pr_config, hidden_size) },
        { "intermediate_size", offsetof(pr_config, intermediate_size) }, { "num_hidden_layers", offsetof(pr_config, num_hidden_layers) },
        { "num_attention_heads", offsetof(pr_config, num_attention_heads) },
        { "num_key_value_heads", offsetof(pr_config, num_key_value_heads) }, { "head_dim", offsetof(pr_config, head_dim) },
        { "tie_word_embeddings", offsetof(pr_config, tie_word_embeddings) }, { "qk_norm", offsetof(pr_config, qk_norm) },
        { "num_experts", offsetof(pr_config, num_experts) }, { "num_experts_per_tok", offsetof(pr_config, num_experts_per_tok) },
        { "moe_intermediate_size", offsetof(pr_config, moe_intermediate_size) },
    };
    if (strcmp(have->model_type, want->model_type))
        return pr__fail(err, PR_ERR_ARG, "%s: a %s model, this trainer's is %s", path, have->model_type, want->model_type);
    for (size_t k = 0; k < sizeof fields / sizeof fields[0]; k++) {
        int a, b;
        memcpy(&a, (const char *)have + fields[k].off, sizeof a);
        memcpy(&b, (const char *)want + fields[k].off, sizeof b);
        if (a != b) return pr__fail(err, PR_ERR_ARG, "%s: %s is %d, this trainer's model has %d (a state of another shape)", path, fields[k].name, a, b);
    }
    return PR_OK;
}

static pr_status pr__state_json(const pr_train_state *s, long step, int version, pr__buf *b) {
    char line[160];
    pr__buf_str(b, "{\n  \"format\": \"" PR__STATE_FORMAT "\",\n");
    snprintf(line, sizeof line, "  \"version\": %d,\n  \"step\": %ld,\n  \"next_group\": %ld,\n  \"seed\": \"%llu\",\n",
             version, step, s->next_group, (unsigned long long)s->seed);
    pr__buf_str(b, line);
    snprintf(line, sizeof line, "  \"real\": \"%s\",\n", sizeof(pr_real) == 8 ? "F64" : "F32");
    pr__buf_str(b, line);
    const pr_adamw_opts *o = &s->adamw;
    snprintf(line, sizeof line, "  \"adamw\": {\"lr\": %.17g, \"beta1\": %.17g, \"beta2\": %.17g, \"eps\": %.17g,\n", o->lr, o->beta1,
             o->beta2, o->eps);
    pr__buf_str(b, line);
    char clip[32];                        /* infinity (never clips) as a number JSON has: 1e999 reads back as it */
    if (isinf(o->max_grad_norm)) snprintf(clip, sizeof clip, "1e999");
    else snprintf(clip, sizeof clip, "%.17g", o->max_grad_norm);
    snprintf(line, sizeof line, "            \"weight_decay\": %.17g, \"max_grad_norm\": %s}%s\n", o->weight_decay, clip,
             s->data_fingerprint ? "," : "");
    pr__buf_str(b, line);
    if (s->data_fingerprint) {   /* a string: JSON numbers are doubles to most readers */
        snprintf(line, sizeof line, "  \"data_fingerprint\": \"%016llx\"\n", (unsigned long long)s->data_fingerprint);
        pr__buf_str(b, line);
    }
    pr__buf_str(b, "}\n");
    return b->failed ? PR_ERR_NOMEM : PR_OK;
}

/* The world size a version-2 state folder was saved on (its index's mesh), 0 when it has none. */
static int pr__state_index_ranks(const char *folder) {
    char path[4400];
    pr__json *j = NULL;
    int64_t w = 0;
    pr_error e;
    snprintf(path, sizeof path, "%s/state_index.json", folder);
    if (!pr__read_json_file(path, (size_t)256 << 20, &j, &e) && !pr__json_int(pr__json_get(pr__json_get(j, "mesh"), "world"), &w)) w = 0;
    PR_FREE(j);
    return w > 0 && w < 1 << 20 ? (int)w : 0;
}

/* Removes a state folder's files and the folder (best effort: what stays is only disk space): the
   files of either layout, with the rank files of a `ranks`-rank save (0: as many as its index says). */
static void pr__state_remove(const char *folder, int ranks) {
    char path[4400];
    if (!ranks) ranks = pr__state_index_ranks(folder);
    for (size_t k = 0; k < sizeof pr__state_files / sizeof pr__state_files[0]; k++) {
        snprintf(path, sizeof path, "%s/%s", folder, pr__state_files[k]);
        remove(path);
    }
    for (int r = 0; r < ranks; r++) {
        snprintf(path, sizeof path, "%s/rank-%d-of-%d.safetensors", folder, r, ranks);
        remove(path);
    }
    remove(folder);
}

/* The name `latest` holds (a plain folder name), or "" when there is none. */
static pr_status pr__state_latest(const char *dir, char *name, size_t cap, int must, pr_error *err) {
    char path[4000], *text = NULL;
    size_t len = 0;
    uint64_t size;
    int is_dir;
    name[0] = 0;
    snprintf(path, sizeof path, "%s/latest", dir);
    if (!must && !pr__io_stat(path, &size, &is_dir)) return PR_OK;
    pr_status st = pr__read_small_file(path, 4096, &text, &len, err);
    if (st) return st;
    while (len && (text[len - 1] == '\n' || text[len - 1] == '\r' || text[len - 1] == ' ')) text[--len] = 0;
    if (!len || len >= cap || strchr(text, '/') || strchr(text, '\\') || !strcmp(text, ".") || !strcmp(text, ".."))
        st = pr__fail(err, PR_ERR_FORMAT, "%s: does not name a state folder of %s", path, dir);
    else memcpy(name, text, len + 1);
    PR_FREE(text);
    return st;
}

/* A save's folders: `final` (dir/step-N, or dir/step-N.K with K = suffix when a state of that step
   exists already) and `tmp`, the folder it is written into (final.tmp.<pid of the writer>). */
typedef struct { char old[256], name[64], final[3980], tmp[4000]; } pr__state_names;

static void pr__state_name(pr__state_names *n, const char *dir, long step, int suffix, long pid) {
    if (suffix) snprintf(n->name, sizeof n->name, "step-%08ld.%d", step, suffix);
    else snprintf(n->name, sizeof n->name, "step-%08ld", step);
    snprintf(n->final, sizeof n->final, "%s/%s", dir, n->name);
    snprintf(n->tmp, sizeof n->tmp, "%s.tmp.%ld", n->final, pid);
}

/* Creates dir (when missing) and a fresh temporary folder in it; n->old gets the current state's
   name ("" for none), *suffix the fresh name's. */
static pr_status pr__state_begin(const char *dir, long step, pr__state_names *n, int *suffix, pr_error *err) {
    pr_status st = pr__mkdir_one(dir, err);
    if (st) return st;
    if (pr__state_latest(dir, n->old, sizeof n->old, 0, err)) n->old[0] = 0;   /* a broken pointer is replaced */
    for (*suffix = 0;; ++*suffix) {
        uint64_t size;
        int is_dir;
        pr__state_name(n, dir, step, *suffix, pr__io_pid());
        if (!pr__io_stat(n->final, &size, &is_dir)) break;
    }
    return pr__mkdir_one(n->tmp, err);
}

/* config.json and trainer_state.json into the temporary folder. */
static pr_status pr__state_meta(const pr_trainer *tr, const char *tmp, const pr_train_state *state, int version,
                                pr__progress *progress, pr_error *err) {
    char path[4100];
    pr__buf b = {NULL, 0, 0, 0};
    snprintf(path, sizeof path, "%s/config.json", tmp);
    pr_status st = pr__config_json(&tr->model, &b, path, err);
    if (!st) st = pr__write_file_progress(path, b.p, b.len, progress, err);
    PR_FREE(b.p);
    memset(&b, 0, sizeof b);
    snprintf(path, sizeof path, "%s/trainer_state.json", tmp);
    if (!st && pr__state_json(state, tr->adam_step, version, &b)) st = pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path);
    if (!st) st = pr__write_file_progress(path, b.p, b.len, progress, err);
    PR_FREE(b.p);
    return st;
}

/* The commit: the complete folder into place, then `latest` replaced, then the previous state
   removed. */
static pr_status pr__state_commit(const char *dir, const pr__state_names *n, pr__progress *progress, pr_error *err) {
    char path[4200], line[80];            /* dir (at most 3900 bytes), '/', the old state's name (under 256) */
    snprintf(path, sizeof path, "%s/trainer_state.json", n->tmp);
    pr__io_sync_parent(path);
    if (!pr__io_rename(n->tmp, n->final))
        return pr__fail(err, PR_ERR_IO, "%s: cannot rename %s into place: %s", n->final, n->tmp, strerror(errno));
    pr__io_sync_parent(n->final);
    snprintf(line, sizeof line, "%s\n", n->name);
    snprintf(path, sizeof path, "%s/latest", dir);
    pr_status st = pr__write_file_progress(path, line, strlen(line), progress, err);
    if (!st && n->old[0] && strcmp(n->old, n->name)) {
        snprintf(path, sizeof path, "%s/%s", dir, n->old);
        pr__state_remove(path, 0);
    }
    return st;
}

/* One rank's whole state (version 1): full tensors, on the trainer without a mesh or with a mesh of one. */
static pr_status pr__save_state_one(pr_trainer *tr, const char *dir, const pr_train_state *state, const pr_save_opts *opts,
                                    pr_error *err) {
    static const char *const prefix[3] = { "", "exp_avg.", "exp_avg_sq." };
    const pr_real *arena[3] = { tr->params, tr->adam_m, tr->adam_v };
    pr__export x;
    char path[4100];
    pr__state_names n;
    pr__progress progress = { opts, 0 };
    pr__json *meta = NULL;
    int suffix;
    pr_status st = pr__export_begin(tr, arena, prefix, 3, "pr_trainer_save_state", &x, err);
    if (!st) st = pr__st_check_entries(x.entries, 3 * x.n, PR__STATE_REAL, dir, NULL, 1, err);
    if (!st) st = pr__st_parse_meta(&meta, "{\"format\":\"pt\"}", dir, err);
    if (!st && !(st = pr__state_begin(dir, tr->adam_step, &n, &suffix, err))) {
        snprintf(path, sizeof path, "%s/model.safetensors", n.tmp);
        st = pr__st_write(path, x.entries, x.n, PR__STATE_REAL, meta, &x.src, &progress, NULL, err);
        snprintf(path, sizeof path, "%s/optimizer.safetensors", n.tmp);    /* m and v in one file, side by side */
        if (!st) st = pr__st_write(path, x.entries + x.n, 2 * x.n, PR__STATE_REAL, meta, &x.src, &progress, NULL, err);
        if (!st) st = pr__state_meta(tr, n.tmp, state, 1, &progress, err);
        if (!st) st = pr__state_commit(dir, &n, &progress, err);
        if (st) pr__state_remove(n.tmp, 0);          /* nothing half-written stays behind */
    }
    PR_FREE(meta);
    return pr__export_end(tr, &x, st, NULL, err);
}

/* ---- a state on a mesh (version 2): each rank's own pieces, an index of them */
static const char *const pr__state_kind[3] = { "param", "exp_avg", "exp_avg_sq" };
static const char *const pr__state_prefix[3] = { "", "exp_avg.", "exp_avg_sq." };
/* What the ranks tell world rank 0 for its index, per full tensor and rank: the rows and columns
   [first, end) of the rank's rectangle, then for each kind the elements [first, end) of its piece
   in the rectangle's row-major order (empty: the rank writes none). */
#define PR__PIECE_NUMS 10

/* The elements of local tensor i in this rank's slice (sliced; else all of them), [*e0, *e1) in its
   rectangle's row-major order. A rank holds its slice of the master weights, m and v (under ZeRO
   1/dp of them, else all), and reads the whole of its weights from a state (the weights the
   kernels read are whole on every rank). */
static void pr__state_held(const pr_trainer *tr, int i, int sliced, size_t *e0, size_t *e1) {
    const pr_tensor_info *t = &tr->tensors[i];
    size_t lo = t->offset, hi = t->offset + t->numel;
    if (sliced) {
        if (lo < tr->slice_lo) lo = tr->slice_lo;
        if (hi > tr->slice_lo + tr->slice_n) hi = tr->slice_lo + tr->slice_n;
    }
    *e0 = lo < hi ? lo - t->offset : 0;
    *e1 = lo < hi ? hi - t->offset : 0;
}

/* Whether this rank writes its pieces of local tensor i: of the ranks holding the same values (the
   replicas of a TP shard, the cp ranks, the dp ranks unless ZeRO slices the state over them) the
   lowest, the one that counts. */
static int pr__state_writes(const pr_trainer *tr, int i) {
    const pr_mesh *m = tr->mesh;
    return !tr->shard[i].elsewhere && m->cp_rank == 0 && (m->dp_rank == 0 || tr->zero);
}

/* state_index.json from the ranks' table (see PR__PIECE_NUMS). */
static void pr__state_index_json(const pr_trainer *tr, const pr_tensor_info *ft, int count, const double *tab, pr__buf *b) {
    const pr_mesh *m = tr->mesh;
    const int W = m->world->size;
    char line[600];
    pr__buf_str(b, "{\n  \"format\": \"prefixreuse-train-state-index\",\n");
    snprintf(line, sizeof line, "  \"mesh\": {\"world\": %d, \"dp\": %d, \"pp\": %d, \"cp\": %d, \"tp\": %d, \"ep\": %d, \"zero\": %d},\n  \"files\": [",
             W, m->dp, m->pp, m->cp, m->tp, m->ep, tr->zero);
    pr__buf_str(b, line);
    for (int r = 0; r < W; r++) {
        snprintf(line, sizeof line, "%s\"rank-%d-of-%d.safetensors\"", r ? ", " : "", r, W);
        pr__buf_str(b, line);
    }
    pr__buf_str(b, "],\n  \"tensors\": [");
    for (int j = 0; j < count; j++) {
        const pr_tensor_info *t = &ft[j];
        if (t->ndim == 2) snprintf(line, sizeof line, "%s\n    {\"name\": \"%s\", \"shape\": [%lld, %lld], \"pieces\": [", j ? "," : "",
                                   t->name, (long long)t->shape[0], (long long)t->shape[1]);
        else snprintf(line, sizeof line, "%s\n    {\"name\": \"%s\", \"shape\": [%lld], \"pieces\": [", j ? "," : "", t->name, (long long)t->shape[0]);
        pr__buf_str(b, line);
        int first = 1;
        for (int kind = 0; kind < 3; kind++)
            for (int r = 0; r < W; r++) {
                const double *p = tab + ((size_t)j * (size_t)W + (size_t)r) * PR__PIECE_NUMS;
                if (p[4 + 2 * kind] == p[5 + 2 * kind]) continue;
                snprintf(line, sizeof line,
                         "%s\n      {\"kind\": \"%s\", \"file\": \"rank-%d-of-%d.safetensors\", \"key\": \"%s%s\", \"rows\": [%.0f, %.0f], "
                         "\"cols\": [%.0f, %.0f], \"elements\": [%.0f, %.0f]}",
                         first ? "" : ",", pr__state_kind[kind], r, W, pr__state_prefix[kind], t->name, p[0], p[1], p[2], p[3],
                         p[4 + 2 * kind], p[5 + 2 * kind]);
                pr__buf_str(b, line);
                first = 0;
            }
        pr__buf_str(b, "]}");
    }
    pr__buf_str(b, "\n  ]\n}\n");
}

/* A collective over world of n doubles, summed, through backend memory. */
static pr_status pr__state_sum(const pr_trainer *tr, double *host, double *dev, size_t n, pr_error *err) {
    const pr_backend *be = tr->be;
    pr_comm *w = tr->mesh->world;
    be->copy(be, dev, host, sizeof(double) * n);
    be->sync(be);
    pr_status st = w->all_reduce(w, dev, n, PR_COMM_F64, err);
    be->copy(be, host, dev, sizeof(double) * n);
    be->sync(be);
    return st;
}

static pr_status pr__save_state_ranks(pr_trainer *tr, const char *dir, const pr_train_state *state, const pr_save_opts *opts,
                                      pr_error *err) {
    const pr_backend *be = tr->be;
    const int W = tr->mesh->world->size, me = tr->mesh->world->rank, nt = tr->n_tensors;
    int count, suffix = 0;
    pr_tensor_info *ft = pr__full_table(tr, &count, NULL);
    const size_t n_tab = 3 + (size_t)count * (size_t)W * PR__PIECE_NUMS;   /* 3: failures, name suffix, rank 0's pid */
    double *tab = (double *)PR_MALLOC(sizeof(double) * n_tab);
    double *dev = (double *)be->alloc(be, sizeof(double) * n_tab, PR_TIER_DEVICE);
    pr_real *host[3];
    for (int k = 0; k < 3; k++) host[k] = (pr_real *)PR_MALLOC(sizeof(pr_real) * (tr->slice_n + 1));
    pr_st_entry *en = (pr_st_entry *)PR_MALLOC(sizeof(pr_st_entry) * 3 * (size_t)nt);
    char *names = (char *)PR_MALLOC((size_t)PR__NAME_CAP * 3 * (size_t)nt), path[4100];
    int n_en = 0, began = 0;
    pr__state_names n;
    pr__progress progress = { opts, 0 };
    pr__json *meta = NULL;
    pr__buf index = {NULL, 0, 0, 0};
    pr_status st = PR_OK, cs;
    if (!ft || !tab || !dev || !host[0] || !host[1] || !host[2] || !en || !names)
        st = pr__fail(err, PR_ERR_NOMEM, "pr_trainer_save_state: out of memory for this rank's state");
    if ((st = pr__ranks_agree(tr, tr->mesh->world, st, NULL, "pr_trainer_save_state", "no rank saves", err)))
        goto release;
    memset(tab, 0, sizeof(double) * n_tab);
    be->download_reals(be, host[0], tr->params, tr->slice_n);
    be->download_reals(be, host[1], tr->adam_m, tr->slice_n);
    be->download_reals(be, host[2], tr->adam_v, tr->slice_n);
    for (int i = 0, j = 0; i < nt; i++) {
        const pr_tensor_info *t = &tr->tensors[i];
        while (strcmp(ft[j].name, t->name)) j++;          /* the local tensors are a subsequence of the full list */
        double *p = tab + 3 + ((size_t)j * (size_t)W + (size_t)me) * PR__PIECE_NUMS;
        int64_t r[4];
        pr__shard_rect(tr, i, r);
        for (int k = 0; k < 4; k++) p[k] = (double)r[k];
        for (int kind = 0; kind < 3; kind++) {
            size_t e0, e1;
            pr__state_held(tr, i, 1, &e0, &e1);
            if (e0 == e1 || !pr__state_writes(tr, i)) continue;
            p[4 + 2 * kind] = (double)e0;
            p[5 + 2 * kind] = (double)e1;
            pr_st_entry *e = &en[n_en];
            char *nm = names + (size_t)PR__NAME_CAP * (size_t)n_en++;
            snprintf(nm, PR__NAME_CAP, "%s%s", pr__state_prefix[kind], t->name);
            memset(e, 0, sizeof *e);
            e->name = nm;
            e->data = host[kind] + t->offset + e0 - tr->slice_lo;
            e->ndim = 1;
            e->shape[0] = (int64_t)(e1 - e0);
        }
    }
    /* rank 0 makes the temporary folder; its name and every rank's pieces go round, with failures */
    if (me == 0) st = pr__state_begin(dir, tr->adam_step, &n, &suffix, err);
    began = me == 0 && !st;      /* rank 0 made the temporary folder */
    tab[0] = st;          /* rank 0's alone: the others' st is PR_OK here */
    tab[1] = me ? 0 : suffix;
    tab[2] = me ? 0 : (double)pr__io_pid();
    cs = pr__state_sum(tr, tab, dev, n_tab, st ? NULL : err);
    if (!st) st = cs;
    if (!st && tab[0] > 0)
        st = pr__fail(err, (pr_status)tab[0], "pr_trainer_save_state: world rank 0 could not create the state folder (status %d; its own "
                      "error says why)", (int)tab[0]);
    if (st) {
        if (began) pr__state_remove(n.tmp, W);
        goto release;
    }
    if (me) pr__state_name(&n, dir, tr->adam_step, (int)tab[1], (long)tab[2]);
    /* each rank its own file, in parallel; rank 0 the index and the run's files */
    snprintf(path, sizeof path, "%s/rank-%d-of-%d.safetensors", n.tmp, me, W);
    st = pr__st_check_entries(en, n_en, PR__STATE_REAL, path, NULL, 0, err);
    if (!st) st = pr__st_parse_meta(&meta, "{\"format\":\"pt\"}", path, err);
    if (!st) st = pr__st_write(path, en, n_en, PR__STATE_REAL, meta, NULL, &progress, NULL, err);
    if (!st && me == 0) {
        pr__state_index_json(tr, ft, count, tab + 3, &index);
        snprintf(path, sizeof path, "%s/state_index.json", n.tmp);
        st = index.failed ? pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path) : pr__write_file_progress(path, index.p, index.len, &progress, err);
        if (!st) st = pr__state_meta(tr, n.tmp, state, 2, &progress, err);
    }
    /* every file on disk: rank 0 commits; then every rank learns how that went */
    st = pr__ranks_agree(tr, tr->mesh->world, st, NULL, "pr_trainer_save_state", "the state is not committed", err);
    if (me == 0) {
        if (!st) st = pr__state_commit(dir, &n, &progress, err);
        if (st) pr__state_remove(n.tmp, W);              /* nothing half-written stays behind */
    }
    st = pr__ranks_agree(tr, tr->mesh->world, st, NULL, "pr_trainer_save_state", "the state is not in place", err);
release:
    PR_FREE(index.p);
    PR_FREE(meta);
    PR_FREE(names);
    PR_FREE(en);
    for (int k = 0; k < 3; k++) PR_FREE(host[k]);
    if (dev) be->release(be, dev, PR_TIER_DEVICE);
    PR_FREE(tab);
    PR_FREE(ft);
    return st;
}

PRDEF pr_status pr_trainer_save_state(pr_trainer *tr, const char *dir, const pr_train_state *state, const pr_save_opts *opts,
                                      pr_error *err) {
    if (!tr || !dir || !dir[0] || !state) return pr__fail(err, PR_ERR_ARG, "pr_trainer_save_state: NULL argument");
    if (strlen(dir) > 3900) return pr__fail(err, PR_ERR_ARG, "pr_trainer_save_state: path too long");
    /* what the load would refuse, or trainer_state.json could not hold, refused before anything is written */
    if (state->next_group < 0) return pr__fail(err, PR_ERR_ARG, "pr_trainer_save_state: next_group %ld (must be >= 0)", state->next_group);
    const pr_status ast = pr__adamw_check(&state->adamw, err);
    if (ast) return ast;
    if (tr->mesh && tr->mesh->world->size > 1) return pr__save_state_ranks(tr, dir, state, opts, err);
    return pr__save_state_one(tr, dir, state, opts, err);
}
/* n decimal digits (and nothing else) of a value below 2^64 into *out; 0 otherwise. */
static int pr__u64_decimal(const char *s, size_t n, uint64_t *out) {
    uint64_t v = 0;
    if (n == 0 || strlen(s) != n) return 0;
    for (size_t i = 0; i < n; i++) {
        const unsigned d = (unsigned)(s[i] - '0');
        if (d > 9 || v > (UINT64_MAX - d) / 10) return 0;
        v = 10 * v + d;
    }
    *out = v;
    return 1;
}

/* trainer_state.json: the format and version first, so that another file or an older state is
   named as such. */
static pr_status pr__state_parse(const char *path, pr_train_state *s, int *version_out, pr_error *err) {
    pr__json *j = NULL;
    pr_status st = pr__read_json_file(path, (size_t)1 << 20, &j, err);
    if (st) return st;
    const pr__json *f = pr__json_get(j, "format"), *a = pr__json_get(j, "adamw"), *seed = pr__json_get(j, "seed");
    const pr__json *real = pr__json_get(j, "real"), *data = pr__json_get(j, "data_fingerprint");
    int64_t version = 0, step = -1, next = -1;
    uint64_t seed_value = 0;
    if (!f || f->type != PR__JSON_STRING || strcmp(f->str, PR__STATE_FORMAT))
        st = pr__fail(err, PR_ERR_FORMAT, "%s: not a prefixreuse training state (its \"format\" is %s%s%s, expected \"" PR__STATE_FORMAT "\")",
                      path, f && f->type == PR__JSON_STRING ? "\"" : "", f && f->type == PR__JSON_STRING ? f->str : pr__json_type_name(f),
                      f && f->type == PR__JSON_STRING ? "\"" : "");
    else if (!pr__json_int(pr__json_get(j, "version"), &version) || version < 1)
        st = pr__fail(err, PR_ERR_FORMAT, "%s: \"version\" must be a positive integer", path);
    else if (version > PR_TRAIN_STATE_VERSION)
        st = pr__fail(err, PR_ERR_UNSUPPORTED, "%s: training state format version %lld is newer; this build reads versions 1 to %d", path,
                      (long long)version, PR_TRAIN_STATE_VERSION);
    /* both kept in a long (32 bits on some platforms), and the step counted on from there */
    else if (!pr__json_int(pr__json_get(j, "step"), &step) || step < 0 || step >= LONG_MAX ||
             !pr__json_int(pr__json_get(j, "next_group"), &next) || next < 0 || next > LONG_MAX)
        st = pr__fail(err, PR_ERR_FORMAT, "%s: \"step\" and \"next_group\" must be integers >= 0 that a long holds (step below its largest)",
                      path);
    else if (!real || real->type != PR__JSON_STRING || strcmp(real->str, sizeof(pr_real) == 8 ? "F64" : "F32"))
        st = pr__fail(err, PR_ERR_UNSUPPORTED, "%s: saved by a %s build; this build is %s (resume in the same precision)", path,
                      real && real->type == PR__JSON_STRING ? real->str : "?", sizeof(pr_real) == 8 ? "F64" : "F32");
    else if (!seed || seed->type != PR__JSON_STRING || !pr__u64_decimal(seed->str, seed->count, &seed_value))
        st = pr__fail(err, PR_ERR_FORMAT, "%s: \"seed\" must be a string of decimal digits, at most 2^64 - 1", path);
    else if (!a || a->type != PR__JSON_OBJECT)
        st = pr__fail(err, PR_ERR_FORMAT, "%s: \"adamw\" must be an object", path);
    else if (data && (data->type != PR__JSON_STRING || data->count != 16 || strspn(data->str, "0123456789abcdef") != 16))
        st = pr__fail(err, PR_ERR_FORMAT, "%s: \"data_fingerprint\" must be a string of 16 lower-case hex digits", path);
    if (!st) {
        static const char *const keys[6] = { "lr", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm" };
        double *dst[6] = { &s->adamw.lr, &s->adamw.beta1, &s->adamw.beta2, &s->adamw.eps, &s->adamw.weight_decay, &s->adamw.max_grad_norm };
        for (int k = 0; k < 6 && !st; k++) {
            const pr__json *v = pr__json_get(a, keys[k]);
            if (!v || v->type != PR__JSON_NUMBER) st = pr__fail(err, PR_ERR_FORMAT, "%s: \"adamw\".\"%s\" must be a number", path, keys[k]);
            else *dst[k] = v->num;
        }
        s->step = (long)step;
        s->next_group = (long)next;
        s->seed = seed_value;
        s->data_fingerprint = data ? strtoull(data->str, NULL, 16) : 0;
        *version_out = (int)version;
    }
    PR_FREE(j);
    return st;
}


/* One piece of a version-2 state, from its index: of kind `kind` of a full tensor, the elements
   [el[0], el[1]) (row-major) of its rectangle rows [rows[0], rows[1]), columns [cols[0], cols[1]),
   held in tensor `key` of file `file`. */
typedef struct { int kind, file; const pr_st_tensor *key; int64_t rows[2], cols[2], el[2]; } pr__piece;

typedef struct {
    char path[4300];          /* the index, for messages */
    pr__json *root;
    int n_files;
    pr_checkpoint **ck;       /* (n_files) headers */
    FILE **fh;                /* (n_files) opened at the first read */
    unsigned char *buf;       /* a read's bytes */
    pr__piece *pieces;
    int *first, *n_of;        /* (count) full tensor j's pieces: pieces[first[j] .. first[j] + n_of[j]) */
} pr__state_index;

#define PR__STATE_READ_CHUNK ((size_t)1 << 20)

static void pr__state_index_close(pr__state_index *ix) {
    for (int f = 0; f < ix->n_files; f++) {
        if (ix->ck && ix->ck[f]) pr_checkpoint_close(ix->ck[f]);
        if (ix->fh && ix->fh[f]) fclose(ix->fh[f]);
    }
    PR_FREE(ix->ck);
    PR_FREE(ix->fh);
    PR_FREE(ix->buf);
    PR_FREE(ix->pieces);
    PR_FREE(ix->first);
    PR_FREE(ix->n_of);
    PR_FREE(ix->root);
}

/* A [first, end) pair of integers. */
static int pr__json_range(const pr__json *a, int64_t out[2]) {
    const pr__json *x = pr__json_first(a);
    return a && a->type == PR__JSON_ARRAY && a->count == 2 && pr__json_int(x, &out[0]) && pr__json_int(pr__json_next(x), &out[1]) &&
           out[0] >= 0 && out[0] < out[1];
}

/* Reads and checks state_index.json against the model's full tensors ft: every tensor once, of the
   model's shape, each kind's pieces inside it, in a listed file under their key with their length,
   and as many elements as the tensor has (a missing piece is refused here, on every rank alike). */
static pr_status pr__state_index_open(pr__state_index *ix, const char *folder, const pr_tensor_info *ft, int count, pr_error *err) {
    char file[4400];
    const char *path = ix->path;
    memset(ix, 0, sizeof *ix);
    snprintf(ix->path, sizeof ix->path, "%s/state_index.json", folder);
    pr_status st = pr__read_json_file(path, (size_t)256 << 20, &ix->root, err);
    if (st) return st;
    const pr__json *fmt = pr__json_get(ix->root, "format"), *files = pr__json_get(ix->root, "files"), *tensors = pr__json_get(ix->root, "tensors");
    if (!fmt || fmt->type != PR__JSON_STRING || strcmp(fmt->str, "prefixreuse-train-state-index"))
        return pr__fail(err, PR_ERR_FORMAT, "%s: not a training state index (\"format\" is not \"prefixreuse-train-state-index\")", path);
    if (!files || files->type != PR__JSON_ARRAY || !files->count || !tensors || tensors->type != PR__JSON_ARRAY)
        return pr__fail(err, PR_ERR_FORMAT, "%s: \"files\" and \"tensors\" must be arrays, \"files\" not empty", path);
    if ((int)tensors->count != count)
        return pr__fail(err, PR_ERR_ARG, "%s: holds %u tensors, the model has %d (a state of another model)", path, tensors->count, count);
    ix->n_files = (int)files->count;
    ix->ck = (pr_checkpoint **)PR_MALLOC(sizeof(pr_checkpoint *) * files->count);
    ix->fh = (FILE **)PR_MALLOC(sizeof(FILE *) * files->count);
    ix->buf = (unsigned char *)PR_MALLOC(PR__STATE_READ_CHUNK);
    ix->first = (int *)PR_MALLOC(sizeof(int) * (size_t)count);
    ix->n_of = (int *)PR_MALLOC(sizeof(int) * (size_t)count);
    if (!ix->ck || !ix->fh || !ix->buf || !ix->first || !ix->n_of) {
        ix->n_files = 0;
        return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path);
    }
    memset(ix->ck, 0, sizeof(pr_checkpoint *) * files->count);
    memset(ix->fh, 0, sizeof(FILE *) * files->count);
    for (int j = 0; j < count; j++) ix->n_of[j] = -1;
    const pr__json *f = pr__json_first(files);
    for (int k = 0; k < ix->n_files && !st; k++, f = pr__json_next(f)) {     /* every file's header, on every rank */
        if (f->type != PR__JSON_STRING || !pr__st_plain_name(f->str, f->count))
            return pr__fail(err, PR_ERR_FORMAT, "%s: \"files\" entry %d is not a plain file name", path, k);
        if ((size_t)snprintf(file, sizeof file, "%s/%s", folder, f->str) >= sizeof file)
            return pr__fail(err, PR_ERR_FORMAT, "%s: \"files\" entry %d is too long a name", path, k);
        st = pr_checkpoint_open(&ix->ck[k], file, err);
        /* a piece is read from its entry's one file (pr__state_read_run): an index or a folder of
           shards is not what a state holds */
        if (!st && ix->ck[k]->n_files != 1)
            return pr__fail(err, PR_ERR_FORMAT, "%s: \"files\" entry %d (%s) is %d files, not one .safetensors file", path, k, f->str,
                            ix->ck[k]->n_files);
    }
    if (st) return st;
    size_t n_pieces = 0;
    const pr__json *te = pr__json_first(tensors);
    for (uint32_t k = 0; k < tensors->count; k++, te = pr__json_next(te)) {
        const pr__json *p = pr__json_get(te, "pieces");
        if (!p || p->type != PR__JSON_ARRAY) return pr__fail(err, PR_ERR_FORMAT, "%s: tensor entry %u has no \"pieces\" array", path, k);
        n_pieces += p->count;
    }
    ix->pieces = (pr__piece *)PR_MALLOC(sizeof(pr__piece) * (n_pieces + 1));
    if (!ix->pieces) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory", path);
    int at = 0;
    te = pr__json_first(tensors);
    for (uint32_t k = 0; k < tensors->count; k++, te = pr__json_next(te)) {
        const pr__json *nm = pr__json_get(te, "name"), *shape = pr__json_get(te, "shape"), *pl = pr__json_get(te, "pieces");
        int j = 0;
        while (nm && nm->type == PR__JSON_STRING && j < count && strcmp(ft[j].name, nm->str)) j++;
        if (!nm || nm->type != PR__JSON_STRING || j == count)
            return pr__fail(err, PR_ERR_ARG, "%s: tensor entry %u (%s) is not a tensor of this model", path, k,
                            nm && nm->type == PR__JSON_STRING ? nm->str : "no name");
        if (ix->n_of[j] >= 0) return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s is listed twice", path, ft[j].name);
        const pr_tensor_info *t = &ft[j];
        int same = shape && shape->type == PR__JSON_ARRAY && (int)shape->count == t->ndim;
        int64_t have[2] = { 0, 0 };
        const pr__json *d = pr__json_first(shape);
        for (int q = 0; same && q < t->ndim; q++, d = pr__json_next(d)) same = pr__json_int(d, &have[q]) && have[q] == t->shape[q];
        if (!same) {
            char want[128];
            pr__shape_text(want, sizeof want, t->ndim, t->shape);
            return pr__fail(err, PR_ERR_ARG, "%s: tensor %s has another shape than the model's %s (a state of another shape)", path, t->name, want);
        }
        const int64_t R = t->shape[0], C = t->ndim == 2 ? t->shape[1] : 1;
        int64_t held[3] = { 0, 0, 0 };
        ix->first[j] = at;
        ix->n_of[j] = (int)pl->count;
        const pr__json *pj = pr__json_first(pl);
        for (uint32_t q = 0; q < pl->count; q++, pj = pr__json_next(pj)) {
            pr__piece *pc = &ix->pieces[at++];
            const pr__json *kind = pr__json_get(pj, "kind"), *fl = pr__json_get(pj, "file"), *key = pr__json_get(pj, "key");
            pc->kind = -1;
            for (int c = 0; c < 3 && kind && kind->type == PR__JSON_STRING; c++)
                if (!strcmp(kind->str, pr__state_kind[c])) pc->kind = c;
            pc->file = -1;
            f = pr__json_first(files);
            for (int c = 0; c < ix->n_files && fl && fl->type == PR__JSON_STRING; c++, f = pr__json_next(f))
                if (!strcmp(fl->str, f->str)) pc->file = c;
            if (pc->kind < 0 || pc->file < 0 || !key || key->type != PR__JSON_STRING || !pr__json_range(pr__json_get(pj, "rows"), pc->rows) ||
                !pr__json_range(pr__json_get(pj, "cols"), pc->cols) || !pr__json_range(pr__json_get(pj, "elements"), pc->el) ||
                pc->rows[1] > R || pc->cols[1] > C || pc->el[1] > (pc->rows[1] - pc->rows[0]) * (pc->cols[1] - pc->cols[0]))
                return pr__fail(err, PR_ERR_FORMAT, "%s: tensor %s: piece %u needs a kind (param, exp_avg, exp_avg_sq), a listed file, a key, "
                                "and rows, cols and elements [first, end) inside the tensor", path, t->name, q);
            pc->key = pr_checkpoint_find(ix->ck[pc->file], key->str);
            if (!pc->key || pc->key->ndim != 1 || pc->key->shape[0] != pc->el[1] - pc->el[0])
                return pr__fail(err, PR_ERR_ARG, "%s: tensor %s: %s %s in %s (a piece of %lld elements)", path, t->name,
                                pc->key ? "the piece's key has another length:" : "missing piece", key->str, fl->str,
                                (long long)(pc->el[1] - pc->el[0]));
            held[pc->kind] += pc->el[1] - pc->el[0];
        }
        for (int c = 0; c < 3; c++)
            if (held[c] != R * C)
                return pr__fail(err, PR_ERR_ARG, "%s: tensor %s: its %s pieces hold %lld elements, the tensor has %lld (a piece missing or one "
                                "too many)", path, t->name, pr__state_kind[c], (long long)held[c], (long long)(R * C));
    }
    return PR_OK;
}

/* n elements from element `from` of piece p's key into dst. */
static pr_status pr__state_read_run(pr__state_index *ix, const pr__piece *p, int64_t from, int64_t n, pr_real *dst, pr_error *err) {
    const pr_checkpoint *ck = ix->ck[p->file];
    const char *path = ck->paths[0];
    const size_t es = (size_t)pr__dtype_size(p->key->dtype);
    if (!ix->fh[p->file] && !(ix->fh[p->file] = fopen(path, "rb"))) return pr__fail(err, PR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    FILE *fh = ix->fh[p->file];
    if (!pr__io_seek(fh, ck->data_start[0] + p->key->begin + (uint64_t)from * es))
        return pr__fail(err, PR_ERR_IO, "%s: cannot seek in tensor %s", path, p->key->name);
    for (size_t done = 0, total = (size_t)n; done < total;) {
        size_t now = total - done < PR__STATE_READ_CHUNK / 8 ? total - done : PR__STATE_READ_CHUNK / 8;
        if (fread(ix->buf, es, now, fh) != now) return pr__fail(err, PR_ERR_IO, "%s: read error in tensor %s", path, p->key->name);
        pr__st_convert(dst + done, ix->buf, now, p->key->dtype);
        done += now;
    }
    return PR_OK;
}

/* This rank's part of kind `kind` of local tensor i (full tensor j) from the pieces into host (a
   copy of the local arena for the weights; for m and v of its slice), row by row of its rectangle, checking that
   the pieces cover each row's part exactly once (no column twice, none left out). Reads
   contiguous in both the file and host merge into one. */
static pr_status pr__state_read_part(const pr_trainer *tr, pr__state_index *ix, int i, int j, int kind, pr_real *host, pr_error *err) {
    const pr_tensor_info *t = &tr->tensors[i];
    int64_t r[4];
    size_t e0, e1;
    pr__shard_rect(tr, i, r);
    pr__state_held(tr, i, kind != 0, &e0, &e1);
    const int64_t cols = r[3] - r[2];
    pr_real *base = host + t->offset - (kind ? tr->slice_lo : 0);    /* the tensor's element e at base[e] */
    unsigned char *taken = (unsigned char *)PR_MALLOC((size_t)cols + 1);  /* the row's columns a piece gave */
    if (!taken) return pr__fail(err, PR_ERR_NOMEM, "%s: out of memory for a row of %lld columns", ix->path, (long long)cols);
    const pr__piece *run = NULL;
    int64_t run_from = 0, run_n = 0;
    pr_real *run_dst = NULL;
    pr_status st = PR_OK;
    for (int64_t lr = (int64_t)e0 / cols; lr * cols < (int64_t)e1 && !st; lr++) {
        const int64_t a = (int64_t)e0 > lr * cols ? (int64_t)e0 - lr * cols : 0;
        const int64_t b = (int64_t)e1 < (lr + 1) * cols ? (int64_t)e1 - lr * cols : cols;
        const int64_t R = r[0] + lr, c0 = r[2] + a, c1 = r[2] + b;       /* the full tensor's row R, columns [c0, c1) */
        int64_t covered = 0;
        memset(taken + a, 0, (size_t)(b - a));
        for (int q = ix->first[j]; q < ix->first[j] + ix->n_of[j] && !st; q++) {
            const pr__piece *p = &ix->pieces[q];
            if (p->kind != kind || R < p->rows[0] || R >= p->rows[1]) continue;
            const int64_t pc = p->cols[1] - p->cols[0], at = (R - p->rows[0]) * pc;   /* row R's first element in the piece's rectangle */
            int64_t x0 = p->cols[0] + (p->el[0] > at ? p->el[0] - at : 0), x1 = p->cols[0] + (p->el[1] - at < pc ? p->el[1] - at : pc);
            if (x0 < c0) x0 = c0;
            if (x1 > c1) x1 = c1;
            if (x0 >= x1) continue;
            for (int64_t x = x0; x < x1 && !st; x++)
                if (taken[x - r[2]]++)
                    st = pr__fail(err, PR_ERR_ARG, "%s: tensor %s: two of its %s pieces give row %lld, column %lld (an overlap)", ix->path,
                                  t->name, pr__state_kind[kind], (long long)R, (long long)x);
            if (st) break;
            covered += x1 - x0;
            const int64_t from = at + (x0 - p->cols[0]) - p->el[0];
            pr_real *dst = base + lr * cols + (x0 - r[2]);
            if (run == p && from == run_from + run_n && dst == run_dst + run_n) {
                run_n += x1 - x0;
                continue;
            }
            if (run) st = pr__state_read_run(ix, run, run_from, run_n, run_dst, err);
            run = p, run_from = from, run_n = x1 - x0, run_dst = dst;
        }
        if (!st && covered != c1 - c0)
            st = pr__fail(err, PR_ERR_ARG, "%s: tensor %s: its %s pieces cover %lld of the %lld elements this rank needs in row %lld "
                          "(a hole)", ix->path, t->name, pr__state_kind[kind], (long long)covered, (long long)(c1 - c0), (long long)R);
    }
    if (!st && run) st = pr__state_read_run(ix, run, run_from, run_n, run_dst, err);
    PR_FREE(taken);
    return st;
}

/* A version-2 state's parameters, m and v into host copies of this rank's arenas (parameters:
   n_params; m and v: its slice), each piece read where it overlaps this rank's part. */
static pr_status pr__load_state_ranks(pr_trainer *tr, const char *folder, pr_real *const host[3], pr_error *err) {
    int count;
    pr_tensor_info *ft = pr__table_of(tr, &count);
    pr__state_index ix;
    memset(&ix, 0, sizeof ix);
    pr_status st = ft ? pr__state_index_open(&ix, folder, ft, count, err) : pr__fail(err, PR_ERR_NOMEM, "pr_trainer_load_state: out of memory");
    for (int i = 0, j = 0; i < tr->n_tensors && !st; i++) {
        while (strcmp(ft[j].name, tr->tensors[i].name)) j++;       /* the local tensors are a subsequence of the full list */
        for (int kind = 0; kind < 3 && !st; kind++) st = pr__state_read_part(tr, &ix, i, j, kind, host[kind], err);
    }
    pr__state_index_close(&ix);
    if (tr->mesh) PR_FREE(ft);
    return st;
}
/* A version-1 state (the full model's tensors) into host (pr__load_state_read's): each of its
   tensors checked, and only this rank's part of each read (pr__read_local), host[0] the scratch of
   m's and v's before it takes the parameters. */
static pr_status pr__load_state_v1(pr_trainer *tr, const char *folder, pr_real *host[3], pr_error *err) {
    char path[4300];
    pr_checkpoint *ck = NULL;
    snprintf(path, sizeof path, "%s/optimizer.safetensors", folder);
    int count = 0;
    pr_status st = pr_checkpoint_open(&ck, path, err);
    for (int k = 1; k < 3 && !st; k++)          /* m and v share one file: each read through its prefix, then the count checked */
        if (!(st = pr__read_local(tr, ck, path, k == 1 ? "exp_avg." : "exp_avg_sq.", 0, host[0], &count, err)))
            memcpy(host[k], host[0] + tr->slice_lo, sizeof(pr_real) * tr->slice_n);
    if (!st && pr_checkpoint_count(ck) != 2 * count)
        st = pr__fail(err, PR_ERR_ARG, "%s: holds %d tensors, the model's moments are %d (a state of another model)", path,
                      pr_checkpoint_count(ck), 2 * count);
    if (ck) pr_checkpoint_close(ck);
    snprintf(path, sizeof path, "%s/model.safetensors", folder);
    if (!st && !(st = pr_checkpoint_open(&ck, path, err))) {
        st = pr__read_local(tr, ck, path, "", 1, host[0], &count, err);
        pr_checkpoint_close(ck);
    }
    return st;
}

/* The state folder of dir (dir itself, or the one its latest names) into folder (4200 bytes) and
   its trainer_state.json parsed into *s; fn names the caller in messages. */
static pr_status pr__state_record(const char *dir, const char *fn, char *folder, pr_train_state *s, int *version, pr_error *err) {
    if (!dir) return pr__fail(err, PR_ERR_ARG, "%s: NULL argument", fn);
    if (strlen(dir) > 3900) return pr__fail(err, PR_ERR_ARG, "%s: path too long", fn);
    char path[4300], name[256];
    uint64_t size;
    int is_dir;
    snprintf(path, sizeof path, "%s/trainer_state.json", dir);
    if (pr__io_stat(path, &size, &is_dir)) snprintf(folder, 4200, "%s", dir);    /* one state folder */
    else {
        snprintf(folder, 4200, "%s/latest", dir);
        if (!pr__io_stat(folder, &size, &is_dir))
            return pr__fail(err, PR_ERR_IO, "%s: %s holds no training state: neither %s (a state's folder) nor %s (the folder a save "
                            "was given)", fn, dir, path, folder);
        pr_status st = pr__state_latest(dir, name, sizeof name, 1, err);
        if (st) return st;
        snprintf(folder, 4200, "%s/%s", dir, name);
    }
    snprintf(path, sizeof path, "%s/trainer_state.json", folder);
    return pr__state_parse(path, s, version, err);
}

PRDEF pr_status pr_train_state_read(const char *dir, char *folder, size_t cap, pr_train_state *state, pr_error *err) {
    char at[4200];
    pr_train_state s;
    int version;
    memset(&s, 0, sizeof s);
    pr_status st = pr__state_record(dir, "pr_train_state_read", at, &s, &version, err);
    if (st) return st;
    if (folder && strlen(at) >= cap)
        return pr__fail(err, PR_ERR_ARG, "pr_train_state_read: the state folder's path (%zu bytes) does not fit in %zu", strlen(at) + 1, cap);
    if (folder) memcpy(folder, at, strlen(at) + 1);
    if (state) *state = s;
    return PR_OK;
}

/* Reads and checks the state at dir (one state folder, or the latest in a run's folder) into *s and
   host copies of this rank's arenas (pr__load_state_v1's), the trainer untouched. */
static pr_status pr__load_state_read(pr_trainer *tr, const char *dir, pr_train_state *s, pr_real *host[3], pr_error *err) {
    char folder[4200], path[4300];
    int version = 0;
    pr_status st = pr__state_record(dir, "pr_trainer_load_state", folder, s, &version, err);
    if (st) return st;
    pr_config cfg;
    snprintf(path, sizeof path, "%s/config.json", folder);
    if ((st = pr_config_load(&cfg, path, err)) || (st = pr__state_same_model(&cfg, &tr->model, path, err))) return st;
    host[0] = (pr_real *)PR_MALLOC(sizeof(pr_real) * (tr->n_params + 1));
    host[1] = (pr_real *)PR_MALLOC(sizeof(pr_real) * (tr->slice_n + 1));
    host[2] = (pr_real *)PR_MALLOC(sizeof(pr_real) * (tr->slice_n + 1));
    if (!host[0] || !host[1] || !host[2]) return pr__fail(err, PR_ERR_NOMEM, "pr_trainer_load_state: out of memory for this rank's state");
    memset(host[0], 0, sizeof(pr_real) * tr->n_params);
    memset(host[1], 0, sizeof(pr_real) * tr->slice_n);
    memset(host[2], 0, sizeof(pr_real) * tr->slice_n);
    return version == 1 ? pr__load_state_v1(tr, folder, host, err) : pr__load_state_ranks(tr, folder, host, err);
}

PRDEF pr_status pr_trainer_load_state(pr_trainer *tr, const char *dir, pr_train_state *state, pr_error *err) {
    if (!tr) return pr__fail(err, PR_ERR_ARG, "pr_trainer_load_state: NULL argument");
    pr_train_state s;
    pr_real *host[3] = { NULL, NULL, NULL };
    memset(&s, 0, sizeof s);
    pr_status st = pr__load_state_read(tr, dir, &s, host, err);
    if (tr->mesh) st = pr__ranks_agree(tr, tr->mesh->world, st, NULL, "pr_trainer_load_state", "no rank takes the state", err);
    if (!st) {           /* every check passed on every rank: the trainer takes the state */
        pr__weights_take(tr, host[0]);
        tr->be->upload_reals(tr->be, tr->adam_m, host[1], tr->slice_n);
        tr->be->upload_reals(tr->be, tr->adam_v, host[2], tr->slice_n);
        tr->adam_step = s.step;
        if (state) *state = s;
    }
    for (int k = 0; k < 3; k++) PR_FREE(host[k]);
    return st;
}

/* ---------------------------------------------------------------- 8.11 The prefix tree of a step's groups */
typedef struct {
    const pr_group *groups;
    int *order;            /* the groups being placed, a scratch permutation */
    pr_prefix_tree *t;
    int min_shared;
} pr__tree_build;

static int pr__tree_node(pr__tree_build *b, int parent, int start, int len, int below) {
    pr_prefix_node *nd = &b->t->nodes[b->t->n_nodes];
    nd->parent = parent;
    nd->start = start;
    nd->len = len;
    nd->groups_below = below;
    b->t->tokens_tree += len;
    return b->t->n_nodes++;
}

/* A span still to place: the groups order[lo..hi-1] share prefix positions start .. d-1, which no
   node holds yet; their node so far is `parent`. */
typedef struct {
    int lo, hi, start, d, parent;
} pr__tree_span;
/* The groups order[0..n-1] placed, a span at a time from a stack of them (spans are disjoint ranges
   of order, so at most n wait). A span's run is extended as far as its groups all agree; a run
   long enough (or one group's own) becomes a node, the groups that go on split by their next
   token. A run too short for a node is carried down into each class of the split, which shares it
   plus its token. The classes are pushed last first, so that each class and everything below it
   is placed before the next (depth first: a recursion's order, without a recursion as deep as the
   longest chain of nested prefixes). */
static void pr__tree_place(pr__tree_build *b, pr__tree_span *stack, int n) {
    const pr_group *g = b->groups;
    int *ord = b->order, top = 0;
    stack[top].lo = 0, stack[top].hi = n, stack[top].start = 0, stack[top].d = 0, stack[top].parent = -1;
    top++;
    while (top) {
        const pr__tree_span sp = stack[--top];
        int lo = sp.lo, start = sp.start, d = sp.d, parent = sp.parent;
        const int hi = sp.hi;
        for (;;) {                              /* extend d while every group has the same token there */
            int same = 1;
            for (int i = lo; i < hi && same; i++)
                same = g[ord[i]].P > d && g[ord[i]].prefix[d] == g[ord[lo]].prefix[d];
            if (!same) break;
            d++;
        }
        if (hi - lo == 1 || d - start >= b->min_shared) {
            int node = d > start ? pr__tree_node(b, parent, start, d - start, hi - lo) : parent;
            int k = lo;                         /* the groups that end here first */
            for (int i = lo; i < hi; i++)
                if (g[ord[i]].P == d) {
                    b->t->group_node[ord[i]] = node;
                    int x = ord[k]; ord[k] = ord[i]; ord[i] = x;
                    k++;
                }
            start = d;
            parent = node;
            lo = k;
        } else {                                /* too short to share: the groups ending inside it keep their own */
            int k = lo;
            for (int i = lo; i < hi; i++)
                if (g[ord[i]].P == d) {
                    b->t->group_node[ord[i]] = pr__tree_node(b, parent, start, d - start, 1);
                    int x = ord[k]; ord[k] = ord[i]; ord[i] = x;
                    k++;
                }
            lo = k;
        }
        const int first = top;
        while (lo < hi) {                       /* each class of the next token */
            const int32_t tok = g[ord[lo]].prefix[d];
            int k = lo + 1;
            for (int i = lo + 1; i < hi; i++)
                if (g[ord[i]].prefix[d] == tok) {
                    int x = ord[k]; ord[k] = ord[i]; ord[i] = x;
                    k++;
                }
            stack[top].lo = lo, stack[top].hi = k, stack[top].start = start, stack[top].d = d + 1, stack[top].parent = parent;
            top++;
            lo = k;
        }
        for (int i = first, j = top - 1; i < j; i++, j--) {   /* the first class on top */
            const pr__tree_span x = stack[i]; stack[i] = stack[j]; stack[j] = x;
        }
    }
}

PRDEF pr_status pr_prefix_tree_build(pr_prefix_tree *tree, const pr_group *groups, int n, int min_shared, pr_error *err) {
    if (!tree || !groups || n < 1) return pr__fail(err, PR_ERR_ARG, "pr_prefix_tree_build: NULL argument or no groups");
    if (min_shared < 1) return pr__fail(err, PR_ERR_ARG, "pr_prefix_tree_build: min_shared %d must be at least 1", min_shared);
    for (int i = 0; i < n; i++)
        if (groups[i].P < 1 || groups[i].G < 1 || !groups[i].prefix)
            return pr__fail(err, PR_ERR_ARG, "pr_prefix_tree_build: group %d has no prefix (P %d, G %d)", i, groups[i].P, groups[i].G);
    /* at most two nodes a group: its own, and the shared one its class opens (n - 1 of those) */
    pr_prefix_tree t;
    memset(&t, 0, sizeof t);
    t.nodes = (pr_prefix_node *)PR_MALLOC(sizeof(pr_prefix_node) * 2 * (size_t)n);
    t.group_node = (int *)PR_MALLOC(sizeof(int) * (size_t)n);
    int *order = (int *)PR_MALLOC(sizeof(int) * (size_t)n);
    pr__tree_span *stack = (pr__tree_span *)PR_MALLOC(sizeof(pr__tree_span) * (size_t)n);
    if (!t.nodes || !t.group_node || !order || !stack) {
        PR_FREE(t.nodes);
        PR_FREE(t.group_node);
        PR_FREE(order);
        PR_FREE(stack);
        return pr__fail(err, PR_ERR_NOMEM, "pr_prefix_tree_build: out of memory for %d groups", n);
    }
    t.n_groups = n;
    for (int i = 0; i < n; i++) {
        order[i] = i;
        t.tokens_baseline += (long)groups[i].G * groups[i].P;
        t.tokens_groups += groups[i].P;
    }
    pr__tree_build b = { groups, order, &t, min_shared };
    pr__tree_place(&b, stack, n);
    PR_FREE(order);
    PR_FREE(stack);
    *tree = t;
    return PR_OK;
}

PRDEF void pr_prefix_tree_free(pr_prefix_tree *tree) {
    if (!tree) return;
    PR_FREE(tree->nodes);
    PR_FREE(tree->group_node);
    memset(tree, 0, sizeof *tree);
}

#ifdef PR__POP_DIAGNOSTICS
#pragma GCC diagnostic pop
#undef PR__POP_DIAGNOSTICS
#endif
#endif /* PREFIXREUSE_IMPLEMENTATION */
