"""Step times of a model split over a group of ranks, against one process (docs/benchmarks.md).

    python -m scripts.bench.dist_bench -m MODEL_DIR [--backend torch|mlx] [--configs 1x1 2x1 1x2 2x2] [--device cpu]

On MLX the ranks meet over its ring on loopback (tensor or pipeline parallel, not both).

Each configuration TPxPP starts its ranks as processes on this host (gloo on loopback on the
CPU, NCCL on CUDA with one GPU per rank) and drives rank 0's GroupBackend directly, as the
engine would: one prefill step of --prompt tokens per row, then --steps decode steps, at each
--batch. It prints one line per configuration and batch: median prefill and decode step times,
and what each rank holds (weights, KV bytes per token). 1x1 is the single-process backend.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def drive(backend, batch: int, prompt: int, steps: int) -> tuple[float, float]:
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.engine.kv_block_pool import BlockAllocator, SequenceKV

    allocator = BlockAllocator(batch * ((prompt + steps) // 16 + 2) + 8, 16)
    backend.bind_kv(allocator)
    rng = np.random.default_rng(0)
    seqs = [SequenceKV(allocator) for _ in range(batch)]
    t = time.perf_counter()
    out = backend.forward([ForwardRow(rng.integers(100, 1000, prompt).tolist(), s) for s in seqs])
    prefill = time.perf_counter() - t
    last = [int(np.argmax(o)) for o in out]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = backend.forward([ForwardRow([tok], s, decode=True) for tok, s in zip(last, seqs)])
        times.append(time.perf_counter() - t)
        last = [int(np.argmax(o)) for o in out]
    return prefill, statistics.median(times)


def rank_main(args) -> int:
    from mlxcel.backends.distributed import ShardOptions
    from mlxcel.backends.group import GroupBackend, follow, join
    from mlxcel.config.distributed import GroupSpec
    from mlxcel.runtime.group import rank_device

    tp, pp = (int(x) for x in args.config.split("x"))
    spec = GroupSpec(tp_size=tp, pp_size=pp, rank=args.rank, local_rank=args.rank, master_port=args.port,
                     timeout_s=300)
    if args.backend == "mlx":
        from mlxcel.backends.mlx.distributed import connect, load_shard

        device = args.device
    else:
        from mlxcel.backends.torch.distributed import connect, cuda_count, load_shard

        device = rank_device(args.device, args.rank, cuda_count())
    collective = connect(spec, device)
    local = load_shard(Path(args.model), spec, collective,
                       ShardOptions(dtype=args.dtype, device=device, threads=args.threads))
    sizes = join(local, collective, b"bench".ljust(32))
    if args.rank:
        follow(local, collective)
        return 0
    group = GroupBackend(local, collective, spec, sizes, lambda reason: None)
    rows = [(b, *drive(group, b, args.prompt, args.steps)) for b in args.batch]
    group.close()
    print(json.dumps({"rows": rows, "ranks": [[s.weight_bytes, s.kv_bytes_per_token] for s in sizes]}))
    return 0


def single(args) -> dict:
    if args.backend == "mlx":
        from mlxcel.backends.mlx.backend import MLXBackend

        b = MLXBackend(args.model, dtype=args.dtype, threads=args.threads)
    else:
        from mlxcel.backends.torch.backend import TorchBackend

        b = TorchBackend(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
    rows = [(n, *drive(b, n, args.prompt, args.steps)) for n in args.batch]
    return {"rows": rows, "ranks": [[b.weight_nbytes, b.kv_spec.bytes_per_token]]}


def group(args, config: str) -> dict:
    tp, pp = (int(x) for x in config.split("x"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, "-m", "scripts.bench.dist_bench", "-m", args.model, "--backend", args.backend,
            "--config", config, "--port",
            str(port), "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads), "--prompt",
            str(args.prompt), "--steps", str(args.steps), "--batch", *map(str, args.batch)]
    procs = [subprocess.Popen([*base, "--rank", str(r)], stdout=subprocess.PIPE, env=os.environ)
             for r in range(tp * pp)]
    out = procs[0].communicate()[0].decode()
    for p in procs[1:]:
        p.wait()
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--backend", choices=("torch", "mlx"), default="torch")
    ap.add_argument("--configs", nargs="+", default=["1x1", "2x1", "1x2"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank (torch's; MLX's per large product)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    print(f"{Path(args.model).name}, {args.backend} {args.dtype} on {args.device}, {args.threads} thread(s) per rank, "
          f"prompt {args.prompt} tokens, median of {args.steps} decode steps")
    print("config (tp x pp) | batch | prefill step ms | decode step ms | weights MiB per rank | KV bytes/token per rank")
    for config in args.configs:
        got = single(args) if config == "1x1" else group(args, config)
        weights = " / ".join(f"{w / 2**20:.1f}" for w, _ in got["ranks"])
        kv = " / ".join(str(k) for _, k in got["ranks"])
        for batch, prefill, decode in got["rows"]:
            print(f"{config} | {batch} | {prefill * 1e3:.1f} | {decode * 1e3:.2f} | {weights} | {kv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
