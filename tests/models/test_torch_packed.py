"""The oneDNN-packed bf16 linears of the torch backend give the stock kernel's results."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mlxcel.backends.torch.packed import PACKED_MAX_ROWS, PackedLinear, pack_linears, packing_available  # noqa: E402

pytestmark = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.bfloat16),
                                reason="this CPU's oneDNN has no bf16 kernels")


def test_packed_linear_matches_stock_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.Linear(160, 48, bias=False)).to(torch.bfloat16)
    xs = [torch.randn(b, n, 96, dtype=torch.bfloat16) for b, n in ((1, 1), (4, 1), (1, 7), (2, PACKED_MAX_ROWS + 5))]
    with torch.inference_mode():
        want = [model(x) for x in xs]
        assert pack_linears(model) == 2
        assert all(type(m) is PackedLinear for m in model)
        got = [model(x) for x in xs]
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_only_bf16_linears_are_packed():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16))
    assert pack_linears(model) == 1
    assert type(model[0]) is torch.nn.Linear and type(model[1]) is PackedLinear
