#!/bin/sh
# Everything a lent GPU is for, in stages that survive each other's failures. POSIX sh: runs under
# dash or bash, from any directory (it works in the repository root).
#
#   bench/run_gpu.sh                        every stage, most informative first (~17 minutes: two calls)
#   bench/run_gpu.sh build smoke test-gpu   these stages only (stage or group names, given in any order,
#                                           run in the table's order below)
#   bench/run_gpu.sh --from sanitize        from a stage or group to the last stage
#   bench/run_gpu.sh --list                 the stages with their expected and longest times
# preflight and after run every time (seconds each); build runs whenever a chosen stage needs it
# (make is incremental: a call after a fix rebuilds what changed), unless --no-build.
# --budget S: the whole run's time (default $BUDGET, else 540 s): a stage starts only while at least
# half its expected time is left (all of it for ncu and torch-ref; EXPECT below for other sizes),
# and never runs past the budget.
#
# Each stage runs in its own process under `timeout`, its output in its own log. One line per stage
# (name, ok / FAIL / TIMEOUT / SKIP, seconds, its key figure: test-gpu's closing "N passed, N failed",
# a sanitizer's ERROR SUMMARY, the benchmarks' headline numbers) is printed and appended to the
# summary; the stages that did not pass add their last lines at the end. Everything goes into ONE
# archive per call, rewritten after every stage (a run cut short keeps what it did):
#   $OUT/gpu-<stages>-<UTC time>.tgz and $OUT/gpu-<stages>-<UTC time>-summary.txt
# Without $OUT: the same under bench/out/, beside the unpacked logs.
#
# Environment (defaults sized for the 9 minutes; widen them in a call of its own):
#   JOBS          make -j (the core count)
#   BENCH_LAYERS  Llama3-8B layers in train-bench, profile, train-memory, torch-ref, train-tree (1); `fit`: the
#                 most whose full-sequence step of BENCH_TOTAL tokens fits this GPU beside their training
#                 state (--fit-layers prints it: 7 on an 80 GB H100, 15 on a 141 GB H200; none fits: 1)
#   FIT_MARGIN_MIB  what `fit` leaves of the card beyond the baseline's step: the CUDA context, cuBLASLt,
#                 and the chunks a run of both schedules keeps beside the largest step's (10240)
#   FIT_MEMORY_MIB  the card's memory for `fit` (nvidia-smi's memory.total when unset)
#   BENCH_GROUPS  group sizes of train-bench and torch-ref (8)
#   BENCH_SPLITS  prefix fractions of train-bench (0.16667,0.5,0.66667,0.83333: 2k/10k ... 10k/2k)
#   BENCH_MICROBATCH  train-bench's and profile's microbatch flags (--microbatch 1: the paper's Phase B, one
#                 suffix at a time; "--microbatch-tokens 6144": the baseline one 12k sequence, Phase B
#                 three 2k suffixes)
#   GEMM_ROWS     gemm-rows: the row counts (2048 6144)
#   MEM_GROUPS    group size of train-memory (4)
#   MEM_SPLITS    prefix fractions of train-memory (0.83333, i.e. 10k/2k)
#   BENCH_TOTAL   tokens per trajectory (12288)
#   TORCH_SPLITS  prefix fractions of torch-ref (0.83333)
#   TORCH_GROUPS  group sizes of torch-ref (BENCH_GROUPS)
#   REPS          timed runs per bench_cuda cell (3)
#   RACE_CASES    test_gpu attention cases under racecheck (0,3,8,9,4: the smallest of each head dim)
#   MMA_RACE_SHAPES  test_gpu_attention shapes under racecheck, one process each, mma.sync kernels
#                 (1: causal at head dim 128; 5 is the two-region padded case, 2 head dim 64)
#   WGMMA_RACE_SHAPES  the same for the wgmma kernels (1 5 2)
#   ATTENTION     train_cuda's --attention in train-bench, train-memory and train-tree: auto (the
#                 default, train_cuda's: wgmma where it runs, else mma, else ffma), ffma, mma, wgmma
#   AB_DIRS       bench-ab: source trees of other revisions inside the repository, space-separated,
#                 each made before the call with `mkdir -p ab/REV && git archive REV Makefile prefixreuse.h
#                 prefixreuse_cuda.cu bench/bench_cuda.c | tar -x -C ab/REV`
#                 (untracked files travel with the working tree); none: the stage is skipped
#   AB_CASES      bench-ab: the attention cases (causal8k,p10k-8x2k)
#   AB_ROUNDS     bench-ab: how many times each tree runs, in turn (2; 1 saves about 40 s)
#   TREE_TOTAL    train-tree: tokens per trajectory (4096; the prompt 5/6 of it)
#   TREE_SYSTEM   train-tree: the system prompt every group's prompt opens with (2048)
#   TREE_GROUPS   train-tree: groups a step (8)
#   MOE_LAYERS    train-moe: Qwen3-30B-A3B layers (2: 1.9B parameters, 34 GB of training state)
#   MOE_TOTAL     train-moe: tokens per trajectory (4096; the prompt 5/6 of it)
#   MOE_GROUPS    train-moe: group sizes (8)
#   FUZZ_SECONDS  fuzz: how long it draws --check cases (40)
#   FUZZ_RESUME_SECONDS  fuzz: how long it draws resume cases (20)
#   EXPECT        expected seconds of stages run at other sizes than the table's, as "stage=seconds ..."
#                 (the table's are one layer's, G 8): what the budget's start rule below reads
#
# Sizing: Llama3-8B (C 4096, 32/8 heads of 128, MLP 14336, vocab 128256). A layer holds 218M
# matrix parameters: 6 x 218M = 1.31 GFLOP per token (fwd + bwd); attention 4 * 128 * 32 = 16.4k
# FLOP per (query, key) pair forward, 2.5x that backward; the LM head 3.15 GFLOP per suffix row.
# Measured on an H100 with the wgmma attention (bench/RESULTS.md): a one-layer baseline step at
# 10k/2k G 8 takes 0.42 s (~51% MFU), reuse 0.21 s; a step's time grows about linearly in G. One
# sweep cell is a warm-up and a timed run of each schedule: four splits at G 8 ran in 78 s, ~20 s
# of it the host drawing the 1.27B parameters (embeddings and head are 1.05B) on one core, which
# train_cuda now does on every core (OpenMP; the same bits). With one layer the
# LM head is most of a step, so the speed-up bound at 10k/2k is 2.1x at G 8 where the whole model's
# is 3.3x (bench/README.md): the issue's goals want layers. Every rank holds 18 bytes a parameter,
# so on an 80 GB card 7 layers (2.6B parameters, 44 GB) leave room for a G 32 baseline step at 12k
# tokens (`./train --bench capacity --config model/llama3-8b --layers 7 --bench-sizes gpu
# --bench-budget 76000`, on any machine); each of their steps costs ~5.5x a one-layer step. A 141 GB
# H200 holds 15 (BENCH_LAYERS=fit counts it on the machine: `--fit-layers`), each step ~11x. So
# one layer and G 8 by default, and a call of its own for the goal cells:
#   BENCH_LAYERS=7 BENCH_GROUPS=4,8,16,32 BENCH_SPLITS=0.83333 bench/run_gpu.sh train-bench torch-ref
# shellcheck disable=SC2015   # `a && b || c` below means "c unless both a and b", as intended
set -u
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$self")/.." || exit 1
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then PATH="$PATH:/usr/local/cuda/bin"; export PATH; fi

JOBS=${JOBS:-$(nproc 2>/dev/null || echo 16)}
BENCH_LAYERS=${BENCH_LAYERS:-1}
BENCH_GROUPS=${BENCH_GROUPS:-8}
BENCH_SPLITS=${BENCH_SPLITS:-0.16667,0.5,0.66667,0.83333}
MEM_GROUPS=${MEM_GROUPS:-4}
MEM_SPLITS=${MEM_SPLITS:-0.83333}
BENCH_TOTAL=${BENCH_TOTAL:-12288}
TORCH_SPLITS=${TORCH_SPLITS:-0.83333}
TORCH_GROUPS=${TORCH_GROUPS:-$BENCH_GROUPS}
REPS=${REPS:-3}
BENCH_MICROBATCH=${BENCH_MICROBATCH---microbatch 1}     # set and empty: the whole group in one microbatch
GEMM_ROWS=${GEMM_ROWS:-2048 6144}
RACE_CASES=${RACE_CASES:-0,3,8,9,4}
MMA_RACE_SHAPES=${MMA_RACE_SHAPES:-1}
WGMMA_RACE_SHAPES=${WGMMA_RACE_SHAPES:-1 5 2}
AB_DIRS=${AB_DIRS:-}
AB_CASES=${AB_CASES:-causal8k,p10k-8x2k}
AB_ROUNDS=${AB_ROUNDS:-2}
EXPECT=${EXPECT:-}
TREE_TOTAL=${TREE_TOTAL:-4096}
TREE_SYSTEM=${TREE_SYSTEM:-2048}
TREE_GROUPS=${TREE_GROUPS:-8}
MOE_LAYERS=${MOE_LAYERS:-2}
MOE_TOTAL=${MOE_TOTAL:-4096}
MOE_GROUPS=${MOE_GROUPS:-8}
FUZZ_SECONDS=${FUZZ_SECONDS:-40}
FUZZ_RESUME_SECONDS=${FUZZ_RESUME_SECONDS:-20}
ATTENTION=${ATTENTION:-auto}
FIT_MARGIN_MIB=${FIT_MARGIN_MIB:-10240}
FIT_MEMORY_MIB=${FIT_MEMORY_MIB:-}
export AB_DIRS AB_CASES AB_ROUNDS JOBS BENCH_LAYERS BENCH_GROUPS BENCH_SPLITS MEM_GROUPS MEM_SPLITS BENCH_TOTAL TORCH_SPLITS TORCH_GROUPS REPS RACE_CASES MMA_RACE_SHAPES WGMMA_RACE_SHAPES TREE_TOTAL TREE_SYSTEM TREE_GROUPS MOE_LAYERS MOE_TOTAL MOE_GROUPS ATTENTION FUZZ_SECONDS FUZZ_RESUME_SECONDS

# The stages, in the order they run: name | expected seconds | longest | needs the build | what.
# Expected times as measured on an H100 on 2026-11-26 (bench/results/2026-11-26-h100; make -j16
# on a fresh machine, the wgmma attention in the train-* stages); initcheck from the H100 run of
# 2026-11-27, the other sanitizers' tensor-core targets from the H200's run or not yet measured.
# Racecheck is the slow part of the mma stage (10-45 s a shape).
# `--list` prints the sum: above the budget, so the last stages wait for a follow-up call.
stages() {
    cat <<'EOF'
preflight|15|60|0|GPU, driver, clocks, temperature, nvcc, NCCL (make info), compute-sanitizer, ncu, cuobjdump, cores, PyTorch
build|50|300|0|make -j$JOBS train_cuda build/test_gpu build/test_gpu_attention build/bench_cuda build/compare_st build/train-double build/train-float; make sass, check-sass
smoke|3|60|1|build/bench_cuda --smoke: device, one GEMM, one attention each way, one training step each way, then the tensor-core attention (mma, wgmma) each way
test-gpu|25|240|1|make test-gpu: kernels and attention against the CPU double path, determinism, --check, GPU vs CPU grads, NCCL on one rank
mma|130|330|1|build/test_gpu_attention: tensor-core attention (its atomic-dQ backward, its wgmma kernels) vs CPU double, FFMA and the tile model; memcheck --quick; racecheck on shapes $MMA_RACE_SHAPES (mma.sync), $WGMMA_RACE_SHAPES (wgmma)
memcheck|10|160|1|compute-sanitizer memcheck (+ leaks): train_cuda --check on model/tiny with offload; test_gpu attention
racecheck|45|160|1|compute-sanitizer racecheck: one train_cuda step; test_gpu attention --cases $RACE_CASES
initcheck|10|60|1|compute-sanitizer initcheck: test_gpu attention; test_gpu_attention --shape 1 (not the step: the tool does not see cuBLASLt's stores)
synccheck|15|120|1|compute-sanitizer synccheck: train_cuda --check on model/tiny with offload; test_gpu attention; test_gpu_attention --shape 1
determinism|5|90|1|train_cuda --steps 2 --save-grads in two processes each, tiny-qwen3 and tiny-moe; cmp
replay|15|150|1|train_cuda --replay 100 --lr 1e-4 on model/tiny in bf16: reuse and full-sequence drift from the CPU's fp32 run, JSON lines
fuzz|65|260|1|test/fuzz_check.py --cuda for $FUZZ_SECONDS s: random models, traces and flags on one rank (head dims 16 to 128), train_cuda --check, a failed bf16 check asked again against the CPU double build; then --resume for $FUZZ_RESUME_SECONDS s: the same cases trained straight and cut in two with --save-state and --resume, bit for bit
bench-cuda|95|200|1|build/bench_cuda --reps $REPS: GEMMs beside cuBLASLt's best; attention TFLOP/s, causal 8k and two-region, head dims 128 and 64; atomic-dQ backward; wgmma
gemm-rows|20|180|1|build/bench_cuda --only gemm --rows R for each R of $GEMM_ROWS: the GEMMs at Phase B's row counts (2048: one 2k suffix; 6144: a wave of three) beside cuBLASLt's best, where bench-cuda has 12288
bench-ab|80|300|1|the attention benchmark (bench_cuda --only attention --att $AB_CASES) of this tree and of each tree in AB_DIRS (built by the build stage, beside this tree), in turn, $AB_ROUNDS rounds (about 20 s a tree a round): a kernel change against the revision before it, on one machine in one run
sdpa|45|120|0|bench/sdpa_ref.py: PyTorch SDPA (flash, cudnn, efficient) on the same attention shapes
ncu|60|180|1|ncu --clock-control none on the attention kernels (causal 8k; FFMA, MMA, fused, wgmma): speed of light, occupancy, stalls
train-bench|80|300|1|train_cuda --bench, Llama3-8B x $BENCH_LAYERS layers, $BENCH_TOTAL tokens, splits $BENCH_SPLITS, G $BENCH_GROUPS, $BENCH_MICROBATCH: baseline vs reuse, MFU, reuse by phase
profile|30|150|1|train_cuda --bench --profile, Llama3-8B x $BENCH_LAYERS layers, 10k/2k, G 8, $BENCH_MICROBATCH: each timed step's GPU time per backend operation (GEMMs by shape), and the time the GPU waited for the host
train-memory|40|240|1|train_cuda --bench memory, Llama3-8B x $BENCH_LAYERS layers, splits $MEM_SPLITS, G $MEM_GROUPS: per-phase peaks, offload on/off and step times, the block copies' own time and GB/s
torch-ref|35|300|0|bench/torch_ref.py: the baseline step in PyTorch, eager and torch.compile, same layers, splits $TORCH_SPLITS, G $TORCH_GROUPS
train-tree|65|240|1|train_cuda --bench tree, Llama3-8B x $BENCH_LAYERS layers: $TREE_GROUPS groups sharing a $TREE_SYSTEM-token system prompt, G 8
train-moe|60|240|1|train_cuda --bench --profile, Qwen3-30B-A3B x $MOE_LAYERS layers, $MOE_TOTAL tokens, split 5/6, G $MOE_GROUPS: baseline vs reuse, each step's GPU time per operation, and the time the GPU waited for the host (its routing)
after|3|20|0|clocks, temperature, power, memory used after the run
EOF
}
all_stages=$(stages | cut -d'|' -f1 | tr '\n' ' ')
field() { stages | awk -F'|' -v n="$1" -v f="$2" '$1 == n { print $f }'; }
# A stage's expected seconds: EXPECT's figure for it where given, else the table's.
expected() {
    e=$(field "$1" 2)
    for x in $EXPECT; do [ "${x%%=*}" = "$1" ] && e=${x#*=}; done
    echo "$e"
}
# Stages whose figures come only at their end, so that one cut short gives nothing: ncu writes its
# report when it ends, torch-ref a row when a cell's compile and timed runs are done. They start
# only while their whole expected time is left, the others while half of it is.
whole_stages="ncu torch-ref"
group() {
    case $1 in
    all) echo "$all_stages" ;;
    sanitize) echo "memcheck racecheck initcheck synccheck" ;;
    bench) echo "bench-cuda gemm-rows bench-ab sdpa ncu train-bench profile train-memory torch-ref train-tree train-moe" ;;
    *) [ -n "$(field "$1" 1)" ] && echo "$1" ;;
    esac
}

# limited SECONDS CMD...: CMD under timeout (TERM, then KILL 10 s later), in the background so that
# a signal to this shell reaches it (see the traps).
child=
limited() {
    lim_s=$1
    shift
    timeout -k 10 "$lim_s" "$@" < /dev/null 3>&- &
    child=$!
    wait "$child"
    rc_l=$?
    child=
    return $rc_l
}

# ------------------------------------------------------------------ stage bodies (run as --body NAME)
key() { case $* in ''|' TF/s'*) ;; *) echo "key: $*" ;; esac; }     # nothing for an empty figure
skip() { echo "skip: $*"; exit 77; }
have() { command -v "$1" >/dev/null 2>&1; }
# sub PART SECONDS CMD...: one part of a stage, its output in <stage>.PART.log, its tail here on failure
sub() {
    part=$1; lim=$2; shift 2
    f="$stage_base.$part.log"
    echo "== $part: $* (up to ${lim} s)"
    t0=$(date +%s)
    limited "$lim" "$@" > "$f" 2>&1
    rc_s=$?
    echo "== $part: exit $rc_s after $(( $(date +%s) - t0 )) s ($(basename "$f"))"
    [ "$rc_s" -eq 0 ] || tail -n 15 "$f" | sed 's/^/   | /'
    return $rc_s
}

body_preflight() {
    fail=0
    echo "== nvidia-smi"
    if have nvidia-smi; then
        nvidia-smi || fail=1
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit,persistence_mode,compute_mode,mig.mode.current --format=csv
        nvidia-smi -q -d PERFORMANCE,CLOCK
        key "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader 2>&1 | head -n 1 |
               awk -F', ' '{ printf "%s, driver %s, SM %s of %s, %s C", $1, $2, $3, $4, $5 }')"
    else
        fail=1
        key "no nvidia-smi"
    fi
    echo "== toolkit"
    if have nvcc; then command -v nvcc; nvcc --version; v=$(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'); else v=none; fail=1; fi
    make -s info
    key "nvcc $v, nccl: $(make -s info 2>/dev/null | sed -n 's/.*nccl: //p')"
    ldconfig -p 2>/dev/null | grep -E 'libnccl|libcublasLt|libcudnn\.' | head -n 20
    tools=
    for t in compute-sanitizer ncu cuobjdump; do
        echo "== $t"
        if have "$t"; then
            command -v "$t"
            "$t" --version 2>&1 | tail -n 2
            ver=$("$t" --version 2>&1 | grep -o -E '[0-9]{4}\.[0-9]+\.[0-9]+|V[0-9.]+' | head -n 1)
            tools="$tools $t ${ver:-present},"
        else tools="$tools $t missing,"; fi
    done
    tools=${tools# }
    key "${tools%,}"
    echo "== machine"
    nproc; free -g; df -h . | tail -n 1; uname -a; cc --version 2>&1 | head -n 1; make --version | head -n 1
    echo "== python"
    if have python3; then
        python3 -c 'import torch; c = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version() if c else "-", torch.cuda.get_device_name() if c else "no GPU for torch")' 2>&1 | tail -n 1
        python3 -c 'import nvidia.nccl as m, os; f = m.__file__; print("nvidia.nccl at", os.path.dirname(f) if f else next(iter(m.__path__)))' 2>&1 | tail -n 1
    fi
    key "$(nproc) cores, $(python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo 'no torch')"
    return $fail
}

body_build() {
    make info
    t0=$(date +%s)
    # bench-ab's trees, built beside this one: nvcc compiles the CUDA file one process a target,
    # which leaves most cores idle (bench-ab's own make then finds them built)
    ab_jobs=
    for d in $AB_EARLY; do
        [ -f "$d/Makefile" ] || continue
        make -C "$d" -j"$JOBS" build/bench_cuda > "$stage_base.ab-$(basename "$d").log" 2>&1 < /dev/null &
        ab_jobs="$ab_jobs $!"
    done
    make -j"$JOBS" train_cuda build/test_gpu build/test_gpu_attention build/bench_cuda build/compare_st build/train-double build/train-float
    rc=$?
    ab_rc=0
    for p in $ab_jobs; do wait "$p" || ab_rc=1; done
    if [ -n "$ab_jobs" ]; then
        if [ $ab_rc -eq 0 ]; then key "AB_DIRS trees built"; else key "AB_DIRS: a tree failed to build (bench-ab tries again; its ab-*.log here)"; fi
    fi
    if [ $rc -eq 0 ]; then
        key "built in $(( $(date +%s) - t0 )) s with -j$JOBS"
        if have cuobjdump; then
            sub sass 60 make -s sass && key "make sass: $(grep -c . "$stage_base.sass.log") lines"
            sub check-sass 60 make -s check-sass
            key "check-sass: $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$stage_base.check-sass.log" | tr '\n' ';' | sed 's/;$//; s/;/; then /g')"
        fi
        return 0
    fi
    # the first errors last, where the summary's tail of this log finds them
    echo "== the first errors"
    grep -E 'error:|error #|fatal|undefined reference|\*\*\*' "$stage_base.log" | head -n 12
    key "make failed: $(grep -m 1 -E 'error:|error #|fatal|undefined reference|\*\*\*' "$stage_base.log" | cut -c1-160)"
    return $rc
}

body_smoke() {
    # every launch synchronous: a fault is reported by the launch that made it, named
    CUDA_LAUNCH_BLOCKING=1 ./build/bench_cuda --smoke
    rc=$?
    key "$(grep '^smoke:' "$stage_base.log" | tail -n 1 | cut -c8-160)"
    return $rc
}

body_test_gpu() {
    make test-gpu
    rc=$?
    key "$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$stage_base.log" | tail -n 1)"
    n=$(grep -c '^FAIL' "$stage_base.log")
    [ "$n" -gt 0 ] && key "$n FAIL lines, the first: $(grep -m 1 '^FAIL' "$stage_base.log" | cut -c1-140)"
    return $rc
}

# The tensor-core attention (the default at head dims 64 and 128): its tests, then memcheck on the
# first six shapes and racecheck on a few, one process each.
body_mma() {
    fail=0; san=0
    sub tests 80 ./build/test_gpu_attention || fail=1
    key "tests: $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$stage_base.tests.log" | tail -n 1)"
    if have compute-sanitizer; then
        sub memcheck 30 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/test_gpu_attention --quick || san=1
        key "memcheck: $(grep -E 'ERROR SUMMARY' "$stage_base.memcheck.log" | sed 's/^=* *//' | tr '\n' ' ')"
        # racecheck slows these kernels past what --quick fits in: a few shapes, one process each
        # (each family in its own processes: --kind)
        for kind in mma wgmma; do
            shapes=$MMA_RACE_SHAPES; [ $kind = wgmma ] && shapes=$WGMMA_RACE_SHAPES
            for i in $shapes; do
                sub "racecheck-$kind-$i" 45 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/test_gpu_attention --shape "$i" --kind $kind || san=1
                s=$(grep -E 'RACECHECK SUMMARY' "$stage_base.racecheck-$kind-$i.log" | sed 's/^=* *//' | tr '\n' ' ')
                key "racecheck $kind shape $i: ${s:-no summary (see its log)}"
            done
        done
    fi
    return $(( fail | san ))
}

# The attention kernels a train_cuda benchmark ran: its header line names them.
ran_attention() { grep -m 1 -o 'cuda backend, [a-z-]* attention' "$stage_base.log" | cut -d' ' -f3; }

# compute-sanitizer TOOL on a tiny training step and on the attention tests (the FFMA kernels'),
# an equal share of the stage's time each. initcheck and synccheck also run the tensor-core
# kernels on one shape (the mma stage runs memcheck and racecheck on them). initcheck runs the
# attention tests alone: on an H100 (bench/RESULTS.md, 2026-11-27) it called every byte cuBLASLt's
# GEMMs had written uninitialized (test_gpu kernels' GEMM into fresh memory: 72,386 reports on
# output that the same test found correct), so on a step it reports each kernel reading a GEMM's
# output, and ran past 80 s doing so.
sanitize() {
    tool=$1; step=$2; shift 2
    have compute-sanitizer || skip "compute-sanitizer not found"
    targets="train attention"
    [ "$tool" = synccheck ] && targets="train attention tensor-core"
    [ "$tool" = initcheck ] && targets="attention tensor-core"
    n=$(echo $targets | wc -w)
    share=$(( stage_limit / n - 5 ))
    [ $share -ge 10 ] || share=10
    fail=0
    for what in $targets; do
        if [ $what = train ]; then
            # shellcheck disable=SC2086   # $step is two words on purpose
            set -- ./train_cuda --config model/tiny $step --microbatch 2 --layout padded --offload on --offload-pool 0.5 --device-budget 4
        elif [ $what = tensor-core ]; then
            set -- build/test_gpu_attention --shape 1
        elif [ "$tool" = racecheck ]; then
            set -- build/test_gpu attention --cases "$RACE_CASES"
        else
            set -- build/test_gpu attention
        fi
        extra=
        [ "$tool" = memcheck ] && extra="--leak-check full"
        [ "$tool" = racecheck ] && extra="--racecheck-report hazard"
        # shellcheck disable=SC2086
        sub $what "$share" compute-sanitizer --tool "$tool" --error-exitcode 9 $extra "$@"
        rc=$?
        [ $rc -eq 0 ] || fail=1
        s=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$stage_base.$what.log" | sed 's/^=* *//' | tr '\n' ' ')
        case $rc in 124|137) s="${s}timed out at $share s" ;; esac
        key "$what: ${s:-exit $rc, no summary}"
    done
    return $fail
}
body_memcheck() { sanitize memcheck --check; }
body_racecheck() { sanitize racecheck "--steps 1"; }
body_initcheck() { sanitize initcheck ""; }
body_synccheck() { sanitize synccheck --check; }

body_determinism() {
    fail=0
    for m in tiny-qwen3 tiny-moe; do
        for i in 1 2; do
            sub "$m-$i" 40 ./train_cuda --config model/$m --steps 2 --save-grads "$stage_base.$m-$i.safetensors" || fail=1
        done
        if [ ! -f "$stage_base.$m-1.safetensors" ] || [ ! -f "$stage_base.$m-2.safetensors" ]; then
            key "$m: a run wrote no gradients"
            fail=1
        elif cmp "$stage_base.$m-1.safetensors" "$stage_base.$m-2.safetensors"; then
            key "$m bitwise equal"
            rm -f "$stage_base.$m-1.safetensors" "$stage_base.$m-2.safetensors"
        else
            key "$m DIFFERS"
            fail=1
        fi
    done
    return $fail
}

body_replay() {
    ./train_cuda --replay 100 --lr 1e-4 --log "$stage_base.jsonl"
    rc=$?
    key "$(grep -E '^replay: (worst|PASS|FAIL)' "$stage_base.log" | sed 's/^replay: //' | tr '\n' ' ' | cut -c1-220)"
    return $rc
}

body_fuzz() {
    # a case may start just before the time is up, and a failed check runs three more (30 s each at most)
    sub check $((FUZZ_SECONDS + 120)) python3 test/fuzz_check.py --train ./train_cuda --cuda build/train-double --processes 1 \
        --seconds "$FUZZ_SECONDS" --timeout 30
    rc=$?
    sub resume $((FUZZ_RESUME_SECONDS + 60)) python3 test/fuzz_check.py --resume --train ./train_cuda --cuda build/train-double \
        --processes 1 --seconds "$FUZZ_RESUME_SECONDS" --timeout 30 || rc=1
    key "$(tail -n 2 "$stage_base.check.log" | tr '\n' ' ' | cut -c1-200); resume: $(tail -n 1 "$stage_base.resume.log")"
    return $rc
}

body_bench_cuda() {
    ./build/bench_cuda --reps "$REPS"
    rc=$?
    key "$(grep '^GEMM: mean' "$stage_base.log" | cut -c7-)"
    # attention lines: "<label> [name]  fwd  bwd   (fwd ms / bwd ms)", FFMA's then MMA's; then the
    # atomic-dQ backward's "<label> [name]  -  bwd   (bwd ms; deterministic / this: ratio)"
    key "$(awk '/\[(causal8k|p10k-8x2k|p10k-32x2k|causal8k-hd64)\]/ { n = $0; sub(/.*\[/, "", n); sub(/\].*/, "", n)
                if ($0 ~ /deterministic \/ this:/) { r = $NF; sub(/\)/, "", r); printf "%s%s atomic-dQ bwd %s (det/atomic time %s)", sep, n, $(NF-6), r }
                else printf "%s%s %s/%s", sep, n, $(NF-5), $(NF-4)
                sep = ", " }' "$stage_base.log") TF/s fwd/bwd"
    return $rc
}

body_gemm_rows() {
    rc=0
    for r in $GEMM_ROWS; do
        echo "== $r rows"
        limited 60 ./build/bench_cuda --only gemm --rows "$r" --reps "$REPS" || rc=1
    done
    # per row count: the forward and backward TF/s of q_proj and down_proj, and the mean ours/best
    key "$(awk '/^== [0-9]+ rows$/ { r = $2 }
                ($1 == "q_proj" || $1 == "down_proj") && NF >= 8 { t[$1] = t[$1] (t[$1] == "" ? "" : "/") $6 }
                /^GEMM: mean/ { printf "%s%s rows: q_proj %s, down_proj %s TF/s fwd/bwd, mean ours/best %s", sep, r, t["q_proj"], t["down_proj"], $4
                                sep = "; "; split("", t) }' "$stage_base.log")"
    return $rc
}

body_sdpa() {
    have python3 && python3 -c 'import torch' 2>/dev/null || skip "no python3 with torch"
    PYTHONUNBUFFERED=1 python3 bench/sdpa_ref.py --reps 10
    rc=$?
    key "$(awk '$1 == "causal8k" && $3 != "-" { printf "%s%s %s/%s", sep, $2, $3, $4; sep = ", " }' "$stage_base.log") TF/s causal 8k fwd/bwd"
    key "$(awk '$1 == "causal8k-hd64" && $3 != "-" { printf "%s%s %s/%s", sep, $2, $3, $4; sep = ", " }' "$stage_base.log") TF/s causal 8k fwd/bwd at head dim 64"
    return $rc
}

body_ncu() {
    have ncu || skip "ncu not found"
    rep="$stage_base.attention"
    lim_p=$(( stage_limit - 20 ))
    [ $lim_p -ge 10 ] || lim_p=10
    # every attention launch of one rep (a warm-up and a timed run each): FFMA's fwd x2, dq, dkv x2;
    # MMA's the same; the atomic-dQ table's fwd_mma, then fused dkv and dq_add x2; the wgmma
    # table's fwd_wgmma x2, bwd_dq_wgmma, bwd_dkv_wgmma x2: 23
    sub profile $lim_p ncu --clock-control none -k regex:'pr_k_attention_(fwd|bwd|dq_add)' --launch-count 23 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats -f -o "$rep" \
        ./build/bench_cuda --only attention --att causal8k --reps 1
    rc=$?
    [ -f "$rep.ncu-rep" ] || { key "no report: $(grep -m 1 -E '==ERROR==|ERR_' "$stage_base.profile.log" | cut -c1-140)"; return 1; }
    ncu -i "$rep.ncu-rep" --page details > "$stage_base.details.log" 2>&1
    ncu -i "$rep.ncu-rep" --page raw --csv > "$stage_base.raw.csv" 2>&1
    # per kernel (a block per kernel, headed by its name and launch): duration, SM and memory throughput
    key "$(awk 'function out() { if (k != "") { printf "%s%s %s %s, SM %s%%, memory %s%%", sep, k, dur, unit, sm, mem; sep = "; " } }
               /pr_k_attention_.*Context/ { out(); k = $0; sub(/.*pr_k_attention_/, "", k); sub(/[(].*/, "", k); sm = mem = dur = unit = "?" }
               /^ *Duration/ { dur = $NF; unit = $(NF-1) }
               /Compute \(SM\) Throughput/ { sm = $NF }
               /^ *Memory Throughput/ && $(NF-1) == "%" { mem = $NF }
               END { out() }' "$stage_base.details.log")"
    # the report itself only if small (the archive comes back under 16 MiB)
    [ "$(wc -c < "$rep.ncu-rep")" -lt 8000000 ] || rm -f "$rep.ncu-rep"
    return $rc
}

body_train_bench() {
    ./train_cuda --bench --config model/llama3-8b --layers "$BENCH_LAYERS" --bench-total "$BENCH_TOTAL" \
        --bench-groups "$BENCH_GROUPS" --bench-splits "$BENCH_SPLITS" $BENCH_MICROBATCH --bench-reps 1 --attention "$ATTENTION"
    rc=$?
    key "attention $(ran_attention); $(grep '^bench: mean' "$stage_base.log" | cut -c8-)"
    # rows: P/S G baseline-s reuse-s speedup bound ratio base-GF/s reuse-GF/s [base-MFU reuse-MFU], each followed
    # by reuse's phases: "reuse A/B/C: ...; beyond the baseline's rate: +a% / +b% / +c% of the step"
    key "$(awk '$1 ~ /^[0-9]+\/[0-9]+$/ && NF >= 9 { printf "%s%s G%s %s (bound %s, MFU %s/%s", sep, $1, $2, $5, $6, $10, $11; sep = "), " }
                $1 == "reuse" && $2 == "A/B/C:" { r = $0; sub(/.*rate: /, "", r); sub(/ of the step/, "", r); gsub(/ /, "", r); printf ", A/B/C beyond %s", r }
                END { if (sep != "") printf ")" }' "$stage_base.log" | cut -c1-400)"
    return $rc
}

body_bench_ab() {
    [ -n "$AB_DIRS" ] || skip "no AB_DIRS (source trees of other revisions to compare with)"
    rc=0
    bins=./build/bench_cuda
    for d in $AB_DIRS; do
        if [ -f "$d/Makefile" ] && sub "build-$(basename "$d")" 240 make -C "$d" -j"$JOBS" build/bench_cuda; then
            bins="$bins $d/build/bench_cuda"
        else
            key "$d: not built"
            rc=1
        fi
    done
    round=0
    while [ $round -lt "$AB_ROUNDS" ]; do     # in turn, so that a drift of the clocks falls on every tree alike
        round=$((round + 1))
        for b in $bins; do
            echo "== $b, round $round"
            limited 120 "$b" --only attention --att "$AB_CASES" --reps "$REPS" || rc=1
        done
    done
    # each tree's wgmma rows, the best of its rounds: "<tree> <case> fwd/bwd"
    key "$(awk '/^== .*round/ { b = $2; sub(/,$/, "", b); sub(/\/build\/bench_cuda$/, "", b); sub(/^\.$/, "this", b); t = 0; next }
                /^wgmma/ { t = 1; next }
                /^$/ { t = 0 }
                t && /\[/ { n = $0; sub(/.*\[/, "", n); sub(/\].*/, "", n); k = b " " n
                             if (!(k in f) || $(NF-5) + 0 > f[k]) f[k] = $(NF-5) + 0
                             if (!(k in w) || $(NF-4) + 0 > w[k]) w[k] = $(NF-4) + 0
                             if (!(k in seen)) { seen[k] = 1; order[++m] = k } }
                END { for (i = 1; i <= m; i++) printf "%s%s %.1f/%.1f", (i > 1 ? ", " : ""), order[i], f[order[i]], w[order[i]] }' "$stage_base.log") TF/s wgmma fwd/bwd"
    return $rc
}

# --profile's tables in a log: per schedule, the step, its three longest operations, the time
# between operations, and the GEMMs whose shape was new (each a query of cuBLASLt's heuristic on the
# host) out of all (test/check_profile.sh runs this on train_cuda's output)
profile_key() {
    awk '$1 == "profile" { printf "%s%s %s s:", sep, $2, $5; sep = "; "; n = 0; next }
         $1 ~ /%$/ && /between operations/ { printf " between %s", $1; next }
         $1 == "GEMMs:" { printf ", GEMMs of new shapes %s/%s a step", $5, $2; next }
         $1 ~ /%$/ && n++ < 3 { name = $6; for (i = 7; i <= NF; i++) name = name " " $i; printf " %s %s,", name, $1 }' "$1"
}

body_profile() {
    ./train_cuda --bench --profile --config model/llama3-8b --layers "$BENCH_LAYERS" --bench-total "$BENCH_TOTAL" \
        --bench-groups 8 --bench-splits 0.83333 $BENCH_MICROBATCH --bench-reps 1 --attention "$ATTENTION"
    rc=$?
    key "attention $(ran_attention); $(profile_key "$stage_base.log")"
    return $rc
}

body_train_memory() {
    ./train_cuda --bench memory --config model/llama3-8b --layers "$BENCH_LAYERS" --bench-total "$BENCH_TOTAL" \
        --bench-groups "$MEM_GROUPS" --bench-splits "$MEM_SPLITS" --attention "$ATTENTION"
    rc=$?
    key "attention $(ran_attention); $(awk '$2 == "reuse+offload" { l = $0 } END { if (l != "") print "last split, reuse+offload: " l }' "$stage_base.log" | tr -s ' ' | cut -c1-200)"
    return $rc
}

body_torch_ref() {
    have python3 && python3 -c 'import torch' 2>/dev/null || skip "no python3 with torch"
    PYTHONUNBUFFERED=1 python3 bench/torch_ref.py --config model/llama3-8b --layers "$BENCH_LAYERS" --total "$BENCH_TOTAL" \
        --groups "$TORCH_GROUPS" --splits "$TORCH_SPLITS" --reps 1
    rc=$?
    key "$(awk '$1 ~ /^[0-9]+\/[0-9]+$/ { printf "%s%s G%s eager %s s compile %s s (MFU %s/%s)", sep, $1, $2, $3, $4, $5, $6; sep = ", " }' "$stage_base.log")"
    return $rc
}

body_train_tree() {
    ./train_cuda --bench tree --config model/llama3-8b --layers "$BENCH_LAYERS" --bench-total "$TREE_TOTAL" \
        --bench-system "$TREE_SYSTEM" --bench-groups "$TREE_GROUPS" --microbatch 1 --bench-reps 2 --attention "$ATTENTION"
    rc=$?
    # rows: groups baseline-s reuse-s tree-s tree/reuse bound ratio tree/baseline bound ratio A+C A+C
    key "attention $(ran_attention); $(awk '$1 ~ /^[0-9]+$/ && NF >= 10 { printf "%s%s groups: tree/reuse %s (bound %s), tree/baseline %s (bound %s)", sep, $1, $5, $6, $8, $9; sep = ", " }' "$stage_base.log")"
    return $rc
}

# MoE's routing runs on the host (a softmax and top-k of 128 experts for every row, each MoE layer
# and pass, on OMP_NUM_THREADS threads, every core by default), between the router's GEMM and the
# experts' gathers: the GPU waits for it, and the profile's time between operations says how long.
# Every expert's row count is a GEMM shape of its own; the warm-up step ran the same routing, so the
# GEMMs of new shapes the profile counts are those the algorithm cache could not keep.
body_train_moe() {
    threads=${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo '?')}
    echo "host threads (OpenMP): $threads"
    ./train_cuda --bench --profile --config model/qwen3-30b-a3b --layers "$MOE_LAYERS" --bench-total "$MOE_TOTAL" \
        --bench-groups "$MOE_GROUPS" --bench-splits 0.83333 --microbatch 1 --bench-reps 1 --attention "$ATTENTION"
    rc=$?
    key "attention $(ran_attention), $threads host threads; $(grep '^bench: mean' "$stage_base.log" | cut -c8-)"
    key "$(profile_key "$stage_base.log")"
    return $rc
}

body_after() {
    have nvidia-smi || skip "no nvidia-smi"
    nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,memory.used,memory.total --format=csv
    nvidia-smi -q -d PERFORMANCE
    key "$(nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw,memory.used --format=csv,noheader 2>&1 | head -n 1 |
           awk -F', ' '{ printf "SM %s, %s C, %s, %s used", $1, $2, $3, $4 }')"
    return 0
}

# ------------------------------------------------------------------ BENCH_LAYERS=fit
# The card's memory in MiB: FIT_MEMORY_MIB, else nvidia-smi's memory.total (the first GPU in view).
card_mib() {
    if [ -n "$FIT_MEMORY_MIB" ]; then echo "$FIT_MEMORY_MIB"
    elif have nvidia-smi; then nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 | tr -dc 0-9
    fi
}
# The most Llama3-8B layers (1 to 32) whose full-sequence step of BENCH_TOTAL tokens fits beside
# their training state in the card less FIT_MARGIN_MIB, as `--bench capacity` counts it: the
# allocator's sizes at the CUDA backend's element sizes, from the CPU driver (no kernel runs, a
# second a count). The baseline's whole sequence is the larger need of the two schedules, and what
# fits only shrinks as layers are added: a bisection. Prints "LAYERS layers: why", or why none.
fit_layers() {
    mib=$(card_mib)
    [ -n "$mib" ] || { echo "no card memory to fit (no nvidia-smi, FIT_MEMORY_MIB unset)"; return 1; }
    make -s build/train-float > /dev/null 2>&1 || { echo "cannot build build/train-float to count with"; return 1; }
    room=$((mib - FIT_MARGIN_MIB))
    fits() {      # the baseline's most tokens at $1 layers, 0 for none
        t=$(build/train-float --bench capacity --config model/llama3-8b --layers "$1" --bench-budget "$room" --bench-sizes gpu 2>/dev/null |
            awk '$1 == "baseline" { print $2 }')
        case $t in ''|*[!0-9]*) echo 0 ;; *) echo "$t" ;; esac
    }
    lo=0; hi=32
    while [ $lo -lt $hi ]; do
        mid=$(( (lo + hi + 1) / 2 ))
        if [ "$(fits $mid)" -ge "$BENCH_TOTAL" ]; then lo=$mid; else hi=$((mid - 1)); fi
    done
    [ $lo -ge 1 ] || { echo "not one layer's step of $BENCH_TOTAL tokens fits in $room MiB ($mib less $FIT_MARGIN_MIB)"; return 1; }
    more=; [ $lo -lt 32 ] && more=", $((lo + 1)) layers $(fits $((lo + 1)))"
    echo "$lo layers: the full-sequence step of $BENCH_TOTAL tokens and the training state fit in $room MiB ($mib less $FIT_MARGIN_MIB): up to $(fits $lo) tokens$more"
}

if [ "${1:-}" = --body ]; then
    trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null; exit 143' TERM INT HUP
    "body_$(echo "$2" | tr - _)"
    exit $?
fi

# ------------------------------------------------------------------ the run
usage() {
    echo "usage: bench/run_gpu.sh [--list | --fit-layers] [--budget SECONDS] [--no-build] [--from STAGE|GROUP | STAGE|GROUP ...]"
    echo "stages: $all_stages"
    echo "groups: all (default), sanitize (memcheck racecheck initcheck synccheck), bench (bench-cuda gemm-rows bench-ab sdpa ncu train-bench profile train-memory torch-ref train-tree train-moe)"
}
list() {
    printf '%-13s %6s %6s %6s  %s\n' stage expect limit build what
    total=0
    for s in $all_stages; do
        e=$(expected "$s"); total=$((total + e))
        printf '%-13s %5ss %5ss %6s  %s\n' "$s" "$e" "$(field "$s" 3)" "$( [ "$(field "$s" 4)" = 1 ] && echo needs || echo -)" "$(field "$s" 5)"
    done
    echo "all: about $total s expected (as measured on an H100, make -j16); the budget stops the run at ${BUDGET:-540} s"
}

budget=${BUDGET:-540}
nobuild=0
chosen=
label=
while [ $# -gt 0 ]; do
    case $1 in
    --list) list; exit 0 ;;
    --fit-layers) fit_layers; exit $? ;;
    -h|--help) usage; exit 0 ;;
    --budget) [ $# -ge 2 ] && [ "$2" -gt 0 ] 2>/dev/null || { echo "run_gpu.sh: --budget wants seconds" >&2; exit 2; }
              budget=$2; shift ;;
    --no-build) nobuild=1 ;;
    --from)
        [ $# -ge 2 ] && g=$(group "$2") || { echo "run_gpu.sh: --from wants a stage or group" >&2; usage >&2; exit 2; }
        first=${g%% *}; on=0
        for s in $all_stages; do [ "$s" = "$first" ] && on=1; [ $on = 1 ] && chosen="$chosen $s"; done
        label="${label}_from-$2"; shift ;;
    -*) echo "run_gpu.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *)
        g=$(group "$1") || { echo "run_gpu.sh: unknown stage or group '$1'" >&2; usage >&2; exit 2; }
        chosen="$chosen $g"; label="${label}_$1" ;;
    esac
    shift
done
[ -n "$chosen" ] || { chosen=$all_stages; label=_all; }
for x in $EXPECT; do
    case $x in *=*) secs=${x#*=} ;; *) secs= ;; esac
    case $secs in ''|*[!0-9]*) echo "run_gpu.sh: EXPECT's '$x' wants stage=seconds" >&2; exit 2 ;; esac
    [ -n "$(field "${x%%=*}" 1)" ] || { echo "run_gpu.sh: EXPECT names no stage '${x%%=*}'" >&2; usage >&2; exit 2; }
done
case $AB_ROUNDS in ''|*[!0-9]*|0) echo "run_gpu.sh: AB_ROUNDS wants a count of rounds, not '$AB_ROUNDS'" >&2; exit 2 ;; esac
label=$(echo "${label#_}" | tr -c 'A-Za-z0-9_.\n-' '-' | cut -c1-60)
# the chosen stages in their running order, with preflight, after, and build where needed
needbuild=0
for s in $chosen; do [ "$(field "$s" 4)" = 1 ] && needbuild=1; done
run=
for s in $all_stages; do
    case " $chosen " in
    *" $s "*) run="$run $s" ;;
    *) { [ "$s" = preflight ] || [ "$s" = after ] || { [ "$s" = build ] && [ $needbuild = 1 ] && [ $nobuild = 0 ]; }; } && run="$run $s" ;;
    esac
done

# bench-ab's trees are built in the build stage, where the cores are idle
AB_EARLY=
case " $run " in *" bench-ab "*) AB_EARLY=$AB_DIRS ;; esac
export AB_EARLY

stamp=$(date -u +%Y%m%d-%H%M%S)
name="gpu-$label-$stamp"
if [ -n "${OUT:-}" ]; then
    outdir=$OUT
    tmproot=$(mktemp -d "${TMPDIR:-/tmp}/run_gpu.XXXXXX") || exit 1
else
    outdir=bench/out
    tmproot=$outdir
fi
mkdir -p "$outdir" "$tmproot/$name" || exit 1
logdir=$(cd "$tmproot/$name" && pwd)
summary="$logdir/summary.txt"
export logdir

archive() {
    tar czf "$outdir/$name.tgz.part" -C "$tmproot" "$name" 2>/dev/null
    if [ "$(wc -c < "$outdir/$name.tgz.part")" -gt 15000000 ]; then    # files come back under 16 MiB
        tar czf "$outdir/$name.tgz.part" --exclude='*.ncu-rep' --exclude='*.safetensors' -C "$tmproot" "$name" 2>/dev/null
    fi
    mv -f "$outdir/$name.tgz.part" "$outdir/$name.tgz"
    cp "$summary" "$outdir/$name-summary.txt"
}

start=$(date +%s)
deadline=$((start + budget))
reserve=25                        # for after and the last archive
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && commit="$commit+changes"
{
    echo "# bench/run_gpu.sh$run"
    echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(hostname 2>/dev/null || uname -n), commit $commit, budget ${budget}s, make -j$JOBS"
    echo "# AB_DIRS=$AB_DIRS BENCH_LAYERS=$BENCH_LAYERS BENCH_GROUPS=$BENCH_GROUPS BENCH_SPLITS=$BENCH_SPLITS BENCH_MICROBATCH=\"$BENCH_MICROBATCH\" MEM_GROUPS=$MEM_GROUPS MEM_SPLITS=$MEM_SPLITS BENCH_TOTAL=$BENCH_TOTAL TORCH_SPLITS=$TORCH_SPLITS TORCH_GROUPS=$TORCH_GROUPS REPS=$REPS RACE_CASES=$RACE_CASES TREE_TOTAL=$TREE_TOTAL TREE_SYSTEM=$TREE_SYSTEM TREE_GROUPS=$TREE_GROUPS MOE_LAYERS=$MOE_LAYERS MOE_TOTAL=$MOE_TOTAL MOE_GROUPS=$MOE_GROUPS ATTENTION=$ATTENTION AB_ROUNDS=$AB_ROUNDS FUZZ_SECONDS=$FUZZ_SECONDS FUZZ_RESUME_SECONDS=$FUZZ_RESUME_SECONDS EXPECT=\"$EXPECT\""
    printf '# %-11s %-7s %5s  %s\n' stage status secs "key figure"
} > "$summary"
cat "$summary"

build_status=ok
n=0
unpassed=
finish() {
    total=$(( $(date +%s) - start ))
    counts=$(awk '!/^#/ && NF >= 2 { c[$2]++ } END { printf "%d ok, %d FAIL, %d TIMEOUT, %d SKIP", c["ok"], c["FAIL"], c["TIMEOUT"], c["SKIP"] }' "$summary")
    echo "# $total s of a ${budget} s budget: $counts" | tee -a "$summary"
    if [ -n "$unpassed" ]; then
        echo "# ---- the last lines of each stage that did not pass" >> "$summary"
        for s in $unpassed; do
            {
                echo "## $s"
                tail -n 15 "$logdir"/[0-9][0-9]-"$s".log
            } >> "$summary"
        done
        sed -n '/^# ---- the last lines/,$p' "$summary"
    fi
    archive
    echo "logs: $outdir/$name.tgz; summary: $outdir/$name-summary.txt"
}
# A signal stops the stage in hand (its process group through timeout) and still writes the archive.
# The handler runs inside the stage's redirection: its output goes to fd 3, the run's own stdout.
on_signal() {
    trap - INT TERM HUP
    {
        [ -n "$child" ] && kill -TERM "$child" 2>/dev/null && wait "$child" 2>/dev/null
        printf '%-13s %-7s %5s  %s\n' "$cur" FAIL "$(( $(date +%s) - t_start ))" "interrupted by a signal" | tee -a "$summary"
        unpassed="$unpassed $cur"
        finish
    } >&3 2>&3
    exit 130
}
exec 3>&1
t_start=$(date +%s)
cur=
trap on_signal INT TERM HUP

# BENCH_LAYERS=fit is counted once, before the first stage that takes it (after the build)
fit_once() {
    case $cur in train-bench|profile|train-memory|torch-ref|train-tree) ;; *) return ;; esac
    [ "$BENCH_LAYERS" = fit ] || return
    if why=$(fit_layers); then BENCH_LAYERS=${why%% *}; else BENCH_LAYERS=1; why="$why; one layer instead"; fi
    export BENCH_LAYERS
    echo "# BENCH_LAYERS=fit: $why" | tee -a "$summary"
}

for cur in $run; do
    fit_once
    exp=$(expected "$cur"); lim=$(field "$cur" 3)
    n=$((n + 1))
    stage_base="$logdir/$(printf '%02d' $n)-$cur"
    log="$stage_base.log"
    t_start=$(date +%s)
    status=; note=; cut=
    if [ "$(field "$cur" 4)" = 1 ] && [ "$build_status" != ok ]; then
        status=SKIP; note="needs the build (build: $build_status)"
    elif [ "$cur" != after ]; then
        left=$((deadline - t_start - reserve))
        need=$(( (exp + 1) / 2 ))
        [ $need -lt 5 ] && need=5
        case " $whole_stages " in *" $cur "*) need=$exp ;; esac
        if [ "$left" -lt "$need" ]; then status=SKIP; note="not started: ${left} s of the budget left, ${exp} s expected"
        elif [ $left -lt "$lim" ]; then lim=$left; cut=" (the budget's)"; fi
    fi
    if [ -z "$status" ]; then
        stage_limit=$lim
        export stage_base stage_limit
        limited "$lim" sh "$self" --body "$cur" > "$log" 2>&1
        rc=$?
        case $rc in
        0) status=ok ;;
        77) status=SKIP; note=$(sed -n 's/^skip: //p' "$log" | tail -n 1) ;;
        124|137) status=TIMEOUT; note="stopped at the ${lim} s limit$cut" ;;
        *) status=FAIL ;;
        esac
    else
        echo "$note" > "$log"
    fi
    [ "$cur" = build ] && build_status=$status
    secs=$(( $(date +%s) - t_start ))
    k=$(sed -n 's/^key: //p' "$log" | awk 'NF { printf "%s%s", sep, $0; sep = "; " }')
    [ -n "$k" ] || [ -n "$note" ] || k=$(grep -v -e '^[[:space:]]*$' -e '^key:' "$log" | tail -n 1)
    [ -n "$note" ] && k="${k:+$k; }$note"
    printf '%-13s %-7s %5s  %s\n' "$cur" "$status" "$secs" "$(echo "$k" | cut -c1-400)" | tee -a "$summary"
    case $status in ok|SKIP) ;; *) unpassed="$unpassed $cur" ;; esac
    archive
done
trap - INT TERM HUP
finish
[ -z "$unpassed" ]
