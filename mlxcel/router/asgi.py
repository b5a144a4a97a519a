"""The router's front door: its own endpoints, or the named model's app (b10621's proxy contract).

A request the router answers itself (routes.py) goes to the router app. Any other GET names
its model with ?model=, any other POST with the JSON body's "model"; the name resolves against
the registry (names and aliases), the model is loaded when autoload allows (--models-autoload,
overridden per request by ?autoload=true|1 or anything else for false), and the request runs on
that model's own app with its body replayed, so the model's routes, streaming and disconnect
handling are exactly a single-model server's. The resumable-stream routes need no model: every
model records into one session store, which the router's own app answers from.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import parse_qs

from mlxcel.config.limits import ERROR_MESSAGE_CHARS, echo
from mlxcel.router.pool import RouterError, RouterPool
from mlxcel.router.routes import TYPES, build_router_litestar

# (method, path) the router answers itself; GET /props only without ?model=
OWN = {("GET", "/health"), ("GET", "/v1/health"), ("GET", "/models"), ("GET", "/v1/models"), ("POST", "/models"),
       ("DELETE", "/models"), ("POST", "/models/load"), ("POST", "/models/unload"), ("GET", "/models/sse"),
       ("GET", "/v1/stream"), ("DELETE", "/v1/stream"), ("POST", "/v1/streams/lookup")}


class RouterApp:
    def __init__(self, pool: RouterPool) -> None:
        self.pool = pool
        self.own = build_router_litestar(pool)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.own(scope, receive, send)
        method, path = scope["method"], scope["path"]
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        if ((method, path) in OWN or path.startswith("/v1/models/")
                or (method == "GET" and path == "/props" and not query.get("model"))
                or method not in ("GET", "POST")):
            return await self.own(scope, receive, send)
        body, receive = await _buffer(receive) if method == "POST" else (b"", receive)
        try:
            name, post = _target(method, query, body)
            slot = self.pool.find(name) if name else None
            if not name:
                raise RouterError(400, "model name is missing from the request")
            if slot is None:
                raise RouterError(400, f"model '{echo(name)}' not found")
            autoload = (query["autoload"] in ("true", "1") if "autoload" in query
                        else self.pool.settings.router.models_autoload)
            child = await self.pool.ready(slot, autoload)
        except RouterError as e:
            return await _send_error(send, e)
        if post:
            slot.last_used = time.monotonic()  # b10621 counts POSTs as use (LRU)
        slot.active += 1
        try:
            await child.app(scope, receive, send)
        finally:
            slot.active -= 1


def _target(method: str, query: dict, body: bytes) -> tuple[str, bool]:
    """The model a request names (?model= on GET, the JSON body's "model" on POST), and whether
    it is a POST."""
    if method == "GET":
        return query.get("model", ""), False
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        raise RouterError(400, "the request body is not valid JSON") from None
    value = parsed.get("model") if isinstance(parsed, dict) else None
    return (value if isinstance(value, str) else ""), True


async def _send_error(send: Any, e: RouterError) -> None:
    body = json.dumps({"error": {"code": e.status, "message": echo(e.message, ERROR_MESSAGE_CHARS),
                                 "type": TYPES.get(e.status, "server_error")}}).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _buffer(receive: Any) -> tuple[bytes, Any]:
    """Read the whole request body, and a `receive` that hands it over once, then the real one
    (which reports the client's disconnect to the model's app)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(chunks)
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay
