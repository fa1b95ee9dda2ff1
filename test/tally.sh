# Sourced by run.sh and run_gpu.sh: `run CMD...` prints a program's output and adds its
# "N passed, N failed" line (or, without one, its exit status as one check) to the totals;
# `report` prints the totals as the last line and sets the exit status.
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
report() {
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ]
}
