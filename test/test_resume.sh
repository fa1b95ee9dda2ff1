#!/bin/sh
# Resume is exact: 8 steps straight, and 4 steps + --save-state, a new process, --resume, 4 more,
# give the same loss and grad norm every step (hex floats) and the same final state files (on a
# mesh, each rank's pieces and the index); on one rank and on in-process meshes, with steps of one
# group and of several (cut by --groups-per-step or a version-2 trace's table). A mesh's state
# resumes on a mesh of another shape and on one rank. A save killed part way
# (--fault-kill-after-bytes), on one rank and on a mesh, leaves the previous state loadable, and
# resuming from it is still exact. A state of another model, or of another trace without
# --new-trace, is refused with the reason. The export (--save) in shards reads back as the
# one-file export.
# Usage: sh test/test_resume.sh TRAIN
train=${1:-./train}
tmp=$(mktemp -d /tmp/pr_resume.XXXXXX) || exit 1
trap 'rm -rf "$tmp"' EXIT
passed=0; failed=0
ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

# resume_case NAME FLAGS...: straight vs split, compared
resume_case() {
    name=$1; shift
    d=$tmp/$name; mkdir -p "$d"
    "$train" "$@" --steps 8 --loss-log "$d/straight.log" --save-state "$d/straight" >"$d/out" 2>&1 || { bad "$name: straight run"; cat "$d/out"; return; }
    "$train" "$@" --steps 4 --loss-log "$d/split.log" --save-state "$d/split" >"$d/out" 2>&1 || { bad "$name: first half"; cat "$d/out"; return; }
    "$train" "$@" --steps 4 --loss-log "$d/split.log" --resume "$d/split" --save-state "$d/split" >"$d/out" 2>&1 || { bad "$name: resumed half"; cat "$d/out"; return; }
    if cmp -s "$d/straight.log" "$d/split.log"; then ok; else bad "$name: losses differ"; diff "$d/straight.log" "$d/split.log"; fi
    files=$(ls "$d/straight/step-00000008")
    [ -n "$files" ] || bad "$name: no final state"
    for f in $files; do
        if cmp -s "$d/straight/step-00000008/$f" "$d/split/step-00000008/$f"; then ok; else bad "$name: final $f differs"; fi
    done
}
resume_case one
resume_case one-baseline --schedule baseline --microbatch 3
resume_case moe --config model/tiny-moe --microbatch 2
resume_case dp2 --dp 2
resume_case dp2-zero2 --dp 2 --zero 2
resume_case dp3-zero1-tp2 --dp 3 --tp 2 --zero 1
resume_case mesh --dp 2 --tp 2 --cp 2
resume_case steps3 --groups-per-step 3 --loss-norm seq-mean-token-sum --microbatch 2
resume_case steps2-dp3 --dp 3 --groups-per-step 2 --loss-norm seq-mean-token-mean
# a version-2 trace's own steps (3 groups, then 1)
python3 -c "import sys; sys.path.insert(0, 'data'); import prtrace as p; g, v = p.read_trace('data/sample.trace'); p.write_trace('$tmp/steps.trace', g, v, steps=[3, 1])" ||
    bad "writing a version-2 trace"
resume_case table --trace "$tmp/steps.trace" --loss-norm seq-mean-token-sum-norm
# resuming at a position that starts no step of the table is refused with the reason
"$train" --trace "$tmp/steps.trace" --groups-per-step 1 --steps 1 --save-state "$tmp/at1" >/dev/null 2>&1 || bad "a state at group 1"
msg=$("$train" --trace "$tmp/steps.trace" --resume "$tmp/at1" --steps 1 2>&1); rc=$?
case "$msg" in *"starts no step"*) [ $rc -eq 1 ] && ok || bad "position off the table: status $rc" ;; *) bad "position off the table: '$msg'" ;; esac

# a state counts the groups of its own trace: another trace is refused (a copy of the same bytes is
# the same trace), and --new-trace starts at its first group with the weights and AdamW state kept.
# From a state at group 4 of the 4-group sample, the same groups as a version-2 trace (other bytes)
# with --new-trace go on as the straight run's steps 5 to 8.
d=$tmp/one
cp data/sample.trace "$tmp/copy.trace"
"$train" --trace "$tmp/copy.trace" --steps 1 --resume "$d/split" >/dev/null 2>&1 && ok || bad "resume with a copy of the trace"
msg=$("$train" --trace "$tmp/steps.trace" --resume "$d/split" --steps 1 2>&1); rc=$?
case "$msg" in *"was saved on another trace"*"--new-trace"*) [ $rc -eq 1 ] && ok || bad "another trace: status $rc" ;;
    *) bad "another trace: '$msg'" ;; esac
python3 -c "import sys; sys.path.insert(0, 'data'); import prtrace as p; g, v = p.read_trace('data/sample.trace'); p.write_trace('$tmp/ones.trace', g, v, steps=[1, 1, 1, 1])" ||
    bad "writing a version-2 trace of one group a step"
sed -n '5,8p' "$d/straight.log" >"$d/straight-tail.log"
"$train" --steps 4 --save-state "$d/at4" >/dev/null 2>&1 &&
"$train" --trace "$tmp/ones.trace" --new-trace --resume "$d/at4" --steps 4 --loss-log "$d/new-trace.log" >/dev/null 2>&1 || bad "--new-trace runs"
cmp -s "$d/new-trace.log" "$d/straight-tail.log" && ok || bad "--new-trace from group 4 of 4 is not the straight run's steps 5 to 8"
"$train" --steps 2 --save-state "$d/at2" >/dev/null 2>&1 &&
"$train" --trace "$tmp/ones.trace" --new-trace --resume "$d/at2" --steps 1 >"$d/out" 2>&1 || bad "--new-trace from group 2"
grep -q '^step   2  group 0 ' "$d/out" && grep -q 'next group 0 (--new-trace' "$d/out" && ok || { bad "--new-trace did not start at group 0"; cat "$d/out"; }
# on a mesh every rank refuses alike (none is left waiting in the load), and --new-trace runs
msg=$("$train" --dp 2 --tp 2 --cp 2 --trace "$tmp/steps.trace" --resume "$tmp/mesh/split" --steps 1 2>&1); rc=$?
case "$msg" in *"was saved on another trace"*) [ $rc -eq 1 ] && ok || bad "another trace on a mesh: status $rc" ;;
    *) bad "another trace on a mesh: '$msg'" ;; esac
"$train" --dp 2 --tp 2 --cp 2 --trace "$tmp/ones.trace" --new-trace --resume "$tmp/mesh/split" --steps 1 >"$d/out" 2>&1 &&
    grep -q 'next group 0 (--new-trace' "$d/out" && grep -q '^step   8  groups 0\.\.0 ' "$d/out" && ok || { bad "--new-trace on a mesh"; cat "$d/out"; }
# a state without a fingerprint goes on at its position, with a note
f=$d/at2/step-00000002/trainer_state.json
python3 -c "import json, sys; j = json.load(open(sys.argv[1])); del j['data_fingerprint']; json.dump(j, open(sys.argv[1], 'w'))" "$f" &&
"$train" --trace "$tmp/ones.trace" --resume "$d/at2" --steps 1 >"$d/out" 2>&1 && grep -q "records no trace fingerprint" "$d/out" &&
    grep -q '^step   2  group 2 ' "$d/out" && ok || { bad "a state without a fingerprint"; cat "$d/out"; }
"$train" --trace "$tmp/ones.trace" --new-trace --resume "$d/at2" --steps 1 >"$d/out" 2>&1 && ! grep -q "records no trace fingerprint" "$d/out" &&
    grep -q '^step   2  group 0 ' "$d/out" && ok || { bad "--new-trace from a state without a fingerprint"; cat "$d/out"; }

# the stage changes the pieces, not the values: a state saved with --zero 2 (each dp rank its slice
# of m and v) resumes with --zero 0 exactly, and saves what the straight --zero 0 run saves
d=$tmp/dp2-zero2
"$train" --dp 2 --steps 4 --zero 2 --save-state "$d/z2" >/dev/null 2>&1 &&
"$train" --dp 2 --steps 4 --zero 0 --resume "$d/z2" --save-state "$d/z2" --loss-log "$d/z0.log" >/dev/null 2>&1 || bad "zero 2 to zero 0"
sed -n '5,8p' "$tmp/dp2/straight.log" >"$d/straight-tail.log"
same=1
for f in $(ls "$tmp/dp2/straight/step-00000008"); do cmp -s "$d/z2/step-00000008/$f" "$tmp/dp2/straight/step-00000008/$f" || same=0; done
cmp -s "$d/straight-tail.log" "$d/z0.log" && [ $same -eq 1 ] && ok || bad "a zero-2 state resumed with zero 0 is not the straight run"

# a mesh's state on another mesh shape and on one rank: each rank reads the pieces over its part.
# The sums run in another order there, so the losses agree to rounding, not bit for bit.
d=$tmp/reshape; mkdir -p "$d"
"$train" --dp 2 --tp 2 --zero 2 --steps 8 --loss-log "$d/straight.log" >/dev/null 2>&1 &&
"$train" --dp 2 --tp 2 --zero 2 --steps 4 --save-state "$d/a" >/dev/null 2>&1 || bad "reshape: the mesh's runs"
for target in "--tp 4" "--dp 2 --pp 2 --zero 1" "--cp 2" ""; do
    "$train" $target --groups-per-step 2 --steps 4 --resume "$d/a" --loss-log "$d/t.log" >"$d/out" 2>&1 || { bad "reshape: resume with $target"; cat "$d/out"; continue; }
    python3 - "$d/straight.log" "$d/t.log" <<'PY' && ok || bad "reshape: resumed with $target, the losses are not the straight run's"
import sys
def losses(p):
    return [float.fromhex(l.split()[3]) for l in open(p)]
want, got = losses(sys.argv[1])[4:8], losses(sys.argv[2])
sys.exit(0 if len(got) == 4 and all(abs(a - b) <= 1e-4 * max(1e-3, abs(a)) for a, b in zip(want, got)) else 1)
PY
    rm -f "$d/t.log"
done

# a save killed part way: the state it was replacing still loads, and resuming from it is exact
d=$tmp/one
"$train" --steps 4 --save-state "$d/victim" >/dev/null 2>&1 || bad "the state to be replaced"
"$train" --steps 2 --resume "$d/victim" --save-state "$d/victim" --fault-kill-after-bytes 200000 >/dev/null 2>&1
rc=$?
[ "$rc" -gt 128 ] && ok || bad "the fault switch did not kill the save (status $rc)"
[ "$(cat "$d/victim/latest")" = "step-00000004" ] && ok || bad "latest moved after a killed save: $(cat "$d/victim/latest")"
ls "$d/victim" | grep -q '\.tmp\.' && ok || bad "the killed save left no partial folder (was it killed mid-write?)"
"$train" --steps 4 --loss-log "$d/after-kill.log" --resume "$d/victim" >/dev/null 2>&1 || bad "resume after the kill"
sed -n '5,8p' "$d/straight.log" >"$d/straight-tail.log"
cmp -s "$d/straight-tail.log" "$d/after-kill.log" && ok || bad "resume after a killed save is not the straight run"

# the same on a mesh: every rank writes its file, the kill lands mid-write, latest stays
d=$tmp/dp3-zero1-tp2
"$train" --dp 3 --tp 2 --zero 1 --steps 4 --save-state "$d/victim" >/dev/null 2>&1 || bad "the mesh state to be replaced"
"$train" --dp 3 --tp 2 --zero 1 --steps 2 --resume "$d/victim" --save-state "$d/victim" --fault-kill-after-bytes 60000 >/dev/null 2>&1
rc=$?
[ "$rc" -gt 128 ] && ok || bad "mesh: the fault switch did not kill the save (status $rc)"
[ "$(cat "$d/victim/latest")" = "step-00000004" ] && ok || bad "mesh: latest moved after a killed save: $(cat "$d/victim/latest")"
ls "$d/victim" | grep -q '\.tmp\.' && ok || bad "mesh: the killed save left no partial folder (was it killed mid-write?)"
"$train" --dp 3 --tp 2 --zero 1 --steps 4 --loss-log "$d/after-kill.log" --resume "$d/victim" >/dev/null 2>&1 || bad "mesh: resume after the kill"
sed -n '5,8p' "$d/straight.log" >"$d/straight-tail.log"
cmp -s "$d/straight-tail.log" "$d/after-kill.log" && ok || bad "mesh: resume after a killed save is not the straight run"

# --save in shards (--save-shard-size): --init reads them back as the one file's tensors, bit for bit
# (a save of them in one file equals the one-file save), and a save in one file into the sharded
# folder leaves no shard or index behind
d=$tmp/export; mkdir -p "$d"
"$train" --steps 2 --save "$d/one" >/dev/null 2>&1 &&
"$train" --steps 2 --save "$d/sharded" --save-shard-size 0.1MB >/dev/null 2>&1 || bad "the exports"
shards=$(ls "$d/sharded" | grep -c '^model-[0-9]*-of-[0-9]*\.safetensors$')
[ "$shards" -gt 2 ] && [ -f "$d/sharded/model.safetensors.index.json" ] && [ ! -f "$d/sharded/model.safetensors" ] && ok ||
    bad "--save-shard-size 0.1MB: $shards shards in $(ls "$d/sharded" | tr '\n' ' ')"
"$train" --init "$d/sharded" --steps 0 --save "$d/again" >/dev/null 2>&1 && cmp -s "$d/one/model.safetensors" "$d/again/model.safetensors" &&
    ok || bad "the sharded export read back is not the one-file export"
"$train" --init "$d/sharded" --steps 0 --save "$d/sharded" >/dev/null 2>&1 && cmp -s "$d/one/model.safetensors" "$d/sharded/model.safetensors" &&
    [ "$(ls "$d/sharded" | tr '\n' ' ')" = "config.json model.safetensors " ] && ok || bad "one file over the shards: $(ls "$d/sharded" | tr '\n' ' ')"

# refusals
d=$tmp/one
msg=$("$train" --resume "$tmp/none" --steps 1 2>&1); rc=$?
case "$msg" in *"$tmp/none/latest"*) [ $rc -eq 1 ] && ok || bad "missing state: status $rc" ;; *) bad "missing state: '$msg'" ;; esac
# an output whose folder above is missing fails before any step runs
for flag in --save --save-state --save-grads; do
    msg=$("$train" --steps 8 $flag "$tmp/none/out" 2>&1); rc=$?
    case "$msg" in *"step "*) bad "$flag in a missing folder: a step ran first" ;;
        *"$flag $tmp/none/out: the folder above it, $tmp/none, does not exist"*) [ $rc -eq 1 ] && ok || bad "$flag: status $rc" ;;
        *) bad "$flag in a missing folder: '$msg'" ;; esac
done
msg=$("$train" --steps 1 --loss-log "$tmp/none/loss.log" 2>&1); rc=$?
case "$msg" in *"--loss-log $tmp/none/loss.log: cannot open"*) [ $rc -eq 1 ] && ok || bad "loss log: status $rc" ;; *) bad "loss log: '$msg'" ;; esac
msg=$("$train" --config model/tiny-qwen3 --resume "$d/split" --steps 1 2>&1); rc=$?
case "$msg" in *"a llama model, this trainer's is qwen3"*) [ $rc -eq 1 ] && ok || bad "other model: status $rc" ;; *) bad "other model: '$msg'" ;; esac
sed 's/"version": 1/"version": 0/' "$d/split/step-00000008/trainer_state.json" >"$tmp/ts" && cp "$tmp/ts" "$d/split/step-00000008/trainer_state.json"
msg=$("$train" --resume "$d/split" --steps 1 2>&1); rc=$?
case "$msg" in *version*) [ $rc -eq 1 ] && ok || bad "old format: status $rc" ;; *) bad "old format: '$msg'" ;; esac
sed 's/"version": 0/"version": 3/' "$tmp/ts" >"$d/split/step-00000008/trainer_state.json"
msg=$("$train" --resume "$d/split" --steps 1 2>&1); rc=$?
case "$msg" in *"version 3 is newer"*) [ $rc -eq 1 ] && ok || bad "newer format: status $rc" ;; *) bad "newer format: '$msg'" ;; esac

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
