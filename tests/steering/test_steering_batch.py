"""Steering inside the continuous batch, on a real (tiny, random-weight) model and engine.

Four requests (unsteered, the live steering, profile A, a cluster at dial 0.5) run together
and each must produce exactly the tokens it produces alone; strength 0 and "off" must be
byte-identical to no SAE attached, down to the logits. Both backends, same assertions.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mlxcel.engine.backend import ForwardRow
from mlxcel.config.settings import BackendSection, EngineSection, ServerSettings, SourceSection
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.types import GenerationRequest
from mlxcel.steering import requests as steer
from mlxcel.steering.store import Profile, SteeringStore
from tests.fixtures import QWEN2_TINY, available, fixture_path
from tests.steering.test_sae_units import random_sae

pytestmark = pytest.mark.skipif(not available(QWEN2_TINY), reason="run scripts/fixtures/build_all.py")
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["mlx", "torch"])
def served(request):
    from mlxcel.runtime.load import load_served_model

    m = load_served_model(ServerSettings(source=SourceSection(model=QWEN2_TINY),
                                         engine=EngineSection(ctx_size=2048, parallel=4, warmup=False),
                                         backend=BackendSection(name=request.param)), fixture_path(QWEN2_TINY))
    assert m.info.backend == request.param
    yield m
    m.engine.shutdown()


def request(served, store, prompt, **fields):
    greq = GenerationRequest(prompt=prompt, params=GREEDY, max_tokens=12)
    headers, _ = steer.apply(steer.take_fields(dict(fields)), served.steering, store, greq)
    return greq, headers


async def run(served, greq):
    tokens = []
    async for ev in served.engine.submit(greq):
        assert ev.error is None, ev.error
        if ev.token is not None:
            tokens.append(ev.token)
    return tokens


def test_four_kinds_of_rows_in_one_batch_each_get_their_own_delta(served, tmp_path):
    store = SteeringStore(tmp_path / "state")
    prompt = served.tokenizer.encode("The quick brown fox jumps over")
    unsteered_before = asyncio.run(run(served, request(served, store, prompt)[0]))

    served.steering.attach(str(random_sae(tmp_path / "sae", d_in=64, d_sae=32, layer=0)))
    store.create(Profile(name="A", steering={5: 40.0}, sae_id="sae"))
    store.create(Profile(name="C", steering={9: -60.0, 2: 30.0}, sae_id="sae", kind="cluster",
                         intensity_min=0.5, intensity_max=1.5))
    # attached, nothing set: byte-identical to no SAE
    assert asyncio.run(run(served, request(served, store, prompt)[0])) == unsteered_before
    served.steering.set_values("sae", {7: 50.0})

    kinds = {"unsteered": {"steering_intensity": "off"}, "live": {}, "profile": {"profile": "A"},
             "cluster": {"profile": "C", "steering_intensity": 0.5}}
    alone = {k: asyncio.run(run(served, request(served, store, prompt, **f)[0])) for k, f in kinds.items()}

    async def together():
        reqs = [request(served, store, prompt, **f)[0] for f in kinds.values()]
        return dict(zip(kinds, await asyncio.gather(*(run(served, r) for r in reqs))))

    assert asyncio.run(together()) == alone
    assert alone["unsteered"] == unsteered_before
    assert len({tuple(v) for v in alone.values()}) == 4, alone  # every steering changed the output
    assert request(served, store, prompt, profile="C", steering_intensity=0.5)[1] == {steer.INTENSITY_HEADER: "0.5"}


def test_unsteered_rows_are_byte_identical_at_the_logits_while_a_hook_is_installed(served, tmp_path):
    be = served.engine.backend
    ids = served.tokenizer.encode("Hello there")

    def logits(steering):
        seq = be.new_sequence()
        out = be.forward([ForwardRow(ids, seq, steering)]).copy()
        seq.release()
        return out

    # the engine is idle between tests, so the backend can be driven directly
    base = logits(None)
    d = np.zeros(64, np.float32)
    d[3] = 5.0
    steered = logits({1: d})
    assert not np.array_equal(base, steered)
    assert np.array_equal(logits(None), base)
    assert np.array_equal(logits({1: np.zeros(64, np.float32)}), base)


def test_capture_hands_each_row_its_residuals_before_and_after_its_own_delta(served):
    be = served.engine.backend
    a, b = served.tokenizer.encode("Hello there"), served.tokenizer.encode("A longer second prompt, in one batch")
    d = np.zeros(64, np.float32)
    d[5] = 4.0
    got = {}

    def capture(name):
        return {1: lambda toks, pre, post: got.__setitem__(name, (toks, pre, post))}

    seqs = [be.new_sequence(), be.new_sequence()]
    be.forward([ForwardRow(a, seqs[0], {1: d}, capture("a")), ForwardRow(b, seqs[1], None, capture("b"))])
    for s in seqs:
        s.release()
    (ta, pre_a, post_a), (tb, pre_b, post_b) = got["a"], got["b"]
    assert ta == a and tb == b
    assert pre_a.shape == post_a.shape == (len(a), 64) and pre_b.shape == (len(b), 64)
    moved = (post_a - pre_a).mean(axis=0)
    assert int(np.argmax(np.abs(moved))) == 5 and abs(moved[5] - 4.0) < 0.5  # bf16 on torch rounds
    assert np.array_equal(pre_b, post_b)  # a row without a delta passes through untouched


def test_a_scoring_pass_is_unsteered_while_a_steered_generation_runs_beside_it(served, tmp_path):
    store = SteeringStore(tmp_path / "state")
    prompt = served.tokenizer.encode("Once upon a time there was")
    if "sae" not in served.steering.attached:
        served.steering.attach(str(random_sae(tmp_path / "sae", d_in=64, d_sae=32, layer=0)))
    served.steering.set_values("sae", {}, replace=True)
    unsteered_logits = served.engine.score(prompt)
    served.steering.set_values("sae", {4: 80.0})
    steered_alone = asyncio.run(run(served, request(served, store, prompt)[0]))
    assert steered_alone != asyncio.run(run(served, request(served, store, prompt, steering_intensity="off")[0]))

    async def together():
        gen = asyncio.ensure_future(run(served, request(served, store, prompt)[0]))
        scores = [await asyncio.wrap_future(served.engine.submit_score(prompt)) for _ in range(3)]
        return await gen, scores

    tokens, scores = asyncio.run(together())
    assert tokens == steered_alone  # the generation beside the scoring passes is still steered
    assert all(np.array_equal(s, unsteered_logits) for s in scores)  # each pass suppressed every SAE
    served.steering.set_values("sae", {}, replace=True)
