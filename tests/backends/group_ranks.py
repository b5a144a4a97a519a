"""One rank of the distributed-shard check (tests/backends/test_group_shards.py), as its own process.

    python -m tests.backends.group_ranks RANK BASE_PORT OUT_JSON PROMPTS BACKEND:MODEL:TP:PP ...

For each configuration in turn, every rank of it joins a group on loopback (a fresh gloo group on
torch; on MLX the process's one ring group, which MLX forms once), loads its shard in fp32 and
(rank 0) drives a GroupBackend: every prompt prefilled in one step, then greedy decode steps over
all rows together. Rank 0 then runs the same steps on the backend's single-process model and
writes both token lists per configuration to OUT_JSON. Ranks beyond a configuration's size sit
it out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from mlxcel.backends.distributed import ShardOptions
from mlxcel.backends.group import GroupBackend, follow, join
from mlxcel.config.distributed import GroupSpec
from mlxcel.engine.backend import ForwardRow
from mlxcel.engine.kv_block_pool import BlockAllocator, SequenceKV
from mlxcel.engine.tokenizer import Tokenizer
from tests.fixtures import fixture_path

STEPS = 6
OPTIONS = ShardOptions(dtype="float32", threads=1)


def greedy(backend, prompts: list[list[int]]) -> list[list[int]]:
    allocator = BlockAllocator(256, 16)
    backend.bind_kv(allocator)
    seqs = [SequenceKV(allocator) for _ in prompts]
    out = backend.forward([ForwardRow(p, s) for p, s in zip(prompts, seqs)])
    tokens = [[int(np.argmax(o))] for o in out]
    for _ in range(STEPS - 1):
        out = backend.forward([ForwardRow(t[-1:], s, decode=True) for t, s in zip(tokens, seqs)])
        for t, o in zip(tokens, out):
            t.append(int(np.argmax(o)))
    return tokens


def single_process(backend: str, path):
    if backend == "mlx":
        from mlxcel.backends.mlx.backend import MLXBackend

        return MLXBackend(path, dtype="float32", threads=1)
    from mlxcel.backends.torch.backend import TorchBackend

    return TorchBackend(path, dtype="float32", threads=1)


def run(rank: int, port: int, config: str, prompts: list[str]) -> dict | None:
    backend, model, tp, pp = config.split(":")
    if backend == "mlx":
        from mlxcel.backends.mlx.distributed import connect, load_shard
    else:
        from mlxcel.backends.torch.distributed import connect, load_shard
    spec = GroupSpec(tp_size=int(tp), pp_size=int(pp), rank=rank, master_port=port, timeout_s=60)
    if rank >= spec.world:
        return None
    path = fixture_path(model)
    collective = connect(spec)
    local = load_shard(path, spec, collective, OPTIONS)
    sizes = join(local, collective, b"same checkpoint and settings".ljust(32))
    if rank:
        follow(local, collective)
        collective.close()
        return None
    group = GroupBackend(local, collective, spec, sizes, lambda reason: None)
    tok = Tokenizer(path)
    ids = [tok.encode(p) for p in prompts]
    got = greedy(group, ids)
    group.close()
    reference = greedy(single_process(backend, path), ids)
    return {"group": got, "reference": reference,
            "ranks": [{"weight_bytes": s.weight_bytes, "kv_bytes_per_token": s.kv_bytes_per_token} for s in sizes]}


def main(argv: list[str]) -> int:
    rank, port, out = int(argv[0]), int(argv[1]), Path(argv[2])
    prompts = json.loads(argv[3])
    results = {}
    for i, config in enumerate(argv[4:]):
        result = run(rank, port + i, config, prompts)
        if result is not None:
            results[config] = result
    if rank == 0:
        out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
