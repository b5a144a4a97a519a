"""Scoring mode: the next token's log-probabilities from one forward pass, nothing generated.

A /v1/completions or chat request with `allowed_token_ids` is a scoring request (`logprobs`
alone asks a generation for its tokens' log-probabilities: logprobs.py). This module owns its
validation (`scoring_spec`), the distribution (`score_logits`: temperature, then a log-softmax
over the allowed set only, in float64) and the OpenAI-shaped `logprobs` objects of both
endpoints. The forward itself is the engine's `submit_score`, on the engine thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel.api.errors import ApiError, engine_error
from mlxcel.api.openai.schemas import SCORING_UNUSED
from mlxcel.engine.types import EngineError
from mlxcel.runtime.served import ServedModel

MAX_ALTERNATIVES = 20
MIN_TEMPERATURE = 0.001  # below it (and above 0) dividing the logits could overflow
STEERING_FIELDS = ("profile", "steering_intensity", "steering")


@dataclass(frozen=True)
class ScoringSpec:
    alternatives: int | None  # top entries to report; None: logprobs not asked (token constrained only)
    allowed: tuple[int, ...] | None  # None: the whole vocabulary
    temperature: float  # 0: no scaling
    as_token_ids: bool


@dataclass(frozen=True)
class Scored:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # best first (logprob desc, then id asc)


def _refuse(message: str, param: str | None, code: str = "invalid_scoring_request") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def is_scoring(body: dict[str, Any]) -> bool:
    return body.get("allowed_token_ids") is not None


def scoring_spec(req: Any, body: dict[str, Any], chat: bool) -> ScoringSpec:
    """Validate a scoring request's shape (everything that needs no model)."""
    if req.stream:
        raise _refuse("scoring mode (allowed_token_ids) does not stream; send stream: false", "stream")
    if req.n not in (None, 1):
        raise _refuse("scoring mode needs n: 1", "n")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens != 1:
        raise _refuse("scoring mode (allowed_token_ids) reads one next-token distribution and needs "
                      f"max_tokens: 1 (or max_completion_tokens: 1); got {max_tokens}", "max_tokens")
    # the 0-2 range is generation.validate_sampling's, which every scoring route also runs
    temperature = 1.0 if req.temperature is None else req.temperature
    if 0 < temperature < MIN_TEMPERATURE:
        raise _refuse(f"scoring temperature must be 0 or at least {MIN_TEMPERATURE}: a smaller one overflows "
                      "the scaled logits", "temperature")
    for name in (*STEERING_FIELDS, "response_format", "echo"):
        value = body.get(name)
        if value is not None and not (name == "response_format" and value == {"type": "text"}) \
                and not (name == "echo" and value is False):
            raise _refuse(f"'{name}' is not allowed on a scoring request (scoring is never steered or "
                          "constrained)", name, code="field_not_honoured")
    if chat:
        if req.top_logprobs is not None and req.logprobs is not True:
            raise _refuse("top_logprobs needs logprobs: true", "top_logprobs")
        alternatives = None if req.logprobs is not True else (req.top_logprobs or 0)
        param = "top_logprobs"
    else:
        alternatives = req.logprobs if type(req.logprobs) is int else None
        param = "logprobs"
    if alternatives is not None and not 0 <= alternatives <= MAX_ALTERNATIVES:
        raise _refuse(f"{param} must be between 0 and {MAX_ALTERNATIVES}", param)
    allowed = None
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise _refuse("allowed_token_ids must not be empty", "allowed_token_ids")
        allowed = tuple(dict.fromkeys(req.allowed_token_ids))  # first occurrence order, no repeats
    return ScoringSpec(alternatives, allowed, float(temperature), bool(req.return_tokens_as_token_ids))


def check_prompt(model: ServedModel, spec: ScoringSpec, prompt: list[int], where: str) -> None:
    """The model-dependent refusals: vocabulary, empty prompt, context window."""
    vocab = model.info.vocab_size
    if spec.allowed is not None:
        bad = [t for t in spec.allowed if not 0 <= t < vocab]
        if bad:
            raise _refuse(f"allowed_token_ids holds ids outside the model's vocabulary of {vocab}: {bad[:8]}",
                          "allowed_token_ids")
    if not prompt:
        raise _refuse(f"{where} tokenizes to nothing; there is no position to score", where.split("[")[0])
    if len(prompt) + 1 > model.n_ctx:
        raise ApiError(400, f"This model's maximum context length is {model.n_ctx} tokens. However, you requested "
                       f"{len(prompt) + 1} tokens ({len(prompt)} in the prompt, 1 for the completion). Please "
                       "reduce the prompt.", code="context_length_exceeded", param=where.split("[")[0])


def _non_finite(what: str) -> ApiError:
    return ApiError(500, f"the model produced {what}; no distribution can be reported",
                    code="non_finite_logits", type="server_error")


def score_logits(logits: np.ndarray, spec: ScoringSpec) -> Scored:
    """Temperature, then log-softmax over the allowed set; the best token and the top entries.
    NaN or +inf where they reach the answer, or -inf on a reported token, is refused."""
    x = np.asarray(logits, dtype=np.float64)
    ids = np.arange(x.shape[0]) if spec.allowed is None else np.asarray(spec.allowed, dtype=np.int64)
    vals = x[ids]
    if np.isnan(vals).any() or np.isposinf(vals).any():
        raise _non_finite("NaN or +inf logits")
    if spec.temperature > 0:
        vals = vals / spec.temperature
    finite = np.isfinite(vals)
    if not finite.any():
        raise _non_finite("-inf logits on every candidate token")
    peak = vals[finite].max()
    lse = peak + np.log(np.exp(vals[finite] - peak).sum())
    lp = np.where(finite, vals - lse, -np.inf)
    order = np.lexsort((ids, -lp))  # logprob desc, ties by id asc
    k = min(spec.alternatives or 0, len(ids))
    reported = order[: max(k, 1)]
    if np.isneginf(lp[reported]).any():
        raise _non_finite("-inf logits on a reported token")
    best = order[0]
    return Scored(int(ids[best]), float(lp[best]), tuple((int(ids[i]), float(lp[i])) for i in order[:k]))


async def score_prompt(model: ServedModel, prompt: list[int], spec: ScoringSpec,
                       capture: dict | None = None) -> Scored:
    """`capture`: residual reads of the pass (return_sae_activations); the pass itself carries no
    steering, so every attached SAE is suppressed for it and for it only."""
    try:
        future = model.engine.submit_score(prompt, capture)
    except EngineError as e:
        raise engine_error(e.message, e.code, e.status) from None
    try:
        logits = await asyncio.wrap_future(future)
    except EngineError as e:
        raise engine_error(e.message, e.code, e.status) from None
    return score_logits(logits, spec)


def token_text(model: ServedModel, token: int) -> str:
    return model.tokenizer.decode([token], skip_special_tokens=False)


def _key(model: ServedModel, spec: ScoringSpec, token: int) -> str:
    return f"token_id:{token}" if spec.as_token_ids else token_text(model, token)


def completion_logprobs(model: ServedModel, spec: ScoringSpec, s: Scored, text_offset: int) -> dict[str, Any] | None:
    """The legacy completions object; entries that share a key keep the most probable one."""
    if spec.alternatives is None:
        return None
    top: dict[str, float] = {}
    for token, lp in s.top:
        top.setdefault(_key(model, spec, token), lp)
    return {"tokens": [_key(model, spec, s.token)], "token_logprobs": [s.logprob],
            "top_logprobs": [top], "text_offset": [text_offset]}


def chat_logprobs(model: ServedModel, spec: ScoringSpec, s: Scored) -> dict[str, Any] | None:
    """The chat object: one content entry, the scored token, with its alternatives."""
    if spec.alternatives is None:
        return None

    def entry(token: int, lp: float) -> dict[str, Any]:
        return {"token": _key(model, spec, token), "logprob": lp,
                "bytes": list(token_text(model, token).encode("utf-8", "surrogatepass"))}

    top, seen = [], set()
    for token, lp in s.top:
        e = entry(token, lp)
        if e["token"] not in seen:
            seen.add(e["token"])
            top.append(e)
    return {"content": [{**entry(s.token, s.logprob), "top_logprobs": top}]}


def resolve(req: Any, body: dict, *, chat: bool) -> tuple[bool, Any, list[str]]:
    """(scoring?, its spec, the fields the mode leaves unused) for a chat or text completion:
    scoring ignores the sampling knobs; generation reads return_tokens_as_token_ids only
    where it reports logprobs."""
    if is_scoring(body):
        return True, scoring_spec(req, body, chat=chat), [f for f in SCORING_UNUSED if body.get(f) is not None]
    asked = req.logprobs is True if chat else type(req.logprobs) is int
    return False, None, ["return_tokens_as_token_ids"] if req.return_tokens_as_token_ids is not None and not asked \
        else []
