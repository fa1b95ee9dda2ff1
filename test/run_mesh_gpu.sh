#!/bin/sh
# train_cuda on a mesh, from the repository root: one process a rank, as on a node of GPUs (RANK,
# WORLD_SIZE, LOCAL_RANK, --nccl-id), through the NCCL communicator. On the emulated device
# (make test-gpu-emu: TRAIN_CUDA=build/emu/train_cuda, test/nccl_emu.h's NCCL between processes)
# it runs on any machine; on a real node it needs 4 GPUs.
#   --check on dp, tp, pp, cp and ep meshes (MoE's all-to-all), split groups, the prefix-tree
#   schedule and the bf16 sum over dp: bf16 reuse on the mesh vs the bf16 baseline on one rank
#   (rank 0 compares); ZeRO stage 2 against stage 0 after three steps; an exact resume (ZeRO-2,
#   dp x tp, and through a state saved again on tp x pp) and offload on a dp x pp and a cp x tp mesh,
#   each bit for bit against the run without; the
#   seeded draw and a checkpoint's load on tp x pp, bit for bit those of one process, and a save
#   failing on rank 0 failing on every rank; one step's
#   gradients on a tp x pp mesh against the CPU double build's, per tensor, within 2^-5 relative;
#   every communicator non-blocking (NCCL_COMM_BLOCKING=0) on dp x tp;
#   a stale --nccl-id file from an earlier launch replaced, not joined; a rank that never starts
#   ending rank 0's init after --nccl-timeout (the init is watched); the id over TCP
#   (--nccl-id tcp://HOST:PORT), rank 0 coming last, the ranks it refuses (another world size, a
#   RANK taken twice, an earlier launch's rank still calling, which then takes no rank's place) or
#   waits for in vain, each named, --nccl-id without a mesh refused, and (with unshare -rn) a rank meeting
#   itself on rank 0's port; a rank that hangs mid-run ending its peer's run with an error after
#   --nccl-timeout, and one that is killed ending it at once (on a real node, where NCCL may not
#   see a killed peer, at once or after the timeout); with FLIP_SEED, a check that fails on a
#   routing flip and says so. EMULATED_NCCL=1: the run is on the emulated device (make
#   test-gpu-emu, test/run.sh).
# A bf16 mesh rounds its sums differently from one rank, so a token whose PPO ratio lies within
# rounding of 1 - eps-low or 1 + eps-high may clip in one run only, and its gradient terms differ
# whole (the check prints the clipped-token counts when they differ): the runs past dp use a clip
# range no token of the trace reaches. Clipping itself is checked on one rank (test/run_gpu.sh)
# and exactly on the CPU. Last line: "N passed, N failed".
# shellcheck disable=SC2086   # $wide and $zt are several words on purpose
. "$(dirname "$0")/tally.sh"
TRAIN_CUDA=${TRAIN_CUDA:-./train_cuda}
tmp=$(mktemp -d)
wide="--eps-low 0.99 --eps-high 100"
id="$tmp/nccl-id"             # --nccl-id of the ranks below
first=0                       # the rank started first; the others follow in order, round to it

# ranks N ARGS...: N processes of train_cuda ARGS, each under a time limit; rank 0's output, the
# other ranks' last lines; fails unless every rank exits 0.
ranks() {
    n=$1; shift
    k=0; pids=
    while [ "$k" -lt "$n" ]; do
        r=$(((first + k) % n))
        RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r timeout 900 "$TRAIN_CUDA" "$@" --nccl-id "$id" > "$tmp/rank$r.log" 2>&1 &
        pids="$pids $!"
        k=$((k + 1))
        [ "$first" -eq 0 ] || sleep 1
    done
    bad=0
    for pid in $pids; do wait "$pid" || bad=1; done
    cat "$tmp/rank0.log"
    r=1
    while [ "$r" -lt "$n" ]; do
        printf 'rank %d: %s\n' "$r" "$(tail -n 1 "$tmp/rank$r.log")"
        r=$((r + 1))
    done
    return $bad
}

# an id file an earlier launch left behind: rank 0 replaces it, and no rank joins the old world
printf 'stale' > "$tmp/nccl-id"
touch -d '1 hour ago' "$tmp/nccl-id"
run ranks 2 --dp 2 --check
run ranks 2 --dp 2 --check --grad-reduce bf16
run ranks 4 --dp 2 --tp 2 --check $wide
# every communicator non-blocking (NCCL_COMM_BLOCKING=0 overrides the configuration): each exchange
# waits for NCCL's thread to queue it before it waits for the stream
nonblocking() {
    had=${NCCL_COMM_BLOCKING-unset}
    NCCL_COMM_BLOCKING=0; export NCCL_COMM_BLOCKING
    ranks "$@"; st=$?
    if [ "$had" = unset ]; then unset NCCL_COMM_BLOCKING; else NCCL_COMM_BLOCKING=$had; fi
    return $st
}
run nonblocking 4 --dp 2 --tp 2 --check $wide
run ranks 4 --pp 2 --tp 2 --check --microbatch 2 $wide
run ranks 4 --cp 2 --dp 2 --check --layout packed $wide
run ranks 4 --dp 4 --groups-per-step 2 --check $wide
run ranks 4 --config model/tiny-moe --dp 2 --tp 2 --ep 2 --check --microbatch 3 $wide
# A router logit within bf16 rounding of a tie may take another expert on the mesh than on one
# rank, and the check must say so (the MoE check above uses a seed whose routing has no such
# near-tie). FLIP_SEED (test/run.sh on the emulated device, whose rounding is fixed): a seed
# where it happens; the check fails and names the layers.
routing_flip() {
    if out=$(ranks 4 --config model/tiny-moe --dp 2 --tp 2 --ep 2 --check --microbatch 3 $wide --seed "$1"); then
        echo "seed $1: the check passed, so no routing flipped: FLIP_SEED must be a seed whose routing flips"
        return 1
    fi
    printf '%s\n' "$out" | grep -E 'expert loads differ|^check:'
    printf '%s\n' "$out" | grep -q "expert loads differ from reuse's .*routings moved: layer"
}
if [ -n "${FLIP_SEED:-}" ]; then run routing_flip "$FLIP_SEED"; fi
run ranks 4 --schedule tree --tree-min 1 --groups-per-step 4 --dp 2 --pp 2 --check $wide
# The id through a file, and a rank that never starts: rank 0's init is watched, so it gives up
# after --nccl-timeout with the reason, and leaves no id file behind.
missing_rank() {
    RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 timeout 60 env -u NCCL_COMM_BLOCKING "$TRAIN_CUDA" --dp 2 --steps 1 --nccl-timeout 3 \
        --nccl-id "$id" > "$tmp/alone.log" 2>&1
    rc=$?
    grep '^train: NCCL' "$tmp/alone.log"
    [ "$rc" -eq 1 ] && grep -q "^train: NCCL init (rank 0 of 2): the world did not come together within 3 s" "$tmp/alone.log" &&
        [ ! -e "$id" ]
}
run missing_rank
# The id over TCP: rank 0 listens, the others connect to it, retrying while it is not there yet.
# a port free now below the local port range (32768 on), where no outgoing connection takes it
free_port() {
    python3 -c 'import random, socket
while True:
    p = random.randrange(20000, 32000)
    try: socket.socket().bind(("127.0.0.1", p)); break
    except OSError: pass
print(p)'
}
tcp="tcp://127.0.0.1:$(free_port)"
# over_tcp N ARGS...: ranks N ARGS... with the id over TCP, rank 1 started first and rank 0 last
over_tcp() { id=$tcp first=1 ranks "$@"; st=$?; id="$tmp/nccl-id"; first=0; return $st; }
run over_tcp 4 --dp 2 --tp 2 --check $wide
# --nccl-id without a mesh, or with --bench capacity (whose ranks are threads), would be read by
# nothing: refused, with the reason
no_mesh_id() {
    msg=$("$TRAIN_CUDA" --steps 1 --nccl-id "$tcp" 2>&1); rc=$?
    echo "$msg"
    [ "$rc" -eq 2 ] && case "$msg" in *"connects a mesh's processes: give the mesh"*) ;; *) false ;; esac || return 1
    msg=$("$TRAIN_CUDA" --bench capacity --dp 2 --nccl-id "$tcp" 2>&1); rc=$?
    echo "$msg"
    [ "$rc" -eq 2 ] && case "$msg" in *"--bench capacity runs its mesh's ranks as threads"*) ;; *) false ;; esac
}
run no_mesh_id
# Refusals, each named, with --nccl-timeout 3: a rank of another world size (rank 0 then waits for
# its rank 1 in vain), and a RANK taken twice (the second told so at once; rank 0 waits for rank 2
# and then tells the rank 1 it holds that it gave up, so no rank waits in NCCL's init).
# tcp_refused RANK0_WORLD "RANK:WORLD ..." PATTERN...: rank 0 of RANK0_WORLD ranks, then the
# listed processes; each PATTERN must be in some process's error line, and every process must
# end by itself with exit status 1.
tcp_refused() {
    world=$1; others=$2; shift 2
    args="--steps 1 --nccl-timeout 3 --nccl-id $tcp"
    RANK=0 WORLD_SIZE=$world LOCAL_RANK=0 timeout 60 "$TRAIN_CUDA" --dp "$world" $args > "$tmp/tcp0.log" 2>&1 &
    pids=$!; k=0
    for o in $others; do
        k=$((k + 1))
        RANK=${o%:*} WORLD_SIZE=${o#*:} LOCAL_RANK=$k timeout 60 "$TRAIN_CUDA" --dp "${o#*:}" $args > "$tmp/tcp$k.log" 2>&1 &
        pids="$pids $!"
    done
    ok=1
    for pid in $pids; do
        wait "$pid"
        rc=$?
        [ "$rc" -eq 1 ] || { echo "a process ended with exit status $rc"; ok=0; }
    done
    grep -h '^train: NCCL' "$tmp"/tcp*.log
    for want in "$@"; do grep -q "^train: NCCL: .*$want" "$tmp"/tcp*.log || { echo "no error says: $want"; ok=0; }; done
    rm -f "$tmp"/tcp*.log
    [ "$ok" -eq 1 ]
}
run tcp_refused 2 1:3 "rank 0 at $tcp has a world of 2 ranks, this rank (1) one of 3" \
    "after 3 s at $tcp, 1 of the 1 other ranks had not come (missing: rank 1)"
run tcp_refused 3 "1:3 1:3" "rank 0 at $tcp already holds a rank 1" "1 of the 2 other ranks had not come (missing: rank 2)" \
    "rank 0 at $tcp gave up: 1 of the 2 other ranks had not come"
# A rank 1 of an earlier launch, still calling when the next launch's rank 0 listens, is refused
# at once and takes no place: the new launch's rank 1 then joins, and the step runs.
stale_launch() {
    args="--dp 2 --steps 1 --nccl-timeout 20 --nccl-id $tcp"
    PR_NCCL_LAUNCH=6 RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 timeout 60 "$TRAIN_CUDA" $args > "$tmp/stale.log" 2>&1 &
    stale=$!
    PR_NCCL_LAUNCH=7 RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 timeout 60 "$TRAIN_CUDA" $args > "$tmp/new0.log" 2>&1 &
    new0=$!
    wait $stale
    rc=$?
    grep -h '^train: NCCL' "$tmp/stale.log"
    ok=1
    [ "$rc" -eq 1 ] && grep -q "^train: NCCL: rank 0 at $tcp belongs to another launch (this rank's: PR_NCCL_LAUNCH=6)" \
        "$tmp/stale.log" || { echo "the earlier launch's rank 1 ended with exit status $rc, not refused"; ok=0; }
    PR_NCCL_LAUNCH=7 RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 timeout 60 "$TRAIN_CUDA" $args > "$tmp/new1.log" 2>&1 ||
        { echo "the new launch's rank 1: $(tail -n 1 "$tmp/new1.log")"; ok=0; }
    wait $new0 || { echo "the new launch's rank 0: $(tail -n 1 "$tmp/new0.log")"; ok=0; }
    rm -f "$tmp/stale.log" "$tmp/new0.log" "$tmp/new1.log"
    [ "$ok" -eq 1 ] && echo "refused the earlier launch's rank 1; the new launch ran its step"
}
run stale_launch
# A rank that retries its connect can be given rank 0's port as its own source port (where the
# port lies in the local port range) and meet itself there, which would hold the port from rank 0.
# In a network namespace of its own (unshare -rn) whose local range is that port and one other,
# rank 1 retries for 4 s before rank 0 starts; the two must still meet.
self_connect() {
    unshare -rn sh -c 'ip link set lo up && echo "40000 40001" > /proc/sys/net/ipv4/ip_local_port_range || exit 1
        a="--dp 2 --steps 1 --nccl-timeout 20 --nccl-id tcp://127.0.0.1:40000"
        RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 timeout 60 "$1" $a > "$2/self1.log" 2>&1 &
        sleep 4
        RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 timeout 60 "$1" $a > "$2/self0.log" 2>&1
        rc=$?
        wait $! && exit $rc' sh "$TRAIN_CUDA" "$tmp"
    rc=$?
    grep -h "^train: NCCL" "$tmp"/self*.log
    echo "both ranks' exit status: $rc"
    return $rc
}
if [ "${EMULATED_NCCL:-0}" = 1 ] &&
    unshare -rn sh -c 'ip link set lo up && echo "40000 40001" > /proc/sys/net/ipv4/ip_local_port_range' 2> /dev/null
then run self_connect
else echo "(the self-connect case needs the emulated NCCL, unshare -rn and ip: not run)"; fi
for z in 0 2; do run ranks 2 --dp 2 --zero $z --steps 3 --save "$tmp/zero$z.safetensors"; done
run build/compare_st "$tmp/zero2.safetensors" "$tmp/zero0.safetensors" 1e-5
zt="--dp 2 --tp 2 --zero 2"
run ranks 4 $zt --steps 4 --save "$tmp/whole.safetensors"
run ranks 4 $zt --steps 2 --save-state "$tmp/state"
run ranks 4 $zt --steps 2 --resume "$tmp/state" --save "$tmp/resumed.safetensors"
run build/compare_st "$tmp/resumed.safetensors" "$tmp/whole.safetensors" 0
# the state moved through a tp x pp mesh (loaded there, each rank taking its pieces, and saved in
# that mesh's layout) resumes on dp x tp as exactly as the state itself
run ranks 4 --tp 2 --pp 2 --resume "$tmp/state" --steps 0 --save-state "$tmp/moved"
run ranks 4 $zt --steps 2 --resume "$tmp/moved" --save "$tmp/moved-resumed.safetensors"
run build/compare_st "$tmp/moved-resumed.safetensors" "$tmp/whole.safetensors" 0
# the seeded draw and a checkpoint's load on a tp x pp mesh, each rank taking only its shard, then
# the model assembled on rank 0 and saved: the bits one process draws, the bits of the checkpoint
run "$TRAIN_CUDA" --steps 0 --save "$tmp/drawn-one"
run ranks 4 --tp 2 --pp 2 --steps 0 --save "$tmp/drawn-mesh"
run build/compare_st "$tmp/drawn-mesh" "$tmp/drawn-one" 0
# and in shards (rank 0 writing each as its chunks arrive): the same tensors
run ranks 4 --tp 2 --pp 2 --steps 0 --save "$tmp/drawn-shards" --save-shard-size 0.1MB
run build/compare_st "$tmp/drawn-shards/model.safetensors.index.json" "$tmp/drawn-one" 0
run ranks 4 --tp 2 --pp 2 --init "$tmp/whole.safetensors" --steps 0 --save "$tmp/loaded-mesh"
run build/compare_st "$tmp/loaded-mesh" "$tmp/whole.safetensors" 0
# a save that fails on rank 0 (its file cannot be renamed over the folder in its place) fails on
# every rank, naming rank 0
save_fails() {
    mkdir -p "$tmp/blocked/model.safetensors/inside" || return 1
    ranks 4 --tp 2 --pp 2 --steps 0 --save "$tmp/blocked" && return 1
    r=1
    while [ "$r" -lt 4 ]; do
        grep -q "pr_trainer_save: world rank 0 failed (status" "$tmp/rank$r.log" || return 1
        r=$((r + 1))
    done
}
run save_fails
# offload_same NAME ARGS...: 4 ranks of ARGS with offload on, the copy stream's work run as early as
# CUDA allows (PR_EMU_SCHEDULE, test/cuda_emu.h), save what they save with it off, bit for bit
offload_same() {
    name=$1; shift
    run ranks 4 "$@" --offload off --save "$tmp/$name-offload-off.safetensors"
    PR_EMU_SCHEDULE=eager-side run ranks 4 "$@" --offload on --save "$tmp/$name-offload-on.safetensors"
    run build/compare_st "$tmp/$name-offload-on.safetensors" "$tmp/$name-offload-off.safetensors" 0
}
offload_same dp-pp --dp 2 --pp 2 --steps 2 --microbatch 2
offload_same cp-tp --cp 2 --tp 2 --steps 2      # each rank parks its block of the prefix
# A rank that fails mid-run ends its peer's run with an error naming the exchange, exit status 1:
#  - stopped (SIGSTOP: a hung process, which NCCL alone would wait for forever): its peer gives up
#    after --nccl-timeout (2 s here), while the stopped rank is still there;
#  - killed (SIGKILL): NCCL reports the peer's end as an asynchronous error (the emulated NCCL as
#    NCCL's network transports do), well before --nccl-timeout (120 s here, past this test's
#    minute). Within a real node NCCL may not notice (its transports there report no closed
#    connection), so there the timeout is 20 s and either error ends the run.
# Rank 1 starts once rank 0 has written the id (its wait for the file is --nccl-timeout too);
# rank 0's first step line says both are past NCCL's init, whose wait is not watched.
# peer_fails SIGNAL TIMEOUT PATTERN: rank 0's error line must match PATTERN.
peer_fails() {
    sig=$1; limit=$2; want=$3
    args="--tp 2 --steps 100000 --nccl-timeout $limit --nccl-id $tmp/$sig-id"
    RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 "$TRAIN_CUDA" $args > "$tmp/${sig}0.log" 2>&1 &
    pid0=$!
    n=0
    while [ ! -e "$tmp/$sig-id" ] && [ "$n" -lt 300 ]; do sleep 0.2; n=$((n + 1)); done
    RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 "$TRAIN_CUDA" $args > "$tmp/${sig}1.log" 2>&1 &
    pid1=$!
    n=0
    while ! grep -q '^step  *[0-9]' "$tmp/${sig}0.log" && kill -0 "$pid0" 2> /dev/null && [ "$n" -lt 600 ]; do
        sleep 0.2; n=$((n + 1))
    done
    signalled=0
    kill -"$sig" "$pid1" 2> /dev/null && signalled=1
    n=0                                         # rank 0's end, a minute at most
    while kill -0 "$pid0" 2> /dev/null && [ "$n" -lt 300 ]; do sleep 0.2; n=$((n + 1)); done
    kill -KILL "$pid0" 2> /dev/null
    wait "$pid0"
    rc=$?
    alive=0
    kill -0 "$pid1" 2> /dev/null && alive=1    # stopped: the timeout was rank 0's own
    kill -KILL "$pid1" 2> /dev/null
    wait "$pid1" 2> /dev/null
    grep -v '^step' "$tmp/${sig}0.log"
    echo "rank 1 sent SIG$sig $signalled, alive until rank 0 ended $alive; rank 0 exit status $rc"
    [ "$signalled" -eq 1 ] && { [ "$sig" != STOP ] || [ "$alive" -eq 1 ]; } && [ "$rc" -eq 1 ] &&
        grep -q "^train: NCCL [a-z_]* (rank 0 of 2, world rank 0): $want" "$tmp/${sig}0.log"
}
run peer_fails STOP 2 'not complete after 2 s (a peer rank has stopped'
if [ "${EMULATED_NCCL:-0}" = 1 ]; then
    run peer_fails KILL 120 'remote process exited or there was a network error'
else
    run peer_fails KILL 20 '\(remote process exited or there was a network error\|not complete after 20 s\)'
fi
run build/train-double --steps 1 --clip 0 $wide --save-grads "$tmp/cpu.safetensors"
run ranks 4 --tp 2 --pp 2 --steps 1 --clip 0 $wide --save-grads "$tmp/mesh.safetensors"
run build/compare_st "$tmp/mesh.safetensors" "$tmp/cpu.safetensors" 0.03125
rm -rf "$tmp"
report
