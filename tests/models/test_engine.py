"""The engine on a real checkpoint: batch invariance, the prefix cache, cancellation.

Greedy outputs are compared token for token, on both backends (the `model` fixture runs each
scenario once on MLX and once on torch at its CPU default dtype). Each backend computes a row
of a batched matmul the same way whatever else the batch holds, so no tolerance is needed.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from mlxcel.cli.flags import BUILD_ENV
from mlxcel.config.settings import BackendSection, EngineSection, KvSection, ServerSettings, SourceSection
from mlxcel.engine.kv_manager import BLOCK_SIZE
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.types import GenerationRequest
from tests.conftest import DEFAULT_MODEL, fixture_path

GREEDY = SamplingParams(temperature=0.0)
LONG_TEXT = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} box holds {i * 7 % 13} stones." for i in range(40))


def make_model(backend: str = "mlx", *, dtype: str = "auto", cache_ram_mib: int | None = None,
               kv: KvSection | None = None, **engine):
    """A served model as the CLI builds it (torch with mlxcel's CPU kernels, as served);
    `engine`: EngineSection fields over this file's defaults; `kv`: the KV section (default: the
    defaults, with `cache_ram_mib` where given)."""
    from mlxcel.runtime.load import load_served_model

    build_env = {k: os.environ[k] for k in BUILD_ENV if k in os.environ}
    settings = ServerSettings(source=SourceSection(model=DEFAULT_MODEL),
                              engine=EngineSection(**{"ctx_size": 8192, "parallel": 4, "warmup": False, **engine}),
                              backend=BackendSection(name=backend, dtype=dtype, build_env=build_env),
                              kv=kv or (KvSection() if cache_ram_mib is None else KvSection(cache_ram_mib=cache_ram_mib)))
    return load_served_model(settings, fixture_path(DEFAULT_MODEL))


@pytest.fixture(scope="module", params=["mlx", "torch"])
def model(request):
    m = make_model(backend=request.param)
    assert m.info.backend == request.param
    yield m
    m.engine.shutdown()


async def run(model, prompt, max_tokens=16, params=GREEDY, **kw):
    handle = model.engine.submit(GenerationRequest(prompt=prompt, params=params, max_tokens=max_tokens, **kw))
    tokens, last = [], None
    async for ev in handle:
        if ev.token is not None:
            tokens.append(ev.token)
        last = ev
    assert last.error is None, last.error
    return tokens, last


def encode(model, text):
    return model.tokenizer.encode(text)


def test_batch_invariance(model):
    target = encode(model, "Once upon a time in a quiet village,")
    others = [encode(model, t) for t in ("Hi", "List the planets of the solar system in order from the sun:",
                                         LONG_TEXT[:300])]

    async def alone():
        return (await run(model, target, 24))[0]

    async def together():
        results = await asyncio.gather(run(model, target, 24), *(run(model, o, 10 + 5 * i) for i, o in enumerate(others)))
        return results[0][0]

    solo = asyncio.run(alone())
    batched = asyncio.run(together())
    assert batched == solo


def test_prefix_cache_hit_is_identical_and_opt_out_prefills_cold(model):
    prompt = encode(model, LONG_TEXT)
    assert len(prompt) > 400

    async def scenario():
        cold = await run(model, prompt, 12)
        warm = await run(model, prompt, 12)
        opt_out = await run(model, prompt, 12, cache_prompt=False)
        again = await run(model, prompt, 12)
        return cold, warm, opt_out, again

    (t0, e0), (t1, e1), (t2, e2), (t3, e3) = asyncio.run(scenario())
    assert t0 == t1 == t2 == t3
    assert e1.timings.cache_n == len(prompt) - 1  # all but the token whose logits the step needs
    assert e1.timings.prompt_n == len(prompt) - e1.timings.cache_n
    assert e2.timings.cache_n == 0 and e2.timings.prompt_n == len(prompt)
    assert e3.timings.cache_n == e1.timings.cache_n  # the opt-out left the store intact


def test_a_prefix_cached_under_another_split_gives_the_same_probabilities(model):
    """The prompt cache supplies KV computed when another prompt was prefilled (here the first
    100 tokens the two share: 96 in shared full blocks, 4 copied out of the block in which they
    part; the rest of this prompt prefilled after them): the same tokens as a cold
    prefill of the whole prompt, and on torch in bf16 with AMX tiles the same bits of every
    probability (its CPU kernels compute a prompt token the same way whatever the chunk:
    backends/torch/row_gemv.py). MLX's matmuls and torch's own linears (fp32, the default on a
    CPU without bf16 instructions) round a row by the call's shape, so there the probabilities
    may differ in the last bits (measured: 1e-7 on MLX, 8e-7 on torch fp32 on an AVX2 CPU)."""
    prompt = encode(model, "Inventory. " + LONG_TEXT)  # a prompt no other test leaves in the cache
    params = SamplingParams(temperature=0.0, n_probs=5)

    async def scenario():
        async def probs(p, **kw):
            handle = model.engine.submit(GenerationRequest(prompt=p, params=params, max_tokens=8, **kw))
            out, last = [], None
            async for ev in handle:
                if ev.token is not None:
                    out.append((ev.token, ev.probs.prob, ev.probs.top))
                last = ev
            assert last.error is None, last.error
            return out, last.timings

        cold = await probs(prompt, cache_prompt=False)
        await probs(prompt[:100] + encode(model, " A different ending."))  # its KV parts from ours at 100
        warm = await probs(prompt)
        return cold, warm

    (cold, _), (warm, timings) = asyncio.run(scenario())
    assert timings.cache_n == 100 and 100 % BLOCK_SIZE, timings
    assert [t for t, _, _ in warm] == [t for t, _, _ in cold]
    if getattr(model.engine.backend, "prompt_linears", None) == "mlxcel AMX tiles":
        assert warm == cold
    else:  # MLX's matmuls and torch's own linears round a row by the chunk's shape
        for (_, pw, top_w), (_, pc, top_c) in zip(warm, cold):
            assert pw == pytest.approx(pc, abs=1e-5)
            assert dict(top_w) == pytest.approx(dict(top_c), abs=1e-5)


def test_concurrent_prompts_parting_inside_a_cached_block_get_their_cold_tokens(model):
    """Four prompts that share 40 tokens with a cached one (two full blocks shared, 8 tokens copied
    out of the third) admitted together: each gets the tokens a cold prefill of it alone gets,
    and every block goes back."""
    base = encode(model, "Harbour log. " + LONG_TEXT)[:40]
    prompts = [base + encode(model, f" Entry {i}: the {w} ship came in late.") for i, w in enumerate(("grey", "tall", "old", "fast"))]

    async def scenario():
        cold = [(await run(model, p, 10, cache_prompt=False))[0] for p in prompts]
        await run(model, base + encode(model, " Nothing else was seen."), 4)  # leaves the shared 40 tokens
        warm = await asyncio.gather(*(run(model, p, 10) for p in prompts))
        return cold, warm

    cold, warm = asyncio.run(scenario())
    assert [t for t, _ in warm] == cold
    assert all(last.timings.cache_n >= 40 for _, last in warm), [last.timings.cache_n for _, last in warm]
    usage = model.engine.kv_usage()
    assert usage["used_blocks"] == usage["cached_blocks"]


def test_cancel_returns_slot_and_blocks(model):
    engine = model.engine
    prompt = encode(model, "Write a very long essay about the sea.")

    async def scenario():
        handle = engine.submit(GenerationRequest(prompt=prompt, params=GREEDY, max_tokens=400))
        async for ev in handle:
            if ev.token is not None:
                break
        handle.cancel()
        for _ in range(200):
            if not any(s.is_processing for s in engine.slots()):
                break
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert not any(s.is_processing for s in engine.slots())
    usage = engine.kv_usage()
    assert usage["used_blocks"] == usage["cached_blocks"]


def test_eviction_under_a_tiny_budget_stays_correct():
    m = make_model(cache_ram_mib=1)  # about one block's worth per 16 tokens at fp32
    try:
        prompts = [encode(m, f"Question {i}: " + LONG_TEXT[: 200 + 40 * i]) for i in range(3)]

        async def scenario():
            first = [await run(m, p, 8) for p in prompts]
            second = [await run(m, p, 8) for p in prompts]
            return first, second

        first, second = asyncio.run(scenario())
        assert [t for t, _ in first] == [t for t, _ in second]
        usage = m.engine.kv_usage()
        budget = m.engine.kv.prefix_cache.budget_blocks
        assert usage["cached_blocks"] <= budget
        assert usage["used_blocks"] == usage["cached_blocks"]
    finally:
        m.engine.shutdown()


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_context_bound_stops_truncated_or_shifts_on(backend):
    prompt_text = "Count slowly from one to one thousand, one number per line:"

    async def go(m, max_tokens):
        return await run(m, encode(m, prompt_text), max_tokens)

    stop = make_model(ctx_size=256, parallel=2, backend=backend)  # 128 tokens per slot
    try:
        tokens, last = asyncio.run(go(stop, 400))
        n_prompt = len(encode(stop, prompt_text))
        assert len(tokens) == 128 - n_prompt
        assert last.finish_reason == "length" and last.stop_type == "limit" and last.truncated
    finally:
        stop.engine.shutdown()

    shift = make_model(ctx_size=256, parallel=2, context_shift=True, keep=-1, backend=backend)
    try:
        # a first request's blocks go back to the pool, so the shift's copy lands in storage the
        # pool already has (on torch: tensors a forward made, writable only in inference mode)
        asyncio.run(run(shift, encode(shift, LONG_TEXT)[:100], 4, cache_prompt=False))
        # greedy on a counting prompt keeps going past the bound: the shift makes room
        handle_tokens, last = asyncio.run(go(shift, 160))
        assert len(handle_tokens) > 128 - n_prompt, (len(handle_tokens), last.finish_reason)  # it did shift
        assert len(handle_tokens) == 160 or last.finish_reason == "stop"
        if len(handle_tokens) == 160:
            assert last.truncated and last.stop_type == "limit"
        usage = shift.engine.kv_usage()
        assert usage["used_blocks"] == usage["cached_blocks"]  # the shifted sequence gave every block back
    finally:
        shift.engine.shutdown()


def test_drain_waits_for_running_requests_and_shutdown_ends_the_rest():
    """What a model switch relies on: drain() reports idle once running requests finish
    (or not, at its timeout); shutdown() ends a request still running with an error event
    instead of leaving its client waiting."""
    from mlxcel.runtime.load import load_served_model
    from tests.fixtures import QWEN2_TINY

    settings = ServerSettings(source=SourceSection(model=QWEN2_TINY),
                              engine=EngineSection(ctx_size=2048, parallel=2, warmup=False),
                              backend=BackendSection(name="mlx"))
    m = load_served_model(settings, fixture_path(QWEN2_TINY))
    engine = m.engine
    prompt = m.tokenizer.encode("a b c")

    async def scenario():
        short = engine.submit(GenerationRequest(prompt=prompt, params=GREEDY, max_tokens=4, ignore_eos=True))
        idle = await asyncio.to_thread(engine.drain, 600)
        events = [ev async for ev in short]
        long = engine.submit(GenerationRequest(prompt=prompt, params=GREEDY, max_tokens=900, ignore_eos=True))
        async for ev in long:
            if ev.token is not None:
                break
        not_idle = await asyncio.to_thread(engine.drain, 0)
        await asyncio.to_thread(engine.shutdown)
        rest = [ev async for ev in long]
        return idle, events, not_idle, rest

    idle, events, not_idle, rest = asyncio.run(scenario())
    assert idle and events[-1].finish_reason == "length" and events[-1].completion_tokens == 4
    assert not_idle is False
    assert rest[-1].error and rest[-1].error_code == "model_busy" and engine.outstanding == 0
