"""The KV cache's quantized storage on MLX: int8 (per-token, per-head absmax) and turbo
(engine/kv_turbo.py's rotation, Lloyd-Max codes and packing), written and read with MLX ops.
paged.PagedStorage quantizes with these as slots are written and dequantizes only the slots a
step reads, just before its attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.engine import kv_turbo


def quantize_int8(x: mx.array) -> tuple[mx.array, mx.array]:
    """x [..., D] as int8 values and an fp32 scale per vector (its absmax / 127)."""
    xf = x.astype(mx.float32)
    scale = mx.max(mx.abs(xf), axis=-1) / 127.0
    q = mx.clip(mx.round(xf / mx.maximum(scale, 1e-30)[..., None]), -127, 127)
    return q.astype(mx.int8), scale


class TurboCodec:
    """One turbo side's constants, for head vectors of `dim` values."""

    def __init__(self, bits: int, dim: int) -> None:
        self.bits, self.dim = bits, dim
        self.levels = mx.array(kv_turbo.LEVELS[bits])
        self.bounds = mx.array(kv_turbo.boundaries(bits))
        self.signs = mx.array(kv_turbo.signs(dim))
        self.norm = mx.array(1.0 / np.sqrt(np.float32(dim)), mx.float32)
        self.record = kv_turbo.packed_bytes(bits, dim)
        self._bit = mx.arange(kv_turbo.GROUP, dtype=mx.uint32)

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [..., dim] as packed codes uint8 [..., record] and an fp32 scale [...]."""
        y = self.rotate(x.astype(mx.float32))
        rms = mx.maximum(mx.sqrt(_sum(y * y) / self.dim), 1.1754944e-38)
        codes = mx.sum((y / rms[..., None])[..., None] > self.bounds, axis=-1)  # midpoints below
        lv = self.levels[codes]
        den = _sum(lv * lv)
        scale = mx.where(den > 0, _sum(y * lv) / mx.maximum(den, 1.1754944e-38), 0.0)
        return self._pack(codes.astype(mx.uint32)), scale

    def dequantize(self, data: mx.array, scale: mx.array, dtype) -> mx.array:
        """Packed codes [..., record] and scales [...] back to vectors [..., dim] in `dtype`."""
        y = self.levels[self._unpack(data)] * scale[..., None]
        return (_hadamard(y) * (self.signs * self.norm)).astype(dtype)

    def rotate(self, x: mx.array) -> mx.array:
        """R x, as butterflies (elementwise, so a row's bits never depend on what else is rotated
        with it, and the same order as the CPU kernel's)."""
        return _hadamard(x * self.signs) * self.norm

    def _pack(self, codes: mx.array) -> mx.array:
        g = codes.reshape(*codes.shape[:-1], -1, kv_turbo.GROUP)
        if self.bits == 4:
            out = g[..., :8] | (g[..., 8:] << 4)
        else:
            planes = [mx.sum(((g >> b) & 1) << self._bit, axis=-1) for b in range(3)]  # [..., groups] each
            out = mx.stack([mx.stack([p & 0xFF, p >> 8], -1) for p in planes], -2)
        return out.astype(mx.uint8).reshape(*codes.shape[:-1], self.record)

    def _unpack(self, data: mx.array) -> mx.array:
        d = data.astype(mx.uint32)
        if self.bits == 4:
            g = d.reshape(*d.shape[:-1], -1, 8)
            codes = mx.concatenate([g & 0xF, g >> 4], -1)
        else:
            g = d.reshape(*d.shape[:-1], -1, 3, 2)
            planes = g[..., 0] | (g[..., 1] << 8)  # [..., groups, 3]
            codes = sum(((planes[..., b, None] >> self._bit) & 1) << b for b in range(3))
        return codes.reshape(*d.shape[:-1], self.dim)


def _hadamard(x: mx.array) -> mx.array:
    """H x over the last axis (Sylvester order, unnormalised), one butterfly stage at a time."""
    n, h = x.shape[-1], 1
    while h < n:
        g = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = g[..., 0, :], g[..., 1, :]
        x = mx.stack([a + b, a - b], -2).reshape(*x.shape[:-1], n)
        h *= 2
    return x


def _sum(x: mx.array) -> mx.array:
    """Sum over the last axis (a power of two) by halving: the same order whatever the array's
    shape, as the CPU kernel sums (a reduction's order may follow the shape)."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]
