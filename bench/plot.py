"""Pictures of train's measurements: the speed-up against its bound, memory per phase, replay drift.

    python3 bench/plot.py INPUT OUT.png

INPUT is what `train` printed or wrote, and the kind is read from it:
    ./train --bench > speed.txt                 speed-up of reuse over the baseline per split and G,
                                                beside the FLOP-count bound
    ./train --bench memory > memory.txt         peak device memory per phase (A, B, C) per schedule
    ./train --replay 100 --log replay.jsonl     the reuse schedule's parameter drift against the
                                                floor (full-sequence against itself, reordered)
The parsers need only the standard library (test/test_plot.py runs them); drawing needs matplotlib.
"""
import json
import re
import sys

SPEED_ROW = re.compile(r"^\s*(\d+)/(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)x\s")
MEMORY_ROW = re.compile(r"^\s*(\d+)/(\d+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+|-)")


class InputError(Exception):
    """The input is not one of the kinds this script reads; the message names the file and line."""


def kind_of(text):
    """'speed', 'memory' or 'replay', from the first line that says."""
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith("{"):
            return "replay"
        if s.startswith("bench memory:"):
            return "memory"
        if s.startswith("bench:"):
            return "speed"
        break
    raise InputError("not the output of `train --bench`, `train --bench memory` or a `--replay --log` file")


def parse_speed(text):
    """Rows of `train --bench`: dicts with P, S, G, baseline and reuse seconds, speedup, bound."""
    rows = []
    for line in text.splitlines():
        m = SPEED_ROW.match(line)
        if m:
            P, S, G = int(m[1]), int(m[2]), int(m[3])
            rows.append(dict(P=P, S=S, G=G, baseline_s=float(m[4]), reuse_s=float(m[5]),
                             speedup=float(m[6]), bound=float(m[7])))
    if not rows:
        raise InputError("no rows 'P/S G baseline reuse speedup bound' found")
    return rows


def parse_memory(text):
    """Rows of `train --bench memory`: dicts with P, S, schedule and the peak MiB of phases A, B, C."""
    rows = []
    for line in text.splitlines():
        m = MEMORY_ROW.match(line)
        if m:
            rows.append(dict(P=int(m[1]), S=int(m[2]), schedule=m[3], A=float(m[4]), B=float(m[5]), C=float(m[6])))
    if not rows:
        raise InputError("no rows 'P/S schedule A B C' found")
    return rows


REPLAY_KEYS = ("step", "loss_full", "loss_reuse", "drift_rel_l2", "floor_rel_l2", "drift_max_abs", "floor_max_abs")


def parse_replay(text, name="replay log"):
    """The lines of `train --replay N --log FILE`, each checked for the fields the plot draws."""
    rows = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{name}:{no}: not JSON ({e.msg})") from None
        missing = [k for k in REPLAY_KEYS if k not in d]
        if missing:
            raise InputError(f"{name}:{no}: missing field {missing[0]}")
        rows.append(d)
    if not rows:
        raise InputError(f"{name}: no lines")
    return rows


def draw_speed(rows, out):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for G in sorted({r["G"] for r in rows}):
        sel = sorted((r for r in rows if r["G"] == G), key=lambda r: r["P"] / (r["P"] + r["S"]))
        x = [r["P"] / (r["P"] + r["S"]) for r in sel]
        line, = ax.plot(x, [r["speedup"] for r in sel], "o-", label=f"measured, G={G}")
        ax.plot(x, [r["bound"] for r in sel], "--", color=line.get_color(), label=f"bound, G={G}")
    ax.set_xlabel("prefix share of each trajectory, P / (P + S)")
    ax.set_ylabel("speed-up of reuse over the baseline")
    ax.axhline(1, color="grey", lw=0.5)
    ax.legend()
    ax.set_title("Speed-up against the FLOP-count bound")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def draw_memory(rows, out):
    import matplotlib.pyplot as plt
    splits = sorted({(r["P"], r["S"]) for r in rows}, key=lambda ps: ps[0] / (ps[0] + ps[1]))
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    fig, axes = plt.subplots(1, len(splits), figsize=(3.2 * len(splits), 4.4), sharey=True, squeeze=False)
    width = 0.8 / len(schedules)
    for ax, (P, S) in zip(axes[0], splits):
        for k, name in enumerate(schedules):
            r = next((r for r in rows if (r["P"], r["S"]) == (P, S) and r["schedule"] == name), None)
            if r is None:
                continue
            ax.bar([i + k * width for i in range(3)], [r["A"], r["B"], r["C"]], width, label=name)
        ax.set_xticks([i + width * (len(schedules) - 1) / 2 for i in range(3)], ["A", "B", "C"])
        ax.set_title(f"P/S {P}/{S}")
    axes[0][0].set_ylabel("peak device MiB")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(schedules), 4), fontsize="small")
    fig.suptitle("Peak memory per phase")
    fig.tight_layout(rect=(0, 0.04 * ((len(schedules) + 3) // 4) + 0.02, 1, 1))
    fig.savefig(out, dpi=110)


def draw_replay(rows, out):
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 5.6), sharex=True)
    # train's floor is full-sequence against itself reordered; train_cuda's (bf16) measures both runs
    # from the full-sequence schedule on the CPU (README "Replay")
    top.semilogy(steps, [max(r["drift_rel_l2"], 1e-300) for r in rows], label="drift: reuse")
    top.semilogy(steps, [max(r["floor_rel_l2"], 1e-300) for r in rows], label="floor: full-sequence (reordered, or bf16 vs CPU)")
    top.set_ylabel("parameter drift, relative L2")
    top.legend(fontsize="small")
    bottom.plot(steps, [r["loss_full"] for r in rows], label="full-sequence")
    bottom.plot(steps, [r["loss_reuse"] for r in rows], "--", label="reuse")
    bottom.set_ylabel("loss")
    bottom.set_xlabel("step")
    bottom.legend(fontsize="small")
    fig.suptitle("Replay: drift of the reuse schedule against the floor")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    src, out = argv[1], argv[2]
    try:
        with open(src) as f:
            text = f.read()
        kind = kind_of(text)
        rows = {"speed": parse_speed, "memory": parse_memory}.get(kind, lambda t: parse_replay(t, src))(text)
    except OSError as e:
        print(f"plot.py: {src}: {e.strerror}", file=sys.stderr)
        return 1
    except InputError as e:
        print(f"plot.py: {src}: {e}", file=sys.stderr)
        return 1
    try:
        import matplotlib
        matplotlib.use("Agg")
    except ImportError:
        print("plot.py: drawing needs matplotlib (python3 -m pip install matplotlib)", file=sys.stderr)
        return 1
    {"speed": draw_speed, "memory": draw_memory, "replay": draw_replay}[kind](rows, out)
    print(f"plot.py: {kind} plot of {len(rows)} rows written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
