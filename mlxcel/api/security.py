"""The pre-routing gate in front of the whole HTTP app: CORS and API-key authentication.

This mirrors b10621's pre-routing handler, which runs before any route is matched:

1. CORS. The allowed origin comes from --cors-origins: `*` with --cors-credentials (the
   default) echoes the request's Origin, `*` without credentials answers a literal `*`,
   `localhost` echoes the Origin only when its host is a loopback name, and a comma-separated
   list echoes an Origin that is on it. Allow-Credentials is sent when enabled, but only with
   an origin the operator named (listed, or loopback under `localhost`): unlike b10621, an
   Origin echoed because of `*` never carries it, so an arbitrary site cannot make credentialed
   calls. The opaque Origin `null` (sandboxed frames, file: pages) is never echoed: under `*`
   it gets a literal `*` without credentials, otherwise nothing. An echoed Origin adds
   `Vary: Origin` so caches keep answers apart. The method and header lists go out on OPTIONS
   preflights only, and no Expose-Headers is sent.
2. OPTIONS to any path is answered here, 200 with an empty body, before authentication and
   before routing (browsers send no Authorization header on a preflight).
3. With API keys configured, every other path except the public ones (/health, /v1/health, /)
   needs `Authorization: Bearer KEY` (or `X-Api-Key: KEY`); otherwise 401 with b10621's body.
   The built-in page's script and style files are public too (api/webui): they hold no data, and
   a browser sends no Authorization header for a <script src>.
   Keys are compared in constant time and never logged. As in b10621 the public set is matched
   against the path as sent, so under --api-prefix the prefixed /health needs a key; the
   built-in page and its files are public under the prefix too (api/webui says why).
4. --api-prefix. b10621 registers every route at prefix + route, so the prefix is removed here,
   once, and a path outside it answers b10621's 404 before any route is matched. The routes
   below never see the prefix (error envelopes and the /predict fan-out stay as they are).

Entry point: `wrap_app(asgi_app, settings)` returns the ASGI app to hand to uvicorn.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any
from urllib.parse import urlsplit

from mlxcel.api.webui.routes import public_paths

log = logging.getLogger("mlxcel.api.security")

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/", "/index.html"})
UNAUTHORIZED_BODY = json.dumps(
    {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}, separators=(",", ":")
).encode()
NOT_FOUND_BODY = json.dumps(
    {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}, separators=(",", ":")
).encode()
JSON_TYPE = b"application/json; charset=utf-8"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def _header(scope: dict, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class CorsPolicy:
    def __init__(self, origins: str, methods: str, headers: str, credentials: bool) -> None:
        self.origins = [o.strip() for o in origins.split(",") if o.strip()]
        self.methods, self.headers, self.credentials = methods, headers, credentials

    def allow_origin(self, origin: str | None) -> tuple[str | None, bool]:
        """(the Allow-Origin value, whether credentials may go with it)."""
        if self.origins == ["*"]:
            if not self.credentials or (origin is not None and origin.strip().lower() == "null"):
                return "*", False
            return origin, False  # echoed for any site: never with credentials
        if origin is None or origin.strip().lower() == "null":
            return None, False
        if self.origins == ["localhost"]:
            host = (urlsplit(origin).hostname or "").lower()
            return (origin, self.credentials) if host in LOOPBACK_HOSTS else (None, False)
        return (origin, self.credentials) if origin in self.origins else (None, False)

    def response_headers(self, origin: str | None, preflight: bool) -> list[tuple[bytes, bytes]]:
        allowed, credentials = self.allow_origin(origin)
        if allowed is None:
            return []
        out = [(b"access-control-allow-origin", allowed.encode("latin-1"))]
        if allowed != "*":
            out.append((b"vary", b"Origin"))
        if credentials:
            out.append((b"access-control-allow-credentials", b"true"))
        if preflight:
            out.append((b"access-control-allow-methods", self.methods.encode("latin-1")))
            out.append((b"access-control-allow-headers", self.headers.encode("latin-1")))
        return out


def presented_key(scope: dict) -> str:
    key = _header(scope, b"authorization") or _header(scope, b"x-api-key") or ""
    return key[len("Bearer "):] if key.startswith("Bearer ") else key


class LlamaGate:
    """ASGI middleware: CORS + preflight + API keys, in b10621's order, ahead of routing."""

    def __init__(self, app: Any, settings: Any) -> None:
        self.app = app
        self.keys = [k.encode() for k in settings.server.api_keys]
        self.cors = CorsPolicy(settings.server.cors_origins, settings.server.cors_methods, settings.server.cors_headers,
                               settings.server.cors_credentials)
        self.prefix = settings.server.api_prefix
        self.public = PUBLIC_PATHS | public_paths(settings)  # + the built-in page's own files

    def key_ok(self, scope: dict) -> bool:
        given = presented_key(scope).encode()
        ok = False
        for k in self.keys:  # no early exit: timing does not reveal which key matched
            ok |= hmac.compare_digest(given, k)
        return ok

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = _header(scope, b"origin")
        if scope["method"] == "OPTIONS":
            headers = self.cors.response_headers(origin, preflight=True)
            await _respond(send, 200, b"", b"text/html", headers)
            return
        cors = self.cors.response_headers(origin, preflight=False)
        if self.keys and scope["path"] not in self.public and not self.key_ok(scope):
            log.warning("unauthorized: Invalid API Key (%s %s)", scope["method"], scope["path"])
            await _respond(send, 401, UNAUTHORIZED_BODY, JSON_TYPE, cors)
            return
        if self.prefix:
            scope = strip_prefix(scope, self.prefix)
            if scope is None:
                await _respond(send, 404, NOT_FOUND_BODY, JSON_TYPE, cors)
                return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in cors if k not in names]
                message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def strip_prefix(scope: dict, prefix: str) -> dict | None:
    """The scope as the routes see it (path without the prefix), or None when the path lies
    outside the prefix: b10621 matches prefix + route literally, so the rest must start a route."""
    path = scope["path"]
    rest = path[len(prefix):] if path.startswith(prefix) else ""
    if not rest.startswith("/"):
        return None
    raw = scope.get("raw_path")
    raw_prefix = prefix.encode("latin-1", "replace")
    if raw is not None and raw.startswith(raw_prefix):
        raw = raw[len(raw_prefix):]
    else:
        raw = rest.encode("utf-8")
    return {**scope, "path": rest, "raw_path": raw}


async def _respond(send: Any, status: int, body: bytes, content_type: bytes,
                   headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def wrap_app(app: Any, settings: Any) -> LlamaGate:
    return LlamaGate(app, settings)
