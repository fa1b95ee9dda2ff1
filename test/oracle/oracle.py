#!/usr/bin/env python3
"""Independent float64 reference ("oracle") for the GRPO loss of one prompt group.

It draws a tiny model's weights from a fixed numpy seed, runs Hugging Face's own
LlamaForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM (eager attention, float64) on every
trajectory (prefix ++ suffix_i) of one group of a PRTRACE file, computes the
GRPO loss, the per-token log-probs and d loss / d parameter with torch
autograd, and writes everything to a safetensors file that the C test compares
against.  The C test itself needs no Python.

Install (CPU is enough; any recent torch/transformers should do, the files in
test/ were made with torch 2.15.0 / transformers 5.23.0 / safetensors 0.8.0 /
numpy 2.4.6, see test/oracle/README.md):

    python3 -m venv /tmp/oracle-venv
    /tmp/oracle-venv/bin/pip install torch transformers safetensors numpy

Regenerate both reference files (run from the repository root):

    /tmp/oracle-venv/bin/python test/oracle/oracle.py \
        --config model/tiny/config.json --norm token-mean \
        --seed 1001 --out test/ref_tiny.safetensors
    /tmp/oracle-venv/bin/python test/oracle/oracle.py \
        --config model/tiny-qwen3/config.json --norm seq-mean-token-mean \
        --seed 1002 --out test/ref_tiny-qwen3.safetensors --embed-std 0.125
    /tmp/oracle-venv/bin/python test/oracle/oracle.py \
        --config model/tiny-moe/config.json --norm token-mean \
        --seed 1003 --out test/ref_tiny-moe.safetensors --embed-std 0.125

For the MoE model the loss also holds router_aux_loss_coef times the load-balancing loss over the
whole group (all G trajectories' routing, every layer pooled, as HF's load_balancing_loss_func
computes it for one batch): the C side's group scope. It is computed here in float64 from HF's
router logits (HF's own function sums in float32; the script prints how close the two are).

(--trace defaults to data/sample.trace, --group to 0, --embed-std to 0.5; see README.md for
why the Qwen3 file's loss is ~7.5e11 with 0.5 and what --embed-std 0.125 gives.)

About float64: HF's modeling code hard-codes float32 in three places (RMSNorm
upcast `.to(torch.float32)`, eager softmax `dtype=torch.float32`, and the RoPE
angles `dtype=torch.float`).  On a float64 model those would *down*-cast to
float32, so the modeling modules' global name `torch` is pointed at a proxy
whose `float32` / `float` are float64 (everything else is the real torch).
The model code itself is run unchanged.  The script prints how far the
unpatched model is from the patched one (float32-level, ~1e-6) and how far
the patched one is from an independent numpy float64 forward (~1e-13).
"""

import argparse
import json
import os
import sys
import types

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04
NORMS = ("token-mean", "seq-mean-token-mean")


# --------------------------------------------------------------------------
# PRTRACE reader (own, minimal)
# --------------------------------------------------------------------------
def read_trace(path, want_group):
    buf = open(path, "rb").read()
    off = 0

    def take(dtype, n):
        nonlocal off
        a = np.frombuffer(buf, dtype=dtype, count=n, offset=off)
        off += a.nbytes
        return a.copy()

    if buf[:8] != b"PRTRACE\0":
        raise ValueError(f"{path}: bad magic {buf[:8]!r}")
    off = 8
    version, flags, n_groups, vocab = (int(x) for x in take("<u4", 4))
    if version != 1:
        raise ValueError(f"{path}: version {version} != 1")
    has_ref = bool(flags & 1)
    if not 0 <= want_group < n_groups:
        raise ValueError(f"{path}: group {want_group} not in [0,{n_groups})")
    for g in range(n_groups):
        P, G = (int(x) for x in take("<u4", 2))
        prefix = take("<i4", P)
        slen = take("<u4", G).astype(np.int64)
        adv = take("<f4", G)
        sufs = []
        for i in range(G):
            S = int(slen[i])
            tok = take("<i4", S)
            old = take("<f4", S)
            ref = take("<f4", S) if has_ref else None
            mask = take("u1", S)
            sufs.append(dict(tokens=tok, old=old, ref=ref, mask=mask))
        if g == want_group:
            grp = dict(prefix=prefix, adv=adv, suffixes=sufs)
    if off != len(buf):
        raise ValueError(f"{path}: {len(buf) - off} trailing bytes")
    return dict(version=version, flags=flags, n_groups=n_groups, vocab=vocab, has_ref=has_ref), grp


# --------------------------------------------------------------------------
# Weights: HF names, float32 values drawn from default_rng(seed)
# --------------------------------------------------------------------------
def param_shapes(cfg):
    """Ordered (hf name, shape, kind) list; the order fixes the random draw."""
    D, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or D // H
    qwen3 = cfg["model_type"] in ("qwen3", "qwen3_moe")
    moe = cfg["model_type"] == "qwen3_moe"
    out = [("model.embed_tokens.weight", (V, D), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (H * hd, D), "linear"),
            (p + "self_attn.k_proj.weight", (KV * hd, D), "linear"),
            (p + "self_attn.v_proj.weight", (KV * hd, D), "linear"),
            (p + "self_attn.o_proj.weight", (D, H * hd), "linear"),
        ]
        if qwen3:
            out += [(p + "self_attn.q_norm.weight", (hd,), "norm"),
                    (p + "self_attn.k_norm.weight", (hd,), "norm")]
        out += [
            (p + "input_layernorm.weight", (D,), "norm"),
            (p + "post_attention_layernorm.weight", (D,), "norm"),
        ]
        if moe:
            E, Fm = cfg["num_experts"], cfg["moe_intermediate_size"]
            out.append((p + "mlp.gate.weight", (E, D), "linear"))
            for e in range(E):
                out += [(p + f"mlp.experts.{e}.gate_proj.weight", (Fm, D), "linear"),
                        (p + f"mlp.experts.{e}.up_proj.weight", (Fm, D), "linear"),
                        (p + f"mlp.experts.{e}.down_proj.weight", (D, Fm), "linear")]
        else:
            out += [(p + "mlp.gate_proj.weight", (F, D), "linear"),
                    (p + "mlp.up_proj.weight", (F, D), "linear"),
                    (p + "mlp.down_proj.weight", (D, F), "linear")]
    out.append(("model.norm.weight", (D,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (V, D), "linear"))
    return out


def draw_weights(cfg, seed, embed_std=0.5):
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape, kind in param_shapes(cfg):
        if kind == "linear":
            a = rng.normal(0.0, 0.08, shape)
        elif kind == "embed":
            a = rng.normal(0.0, embed_std, shape)
        else:
            a = 1.0 + rng.normal(0.0, 0.1, shape)
        w[name] = a.astype(np.float32)
    return w


# --------------------------------------------------------------------------
# Independent numpy float64 forward (for the weight-loading / HF cross-check)
# --------------------------------------------------------------------------
def np_inv_freq(cfg):
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = float(cfg["rope_theta"])
    freqs = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        # Meta's reference apply_scaling (llama3 repo), written as a loop.
        scale, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        new = []
        for f in freqs:
            wl = 2 * np.pi / f
            if wl < hi_wl:
                new.append(f)
            elif wl > lo_wl:
                new.append(f / scale)
            else:
                s = (old / wl - lo) / (hi - lo)
                new.append((1 - s) * f / scale + s * f)
        freqs = np.array(new)
    elif rs:
        raise NotImplementedError(f"rope scaling {rs}")
    return freqs


def np_forward(cfg, w, ids):
    D, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or D // H
    eps = cfg["rms_norm_eps"]
    W = {k: v.astype(np.float64) for k, v in w.items()}
    T = len(ids)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    ang = np.arange(T, dtype=np.float64)[:, None] * np_inv_freq(cfg)[None, :]  # [T, hd/2]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(x):  # x [heads, T, hd], rotate-half convention
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    causal = np.tril(np.ones((T, T), dtype=bool))
    x = W["model.embed_tokens.weight"][ids]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, H, hd).transpose(1, 0, 2)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        if cfg["model_type"] == "qwen3":
            q = rms(q, W[p + "self_attn.q_norm.weight"])
            k = rms(k, W[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        o = np.empty((H, T, hd))
        for hh in range(H):
            kv = hh // (H // KV)
            s = q[hh] @ k[kv].T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            o[hh] = (s / s.sum(-1, keepdims=True)) @ v[kv]
        x = x + o.transpose(1, 0, 2).reshape(T, H * hd) @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"])
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return x @ head.T


# --------------------------------------------------------------------------
# HF model in float64
# --------------------------------------------------------------------------
def float64_hf_modules(enable):
    """Point the HF modeling modules' `torch` at a proxy whose float32/float are float64."""
    import torch
    import transformers.modeling_rope_utils as ru
    import transformers.models.llama.modeling_llama as ml
    import transformers.models.qwen3.modeling_qwen3 as mq
    import transformers.models.qwen3_moe.modeling_qwen3_moe as mqm

    class Torch64(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    proxy = Torch64("torch64")
    proxy.float32 = torch.float64
    proxy.float = torch.float64
    for m in (ru, ml, mq, mqm):
        m.torch = proxy if enable else torch


def to_hf_names(cfg, weights):
    """Per-expert tensors (the checkpoint layout) into HF's fused ones: experts.gate_up_proj
    (E, 2Fm, D) = [gate; up] per expert, experts.down_proj (E, D, Fm)."""
    if cfg["model_type"] != "qwen3_moe":
        return dict(weights)
    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        E = cfg["num_experts"]
        out[p + "gate_up_proj"] = np.stack([np.concatenate([weights[p + f"{e}.gate_proj.weight"],
                                                            weights[p + f"{e}.up_proj.weight"]]) for e in range(E)])
        out[p + "down_proj"] = np.stack([weights[p + f"{e}.down_proj.weight"] for e in range(E)])
    return out


def from_hf_grads(cfg, grads):
    """HF's fused expert gradients back under the per-expert names."""
    if cfg["model_type"] != "qwen3_moe":
        return grads
    out = {k: v for k, v in grads.items() if ".mlp.experts." not in k}
    Fm = cfg["moe_intermediate_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gu, dn = grads[p + "gate_up_proj"], grads[p + "down_proj"]
        for e in range(cfg["num_experts"]):
            out[p + f"{e}.gate_proj.weight"] = gu[e, :Fm]
            out[p + f"{e}.up_proj.weight"] = gu[e, Fm:]
            out[p + f"{e}.down_proj.weight"] = dn[e]
    return out


def build_hf(cfg_path, weights, f64=True):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    float64_hf_modules(f64)
    config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(cfg_path)))
    config._attn_implementation = "eager"
    extra = {}
    if config.model_type == "qwen3_moe":      # the plain loop over experts: the fused kernels refuse float64
        extra["experts_implementation"] = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **extra)
    model = model.double().eval()
    weights = to_hf_names(json.load(open(cfg_path)), weights)
    sd = {k: torch.from_numpy(v.astype(np.float64)) for k, v in weights.items()}
    res = model.load_state_dict(sd, strict=False)
    tied = config.tie_word_embeddings
    allowed_missing = {"lm_head.weight"} if tied else set()
    if res.unexpected_keys or set(res.missing_keys) != allowed_missing:
        raise RuntimeError(f"load_state_dict: missing {res.missing_keys}, unexpected {res.unexpected_keys}")
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("tie_word_embeddings set but lm_head is not tied")
    names = [n for n, _ in model.named_parameters()]
    if sorted(names) != sorted(weights):
        raise RuntimeError(f"parameter set mismatch: {sorted(set(names) ^ set(weights))}")
    for n, p in model.named_parameters():
        assert p.dtype == torch.float64
    # The rotary buffers are float64 and, with the proxy, computed in float64 by HF's own init.
    return model


def hf_logits(model, ids, router=None):
    """Logits of one sequence; with a list `router`, also appends each layer's router logits."""
    import torch
    x = torch.tensor(ids, dtype=torch.long)[None]
    pos = torch.arange(len(ids))[None]
    moe = router is not None
    out = model(input_ids=x, position_ids=pos, use_cache=False, **({"output_router_logits": True} if moe else {}))
    if moe:
        router.append(out.router_logits)
    return out.logits[0]


def aux_loss(cfg, router):
    """The load-balancing loss over every trajectory and layer pooled, in float64:
    E * sum_e f_e P_e, f_e = share of (layer, token) top-k choices for e, P_e = mean probability."""
    import torch
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    counts, probs, M = torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64), 0
    for per_traj in router:
        for layer_logits in per_traj:
            p = torch.softmax(layer_logits.to(torch.float64), dim=-1)
            sel = torch.topk(p, k, dim=-1).indices
            counts = counts + torch.zeros(E, dtype=torch.float64).scatter_add_(0, sel.reshape(-1), torch.ones(sel.numel(), dtype=torch.float64))
            probs = probs + p.sum(0)
            M += p.shape[0]
    return E * torch.sum((counts / M) * (probs / M))


# --------------------------------------------------------------------------
# GRPO loss
# --------------------------------------------------------------------------
def grpo_loss(lib, logps, grp, norm):
    """lib: torch or numpy. logps: list of [S_i] float64 arrays/tensors."""
    per_tok, masks, stats = [], [], dict(n=0, n_masked=0, outside=0, clipped=0, clipped_masked=0)
    for i, (lp, suf) in enumerate(zip(logps, grp["suffixes"])):
        A = float(grp["adv"][i])
        o = lib.asarray(suf["old"].astype(np.float64)) if lib is np else _t(suf["old"])
        r = lib.asarray(suf["ref"].astype(np.float64)) if lib is np else _t(suf["ref"])
        m = suf["mask"].astype(np.float64)
        ratio = lib.exp(lp - o)
        clipped_ratio = lib.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) if lib is np else \
            ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH)
        pg = -lib.minimum(ratio * A, clipped_ratio * A)
        kl = lib.exp(r - lp) - (r - lp) - 1
        per_tok.append(pg + BETA * kl)
        masks.append(m)
        rn = np.asarray(ratio.detach() if lib is not np else ratio, dtype=np.float64)
        out = (rn < 1 - EPS_LOW) | (rn > 1 + EPS_HIGH)
        # the min picks the clipped term (strictly): A>0 and ratio>1+eps_high, or A<0 and ratio<1-eps_low
        clip = (rn > 1 + EPS_HIGH) if A > 0 else (rn < 1 - EPS_LOW) if A < 0 else np.zeros(len(rn), bool)
        stats["n"] += len(rn)
        stats["n_masked"] += int(m.sum())
        stats["outside"] += int(out.sum())
        stats["clipped"] += int(clip.sum())
        stats["clipped_masked"] += int((clip & (m > 0)).sum())
    if norm == "token-mean":
        den = sum(m.sum() for m in masks)
        assert den > 0, "no loss tokens in group"
        L = sum((l * (m if lib is np else _t(m))).sum() for l, m in zip(per_tok, masks)) / den
    elif norm == "seq-mean-token-mean":
        G = len(masks)
        L = sum((l * (m if lib is np else _t(m))).sum() / max(1.0, m.sum())
                for l, m in zip(per_tok, masks)) / G
    else:
        raise ValueError(norm)
    return L, stats


def _t(a):
    import torch
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def torch_logps(model, grp, router=None):
    import torch
    P = len(grp["prefix"])
    out = []
    for suf in grp["suffixes"]:
        S = len(suf["tokens"])
        ids = np.concatenate([grp["prefix"], suf["tokens"]]).astype(np.int64)
        logits = hf_logits(model, ids, router)
        lsm = torch.log_softmax(logits[P - 1: P - 1 + S], dim=-1)
        out.append(lsm.gather(1, torch.from_numpy(suf["tokens"].astype(np.int64))[:, None])[:, 0])
    return out


def np_logps(cfg, w, grp):
    P = len(grp["prefix"])
    out, logits_all = [], []
    for suf in grp["suffixes"]:
        S = len(suf["tokens"])
        ids = np.concatenate([grp["prefix"], suf["tokens"]]).astype(np.int64)
        lg = np_forward(cfg, w, ids)
        logits_all.append(lg)
        z = lg[P - 1: P - 1 + S]
        z = z - z.max(-1, keepdims=True)
        lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
        out.append(lsm[np.arange(S), suf["tokens"]])
    return out, logits_all


# --------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="model config.json (relative to repo root or absolute)")
    ap.add_argument("--trace", default="data/sample.trace")
    ap.add_argument("--group", type=int, default=0)
    ap.add_argument("--norm", required=True, choices=NORMS)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--embed-std", type=float, default=0.5, help="std of the embedding init (default 0.5)")
    ap.add_argument("--fd-entries", type=int, default=8, help="gradient entries to finite-difference check")
    args = ap.parse_args()

    import torch
    import transformers
    import safetensors
    from safetensors.numpy import save_file
    torch.set_grad_enabled(True)

    rp = lambda p: p if os.path.isabs(p) else os.path.join(REPO, p)  # noqa: E731
    relname = lambda p: os.path.relpath(rp(p), REPO)  # noqa: E731
    cfg = json.load(open(rp(args.config)))
    framework = f"torch {torch.__version__} / transformers {transformers.__version__}"
    print(f"oracle: config={relname(args.config)} trace={relname(args.trace)} group={args.group} "
          f"norm={args.norm} seed={args.seed} embed_std={args.embed_std:g}")
    print(f"oracle: {framework} / safetensors {safetensors.__version__} / numpy {np.__version__}")

    hdr, grp = read_trace(rp(args.trace), args.group)
    if hdr["vocab"] != cfg["vocab_size"]:
        raise ValueError(f"trace vocab {hdr['vocab']} != config vocab {cfg['vocab_size']}")
    if not hdr["has_ref"]:
        raise ValueError("trace has no ref log-probs (flags bit0 clear); the KL term needs them")
    P, G = len(grp["prefix"]), len(grp["suffixes"])
    Ss = [len(s["tokens"]) for s in grp["suffixes"]]
    allt = np.concatenate([grp["prefix"]] + [s["tokens"] for s in grp["suffixes"]])
    assert allt.min() >= 0 and allt.max() < cfg["vocab_size"], "token id out of range"
    assert P >= 1 and all(S >= 1 for S in Ss)
    print(f"oracle: trace n_groups={hdr['n_groups']} vocab={hdr['vocab']}; group {args.group}: P={P} G={G} "
          f"S={Ss} adv={np.round(grp['adv'], 4).tolist()} mask_sum={[int(s['mask'].sum()) for s in grp['suffixes']]}")

    weights = draw_weights(cfg, args.seed, args.embed_std)
    model = build_hf(rp(args.config), weights, f64=True)
    moe = cfg["model_type"] == "qwen3_moe"

    def total_loss():
        """GRPO loss (+ the MoE aux term), its log-probs and stats, the aux value."""
        router = [] if moe else None
        lps = torch_logps(model, grp, router)
        L, st = grpo_loss(torch, lps, grp, args.norm)
        aux = aux_loss(cfg, router) if moe else None
        if moe:
            L = L + cfg["router_aux_loss_coef"] * aux
        return L, lps, st, aux, router

    # ---- self-check 1: HF logits vs independent numpy forward (all trajectories; dense models)
    if moe:
        print("check: (MoE) the numpy forward covers dense models only; the finite differences below check this model")
    else:
        with torch.no_grad():
            lps_np, logits_np = np_logps(cfg, weights, grp)
            maxd = 0.0
            for i, suf in enumerate(grp["suffixes"]):
                ids = np.concatenate([grp["prefix"], suf["tokens"]]).astype(np.int64)
                maxd = max(maxd, float(np.abs(hf_logits(model, ids).numpy() - logits_np[i]).max()))
            scale = max(float(np.abs(l).max()) for l in logits_np)
        print(f"check: HF float64 logits vs numpy forward, all {G} trajectories: max |diff| = {maxd:.3e} "
              f"(max |logit| {scale:.3f})")
        assert maxd < 1e-10, "HF model and numpy forward disagree: weights not loaded as intended?"

        # (informative) unpatched HF, i.e. with its float32 RMSNorm / softmax / RoPE
        m32 = build_hf(rp(args.config), weights, f64=False)
        with torch.no_grad():
            ids0 = np.concatenate([grp["prefix"], grp["suffixes"][0]["tokens"]]).astype(np.int64)
            d32 = float(np.abs(hf_logits(m32, ids0).numpy() - logits_np[0]).max())
        float64_hf_modules(True)
        del m32
        print(f"info:  unpatched HF (float32 RMSNorm/softmax/RoPE inside) vs numpy, trajectory 0: "
              f"max |diff| = {d32:.3e}")

    # ---- loss and gradient
    model.zero_grad()
    L, lps, st, aux, router = total_loss()
    L.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    lp_all = torch.cat([l.detach() for l in lps]).numpy()
    if moe:
        import transformers.models.qwen3_moe.modeling_qwen3_moe as mqm
        per_layer = tuple(torch.cat([r[l] for r in router]).detach() for l in range(cfg["num_hidden_layers"]))
        hf_aux = float(mqm.load_balancing_loss_func(per_layer, cfg["num_experts"], cfg["num_experts_per_tok"], None))
        print(f"check: aux loss float64 {aux.item():.15g} vs HF load_balancing_loss_func (float32 sums) {hf_aux:.9g}: "
              f"rel diff {abs(aux.item() - hf_aux) / abs(aux.item()):.1e}")
        assert abs(aux.item() - hf_aux) <= 1e-5 * abs(aux.item()), "aux loss disagrees with HF's"
    else:
        L_np, _ = grpo_loss(np, lps_np, grp, args.norm)
        print(f"check: loss torch {L.item():.15g} vs numpy {L_np:.15g}: |diff| = {abs(L.item() - L_np):.3e}; "
              f"logprobs max |diff| = {np.abs(lp_all - np.concatenate(lps_np)).max():.3e}")

    # ---- self-check 2: central finite differences on a few gradient entries
    rng = np.random.default_rng(args.seed + 7)
    params = dict(model.named_parameters())
    names = list(params)
    picks = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight", "model.norm.weight"]
    picks += [n for n in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight", "model.layers.1.self_attn.k_norm.weight",
                          "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight",
                          "model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj") if n in params]
    rest = [n for n in names if n not in picks]
    picks += [rest[j] for j in rng.choice(len(rest), size=max(0, args.fd_entries - len(picks)), replace=False)]
    h = 1e-6
    worst = 0.0
    with torch.no_grad():
        for n in picks:
            p = params[n]
            g = grads[n]
            if n == "model.embed_tokens.weight":  # pick a row of a token that occurs
                row = int(allt[rng.integers(len(allt))])
                idx = (row, int(rng.integers(p.shape[1])))
            else:  # bias towards an entry with a non-tiny gradient
                flat = g.abs().flatten()
                cand = torch.argsort(flat, descending=True)[: max(1, flat.numel() // 4)]
                idx = np.unravel_index(int(cand[rng.integers(len(cand))]), p.shape)
            old = p[idx].item()
            p[idx] = old + h
            Lp = total_loss()[0].item()
            p[idx] = old - h
            Lm = total_loss()[0].item()
            p[idx] = old
            fd = (Lp - Lm) / (2 * h)
            an = g[idx].item()
            rel = abs(fd - an) / max(abs(an), 1e-8)
            worst = max(worst, rel)
            print(f"check: FD {n}{list(int(i) for i in idx)}: autograd {an:+.10e} fd {fd:+.10e} rel {rel:.1e}")
    print(f"check: finite differences worst relative error {worst:.1e}")
    assert worst < 1e-5, "finite-difference check failed"

    # ---- summary
    print(f"summary: loss = {L.item():.17g}  ({args.norm}" + (f", aux {aux.item():.17g} x {cfg['router_aux_loss_coef']})" if moe else ")"))
    print(f"summary: tokens = {st['n']} (loss-masked in: {st['n_masked']}); ratio outside "
          f"[{1 - EPS_LOW}, {1 + EPS_HIGH}]: {st['outside']}; clipped (min takes the clipped term): "
          f"{st['clipped']} ({st['clipped_masked']} of them in the loss mask)")
    gn = float(np.sqrt(sum(float((g ** 2).sum()) for g in grads.values())))
    print(f"summary: |grad| = {gn:.6e}")

    # ---- write
    out = dict(weights)
    out["oracle.loss"] = np.array([L.item()], dtype=np.float64)
    if moe:
        out["oracle.aux_loss"] = np.array([cfg["router_aux_loss_coef"] * aux.item()], dtype=np.float64)
    out["oracle.logprobs"] = lp_all.astype(np.float64)
    for n, g in from_hf_grads(cfg, {n: g.numpy() for n, g in grads.items()}).items():
        out["oracle.grad." + n] = np.ascontiguousarray(g.astype(np.float64))
    meta = {"config": relname(args.config), "trace": relname(args.trace), "group": str(args.group),
            "eps_low": str(EPS_LOW), "eps_high": str(EPS_HIGH), "beta": str(BETA),
            "normalization": args.norm, "seed": str(args.seed), "framework": framework,
            "init": f"default_rng(seed), fixed order; linear N(0,0.08), embed N(0,{args.embed_std:g}), "
                    "rmsnorm 1+N(0,0.1); stored f32, run f64"}
    save_file(out, rp(args.out), metadata=meta)
    print(f"wrote {relname(args.out)} ({os.path.getsize(rp(args.out))} bytes, {len(out)} tensors)")


if __name__ == "__main__":
    sys.exit(main())
