"""README.md's capacity figures against the program that prints them: the whole-Llama3-8B table
(`train --bench capacity --bench-sizes gpu`, one column a mesh, its flags read from the column's
heading) and the CPU-size figures of eight layers. Each search takes a second or two; a figure the
code no longer gives fails, naming the cell, the command and what it prints now, so that a change
that moves them also updates the README.

    python3 test/check_readme.py build/train-float   (make test)

The last line is "N passed, N failed" (test/tally.sh)."""
import re
import subprocess
import sys

README = "README.md"
LLAMA = ["--config", "model/llama3-8b", "--bench-budget", "81920"]


def number(cell):
    """The first number of a table cell or a sentence's figure ("**33,152**", "131,072 (the
    position limit)")."""
    return int(re.search(r"\d[\d,]*", cell).group(0).replace(",", ""))


def capacity(train, flags):
    """Max tokens of each schedule variant, and the training state's (GiB, bytes a parameter), as a
    run that ended well printed them (none of either otherwise); and its output."""
    try:
        p = subprocess.run([train, "--bench", "capacity"] + flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=600)
    except subprocess.TimeoutExpired:
        return {}, None, "(timed out after 600 s)"
    out = p.stdout.decode(errors="replace")
    if p.returncode != 0:
        return {}, None, out + f"(exit status {p.returncode})"
    tokens = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s+(\d+)\s+\d+/\d+", out, re.M)}
    state = re.search(r"training state on rank 0: ([\d.]+) MiB, ([\d.]+) bytes", out)
    return tokens, (float(state.group(1)) / 1024, float(state.group(2))) if state else None, out


def table_after(text, marker):
    """The first markdown table after marker: its heading cells and its rows, each a list of cells
    (none where the README no longer has the marker)."""
    if marker not in text:
        return [], []
    lines = text[text.index(marker):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[0], rows[2:]


def mesh_flags(heading):
    """A column's heading as train's flags: "tp 2 × cp 2 × dp 2, `--zero 2`"."""
    flags = []
    for dim, n in re.findall(r"\b(dp|tp|cp|pp|ep) (\d+)", heading):
        flags += ["--" + dim, n]
    for z in re.findall(r"`--zero (\d)`", heading):
        flags += ["--zero", z]
    return flags


def main():
    train = sys.argv[1] if len(sys.argv) > 1 else "./train"
    text = open(README).read()
    passed = failed = 0

    def check(ok, what, cmd, out):
        nonlocal passed, failed
        if ok:
            passed += 1
            return
        failed += 1
        print(f"FAIL: README {what}\n    {' '.join(cmd)} prints:")
        print("".join("    " + line + "\n" for line in out.splitlines()))

    marker = "**The whole Llama3-8B (32 layers) on one node"
    heading, rows = table_after(text, marker)
    check(heading, f"the table after \"{marker}\" was not found", [], "")
    for col, head in enumerate(heading[1:], start=1):
        flags = LLAMA + ["--bench-sizes", "gpu"] + mesh_flags(head)
        tokens, state, out = capacity(train, flags)
        cmd = [train, "--bench", "capacity"] + flags
        for row in rows:
            variant = re.sub(r"\s*\(`.*`\)$", "", row[0])
            if variant == "training state a rank":
                gib, per = float(re.search(r"([\d.]+) GiB", row[col]).group(1)), float(re.search(r"([\d.]+) B", row[col]).group(1))
                check(state and abs(state[0] - gib) <= 0.05 + 1e-9 and abs(state[1] - per) <= 0.05 + 1e-9,
                      f"Llama3-8B table, {head}: training state {row[col]}", cmd, out)
            else:
                check(tokens.get(variant) == number(row[col]), f"Llama3-8B table, {head}: {variant} {row[col]}", cmd, out)

    said = re.search(r"--layers 8 --bench-budget 81920` gives ([\d,]+) tokens for the baseline, ([\d,]+) for reuse, "
                     r"([\d,]+) for reuse\+offload and ([\d,]+) for reuse\+recompute-all", re.sub(r"\s+", " ", text))
    flags = LLAMA + ["--layers", "8"]
    tokens, _, out = capacity(train, flags)
    check(said is not None, "eight layers at the CPU build's sizes: the sentence was not found", [], "")
    if said:
        for variant, figure in zip(["baseline", "reuse", "reuse+offload", "reuse+recompute-all"], said.groups()):
            check(tokens.get(variant) == number(figure), f"eight layers at the CPU build's sizes: {variant} {figure}",
                  [train, "--bench", "capacity"] + flags, out)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
