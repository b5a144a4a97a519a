"""The slot's context bound: with context shift on a generation goes past it keeping the first
n_keep tokens; with it off the generation stops there, finish_reason "length", truncated."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.fake_backend import reference
from tests.engine.harness import collect, engine_on, prompt, request, run

# a regression that never ends a generation fails here instead of hanging the tier
pytestmark = pytest.mark.timeout(30)

N_CTX_SLOT = 32  # n_ctx=64 over 2 slots


@pytest.mark.parametrize("n_discard", [8, 0])  # 0: half of what follows the kept tokens
def test_context_shift_keeps_the_first_n_keep_tokens_and_goes_on(n_discard):
    p = prompt(100, 10)
    with engine_on(n_ctx=64, parallel=2, context_shift=True) as engine:
        res = asyncio.run(run(engine, p, 60, n_keep=4, n_discard=n_discard))
        usage = engine.kv_usage()
    backend = engine.backend
    # the fake computes each token from the KV it reads back: the compacted history must be
    # exactly the kept tokens, then everything after the dropped run
    assert res.tokens == reference(p, 60, n_ctx_slot=N_CTX_SLOT, keep=4, discard=n_discard)
    assert res.last.finish_reason == "length" and res.last.truncated
    assert len(backend.compactions) >= 2
    for before, after in backend.compactions:
        assert len(before) == N_CTX_SLOT and after[:4] == p[:4]
        dropped = n_discard or (len(before) - 4) // 2
        assert after == before[:4] + before[4 + dropped:]
    assert backend.poison_reads == 0
    assert usage["used_blocks"] == usage["cached_blocks"] == 0  # a shifted row is released, never donated


@pytest.mark.parametrize("max_tokens", [60, -1])
def test_without_context_shift_a_generation_stops_at_the_bound_truncated(max_tokens):
    p = prompt(100, 10)
    with engine_on(n_ctx=64, parallel=2, context_shift=False) as engine:
        res = asyncio.run(run(engine, p, max_tokens))
    assert res.tokens == reference(p, N_CTX_SLOT - len(p))
    assert res.last.finish_reason == "length" and res.last.truncated
    assert engine.backend.compactions == []


def test_kv_unified_lets_every_slot_fill_the_whole_context():
    # two rows at once, each past the per-slot share (64 over 2 slots = 32) but inside n_ctx
    a, b = prompt(100, 20), prompt(300, 20)

    async def both(engine):
        ha, hb = engine.submit(request(a, 30)), engine.submit(request(b, 30))
        engine.start()  # the first step sees both: they share the steps, in slots 0 and 1
        return await asyncio.gather(collect(ha), collect(hb))

    with engine_on(n_ctx=64, parallel=2, kv_unified=True, start=False) as engine:
        ra, rb = asyncio.run(both(engine))
    assert engine.n_ctx_slot == 64 and (ra.slot, rb.slot) == (0, 1)
    assert (ra.tokens, rb.tokens) == (reference(a, 30), reference(b, 30))
    assert not ra.last.truncated and not rb.last.truncated
    assert engine.backend.poison_reads == 0
    with engine_on(n_ctx=64, parallel=2) as split:  # the default: each slot its share
        assert split.n_ctx_slot == N_CTX_SLOT
        assert asyncio.run(run(split, a, 30)).last.truncated
