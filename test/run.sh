#!/bin/sh
# Runs every test program of a build folder and ./train --check in both precisions; prints each
# program's output, then the total as the last line: "N passed, N failed".
dir=${1:-build}
passed=0; failed=0
run() {
    echo "== $*"
    out=$("$@" 2>&1); rc=$?
    printf '%s\n' "$out"
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    if [ -n "$line" ]; then
        np=${line%% passed*}; nf=${line#*passed, }; nf=${nf%% failed*}
        passed=$((passed + np)); failed=$((failed + nf))
        [ "$rc" -ne 0 ] && [ "$nf" -eq 0 ] && failed=$((failed + 1))
    elif [ "$rc" -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
}
for p in float double; do
    for t in test_core test_gemm test_io test_trace; do run "$dir/$t-$p"; done
done
for p in float double; do
    for lay in padded packed; do run "$dir/train-$p" --check --microbatch 3 --layout $lay --kl-coef 0.04; done
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
