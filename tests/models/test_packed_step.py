"""One forward per engine step: rows of different lengths packed (backends/*/packed.py).

A packed step (a prefill chunk beside one-token decode rows) must give every row the logits its
own padded forward gives: RoPE at the row's own positions, attention over the row's own paged
history (sliding windows included, and DeepSeek's latent attention over a pool of latents), and
the per-row extensions (steering deltas, residual reads, LoRA scales) on that row's tokens only.
The engine then plans each step as one forward: a request admitted while another decodes shares
the decode forward with it.

Tolerance: fp32 logits within 5e-4 absolute and the same argmax. MLX's CPU kernels give the
padded forwards' bits exactly here; torch's are not invariant to the batch's shape (measured
up to 6.9e-5 on gemma-3-270m, whose logits reach ~40).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mlxcel.engine.backend import ForwardRow
from mlxcel.backends.rows import RowLayout
from mlxcel.engine.types import GenerationRequest
from tests import fixtures
from tests.conftest import DEFAULT_MODEL, default_backends, fixture_path
from tests.models.test_engine import GREEDY, make_model, run
from tests.models.test_lora import _adapter_path, _backend

TOL = 5e-4
GEMMA = "google/gemma-3-270m"  # sliding-window layers (512) beside full ones
# multi-head latent attention: the pool holds the latent, which each row group expands or absorbs
MLA = [fixtures.zoo_fixture("deepseek_v2"), fixtures.zoo_fixture("deepseek_v3")]


def _close(a, b):
    assert a.shape == b.shape
    assert float(np.abs(a - b).max()) <= TOL and int(a.argmax()) == int(b.argmax())


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    # the first history is longer than gemma's 512-token window
    return [rng.integers(100, 5000, n).tolist() for n in (600, 23, 30)]


def _prime(backend, a, b):
    sa, sb = backend.new_sequence(), backend.new_sequence()
    backend.forward([ForwardRow(a, sa)])
    backend.forward([ForwardRow(b, sb)])
    return sa, sb, backend.new_sequence()


@pytest.mark.parametrize("ref", [DEFAULT_MODEL, GEMMA, *MLA])
@pytest.mark.parametrize("backend_name", default_backends())
def test_a_packed_step_gives_each_row_its_own_logits(backend_name, ref):
    backend = _backend(backend_name, fixture_path(ref))
    assert backend.packs_rows
    a, b, c = _prompts()
    # padded: the decode rows together, then each prefill chunk alone
    sa, sb, sc = _prime(backend, a, b)
    decode = backend.forward([ForwardRow([7], sa), ForwardRow([9], sb)])
    chunk1 = backend.forward([ForwardRow(c[:20], sc)])[0]
    chunk2 = backend.forward([ForwardRow(c[20:], sc)])[0]
    after = backend.forward([ForwardRow([11], sa)])[0]
    for s in (sa, sb, sc):
        s.release()
    # packed: a chunk between two decode rows, then a chunk before a decode row
    sa, sb, sc = _prime(backend, a, b)
    step1 = backend.forward([ForwardRow([7], sa), ForwardRow(c[:20], sc), ForwardRow([9], sb)])
    step2 = backend.forward([ForwardRow(c[20:], sc), ForwardRow([11], sa)])
    _close(step1[0], decode[0])
    _close(step1[2], decode[1])
    _close(step1[1], chunk1)
    _close(step2[0], chunk2)
    _close(step2[1], after)  # the packed steps stored the right keys at the right slots
    for s in (sa, sb, sc):
        s.release()


@pytest.mark.parametrize("backend_name", default_backends())
def test_steering_reads_and_lora_scales_stay_on_their_rows(backend_name):
    from mlxcel.models.lora import load_adapter

    backend = _backend(backend_name, fixture_path(DEFAULT_MODEL))
    backend.attach_lora([load_adapter(_adapter_path())])
    a, b, c = _prompts(1)
    hidden = int(backend.info.config["hidden_size"])
    delta = {6: np.random.default_rng(2).normal(0, 4.0, hidden).astype(np.float32)}

    def rows(sa, sb, sc, reads):
        def keep(name):
            return lambda toks, pre, post: reads.setdefault(name, (pre, post))
        return [ForwardRow([7], sa, steering=delta, capture={6: keep("a")}),
                ForwardRow(c, sc, capture={6: keep("c")}, lora=(0.75,)),
                ForwardRow([9], sb)]

    sa, sb, sc = _prime(backend, a[:40], b)
    alone_reads: dict = {}
    r = rows(sa, sb, sc, alone_reads)
    alone = [backend.forward([r[0]])[0], backend.forward([r[1]])[0], backend.forward([r[2]])[0]]
    for s in (sa, sb, sc):
        s.release()
    sa, sb, sc = _prime(backend, a[:40], b)
    packed_reads: dict = {}
    assert RowLayout.of([1, len(c), 1]).packed
    packed = backend.forward(rows(sa, sb, sc, packed_reads))
    for i in range(3):
        _close(packed[i], alone[i])
    for name, n in (("a", 1), ("c", len(c))):
        for got, want in zip(packed_reads[name], alone_reads[name]):
            assert got.shape == want.shape == (n, hidden)
            assert float(np.abs(got - want).max()) <= TOL
    # the extensions really act: the steered and adapted rows moved, the plain one did not
    sa2, sb2, sc2 = _prime(backend, a[:40], b)
    plain = backend.forward([ForwardRow([7], sa2), ForwardRow(c, sc2), ForwardRow([9], sb2)])
    assert float(np.abs(plain[0] - packed[0]).max()) > 0.1 and float(np.abs(plain[1] - packed[1]).max()) > 0.1
    _close(plain[2], packed[2])


@pytest.mark.parametrize("backend_name", default_backends())
def test_the_engine_runs_one_forward_per_step(backend_name):
    """A request admitted mid-decode has its prompt chunks packed into the decoding row's
    forward, and both texts equal their solo runs."""
    model = make_model(backend=backend_name, batch_size=16)
    try:
        backend = model.engine.backend
        shapes: list[list[int]] = []
        original = backend.forward

        def recorded(rows):
            shapes.append([len(r.tokens) for r in rows])
            return original(rows)

        backend.forward = recorded
        tok = model.tokenizer
        a = tok.encode("Write a very long essay about the sea.")
        b = tok.encode("List the planets of the solar system in order from the sun, with one fact about each:")
        solo_a = asyncio.run(run(model, a, 30))[0]
        solo_b = asyncio.run(run(model, b, 8))[0]

        async def joined():
            handle = model.engine.submit(GenerationRequest(prompt=a, params=GREEDY, max_tokens=30))
            got, task = [], None
            async for ev in handle:
                if ev.token is not None:
                    got.append(ev.token)
                if len(got) == 4 and task is None:
                    task = asyncio.ensure_future(run(model, b, 8, cache_prompt=False))
            return got, (await task)[0]

        shapes.clear()
        got_a, got_b = asyncio.run(joined())
        assert got_a == solo_a and got_b == solo_b
        mixed = [s for s in shapes if 1 in s and max(s) > 1]
        assert mixed, shapes  # b's chunks rode in a's decode forwards
        assert len(b) > 16 and all(sum(s) <= 16 for s in shapes)  # under the token budget
    finally:
        model.engine.shutdown()

