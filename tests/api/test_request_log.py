"""The -v request line (api/request_log.py): what it says for generation and plain requests,
and that the middleware writes one per request, at DEBUG only."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from mlxcel.api.request_log import RequestLog, RequestRecord, describe, track
from mlxcel.engine.types import TokenEvent


def _handle(prompt: int, final: TokenEvent | None):
    return SimpleNamespace(request=SimpleNamespace(prompt=[0] * prompt), final=final)


def test_generation_line_sums_rows_and_names_slots():
    rows = [_handle(12, TokenEvent(finish_reason="stop", prompt_tokens=12, completion_tokens=5, slot=1)),
            _handle(12, TokenEvent(finish_reason="length", prompt_tokens=12, completion_tokens=8, slot=0))]
    line = describe("POST", "/v1/completions", 200, 1.234, RequestRecord(rows))
    assert line == "request: POST /v1/completions 200, tokens in 24 out 13, 1.23 s, slot 0,1"


def test_cancelled_rows_and_plain_requests():
    cancelled = describe("POST", "/completion", 499, 0.05, RequestRecord([_handle(7, None)]))
    assert cancelled == "request: POST /completion 499, tokens in 7 out ?, 50 ms"
    assert describe("GET", "/health", 200, 0.0004, RequestRecord()) == "request: GET /health 200, 0 ms"


def _app(status: int, handles=()):
    async def app(scope, receive, send):
        track(list(handles))
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return app


async def _call(app, path: str) -> None:
    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        pass

    await app({"type": "http", "method": "POST", "path": path, "query_string": b"key=secret"}, receive, send)


def test_middleware_logs_one_line_at_debug_only(caplog):
    done = _handle(3, TokenEvent(finish_reason="stop", prompt_tokens=3, completion_tokens=2, slot=0))
    caplog.set_level(logging.INFO, logger="mlxcel.api.requests")
    asyncio.run(_call(RequestLog(_app(200, [done])), "/v1/chat/completions"))
    assert not caplog.records
    caplog.set_level(logging.DEBUG, logger="mlxcel.api.requests")
    asyncio.run(_call(RequestLog(_app(401)), "/slots"))
    asyncio.run(_call(RequestLog(_app(200, [done])), "/v1/chat/completions"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("request: POST /slots 401, ")
    assert lines[1].startswith("request: POST /v1/chat/completions 200, tokens in 3 out 2, ")
    assert lines[1].endswith(", slot 0") and "secret" not in "".join(lines)
