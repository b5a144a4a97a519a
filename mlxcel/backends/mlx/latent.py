"""Multi-head latent attention (DeepSeek V2/V3) on MLX, over mlxcel's paged views.

MLA compresses each token's keys and values into one normed latent (kv_lora_rank values) plus
one rotated key every head shares (qk_rope_head_dim); each head's keys (their unrotated part)
and values are linear maps of the latent. The pool keeps only that pair per token (the views'
keys: the latent, values: the rotary key, one "head" each; engine.backend.latent_width sizes
it), and attention absorbs the up-projections: each head's query is mapped into latent space
and scored against [latent, rotary key] as one shared key head, and its output, a mix of
latents, is mapped to the value dimension. mlx-lm's V3 module stores the same pair but scores
the rotary part itself, outside the attention seam, from the history its cache returns and an
array mask: a packed view returns neither (it attends per row group itself). mlx-lm's V2 module
stores every head's decompressed keys and values. Over mlxcel's views both take this forward
(`install`), and under any other cache their own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxcel.backends.mlx.packed import PackedBatchView, _dispatch_sdpa
from mlxcel.backends.mlx.paged import PagedBatchView

# what this forward reads from a family's MLA module (and embed_q/unembed_out or kv_b_proj)
_ATTRS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj", "rope", "scale", "num_heads", "q_lora_rank",
          "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_LATENT: dict[type, type] = {}


def is_latent(attn) -> bool:
    return (all(hasattr(attn, a) for a in _ATTRS)
            and (hasattr(attn, "embed_q") and hasattr(attn, "unembed_out") or hasattr(attn, "kv_b_proj")))


def _kv_b(attn) -> mx.array:
    """V2's up-projection [heads, nope + v, rank] (dequantized when the checkpoint is)."""
    proj = attn.kv_b_proj
    w = proj.weight
    if hasattr(proj, "scales"):
        w = mx.dequantize(w, proj.scales, proj.get("biases"), group_size=proj.group_size, bits=proj.bits)
    return w.reshape(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim, -1)


def absorb_query(attn, q_nope: mx.array) -> mx.array:
    """[B, H, L, nope] unrotated queries -> [B, H, L, rank]: scored against the latent, they
    give each head's q . k_nope."""
    if hasattr(attn, "embed_q"):
        return attn.embed_q(q_nope)
    return q_nope @ _kv_b(attn)[:, : attn.qk_nope_head_dim]


def expand_output(attn, out: mx.array) -> mx.array:
    """[B, H, L, rank] attention-weighted latents -> [B, H, L, v]: each head's value map."""
    if hasattr(attn, "unembed_out"):
        return attn.unembed_out(out)
    return out @ _kv_b(attn)[:, attn.qk_nope_head_dim:].swapaxes(-1, -2)


def joined(latent: mx.array, rope_keys: mx.array) -> tuple[mx.array, mx.array]:
    """The stored pair as one shared key head and its value: keys [latent, rotary key], values the latent."""
    return mx.concatenate([latent, rope_keys], axis=-1), latent


def _latent_class(cls: type) -> type:
    if cls not in _LATENT:

        def __call__(self, x, mask=None, cache=None):
            if not isinstance(cache, (PagedBatchView, PackedBatchView)):
                return cls.__call__(self, x, mask, cache)
            b, n, _ = x.shape
            q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            q = q.reshape(b, n, self.num_heads, -1).transpose(0, 2, 1, 3)
            q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
            latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
            latent = self.kv_a_layernorm(latent)[:, None]  # [B, 1, L, rank]: one shared "head"
            k_pe = k_pe.reshape(b, n, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
            q_pe, k_pe = self.rope(q_pe, offset=cache.offset), self.rope(k_pe, offset=cache.offset)
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
            queries = mx.concatenate([absorb_query(self, q_nope), q_pe], axis=-1)
            if isinstance(cache, PackedBatchView):
                out = cache.attend(queries, self.scale, mask, compose=joined)
            else:
                out = _dispatch_sdpa(queries, *joined(latent, k_pe), cache, self.scale, mask)
            out = expand_output(self, out)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

        _LATENT[cls] = type(f"Latent{cls.__name__}", (cls,), {"__call__": __call__})
    return _LATENT[cls]


def install(model: nn.Module) -> int:
    """Give every MLA attention module this forward over mlxcel's views; how many layers have one."""
    n = 0
    for layer in getattr(model, "layers", None) or ():
        attn = getattr(layer, "self_attn", None)
        if attn is None or not is_latent(attn):
            continue
        if type(attn) not in _LATENT.values():
            attn.__class__ = _latent_class(type(attn))
        n += 1
    return n
