"""The KV-cache protocol mlxcel owns.

mlx-lm's family modules talk to a layer cache through these members: `offset` (the
position of the first new token; an int, or a per-row array for a batch), and
`update_and_fetch(keys, values)`, `make_mask(n, window_size=..., return_array=...)`.
Any object that honours them drops into every family unchanged. The paged batch view
(backends/mlx/paged.py) is the implementation the engine runs on; a quantized cache
implements the same members.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class LayerKVCache(Protocol):
    offset: int | mx.array

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False): ...
