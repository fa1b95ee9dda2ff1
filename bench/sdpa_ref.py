#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the same GPU and shapes as bench_cuda's attention: the
yardstick for its TFLOP/s.

Shapes (bf16, 32 query / 8 KV heads, head dim 128 unless said):
  causal8k     one causal 8k sequence;
  p10k-8x2k    the two-region case: G = 8 suffixes of 2k rows, each attending to a 10k prefix and
  p10k-32x2k   causally to itself (G = 32). As PyTorch runs it: a batch of G sequences, queries = the
               suffix rows, keys = prefix + suffix, causal mask aligned bottom-right. The (query, key)
               pairs are the ones bench_cuda counts, so the FLOPs are the same.
  causal8k-hd64, p10k-8x2k-hd64   the first two at head dim 64 (Llama-3.2-1B's).
Backends, each forced in turn: flash (FlashAttention-2), cudnn, efficient (memory-efficient).
A backend that refuses a shape is reported as such. GQA through enable_gqa where the backend takes
it, else K/V repeated to 32 heads (same FLOPs).
FLOPs as bench_cuda counts them: 4 * pairs * head_dim * heads forward, 2.5x that backward.
Times: CUDA events, median of --reps runs after a warm-up (fewer runs past --max-seconds).

    python3 bench/sdpa_ref.py [--shapes causal8k,p10k-8x2k] [--backends flash,cudnn] [--reps 10]
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

SHAPES = {  # name: (prefix, segments, rows per segment, head dim)
    "causal8k": (0, 1, 8192, 128),
    "p10k-8x2k": (10240, 8, 2048, 128),
    "p10k-32x2k": (10240, 32, 2048, 128),
    "causal8k-hd64": (0, 1, 8192, 64),
    "p10k-8x2k-hd64": (10240, 8, 2048, 64),
}
NH, NKV = 32, 8


def backends():
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def timed(fn, reps, max_seconds):
    """Median seconds of fn() over reps runs after one warm-up, CUDA events around each."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); fn(); end.record(); torch.cuda.synchronize()
    warm = start.elapsed_time(end) / 1e3
    n = max(1, min(reps, int(max_seconds / max(warm, 1e-9))))
    times = []
    for _ in range(n):
        start.record(); fn(); end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run(shape, backend, reps, max_seconds):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    P, G, S, HS = SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(G, NH, S, HS, device=dev, dtype=dt, generator=gen)
    k = torch.randn(G, NKV, P + S, HS, device=dev, dtype=dt, generator=gen)
    v = torch.randn(G, NKV, P + S, HS, device=dev, dtype=dt, generator=gen)
    pairs = G * (S * P + S * (S + 1) / 2)
    flop = 4 * pairs * HS * NH
    mask = causal_lower_right(S, P + S) if P else None
    how = "gqa"
    for attempt in ("gqa", "repeat"):
        qq, kk, vv = q, k, v
        if attempt == "repeat":
            kk, vv = k.repeat_interleave(NH // NKV, dim=1), v.repeat_interleave(NH // NKV, dim=1)
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (qq, kk, vv))
        gqa = attempt == "gqa"

        def fwd():
            with sdpa_kernel([backend]):
                if mask is None:
                    return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
                return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=gqa)
        try:
            o = fwd()
            torch.cuda.synchronize()
            how = attempt
            break
        except (RuntimeError, TypeError, NotImplementedError) as e:
            err = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if attempt == "repeat":
                return None, None, "refused: " + err[:160]
    dout = torch.randn_like(o)

    def bwd():
        torch.autograd.grad(o, (qq, kk, vv), dout, retain_graph=True)
    tf = timed(fwd, reps, max_seconds)
    tb = timed(bwd, reps, max_seconds)
    return flop / tf / 1e12, 2.5 * flop / tb / 1e12, f"{tf * 1e3:.2f} / {tb * 1e3:.2f} ms, {'enable_gqa' if how == 'gqa' else 'K/V repeated'}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--backends", default="flash,cudnn,efficient")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=3.0)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("sdpa_ref: no CUDA device for PyTorch")
        return 1
    names = backends()
    shapes = a.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            print(f"sdpa_ref: no shape '{s}' (of {', '.join(SHAPES)})")
            return 2
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"on {torch.cuda.get_device_name()}; bf16, {NH} query / {NKV} KV heads, head dim 128 unless the shape says")
    print(f"{'shape':<14} {'backend':<10} {'fwd TF/s':>9} {'bwd TF/s':>9}   notes")
    failed = 0
    for s in shapes:
        for b in a.backends.split(","):
            if b not in names:
                print(f"sdpa_ref: no backend '{b}' (of {', '.join(names)})")
                return 2
            try:
                f, g, note = run(s, names[b], a.reps, a.max_seconds)
            except torch.cuda.OutOfMemoryError as e:
                f, g, note = None, None, "out of memory: " + str(e).splitlines()[0][:120]
            torch.cuda.empty_cache()
            if f is None:
                print(f"{s:<14} {b:<10} {'-':>9} {'-':>9}   {note}", flush=True)
                failed += 1
            else:
                print(f"{s:<14} {b:<10} {f:>9.1f} {g:>9.1f}   {note}", flush=True)
    return 0 if failed < len(shapes) * len(a.backends.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
