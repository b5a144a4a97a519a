"""Packed steps on torch: rows of different lengths as one sequence through one forward.

The torch counterpart of backends/mlx/packed.py. A step that mixes a prefill chunk with
decode rows (base.RowLayout.packed) feeds transformers' family one [1, T] sequence of all its
tokens, with per-token position ids (transformers builds RoPE from them, so rotation needs no
seam). Attention is the one seam: the model runs under mlxcel's registered attention
implementation, which hands each layer's attention to the step's plan (transformers' SDPA
unchanged outside a step). In a packed step each row attends its own paged history: where
mlxcel's kernels are loaded (fused_ops.py) decode rows through them, one at a time, as in a
padded step (decode_attention), and prompt tokens too where the plan says (prompt_attention);
other groups as without the kernels: the one-token rows together (padded to their longest
history, as a decode step does) and each longer row on its own with its causal mask, each
group through the same SDPA call a padded forward of those rows would make. Multi-head latent
attention (DeepSeek V2/V3) hands the cache its compressed latent and shared rotary key, and
expands them to per-head keys and values only after the cache returns them (`expand_kv`): the
pool holds that pair, and a group expands what it reads the same way.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mlxcel.backends.rows import AttendGroup, RowLayout, attend_groups, contiguous_start, packed_positions
from mlxcel.backends.torch import fused_ops, scores
from mlxcel.backends.torch.paged import WINDOW_ATTR, _to_device, additive_mask, expands_cache
from mlxcel.engine.kv_block_pool import NULL_BLOCK, SequenceKV

IMPLEMENTATION = "mlxcel_packed"
_step = threading.local()  # the plan (packed or paged.StepPlan) of the forward running on this thread


@contextmanager
def step_plan(plan):
    _step.plan = plan
    try:
        yield
    finally:
        _step.plan = None


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    plan = getattr(_step, "plan", None)
    if plan is None:
        return scores.attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                **kwargs)
    return plan.attend(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)


class GroupPlans:
    """A step's plans, one per block group (kv_block_pool.group_rows): each layer stores and
    attends through its group's (`of`). Masks and positions are the same in every group (the
    rows' tokens and positions are), so everything else is the first plan's."""

    def __init__(self, plans: list, groups: list[int]) -> None:
        self.plans, self.groups = plans, groups

    def __getattr__(self, name: str):
        return getattr(self.plans[0], name)

    def of(self, layer: int):
        return self.plans[self.groups[layer]]

    def attend(self, module, *args, **kwargs):
        return self.of(module.layer_idx).attend(module, *args, **kwargs)


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
    """One attention group (base.AttendGroup) as torch index tensors, with its masks."""

    def __init__(self, g: AttendGroup, device: torch.device, kernel: bool = False, decode: list[int] | None = None) -> None:
        """`kernel`: the group's queries attend through the kernels, one at a time; `decode`:
        which of its rows are decode rows (one-token groups only), the rest prompt tokens."""
        self.g, self.device = g, device
        self.tokens = g.tokens if isinstance(g.tokens, slice) else _to_device(np.asarray(g.tokens, np.int64), device)
        self.b, self.lmax = g.read.shape
        self.start = contiguous_start(g.read)
        self.read = _to_device(g.read.reshape(-1), device)
        self._masks: dict[tuple, torch.Tensor] = {}
        self.kernel = kernel
        if kernel:  # one table row per one-token row, or one longer row's table shared by its queries
            self.table = self.read.view(self.b, self.lmax)
            self.kv_lengths = _to_device(g.qpos.reshape(-1).astype(np.int64) + 1, device)
            # (decode rows, prompt rows) of a one-token group; None: all prompt tokens
            self.split = None
            if decode:
                rest = sorted(set(range(self.b)) - set(decode))
                self.split = tuple(_to_device(np.asarray(x, np.int64), device) for x in (decode, rest))

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[b, 1, nq, lmax] additive, in the compute dtype (see paged.StepPlan.mask)."""
        if (window, dtype) not in self._masks:
            self._masks[(window, dtype)] = additive_mask(self.g.allowed(window), dtype, self.device)
        return self._masks[(window, dtype)]


class PackedPlan:
    """Index tensors and positions shared by every layer of one packed forward over `rows`."""

    packed = True
    decode_all = False  # (paged.StepPlan's flag) a packed step stores its keys and values before attending

    def __init__(self, rows: list[tuple[SequenceKV, int]], layout: RowLayout, storage, device: torch.device,
                 decode: list[bool] | None = None, prompts: bool = True) -> None:
        """`decode`: which rows are decode rows; given when the kernels (fused_ops.py) are in
        use, and then the one-token group attends through them where it holds a decode row,
        and every group with `prompts` (else SDPA per group)."""
        bs = rows[0][0].allocator.block_size
        self.storage, self.device = storage, device
        self.offsets = [seq.length for seq, _ in rows]  # get_seq_length reads these
        write, pos = packed_positions(rows)
        self.write = _to_device(write, device)
        self.position_ids = _to_device(pos[None], device)
        groups, order = attend_groups(rows, layout, NULL_BLOCK * bs)
        one = [i for i, (_, n) in enumerate(rows) if n == 1]  # attend_groups' first group, if any
        dec = [k for k, i in enumerate(one) if decode and decode[i]]
        kernel = decode is not None and (prompts or bool(dec))
        self.groups = [_Group(g, device, kernel and (prompts or isinstance(g.tokens, list)),
                              dec if isinstance(g.tokens, list) else None) for g in groups]
        # the groups' outputs come out in `order`; this puts them back in token order
        self.unperm = None if order == sorted(order) else _to_device(np.argsort(order).astype(np.int64), device)

    def of(self, layer: int) -> PackedPlan:
        return self  # one block group (GroupPlans routes several)

    def mask(self, window: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """What the model is handed as its mask: a placeholder (attention builds its own per group)."""
        return torch.zeros((1, 1, 1, 1), dtype=dtype, device=self.device)

    def attend(self, module, query: torch.Tensor, key, value, attention_mask, scaling: float | None,
               dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
        """[1, T, H, D] attention output for packed queries [1, H, T, D], each row over its
        history: through the kernels, one query at a time, as in a padded step, where its group
        takes them; else through transformers' own SDPA call per group: the same call, on the same
        shapes, that a padded forward of those rows makes, so the packed step rounds alike."""
        layer, window = module.layer_idx, getattr(module, WINDOW_ATTR, None)
        keys, values, quant = self.storage.kernel_operands(layer)
        kvh, dk, dv = self.storage.head_dims(layer)
        fits = fused_ops.attention_fits(query, dropout, kwargs)
        outs = []
        for g in self.groups:
            if isinstance(g.tokens, slice):
                q = query[:, :, g.tokens]
            else:
                q = query[0].index_select(1, g.tokens).transpose(0, 1).unsqueeze(2)  # [b, H, 1, D]
            if g.kernel and fits:
                rows = q[0].transpose(0, 1) if isinstance(g.tokens, slice) else q[:, :, 0]  # [queries, H, D]
                if g.split is None:
                    o = fused_ops.prompt_attention(module, rows, keys, values, g.table, g.kv_lengths, scaling,
                                                   quant=quant)
                else:
                    dec, rest = g.split
                    o = torch.empty(rows.shape[0], rows.shape[1], dv, dtype=rows.dtype, device=rows.device)
                    o[dec] = fused_ops.decode_attention(module, rows[dec], keys, values, g.table[dec],
                                                        g.kv_lengths[dec], scaling, quant=quant)
                    if len(rest):
                        o[rest] = fused_ops.prompt_attention(module, rows[rest], keys, values, g.table[rest],
                                                             g.kv_lengths[rest], scaling, quant=quant)
                outs.append(o.unsqueeze(0))  # [1, queries, H, D]
                continue
            if g.start is not None:  # dequantized here where stored quantized: only the rows read
                k, v = self.storage.take(layer, start=g.start, length=g.lmax)
                k, v = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
            else:
                k, v = self.storage.take(layer, g.read)
                k = k.view(g.b, g.lmax, kvh, dk).transpose(1, 2)
                v = v.view(g.b, g.lmax, kvh, dv).transpose(1, 2)
            if expands_cache(module):  # the pool holds MLA's latent: the module makes keys and values of it
                k, v = module.expand_kv(k, v)
            o, _ = scores.attention(module, q, k, v, g.mask(window, q.dtype), dropout=dropout, scaling=scaling,
                                    **kwargs)
            outs.append(o if isinstance(g.tokens, slice) else o.reshape(1, g.b, *o.shape[2:]))  # [1, n, H, D]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return (out if self.unperm is None else out.index_select(1, self.unperm)), None
