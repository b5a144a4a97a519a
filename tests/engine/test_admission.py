"""Who gets a slot and when: the lowest free slot at the first prompt token, id_slot pinning,
what slots() and stats() report, and the requests submit() refuses."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.engine.types import EngineError
from tests.engine.fake_backend import FakeBackend, reference
from tests.engine.harness import collect, engine_on, first_step, last_step, prompt, request, run

# a regression that never ends a generation fails here instead of hanging the tier
pytestmark = pytest.mark.timeout(30)


def test_a_request_takes_the_lowest_free_slot_at_its_first_prompt_token():
    a, b, c = prompt(100, 40), prompt(200, 4), prompt(300, 4)
    req_a = request(a, 5)
    backend = FakeBackend()
    # a's first chunk takes the whole budget: b is admitted but has not run a token yet
    first_chunk = backend.hold_when(lambda step: any(r.first == 100 and r.start == 0 for r in step))
    # well after a (5 tokens) finished, while b still decodes
    b_late = backend.hold_when(lambda step: any(r.first == 200 and r.decode and r.start >= 30 for r in step))

    async def scenario(engine):
        ha, hb = engine.submit(req_a), engine.submit(request(b, 60))
        engine.start()
        await first_chunk.wait()
        slots, stats = engine.slots(), engine.stats()
        first_chunk.release()
        ra = await collect(ha)
        await b_late.wait()
        slots_late = engine.slots()
        hc = engine.submit(request(c, 5))
        b_late.release()
        rb, rc = await asyncio.gather(collect(hb), collect(hc))
        return slots, stats, slots_late, ra, rb, rc

    with engine_on(backend, parallel=3, batch_size=16, start=False) as engine:
        slots, stats, slots_late, ra, rb, rc = asyncio.run(scenario(engine))
    assert [s.is_processing for s in slots] == [True, False, False]
    assert slots[0].id_task == req_a.id and slots[0].n_prompt_tokens == 40
    assert stats.n_processing == 1 and stats.n_deferred == 1  # b holds a row but no slot yet
    assert (ra.slot, rb.slot) == (0, 1)
    # a's slot 0 is free again while b holds 1: the lowest free one is 0, not 2
    assert [s.is_processing for s in slots_late] == [False, True, False]
    assert slots_late[0].id_task == req_a.id  # an idle slot reports what last ran there
    assert rc.slot == 0
    assert (ra.tokens, rb.tokens, rc.tokens) == (reference(a, 5), reference(b, 60), reference(c, 5))


def test_a_pinned_request_waits_for_its_busy_slot_without_blocking_others():
    a, b, c = prompt(100, 4), prompt(200, 4), prompt(300, 4)
    backend = FakeBackend()
    hold = backend.hold_when(lambda step: any(r.first == 100 and r.decode and r.start >= 7 for r in step))

    async def scenario(engine):
        ha = engine.submit(request(a, 20))
        await hold.wait()
        hb = engine.submit(request(b, 5, id_slot=0))  # a holds slot 0
        hc = engine.submit(request(c, 5))  # queued behind b
        hold.release()
        return await asyncio.gather(collect(ha), collect(hb), collect(hc))

    with engine_on(backend, parallel=3) as engine:
        ra, rb, rc = asyncio.run(scenario(engine))
    assert (ra.slot, rb.slot, rc.slot) == (0, 0, 1)
    assert first_step(backend, 300) < last_step(backend, 100)  # c ran while a held slot 0
    assert first_step(backend, 200) > last_step(backend, 100)  # b waited for slot 0
    assert (ra.tokens, rb.tokens, rc.tokens) == (reference(a, 20), reference(b, 5), reference(c, 5))


def test_a_full_queue_refuses_with_503_and_frees_up_when_requests_finish():
    async def scenario(engine):
        handles = [engine.submit(request(prompt(100 + i, 4), 3)) for i in range(2)]  # 1 running + 1 waiting
        with pytest.raises(EngineError) as refused:
            engine.submit(request(prompt(150, 4), 3))
        engine.start()
        done = await asyncio.gather(*(collect(h) for h in handles))
        again = await run(engine, prompt(150, 4), 3)  # the places are free again
        return refused.value, done, again

    with engine_on(parallel=1, max_queue_depth=1, start=False) as engine:
        err, done, again = asyncio.run(scenario(engine))
        stats = engine.stats()
    assert (err.code, err.status) == ("queue_full", 503)
    assert stats.n_rejected_total == 1
    assert [r.tokens for r in done] == [reference(prompt(100 + i, 4), 3) for i in range(2)]
    assert again.tokens == reference(prompt(150, 4), 3)


def test_a_prompt_that_cannot_fit_the_slot_context_is_refused_with_400():
    async def scenario(engine):
        with pytest.raises(EngineError) as refused:
            engine.submit(request(prompt(100, 32), 4))
        return refused.value, await run(engine, prompt(100, 31), 4)

    with engine_on(n_ctx=64, parallel=2) as engine:  # 32 tokens per slot
        err, fits = asyncio.run(scenario(engine))
    assert (err.code, err.status) == ("context_length_exceeded", 400)
    assert err.details["n_ctx"] == 32 and err.details["n_prompt_tokens"] == 32
    # one token of room: one token, stopped at the bound
    assert fits.tokens == reference(prompt(100, 31), 1)
    assert fits.last.finish_reason == "length" and fits.last.truncated
