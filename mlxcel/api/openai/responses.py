"""The OpenAI Responses API: POST /v1/responses (and /responses), retrieve, delete, cancel.

A request's `input` (a string or a list of message / function_call / function_call_output
items), its `instructions` and, with `previous_response_id`, the stored conversation before
it become one chat request served by the chat surface; the parsed output comes back as
output items (reasoning, message, function_call). Responses are kept in a bounded store
(oldest evicted first) so a later turn can continue them; `store: false` keeps none.
A stored or running response belongs to the API key that created it (the owner, as for
resumable streams: api/stream_sessions.stream_owner): another key's retrieve, delete, cancel
or previous_response_id is answered 404 exactly as for an id never stored.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from typing import Any

import msgspec
from litestar import Request, delete, get, post

from mlxcel.api import media
from mlxcel.api import stream_runner as runner
from mlxcel.api.body import convert, read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.model_switch import model_for
from mlxcel.api.openai import chat_surface
from mlxcel.api.openai import generation as g
from mlxcel.api.openai import logprobs as lp
from mlxcel.api.openai.fields import object_locations, settle_unused, strict_mode
from mlxcel.api.openai.schemas import ChatCompletionRequest
from mlxcel.api.security import presented_key
from mlxcel.api.state import AppState
from mlxcel.api.stream_sessions import stream_owner
from mlxcel.api.stream_runner import Encoder, Job, Run
from mlxcel.config.limits import echo
from mlxcel.engine.types import TokenEvent
from mlxcel.steering import requests as steer

STORE_CAPACITY = 256
CANCEL_SETTLE_S = 30.0  # how long a cancel waits for its response's producer to store it
RESPONSES = "/v1/responses"
# Output-changing Responses fields this server does not have, with the values that ask for
# nothing; anything else is refused with field_not_honoured (never silently dropped).
NOT_HONOURED: dict[str, tuple[Any, ...]] = {
    "background": (False,), "conversation": (), "truncation": ("disabled",), "prompt": (), "max_tool_calls": (),
}
# the one `include` value this route produces: per-token logprobs on the output text
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    include: list[Any] | None = None
    top_logprobs: Any = None  # 0-20, checked by `_logprobs_ask`


class Live:
    """A running response: its engine handle, whether POST .../cancel stopped it, and the
    final response once its producer has built it (what the cancel answers)."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.cancelled, self.owner = handle, False, ""
        self.final: dict[str, Any] | None = None
        self.settled = asyncio.Event()

    def settle(self, resp: dict[str, Any] | None) -> None:
        self.final = resp
        self.settled.set()


class ResponseStore:
    """Finished responses with the conversation that produced them; running ones by id."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self.done: OrderedDict[str, tuple[dict, list[dict], str]] = OrderedDict()  # id -> (resp, conv, owner)
        self.live: dict[str, Live] = {}

    def put(self, resp: dict, conversation: list[dict], owner: str = "") -> None:
        self.done[resp["id"]] = (resp, conversation, owner)
        self.done.move_to_end(resp["id"])
        while len(self.done) > self.capacity:
            self.done.popitem(last=False)

    def find(self, rid: str, owner: str) -> tuple[dict, list[dict], str] | None:
        """The stored response `rid` if `owner` created it; another owner's is absent."""
        entry = self.done.get(rid)
        return entry if entry is not None and entry[2] == owner else None

    def running(self, rid: str, owner: str) -> Live | None:
        live = self.live.get(rid)
        return live if live is not None and live.owner == owner else None


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def check_fields(raw: dict[str, Any], strict: bool) -> dict[str, str]:
    """Refuse what this route cannot honour; report (or, strict, refuse) what it does not use,
    with the /v1 contract's X-miLLM-Ignored-Fields header."""
    unused: list[str] = []
    for key, value in raw.items():
        if value is None:
            continue
        if key in NOT_HONOURED:
            if any(_same(value, ok) for ok in NOT_HONOURED[key]):
                continue
            raise ApiError(400, f"'{echo(key)}' is not honoured on {RESPONSES} by this server",
                           code="field_not_honoured", param=key)
        if key == "text":  # structured output is chat's response_format; plain text is the default
            fmt = value.get("format") if isinstance(value, dict) else value
            if fmt is not None and not _same(fmt, {"type": "text"}):
                raise ApiError(400, f"'text.format' is not honoured on {RESPONSES} by this server (use "
                               "response_format on /v1/chat/completions)", code="field_not_honoured", param="text")
            unused += object_locations(value, ["format"], "text")
        elif key == "reasoning":
            unused += object_locations(value, ["effort"], "reasoning")
        elif key not in ResponsesRequest.__struct_fields__:
            unused.append(key)
    return settle_unused(unused, strict, RESPONSES)


def _logprobs_ask(req: ResponsesRequest) -> lp.LogprobsAsk | None:
    """`include: ["message.output_text.logprobs"]` asks for each generated token's logprob on the
    output text, with `top_logprobs` (0-20) alternatives; any other `include` value is refused."""
    include = req.include or []
    for value in include:
        if value != LOGPROBS_INCLUDE:
            raise ApiError(400, f"include {value!r} is not honoured on {RESPONSES} by this server (only "
                           f"{LOGPROBS_INCLUDE!r})", code="field_not_honoured", param="include")
    top = req.top_logprobs
    if top is not None and (type(top) is not int or not 0 <= top <= lp.MAX_TOP):
        raise ApiError(400, f"top_logprobs must be an integer between 0 and {lp.MAX_TOP}", code="invalid_parameter",
                       param="top_logprobs")
    if LOGPROBS_INCLUDE not in include:
        if top:  # 0 asks for nothing
            raise ApiError(400, f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]", code="invalid_parameter",
                           param="top_logprobs")
        return None
    return lp.LogprobsAsk(top or 0, as_token_ids=False)


def _store(state: AppState) -> ResponseStore:
    return state.__dict__.setdefault("_responses_store", ResponseStore())


def response_owner(request: Request, state: AppState) -> str:
    """The owner of what `request` stores or reads: its API key's digest when several keys exist."""
    return stream_owner(presented_key(request.scope), state.settings.server.api_keys)


def _clip(rid: str) -> str:
    """An id quoted in an error, truncated: an answer never echoes unbounded client input."""
    return rid if len(rid) <= 64 else rid[:64] + "..."


def _text(content: Any) -> Any:
    """A string, or a list of text and image parts when the content carries images (read and
    replaced by api/media.py before rendering)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
            return [p if p.get("type") == "input_image" else {"type": "text", "text": _text([p])} for p in content]
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
                out.append(part.get("text") or "")
            else:
                raise ApiError(400, "input content parts must be input_text or output_text", code="invalid_parameter",
                               param="input")
        return "".join(out)
    raise ApiError(400, "input content must be a string or a list of parts", code="invalid_parameter", param="input")


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            out.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and not out[-1].get("content"):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))})
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(400, f"input item type {echo(kind)!r} is not supported", code="invalid_parameter",
                           param="input")
    return out


def _conversation(state: AppState, req: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
    before: list[dict[str, Any]] = []
    if req.previous_response_id:
        found = _store(state).find(req.previous_response_id, owner)
        if found is None:
            raise ApiError(404, f"Previous response with id '{_clip(req.previous_response_id)}' not found.",
                           code="previous_response_not_found", param="previous_response_id")
        before = list(found[1])
    return before + _messages(req.input)


def _tool_choice(choice: Any) -> Any:
    """The Responses spelling of a named function ({"type": "function", "name": ...}) in chat's."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    tools = None
    if req.tools:
        for t in req.tools:
            if t.get("type") != "function":
                raise ApiError(400, f"tool type {echo(t.get('type'))!r} is not supported (function tools only)",
                               code="invalid_parameter", param="tools")
        tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                 for t in req.tools]
    messages = list(conversation)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, tools=tools, tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        reasoning_effort=(req.reasoning or {}).get("effort"))


def _items(deltas: list[dict[str, Any]], cut: set[str] = frozenset()) -> list[dict[str, Any]]:
    """Output items of these deltas; a call in `cut` was cut off by the token limit: its
    arguments are the text written so far and its status is incomplete."""
    msg = chat_surface.message(deltas)
    items: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        items.append({"type": "reasoning", "id": _item_id("rs_"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg.get("content"):
        items.append({"type": "message", "id": _item_id("msg_"), "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": msg["content"], "annotations": []}]})
    for c in msg.get("tool_calls", ()):
        items.append({"type": "function_call", "id": _item_id("fc_"), "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                      "status": "incomplete" if c["id"] in cut else "completed"})
    return items


def _response(rid: str, req: ResponsesRequest, model_id: str, status: str, output: list, ev=None) -> dict[str, Any]:
    usage = None
    if ev is not None:
        usage = {"input_tokens": ev.prompt_tokens, "output_tokens": ev.completion_tokens,
                 "total_tokens": ev.prompt_tokens + ev.completion_tokens,
                 "input_tokens_details": {"cached_tokens": ev.timings.cache_n if ev.timings else 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model_id,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "previous_response_id": req.previous_response_id,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "store": req.store, "text": {"format": {"type": "text"}}}


def _after(conversation: list[dict], output: list[dict]) -> list[dict]:
    """The conversation a later turn continues: this turn's input plus its output."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            msg["content"] = item["content"][0]["text"]
        elif item["type"] == "function_call":
            msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return [*conversation, msg]


def _item_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponsesEncoder(Encoder):
    """The chat deltas of one response as output items (reasoning, message, function_call),
    the finished response stored for a later turn. Streamed, items open as their first delta
    arrives, each at the next output_index; the final output keeps that order and those ids,
    so added/delta/done events and the stored response agree."""

    def __init__(self, rid: str, req: ResponsesRequest, model_id: str, conversation: list[dict],
                 store: ResponseStore, out: chat_surface.ChatOutput, owner: str = "",
                 logprobs: lp.ChatLogprobs | None = None) -> None:
        self.rid, self.req, self.model_id, self.conversation = rid, req, model_id, conversation
        self.store, self.out, self.owner = store, out, owner
        self.logprobs = logprobs  # include: message.output_text.logprobs
        self.entries: list[dict[str, Any]] = []  # the output text's logprobs so far
        self.live = Live(None)  # registered in store.live while the rows run
        self.live.owner = owner
        self.seq = 0
        self.deltas: list[dict[str, Any]] = []
        self.opened: dict[Any, tuple[int, str]] = {}  # "reasoning", "message" or a call index -> (index, id)
        self.call_keys: dict[str, int] = {}  # call_id -> call index

    def begin(self, handles: list[Any]) -> None:
        self.live.handle = handles[0]
        self.store.live[self.rid] = self.live

    def stopped(self) -> bool:
        return self.live.cancelled

    def close(self) -> None:
        self.store.live.pop(self.rid, None)
        self.live.settled.set()  # a cancel waiting on an error answers what is stored

    def body(self, runs: list[Run]) -> dict[str, Any]:
        self.deltas = self.out.feed(runs[0].text) + self.out.finish(runs[0].final.finish_reason)
        if self.logprobs is not None:
            self.entries = self.logprobs.whole(runs[0])["content"]
        return self._finished(runs[0].final)

    def _finished(self, ev: TokenEvent | None) -> dict[str, Any]:
        # ev None: the rows ended without a last event, i.e. POST .../cancel stopped them
        status = "cancelled" if ev is None else "incomplete" if ev.finish_reason == "length" else "completed"
        output = _items(self.deltas, self.out.cut_calls)
        for item in output:
            if item["type"] == "message" and self.logprobs is not None:
                item["content"][0]["logprobs"] = self.entries
        resp = _response(self.rid, self.req, self.model_id, status, self._arrange(output), ev)
        if self.req.store:
            self.store.put(resp, _after(self.conversation, resp["output"]), self.owner)
        self.live.settle(resp)
        return resp

    def _arrange(self, output: list[dict]) -> list[dict]:
        keyed = []
        for item in output:
            key = item["type"] if item["type"] != "function_call" else self.call_keys.get(item["call_id"])
            if key in self.opened:
                item["id"] = self.opened[key][1]
            keyed.append((self.opened.get(key, (len(self.opened) + len(keyed), ""))[0], item))
        return [item for _, item in sorted(keyed, key=lambda t: t[0])]

    def _event(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return f"event: {kind}\n".encode() + b"data: " + msgspec.json.encode(
            {"type": kind, "sequence_number": self.seq - 1, **data}) + b"\n\n"

    def _open(self, key: Any, item: dict[str, Any]) -> bytes:
        self.opened[key] = (len(self.opened), item["id"])
        return self._event("response.output_item.added", output_index=self.opened[key][0], item=item)

    def opening(self) -> list[bytes]:
        started = _response(self.rid, self.req, self.model_id, "in_progress", [])
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def error(self, ev: TokenEvent) -> bytes:
        return self._event("error", code=ev.error_code, message=ev.error, param=None)

    def frames(self, index: int, ev: TokenEvent) -> list[bytes]:
        new = self.out.feed(ev.text) + (self.out.finish(ev.finish_reason) if ev.done else [])
        self.deltas += new
        entries = None  # the tokens' logprobs ride on the first text delta that goes out with (or after) them
        if self.logprobs is not None:
            due = self.logprobs.event(ev, any("content" in d for d in new) or ev.done)
            entries = due["content"] if due is not None else None
            self.entries += entries or []
        frames = []
        for d in new:
            frames += self._delta(d, entries if "content" in d else None)
            entries = [] if "content" in d and entries is not None else entries
        if ev.done:
            frames += self._done(self._finished(ev))
        return frames

    def closing(self, finished: bool) -> list[bytes]:
        if not finished and self.live.cancelled:  # ended with no last event: stored as cancelled
            self._finished(None)
        return []

    def _delta(self, d: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        frames: list[bytes] = []
        if "reasoning_content" in d:
            if "reasoning" not in self.opened:
                frames.append(self._open("reasoning", {"type": "reasoning", "id": _item_id("rs_"), "summary": [],
                                                       "content": []}))
            i, item_id = self.opened["reasoning"]
            frames.append(self._event("response.reasoning_text.delta", item_id=item_id, output_index=i,
                                      content_index=0, delta=d["reasoning_content"]))
        elif "content" in d:
            if "message" not in self.opened:
                frames.append(self._open("message", {"type": "message", "id": _item_id("msg_"),
                                                     "status": "in_progress", "role": "assistant", "content": []}))
                i, item_id = self.opened["message"]
                frames.append(self._event("response.content_part.added", item_id=item_id, output_index=i,
                                          content_index=0, part={"type": "output_text", "text": "",
                                                                 "annotations": []}))
            i, item_id = self.opened["message"]
            extra = {"logprobs": logprobs} if logprobs is not None else {}
            frames.append(self._event("response.output_text.delta", item_id=item_id, output_index=i,
                                      content_index=0, delta=d["content"], **extra))
        elif "tool_calls" in d:
            tc = d["tool_calls"][0]
            if "id" in tc:
                self.call_keys[tc["id"]] = tc["index"]
                frames.append(self._open(tc["index"], {
                    "type": "function_call", "id": _item_id("fc_"), "call_id": tc["id"],
                    "name": tc["function"]["name"], "arguments": "", "status": "in_progress"}))
            elif tc["function"].get("arguments"):
                i, item_id = self.opened[tc["index"]]
                frames.append(self._event("response.function_call_arguments.delta", item_id=item_id,
                                          output_index=i, delta=tc["function"]["arguments"]))
        return frames

    def _done(self, resp: dict[str, Any]) -> list[bytes]:
        frames: list[bytes] = []
        for i, item in enumerate(resp["output"]):
            if item["type"] == "reasoning":
                frames.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                          content_index=0, text=item["content"][0]["text"]))
            elif item["type"] == "message":
                part = item["content"][0]
                frames.append(self._event("response.output_text.done", item_id=item["id"], output_index=i,
                                          content_index=0, text=part["text"]))
                frames.append(self._event("response.content_part.done", item_id=item["id"], output_index=i,
                                          content_index=0, part=part))
            else:
                frames.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=i, name=item["name"], arguments=item["arguments"]))
            frames.append(self._event("response.output_item.done", output_index=i, item=item))
        kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
        return frames + [self._event(kind, response=resp)]


@post(["/v1/responses", "/responses"], status_code=200)
async def create_response(request: Request, app_state: AppState) -> Any:
    strict = strict_mode(request.headers)
    raw = await read_json_object(request)
    steer.refuse_fields(raw, "/v1/responses")  # per-request steering is chat's; the server's applies below
    req = convert(raw, ResponsesRequest)
    field_headers = check_fields(raw, strict)
    ask = _logprobs_ask(req)
    model = await model_for(app_state, req.model)  # may switch models (api/model_switch.py)
    owner = response_owner(request, app_state)
    conversation = _conversation(app_state, req, owner)
    rendered, images = conversation, []
    if media.has_media(conversation):  # image parts stay in the stored conversation; a later turn reads them again
        rendered, images = await media.gather(model, media.policy(app_state.settings), conversation)
    chat = await chat_surface.job(app_state, model, _chat_request(req, rendered), field_headers, images, "input",
                                  logprobs=ask)
    out = chat_surface.ChatOutput(chat.prep, parallel_tool_calls=req.parallel_tool_calls is not False)
    encoder = ResponsesEncoder(_item_id("resp_"), req, model.id, conversation, _store(app_state), out, owner,
                               logprobs=lp.ChatLogprobs(model, ask) if ask is not None else None)
    job = Job(model=model, requests=[chat.request], headers=chat.headers, stream=req.stream)
    return await runner.run(request, job, encoder)


def _found(state: AppState, rid: str, owner: str) -> dict[str, Any]:
    found = _store(state).find(rid, owner)
    if found is None:
        raise ApiError(404, f"Response with id '{_clip(rid)}' not found.", code="not_found", param="response_id")
    return found[0]


@get(["/v1/responses/{rid:str}", "/responses/{rid:str}"])
async def get_response(rid: str, request: Request, app_state: AppState) -> dict[str, Any]:
    return _found(app_state, rid, response_owner(request, app_state))


@delete(["/v1/responses/{rid:str}", "/responses/{rid:str}"], status_code=200)
async def delete_response(rid: str, request: Request, app_state: AppState) -> dict[str, Any]:
    _found(app_state, rid, response_owner(request, app_state))
    del _store(app_state).done[rid]
    return {"id": rid, "object": "response.deleted", "deleted": True}


@post(["/v1/responses/{rid:str}/cancel", "/responses/{rid:str}/cancel"], status_code=200)
async def cancel_response(rid: str, request: Request, app_state: AppState) -> dict[str, Any]:
    """Stops a running response's generation; it is stored (and answered) with status
    "cancelled" and the output made so far. A finished one is answered as stored."""
    owner = response_owner(request, app_state)
    live = _store(app_state).running(rid, owner)
    if live is not None:
        live.cancelled = True
        live.handle.cancel()
        try:  # a stream's producer settles once its client has read what was already made
            await asyncio.wait_for(live.settled.wait(), CANCEL_SETTLE_S)
        except TimeoutError:  # a client not reading its stream: the id and status, no output
            return {"id": rid, "object": "response", "status": "cancelled", "output": []}
        if live.final is not None:
            return live.final
    return _found(app_state, rid, owner)


def count_input_tokens(app_state: AppState, body: dict[str, Any], owner: str) -> int:
    """The prompt tokens a Responses request would prefill: the same translation
    (previous_response_id rehydrated, tools rendered) and the same render as create_response.
    Served on /v1/responses/input_tokens by api/llamacpp/templates.py."""
    if body.get("conversation") is not None:
        raise ApiError(400, "conversation is not supported by this server; chain turns with previous_response_id",
                       code="field_not_honoured", param="conversation")
    req = convert(body, ResponsesRequest)
    model = g.served_model(app_state, req.model)
    return len(chat_surface.prepare(app_state, model, _chat_request(req, _conversation(app_state, req, owner))).prompt)


RESPONSES_ROUTES = [create_response, get_response, delete_response, cancel_response]
