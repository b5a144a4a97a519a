"""POST /v1/completions: raw prompts (no chat template) -> engine -> OpenAI text shapes."""

from __future__ import annotations

from typing import Any

from litestar import Request, post

from mlxcel.api.body import convert, read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.openai import generation as g
from mlxcel.api.openai import response_format as rf
from mlxcel.api.openai.fields import check_fields, ignored_fields_header
from mlxcel.api.openai.schemas import CompletionRequest
from mlxcel.api.state import ServedModel, AppState


def tokenize_prompts(model: ServedModel, prompt: Any) -> list[list[int]]:
    """A string, a list of strings, a token list, or a list of token lists."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [tok.encode(p) for p in prompt]
    elif all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids, "
                       "or a list of token-id lists", code="invalid_parameter", param="prompt")
    if not prompts:
        raise ApiError(400, "prompt must not be empty", code="invalid_parameter", param="prompt")
    vocab = model.info.vocab_size
    for i, p in enumerate(prompts):
        if not p:
            raise ApiError(400, f"prompt[{i}] tokenizes to nothing", code="invalid_parameter", param="prompt")
        if any(not 0 <= t < vocab for t in p):
            raise ApiError(400, f"prompt[{i}] holds a token id outside the vocabulary", code="invalid_parameter", param="prompt")
    return prompts


@post("/v1/completions", status_code=200)
async def completions(request: Request, app_state: AppState) -> Any:
    body = await read_json_object(request)
    req = convert(body, CompletionRequest)
    rf.refuse(body, "/v1/completions")
    ignored = check_fields(body, CompletionRequest, "/v1/completions")
    model = g.served_model(app_state, req.model)
    greqs = [g.build_request(req, model, p) for p in tokenize_prompts(model, req.prompt)]
    handles = []
    try:
        for greq in greqs:
            handles.append(g.submit(model, greq))
    except ApiError:
        for h in handles:
            h.cancel()
        raise
    cid, created = g.new_id("cmpl"), g.now()
    base = {"id": cid, "object": "text_completion", "created": created, "model": model.id}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def frames(events):
            finals = []
            async for i, ev in events:
                if ev.error is not None:
                    yield g.error_frame(ev)
                    return
                if ev.text or ev.done:
                    yield g.sse({**base, "system_fingerprint": g.fingerprint(model),
                                 "choices": [{"index": i, "text": ev.text, "logprobs": None,
                                              "finish_reason": ev.finish_reason}]})
                if ev.done:
                    finals.append(("", ev))
            if include_usage:
                yield g.sse({**base, "choices": [], "usage": g.usage(finals)})

        return g.stream_response(handles, frames, ignored_fields_header(ignored))
    results = await g.collect(request, handles)
    for _, ev in results:
        g.raise_for_error(ev)
    return g.json_response({
        **base, "system_fingerprint": g.fingerprint(model),
        "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": ev.finish_reason}
                    for i, (text, ev) in enumerate(results)],
        "usage": g.usage(results),
    }, ignored)
