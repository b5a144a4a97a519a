"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat shapes."""

from __future__ import annotations

from typing import Any

from litestar import Request, post

from mlxcel.api.body import convert, read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.openai import chat_surface
from mlxcel.api.openai import generation as g
from mlxcel.api.openai.fields import check_fields, ignored_fields_header
from mlxcel.api.openai.schemas import ChatCompletionRequest
from mlxcel.api.state import AppState, ServedModel
from mlxcel.engine.chat_template import TemplateError, render_chat, render_plain

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
    prefill = ""
    if clean[-1]["role"] == "assistant" and prefill_assistant:
        if len(clean) > 1 and clean[-2]["role"] == "assistant":
            raise ApiError(400, "Cannot have 2 or more assistant messages at the end of the list.",
                           code="invalid_parameter", param="messages")
        prefill = clean.pop()["content"]
    tok = model.tokenizer
    try:
        if tok.chat_template:
            text = render_chat(tok.chat_template, clean, add_generation_prompt=True,
                               bos_token=tok.bos_token, eos_token=tok.eos_token, tools=tools, extra=extra)
        else:
            text = render_plain(clean)
    except TemplateError as e:
        raise ApiError(400, str(e), code="invalid_parameter", param="messages") from None
    return text + prefill


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, app_state: AppState) -> Any:
    body = await read_json_object(request)
    req = convert(body, ChatCompletionRequest)
    ignored = check_fields(body, ChatCompletionRequest, "/v1/chat/completions")
    model = g.served_model(app_state, req.model)
    prep = chat_surface.prepare(app_state, model, req)
    greq = g.build_request(req, model, prep.prompt)
    handle = g.submit(model, greq)
    out = chat_surface.ChatOutput(prep, parallel_tool_calls=req.parallel_tool_calls is not False,
                                  echo=bool(req.echo))
    cid, created = g.new_id("chatcmpl"), g.now()
    base = {"id": cid, "created": created, "model": model.id}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def frames(events):
            yield g.sse({**base, "object": "chat.completion.chunk", "system_fingerprint": g.fingerprint(model),
                         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            async for _, ev in events:
                if ev.error is not None:
                    yield g.error_frame(ev)
                    return
                deltas = out.feed(ev.text) + (out.finish() if ev.done else [])
                for i, delta in enumerate(deltas if not ev.done else [*deltas, {}]):
                    last = ev.done and i == len(deltas)
                    chunk = {**base, "object": "chat.completion.chunk", "system_fingerprint": g.fingerprint(model),
                             "choices": [{"index": 0, "delta": delta,
                                          "finish_reason": out.finish_reason(ev.finish_reason) if last else None}]}
                    if last:
                        chunk["usage"] = g.usage([("", ev)])
                    yield g.sse(chunk)
                if ev.done and include_usage:
                    yield g.sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": g.usage([("", ev)])})

        return g.stream_response([handle], frames, ignored_fields_header(ignored))
    results = await g.collect(request, [handle])
    text, ev = results[0]
    g.raise_for_error(ev)
    return g.json_response({
        **base, "object": "chat.completion", "system_fingerprint": g.fingerprint(model),
        "choices": [{"index": 0, "message": chat_surface.message(out.feed(text) + out.finish()),
                     "logprobs": None, "finish_reason": out.finish_reason(ev.finish_reason)}],
        "usage": g.usage(results),
    }, ignored)
