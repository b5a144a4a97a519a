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
from mlxcel.backends.torch.kv_codecs import TurboCodec, quantize_int8
from mlxcel.engine.backend import KVCacheTypes
from mlxcel.engine.kv_turbo import TURBO_BITS
from mlxcel.engine.kv_block_pool import NULL_BLOCK, SCRATCH_BLOCK, BlockAllocator, SequenceKV, grown_slots


class PagedStorage:
    """The per-layer key/value tensors behind a BlockAllocator; grows by doubling. A side's
    mode (`types`) sets its records: the compute dtype [slots, kv_heads, dim]; "int8", int8
    values [slots, kv_heads, dim]; "turbo4" / "turbo3", packed codes uint8 [slots, kv_heads,
    dim * bits / 8] (kv_codecs.TurboCodec); the quantized ones with an fp32 scale per slot and
    head (`key_scales` / `value_scales`, [slots, kv_heads]). `put` quantizes as it writes, `take`
    dequantizes what it reads, and the kernels read the records directly."""

    def __init__(self, allocator: BlockAllocator, num_layers: int, dtype: torch.dtype, device: torch.device,
                 groups: list[int] | None = None, types: KVCacheTypes | None = None) -> None:
        self.allocator = allocator
        self.groups = groups or [0] * num_layers  # each layer's block group (kv_block_pool.layer_groups)
        self.dtype, self.device = dtype, device
        self.types = types or KVCacheTypes()
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.key_scales: list[torch.Tensor | None] = [None] * num_layers
        self.value_scales: list[torch.Tensor | None] = [None] * num_layers
        self.dims: list[tuple[int, int, int] | None] = [None] * num_layers  # (kv_heads, k_dim, v_dim) once sized
        self._codecs: dict[tuple[str, int], TurboCodec] = {}

    def codec(self, mode: str, dim: int) -> TurboCodec | None:
        """A turbo side's codec for heads of `dim` (None for f16 and int8)."""
        if mode not in TURBO_BITS:
            return None
        if (mode, dim) not in self._codecs:
            self._codecs[mode, dim] = TurboCodec(TURBO_BITS[mode], dim, self.device)
        return self._codecs[mode, dim]

    def _sides(self, layer: int):
        """(records, scales, codec) of the keys, then the values, of a sized layer."""
        _, dk, dv = self.dims[layer]
        return ((self.keys, self.key_scales, self.codec(self.types.k, dk)),
                (self.values, self.value_scales, self.codec(self.types.v, dv)))

    def ensure(self, layer: int, kv_heads: int, k_dim: int, v_dim: int) -> None:
        have = 0 if self.keys[layer] is None else self.keys[layer].shape[0]
        new = grown_slots(self.allocator.group(self.groups[layer]), have)
        if new is None:
            return
        self.dims[layer] = (kv_heads, k_dim, v_dim)
        for data, scales, mode, dim in ((self.keys, self.key_scales, self.types.k, k_dim),
                                        (self.values, self.value_scales, self.types.v, v_dim)):
            codec = self.codec(mode, dim)
            width, dtype = (codec.record, torch.uint8) if codec else (dim, torch.int8 if mode == "int8" else self.dtype)
            t = torch.zeros((new, kv_heads, width), dtype=dtype, device=self.device)
            if have:
                t[:have] = data[layer]
            data[layer] = t
            if mode != "f16":
                sc = torch.zeros((new, kv_heads), dtype=torch.float32, device=self.device)
                if have:
                    sc[:have] = scales[layer]
                scales[layer] = sc

    @property
    def nbytes(self) -> int:
        held = self.keys + self.values + self.key_scales + self.value_scales
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def put(self, layer: int, write: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New keys / values [n, kv_heads, D] into slots `write` [n], quantized where stored so."""
        for (data, scales, codec), x in zip(self._sides(layer), (keys, values)):
            if scales[layer] is None:
                data[layer].index_copy_(0, write, x.to(data[layer].dtype))
                continue
            q, sc = codec.quantize(x) if codec else quantize_int8(x)
            data[layer].index_copy_(0, write, q)
            scales[layer].index_copy_(0, write, sc)

    def take(self, layer: int, read: torch.Tensor | None = None, start: int = 0,
             length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots `read` (or the `length` slots from `start`), [n, kv_heads, D]
        in the compute dtype: quantized records dequantized here, only the rows read."""
        out = []
        for data, scales, codec in self._sides(layer):
            t = data[layer].index_select(0, read) if read is not None else data[layer].narrow(0, start, length)
            if scales[layer] is not None:
                sc = scales[layer].index_select(0, read) if read is not None else scales[layer].narrow(0, start, length)
                t = codec.dequantize(t, sc, self.dtype) if codec else \
                    (t.to(torch.float32) * sc.unsqueeze(-1)).to(self.dtype)
            out.append(t)
        return out[0], out[1]

    def kernel_operands(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, fused_ops.KVQuantOperands]:
        """(keys, values, their quantized sides' operands) as the kernels read them."""
        (_, _, kc), (_, _, vc) = self._sides(layer)
        quant = fused_ops.KVQuantOperands(self.key_scales[layer], kc and kc.levels, kc and kc.signs,
                                          self.value_scales[layer], vc and vc.levels, vc and vc.signs)
        return self.keys[layer], self.values[layer], quant

    def head_dims(self, layer: int) -> tuple[int, int, int]:
        """(kv_heads, key dim, value dim) of a sized layer, whatever its records hold."""
        return self.dims[layer]

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, group: int = 0) -> None:
        """Every stored tensor's [dst] = [src] in every layer of block group `group` (a context
        shift's compaction, a partial prefix's copy): quantized records move as they are, with
        their scales."""
        s, d = _to_device(np.asarray(src, np.int64), self.device), _to_device(np.asarray(dst, np.int64), self.device)
        for li, keys in enumerate(self.keys):
            if keys is not None and self.groups[li] == group:
                self.ensure(li, *self.dims[li])  # dst blocks may be new
                for held in (self.keys, self.values, self.key_scales, self.value_scales):
                    if held[li] is not None:
                        # index_select copies first, so overlapping src/dst ranges read the old values
                        held[li].index_copy_(0, d, held[li].index_select(0, s))


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
        keys, values, quant = self.storage.kernel_operands(layer)
        if fused_ops.attention_fits(query, dropout, kwargs):
            b, h, n, d = query.shape
            q = query[:, :, 0] if n == 1 else query.transpose(1, 2).reshape(b * n, h, d)
            if self.decode_all:  # the rows' new keys and values are stored (quantized where int8) by the same call
                out = fused_ops.decode_attention(module, q, keys, values, self.table, self.kv_lengths, scaling,
                                                 (key[:, :, 0], value[:, :, 0], self.write), quant=quant)
            elif self.split is None:  # prompt rows only
                out = fused_ops.prompt_attention(module, q, keys, values, self.table, self.kv_lengths, scaling,
                                                 quant=quant)
            else:
                dec, rest = self.split
                out = torch.empty(b, h, value.shape[-1], dtype=query.dtype, device=query.device)
                out[dec] = fused_ops.decode_attention(module, q[dec], keys, values, self.table[dec],
                                                      self.kv_lengths[dec], scaling, quant=quant)
                out[rest] = fused_ops.prompt_attention(module, q[rest], keys, values, self.table[rest],
                                                       self.kv_lengths[rest], scaling, quant=quant)
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
        """Every row's history of `layer` [B, kv_heads, lmax, D], right-padded (dequantized
        where stored int8)."""
        if self.read_start is not None:
            k, v = self.storage.take(layer, start=self.read_start, length=self.lmax)
            return k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
        k, v = self.storage.take(layer, self.read)
        k = k.view(self.batch, self.lmax, *k.shape[1:]).transpose(1, 2)
        v = v.view(self.batch, self.lmax, *v.shape[1:]).transpose(1, 2)
        return k, v


def expands_cache(module) -> bool:
    """Whether an attention module caches something other than its keys and values and makes
    them from what the cache returns (transformers' DeepSeek V2/V3: the latent and rotary key)."""
    return callable(getattr(module, "expand_kv", None))


def store(storage: PagedStorage, layer: int, write: torch.Tensor, key_states: torch.Tensor,
          value_states: torch.Tensor) -> None:
    """A step's new keys/values [B, kv_heads, n, D] into their slots `write` [B * n]."""
    b, h, n, dk = key_states.shape
    storage.put(layer, write, key_states.transpose(1, 2).reshape(b * n, h, dk),
                value_states.transpose(1, 2).reshape(b * n, h, -1))


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
