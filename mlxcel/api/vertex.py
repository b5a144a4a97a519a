"""POST /predict for Google Cloud Vertex AI custom containers (AIP_MODE=PREDICTION).

The body is {"instances": [...]} (at most 128). Each instance names its target in
`@requestFormat`: either the camelCase alias of a registered POST route (chatCompletions,
embeddings, applyTemplate, ...) or a registered path verbatim. The field is removed, a `stream`
field is forced off (with a warning), and the rest is dispatched in-process through the same
app with the predict request's own headers, so API-key checks, validation and queueing apply as
for a direct call. The answer is {"predictions": [...]} in request order; an instance that fails
holds an error object in its slot. At most eight instances run at once.

Aliases come from the app's own route table: the path without a leading /v1, camelCased on its
separators; when two paths share an alias the /v1 one wins (b10621 leaves that unspecified).

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

from mlxcel.cli.refusal import StartupRefusal

log = logging.getLogger("mlxcel.api.vertex")

MAX_INSTANCES = 128
MAX_CONCURRENT = 8


def _error(code: int, message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"code": code, "message": message, "type": kind}}


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


def _post_paths(app: Any) -> list[str]:
    paths = []
    for r in app.routes:
        if "POST" in getattr(r, "methods", ()) and "{" not in r.path:
            paths.append(r.path)
    return paths


async def _dispatch(app: Any, scope: dict, path: str, body: bytes) -> tuple[int, bytes]:
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    sub = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
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


def make_predict_handler(path: str = "/predict"):
    aliases: dict[str, str] = {}

    async def predict(request: Request) -> Response:
        try:
            payload = json.loads(await request.body())
        except ValueError:
            return Response(_error(400, "request body is not valid JSON"), status_code=400)
        instances = payload.get("instances") if isinstance(payload, dict) else None
        if not isinstance(instances, list):
            return Response(_error(400, '"instances" must be an array'), status_code=400)
        if len(instances) > MAX_INSTANCES:
            return Response(_error(400, f"at most {MAX_INSTANCES} instances per request"), status_code=400)
        if not aliases:
            aliases.update(alias_table(_post_paths(request.app)))
        known_paths = set(aliases.values())
        gate = asyncio.Semaphore(MAX_CONCURRENT)

        async def one(inst: Any) -> Any:
            if not isinstance(inst, dict):
                return _error(400, "each instance must be an object")
            inst = dict(inst)
            fmt = inst.pop("@requestFormat", None)
            target = aliases.get(fmt) if isinstance(fmt, str) else None
            if target is None and isinstance(fmt, str) and fmt in known_paths:
                target = fmt
            if target is None:
                return _error(400, f"unknown @requestFormat: {fmt!r}")
            if inst.get("stream"):
                log.warning("predict: streaming is not available through %s; answering non-streamed", path)
                inst["stream"] = False
            async with gate:
                status, body = await _dispatch(request.app, request.scope, target, json.dumps(inst).encode())
            try:
                return json.loads(body)
            except ValueError:
                return _error(status, body.decode("utf-8", "replace"), "server_error")

        predictions = await asyncio.gather(*(one(i) for i in instances))
        return Response({"predictions": list(predictions)})

    return post(path, name="vertex-predict", status_code=200)(predict)
