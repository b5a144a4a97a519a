"""Pooling kernels and b10621's `--embd-normalize` arithmetic, on numpy arrays.

Pooling turns an encoder's hidden states [B, T, H] plus the attention mask [B, T] into one
vector per input. Normalization follows upstream's `common_embd_normalize` exactly: -1 none,
0 max-absolute rescaled into the int16 range (divisor 32760), 2 euclidean, any other value the
p-norm with that p (1 is taxicab); the scale is 1/sum when sum > 0, else 0, so a zero vector
stays zeros instead of becoming NaN.
"""

from __future__ import annotations

import numpy as np

POOLINGS = ("mean", "cls", "last", "max")  # max is mlxcel's own (no b10621 spelling)


def pool(hidden: np.ndarray, mask: np.ndarray, how: str) -> np.ndarray:
    """[B, T, H] hidden states and [B, T] 0/1 mask -> [B, H] float32."""
    hidden = hidden.astype(np.float32)
    m = mask.astype(np.float32)[:, :, None]
    if how == "mean":
        return (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    if how == "cls":
        return hidden[:, 0]
    if how == "last":
        last = mask.astype(np.int64).sum(axis=1) - 1  # right padding: the last real token
        return hidden[np.arange(hidden.shape[0]), np.maximum(last, 0)]
    if how == "max":
        return np.where(m > 0, hidden, -np.inf).max(axis=1)
    raise ValueError(f"unknown pooling {how!r} (expected one of {', '.join(POOLINGS)})")


def normalize(vec: np.ndarray, mode: int) -> np.ndarray:
    """One vector through upstream's normalization; computed in float64, returned float32."""
    x = np.asarray(vec, dtype=np.float64)
    if mode == -1:
        total = 1.0
    elif mode == 0:
        total = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif mode == 2:
        total = float(np.sqrt((x * x).sum()))
    else:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            total = float(np.power(np.power(np.abs(x), mode).sum(), 1.0 / mode))
    scale = 1.0 / total if total > 0.0 and np.isfinite(total) else 0.0
    return (x * scale).astype(np.float32)
