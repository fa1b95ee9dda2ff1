#!/usr/bin/env python3
"""Random cases for `train --check`: the reuse (or tree) schedule against the full-sequence one on
models, traces and flags drawn at random, so that the schedule meets shapes and combinations no
fixed test names.

Each case draws, from its own seed:
  - a model config.json: llama (with or without llama3 RoPE scaling), qwen3 (q/k norms) or
    qwen3_moe; 1 to 4 layers, heads, GQA ratio, head dim, widths, vocabulary, tied embeddings,
    experts and top-k, all sized to fit the mesh (tp divides the heads and the MLP widths, and the
    KV heads or is a multiple of them; ep divides the experts; pp is at most the layers);
  - a trace: 1 to 6 groups whose prompts share runs (a system prompt, a common turn, whole
    prompts), G 1 to 6, suffixes of 1 to 12 tokens, loss masks with holes, reference log-probs or
    none, trained prefix tokens (multi-turn) in some groups, one group a step or a step table;
  - flags: microbatch and token budget, padded or packed, the four loss norms, KL, clip ranges,
    recompute, offload with small pools and budgets, gradient clipping, the MoE aux-loss scope,
    a mesh of dp x pp x cp x tp (x ep) ranks of up to 8 with ZeRO 0-2 and the bf16 dp sum, and the
    tree schedule.
and runs `TRAIN --config DIR --trace FILE --check FLAGS`. A case passes on exit 0 with the
"check: PASS" line. Anything else (a FAIL, a refusal, a crash) fails it, and the case is printed
with the command that reruns it: `python3 test/fuzz_check.py --train T --case SEED --keep DIR`
writes the case's files into DIR and runs it alone.

With --cuda DOUBLE_TRAIN, TRAIN is a train_cuda (on the emulated device, or on a GPU): head dims 16,
32, 64 and 128 (its attention's), one step a trace, half the cases on a mesh of up to 4 ranks, one process each (RANK,
WORLD_SIZE, LOCAL_RANK, an --nccl-id file, as test/run_mesh_gpu.sh starts them; with a clip range
no token reaches, as there). Its --check is bf16's
mixed test, which the full-sequence schedule's own rounding can fail on a tiny model; a case that
fails it is asked again against the double build (bf16_triage).

    python3 test/fuzz_check.py --train build/train-double --cases 300 --seed 1     (make test)
    python3 test/fuzz_check.py --train build/train-double --seconds 600            (make fuzz)
    python3 test/fuzz_check.py --train build/emu/train_cuda --cuda build/train-double --cases 30 --seed 1

With --resume the same cases train instead (with --cuda, on train_cuda): 2 to 5 steps straight
against a first part saved with --save-state and the rest resumed in a new process, now and then
after a run that kills itself in a save (--fault-kill-after-bytes), four times in ten on another
mesh (resume_plan). On the same mesh every step's loss and gradient norm, the final state's files and
the exported weights must be the straight run's bit for bit; on another, to rounding
(compare_resume), and the state read there and saved again must hold the same bytes
(reshaped_state). The export, read on the resumed part's mesh and saved (in shards or one file),
then read on one rank and saved, must be the same bytes (export_round_trip).

    python3 test/fuzz_check.py --resume --train build/train-double --cases 300 --seed 1   (make test)

With --faults TRAIN is a build of test/train_faults.c (train with one of the library's allocations
failing on demand): each case runs once to count the allocations, then with one of them failing,
and must end with an out-of-memory error, every rank ending (or as if nothing failed), never a
crash or a hang (run_fault_case).

    python3 test/fuzz_check.py --faults --train build/train_faults-double --cases 300 --seed 1   (make test)

The last line is "N passed, N failed" (test/tally.sh). Needs python3 and numpy.
"""
import argparse
import collections
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import struct
import time

import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data"))
from prtrace import write_trace  # noqa: E402

MAX_RANKS = 8          # threads of one train process
MAX_PROCESSES = 4      # train_cuda processes, one a rank (test/run_mesh_gpu.sh's largest mesh; --processes)


def draw_mesh(r, moe, cuda):
    """dp, pp, cp, tp, ep with at most MAX_RANKS ranks (train_cuda: MAX_PROCESSES); a third of the
    cases on one rank (train_cuda: half)."""
    if r.random() < (1 / 2 if cuda else 1 / 3) or (cuda and MAX_PROCESSES == 1):
        return dict(dp=1, pp=1, cp=1, tp=1, ep=1)
    while True:
        m = dict(dp=r.choice([1, 1, 2, 3, 4]), pp=r.choice([1, 1, 2, 3]), cp=r.choice([1, 1, 2, 3]),
                 tp=r.choice([1, 1, 2, 3, 4]))
        m["ep"] = m["tp"] if moe and m["tp"] > 1 and r.random() < 0.5 else 1
        n = m["dp"] * m["pp"] * m["cp"] * m["tp"]
        if 1 < n <= (MAX_PROCESSES if cuda else MAX_RANKS):
            return m


def ranks(mesh):
    return mesh["dp"] * mesh["pp"] * mesh["cp"] * mesh["tp"]


def mesh_flags(r, mesh):
    """The mesh's flags, and a ZeRO stage drawn where there is dp."""
    flags = [f for k in ("dp", "pp", "cp", "tp", "ep") if mesh[k] > 1 for f in ("--" + k, str(mesh[k]))]
    return flags + (["--zero", str(r.choice([0, 1, 2]))] if mesh["dp"] > 1 else [])


def draw_model(r, kind, mesh, cuda):
    tp, pp, ep = mesh["tp"], mesh["pp"], mesh["ep"]
    heads = tp * r.choice([1, 2, 3])
    kv = r.choice([d for d in range(1, heads + 1) if heads % d == 0 and (d % tp == 0 or tp % d == 0)])
    head_dim = r.choice([16, 32, 64, 128] if cuda else [2, 4, 6, 8, 12, 16])    # the CUDA attention's
    c = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[kind]],
        "model_type": kind,
        "vocab_size": r.randint(max(tp, 8), 160),
        "hidden_size": r.choice([8, 12, 16, 20, 24, 32]),
        "intermediate_size": tp * r.randint(2, 10),
        "num_hidden_layers": r.randint(pp, max(pp, 4) if r.random() < 0.5 else max(pp, 2)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": r.choice([1e-6, 1e-5]),
        "rope_theta": r.choice([10000.0, 500000.0, 1000000.0]),
        "rope_scaling": None,
        "tie_word_embeddings": r.random() < 0.4,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    if kind == "llama" and r.random() < 0.4:
        c["rope_scaling"] = {"factor": r.choice([2.0, 8.0]), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": r.choice([8, 16, 64]), "rope_type": "llama3"}
    if kind == "qwen3_moe":
        experts = ep * r.choice([1, 2, 3, 4]) if ep > 1 else r.choice([2, 3, 4, 6, 8])
        c.update({"moe_intermediate_size": tp * r.randint(1, 6), "num_experts": experts,
                  "num_experts_per_tok": r.randint(1, min(experts, 3)), "norm_topk_prob": r.random() < 0.5,
                  "router_aux_loss_coef": r.choice([0.01, 0.05, 0.2]), "decoder_sparse_step": 1, "mlp_only_layers": []})
    return c


def draw_trace(r, vocab, ref, tree, one_step):
    """Groups whose prompts share runs: a system prompt some open with, a turn several continue."""
    n = r.randint(1, 6) if not tree else r.randint(2, 6)
    system = [r.randrange(vocab) for _ in range(r.randint(1, 24))]
    turns = [[r.randrange(vocab) for _ in range(r.randint(1, 10))] for _ in range(2)]
    multiturn = r.random() < 0.25
    groups = []
    for _ in range(n):
        shape = r.random()
        if groups and shape < 0.15:
            prefix = list(groups[r.randrange(len(groups))]["prefix"])          # the same prompt again
        else:
            prefix = system[:r.randint(1, len(system))] if shape < 0.7 else []
            if r.random() < 0.5:
                prefix += r.choice(turns)
            prefix += [r.randrange(vocab) for _ in range(r.randint(0 if prefix else 1, 12))]
        P, G = len(prefix), r.randint(1, 6)
        lens = [r.randint(1, 12) for _ in range(G)]
        base = -math.log(vocab)

        def logps(k):
            return [min(0.0, base + r.gauss(0, 0.15)) for _ in range(k)]

        g = {
            "prefix": prefix,
            "suffixes": [[r.randrange(vocab) for _ in range(s)] for s in lens],
            "advantages": [r.gauss(0, 1) for _ in range(G)],
            "old_logp": [logps(s) for s in lens],
            "ref_logp": [logps(s) for s in lens] if ref else None,
            "loss_mask": [[1 if r.random() < 0.85 else 0 for _ in range(s)] for s in lens],
        }
        if multiturn and P > 1 and r.random() < 0.6:
            a = r.randint(1, P - 1)
            b = r.randint(a, P - 1)
            g["prefix_mask"] = [1 if a <= j <= b else 0 for j in range(P)]
            g["prefix_old_logp"] = logps(P)
            if ref:
                g["prefix_ref_logp"] = logps(P)
        groups.append(g)
    steps = None
    if r.random() < 0.3 and n > 1 and not one_step:      # a version-2 step table
        steps, left = [], n
        while left:
            k = r.randint(1, left)
            steps.append(k)
            left -= k
    return groups, steps


def draw_case(seed, cuda):
    r = random.Random(seed)
    kind = r.choice(["llama", "llama", "qwen3", "qwen3_moe"])
    moe = kind == "qwen3_moe"
    tree = r.random() < 0.25
    mesh = draw_mesh(r, moe, cuda)
    config = draw_model(r, kind, mesh, cuda)
    ref = r.random() < 0.5
    groups, steps = draw_trace(r, config["vocab_size"], ref, tree, cuda)
    flags = ["--seed", str(r.randint(1, 10**6))]
    if tree:
        flags += ["--schedule", "tree", "--tree-min", str(r.randint(1, 8))]
    if r.random() < 0.7:
        flags += ["--microbatch", str(r.randint(0, 4))]
    budget = r.random() < 0.2
    if budget:
        flags += ["--microbatch-tokens", str(r.randint(1, 40))]
    flags += ["--layout", r.choice(["padded", "packed"])]
    norm = r.choice(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
    flags += ["--loss-norm", norm]
    if norm == "seq-mean-token-sum-norm" and r.random() < 0.5:
        flags += ["--loss-norm-len", str(r.randint(1, 20))]
    if ref and r.random() < 0.7:
        flags += ["--kl-coef", r.choice(["0.02", "0.1", "0.5"])]
    if cuda and ranks(mesh) > 1:
        # a bf16 mesh rounds its sums otherwise than one rank, and a ratio within that rounding of
        # a clip bound clips in one run only (test/run_mesh_gpu.sh): a range no token reaches
        flags += ["--eps-low", "0.99", "--eps-high", "100"]
    elif r.random() < 0.3:
        flags += ["--eps-low", r.choice(["0.1", "0.2"]), "--eps-high", r.choice(["0.2", "0.28", "0.4"])]
    flags += ["--clip", r.choice(["0", "0.5", "1"]), "--lr", r.choice(["1e-3", "1e-2"])]
    recompute = r.choice(["none", "none", "prefix", "all"])
    flags += ["--recompute", recompute]
    if r.random() < 0.3:
        flags += ["--offload", "on"]
        if r.random() < 0.5:
            flags += ["--offload-pool", r.choice(["0.001", "0.01", "1"])]
        if r.random() < 0.3:
            flags += ["--device-budget", r.choice(["0.01", "0.1", "4"])]
    flags += mesh_flags(r, mesh)
    if mesh["dp"] > 1 and r.random() < 0.2:
        flags += ["--grad-reduce", "bf16"]
    per_step = None
    if cuda:                         # one step, whose gradients --save-grads can write (triage)
        per_step = len(groups)
        flags += ["--groups-per-step", str(per_step)]
    elif steps is None and len(groups) > 1 and r.random() < 0.5:
        per_step = r.randint(1, len(groups))
        flags += ["--groups-per-step", str(per_step)]
    if moe:
        # The microbatch scope's aux loss is a sum over the microbatches that run. --check refuses
        # the two ways they can differ from the one-rank baseline's: a token budget that cuts the
        # schedules' microbatches differently, and a step of fewer groups than dp, whose groups
        # each rank of a team cuts into microbatches of its own. There, the group scope.
        sizes = steps or [per_step or mesh["dp"]]
        split = mesh["dp"] > 1 and min(sizes) < mesh["dp"]
        flags += ["--aux-scope", "group" if budget or split else r.choice(["microbatch", "group"])]
    return config, groups, steps, flags


def describe(config, groups, flags):
    c = config
    model = f"{c['model_type']} L{c['num_hidden_layers']} h{c['num_attention_heads']}/{c['num_key_value_heads']}x{c['head_dim']} " \
            f"C{c['hidden_size']} V{c['vocab_size']}"
    if "num_experts" in c:
        model += f" E{c['num_experts']}k{c['num_experts_per_tok']}"
    shapes = " ".join(f"{len(g['prefix'])}/{len(g['suffixes'])}" for g in groups)
    return f"{model}; P/G {shapes}; {' '.join(flags[2:])}"


def write_case(d, seed, cuda):
    config, groups, steps, flags = draw_case(seed, cuda)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_trace(os.path.join(d, "case.trace"), groups, config["vocab_size"], steps=steps)
    return config, groups, steps, flags


def mesh_ranks(flags):
    n = 1
    for k, v in zip(flags, flags[1:]):
        if k in ("--dp", "--pp", "--cp", "--tp"):
            n *= int(v)
    return n


def run(cmd, timeout, processes=1, d=None, env=None):
    """Output and exit status of cmd (with env's variables added); with processes > 1, cmd is a
    train_cuda of that many ranks,
    one process each (RANK, WORLD_SIZE, LOCAL_RANK and an --nccl-id file in d, as
    test/run_mesh_gpu.sh starts them): rank 0's output and the others' last lines, the first
    failing status (None on a timeout)."""
    if processes == 1:
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                               env=dict(os.environ, **env) if env else None)
            return p.stdout.decode(errors="replace"), p.returncode
        except subprocess.TimeoutExpired as e:
            return (e.stdout or b"").decode(errors="replace") + f"\n(timed out after {timeout} s)", None
    # the ranks share the machine's cores: more ranks than cores run that many times slower
    timeout *= max(1.0, processes / (os.cpu_count() or 1))
    logs = [open(os.path.join(d, f"rank{k}.log"), "w+b") for k in range(processes)]
    procs = [subprocess.Popen(cmd + ["--nccl-id", os.path.join(d, "nccl-id"), "--nccl-timeout", str(int(timeout))],
                              stdout=logs[k], stderr=subprocess.STDOUT,
                              env=dict(os.environ, RANK=str(k), WORLD_SIZE=str(processes), LOCAL_RANK=str(k)))
             for k in range(processes)]
    end, rc = time.time() + timeout, 0
    try:
        for p in procs:
            try:
                code = p.wait(timeout=max(1.0, end - time.time()))
            except subprocess.TimeoutExpired:
                code = None
            if rc == 0 and code != 0:
                rc = code
    finally:                           # also when a signal stops the run (Stopped)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for f in logs:
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    out = texts[0] + "".join(f"rank {k}: {(t.strip().splitlines() or [''])[-1]}\n" for k, t in enumerate(texts) if k)
    return out + (f"(timed out after {timeout} s)\n" if rc is None else ""), rc


def read_safetensors(path):
    """name -> float64 array of a safetensors file of F32 or F64 tensors (what --save-grads writes)."""
    with open(path, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    out = {}
    for name, t in json.loads(b[8:8 + n]).items():
        if name != "__metadata__":
            lo, hi = t["data_offsets"]
            out[name] = np.frombuffer(b[8 + n + lo:8 + n + hi], dtype={"F32": "<f4", "F64": "<f8"}[t["dtype"]]).astype(np.float64)
    return out


def without(flags, drops):
    """flags less those named in drops (flag -> how many values it takes) and their values."""
    out, skip = [], 0
    for f in flags:
        if skip:
            skip -= 1
        elif f in drops:
            skip = drops[f]
        else:
            out.append(f)
    return out


# flags the triage's full-sequence runs on one rank drop (the reuse schedule's own, and the mesh's),
# and how many values each takes
BASELINE_DROPS = {"--schedule": 1, "--tree-min": 1, "--offload": 1, "--offload-pool": 1, "--device-budget": 1, "--layout": 1,
                  "--recompute": 1, "--dp": 1, "--pp": 1, "--cp": 1, "--tp": 1, "--ep": 1, "--zero": 1, "--grad-reduce": 1}


def bf16_triage(train, reference, d, flags, timeout):
    """The bf16 --check is the paper's mixed test (a tolerance per tensor from its largest gradient),
    which on a tiny random model the full-sequence schedule's own rounding can fail. Asked again
    against the double build: one step's gradients of the full-sequence schedule and of the case's,
    both on the device in bf16, each against the double build's full-sequence gradients. The case
    passes where the whole gradient's L2 error is within twice the full-sequence schedule's (the
    rule --replay applies to trajectories), and no tensor's worst error is more than 8 times the
    full-sequence schedule's there (or than bf16's spacing, 2^-8, of the tensor's largest
    gradient). Rounding spreads: over a model's tensors the worst ratio of two runs' rounding
    errors reaches 2 to 4 now and then; a schedule's error (a wrong row, mask or weight) is of the
    gradient's own size, tens to thousands of times the rounding. Returns (passed, a line saying
    why)."""
    base = without(flags, BASELINE_DROPS)
    common = ["--config", d, "--trace", os.path.join(d, "case.trace"), "--steps", "1"]
    runs = {"device baseline": [train] + common + base + ["--schedule", "baseline"],
            "device case": [train] + common + flags,
            "double baseline": [reference] + common + base + ["--schedule", "baseline"]}
    grads = {}
    for name, cmd in runs.items():
        path = os.path.join(d, name.replace(" ", "-") + ".safetensors")
        out, rc = run(cmd + ["--save-grads", path], timeout, mesh_ranks(cmd), d)
        if rc != 0:
            return False, f"triage: the {name} run failed (exit {rc}): {(out.strip().splitlines() or [''])[-1]}"
        grads[name] = read_safetensors(path)
    worst, where, err_b, err_r = 0.0, "", 0.0, 0.0
    for name, ref in grads["double baseline"].items():
        db, dr = grads["device baseline"][name] - ref, grads["device case"][name] - ref
        err_b += float(db @ db)
        err_r += float(dr @ dr)
        eb, er = np.abs(db).max(), np.abs(dr).max()
        ratio = er / max(eb, 2.0**-8 * np.abs(ref).max(), 1e-30)
        if ratio > worst:
            worst, where = ratio, f"{name}: {er:.2e} against the double build, the baseline's {eb:.2e}"
    whole = math.sqrt(err_r / max(err_b, 1e-300))
    return whole <= 2 and worst <= 8, (f"triage against the double build: the whole gradient's L2 error {whole:.2f}x the baseline's "
                                       f"(limit 2x); the worst tensor {worst:.2f}x (limit 8x: {where})")


def routing_flip(out, trajectories):
    """In bf16 a router logit within rounding of a tie takes another expert in one run only, and
    its token's gradient terms go with it: --check then names the layers whose expert loads moved
    and how many routings at least, counted as the loads count them (a prefix token once for each
    trajectory it stands for). True where no layer moved more than one token can: the step's
    trajectories. A wrong routing or accounting moves the routings of many tokens."""
    for line in out.splitlines():
        if "routings moved:" in line:
            words = line.split("routings moved:")[1].split()
            return bool(words) and set(words[::3]) == {"layer"} and all(int(n) <= trajectories for n in words[2::3])
    return False


def run_case(train, seed, d, timeout, cuda, reference):
    """(verdict: "pass", "triage" (passed on the triage), "flip" (not judged: a routing flip) or
    "fail"; what the case is, seconds, output, exit status)"""
    config, groups, _, flags = write_case(d, seed, cuda)
    t0 = time.time()
    out, rc = run([train, "--config", d, "--trace", os.path.join(d, "case.trace"), "--check"] + flags, timeout,
                  mesh_ranks(flags) if cuda else 1, d)
    verdict = "pass" if rc == 0 and any(line.startswith("check: PASS") for line in out.splitlines()) else "fail"
    if verdict == "fail" and reference and any(line.startswith("check: FAIL") for line in out.splitlines()):
        if routing_flip(out, sum(len(g["suffixes"]) for g in groups)):
            verdict = "flip"
        else:
            ok, why = bf16_triage(train, reference, d, flags, timeout)
            out += why + "\n"
            verdict = "triage" if ok else "fail"
    return verdict, describe(config, groups, flags), time.time() - t0, out, rc


MESH_KEYS = ("dp", "pp", "cp", "tp", "ep")
MESH_DROPS = {"--dp": 1, "--pp": 1, "--cp": 1, "--tp": 1, "--ep": 1, "--zero": 1, "--grad-reduce": 1}


def mesh_part(flags):
    """The flags that place the run on its mesh (--dp .. --ep, --zero) with their values."""
    return [v for i, f in enumerate(flags) if f in MESH_DROPS and f != "--grad-reduce" for v in flags[i:i + 2]]


def fits(config, mesh):
    """The mesh can hold the model: the library's rules for a shard (pr__shard_config)."""
    tp, ep = mesh["tp"], mesh["ep"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    if mesh["pp"] > config["num_hidden_layers"] or heads % tp or (kv % tp and tp % kv) or config["vocab_size"] < tp:
        return False
    if "num_experts" in config:
        return config["num_experts"] % ep == 0 if ep > 1 else config["moe_intermediate_size"] % tp == 0
    return ep == 1 and config["intermediate_size"] % tp == 0


Plan = collections.namedtuple("Plan", "first later total cut every kill shards")


def resume_plan(seed, config, steps, flags, cuda):
    """A training run of the check case of this seed, cut in two, as a Plan: the first part's flags,
    the resumed part's, the steps in all, the steps before the cut, --save-every for the first part
    or None, where a run between the parts dies in a save (killed_run) or None, and the
    --save-shard-size of the export's round trip (export_round_trip). Four times in ten
    the resumed part runs on another mesh drawn for the model (or the same one with another ZeRO
    stage); its sums then run in another order, so the bf16 dp sum, which rounds them, is dropped
    from both parts, and a MoE model's aux loss takes the group scope (the microbatch scope's
    microbatches are each rank's own under split groups). On train_cuda only a run of one process
    is killed (on a mesh the others would wait for it until --nccl-timeout)."""
    r = random.Random(f"resume {seed}")
    if steps is None and "--groups-per-step" not in flags:
        # the default, dp groups a step, said: the resumed part keeps the steps on another mesh
        flags = flags + ["--groups-per-step", str(int(dict(zip(flags, flags[1:])).get("--dp", 1)))]
    total = r.randint(2, 5)
    cut = r.randint(1, total - 1)
    every = r.randint(1, cut) if r.random() < 0.3 else None
    later = flags
    if r.random() < 0.4:
        base = without(flags, MESH_DROPS)
        if "num_experts" in config:
            base = without(base, {"--aux-scope": 1}) + ["--aux-scope", "group"]
        other = next((m for m in (draw_mesh(r, "num_experts" in config, cuda) for _ in range(100)) if fits(config, m)),
                     dict.fromkeys(MESH_KEYS, 1))
        flags, later = base + mesh_part(flags), base + mesh_flags(r, other)
    kill = (None if r.random() < 0.7 else 1.0 if r.random() < 0.25 else r.random())
    if cuda and mesh_ranks(later) > 1:
        kill = None
    return Plan(flags, later, total, cut, every, kill, r.choice(["0", "0", "1KB", "4KB", "20KB"]))


def read_log(path):
    """A --loss-log's lines as (step, loss, grad norm, the line)."""
    with open(path) as f:
        return [(int(w[1]), float.fromhex(w[3]), float.fromhex(w[5]), " ".join(w)) for w in (line.split() for line in f)]


def final_state(folder):
    """The folder of a --save-state's newest state (its latest file names it)."""
    with open(os.path.join(folder, "latest")) as f:
        return os.path.join(folder, f.read().strip())


def state_record(folder):
    """A state folder's trainer_state.json."""
    with open(os.path.join(folder, "trainer_state.json")) as f:
        return json.load(f)


def same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def differing_file(a, b):
    """The first file name, in order, that folders a and b do not hold with the same bytes (one of
    them without it counts), or None."""
    return next((f for f in sorted(set(os.listdir(a)) | set(os.listdir(b)))
                 if not (os.path.exists(os.path.join(a, f)) and os.path.exists(os.path.join(b, f))
                         and same_bytes(os.path.join(a, f), os.path.join(b, f)))), None)


def compare_resume(d, cut, alike, cuda):
    """What differs between the straight run and the resumed one ("" if nothing): the losses and
    grad norms of every step (the first part's bit for bit; the resumed part's too on the same
    mesh, else to the precision's rounding), the final state (its files bit for bit on the same
    mesh, else its step and next group) and the exported weights (bit for bit, or to rounding).
    train_cuda's steps on another mesh are not compared: its bf16 sums there round otherwise, far
    beyond fp32's (reshaped_state checks what the new mesh reads, bit for bit)."""
    state = final_state(os.path.join(d, "straight"))
    record = state_record(state)
    # Another mesh's sums round otherwise, and AdamW divides a gradient by its own size plus eps: a
    # component that cancels to near eps moves its update by (summands / eps) x the rounding, in
    # float up to a good part of lr. So in float the losses are compared there, not the weights.
    # The export is fp32 in both builds: the double build's weights agree to its rounding.
    tol, wtol = (None, None) if cuda else (1e-9, 1e-6) if record["real"] == "F64" else (1e-4, None)
    straight, split = read_log(os.path.join(d, "straight.log")), read_log(os.path.join(d, "split.log"))
    if len(straight) != len(split) or any(a[0] != b[0] for a, b in zip(straight, split)):
        return f"the logs' steps differ: {[a[0] for a in straight]} against {[b[0] for b in split]}"
    for i, (a, b) in enumerate(zip(straight, split)):
        if alike or i < cut:       # the same mesh's steps: the same text (a NaN too)
            differs = a[3] != b[3]
        elif tol is None:
            differs = False
        else:                      # (a NaN is never within)
            differs = not all(abs(x - y) <= tol * max(abs(x), abs(y), 1e-2) for x, y in zip(a[1:3], b[1:3]))
        if differs:
            return f"step {a[0]}: loss {a[1]!r}, grad norm {a[2]!r} straight; {b[1]!r}, {b[2]!r} resumed"
    resumed = final_state(os.path.join(d, "split"))
    if alike:
        f = differing_file(state, resumed)
        if f:
            return f"the final states' {f} differ (or one of them lacks it)"
        same = same_bytes(os.path.join(d, "straight-export", "model.safetensors"), os.path.join(d, "split-export", "model.safetensors"))
        return "" if same else "the exports differ"
    other = state_record(resumed)
    if (record["step"], record["next_group"]) != (other["step"], other["next_group"]):
        return f"the final states are at step {record['step']}, group {record['next_group']} and {other['step']}, {other['next_group']}"
    if wtol is None:
        return ""
    a = read_safetensors(os.path.join(d, "straight-export", "model.safetensors"))
    b = read_safetensors(os.path.join(d, "split-export", "model.safetensors"))
    if a.keys() != b.keys():
        return "the exports hold other tensors"
    for name in a:
        err = float(np.abs(a[name] - b[name]).max(initial=0))
        if not err <= wtol * max(float(np.abs(a[name]).max(initial=0)), 1e-30):     # (a NaN is never within)
            return f"the exports' {name} differ by {err:.3e}"
    return ""


def reshaped_state(step, d, later, at_step):
    """The first part's state read on the resumed part's mesh and saved again there (no step),
    then each of the two read on one rank and saved: the two one-rank states must be the same
    bytes (weights, AdamW moments, step and position), each rank having read exactly its part.
    step(name, flags) runs train; returns what differs, or ""."""
    one_rank = without(later, MESH_DROPS)
    for name, flags in (("reshaped", later + ["--resume", os.path.join(d, "split"), "--save-state", os.path.join(d, "reshaped")]),
                        ("one rank from the first part", one_rank + ["--resume", os.path.join(d, "split"), "--save-state",
                                                                     os.path.join(d, "one-first")]),
                        ("one rank from the reshaped", one_rank + ["--resume", os.path.join(d, "reshaped"), "--save-state",
                                                                   os.path.join(d, "one-reshaped")])):
        _, rc = step(name, flags + ["--steps", "0"])
        if rc != 0:
            return f"the {name} run failed (exit {rc})\n"
    f = differing_file(final_state(os.path.join(d, "one-first")), final_state(os.path.join(d, "one-reshaped")))
    return f"the first part's state at step {at_step}, read on the resumed part's mesh and saved, then on one rank: its {f} differs\n" \
        if f else ""


def export_round_trip(step, d, later, shards):
    """The straight run's export read with --init on the resumed part's mesh (each rank its shard)
    and saved there in files of at most `shards` bytes (0: one), then those read on one rank and
    saved in one file: the same bytes as the export. step(name, flags) runs train; returns what
    differs, or ""."""
    runs = (("export read on the resumed part's mesh", later + ["--init", os.path.join(d, "straight-export"), "--save",
                                                               os.path.join(d, "re-export"), "--save-shard-size", shards]),
            ("that read on one rank", without(later, MESH_DROPS) + ["--init", os.path.join(d, "re-export"), "--save",
                                                                    os.path.join(d, "one-file")]))
    for name, flags in runs:
        _, rc = step(name, flags + ["--steps", "0"])
        if rc != 0:
            return f"the {name} failed (exit {rc})"
    if not same_bytes(os.path.join(d, "straight-export", "model.safetensors"), os.path.join(d, "one-file", "model.safetensors")):
        return f"the export read on the resumed part's mesh, saved in files of {shards} bytes (0: one) and read on one rank is not the export"
    return ""


def rank0_bytes(folder):
    """What world rank 0 writes in a save into folder (a --save-state folder), as its newest state
    holds it: the state's files but the other ranks' pieces, and `latest`."""
    state, size = final_state(folder), os.path.getsize(os.path.join(folder, "latest"))
    for f in os.listdir(state):
        piece = re.fullmatch(r"rank-(\d+)-of-\d+\.safetensors", f)
        if not piece or piece.group(1) == "0":
            size += os.path.getsize(os.path.join(state, f))
    return size


def killed_run(run_later, d, cut, kill, reference):
    """A resumed run that kills itself (SIGKILL) in its first save, once that save has written a
    fraction kill of what rank 0 writes in a save on the run's mesh (reference: a --save-state
    folder of that mesh; at 1, within `latest`, the last file it writes). The newest state must
    still be the one it resumed, at step cut. run_later(extra flags) runs it and returns its
    (output, exit status). Returns what went wrong, or ""."""
    size = rank0_bytes(reference)
    # a few bytes short of the whole: the next save's trainer_state.json may be a digit longer
    at = max(1, size - 3 if kill == 1 else int(kill * size))
    _, rc = run_later(["--save-every", "1", "--fault-kill-after-bytes", str(at)])
    if rc != -signal.SIGKILL:
        return f"the run to be killed at byte {at} of its first save's {size} ended with exit {rc}\n"
    saved = state_record(final_state(os.path.join(d, "split")))["step"]
    return f"after the kill the newest state is at step {saved}, not {cut}, the one the run resumed\n" if saved != cut else ""


def run_resume_case(train, seed, d, timeout, cuda):
    """A --resume case: the run straight, and cut into a first part saved with --save-state and the
    rest resumed in a new process (now and then after a run that dies in a save); (verdict "pass"
    or "fail", what the case is, seconds, output, exit status)."""
    config, groups, steps, flags = write_case(d, seed, cuda)
    plan = resume_plan(seed, config, steps, flags, cuda)
    first, later, total, cut, every, kill = plan[:6]

    def at(name):
        return os.path.join(d, name)

    common = [train, "--config", d, "--trace", at("case.trace")]
    alike = later == first
    what = describe(config, groups, first) + f"; {cut} + {total - cut} steps" + \
        ("" if alike else f", resumed with: {' '.join(mesh_part(later)) or 'one rank'}") + \
        (f"; its first save killed at {kill:.3f} of its bytes" if kill is not None else "")
    t0, out = time.time(), ""

    def step(name, flags):
        nonlocal out
        text, rc = run(common + flags, timeout, mesh_ranks(flags) if cuda else 1, d)
        out += f"{name}: {' '.join(flags)}\n{text}"
        return text, rc

    def resumed(steps):
        return later + ["--steps", str(steps), "--resume", at("split"), "--save-state", at("split")]

    for name, flags in (("straight", first + ["--steps", str(total), "--loss-log", at("straight.log"), "--save-state",
                                              at("straight"), "--save", at("straight-export")]),
                        ("first part", first + ["--steps", str(cut), "--loss-log", at("split.log"), "--save-state", at("split")] +
                         (["--save-every", str(every)] if every else []))):
        _, rc = step(name, flags)
        if rc != 0:
            return "fail", what, time.time() - t0, out + f"the {name} failed (exit {rc})\n", rc

    judging = "the runs after the first part"

    def later_runs():
        """The runs after the first part, each judged as it ends: (what went wrong or "", exit status)."""
        nonlocal judging
        if not alike:
            judging = "the reshaped states"
            why = reshaped_state(step, d, later, at_step=cut)
            if why:
                return why, 1
        if kill is not None:
            judging = "the killed run's state"
            why = killed_run(lambda extra: step("killed run", resumed(total - cut) + extra), d, cut, kill,
                             at("split") if alike else at("reshaped"))
            if why:
                return why, 1
        judging = "the resumed part"
        _, rc = step("resumed part", resumed(total - cut) + ["--loss-log", at("split.log"), "--save", at("split-export")])
        if rc != 0:
            return f"the resumed part failed (exit {rc})\n", rc
        judging = "the resumed part's files"
        why = compare_resume(d, cut, alike, cuda) or export_round_trip(step, d, later, plan.shards)
        return (why + "\n", 1) if why else ("", 0)

    try:
        why, rc = later_runs()
    except (OSError, ValueError, KeyError) as e:     # a file the runs said they wrote, missing or unreadable
        why, rc = f"{judging} cannot be compared: {e}\n", 1
    return ("fail" if why else "pass"), what, time.time() - t0, out + (why or "resume: PASS\n"), rc


def drawn_allocation(counts, r):
    """One of the allocations a run made, every one as likely, as (thread, its allocation number):
    counts[t] is thread t's (train_faults counts them thread by thread, so that the same pair fails
    the same allocation in a rerun)."""
    at = r.randrange(sum(counts))
    for thread, n in enumerate(counts):
        if at < n:
            return thread, at
        at -= n


def run_fault_case(train, seed, d, timeout):
    """A --faults case: the check case of this seed (half the time a training run of two steps
    with --save-state and --save instead of --check) on a build of train whose allocations can fail
    (test/train_faults.c): once to count the library's allocations, then with one of them, drawn,
    failing. The run must end with status 1 and say that memory ran out (on a mesh every rank
    ends, none left waiting), or with 0 where the allocation was one it could do without, its
    losses then the unfailed run's; never a crash or a hang (under the sanitizers, never a leak
    or a bad access either). (verdict "pass" or "fail", what the case is, seconds, output, exit
    status)"""
    config, groups, _, flags = write_case(d, seed, False)
    r = random.Random(f"faults {seed}")
    t0 = time.time()

    def outputs(tag):
        return ["--steps", "2", "--loss-log", os.path.join(d, tag + ".log"), "--save-state", os.path.join(d, tag + "-state"),
                "--save", os.path.join(d, tag + "-export")]

    check = r.random() < 0.5
    cmd = [train, "--config", d, "--trace", os.path.join(d, "case.trace")] + flags
    out, rc = run(cmd + (["--check"] if check else outputs("whole")), timeout, env={"PR_COUNT_ALLOCS": "1"})
    counts = [[int(n) for n in line.split()[1:]] for line in out.splitlines() if line.startswith("allocations: ")]
    what = describe(config, groups, flags) + ("; --check" if check else "; two steps saved")
    if rc != 0 or not counts:
        return "fail", what, time.time() - t0, out + f"the run without a failing allocation failed (exit {rc})\n", rc or 1
    thread, at = drawn_allocation(counts[-1], r)
    what += f"; allocation {at} of thread {thread} fails ({sum(counts[-1])} in {len(counts[-1])} threads)"
    out, rc = run(cmd + (["--check"] if check else outputs("failed")), timeout, env={"PR_FAIL_ALLOC": f"{thread}:{at}"})
    said = [line for line in out.splitlines() if line.startswith("train: ")]
    if rc == 1 and any("memory" in line or "cannot allocate" in line for line in said):
        return "pass", what, time.time() - t0, out, 0
    if rc == 0 and (check or same_bytes(os.path.join(d, "whole.log"), os.path.join(d, "failed.log"))):
        return "pass", what, time.time() - t0, out + "the allocation was not needed\n", 0
    why = ("its losses are not the unfailed run's" if rc == 0 else
           "it said nothing of memory running out" if rc == 1 else "it crashed or was stopped" if rc is None or rc < 0 or rc > 2 else
           "a usage error")
    return "fail", what, time.time() - t0, out + f"with allocation {at} failing: exit {rc}, {why}\n", rc or 1


class Stopped(Exception):
    """SIGTERM (a time limit around the run): the cases so far are still counted and reported."""


def stop(signum, frame):
    raise Stopped()


def main():
    global MAX_PROCESSES
    signal.signal(signal.SIGTERM, stop)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", required=True, help="a train build (build/train-double: its tolerances are double's)")
    ap.add_argument("--cases", type=int, default=0, help="cases to run (with --seconds: at most)")
    ap.add_argument("--seconds", type=float, default=0, help="run cases until this much time has passed")
    ap.add_argument("--seed", type=int, default=None, help="the run's seed (default: from the clock, printed)")
    ap.add_argument("--case", type=lambda s: int(s, 0), help="run the one case of this seed (printed by a failure)")
    ap.add_argument("--keep", help="with --case: write the case's files here and keep them")
    ap.add_argument("--timeout", type=float, default=120, help="seconds a case may take (default 120; a case of more ranks than cores, that many times more)")
    ap.add_argument("--cuda", metavar="DOUBLE_TRAIN",
                    help="TRAIN is a train_cuda (the emulated device's, or a GPU's): head dims 16 to 128, one step, meshes "
                         "of up to 4 processes; a failed bf16 check is asked again against DOUBLE_TRAIN, a double build "
                         "of train")
    ap.add_argument("--processes", type=int, default=MAX_PROCESSES,
                    help=f"with --cuda: the most processes a mesh takes (default {MAX_PROCESSES}; 1 on one GPU, whose "
                         "NCCL takes one rank a device)")
    ap.add_argument("--resume", action="store_true",
                    help="each case trains instead: a few steps straight, and cut in two with --save-state and --resume "
                         "(on the same mesh or another); the runs must agree (bit for bit on the same mesh)")
    ap.add_argument("--faults", action="store_true",
                    help="TRAIN is a build of test/train_faults.c: each case runs with one of the library's allocations "
                         "failing; it must end with an out-of-memory error (or as if nothing failed), never crash or hang")
    a = ap.parse_args()
    if a.faults and (a.cuda or a.resume):
        ap.error("--faults runs alone (a CPU build of test/train_faults.c)")
    if a.case is None and a.cases <= 0 and a.seconds <= 0:
        ap.error("give --cases N, --seconds S or --case SEED")
    if a.processes < 1:
        ap.error("--processes: at least 1")
    MAX_PROCESSES = a.processes
    if a.keep and a.case is None:
        ap.error("--keep writes one case's files: give --case SEED")
    train = os.path.abspath(a.train)
    reference = os.path.abspath(a.cuda) if a.cuda else None
    for path in (train, reference):
        if path and not os.access(path, os.X_OK):
            ap.error(f"{path} is not an executable")

    def one_case(case_seed, d):
        if a.faults:
            return run_fault_case(train, case_seed, d, a.timeout)
        if a.resume:
            return run_resume_case(train, case_seed, d, a.timeout, bool(a.cuda))
        return run_case(train, case_seed, d, a.timeout, bool(a.cuda), reference)

    if a.case is not None:
        d = os.path.abspath(a.keep) if a.keep else tempfile.mkdtemp(prefix="fuzz_check.")
        if a.keep and os.path.isdir(d) and os.listdir(d):
            # a case's outputs are appended to and resumed from: an earlier case's go first
            if not os.path.exists(os.path.join(d, "case.trace")):
                ap.error(f"--keep {a.keep}: the folder holds other files than a case's")
            shutil.rmtree(d)
        os.makedirs(d, exist_ok=True)
        try:
            verdict, what, secs, out, rc = one_case(a.case, d)
        finally:
            if not a.keep:
                shutil.rmtree(d)
        print(out, end="")
        ok = verdict in ("pass", "triage")
        said = {"pass": "PASS", "triage": "PASS on the triage", "flip": "not judged: a routing flip", "fail": "FAIL"}[verdict]
        print(f"case {a.case:#x}: {what}: {said} ({secs:.1f} s){'; files in ' + d if a.keep else ''}")
        print(f"{int(ok)} passed, {int(verdict == 'fail')} failed")
        return 1 if verdict == "fail" else 0
    seed = a.seed if a.seed is not None else int(time.time()) % 1000000
    print(f"fuzz_check{' --resume' if a.resume else ' --faults' if a.faults else ''}: {a.train}, seed {seed}, " +
          (f"{a.cases} cases" if a.cases and not a.seconds else f"{a.seconds:g} s" + (f" or {a.cases} cases" if a.cases else "")))
    passed = failed = triage_passes = flips = 0
    start = time.time()
    work = tempfile.mkdtemp(prefix="fuzz_check.")
    try:
        i = 0
        while (not a.cases or i < a.cases) and (not a.seconds or time.time() - start < a.seconds):
            case_seed = seed * 1000003 + i
            d = os.path.join(work, str(i))
            os.mkdir(d)
            try:
                verdict, what, secs, out, rc = one_case(case_seed, d)
            except Stopped:
                failed += 1
                print(f"case {i} stopped by SIGTERM before it ended ({case_seed:#x})")
                break
            ok = verdict in ("pass", "triage")
            triage_passes += verdict == "triage"
            flips += verdict == "flip"
            if verdict == "flip":
                print(f"case {i} not judged: a routing flip ({case_seed:#x})")
            shutil.rmtree(d)
            if ok:
                passed += 1
            elif verdict == "fail":
                failed += 1
                print(f"case {i} FAIL (exit {rc}): {what}")
                print("".join("    " + line + "\n" for line in out.splitlines()[-25:]), end="")
                mode = (f" --cuda {a.cuda} --processes {a.processes}" if a.cuda else "") + (" --resume" if a.resume else "") + \
                    (" --faults" if a.faults else "")
                print(f"    rerun: python3 {os.path.relpath(__file__)} --train {a.train}{mode} --timeout {a.timeout:g} "
                      f"--case {case_seed:#x} --keep fuzz-case")
            i += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"fuzz_check: {passed + failed} cases in {time.time() - start:.0f} s" +
          (f"; {triage_passes} of the passes failed the bf16 check and passed the triage against the double build; "
           f"{flips} not judged (a routing flip)" if a.cuda and not a.resume else ""))
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
