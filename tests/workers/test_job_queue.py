"""The side workers' fair queue (workers/queue.py): one job at a time, first come first served,
a bounded wait (QueueFull past it), a waiting job cancelled out of the queue, and a running job
asked to stop and holding its turn until its thread returns. Jobs block on events, so every
step is observed by the queue's own counters, never by timing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlxcel.workers.queue import JobQueue, QueueClosed, QueueFull


async def _until(check) -> None:
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the queue never reached the expected state")


def _blocking(gate: threading.Event, log: list, name: str):
    def job():
        assert gate.wait(30)
        log.append(name)
        return name
    return job


def test_full_queue_refuses_and_jobs_run_in_arrival_order():
    async def main():
        q, gate, log = JobQueue("embedding", depth=1), threading.Event(), []
        first = asyncio.ensure_future(q.run(_blocking(gate, log, "a")))
        await _until(lambda: q.running == 1)
        second = asyncio.ensure_future(q.run(_blocking(gate, log, "b")))
        await _until(lambda: q.waiting == 1)
        with pytest.raises(QueueFull, match="embedding queue is full"):
            await q.run(_blocking(gate, log, "c"))
        assert q.rejected_total == 1
        gate.set()
        assert await asyncio.gather(first, second) == ["a", "b"] and log == ["a", "b"]
        assert (q.waiting, q.running, q.cancelled_total) == (0, 0, 0)

    asyncio.run(main())


def test_unbounded_queue_never_refuses():
    async def main():
        q, gate, log = JobQueue("reranker", depth=-1), threading.Event(), []
        jobs = [asyncio.ensure_future(q.run(_blocking(gate, log, str(i)))) for i in range(20)]
        await _until(lambda: q.waiting == 19 and q.running == 1)
        gate.set()
        assert await asyncio.gather(*jobs) == [str(i) for i in range(20)]

    asyncio.run(main())


def test_a_cancelled_waiting_job_leaves_the_queue_without_running():
    async def main():
        q, gate, log = JobQueue("transcription", depth=2), threading.Event(), []
        first = asyncio.ensure_future(q.run(_blocking(gate, log, "a")))
        await _until(lambda: q.running == 1)
        left = asyncio.ensure_future(q.run(_blocking(gate, log, "gone")))
        third = asyncio.ensure_future(q.run(_blocking(gate, log, "c")))
        await _until(lambda: q.waiting == 2)
        left.cancel()
        await _until(lambda: q.waiting == 1)
        assert q.cancelled_total == 1
        gate.set()
        assert await asyncio.gather(first, third) == ["a", "c"] and log == ["a", "c"]

    asyncio.run(main())


def test_a_cancelled_running_job_is_stopped_and_keeps_its_turn_until_it_returns():
    async def main():
        q, stop, log = JobQueue("transcription", depth=1), threading.Event(), []
        running = asyncio.ensure_future(q.run(_blocking(stop, log, "stopped"), on_cancel=lambda: log.append("asked")))
        await _until(lambda: q.running == 1)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert log == ["asked"] and q.cancelled_total == 1
        nxt = asyncio.ensure_future(q.run(lambda: log.append("next")))
        await _until(lambda: q.waiting == 1)
        assert q.running == 1  # the stopped job's thread has not returned: the next one waits
        stop.set()
        await nxt
        assert log == ["asked", "stopped", "next"] and (q.waiting, q.running) == (0, 0)

    asyncio.run(main())


def test_close_ends_waiting_and_running_jobs_with_the_reason_and_refuses_later_ones():
    """What the shutdown drain does when --shutdown-timeout passes (api/side_workers.close_worker_queues):
    the running job is asked to stop and ends at once, the waiting one without running."""
    async def main():
        q, gate, log = JobQueue("embedding", depth=4), threading.Event(), []
        running = asyncio.ensure_future(q.run(_blocking(gate, log, "a"), on_cancel=lambda: log.append("asked")))
        await _until(lambda: q.running == 1)
        waiting = asyncio.ensure_future(q.run(_blocking(gate, log, "b")))
        await _until(lambda: q.waiting == 1)
        await asyncio.to_thread(q.close, "shutting down")  # from another thread, as the drain's deadline calls it
        with pytest.raises(QueueClosed, match="^shutting down before this request finished$"):
            await running
        with pytest.raises(QueueClosed, match="^shutting down before this request started$"):
            await waiting
        with pytest.raises(QueueClosed, match="before this request started"):
            await q.run(lambda: log.append("late"))
        assert log == ["asked"] and q.cancelled_total == 0
        gate.set()
        await _until(lambda: q.running == 0)
        assert log == ["asked", "a"]  # the stopped job's thread returned; "b" and "late" never ran

    asyncio.run(main())
