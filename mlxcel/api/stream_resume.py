"""Resumable streams over HTTP: the ASGI hook that records streaming answers, and the three
routes that manage them (GET /v1/stream, POST /v1/streams/lookup, DELETE /v1/stream).

The hook sits between the API-key gate and the routes, so every streaming surface is covered
in one place, without the routes knowing. For a POST to a streaming route that carries
`X-Conversation-Id`, it runs the route in its own task and watches the answer start: an SSE
answer (200, text/event-stream) becomes a `StreamSession` that the route writes into, and the
client is served by following that session from byte 0, so what it receives is exactly a
prefix of what a resume replays. The client going away then only ends the following: the
route never sees the disconnect and keeps generating into the buffer. It sees a disconnect
only when the session is stopped (DELETE, or a new stream on the same conversation), which
cancels the generation exactly as an unrecorded stream's disconnect does. Any other answer
(JSON, an error) passes through untouched.

Error bodies are b10621's `{"error": {code, message, type}}`, with its wording.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from litestar import Request, Response, delete, get, post
from litestar.response import Stream

from mlxcel.api.body import decode_json
from mlxcel.api.errors import ApiError
from mlxcel.api.stream_runner import SSE_HEADERS
from mlxcel.api.security import presented_key
from mlxcel.api.state import AppState
from mlxcel.api.stream_sessions import OffsetLost, StreamSession, StreamStore, stream_owner
from mlxcel.config.limits import ERROR_MESSAGE_CHARS, echo

log = logging.getLogger("mlxcel.api.streams")

HEADER = b"x-conversation-id"
# the routes whose streaming answers are recorded (the seed's list of streaming surfaces)
STREAM_PATHS = frozenset({
    "/chat/completions", "/v1/chat/completions", "/v1/completions", "/completion", "/completions",
    "/v1/responses", "/responses", "/v1/messages",
})
DISCONNECT = {"type": "http.disconnect"}


def _header(scope: dict, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _is_sse(message: dict) -> bool:
    if message.get("status") != 200:
        return False
    ctype = next((v for k, v in message.get("headers", ()) if k.lower() == b"content-type"), b"")
    return ctype.split(b";")[0].strip().lower() == b"text/event-stream"


class _Attachment:
    """One recorded request: the route's task on one side, the client on the other."""

    def __init__(self, app: Any, store: StreamStore, owner: str, conv_id: str,
                 scope: dict, receive: Any, send: Any) -> None:
        self.app, self.store, self.owner, self.conv_id = app, store, owner, conv_id
        self.scope, self.receive, self.send = scope, receive, send
        self.session: StreamSession | None = None
        self.started: asyncio.Future = asyncio.get_running_loop().create_future()
        self.inbox: asyncio.Queue = asyncio.Queue()  # what the client sent, for the route
        self.release = asyncio.Event()  # the route may see a disconnect now (stopped, or answer done)
        self.client_gone = asyncio.Event()

    async def _pump(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.client_gone.set()
                if self.session is None:
                    await self.inbox.put(message)
                return
            await self.inbox.put(message)

    async def _route_receive(self) -> dict:
        while True:
            get_msg = asyncio.ensure_future(self.inbox.get())
            released = asyncio.ensure_future(self.release.wait())
            try:
                done, _ = await asyncio.wait({get_msg, released}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                get_msg.cancel()
                released.cancel()
            if get_msg in done and not get_msg.cancelled():
                message = get_msg.result()
                if message["type"] == "http.disconnect" and self.session is not None:
                    continue  # attached: a client leaving does not stop the generation
                return message
            return DISCONNECT

    async def _route_send(self, message: dict) -> None:
        if message["type"] == "http.response.start" and not self.started.done():
            if _is_sse(message):
                self.session = self.store.open(self.owner, self.conv_id)
                self.session.on_cancel = self.release.set
            self.started.set_result(message)
            if self.session is not None:
                return
        if self.session is None:
            await self.send(message)
            return
        if message["type"] == "http.response.body":
            self.session.append(message.get("body", b""))
            if not message.get("more_body", False):
                self.session.finish()
                self.release.set()

    def _route_ended(self, task: asyncio.Task) -> None:
        if self.session is not None:
            self.session.finish()
        if not task.cancelled() and task.exception() is not None and self.session is not None:
            log.error("stream %s ended with an error", self.conv_id, exc_info=task.exception())

    async def run(self) -> None:
        pump = asyncio.create_task(self._pump())
        route = asyncio.create_task(self.app(self.scope, self._route_receive, self._route_send))
        route.add_done_callback(self._route_ended)
        try:
            await asyncio.wait({self.started, route}, return_when=asyncio.FIRST_COMPLETED)
            if self.session is None:  # not a stream: the route answered the client directly
                await route
                return
            self.session.producer = route
            await self.send(self.started.result())
            try:
                async for chunk in self.session.follow(0, stop=self.client_gone):
                    await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
            except OffsetLost:
                log.warning("stream %s: the client fell more than the buffer behind", self.conv_id)
            except OSError:  # a server that raises on a closed connection: the client is gone
                self.client_gone.set()
            if not self.client_gone.is_set():
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            pump.cancel()


class StreamRecorder:
    """ASGI middleware: record the streaming answers of requests naming a conversation."""

    def __init__(self, app: Any, state: AppState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        conv_id = None
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in STREAM_PATHS:
            conv_id = _header(scope, HEADER)
        if not conv_id:
            await self.app(scope, receive, send)
            return
        owner = stream_owner(presented_key(scope), self.state.settings.server.api_keys)
        await _Attachment(self.app, self.state.streams, owner, conv_id, scope, receive, send).run()


def wrap_streams(app: Any, state: AppState) -> StreamRecorder:
    return StreamRecorder(app, state)


def _error(status: int, message: str) -> Response:
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    return Response({"error": {"code": status, "message": echo(message, ERROR_MESSAGE_CHARS), "type": kind}},
                    status_code=status)


def _owner(request: Request, state: AppState) -> str:
    return stream_owner(presented_key(request.scope), state.settings.server.api_keys)


@get("/v1/stream")
async def stream_replay(request: Request, app_state: AppState) -> Any:
    """Replay the session's bytes from `from`, then follow it live until it finishes."""
    conv_id = request.query_params.get("conv_id") or ""
    if not conv_id:
        return _error(400, "Missing conversation id in path")
    session = app_state.streams.get(_owner(request, app_state), conv_id)
    if session is None:
        return _error(404, "Stream not found or expired")
    raw = request.query_params.get("from") or ""
    if raw and not (raw.isascii() and raw.isdigit()):
        return _error(400, "Invalid 'from' offset")
    offset = int(raw) if raw else 0
    if offset < session.dropped:
        return _error(400, "Stream offset lost, please restart")

    async def body():
        try:
            async for chunk in session.follow(offset):
                yield chunk
        except OffsetLost:
            log.warning("stream %s: a resuming reader fell more than the buffer behind", conv_id)

    return Stream(body(), media_type="text/event-stream", headers=SSE_HEADERS)


@post("/v1/streams/lookup", status_code=200)
async def streams_lookup(request: Request, app_state: AppState) -> Any:
    """Status of the sessions the caller names; sessions it does not name are never listed."""
    try:
        body = decode_json(await request.body())
    except ApiError as e:
        return Response({"error": {"message": f"invalid body: {e.message}", "type": "invalid_request_error"}},
                        status_code=400)
    ids = body.get("conversation_ids") if isinstance(body, dict) else None
    wanted = [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []
    return Response(app_state.streams.lookup(_owner(request, app_state), wanted))


@delete("/v1/stream", status_code=200)  # 204 on success, set on the Response
async def stream_stop(request: Request, app_state: AppState) -> Any:
    """Stop: cancel the generation and drop the buffer. Idempotent."""
    conv_id = request.query_params.get("conv_id") or ""
    if not conv_id:
        return _error(400, "Missing conversation id in path")
    app_state.streams.stop(_owner(request, app_state), conv_id)
    return Response(None, status_code=204)


STREAM_ROUTES = [stream_replay, streams_lookup, stream_stop]
