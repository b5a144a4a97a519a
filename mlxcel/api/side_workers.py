"""What the side-worker routes (embedding, rerank, transcription, speech) share: finding the worker the
mode selected, and running a job through that worker's fair queue.

A worker that was planned but is still loading answers 503 like the chat model does; a server
that serves no such worker answers b10621's 501, naming the flag that would turn it on.

Each worker kind has one queue (workers/queue.py) with --max-queue-depth waiting places: a full
queue is a 503 `queue_full` with Retry-After, and a client that goes away while its job waits
takes the job out of the queue (a running Whisper job stops at its next 30-second window, an
embedding or rerank job at its next batch).

When a shutdown drain's --shutdown-timeout passes, `close_worker_queues` ends every queued and
running job with a 503 saying the server is shutting down, as the engine's requests end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from litestar import Request

from mlxcel.api.errors import ApiError, queue_closed_error, queue_full_error
from mlxcel.api.state import AppState
from mlxcel.workers.queue import JobQueue, QueueClosed, QueueFull

T = TypeVar("T")

_FLAG = {"embedder": ("embeddings", "--embeddings"), "reranker": ("reranking", "--reranking")}


def side_worker(state: AppState, attr: str):
    worker = getattr(state, attr)
    if worker is not None:
        return worker
    kind = "embedding" if attr == "embedder" else "reranker"
    if state.plan is not None and any(s.kind == kind for s in state.plan.sides):
        if state.load_error:
            raise ApiError(503, f"the {kind} model failed to load: {state.load_error}", type="unavailable_error")
        raise ApiError(503, "Loading model", code="model_not_loaded", type="unavailable_error")
    what, flag = _FLAG[attr]
    raise ApiError(501, f"This server does not support {what}. Start it with `{flag}`", code="not_supported",
                   type="not_supported_error")


def generation_refusal(state: AppState) -> ApiError | None:
    """In --embeddings / --reranking mode (or serving a Whisper checkpoint) every generation route
    answers this 501."""
    flag = state.plan.restricted_by if state.plan is not None else None
    if flag is None:
        return None
    if flag == "-m":
        what = "a Kokoro (text-to-speech)" if any(s.kind == "speech" for s in state.plan.sides) else \
            "a Whisper (speech-to-text)"
        return ApiError(501, f"This server does not support completions: -m names {what} checkpoint",
                        code="not_supported", type="not_supported_error")
    return ApiError(501, f"This server does not support completions. Start it without `{flag}`",
                    code="not_supported", type="not_supported_error")


def worker_queue(state: AppState, kind: str) -> JobQueue:
    """The fair queue of one worker kind, made at first use."""
    queue = state.worker_queues.get(kind)
    if queue is None:
        queue = state.worker_queues[kind] = JobQueue(kind, state.settings.engine.max_queue_depth)
        if state.workers_closed is not None:
            queue.close(state.workers_closed)
    return queue


def close_worker_queues(state: AppState, reason: str) -> None:
    """The end of a shutdown drain: every side worker's queued and running jobs end with `reason`,
    and later ones are refused with it. Called from any thread."""
    state.workers_closed = reason
    for queue in list(state.worker_queues.values()):
        queue.close(reason)


def check_queue(queue: JobQueue) -> None:
    """Refuse now when the queue is full: before the upload is decoded, or a stream starts."""
    try:
        queue.check()
    except QueueFull as e:
        raise queue_full_error(e) from None
    except QueueClosed as e:
        raise queue_closed_error(e) from None


async def run_queued(request: Request, queue: JobQueue, start: Callable[[], Any],
                     on_cancel: Callable[[], None] | None = None) -> Any:
    """`start()` (blocking) in its turn on `queue`; the job is dropped, or asked to stop, when
    the client goes away first."""
    try:
        return await while_connected(request, queue.run(start, on_cancel))
    except QueueFull as e:
        raise queue_full_error(e) from None
    except QueueClosed as e:
        raise queue_closed_error(e) from None


async def while_connected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then a 499 nobody reads).
    The body has been read by now, so the next ASGI message is the disconnect."""
    job = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if job.done():
            return job.result()
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        raise ApiError(499, "request cancelled: the client went away")
    finally:
        watcher.cancel()
        job.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
