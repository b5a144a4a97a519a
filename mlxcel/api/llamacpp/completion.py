"""POST /completion and /completions: b10621's native completion object.

The prompt may be a string, a mixed array of strings and token ids (one prompt), or an
array of those (several prompts, answered as a JSON array in prompt order). Streaming
sends one frame per generated token (and prompt-progress frames when asked), then the
final object itself; there is no `[DONE]` sentinel on native streams. The server's steering
(live values, active profile or circuit) applies to every row, as on /v1.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.response import Stream

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp import native_grammar, render
from mlxcel.api.llamacpp.native_params import NativeRequest, parse_native, with_prompt
from mlxcel.api.openai.fields import ignored_fields_header
from mlxcel.api.openai.generation import SSE_HEADERS, merged, served_model, submit_all
from mlxcel.api.state import AppState
from mlxcel.engine.requests import RequestHandle
from mlxcel.engine.types import GenerationRequest, TokenEvent
from mlxcel.runtime.served import ServedModel
from mlxcel.steering.requests import server_steering

PING = b": ping\n\n"


def _tokenize_one(model: ServedModel, prompt: Any, where: str) -> list[int]:
    tok = model.tokenizer
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_string"), str):
        if prompt.get("multimodal_data"):
            raise ApiError(501, "multimodal_data is not supported: the loaded model has no media tower",
                           code="not_supported", type="not_supported_error")
        return tok.encode(prompt["prompt_string"])
    if isinstance(prompt, list) and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in prompt):
        # a mixed prompt: strings tokenized (special tokens added for a leading string only), ids kept
        out: list[int] = []
        for i, p in enumerate(prompt):
            out.extend(tok.encode(p, add_special_tokens=(i == 0)) if isinstance(p, str) else [p])
        return out
    raise ApiError(400, f"{where} must be a string, an array of strings and token ids, or an object "
                   "with prompt_string", code="invalid_parameter", param="prompt")


def tokenize_native_prompts(model: ServedModel, prompt: Any) -> list[list[int]]:
    if prompt is None:
        raise ApiError(400, '"prompt" must be provided', code="invalid_parameter", param="prompt")
    if isinstance(prompt, list) and any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [_tokenize_one(model, prompt, "prompt")]
    elif isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", code="invalid_parameter", param="prompt")
        prompts = [_tokenize_one(model, p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        prompts = [_tokenize_one(model, prompt, "prompt")]
    vocab = model.info.vocab_size
    for p in prompts:
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is out of range [0, {vocab})", code="invalid_parameter", param="prompt")
    return prompts


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _native_error(ev: TokenEvent) -> dict[str, Any]:
    return {"error": {"code": 500, "message": ev.error, "type": "server_error"}}


async def _with_pings(events: AsyncIterator, interval: int) -> AsyncIterator:
    """Yield the events, and None whenever `interval` seconds pass without one."""
    if interval <= 0:
        async for ev in events:
            yield ev
        return
    it = events.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                return
            yield ev
            nxt = asyncio.ensure_future(it.__anext__())
    finally:
        nxt.cancel()


class _Result:
    """What one prompt's run has produced so far."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.tokens: list[int] = []
        self.probs: list = []
        self.final: TokenEvent | None = None

    def add(self, ev: TokenEvent) -> None:
        if ev.progress is not None:
            return
        self.parts.append(ev.text)
        if ev.token is not None:
            self.tokens.append(ev.token)
        if ev.probs is not None:
            self.probs.append(ev.probs)
        if ev.done:
            self.final = ev

    def content(self) -> str:
        text = "".join(self.parts)
        cut = self.final.truncate_to if self.final is not None else None
        return text if cut is None else text[:cut]


def final_object(model: ServedModel, nreq: NativeRequest, greq: GenerationRequest, res: _Result,
                 index: int, stream: bool) -> dict[str, Any]:
    ev = res.final
    probs = res.probs if not stream else None
    if probs and ev.stop_type == "word":
        # drop the reports of the tokens that spelled the stop word, as upstream does
        n_stop = len(model.tokenizer.encode(ev.stopping_word, add_special_tokens=False))
        probs = probs[: max(len(probs) - n_stop, 0)]
    obj = render.final_json(
        model, greq, ev, index=index, content="" if stream else res.content(),
        tokens=res.tokens if (nreq.return_tokens and not stream) else [], stream=stream,
        timings_per_token=nreq.timings_per_token, probs=probs)
    return render.project(obj, nreq.response_fields)


async def _watch_disconnect(request: Request, handles: list[RequestHandle]) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            for h in handles:
                h.cancel()
            return


async def respond(request: Request, app_state: AppState, model: ServedModel, nreq: NativeRequest,
                  greqs: list[GenerationRequest]) -> Any:
    """Run the prompts and answer in the native shape (one object, an array, or a stream)."""
    headers = {**ignored_fields_header(nreq.ignored), **server_steering(app_state, model, greqs)}
    handles = submit_all(model, greqs)
    results = [_Result() for _ in handles]
    if nreq.stream:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for item in _with_pings(merged(handles), nreq.sse_ping_interval):
                    if item is None:
                        yield PING
                        continue
                    i, ev = item
                    if ev.error is not None:
                        yield _sse(_native_error(ev))
                        return
                    results[i].add(ev)
                    idx = i if len(handles) > 1 else 0
                    yield _sse(render.partial_json(model, ev, index=idx, timings_per_token=nreq.timings_per_token))
                    if ev.done:
                        yield _sse(final_object(model, nreq, greqs[i], results[i], idx, stream=True))
            finally:
                for h in handles:
                    h.cancel()

        # the handler is declared JSON (for the non-streaming answer): name the stream type explicitly
        return Stream(body(), media_type="text/event-stream",
                      headers={**SSE_HEADERS, **headers, "Content-Type": "text/event-stream"})

    watcher = asyncio.create_task(_watch_disconnect(request, handles))

    async def run(h: RequestHandle, res: _Result) -> None:
        async for ev in h:
            res.add(ev)

    try:
        await asyncio.gather(*(run(h, r) for h, r in zip(handles, results)))
    finally:
        watcher.cancel()
        for h in handles:
            h.cancel()
    for res in results:
        if res.final is None:
            raise ApiError(499, "request cancelled")
        if res.final.error is not None:
            raise ApiError(500, res.final.error, code=res.final.error_code or "server_error", type="server_error")
    objs = [final_object(model, nreq, g, r, i, stream=False) for i, (g, r) in enumerate(zip(greqs, results))]
    return Response(objs[0] if len(objs) == 1 else objs, headers=headers)


@post(["/completion", "/completions"], status_code=200)
async def completion(request: Request, app_state: AppState) -> Any:
    body = await read_json_object(request)
    model = served_model(app_state, None)
    nreq = parse_native(body, model, app_state.settings.parallel, app_state.settings.sse_ping_interval)
    nreq.template.grammar = await native_grammar.resolve(body, model)
    nreq.template.keep_tokens = native_grammar.preserved_tokens(body, model)  # written into the text
    nreq.template.grammar = native_grammar.lazy(body, model, nreq.template.grammar, nreq.template.keep_tokens)
    prompts = tokenize_native_prompts(model, body.get("prompt"))
    return await respond(request, app_state, model, nreq, [with_prompt(nreq.template, p) for p in prompts])
