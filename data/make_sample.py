"""Write data/sample.trace: a small, deterministic GRPO batch for the tiny models (vocab_size 256).

    python data/make_sample.py [OUT]        (default: sample.trace next to this script)

4 prompt groups (P = 96, 64, 120, 48; G = 8, 4, 8, 6), ragged suffixes of 1..40 tokens (at least
one of length 1 and one of length 2), group-normalised 0/1 rewards as advantages, rollout
log-probs around -log(256), reference log-probs near them, and a loss mask that is mostly 1.
The same seed always gives the same bytes.

It then reads the file back with prtrace.read_trace, checks it equals what was generated, and
prints per-group checksums computed from the generated arrays (not from the file). The C test
test/test_trace.c holds a copy of these numbers; regenerate them here if the sample changes.
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prtrace import read_trace, write_trace  # noqa: E402

SEED = 20240601
VOCAB = 256
PREFIX_LENS = [96, 64, 120, 48]
GROUP_SIZES = [8, 4, 8, 6]


def make_groups(rng):
    groups = []
    for k, (P, G) in enumerate(zip(PREFIX_LENS, GROUP_SIZES)):
        lens = rng.integers(1, 41, size=G)
        if k == 0:
            lens[3] = 1          # a one-token suffix: its only token is predicted from the prefix
        if k == 1:
            lens[1] = 2
        rewards = rng.integers(0, 2, size=G).astype(np.float64)
        if np.all(rewards == rewards[0]):
            adv = np.zeros(G)
        else:
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        g = {"prefix": rng.integers(0, VOCAB, size=P), "suffixes": [], "advantages": adv,
             "old_logp": [], "ref_logp": [], "loss_mask": []}
        for S in lens:
            S = int(S)
            old = np.minimum(-math.log(VOCAB) + rng.normal(0.0, 0.3, size=S), -1e-3)
            ref = np.minimum(old + rng.normal(0.0, 0.1, size=S), -1e-3)
            mask = np.ones(S, dtype=np.uint8)
            if S >= 3:
                mask[rng.random(S) < 0.08] = 0       # a few random positions
                if rng.random() < 0.5:
                    mask[-1] = 0                     # e.g. a truncated end-of-sequence token
            g["suffixes"].append(rng.integers(0, VOCAB, size=S))
            g["old_logp"].append(old)
            g["ref_logp"].append(ref)
            g["loss_mask"].append(mask)
        groups.append(g)
    return groups


def fnv1a(h, tokens):
    for t in np.asarray(tokens, dtype=np.int64):
        h = ((h ^ int(t)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def seqsum(values):
    """sum over j of (j+1) * values[j], left to right in double, over the float32 values the file
    stores (each product is exact; the C test sums in the same order, so the result is too)."""
    s = 0.0
    for j, v in enumerate(np.asarray(values, dtype=np.float32).astype(np.float64)):
        s += (j + 1) * float(v)
    return s


def checksums(g):
    h = fnv1a(1469598103934665603, g["prefix"])
    for s in g["suffixes"]:
        h = fnv1a(h, s)
    lens = [len(s) for s in g["suffixes"]]
    return {
        "P": len(g["prefix"]), "G": len(lens), "lens": lens, "hash": h,
        "adv": seqsum(g["advantages"]),
        "old": seqsum(np.concatenate(g["old_logp"])),
        "ref": seqsum(np.concatenate(g["ref_logp"])),
        "masked": int(sum(int(np.sum(m)) for m in g["loss_mask"])),
    }


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                             "sample.trace")
    groups = make_groups(np.random.default_rng(SEED))
    write_trace(out, groups, VOCAB)

    back, vocab = read_trace(out)
    assert vocab == VOCAB and len(back) == len(groups)
    for g, b in zip(groups, back):
        assert np.array_equal(g["prefix"], b["prefix"])
        assert np.array_equal(np.float32(g["advantages"]), b["advantages"])
        for key, dt in (("suffixes", np.int32), ("old_logp", np.float32), ("ref_logp", np.float32),
                        ("loss_mask", np.uint8)):
            assert all(np.array_equal(np.asarray(x).astype(dt), y) for x, y in zip(g[key], b[key])), key

    print(f"wrote {out}: {os.path.getsize(out)} bytes, {len(groups)} groups, vocab_size {VOCAB}")
    print("checksums (token FNV-1a 64 over prefix then suffixes; position-weighted double sums of"
          " advantages, old_logp, ref_logp; masked tokens), as C initialisers for test/test_trace.c:")
    for g in groups:
        c = checksums(g)
        lens = ", ".join(str(n) for n in c["lens"])
        print(f"    {{{c['P']}, {c['G']}, {{{lens}}}, 0x{c['hash']:016x}ULL, {c['adv'].hex()}, "
              f"{c['old'].hex()}, {c['ref'].hex()}, {c['masked']}}},")


if __name__ == "__main__":
    main()
