"""The startup fit decision (runtime/estimate.check_fits) on made-up figures, and weight bytes
from safetensors headers at a compute dtype (packed quantized tensors as stored)."""

from __future__ import annotations

import math

import pytest

from mlxcel.backends.select import Choice
from mlxcel.config.refusal import StartupRefusal
from mlxcel.engine.kv_memory import KVBytes
from mlxcel.config.refusal import StartupRefusal
from mlxcel.runtime.estimate import MemoryEstimate, check_fits, weight_bytes
from mlxcel.store.tensor_scan import entries
from tests.conftest import fixture_path
from tests.fixtures import DEFAULT_MODEL, SMOLLM2_4BIT

MIB = 1 << 20


def figures(weights_mib: int, cache_blocks: int, explicit: bool) -> MemoryEstimate:
    # 1 MiB per block: 2 slots of 10 blocks, the reserved 2, then the prefix cache's blocks
    kv = KVBytes(bytes_per_token=MIB // 16, block_size=16, n_ctx_slot=144, parallel=2,
                 pool_blocks=2 + 20 + cache_blocks, slot_blocks=10, state_bytes=0, state_slots=0)
    return MemoryEstimate(Choice("mlx", "cpu", "test"), "float32", weights_mib * MIB, kv, explicit)


def test_weights_and_slots_over_the_device_are_refused_by_how_much():
    with pytest.raises(StartupRefusal) as e:
        check_fits(figures(100, 50, explicit=False), 110 * MIB, "available RAM")
    msg = e.value.message
    assert "needs about 122.0 MiB" in msg and "12.0 MiB more than the 110.0 MiB of available RAM" in msg
    assert "prefix cache" not in msg and "--fit off" in msg


def test_an_explicit_cache_budget_that_does_not_fit_is_refused_too():
    with pytest.raises(StartupRefusal) as e:
        check_fits(figures(100, 50, explicit=True), 150 * MIB, "available RAM")
    assert "needs about 172.0 MiB" in e.value.message and "prefix cache 50.0 MiB" in e.value.message
    assert "--cache-ram" in e.value.message


def test_the_default_cache_budget_only_warns_and_a_fit_passes():
    warning = check_fits(figures(100, 50, explicit=False), 150 * MIB, "available RAM")
    assert warning is not None and "default budget (50.0 MiB)" in warning
    assert check_fits(figures(100, 50, explicit=True), 200 * MIB, "available RAM") is None
    assert check_fits(figures(100, 50, explicit=True), None, "available RAM") is None


def test_weight_bytes_scale_floats_and_keep_packed_tensors():
    plain = fixture_path(DEFAULT_MODEL)
    n = sum(math.prod(t.shape) for t in entries(plain))
    assert weight_bytes(plain, "float32") == 4 * n and weight_bytes(plain, "bfloat16") == 2 * n
    packed = fixture_path(SMOLLM2_4BIT)
    tensors = list(entries(packed))
    stored = sum(t.end - t.start for t in tensors if t.dtype == "U32")
    floats = sum(math.prod(t.shape) for t in tensors if t.dtype != "U32")
    assert stored > 0 and weight_bytes(packed, "float32") == stored + 4 * floats


def test_a_truncated_checkpoint_is_refused_in_one_line(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(StartupRefusal, match="cannot read the safetensors headers"):
        weight_bytes(tmp_path, "float32")
