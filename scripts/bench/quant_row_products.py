"""One decode step's quantized weight products, alone, against the memory's read rate.

Loads an MLX-quantized checkpoint on the torch backend (weights packed, the CPU kernel of
kernels/cpu/quant_rows.cpp installed) and times multiplying `--rows` activation rows by every
packed linear in a step's order (each layer's, then the LM head), through the modules' own
forward as a step calls them. Prints ms per step, the GB/s the packed bytes (codes, scales and
biases) are read at, and that as a fraction of a streaming read of a buffer as large as the
served bytes (scripts/bench/mem_bandwidth.py's measure, taken before and after in this process).
The gap between this and a served decode token's time is the rest of the step (norms,
attention, Python). Not a test.

    python -m scripts.bench.quant_row_products -m models/qbench/SmolLM2-135M-Instruct-Q4_1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def packed_bytes(modules) -> int:
    """Bytes one pass over `modules` reads: each packed tensor once (a tied head shares them)."""
    seen, total = set(), 0
    for m in modules:
        for t in (m.weight, m.scales, m.biases):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()

    import torch

    from mlxcel.backends.torch.quantized import quantized_linears
    from mlxcel.config.settings import BackendSection, ServerSettings
    from mlxcel.runtime.load import load_backend
    from scripts.bench.mem_bandwidth import read_gbs

    torch.set_num_threads(args.threads)
    settings = ServerSettings(backend=BackendSection(name="torch", device="cpu", dtype="float32",
                                                     threads=args.threads, build_env=dict(os.environ)))
    backend, _ = load_backend(settings, args.model)
    modules = quantized_linears(backend.base, backend.lm_head)
    if not modules or any(m.op is None for m in modules):
        raise SystemExit("no packed linears on the CPU kernel here (not an MLX-quantized checkpoint?)")
    nbytes = packed_bytes(modules)
    mib = max(16, 1 << (nbytes - 1).bit_length() >> 20)  # the power of two at or above the served bytes
    before = read_gbs(mib, args.threads, 9)
    times: dict[int, list[float]] = {r: [] for r in args.rows}
    cpu: dict[int, list[float]] = {r: [] for r in args.rows}
    xs = {r: {m.in_features: torch.randn(r, m.in_features) for m in modules} for r in args.rows}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for r in args.rows:  # the row counts take turns, so load falls on each alike
                t, c = time.perf_counter(), time.process_time()
                for m in modules:
                    m(xs[r][m.in_features])
                times[r].append(time.perf_counter() - t)
                cpu[r].append(time.process_time() - c)
    after = read_gbs(mib, args.threads, 9)
    print(f"{len(modules)} packed products, {nbytes / 1e6:.1f} MB read per pass, {args.threads} threads, "
          f"{args.rounds} rounds, kernel {modules[0].op}")
    print(f"streaming read ({mib} MiB buffer): {before:.1f} GB/s before, {after:.1f} after")
    for r, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        gbs = nbytes / med / 1e9
        print(f"{r} row{'s' * (r > 1)}: {med * 1e3:6.2f} ms per pass (best {best * 1e3:6.2f}), {gbs:5.1f} GB/s, "
              f"{100 * gbs / before:.0f}-{100 * gbs / after:.0f}% of the streaming read; "
              f"{r / med:.0f} rows/s through the products alone; CPU {statistics.median(cpu[r]) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
