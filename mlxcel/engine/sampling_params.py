"""Interim sampling parameters (replaced by the full b10621 chain)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None


def fold_seed(seed: int | None) -> int | None:
    if seed is None or seed in (-1, 4294967295):
        return None
    return seed & 0xFFFFFFFF
