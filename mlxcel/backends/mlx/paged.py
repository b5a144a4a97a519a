"""Paged KV storage on MLX, and the per-step batch view mlx-lm's families attend through.

Storage is one array per layer for keys and one for values, shaped [slots, kv_heads,
head_dim], where slot = block * block_size + offset. A step builds one `PagedBatchView`
per layer that honours mlxcel's cache protocol for a whole batch of rows: it scatters
each row's new keys/values into that row's slots, gathers every row's history right-
padded to the longest row, and builds the mask from per-row positions. RoPE reads
`offset` as a per-row array, so rows at different positions share one forward.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.backends.rows import causal_allowed, contiguous_start
from mlxcel.engine.backend import KVCacheTypes
from mlxcel.engine.kv_block_pool import NULL_BLOCK, SCRATCH_BLOCK, BlockAllocator, SequenceKV, grown_slots


class PagedStorage:
    """The per-layer key/value arrays behind a BlockAllocator; grows by doubling. A side stored
    "int8" (`types`) holds int8 values [slots, kv_heads, dim] and an fp32 absmax scale per slot
    and head (`key_scales` / `value_scales`); `put` quantizes as it writes, `take` dequantizes
    only the slots a step reads, just before its attention."""

    def __init__(self, allocator: BlockAllocator, num_layers: int, dtype, groups: list[int] | None = None,
                 types: KVCacheTypes | None = None) -> None:
        self.allocator = allocator
        self.groups = groups or [0] * num_layers  # each layer's block group (kv_block_pool.layer_groups)
        self.num_layers = num_layers
        self.dtype = dtype
        self.types = types or KVCacheTypes()
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.key_scales: list[mx.array | None] = [None] * num_layers
        self.value_scales: list[mx.array | None] = [None] * num_layers
        self._slots = 0

    def ensure(self, layer: int, kv_heads: int, k_dim: int, v_dim: int) -> None:
        have = 0 if self.keys[layer] is None else self.keys[layer].shape[0]
        new = grown_slots(self.allocator.group(self.groups[layer]), have)
        if new is None:
            return
        for data, scales, mode, dim in ((self.keys, self.key_scales, self.types.k, k_dim),
                                        (self.values, self.value_scales, self.types.v, v_dim)):
            grow = mx.zeros((new - have, kv_heads, dim), mx.int8 if mode == "int8" else self.dtype)
            data[layer] = grow if data[layer] is None else mx.concatenate([data[layer], grow])
            if mode == "int8":
                grow = mx.zeros((new - have, kv_heads), mx.float32)
                scales[layer] = grow if scales[layer] is None else mx.concatenate([scales[layer], grow])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def put(self, layer: int, write: mx.array, keys: mx.array, values: mx.array) -> None:
        """New keys / values [n, kv_heads, D] into slots `write`, quantized where stored so."""
        for data, scales, x in ((self.keys, self.key_scales, keys), (self.values, self.value_scales, values)):
            if scales[layer] is None:
                data[layer][write] = x
            else:
                q, sc = quantize_int8(x)
                data[layer][write] = q
                scales[layer][write] = sc

    def take(self, layer: int, read) -> tuple[mx.array, mx.array]:
        """Keys and values of slots `read` (an index array or a slice), [..., kv_heads, D] in
        the compute dtype: int8 records dequantized here, only the slots read."""
        out = []
        for data, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
            t = data[layer][read]
            if scales[layer] is not None:
                t = (t.astype(mx.float32) * scales[layer][read][..., None]).astype(self.dtype)
            out.append(t)
        return out[0], out[1]

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, group: int = 0) -> None:
        """Every stored array's [dst] = [src] in every layer of block group `group` (a context
        shift's compaction, a partial prefix's copy): int8 records move as they are, with their
        scales."""
        s, d = mx.array(src), mx.array(dst)
        layers = [li for li in range(self.num_layers) if self.keys[li] is not None and self.groups[li] == group]
        for li in layers:
            _, h, dk = self.keys[li].shape
            self.ensure(li, h, dk, self.values[li].shape[-1])  # dst blocks may be new
        held = [self.keys, self.values, self.key_scales, self.value_scales]
        # gathered and evaluated first: a scatter whose source still reads the pool cannot
        # reuse the pool's buffer and copies all of it (measured: 130 ms against 2 ms)
        got = [[h[li][s] if h[li] is not None else None for h in held] for li in layers]
        mx.eval([a for row in got for a in row if a is not None])
        for li, row in zip(layers, got):
            for h, a in zip(held, row):
                if a is not None:
                    h[li][d] = a
        mx.eval(*self.arrays())

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values + self.key_scales + self.value_scales if a is not None]


def quantize_int8(x: mx.array) -> tuple[mx.array, mx.array]:
    """x [..., D] as int8 values and an fp32 scale per vector (its absmax / 127)."""
    xf = x.astype(mx.float32)
    scale = mx.max(mx.abs(xf), axis=-1) / 127.0
    q = mx.clip(mx.round(xf / mx.maximum(scale, 1e-30)[..., None]), -127, 127)
    return q.astype(mx.int8), scale


class StepPlan:
    """Index arrays shared by every layer of one forward over `rows`."""

    def __init__(self, rows: list[tuple[SequenceKV, int]]) -> None:
        bs = rows[0][0].allocator.block_size
        self.n = [n for _, n in rows]
        self.offsets = [seq.length for seq, _ in rows]
        self.lengths = [o + n for o, n in zip(self.offsets, self.n)]
        b, nmax, lmax = len(rows), max(self.n), max(self.lengths)
        self.batch, self.nmax, self.lmax = b, nmax, lmax
        write = np.full((b, nmax), SCRATCH_BLOCK * bs, dtype=np.int64)
        read = np.full((b, lmax), NULL_BLOCK * bs, dtype=np.int64)
        for i, (seq, n) in enumerate(rows):
            write[i, :n] = seq.slots(self.offsets[i], self.lengths[i])
            read[i, : self.lengths[i]] = seq.slots(0, self.lengths[i])
        self.write = mx.array(write.reshape(-1))
        self.read = mx.array(read)
        self.read_start = contiguous_start(read)  # one row in order: its history is a slice
        # RoPE reads logical positions (ahead of the stored length after a context shift);
        # one row passes a plain int, as mlx-lm's own cache does
        positions = [seq.position for seq, _ in rows]
        self.offset = positions[0] if b == 1 else mx.array(np.asarray(positions, dtype=np.int32))
        self._masks: dict[int | None, mx.array] = {}
        # (row, [queries, keys] bool): pairs a row attends beyond causality (an image's tokens
        # seeing each other both ways, backends/mlx/vlm.py); set before the first mask is built
        self.opened: list[tuple[int, np.ndarray]] = []

    def mask(self, window: int | None) -> mx.array | None:
        if self.batch == 1 and self.nmax == 1 and (window is None or window >= self.lmax):
            return None  # one query that sees the whole history: no mask, as mlx-lm decodes
        if window not in self._masks:
            # query j of row i sits at position offset_i + j (padded queries repeat the last)
            j = np.minimum(np.arange(self.nmax)[None, :], np.asarray(self.n)[:, None] - 1)
            qpos = np.asarray(self.offsets)[:, None] + j  # [B, nmax]
            allowed = causal_allowed(qpos, self.lmax, window)
            for i, extra in self.opened:
                allowed[i, :extra.shape[0], :extra.shape[1]] |= extra
            self._masks[window] = mx.array(allowed[:, None])
        return self._masks[window]


class PagedBatchView:
    """One layer's cache, as mlx-lm sees it, for one step over a batch of rows."""

    def __init__(self, storage: PagedStorage, layer: int, plan: StepPlan, window: int | None = None) -> None:
        self.storage, self.layer, self.plan = storage, layer, plan
        self.window = window  # the layer's declared sliding window (engine.backend.layer_windows)
        self.offset = plan.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, n, dk = keys.shape
        dv = values.shape[-1]
        st, li = self.storage, self.layer
        st.ensure(li, h, dk, dv)
        st.put(li, self.plan.write, keys.transpose(0, 2, 1, 3).reshape(b * n, h, dk),
               values.transpose(0, 2, 1, 3).reshape(b * n, h, dv))
        if self.plan.read_start is not None:
            lo, hi = self.plan.read_start, self.plan.read_start + self.plan.lmax
            k, v = st.take(li, slice(lo, hi))
            k, v = k[None], v[None]
        else:
            k, v = st.take(li, self.plan.read)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return k, v

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        return self.plan.mask(window_size)

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes
