"""What the /v1 chat and text completion routes share: validated sampling, engine rows,
and the OpenAI pieces of their answers (ids, fingerprint, usage, the mid-stream error frame).

A route validates its sampling fields once (`validate_sampling`), builds one engine row per
prompt and choice (`build_request`, each row with its own seed), and hands them to the
stream runner (api/stream_runner.py) with its encoder.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.api.engine_request import Sampling, generation_request
from mlxcel.api.errors import ApiError, error_type
from mlxcel.api.llamacpp import native_grammar
from mlxcel.api.llamacpp.native_params import OPENAI_SHARED, SharedFields, check_slot, parse_shared
from mlxcel.api.model_names import accepts, not_found
from mlxcel.api.openai.logprobs import LogprobsAsk
from mlxcel.api.openai.schemas import _Sampling
from mlxcel.api.state import AppState
from mlxcel.api.stream_runner import sse
from mlxcel.config.limits import ERROR_MESSAGE_CHARS, echo
from mlxcel.engine.types import GenerationRequest, TokenEvent
from mlxcel.runtime.served import ServedModel

# request field -> SamplingParams field, when sent
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty")


def served_model(state: AppState, name: str | None) -> ServedModel:
    from mlxcel.api.model_switch import check_not_busy
    from mlxcel.api.side_workers import generation_refusal

    check_not_busy(state)  # a model switch is unloading or loading
    refusal = generation_refusal(state)  # --embeddings / --reranking: no chat model at all
    if refusal is not None:
        raise refusal
    model = state.model
    if model is None:
        unloaded = state.switch.unloaded if state.switch is not None else None
        why = (f"no model is loaded: {state.load_error}" if state.load_error
               else f"no model is loaded: {unloaded!r} was unloaded; load one (POST /api/models/<id>/load) or "
                    "name one in the request" if unloaded else "the model is still loading")
        raise ApiError(503, why, code="model_not_loaded", type="server_error")
    if not accepts(state, model.answers_to, name, model.id):
        raise not_found(name)
    return model


@dataclass(frozen=True)
class SamplingAsk:
    """A /v1 request's sampling fields, range-checked once; `build_request` makes its rows."""

    max_tokens: int | None  # None: the server's --n-predict
    overrides: dict[str, Any]  # SamplingParams fields the request sets
    seed: int | None
    stop: list[str]
    logit_bias: dict[str, Any] | None  # OpenAI's, checked against the model's vocabulary per row
    lora: Any
    cache_prompt: bool
    shared: SharedFields | None = None  # b10621's native sampler / grammar fields, as /completion reads them

    @property
    def timings_per_token(self) -> bool:
        return self.shared is not None and self.shared.timings_per_token


def read_shared(body: dict[str, Any], scoring: bool) -> tuple[SharedFields | None, list[str]]:
    """The native fields a /v1 body carries, parsed by the /completion parser (None: it sends
    none); in scoring mode nothing is sampled, so they are reported as unused instead."""
    sent = [f for f in OPENAI_SHARED if body.get(f) is not None]
    if scoring or not sent:
        return None, sent if scoring else []
    return parse_shared(body), []


def validate_sampling(req: _Sampling, logprobs: LogprobsAsk | None = None,
                      shared: SharedFields | None = None) -> SamplingAsk:
    """Range checks shared by every /v1 generation and scoring request; `logprobs` adds the
    engine's per-token reports to the overrides."""
    if (req.max_tokens is not None and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens):
        raise ApiError(400, f"max_tokens ({req.max_tokens}) and max_completion_tokens ({req.max_completion_tokens}) "
                       "differ; send one of them", code="invalid_parameter", param="max_completion_tokens")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None and max_tokens < 0:
        raise ApiError(400, "max_tokens must be at least 0", code="invalid_parameter", param="max_tokens")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise ApiError(400, "temperature must be between 0 and 2", code="invalid_parameter", param="temperature")
    if req.top_p is not None and not 0 <= req.top_p <= 1:
        raise ApiError(400, "top_p must be between 0 and 1", code="invalid_parameter", param="top_p")
    if req.seed is not None and (isinstance(req.seed, bool) or not 0 <= req.seed <= 0xFFFFFFFF):
        raise ApiError(400, "seed must be an integer from 0 to 4294967295", code="invalid_parameter", param="seed")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(req, name)
        if value is not None and not -2 <= value <= 2:
            raise ApiError(400, f"{name} must be between -2 and 2", code="invalid_parameter", param=name)
    if req.n is not None and req.n < 1:
        raise ApiError(400, "n must be at least 1", code="invalid_parameter", param="n")
    overrides = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
    if logprobs is not None:
        overrides.update(logprobs.overrides())
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingAsk(max_tokens=max_tokens, overrides=overrides, seed=req.seed, stop=stop,
                       logit_bias=req.logit_bias, lora=req.lora, cache_prompt=req.cache_prompt is not False,
                       shared=shared)


def openai_logit_bias(raw: dict[str, Any] | None, n_vocab: int) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids (as strings) to a bias from -100 to 100, added to the
    logits; -100 effectively bans the token. Anything else is refused, never skipped."""
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            tok = int(key)
        except ValueError:
            tok = -1
        if not 0 <= tok < n_vocab:
            raise ApiError(400, f"logit_bias: {echo(key)!r} is not a token id of this model (0..{n_vocab - 1})",
                           code="invalid_parameter", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{echo(key)!r}] must be a number from -100 to 100",
                           code="invalid_parameter", param="logit_bias")
        out[tok] = float(value)
    return out


def row_seed(seed: int | None, row: int) -> int | None:
    """The seed of one row of a request: the request's own for row 0, a fixed derivation
    of (seed, row) for the others, so choices differ yet each reproduces."""
    if seed is None or row == 0:
        return seed
    return int(np.random.SeedSequence([seed, row]).generate_state(1, dtype=np.uint32)[0])


def check_context(model: ServedModel, n_prompt: int, max_tokens: int, param: str) -> None:
    """context_length_exceeded with the window and the request's figures."""
    asked = n_prompt + max(max_tokens, 0)
    if n_prompt >= model.n_ctx or asked > model.n_ctx:
        raise ApiError(
            400,
            f"This model's maximum context length is {model.n_ctx} tokens. However, you requested "
            f"{asked} tokens ({n_prompt} in the prompt, {max(max_tokens, 0)} for the completion). "
            "Please reduce the prompt or max_tokens.",
            code="context_length_exceeded", param=param,
        )


def build_request(ask: SamplingAsk, model: ServedModel, prompt: list[int], *, row: int = 0,
                  param: str = "messages") -> GenerationRequest:
    """One engine row of a request; `row` picks the row's seed (see `row_seed`)."""
    max_tokens = model.n_predict if ask.max_tokens is None else ask.max_tokens
    bias = openai_logit_bias(ask.logit_bias, model.info.vocab_size)
    check_context(model, len(prompt), max_tokens, param)
    shared = ask.shared
    # the native knobs are the ones the OpenAI fields do not spell (native_params.OPENAI_SAMPLERS)
    overrides = {**shared.overrides, **ask.overrides} if shared is not None else ask.overrides
    # absent ignore_eos: the server's --ignore-eos
    ignore_eos = model.ignore_eos if shared is None or shared.ignore_eos is None else bool(shared.ignore_eos)
    sampling = Sampling(max_tokens=max_tokens, overrides=overrides, seed=row_seed(ask.seed, row),
                        bias=bias or None, ignore_eos=ignore_eos, stop=ask.stop, lora=ask.lora,
                        cache_prompt=ask.cache_prompt)
    id_slot = shared.id_slot if shared is not None and shared.id_slot is not None else -1
    check_slot(id_slot, model.engine.parallel)
    return generation_request(model, sampling, prompt, id_slot=id_slot)


async def shared_grammar(ask: SamplingAsk, model: ServedModel, other: str | None = None) -> Any:
    """The compiled grammar a /v1 body's `grammar` / `json_schema` asks for (None: none);
    `other` names a constraint the request already runs under, which cannot be combined."""
    if ask.shared is None or not ask.shared.asks_grammar:
        return None
    if other is not None:
        raise ApiError(400, f"'grammar' / 'json_schema' cannot be combined with {other}", code="invalid_parameter",
                       param="grammar" if "grammar" in ask.shared.grammar else "json_schema")
    return await native_grammar.resolve(ask.shared.grammar, model)


def seed_header(seed: int | None, scope: str = "request") -> dict[str, str]:
    """`X-miLLM-Seed: N;scope="..."`, absent when the request sent no seed."""
    return {} if seed is None else {"X-miLLM-Seed": f'{seed};scope="{scope}"'}


def model_revision(path: Path) -> str:
    """The checkpoint's git/hub revision when its location records one (a hub snapshot
    directory is named by its commit), else `unrecorded`."""
    for part in reversed(Path(path).parts):
        if len(part) == 40 and all(c in "0123456789abcdef" for c in part):
            return part[:8]
    return "unrecorded"


def fingerprint(model: ServedModel) -> str:
    """millm:<model>@<revision>:<dtype>/<quantization>:<engine>; unknown parts `unrecorded`."""
    info = model.info
    quant = info.quantization or "none"
    return (f"millm:{model.id}@{model_revision(info.path)}:{info.dtype or 'unrecorded'}/{quant}"
            f":mlxcel-{info.backend or 'unrecorded'}")


def usage(finals: list[TokenEvent]) -> dict[str, Any]:
    """OpenAI's usage object over the last events of a request's rows."""
    prompt = sum(ev.prompt_tokens for ev in finals)
    completion = sum(ev.completion_tokens for ev in finals)
    cached = sum(ev.timings.cache_n for ev in finals if ev.timings is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_frame(ev: TokenEvent) -> bytes:
    """A mid-stream error event; its type follows the code as a non-streamed error's would."""
    return sse({"error": {"message": echo(ev.error or "", ERROR_MESSAGE_CHARS), "type": error_type(ev.error_code),
                          "param": None,
                          "code": ev.error_code}})
