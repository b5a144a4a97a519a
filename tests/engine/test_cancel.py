"""Cancellation: a running row is reaped (its slot and blocks back, the others untouched); a
queued request never runs and gives its queue place back."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.engine.kv_block_pool import RESERVED
from tests.engine.fake_backend import FakeBackend, reference
from tests.engine.harness import collect, engine_on, prompt, request

# a regression that never ends a generation fails here instead of hanging the tier
pytestmark = pytest.mark.timeout(30)


def test_a_cancelled_row_is_reaped_and_frees_its_slot_and_blocks():
    a, b = prompt(100, 20), prompt(200, 6)
    backend = FakeBackend()
    hold = backend.hold_when(lambda step: any(r.first == 100 and r.decode and r.start == len(a) + 5 for r in step))

    async def scenario(engine):
        ha, hb = engine.submit(request(a, 200)), engine.submit(request(b, 40))
        engine.start()
        await hold.wait()
        at = len(backend.steps)  # the held step's index once it runs
        a_seq = next(r.uid for r in hold.step if r.first == 100)
        ha.cancel()
        # a's own prompt again, on the slot and blocks a's reaping gives back (parallel=2)
        hc = engine.submit(request(a, 8))
        hold.release()
        ra, rb, rc = await asyncio.gather(collect(ha), collect(hb), collect(hc))
        return at, a_seq, ra, rb, rc

    with engine_on(backend, start=False) as engine:
        at, a_seq, ra, rb, rc = asyncio.run(scenario(engine))
        usage = engine.kv_usage()
    assert not any(ev.done for ev in ra.events)  # a reaped row sends no final event
    assert ra.tokens == reference(a, 200)[:len(ra.tokens)] and len(ra.tokens) <= 7
    assert all(i <= at for i, r in backend.rows_of(100) if r.uid == a_seq)  # nothing ran for a after
    assert rb.tokens == reference(b, 40)  # the row beside it is unaffected
    assert rc.slot == 0 and rc.tokens == reference(a, 8)
    assert rc.last.timings.cache_n == len(a) - 1  # the cancelled row's blocks were donated intact
    assert usage["used_blocks"] == usage["cached_blocks"]
    engine.kv.prefix_cache.clear()
    assert backend.allocator.used_blocks == 0
    assert all(backend.allocator.refs(blk) == 0 for blk in range(RESERVED, backend.allocator.num_blocks))


def test_a_request_cancelled_while_queued_never_runs_and_frees_its_place():
    a, b, c = prompt(100, 4), prompt(200, 4), prompt(300, 4)
    backend = FakeBackend()
    cancelled = backend.hold_when(lambda step: any(r.first == 100 and r.decode and r.start == 6 for r in step))
    later = backend.hold_when(lambda step: any(r.first == 100 and r.decode and r.start == 9 for r in step))

    async def scenario(engine):
        ha, hb = engine.submit(request(a, 12)), engine.submit(request(b, 4))  # b waits for the one slot
        engine.start()
        await cancelled.wait()
        hb.cancel()
        cancelled.release()
        await later.wait()
        # the queue (1 running + 1 waiting) has room again while a still runs
        hc = engine.submit(request(c, 4))
        later.release()
        return await asyncio.gather(collect(ha), collect(hb), collect(hc))

    with engine_on(backend, parallel=1, max_queue_depth=1, start=False) as engine:
        ra, rb, rc = asyncio.run(scenario(engine))
        outstanding = engine.outstanding
    assert rb.events == []
    assert backend.rows_of(200) == []  # b never reached the backend
    assert ra.tokens == reference(a, 12) and rc.tokens == reference(c, 4)
    assert rc.slot == 0 and outstanding == 0
