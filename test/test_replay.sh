#!/bin/sh
# train --replay: the reuse drift stays at the floor (exit 0) and its JSON lines parse with every
# field; a reuse run made wrong on purpose (a MoE prefix token counted once in the aux loss, not G
# times) drifts past the floor and fails. Usage: sh test/test_replay.sh TRAIN (the CPU build's
# train, or a train_cuda, whose bf16 floor is the baseline's distance from the CPU's trajectory:
# the wrong run is made to matter there with a load-balancing loss 100 times the preset's).
train=${1:-./train}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
passed=0; failed=0
ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

if "$train" --replay 3 --microbatch 3 --layout packed --kl-coef 0.04 --log "$dir/replay.jsonl" >"$dir/out" 2>&1 &&
   grep -q "replay: PASS" "$dir/out"; then ok; else bad "replay of 3 steps did not pass"; cat "$dir/out"; fi
if python3 - "$dir/replay.jsonl" <<'PY'
import json, math, sys
keys = ["step", "first_group", "groups", "loss_full", "loss_reuse", "loss_floor", "grad_norm_full", "grad_norm_reuse", "grad_norm_floor",
        "drift_max_abs", "drift_rel_l2", "floor_max_abs", "floor_rel_l2"]
lines = [json.loads(l) for l in open(sys.argv[1])]
assert [d["step"] for d in lines] == [0, 1, 2], lines
for d in lines:
    assert sorted(d) == sorted(keys), d
    assert all(isinstance(d[k], (int, float)) and math.isfinite(d[k]) for k in keys), d
    assert d["groups"] == 1 and d["first_group"] == d["step"] % 4, d
    assert d["floor_rel_l2"] > 0, d      # the floor is real: sums reordered, or bf16 against the CPU
PY
then ok; else bad "the --log JSON lines"; fi

mkdir "$dir/moe"
sed 's/"router_aux_loss_coef": 0.05/"router_aux_loss_coef": 5.0/' model/tiny-moe/config.json > "$dir/moe/config.json"
grep -q '"router_aux_loss_coef": 5.0' "$dir/moe/config.json" || bad "the MoE preset's aux-loss coefficient was not found"
if "$train" --config "$dir/moe" --replay 2 --microbatch 2 --prefix-multiplicity 1 >"$dir/out" 2>&1; then
    bad "a wrong reuse run passed the replay"
elif grep -q "replay: FAIL: 2 of 2 steps" "$dir/out"; then ok; else bad "a wrong reuse run: no FAIL line"; cat "$dir/out"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
