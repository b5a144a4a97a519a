"""mlxcel's AMX tile kernel for prompt rows' bf16 linears (kernels/cpu/bf16_tiles.cpp): against
its plain-op reference, its rounding, its row independence whatever the call's shape, and what
that buys the served model: a prompt's logits carry the same bits however its prefill was
split (whole, after a cached prefix, in chunks, beside other sequences' decode rows).

Reference: F.linear in fp32 on the same bf16 values. The kernel sums each output in fp32 in
its own order and rounds once (nearest even), so a result is within one bf16 step of the
reference's; with integer inputs whose sums fp32 holds exactly it must equal torch's rounding
of the exact sum. On a CPU without AMX bf16 tiles there is nothing to test (prompt rows keep
torch's linear there); where /proc/cpuinfo lists them, the kernel must be available.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlxcel.backends.torch.cpu_kernels import cpu_flags
from mlxcel.backends.torch.row_gemv import load_row_kernel
from tests.conftest import DEFAULT_MODEL, fixture_path
from tests.fixtures import GEMMA3, QWEN2_TINY, QWEN3_TINY
from tests.models.callers import assert_each_caller_gets_its_own


@pytest.fixture(scope="module")
def tiles():
    kernel = load_row_kernel(os.environ)
    if kernel.prompt is None:
        assert "amx_bf16" not in cpu_flags(), "the CPU lists AMX bf16 tiles, yet the kernel says it has none"
        pytest.skip("this CPU has no AMX bf16 tiles: prompt rows keep torch's linear")
    return kernel.prompt


def _data(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    return x, w, b


# SmolLM2's and Gemma 3's shapes, then edges: outputs not a multiple of 16 or 32, inputs not a
# multiple of 32 (or odd), one output
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (1024, 640), (49, 33), (17, 40), (1, 31), (40, 7)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_tiles_match_fp32_reference(tiles, n, k):
    for m in (1, 5, 16, 33, 300):
        x, w, b = _data(m, n, k, seed=n * 31 + k + m)
        with torch.inference_mode():
            for bias in (None, b):
                got = tiles(x, w, bias)
                want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
                assert got.dtype == torch.bfloat16 and got.shape == want.shape
                # one bf16 step of each output (2^-8 relative, as the rounding is to nearest),
                # plus fp32 summation noise
                bound = want.abs() * 2.0 ** -8 + 1e-5 * float(want.abs().max())
                assert bool(((got.float() - want).abs() <= bound).all()), f"{m} rows, bias {bias is not None}"


def test_tiles_round_exact_sums_to_nearest_even(tiles):
    """Integer inputs: every partial sum is exact in fp32, so the result must be torch's own
    rounding of the exact sum, ties to even included (9-bit sums need it)."""
    g = torch.Generator().manual_seed(7)
    m, n, k = 37, 50, 96
    x = torch.randint(-16, 17, (m, k), generator=g).to(torch.bfloat16)
    w = torch.randint(-16, 17, (n, k), generator=g).to(torch.bfloat16)
    b = torch.randint(-300, 301, (n,), generator=g).to(torch.bfloat16)
    exact = F.linear(x.double(), w.double(), b.double())
    assert float(exact.abs().max()) < 2 ** 24  # exact in fp32 too
    assert bool(((exact.abs() > 256) & (exact % 2 == 1)).any())  # some sums are not bf16 values
    with torch.inference_mode():
        assert torch.equal(tiles(x, w, b), exact.float().to(torch.bfloat16))
        assert torch.equal(tiles(x, w, None), F.linear(x.double(), w.double()).float().to(torch.bfloat16))


@pytest.mark.parametrize("n,k", [(576, 576), (49, 33), (1536, 576)])
def test_a_row_gets_the_same_bits_whatever_the_call_holds(tiles, n, k):
    """The point of the kernel: a row's result does not depend on how many rows the call has,
    nor where the row sits among them (torch's bf16 linear gives other bits for other shapes)."""
    x, w, b = _data(70, n, k, seed=n + k)
    with torch.inference_mode():
        alone = torch.cat([tiles(x[i:i + 1], w, b) for i in range(len(x))])
        for lo, hi in [(0, 70), (0, 16), (0, 17), (0, 33), (3, 70), (5, 21), (31, 64), (69, 70)]:
            assert torch.equal(tiles(x[lo:hi], w, b), alone[lo:hi]), f"rows {lo}:{hi}"
        shuffled = torch.randperm(70, generator=torch.Generator().manual_seed(1))
        assert torch.equal(tiles(x[shuffled], w, b), alone[shuffled])
        assert torch.equal(tiles(x[:12].reshape(3, 4, k), w, b).reshape(12, -1), alone[:12])
        strided = x.t().contiguous().t()[:20]  # a non-contiguous input
        assert torch.equal(tiles(strided, w, b), alone[:20])


def test_tiles_refuse_what_they_do_not_take(tiles):
    w = torch.randn(8, 16).to(torch.bfloat16)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="last dimension"):
            tiles(torch.randn(2, 15).to(torch.bfloat16), w, None)
        with pytest.raises(RuntimeError, match="bf16"):
            tiles(torch.randn(1, 16), w.float(), None)
        with pytest.raises(RuntimeError, match="contiguous"):
            tiles(torch.randn(1, 16).to(torch.bfloat16), torch.randn(16, 8).to(torch.bfloat16).t(), None)


def test_two_callers_at_once_each_get_their_own_answer(tiles):
    """Each thread configures its own tiles: two engine threads (router mode) may call together."""
    work = [_data(40 + 9 * i, 1536, 576, seed=i) for i in range(2)]
    assert_each_caller_gets_its_own([lambda x=x, w=w, b=b: tiles(x, w, b) for x, w, b in work], rounds=100)


def _prefill(backend, prompt: list[int], cuts: list[int], beside: list[int] | None = None) -> np.ndarray:
    """The prompt's last logits after prefilling it in chunks ending at `cuts`; with `beside`,
    each chunk shares its step with a decode row of another sequence (a packed step)."""
    from mlxcel.engine.backend import ForwardRow

    seq = backend.new_sequence()
    other = None
    if beside is not None:
        other = backend.new_sequence()
        backend.forward([ForwardRow(beside, other)])
    start, logits = 0, None
    for cut in [*cuts, len(prompt)]:
        rows = [ForwardRow(prompt[start:cut], seq)]
        if other is not None:
            rows.append(ForwardRow([beside[-1]], other, decode=True))
        logits = backend.forward(rows)[0]
        start = cut
    seq.release()
    if other is not None:
        other.release()
    return logits


@pytest.mark.parametrize("ref", [DEFAULT_MODEL, GEMMA3, QWEN2_TINY, QWEN3_TINY])
def test_prompt_logits_are_the_same_however_the_prefill_was_split(tiles, ref):
    """Prompt-cache identity on bf16 torch: a cached prefix plus the rest, or any chunking, gives
    the bits of one whole prefill (the prompt cache stores blocks computed under other splits).
    530 tokens: past Gemma 3's 512-token window, so its windowed layers' prompt rows attend a
    window's worth. Each family as served: tile linears, fused norms and RoPE, row-by-row
    attention."""
    from mlxcel.backends.torch.backend import TorchBackend

    backend = TorchBackend(fixture_path(ref), dtype="bfloat16", build_env=os.environ)
    assert backend.prompt_linears == "mlxcel AMX tiles" and backend.fused_ops.endswith("row-by-row attention: all")
    prompt = [(i * 37) % 5000 + 100 for i in range(530)]
    whole = _prefill(backend, prompt, [])
    for cuts in ([96], [16, 17, 300], [529]):
        np.testing.assert_array_equal(_prefill(backend, prompt, cuts), whole, err_msg=f"chunks ending at {cuts}")
    np.testing.assert_array_equal(_prefill(backend, prompt, [96], beside=prompt[:40]), whole,
                                  err_msg="chunks beside a decode row (packed steps)")
