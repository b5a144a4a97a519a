"""The TurboQuant KV storage modes' numerics (`turbo4`, `turbo3`), backend-agnostic: the one
definition both backends' storage and the CPU kernel (kernels/cpu/kv_quant.cpp) follow.

A head vector x of `dim` values (a power of two) is rotated, y = R x with R = H diag(signs) /
sqrt(dim): H the Sylvester Walsh-Hadamard matrix, `signs` a fixed +-1 pattern, so R is
orthonormal and x . x' = y . y'. After the rotation each coordinate of y / rms(y) is close to a
standard Gaussian whatever x looked like (outlier channels are spread over all coordinates), so
one Lloyd-Max codebook for N(0, 1) (`LEVELS`: 16 levels for 4 bits, 8 for 3) fits every head:
each coordinate is stored as the index of its nearest level at scale rms(y), and one fp32 scale
per token per head is kept beside, refit by least squares to the chosen levels
(scale = <y, L[c]> / <L[c], L[c]>). Reading back: y ~ scale * L[c], x ~ R^T y. Attention never
needs x: q . x = (R q) . y, and a weighted sum of values is R^T of the sum of their y.

Packing, per group of 16 coordinates (so `dim` >= 16):
  4 bits: 8 bytes; byte i holds coordinate i in its low nibble and coordinate i + 8 in its high.
  3 bits: 6 bytes; three little-endian 16-bit bit planes (plane b: bit b of each coordinate's
          code, coordinate i at bit i).
"""

from __future__ import annotations

import numpy as np

TURBO_BITS = {"turbo4": 4, "turbo3": 3}
GROUP = 16  # coordinates per packed group
SCALE_BYTES = 4  # one fp32 scale per token per head

# Lloyd-Max levels for a standard Gaussian (the positive half; the codebook is symmetric),
# the fixed point of the centroid / midpoint iteration (tests/models/test_kv_quant.py checks it)
_HALF = {
    4: (0.128395, 0.3880483, 0.6567591, 0.9423405, 1.2562312, 1.6180464, 2.0690172, 2.7325896),
    3: (0.2450942, 0.7560053, 1.3439093, 2.1519457),
}
LEVELS = {bits: np.asarray([-v for v in reversed(half)] + list(half), np.float32) for bits, half in _HALF.items()}


def boundaries(bits: int) -> np.ndarray:
    """The decision thresholds between consecutive levels (their midpoints), ascending."""
    lv = LEVELS[bits]
    return ((lv[1:] + lv[:-1]) / 2).astype(np.float32)


def dim_refusal(dim: int) -> str | None:
    """Why a head of `dim` values cannot be stored turbo (None: it can)."""
    if dim < GROUP or dim & (dim - 1):
        return (f"head_dim {dim} is not a power of two of at least {GROUP}, which the Walsh-Hadamard rotation and "
                f"the packing need")
    return None


def packed_bytes(bits: int, dim: int) -> int:
    """Bytes of one head vector's codes."""
    return dim * bits // 8


def signs(dim: int) -> np.ndarray:
    """The fixed +-1 pattern applied before the Hadamard transform: the parity of a
    multiplicative hash of each index, the same on every platform."""
    bits = [bin((j * 0x9E3779B1) & 0xFFFFFFFF).count("1") & 1 for j in range(dim)]
    return np.asarray([-1.0 if b else 1.0 for b in bits], np.float32)


def rotation(dim: int) -> np.ndarray:
    """R [dim, dim] (fp32): y = R @ x."""
    j = np.arange(dim)
    hadamard = np.where(np.vectorize(lambda v: bin(v).count("1") & 1)(j[:, None] & j[None, :]), -1.0, 1.0)
    return (hadamard * signs(dim)[None, :] / np.sqrt(dim)).astype(np.float32)


def quantize(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference quantizer (float64 arithmetic): x [..., dim] as packed codes uint8
    [..., packed_bytes] and an fp32 scale [...]."""
    dim = x.shape[-1]
    y = x.astype(np.float64) @ rotation(dim).astype(np.float64).T
    rms = np.sqrt((y * y).mean(-1))
    codes = (y[..., None] / np.maximum(rms, np.finfo(np.float32).tiny)[..., None, None] > boundaries(bits)).sum(-1)
    lv = LEVELS[bits].astype(np.float64)[codes]
    den = (lv * lv).sum(-1)
    scale = np.where(den > 0, (y * lv).sum(-1) / np.where(den > 0, den, 1), 0)
    return pack(codes.astype(np.uint8), bits), scale.astype(np.float32)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes uint8 [..., dim] in the packed layout [..., packed_bytes]."""
    g = codes.reshape(*codes.shape[:-1], -1, GROUP).astype(np.uint16)
    if bits == 4:
        out = (g[..., :8] | (g[..., 8:] << 4)).astype(np.uint8)
    else:
        planes = [(((g >> b) & 1) << np.arange(GROUP, dtype=np.uint16)).sum(-1, dtype=np.uint16) for b in range(3)]
        out = np.stack([np.stack([p & 0xFF, p >> 8], -1) for p in planes], -2).astype(np.uint8)
    return out.reshape(*codes.shape[:-1], -1)


def unpack(data: np.ndarray, bits: int) -> np.ndarray:
    """The packed layout [..., packed_bytes] back to codes uint8 [..., dim]."""
    if bits == 4:
        g = data.reshape(*data.shape[:-1], -1, 8)
        codes = np.concatenate([g & 0xF, g >> 4], -1)
    else:
        g = data.reshape(*data.shape[:-1], -1, 3, 2).astype(np.uint16)
        planes = g[..., 0] | (g[..., 1] << 8)  # [..., groups, 3]
        i = np.arange(GROUP, dtype=np.uint16)
        codes = sum((((planes[..., b, None] >> i) & 1) << b) for b in range(3))
    return codes.reshape(*data.shape[:-1], -1).astype(np.uint8)


def dequantize(data: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """The reference reading (float64): x ~ R^T (scale * L[codes])."""
    y = LEVELS[bits].astype(np.float64)[unpack(data, bits)] * scale.astype(np.float64)[..., None]
    return y @ rotation(y.shape[-1]).astype(np.float64)
