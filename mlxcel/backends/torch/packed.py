"""Packed steps on torch: rows of different lengths as one sequence through one forward.

The torch counterpart of backends/mlx/packed.py. A step that mixes a prefill chunk with
decode rows (base.RowLayout.packed) feeds transformers' family one [1, T] sequence of all its
tokens, with per-token position ids (transformers builds RoPE from them, so rotation needs no
seam). Attention is the one seam: the model runs under mlxcel's registered attention
implementation, which is transformers' SDPA unchanged except during a packed step, when each
row attends its own paged history: the one-token rows together (padded to their longest
history, as a decode step does), each longer row on its own with its causal mask, each group
through the same SDPA call a padded forward of those rows would make.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mlxcel.backends.base import RowLayout
from mlxcel.backends.torch.paged import _consecutive, _to_device
from mlxcel.engine.kv_block_pool import NULL_BLOCK, SequenceKV

IMPLEMENTATION = "mlxcel_packed"
_step = threading.local()  # the packed plan of the forward running on this thread, if any


@contextmanager
def packed_step(plan: PackedPlan):
    _step.plan = plan
    try:
        yield
    finally:
        _step.plan = None


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    plan = getattr(_step, "plan", None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    return plan.attend(module, query, scaling, dropout=dropout, **kwargs), None


AttentionInterface.register(IMPLEMENTATION, _attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def install(model) -> bool:
    """Run the model under the packed-aware attention; False (nothing changed) when the family
    refuses it, and its steps stay padded."""
    try:
        model.set_attn_implementation(IMPLEMENTATION)
    except (ValueError, ImportError, TypeError):
        return False
    return True


class _Group:
    """Rows attended together: their query token indices, history slots and query positions."""

    def __init__(self, tokens, read: np.ndarray, qpos: np.ndarray, device: torch.device) -> None:
        self.tokens = tokens  # a LongTensor of token indices (one-token rows) or a slice (one row)
        self.b, self.lmax = read.shape
        self.start = int(read[0, 0]) if self.b == 1 and _consecutive(read[0]) else None
        self.read = _to_device(read.reshape(-1), device)
        self.qpos, self.device = qpos, device
        self._masks: dict[tuple, torch.Tensor] = {}

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[b, 1, nq, lmax] additive, in the compute dtype (see paged.StepPlan.mask)."""
        if (window, dtype) not in self._masks:
            kpos = np.arange(self.lmax)[None, None, :]
            allowed = kpos <= self.qpos[:, :, None]
            if window is not None:
                allowed &= kpos > self.qpos[:, :, None] - window
            allowed = _to_device(np.ascontiguousarray(allowed[:, None]), self.device)
            additive = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            self._masks[(window, dtype)] = additive.masked_fill_(~allowed, torch.finfo(dtype).min)
        return self._masks[(window, dtype)]


class PackedPlan:
    """Index tensors and positions shared by every layer of one packed forward over `rows`."""

    packed = True

    def __init__(self, rows: list[tuple[SequenceKV, int]], layout: RowLayout, storage, device: torch.device) -> None:
        bs = rows[0][0].allocator.block_size
        self.layout, self.storage, self.device = layout, storage, device
        self.n = list(layout.n)
        self.offsets = [seq.length for seq, _ in rows]
        write = np.concatenate([seq.slots(o, o + n) for (seq, n), o in zip(rows, self.offsets)])
        self.write = _to_device(np.asarray(write, np.int64), device)
        # RoPE reads logical positions (ahead of the stored length after a context shift)
        pos = np.concatenate([seq.position + np.arange(n) for seq, n in rows]).astype(np.int64)
        self.position_ids = _to_device(pos[None], device)
        starts = layout.starts
        one = [i for i, n in enumerate(self.n) if n == 1]
        self.groups: list[_Group] = []
        order: list[int] = []
        if one:
            lmax = max(self.offsets[i] + 1 for i in one)
            read = np.full((len(one), lmax), NULL_BLOCK * bs, dtype=np.int64)
            for k, i in enumerate(one):
                read[k, : self.offsets[i] + 1] = rows[i][0].slots(0, self.offsets[i] + 1)
            idx = _to_device(np.asarray([starts[i] for i in one], np.int64), device)
            self.groups.append(_Group(idx, read, np.asarray([[self.offsets[i]] for i in one]), device))
            order += [starts[i] for i in one]
        for i, (seq, n) in enumerate(rows):
            if n > 1:
                read = np.asarray(seq.slots(0, self.offsets[i] + n), dtype=np.int64)[None]
                qpos = (self.offsets[i] + np.arange(n))[None]
                self.groups.append(_Group(slice(starts[i], starts[i] + n), read, qpos, device))
                order += range(starts[i], starts[i] + n)
        # the groups' outputs come out in `order`; this puts them back in token order
        self.unperm = None if order == sorted(order) else _to_device(np.argsort(order).astype(np.int64), device)

    def mask(self, window: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """What the model is handed as its mask: a placeholder (attention builds its own per group)."""
        return torch.zeros((1, 1, 1, 1), dtype=dtype, device=self.device)

    def attend(self, module, query: torch.Tensor, scaling: float | None, **kwargs) -> torch.Tensor:
        """[1, T, H, D] attention output for packed queries [1, H, T, D], each row over its
        history, through transformers' own SDPA call per group: the same call, on the same
        shapes, that a padded forward of those rows makes, so the packed step rounds alike."""
        layer, window = module.layer_idx, getattr(module, "sliding_window", None)
        keys, values = self.storage.keys[layer], self.storage.values[layer]
        _, kvh, dk = keys.shape
        dv = values.shape[-1]
        outs = []
        for g in self.groups:
            if isinstance(g.tokens, slice):
                q = query[:, :, g.tokens]
            else:
                q = query[0].index_select(1, g.tokens).transpose(0, 1).unsqueeze(2)  # [b, H, 1, D]
            if g.start is not None:
                k = keys.narrow(0, g.start, g.lmax).unsqueeze(0).transpose(1, 2)
                v = values.narrow(0, g.start, g.lmax).unsqueeze(0).transpose(1, 2)
            else:
                k = keys.index_select(0, g.read).view(g.b, g.lmax, kvh, dk).transpose(1, 2)
                v = values.index_select(0, g.read).view(g.b, g.lmax, kvh, dv).transpose(1, 2)
            o, _ = sdpa_attention_forward(module, q, k, v, g.mask(window, q.dtype), scaling=scaling, **kwargs)
            outs.append(o if isinstance(g.tokens, slice) else o.reshape(1, g.b, *o.shape[2:]))  # [1, n, H, D]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out if self.unperm is None else out.index_select(1, self.unperm)
