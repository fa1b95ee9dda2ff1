"""Tests of train's JSON step logs (--log) and of bench/plot.py on what train really prints and writes.

    python3 test/test_plot.py TRAIN

A training run's --log on one rank and on dp 2: every field, the loss as printed, the diagnostics in
range and the same on both. Then a small `TRAIN --bench`, `--bench memory` and `--replay 2 --log`:
the parsers find every row with the printed numbers, bad input is refused with the file and line
named, and, where matplotlib is installed, each kind is drawn to a PNG. The last line is
"N passed, N failed".
"""
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import plot  # noqa: E402

passed = failed = 0


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAIL: {what}")


def run(train, *args):
    p = subprocess.run([train, *args], cwd=ROOT, capture_output=True, text=True)
    check(p.returncode == 0, f"train {' '.join(args)}: status {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def main():
    train = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.join(ROOT, "build", "train-float")
    if not os.path.exists(train):
        print(f"{train}: no such program\n0 passed, 1 failed")
        return 1
    tmp = tempfile.mkdtemp()
    fields = ["step", "first_group", "groups", "loss", "kl", "clip_fraction", "grad_norm", "loss_tokens", "seconds_a",
              "seconds_b", "seconds_c", "tokens_per_s", "peak_mib_a", "peak_mib_b", "peak_mib_c"]
    logs = {}
    for name, mesh in [("one rank", []), ("dp 2", ["--dp", "2"])]:
        path = os.path.join(tmp, "train.jsonl")
        out = run(train, "--steps", "3", "--groups-per-step", "2", "--kl-coef", "0.04", "--log", path, *mesh)
        with open(path) as f:
            lines = [json.loads(line) for line in f]
        printed = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]
        check([d["step"] for d in lines] == [0, 1, 2] and all(sorted(d) == sorted(fields) for d in lines),
              f"--log, {name}: steps 0..2 with every field: {lines}")
        check(all(d["groups"] == 2 and d["first_group"] == 2 * d["step"] % 4 for d in lines), f"--log, {name}: the steps' groups")
        check(all(abs(d["loss"] - p) <= 5e-7 for d, p in zip(lines, printed)) and len(printed) == 3,
              f"--log, {name}: losses {[d['loss'] for d in lines]} vs printed {printed}")
        check(all(0 < d["clip_fraction"] < 1 and d["kl"] > 0 and d["loss_tokens"] > 0 and d["peak_mib_b"] > 0 for d in lines),
              f"--log, {name}: diagnostics out of range: {lines}")
        logs[name] = lines
    for a, b in zip(logs["one rank"], logs["dp 2"]):
        check(a["loss_tokens"] == b["loss_tokens"] and a["clip_fraction"] == b["clip_fraction"] and
              abs(a["kl"] - b["kl"]) <= 1e-5 * a["kl"], f"--log: one rank {a} and dp 2 {b} disagree")
    speed = run(train, "--bench", "--bench-total", "48", "--bench-reps", "1", "--bench-groups", "2")
    rows = plot.parse_speed(speed)
    check(plot.kind_of(speed) == "speed" and len(rows) == 4, f"speed: 4 rows (splits x G), got {len(rows)}")
    check(all(r["P"] + r["S"] == 48 and r["G"] == 2 and r["bound"] > 1 for r in rows), f"speed rows: {rows}")
    for r in rows:       # the printed speed-up is the ratio of the printed times, to their rounding (half a ms each)
        low = (r["baseline_s"] - 0.0005) / (r["reuse_s"] + 0.0005)
        high = (r["baseline_s"] + 0.0005) / (r["reuse_s"] - 0.0005) if r["reuse_s"] > 0.0005 else float("inf")
        check(low - 0.005 <= r["speedup"] <= high + 0.005, f"speed row {r}: speedup is not baseline / reuse")
    # under each row, reuse's phases: their times add up to the step's, their shares beyond the
    # baseline's rate to 1 - ratio (each to its printed rounding)
    lines = speed.splitlines()
    phases = [(lines[i - 1].split(), l) for i, l in enumerate(lines) if l.strip().startswith("reuse A/B/C:")]
    check(len(phases) == 4, f"speed: a phase line under each of the 4 rows, got {len(phases)}")
    for row, l in phases:
        secs = [float(x) for x in re.findall(r"([-\d.]+) s\b", l.split(";")[0])]
        shares = [float(x) for x in re.findall(r"([-+\d.]+)%", l.split("rate:")[1])]
        check(len(secs) == 3 and abs(sum(secs) - float(row[3])) <= 0.0005 + 0.00015, f"phase times {secs} against reuse {row[3]} s: {l}")
        check(len(shares) == 3 and abs(sum(shares) / 100 - (1 - float(row[6]))) <= 0.0005 + 0.0015,
              f"phase shares {shares} against 1 - ratio {row[6]}: {l}")

    some = plot.parse_speed(run(train, "--bench", "--bench-total", "48", "--bench-reps", "1", "--bench-groups", "2,3",
                                "--bench-splits", "0.75,0.25"))
    check([(r["P"], r["S"], r["G"]) for r in some] == [(36, 12, 2), (36, 12, 3), (12, 36, 2), (12, 36, 3)],
          f"--bench-splits 0.75,0.25: the splits in their order, each G, got {some}")
    some = plot.parse_memory(run(train, "--bench", "memory", "--bench-total", "48", "--bench-groups", "2", "--bench-splits", "0.5"))
    check({(r["P"], r["S"]) for r in some} == {(24, 24)} and len(some) == len(set(r["schedule"] for r in some)),
          f"--bench memory --bench-splits 0.5: one split, each schedule once, got {some}")

    memory = run(train, "--bench", "memory", "--bench-total", "48", "--bench-groups", "2")
    rows = plot.parse_memory(memory)
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    check(plot.kind_of(memory) == "memory" and len(rows) == 4 * len(schedules) and {"baseline", "reuse"} <= set(schedules),
          f"memory: 4 splits of every schedule, got {len(rows)} rows of {schedules}")
    check(all(r["A"] == 0 and r["C"] == 0 and r["B"] > 0 for r in rows if r["schedule"] == "baseline"),
          "memory: the baseline runs all in phase B")

    log = os.path.join(tmp, "replay.jsonl")
    run(train, "--replay", "2", "--log", log)
    with open(log) as f:
        text = f.read()
    rows = plot.parse_replay(text, log)
    check(plot.kind_of(text) == "replay" and [r["step"] for r in rows] == [0, 1], "replay: steps 0 and 1")

    for bad, want in [("{\"step\": 0}\n", "x.jsonl:1: missing field loss_full"), ("\n{nope\n", "x.jsonl:2: not JSON"),
                      ("", "x.jsonl: no lines")]:
        try:
            plot.parse_replay(bad, "x.jsonl")
            check(False, f"bad replay input {bad!r} was accepted")
        except plot.InputError as e:
            check(str(e).startswith(want), f"bad replay input {bad!r}: message {e!s}, want {want}")
    try:
        plot.kind_of("hello\n")
        check(False, "an unknown input was accepted")
    except plot.InputError:
        check(True, "")

    try:
        import matplotlib  # noqa: F401
        for name, text in [("speed", speed), ("memory", memory), ("replay", log)]:
            src = text if name == "replay" else os.path.join(tmp, name + ".txt")
            if name != "replay":
                with open(src, "w") as f:
                    f.write(text)
            out = os.path.join(tmp, name + ".png")
            p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "plot.py"), src, out], capture_output=True, text=True)
            with open(out, "rb") if os.path.exists(out) else open(os.devnull, "rb") as f:
                check(p.returncode == 0 and f.read(8) == b"\x89PNG\r\n\x1a\n", f"plot.py {name}: {p.stderr.strip()}")
    except ImportError:
        print("matplotlib is not installed: the parsers are tested, the drawing is not")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
