/* fuzz_state.c — libFuzzer harness for the training-state loader (pr_trainer_load_state) on a real
   version-2 state: the first input byte picks the file of that state the rest replaces,
     0  state_index.json (the pieces: kinds, files, keys, rectangles, element ranges)
     1  trainer_state.json (format, version, step, next_group, seed, precision, AdamW settings, data fingerprint)
   and the other files (config.json, the ranks' safetensors) stay as saved. `make fuzz` saves the
   state first (./train --dp 2 --tp 2 --zero 2 --steps 1 --save-state build/fuzz_state.d) and seeds
   the corpus with its two files; FUZZ_STATE names another folder given to --save-state (the one
   holding `latest`). The copy it loads from is made under TMPDIR (default /tmp) and removed at the end.
   Properties, beyond "no crash, no leak, no over-read":
     - a refused load returns a status with a message and leaves the trainer's parameters, AdamW m
       and v and step count as they were (the loader checks everything before it touches the trainer);
     - after an accepted one, the saved state loads again and gives back the same.
   Any crash, sanitizer report or abort() is a finding.

   fuzz:   make fuzz
   replay: cc -std=c11 -g -DPR_FUZZ_MAIN [-fsanitize=address,undefined] test/fuzz_state.c -o replay -lm
           FUZZ_STATE=DIR ./replay FILE... */
#define _XOPEN_SOURCE 700     /* mkdtemp, symlink, realpath */
#define PREFIXREUSE_IMPLEMENTATION
#include "../prefixreuse.h"
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUZZ_SANITIZED 1
#endif
#elif defined(__SANITIZE_ADDRESS__)
#define FUZZ_SANITIZED 1
#endif
#ifndef FUZZ_SANITIZED
#define FUZZ_SANITIZED 0
#else
#include <sanitizer/common_interface_defs.h>
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fuzz_cleanup(void);
#define FUZZ_ASSERT(c)                                                          \
    do {                                                                        \
        if (!(c)) {                                                             \
            fprintf(stderr, "%s:%d: property failed: %s\n", __FILE__, __LINE__, #c); \
            fuzz_cleanup();                                                     \
            abort();                                                            \
        }                                                                       \
    } while (0)

static const char *const fuzzed_file[2] = { "state_index.json", "trainer_state.json" };

static struct {
    pr_trainer *tr;
    char work[4200];          /* a copy of the state: `latest`, and s/ with links to the saved files */
    char saved[4200];         /* the saved state's folder */
    pr_real *held;            /* (n + 2 slice_n) the saved state: parameters, m, v */
    pr_real *now;             /* (n + 2 slice_n) scratch */
    size_t n, count;
    long step;                /* the saved state's AdamW step count */
} fz;

static void fuzz_die(const char *what, const char *detail) {
    fprintf(stderr, "fuzz_state: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    fuzz_cleanup();
    abort();
}

/* What a load replaces: the parameters (public), AdamW's m and v and its step count (the trainer's
   own fields: the CPU backend's arenas are host memory). */
static void state_of(pr_real *dst) {
    pr_error err;
    if (pr_trainer_get_params(fz.tr, dst, fz.n, &err)) fuzz_die("get_params", err.message);
    memcpy(dst + fz.n, fz.tr->adam_m, sizeof(pr_real) * fz.tr->slice_n);
    memcpy(dst + fz.n + fz.tr->slice_n, fz.tr->adam_v, sizeof(pr_real) * fz.tr->slice_n);
}

static int same_state(void) {
    state_of(fz.now);
    return !memcmp(fz.now, fz.held, sizeof(pr_real) * fz.count) && fz.tr->adam_step == fz.step;
}

/* The work folder goes at exit, and before an abort or a sanitizer's report: its links, the
   fuzzed files, `latest`. */
static void fuzz_cleanup(void) {
    char path[4600];
    if (!fz.work[0]) return;
    snprintf(path, sizeof path, "%s/s", fz.work);
    DIR *d = opendir(path);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/s/%s", fz.work, e->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    snprintf(path, sizeof path, "%s/s", fz.work);
    rmdir(path);
    snprintf(path, sizeof path, "%s/latest", fz.work);
    unlink(path);
    rmdir(fz.work);
    fz.work[0] = 0;
}

/* The saved state (FUZZ_STATE, default build/fuzz_state.d: its `latest` followed), a trainer of its
   model, and the work folder whose files but the fuzzed one link to the saved ones. */
static void fuzz_setup(void) {
    const char *dir = getenv("FUZZ_STATE") ? getenv("FUZZ_STATE") : "build/fuzz_state.d";
    char path[4600], name[256] = "";
    pr_error err;
    snprintf(path, sizeof path, "%s/latest", dir);
    FILE *f = fopen(path, "r");
    if (!f || !fgets(name, sizeof name, f)) fuzz_die("no saved state (make fuzz saves one) at", path);
    fclose(f);
    name[strcspn(name, "\n")] = 0;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *whole = realpath(path, NULL);       /* links from the work folder need the whole path */
    if (!whole || strlen(whole) >= sizeof fz.saved - 64) fuzz_die("no state folder", path);
    memcpy(fz.saved, whole, strlen(whole) + 1);
    free(whole);
    pr_config cfg;
    snprintf(path, sizeof path, "%s/config.json", fz.saved);
    if (pr_config_load(&cfg, path, &err) || pr_trainer_create(&fz.tr, &cfg, pr_backend_cpu(), &err)) fuzz_die("the model", err.message);
    const char *tmp = getenv("TMPDIR") && strlen(getenv("TMPDIR")) < 4000 ? getenv("TMPDIR") : "/tmp";
    snprintf(fz.work, sizeof fz.work, "%s/fuzz_state.XXXXXX", tmp);
    if (!mkdtemp(fz.work)) fuzz_die("mkdtemp in", tmp);
    atexit(fuzz_cleanup);
#if FUZZ_SANITIZED
    __sanitizer_set_death_callback(fuzz_cleanup);
#endif
    snprintf(path, sizeof path, "%s/latest", fz.work);
    if (!(f = fopen(path, "w")) || fputs("s\n", f) < 0 || fclose(f)) fuzz_die("writing", path);
    snprintf(path, sizeof path, "%s/s", fz.work);
    if (mkdir(path, 0700)) fuzz_die("mkdir", path);
    DIR *d = opendir(fz.saved);
    if (!d) fuzz_die("opendir", fz.saved);
    for (struct dirent *e; (e = readdir(d));) {
        char from[4600], to[4600];
        if (e->d_name[0] == '.') continue;
        snprintf(from, sizeof from, "%s/%s", fz.saved, e->d_name);
        snprintf(to, sizeof to, "%s/s/%s", fz.work, e->d_name);
        if (symlink(from, to)) fuzz_die("symlink", to);
    }
    closedir(d);
    fz.n = pr_trainer_param_count(fz.tr);
    fz.count = fz.n + 2 * fz.tr->slice_n;
    fz.held = (pr_real *)malloc(sizeof(pr_real) * fz.count);
    fz.now = (pr_real *)malloc(sizeof(pr_real) * fz.count);
    if (!fz.held || !fz.now) fuzz_die("out of memory", NULL);
    if (pr_trainer_load_state(fz.tr, fz.saved, NULL, &err)) fuzz_die("the saved state does not load", err.message);
    state_of(fz.held);
    fz.step = fz.tr->adam_step;
}

/* The work folder's `which` file: the saved one (a link), or these bytes. */
static void fuzz_put(int which, const uint8_t *bytes, size_t n) {
    char path[4600], from[4400];
    snprintf(path, sizeof path, "%s/s/%s", fz.work, fuzzed_file[which]);
    unlink(path);
    if (!bytes) {
        snprintf(from, sizeof from, "%s/%s", fz.saved, fuzzed_file[which]);
        if (symlink(from, path)) fuzz_die("symlink", path);
        return;
    }
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(bytes, 1, n, f) != n) || fclose(f)) fuzz_die("writing", path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!fz.tr) fuzz_setup();
    if (size < 1) return 0;
    const int which = data[0] & 1;
    pr_train_state state;
    pr_error err;
    fuzz_put(which, data + 1, size - 1);
    err.message[0] = 0;
    pr_status st = pr_trainer_load_state(fz.tr, fz.work, &state, &err);
    fuzz_put(which, NULL, 0);
    if (st != PR_OK) {
        FUZZ_ASSERT(err.status == st && err.message[0]);
        FUZZ_ASSERT(same_state());        /* the trainer as it was */
        return 0;
    }
    FUZZ_ASSERT(pr_trainer_load_state(fz.tr, fz.work, NULL, &err) == PR_OK);  /* the saved files again */
    FUZZ_ASSERT(same_state());
    return 0;
}

#ifdef PR_FUZZ_MAIN
int main(int argc, char **argv) {
    int n = 0;
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) { perror(argv[i]); return 1; }
        static uint8_t buf[1 << 20];
        size_t len = fread(buf, 1, sizeof buf, f);
        fclose(f);
        LLVMFuzzerTestOneInput(buf, len);
        n++;
    }
    printf("replayed %d file(s): no property failed\n", n);
    return 0;
}
#endif
