"""Shared part of the importers (import_nemo_rl.py, import_slime.py, import_jsonl.py): checking the
fields of one trajectory, forming prompt groups, the report, and the
command line. Python 3.8+ and numpy only; data/README.md ("Importing from RL frameworks") has the rules.

An importer turns each trajectory of its input into a Traj: the prompt tokens, the response
tokens and, per response token, the rollout log-prob, optionally the reference log-prob, and a
0/1 loss mask, plus one advantage (or a reward to compute it from). build() then forms the groups:

- by an explicit group id where the source has one (the importer sets Traj.key), else by
  identical prompt tokens: trajectories whose prompts are equal token for token form one group;
- a group's prefix is its prompt. The prefix never reaches into the responses, even when all G
  responses begin with the same tokens: every response token carries its own log-prob, mask and
  loss, and a prefix token carries none, so the prefix stops where the prompt stops;
- with an explicit id, the prompts of a group must be equal; with --common-prefix the prefix is
  their longest common prefix (at least 1 token) and the rest of each prompt opens that
  trajectory's suffix with loss mask 0 and log-prob 0 (attended to, never trained);
- groups never span input files (nor two optimizer steps an importer cuts a file into), and keep the order in which their first trajectory appears.

Errors are InputError (a ValueError) whose message names the file, the line or record, and the
field. Nothing is written until every input has been read and checked; prtrace.write_trace
then writes the trace atomically (a temporary file and os.replace).
"""
import argparse
import itertools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prtrace  # noqa: E402  (data/prtrace.py, beside this file)

MAX_VOCAB = prtrace.INT_MAX


class InputError(ValueError):
    """Bad input: the message names the file, the line or record, and the field."""


class Traj:
    """One trajectory as read from the source.

    where       "FILE: line N" or "FILE: samples[K]", for messages
    scope       where its group may be: the input file's index, or (file, step) where an importer cuts
                a file into optimizer steps; groups never span two scopes
    key         explicit group id (hashable), or None to group by identical prompt
    prompt      int64 (P,) tokens; response int64 (S,) tokens (S may be 0 only with drop_empty)
    old_logp, ref_logp (or None), loss_mask: (S,) arrays
    advantage   float; an importer whose source holds rewards instead (slime) sets it from `reward`
                before build()
    """
    __slots__ = ("where", "scope", "key", "prompt", "response", "old_logp", "ref_logp",
                 "loss_mask", "advantage", "reward")

    def __init__(self, where, scope, key, prompt, response, old_logp, ref_logp, loss_mask,
                 advantage=None, reward=None):
        self.where, self.scope, self.key = where, scope, key
        self.prompt, self.response = prompt, response
        self.old_logp, self.ref_logp, self.loss_mask = old_logp, ref_logp, loss_mask
        self.advantage, self.reward = advantage, reward


# ---------------------------------------------------------------- field checks

def jsonl_records(path):
    """(where, record) for each non-blank line of a JSON-lines file; a line that is not a JSON
    object is an InputError naming the file and line."""
    with open(path, "r", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            where = f"{path}: line {n}"
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise InputError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            yield where, rec


def _array(where, field, value, what):
    try:
        a = np.asarray(value)
    except (ValueError, TypeError):
        raise InputError(f"{where}: {field}: must be {what}") from None
    if a.ndim != 1:
        if a.ndim == 0:
            raise InputError(f"{where}: {field}: must be {what}, got {type(value).__name__} {value!r:.40}")
        raise InputError(f"{where}: {field}: must be {what}, got an array of shape {a.shape}")
    return a


def tokens(where, field, value, vocab_size, n=None):
    """A 1-D list/array of token ids in [0, vocab_size) (of length n if given); int64 array."""
    a = _array(where, field, value, "a list of token ids")
    if a.size == 0:
        a = a.astype(np.int64)
    elif a.dtype.kind not in "iu":
        bad = next((j for j, x in enumerate(a.tolist()) if isinstance(x, bool) or not isinstance(x, int)), 0)
        raise InputError(f"{where}: {field}[{bad}] = {a.tolist()[bad]!r} is not an integer token id")
    if n is not None and a.shape[0] != n:
        raise InputError(f"{where}: {field}: has {a.shape[0]} entries, expected {n}")
    a = a.astype(np.int64)
    out = np.flatnonzero((a < 0) | (a >= vocab_size))
    if out.size:
        j = int(out[0])
        raise InputError(f"{where}: {field}[{j}] = {int(a[j])} is outside the vocabulary [0, {vocab_size}) "
                         f"(--vocab-size)")
    return a


def reals(where, field, value, n, logp, logp_tolerance=0.0):
    """A 1-D list/array of n real numbers, finite; log-probs also <= 0 once stored as float32.
    Log-probs in (0, logp_tolerance] are taken as 0 (rounding in the trainer's own arithmetic)."""
    a = _array(where, field, value, f"a list of {n} numbers")
    if a.shape[0] != n:
        raise InputError(f"{where}: {field}: has {a.shape[0]} entries, expected {n}")
    if a.size and (a.dtype.kind not in "iuf"):
        bad = next((j for j, x in enumerate(a.tolist())
                    if isinstance(x, bool) or not isinstance(x, (int, float))), 0)
        raise InputError(f"{where}: {field}[{bad}] = {a.tolist()[bad]!r} is not a number")
    with np.errstate(over="ignore", invalid="ignore"):
        a = a.astype(np.float64)
        f32 = a.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(f32))
    if bad.size:
        j = int(bad[0])
        raise InputError(f"{where}: {field}[{j}] = {float(a[j])!r} is not finite" +
                         (" as float32" if np.isfinite(a[j]) else ""))
    if logp:
        if logp_tolerance > 0:
            a = np.where((f32 > 0) & (a <= logp_tolerance), 0.0, a)
            f32 = a.astype(np.float32)
        bad = np.flatnonzero(f32 > 0)
        if bad.size:
            j = int(bad[0])
            raise InputError(f"{where}: {field}[{j}] = {float(a[j])!r} is positive (log-probs must be <= 0; "
                             f"--logp-tolerance accepts small rounding errors)")
    return a


def mask(where, field, value, n):
    """A 1-D list/array of n values that are each 0 or 1 (ints, bools or 0.0/1.0); uint8 array."""
    a = _array(where, field, value, f"a list of {n} values 0 or 1")
    if a.shape[0] != n:
        raise InputError(f"{where}: {field}: has {a.shape[0]} entries, expected {n}")
    if a.size and a.dtype.kind not in "biuf":
        raise InputError(f"{where}: {field}: must hold 0 or 1, got {a.tolist()[0]!r}")
    bad = np.flatnonzero((a != 0) & (a != 1))
    if bad.size:
        j = int(bad[0])
        raise InputError(f"{where}: {field}[{j}] = {a.tolist()[j]!r} (must be 0 or 1)")
    return a.astype(np.uint8)


def real(where, field, value):
    """One finite real number (int or float, not bool)."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: {field}: must be a number, got {value!r:.60}")
    v = float(value)
    if not np.isfinite(v) or not np.isfinite(np.float32(v)):
        raise InputError(f"{where}: {field} = {value!r} is not finite")
    return v


def integer(where, field, value, lo=None):
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: {field}: must be an integer, got {value!r:.60}")
    if lo is not None and value < lo:
        raise InputError(f"{where}: {field} = {value} (must be >= {lo})")
    return value


def require(where, record, field, what=""):
    if field not in record:
        raise InputError(f"{where}: {field}: missing{what}")
    return record[field]


# ---------------------------------------------------------------- grouping

def group_trajs(trajs):
    """[(key, [Traj...])] in order of first appearance: by Traj.key where every trajectory has one,
    by identical prompt tokens where none has; keys are scoped to their Traj.scope."""
    if not trajs:
        return []
    with_id = [t for t in trajs if t.key is not None]
    if with_id and len(with_id) != len(trajs):
        a = with_id[0]
        b = next(t for t in trajs if t.key is None)
        raise InputError(f"{b.where}: group id missing, but {a.where} has one (give every trajectory a "
                         f"group id, or none)")
    buckets = {}
    for t in trajs:
        k = (t.scope, t.key) if with_id else (t.scope, t.prompt.shape[0], t.prompt.tobytes())
        buckets.setdefault(k, []).append(t)
    return [(k[1] if with_id else None, v) for k, v in buckets.items()]


def _lcp(a, b):
    n = min(a.shape[0], b.shape[0])
    d = np.flatnonzero(a[:n] != b[:n])
    return int(d[0]) if d.size else n


def build(trajs, prompt_field, common_prefix=False):
    """Form the trace's groups from checked trajectories, each with its advantage. Trajectories
    with an empty response are dropped here (the importers only let them through with
    --drop-empty, after any advantages computed from rewards, which count them as the trainer
    did). Returns (groups for prtrace.write_trace, report)."""
    buckets = group_trajs(trajs)
    has_ref = trajs[0].ref_logp is not None if trajs else False
    for t in trajs:
        if (t.ref_logp is not None) != has_ref:
            first = trajs[0]
            raise InputError(f"{t.where}: reference log-probs {'present' if t.ref_logp is not None else 'missing'}"
                             f", but {'absent' if t.ref_logp is not None else 'present'} at {first.where} "
                             f"(all trajectories carry them or none)")
    groups, scopes, dropped, all_empty, trimmed = [], [], 0, 0, 0
    for key, members in buckets:
        kept = [t for t in members if t.response.shape[0] > 0]
        dropped += len(members) - len(kept)
        if not kept:
            all_empty += 1
            continue
        first = kept[0]
        P = first.prompt.shape[0]
        for t in kept[1:]:
            n = _lcp(first.prompt, t.prompt)
            if n == first.prompt.shape[0] == t.prompt.shape[0]:
                continue
            if not common_prefix:
                a = first.prompt[n] if n < first.prompt.shape[0] else "(end)"
                b = t.prompt[n] if n < t.prompt.shape[0] else "(end)"
                raise InputError(
                    f"{t.where}: {prompt_field}: group {key!r} has a different prompt at {first.where} "
                    f"(lengths {t.prompt.shape[0]} and {first.prompt.shape[0]}, first difference at token {n}: "
                    f"{b} vs {a}); a group's trajectories must share their prompt (--common-prefix: "
                    f"use the longest common prefix)")
            P = min(P, n)
        if P == 0:
            raise InputError(f"{first.where}: {prompt_field}: group {key!r}: its prompts share no first token, "
                             f"so there is no prefix to reuse")
        g = {"prefix": first.prompt[:P], "suffixes": [], "advantages": [], "old_logp": [],
             "ref_logp": [] if has_ref else None, "loss_mask": []}
        for t in kept:
            tail = t.prompt[P:]
            k = tail.shape[0]
            trimmed += k
            z = np.zeros(k)
            g["suffixes"].append(np.concatenate([tail, t.response]))
            g["advantages"].append(t.advantage)
            g["old_logp"].append(np.concatenate([z, t.old_logp]))
            if has_ref:
                g["ref_logp"].append(np.concatenate([z, t.ref_logp]))
            g["loss_mask"].append(np.concatenate([np.zeros(k, np.uint8), t.loss_mask]))
        groups.append(g)
        scopes.append(first.scope)
    if not groups:
        raise InputError("no trajectory with a non-empty response: nothing to write")
    report = _report(groups, trajs, dropped, all_empty, trimmed, explicit=trajs[0].key is not None)
    report["group_scopes"] = scopes    # each group's scope, in the order the groups come
    return groups, report


# ---------------------------------------------------------------- report

def _stats(xs):
    xs = np.asarray(xs)
    return {"min": int(xs.min()), "mean": float(xs.mean()), "max": int(xs.max())}


def _report(groups, trajs, dropped, all_empty, trimmed, explicit):
    G = [len(g["suffixes"]) for g in groups]
    P = [g["prefix"].shape[0] for g in groups]
    S = [s.shape[0] for g in groups for s in g["suffixes"]]
    trained = sum(int(m.sum()) for g in groups for m in g["loss_mask"])
    baseline = sum(Gi * Pi for Gi, Pi in zip(G, P)) + sum(S)
    saved = sum((Gi - 1) * Pi for Gi, Pi in zip(G, P))
    return {
        "trajectories": len(trajs), "dropped_empty": dropped, "groups_all_empty": all_empty,
        "grouping": "explicit group ids" if explicit else "identical prompts",
        "groups": len(groups), "G": G, "P": P, "suffix_tokens": sum(S), "trained_tokens": trained,
        "prompt_tokens_moved_to_suffix": trimmed,
        "G_stats": _stats(G), "P_stats": _stats(P), "S_stats": _stats(S),
        "baseline_tokens": baseline, "reuse_tokens": baseline - saved, "saved_prefix_tokens": saved,
        "ref_logp": groups[0]["ref_logp"] is not None, "notes": [],
    }


def tree_prefix_tokens(groups, steps=None):
    """Prefix tokens a prefix tree runs (train --schedule tree --tree-min 1): each step's prompts
    merged by common token prefixes, every distinct prefix position once. Sorted, a prompt adds its
    length less its common prefix with the one before it. steps None: all groups are one step."""
    total, at = 0, 0
    for n in steps or [len(groups)]:
        prompts = sorted(tuple(int(t) for t in g["prefix"]) for g in groups[at:at + n])
        prev = ()
        for p in prompts:
            common = 0
            while common < min(len(p), len(prev)) and p[common] == prev[common]:
                common += 1
            total += len(p) - common
            prev = p
        at += n
    return total


def format_report(r):
    def st(s, unit=""):
        return f"min {s['min']}, mean {s['mean']:.1f}, max {s['max']}{unit}"
    lines = [f"trajectories: {r['trajectories']}" +
             (f" ({r['dropped_empty']} with an empty response dropped"
              + (f", {r['groups_all_empty']} groups left empty" if r['groups_all_empty'] else "") + ")"
              if r["dropped_empty"] else ""),
             f"groups: {r['groups']} (by {r['grouping']})"
             + (f"; {len(r['steps'])} step{'s' if len(r['steps']) > 1 else ''}, one per {r['steps_of']}, of "
                f"{', '.join(map(str, r['steps']))} groups" if r.get("steps") else ""),
             f"G per group: {st(r['G_stats'])}",
             f"prefix length P: {st(r['P_stats'], ' tokens')}",
             f"suffix length S: {st(r['S_stats'], ' tokens')}; {r['trained_tokens']} of "
             f"{r['suffix_tokens']} suffix tokens have loss mask 1"]
    if r["prompt_tokens_moved_to_suffix"]:
        lines.append(f"--common-prefix: {r['prompt_tokens_moved_to_suffix']} prompt tokens past the common "
                     f"prefix moved into suffixes (loss mask 0)")
    pct = 100.0 * r["saved_prefix_tokens"] / r["baseline_tokens"]
    lines += [f"tokens run forward+backward: baseline {r['baseline_tokens']} (G*P + sum S per group), "
              f"reuse {r['reuse_tokens']} (P + sum S)",
              f"prefix tokens reuse saves: {r['saved_prefix_tokens']} = sum over groups of (G-1)*P "
              f"({pct:.1f}% of the baseline's tokens)"]
    if "tree_prefix_tokens" in r:
        reuse = sum(r["P"])
        lines.append(f"prefix tokens a prefix tree runs (shared prompt prefixes once a step, train --schedule tree "
                     f"--tree-min 1): {r['tree_prefix_tokens']} of the reuse schedule's {reuse} "
                     f"({100.0 * (reuse - r['tree_prefix_tokens']) / reuse:.1f}% fewer)")
    lines.append(f"reference log-probs: {'yes' if r['ref_logp'] else 'no'}")
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


# ---------------------------------------------------------------- command line

def parser(prog, description):
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="input files, read in the order given")
    p.add_argument("-o", "--output", required=True, metavar="OUT.trace", help="trace to write (atomically)")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="the model's vocabulary size; every token id must be < N")
    p.add_argument("--common-prefix", action="store_true",
                   help="a group whose prompts differ gets their longest common prefix as its prefix "
                        "(default: an error)")
    p.add_argument("--drop-empty", action="store_true",
                   help="drop trajectories with an empty response (default: an error)")
    p.add_argument("--logp-tolerance", type=float, default=0.0, metavar="X",
                   help="take log-probs in (0, X] as 0 (default 0: any positive log-prob is an error)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    return p


def run(args, read, prompt_field, notes=(), steps_of=None):
    """Read every input with read(path, file_index) -> [Traj], build the groups, write the trace,
    print the report. steps_of, when set, names what a Traj.scope is ("input file", ...): each
    scope is one optimizer step (a version-2 trace whose step table holds each scope's groups);
    otherwise a version-1 trace. Returns the process
    exit status (0, or 1 after printing the error)."""
    try:
        if not 1 <= args.vocab_size <= MAX_VOCAB:
            raise InputError(f"--vocab-size {args.vocab_size}: must be 1..{MAX_VOCAB}")
        trajs = []
        for i, path in enumerate(args.inputs):
            trajs.extend(read(path, i))
        if not trajs:
            raise InputError(f"{', '.join(args.inputs)}: no trajectories")
        groups, report = build(trajs, prompt_field, args.common_prefix)
        report["notes"].extend(notes)
        steps = None
        if steps_of:           # groups come scope by scope, in input order
            steps = [len(list(same)) for _, same in itertools.groupby(report["group_scopes"])]
            report["steps"], report["steps_of"] = steps, steps_of
        report["tree_prefix_tokens"] = tree_prefix_tokens(groups, steps)
        prtrace.write_trace(args.output, groups, args.vocab_size, steps=steps)
    except (InputError, prtrace.TraceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"read {len(args.inputs)} file{'s' if len(args.inputs) > 1 else ''}: {', '.join(args.inputs)}")
        print(format_report(report))
        print(f"wrote {args.output} ({os.path.getsize(args.output)} bytes)")
    return 0
