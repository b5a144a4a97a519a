"""Attention over a view's keys/values on MLX: the fused kernel, or mlxcel's own scores where
the family's attention soft-caps its logits.

mx.fast.scaled_dot_product_attention takes sinks (gpt-oss) but not logit soft-capping (Gemma 2:
scores = tanh(scores / cap) * cap, before the mask and softmax). A family that soft-caps
computes its attention itself in mlx-lm, where mlxcel's views cannot reach it; packed.py gives
such an attention mlxcel's forward, which comes here with the cap.
"""

from __future__ import annotations

import mlx.core as mx


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, sinks=None,
              softcap: float | None = None) -> mx.array:
    """[B, H, L, Dv] for queries [B, H, L, D] over keys/values [B, kv_heads, S, D]; `mask`:
    None, a boolean (True: may attend) or additive array broadcasting to [B, 1, L, S]."""
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    return capped_attention(queries, keys, values, scale, mask, softcap, sinks)


def capped_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, softcap: float,
                     sinks: mx.array | None = None) -> mx.array:
    """Softmax attention over soft-capped scores (and a per-head sink logit, when given)."""
    b, h, n, d = queries.shape
    kvh, length = keys.shape[1], keys.shape[2]
    # grouped query heads against their shared key head: [B, kv_heads, group, L, S]
    q = queries.reshape(b, kvh, h // kvh, n, d)
    scores = (q @ keys[:, :, None].swapaxes(-1, -2)) * scale
    scores = mx.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.ndim == 4:
            mask = mask[:, :, None]  # one mask for every head of a group
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    if sinks is not None:
        # the sink's logit takes its share of each softmax and carries no value
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, kvh, h // kvh, 1, 1), (*scores.shape[:-1], 1))
        probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :length]
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs @ values[:, :, None]
    return out.reshape(b, h, n, values.shape[-1])
