"""The torch backend's one-row decode shortcuts: the matrix-vector linear path, the
contiguous KV read, and the --torch-compile flag's parsing and refusal (the compiled
forward itself is measured in docs/benchmarks.md, not tested: it compiles for minutes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlxcel.backends.torch.paged import StepPlan
from mlxcel.backends.torch.row_gemv import ALL, install_row_gemv, remove_row_gemv
from mlxcel.cli.flags import parse_server_args
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import BackendSection, ServerSettings
from mlxcel.engine.kv_block_pool import BlockAllocator, SequenceKV
from mlxcel.runtime.load import select_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_gemv_matches_linear_and_leaves_linears_visible(dtype):
    """Without mlxcel's kernel, one row runs torch.mv (bf16: torch's linear bits) and more
    rows torch's linear, whatever the step's routing says."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=True), torch.nn.Linear(96, 32, bias=False)).to(dtype)
    one, many = torch.randn(1, 1, 64, dtype=dtype), torch.randn(3, 2, 64, dtype=dtype)
    with torch.inference_mode():
        want_one, want_many = model(one), model(many)
        routing = install_row_gemv(None, model)
        seen = []
        model[1].register_forward_hook(lambda m, args, out: seen.append(out.shape))  # e.g. a LoRA term
        got_one = model(one)
        with routing.decode_rows(ALL):
            got_many = model(many)
    assert all(type(m) is torch.nn.Linear for m in model)
    assert seen == [torch.Size([1, 1, 32]), torch.Size([3, 2, 32])]
    assert got_one.shape == want_one.shape and got_one.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got_one, want_one)
    else:
        torch.testing.assert_close(got_one, want_one, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_many, want_many)  # more than one row: torch's own linear, untouched
    remove_row_gemv(model)
    assert all("forward" not in m.__dict__ for m in model)


def _seq(alloc: BlockAllocator, n: int) -> SequenceKV:
    seq = SequenceKV(alloc)
    seq.reserve(n)
    seq.tokens.extend(range(n))
    return seq


def test_one_row_in_consecutive_blocks_reads_a_view_and_others_gather():
    alloc = BlockAllocator(16, 4)
    fresh = _seq(alloc, 6)
    fresh.reserve(7)
    plan = StepPlan([(fresh, 1)], torch.device("cpu"))
    assert plan.read_start == int(fresh.slots(0, 1)[0])
    assert np.array_equal(plan.read.numpy(), plan.read_start + np.arange(7))
    # two rows, or one row whose blocks are out of order, go through the index gather
    other = _seq(alloc, 3)
    other.reserve(4)
    assert StepPlan([(fresh, 1), (other, 1)], torch.device("cpu")).read_start is None
    full = _seq(alloc, 8)  # two full blocks, adopted in reverse order (as a prefix-cache hit may)
    scattered = SequenceKV(alloc)
    scattered.adopt(list(reversed(full.blocks)), list(full.tokens))
    scattered.reserve(1)
    assert StepPlan([(scattered, 1)], torch.device("cpu")).read_start is None


def test_torch_compile_flag_reaches_settings_and_is_refused_on_mlx():
    assert parse_server_args(["--torch-compile"], {}).backend.torch_compile is True
    assert parse_server_args([], {}).backend.torch_compile is False
    compiled = ServerSettings(backend=BackendSection(name="torch", device="cpu", torch_compile=True))
    assert select_backend(compiled).backend == "torch"
    with pytest.raises(StartupRefusal) as e:
        select_backend(ServerSettings(backend=BackendSection(name="mlx", device="cpu", torch_compile=True)))
    assert "--torch-compile" in str(e.value.code) and "--backend torch" in str(e.value.code)
