"""Decode and prefill throughput of one backend on one checkpoint, straight through the
backend interface (no HTTP): single-stream decode, an 8-row batched decode, a 128-token
prefill. Prints one line of JSON.

    python -m scripts.bench.decode_bench --backend torch --device cpu --dtype auto -m DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--backend", default="torch", choices=("mlx", "torch"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=-1)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()

    from mlxcel.engine.backend import ForwardRow
    from mlxcel.config.settings import BackendSection, ServerSettings
    from mlxcel.runtime.load import load_backend

    # build_env as served: the torch kernel for decode rows
    settings = ServerSettings(backend=BackendSection(name=args.backend, device=args.device, dtype=args.dtype,
                                                     threads=args.threads, build_env=dict(os.environ)))
    backend, choice = load_backend(settings, args.model)
    prompt = [(i * 37) % 1000 + 100 for i in range(128)]

    def sync():
        if choice.backend == "torch" and choice.device.startswith("cuda"):
            import torch
            torch.cuda.synchronize()

    seq = backend.new_sequence()
    backend.forward([ForwardRow(prompt[:8], seq)])  # warm-up
    seq.release()
    seq = backend.new_sequence()
    t = time.perf_counter()
    nxt = int(backend.forward([ForwardRow(prompt, seq)])[0].argmax())
    sync()
    prefill = len(prompt) / (time.perf_counter() - t)
    for _ in range(4):
        nxt = int(backend.forward([ForwardRow([nxt], seq, decode=True)])[0].argmax())
    t = time.perf_counter()
    for _ in range(args.steps):
        nxt = int(backend.forward([ForwardRow([nxt], seq, decode=True)])[0].argmax())
    single = args.steps / (time.perf_counter() - t)
    seqs = [backend.new_sequence() for _ in range(8)]
    for s in seqs:
        backend.forward([ForwardRow(prompt[:64], s)])
    t = time.perf_counter()
    for _ in range(args.steps // 2):
        backend.forward([ForwardRow([5], s, decode=True) for s in seqs])
    batched = 8 * (args.steps // 2) / (time.perf_counter() - t)
    print(json.dumps({"backend": choice.backend, "device": choice.device, "dtype": backend.info.dtype,
                      "prefill_tok_s": round(prefill, 1), "decode_tok_s": round(single, 1),
                      "decode_8rows_tok_s": round(batched, 1)}))


if __name__ == "__main__":
    main()
