"""One log line per HTTP request, at DEBUG (shown with -v): method, path, status, tokens in and
out, time taken, and the slots the request ran in.

`RequestLog` is ASGI middleware around the whole app (the API-key gate included, so a 401 is
logged too). It opens a `RequestRecord` in a context variable for the request; the generation
runner (`stream_runner.submit_all`) adds the engine handles it submitted with `track`, and once
the response is sent (a stream to its last frame) the line reads their last events. Paths are
logged without their query string; bodies and headers never are.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("mlxcel.api.requests")


@dataclass
class RequestRecord:
    handles: list[Any] = field(default_factory=list)  # engine RequestHandles (engine/requests.py)


_RECORD: ContextVar[RequestRecord | None] = ContextVar("mlxcel_request_record", default=None)


def track(handles: list[Any]) -> None:
    """Count `handles` in the current request's log line (no-op outside one, or when not logging)."""
    record = _RECORD.get()
    if record is not None:
        record.handles.extend(handles)


def describe(method: str, path: str, status: int | None, seconds: float, record: RequestRecord) -> str:
    parts = [f"{method} {path} {status if status is not None else '-'}"]
    if record.handles:
        finals = [h.final for h in record.handles]
        tokens_in = sum(f.prompt_tokens if f is not None else len(h.request.prompt)
                        for h, f in zip(record.handles, finals))
        done = [f for f in finals if f is not None]
        tokens_out = str(sum(f.completion_tokens for f in done)) if len(done) == len(finals) else "?"
        parts.append(f"tokens in {tokens_in} out {tokens_out}")
    parts.append(f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s")
    slots = sorted({f.slot for h in record.handles if (f := h.final) is not None and f.slot >= 0})
    if slots:
        parts.append("slot " + ",".join(map(str, slots)))
    return "request: " + ", ".join(parts)


class RequestLog:
    """ASGI middleware writing `describe`'s line for every HTTP request once it is answered."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.DEBUG):
            await self.app(scope, receive, send)
            return
        record = RequestRecord()
        token = _RECORD.set(record)
        start = time.perf_counter()
        status: list[int] = []

        async def send_noting_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            _RECORD.reset(token)
            log.debug("%s", describe(scope["method"], scope["path"], status[0] if status else None,
                                     time.perf_counter() - start, record))
