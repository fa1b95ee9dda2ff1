"""Tests of the importers in data/ (import_nemo_rl.py, import_slime.py, import_jsonl.py, ptfile.py).

    python3 test/test_importers.py [TRAIN]      # TRAIN: a train binary to replay the imported traces

Numpy only, no network, no torch. The fixtures are built here, in temporary folders, in the
shape the frameworks' own writers give them:
- NeMo-RL: Logger.log_batched_dict_as_jsonl (nemo_rl/utils/logger.py) over the log_data dict of
  grpo_train (nemo_rl/algorithms/grpo.py): one line per sequence, every value the batch's row
  sliced [i:i+1], plus "idx"; right-padded token rows, advantages expanded per token, log-probs
  in NeMo-RL's convention (entry i = log-prob of token i, entry 0 = 0);
- slime: torch.save({"rollout_id", "samples": [Sample.to_dict()]}) as in save_debug_rollout_data
  (slime/observability/rollout_data_utils.py), every field of Sample (slime/utils/types.py), a few
  of them tensors, written by test/ptwriter.py in torch.save's zip layout;
- the minimal JSONL record of data/import_jsonl.py.
Every imported trace is read back with data/prtrace.py and compared with what the fixture says,
and, when a train binary is found (argument, build/train-float or ./train), replayed with
`train --trace OUT --steps 1` and checked with `train --trace OUT --check`.
The last line is "N passed, N failed".
"""
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "data"), os.path.join(ROOT, "test")]

import import_jsonl  # noqa: E402
import import_nemo_rl  # noqa: E402
import import_slime  # noqa: E402
import ptfile  # noqa: E402
from prtrace import read_trace  # noqa: E402
from ptwriter import Tensor, save_pt  # noqa: E402

VOCAB = 256          # model/tiny
TMP = tempfile.mkdtemp(prefix="primport-")
TRAIN = None
TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


def tmp(name):
    return os.path.join(TMP, name)


def run_main(main, argv):
    """Run an importer's main in-process; return (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def imported(main, inputs, out, *extra):
    rc, so, se = run_main(main, list(inputs) + ["-o", out, "--vocab-size", str(VOCAB)] + list(extra))
    assert rc == 0, f"import failed: {se}"
    groups, vocab = read_trace(out)
    assert vocab == VOCAB
    return groups, so


def replay(trace):
    """The C reader and both schedules on an imported trace."""
    if TRAIN is None:
        return
    for flags in (["--steps", "1"], ["--check"]):
        p = subprocess.run([TRAIN, "--trace", trace] + flags, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"{TRAIN} --trace {trace} {' '.join(flags)} failed:\n{p.stdout}{p.stderr}"


def expect_error(main, inputs, *needles, extra=()):
    """The import fails with status 1, its message contains every needle, and no output is left."""
    out = tmp("bad.trace")
    if os.path.exists(out):
        os.remove(out)
    rc, so, se = run_main(main, list(inputs) + ["-o", out, "--vocab-size", str(VOCAB)] + list(extra))
    assert rc == 1, f"expected failure, got {rc}: {so}{se}"
    for n in needles:
        assert n in se, f"{n!r} not in the error: {se.strip()}"
    assert not os.path.exists(out), "an output file was left behind"
    assert not [f for f in os.listdir(TMP) if ".tmp" in f], "a temporary file was left behind"
    return se


def saved(groups):
    return sum((len(g["suffixes"]) - 1) * g["prefix"].shape[0] for g in groups)


def tree_tokens(groups, steps):
    """Distinct prompt prefixes in each step: what a prefix tree at minimum 1 runs, counted as a set."""
    total, at = 0, 0
    for n in steps:
        total += len({tuple(g["prefix"][:k].tolist()) for g in groups[at:at + n] for k in range(1, g["prefix"].shape[0] + 1)})
        at += n
    return total


def logps(rng, n):
    return [float(x) for x in np.round(-rng.uniform(0.01, 6.0, n), 4)]


def ints(rng, lo, hi, n):
    return [int(x) for x in rng.integers(lo, hi, n)]


# ------------------------------------------------------------------ NeMo-RL fixture

def nemo_rows(seed=1):
    """Sequences as NeMo-RL's GRPO step holds them: per sequence the prompt, then message spans
    (tokens, generated?), reward, advantage, loss multiplier, log-probs. Returns the rows and
    the expected trace groups keyed by prompt."""
    rng = np.random.default_rng(seed)
    prompts = {"A": ints(rng, 1, 200, 7), "B": ints(rng, 1, 200, 5), "C": ints(rng, 1, 200, 9)}
    plan = [("A", 1.0), ("A", 0.0), ("A", 1.0), ("A", 0.0), ("B", 1.0), ("B", 1.0), ("B", 0.0), ("B", 0.0),
            ("C", 0.0), ("C", 1.0), ("C", 1.0)]
    rows = []
    for n, (p, reward) in enumerate(plan):
        spans = [(ints(rng, 1, 250, int(rng.integers(1, 7))), True)]
        if n == 9:      # a multi-turn sequence: tool output (not generated), then a second answer
            spans += [(ints(rng, 1, 250, 3), False), (ints(rng, 1, 250, 2), True)]
        rows.append({"prompt": p, "prompt_ids": prompts[p], "spans": spans, "reward": reward,
                     "multiplier": 0.0 if n == 6 else 1.0,
                     "gen_logp": [logps(rng, len(t)) for t, _ in spans],
                     "prev_logp": logps(rng, len(prompts[p]) + sum(len(t) for t, _ in spans))})
    for p in "ABC":   # GRPO advantages as NeMo-RL computes them (leave-one-out baseline, std-normalised)
        members = [r for r in rows if r["prompt"] == p]
        rew = np.array([r["reward"] for r in members])
        for i, r in enumerate(members):
            others = np.delete(rew, i)
            r["advantage"] = float((rew[i] - others.mean()) / (rew.std(ddof=1) + 1e-6))
    return rows


def nemo_log_data(rows, pad_id=0, divisible_by=8):
    """train_data as batched_message_log_to_flat_message pads it, and log_data as grpo_train builds it."""
    seqs = [r["prompt_ids"] + [t for toks, _ in r["spans"] for t in toks] for r in rows]
    T = -(-max(map(len, seqs)) // divisible_by) * divisible_by
    log = {"content": [], "rewards": [], "input_lengths": [], "token_ids": [], "token_loss_mask": [],
           "sample_loss_mask": [], "advantages": [], "generation_logprobs": [], "prev_logprobs": []}
    for r, s in zip(rows, seqs):
        L, pad = len(s), T - len(s)
        mask = [0] * len(r["prompt_ids"]) + [int(g) for toks, g in r["spans"] for _ in toks]
        gen = [0.0] * len(r["prompt_ids"]) + [lp if g else 0.0 for (toks, g), lps in zip(r["spans"], r["gen_logp"])
                                              for lp in (lps if g else [0.0] * len(toks))]
        prev = [0.0] + r["prev_logp"][1:]          # entry 0 is 0 by NeMo-RL's convention
        log["content"].append(["user: ...", "assistant: ..."])
        log["rewards"].append(r["reward"])
        log["input_lengths"].append(L)
        log["token_ids"].append([int(t) for t in s] + [pad_id] * pad)
        log["token_loss_mask"].append(mask + [0] * pad)
        log["sample_loss_mask"].append(r["multiplier"])
        log["advantages"].append([r["advantage"]] * T)   # .expand(mask.shape): every position
        log["generation_logprobs"].append(gen + [0.0] * pad)
        log["prev_logprobs"].append(prev + [0.0] * pad)
    return log


def write_nemo(path, log):
    """Logger.log_batched_dict_as_jsonl: each value sliced to the row, plus idx."""
    B = len(log["token_ids"])
    with open(path, "w") as f:
        for i in range(B):
            sample = {k: v[i:i + 1] for k, v in log.items()}
            f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")


@test
def nemo_rl_step_dump():
    rows = nemo_rows()
    path = tmp("train_data_step3.jsonl")
    write_nemo(path, nemo_log_data(rows))
    groups, report = imported(import_nemo_rl.main, [path], tmp("nemo.trace"))
    assert [len(g["suffixes"]) for g in groups] == [4, 4, 3]
    for g, p in zip(groups, "ABC"):
        members = [r for r in rows if r["prompt"] == p]
        assert g["prefix"].tolist() == [int(t) for t in members[0]["prompt_ids"]]
        for i, r in enumerate(members):
            P = len(r["prompt_ids"])
            toks = [t for ts, _ in r["spans"] for t in ts]
            mask = [int(gen) for ts, gen in r["spans"] for _ in ts]
            assert g["suffixes"][i].tolist() == toks
            # old_logp[j] is the log-prob of suffix token j: NeMo-RL's prev_logprobs at position P + j
            assert np.allclose(g["old_logp"][i], np.float32(r["prev_logp"][P:]))
            assert g["loss_mask"][i].tolist() == [m * int(r["multiplier"]) for m in mask]
            assert np.isclose(g["advantages"][i], r["advantage"], rtol=1e-6)
        assert g["ref_logp"] is None
    assert sum(m.sum() == 0 for m in groups[1]["loss_mask"]) == 1        # the filtered sample (multiplier 0)
    assert groups[2]["loss_mask"][1].tolist().count(0) == 3              # the tool span
    want = 3 * 7 + 3 * 5 + 2 * 9
    assert saved(groups) == want
    assert f"prefix tokens reuse saves: {want} = " in report
    assert "groups: 3 (by identical prompts); 1 step, one per input file, of 3 groups" in report
    assert "G per group: min 3, mean 3.7, max 4" in report
    assert read_trace(tmp("nemo.trace"), steps=True)[2] == [3]         # one step: the file's batch
    replay(tmp("nemo.trace"))
    # two step files: two steps, each holding its file's groups; the C reader and train take them
    path2 = tmp("train_data_step4.jsonl")
    write_nemo(path2, nemo_log_data(nemo_rows(5)))
    imported(import_nemo_rl.main, [path, path2], tmp("nemo-2steps.trace"))
    g2, _, steps = read_trace(tmp("nemo-2steps.trace"), steps=True)
    assert steps == [3, len(g2) - 3] and len(g2) > 3, steps
    replay(tmp("nemo-2steps.trace"))


@test
def nemo_rl_global_batches():
    """--train-global-batch-size N: NeMo-RL's optimizer steps of a dump, N consecutive rows each
    (BatchedDataDict.shard_by_batch_size, which refuses a batch that is not a multiple of N)."""
    rows = nemo_rows()[:9]              # prompts A A A A B B B B C
    path = tmp("train_data_step7.jsonl")
    write_nemo(path, nemo_log_data(rows))
    groups, report = imported(import_nemo_rl.main, [path], tmp("nemo-gbs.trace"), "--train-global-batch-size", "3")
    _, _, steps = read_trace(tmp("nemo-gbs.trace"), steps=True)
    assert steps == [1, 2, 2], steps     # rows 0-2: A; 3-5: A, B; 6-8: B, C
    assert [len(g["suffixes"]) for g in groups] == [3, 1, 2, 2, 1]
    got = [a for g in groups for a in g["advantages"]]
    assert np.allclose(got, [r["advantage"] for r in rows], rtol=1e-6)
    assert "3 steps, one per global batch of 3 sequences, of 1, 2, 2 groups" in report, report
    replay(tmp("nemo-gbs.trace"))
    expect_error(import_nemo_rl.main, [path], "9 sequences, not a multiple of --train-global-batch-size 4",
                 extra=["--train-global-batch-size", "4"])


@test
def nemo_rl_generation_logprobs_and_pooled_prompts():
    rows = nemo_rows(2)
    rows.append(dict(rows[0]))           # a prompt seen again later in the batch joins its group
    path = tmp("train_data_step4.jsonl")
    write_nemo(path, nemo_log_data(rows, pad_id=7, divisible_by=1))
    groups, _ = imported(import_nemo_rl.main, [path], tmp("nemo2.trace"), "--logprobs", "generation")
    assert [len(g["suffixes"]) for g in groups] == [5, 4, 3]
    r = rows[9]                          # multi-turn: generation log-probs are 0 on the tool span
    want = [lp if gen else 0.0 for (ts, gen), lps in zip(r["spans"], r["gen_logp"]) for lp in (lps if gen else [0] * len(ts))]
    assert np.allclose(groups[2]["old_logp"][1], np.float32(want))


@test
def nemo_rl_bad_input():
    rows = nemo_rows()
    log = nemo_log_data(rows)
    good = tmp("good_step.jsonl")
    write_nemo(good, log)

    def variant(name, edit):
        lines = open(good).read().splitlines()
        rec = json.loads(lines[4])
        edit(rec)
        lines[4] = json.dumps(rec)
        path = tmp(name)
        open(path, "w").write("\n".join(lines) + "\n")
        return path

    old = variant("old_dump.jsonl", lambda r: r.pop("token_ids"))
    expect_error(import_nemo_rl.main, [old], "old_dump.jsonl: line 5: token_ids: missing", "v0.6.0")

    def vary(r):
        r["advantages"][0][len(rows[4]["prompt_ids"]) + 1] += 0.5
    P4 = len(rows[4]["prompt_ids"])
    assert len(rows[4]["spans"][0][0]) > 1          # (the seed gives line 5 a response of 3 tokens)
    expect_error(import_nemo_rl.main, [variant("vary.jsonl", vary)], f"line 5: advantages[{P4 + 1}]",
                 "one advantage per response")
    imported(import_nemo_rl.main, [tmp("vary.jsonl")], tmp("vary.trace"), "--varying-advantage", "mean")
    expect_error(import_nemo_rl.main, [variant("short.jsonl", lambda r: r["token_loss_mask"][0].pop())],
                 "line 5: token_loss_mask: has", "token_ids has")
    expect_error(import_nemo_rl.main, [variant("pos.jsonl", lambda r: r["prev_logprobs"][0].__setitem__(P4, 0.5))],
                 f"line 5: prev_logprobs[{P4}] = 0.5 is positive")
    expect_error(import_nemo_rl.main, [variant("nan.jsonl", lambda r: r["prev_logprobs"][0].__setitem__(P4, float("nan")))],
                 f"line 5: prev_logprobs[{P4}] = nan is not finite")
    nomask = variant("nomask.jsonl", lambda r: r.__setitem__("token_loss_mask", [[0] * len(r["token_ids"][0])]))
    expect_error(import_nemo_rl.main, [nomask], "line 5: token_loss_mask: no token is marked 1")
    groups, report = imported(import_nemo_rl.main, [nomask], tmp("dropped.trace"), "--drop-empty")
    assert [len(g["suffixes"]) for g in groups] == [4, 3, 3] and "1 with an empty response dropped" in report
    expect_error(import_nemo_rl.main, [variant("vocab.jsonl", lambda r: r["token_ids"][0].__setitem__(0, 300))],
                 "line 5: token_ids[0] = 300 is outside the vocabulary")

    def mask_past_length(r):
        assert len(r["token_ids"][0]) > r["input_lengths"][0]      # (line 5 is padded)
        r["token_loss_mask"][0][-1] = 1
    T5 = len(json.loads(open(good).read().splitlines()[4])["token_ids"][0])
    expect_error(import_nemo_rl.main, [variant("past.jsonl", mask_past_length)],
                 f"line 5: token_loss_mask[{T5 - 1}] = 1 lies past input_lengths")

    # line 10 (prompt C, then an answer, a tool span and a second answer) with its first answer's
    # mask 0: its prompt runs on through the tool span, a group of one, which the report points out
    C = len(rows[9]["prompt_ids"])
    first = len(rows[9]["spans"][0][0])
    lines = open(good).read().splitlines()
    rec = json.loads(lines[9])
    rec["token_loss_mask"][0][C:C + first] = [0] * first
    lines[9] = json.dumps(rec)
    open(tmp("empty_turn.jsonl"), "w").write("\n".join(lines) + "\n")
    groups, report = imported(import_nemo_rl.main, [tmp("empty_turn.jsonl")], tmp("empty_turn.trace"))
    assert [len(g["suffixes"]) for g in groups] == [4, 4, 2, 1]
    assert f"line 10: its prompt is that of {tmp('empty_turn.jsonl')}: line 9 and {first + 3} more tokens" in report, report
    assert "its prompt is that of" not in imported(import_nemo_rl.main, [good], tmp("good.trace"))[1]


# ------------------------------------------------------------------ slime fixture

def slime_sample(group, index, prompt, response, logp, reward, loss_mask=None, **kw):
    """A dict as Sample.to_dict() returns it: every field of slime's Sample."""
    d = {"group_index": group, "index": index, "rollout_id": None, "prompt": "<prompt text>",
         "tokens": list(prompt) + list(response), "multimodal_inputs": None, "multimodal_train_inputs": None,
         "multimodal_train_input_id": None, "apply_chat_template_kwargs": {}, "response": "<response text>",
         "response_length": len(response), "label": "42", "reward": reward, "loss_mask": loss_mask,
         "weight_versions": ["3"], "rollout_log_probs": list(logp), "rollout_top_p_token_ids": None,
         "rollout_top_p_token_offsets": None, "rollout_routed_experts": None, "remove_sample": False,
         "teacher_log_probs": None, "status": "completed", "metadata": {}, "generate_function_path": None,
         "custom_rm_path": None, "train_metadata": None, "session_id": None, "non_generation_time": 0.0,
         "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                       "completion_token_num": len(response)},
         "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": len(prompt)}}
    d.update(kw)
    return d


def slime_rollout(seed=3, interleave=False):
    rng = np.random.default_rng(seed)
    prompts = [ints(rng, 1, 250, n) for n in (11, 6)]
    samples = []
    for k in range(8):
        g = k // 4
        resp = ints(rng, 1, 250, int(rng.integers(1, 8)))
        samples.append(slime_sample(g, k, prompts[g], resp, logps(rng, len(resp)), float(k % 3 == 0)))
    s = samples[1]                                  # multi-turn: a tool span with loss mask 0, log-prob 0.0
    tool = [17, 18, 19]
    s["tokens"] += tool + [20]
    s["response_length"] += 4
    s["loss_mask"] = [1] * (s["response_length"] - 4) + [0, 0, 0, 1]
    s["rollout_log_probs"] += [0.0, 0.0, 0.0, -0.7]
    samples[2]["remove_sample"] = True
    samples[3]["tokens"] = Tensor(np.array(samples[3]["tokens"], np.int64))
    samples[5]["rollout_routed_experts"] = Tensor(rng.integers(0, 8, (len(samples[5]["tokens"]) - 1, 2, 2)).astype(np.int32))
    samples[6]["metadata"] = {"raw_reward": np.float64(0.5), "turns": {1, 2}}
    if interleave:
        samples.insert(2, samples.pop(6))           # a sample of group 1 among group 0's
    return {"rollout_id": 3, "samples": samples}


def grpo(rewards):
    m, sd = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - m) / (sd + 1e-6) for r in rewards]


@test
def slime_rollout_dump():
    data = slime_rollout()
    path = tmp("rollout_3.pt")
    save_pt(path, data)
    groups, report = imported(import_slime.main, [path], tmp("slime.trace"))
    samples = data["samples"]
    for gi, g in enumerate(groups):
        members = [s for s in samples if s["group_index"] == gi]
        assert len(g["suffixes"]) == len(members) == 4
        for i, s in enumerate(members):
            tok = s["tokens"].storage.tolist() if isinstance(s["tokens"], Tensor) else s["tokens"]
            R = s["response_length"]
            assert g["prefix"].tolist() == tok[:-R] and g["suffixes"][i].tolist() == tok[-R:]
            assert np.allclose(g["old_logp"][i], np.float32(s["rollout_log_probs"]))
            lm = [0] * R if s["remove_sample"] else (s["loss_mask"] or [1] * R)
            assert g["loss_mask"][i].tolist() == lm
        assert np.allclose(g["advantages"], grpo([s["reward"] for s in members]), rtol=1e-6, atol=1e-7)
    assert saved(groups) == 3 * 11 + 3 * 6 and "prefix tokens reuse saves: 51 = " in report
    assert "groups: 2 (by explicit group ids)" in report and "advantages computed from rewards" in report
    replay(tmp("slime.trace"))
    g2, _ = imported(import_slime.main, [path], tmp("slime_mean.trace"), "--advantage", "mean")
    r = [s["reward"] for s in samples if s["group_index"] == 0]
    assert np.allclose(g2[0]["advantages"], np.array(r) - np.mean(r))


def slime_advantages_in_trace_order(groups, samples, adv):
    """adv (one per sample, in sample order) in the order the trace's groups hold the samples."""
    return [[adv[k] for k, s in enumerate(samples) if s["group_index"] == gi] for gi in range(len(groups))]


@test
def slime_normalisation_blocks():
    """slime's rule (rollout.py, _post_process_rewards): blocks of n_samples_per_prompt samples in sample
    order when the rollout holds n_samples_per_prompt * rollout_batch_size, else the whole rollout."""
    data = slime_rollout(interleave=True)
    path = tmp("rollout_5.pt")
    save_pt(path, data)
    samples = data["samples"]
    r = [s["reward"] for s in samples]
    expect_error(import_slime.main, [path], "rollout_5.pt: the groups are not consecutive runs of one size",
                 "--n-samples-per-prompt and --rollout-batch-size")
    for B, want in ((2, grpo(r[:4]) + grpo(r[4:])), (3, grpo(r))):
        groups, report = imported(import_slime.main, [path], tmp(f"slime_b{B}.trace"),
                                  "--n-samples-per-prompt", "4", "--rollout-batch-size", str(B))
        assert [len(g["suffixes"]) for g in groups] == [4, 4]        # the groups are still group_index's
        for g, w in zip(groups, slime_advantages_in_trace_order(groups, samples, want)):
            assert np.allclose(g["advantages"], w, rtol=1e-6, atol=1e-7), (B, g["advantages"], w)
        assert ("blocks of 4" if B == 2 else "one block of all 8") in report
    groups, _ = imported(import_slime.main, [path], tmp("slime_n1.trace"),     # one block, no std at N 1
                         "--n-samples-per-prompt", "1", "--rollout-batch-size", "4")
    for g, w in zip(groups, slime_advantages_in_trace_order(groups, samples, list(np.array(r) - np.mean(r)))):
        assert np.allclose(g["advantages"], w, rtol=1e-6, atol=1e-7), (g["advantages"], w)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "data", "import_slime.py"), path, "-o", tmp("x.trace"),
                        "--vocab-size", str(VOCAB), "--rollout-batch-size", "2"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "go together" in p.stderr, p.stderr


@test
def slime_normalize_advantages():
    """--normalize-advantages: every loss token carries its response's advantage; the result is
    those tokens' values less their mean, over sqrt(their unbiased variance + 1e-8)."""
    data = slime_rollout()
    path = tmp("rollout_6.pt")
    save_pt(path, data)
    samples = data["samples"]
    groups, report = imported(import_slime.main, [path], tmp("slime_w.trace"), "--normalize-advantages")
    a = [x for g in range(2) for x in grpo([s["reward"] for s in samples if s["group_index"] == g])]
    masks = [[0] * s["response_length"] if s["remove_sample"] else (s["loss_mask"] or [1] * s["response_length"])
             for s in samples]
    tokens = np.array([x for x, m in zip(a, masks) for on in m if on])
    want = (np.array(a) - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-8)
    for g, w in zip(groups, slime_advantages_in_trace_order(groups, samples, want)):
        assert np.allclose(g["advantages"], w, rtol=1e-6, atol=1e-7), (g["advantages"], w)
    assert "whitened over the loss tokens" in report
    for s in samples:
        s["remove_sample"] = True
    save_pt(path, data)
    expect_error(import_slime.main, [path], "--normalize-advantages: no token has loss mask 1",
                 extra=["--normalize-advantages"])


@test
def slime_reward_dict_and_no_group_index():
    data = slime_rollout(4)
    for s in data["samples"]:
        s["reward"] = {"acc": s["reward"], "fmt": 1.0}
        s["group_index"] = None
    path = tmp("rollout_4.pt")
    save_pt(path, data)
    expect_error(import_slime.main, [path], "rollout_4.pt: samples[0]: reward: a dict", "--reward-key")
    groups, report = imported(import_slime.main, [path], tmp("slime4.trace"), "--reward-key", "acc")
    assert [len(g["suffixes"]) for g in groups] == [4, 4] and "(by identical prompts)" in report


@test
def slime_bad_input():
    def bad(name, edit):
        data = slime_rollout()
        edit(data["samples"])
        save_pt(tmp(name), data)
        return tmp(name)
    expect_error(import_slime.main, [bad("lm.pt", lambda s: s[3].__setitem__("loss_mask", [1, 1, 1] * 9))],
                 "lm.pt: samples[3]: loss_mask: has 27 entries, expected")
    expect_error(import_slime.main, [bad("lp.pt", lambda s: s[0]["rollout_log_probs"].__setitem__(0, 0.125))],
                 "lp.pt: samples[0]: rollout_log_probs[0] = 0.125 is positive")
    expect_error(import_slime.main, [bad("inf.pt", lambda s: s[0]["rollout_log_probs"].__setitem__(0, -float("inf")))],
                 "inf.pt: samples[0]: rollout_log_probs[0] = -inf is not finite")
    expect_error(import_slime.main, [bad("nolp.pt", lambda s: s[4].pop("rollout_log_probs"))],
                 "nolp.pt: samples[4]: rollout_log_probs: missing")
    expect_error(import_slime.main, [bad("empty.pt", lambda s: s[0].__setitem__("response_length", 0))],
                 "empty.pt: samples[0]: response_length = 0: an empty response")
    expect_error(import_slime.main, [bad("mixed.pt", lambda s: s[5].__setitem__("group_index", None))],
                 "mixed.pt: samples[5]: group id missing")
    expect_error(import_slime.main, [bad("prompt.pt", lambda s: s[3]["tokens"].storage.__setitem__(0, 0))],
                 "prompt.pt: samples[3]:", "tokens: group 0 has a different prompt", "first difference at token 0")
    # --common-prefix: the prompts of group 0 share 0 tokens now, so it still fails, naming the group
    expect_error(import_slime.main, [tmp("prompt.pt")], "share no first token", extra=["--common-prefix"])
    not_pt = tmp("not_a.pt")
    open(not_pt, "wb").write(b"\x80\x02\x8a\x0alegacy torch file")
    expect_error(import_slime.main, [not_pt], "not_a.pt: a torch file in the pre-1.6 format")


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {tmp('pwned')}",))


@test
def pickle_globals_are_refused():
    path = tmp("evil.pt")
    data = slime_rollout()
    data["samples"][0]["metadata"] = {"x": _Evil()}
    save_pt(path, data)
    expect_error(import_slime.main, [path], "evil.pt: data.pkl names the global", "system",
                 "no code from the file is run")
    assert not os.path.exists(tmp("pwned"))
    # the zip layout: data.pkl under any folder name; storages checked against their records
    save_pt(tmp("other.pt"), {"t": Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))}, archive="archive")
    assert ptfile.load_pt(tmp("other.pt"))["t"].tolist() == [[0, 1, 2], [3, 4, 5]]
    with zipfile.ZipFile(tmp("other.pt")) as z, zipfile.ZipFile(tmp("cut.pt"), "w") as w:
        for n in z.namelist():
            w.writestr(n, z.read(n)[:8] if n.endswith("data/0") else z.read(n))
    try:
        ptfile.load_pt(tmp("cut.pt"))
        raise AssertionError("a short storage record was accepted")
    except ptfile.PtError as e:
        assert "8 bytes for 6 elements of FloatStorage" in str(e), e


@test
def pt_tensors_views_and_dtypes():
    base = np.arange(20, dtype=np.int64)
    bf16 = np.array([0x3F80, 0xC000, 0x4049], np.uint16)              # 1, -2, 3.140625
    obj = {"view": Tensor(base, offset=2, size=(3, 2), stride=(1, 5)), "bf16": Tensor(bf16, bf16=True),
           "f16": Tensor(np.array([0.5, -1.0], np.float16)), "bool": Tensor(np.array([True, False])),
           "empty": Tensor(np.zeros((0, 4), np.float32)), "bytes": b"\x00\xff", "set": {1, 2},
           "np": np.arange(3.0), "scalar": np.float32(1.5), "nested": [(1, 2.5, None, "s")]}
    save_pt(tmp("types.pt"), obj)
    o = ptfile.load_pt(tmp("types.pt"))
    assert o["view"].tolist() == [[2, 7], [3, 8], [4, 9]]
    assert o["bf16"].dtype == np.float32 and o["bf16"].tolist() == [1.0, -2.0, 3.140625]
    assert o["f16"].tolist() == [0.5, -1.0] and o["bool"].tolist() == [True, False]
    assert o["empty"].shape == (0, 4) and o["bytes"] == b"\x00\xff" and o["set"] == {1, 2}
    assert o["np"].tolist() == [0.0, 1.0, 2.0] and o["scalar"] == 1.5 and o["nested"] == [(1, 2.5, None, "s")]


# ------------------------------------------------------------------ minimal JSONL

def jl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def jrec(group, prompt, response, adv, rng, ref=True, mask=None):
    r = {"group": group, "prompt_ids": prompt, "response_ids": response, "advantage": adv,
         "old_logprobs": logps(rng, len(response))}
    if ref:
        r["ref_logprobs"] = logps(rng, len(response))
    if mask is not None:
        r["loss_mask"] = mask
    return r


@test
def jsonl_groups_by_id_and_by_prompt():
    rng = np.random.default_rng(5)
    p1, p2 = [1, 2, 3, 4, 5], [9, 8, 7]
    recs = [jrec("u-a", p1, [5, 6, 7], 0.5, rng), jrec("u-b", p2, [1], -1.0, rng, mask=[0]),
            jrec("u-a", p1, [5, 6], -0.5, rng), jrec("u-b", p2, [1, 2, 3, 4], 1.0, rng),
            jrec("u-a", p1, [5, 6, 7, 8], 0.0, rng), "", jrec("u-c", p2, [4, 4], 0.25, rng)]
    path = jl(tmp("rollouts.jsonl"), recs)
    groups, report = imported(import_jsonl.main, [path], tmp("jl.trace"))
    assert [len(g["suffixes"]) for g in groups] == [3, 2, 1]        # order of first appearance, ids kept apart
    assert groups[0]["prefix"].tolist() == p1 and groups[1]["prefix"].tolist() == p2
    assert groups[0]["suffixes"][1].tolist() == [5, 6]               # shared response tokens stay in the suffixes
    assert np.allclose(groups[0]["ref_logp"][2], np.float32(recs[4]["ref_logprobs"]))
    assert groups[1]["loss_mask"][0].tolist() == [0] and groups[1]["loss_mask"][1].tolist() == [1] * 4
    assert np.allclose(groups[1]["advantages"], [-1.0, 1.0])
    assert saved(groups) == 2 * 5 + 1 * 3 and "prefix tokens reuse saves: 13 = " in report
    assert "prefix tree runs (shared prompt prefixes once a step, train --schedule tree --tree-min 1): 8 of the reuse " \
           "schedule's 11 (27.3% fewer)" in report and tree_tokens(groups, [3]) == 8
    replay(tmp("jl.trace"))
    for r in recs:
        if isinstance(r, dict):
            r.pop("group")
    jl(path, recs)
    groups, report = imported(import_jsonl.main, [path, path], tmp("jl2.trace"))
    assert [len(g["suffixes"]) for g in groups] == [3, 3, 3, 3]        # by prompt, each file on its own
    assert "(by identical prompts)" in report
    # prompts that open alike: a system prompt [1, 2, 3] and the questions after it
    recs = [jrec(k, [1, 2, 3] + q, [4, 5], 0.5 - k, rng, ref=False) for k, q in enumerate([[7, 7], [7, 8, 9], [6]])]
    groups, report = imported(import_jsonl.main, [jl(tmp("system.jsonl"), recs)], tmp("system.trace"))
    want = tree_tokens(groups, [3])
    assert want == 3 + 1 + 1 + 2 + 1 and f"prefix tree runs (shared prompt prefixes once a step, train --schedule tree " \
           f"--tree-min 1): {want} of the reuse schedule's 15 (46.7% fewer)" in report, report


@test
def jsonl_common_prefix():
    rng = np.random.default_rng(6)
    recs = [jrec(7, [1, 2, 3, 4], [9, 9], 1.0, rng, ref=False), jrec(7, [1, 2, 5], [8], -1.0, rng, ref=False)]
    path = jl(tmp("differ.jsonl"), recs)
    expect_error(import_jsonl.main, [path], "differ.jsonl: line 2: prompt_ids: group 7 has a different prompt",
                 "first difference at token 2: 5 vs 3", "--common-prefix")
    groups, report = imported(import_jsonl.main, [path], tmp("common.trace"), "--common-prefix")
    g = groups[0]
    assert g["prefix"].tolist() == [1, 2]
    assert g["suffixes"][0].tolist() == [3, 4, 9, 9] and g["loss_mask"][0].tolist() == [0, 0, 1, 1]
    assert g["suffixes"][1].tolist() == [5, 8] and g["old_logp"][1][0] == 0.0
    assert "3 prompt tokens past the common prefix moved into suffixes" in report
    replay(tmp("common.trace"))


@test
def jsonl_bad_input():
    rng = np.random.default_rng(7)

    def one(name, edit, line2=True):
        recs = [jrec("g", [1, 2, 3], [4, 5], 1.0, rng), jrec("g", [1, 2, 3], [6, 7], -1.0, rng)]
        edit(recs[1] if line2 else recs)
        return jl(tmp(name), recs)
    cases = [
        ("missing.jsonl", lambda r: r.pop("old_logprobs"), "missing.jsonl: line 2: old_logprobs: missing"),
        ("long.jsonl", lambda r: r["old_logprobs"].append(-1.0), "long.jsonl: line 2: old_logprobs: has 3 entries, expected 2"),
        ("nan.jsonl", lambda r: r["old_logprobs"].__setitem__(1, float("nan")), "nan.jsonl: line 2: old_logprobs[1] = nan is not finite"),
        ("pos.jsonl", lambda r: r["ref_logprobs"].__setitem__(0, 0.25), "pos.jsonl: line 2: ref_logprobs[0] = 0.25 is positive"),
        ("empty.jsonl", lambda r: (r.__setitem__("response_ids", []), r.__setitem__("old_logprobs", []),
                                   r.__setitem__("ref_logprobs", [])), "empty.jsonl: line 2: response_ids: empty"),
        ("prompt.jsonl", lambda r: r.__setitem__("prompt_ids", [1, 2, 4]), "prompt.jsonl: line 2: prompt_ids: group 'g' has a different prompt"),
        ("vocab.jsonl", lambda r: r["response_ids"].__setitem__(1, 256), "vocab.jsonl: line 2: response_ids[1] = 256 is outside the vocabulary [0, 256)"),
        ("neg.jsonl", lambda r: r["prompt_ids"].__setitem__(0, -1), "neg.jsonl: line 2: prompt_ids[0] = -1 is outside"),
        ("float.jsonl", lambda r: r["prompt_ids"].__setitem__(0, 1.5), "float.jsonl: line 2: prompt_ids[0] = 1.5 is not an integer"),
        ("adv.jsonl", lambda r: r.__setitem__("advantage", "high"), "adv.jsonl: line 2: advantage: must be a number"),
        ("advinf.jsonl", lambda r: r.__setitem__("advantage", float("inf")), "advinf.jsonl: line 2: advantage = inf is not finite"),
        ("mask.jsonl", lambda r: r.__setitem__("loss_mask", [1, 2]), "mask.jsonl: line 2: loss_mask[1] = 2 (must be 0 or 1)"),
        ("typo.jsonl", lambda r: r.__setitem__("old_logprob", [-1.0]), "typo.jsonl: line 2: old_logprob: unknown field"),
        ("nogroup.jsonl", lambda r: r.pop("group"), "line 2: group id missing, but "),
        ("noref.jsonl", lambda r: r.pop("ref_logprobs"), "noref.jsonl: line 2: reference log-probs missing"),
        ("noprompt.jsonl", lambda r: r.__setitem__("prompt_ids", []), "noprompt.jsonl: line 2: prompt_ids: empty"),
    ]
    for name, edit, needle in cases:
        expect_error(import_jsonl.main, [one(name, edit)], needle)
    path = jl(tmp("json.jsonl"), [jrec(None, [1], [2], 0.0, rng), '{"prompt_ids": [1], oops}'])
    expect_error(import_jsonl.main, [path], "json.jsonl: line 2: not valid JSON")
    expect_error(import_jsonl.main, [tmp("no_such.jsonl")], "no_such.jsonl")
    # a failed import leaves an existing output as it was
    out = tmp("kept.trace")
    imported(import_jsonl.main, [one("ok.jsonl", lambda r: None)], out)
    before = open(out, "rb").read()
    rc, _, _ = run_main(import_jsonl.main, [tmp("missing.jsonl"), "-o", out, "--vocab-size", "256"])
    assert rc == 1 and open(out, "rb").read() == before
    # --drop-empty keeps the others; --logp-tolerance accepts rounding above 0
    groups, _ = imported(import_jsonl.main, [tmp("empty.jsonl")], tmp("drop.trace"), "--drop-empty")
    assert len(groups[0]["suffixes"]) == 1
    groups, _ = imported(import_jsonl.main, [one("tiny.jsonl", lambda r: r["old_logprobs"].__setitem__(0, 1e-7))],
                         tmp("tol.trace"), "--logp-tolerance", "1e-6")
    assert groups[0]["old_logp"][1][0] == 0.0


@test
def command_line():
    rng = np.random.default_rng(8)
    path = jl(tmp("cli.jsonl"), [jrec("a", [1, 2, 3], [4], 1.0, rng), jrec("a", [1, 2, 3], [5, 6], -1.0, rng)])
    out = tmp("cli.trace")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "data", "import_jsonl.py"), path, "-o", out,
                        "--vocab-size", "256"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "prefix tokens reuse saves: 3 = " in p.stdout and os.path.exists(out), p.stderr
    p = subprocess.run([sys.executable, os.path.join(ROOT, "data", "import_jsonl.py"), path, "-o", out,
                        "--vocab-size", "4"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.startswith("error: ") and "line 1: prompt_ids" not in p.stderr
    assert "cli.jsonl: line 1: response_ids[0] = 4 is outside the vocabulary [0, 4)" in p.stderr, p.stderr


@test
def trace_readers_refuse_what_no_writer_writes():
    """A context-only group's prefix log-probs other than the writer's zeros, and flags bit 1 with no
    trained prefix token: both would be lost on reading, so prtrace.py and the C reader refuse them alike."""
    import prtrace
    rng = np.random.default_rng(5)

    def group(P, S, trained):
        g = {"prefix": ints(rng, 0, VOCAB, P), "suffixes": [ints(rng, 0, VOCAB, S)], "advantages": np.ones(1, "<f4"),
             "old_logp": [logps(rng, S)], "ref_logp": [logps(rng, S)], "loss_mask": [np.ones(S, np.uint8)]}
        if trained:
            g["prefix_mask"] = np.array([0] + [1] * (P - 1), np.uint8)
            g["prefix_old_logp"], g["prefix_ref_logp"] = logps(rng, P), logps(rng, P)
        return g

    good = tmp("prefix-loss.trace")
    prtrace.write_trace(good, [group(3, 2, True), group(2, 2, False)], VOCAB)
    data = open(good, "rb").read()
    tail0 = len(data) - 18 - (8 + 8 + 8 + 9 * 2 + 4 * 2) - 27   # group 0's prefix arrays: 3 + 12 + 12 bytes
    cases = [("old", len(data) - 12, b"\x00\x00\x80\xbf", "group 1: prefix_old_logp[1] = -1, but the group trains no"),
             ("ref", len(data) - 8, b"\x00\x00\x00\x80", "group 1: prefix_ref_logp[0] = -0, but the group trains no"),
             ("none", tail0, bytes(27), "flags bit 1 (trained prefix tokens) is set, but no group trains a prefix token")]
    for name, at, patch, needle in cases:
        bad = tmp(f"prefix-loss-{name}.trace")
        open(bad, "wb").write(data[:at] + patch + data[at + len(patch):])
        try:
            prtrace.read_trace(bad)
            raise AssertionError(f"{name}: prtrace.py read it")
        except prtrace.TraceError as e:
            assert needle in str(e), f"{name}: {e}"
        if TRAIN is not None:
            p = subprocess.run([TRAIN, "--trace", bad, "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert p.returncode != 0 and needle in p.stdout + p.stderr, f"{name}: the C reader: {p.stdout}{p.stderr}"
    assert len(prtrace.read_trace(good)[0]) == 2


def main():
    global TRAIN
    cands = sys.argv[1:] or [os.path.join(ROOT, "build", "train-float"), os.path.join(ROOT, "train")]
    TRAIN = next((os.path.abspath(c) for c in cands if os.path.isfile(c) and os.access(c, os.X_OK)), None)
    if sys.argv[1:] and TRAIN is None:
        print(f"{sys.argv[1]}: no such program\n0 passed, 1 failed")
        return 1
    print(f"replaying imported traces with {TRAIN}" if TRAIN else "no train binary found: traces not replayed")
    t0, passed, failed = time.time(), 0, 0
    for fn in TESTS:
        try:
            fn()
            passed += 1
            print(f"ok    {fn.__name__}")
        except Exception as e:  # noqa: BLE001 (report every failure and go on)
            failed += 1
            print(f"FAIL  {fn.__name__}: {type(e).__name__}: {e}")
    print(f"({time.time() - t0:.1f} s; temporary files in {TMP})" if failed else f"({time.time() - t0:.1f} s)")
    if not failed:
        import shutil
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
