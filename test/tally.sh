# Sourced by run.sh, run_gpu.sh and run_mesh_gpu.sh: `run CMD...` prints a program's output and adds
# its "N passed, N failed" line (or, without one, its exit status as one check) to the totals;
# `report` prints the totals as the last line and sets the exit status. Each program's seconds follow
# its output, and the report lists the ten slowest first (what to cut when the suite outgrows CI's
# time).
# `run_at_once N`, before the first `run`, lets N programs run at once (test/run.sh: one a core;
# the emulated device and most tests are single-threaded; each program gets one OpenMP thread unless
# OMP_NUM_THREADS says otherwise). Each program's output is still printed whole, under its command
# line, as the program ends; the totals are the same; an interrupt ends every program started.
passed=0; failed=0
tally_pool=1; tally_started=0; tally_shown=0; tally_pids=
tally_spool=$(mktemp -d) || exit 1

run_at_once() {
    case $1 in
        '' | *[!0-9]* | 0) echo "run_at_once: '$1' is not a number of programs"; exit 2 ;;
    esac
    tally_pool=$1
    [ "$tally_pool" -gt 1 ] || return 0
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    # Programs started in the background ignore SIGINT (a shell without job control) and live on
    # after this shell, so an interrupt ends them here, with whatever they started.
    trap 'tally_interrupted 130' INT
    trap 'tally_interrupted 143' TERM
    trap 'tally_interrupted 129' HUP
}

# ends process $1 and its descendants, each before the processes it started (a script cannot start
# another once ended; procps's pgrep finds the children, and without it only $1 ends)
tally_end_tree() {
    tally_children=$(pgrep -P "$1" 2>/dev/null)
    kill -TERM "$1" 2>/dev/null
    for tally_child in $tally_children; do tally_end_tree "$tally_child"; done
}

tally_interrupted() {
    for tally_pid in $tally_pids; do tally_end_tree "$tally_pid"; done
    rm -rf "$tally_spool"
    exit "$1"
}

# prints program $1's output and adds it to the totals
tally_show() {
    [ "$tally_pool" -gt 1 ] && echo "== $(cat "$1.cmd")"
    cat "$1.out"
    tally_rc=$(cat "$1.rc")
    tally_sec=$(( $(cat "$1.end") - $(cat "$1.start") ))
    echo "($tally_sec s)"
    printf '%6d s  %s\n' "$tally_sec" "$(cat "$1.cmd")" >> "$tally_spool/seconds"
    tally_line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1.out" | tail -n 1)
    if [ -n "$tally_line" ]; then
        tally_np=${tally_line%% passed*}; tally_nf=${tally_line#*passed, }; tally_nf=${tally_nf%% failed*}
        passed=$((passed + tally_np)); failed=$((failed + tally_nf))
        [ "$tally_rc" -ne 0 ] && [ "$tally_nf" -eq 0 ] && failed=$((failed + 1))
    elif [ "$tally_rc" -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
    rm -f "$1".*
}

# shows every program that has ended (its exit status appears whole, by a rename)
tally_show_ended() {
    for tally_rcf in "$tally_spool"/*.rc; do
        [ -f "$tally_rcf" ] || continue
        tally_show "${tally_rcf%.rc}"
        tally_shown=$((tally_shown + 1))
    done
}

# Pool 1 runs the program in the foreground, its command line printed before it starts; a pool
# waits for a free place, then starts it in the background.
run() {
    while [ $((tally_started - tally_shown)) -ge "$tally_pool" ]; do tally_show_ended; sleep 0.2; done
    tally_started=$((tally_started + 1))
    tally_f=$tally_spool/$tally_started
    printf '%s\n' "$*" > "$tally_f.cmd"
    if [ "$tally_pool" -le 1 ]; then
        echo "== $*"
        date +%s > "$tally_f.start"; "$@" > "$tally_f.out" 2>&1; echo $? > "$tally_f.rc"; date +%s > "$tally_f.end"
    else
        ( date +%s > "$tally_f.start"; "$@" > "$tally_f.out" 2>&1; echo $? > "$tally_f.part"; date +%s > "$tally_f.end"
          mv "$tally_f.part" "$tally_f.rc" ) &
        tally_pids="$tally_pids $!"
    fi
    tally_show_ended
}

report() {
    until tally_show_ended; [ "$tally_shown" -eq "$tally_started" ]; do sleep 0.2; done
    if [ -f "$tally_spool/seconds" ]; then
        echo "the slowest programs:"
        sort -rn "$tally_spool/seconds" | head -n 10
    fi
    rm -rf "$tally_spool"
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ]
}
