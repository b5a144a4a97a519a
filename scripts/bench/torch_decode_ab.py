"""Interleaved A/B of one-row torch decode variants on a shared, noisy CPU.

Each arm is a (dtype, variant) pair on the same checkpoint; the arms take turns, one block
of decode steps each, for several rounds, so load from other processes falls on every arm
alike. Per arm it prints the median wall and CPU ms per token, tok/s, and the percentage of
the memory-bandwidth limit for that dtype (weight bytes read per token / --bandwidth-gbs).
Prints text; not a test.

    python -m scripts.bench.torch_decode_ab -m DIR --arms bfloat16:stock bfloat16:gemv float32:gemv

Variants: stock (torch's nn.Linear.forward), gemv (one-row linears through torch.mv), kernel
(one-row linears through mlxcel's kernel, kernels/cpu/rows_linear.cpp), fused (kernel plus
the fused norms, RoPE and decode attention of kernels/cpu/decode_ops.cpp: the server's default
on a CPU), fused-no-read-ahead (fused, without the row kernel's read-ahead of the next
weights), fused-sdpa (fused norms and RoPE, attention left to SDPA), compile (kernel plus --torch-compile; its compile time is printed once, outside the
rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def _cpu_times() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]  # total, idle + iowait


def wait_quiet(busy_max: float, max_wait: float) -> float:
    """Sleep until the other processes leave the CPUs (nearly) idle for half a second, or
    max_wait passes; returns the busy fraction seen last (this process is idle meanwhile)."""
    deadline = time.monotonic() + max_wait
    while True:
        t0, i0 = _cpu_times()
        time.sleep(0.5)
        t1, i1 = _cpu_times()
        busy = 1.0 - (i1 - i0) / max(t1 - t0, 1)
        if busy <= busy_max or time.monotonic() > deadline:
            return busy


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:  # tied embeddings are read once per token (the lm_head)
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--arms", nargs="+", default=["bfloat16:kernel", "bfloat16:fused"])
    p.add_argument("--threads", type=int, default=-1)
    p.add_argument("--steps", type=int, default=16, help="decode steps per arm per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the decode steps")
    p.add_argument("--bandwidth-gbs", type=float, default=45.0)
    p.add_argument("--quiet-busy", type=float, default=0.15,
                   help="before each block, wait until other processes use at most this share of the CPUs")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="longest wait for a quiet moment, seconds")
    args = p.parse_args()

    from mlxcel.engine.backend import ForwardRow
    import os

    from mlxcel.backends.torch.row_gemv import load_row_kernel, remove_row_gemv
    from mlxcel.config.settings import BackendSection, ServerSettings
    from mlxcel.runtime.load import load_backend

    kernel = load_row_kernel(os.environ)
    print(f"row kernel: {kernel.path}", flush=True)

    import torch

    def variant(row_kernel, fused: bool = False, stock: bool = False, read_ahead: int = 4 << 20,
                attention: bool = True):
        def apply(b):
            torch.ops.mlxcel_cpu.set_read_ahead(read_ahead)
            b.set_row_linears(row_kernel)
            if b._base_forward is b.base:  # not under compile
                b.set_fused_ops(fused, attention)
            if stock:
                remove_row_gemv(b.base, b.lm_head)
        return apply

    variants = {"stock": variant(None, stock=True), "gemv": variant(None), "kernel": variant(kernel),
                "fused": variant(kernel, fused=True), "fused-no-read-ahead": variant(kernel, fused=True, read_ahead=0),
                "fused-sdpa": variant(kernel, fused=True, attention=False),
                "compile": variant(kernel)}
    backends = {}
    for arm in args.arms:
        dtype, variant = arm.split(":")
        key = (dtype, variant == "compile")
        if key not in backends:
            asked = BackendSection(name="torch", device="cpu", dtype=dtype, threads=args.threads, torch_compile=key[1])
            settings = ServerSettings(backend=asked)
            backends[key] = load_backend(settings, args.model)[0]
    prompt = [(i * 37) % 1000 + 100 for i in range(args.context)]

    def backend_of(arm: str):
        dtype, variant = arm.split(":")
        return backends[(dtype, variant == "compile")]

    def run(arm: str) -> tuple[float, float]:
        backend = backend_of(arm)
        variants[arm.split(":")[1]](backend)
        seq = backend.new_sequence()
        nxt = int(backend.forward([ForwardRow(prompt, seq)])[0].argmax())
        for _ in range(2):
            nxt = int(backend.forward([ForwardRow([nxt], seq, decode=True)])[0].argmax())
        c, w = time.process_time(), time.perf_counter()
        for _ in range(args.steps):
            nxt = int(backend.forward([ForwardRow([nxt], seq, decode=True)])[0].argmax())
        wall, cpu = (time.perf_counter() - w) / args.steps, (time.process_time() - c) / args.steps
        seq.release()
        return wall, cpu

    for arm in args.arms:
        if arm.endswith(":compile"):  # compile time, paid once per shape family, outside the rounds
            c, w = time.process_time(), time.perf_counter()
            run(arm)
            print(f"{arm}: first run incl. compiling {time.perf_counter() - w:.1f} s wall, "
                  f"{time.process_time() - c:.1f} s CPU", flush=True)
    results: dict[str, list[tuple[float, float]]] = {a: [] for a in args.arms}
    busy_seen = []
    for r in range(args.rounds):
        for arm in args.arms:
            busy_seen.append(wait_quiet(args.quiet_busy, args.quiet_wait))
            results[arm].append(run(arm))
            wall, cpu = results[arm][-1]
            print(f"round {r} {arm:18s} wall {wall * 1e3:6.1f} ms cpu {cpu * 1e3:6.1f} ms "
                  f"(others busy {100 * busy_seen[-1]:.0f}%)", flush=True)
    print(f"other load before each block: median {100 * statistics.median(busy_seen):.0f}% of the CPUs, "
          f"max {100 * max(busy_seen):.0f}%")
    for arm, rs in results.items():
        backend = backend_of(arm)
        limit = args.bandwidth_gbs * 1e9 / weight_bytes(backend.model)
        wall = statistics.median(w for w, _ in rs)
        cpu = statistics.median(c for _, c in rs)
        best = min(w for w, _ in rs)
        print(f"{arm:18s} wall {wall * 1e3:6.1f} ms (best {best * 1e3:6.1f}) cpu {cpu * 1e3:6.1f} ms  "
              f"{1 / wall:6.1f} tok/s (best {1 / best:6.1f})  limit {limit:5.0f} tok/s  "
              f"{100 / wall / limit:4.1f}% (best {100 / best / limit:4.1f}%)")


if __name__ == "__main__":
    main()
