"""A prompt chunk's weight products, alone: torch's bf16 `linear` against mlxcel's AMX tile kernel
(kernels/cpu/bf16_tiles.cpp), for chunks of several row counts.

Builds random bf16 matrices in the shapes of a checkpoint's decoder linears, then times
multiplying an M-row activation by all of them, the two paths taking turns each round so
machine load falls on both alike. Prints per M the median ms, GFLOP/s and the tiles/torch
ratio of medians. Not a test.

    python -m scripts.bench.torch_prompt_products -m models/HuggingFaceTB/SmolLM2-135M-Instruct --rows 16 128 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from scripts.bench.torch_row_products import linear_shapes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 512])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from mlxcel.backends.torch.row_gemv import load_row_kernel

    torch.set_num_threads(args.threads)
    kernel = load_row_kernel(os.environ, args.threads)
    if kernel.prompt is None:
        raise SystemExit("this CPU has no AMX bf16 tiles: nothing to compare")
    shapes = linear_shapes(json.loads((args.model / "config.json").read_text()))[:-1]  # no LM head
    weights = [(torch.randn(n, k) / k ** 0.5).to(torch.bfloat16) for n, k in shapes]
    flops = 2 * sum(n * k for n, k in shapes)
    print(f"{len(weights)} products, threads {args.threads}")

    def run(op, xs: dict[int, torch.Tensor]) -> float:
        t = time.perf_counter()
        for w in weights:
            op(xs[w.shape[1]], w, None)
        return time.perf_counter() - t

    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k in shapes}}
            arms = {"torch": lambda x, w, b: F.linear(x, w, b), "tiles": kernel.prompt}
            for op in arms.values():
                run(op, xs)
            times: dict[str, list[float]] = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, op in arms.items():
                    times[name].append(run(op, xs))
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = "   ".join(f"{name} {s * 1e3:7.1f} ms ({flops * m / s / 1e9:5.0f} GFLOP/s)" for name, s in med.items())
            print(f"{m:4d} rows: {cells}   tiles/torch {med['tiles'] / med['torch']:.2f}")


if __name__ == "__main__":
    main()
