"""The KV cache's quantized storage on torch: int8 (per-token, per-head absmax) and turbo
(engine/kv_turbo.py's rotation, Lloyd-Max codes and packing), written and read with torch ops.
paged.PagedStorage quantizes with these as slots are written and dequantizes only the slots a
step gathers; the CPU kernel (kernels/cpu/kv_quant.cpp) reads the same records directly and
quantizes a decode step's rows itself, the same way."""

from __future__ import annotations

import numpy as np
import torch

from mlxcel.engine import kv_turbo


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as int8 values and an fp32 scale per vector (its absmax / 127)."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / 127.0
    q = torch.round(xf / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp_(-127, 127)
    return q.to(torch.int8), scale


class TurboCodec:
    """One turbo side's constants on a device, for head vectors of `dim` values."""

    def __init__(self, bits: int, dim: int, device: torch.device) -> None:
        self.bits, self.dim = bits, dim
        self.levels = torch.from_numpy(kv_turbo.LEVELS[bits]).to(device)
        self.bounds = torch.from_numpy(kv_turbo.boundaries(bits)).to(device)
        self.signs = torch.from_numpy(kv_turbo.signs(dim)).to(device)
        self.norm = float(np.float32(1.0) / np.sqrt(np.float32(dim)))
        self.record = kv_turbo.packed_bytes(bits, dim)
        self._bit = torch.arange(kv_turbo.GROUP, device=device, dtype=torch.int32)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] as packed codes uint8 [..., record] and an fp32 scale [...]."""
        y = self.rotate(x.to(torch.float32))
        rms = (_sum(y * y) / self.dim).sqrt().clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.bucketize(y / rms.unsqueeze(-1), self.bounds)  # how many midpoints lie below
        lv = self.levels[codes]
        den = _sum(lv * lv)
        scale = torch.where(den > 0, _sum(y * lv) / den.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        return self._pack(codes.to(torch.int32)), scale

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Packed codes [..., record] and scales [...] back to vectors [..., dim] in `dtype`."""
        y = self.levels[self._unpack(data)] * scale.unsqueeze(-1)
        return (_hadamard(y) * self.signs * self.norm).to(dtype)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """R x, as butterflies (elementwise, so a row's bits never depend on what else is rotated
        with it, and the same order as the CPU kernel's)."""
        return _hadamard(x * self.signs) * self.norm

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        g = codes.reshape(*codes.shape[:-1], -1, kv_turbo.GROUP)
        if self.bits == 4:
            out = g[..., :8] | (g[..., 8:] << 4)
        else:
            planes = [(((g >> b) & 1) << self._bit).sum(-1) for b in range(3)]  # [..., groups] each
            out = torch.stack([torch.stack([p & 0xFF, p >> 8], -1) for p in planes], -2)
        return out.to(torch.uint8).reshape(*codes.shape[:-1], self.record)

    def _unpack(self, data: torch.Tensor) -> torch.Tensor:
        d = data.to(torch.int32)
        if self.bits == 4:
            g = d.reshape(*d.shape[:-1], -1, 8)
            codes = torch.cat([g & 0xF, g >> 4], -1)
        else:
            g = d.reshape(*d.shape[:-1], -1, 3, 2)
            planes = g[..., 0] | (g[..., 1] << 8)  # [..., groups, 3]
            codes = sum(((planes[..., b, None] >> self._bit) & 1) << b for b in range(3))
        return codes.reshape(*d.shape[:-1], self.dim).long()


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """H x over the last axis (Sylvester order, unnormalised), one butterfly stage at a time."""
    n, h = x.shape[-1], 1
    while h < n:
        g = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = g[..., 0, :], g[..., 1, :]
        x = torch.stack([a + b, a - b], -2).reshape(*x.shape[:-1], n)
        h *= 2
    return x


def _sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis (a power of two) by halving: the same order whatever the tensor's
    shape, as the CPU kernel sums (a reduction's order may follow the shape)."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]
