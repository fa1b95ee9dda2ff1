#!/bin/sh
# train_cuda --bench --profile on model/tiny (2 layers), G 2, microbatch 1: the GPU's time in
# operations fits inside the step's wall time (what is left is the time between them), and the
# attention calls a step are the schedule's: the baseline runs each layer's forward once a
# trajectory (2 x 2), reuse once for the prefix and once a suffix (2 x 3); and after the warm-up
# step every GEMM's shape is one the algorithm cache holds (none asks cuBLASLt's heuristic again).
# bench/run_gpu.sh's summary of such output (profile_key, its profile and train-moe stages' key),
# under that script's set -u, names both schedules' steps, operations and time between them.
# Usage: sh test/check_profile.sh TRAIN_CUDA. Last line: "N passed, N failed".
train=${1:-./train_cuda}
out=$("$train" --bench --profile --bench-total 48 --bench-groups 2 --bench-splits 0.75 --bench-reps 2 --microbatch 1 2>&1)
rc=$?
printf '%s\n' "$out"
key=$(set -u; eval "$(sed -n '/^profile_key() {/,/^}/p' "$(dirname "$0")/../bench/run_gpu.sh")" &&
      printf '%s\n' "$out" | profile_key - 2>&1)
echo "bench/run_gpu.sh's key: $key"
printf '%s\n' "$out" | awk -v rc="$rc" -v key="$key" '
    function fail(msg) { failed++; print "FAIL: " msg }
    function close_block() {
        if (what == "") return
        if (between_ms == "" || between_ms < -0.001 * step_ms) fail(what ": " between_ms " ms between operations: the operations outlast the step"); else passed++
        want = what == "baseline" ? 4 : 6
        if (att != want) fail(what ": " att " attention_fwd calls a step, want " want); else passed++
        if (gemms == "" || gemms <= 0 || fresh != 0) fail(what ": GEMMs a step " gemms ", of new shapes " fresh " (want some, none new)"); else passed++
        blocks++
        what = ""
    }
    $1 == "profile" {
        close_block(); what = $2; step_ms = 1000 * $5; att = -1; between_ms = ""; gemms = ""; fresh = ""
        if (/some untimed/) fail(what ": some operations went untimed"); else passed++
        next
    }
    what != "" && $1 == "GEMMs:" { gemms = $2; fresh = $5; next }
    what != "" && $1 ~ /%$/ {
        if ($0 ~ /between operations/) between_ms = $2
        if ($6 == "attention_fwd") att = $4
        next
    }
    { close_block() }
    END {
        close_block()
        if (rc != 0) fail("train_cuda exited " rc); else passed++
        if (blocks != 2) fail(blocks + 0 " profiles, want 2 (baseline and reuse)"); else passed++
        if (key !~ /^baseline [0-9.]+ s: [^;]+ [0-9.]+%, .* between -?[0-9.]+%, GEMMs of new shapes 0\.0\/[0-9.]+ a step; reuse [0-9.]+ s: [^;]+ [0-9.]+%, .* between -?[0-9.]+%, GEMMs of new shapes 0\.0\/[0-9.]+ a step$/)
            fail("bench/run_gpu.sh summarises the profile as \"" key "\""); else passed++
        printf "%d passed, %d failed\n", passed, failed
    }'
