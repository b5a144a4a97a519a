"""Recurrent state across rows on both backends: in one step a decoding row, fresh prompt rows of
different lengths and a row whose state slot another sequence held before each give the logits
of their solo runs (the zoo's lfm2 and mamba2 checkpoints). On MLX the step is padded; on torch
LFM2's step is padded too (its convolution state is taken at each row's last real token) and
Mamba 2's rows of different lengths run as separate forwards (a scan's state would run on
through the padding).
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.engine.backend import ForwardRow
from mlxcel.engine.kv_block_pool import BlockAllocator, StateSlots
from tests import fixtures
from tests.conftest import fixture_path

TOLERANCE = 1e-4


def _solo(backend, tokens: list[int]) -> np.ndarray:
    seq = backend.new_sequence()
    out = backend.forward_all(tokens, seq)[-1]
    seq.release()
    return out


def _load(family: str, backend: str):
    path = fixture_path(fixtures.zoo_fixture(family))
    if backend == "mlx":
        from mlxcel.backends.mlx.backend import MLXBackend

        return MLXBackend(path, dtype="float32")
    from mlxcel.backends.torch.backend import TorchBackend

    loaded = TorchBackend(path, dtype="float32")
    assert loaded.pads_rows == (family == "lfm2")  # only convolution states can be cut at a row's end
    return loaded


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("family", ["lfm2", "mamba2"])
def test_rows_at_different_positions_keep_their_own_state(family, backend):
    backend = _load(family, backend)
    assert backend.recurrent and not backend.packs_rows
    allocator = BlockAllocator(64, 16)
    allocator.states = StateSlots(4)
    backend.bind_kv(allocator)
    a_tokens, b_tokens, c_tokens = list(range(300, 313)), list(range(500, 507)), [42, 43, 44]
    a, old = backend.new_sequence(), backend.new_sequence()
    backend.forward([ForwardRow(a_tokens, a)])
    backend.forward([ForwardRow([9, 8, 7, 6], old)])  # leaves a state in the slot b reuses
    old.release()
    b, c = backend.new_sequence(), backend.new_sequence()
    got = backend.forward([ForwardRow([77], a, decode=True), ForwardRow(b_tokens, b), ForwardRow(c_tokens, c)])
    assert b.state == 1  # old's slot: its stale state must not leak into b
    want = [_solo(backend, a_tokens + [77]), _solo(backend, b_tokens), _solo(backend, c_tokens)]
    for row, (g, w) in enumerate(zip(got, want)):
        assert float(np.abs(g - w).max()) <= TOLERANCE, f"row {row}"
    # and the padded step left each state at its row's last real token
    nxt = backend.forward([ForwardRow([5], b), ForwardRow([5], c)])
    assert float(np.abs(nxt[0] - _solo(backend, b_tokens + [5])).max()) <= TOLERANCE
    assert float(np.abs(nxt[1] - _solo(backend, c_tokens + [5])).max()) <= TOLERANCE

