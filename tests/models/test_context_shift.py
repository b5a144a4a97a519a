"""Context shift on both backends: `compact` drops a span of a sequence's KV and the sequence
goes on at its logical position, with the kept keys' rotation untouched.

Without a discard, compaction must be invisible (the next logits are byte-identical), in each
KV storage mode (int8 and turbo records move with their scales); with one, MLX and torch at fp32 must
continue the shifted sequence the same way.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.engine.backend import ForwardRow, KVCacheTypes
from mlxcel.engine.kv_manager import compacted
from tests.conftest import DEFAULT_MODEL, fixture_path

PROMPT = "Count slowly from one to fifty, one number per line: one, two, three, four, five, six, seven, eight,"


def load(backend: str, kv: str = "f16"):
    path = fixture_path(DEFAULT_MODEL)
    if backend == "mlx":
        from mlxcel.backends.mlx.backend import MLXBackend

        return MLXBackend(path, dtype="float32", kv_cache=KVCacheTypes(kv, kv))
    from mlxcel.backends.torch.backend import TorchBackend

    return TorchBackend(path, dtype="float32", kv_cache=KVCacheTypes(kv, kv))


@pytest.fixture(scope="module")
def backends():
    """(backend, KV storage mode) -> the loaded backend, loaded on first use."""
    made = {}

    def get(name: str, kv: str = "f16"):
        if (name, kv) not in made:
            made[(name, kv)] = load(name, kv)
        return made[(name, kv)]

    return get


def prompt_ids():
    from mlxcel.engine.tokenizer import Tokenizer

    return Tokenizer(fixture_path(DEFAULT_MODEL)).encode(PROMPT)


def shifted_greedy(be, ids, keep, discard, steps=8):
    """Prefill, compact, then decode greedily; the logits of every decode step."""
    seq = be.new_sequence()
    logits = be.forward([ForwardRow(ids, seq)])[0]
    out = compacted(seq, keep, discard, be.copy_slots)
    assert out.position == seq.position and out.length == len(ids) - discard
    assert out.tokens == ids[:keep] + ids[keep + discard:]
    seq.release()
    steps_logits = []
    for _ in range(steps):
        logits = be.forward([ForwardRow([int(logits.argmax())], out)])[0].copy()
        steps_logits.append(logits)
    out.release()
    assert be.allocator.used_blocks == 0  # the old and the compacted sequence gave every block back
    return steps_logits


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("kv", ["f16", "int8", "turbo4"])
def test_compaction_without_a_discard_is_invisible(backends, backend, kv):
    be, ids = backends(backend, kv), prompt_ids()
    assert len(ids) > 20
    plain = be.new_sequence()
    first = be.forward([ForwardRow(ids, plain)])[0]
    expected = be.forward([ForwardRow([int(first.argmax())], plain)])[0].copy()
    plain.release()
    assert np.array_equal(shifted_greedy(be, ids, keep=5, discard=0, steps=1)[0], expected)


def test_mlx_and_torch_continue_a_shifted_sequence_alike(backends):
    ids = prompt_ids()
    mlx_steps = shifted_greedy(backends("mlx"), ids, keep=4, discard=len(ids) // 2)
    torch_steps = shifted_greedy(backends("torch"), ids, keep=4, discard=len(ids) // 2)
    for step, (a, b) in enumerate(zip(mlx_steps, torch_steps)):
        assert int(a.argmax()) == int(b.argmax()), f"greedy differs at step {step}"
        assert float(np.abs(a - b).max()) <= 1e-3, f"step {step}: max abs diff {np.abs(a - b).max()}"
