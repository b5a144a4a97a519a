"""Speculative decoding on real checkpoints: the text is plain decoding's text.

SmolLM2 drafting for itself accepts nearly everything (the accept path); a random-weight llama
on SmolLM2's exact vocabulary (json-tools-tiny) is rejected nearly always (the rollback path);
ngram-simple drafts from a repetitive prompt. Each is compared token for token with the same
request decoded plainly, on both backends at fp32, and the KV blocks all return afterwards.
"""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.speculative import (
    DRAFT, NGRAM_SIMPLE, ModelDrafter, NgramDrafter, SpecConfig, Speculator, ngram_simple_draft,
)
from tests.conftest import DEFAULT_MODEL, fixture_path
from tests.fixtures import JSON_TOOLS_TINY, available
from tests.models.test_engine import make_model
from tests.models.test_engine import run as run_engine

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=1234)
PROMPTS = ("Once upon a time in a quiet village,",
           "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
           "Again: Monday, Tuesday,")


def test_ngram_simple_proposes_the_continuation_of_the_last_match():
    ctx = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert ngram_simple_draft(ctx, 3, size_n=3, size_m=4) == [4, 5, 6, 7]
    assert ngram_simple_draft(ctx, 99, size_n=3, size_m=4) == []  # no earlier occurrence
    assert ngram_simple_draft(ctx[:8], 3, size_n=3, size_m=4) == []  # too short a context
    # the continuation is cut at the end of the context
    assert ngram_simple_draft([0, 7, 7, 7, 7, 7, 7, 1, 2, 3, 9, 1, 2], 3, size_n=3, size_m=8) == [9, 1, 2]


def attach(model, kind, draft_model=None, **kw):
    from mlxcel.runtime.load import load_backend

    config = SpecConfig(kind=kind, draft_model=draft_model, **kw)
    if kind == NGRAM_SIMPLE:
        model.engine.speculator = Speculator(config, NgramDrafter(config))
        return
    from mlxcel.config.settings import BackendSection, ServerSettings
    from mlxcel.engine.kv_manager import BLOCK_SIZE

    draft, _ = load_backend(ServerSettings(backend=BackendSection(name=model.info.backend)), draft_model)
    e = model.engine
    model.engine.speculator = Speculator(config, ModelDrafter(
        draft, config, n_ctx_slot=e.n_ctx_slot, parallel=e.parallel, batch_size=e.batch_size, block_size=BLOCK_SIZE,
        target_vocab=model.info.vocab_size))


async def run(model, prompt, params, max_tokens, kw=None):
    return await run_engine(model, prompt, max_tokens, params, **(kw or {}))


def generate(model, requests, concurrent=False):
    """One request at a time unless `concurrent` (at bf16 torch a row's logits shift with the other
    rows' padded lengths; the tests run at fp32, where a row is computed the same in any batch)."""
    async def go():
        if concurrent:
            return await asyncio.gather(*(run(model, *r) for r in requests))
        return [await run(model, *r) for r in requests]
    return asyncio.run(go())


@pytest.fixture(scope="module", params=["mlx", "torch"])
def model(request):
    # torch at fp32: at bf16 its attention sums over the batch's padded key length in blocks, so a
    # row's logits move with the other rows' lengths (plain decoding beside a longer row shows the
    # same shift); a verify batch holds rows of several lengths, so only fp32 is exact there
    m = make_model(backend=request.param, parallel=2, ctx_size=2048, dtype="float32")
    yield m
    m.engine.shutdown()


def scenario(model, kind, draft=None, which=(0, 1, 2), concurrent=False, **kw):
    """Plain decoding first, then the same requests speculated: identical tokens and stop."""
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    reqs = [(prompts[0], GREEDY, 16), (prompts[1], GREEDY, 16), (prompts[0], SEEDED, 12)]
    reqs = [reqs[i] for i in which]
    model.engine.speculator = None
    plain = generate(model, reqs, concurrent)
    attach(model, kind, draft, **kw)
    try:
        spec = generate(model, reqs, concurrent)
    finally:
        model.engine.speculator = None
    for (tp, ep), (ts, es) in zip(plain, spec):
        assert ts == tp
        assert (es.finish_reason, es.stop_type) == (ep.finish_reason, ep.stop_type)
    kv = model.engine.kv_usage()
    assert kv["used_blocks"] == kv["cached_blocks"]  # every row's blocks came back (the cache keeps its own)
    return [e.timings for _, e in spec]


def test_self_draft_accepts_and_matches_plain_decoding(model):
    timings = scenario(model, DRAFT, fixture_path(DEFAULT_MODEL), which=(0, 2), n_max=4)
    for t in timings:
        assert t.draft_kind == DRAFT and t.draft_rounds > 0
        assert t.draft_n_accepted > 0 and t.draft_n_accepted <= t.draft_n <= 4 * t.draft_rounds
    assert timings[0].draft_n_accepted >= timings[0].draft_n // 2  # a model agrees with itself when greedy


@pytest.mark.skipif(not available(JSON_TOOLS_TINY), reason="random-weight draft fixture not built")
def test_random_draft_is_rejected_and_rolled_back(model):
    timings = scenario(model, DRAFT, fixture_path(JSON_TOOLS_TINY), which=(0,), n_max=3)
    for t in timings:
        assert t.draft_rounds > 0 and t.draft_n_accepted < t.draft_n


def test_ngram_simple_matches_plain_decoding(model):
    # side by side: steps where one row verifies and the other decodes plainly share one forward
    timings = scenario(model, NGRAM_SIMPLE, which=(1, 0), concurrent=True, ngram_size_n=2, ngram_size_m=6)
    assert timings[0].draft_rounds > 0  # the repetitive prompt gives the lookup something to find


@pytest.mark.skipif(not available(JSON_TOOLS_TINY), reason="random-weight draft fixture not built")
def test_draft_p_min_stops_drafting_and_the_draft_cache_follows_the_context():
    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.engine.speculative import RowSpec

    be = MLXBackend(fixture_path(JSON_TOOLS_TINY), dtype="float32")
    ctx = list(range(100, 140))

    def drafter(p_min):
        return ModelDrafter(be, SpecConfig(kind=DRAFT, n_max=4, p_min=p_min), n_ctx_slot=256, parallel=2,
                            batch_size=16, block_size=16, target_vocab=49152)

    d = drafter(0.0)
    a, b = RowSpec(), RowSpec()
    first = d.propose([(a, ctx, 7, 4), (b, ctx[:20], 8, 2)])
    assert [len(x) for x in first] == [4, 2]
    assert a.seq.tokens == ctx + [7] + first[0][:3]  # the last draft token is never fed
    again = d.propose([(a, ctx + [7, 9], 11, 4)])  # the context diverged after `7`: re-synchronised
    assert a.seq.tokens[:len(ctx) + 3] == ctx + [7, 9, 11]
    assert len(again[0]) == 4
    d.release(a)
    d.release(b)
    assert a.seq is None and be.allocator.used_blocks == d.kv.prefix_cache.cached_blocks > 0  # kept for later rows
    assert drafter(1.0).propose([(RowSpec(), ctx, 7, 4)]) == [[]]  # no draft token is that certain


@pytest.mark.skipif(not available(JSON_TOOLS_TINY), reason="random-weight draft fixture not built")
def test_the_draft_starts_from_its_prefix_cache_and_a_shift_never_writes_into_it():
    """A row whose context an ended row's draft sequence already holds adopts it (shared full
    blocks, the rest copied) and drafts what a cold draft sequence drafts; a context rewritten
    inside the shared blocks (a context shift) starts the row over instead of overwriting them;
    a row whose request opted out of the prompt cache neither adopts nor leaves anything."""
    import mlx.core as mx
    import numpy as np

    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.engine.speculative import RowSpec

    be = MLXBackend(fixture_path(JSON_TOOLS_TINY), dtype="float32")

    def keys_at(slots):
        return [np.array(k[mx.array(slots)]) for k in be.storage.keys if k is not None]

    d = ModelDrafter(be, SpecConfig(kind=DRAFT, n_max=4), n_ctx_slot=256, parallel=2, batch_size=16, block_size=16,
                     target_vocab=49152)
    ctx = list(range(200, 240))
    cold = RowSpec()
    first = d.propose([(cold, ctx, 7, 4)])
    d.release(cold)

    warm = RowSpec()
    assert d.propose([(warm, ctx, 7, 4)]) == first
    assert warm.shared == 32  # two full blocks shared; the 8 tokens after them copied
    shared = warm.seq.slots(0, 32)
    held = keys_at(shared)
    shifted = ctx[:20] + ctx[30:] + [7] + first[0][:1]  # 10 tokens dropped inside the shared blocks
    d.propose([(warm, shifted, 5, 2)])
    assert warm.seq.tokens[:len(shifted)] == shifted and warm.shared == 16
    assert all(np.array_equal(a, b) for a, b in zip(held, keys_at(shared)))  # the cache's blocks untouched
    d.release(warm)

    again = RowSpec()
    assert d.propose([(again, ctx, 7, 4)]) == first  # the shared blocks still hold ctx's keys
    d.release(again)

    held = d.kv.prefix_cache.cached_blocks
    cached = {n.block for n in d.kv.prefix_cache._nodes()}
    opted_out = RowSpec(cache=False)  # a request with cache_prompt false: prefilled cold, not kept
    assert d.propose([(opted_out, ctx, 7, 4)]) == first
    assert opted_out.shared == 0 and not cached & set(opted_out.seq.blocks)
    d.release(opted_out)
    assert d.kv.prefix_cache.cached_blocks == held and be.allocator.used_blocks == held


def test_lora_rows_speculate_with_their_own_scales():
    """A verify row carries the request's adapter scales: speculated text under a LoRA adapter is
    the adapted model's plain text (and differs from the base model's)."""
    from mlxcel.cli.flags import parse_server_args
    from mlxcel.runtime.load import load_served_model
    from tests.fixtures import LORA_SMOLLM2, fixture_path as store_path, lora_available

    if not lora_available(LORA_SMOLLM2):
        pytest.skip("LoRA fixture not built")
    settings = parse_server_args(["-m", DEFAULT_MODEL, "--backend", "mlx", "-np", "1", "-c", "1024", "--no-warmup",
                                  "--lora-scaled", f"{store_path(LORA_SMOLLM2)}:4.0"], {})
    model = load_served_model(settings, fixture_path(DEFAULT_MODEL))
    try:
        prompt = model.tokenizer.encode(PROMPTS[0])
        base = generate(model, [(prompt, GREEDY, 12, {"lora": (0.0,)})])[0][0]
        timings = scenario(model, NGRAM_SIMPLE, which=(0,), ngram_size_n=1, ngram_size_m=4)
        adapted = generate(model, [(prompt, GREEDY, 12)])[0][0]
        assert adapted != base
        assert timings[0].draft_rounds > 0
    finally:
        model.engine.shutdown()
