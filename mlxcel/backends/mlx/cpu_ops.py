"""Leaner CPU graphs for two of MLX's fast ops: RoPE and RMSNorm.

On the CPU device `mx.fast.rope` and `mx.fast.rms_norm` have no kernel: each call builds its
reference graph of plain ops (rope: positions, inverse frequencies, cos and sin, then the
rotation, every call, twice per layer). Every op is a task the host thread must
schedule and the stream thread must run, so at one token per step these graphs are a large
share of a decode step's 4946 ops (SmolLM2, counted with mx.export_to_dot). Here the same computations are built with fewer ops:
- RoPE's cos/sin tables are built once per step and reused by every layer that rotates with
  the same settings at the same positions (they all do), so a layer only rotates;
- RMSNorm's elementwise tail runs as one compiled kernel.
Both use the reference graph's ops in its order and dtypes, so outputs are its bits
(tests/models/test_cpu_ops.py). Metal keeps the fast kernels.
"""

from __future__ import annotations

import math
import threading
from functools import partial

import mlx.core as mx
import mlx.nn as nn

_local = threading.local()


def _tables(t: int, offset, dims: int, base: float, scale: float, dtype) -> tuple[mx.array, mx.array]:
    """cos and sin of the rotation angles at positions offset + [0, t), shaped to broadcast
    against [B, N, t, dims / 2]; one entry per settings, reused while the positions repeat."""
    cache = getattr(_local, "tables", None)
    if cache is None:
        cache = _local.tables = {}
    key = (t, dims, base, scale, dtype)
    hit = cache.get(key)
    # an int offset is the same position for equal values; an array only for the same object
    if hit is not None and (hit[0] is offset or type(offset) is type(hit[0]) is int and hit[0] == offset):
        return hit[1], hit[2]
    off = mx.array(offset, mx.int32) if isinstance(offset, int) else offset
    if off.size > 1:
        off = off[:, None, None]  # one position per batch row: [B, 1, 1]
    positions = (mx.arange(t, dtype=mx.float32) + off) * mx.array(scale, mx.float32)
    half = dims // 2
    inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(base) / half, mx.float32))
    theta = positions[..., None] * inv_freqs
    cos, sin = mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)
    cache[key] = (offset, cos, sin)
    return cos, sin


@partial(mx.compile, shapeless=True)
def _rotate(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


class TableRoPE(nn.RoPE):
    """nn.RoPE whose CPU graph takes its cos/sin from the step's shared tables."""

    def __call__(self, x, offset=0):
        if self.traditional or x.ndim != 4 or isinstance(offset, mx.array) and offset.ndim > 1:
            return super().__call__(x, offset)
        cos, sin = _tables(x.shape[2], offset, self.dims, float(self.base), float(self.scale), x.dtype)
        half, d = self.dims // 2, self.dims
        x1, x2 = x[..., :half], x[..., half:d]
        if x.dtype == mx.float32:
            parts = list(_rotate(x1, x2, cos, sin))
        else:  # a fused kernel may keep a narrower dtype's intermediates wider: stay op by op
            parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if d < x.shape[-1]:
            parts.append(x[..., d:])
        return mx.concatenate(parts, axis=-1)


@partial(mx.compile, shapeless=True)
def _rms_tail(x, ms, eps, weight):
    return (x * mx.rsqrt(ms + eps)) * weight


class CompiledRMSNorm(nn.RMSNorm):
    """nn.RMSNorm with the reference graph's elementwise tail fused (fp32 weights and inputs;
    other dtypes keep the fast op's own graph, which casts between them)."""

    def __call__(self, x):
        w = self["weight"]
        if x.dtype != mx.float32 or w.dtype != mx.float32:
            return super().__call__(x)
        ms = mx.mean(mx.square(x), axis=-1, keepdims=True)
        return _rms_tail(x, ms, mx.array(self.eps, mx.float32), w)


def install(model: nn.Module) -> int:
    """Swap the model's plain nn.RoPE and nn.RMSNorm modules for the leaner CPU graphs; returns
    how many were swapped. Call only on the CPU device."""
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.RoPE:
            m.__class__ = TableRoPE
        elif type(m) is nn.RMSNorm:
            m.__class__ = CompiledRMSNorm
        else:
            continue
        n += 1
    return n
