"""Read and write prefixreuse GRPO traces (format versions 1 and 2, flag bits 0 and 1; data/README.md has the layout).

Python 3.8+ and numpy only.

    from prtrace import write_trace, read_trace
    write_trace("batch.trace", groups, vocab_size)
    groups, vocab_size = read_trace("batch.trace")
    write_trace("steps.trace", groups, vocab_size, steps=[2, 2])   # version 2: steps of 2 groups
    groups, vocab_size, steps = read_trace("steps.trace", steps=True)   # steps None for version 1

A group is a dict:
    prefix      1-D integer array (P,)            prompt tokens, shared by the G suffixes
    suffixes    list of G 1-D integer arrays      sampled completions, S_i tokens each
    advantages  1-D float array (G,)              one advantage per completion
    old_logp    list of G float arrays (S_i,)     rollout-policy log-prob of each suffix token
    ref_logp    list of G float arrays, or None   reference-policy log-probs (all groups or none)
    loss_mask   list of G 0/1 arrays (S_i,)       1 = the token contributes to the loss
Optional, for a multi-turn group that trains a turn inside its prefix (every trajectory shares it):
    prefix_mask      0/1 array (P,), entry 0 is 0  1 = the prefix token is trained in every trajectory
    prefix_old_logp  float array (P,)              its rollout-policy log-prob (with prefix_mask)
    prefix_ref_logp  float array (P,)              its reference log-prob (with prefix_mask and ref_logp)
A prefix_mask of zeros is read back as no prefix_mask.

Both functions check every rule the C reader checks (pr_trace_parse in prefixreuse.h) and raise
TraceError with the file, group, field and value on the first violation. read_trace returns
numpy arrays: int32 tokens, float32 advantages and log-probs, uint8 masks.
Run `python prtrace.py FILE...` to validate files and print a summary.
"""
import os
import struct
import sys

import numpy as np

MAGIC = b"PRTRACE\0"
VERSIONS = (1, 2)            # 2: a step table after the header
FLAG_REF_LOGP = 1
FLAG_PREFIX_LOSS = 2         # every group record ends with prefix_mask, prefix_old_logp[, prefix_ref_logp]
MAX_COUNT = 1 << 24          # limit on P, G and every S_i
INT_MAX = 2**31 - 1          # vocab_size, n_groups and P + max S_i must fit a C int
HEADER = struct.Struct("<8sIIII")


class TraceError(ValueError):
    """A trace (or a batch about to be written) breaks a rule of the format."""


def _count(where, name, n):
    if not 1 <= n <= MAX_COUNT:
        raise TraceError(f"{where}: {name} = {n} (must be 1..{MAX_COUNT})")


def _tokens(where, name, x, vocab_size):
    a = np.asarray(x)
    if a.ndim != 1:
        raise TraceError(f"{where}: {name} must be 1-D, got shape {a.shape}")
    if a.size and not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        raise TraceError(f"{where}: {name} must hold integers, got dtype {a.dtype}")
    a = a.astype(np.int64)
    bad = np.flatnonzero((a < 0) | (a >= vocab_size))
    if bad.size:
        j = int(bad[0])
        raise TraceError(f"{where}: {name}[{j}] = {int(a[j])} is outside the vocabulary [0, {vocab_size})")
    return a.astype("<i4")


def _reals(where, name, x, n, logp):
    a = np.asarray(x)
    if a.ndim != 1 or a.shape[0] != n:
        raise TraceError(f"{where}: {name} must have shape ({n},), got {a.shape}")
    if a.size and not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise TraceError(f"{where}: {name} must hold real numbers, got dtype {a.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        a = a.astype("<f4")                      # what the file stores; 1e39 becomes inf here
        bad = ~np.isfinite(a) | ((a > 0) if logp else False)
    bad = np.flatnonzero(bad)
    if bad.size:
        j = int(bad[0])
        rule = "log-probs must be finite and <= 0" if logp else "must be finite"
        raise TraceError(f"{where}: {name}[{j}] = {a[j]} as float32 ({rule})")
    return a


def _mask(where, name, x, n):
    a = np.asarray(x)
    if a.ndim != 1 or a.shape[0] != n:
        raise TraceError(f"{where}: {name} must have shape ({n},), got {a.shape}")
    if a.size and not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        raise TraceError(f"{where}: {name} must hold 0/1 integers, got dtype {a.dtype}")
    a = a.astype(np.int64)
    bad = np.flatnonzero((a != 0) & (a != 1))
    if bad.size:
        j = int(bad[0])
        raise TraceError(f"{where}: {name}[{j}] = {int(a[j])} (must be 0 or 1)")
    return a.astype(np.uint8)


def _check_group(where, g, vocab_size, has_ref):
    """Validate one group dict; return it with arrays in file dtypes."""
    for key in ("prefix", "suffixes", "advantages", "old_logp", "loss_mask"):
        if key not in g:
            raise TraceError(f"{where}: missing key {key!r}")
    prefix = np.asarray(g["prefix"])
    if prefix.ndim != 1:
        raise TraceError(f"{where}: prefix must be 1-D, got shape {prefix.shape}")
    P = prefix.shape[0]
    _count(where, "P (prefix length)", P)
    prefix = _tokens(where, "prefix_tokens", prefix, vocab_size)
    suffixes = list(g["suffixes"])
    G = len(suffixes)
    _count(where, "G (number of suffixes)", G)
    ref = g.get("ref_logp")
    if (ref is not None) != has_ref:
        raise TraceError(f"{where}: ref_logp is {'given' if ref is not None else 'None'} but group 0 "
                         f"{'has none' if ref is not None else 'has them'} (all groups carry it or none)")
    for key, val in (("old_logp", g["old_logp"]), ("loss_mask", g["loss_mask"]), ("ref_logp", ref)):
        if val is not None and len(val) != G:
            raise TraceError(f"{where}: {key} has {len(val)} entries for {G} suffixes")
    adv = _reals(where, "advantage", g["advantages"], G, logp=False)
    out = {"prefix": prefix, "suffixes": [], "advantages": adv, "old_logp": [],
           "ref_logp": [] if has_ref else None, "loss_mask": []}
    for i, s in enumerate(suffixes):
        w = f"{where}: suffix {i}"
        s = np.asarray(s)
        if s.ndim != 1:
            raise TraceError(f"{w}: tokens must be 1-D, got shape {s.shape}")
        S = s.shape[0]
        _count(w, "suffix_len", S)
        if P + S > INT_MAX:
            raise TraceError(f"{w}: P + S = {P + S} does not fit a C int")
        out["suffixes"].append(_tokens(w, "tokens", s, vocab_size))
        out["old_logp"].append(_reals(w, "old_logp", g["old_logp"][i], S, logp=True))
        if has_ref:
            out["ref_logp"].append(_reals(w, "ref_logp", ref[i], S, logp=True))
        out["loss_mask"].append(_mask(w, "loss_mask", g["loss_mask"][i], S))
    pm = g.get("prefix_mask")
    if pm is None:
        if g.get("prefix_old_logp") is not None or g.get("prefix_ref_logp") is not None:
            raise TraceError(f"{where}: prefix_old_logp or prefix_ref_logp without prefix_mask")
        return out
    pm = _mask(where, "prefix_mask", pm, P)
    if pm[0]:
        raise TraceError(f"{where}: prefix_mask[0] = 1 (the first token has nothing to predict it: must be 0)")
    if g.get("prefix_old_logp") is None or (g.get("prefix_ref_logp") is None) == has_ref:
        raise TraceError(f"{where}: prefix_mask needs prefix_old_logp, and prefix_ref_logp exactly when ref_logp is given")
    if not pm.any():
        return out
    out["prefix_mask"] = pm
    out["prefix_old_logp"] = _reals(where, "prefix_old_logp", g["prefix_old_logp"], P, logp=True)
    if has_ref:
        out["prefix_ref_logp"] = _reals(where, "prefix_ref_logp", g["prefix_ref_logp"], P, logp=True)
    return out


def _check_vocab(where, vocab_size):
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
        raise TraceError(f"{where}: vocab_size must be an integer, got {vocab_size!r}")
    if not 1 <= vocab_size <= INT_MAX:
        raise TraceError(f"{where}: vocab_size = {vocab_size} (must be 1..{INT_MAX})")
    return int(vocab_size)


def _check_steps(where, steps, n_groups):
    """A step table: each step's group count, consecutive groups in file order, covering them all."""
    steps = [int(c) for c in steps]
    if not 1 <= len(steps) <= n_groups:
        raise TraceError(f"{where}: n_steps = {len(steps)} (must be 1..n_groups = {n_groups})")
    covered = 0
    for k, c in enumerate(steps):
        if not 1 <= c <= n_groups - covered:
            raise TraceError(f"{where}: step {k} has {c} groups (every step 1 or more, the steps together exactly "
                             f"n_groups = {n_groups}; {n_groups - covered} left for it)")
        covered += c
    if covered != n_groups:
        raise TraceError(f"{where}: the steps hold {covered} of the {n_groups} groups (they must cover every group once, in order)")
    return steps


def write_trace(path, groups, vocab_size, steps=None):
    """Validate `groups` and write them to `path` atomically (a temporary file, then os.replace).
    steps: None (format version 1), or each optimizer step's number of groups, consecutive groups
    in order, summing to len(groups) (version 2)."""
    path = os.fspath(path)
    vocab_size = _check_vocab(path, vocab_size)
    groups = list(groups)
    if not 1 <= len(groups) <= INT_MAX:
        raise TraceError(f"{path}: n_groups = {len(groups)} (must be >= 1)")
    if steps is not None:
        steps = _check_steps(path, steps, len(groups))
    has_ref = groups[0].get("ref_logp") is not None
    checked = [_check_group(f"{path}: group {k}", g, vocab_size, has_ref) for k, g in enumerate(groups)]

    prefix_loss = any("prefix_mask" in g for g in checked)
    flags = (FLAG_REF_LOGP if has_ref else 0) | (FLAG_PREFIX_LOSS if prefix_loss else 0)
    parts = [HEADER.pack(MAGIC, 1 if steps is None else 2, flags, len(checked), vocab_size)]
    if steps is not None:
        parts.append(np.array([len(steps)] + steps, dtype="<u4").tobytes())
    for g in checked:
        parts.append(struct.pack("<II", g["prefix"].shape[0], len(g["suffixes"])))
        parts.append(g["prefix"].tobytes())
        parts.append(np.array([s.shape[0] for s in g["suffixes"]], dtype="<u4").tobytes())
        parts.append(g["advantages"].tobytes())
        for i, s in enumerate(g["suffixes"]):
            parts.append(s.tobytes())
            parts.append(g["old_logp"][i].tobytes())
            if has_ref:
                parts.append(g["ref_logp"][i].tobytes())
            parts.append(g["loss_mask"][i].tobytes())
        if prefix_loss:
            P = g["prefix"].shape[0]
            zeros = np.zeros(P, dtype="<f4")
            parts.append(g.get("prefix_mask", np.zeros(P, dtype=np.uint8)).tobytes())
            parts.append(g.get("prefix_old_logp", zeros).tobytes())
            if has_ref:
                parts.append(g.get("prefix_ref_logp", zeros).tobytes())

    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class _Reader:
    def __init__(self, path, data):
        self.path, self.data, self.pos = path, data, 0

    def take(self, n, dtype, what):
        nbytes = n * np.dtype(dtype).itemsize
        if len(self.data) - self.pos < nbytes:
            raise TraceError(f"{self.path}: truncated: {what} needs {nbytes} bytes at offset {self.pos}, "
                             f"{len(self.data) - self.pos} left")
        a = np.frombuffer(self.data, dtype=dtype, count=n, offset=self.pos)
        self.pos += nbytes
        return a


def read_trace(path, steps=False):
    """Read and validate a trace; return (groups, vocab_size) in the form write_trace takes, or with
    steps=True (groups, vocab_size, steps), steps None for a version-1 file."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER.size:
        raise TraceError(f"{path}: {len(data)} bytes, too short for the {HEADER.size}-byte header")
    magic, version, flags, n_groups, vocab_size = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise TraceError(f"{path}: not a prefixreuse trace (bad magic {magic!r})")
    if version not in VERSIONS:
        raise TraceError(f"{path}: format version {version} is not supported (this reader knows versions 1 and 2)")
    known = FLAG_REF_LOGP | FLAG_PREFIX_LOSS
    if flags & ~known:
        raise TraceError(f"{path}: unknown flag bits 0x{flags & ~known:x} in flags 0x{flags:x}")
    if not 1 <= n_groups <= INT_MAX:
        raise TraceError(f"{path}: n_groups = {n_groups} (must be 1..{INT_MAX})")
    vocab_size = _check_vocab(path, vocab_size)
    has_ref = bool(flags & FLAG_REF_LOGP)
    prefix_loss = bool(flags & FLAG_PREFIX_LOSS)

    r = _Reader(path, data)
    r.pos = HEADER.size
    table = None
    if version == 2:
        n_steps = int(r.take(1, "<u4", "the step table's n_steps")[0])
        if not 1 <= n_steps <= n_groups:
            raise TraceError(f"{path}: n_steps = {n_steps} (must be 1..n_groups = {n_groups})")
        table = _check_steps(path, r.take(n_steps, "<u4", f"the step table's {n_steps} group counts"), n_groups)
    groups = []
    for k in range(n_groups):
        where = f"{path}: group {k}"
        P, G = (int(v) for v in r.take(2, "<u4", f"{where} P and G"))
        _count(where, "P (prefix length)", P)
        _count(where, "G (number of suffixes)", G)
        prefix = r.take(P, "<i4", f"{where} prefix_tokens")
        lens = r.take(G, "<u4", f"{where} suffix_len")
        for i, S in enumerate(lens):
            _count(where, f"suffix_len[{i}]", int(S))
        adv = r.take(G, "<f4", f"{where} advantage")
        g = {"prefix": prefix, "suffixes": [], "advantages": adv, "old_logp": [],
             "ref_logp": [] if has_ref else None, "loss_mask": []}
        for i, S in enumerate(int(s) for s in lens):
            w = f"{where} suffix {i}"
            g["suffixes"].append(r.take(S, "<i4", f"{w} tokens"))
            g["old_logp"].append(r.take(S, "<f4", f"{w} old_logp"))
            if has_ref:
                g["ref_logp"].append(r.take(S, "<f4", f"{w} ref_logp"))
            g["loss_mask"].append(r.take(S, "u1", f"{w} loss_mask"))
        if prefix_loss:
            g["prefix_mask"] = r.take(P, "u1", f"{where} prefix_mask")
            g["prefix_old_logp"] = r.take(P, "<f4", f"{where} prefix_old_logp")
            if has_ref:
                g["prefix_ref_logp"] = r.take(P, "<f4", f"{where} prefix_ref_logp")
        groups.append(_check_group(where, g, vocab_size, has_ref))
        if prefix_loss and "prefix_mask" not in groups[-1]:
            # a context-only group: the writer's zeros, since reading drops them (-0.0 is not zero here)
            for name in ("prefix_old_logp", "prefix_ref_logp") if has_ref else ("prefix_old_logp",):
                bad = np.flatnonzero(g[name].view("<u4"))
                if bad.size:
                    j = int(bad[0])
                    raise TraceError(f"{where}: {name}[{j}] = {float(g[name][j]):g}, but the group trains no prefix token "
                                     "(a writer puts 0 there)")
    if r.pos != len(data):
        raise TraceError(f"{path}: {len(data) - r.pos} trailing bytes after the last group (offset {r.pos})")
    if prefix_loss and not any("prefix_mask" in g for g in groups):
        raise TraceError(f"{path}: flags bit 1 (trained prefix tokens) is set, but no group trains a prefix token "
                         "(a writer sets it only when one does)")
    return (groups, vocab_size, table) if steps else (groups, vocab_size)


def summary(groups, vocab_size, steps=None):
    lines = [f"vocab_size {vocab_size}, {len(groups)} groups, "
             f"reference log-probs: {'yes' if groups[0]['ref_logp'] is not None else 'no'}, "
             f"steps: {'none (version 1)' if steps is None else f'{len(steps)} of {steps} groups'}"]
    for k, g in enumerate(groups):
        lens = [s.shape[0] for s in g["suffixes"]]
        masked = sum(int(m.sum()) for m in g["loss_mask"])
        trained = f", trained prefix tokens {int(g['prefix_mask'].sum())}" if "prefix_mask" in g else ""
        lines.append(f"group {k}: P={g['prefix'].shape[0]} G={len(lens)} suffix_len={lens} "
                     f"masked tokens {masked}/{sum(lens)}{trained}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python prtrace.py FILE...   (validate traces and print a summary)")
    status = 0
    for p in sys.argv[1:]:
        try:
            print(summary(*read_trace(p, steps=True)))
        except (OSError, TraceError) as e:
            print(f"error: {e}", file=sys.stderr)
            status = 1
    sys.exit(status)
