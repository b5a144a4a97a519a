"""Blocks behind a sliding window go back to the pool: over the fake backend as a sliding-window
model (each token a hash of the last WINDOW tokens, read back through the block table), a long
generation holds a bounded number of blocks where a full-attention model's grow, every row's
tokens stay the windowed reference's, and the prefix cache resumes a prompt only where the
window before the resume point is still held. The same holds for a model whose sliding layers
sit beside full-attention ones (`interleaved`): its sliding layers' own block group stays bounded
while the global layers' table keeps every block."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.engine.kv_block_pool import NULL_BLOCK, BlockAllocator, SequenceKV
from mlxcel.engine.kv_manager import BLOCK_SIZE, WINDOW_KEPT_SHIFT, WINDOW_NONE, KVManager
from tests.engine.fake_backend import FakeBackend, reference
from tests.engine.harness import engine_on, prompt, run

pytestmark = pytest.mark.timeout(60)

WINDOW = 16  # one block: a query's window spans at most two blocks
GENERATE = 200


INTERLEAVED = pytest.mark.parametrize("interleaved", [False, True], ids=["all-sliding", "interleaved"])


def sliding_blocks(backend: FakeBackend) -> list[int]:
    """The blocks the sliding layers held as each forward started: the whole pool's where every
    layer slides, their own group's where they sit beside global layers."""
    return backend.sliding_used if backend.interleaved else backend.used_blocks


@INTERLEAVED
@pytest.mark.parametrize("cache_prompt", [False, True])
def test_a_long_generation_holds_its_window_not_its_history(cache_prompt, interleaved):
    p = prompt(100, 20)
    sliding, full = FakeBackend(window=WINDOW, interleaved=interleaved), FakeBackend()
    for backend in (sliding, full):
        with engine_on(backend) as engine:
            got = asyncio.run(run(engine, p, GENERATE, cache_prompt=cache_prompt))
        assert got.tokens == reference(p, GENERATE, window=backend.window, interleaved=backend.interleaved)
        assert backend.poison_reads == 0
    # the window's two blocks, and with the prompt cache the two the prompt's own window
    # reads (kept so a re-sent prompt resumes from the cache)
    assert max(sliding_blocks(sliding)) <= (4 if cache_prompt else 2)
    history = -(-(len(p) + GENERATE - 2) // BLOCK_SIZE)
    assert max(full.used_blocks) == history
    if interleaved:  # the global layers' table keeps every block
        assert max(sliding.used_blocks) == history and len(sliding.sliding_used) == len(sliding.used_blocks)


@INTERLEAVED
def test_rows_in_one_batch_each_free_behind_their_own_window(interleaved):
    backend = FakeBackend(window=WINDOW, interleaved=interleaved)
    prompts = [prompt(100 + 20 * i, n) for i, n in enumerate((5, 20, 47, 90))]

    async def scenario(engine):
        return await asyncio.gather(*(run(engine, p, 60 + 10 * i) for i, p in enumerate(prompts)))

    with engine_on(backend, start=False, n_ctx=1024, parallel=4) as engine:
        engine.start()
        results = asyncio.run(scenario(engine))
    for i, (p, got) in enumerate(zip(prompts, results)):
        # each row's tokens are its solo run's: the reference is one sequence alone
        assert got.tokens == reference(p, 60 + 10 * i, window=WINDOW, interleaved=interleaved), f"row {i}"
    assert backend.poison_reads == 0
    assert max(sliding_blocks(backend)) <= 4 * 4 + 4  # per row: its window and its prompt's; some chunks wider


@INTERLEAVED
def test_the_prefix_cache_resumes_only_where_the_window_is_held(interleaved):
    p = prompt(100, 20)
    backend = FakeBackend(window=WINDOW, interleaved=interleaved)
    with engine_on(backend) as engine:
        cold = asyncio.run(run(engine, p, GENERATE))
        stored = p + cold.tokens[:-1]  # what the donated sequence's KV covered
        resent = asyncio.run(run(engine, p, 8))
        # a follow-up turn: the whole conversation so far, then more
        follow = stored + [cold.tokens[-1]] + prompt(300, 5)
        turn = asyncio.run(run(engine, follow, 8))
        # parts from the conversation mid-way, where the window was freed long ago
        parted = stored[:120] + prompt(400, 10)
        mid = asyncio.run(run(engine, parted, 8))
    assert resent.last.timings.cache_n == len(p) - 1 and resent.tokens == cold.tokens[:8]
    assert turn.last.timings.cache_n == len(stored)
    assert turn.tokens == reference(follow, 8, window=WINDOW, interleaved=interleaved)
    # back to the end of the blocks kept for the prompt's own window: 2 blocks
    assert mid.last.timings.cache_n == 2 * BLOCK_SIZE
    assert mid.tokens == reference(parted, 8, window=WINDOW, interleaved=interleaved)
    assert backend.poison_reads == 0


def test_props_policy_says_whether_blocks_are_freed_and_why_not():
    with engine_on(FakeBackend(window=WINDOW)) as engine:
        assert engine.kv_policy()["free_behind_window"] is True
    with engine_on(FakeBackend(window=WINDOW, interleaved=True)) as engine:
        assert engine.kv_policy()["free_behind_window"] is True
        assert engine.kv.allocator.window is None and engine.kv.allocator.sliding.window == WINDOW
    with engine_on(FakeBackend()) as engine:
        policy = engine.kv_policy()
        assert not policy["free_behind_window"] and policy["free_behind_window_off_reason"] == WINDOW_NONE
    backend = FakeBackend(window=WINDOW)
    with engine_on(backend, n_ctx=1024, context_shift=True) as engine:
        policy = engine.kv_policy()
        got = asyncio.run(run(engine, prompt(100, 20), 100))
    assert not policy["free_behind_window"] and policy["free_behind_window_off_reason"] == WINDOW_KEPT_SHIFT
    assert got.tokens == reference(prompt(100, 20), 100, window=WINDOW)
    assert max(backend.used_blocks) == -(-(20 + 100 - 2) // BLOCK_SIZE)  # every block kept


@INTERLEAVED
def test_a_rewind_behind_the_freed_blocks_is_refused(interleaved):
    allocator = BlockAllocator(64, BLOCK_SIZE)
    windowed = allocator
    if interleaved:  # the sliding layers' own group frees; the global table keeps every block
        windowed = allocator.sliding = BlockAllocator(64, BLOCK_SIZE)
    windowed.window = WINDOW
    seq = SequenceKV(allocator)
    for _ in range(5):  # five blocks' worth, one block at a time
        seq.reserve(BLOCK_SIZE)
        seq.tokens += [7] * BLOCK_SIZE
    seq.reserve(6)  # at 80 tokens: a query from 80 on reads 65 onward
    seq.tokens += [7] * 6
    table = seq.sliding if interleaved else seq.blocks
    assert table[:4] == [NULL_BLOCK] * 4 and windowed.used_blocks == 2
    if interleaved:
        assert NULL_BLOCK not in seq.blocks and allocator.used_blocks == 6
    seq.truncate(81)  # a rejected draft: back to where the last reserve was, no further
    with pytest.raises(RuntimeError, match="freed behind the sliding window"):
        seq.truncate(2 * BLOCK_SIZE)
    seq.release()
    assert allocator.used_blocks == 0 and windowed.used_blocks == 0


def test_the_sliding_group_follows_the_spec():
    """Sliding layers beside global ones get a block group of their own; a context shift keeps
    every block in one table, as for an all-sliding model."""
    backend = FakeBackend(window=WINDOW, interleaved=True)
    kv = KVManager(n_ctx_slot=64, parallel=1, budget_bytes=0)
    kv.bind(backend)
    assert kv.allocator.window is None and kv.allocator.sliding.window == WINDOW
    assert kv.allocator.sliding.num_blocks == kv.allocator.num_blocks and kv.window_policy["free_behind_window"]
    seq = kv.new_sequence()
    seq.reserve(3 * BLOCK_SIZE)
    usage = kv.usage()  # /props kv_cache shows the sliding group's occupancy beside the pool's
    assert usage["used_blocks"] == usage["sliding_used_blocks"] == 3
    kept = KVManager(n_ctx_slot=64, parallel=1, budget_bytes=0, keep_window=WINDOW_KEPT_SHIFT)
    kept.bind(FakeBackend(window=WINDOW, interleaved=True))
    assert kept.allocator.sliding is None and kept.window_policy["free_behind_window_off_reason"] == WINDOW_KEPT_SHIFT


@INTERLEAVED
def test_speculated_rows_rewind_within_the_window_they_hold(interleaved):
    """Verification rows write a draft's positions and the rejected ones are trimmed: never
    behind what the row's window still holds, so its tokens stay the plain reference's."""
    from mlxcel.engine.speculative import NGRAM_SIMPLE, NgramDrafter, SpecConfig, Speculator

    config = SpecConfig(NGRAM_SIMPLE, ngram_size_n=1, ngram_size_m=6)
    p = prompt(100, 64)  # a one-token n-gram: most tokens recur in it, so drafts are proposed
    backend = FakeBackend(window=WINDOW, interleaved=interleaved)
    with engine_on(backend, speculator=Speculator(config, NgramDrafter(config))) as engine:
        got = asyncio.run(run(engine, p, 120))
    assert got.tokens == reference(p, 120, window=WINDOW, interleaved=interleaved)
    assert got.last.timings.draft_n > 0  # it did speculate
    assert backend.poison_reads == 0 and max(sliding_blocks(backend)) <= 6


@pytest.mark.parametrize("argv,environ", [(["--swa-full"], {}), ([], {"LLAMA_ARG_SWA_FULL": "1"})])
def test_swa_full_keeps_every_block(argv, environ):
    from mlxcel.cli.flags import parse_server_args
    from mlxcel.engine.kv_manager import WINDOW_KEPT_FULL

    settings = parse_server_args(["-m", "some/model", *argv], environ)
    assert settings.kv.swa_full is True and parse_server_args(["-m", "some/model"], {}).kv.swa_full is False
    backend, p = FakeBackend(window=WINDOW), prompt(100, 20)
    with engine_on(backend, swa_full=settings.kv.swa_full) as engine:
        policy = engine.kv_policy()
        got = asyncio.run(run(engine, p, 100))
    assert policy["free_behind_window"] is False and policy["free_behind_window_off_reason"] == WINDOW_KEPT_FULL
    assert got.tokens == reference(p, 100, window=WINDOW)
    assert max(backend.used_blocks) == -(-(len(p) + 100 - 2) // BLOCK_SIZE)


@INTERLEAVED
def test_prompts_cut_from_earlier_conversations_anywhere_serve_the_reference(interleaved):
    """Prompts that share a prefix of an earlier stream cut at random points (in freed parts, in
    kept parts, inside blocks), some at once: every row serves the windowed reference, and once
    all end the pool holds only what the prefix cache keeps."""
    import random

    rng = random.Random(7)
    backend = FakeBackend(window=WINDOW, interleaved=interleaved)
    streams = [prompt(100, 30)]

    async def one(engine, p, n):
        got = await run(engine, p, n)
        streams.append(p + got.tokens)
        return p, n, got

    async def wave(engine):
        prompts = []
        for _ in range(3):
            base = rng.choice(streams)
            cut = rng.randrange(1, len(base))
            prompts.append((base[:cut] + prompt(rng.randrange(2, 500), rng.randrange(1, 20)), rng.randrange(5, 60)))
        return await asyncio.gather(*(one(engine, p, n) for p, n in prompts))

    with engine_on(backend, n_ctx=1024, parallel=3) as engine:
        results = [r for _ in range(5) for r in asyncio.run(wave(engine))]
        usage = engine.kv_usage()
        sliding = engine.kv.allocator.sliding
        held = sum(x.sliding != NULL_BLOCK for x in engine.kv.prefix_cache._nodes())
    for p, n, got in results:
        assert got.tokens == reference(p, n, window=WINDOW, interleaved=interleaved)
    assert any(got.last.timings.cache_n > 0 for _, _, got in results)  # the cache did serve some
    assert backend.poison_reads == 0 and usage["used_blocks"] == usage["cached_blocks"]
    if interleaved:  # the sliding group too holds only what the cache keeps
        assert sliding.used_blocks == held


def test_a_prefix_cache_reset_gives_the_sliding_group_back():
    """POST /v1/cache/reset drops every cached node: the sliding group's blocks go back with the
    global table's."""
    kv = KVManager(n_ctx_slot=64, parallel=1, budget_bytes=None)
    kv.bind(FakeBackend(window=WINDOW, interleaved=True))
    seq, _ = kv.start(list(range(3 * BLOCK_SIZE)), use_cache=True)
    seq.reserve(3 * BLOCK_SIZE)
    seq.tokens = list(range(3 * BLOCK_SIZE))
    kv.release(seq, donate=True)
    assert kv.usage()["sliding_used_blocks"] > 0 and kv.prefix_cache.cached_blocks > 0
    kv.prefix_cache.reset()
    usage = kv.usage()
    assert usage["used_blocks"] == usage["sliding_used_blocks"] == 0, usage
