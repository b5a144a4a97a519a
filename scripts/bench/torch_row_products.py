"""One decode step's weight products, alone: torch's one-row paths against mlxcel's kernel (bf16 or fp32).

Builds random matrices (--dtype) in the shapes of a checkpoint's linears (every decoder layer's,
plus the LM head), then times multiplying one activation row by all of them, the paths taking
turns for several rounds so machine load falls on each alike. Prints ms per token and the GB/s
each path reads the weights at; compare with scripts/bench/mem_bandwidth.py. Not a test.

    python -m scripts.bench.torch_row_products -m models/HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """[out, in] of each linear one token passes through (Llama-style attention and MLP)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads)
    layer = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (inter, h), (inter, h), (h, inter)]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], h)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from mlxcel.backends.torch.row_gemv import load_row_kernel

    torch.set_num_threads(args.threads)
    kernel = load_row_kernel(os.environ)
    shapes = linear_shapes(json.loads((args.model / "config.json").read_text()))
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(o, i).mul_(0.02).to(dtype) for o, i in shapes]
    rows = {i: torch.randn(1, i).to(dtype) for _, i in shapes}
    nbytes = sum(w.nbytes for w in weights)
    paths = {
        "F.linear": lambda x, w: F.linear(x, w),
        "torch.mv": lambda x, w: torch.mv(w, x[0]),
        "mlxcel kernel": lambda x, w: kernel.op(x, w, None),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, fn in paths.items():
                for w in weights[:8]:
                    fn(rows[w.shape[1]], w)
                t = time.perf_counter()
                for w in weights:
                    fn(rows[w.shape[1]], w)
                times[name].append(time.perf_counter() - t)
    print(f"{len(weights)} products, {nbytes / 1e6:.0f} MB of {args.dtype} weights, {args.threads} threads, "
          f"{args.rounds} rounds")
    for name, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        print(f"{name:14s} {med * 1e3:6.2f} ms (best {best * 1e3:6.2f})  {nbytes / med / 1e9:5.1f} GB/s "
              f"(best {nbytes / best / 1e9:5.1f})")


if __name__ == "__main__":
    main()
