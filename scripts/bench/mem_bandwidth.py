"""How fast this machine reads memory, and what that allows a decode step.

Streams fp32 buffers of several sizes through `torch.sum` on 1 and N threads (the median of
several passes each) and prints GB/s; buffers that fit the last-level cache read faster than
ones that must come from DRAM, so the size of a model's weights decides which line applies.
With -m, it also prints the single-stream decode limit for that checkpoint in each dtype:
weight bytes read per token / bandwidth. Prints text; not a test.

    python -m scripts.bench.mem_bandwidth --threads 2 -m models/HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def read_gbs(mib: int, threads: int, passes: int) -> float:
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(mib * 1024 * 1024 // 4)
    buf.sum()
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def weight_count(model: Path) -> int:
    """Parameters read per token: every tensor in the checkpoint's SafeTensors (a tied
    embedding is stored, and read, once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--passes", type=int, default=9)
    p.add_argument("-m", "--model", type=Path, help="checkpoint directory: also print its decode limits")
    args = p.parse_args()
    rows = {}
    for mib in args.sizes_mib:
        rows[mib] = {t: read_gbs(mib, t, args.passes) for t in sorted({1, args.threads})}
        print(f"{mib:5d} MiB: " + "  ".join(f"{t} thread{'s' * (t > 1)} {g:5.1f} GB/s" for t, g in rows[mib].items()),
              flush=True)
    if args.model:
        n = weight_count(args.model)
        print(f"{args.model.name}: {n / 1e6:.1f} M parameters")
        for dtype, size in (("bfloat16", 2), ("float32", 4)):
            nbytes = n * size
            # the row whose buffer is the nearest size at or above the weights: what a step streams
            fit = min((m for m in rows if m * 1024 * 1024 >= nbytes), default=max(rows))
            gbs = rows[fit][args.threads]
            print(f"  {dtype}: {nbytes / 1e6:.0f} MB per token; at {gbs:.1f} GB/s ({fit} MiB buffer, "
                  f"{args.threads} threads) the limit is {gbs * 1e9 / nbytes:.0f} tok/s")
    print(json.dumps({str(k): v for k, v in rows.items()}))


if __name__ == "__main__":
    main()
