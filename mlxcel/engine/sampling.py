"""Token selection for one batch row: b10621's sampler chain over numpy logits.

Flow for one row and one step (`sample_row`):
  raw logits -> allowed-token mask (the grammar seam) -> logit_bias ->
    mirostat off: the stages named by `params.samplers`, in that order, then a draw
                  from the result (or adaptive-p's draw when the order names it);
    mirostat 1/2: plain temperature, then mirostat's own truncation and draw
                  (penalties, DRY and every other filter are bypassed, as upstream does).
The per-row `SamplerState` carries what persists between steps (the random generators,
mirostat's mu, adaptive-p's running average, DRY's breaker table); the token history is
passed in. Stages are pure functions in `sampling_stages.py` and `sampling_dry.py`.

Backend-agnostic: logits arrive as anything numpy can read; nothing here touches a device.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from mlxcel.engine.sampling_dry import BreakerTable, DryVocab, dry
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.sampling_stages import (
    Candidates, NoCandidatesError, adaptive_p_logits, apply_logit_bias, draw_index,
    dynamic_temperature, min_p, mirostat_v1_top_k, mirostat_v2_truncate, penalties, softmax,
    temperature, top_k, top_n_sigma, top_p, typical_p, xtc,
)

__all__ = [
    "NoCandidatesError", "ProbsReport", "RowExtras", "SampleResult", "SamplerState",
    "SamplingRow", "sample_batch", "sample_row",
]

# A C float's lowest value: upstream reports it as the logprob of a zero probability,
# because JSON has no -inf.
LOWEST_LOGPROB = -3.4028234663852886e38


@dataclass
class SamplerState:
    """What one row's sampler carries from step to step. Mutated by `sample_row`."""

    seed: int                       # the effective uint32 seed (drawn when the request asked for random)
    rng: np.random.Generator        # the final draw (dist, mirostat, adaptive-p)
    xtc_rng: np.random.Generator    # XTC's coin, a separate stream as upstream keeps it
    mirostat_mu: float
    adaptive_weighted_sum: float
    adaptive_total_weight: float
    dry_breakers: BreakerTable = field(default_factory=dict)
    n_ctx_train: int | None = None  # DRY's window cap and its penalty_last_n = -1 meaning

    @classmethod
    def create(cls, params: SamplingParams, *, dry_vocab: DryVocab | None = None,
               n_ctx_train: int | None = None) -> "SamplerState":
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        main, coin = np.random.SeedSequence(seed).spawn(2)
        decay = min(max(params.adaptive_decay, 0.0), 0.99)
        breakers: BreakerTable = {}
        if (params.mirostat == 0 and "dry" in params.samplers and params.dry_enabled
                and params.dry_sequence_breakers):
            if dry_vocab is None:
                raise ValueError("DRY sequence breakers need the model vocabulary (dry_vocab)")
            breakers = dry_vocab.breaker_table(params.dry_sequence_breakers)
        return cls(
            seed=seed,
            rng=np.random.Generator(np.random.PCG64(main)),
            xtc_rng=np.random.Generator(np.random.PCG64(coin)),
            mirostat_mu=2.0 * params.mirostat_tau,
            adaptive_weighted_sum=params.adaptive_target / (1.0 - decay),
            adaptive_total_weight=1.0 / (1.0 - decay),
            dry_breakers=breakers,
            n_ctx_train=n_ctx_train,
        )


@dataclass(frozen=True)
class ProbsReport:
    """One `completion_probabilities` entry, ids and numbers only (the caller adds
    `token` and `bytes` text). Pre-sampling: from the softmax of the raw logits,
    reported as log-probabilities. Post-sampling: the distribution the draw was made
    from, reported as linear probabilities, zero-probability tokens left out."""

    post_sampling: bool
    token: int
    prob: float
    top: tuple[tuple[int, float], ...]

    def to_json(self) -> dict:
        if self.post_sampling:
            return {"id": self.token, "prob": self.prob,
                    "top_probs": [{"id": t, "prob": p} for t, p in self.top]}
        return {"id": self.token, "logprob": _logprob(self.prob),
                "top_logprobs": [{"id": t, "logprob": _logprob(p)} for t, p in self.top]}


def _logprob(p: float) -> float:
    return float(np.log(p)) if p > 0.0 else LOWEST_LOGPROB


@dataclass(frozen=True)
class SampleResult:
    token: int
    probs: ProbsReport | None = None


@dataclass
class RowExtras:
    """Per-row extensions that ride with the row through a shared batch: none of them
    may take a request out of the batch. Sampling reads none of these; the grammar
    matcher writes `SamplingRow.mask`, the backend reads steering and LoRA scales."""

    grammar: object | None = None                   # the row's grammar matcher
    steering: Mapping[int, np.ndarray] | None = None  # layer index -> residual delta
    lora_scales: Mapping[str, float] | None = None    # adapter name -> scale


@dataclass
class SamplingRow:
    """One row of a batch step: its parameters, state, history and this step's mask."""

    params: SamplingParams
    state: SamplerState
    history: Sequence[int] = ()     # prompt tokens then generated tokens, oldest first
    mask: np.ndarray | None = None  # allowed tokens for this step (True = allowed)
    extras: RowExtras = field(default_factory=RowExtras)


Stage = Callable[[Candidates, SamplingParams, SamplerState, Sequence[int]], Candidates]

# The chain's stages by canonical name. adaptive_p is a selector, applied after the chain.
STAGES: Mapping[str, Stage] = {
    "penalties": lambda c, p, s, h: penalties(
        c, h, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty),
    "dry": lambda c, p, s, h: dry(
        c, h, multiplier=p.dry_multiplier, base=p.dry_base, allowed_length=p.dry_allowed_length,
        penalty_last_n=p.dry_penalty_last_n, breakers=s.dry_breakers, n_ctx_train=s.n_ctx_train),
    "top_n_sigma": lambda c, p, s, h: top_n_sigma(c, p.top_n_sigma),
    "top_k": lambda c, p, s, h: top_k(c, p.top_k),
    "typ_p": lambda c, p, s, h: typical_p(c, p.typical_p, p.min_keep),
    "top_p": lambda c, p, s, h: top_p(c, p.top_p, p.min_keep),
    "min_p": lambda c, p, s, h: min_p(c, p.min_p, p.min_keep),
    "xtc": lambda c, p, s, h: xtc(c, p.xtc_probability, p.xtc_threshold, p.min_keep, s.xtc_rng),
    "temperature": lambda c, p, s, h: dynamic_temperature(
        c, p.temperature, p.dynatemp_range, p.dynatemp_exponent),
    "adaptive_p": lambda c, p, s, h: c,
}


def run_chain(c: Candidates, params: SamplingParams, state: SamplerState,
              history: Sequence[int]) -> Candidates:
    """The non-mirostat stages, in the order `params.samplers` names them."""
    for name in params.samplers:
        c = STAGES[name](c, params, state, history)
    return c


def _select(c: Candidates, params: SamplingParams, state: SamplerState, n_vocab: int,
            history: Sequence[int]) -> tuple[Candidates, np.ndarray, int]:
    """Run the chain for this row; returns (final candidates, their probabilities, index)."""
    if params.mirostat == 0:
        c = run_chain(c, params, state, history)
        probs = softmax(c.logits)
        if params.uses_adaptive_p and params.adaptive_target >= 0.0:
            return _adaptive_p(c, probs, params, state)
        if c.size == 1:
            return c, probs, 0
        return c, probs, draw_index(probs, state.rng)
    c = temperature(c, params.temperature)
    if params.mirostat == 1:
        c = top_k(c, mirostat_v1_top_k(c, state.mirostat_mu, n_vocab))
    else:
        c = mirostat_v2_truncate(c, state.mirostat_mu)
    probs = softmax(c.logits)
    idx = draw_index(probs, state.rng)
    surprise = -float(np.log2(probs[idx]))
    state.mirostat_mu -= params.mirostat_eta * (surprise - params.mirostat_tau)
    return c, probs, idx


def _adaptive_p(c: Candidates, probs: np.ndarray, params: SamplingParams,
                state: SamplerState) -> tuple[Candidates, np.ndarray, int]:
    """Draw near a target probability that adapts to the recent picks' average."""
    target = min(max(params.adaptive_target, 0.0), 1.0)
    adapted = target if state.adaptive_total_weight == 0.0 else \
        2.0 * target - state.adaptive_weighted_sum / state.adaptive_total_weight
    adapted = min(max(adapted, 0.0), 1.0)
    transformed = softmax(adaptive_p_logits(probs, adapted))
    idx = draw_index(transformed, state.rng)
    decay = min(max(params.adaptive_decay, 0.0), 0.99)
    state.adaptive_weighted_sum = float(probs[idx]) + decay * state.adaptive_weighted_sum
    state.adaptive_total_weight = 1.0 + decay * state.adaptive_total_weight
    return c, transformed, idx


def _pre_sampling_report(raw: np.ndarray, token: int, n_probs: int) -> ProbsReport:
    probs = softmax(raw)
    n = min(n_probs, raw.shape[0])
    top = np.argpartition(-raw, n - 1)[:n] if n < raw.shape[0] else np.arange(raw.shape[0])
    top = top[np.lexsort((top, -raw[top]))]
    return ProbsReport(False, token, float(probs[token]),
                       tuple((int(t), float(probs[t])) for t in top))


def prompt_reports(logits: np.ndarray, next_tokens: Sequence[int], n_probs: int) -> list[ProbsReport]:
    """Pre-sampling reports of tokens already known (a prompt's): row i of `logits` is the
    distribution `next_tokens[i]` was drawn from; rows past the last token are skipped."""
    return [_pre_sampling_report(np.asarray(row, dtype=np.float32), int(t), n_probs)
            for row, t in zip(logits, next_tokens)]


def _post_sampling_report(c: Candidates, probs: np.ndarray, idx: int, n_probs: int) -> ProbsReport:
    order = np.argsort(-probs, kind="stable")[:n_probs]
    top = tuple((int(c.ids[i]), float(probs[i])) for i in order if probs[i] > 0.0)
    return ProbsReport(True, int(c.ids[idx]), float(probs[idx]), top)


def sample_row(logits: np.ndarray, params: SamplingParams, state: SamplerState,
               history: Sequence[int] = (), mask: np.ndarray | None = None) -> SampleResult:
    """Pick the next token of one row. `history` is the row's tokens so far (prompt then
    generated, as upstream feeds both to its penalties); `mask` marks allowed tokens.
    Advances `state` (random streams, mirostat's mu, adaptive-p's average)."""
    raw = np.asarray(logits, dtype=np.float32).reshape(-1)
    c = Candidates.from_logits(raw, mask)
    c = apply_logit_bias(c, params.logit_bias)
    c, probs, idx = _select(c, params, state, raw.shape[0], history)
    token = int(c.ids[idx])
    report = None
    if params.n_probs > 0:
        report = _post_sampling_report(c, probs, idx, params.n_probs) if params.post_sampling_probs \
            else _pre_sampling_report(raw, token, params.n_probs)
    return SampleResult(token, report)


def sample_batch(logits_2d: np.ndarray, rows: Sequence[SamplingRow]) -> list[SampleResult]:
    """Sample every row of a batch step; row i reads logits_2d[i] with its own parameters."""
    logits_2d = np.asarray(logits_2d)
    if logits_2d.ndim != 2 or logits_2d.shape[0] != len(rows):
        raise ValueError(f"logits of shape {logits_2d.shape} do not match {len(rows)} rows")
    return [sample_row(logits_2d[i], row.params, row.state, row.history, row.mask)
            for i, row in enumerate(rows)]
