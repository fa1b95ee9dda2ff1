#!/bin/sh
# ./train refuses bad command lines before it loads anything: each row is the flags, then a piece
# of the message it must print; the exit status must be 2. Last, command lines it must take.
# Usage: sh test/test_flags.sh TRAIN
train=${1:-./train}
passed=0; failed=0
check() {
    want=$1; shift
    msg=$("$train" "$@" 2>&1 >/dev/null); rc=$?
    case "$msg" in
        *"$want"*) [ "$rc" -eq 2 ] && { passed=$((passed + 1)); return; } ;;
    esac
    failed=$((failed + 1))
    echo "FAIL: train $* -> status $rc, '$msg' (want status 2 and '$want')"
}
check "bad value 'inf' for --lr"            --lr inf
check "bad value 'nan' for --lr"            --lr nan
check "bad value '-1' for --lr"             --lr -1
check "bad value 'inf' for --weight-decay"  --weight-decay inf
check "bad value 'nan' for --clip"          --clip nan
check "bad value '-3' for --clip"           --clip -3
check "bad value '1' for --eps-low"         --eps-low 1
check "bad value '-0.1' for --kl-coef"      --kl-coef -0.1
check "bad value '1e300' for --offload-pool" --offload-pool 1e300
check "bad value '0' for --device-budget"   --device-budget 0
check "bad value '-1' for --seed"           --seed -1
check "bad value '12x' for --steps"         --steps 12x
check "bad value '-5' for --microbatch-tokens" --microbatch-tokens -5
check "bad value '0' for --layers"          --layers 0
check "the model model/tiny has 2 layers"   --layers 5
check "unknown flag --bogus"                --steps 1 --bogus
check "unknown flag --bogus"                --bogus 3
check "--lr needs a value"                  --steps 1 --lr
check "--save-grads writes a training step" --save-grads /tmp/never-written.safetensors --check
check "bad value 'fast' for --schedule"     --schedule fast
check "bad value 'some' for --recompute"    --recompute some
check "--save-every needs --save-state"     --save-every 2
check "bad value '3' for --zero"            --zero 3
check "bad value '0' for --save-every"      --save-every 0 --save-state /tmp/never-written
check "--resume and --init"                 --resume /tmp/never-read --init /tmp/never-read
check "not --check or --bench"              --check --save-state /tmp/never-written
check "bad value 'fp16' for --grad-reduce"  --grad-reduce fp16
check "bad value '0' for --replay"          --replay 0
check "bad value '0' for --prefix-tree"     --prefix-tree 0
check "--prefix-tree reports on the trace"  --prefix-tree 4 --check
check "bad value '0' for --tree-min"       --tree-min 0
check "--schedule tree trains or checks on one rank or a mesh" --schedule tree --prefix-tree 8
check "bad value '0' for --bench-system"   --bench tree --bench-system 0
check "bad value 'tpu' for --bench-sizes"   --bench capacity --bench-sizes tpu
check "--bench-sizes belongs to --bench memory and --bench capacity" --bench --bench-sizes gpu
check "--profile belongs to --bench (speed)" --bench memory --profile
check "--profile times the CUDA backend's operations: it is train_cuda's" --bench --profile
check "bad value '0.5,1' for --bench-splits"  --bench --bench-splits 0.5,1
check "bad value '0.5,,0.25' for --bench-splits" --bench --bench-splits 0.5,,0.25
check "bad value '0.5,' for --bench-splits"   --bench --bench-splits 0.5,
check "bad value '4,,8' for --bench-groups"   --bench --bench-groups 4,,8
check "--bench-splits belongs to --bench (speed) and --bench memory" --bench tree --bench-splits 0.5
check "a prefix of 0 tokens: a split needs a token on each side" --bench memory --bench-total 12 --bench-splits 0.5,0.01
check "--bench speed and memory run on one rank" --bench memory --dp 2
check "--replay runs its own three trainers" --replay 2 --check
check "--log FILE writes the steps"          --log /tmp/never-written.jsonl --check
check "it needs --dp 2 or more"             --grad-reduce bf16
check "bad value 'seq-mean' for --loss-norm" --loss-norm seq-mean
check "bad value '0' for --groups-per-step" --groups-per-step 0
check "bad value '0' for --loss-norm-len"   --loss-norm-len 0
check "bad value '5gb' for --save-shard-size" --save /tmp/never-written --save-shard-size 5gb
check "bad value '-1MB' for --save-shard-size" --save /tmp/never-written --save-shard-size -1MB
check "--save-shard-size needs --save DIR"  --save-shard-size 5GB
check "--save-bf16 needs --save DIR"        --save-bf16 --steps 1
check "--new-trace says where a --resume starts" --new-trace --steps 1
check "bad value 'memroy' for --bench"      --bench memroy
check "--tree-min sets --schedule tree's"   --tree-min 4 --steps 1
check "--offload-pool sets up the prefix's offload: it needs --offload on" --offload-pool 64 --steps 1
check "--device-budget sets up the prefix's offload" --offload off --device-budget 64 --steps 1
check "--nccl-id connects train_cuda's processes" --dp 2 --nccl-id /tmp/never-read --steps 1
check "--nccl-timeout connects train_cuda's processes" --nccl-timeout 5 --steps 1
check "belong to a training run"            --check --save /tmp/never-written
check "--check and --bench are two runs"    --check --bench
check "--loss-norm-len is seq-mean-token-sum-norm's length" --loss-norm-len 48
check "bad value '99999999999999999999999' for --seed" --seed 99999999999999999999999
# ... and takes the flags where something reads them: the offload's pool and budget in --bench
# capacity's and memory's offload rows
accepts() {
    "$train" "$@" >/dev/null 2>&1 && { passed=$((passed + 1)); return; }
    failed=$((failed + 1))
    echo "FAIL: train $* was refused or failed"
}
accepts --bench capacity --bench-budget 8 --device-budget 0.25 --offload-pool 1
accepts --bench memory --bench-total 24 --bench-groups 2 --device-budget 0.25
# --check's comparisons it cannot make, refused once the trace is read (status 1, nothing run):
# sample.trace's group 0 has G 8, so over dp 3 its shares start at trajectories 2 and 5, inside
# one rank's microbatches of 4; microbatches of 1 always agree, and that runs
refused_check() {
    want=$1; shift
    msg=$("$train" --check "$@" 2>&1 >/dev/null); rc=$?
    case "$msg" in
        *"$want"*) [ "$rc" -eq 1 ] && { passed=$((passed + 1)); return; } ;;
    esac
    failed=$((failed + 1))
    echo "FAIL: train --check $* -> status $rc, '$msg' (want status 1 and '$want')"
}
refused_check "splits its group 0 (G 8) over 3 dp ranks" --config model/tiny-moe --dp 3 --groups-per-step 1 --microbatch 4
accepts --check --config model/tiny-moe --dp 2 --groups-per-step 1 --microbatch 1
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
