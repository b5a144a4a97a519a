"""The prefix cache seen from the engine: what a request reuses, that reused KV serves the
cold tokens (the fake reads every history back through the block table), the opt-out, and
that eviction under a small budget leaves the pool's references balanced."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.engine.kv_manager import BLOCK_SIZE
from mlxcel.engine.kv_block_pool import RESERVED
from tests.engine.fake_backend import KV_BYTES_PER_TOKEN, FakeBackend, reference
from tests.engine.harness import engine_on, prompt, run

# a regression that never ends a generation fails here instead of hanging the tier
pytestmark = pytest.mark.timeout(30)


def test_a_re_sent_prompt_reuses_all_but_its_last_token_and_serves_the_cold_tokens():
    p = prompt(100, 40)  # two full blocks and a partial one

    async def scenario(engine):
        return await run(engine, p, 8), await run(engine, p, 8)

    with engine_on() as engine:
        cold, warm = asyncio.run(scenario(engine))
    backend = engine.backend
    assert cold.tokens == reference(p, 8) and warm.tokens == cold.tokens
    assert cold.last.timings.cache_n == 0 and cold.last.timings.prompt_n == len(p)
    assert warm.last.timings.cache_n == len(p) - 1 and warm.last.timings.prompt_n == 1
    # (where each prefill row started, how many tokens it ran): all of p cold, then one token
    assert [(r.start, r.n) for _, r in backend.rows_of(100) if not r.decode] == [(0, len(p)), (len(p) - 1, 1)]
    assert backend.poison_reads == 0


def test_prompts_parting_inside_a_block_reuse_their_common_prefix():
    base = prompt(100, 60)
    tail = prompt(300, 20)[1:]
    parted = base[:37] + tail  # agrees with base for 2 full blocks + 5 tokens

    async def scenario(engine):
        first = await run(engine, base, 6)
        second = await run(engine, parted, 6)
        # two at once, parting from what is cached inside the first and the third block
        both = await asyncio.gather(run(engine, base[:21] + tail, 6), run(engine, base[:45] + tail[::-1], 6))
        return first, second, both

    with engine_on(batch_size=32) as engine:
        first, second, (third, fourth) = asyncio.run(scenario(engine))
    assert first.tokens == reference(base, 6)
    assert second.last.timings.cache_n == 37 and second.tokens == reference(parted, 6)
    assert third.last.timings.cache_n == 21 and third.tokens == reference(base[:21] + tail, 6)
    assert fourth.last.timings.cache_n == 45 and fourth.tokens == reference(base[:45] + tail[::-1], 6)
    assert engine.backend.poison_reads == 0


def test_a_request_opting_out_prefills_cold_and_leaves_the_cache_untouched():
    p, q = prompt(100, 40), prompt(200, 40)

    async def scenario(engine):
        await run(engine, p, 4)
        cached = engine.kv_usage()["cached_blocks"]
        opted_out = await run(engine, p, 4, cache_prompt=False)
        q_out = await run(engine, q, 4, cache_prompt=False)
        after = engine.kv_usage()["cached_blocks"]
        q_again = await run(engine, q, 4)  # the opt-out never donated q
        p_again = await run(engine, p, 4)  # nor took p's blocks away
        return cached, after, opted_out, q_out, q_again, p_again

    with engine_on() as engine:
        cached, after, opted_out, q_out, q_again, p_again = asyncio.run(scenario(engine))
    assert cached > 0 and after == cached
    assert opted_out.last.timings.cache_n == 0 and opted_out.last.timings.prompt_n == len(p)
    assert opted_out.tokens == p_again.tokens == reference(p, 4)
    assert q_out.tokens == q_again.tokens == reference(q, 4)
    assert q_again.last.timings.cache_n == 0
    assert p_again.last.timings.cache_n == len(p) - 1


def test_eviction_under_a_small_budget_keeps_the_pool_balanced():
    budget_blocks = 4
    prompts = [prompt(100 + 10 * i, 30 + 7 * i) for i in range(6)]

    async def scenario(engine):
        out = []
        for i in range(0, 6, 2):  # pairs at once: donations and evictions interleave with live rows
            out += await asyncio.gather(run(engine, prompts[i], 10), run(engine, prompts[i + 1], 10))
        # the newest re-sent beside two long evicted: adoption, donation and eviction at once
        out += await asyncio.gather(*(run(engine, prompts[i], 10) for i in (5, 0, 1)))
        return out, engine.kv_usage()

    backend = FakeBackend()
    with engine_on(backend, cache_budget_bytes=budget_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN) as engine:
        results, usage = asyncio.run(scenario(engine))
    expected = [reference(p, 10) for p in prompts] + [reference(prompts[i], 10) for i in (5, 0, 1)]
    assert [r.tokens for r in results] == expected
    assert results[6].last.timings.cache_n >= BLOCK_SIZE  # the re-send did adopt cached blocks
    assert backend.poison_reads == 0
    assert 0 < usage["cached_blocks"] <= budget_blocks
    assert usage["used_blocks"] == usage["cached_blocks"]  # nothing but the cache holds a block
    engine.kv.prefix_cache.clear()  # the engine thread is stopped: nothing else touches the pool
    alloc = backend.allocator
    assert engine.kv_usage()["cached_blocks"] == 0
    assert alloc.used_blocks == 0 and alloc.free_blocks == alloc.num_blocks - RESERVED
    assert all(alloc.refs(b) == 0 for b in range(RESERVED, alloc.num_blocks))


def test_a_trim_keeps_the_newest_donation_over_older_blocks():
    """Eviction goes leaf by leaf in age order: an older chain's inner block, once its leaf is
    gone, is evicted before the newest donation's last block."""
    budget_blocks = 4
    old, new = prompt(120, 65), prompt(110, 37)  # 5 blocks with its answer; then 3

    async def scenario(engine):
        await run(engine, old, 10)  # trimmed to its first 4 blocks
        await run(engine, new, 10)  # 3 more: 3 of the 7 must go, the oldest first
        return await run(engine, new, 10)

    with engine_on(cache_budget_bytes=budget_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN) as engine:
        again = asyncio.run(scenario(engine))
    assert again.tokens == reference(new, 10)
    assert again.last.timings.cache_n == len(new) - 1
