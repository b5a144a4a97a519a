"""A GGUF's quantized tensors in MLX's affine format, without a round trip through floats.

MLX's affine quantization stores, per group of `group_size` consecutive inputs of a row,
`w = scale * q + bias` with `q` an unsigned `bits`-bit integer, packed little-endian into
uint32 words. llama.cpp's formats whose blocks (or sub-blocks) are 32 values with one scale and
one offset are that form exactly: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (scale d, offset m or a fixed
-2^(bits-1) d) and Q4_K / Q5_K (8 sub-blocks of 32 per 256-value block, scale d*sc and offset
-dmin*m). The rest have no exact affine form of 32 (Q2_K, Q3_K and Q6_K scale 16-value
sub-blocks; the ternary and importance formats use codebooks or signed scales) and are
dequantized; `to_packed` returns the reason.

Exactness is checked rather than assumed: the codes are recovered from gguf's own dequantized
values and a tensor is kept packed only if `scale * q + bias` in fp32 gives those values back
bit for bit. Scales and biases are stored in fp16 where that holds them exactly (the non-K
formats), else in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GROUP = 32
# GGML type name -> (bits, offset of q in units of d, or None where the block stores its minimum)
_PLAIN = {"Q4_0": (4, 8), "Q4_1": (4, None), "Q5_0": (5, 16), "Q5_1": (5, None), "Q8_0": (8, 128)}
_K = {"Q4_K": 4, "Q5_K": 5}
_DENSE_REASON = {
    "Q2_K": "its 16-value sub-blocks have no exact form in groups of 32",
    "Q3_K": "its 16-value sub-blocks have no exact form in groups of 32",
    "Q6_K": "its 16-value sub-blocks have no exact form in groups of 32",
}
_ROWS_PER_CHUNK_ELEMS = 1 << 22  # bounds the fp32 scratch of one tensor


@dataclass(frozen=True)
class Packed:
    """One weight in MLX's affine layout: rows as the GGUF has them, inputs packed."""

    weight: np.ndarray  # uint32 [..., inputs * bits / 32]
    scales: np.ndarray  # [..., inputs / group_size]
    biases: np.ndarray
    bits: int
    group_size: int = GROUP

    def __len__(self) -> int:
        return self.weight.shape[0]

    def __getitem__(self, i) -> Packed:
        return self.rows(lambda a: a[i])

    def rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> Packed:
        """The same row operation (a permutation, a slice, an expert) on all three arrays."""
        return Packed(fn(self.weight), fn(self.scales), fn(self.biases), self.bits, self.group_size)

    def parts(self, name: str) -> dict[str, np.ndarray]:
        """The safetensors entries for the HF weight `name` (ending in `.weight`)."""
        stem = name.removesuffix(".weight")
        return {name: self.weight, f"{stem}.scales": self.scales, f"{stem}.biases": self.biases}


def dense_reason(type_name: str) -> str:
    return _DENSE_REASON.get(type_name, "MLX's affine format has no exact form of it")


def _scale_bias(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-group fp32 scale and bias, one row per group of 32, from the block headers."""
    import gguf

    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if type_name in _PLAIN:
        bits, offset = _PLAIN[type_name]
        if offset is None:
            return d, blocks[:, 2:4].copy().view(np.float16).astype(np.float32), bits
        return d, -np.float32(offset) * d, bits
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale = d * sc.reshape(len(blocks), -1).astype(np.float32)
    bias = -(dmin * m.reshape(len(blocks), -1).astype(np.float32))
    return scale.reshape(-1, 1), bias.reshape(-1, 1), _K[type_name]


def _pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes [n, 32] -> uint32 words [n, bits], bit i*bits of a group's stream first."""
    q = q.astype(np.uint32)
    out = np.zeros((q.shape[0], bits), dtype=np.uint32)
    for i in range(GROUP):
        word, off = divmod(i * bits, 32)
        out[:, word] |= q[:, i] << np.uint32(off)
        if off + bits > 32:
            out[:, word + 1] |= q[:, i] >> np.uint32(32 - off)
    return out


def _pack_rows(raw: np.ndarray, type_name: str, inputs: int):
    """One chunk of rows (raw block bytes [rows, bytes]) -> (words, scales, biases) or None."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    scale, bias, bits = _scale_bias(blocks, type_name)
    w = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(-1, GROUP)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(np.where(scale != 0, (w - bias) / scale, 0))
    q = np.clip(np.nan_to_num(q), 0, (1 << bits) - 1).astype(np.float32)
    if not np.array_equal(scale * q + bias, w):
        return None
    groups = inputs // GROUP
    return (_pack_codes(q, bits).reshape(rows, groups * bits), scale.reshape(rows, groups),
            bias.reshape(rows, groups))


def to_packed(data: np.ndarray, type_name: str) -> Packed | str:
    """The GGUF tensor's raw blocks ([..., rows, bytes], as gguf's reader gives them) in MLX's
    affine layout, or the reason it has none."""
    import gguf

    if type_name not in _PLAIN and type_name not in _K:
        return dense_reason(type_name)
    if data.ndim < 2:
        return "a vector is stored unquantized"
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    lead, nbytes = data.shape[:-1], data.shape[-1]
    inputs = nbytes // size * block
    flat = data.reshape(-1, nbytes)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // inputs)
    chunks = []
    for start in range(0, flat.shape[0], step):
        got = _pack_rows(flat[start:start + step], type_name, inputs)
        if got is None:
            return "its values are not scale * q + bias in fp32 (the source rounds differently)"
        chunks.append(got)
    words, scales, biases = (np.concatenate(parts).reshape(*lead, -1) for parts in zip(*chunks))
    bits = words.shape[-1] * 32 // inputs
    exact16 = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (scales, biases))
    kind = np.float16 if exact16 else np.float32
    return Packed(words, scales.astype(kind), biases.astype(kind), bits)
