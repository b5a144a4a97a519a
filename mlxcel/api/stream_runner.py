"""How every generation route runs its engine requests and answers.

A surface validates its body into a `Job` (the engine requests, its response headers,
streaming or not, the SSE ping interval) and an `Encoder` (how its rows' events become its
wire frames, and its rows' results its JSON body). `run` owns the rest, once for all
surfaces: submission (all rows queued or none), disconnect watching
and cancellation, `--sse-ping-interval` comments, and the status of an engine error (the
one map in errors.py, rendered in the route's own envelope). A stream carrying
`X-Conversation-Id` is recorded below the routes (stream_resume.StreamRecorder), so every
stream this module writes is resumable without the surface knowing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.response import Stream

from mlxcel.api.errors import ApiError, engine_error
from mlxcel.api.request_log import track
from mlxcel.runtime.served import ServedModel
from mlxcel.engine.requests import RequestHandle
from mlxcel.engine.sampling import ProbsReport
from mlxcel.engine.types import EngineError, GenerationRequest, TokenEvent

# Content-Type named here too: a handler declared JSON would otherwise label its stream JSON
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Content-Type": "text/event-stream"}
PING = b": ping\n\n"


def sse(obj: Any) -> bytes:
    """One `data:` frame holding `obj` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


@dataclass
class Job:
    """A validated generation request: its engine rows and how to answer."""

    model: ServedModel
    requests: list[GenerationRequest]
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    ping_interval: int = 0  # seconds of silence before an SSE comment goes out; <= 0: never


@dataclass
class Run:
    """What one row produced: its text, tokens and probability reports, and its last event."""

    parts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    probs: list[ProbsReport] = field(default_factory=list)
    final: TokenEvent | None = None  # None: the row ended without one (cancelled)

    def add(self, ev: TokenEvent) -> None:
        if ev.progress is not None:
            return
        self.parts.append(ev.text)
        if ev.token is not None:
            self.tokens.append(ev.token)
        if ev.probs is not None:
            self.probs.append(ev.probs)
        if ev.done:
            self.final = ev

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def content(self) -> str:
        """The text cut where the last event says (native `n_indent` / `t_max_predict_ms`)."""
        cut = self.final.truncate_to if self.final is not None else None
        return self.text if cut is None else self.text[:cut]


class Encoder:
    """One surface's wire format. The runner calls `begin` as it starts reading the rows; then,
    streaming, `opening`, `frames` for each event, `error` for a row's error event (the stream
    ends there) and `closing` once every row has ended; or, not streaming, `body` with every
    row's `Run`. `close` always comes last."""

    trailer = b""  # written after the last frame, an error frame included (OpenAI's `data: [DONE]`)

    def begin(self, handles: list[RequestHandle]) -> None:
        pass

    def opening(self) -> list[bytes]:
        return []

    def frames(self, index: int, ev: TokenEvent) -> list[bytes]:
        raise NotImplementedError

    def error(self, ev: TokenEvent) -> bytes:
        raise NotImplementedError

    def closing(self, finished: bool) -> list[bytes]:
        """`finished`: every row ended with its last event (else some were cancelled)."""
        return []

    def stopped(self) -> bool:
        """The rows were cancelled on purpose by another route, not by the client leaving."""
        return False

    def body(self, runs: list[Run]) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


def submit_all(model: ServedModel, greqs: list[GenerationRequest]) -> list[RequestHandle]:
    """Submit every row of one request; the engine queues all of them or none."""
    try:
        handles = model.engine.submit_all(greqs)
    except EngineError as e:
        raise engine_error(e.message, e.code, e.status) from None
    track(handles)  # the -v request line reads their token counts and slots
    return handles


def raise_for_error(ev: TokenEvent) -> None:
    """A row's error event as the status the error map gives it."""
    if ev.error is not None:
        raise engine_error(ev.error, ev.error_code)


async def watch_disconnect(request: Request, handles: list[RequestHandle]) -> None:
    """Cancel the rows when the client goes away."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            for h in handles:
                h.cancel()
            return


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Events of several handles as they come, tagged with the handle's index."""
    if len(handles) == 1:
        async for ev in handles[0]:
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | None]] = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        async for ev in h:
            await queue.put((i, ev))
        await queue.put((i, None))  # this handle has ended (done, or cancelled)

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, ev = await queue.get()
            if ev is None:
                remaining -= 1
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()


async def with_pings(events: AsyncIterator, interval: int) -> AsyncIterator:
    """Yield the events, and None whenever `interval` seconds pass without one."""
    if interval <= 0:
        async for ev in events:
            yield ev
        return
    it = events.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                return
            yield ev
            nxt = asyncio.ensure_future(it.__anext__())
    finally:
        nxt.cancel()


async def collect(request: Request, handles: list[RequestHandle]) -> list[Run]:
    """Run every handle to its end; cancel them all if the client goes away."""
    runs = [Run() for _ in handles]
    watcher = asyncio.create_task(watch_disconnect(request, handles))

    async def one(h: RequestHandle, run: Run) -> None:
        async for ev in h:
            run.add(ev)

    try:
        await asyncio.gather(*(one(h, r) for h, r in zip(handles, runs)))
    finally:
        watcher.cancel()
        for h in handles:
            h.cancel()
    return runs


async def _stream(handles: list[RequestHandle], encoder: Encoder, ping_interval: int) -> AsyncIterator[bytes]:
    try:
        encoder.begin(handles)
        for frame in encoder.opening():
            yield frame
        ended = 0
        async for item in with_pings(merged(handles), ping_interval):
            if item is None:
                yield PING
                continue
            i, ev = item
            if ev.error is not None:
                yield encoder.error(ev)
                break
            ended += ev.done
            for frame in encoder.frames(i, ev):
                yield frame
        else:
            for frame in encoder.closing(ended == len(handles)):
                yield frame
        if encoder.trailer:
            yield encoder.trailer
    finally:
        for h in handles:
            h.cancel()
        encoder.close()


async def _answer(request: Request, handles: list[RequestHandle], encoder: Encoder,
                  headers: dict[str, str]) -> Response:
    try:
        encoder.begin(handles)
        runs = await collect(request, handles)
        for r in runs:
            if r.final is None and not encoder.stopped():
                raise ApiError(499, "request cancelled")  # the client went away
            if r.final is not None:
                raise_for_error(r.final)
        return Response(encoder.body(runs), headers=headers)
    finally:
        encoder.close()


async def run(request: Request, job: Job, encoder: Encoder) -> Response | Stream:
    """Submit the job's rows and answer: one JSON body, or an SSE stream."""
    handles = submit_all(job.model, job.requests)
    if job.stream:
        return Stream(_stream(handles, encoder, job.ping_interval), media_type="text/event-stream",
                      headers={**SSE_HEADERS, **job.headers})
    return await _answer(request, handles, encoder, job.headers)
