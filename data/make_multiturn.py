"""Write data/multiturn.trace: a small multi-turn GRPO batch for the tiny models (vocab_size 256).

    python data/make_multiturn.py [OUT]        (default: multiturn.trace next to this script)

Two optimizer steps of four groups. Every prompt of a step opens with the step's system prompt
(context only). Three groups of each step go on with a trained first assistant turn and a tool's
output (context only): two of them share that turn and branch after it into their G completions;
one of those shares it with a fourth group that goes on with a second trained turn and a second
tool output before branching. The last group is a plain question. So a step's prefix tree has a
shared root, a shared trained node under it, and a node below that with trained tokens of its
own: every trained prefix token (prefix_mask) is trained once per trajectory below it.
The same seed always gives the same bytes.
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prtrace import read_trace, write_trace  # noqa: E402

SEED = 20261124
VOCAB = 256
SYSTEM, TURN, TOOL, QUESTION = 40, 12, 8, 16


def logps(rng, n):
    return np.minimum(-math.log(VOCAB) + rng.normal(0.0, 0.3, size=n), -1e-3)


def group(rng, segments, trained, G):
    """A group whose prefix is the segments joined; trained[k] says whether segment k is a turn."""
    prefix = np.concatenate([s["tokens"] for s in segments])
    mask = np.concatenate([np.full(len(s["tokens"]), int(t), dtype=np.uint8) for s, t in zip(segments, trained)])
    lens = rng.integers(1, 25, size=G)
    rewards = rng.integers(0, 2, size=G).astype(np.float64)
    adv = np.zeros(G) if np.all(rewards == rewards[0]) else (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    g = {"prefix": prefix, "suffixes": [], "advantages": adv, "old_logp": [], "ref_logp": [], "loss_mask": []}
    if mask.any():
        g["prefix_mask"] = mask
        g["prefix_old_logp"] = np.concatenate([s["old"] for s in segments])
        g["prefix_ref_logp"] = np.concatenate([s["ref"] for s in segments])
    for S in (int(s) for s in lens):
        old = logps(rng, S)
        g["suffixes"].append(rng.integers(0, VOCAB, size=S))
        g["old_logp"].append(old)
        g["ref_logp"].append(np.minimum(old + rng.normal(0.0, 0.1, size=S), -1e-3))
        g["loss_mask"].append(np.ones(S, dtype=np.uint8))
    return g


def segment(rng, n):
    """n tokens with their log-probs: shared segments carry the same values in every group."""
    old = logps(rng, n)
    return {"tokens": rng.integers(0, VOCAB, size=n), "old": old,
            "ref": np.minimum(old + rng.normal(0.0, 0.1, size=n), -1e-3)}


def make_groups(rng):
    groups = []
    for _ in range(2):
        system, turn1, tool1, turn2, tool2 = (segment(rng, n) for n in (SYSTEM, TURN, TOOL, TURN, TOOL))
        own_turn, own_tool, question = segment(rng, TURN), segment(rng, TOOL), segment(rng, QUESTION)
        groups += [group(rng, [system, turn1, tool1], [0, 1, 0], 4),
                   group(rng, [system, turn1, tool1, turn2, tool2], [0, 1, 0, 1, 0], 4),
                   group(rng, [system, own_turn, own_tool], [0, 1, 0], 4),
                   group(rng, [system, question], [0, 0], 4)]
    return groups


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiturn.trace")
    groups = make_groups(np.random.default_rng(SEED))
    write_trace(out, groups, VOCAB, steps=[4, 4])
    back, vocab, steps = read_trace(out, steps=True)
    assert vocab == VOCAB and steps == [4, 4] and len(back) == len(groups)
    for g, b in zip(groups, back):
        assert np.array_equal(g["prefix"], b["prefix"])
        assert ("prefix_mask" in g) == ("prefix_mask" in b)
        if "prefix_mask" in g:
            assert np.array_equal(g["prefix_mask"], b["prefix_mask"])
    trained = sum(int(g["prefix_mask"].sum()) * len(g["suffixes"]) for g in groups if "prefix_mask" in g)
    print(f"wrote {out}: {len(groups)} groups in 2 steps, {trained} trained prefix tokens over all trajectories")


if __name__ == "__main__":
    main()
