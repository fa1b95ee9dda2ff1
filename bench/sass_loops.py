"""The tensor-core attention kernels' inner loops, read from their SASS (no GPU needed).

    cuobjdump -sass build/prefixreuse_cuda.o | python3 bench/sass_loops.py      (make sass runs it)

For each *_mma kernel of each architecture: its largest loop that holds HMMA (the key-tile walk,
or the dK/dV's query sub-tile), as instructions, HMMA among them, instructions per HMMA, and the
ten commonest opcodes; for each *_wgmma kernel the same with HGMMA (Hopper's warpgroup MMA, whose
one instruction is a 64-row product: 8 to 16 times an HMMA's work). A loop is the span from a backward branch's target to the branch. Counts
are static: a loop with two paths (a tile that needs the mask test and one that does not) counts
both, so compare a kernel with itself across changes, not with a profiler's figures.
"""
import collections
import re
import sys

FUNCTION = re.compile(r"Function : (\S+)")
ARCH = re.compile(r"(?:arch = |code for )(sm_\w+)")
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
TARGET = re.compile(r"0x([0-9a-f]+)")
KERNEL = re.compile(r"pr_k_attention_(\w+?_(?:wg)?mma)ILi(\d+)E(?:Lb([01])E)?")     # name, head dim, fused


def kernels(lines):
    """(arch, function name, [(address, text)]) for every function in the listing."""
    arch, name, body = "?", None, []
    for line in lines:
        m = ARCH.search(line)
        if m:
            arch = m[1]
        m = FUNCTION.search(line)
        if m:
            if name:
                yield arch, name, body
            name, body = m[1], []
            continue
        m = INSTRUCTION.match(line)
        if m and name:
            body.append((int(m[1], 16), m[2]))
    if name:
        yield arch, name, body


def opcode(text):
    words = text.split()
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def hottest_loop(body, tensor="HMMA"):
    """The largest backward-branch span holding `tensor` instructions: Counter of opcodes, or None."""
    best = None
    for address, text in body:
        if opcode(text) != "BRA":
            continue
        m = TARGET.search(text)
        if not m or int(m[1], 16) >= address:
            continue
        start = int(m[1], 16)
        ops = collections.Counter(opcode(t) for a, t in body if start <= a <= address)
        if ops[tensor] and (best is None or sum(ops.values()) > sum(best.values())):
            best = ops
    return best


def main():
    shown = 0
    for arch, name, body in kernels(sys.stdin):
        m = KERNEL.search(name)
        if not m:
            continue
        short = f"{m[1]} hd {m[2]}" + (" fused" if m[3] == "1" else "")
        tensor = "HGMMA" if m[1].endswith("wgmma") else "HMMA"
        ops = hottest_loop(body, tensor)
        if not ops:
            print(f"{arch} {short}: no loop with {tensor}")
            continue
        n = sum(ops.values())
        mix = " ".join(f"{k} {v}" for k, v in ops.most_common(10))
        print(f"{arch} {short}: loop {n} instructions, {tensor} {ops[tensor]}, {n / ops[tensor]:.2f} a {tensor}; {mix}")
        shown += 1
    if not shown:
        print("sass_loops: no tensor-core attention kernel in the input", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
