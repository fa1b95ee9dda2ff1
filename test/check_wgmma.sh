#!/bin/sh
# The wgmma attention kernels as ptxas compiles them (no GPU needed): a warpgroup instruction
# ptxas has to order itself (it injects warpgroup.arrive or warpgroup.wait where registers a
# wgmma reads or writes are touched outside the kernel's own fences and waits: "(C7517)",
# "(C7519)"), or wgmma it serializes ("Potential Performance Loss"), costs the overlap the kernels
# are written for, with results unchanged; neither shows anywhere but in ptxas -v's report.
# Compiles prefixreuse_cuda.cu for sm_90a with ptxas -v and fails on either for any wgmma kernel.
# And the wgmma instructions as the PTX holds them, the one place their immediates are seen (the
# emulated block, test/gpu_emu.h, takes the wrappers' meaning, not their text): S = A B^T forms
# (m64n64k16, both operands through descriptors) with scale-d from the predicate, scale-a/b 1 and
# no transpose; P V forms (m64n64k16 or m64n128k16, A from 4 registers) with B transposed
# (MN-major); nothing else.
#   sh test/check_wgmma.sh [nvcc] [flags]     (make check-sass; the Makefile's NVCC and NVFLAGS)
# Last line: "N passed, N failed".
nvcc=${1:-nvcc}
flags=${2:--O3 -std=c++17}
if ! command -v "$nvcc" >/dev/null 2>&1; then
    echo "check_wgmma: $nvcc not found: not checked"
    exit 0
fi
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086
if ! "$nvcc" $flags -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -keep -keep-dir "$tmp" -c -o "$tmp/x.o" prefixreuse_cuda.cu > "$tmp/log" 2>&1; then
    cat "$tmp/log"
    echo "0 passed, 1 failed"
    exit 1
fi
kernels=$(grep -c "Compiling entry function '_Z[0-9]*pr_k_attention_[a-z_]*wgmma" "$tmp/log")
bad=$(grep -E "C7517|C7519|Potential Performance Loss" "$tmp/log" | grep -c wgmma)
grep -E "C7517|C7519|Potential Performance Loss" "$tmp/log" | grep wgmma | cut -c1-220
echo "check_wgmma: $kernels wgmma kernels compiled for sm_90a; $bad warpgroup instructions ptxas injected or serialized"
ptx=$(ls "$tmp"/*.ptx 2>/dev/null | head -n 1)
n_mma=0; n_odd=0
if [ -n "$ptx" ]; then
    n_mma=$(grep -c 'wgmma\.mma_async' "$ptx")
    n_odd=$(grep 'wgmma\.mma_async' "$ptx" | grep -cvE \
        -e 'm64n64k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd[0-9]+, %rd[0-9]+, p, 1, 1, 0, 0;' \
        -e 'm64n(64|128)k16\.f32\.bf16\.bf16 \{[^}]*\}, \{%r[0-9]+, %r[0-9]+, %r[0-9]+, %r[0-9]+\}, %rd[0-9]+, p, 1, 1, 1;')
    grep 'wgmma\.mma_async' "$ptx" | grep -vE \
        -e 'm64n64k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd[0-9]+, %rd[0-9]+, p, 1, 1, 0, 0;' \
        -e 'm64n(64|128)k16\.f32\.bf16\.bf16 \{[^}]*\}, \{%r[0-9]+, %r[0-9]+, %r[0-9]+, %r[0-9]+\}, %rd[0-9]+, p, 1, 1, 1;' | cut -c1-200
fi
echo "check_wgmma: $n_mma wgmma.mma_async in the PTX, $n_odd of another form"
pass=0; fail=0
if [ "$n_mma" -gt 0 ] && [ "$n_odd" -eq 0 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: wgmma forms in the PTX"; fi
if [ "$kernels" -ge 6 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $kernels wgmma kernels, expected 6"; fi
if [ "$bad" -eq 0 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: ptxas reordered or serialized warpgroup instructions"; fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
