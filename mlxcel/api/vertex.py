"""POST /predict for Google Cloud Vertex AI custom containers (AIP_MODE=PREDICTION).

The body is {"instances": [...]} (at most 128). Each instance names its target in
`@requestFormat`: either the camelCase alias of a registered route (chatCompletions,
embeddings, applyTemplate, props, ...) or a registered path verbatim. The field is removed, a
`stream` field is forced off (with a warning), and the rest is dispatched in-process through the
same app with the predict request's own headers, so API-key checks, validation and queueing apply
as for a direct call. The answer is {"predictions": [...]} in request order; an instance that
fails holds an error object in its slot. At most eight instances run at once. Error wordings are
b10621's.

Aliases come from the app's own route table: the path without a leading /v1, camelCased on its
separators; when two paths share an alias the /v1 one wins (b10621 leaves that unspecified).
b10621 keeps one handler per path, the first registered, which for every path served under two
methods is the GET one; so a path is dispatched as GET when it has one, else POST, else DELETE.

Entry points: `make_predict_handler(path)` (a Litestar route handler for the app) and
`check_predict_route(path, registered_paths)` (startup refusal on a collision).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from litestar import Request, Response, post

from mlxcel.api.body import decode_json
from mlxcel.api.errors import ApiError
from mlxcel.config.limits import ERROR_MESSAGE_CHARS, echo
from mlxcel.config.refusal import StartupRefusal

log = logging.getLogger("mlxcel.api.vertex")

MAX_INSTANCES = 128
MAX_CONCURRENT = 8


def _error(code: int, message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"code": code, "message": echo(message, ERROR_MESSAGE_CHARS), "type": kind}}


def route_alias(path: str) -> str:
    p = path[3:] if path.startswith("/v1/") else path
    words = [w for w in re.split(r"[/\-_]", p) if w and not w.startswith("{")]
    return words[0] + "".join(w[:1].upper() + w[1:] for w in words[1:]) if words else ""


def alias_table(post_paths: list[str]) -> dict[str, str]:
    table: dict[str, str] = {}
    for path in post_paths:
        alias = route_alias(path)
        if alias and (alias not in table or (path.startswith("/v1/") and not table[alias].startswith("/v1/"))):
            table[alias] = path
    return table


def check_predict_route(path: str, registered_paths: list[str]) -> None:
    if path in registered_paths:
        raise StartupRefusal(f"AIP_PREDICT_ROUTE={path}: collides with a route the server already registers")


def _route_methods(app: Any) -> dict[str, str]:
    """path -> the method b10621's one-handler-per-path table would dispatch it with."""
    methods: dict[str, set[str]] = {}
    for r in app.routes:
        if "{" not in r.path:
            methods.setdefault(r.path, set()).update(getattr(r, "methods", ()))
    chosen = {}
    for path, ms in methods.items():
        for m in ("GET", "POST", "DELETE"):
            if m in ms:
                chosen[path] = m
                break
    return chosen


async def _dispatch(app: Any, scope: dict, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    sub = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": scope.get("scheme", "http"), "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": scope.get("client"), "server": scope.get("server"),
    }
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect while the sub-request runs
        return {"type": "http.disconnect"}

    status, chunks = 500, []

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(sub, receive, send)
    return status, b"".join(chunks)


def _result(status: int, body: bytes) -> Any:
    """An instance's answer as b10621 reads it: JSON when it parses, else the text; empty is null."""
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


def make_predict_handler(path: str = "/predict"):
    routes: dict[str, str] = {}
    aliases: dict[str, str] = {}

    async def predict(request: Request) -> Response:
        try:
            payload = decode_json(await request.body())
        except ApiError as e:
            return Response(_error(400, e.message), status_code=400)
        if not isinstance(payload, dict):
            return Response(_error(400, "request body must be a JSON object"), status_code=400)
        instances = payload.get("instances")
        if not isinstance(instances, list):
            return Response(_error(400, "request body must include an array field named instances"), status_code=400)
        if len(instances) > MAX_INSTANCES:
            return Response(_error(400, f"instances array exceeds maximum size of {MAX_INSTANCES}"), status_code=400)
        if not routes:
            routes.update(_route_methods(request.app))
            routes.pop(path, None)  # b10621 builds its alias table before mounting the predict route
            aliases.update(alias_table(list(routes)))
        gate = asyncio.Semaphore(MAX_CONCURRENT)

        async def one(inst: Any) -> Any:
            if not isinstance(inst, dict):
                return _error(400, "each instance must be a JSON object")
            inst = dict(inst)
            fmt = inst.pop("@requestFormat", None)
            if not isinstance(fmt, str):
                return _error(400, "each instance must include a string @requestFormat")
            target = aliases.get(fmt) or (fmt if fmt in routes else None)
            if target is None:
                return _error(400, f"no handler registered for @requestFormat: {fmt}")
            if "stream" in inst:
                log.warning("predict: streaming is not available through %s; answering non-streamed", path)
                inst["stream"] = False
            async with gate:
                status, body = await _dispatch(request.app, request.scope, routes[target], target,
                                               json.dumps(inst).encode())
            return _result(status, body)

        predictions = await asyncio.gather(*(one(i) for i in instances))
        return Response({"predictions": list(predictions)})

    return post(path, name="vertex-predict", status_code=200)(predict)
