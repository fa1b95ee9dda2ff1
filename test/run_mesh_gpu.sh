#!/bin/sh
# train_cuda on a mesh, from the repository root: one process a rank, as on a node of GPUs (RANK,
# WORLD_SIZE, LOCAL_RANK, --nccl-id), through the NCCL communicator. On the emulated device
# (make test-gpu-emu: TRAIN_CUDA=build/emu/train_cuda, test/nccl_emu.h's NCCL between processes)
# it runs on any machine; on a real node it needs 4 GPUs.
#   --check on dp, tp, pp, cp and ep meshes (MoE's all-to-all), split groups, the prefix-tree
#   schedule and the bf16 sum over dp: bf16 reuse on the mesh vs the bf16 baseline on one rank
#   (rank 0 compares); ZeRO stage 2 against stage 0 after three steps; an exact resume (ZeRO-2,
#   dp x tp) and offload on a dp x pp mesh, each bit for bit against the run without; one step's
#   gradients on a tp x pp mesh against the CPU double build's, per tensor, within 2^-5 relative;
#   a stale --nccl-id file from an earlier launch replaced, not joined; a rank that hangs mid-run
#   ending its peer's run with an error after --nccl-timeout, and one that is killed ending it at
#   once; with FLIP_SEED, a check that fails on a routing flip and says so.
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

# ranks N ARGS...: N processes of train_cuda ARGS, each under a time limit; rank 0's output, the
# other ranks' last lines; fails unless every rank exits 0.
ranks() {
    n=$1; shift
    r=0; pids=
    while [ "$r" -lt "$n" ]; do
        RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r timeout 900 "$TRAIN_CUDA" "$@" --nccl-id "$tmp/nccl-id" > "$tmp/rank$r.log" 2>&1 &
        pids="$pids $!"
        r=$((r + 1))
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
for z in 0 2; do run ranks 2 --dp 2 --zero $z --steps 3 --save "$tmp/zero$z.safetensors"; done
run build/compare_st "$tmp/zero2.safetensors" "$tmp/zero0.safetensors" 1e-5
zt="--dp 2 --tp 2 --zero 2"
run ranks 4 $zt --steps 4 --save "$tmp/whole.safetensors"
run ranks 4 $zt --steps 2 --save-state "$tmp/state"
run ranks 4 $zt --steps 2 --resume "$tmp/state" --save "$tmp/resumed.safetensors"
run build/compare_st "$tmp/resumed.safetensors" "$tmp/whole.safetensors" 0
for off in off on; do run ranks 4 --dp 2 --pp 2 --steps 2 --microbatch 2 --offload $off --save "$tmp/offload-$off.safetensors"; done
run build/compare_st "$tmp/offload-on.safetensors" "$tmp/offload-off.safetensors" 0
# A rank that fails mid-run ends its peer's run with an error naming the exchange, exit status 1:
#  - stopped (SIGSTOP: a hung process, which NCCL alone would wait for forever): its peer gives up
#    after --nccl-timeout (2 s here), while the stopped rank is still there;
#  - killed (SIGKILL): NCCL reports the peer's end as an asynchronous error (the emulated NCCL as
#    NCCL's network transports do), well before --nccl-timeout (120 s here, past this test's
#    minute).
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
run peer_fails KILL 120 'remote process exited or there was a network error'
run build/train-double --steps 1 --clip 0 $wide --save-grads "$tmp/cpu.safetensors"
run ranks 4 --tp 2 --pp 2 --steps 1 --clip 0 $wide --save-grads "$tmp/mesh.safetensors"
run build/compare_st "$tmp/mesh.safetensors" "$tmp/cpu.safetensors" 0.03125
rm -rf "$tmp"
report
