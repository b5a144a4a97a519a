"""Paged KV storage on torch, and the transformers `Cache` one batched step attends through.

Storage mirrors the MLX backend's: one tensor per layer for keys and one for values, shaped
[slots, kv_heads, head_dim], slot = block * block_size + offset, with the same reserved
blocks (0 reads as zeros for padding, 1 absorbs padding writes). A `StepPlan` turns the
rows of one forward into index tensors shared by every layer; `PagedStepCache` is the
`transformers.cache_utils.Cache` the attention modules call `update(...)` on: it scatters
each row's new keys/values into its slots and gathers every row's history, right-padded to
the longest row. Masks are built here from per-row positions and handed to the model
ready-made (a 4-D additive tensor, or one per layer type), so transformers never sizes a
mask from the cache.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache

from mlxcel.backends.rows import causal_allowed, contiguous_start
from mlxcel.backends.torch import fused_ops, scores
from mlxcel.backends.torch.fused_ops import WINDOW_ATTR
from mlxcel.engine.kv_block_pool import NULL_BLOCK, SCRATCH_BLOCK, BlockAllocator, SequenceKV, grown_slots


class PagedStorage:
    """The per-layer key/value tensors behind a BlockAllocator; grows by doubling."""

    def __init__(self, allocator: BlockAllocator, num_layers: int, dtype: torch.dtype, device: torch.device,
                 groups: list[int] | None = None) -> None:
        self.allocator = allocator
        self.groups = groups or [0] * num_layers  # each layer's block group (kv_block_pool.layer_groups)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def ensure(self, layer: int, kv_heads: int, k_dim: int, v_dim: int) -> None:
        have = 0 if self.keys[layer] is None else self.keys[layer].shape[0]
        new = grown_slots(self.allocator.group(self.groups[layer]), have)
        if new is None:
            return
        k = torch.zeros((new, kv_heads, k_dim), dtype=self.dtype, device=self.device)
        v = torch.zeros((new, kv_heads, v_dim), dtype=self.dtype, device=self.device)
        if have:
            k[:have] = self.keys[layer]
            v[:have] = self.values[layer]
        self.keys[layer], self.values[layer] = k, v

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, group: int = 0) -> None:
        """keys/values[dst] = keys/values[src] in every layer of block group `group` (a context
        shift's compaction, a partial prefix's copy)."""
        s, d = _to_device(np.asarray(src, np.int64), self.device), _to_device(np.asarray(dst, np.int64), self.device)
        for li, keys in enumerate(self.keys):
            if keys is not None and self.groups[li] == group:
                _, h, dk = keys.shape
                self.ensure(li, h, dk, self.values[li].shape[-1])  # dst blocks may be new
                # index_select copies first, so overlapping src/dst ranges read the old values
                self.keys[li].index_copy_(0, d, self.keys[li].index_select(0, s))
                self.values[li].index_copy_(0, d, self.values[li].index_select(0, s))


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cuda":  # pinned host memory lets the copy overlap the launch queue
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def additive_mask(allowed: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A boolean visibility array as SDPA's additive mask: 0 where allowed, dtype's minimum not."""
    allowed_t = _to_device(np.ascontiguousarray(allowed), device)
    return torch.zeros(allowed_t.shape, dtype=dtype, device=device).masked_fill_(~allowed_t, torch.finfo(dtype).min)


class StepPlan:
    """Index tensors, positions and masks shared by every layer of one forward over `rows`."""

    packed = False  # rows right-padded to the longest (backends/torch/packed.PackedPlan packs them)

    def __init__(self, rows: list[tuple[SequenceKV, int]], device: torch.device, storage: PagedStorage | None = None,
                 decode: list[bool] | None = None, prompts: bool = True) -> None:
        """`decode`: which rows are one-token decode rows; given when the kernels (fused_ops.py)
        are in use over `storage`, and then every query of a step with a decode row attends
        through them, one at a time (decode rows through decode_attention, prompt tokens through
        prompt_attention), and of any step with `prompts`; else SDPA."""
        self.storage = storage
        bs = rows[0][0].allocator.block_size
        self.n = [n for _, n in rows]
        self.offsets = [seq.length for seq, _ in rows]
        self.lengths = [o + n for o, n in zip(self.offsets, self.n)]
        b, nmax, lmax = len(rows), max(self.n), max(self.lengths)
        self.batch, self.nmax, self.lmax = b, nmax, lmax
        self.device = device
        write = np.full((b, nmax), SCRATCH_BLOCK * bs, dtype=np.int64)
        read = np.full((b, lmax), NULL_BLOCK * bs, dtype=np.int64)
        for i, (seq, n) in enumerate(rows):
            write[i, :n] = seq.slots(self.offsets[i], self.lengths[i])
            read[i, : self.lengths[i]] = seq.slots(0, self.lengths[i])
        # query j of row i sits at slot offset_i + j; padded queries repeat the last
        j = np.minimum(np.arange(nmax)[None, :], np.asarray(self.n)[:, None] - 1)
        self._qpos = np.asarray(self.offsets)[:, None] + j  # [B, nmax]
        # RoPE reads logical positions (ahead of the stored length after a context shift)
        shift = np.asarray([seq.position - seq.length for seq, _ in rows], dtype=np.int64)
        self.write = _to_device(write.reshape(-1), device)
        self.read = _to_device(read.reshape(-1), device)
        # one row whose slots run in order (a fresh pool's blocks) reads its history as a view
        self.read_start = contiguous_start(read)
        self.position_ids = _to_device(self._qpos.astype(np.int64) + shift[:, None], device)
        self._masks: dict[int | None, torch.Tensor] = {}
        # every query through the kernels, over its row's slots up to its own position: a prompt
        # token's bits then do not depend on how its prompt was split into chunks (a cached
        # prefix plus the rest, or whole), as SDPA's blocking made them
        self.rowwise = decode is not None and (prompts or any(decode))
        # every row a decode row: the kernel also stores their keys and values, so nothing is
        # stored or gathered before attention
        self.decode_all = self.rowwise and nmax == 1 and all(decode)
        if self.rowwise:
            table = self.read.view(b, lmax)
            self.table = table if nmax == 1 else table.repeat_interleave(nmax, 0) if b > 1 else table
            self.kv_lengths = _to_device((self._qpos + 1).reshape(-1).astype(np.int64), device)
            # decode rows beside one-token prompt rows: each kind through its own op
            dec = [i for i, d in enumerate(decode) if d and self.n[i] == 1]
            self.split = None
            if dec and not self.decode_all:
                rest = sorted(set(range(b)) - set(dec))
                self.split = tuple(_to_device(np.asarray(x, np.int64), device) for x in (dec, rest))

    def of(self, layer: int) -> StepPlan:
        return self  # one block group (packed.GroupPlans routes several)

    def mask(self, window: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[B, 1, nmax, lmax] additive: 0 where a query may attend a key, dtype's minimum where
        not. Built once per step in the compute dtype: a boolean mask would be converted to
        this form again inside every layer's attention call."""
        if self.rowwise:  # the kernel masks by length (and window) itself
            return torch.zeros((1, 1, 1, 1), dtype=dtype, device=self.device)
        if window not in self._masks:
            self._masks[window] = additive_mask(causal_allowed(self._qpos, self.lmax, window)[:, None], dtype, self.device)
        return self._masks[window]

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """The attention output [B, nmax, H, D] for this step's padded rows [B, H, nmax, D]:
        through the kernels (fused_ops.py) where they are in use and the family's attention is
        their kind, else SDPA (or scores.py's soft-capped / sink attention) over the gathered history."""
        if not self.rowwise:  # PagedStepCache.update stored and gathered the history
            return scores.attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    **kwargs)
        layer = module.layer_idx
        keys, values = self.storage.keys[layer], self.storage.values[layer]
        if fused_ops.attention_fits(query, dropout, kwargs):
            b, h, n, d = query.shape
            q = query[:, :, 0] if n == 1 else query.transpose(1, 2).reshape(b * n, h, d)
            if self.decode_all:  # the rows' new keys and values are stored by the same call
                out = fused_ops.decode_attention(module, q, keys, values, self.table, self.kv_lengths, scaling,
                                                 (key[:, :, 0], value[:, :, 0], self.write))
            elif self.split is None:  # prompt rows only
                out = fused_ops.prompt_attention(module, q, keys, values, self.table, self.kv_lengths, scaling)
            else:
                dec, rest = self.split
                out = torch.empty(b, h, value.shape[-1], dtype=query.dtype, device=query.device)
                out[dec] = fused_ops.decode_attention(module, q[dec], keys, values, self.table[dec],
                                                      self.kv_lengths[dec], scaling)
                out[rest] = fused_ops.prompt_attention(module, q[rest], keys, values, self.table[rest],
                                                       self.kv_lengths[rest], scaling)
            return out.view(b, n, h, -1), None
        if self.decode_all:  # not the kernel's kind of attention: store, then SDPA as without it
            store(self.storage, layer, self.write, key, value)
        key, value = self.gather(layer)
        if expands_cache(module):  # MLA's latent pair (the kernels are off for it; kept whole here too)
            key, value = module.expand_kv(key, value)
        window = getattr(module, WINDOW_ATTR, None)
        mask = additive_mask(causal_allowed(self._qpos, self.lmax, window)[:, None], query.dtype, self.device)
        return scores.attention(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's history of `layer` [B, kv_heads, lmax, D], right-padded."""
        keys, values = self.storage.keys[layer], self.storage.values[layer]
        _, h, dk = keys.shape
        dv = values.shape[-1]
        if self.read_start is not None:
            k = keys.narrow(0, self.read_start, self.lmax).unsqueeze(0).transpose(1, 2)
            v = values.narrow(0, self.read_start, self.lmax).unsqueeze(0).transpose(1, 2)
            return k, v
        k = keys.index_select(0, self.read).view(self.batch, self.lmax, h, dk).transpose(1, 2)
        v = values.index_select(0, self.read).view(self.batch, self.lmax, h, dv).transpose(1, 2)
        return k, v


def expands_cache(module) -> bool:
    """Whether an attention module caches something other than its keys and values and makes
    them from what the cache returns (transformers' DeepSeek V2/V3: the latent and rotary key)."""
    return callable(getattr(module, "expand_kv", None))


def store(storage: PagedStorage, layer: int, write: torch.Tensor, key_states: torch.Tensor,
          value_states: torch.Tensor) -> None:
    """A step's new keys/values [B, kv_heads, n, D] into their slots `write` [B * n]."""
    b, h, n, dk = key_states.shape
    keys, values = storage.keys[layer], storage.values[layer]
    keys.index_copy_(0, write, key_states.transpose(1, 2).reshape(b * n, h, dk).to(keys.dtype))
    values.index_copy_(0, write, value_states.transpose(1, 2).reshape(b * n, h, -1).to(values.dtype))


class PagedStepCache(Cache):
    """The transformers cache for one step: every layer reads and writes the paged storage."""

    is_compileable = False

    def __init__(self, storage: PagedStorage, plan: StepPlan) -> None:
        super().__init__(layers=[])
        self.storage, self.plan = storage, plan

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        _, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        st, plan = self.storage, self.plan.of(layer_idx)
        st.ensure(layer_idx, h, dk, dv)
        if plan.decode_all:  # the decode kernel stores them as it attends (StepPlan.attend)
            return key_states, value_states
        store(st, layer_idx, plan.write, key_states, value_states)
        if plan.packed or plan.rowwise:
            return key_states, value_states  # attention reads each row's history itself
        return plan.gather(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.plan.offsets)

    def __len__(self) -> int:
        return len(self.storage.keys)
