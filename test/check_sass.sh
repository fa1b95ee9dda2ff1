#!/bin/sh
# The tensor-core attention kernels' machine code, checked without a GPU: in every SASS
# architecture the object carries, each of the eight *_mma kernels (forward, dQ, dK/dV and the
# fused dK/dV of PR_CUDA_ATTENTION_MMA_ATOMIC, for head dims 64 and 128) holds tensor-core
# instructions (HMMA), and the wgmma forward, dQ and dK/dV (PR_CUDA_ATTENTION_WGMMA) Hopper's (HGMMA), with
# no local-memory traffic (STL/LDL: register spills), and its resource usage shows no stack and no
# local memory.
#   sh test/check_sass.sh [object]          (default build/prefixreuse_cuda.o; make check-sass)
# Needs cuobjdump and nvdisasm: the CUDA toolkit's, or pip's nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm (found by themselves). Without them it says so and exits 0.
# Last line: "N passed, N failed".
obj=${1:-build/prefixreuse_cuda.o}
CUOBJDUMP=${CUOBJDUMP:-cuobjdump}
if ! command -v "$CUOBJDUMP" >/dev/null 2>&1 || ! command -v nvdisasm >/dev/null 2>&1; then
    for p in $(python3 -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null); do
        for b in "$p"/*/bin; do
            [ -x "$b/cuobjdump" ] && [ -x "$b/nvdisasm" ] && PATH="$b:$PATH" && CUOBJDUMP=cuobjdump
        done
    done
fi
if ! command -v "$CUOBJDUMP" >/dev/null 2>&1 || ! command -v nvdisasm >/dev/null 2>&1; then
    echo "check_sass: cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): not checked"
    exit 0
fi
if [ ! -f "$obj" ]; then
    echo "check_sass: $obj not found (make build/prefixreuse_cuda.o)"
    echo "0 passed, 1 failed"
    exit 1
fi
sass=$("$CUOBJDUMP" -sass "$obj") || { echo "0 passed, 1 failed"; exit 1; }
res=$("$CUOBJDUMP" -res-usage "$obj" 2>/dev/null)
printf '%s\n' "$sass" | awk -v res="$res" '
    /arch = /    { arch = $NF }
    /Function :/ { f = $3; if (f ~ /pr_k_attention_.*_(wg)?mma/) { key = arch " " f; seen[key] = 1; hmma[key] += 0; local[key] += 0 } }
    f ~ /pr_k_attention_.*_mma/ && /HMMA/ { hmma[arch " " f]++ }
    f ~ /pr_k_attention_.*_wgmma/ && /HGMMA/ { hmma[arch " " f]++ }
    f ~ /pr_k_attention_.*_(wg)?mma/ && /[^A-Z](STL|LDL)[. ]/ { local[arch " " f]++ }
    END {
        n = split(res, lines, "\n")
        for (i = 1; i < n; i++) {
            if (lines[i] ~ /arch = /) { ra = lines[i]; sub(/.*= */, "", ra) }
            if (lines[i] ~ /Function .*pr_k_attention_.*_(wg)?mma/) {
                name = lines[i]; sub(/.*Function /, "", name); sub(/:.*/, "", name)
                usage[ra " " name] = lines[i + 1]
            }
        }
        pass = 0; fail = 0; per_arch_kernels = 0
        for (k in seen) {
            split(k, a, " "); name = a[2]; count[a[1]]++
            u = usage[k]
            ok = hmma[k] > 0 && local[k] == 0 && (u == "" || (u ~ /STACK:0 / && u ~ /LOCAL:0 /))
            printf "%s %s: %s %d, STL/LDL %d; %s %s\n", a[1], name, name ~ /wgmma/ ? "HGMMA" : "HMMA", hmma[k], local[k], u == "" ? "(no resource line)" : u, ok ? "ok" : "FAIL"
            if (ok) pass++; else fail++
        }
        archs = 0
        for (a2 in count) { archs++; if (count[a2] != 14) { printf "FAIL %s: %d tensor-core kernels, expected 14\n", a2, count[a2]; fail++ } else pass++ }
        if (archs == 0) { print "FAIL: no tensor-core kernel in the object"; fail++ }
        printf "%d passed, %d failed\n", pass, fail
        exit fail > 0
    }'
