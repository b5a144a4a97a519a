"""Recurrent state slots: one per live sequence beside its block table, from admission to
release, never shared; the prefix cache and the context shift are off for such a model."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.engine.backend import KVSpec, LayerKV
from mlxcel.engine.kv_block_pool import BlockAllocator, OutOfBlocks, OutOfStateSlots, SequenceKV, StateSlots
from mlxcel.engine.kv_manager import RECURRENT_NO_PREFIX, RECURRENT_NO_SHIFT, KVLayoutUnsupported, KVManager
from tests.engine.fake_backend import STATE_BYTES, FakeBackend, next_token, reference
from tests.engine.harness import engine_on, prompt, run

pytestmark = pytest.mark.timeout(30)


def test_state_slots_hand_out_the_lowest_free_id_up_to_their_capacity():
    slots = StateSlots(3)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2] and slots.used == 3
    with pytest.raises(OutOfStateSlots, match="all 3 recurrent state slots"):
        slots.allocate()
    assert issubclass(OutOfStateSlots, OutOfBlocks)  # callers that answer "no KV memory" answer it too
    slots.free(2)
    slots.free(0)
    assert slots.allocate() == 0 and slots.allocate() == 2 and slots.high_water == 3
    with pytest.raises(AssertionError, match="freed twice"):
        slots.free(1)
        slots.free(1)
    unbounded = StateSlots()
    assert [unbounded.allocate() for _ in range(40)] == list(range(40))


def test_a_sequence_holds_one_state_slot_from_its_first_tokens_until_release():
    allocator = BlockAllocator(16, 4)
    allocator.states = StateSlots(2)
    a, b = SequenceKV(allocator), SequenceKV(allocator)
    assert a.state is None
    a.reserve(5)
    a.reserve(3)  # more tokens, the same slot
    b.claim_state()
    assert (a.state, b.state) == (0, 1) and allocator.states.used == 2
    a.tokens = [7] * 5
    a.truncate(2)  # the tokens go; the state they produced cannot be rewound
    assert a.state_ahead
    a.release()
    assert a.state is None and not a.state_ahead and allocator.states.used == 1
    c = SequenceKV(allocator)
    c.reserve(1)
    assert c.state == 0  # the released slot, reused
    plain = SequenceKV(BlockAllocator(16, 4))  # a model without recurrent layers takes none
    plain.reserve(4)
    assert plain.state is None


def test_the_manager_sizes_state_slots_and_turns_the_prefix_cache_off():
    kv = KVManager(n_ctx_slot=64, parallel=3, budget_bytes=None)
    kv.bind(FakeBackend(recurrent=True))
    assert kv.recurrent and kv.allocator.states.capacity == 4  # the slots and one scoring pass
    assert not kv.prefix_cache.enabled and kv.prefix_cache_off == RECURRENT_NO_PREFIX
    seq, cached = kv.start([5, 6, 7] * 20, use_cache=True)
    assert cached == 0 and seq.state == 0  # claimed at admission, before any forward
    usage = kv.usage()
    assert (usage["state_slots_total"], usage["state_slots_used"], usage["state_bytes_per_slot"]) == (4, 1, STATE_BYTES)
    seq.tokens = [5] * 40
    with pytest.raises(KVLayoutUnsupported, match="no context shift"):
        kv.compact(seq, 4, 8)
    kv.release(seq, donate=True)
    assert kv.usage()["state_slots_used"] == 0 and kv.prefix_cache.cached_blocks == 0
    plain = KVManager(n_ctx_slot=64, parallel=3, budget_bytes=None)
    plain.bind(FakeBackend())
    assert not plain.recurrent and plain.allocator.states is None and plain.prefix_cache_off is None
    assert "state_slots_total" not in plain.usage()


def test_the_spec_counts_state_bytes_apart_from_per_token_bytes():
    spec = KVSpec((LayerKV("full", 64), LayerKV("recurrent", 0, state_bytes=100),
                   LayerKV("recurrent", 0, state_bytes=28)))
    assert spec.bytes_per_token == 64 and spec.state_bytes == 128 and spec.recurrent
    assert not KVSpec((LayerKV("full", 64),)).recurrent


def test_concurrent_rows_each_keep_their_own_state_and_give_the_slots_back():
    prompts = [prompt(100 + 7 * i, 5 + 9 * i) for i in range(4)]

    async def scenario(engine):
        return await asyncio.gather(*(run(engine, p, 6 + i) for i, p in enumerate(prompts)))

    backend = FakeBackend(recurrent=True)
    with engine_on(backend, n_ctx=256, parallel=4, batch_size=16) as engine:
        results = asyncio.run(scenario(engine))
        usage = engine.kv_usage()
    for i, (p, res) in enumerate(zip(prompts, results)):
        assert res.tokens == reference(p, 6 + i)  # chunked prompts beside decoding rows, state intact
    assert backend.poison_reads == 0
    steps: dict[int, list[int]] = {}
    for step, slot in backend.state_rows:
        steps.setdefault(step, []).append(slot)
    assert any(len(s) > 1 for s in steps.values())  # rows did share forwards
    assert all(len(s) == len(set(s)) for s in steps.values())  # never a slot twice in one forward
    assert usage["state_slots_used"] == 0 and usage["used_blocks"] == 0


def test_a_repeated_prompt_is_recomputed_and_a_scoring_pass_takes_the_spare_slot():
    p = prompt(200, 40)

    async def scenario(engine):
        first = await run(engine, p, 5)
        # a scoring pass while both slots decode: it runs on the pool's spare state slot
        busy = [asyncio.ensure_future(run(engine, prompt(300 + i, 20), 30)) for i in range(2)]
        await asyncio.sleep(0.05)
        scored = await asyncio.wrap_future(engine.submit_score(p))
        return first, await run(engine, p, 5), scored, await asyncio.gather(*busy)

    with engine_on(FakeBackend(recurrent=True), n_ctx=256, parallel=2) as engine:
        first, again, scored, busy = asyncio.run(scenario(engine))
        policy = engine.kv_policy()
    assert first.tokens == again.tokens == reference(p, 5)
    assert first.last.timings.cache_n == 0 and again.last.timings.cache_n == 0  # no prefix cache to hit
    assert int(scored.argmax()) == next_token(p)
    assert [b.tokens for b in busy] == [reference(prompt(300 + i, 20), 30) for i in range(2)]
    assert policy["prefix_cache"] is False and policy["prefix_cache_off_reason"] == RECURRENT_NO_PREFIX


def test_a_requested_context_shift_is_turned_off_and_a_full_context_ends_the_request():
    p = prompt(120, 20)
    with engine_on(FakeBackend(recurrent=True), n_ctx=64, parallel=2, context_shift=True) as engine:
        res = asyncio.run(run(engine, p, 100))
        policy = engine.kv_policy()
    assert policy["context_shift"] is False and policy["context_shift_off_reason"] == RECURRENT_NO_SHIFT
    assert res.tokens == reference(p, 12)  # the slot's 32 tokens, then the request ends
    assert res.last.finish_reason == "length"
