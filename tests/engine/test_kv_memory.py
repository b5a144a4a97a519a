"""KV bytes from a spec (engine/kv_memory.py): the pool the KV manager builds, the spec a config
alone yields against the one a loaded backend reports, and emptying the prefix cache under a
live sequence."""

from __future__ import annotations

import json

import pytest

from mlxcel.engine.backend import KVSpec, LayerKV
from mlxcel.engine.kv_block_pool import RESERVED, BlockAllocator, SequenceKV
from mlxcel.engine.kv_manager import KVManager
from mlxcel.engine.kv_memory import pool_bytes, slot_share, spec_from_config, usage_bytes
from mlxcel.engine.kv_prefix_cache import PrefixCache
from tests.conftest import fixture_path
from tests.engine.fake_backend import FakeBackend
from tests.fixtures import DEFAULT_MODEL, zoo_fixture


@pytest.mark.parametrize(("budget", "recurrent"), [(1 << 20, False), (None, False), (0, False), (1 << 20, True)])
def test_pool_bytes_is_the_pool_bind_builds(budget, recurrent):
    manager = KVManager(n_ctx_slot=100, parallel=3, budget_bytes=budget)
    backend = FakeBackend(recurrent=recurrent)
    manager.bind(backend)
    kv = pool_bytes(manager, backend.kv_spec)
    spec = backend.kv_spec
    assert kv.pool_blocks == manager.allocator.num_blocks
    assert kv.capacity_bytes == (manager.allocator.num_blocks * 16 * spec.bytes_per_token
                                 + spec.state_bytes * (manager.state_slots if recurrent else 0))
    assert kv.slots_bytes + kv.prefix_cache_bytes + RESERVED * 16 * spec.bytes_per_token \
        + (spec.state_bytes if recurrent else 0) == kv.capacity_bytes
    assert usage_bytes(manager)["capacity_bytes"] == kv.capacity_bytes
    if budget == 0 or recurrent:
        assert kv.prefix_cache_bytes == 0


def test_a_mode_changes_bytes_through_the_spec_alone():
    manager = KVManager(n_ctx_slot=64, parallel=2, budget_bytes=0)
    wide = pool_bytes(manager, KVSpec((LayerKV("full", 1024),) * 4))
    narrow = pool_bytes(manager, KVSpec((LayerKV("full", 512, quant="int8"),) * 4))
    assert narrow.capacity_bytes * 2 == wide.capacity_bytes


def test_slot_share_matches_the_engine_rule():
    assert slot_share(4096, 4) == (1024, 4)
    assert slot_share(4096, 0) == (4096, 1)
    assert slot_share(3, 4) == (2, 4)


# families whose KV differs in kind: full, sliding, latent, recurrent beside attention, recurrent only;
# the torch backend keeps a wider convolution state, so its recurrent rows are checked too
@pytest.mark.parametrize(("backend", "ref"), [
    *(("mlx", ref) for ref in (DEFAULT_MODEL, zoo_fixture("gemma3"), zoo_fixture("deepseek_v2"),
                               zoo_fixture("lfm2"), zoo_fixture("mamba2"))),
    ("torch", zoo_fixture("lfm2")), ("torch", zoo_fixture("mamba2")), ("torch", zoo_fixture("gemma3"))])
def test_config_spec_is_the_loaded_backends(backend, ref):
    from mlxcel.models.checkpoint_config import normalize_config

    path = fixture_path(ref)
    if backend == "mlx":
        import mlx.core as mx

        from mlxcel.backends.mlx.backend import MLXBackend

        mx.set_default_device(mx.cpu)
        loaded = MLXBackend(path)
    else:
        from mlxcel.backends.torch.backend import TorchBackend

        loaded = TorchBackend(path, dtype="float32")
    config = normalize_config(json.loads((path / "config.json").read_text()))
    assert spec_from_config(config, 4, conv_keeps_kernel=backend == "torch") == loaded.kv_spec


def test_reset_empties_the_cache_and_a_live_sequence_keeps_its_blocks():
    alloc = BlockAllocator(16, 4)
    cache = PrefixCache(alloc, None)
    done = SequenceKV(alloc)
    done.reserve(10)
    done.tokens = list(range(10))
    live = SequenceKV(alloc)
    cache.insert(done.tokens, done.blocks)
    assert cache.adopt(live, list(range(9)) + [99], lambda s, d: None) == 9  # two full blocks shared, one copied
    done.release()
    shared = live.blocks[:2]
    assert all(alloc.refs(b) == 2 for b in shared)
    assert cache.reset() == 3 and cache.cached_blocks == 0 and not cache.root.children
    assert all(alloc.refs(b) == 1 for b in shared)  # the live sequence's own references remain
    assert cache.match(list(range(10))).tokens == 0
    live.release()
    assert alloc.free_blocks == 16 - RESERVED
