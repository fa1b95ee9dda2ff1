#!/bin/sh
# train_cuda on the emulated device with each of its allocations failing in turn (PR_EMU_FAIL_ALLOC,
# test/cuda_emu.h): every run either goes on without the allocation (exit 0) or stops with
# exit 1 and a message that says memory ran out (or that it cannot allocate); none crashes, hangs, faults on the device or
# trips the sanitizers. The sweep ends at the first allocation number no run reaches.
# Usage: sh test/check_oom.sh TRAIN_CUDA [STRIDE] (every STRIDE-th allocation; 1: all).
# Last line: "N passed, N failed".
train=${1:-build/emu/train_cuda}
stride=${2:-1}
passed=0
failed=0
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }
out=$(mktemp)
err=$(mktemp)
for args in "--steps 2 --groups-per-step 2 --microbatch 2 --offload on" \
            "--config model/tiny-moe --schedule tree --tree-min 1 --groups-per-step 4 --microbatch 2 --aux-scope group --offload on --steps 1"; do
    k=0
    stopped=0
    while :; do
        # shellcheck disable=SC2086   # $args is several words on purpose
        PR_EMU_FAIL_ALLOC=$k timeout 300 "$train" $args >"$out" 2>"$err"
        rc=$?
        if ! grep -q "allocation $k fails, as PR_EMU_FAIL_ALLOC asks" "$err"; then
            [ $rc = 0 ] || fail "$args: the run past the last allocation exited $rc: $(tail -n 1 "$err")"
            break
        fi
        last=$(grep -v "^emulated device: allocation" "$err" | tail -n 1)    # the error, if any
        if grep -q "AddressSanitizer\|runtime error:\|LeakSanitizer" "$err"; then
            fail "$args: allocation $k: the sanitizers report: $(grep -m 1 "AddressSanitizer\|runtime error:\|LeakSanitizer" "$err")"
        elif grep -v "^emulated device: allocation" "$err" | grep -q "^emulated device:"; then
            fail "$args: allocation $k: a device fault: $(grep -v "^emulated device: allocation" "$err" | grep -m 1 "^emulated device:")"
        elif [ $rc = 1 ] && printf '%s\n' "$last" | grep -q "memory\|cannot allocate"; then
            passed=$((passed + 1))
            stopped=$((stopped + 1))
        elif [ $rc = 0 ]; then
            passed=$((passed + 1))
        else
            fail "$args: allocation $k: exit $rc: $last"
        fi
        k=$((k + stride))
    done
    echo "check_oom: $args: $k allocations, one in $stride made to fail; $stopped runs stopped, out of memory"
    [ $stopped -gt 0 ] || fail "$args: no run stopped: the failures were not injected"
done
rm -f "$out" "$err"
printf '%d passed, %d failed\n' "$passed" "$failed"
