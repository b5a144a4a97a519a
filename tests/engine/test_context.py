"""The slot's context bound: with context shift on a generation goes past it keeping the first
n_keep tokens; with it off the generation stops there, finish_reason "length", truncated."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.fake_backend import reference
from tests.engine.harness import engine_on, prompt, run

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
