#!/bin/sh
# The GPU tests (make test-gpu), from the repository root:
#   build/test_gpu      every CUDA kernel and the two-region attention against the double CPU
#                       path, bitwise reproducibility of the backward and of whole steps, the
#                       bf16 weights the kernels read refreshed by an AdamW step, and the NCCL
#                       communicator on one rank (again with NCCL_COMM_BLOCKING=0);
#   train_cuda --check  bf16 reuse vs bf16 baseline after one AdamW step (the mixed test; MoE too;
#                       microbatches of 1, 2 and 3; the tensor-core attention, mma and wgmma, at
#                       head dim 128 on model/tiny-hd128), and with offload on: reuse with and without
#                       offload bitwise equal (copy stream); recomputation and the prefix-tree
#                       schedule with offload;
#   one step's gradients on the GPU against the CPU double build's, per tensor, within 2^-5
#   relative (four bf16 spacings: the activations are rounded at every layer), tiny-hd128's
#   through the default (tensor-core) attention; tiny-moe's on 1 and 3 host threads bit for bit
#   (where train_cuda is built with OpenMP);
#   train_cuda --bench --profile (test/check_profile.sh): the operations' time within the step's,
#   and the schedule's attention calls.
# Last line: "N passed, N failed". TRAIN_CUDA and TEST_GPU name other binaries of the two (make
# test-gpu-emu: those built on the emulated device, test/cuda_emu.cc).
. "$(dirname "$0")/tally.sh"
TRAIN_CUDA=${TRAIN_CUDA:-./train_cuda}
TEST_GPU=${TEST_GPU:-build/test_gpu}
run "$TEST_GPU"
# the NCCL communicator once more with every communicator non-blocking (NCCL's environment
# overrides the configuration): each call's queueing is then waited for before its stream
run env NCCL_COMM_BLOCKING=0 "$TEST_GPU" nccl
for m in tiny tiny-qwen3; do
    for lay in padded packed; do run "$TRAIN_CUDA" --config model/$m --check --microbatch 3 --layout $lay --kl-coef 0.04; done
    run "$TRAIN_CUDA" --config model/$m --check --microbatch 2 --offload on --offload-pool 0.5 --device-budget 4
    # one suffix per microbatch: gK/gV summed over the most Phase-B passes (fp32 on the GPU)
    run "$TRAIN_CUDA" --config model/$m --check --microbatch 1
done
for scope in microbatch group; do
    run "$TRAIN_CUDA" --config model/tiny-moe --check --microbatch 3 --aux-scope $scope
done
# the tensor-core attention kernels in whole steps, at Llama3-8B's head dim 128 (the tiny models'
# 16 and 32 run the FFMA kernels): mma.sync, and wgmma where this GPU runs it
run "$TRAIN_CUDA" --config model/tiny-hd128 --layers 1 --check --microbatch 3 --layout packed --attention mma
case $("$TRAIN_CUDA" --config model/tiny-hd128 --layers 1 --steps 1 --attention wgmma 2>&1) in
    *"wgmma attention needs"*) echo "== --attention wgmma: this GPU does not run it (compute capability 9.0 and sm_90a code): not checked" ;;
    *) run "$TRAIN_CUDA" --config model/tiny-hd128 --layers 1 --check --microbatch 3 --layout packed --attention wgmma ;;
esac
# recomputation and the prefix-tree schedule, both with offload's copies
run "$TRAIN_CUDA" --check --microbatch 2 --layout packed --recompute all --offload on
run "$TRAIN_CUDA" --config model/tiny-moe --check --schedule tree --tree-min 1 --groups-per-step 4 --microbatch 2 --aux-scope group --offload on
tmp=$(mktemp -d)
# (tiny-hd128: through the attention kernels a new backend picks, the tensor-core ones where they run)
for m in tiny tiny-qwen3 tiny-hd128; do
    run build/train-double --config model/$m --steps 1 --clip 0 --save-grads "$tmp/$m-cpu.safetensors"
    run "$TRAIN_CUDA" --config model/$m --steps 1 --clip 0 --save-grads "$tmp/$m-gpu.safetensors"
    run build/compare_st "$tmp/$m-gpu.safetensors" "$tmp/$m-cpu.safetensors" 0.03125
done
# MoE's routing runs on the host's cores: two steps on 1 and on 3 threads, the same bytes, where
# train_cuda was built with OpenMP (its model line names the threads the routing runs on)
case $(OMP_NUM_THREADS=3 "$TRAIN_CUDA" --config model/tiny-moe --steps 0 2>&1) in
    *"routed on 3 host threads"*)
        for n in 1 3; do run env OMP_NUM_THREADS=$n "$TRAIN_CUDA" --config model/tiny-moe --steps 2 --save-grads "$tmp/moe-$n.safetensors"; done
        run cmp "$tmp/moe-1.safetensors" "$tmp/moe-3.safetensors" ;;
    *) echo "== MoE routing on 1 and 3 host threads: not checked, train_cuda does not route on 3 (built without OpenMP?)" ;;
esac
rm -rf "$tmp"
run sh "$(dirname "$0")/check_profile.sh" "$TRAIN_CUDA"
report
