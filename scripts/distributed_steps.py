"""Step times and bytes per rank of a distributed group on this host (docs/distributed.md).

Starts `--tp N` or `--pp N` ranks of `--backend` over loopback (or one process with neither),
drives rank 0's GroupBackend directly (no HTTP: the numbers are the group's, not the server's)
over SmolLM2 by default: one prefill of `--rows` prompts, then `--steps` greedy decode steps of
all rows together. Prints, per rank, its weight bytes and KV bytes per token, and on rank 0 the
median decode step, the prefill time and the greedy tokens (equal to the single process's).

    python -m scripts.distributed_steps --backend mlx --tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):", "The three primary colors are",
           "Water boils at", "My favourite food is", "In 1492, Columbus", "The quick brown fox"]


def _runtime(backend: str):
    if backend == "mlx":
        from mlxcel.backends.mlx import distributed
    else:
        from mlxcel.backends.torch import distributed
    return distributed


def _single(args) -> tuple[object, None]:
    if args.backend == "mlx":
        from mlxcel.backends.mlx.backend import MLXBackend

        return MLXBackend(args.model, dtype="float32"), None
    from mlxcel.backends.torch.backend import TorchBackend

    return TorchBackend(args.model, dtype="float32"), None


def _member(args):
    from mlxcel.backends.distributed import ShardOptions
    from mlxcel.backends.group import GroupBackend, follow, join
    from mlxcel.config.distributed import GroupSpec

    spec = GroupSpec(tp_size=args.tp, pp_size=args.pp, rank=args.rank, master_port=args.port, timeout_s=120,
                     launch="env")
    runtime = _runtime(args.backend)
    collective = runtime.connect(spec, "cpu")
    local = runtime.load_shard(Path(args.model), spec, collective, ShardOptions(dtype="float32"))
    sizes = join(local, collective, b"\0" * 32)
    if args.rank != 0:
        follow(local, collective)
        return None, None
    print(json.dumps({"ranks": [{"rank": s.rank, "weight_bytes": s.weight_bytes,
                                 "kv_bytes_per_token": s.kv_bytes_per_token} for s in sizes]}), flush=True)
    return GroupBackend(local, collective, spec, sizes, lambda why: print("group failed:", why, flush=True)), local


def _drive(backend, args) -> dict:
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.engine.kv_block_pool import BlockAllocator, SequenceKV
    from mlxcel.engine.tokenizer import Tokenizer

    allocator = BlockAllocator(64 * args.rows, 16)
    backend.bind_kv(allocator)
    tok = Tokenizer(args.model)
    prompts = [tok.encode(p) for p in PROMPTS[: args.rows]]
    seqs = [SequenceKV(allocator) for _ in prompts]
    t = time.perf_counter()
    logits = backend.forward([ForwardRow(p, s) for p, s in zip(prompts, seqs)])
    prefill = time.perf_counter() - t
    out, times = [[] for _ in prompts], []
    for _ in range(args.steps):
        nxt = logits.argmax(-1)
        for o, tid in zip(out, nxt):
            o.append(int(tid))
        t = time.perf_counter()
        logits = backend.forward([ForwardRow([int(i)], s, decode=True) for i, s in zip(nxt, seqs)])
        times.append(time.perf_counter() - t)
    times.sort()
    return {"prefill_ms": round(prefill * 1e3, 1), "decode_step_ms": round(times[len(times) // 2] * 1e3, 1),
            "tokens": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("mlx", "torch"), default="mlx")
    p.add_argument("--model", default=str(Path(os.environ.get("MLXCEL_MODELS_DIR", "models"))
                                          / "HuggingFaceTB/SmolLM2-135M-Instruct"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    world = args.tp * args.pp
    if world == 1:
        backend, _ = _single(args)
        print(json.dumps({"ranks": [{"rank": 0, "weight_bytes": backend.weight_nbytes,
                                     "kv_bytes_per_token": backend.kv_spec.bytes_per_token}]}))
        print(json.dumps(_drive(backend, args)))
        return
    if args.rank is None:  # the launcher: this process starts every rank and waits
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [sys.executable, "-m", "scripts.distributed_steps", *sys.argv[1:], "--port", str(port)]
        procs = [subprocess.Popen([*argv, "--rank", str(r)]) for r in range(world)]
        sys.exit(max(proc.wait() for proc in procs))
    group, _ = _member(args)
    if group is not None:
        print(json.dumps(_drive(group, args)), flush=True)
        group.close()


if __name__ == "__main__":
    main()
