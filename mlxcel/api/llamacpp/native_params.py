"""Native request fields -> engine types, with b10621's limits and wordings.

`parse_native` reads a /completion or /infill body: nulls are dropped (a null is an
absent field), types are checked by `NativeCompletionRequest`, "hard" limits of
native-fields.tsv refuse with upstream's "Field 'x': Value must be between ..." wording,
"clamp" limits clamp silently, and fields whose behaviour this server does not have are
refused with a 400 when they ask for anything but the no-op value. The result is a
`NativeRequest`: a `GenerationRequest` template (prompt filled in per prompt later) and
the response options the route renders with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from mlxcel.api.body import convert
from mlxcel.api.engine_request import Sampling, generation_request, reasoning_budget
from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp import native_grammar
from mlxcel.api.llamacpp.schemas import NativeCompletionRequest, declared_names
from mlxcel.chat.reasoning import CLOSE, OPEN
from mlxcel.config.limits import MAX_N_PROBS, echo
from mlxcel.engine.sampling_params import resolve_logit_bias, samplers_from_chars, samplers_from_names
from mlxcel.engine.reasoning_budget import ReasoningBudget
from mlxcel.engine.types import GenerationRequest
from mlxcel.runtime.served import ServedModel
from mlxcel.steering.requests import refuse_fields as refuse_steering_fields

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLT_MAX = 3.4028234663852886e38

# "hard" limits: out of range is refused. None = the server's --parallel (n_cmpl).
HARD: dict[str, tuple[float, float | None]] = {
    "sse_ping_interval": (-1, INT32_MAX), "n_predict": (-1, INT32_MAX),
    "max_tokens": (-1, INT32_MAX), "max_completion_tokens": (-1, INT32_MAX),
    "n_indent": (0, INT32_MAX), "n_keep": (-1, INT32_MAX), "n_discard": (0, INT32_MAX),
    "n_cmpl": (1, None), "n": (1, None), "n_cache_reuse": (0, INT32_MAX),
    "t_max_predict_ms": (-1, INT64_MAX), "repeat_last_n": (0, INT32_MAX),
    "dry_allowed_length": (0, INT32_MAX), "dry_penalty_last_n": (0, INT32_MAX),
    "adaptive_decay": (0.0, 0.99), "min_keep": (0, INT32_MAX), "reasoning_budget_tokens": (-1, INT32_MAX),
}
# "clamp" limits: out of range is pulled to the bound.
CLAMP: dict[str, tuple[float, float]] = {
    "top_k": (0, INT32_MAX), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "xtc_probability": (0.0, 1.0),
    "xtc_threshold": (0.0, 1.0), "typical_p": (0.0, 1.0), "temperature": (0.0, math.inf),
    "mirostat": (0, 2), "adaptive_target": (-FLT_MAX, 1.0),
}
# request field -> SamplingParams field, for the plain numeric knobs
SAMPLING_FIELDS = (
    "top_k", "top_p", "min_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "typical_p",
    "temperature", "dynatemp_range", "dynatemp_exponent", "repeat_last_n", "repeat_penalty",
    "frequency_penalty", "presence_penalty", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "adaptive_target",
    "adaptive_decay", "min_keep",
)
# The sampler knobs the OpenAI structs do not declare themselves (they read temperature, top_p,
# top_k, min_p and the two penalties with OpenAI's ranges), and the other native fields b10621's
# OpenAI routes read: all parsed by `parse_shared`.
OPENAI_SAMPLERS = tuple(f for f in SAMPLING_FIELDS if f not in (
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty"))
OPENAI_SHARED = (*OPENAI_SAMPLERS, "dry_sequence_breakers", "samplers", "ignore_eos", "grammar", "json_schema",
                 "id_slot", "n_probs", "timings_per_token")
# Fields for behaviour this server does not have yet, with the values that ask for nothing.
# (json_schema, grammar, grammar_lazy, grammar_triggers and preserved_tokens are resolved by
# native_grammar.py, in the route.)
DEFERRED: dict[str, tuple[Any, ...]] = {
    # /completion has no completion id a control request could name (chat routes honour it)
    "reasoning_control": (False,),
}
# Chat-parser configuration: /completion renders no chat template and parses no output, so
# these only configure the chat routes; anything but the no-op value is refused here.
CHAT_ONLY: dict[str, tuple[Any, ...]] = {
    "chat_format": (), "reasoning_format": ("none",), "generation_prompt": ("",),
    "parse_tool_calls": (False,), "chat_parser": ("",), "continue_final_message": (False,),
}
# Accepted and inert, as upstream (echo only primes the chat parser of a continuation, and
# a raw prompt is never one): verbose only touches OpenAI-shaped bodies; the native
# final frame always carries counts and timings; speculative.* is compiled out upstream;
# backend_sampling moves upstream's chain into the compute graph, where mlxcel's already is
# (the same chain either way, as -bs is inert); grammar_type "tool_calls" only makes upstream
# prefill the chat parser's generation_prompt into the grammar, and that is "" here.
INERT = ("verbose", "echo", "stream_options", "model", "backend_sampling", "grammar_type", *(f"speculative.{k}" for k in (
    "n_max", "n_min", "p_min", "type", "ngram_size_n", "ngram_size_m", "ngram_m_hits")))

NATIVE_FIELDS = declared_names(NativeCompletionRequest)


@dataclass
class NativeRequest:
    template: GenerationRequest  # prompt empty: filled per prompt
    stream: bool = False
    return_tokens: bool = False
    timings_per_token: bool = False
    response_fields: list[str] | None = None  # None: the whole object
    n_probs: int = 0
    post_sampling_probs: bool = False
    sse_ping_interval: int = 30
    ignored: list[str] = field(default_factory=list)


def _range_error(name: str, value: Any, lo: Any, hi: Any) -> ApiError:
    return ApiError(400, f"Field '{name}': Value must be between {lo} <= value <= {hi}, but got {value}",
                    code="invalid_parameter", param=name)


def _clean(body: dict[str, Any]) -> dict[str, Any]:
    """Drop nulls; tolerate a non-object stream_options (upstream ignores it)."""
    out = {k: v for k, v in body.items() if v is not None}
    so = out.get("stream_options")
    if so is not None and not isinstance(so, dict):
        del out["stream_options"]
    elif isinstance(so, dict):
        if so.get("include_usage", False) is not None and not isinstance(so.get("include_usage", False), bool):
            raise ApiError(400, "Field 'stream_options.include_usage': Expected a boolean",
                           code="invalid_parameter", param="stream_options")
        out["stream_options"] = {"include_usage": so["include_usage"]} if so.get("include_usage") is not None else {}
    return out


def _check_limits(body: dict[str, Any], n_parallel: int) -> None:
    for name, (lo, hi) in HARD.items():
        v = body.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            top = n_parallel if hi is None else hi
            if not lo <= v <= top:
                lo_s = lo if not isinstance(lo, float) else f"{lo:.6f}"
                hi_s = top if not isinstance(top, float) else f"{top:.6f}"
                raise _range_error(name, v, lo_s, hi_s)


def _check_cache_hints(body: dict[str, Any]) -> None:
    """n_cache_reuse asks for KV-shifted chunk reuse, which a prefix cache cannot do (the
    --cache-reuse N>0 refusal, per request); message_delimiters only places upstream's context
    checkpoints, which mlxcel does not need (its cache resumes at any block), so it is checked
    for shape and otherwise changes nothing."""
    if body.get("n_cache_reuse", 0) != 0:
        raise ApiError(400, "'n_cache_reuse' asks for reuse of non-prefix cache chunks by KV shifting; mlxcel's "
                       "prompt cache reuses exact token prefixes only (always on, see cache_prompt); send 0",
                       code="field_not_honoured", param="n_cache_reuse")
    delims = body.get("message_delimiters", [])
    if not isinstance(delims, list) or not all(
            isinstance(d, dict) and isinstance(d.get("role", ""), str) and isinstance(d.get("delimiter", ""), str)
            for d in delims):
        raise ApiError(400, "Field 'message_delimiters': expected an array of {\"role\": string, "
                       "\"delimiter\": string} objects", code="invalid_parameter", param="message_delimiters")


def _check_deferred(body: dict[str, Any]) -> None:
    for name, no_ops in CHAT_ONLY.items():
        if name in body and body[name] not in no_ops:
            raise ApiError(400, f"'{name}' configures chat parsing, which /completion does not do (it renders no "
                           f"chat template); use /v1/chat/completions", code="field_not_honoured", param=name)
    for name, no_ops in DEFERRED.items():
        if name in body and body[name] not in no_ops:
            raise ApiError(400, f"'{name}' is not supported by this server yet; send it only with "
                           f"its default value{'' if not no_ops else ' ' + msgspec.json.encode(no_ops[0]).decode()}",
                           code="field_not_honoured", param=name)


def parse_native(body: dict[str, Any], model: ServedModel, n_parallel: int,
                 sse_ping_interval: int = 30, accepts_name: Callable[[str | None], bool] | None = None) -> NativeRequest:
    """`sse_ping_interval` is the server default (--sse-ping-interval) for a body without one;
    `accepts_name` says which `model` names the loaded model serves (default: its own)."""
    body = _clean(body)
    req = convert(body, NativeCompletionRequest)
    _check_limits(body, n_parallel)
    _check_deferred(body)
    _check_cache_hints(body)
    refuse_steering_fields(body, "the native completion routes")  # the server's steering still applies
    _check_routing(req, accepts_name or model.answers_to, n_parallel)
    sampling, n_probs = _sampling(req, model)
    template = generation_request(
        model, sampling, [], n_indent=req.n_indent or 0,
        t_max_predict_ms=req.t_max_predict_ms if req.t_max_predict_ms is not None else -1,
        return_progress=bool(req.return_progress and req.stream),
        n_keep=req.n_keep or 0, n_discard=req.n_discard or 0,
        id_slot=req.id_slot if req.id_slot is not None else -1, reasoning=_budget(req, model),
    )
    fields = req.response_fields
    fields = fields if isinstance(fields, list) and all(isinstance(f, str) for f in fields) and fields else None
    return NativeRequest(
        template=template, stream=bool(req.stream), return_tokens=bool(req.return_tokens),
        timings_per_token=bool(req.timings_per_token), response_fields=fields, n_probs=n_probs,
        post_sampling_probs=bool(req.post_sampling_probs),
        sse_ping_interval=req.sse_ping_interval if req.sse_ping_interval is not None else sse_ping_interval,
        ignored=[k for k in body if k not in NATIVE_FIELDS],
    )


def _check_routing(req: NativeCompletionRequest, accepts_name: Callable[[str | None], bool], n_parallel: int) -> None:
    """One completion per prompt, on a slot that exists, for the loaded model."""
    n_cmpl = req.n_cmpl if req.n_cmpl is not None else (req.n if req.n is not None else 1)
    if n_cmpl > 1:
        raise ApiError(400, "n_cmpl above 1 is not supported: this server returns one completion per prompt",
                       code="field_not_honoured", param="n_cmpl")
    check_slot(req.id_slot, n_parallel)
    if req.model is not None and not accepts_name(req.model):
        raise ApiError(404, f"model '{echo(req.model)}' not found", code="model_not_found", param="model")


def check_slot(id_slot: int | None, n_parallel: int) -> None:
    if id_slot is not None and not -1 <= id_slot < n_parallel:
        # b10621 defers a task pinned to a slot that does not exist, forever; refused here
        raise ApiError(400, "Invalid slot ID", code="invalid_request", param="id_slot")


def _sampler_overrides(req: NativeCompletionRequest, names: tuple[str, ...]) -> dict[str, Any]:
    """SamplingParams fields for the sampler knobs `names` a body sets, with upstream's clamps
    and refusals (dry_sequence_breakers and samplers included)."""
    over: dict[str, Any] = {}
    for name in names:
        v = getattr(req, name)
        if v is None:
            continue
        if name in CLAMP:
            lo, hi = CLAMP[name]
            v = type(v)(min(max(v, lo), hi)) if not math.isnan(v) else v
        over[name] = v
    if over.get("dry_base") is not None and over["dry_base"] < 1.0:
        del over["dry_base"]  # upstream falls back to the default below 1.0
    if req.dry_sequence_breakers is not None:
        br = req.dry_sequence_breakers
        if not isinstance(br, list) or not br or not all(isinstance(s, str) for s in br):
            raise ApiError(400, "Error: dry_sequence_breakers must be a non-empty array of strings",
                           code="invalid_parameter", param="dry_sequence_breakers")
        over["dry_sequence_breakers"] = tuple(br)
    if req.samplers is not None:
        over["samplers"] = _samplers(req.samplers)
    return over


def _sampling(req: NativeCompletionRequest, model: ServedModel) -> tuple[Sampling, int]:
    """The sampler fields with upstream's clamps and refusals; also n_probs."""
    over = _sampler_overrides(req, SAMPLING_FIELDS)
    n_probs = req.n_probs if req.n_probs is not None else (req.logprobs if req.logprobs is not None else 0)
    if not 0 <= n_probs <= MAX_N_PROBS:
        raise ApiError(400, f"n_probs must be between 0 and {MAX_N_PROBS}", code="invalid_parameter",
                       param="n_probs")
    over["n_probs"] = n_probs
    over["post_sampling_probs"] = bool(req.post_sampling_probs)
    bias = None  # absent: the server's -l set
    if req.logit_bias is not None:
        bias = resolve_logit_bias(req.logit_bias, lambda s: model.tokenizer.encode(s, add_special_tokens=False),
                                  n_vocab=model.info.vocab_size)
    n_predict = next((v for v in (req.n_predict, req.max_completion_tokens, req.max_tokens) if v is not None),
                     model.n_predict)
    stop = [req.stop] if isinstance(req.stop, str) else [s for s in (req.stop or []) if s]
    sampling = Sampling(
        max_tokens=n_predict, overrides=over, seed=req.seed, bias=bias,
        # absent: --ignore-eos; upstream bans every end-of-generation token rather than skipping it
        ignore_eos=model.ignore_eos if req.ignore_eos is None else bool(req.ignore_eos), stop=stop, lora=req.lora,
        cache_prompt=req.cache_prompt if req.cache_prompt is not None else True)
    return sampling, n_probs


@dataclass(frozen=True)
class SharedFields:
    """The native fields an OpenAI-route body carries, parsed as /completion parses them."""

    overrides: dict[str, Any]  # SamplingParams fields
    ignore_eos: bool | None  # None: the server's --ignore-eos
    grammar: dict[str, Any]  # the body's grammar / json_schema keys, as sent (native_grammar.resolve)
    id_slot: int | None = None  # the slot the rows are pinned to (checked against the model's slots per row)
    n_probs: int | None = None  # per-token alternatives (the route maps it onto its logprobs shape)
    timings_per_token: bool = False  # a `timings` object on every streamed chunk

    @property
    def asks_grammar(self) -> bool:
        return native_grammar.requested(self.grammar) is not None


def parse_shared(body: dict[str, Any]) -> SharedFields:
    """b10621's OpenAI routes hand their body to the /completion field parser too: the
    sampler, grammar and ignore_eos fields of `OPENAI_SHARED` are read here by the same code,
    with the same limits, clamps and refusals."""
    sub = _clean({k: body[k] for k in OPENAI_SHARED if k in body})
    req = convert(sub, NativeCompletionRequest)
    _check_limits(sub, 1)
    if req.n_probs is not None and not 0 <= req.n_probs <= MAX_N_PROBS:
        raise ApiError(400, f"n_probs must be between 0 and {MAX_N_PROBS}", code="invalid_parameter",
                       param="n_probs")
    return SharedFields(overrides=_sampler_overrides(req, OPENAI_SAMPLERS), ignore_eos=req.ignore_eos,
                        grammar={k: body[k] for k in ("grammar", "json_schema") if k in body}, id_slot=req.id_slot,
                        n_probs=req.n_probs, timings_per_token=bool(req.timings_per_token))


def _samplers(value: Any) -> tuple[str, ...]:
    try:
        if isinstance(value, str):
            return samplers_from_chars(value)
        if isinstance(value, list):
            return samplers_from_names(value)
        raise ValueError("samplers must be an array of names or a string of sampler characters")
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_parameter", param="samplers") from None


def _budget(req: NativeCompletionRequest, model: ServedModel) -> ReasoningBudget | None:
    """reasoning_budget_tokens with its tags and message (defaults <think> / </think> / "")."""
    n = req.reasoning_budget_tokens
    if n is None or n < 0:
        return None
    start = req.reasoning_budget_start_tag if req.reasoning_budget_start_tag is not None else OPEN
    ends = req.reasoning_budget_end_tags if req.reasoning_budget_end_tags is not None else req.reasoning_budget_end_tag
    ends = [ends] if isinstance(ends, str) else ends
    end = ends[0] if isinstance(ends, list) and ends else CLOSE
    message = req.reasoning_budget_message if req.reasoning_budget_message is not None else ""
    for name, value in (("reasoning_budget_start_tag", start), ("reasoning_budget_end_tags", end),
                        ("reasoning_budget_message", message)):
        if not isinstance(value, str) or (not value and name != "reasoning_budget_message"):
            raise ApiError(400, f"'{name}' must be {'a string' if name.endswith('message') else 'non-empty strings'}",
                           code="invalid_parameter", param=name)
    return reasoning_budget(model, n, start, end, message)


def with_prompt(template: GenerationRequest, prompt: list[int]) -> GenerationRequest:
    """One engine request per prompt (each gets its own id)."""
    return replace(template, prompt=prompt, id=GenerationRequest(prompt=[]).id)
