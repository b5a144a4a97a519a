"""What the chat and text completion routes share: request -> engine -> OpenAI shapes.

A route turns its body into prompts (token lists) plus one `GenerationRequest` template,
then `respond` runs them on the engine and renders either one JSON body or an SSE stream.
Several prompts (a list on /v1/completions) become several choices, run concurrently.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from litestar import Request, Response
from litestar.response import Stream

from mlxcel.api.errors import ApiError, error_type
from mlxcel.api.openai.schemas import _Sampling
from mlxcel.api.state import AppState
from mlxcel.engine.requests import RequestHandle
from mlxcel.engine.sampling_params import fold_seed
from mlxcel.engine.types import EngineError, GenerationRequest, TokenEvent
from mlxcel.runtime.served import ServedModel

# Content-Type named here too: a handler declared JSON would otherwise label its stream JSON
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Content-Type": "text/event-stream"}


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
    if not model.answers_to(name):
        raise ApiError(404, f"The model '{name}' does not exist", code="model_not_found", param="model")
    return model


def validate_sampling(req: _Sampling) -> int | None:
    """Range checks shared by every /v1 generation and scoring request; the effective
    max_tokens (None: the server's default)."""
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
    return max_tokens


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
            raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model (0..{n_vocab - 1})",
                           code="invalid_parameter", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{key!r}] must be a number from -100 to 100",
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


def build_request(req: _Sampling, model: ServedModel, prompt: list[int], *, row: int = 0,
                  param: str = "messages") -> GenerationRequest:
    """One engine row of a request; `row` picks the row's seed (see `row_seed`)."""
    max_tokens = validate_sampling(req)
    if max_tokens is None:
        max_tokens = model.n_predict
    overrides: dict[str, Any] = {}
    for field in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty"):
        value = getattr(req, field)
        if value is not None:
            overrides[field] = value
    bias = openai_logit_bias(req.logit_bias, model.info.vocab_size)
    if bias or model.ignore_eos:  # --ignore-eos reaches /v1 too: the OpenAI bodies have no field for it
        overrides["logit_bias"] = model.request_bias(bias or None, model.ignore_eos)
    params = replace(model.defaults, **overrides)
    if req.seed is not None:
        params = replace(params, seed=fold_seed(row_seed(req.seed, row)))
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    check_context(model, len(prompt), max_tokens, param)
    from mlxcel.api.llamacpp.lora_adapters import request_lora

    lora, asked = request_lora(model, req.lora)
    return GenerationRequest(prompt=prompt, params=params, max_tokens=max_tokens, stop=stop,
                             ignore_eos=model.ignore_eos, cache_prompt=req.cache_prompt is not False,
                             lora=lora, lora_asked=asked)


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


def submit(model: ServedModel, greq: GenerationRequest) -> RequestHandle:
    try:
        return model.engine.submit(greq)
    except EngineError as e:
        raise ApiError(e.status, e.message, code=e.code) from None


def submit_all(model: ServedModel, greqs: list[GenerationRequest]) -> list[RequestHandle]:
    """Submit every row of one request; if one is refused, cancel those already queued."""
    handles: list[RequestHandle] = []
    try:
        for greq in greqs:
            handles.append(submit(model, greq))
    except ApiError:
        for h in handles:
            h.cancel()
        raise
    return handles


async def watch_disconnect(request: Request, handles: list[RequestHandle]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for h in handles:
                h.cancel()
            return


async def collect(request: Request, handles: list[RequestHandle]) -> list[tuple[str, TokenEvent]]:
    """Run every handle to completion; cancel them all if the client goes away."""
    watcher = asyncio.create_task(watch_disconnect(request, handles))

    async def one(h: RequestHandle) -> tuple[str, TokenEvent]:
        parts: list[str] = []
        async for ev in h:
            parts.append(ev.text)
            if ev.done:
                return "".join(parts), ev
        raise ApiError(499, "request cancelled")

    try:
        return await asyncio.gather(*(one(h) for h in handles))
    finally:
        watcher.cancel()
        for h in handles:
            h.cancel()


def usage(results: list[tuple[str, TokenEvent]]) -> dict[str, Any]:
    prompt = sum(ev.prompt_tokens for _, ev in results)
    completion = sum(ev.completion_tokens for _, ev in results)
    cached = sum(ev.timings.cache_n for _, ev in results if ev.timings is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# Engine errors that end a request have the seed's statuses (503 for the retryable ones); the
# rest are the server's own failure.
EVENT_STATUS = {"model_busy": 503, "insufficient_memory": 503, "queue_full": 503, "context_length_exceeded": 400}


def raise_for_error(ev: TokenEvent) -> None:
    if ev.error is not None:
        raise ApiError(EVENT_STATUS.get(ev.error_code or "", 500), ev.error, code=ev.error_code or "server_error",
                       type=error_type(ev.error_code))


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Events of several handles as they come, tagged with the handle's index."""
    if len(handles) == 1:
        async for ev in handles[0]:
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        async for ev in h:
            await queue.put((i, ev))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, ev = await queue.get()
            remaining -= ev.done
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def stream_response(handles: list[RequestHandle], frames: Callable[[AsyncIterator[tuple[int, TokenEvent]]], AsyncIterator[bytes]],
                    headers: dict[str, str]) -> Stream:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in frames(merged(handles)):
                yield chunk
            yield b"data: [DONE]\n\n"
        finally:
            for h in handles:
                h.cancel()

    return Stream(body(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


def json_response(body: dict[str, Any], headers: dict[str, str]) -> Response:
    return Response(body, headers=headers)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_frame(ev: TokenEvent) -> bytes:
    """A mid-stream error event; its type follows the code as a non-streamed error's would."""
    return sse({"error": {"message": ev.error, "type": error_type(ev.error_code), "param": None,
                          "code": ev.error_code}})
