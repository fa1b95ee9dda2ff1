#!/bin/sh
# Runs every test program of a build folder (the C++ one too) and ./train --check in both precisions (offload off
# and on, recompute, steps of several groups, the MoE preset in both aux-loss scopes, and meshes of in-process
# ranks); prints each program's output, then the total as the last line: "N passed, N failed".
# TEST_JOBS programs run at once (default: one a core; 1: one after another), each one's output printed as it ends.
dir=${1:-build}
. "$(dirname "$0")/tally.sh"
run_at_once "${TEST_JOBS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)}"
# the sanitizer build's train_cuda on the emulated device: one in six allocations failing, one
# --check with offload's copies (the emulated kernels under the sanitizers take minutes a run), and
# the operation profile's events. First, as the longest programs of that suite: the others then
# share the cores with them.
if [ -x "$dir/train_cuda-emu" ]; then
    run sh "$(dirname "$0")/check_oom.sh" "$dir/train_cuda-emu" 6
    run "$dir/train_cuda-emu" --check --offload on
    run sh "$(dirname "$0")/check_profile.sh" "$dir/train_cuda-emu"
fi
for p in float double; do
    for t in test_core test_gemm test_io test_trace test_comm; do run "$dir/$t-$p"; done
done
run "$dir/test_attn_model-double"
run "$dir/test_attn_check"
run "$dir/test_cxx"
run sh "$(dirname "$0")/test_flags.sh" "$dir/train-float"
run "$dir/test_mma_emul"
run "$dir/test_mma_kernels"
run "$dir/test_cuda_emu"
# The GPU suite (test/run_gpu.sh) and the tensor-core attention's GPU test on the emulated device
# (test/cuda_emu.cc), and train_cuda on meshes of processes (test/run_mesh_gpu.sh, test/nccl_emu.h's
# NCCL): the CUDA backend's host code and kernels against the CPU double build. Built
# in build/emu by make test; the sanitizer build has none.
if [ -x "$dir/emu/train_cuda" ]; then
    run env TRAIN_CUDA="$dir/emu/train_cuda" TEST_GPU="$dir/emu/test_gpu" sh "$(dirname "$0")/run_gpu.sh"
    run "$dir/emu/test_gpu_attention"
    run env EMULATED_NCCL=1 TRAIN_CUDA="$dir/emu/train_cuda" FLIP_SEED=1 sh "$(dirname "$0")/run_mesh_gpu.sh"
    # offload's copy stream run as early as allowed (test/cuda_emu.h): a copy that overwrites what
    # compute still reads, or one not ordered behind the compute it copies, then shows
    for args in "--microbatch 2 --offload on --offload-pool 0.5 --device-budget 4" "--microbatch 2 --layout packed --recompute all --offload on" \
                "--config model/tiny-moe --schedule tree --tree-min 1 --groups-per-step 4 --microbatch 2 --aux-scope group --offload on"; do
        run env PR_EMU_SCHEDULE=eager-side "$dir/emu/train_cuda" --check $args
    done
    # a process given one GPU alone (CUDA_VISIBLE_DEVICES naming one) runs on it, device 0,
    # whatever its LOCAL_RANK (the emulated machine has 8 devices)
    run env LOCAL_RANK=11 CUDA_VISIBLE_DEVICES=3 "$dir/emu/train_cuda" --steps 1
    # every kernel's result independent of the order its blocks, warps and lanes run in
    # (PR_EMU_ORDER, test/gpu_emu.h): two threads adding into one element, updates a GPU loses,
    # give other bits in reverse. Reuse (its loss head's repeated rows), MoE (its combine), packed.
    # One program to the totals: both orders' steps and their comparison.
    same_bits_both_orders() {
        d=$(mktemp -d) || return 1
        for order in forward reverse; do
            PR_EMU_ORDER=$order "$dir/emu/train_cuda" "$@" --steps 1 --save-grads "$d/$order.safetensors" || { rm -rf "$d"; return 1; }
        done
        cmp "$d/forward.safetensors" "$d/reverse.safetensors" && echo "the same bits in both orders"
        rc=$?
        rm -rf "$d"
        return $rc
    }
    for args in "--config model/tiny" "--config model/tiny-moe" "--config model/tiny-qwen3 --layout packed --microbatch 2"; do
        # shellcheck disable=SC2086   # $args is several words on purpose
        run same_bits_both_orders $args
    done
    # random cases (test/fuzz_check.py) on the device's kernels, in bf16: a failed check asked again
    # against the double build; resumed runs bit for bit those that never stopped
    run python3 test/fuzz_check.py --train "$dir/emu/train_cuda" --cuda "$dir/train-double" --cases 30 --seed 1
    run python3 test/fuzz_check.py --resume --train "$dir/emu/train_cuda" --cuda "$dir/train-double" --cases 10 --seed 1
    # the replay's bf16 rule: reuse and the full-sequence schedule against the CPU's trajectory
    run sh "$(dirname "$0")/test_replay.sh" "$dir/emu/train_cuda"
    # each device and pinned allocation failing in turn: an out-of-memory error, never a crash
    run sh "$(dirname "$0")/check_oom.sh" "$dir/emu/train_cuda"
fi
for p in float double; do run sh "$(dirname "$0")/test_resume.sh" "$dir/train-$p"; done
for p in float double; do run sh "$(dirname "$0")/test_replay.sh" "$dir/train-$p"; done
for p in float double; do
    for lay in padded packed; do run "$dir/train-$p" --check --microbatch 3 --layout $lay --kl-coef 0.04; done
    run "$dir/train-$p" --check --groups-per-step 2 --loss-norm seq-mean-token-sum --microbatch 3 --layout packed --kl-coef 0.04
    run "$dir/train-$p" --check --dp 3 --groups-per-step 2 --loss-norm seq-mean-token-sum-norm --loss-norm-len 48
    run "$dir/train-$p" --check --microbatch 2 --offload on --offload-pool 0.5 --device-budget 4
    run "$dir/train-$p" --check --microbatch 2 --layout packed --recompute all --offload on
    run "$dir/train-$p" --config model/tiny-moe --check --recompute prefix --tp 2 --ep 2 --cp 2 --aux-scope group
    for scope in microbatch group; do
        run "$dir/train-$p" --config model/tiny-moe --check --microbatch 3 --layout packed --aux-scope $scope --kl-coef 0.04
    done
    run "$dir/train-$p" --check --tp 2 --cp 2
    run "$dir/train-$p" --check --tp 2 --cp 2 --offload on --offload-pool 0.5 --device-budget 4 --recompute prefix
    run "$dir/train-$p" --check --tp 4 --kl-coef 0.04
    run "$dir/train-$p" --config model/tiny-qwen3 --check --tp 4 --cp 2
    run "$dir/train-$p" --check --dp 2 --cp 2 --kl-coef 0.04
    run "$dir/train-$p" --check --dp 2 --cp 2 --kl-coef 0.04 --microbatch 1
    run "$dir/train-$p" --config model/tiny-moe --check --tp 2 --ep 2 --cp 2 --aux-scope group
    run "$dir/train-$p" --check --pp 2 --tp 2 --cp 2 --kl-coef 0.04
    run "$dir/train-$p" --config model/tiny-moe --check --pp 2 --tp 2 --ep 2 --microbatch 2 --layout packed
    run "$dir/train-$p" --check --dp 2 --groups-per-step 1 --kl-coef 0.04
    run "$dir/train-$p" --check --dp 3 --zero 2 --grad-reduce bf16
    run "$dir/train-$p" --config model/tiny-moe --check --dp 4 --groups-per-step 2 --pp 2 --aux-scope group
    # more groups than dp ranks: each rank's expert load covers all of its groups (the check
    # compares the loads with the baseline's)
    run "$dir/train-$p" --config model/tiny-moe --check --tp 2 --groups-per-step 2
done
run "$dir/train-float" --bench capacity --bench-sizes gpu --bench-budget 6 --config model/tiny-moe --dp 2 --tp 2 --ep 2 --zero 2
run "$dir/train-float" --bench memory --bench-sizes gpu --bench-total 96 --bench-groups 4 --bench-splits 0.5 --microbatch-tokens 100
for p in float double; do      # a token budget: microbatches of one trajectory full-sequence, of two or three in Phase B
    run "$dir/train-$p" --check --microbatch-tokens 150 --layout packed --kl-coef 0.04
    run "$dir/train-$p" --check --pp 2 --tp 2 --microbatch-tokens 150
    run "$dir/train-$p" --check --schedule tree --tree-min 1 --groups-per-step 4 --microbatch-tokens 100
done
run "$dir/train-float" --prefix-tree 4 --groups-per-step 4
for p in float double; do
    run "$dir/train-$p" --check --schedule tree --tree-min 1 --groups-per-step 4 --microbatch 3 --recompute prefix
    run "$dir/train-$p" --config model/tiny-moe --check --schedule tree --tree-min 1 --groups-per-step 4 --microbatch 2 \
        --aux-scope group --offload on
done
run "$dir/train-float" --schedule tree --groups-per-step 2 --steps 2
run "$dir/train-float" --check --schedule tree --tree-min 1 --groups-per-step 4 --dp 2 --tp 2 --pp 2
run "$dir/train-double" --config model/tiny-moe --check --schedule tree --tree-min 1 --groups-per-step 4 --pp 2 --aux-scope group
run "$dir/train-double" --check --schedule tree --tree-min 1 --groups-per-step 4 --cp 3 --tp 2
for p in float double; do      # the expert load summed over cp once, not once a group
    run "$dir/train-$p" --config model/tiny-moe --check --schedule tree --tree-min 1 --groups-per-step 4 --cp 2
done
run "$dir/train-float" --check --trace data/multiturn.trace --schedule tree --tree-min 8 --cp 2 --dp 2
for p in float double; do      # trained prefix tokens: a multi-turn trace, both schedules and its tree
    run "$dir/train-$p" --check --trace data/multiturn.trace --microbatch 2 --recompute prefix
    run "$dir/train-$p" --check --trace data/multiturn.trace --schedule tree --tree-min 8 --offload on
done
run "$dir/train-float" --check --schedule tree --tree-min 1 --groups-per-step 2 --dp 4    # a tree step of fewer groups than dp ranks
# random models, traces and flags (test/fuzz_check.py), the same cases every run (a new seed's with
# make fuzz): each case's --check, and the case trained straight against cut in two and resumed
for p in float double; do
    run python3 test/fuzz_check.py --train "$dir/train-$p" --cases 300 --seed 1
    run python3 test/fuzz_check.py --resume --train "$dir/train-$p" --cases 300 --seed 1
done
# the same cases with one of the library's allocations failing: an out-of-memory error, every rank
# ending, never a crash, a hang or (under the sanitizers) a leak
run python3 test/fuzz_check.py --faults --train "$dir/train_faults-double" --cases 300 --seed 1
run python3 test/test_importers.py "$dir/train-float"
run python3 test/test_plot.py "$dir/train-float"
run python3 test/check_readme.py "$dir/train-float"      # README's capacity tables against the program
run python3 test/test_sass_loops.py
report
