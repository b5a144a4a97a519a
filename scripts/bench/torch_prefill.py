"""Interleaved A/B of torch CPU prefill (--dtype bf16 or fp32): prompt rows on torch's own ops
against mlxcel's kernels (the server's default), on one loaded checkpoint. Prints text; not a test.

    python -m scripts.bench.torch_prefill -m models/HuggingFaceTB/SmolLM2-135M-Instruct --lengths 32 128 512 2048

Arms: torch (prompt rows' linears torch's `linear`, attention SDPA, the family's own norms and
RoPE) and kernels (bf16: the AMX tile linears of kernels/cpu/bf16_tiles.cpp where the CPU has
them, else torch's; fp32: torch's linears; either way every query's attention
through the row-by-row kernel, fused norms and RoPE: a prompt token's bits then do not depend on
its chunk). A prompt longer than --chunk is prefilled in chunks of that many tokens, as the
engine's batch size splits it. The arms take turns each round, so load from other processes
falls on both alike; per arm and length: median ms and prompt tokens per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512, 2048])
    p.add_argument("--chunk", type=int, default=512, help="prompt tokens per forward (the engine's -b)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=-1)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args()

    import torch

    from mlxcel.engine.backend import ForwardRow
    from mlxcel.backends.torch.backend import TorchBackend
    from mlxcel.backends.torch.row_gemv import load_row_kernel

    backend = TorchBackend(args.model, dtype=args.dtype, threads=args.threads, build_env=os.environ)
    print(f"threads {torch.get_num_threads()}; decode rows' linears: {backend.row_kernel}; "
          f"prompt rows' linears: {backend.prompt_linears}; fused ops: {backend.fused_ops}")

    def arm(name: str) -> None:
        kernels = name == "kernels"
        backend.set_row_linears(load_row_kernel(os.environ, prompt=kernels))
        backend.set_fused_ops(kernels)

    def prefill(n: int) -> float:
        ids = [(i * 37) % 5000 + 100 for i in range(n)]
        seq = backend.new_sequence()
        t = time.perf_counter()
        for start in range(0, n, args.chunk):
            backend.forward([ForwardRow(ids[start:start + args.chunk], seq)])
        dt = time.perf_counter() - t
        seq.release()
        return dt

    times: dict[tuple[str, int], list[float]] = {}
    for name in ("torch", "kernels"):  # warm both arms (first calls build caches)
        arm(name)
        prefill(min(args.lengths))
    for _ in range(args.rounds):
        for n in args.lengths:
            for name in ("torch", "kernels"):
                arm(name)
                times.setdefault((name, n), []).append(prefill(n))
    arm("kernels")
    for n in args.lengths:
        cells = []
        for name in ("torch", "kernels"):
            ms = statistics.median(times[(name, n)]) * 1e3
            cells.append(f"{name} {ms:8.1f} ms ({n / ms * 1e3:6.0f} tok/s)")
        ratio = statistics.median(times[("kernels", n)]) / statistics.median(times[("torch", n)])
        print(f"{n:5d} tokens: " + "   ".join(cells) + f"   kernels/torch {ratio:.2f}")


if __name__ == "__main__":
    main()
