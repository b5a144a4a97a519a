"""Pipelined greedy decode on MLX (engine/decode_pipeline.py): the same output as the plain path.

Each scenario runs once with pipelining off and once on, on the same engine, and compares the
streamed events field by field; a counter on the backend's `decode_greedy` shows the pipelined
path really ran. Afterwards every KV block is back (only the prefix cache holds any).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from mlxcel.engine.decode_pipeline import device_greedy
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.types import GenerationRequest
from tests.models.test_engine import GREEDY, make_model

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def test_device_greedy_only_when_the_host_pick_is_the_raw_argmax():
    assert device_greedy(GREEDY)  # the default chain (top-k, top-p, min-p keep the top logit) at temp 0
    assert not device_greedy(SamplingParams())  # temperature 0.8 draws
    for change in ({"repeat_penalty": 1.1}, {"presence_penalty": 0.5}, {"dry_multiplier": 0.8},
                   {"typical_p": 0.9}, {"xtc_probability": 0.5, "xtc_threshold": 0.1}, {"mirostat": 2},
                   {"n_probs": 3}, {"logit_bias": {5: 0.1}}, {"logit_bias": {5: 1e38}}, {"dynatemp_range": 0.5},
                   {"samplers": ("top_k", "top_p")}, {"samplers": ("temperature", "adaptive_p"),
                                                      "adaptive_target": 0.5}):
        assert not device_greedy(replace(GREEDY, **change)), change
    with pytest.raises(ValueError, match="logit_bias"):  # +inf never reaches either path
        replace(GREEDY, logit_bias={5: math.inf})
    assert device_greedy(replace(GREEDY, repeat_penalty=1.3, repeat_last_n=0))  # a zero window is off
    assert device_greedy(replace(GREEDY, xtc_probability=0.5, xtc_threshold=0.6))  # XTC never fires
    # biases exact in fp32 (ignore_eos bans the end tokens with -inf) are added on the device
    assert device_greedy(replace(GREEDY, logit_bias={5: -math.inf, 7: 2.5}))


@pytest.fixture(scope="module")
def model():
    m = make_model(backend="mlx")
    backend = m.engine.backend
    assert m.engine.pipeline_decode  # on by default wherever the backend picks tokens on its device
    calls = [0]
    original = backend.decode_greedy

    def counted(rows, ids=None, bias=None):
        calls[0] += 1
        return original(rows, ids, bias)

    backend.decode_greedy = counted
    m.calls = calls
    yield m
    m.engine.shutdown()


def collect(model, prompt, **kw):
    """(events, handle) of one request; events keep the fields a client sees."""
    async def go():
        h = model.engine.submit(GenerationRequest(prompt=prompt, params=kw.pop("params", GREEDY), **kw))
        return [ev async for ev in h]
    return asyncio.run(go())


def view(events):
    return [(e.token, e.text, e.finish_reason, e.stop_type, e.stopping_word, e.error, e.completion_tokens)
            for e in events]


def both(model, prompt, **kw):
    """The same request with pipelining off, then on; returns both event views."""
    engine = model.engine
    engine.pipeline_decode = False
    try:
        before = model.calls[0]
        off = collect(model, prompt, **kw)
        assert model.calls[0] == before
    finally:
        engine.pipeline_decode = True
    before = model.calls[0]
    on = collect(model, prompt, **kw)
    assert model.calls[0] > before  # the pipelined path ran
    return view(off), view(on)


def assert_blocks_back(model):
    engine = model.engine
    for _ in range(100):
        if not any(s.is_processing for s in engine.slots()):
            break
        asyncio.run(asyncio.sleep(0.02))
    usage = engine.kv_usage()
    assert usage["used_blocks"] == usage["cached_blocks"]


def test_max_tokens_and_eos_match_the_plain_path(model):
    tok = model.tokenizer
    off, on = both(model, tok.encode("Once upon a time in a quiet village,"), max_tokens=24)
    assert on == off and len([e for e in on if e[0] is not None]) == 24 and on[-1][2] == "length"
    off, on = both(model, tok.encode(CHAT.format("What is 2+2? Answer with just the number.")), max_tokens=40)
    assert on == off and on[-1][3] == "eos"  # the reply ends on its end-of-turn token
    assert_blocks_back(model)


def test_logit_bias_and_ignore_eos_match_the_plain_path(model):
    """ignore_eos as the routes spell it (the end tokens banned by a -inf bias) and a boost
    that changes the text: the device adds the bias before its argmax, as the host chain does."""
    tok = model.tokenizer
    chat = tok.encode(CHAT.format("What is 2+2? Answer with just the number."))
    ban = {t: -math.inf for t in tok.eos_token_ids}
    off, on = both(model, chat, max_tokens=20, ignore_eos=True, params=replace(GREEDY, logit_bias=ban))
    assert on == off and on[-1][2] == "length"  # ran past the end-of-turn it stops on unbiased
    plain = [e[0] for e in collect_view(model, chat, max_tokens=12)]
    boost = {tok.encode(" four")[0]: 8.0, tok.encode("4")[0]: -4.0}
    off, on = both(model, chat, max_tokens=12, params=replace(GREEDY, logit_bias=boost))
    assert on == off and [e[0] for e in on] != plain
    assert_blocks_back(model)


def collect_view(model, prompt, **kw):
    return view(collect(model, prompt, **kw))


def test_stop_string_matches_the_plain_path(model):
    prompt = model.tokenizer.encode("The days of the week are Monday,")
    events = collect(model, prompt, max_tokens=20)
    text = "".join(e.text for e in events)
    word = text[len(text) // 2: len(text) // 2 + 3]
    off, on = both(model, prompt, max_tokens=20, stop=[word])
    assert on == off and on[-1][3] == "word" and on[-1][4] == word
    assert_blocks_back(model)


def test_donated_kv_after_a_pipelined_stop_is_the_real_one(model):
    """The position queued ahead of the last token is dropped before the prefix cache takes
    the blocks: a request continuing the text reads them and matches a cold prefill."""
    tok = model.tokenizer
    prompt = tok.encode("A list of fruits: apple, banana, cherry,")
    first = [e.token for e in collect(model, prompt, max_tokens=35) if e.token is not None]
    follow = prompt + first + tok.encode(" and")
    warm = [e.token for e in collect(model, follow, max_tokens=8)]
    cold = [e.token for e in collect(model, follow, max_tokens=8, cache_prompt=False)]
    assert warm == cold
    assert_blocks_back(model)


def test_cancel_mid_stream_and_a_second_request_mid_decode(model):
    tok = model.tokenizer
    a = tok.encode("Write a very long essay about the sea.")
    b = tok.encode("List the planets of the solar system in order from the sun:")
    solo_a = [e.token for e in collect(model, a, max_tokens=30) if e.token is not None]
    solo_b = [e.token for e in collect(model, b, max_tokens=12) if e.token is not None]

    async def scenario():
        engine = model.engine
        ha = engine.submit(GenerationRequest(prompt=a, params=GREEDY, max_tokens=30))
        got_a, got_b, hb = [], None, None
        async for ev in ha:
            if ev.token is not None:
                got_a.append(ev.token)
            if len(got_a) == 5 and hb is None:  # a second request joins mid-decode
                hb = engine.submit(GenerationRequest(prompt=b, params=GREEDY, max_tokens=12))
                task = asyncio.ensure_future(_tokens(hb))
        got_b = await task
        hc = engine.submit(GenerationRequest(prompt=a, params=GREEDY, max_tokens=200))
        got_c = []
        async for ev in hc:
            got_c.append(ev.token)
            if len(got_c) == 7:
                break
        hc.cancel()  # cancelled while its next step is queued ahead
        return got_a, got_b, got_c

    got_a, got_b, got_c = asyncio.run(scenario())
    assert got_a == solo_a and got_b == solo_b and got_c == solo_a[:7]
    assert_blocks_back(model)
    # the cancelled row's donated blocks are sound: the same prompt again gives the same text
    assert [e.token for e in collect(model, a, max_tokens=30) if e.token is not None] == solo_a


async def _tokens(handle):
    return [ev.token async for ev in handle if ev.token is not None]


@pytest.mark.timeout(300)
def test_a_request_whose_event_loop_closed_does_not_stop_the_engine(model):
    """A caller that walks away without cancel() (its event loop closes while its row still
    decodes, a token queued ahead) ends that request only: the engine thread lives on."""
    a = model.tokenizer.encode("Write a very long essay about the sea.")

    async def abandon():
        handle = model.engine.submit(GenerationRequest(prompt=a, params=GREEDY, max_tokens=200))
        async for ev in handle:
            if ev.token is not None:
                return

    asyncio.run(abandon())
    assert model.engine._thread.is_alive()
    got = [e.token for e in collect(model, a, max_tokens=5) if e.token is not None]
    assert len(got) == 5
    assert_blocks_back(model)
