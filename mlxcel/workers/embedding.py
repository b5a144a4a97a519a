"""The embedding worker: text or token ids in, one pooled, normalized vector per input out.

Built once at startup from a resolved checkpoint path with the pooling and the normalize
default already decided (workers/checkpoint.py); requests may override the normalization per
call (`embd_normalize`). An input longer than the model's context is refused, never truncated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlxcel.workers import checkpoint as ck
from mlxcel.workers.encoder import Encoder, pad
from mlxcel.workers.vectors import normalize, pool

BATCH = 32  # inputs per forward; bounds padding waste and peak memory


class InputTooLong(ValueError):
    pass


class Stopped(Exception):
    """The job was asked to stop (its client left, or the server is shutting down)."""


def batches(n: int, cancelled: Callable[[], bool]) -> Iterator[int]:
    """Start offsets of BATCH-sized batches over `n` inputs; polls `cancelled` before each."""
    for start in range(0, n, BATCH):
        if cancelled():
            raise Stopped
        yield start


@dataclass
class EmbeddingWorker:
    id: str
    path: Path
    pooling: str
    normalize: int  # the default in force (flag, else the checkpoint's)
    n_ctx: int
    encoder: Encoder
    tokenizer: object
    created: int = field(default_factory=lambda: int(time.time()))

    kind = ck.EMBEDDING

    @classmethod
    def load(cls, model_id: str, path: Path, *, pooling: str, normalize: int | None,
             backend: str = "mlx") -> "EmbeddingWorker":
        return cls(model_id, path, pooling, ck.default_normalize(path) if normalize is None else normalize,
                   ck.context_length(path), Encoder(path, backend), ck.load_tokenizer(path))

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def embed(self, inputs: list[list[int]], embd_normalize: int | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> list[np.ndarray]:
        """Token lists (already carrying the model's special tokens) -> one vector each; `cancelled`
        is polled between batches (Stopped)."""
        mode = self.normalize if embd_normalize is None else embd_normalize
        for i, ids in enumerate(inputs):
            if len(ids) > self.n_ctx:
                raise InputTooLong(f"input {i} has {len(ids)} tokens, more than the embedding model's context "
                                   f"of {self.n_ctx} tokens")
        out: list[np.ndarray] = []
        for start in batches(len(inputs), cancelled):
            chunk = inputs[start : start + BATCH]
            ids, types, mask = pad([(row, [0] * len(row)) for row in chunk])
            pooled = pool(self.encoder.hidden(ids, types, mask), mask, self.pooling)
            out.extend(normalize(v, mode) for v in pooled)
        return out
