#!/bin/sh
# Everything a lent GPU is for, in one run (from the repository root; writes logs under ${OUT:-bench/out}):
#   1. make test-gpu                         kernels, attention shapes, determinism, --check, GPU vs CPU double
#   2. make sass                             registers, spills and instruction mix of the kernels (needs cuobjdump)
#   3. build/bench_cuda                      GEMMs beside cuBLASLt's best; attention TFLOP/s (causal 8k, two-region)
#   4. train_cuda --bench                    baseline vs reuse on Llama3-8B-shaped layers at 12,288 tokens per
#                                            trajectory, splits 2k/10k .. 10k/2k, G in $GROUPS, with MFU
#   5. train_cuda --bench memory             per-phase peak memory and step time of baseline, reuse and
#                                            reuse+offload at the same shapes (offload's saving and overhead)
#   6. bench/torch_ref.py                    the same baseline step in PyTorch (eager and torch.compile), when
#                                            torch imports
# LAYERS (default 4) and GROUPS (default 4,8,16,32) size step 4 to the time at hand.
set -u
out=${OUT:-bench/out}
mkdir -p "$out"
layers=${LAYERS:-4}
groups=${GROUPS:-4,8,16,32}
date -u +"run started %Y-%m-%d %H:%M UTC" | tee "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$out/summary.txt"
make -s cuda build/test_gpu build/bench_cuda build/compare_st build/train-double > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
make -s test-gpu > "$out/test_gpu.log" 2>&1; echo "test-gpu: $(tail -n 1 "$out/test_gpu.log")" | tee -a "$out/summary.txt"
grep FAIL "$out/test_gpu.log" | head -20
make -s sass > "$out/sass.txt" 2>&1 || echo "sass: cuobjdump not available" | tee -a "$out/summary.txt"
./build/bench_cuda --reps 10 > "$out/bench_cuda.txt" 2>&1; cat "$out/bench_cuda.txt" | tee -a "$out/summary.txt" > /dev/null
./train_cuda --bench --config model/llama3-8b --layers "$layers" --bench-total 12288 --bench-groups "$groups" \
    --microbatch 1 --bench-reps 1 > "$out/train_bench.txt" 2>&1
cat "$out/train_bench.txt" >> "$out/summary.txt"
./train_cuda --bench memory --config model/llama3-8b --layers "$layers" --bench-total 12288 --bench-groups 8 \
    > "$out/train_memory.txt" 2>&1
cat "$out/train_memory.txt" >> "$out/summary.txt"
if python3 -c "import torch" 2>/dev/null; then
    python3 bench/torch_ref.py --config model/llama3-8b --layers "$layers" --total 12288 --groups "$groups" --reps 1 \
        > "$out/torch_ref.txt" 2>&1
    cat "$out/torch_ref.txt" >> "$out/summary.txt"
else
    echo "torch_ref: torch is not installed here" >> "$out/summary.txt"
fi
cat "$out/summary.txt"
