"""The KV-cache protocol mlxcel owns, and its dense per-sequence implementation.

mlx-lm's family modules talk to a cache through four members: `offset` (tokens already
stored, which is also the RoPE position of the next token), `update_and_fetch(k, v)`,
`make_mask(n, window_size=..., return_array=...)` and `nbytes`. Any cache that honours
this protocol drops into every family unchanged; paged and quantized caches implement
the same members. A sliding-window layer keeps a dense store and masks by window, so all
layers of a sequence share one layout (which the prompt cache relies on).
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask


class LayerKVCache(Protocol):
    offset: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False): ...

    @property
    def nbytes(self) -> int: ...


class DenseKVCache:
    """Keys and values of one layer of one sequence, grown in fixed steps."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            b, h, _, dk = keys.shape
            dv = values.shape[3]
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((b, h, grow, dk), keys.dtype)
            new_v = mx.zeros((b, h, grow, dv), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.offset += n
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        return create_attention_mask_at(n, self.offset, window_size, return_array)

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens (used to roll back speculative or re-fed tokens)."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


def create_attention_mask_at(n: int, offset: int, window_size: int | None, return_array: bool):
    from mlx_lm.models.base import create_causal_mask

    if n == 1 and (window_size is None or offset < window_size):
        return None
    if return_array or (window_size is not None and offset + n > window_size):
        return create_causal_mask(n, offset, window_size=window_size)
    return "causal"


class SequenceCache:
    """All layers' caches of one sequence, plus the tokens they hold."""

    def __init__(self, layers: list[LayerKVCache]) -> None:
        self.layers = layers
        self.tokens: list[int] = []

    @property
    def offset(self) -> int:
        return self.layers[0].offset if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)


def new_dense_cache(num_layers: int) -> SequenceCache:
    return SequenceCache([DenseKVCache() for _ in range(num_layers)])


__all__ = ["LayerKVCache", "DenseKVCache", "SequenceCache", "new_dense_cache", "create_attention_mask"]
