"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A Messages request is translated into the chat request the OpenAI route serves (system
prompt first, content blocks flattened, tool_use -> assistant tool_calls, tool_result ->
`role: tool` messages, `thinking` -> the template's enable_thinking), rendered and parsed
by the same chat surface, and the output is written back as content blocks: thinking,
text and tool_use, in the order the model produced them. Streaming follows Anthropic's
event sequence (message_start, content_block_start/delta/stop, message_delta,
message_stop). A message naming another checkpoint of the model store switches to it first,
as the OpenAI /v1 routes do (api/model_switch.py); count_tokens counts with the loaded model
and does not switch.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec
from litestar import Request, post

from mlxcel.api import media
from mlxcel.api import stream_runner as runner
from mlxcel.api.body import convert, read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.model_switch import model_for
from mlxcel.api.openai import chat_surface
from mlxcel.api.openai import generation as g
from mlxcel.api.openai.fields import settle_unused, strict_mode
from mlxcel.api.openai.schemas import ChatCompletionRequest
from mlxcel.api.state import AppState
from mlxcel.config.limits import ERROR_MESSAGE_CHARS, echo
from mlxcel.runtime.served import ServedModel
from mlxcel.api.stream_runner import Encoder, Job, Run
from mlxcel.chat.json_prefix import object_of_prefix
from mlxcel.engine.types import TokenEvent
from mlxcel.steering import requests as steer

_STOP = {"eos": "end_turn", "word": "stop_sequence", "limit": "max_tokens", "none": "end_turn"}


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for b in content:
            if not isinstance(b, dict) or b.get("type") != "text":
                raise ApiError(400, f"{where}: only text blocks are supported here", code="invalid_parameter")
            parts.append(b.get("text") or "")
        return "".join(parts)
    raise ApiError(400, f"{where}: content must be a string or a list of blocks", code="invalid_parameter")


def _chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be 'user' or 'assistant'", code="invalid_parameter")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of blocks", code="invalid_parameter")
        text, thinking, calls = [], [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(b.get("text") or "")
            elif kind == "thinking" and role == "assistant":
                thinking.append(b.get("thinking") or "")
            elif kind == "redacted_thinking" and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                body = b.get("content")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text(body, f"messages[{i}].content[{j}]") if body is not None else ""})
            elif kind in ("image", "document", "image_url"):  # images reach here only unread (api/media.py)
                raise ApiError(501, f"{'document' if kind == 'document' else 'image'} input is not supported - "
                               "hint: the loaded model has no media tower", code="not_supported",
                               type="not_supported_error")
            else:
                raise ApiError(400, f"messages[{i}].content[{j}]: unsupported block type {echo(kind)!r}",
                               code="invalid_parameter")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
            out.append({"role": "user", "content": "".join(text)})
    return out


def _chat_request(req: MessagesRequest, *, counting: bool = False) -> ChatCompletionRequest:
    if not counting and (req.max_tokens is None or req.max_tokens < 1):
        raise ApiError(400, "max_tokens: a positive integer is required", code="invalid_parameter", param="max_tokens")
    tools = None
    if req.tools:
        tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                   "parameters": t.get("input_schema") or {}}} for t in req.tools]
    kind = (req.tool_choice or {}).get("type", "auto")
    if kind == "any":
        choice: Any = "required"
    elif kind == "tool":
        choice = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
    elif kind in ("auto", "none"):
        choice = kind
    else:
        raise ApiError(400, f"tool_choice type '{echo(kind)}' must be auto, any, tool or none",
                       code="invalid_parameter",
                       param="tool_choice")
    kwargs, budget = None, None
    if req.thinking is not None:
        kwargs = {"enable_thinking": req.thinking.get("type") == "enabled"}
        if kwargs["enable_thinking"] and req.thinking.get("budget_tokens") is not None:
            budget = req.thinking["budget_tokens"]  # enforced as the thinking budget
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise ApiError(400, "thinking.budget_tokens must be a non-negative integer",
                               code="invalid_parameter", param="thinking")
    return ChatCompletionRequest(
        model=req.model, messages=_chat_messages(req), max_tokens=req.max_tokens, stop=req.stop_sequences,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, tools=tools, tool_choice=choice,
        chat_template_kwargs=kwargs, reasoning_budget_tokens=budget,
        parallel_tool_calls=not (req.tool_choice or {}).get("disable_parallel_tool_use"),
    )


def _blocks(deltas: list[dict[str, Any]], cut: set[str] = frozenset()) -> list[dict[str, Any]]:
    """Content blocks, merging consecutive deltas of one kind; a call in `cut` was cut off by
    the token limit, so its input is the object its arguments had reached."""
    blocks: list[dict[str, Any]] = []
    for d in deltas:
        if "reasoning_content" in d:
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += d["reasoning_content"]
            else:
                blocks.append({"type": "thinking", "thinking": d["reasoning_content"], "signature": ""})
        elif "content" in d:
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += d["content"]
            else:
                blocks.append({"type": "text", "text": d["content"]})
        elif "tool_calls" in d:
            tc = d["tool_calls"][0]
            if "id" in tc:
                blocks.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"], "input": ""})
            else:
                blocks[-1]["input"] += tc["function"]["arguments"]
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = object_of_prefix(b["input"]) if b["id"] in cut else json.loads(b["input"] or "{}")
    return blocks


def _stop(out: chat_surface.ChatOutput, ev) -> tuple[str, str | None]:
    if out.n_calls and ev.stop_type != "limit":
        return "tool_use", None
    reason = _STOP.get(ev.stop_type, "end_turn")
    return reason, (ev.stopping_word if reason == "stop_sequence" else None)


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\n".encode() + b"data: " + msgspec.json.encode({"type": kind, **data}) + b"\n\n"


_STARTS = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}


class MessagesEncoder(Encoder):
    """The chat deltas of one message as Anthropic content blocks: thinking, text and
    tool_use, in the order the model produced them; streamed as message_start,
    content_block_start/delta/stop, message_delta and message_stop."""

    def __init__(self, prep: chat_surface.Prepared, out: chat_surface.ChatOutput, head: dict[str, Any]) -> None:
        self.prep, self.out, self.head = prep, out, head
        self.index, self.open_kind = -1, None

    def opening(self) -> list[bytes]:
        return [_event("message_start", {"message": {
            **self.head, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(self.prep.prompt), "output_tokens": 0}}})]

    def error(self, ev: TokenEvent) -> bytes:
        return _event("error", {"error": {"type": "api_error", "message": echo(ev.error or "", ERROR_MESSAGE_CHARS)}})

    def frames(self, index: int, ev: TokenEvent) -> list[bytes]:
        frames: list[bytes] = []
        for d in self.out.feed(ev.text) + (self.out.finish(ev.finish_reason) if ev.done else []):
            frames += self._block(d)
        if ev.done:
            if self.open_kind is not None:
                frames.append(_event("content_block_stop", {"index": self.index}))
            reason, seq = _stop(self.out, ev)
            frames.append(_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                                   "usage": {"output_tokens": ev.completion_tokens}}))
            frames.append(_event("message_stop", {}))
        return frames

    def _block(self, d: dict[str, Any]) -> list[bytes]:
        """One delta: a new block opens when the kind changes or a tool call starts."""
        frames: list[bytes] = []
        kind = "thinking" if "reasoning_content" in d else "text" if "content" in d else "tool_use"
        tc = d["tool_calls"][0] if kind == "tool_use" else None
        if kind != self.open_kind or (tc and "id" in tc):
            if self.open_kind is not None:
                frames.append(_event("content_block_stop", {"index": self.index}))
            self.index, self.open_kind = self.index + 1, kind
            start = _STARTS.get(kind) or {"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                                          "input": {}}
            frames.append(_event("content_block_start", {"index": self.index, "content_block": start}))
            if tc:
                return frames
        delta = ({"type": "thinking_delta", "thinking": d["reasoning_content"]} if kind == "thinking"
                 else {"type": "text_delta", "text": d["content"]} if kind == "text"
                 else {"type": "input_json_delta", "partial_json": tc["function"]["arguments"]})
        frames.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return frames

    def body(self, runs: list[Run]) -> dict[str, Any]:
        ev = runs[0].final
        blocks = _blocks(self.out.feed(runs[0].text) + self.out.finish(ev.finish_reason), self.out.cut_calls)
        reason, seq = _stop(self.out, ev)  # after the parse: it counts the tool calls
        return {**self.head, "content": blocks, "stop_reason": reason, "stop_sequence": seq,
                "usage": {"input_tokens": ev.prompt_tokens, "output_tokens": ev.completion_tokens}}


async def _chat_job(app_state: AppState, req: MessagesRequest,
                    field_headers: dict[str, str]) -> tuple[ServedModel, ChatCompletionRequest, chat_surface.ChatJob]:
    """The message as a chat request on the model it names, its images read."""
    images: list = []
    shape = req
    if media.anthropic_has_images(req.messages):  # images become image_url parts, read once the model is known
        req = msgspec.structs.replace(req, messages=media.from_anthropic(req.messages))
        shape = msgspec.structs.replace(req, messages=media.without_images(req.messages))
    creq = _chat_request(shape)  # shape errors first: a malformed request never switches models
    model = await model_for(app_state, req.model)  # may switch models (api/model_switch.py)
    if media.has_media(req.messages):
        messages, images = await media.gather(model, media.policy(app_state.settings), req.messages)
        creq = _chat_request(msgspec.structs.replace(req, messages=messages))
    return model, creq, await chat_surface.job(app_state, model, creq, field_headers, images, "messages")


@post("/v1/messages", status_code=200)
async def messages(request: Request, app_state: AppState) -> Any:
    strict = strict_mode(request.headers)
    raw = await read_json_object(request)
    steer.refuse_fields(raw, "/v1/messages")  # per-request steering is chat's; the server's applies below
    req = convert(raw, MessagesRequest)
    # a field this route does not read is reported (or refused under X-miLLM-Strict), never dropped
    unused = [k for k, v in raw.items() if v is not None and k not in MessagesRequest.__struct_fields__]
    field_headers = settle_unused(unused, strict, "/v1/messages")
    model, creq, chat = await _chat_job(app_state, req, field_headers)
    out = chat_surface.ChatOutput(chat.prep, parallel_tool_calls=creq.parallel_tool_calls is not False)
    head = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model.id}
    job = Job(model=model, requests=[chat.request], headers=chat.headers, stream=req.stream)
    return await runner.run(request, job, MessagesEncoder(chat.prep, out, head))


@post("/v1/messages/count_tokens", status_code=200)
async def count_tokens(request: Request, app_state: AppState) -> dict[str, int]:
    req = convert(await read_json_object(request), MessagesRequest)
    model = g.served_model(app_state, req.model)
    prep = chat_surface.prepare(app_state, model, _chat_request(req, counting=True))
    return {"input_tokens": len(prep.prompt)}


MESSAGES_ROUTES = [messages, count_tokens]
