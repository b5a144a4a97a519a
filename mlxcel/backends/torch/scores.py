"""Attention over gathered keys/values on torch: SDPA, or mlxcel's own scores where the family's
attention is not plain softmax attention.

Two family knobs change the scores before their softmax, and torch's SDPA takes neither:
logit soft-capping (Gemma 2: scores = tanh(scores / cap) * cap, before the mask) and attention
sinks (gpt-oss: one learned logit per head that joins every row's softmax and is then dropped).
transformers hands both to the attention implementation as keyword arguments (`softcap`,
`s_aux`); every mlxcel attention path that is not the CPU kernels (whose `attention_fits` turns
both away) comes through `attention`, so one place computes them.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """[B, n, H, D] for queries [B, H, n, D] over keys/values [B, kv_heads, L, D] and an additive
    mask [B | 1, 1, n, L]: transformers' SDPA call unless the family asks for soft-capping or sinks."""
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return capped_attention(query, key, value, mask, scale, softcap, sinks), None


def capped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention with the scores soft-capped and/or a per-head sink logit, [B, n, H, Dv]."""
    b, h, n, d = query.shape
    kvh, length = key.shape[1], key.shape[2]
    # grouped queries against their shared key head, without copying the keys per query head
    q = query.reshape(b, kvh, h // kvh, n, d)
    scores = torch.matmul(q, key.unsqueeze(2).transpose(-1, -2)).reshape(b, h, n, length) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    if sinks is not None:
        # the sink's logit takes its share of each softmax and carries no value
        sink = sinks.to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :length]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = probs.to(value.dtype).reshape(b, kvh, h // kvh, n, length)
    out = torch.matmul(probs, value.unsqueeze(2)).reshape(b, h, n, value.shape[-1])
    return out.transpose(1, 2).contiguous()
