"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat shapes.

`messages` and each `extra_messages` conversation are rendered separately; every one, and
each of `n` choices, is its own engine row with its own seed, returned in index order;
`logprobs: true` reports each generated token's log-probability (logprobs.py). With
`allowed_token_ids` the request is chat scoring (scoring.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response, post

from mlxcel.api import media
from mlxcel.api import stream_runner as runner
from mlxcel.api.body import check_count, convert, read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.model_switch import model_for
from mlxcel.api.openai import chat_surface, reasoning_control
from mlxcel.api.openai import generation as g
from mlxcel.api.openai import logprobs as lp
from mlxcel.api.openai import scoring as sc
from mlxcel.api.openai.fields import (
    CHAT, MESSAGE_KEYS, check_fields, message_locations, object_locations, settle_unused, strict_mode,
)
from mlxcel.api.openai.encoders import ChatEncoder
from mlxcel.api.openai.schemas import ChatCompletionRequest
from mlxcel.api.openai import response_format as rf
from mlxcel.api.state import AppState
from mlxcel.api.stream_runner import Job
from mlxcel.chat.chat_template import TemplateError, render_chat, render_plain
from mlxcel.chat.reasoning import primed
from mlxcel.config.limits import MAX_PROMPTS, echo
from mlxcel.engine.requests import RequestHandle
from mlxcel.engine.types import GenerationRequest
from mlxcel.runtime.served import ServedModel
from mlxcel.steering import requests as steer

_ROLES = {"system", "user", "assistant", "tool", "function", "developer"}


def _text_content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif kind in ("image_url", "input_image", "input_audio", "audio", "video_url"):
                raise ApiError(501, f"{kind.split('_')[-1] if kind != 'image_url' else 'image'} input is not supported "
                               "- hint: the loaded model has no media tower", code="not_supported", type="not_supported_error")
            else:
                raise ApiError(400, f"{where}.content[{i}] must be a text part", code="invalid_parameter", param="messages")
        return "".join(out)
    raise ApiError(400, f"{where}.content must be a string or a list of parts", code="invalid_parameter", param="messages")


def render_prompt(model: ServedModel, messages: list[dict[str, Any]]) -> list[int]:
    return model.tokenizer.encode(render_prompt_text(model, messages), add_special_tokens=False)


def render_prompt_text(model: ServedModel, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                       extra: dict[str, Any] | None = None, prefill_assistant: bool = True) -> str:
    """The text the chat template renders for these messages (plus a continued prefix)."""
    if not messages:
        raise ApiError(400, "messages must not be empty", code="invalid_parameter", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ApiError(400, f"messages[{i}] needs a role among {sorted(_ROLES)}", code="invalid_parameter", param="messages")
        clean.append({**m, "content": _text_content(m.get("content"), f"messages[{i}]")})
    # A trailing assistant message is a prefix to continue, not a turn to answer.
    prefill, thought = "", None
    if clean[-1]["role"] == "assistant" and prefill_assistant:
        if len(clean) > 1 and clean[-2]["role"] == "assistant":
            raise ApiError(400, "Cannot have 2 or more assistant messages at the end of the list.",
                           code="invalid_parameter", param="messages")
        last = clean.pop()
        prefill, thought = last["content"], last.get("reasoning_content")
    tok = model.tokenizer
    try:
        if tok.chat_template:
            text = render_chat(tok.chat_template, clean, add_generation_prompt=True,
                               bos_token=tok.bos_token, eos_token=tok.eos_token, tools=tools, extra=extra)
        else:
            text = render_plain(clean)
    except TemplateError as e:
        raise ApiError(400, str(e), code="invalid_parameter", param="messages") from None
    if thought:
        # Continuing a thought needs the template's own open block; rebuilding markers here would
        # hard-code a per-family table, so every other shape is refused rather than dropped.
        if not isinstance(thought, str) or prefill or not primed(text):
            raise ApiError(400, "a trailing assistant message with reasoning_content is continued only when it has "
                           "no content and the chat template opens a thinking block", code="invalid_parameter",
                           param="messages")
        prefill = thought
    return text + prefill


def _conversations(req: ChatCompletionRequest) -> list[tuple[str, list[dict[str, Any]]]]:
    """Every conversation of the request with its location: messages, then extra_messages."""
    convs = [("messages", req.messages)]
    convs += [(f"extra_messages[{k}]", m) for k, m in enumerate(req.extra_messages or [])]
    return convs


def _renderable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Only the keys the contract honours reach the template (the rest are reported)."""
    return [{k: v for k, v in m.items() if k in MESSAGE_KEYS} if isinstance(m, dict) else m for m in messages]


def _render(model: ServedModel, where: str, messages: list[dict[str, Any]]) -> list[int]:
    try:
        return render_prompt(model, _renderable(messages))
    except ApiError as e:
        if where != "messages":
            e.message = f"{where}: {e.message}"
        raise


@dataclass
class ChatAsk:
    """A chat completion request with its fields checked: nothing here needs the model."""

    req: ChatCompletionRequest
    steering: steer.SteeringFields
    constraint: rf.Constraint | None  # response_format's
    spec: sc.ScoringSpec | None  # a scoring request's (None: generation)
    logprobs: lp.LogprobsAsk | None  # a generation's (None: not asked)
    sampling: g.SamplingAsk
    headers: dict[str, str]  # the field contract's, then the seed's and the constraint's

    @property
    def n(self) -> int:
        return self.req.n or 1


def _check_shape(req: ChatCompletionRequest) -> None:
    n = req.n or 1
    if req.stream and n > 1:
        raise ApiError(400, "n above 1 is not available with stream: true", code="field_not_honoured", param="n")
    if req.stream and req.extra_messages:
        raise ApiError(400, "extra_messages is not available with stream: true", code="field_not_honoured",
                       param="extra_messages")
    if n > 1 and req.extra_messages:
        raise ApiError(400, "send either n above 1 or extra_messages, not both", code="invalid_parameter",
                       param="extra_messages")


async def _ask(request: Request) -> ChatAsk:
    """Read and check the body: the field contract, scoring mode, the sampling ranges."""
    strict = strict_mode(request.headers)
    body = await read_json_object(request)
    check_count(body, "extra_messages", MAX_PROMPTS, "conversations")
    steering = steer.take_fields(body)  # profile, steering_intensity, return_sae_activations: honoured here
    req = convert(body, ChatCompletionRequest)
    constraint = rf.parse(body)  # first: a conflicting field is refused naming response_format
    unused = check_fields(body, ChatCompletionRequest, CHAT)
    unused += message_locations(body.get("messages"), "messages")
    for k, conv in enumerate(body.get("extra_messages") or []):
        unused += message_locations(conv, f"extra_messages[{k}]")
    unused += object_locations(body.get("stream_options"), ["include_usage"], "stream_options")
    _, spec, mode_unused = sc.resolve(req, body, chat=True)
    shared, shared_unused = g.read_shared(body, scoring=spec is not None)
    n_probs = shared.n_probs if shared is not None else None
    logprobs = lp.ask_of(req, chat=True, n_probs=n_probs) if spec is None else None
    _check_shape(req)
    unused += mode_unused + shared_unused + lp.n_probs_unused(req, n_probs, chat=True)
    headers = settle_unused(unused, strict, CHAT)
    return ChatAsk(req=req, steering=steering, constraint=constraint, spec=spec, logprobs=logprobs,
                   sampling=g.validate_sampling(req, logprobs, shared), headers=headers)


async def _with_model(app_state: AppState, model: ServedModel, ask: ChatAsk) -> list:
    """What needs the model before rendering: the images read (returned; their placeholders
    put in `ask.req`), and the refusals and headers that come after them."""
    req, images = ask.req, []
    if media.has_media(req.messages) or any(media.has_media(m) for m in req.extra_messages or []):
        if ask.spec is not None:
            raise ApiError(400, "image parts are not accepted on a scoring request (allowed_token_ids)",
                           code="field_not_honoured", param="messages")
        messages, images = await media.gather(model, media.policy(app_state.settings), req.messages,
                                              list(req.extra_messages or []))
        ask.req = msgspec.structs.replace(req, messages=messages)
    ask.headers.update(g.seed_header(req.seed, "batch-shape" if req.extra_messages else "request"))
    steering = ask.steering
    if ask.spec is not None and (steering.profile is not None or steering.intensity is not None):
        field = "profile" if steering.profile is not None else "steering_intensity"
        raise ApiError(400, f"'{echo(field)}' is not honoured on a scoring request: scoring is never steered",
                       code="field_not_honoured", param=field)
    if steering.activations is not None and (ask.n > 1 or req.extra_messages):
        raise ApiError(400, "return_sae_activations reads one position axis: it is refused with n above 1 and "
                       "with extra_messages", code="invalid_parameter", param="return_sae_activations")
    if ask.constraint is not None:
        ask.headers.update(ask.constraint.header)
    return images


async def _rows(app_state: AppState, model: ServedModel, ask: ChatAsk, prep: chat_surface.Prepared,
                images: list) -> tuple[list[GenerationRequest], dict[str, str], steer.ActivationReader | None]:
    """One engine row per conversation and choice, each with its seed, grammar, steering and
    thinking budget; also the steering headers and the activation reader."""
    prompts = [(where, prep.prompt if where == "messages" else _render(model, where, msgs))
               for where, msgs in _conversations(ask.req)]
    if ask.n > 1:
        prompts = prompts * ask.n
    media_of = None
    if images:  # only `messages` carries images (media.check); the engine splices them per row
        full, media_of = await media.prepare(model, prompts[0][1], images)
        prompts = [(where, full if where == "messages" else p) for where, p in prompts]
    greqs = [g.build_request(ask.sampling, model, p, row=row, param=where.split("[")[0])
             for row, (where, p) in enumerate(prompts)]
    for greq, (where, _) in zip(greqs, prompts):
        if media_of is not None and where == "messages":
            media.keyed(greq, media_of)
    if ask.constraint is not None and prep.forced is not None:
        raise ApiError(400, "response_format cannot be combined with tool_choice 'required' or a named function",
                       code="response_format_unsupported", param="response_format")
    calls_grammar = await chat_surface.tool_grammar(prep, model)
    other = "response_format" if ask.constraint is not None else "tools" if prep.tools else None
    native = await g.shared_grammar(ask.sampling, model, other)  # b10621's grammar / json_schema fields
    steer_headers, reader = {}, None
    for greq in greqs:  # each choice carries its own steering delta and grammar through the batch
        steer_headers, reader = steer.apply(ask.steering, model.steering, app_state.steering_store, greq)
        if ask.constraint is not None:
            greq.grammar = await rf.compile_grammar(ask.constraint, model)
        elif calls_grammar is not None:
            greq.grammar = calls_grammar
        elif native is not None:
            greq.grammar = native
        greq.keep_tokens = prep.keep_tokens
        greq.reasoning = prep.budget
    return greqs, steer_headers, reader


def _armer(app_state: AppState, cid: str,
           prep: chat_surface.Prepared) -> Callable[[list[RequestHandle]], None] | None:
    """reasoning_control: the request's rows armed under its completion id once they run."""
    control = prep.budget.control if prep.budget is not None else None
    if control is None:
        return None
    return lambda handles: reasoning_control.arm(app_state, cid, control, handles)


# b10621 also mounts the unprefixed spelling; both are the same handler under the same contract
@post(["/v1/chat/completions", "/chat/completions"], status_code=200)
async def chat_completions(request: Request, app_state: AppState) -> Any:
    ask = await _ask(request)
    model = await model_for(app_state, ask.req.model)  # may switch models (api/model_switch.py)
    images = await _with_model(app_state, model, ask)
    req = ask.req
    # only the message keys the contract honours reach the template (the rest were reported above)
    prep = chat_surface.prepare(app_state, model, msgspec.structs.replace(req, messages=_renderable(req.messages)))
    cid = g.new_id("chatcmpl")
    base = {"id": cid, "created": g.now(), "model": model.id}
    if ask.spec is not None:
        return await _score(model, ask.spec, _conversations(req), base, ask.headers, ask.steering.activations)
    greqs, steer_headers, reader = await _rows(app_state, model, ask, prep, images)
    outputs = [chat_surface.ChatOutput(prep, parallel_tool_calls=req.parallel_tool_calls is not False,
                                       echo=bool(req.echo)) for _ in greqs]  # one output parser per choice
    encoder = ChatEncoder(base, g.fingerprint(model), outputs, alias=app_state.settings.chat.reasoning_alias_field,
                          include_usage=bool(req.stream_options and req.stream_options.include_usage),
                          reader=reader, constraint=ask.constraint, on_begin=_armer(app_state, cid, prep),
                          logprobs=lp.ChatLogprobs(model, ask.logprobs) if ask.logprobs is not None else None,
                          timings=ask.sampling.timings_per_token)
    job = Job(model=model, requests=greqs, headers={**ask.headers, **steer_headers}, stream=req.stream)
    return await runner.run(request, job, encoder)


async def _score(model: ServedModel, spec: sc.ScoringSpec, convs: list[tuple[str, list[dict[str, Any]]]],
                 base: dict[str, Any], headers: dict[str, str], activations: dict | None = None) -> Any:
    """Each conversation rendered with the generation prompt and scored as completion scoring
    of that text without special tokens, one at a time, one choice each. Unsteered: the
    response says so in `X-miLLM-Steering: none`."""
    if not model.tokenizer.chat_template:
        raise ApiError(400, "chat scoring needs the model's chat template and this model has none; score the "
                       "prompt on /v1/completions instead", code="no_chat_template", param="messages")
    choices, n_prompt, reader = [], 0, None
    for i, (where, msgs) in enumerate(convs):
        prompt = _render(model, where, msgs)
        try:
            sc.check_prompt(model, spec, prompt, where)
            if activations is not None:  # one conversation (extra_messages was refused)
                reader = steer.scoring_reader(model.steering, activations, len(prompt))
            scored = await sc.score_prompt(model, prompt, spec, reader.capture() if reader else None)
        except ApiError as e:
            if where != "messages":
                e.message = f"{where}: {e.message}"
            raise
        n_prompt += len(prompt)
        choices.append({"index": i, "message": {"role": "assistant", "content": sc.token_text(model, scored.token)},
                        "logprobs": sc.chat_logprobs(model, spec, scored), "finish_reason": "length"})
    body = {
        **base, "object": "chat.completion", "system_fingerprint": g.fingerprint(model), "choices": choices,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(convs), "total_tokens": n_prompt + len(convs),
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }
    if reader is not None:
        body["millm"] = {"sae_activations": reader.render()}
    return Response(body, headers={**headers, **steer.UNSTEERED})
