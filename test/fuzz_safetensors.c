/* fuzz_safetensors.c — libFuzzer harness for the safetensors, index and config parsers. The first input byte picks the
   target, the rest is its input:
     0  a whole safetensors file in memory: 8-byte length, header, data
     1  a safetensors header alone, data size from the next 2 bytes
     2  pr_config_parse; a config that parses must also save and read back to the same struct
     3  the JSON reader; every node's links are walked and checked
     4  a model.safetensors.index.json (shard list; no files are opened)
     5  float -> bf16/f16 rounding (4 bytes) against a slow reference
     6  config sizes: a model type and 11 little-endian int32 counts (vocabulary, widths, layers,
        heads, head_dim, positions, experts) into pr_config_validate; a config it accepts is within
        every limit, and a trainer on the measuring backend is created with exactly the parameter
        count worked out here independently; one it refuses says why
   Any crash, sanitizer report or abort() is a finding.

   fuzz:   make fuzz   (clang -fsanitize=fuzzer,address,undefined test/fuzz_safetensors.c)
   replay: cc -std=c11 -g -DPR_FUZZ_MAIN [-fsanitize=address,undefined] test/fuzz_safetensors.c -o replay -lm
           ./replay FILE...   (no arguments: one input from stdin) */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fuzz_header(const char *hdr, size_t n, uint64_t data_size) {
    pr_st_tensor *ts;
    int nt;
    pr_error err;
    if (pr__st_parse_header(&ts, &nt, hdr, n, data_size, 0, "fuzz", &err) != PR_OK) {
        if (!err.message[0]) abort(); /* every failure explains itself */
        return;
    }
    /* what the parser promises: sorted unique names, offsets in range and consistent, exact cover */
    uint64_t covered = 0;
    for (int i = 0; i < nt; i++) {
        int ok;
        uint64_t numel = pr__st_numel(ts[i].shape, ts[i].ndim, &ok);
        if (!ok || ts[i].end > data_size || ts[i].begin > ts[i].end) abort();
        if (numel * (uint64_t)pr__dtype_size(ts[i].dtype) != ts[i].end - ts[i].begin) abort();
        if (i && strcmp(ts[i - 1].name, ts[i].name) >= 0) abort();
        covered += ts[i].end - ts[i].begin;
    }
    if (covered != data_size) abort();
    PR_FREE(ts);
}

static void fuzz_config(const char *text, size_t n) {
    pr_config c, back;
    pr_error err;
    if (pr_config_parse(&c, text, n, &err) != PR_OK) {
        if (!err.message[0]) abort();
        return;
    }
    if (pr_config_validate(&c, &err) != PR_OK) abort();
    pr__buf b = {NULL, 0, 0, 0};
    if (pr__config_json(&c, &b, "fuzz", &err) != PR_OK) abort();
    if (pr_config_parse(&back, b.p, b.len, &err) != PR_OK) { fprintf(stderr, "%s\n%s\n", err.message, b.p); abort(); }
    PR_FREE(b.p);
    if (strcmp(c.model_type, back.model_type) || c.vocab_size != back.vocab_size || c.hidden_size != back.hidden_size ||
        c.intermediate_size != back.intermediate_size || c.num_hidden_layers != back.num_hidden_layers ||
        c.num_attention_heads != back.num_attention_heads || c.num_key_value_heads != back.num_key_value_heads ||
        c.head_dim != back.head_dim || c.max_position_embeddings != back.max_position_embeddings ||
        c.rms_norm_eps != back.rms_norm_eps || c.rope_theta != back.rope_theta || c.rope_llama3 != back.rope_llama3 ||
        c.rope_factor != back.rope_factor || c.rope_low_freq_factor != back.rope_low_freq_factor ||
        c.rope_high_freq_factor != back.rope_high_freq_factor || c.rope_original_max_position != back.rope_original_max_position ||
        c.tie_word_embeddings != back.tie_word_embeddings || c.qk_norm != back.qk_norm)
        abort();
}

/* The parameter count of a config, worked out apart from the library (in double: exact below 2^53). */
static double param_count(const pr_config *c) {
    double V = c->vocab_size, C = c->hidden_size, L = c->num_hidden_layers, HS = c->head_dim;
    double qd = c->num_attention_heads * HS, kvd = c->num_key_value_heads * HS, emb = V * C;
    double mlp = strcmp(c->model_type, "qwen3_moe") == 0 ? C * c->num_experts + 3 * C * c->moe_intermediate_size * c->num_experts : 3 * C * c->intermediate_size;
    double layer = C * (2 * qd + 2 * kvd) + mlp + 2 * C + (c->qk_norm ? 2 * HS : 0);
    return L * layer + emb + C + (c->tie_word_embeddings ? 0 : emb);
}

static void fuzz_config_sizes(const uint8_t *p, size_t n) {
    if (n < 1 + 11 * 4) return;
    static const char *const types[] = {"llama", "qwen3", "qwen3_moe"};
    pr_config c;
    memset(&c, 0, sizeof c);
    strcpy(c.model_type, types[p[0] % 3]);
    c.qk_norm = p[0] % 3 != 0;
    c.tie_word_embeddings = (p[0] >> 2) & 1;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 10000;
    int *f[11] = {&c.vocab_size, &c.hidden_size, &c.intermediate_size, &c.num_hidden_layers, &c.num_attention_heads,
                  &c.num_key_value_heads, &c.head_dim, &c.max_position_embeddings, &c.num_experts, &c.num_experts_per_tok,
                  &c.moe_intermediate_size};
    for (int i = 0; i < 11; i++) {
        const uint8_t *q = p + 1 + 4 * i;
        *f[i] = (int)((uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24);
    }
    pr_error err;
    memset(&err, 0, sizeof err);
    if (pr_config_validate(&c, &err) != PR_OK) {
        if (!err.message[0]) abort();
        return;
    }
    /* accepted: every count within its limit, the parameter count too */
    if (c.num_hidden_layers > PR_MAX_LAYERS || c.vocab_size > PR_MAX_VOCAB || c.hidden_size > PR_MAX_WIDTH ||
        c.intermediate_size > PR_MAX_WIDTH || c.num_attention_heads > PR_MAX_HEADS || c.num_key_value_heads > PR_MAX_HEADS ||
        c.head_dim > PR_MAX_HEAD_DIM || c.max_position_embeddings > PR_MAX_POSITIONS || c.num_experts > PR_MAX_EXPERTS)
        abort();
    double want = param_count(&c);
    if (want > (double)PR_MAX_PARAMS || (strcmp(c.model_type, "qwen3_moe") != 0) != (c.num_experts == 0)) abort();
    if ((double)c.num_hidden_layers * c.num_experts > 1e6) return;   /* the expert-load table would dominate the run */
    pr_backend storage;
    const pr_backend *be = pr_backend_measure(pr_backend_cpu(), &storage);
    pr_trainer *tr;
    if (pr_trainer_create(&tr, &c, be, &err) != PR_OK) {
        if (!err.message[0]) abort();
        return;
    }
    if ((double)pr_trainer_param_count(tr) != want) {
        fprintf(stderr, "%zu parameters, want %.0f\n", pr_trainer_param_count(tr), want);
        abort();
    }
    pr_trainer_destroy(tr);
}

/* Walks a subtree and checks that skip/count links stay inside the node array. */
static size_t walk(const pr__json *v, const pr__json *end, int depth) {
    if (v >= end || v->skip == 0 || v + v->skip > end || depth > PR__JSON_MAX_DEPTH) abort();
    if (v->type == PR__JSON_ARRAY || v->type == PR__JSON_OBJECT) {
        const pr__json *c = v + 1; /* children follow their container (pr__json_first is NULL when empty) */
        size_t inside = 1;
        for (uint32_t i = 0; i < v->count; i++) {
            if ((v->type == PR__JSON_OBJECT) != (c->key != NULL)) abort();
            if (c->key && c->key[c->key_len] != 0) abort();
            inside += walk(c, v + v->skip, depth + 1);
            c = pr__json_next(c);
        }
        if (inside != v->skip || c != v + v->skip) abort();
        if (v->type == PR__JSON_OBJECT && v->count) (void)pr__json_get(v, pr__json_first(v)->key);
    } else if (v->skip != 1) abort();
    if (v->type == PR__JSON_STRING && v->str[v->count] != 0) abort();
    int64_t i;
    if (pr__json_int(v, &i) && v->is_int && (double)i != v->num && fabs(v->num) < 9e15) abort();
    return v->skip;
}

static void fuzz_json(const char *text, size_t n) {
    pr__json *j;
    pr_error err;
    if (pr__json_parse(&j, text, n, "fuzz", 0, &err) != PR_OK) {
        if (!err.message[0] || (!strstr(err.message, "byte") && !strstr(err.message, "large"))) abort();
        return;
    }
    walk(j, j + j->skip, 0);
    PR_FREE(j);
}

static void fuzz_index(const char *text, size_t n) {
    pr__json *j;
    pr_error err;
    if (pr__json_parse(&j, text, n, "fuzz", 0, &err) != PR_OK) return;
    pr_checkpoint ck;
    memset(&ck, 0, sizeof ck);
    if (pr__st_index_files(&ck, j, "/nonexistent-dir", "fuzz", &err) == PR_OK && ck.n_files == 0) abort();
    for (int i = 0; i < ck.n_files; i++) {
        if (strncmp(ck.paths[i], "/nonexistent-dir/", 17) != 0 || strchr(ck.paths[i] + 17, '/')) abort(); /* no escape */
        if (i && strcmp(ck.paths[i - 1], ck.paths[i]) >= 0) abort(); /* sorted, unique */
    }
    for (int i = 0; i < ck.n_files; i++) PR_FREE(ck.paths[i]);
    PR_FREE(ck.paths);
    PR_FREE(j);
}

/* Reference rounding: the nearest of the two neighbouring codes, ties to the even code. */
static void fuzz_rounding(const uint8_t *p) {
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &u, 4);
    uint16_t b = pr_f32_to_bf16(f), h = pr_f32_to_f16(f);
    if (isnan(f)) {
        if (!isnan(pr_bf16_to_f32(b)) || !isnan(pr_f16_to_f32(h))) abort();
        return;
    }
    double x = fabs((double)f);
    uint16_t sign = (uint16_t)(u >> 31 ? 0x8000 : 0);
    /* bf16: truncation and the next code up */
    uint16_t lo = (uint16_t)((u & 0x7fffffffu) >> 16), want;
    double dlo = (double)pr_bf16_to_f32(lo), dhi = (double)pr_bf16_to_f32((uint16_t)(lo + 1));
    if (lo == 0x7f7f) dhi = ldexp(1.0, 128); /* past the largest finite: the next step would be 2^128 */
    if (isinf(x)) want = 0x7f80;
    else if (x - dlo < dhi - x || (x - dlo == dhi - x && !(lo & 1))) want = lo;
    else want = (uint16_t)(lo + 1);
    if (b != (sign | want)) { fprintf(stderr, "bf16(%a) = %04x, want %04x\n", (double)f, b, sign | want); abort(); }
    /* f16: binary search for the largest code <= x, over the finite codes and inf */
    uint16_t a = 0, z = 0x7c00;
    while (a < z) {
        uint16_t m = (uint16_t)((a + z + 1) / 2);
        if ((double)pr_f16_to_f32(m) <= x) a = m; else z = (uint16_t)(m - 1);
    }
    if (a == 0x7c00) want = 0x7c00;
    else if (a == 0x7bff) want = x >= 65520.0 ? 0x7c00 : 0x7bff; /* beyond max: the step to inf is 32 */
    else {
        dlo = (double)pr_f16_to_f32(a);
        dhi = (double)pr_f16_to_f32((uint16_t)(a + 1));
        want = x - dlo < dhi - x || (x - dlo == dhi - x && !(a & 1)) ? a : (uint16_t)(a + 1);
    }
    if (h != (sign | want)) { fprintf(stderr, "f16(%a) = %04x, want %04x\n", (double)f, h, sign | want); abort(); }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const char *rest = (const char *)data + 1;
    size_t n = size - 1;
    switch (data[0] % 7) {
    case 0: { /* a whole file: the same checks as pr__st_open_file, on memory */
        uint64_t hlen;
        pr_error err;
        if (n < 8 || pr__st_check_prefix(&hlen, (const unsigned char *)rest, n, "fuzz", &err) != PR_OK) return 0;
        fuzz_header(rest + 8, (size_t)hlen, n - 8 - hlen);
        break;
    }
    case 1:
        if (n < 2) return 0;
        fuzz_header(rest + 2, n - 2, (uint64_t)(uint8_t)rest[0] | (uint64_t)(uint8_t)rest[1] << 8);
        break;
    case 2: fuzz_config(rest, n); break;
    case 3: fuzz_json(rest, n); break;
    case 4: fuzz_index(rest, n); break;
    case 5: if (n >= 4) fuzz_rounding((const uint8_t *)rest); break;
    case 6: fuzz_config_sizes((const uint8_t *)rest, n); break;
    }
    return 0;
}

#ifdef PR_FUZZ_MAIN
/* Plain program: replays the given files (e.g. a crash or a corpus) through the harness. */
static int replay(FILE *f, const char *name) {
    size_t cap = 1 << 16, len = 0;
    uint8_t *buf = malloc(cap);
    if (!buf) return 1;
    for (;;) {
        len += fread(buf + len, 1, cap - len, f);
        if (len < cap) break;
        uint8_t *q = realloc(buf, cap * 2);
        if (!q) { free(buf); return 1; }
        buf = q;
        cap *= 2;
    }
    LLVMFuzzerTestOneInput(buf, len);
    free(buf);
    printf("ok %s (%zu bytes)\n", name, len);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) return replay(stdin, "<stdin>");
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) { fprintf(stderr, "cannot open %s\n", argv[i]); return 1; }
        int rc = replay(f, argv[i]);
        fclose(f);
        if (rc) return rc;
    }
    return 0;
}
#endif
