"""Packed steps on MLX: rows of different lengths as one sequence through one forward.

A step that mixes a prefill chunk with decode rows (base.RowLayout.packed) feeds the mlx-lm
family all its tokens as one [1, T] sequence, so every linear, norm and MLP runs once over
all rows and no decode row is padded to a chunk's width. Two places must still see rows:
RoPE (each token at its own row's position) and attention (each row attends only its own
history). mlxcel owns both seams (`install`): each attention's `rope` gets a subclass that
also takes a per-token position array, and the family module's `scaled_dot_product_attention`
name points at a dispatcher that hands a packed view's attention to the view. The view attends
per row group: the one-token rows together (padded to their longest history, as a decode step
does), each longer row on its own with its causal mask. A family that computes its attention
scores itself, because it soft-caps them (Gemma 2), has no such name: its attention modules get
mlxcel's forward instead (`_own_scores_class`), which reaches the same dispatcher with the cap.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base as mlx_base

from mlxcel.backends.mlx import scores
from mlxcel.backends.mlx.paged import PagedBatchView
from mlxcel.backends.rows import AttendGroup, RowLayout, attend_groups, contiguous_start, packed_positions
from mlxcel.engine.kv_block_pool import NULL_BLOCK, SequenceKV

_sdpa = mlx_base.scaled_dot_product_attention


class TokenPositions:
    """A packed step's RoPE offset: every token's logical position, [T] int32."""

    def __init__(self, positions: mx.array) -> None:
        self.positions = positions


class PackedMask:
    """What a packed view's make_mask returns: only the window, read back by `attend`."""

    def __init__(self, window: int | None) -> None:
        self.window = window


_PACKED_ROPE: dict[type, type] = {}


def _packed_rope_class(cls: type) -> type:
    """A family's RoPE class that also takes per-token positions; everything else unchanged
    (the module keeps its attributes: base, scale, dims)."""
    if cls not in _PACKED_ROPE:

        def __call__(self, x, offset=0):
            if isinstance(offset, TokenPositions):
                # [1, H, T, D] as T one-token rows: mx.fast.rope takes one offset per batch entry
                return cls.__call__(self, x.swapaxes(0, 2), offset=offset.positions).swapaxes(0, 2)
            return cls.__call__(self, x, offset=offset)

        _PACKED_ROPE[cls] = type(f"Packed{cls.__name__}", (cls,), {"__call__": __call__})
    return _PACKED_ROPE[cls]


def _dispatch_sdpa(queries, keys, values, cache, scale, mask, sinks=None, softcap=None):
    if isinstance(cache, PackedBatchView):
        return cache.attend(queries, scale, mask, sinks, softcap)
    if isinstance(cache, PagedBatchView):
        if cache.window is not None:
            # the layer's declared window, whatever mask the family built (mlx-lm's llama, phi3,
            # starcoder2 and gemma2 build none for a config's sliding_window)
            mask = cache.plan.mask(cache.window)
        return scores.attention(queries, keys, values, scale, mask, sinks, softcap)
    return _sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


# what mlxcel's forward reads from a family attention module that computes its own scores
_OWN_SCORES_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads", "scale",
                     "attn_logit_softcapping")
_OWN_SCORES: dict[type, type] = {}


def _own_scores_class(cls: type) -> type:
    """A soft-capping family's attention class whose forward, over one of mlxcel's views, is
    mlxcel's: the family's projections and RoPE, then the dispatcher with the cap, so windows,
    packed rows and the cap all come from one place; under any other cache it is the family's."""
    if cls not in _OWN_SCORES:

        def __call__(self, x, mask=None, cache=None):
            if not isinstance(cache, (PagedBatchView, PackedBatchView)):
                return cls.__call__(self, x, mask, cache)
            b, n, _ = x.shape
            q = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
            k = self.k_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
            out = _dispatch_sdpa(q, k, v, cache, self.scale, mask, softcap=self.attn_logit_softcapping)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

        _OWN_SCORES[cls] = type(f"Paged{cls.__name__}", (cls,), {"__call__": __call__})
    return _OWN_SCORES[cls]


def install(model: nn.Module, positions_given: bool = False) -> bool:
    """Route the family's RoPE and attention through the packed seams; False (nothing changed)
    when the family does not have the shape these seams expect, and its steps stay padded.
    `positions_given`: the step passes the family every token's position (a multimodal RoPE's
    position ids, backends/mlx/vlm.py), so only the attention seam is needed."""
    layers = getattr(model, "layers", None)
    if not layers:
        return False
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    if any(a is None or not (positions_given or isinstance(getattr(a, "rope", None), nn.Module) or _rope_free(a))
           for a in attns):
        return False
    # the module whose name the attention calls: the attention class's, which a multimodal
    # wrapper (Gemma 3's, around gemma3_text) does not share with its Model class
    modules = {_family_module(a) for a in attns}
    if None in modules:
        return False
    if all(hasattr(m, "scaled_dot_product_attention") for m in modules):
        for m in modules:
            m.scaled_dot_product_attention = _dispatch_sdpa
    elif all(hasattr(a, name) for a in attns for name in _OWN_SCORES_ATTRS):
        for attn in attns:
            if type(attn) not in _OWN_SCORES.values():
                attn.__class__ = _own_scores_class(type(attn))
    else:
        return False
    for attn in attns:
        rope = None if positions_given else getattr(attn, "rope", None)
        if rope is not None and type(rope) not in _PACKED_ROPE.values():
            rope.__class__ = _packed_rope_class(type(rope))
    return True


def _family_module(attn: nn.Module):
    """The mlx-lm module an attention's class is defined in (through mlxcel's own-scores subclass)."""
    cls = type(attn)
    if cls in _OWN_SCORES.values():
        cls = cls.__base__
    return sys.modules.get(cls.__module__)


def _rope_free(attn: nn.Module) -> bool:
    """An attention without positional rotation (EXAONE 4's global layers): no `rope` and no
    submodule of a RoPE class, so its positions come only from the mask and nothing is patched.
    A rotation kept under another name is not this, and leaves the family unpacked."""
    return getattr(attn, "rope", None) is None and not any(
        "rope" in type(m).__name__.lower() or "rotary" in type(m).__name__.lower() for _, m in attn.named_modules())


class _Group:
    """One attention group (base.AttendGroup) as MLX index arrays, with its masks."""

    def __init__(self, g: AttendGroup) -> None:
        self.g = g
        self.tokens = g.tokens if isinstance(g.tokens, slice) else mx.array(g.tokens)
        self.lmax = g.read.shape[1]
        self.read_start = contiguous_start(g.read)  # one row in order: its history is a slice
        self.read = mx.array(g.read)
        self._masks: dict[int | None, mx.array] = {}

    def mask(self, window: int | None) -> mx.array:
        if window not in self._masks:
            self._masks[window] = mx.array(self.g.allowed(window))
        return self._masks[window]


class PackedPlan:
    """Index arrays shared by every layer of one packed forward over `rows`."""

    def __init__(self, rows: list[tuple[SequenceKV, int]], layout: RowLayout) -> None:
        bs = rows[0][0].allocator.block_size
        write, pos = packed_positions(rows)
        self.write = mx.array(write)
        self.offset = TokenPositions(mx.array(pos.astype(np.int32)))
        groups, order = attend_groups(rows, layout, NULL_BLOCK * bs)
        self.groups = [_Group(g) for g in groups]
        # the groups' outputs come out in `order`; this puts them back in token order
        self.unperm = None if order == sorted(order) else mx.array(np.argsort(order))


class PackedBatchView:
    """One layer's cache, as mlx-lm sees it, for one packed step."""

    def __init__(self, storage, layer: int, plan: PackedPlan, window: int | None = None) -> None:
        self.storage, self.layer, self.plan = storage, layer, plan
        self.window = window  # the layer's declared sliding window (engine.backend.layer_windows)
        self.offset = plan.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the step's keys/values; attention reads the history itself (`attend`), so the
        returned arrays only pass through the family's code."""
        _, h, t, dk = keys.shape
        dv = values.shape[-1]
        st, li = self.storage, self.layer
        st.ensure(li, h, dk, dv)
        st.put(li, self.plan.write, keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2))
        return keys, values

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> PackedMask:
        return PackedMask(window_size)

    def attend(self, queries: mx.array, scale: float, mask, sinks=None, softcap: float | None = None,
               compose=None) -> mx.array:
        """[1, H, T, D] attention output, each row over its own history; `compose(stored keys,
        stored values)` gives the keys and values attended where the pool holds something else
        (latent.py: MLA's latent and rotary key)."""
        window = self.window if self.window is not None else mask.window if isinstance(mask, PackedMask) else None
        st, li = self.storage, self.layer
        outs = []
        for g in self.plan.groups:
            if isinstance(g.tokens, slice):
                q = queries[:, :, g.tokens]
            else:
                q = queries[:, :, g.tokens].transpose(2, 1, 0, 3)  # [b, H, 1, D]: one row per token
            if g.read_start is not None:
                k, v = st.take(li, slice(g.read_start, g.read_start + g.lmax))
                k, v = k[None], v[None]
            else:  # int8 records dequantized here, only this group's slots
                k, v = st.take(li, g.read)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            if compose is not None:
                k, v = compose(k, v)
            o = scores.attention(q, k, v, scale, g.mask(window), sinks, softcap)
            outs.append(o if isinstance(g.tokens, slice) else o.transpose(2, 1, 0, 3))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
        return out if self.plan.unperm is None else out[:, :, self.plan.unperm]

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes
