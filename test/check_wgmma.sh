#!/bin/sh
# The wgmma attention kernels as ptxas compiles them (no GPU needed): a warpgroup instruction
# ptxas has to order itself (it injects warpgroup.arrive or warpgroup.wait where registers a
# wgmma reads or writes are touched outside the kernel's own fences and waits: "(C7517)",
# "(C7519)"), or wgmma it serializes ("Potential Performance Loss"), costs the overlap the kernels
# are written for, with results unchanged; neither shows anywhere but in ptxas -v's report.
# Compiles prefixreuse_cuda.cu for sm_90a with ptxas -v and fails on either for any wgmma kernel.
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
if ! "$nvcc" $flags -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -c -o "$tmp/x.o" prefixreuse_cuda.cu > "$tmp/log" 2>&1; then
    cat "$tmp/log"
    echo "0 passed, 1 failed"
    exit 1
fi
kernels=$(grep -c "Compiling entry function '_Z[0-9]*pr_k_attention_[a-z_]*wgmma" "$tmp/log")
bad=$(grep -E "C7517|C7519|Potential Performance Loss" "$tmp/log" | grep -c wgmma)
grep -E "C7517|C7519|Potential Performance Loss" "$tmp/log" | grep wgmma | cut -c1-220
echo "check_wgmma: $kernels wgmma kernels compiled for sm_90a; $bad warpgroup instructions ptxas injected or serialized"
pass=0; fail=0
if [ "$kernels" -ge 6 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $kernels wgmma kernels, expected 6"; fi
if [ "$bad" -eq 0 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: ptxas reordered or serialized warpgroup instructions"; fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
