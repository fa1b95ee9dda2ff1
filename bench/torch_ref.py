#!/usr/bin/env python3
"""The full-sequence GRPO step of train_cuda's baseline, in PyTorch: the yardstick for its speed.

The same model (a Llama config.json, optionally cut to --layers), the same step: G trajectories of
prefix + suffix tokens, each run forward and backward whole (the baseline schedule), the clipped
GRPO token loss on the suffix tokens, token-mean. bf16 weights and activations, fp32 loss; RMSNorm,
rotate-half RoPE, grouped-query attention through scaled_dot_product_attention (causal), SwiGLU.
Eager and torch.compile are timed side by side on the same inputs; the median of --reps runs after
a warm-up, synchronised. FLOPs are counted as pr_step_flops counts them (train.c prints the same
number), so MFU columns are comparable with ./train_cuda --bench.

    python3 bench/torch_ref.py --config model/llama3-8b --layers 4 --total 12288 --groups 4,8
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F


def rope_inv_freq(cfg):
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type") == "llama3":   # the header's pr__rope_frequencies, same formula
        factor, lo, hi, orig = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > orig / lo, inv / factor, inv)
        mid = (wavelen <= orig / lo) & (wavelen >= orig / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


class Model(torch.nn.Module):
    def __init__(self, cfg, layers):
        super().__init__()
        C, F_, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
        self.NH, self.NKV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.HS = cfg.get("head_dim") or C // self.NH
        self.eps = cfg["rms_norm_eps"]
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
        self.emb = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            m = torch.nn.Module()
            m.ln1, m.ln2 = torch.nn.Parameter(torch.ones(C)), torch.nn.Parameter(torch.ones(C))
            m.q, m.k, m.v = lin(C, self.NH * self.HS), lin(C, self.NKV * self.HS), lin(C, self.NKV * self.HS)
            m.o = lin(self.NH * self.HS, C)
            m.gate, m.up, m.down = lin(C, F_), lin(C, F_), lin(F_, C)
            self.layers.append(m)
        self.norm = torch.nn.Parameter(torch.ones(C))
        self.head = lin(C, V)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)

    def rms(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w.to(x.dtype)

    def rope(self, x, cos, sin):            # x (B, H, T, HS), rotate-half pairing
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), -1)
        return (x.float() * cos + rot.float() * sin).to(x.dtype)

    def forward(self, tokens):              # (B, T) -> hidden (B, T, C)
        B, T = tokens.shape
        ang = torch.arange(T, device=tokens.device, dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
        x = self.emb(tokens)
        for m in self.layers:
            h = self.rms(x, m.ln1)
            q = m.q(h).view(B, T, self.NH, self.HS).transpose(1, 2)
            k = m.k(h).view(B, T, self.NKV, self.HS).transpose(1, 2)
            v = m.v(h).view(B, T, self.NKV, self.HS).transpose(1, 2)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + m.o(a.transpose(1, 2).reshape(B, T, -1))
            h = self.rms(x, m.ln2)
            x = x + m.down(F.silu(m.gate(h)) * m.up(h))
        return self.rms(x, self.norm)


def grpo_loss(model, hidden, targets, old_logp, adv, weight, eps_low=0.2, eps_high=0.28):
    logits = model.head(hidden).float()
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    r = torch.exp(logp - old_logp)
    loss = -torch.minimum(r * adv, r.clamp(1 - eps_low, 1 + eps_high) * adv)
    return (loss * weight).sum()


def step(model, tokens, P, old_logp, adv, weight):
    """One baseline step: every trajectory forward and backward whole, one at a time (microbatch 1)."""
    for i in range(tokens.shape[0]):
        seq = tokens[i:i + 1]
        hidden = model(seq)[:, P - 1:-1]              # rows that predict the suffix tokens
        grpo_loss(model, hidden, seq[:, P:], old_logp[i:i + 1], adv[i], weight).backward()


def step_flops(cfg, layers, P, S, G):
    """pr_step_flops for the baseline: matmuls 6x params-per-token, attention 12*qd per pair, head on S rows."""
    C, F_, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    HS = cfg.get("head_dim") or C // cfg["num_attention_heads"]
    qd, kvd = cfg["num_attention_heads"] * HS, cfg["num_key_value_heads"] * HS
    per_token = 6 * (C * qd + 2 * C * kvd + qd * C + 3 * C * F_) * layers
    T = P + S
    return G * (T * per_token + T * (T + 1) / 2 * 12 * qd * layers + S * 6 * C * V)


def timed(fn, reps):
    fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="model/llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--total", type=int, default=12288, help="tokens per trajectory")
    ap.add_argument("--splits", default="0.1667,0.5,0.6667,0.8333", help="prefix fractions of --total")
    ap.add_argument("--groups", default="4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    path = a.config if a.config.endswith(".json") else os.path.join(a.config, "config.json")
    cfg = json.load(open(path))
    layers = min(a.layers, cfg["num_hidden_layers"])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = Model(cfg, layers).to(dev, torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.02) if p.dim() == 2 else torch.nn.init.ones_(p)
    compiled = None if a.no_compile else torch.compile(model)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}: {cfg['model_type']}, {layers} layers, hidden {cfg['hidden_size']}, "
          f"{a.total} tokens per trajectory, baseline step (microbatch 1), median of {a.reps}")
    print(f"{'split P/S':>11} {'G':>3} {'eager s':>10} {'compile s':>10} {'eager MFU':>10} {'compile MFU':>12}")
    V = cfg["vocab_size"]
    for frac in (float(x) for x in a.splits.split(",")):
        P = round(a.total * frac)
        S = a.total - P
        for G in (int(x) for x in a.groups.split(",")):
            g = torch.Generator(device="cpu").manual_seed(P * 131 + G)
            tokens = torch.randint(0, V, (G, P + S), generator=g).to(dev)
            old = (-math.log(V) - 0.3 * torch.rand(G, S, generator=g)).to(dev)
            adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(G)], device=dev)
            weight = 1.0 / (G * S)
            fl = step_flops(cfg, layers, P, S, G)
            te = timed(lambda: step(model, tokens, P, old, adv, weight), a.reps)
            tc = timed(lambda: step(compiled, tokens, P, old, adv, weight), a.reps) if compiled is not None else float("nan")
            mfu = lambda t: 100 * fl / t / (a.peak_tflops * 1e12)
            print(f"{P:>5}/{S:<5} {G:>3} {te:>10.3f} {tc:>10.3f} {mfu(te):>9.1f}% {mfu(tc):>11.1f}%", flush=True)
            model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
