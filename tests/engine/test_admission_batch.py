"""A request's rows are admitted together: one that can never fit the slots and the queue is a
400 on an idle server, one that does not fit now a 503, and neither holds queue places."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.engine.types import EngineError
from tests.engine.fake_backend import reference
from tests.engine.harness import collect, engine_on, prompt, request

pytestmark = pytest.mark.timeout(30)


def test_more_rows_than_slots_and_queue_is_a_400_that_holds_no_places():
    rows = [request(prompt(100 + i, 4), 3) for i in range(3)]

    async def scenario(engine):
        with pytest.raises(EngineError) as refused:
            engine.submit_all(rows)
        rejected = engine.stats().n_rejected_total
        # every place is still free: a request of exactly slots + queue rows is taken whole
        handles = engine.submit_all(rows[:2])
        engine.start()
        return refused.value, rejected, await asyncio.gather(*(collect(h) for h in handles))

    with engine_on(parallel=1, max_queue_depth=1, start=False) as engine:
        err, rejected, done = asyncio.run(scenario(engine))
    assert (err.code, err.status) == ("invalid_request", 400)
    assert "at most 2" in err.message
    assert rejected == 0  # not a busy server: the request itself is too big
    assert [r.tokens for r in done] == [reference(prompt(100 + i, 4), 3) for i in range(2)]


def test_rows_that_do_not_fit_now_are_a_503_and_none_is_queued():
    async def scenario(engine):
        first = engine.submit(request(prompt(100, 4), 3))
        with pytest.raises(EngineError) as refused:
            engine.submit_all([request(prompt(150 + i, 4), 3) for i in range(2)])
        second = engine.submit(request(prompt(200, 4), 3))  # the refused pair took no place
        engine.start()
        return refused.value, await asyncio.gather(collect(first), collect(second))

    with engine_on(parallel=1, max_queue_depth=1, start=False) as engine:
        err, done = asyncio.run(scenario(engine))
        stats = engine.stats()
    assert (err.code, err.status) == ("queue_full", 503)
    assert stats.n_rejected_total == 1
    assert [r.tokens for r in done] == [reference(prompt(100, 4), 3), reference(prompt(200, 4), 3)]
