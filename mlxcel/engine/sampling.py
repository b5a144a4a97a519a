"""Interim sampler (replaced by the full b10621 chain)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mlxcel.engine.sampling_params import SamplingParams, fold_seed


@dataclass
class SamplerState:
    rng: np.random.Generator

    @classmethod
    def create(cls, params: SamplingParams) -> "SamplerState":
        return cls(np.random.default_rng(fold_seed(params.seed)))


@dataclass
class SampleResult:
    token: int
    probs: list = field(default_factory=list)


def sample_row(logits: np.ndarray, params: SamplingParams, state: SamplerState,
               history: Sequence[int] = (), mask: np.ndarray | None = None) -> SampleResult:
    logits = logits.astype(np.float64)
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    if params.temperature <= 0:
        return SampleResult(int(np.argmax(logits)))
    ids = np.arange(logits.shape[0])
    if params.top_k > 0 and params.top_k < logits.shape[0]:
        keep = np.argpartition(-logits, params.top_k - 1)[: params.top_k]
        ids, logits = ids[keep], logits[keep]
    order = np.argsort(-logits, kind="stable")
    ids, logits = ids[order], logits[order]
    p = np.exp(logits - logits[0])
    p /= p.sum()
    if 0 < params.top_p < 1:
        cut = int(np.searchsorted(np.cumsum(p), params.top_p) + 1)
        ids, logits = ids[:cut], logits[:cut]
    if params.min_p > 0:
        pm = np.exp(logits - logits[0])
        keep = pm >= params.min_p
        ids, logits = ids[keep], logits[keep]
    z = logits / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    return SampleResult(int(ids[state.rng.choice(len(ids), p=p)]))
