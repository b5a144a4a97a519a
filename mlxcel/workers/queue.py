"""The fair queue in front of each side worker (transcription, embedding, rerank).

One job runs at a time, the rest wait first come, first served, and at most `depth` of them
(the server's --max-queue-depth; -1 unbounded): a request that finds the queue full is refused
at once (`QueueFull`, the API's 503 `queue_full` with Retry-After) rather than piling up. A
waiting job whose caller is cancelled (its client went away) leaves the queue without running;
a running one is asked to stop (`on_cancel`, which a Whisper job polls between 30-second
windows) and keeps its turn until its thread has returned, so jobs never overlap.

At the end of a bounded shutdown drain the server closes every queue (`close`, from any thread):
waiting and running jobs end at once with `QueueClosed` carrying the reason (a running one is
also asked to stop, as above), and any job that arrives later is refused with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class QueueFull(Exception):
    """No place left in a worker's queue; the message says which and how deep it is."""

    def __init__(self, name: str, depth: int) -> None:
        super().__init__(f"the server is busy: the {name} queue is full ({depth} requests already waiting "
                         f"behind the one running); retry later")
        self.name, self.depth = name, depth


class QueueClosed(Exception):
    """The queue was closed (the server is shutting down) before this job finished."""

    def __init__(self, name: str, reason: str, started: bool) -> None:
        super().__init__(f"{reason} before this request {'finished' if started else 'started'}")
        self.name, self.reason = name, reason


class JobQueue:
    def __init__(self, name: str, depth: int) -> None:
        self.name, self.depth = name, depth
        self.waiting = 0
        self.running = 0
        self.rejected_total = 0  # refused with QueueFull
        self.cancelled_total = 0  # left the queue, or were stopped while running, because the caller went away
        self._lock: asyncio.Lock | None = None  # made on the event loop at first use
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: set[asyncio.Task] = set()  # the tasks inside `run`, ended by `close`
        self.running_task: asyncio.Task | None = None  # the one whose job holds the turn
        self.closed: str | None = None  # the reason, once closed

    def check(self) -> None:
        """Refuse now if a job arriving now would find no place (a stream checks before it starts)."""
        self.check_open()
        if self.depth >= 0 and self.waiting + self.running > self.depth:
            self.rejected_total += 1
            raise QueueFull(self.name, self.depth)

    async def run(self, start: Callable[[], Any], on_cancel: Callable[[], None] | None = None) -> Any:
        """Wait for this job's turn, then run the blocking `start()` on a thread and return its result."""
        self.check()
        if self._lock is None:
            self._lock = asyncio.Lock()  # FIFO: a release wakes the oldest waiter, newcomers do not barge
            self._loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        self._jobs.add(me)
        try:
            self.check_open()  # closed from another thread before this job could be found
            return await self._turn(start, on_cancel)
        except asyncio.CancelledError:
            if self.closed is None:
                self.cancelled_total += 1
                raise
            me.uncancel()  # cancelled by `close`, not by the caller: end with the reason instead
            raise QueueClosed(self.name, self.closed, started=self.running_task is me) from None
        finally:
            self._jobs.discard(me)
            if self.running_task is me:
                self.running_task = None

    def check_open(self) -> None:
        if self.closed is not None:
            raise QueueClosed(self.name, self.closed, started=False)

    def close(self, reason: str) -> None:
        """End every waiting and running job with `reason`, and refuse later ones. Any thread."""
        self.closed = reason
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._end_jobs)

    def _end_jobs(self) -> None:
        for task in self._jobs:
            task.cancel()

    async def _turn(self, start: Callable[[], Any], on_cancel: Callable[[], None] | None) -> Any:
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        self.running, self.running_task = 1, asyncio.current_task()
        job = asyncio.get_running_loop().run_in_executor(None, start)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel()
            raise
        finally:
            if job.done():
                self._release()
            else:  # cancelled while its thread still runs: the turn ends when that thread does
                job.add_done_callback(self._ended)

    def _ended(self, job: asyncio.Future) -> None:
        if not job.cancelled():
            job.exception()  # retrieved: nobody awaits a job whose caller left
        self._release()

    def _release(self) -> None:
        self.running = 0
        self._lock.release()


