"""mlxcel's few-row kernel (kernels/cpu/rows_linear.cpp, bf16 and fp32) against its plain-op reference, its
row independence, and the routing that sends decode rows to it and prompt rows to the tile
kernel or torch (backends/torch/row_gemv.py; the tile kernel's own tests:
test_torch_prompt_tiles.py).

Reference: F.linear in fp32 on the same bf16 values, rounded to bf16 once. The kernel sums in
fp32 in a different order (and, with AVX512-BF16, rounds each pair's partial sum), so results
may differ by one bf16 step; the bound below is two steps of the largest output (2 * 2^-7
relative). In fp32 only the order of the sums differs: within 2^-16 of the largest output. Then
the served model: SmolLM2 with the kernel against the same model with torch's own linears, in
bf16 logits within the bf16 noise of a 30-layer stack, in fp32 within 1e-4 of their range, and
the same greedy text.

The kernel is built with the system C++ compiler on first use (~10 s) and cached; on the CI
machine kind a compiler is present, so a build failure fails these tests instead of skipping.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlxcel.backends.torch.row_gemv import ALL, install_row_gemv, load_row_kernel, remove_row_gemv
from tests.conftest import DEFAULT_MODEL, fixture_path
from tests.models.callers import assert_each_caller_gets_its_own


@pytest.fixture(scope="module")
def kernel():
    return load_row_kernel(os.environ)


DTYPES = [torch.bfloat16, torch.float32]


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == w.dtype and got.shape == want.shape
    scale = float(want.abs().max())
    err = float((got.float() - want).abs().max())
    bound = 2 * 2.0 ** -7 if w.dtype == torch.bfloat16 else 2.0 ** -16
    assert err <= bound * scale, f"max abs error {err} for outputs up to {scale}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (192, 576), (1536, 576), (576, 1536),
                                                      (4099, 576), (7, 37), (3, 100), (50, 33)])
def test_kernel_matches_fp32_reference(kernel, out_features, in_features, dtype):
    g = torch.Generator().manual_seed(out_features * 7 + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(1, 1, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    with torch.inference_mode():
        _close(kernel.op(x, w, None), x, w, None)
        _close(kernel.op(x, w, b), x, w, b)
        strided = torch.randn(in_features, 3, generator=g).to(dtype)[:, 1]  # a non-contiguous row
        _close(kernel.op(strided, w, None), strided, w, None)


def test_kernel_refuses_what_it_does_not_take(kernel):
    w = torch.randn(8, 16).to(torch.bfloat16)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="last dimension"):
            kernel.op(torch.randn(2, 15).to(torch.bfloat16), w, None)
        with pytest.raises(RuntimeError, match="share a dtype"):
            kernel.op(torch.randn(1, 16), w, None)
        with pytest.raises(RuntimeError, match="bf16 or fp32"):
            kernel.op(torch.randn(1, 16).half(), w.half(), None)
        with pytest.raises(RuntimeError, match="contiguous"):
            kernel.op(torch.randn(1, 16).to(torch.bfloat16), torch.randn(16, 8).to(torch.bfloat16).t(), None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_alone_and_among_others(kernel, dtype):
    """Up to eight rows share a pass over the weights, more take several; each row's result
    must not depend on the call's other rows (engine batch invariance)."""
    g = torch.Generator().manual_seed(3)
    for out_features, in_features in [(576, 576), (4099, 576), (7, 37)]:
        w = torch.randn(out_features, in_features, generator=g).to(dtype)
        b = torch.randn(out_features, generator=g).to(dtype)
        x = torch.randn(19, in_features, generator=g).to(dtype)
        with torch.inference_mode():
            alone = torch.cat([kernel.op(x[i:i + 1], w, b) for i in range(len(x))])
            for m in range(1, len(x) + 1):
                assert torch.equal(kernel.op(x[:m], w, b), alone[:m]), f"{m} rows"
            assert torch.equal(kernel.op(x[:12].reshape(3, 4, in_features), w, b).reshape(12, -1), alone[:12])
        _close(alone, x, w, b)


@pytest.mark.parametrize("tiles", [True, False])
def test_routing_sends_decode_rows_to_the_row_kernel_and_prompt_rows_to_theirs(kernel, tiles):
    """Decode rows take the row kernel; prompt rows the AMX tile kernel where the CPU has one
    (`tiles`), else torch's linear."""
    from dataclasses import replace

    if tiles and kernel.prompt is None:
        pytest.skip("this CPU has no AMX bf16 tiles")
    kernel = kernel if tiles else replace(kernel, prompt=None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=True), torch.nn.Linear(96, 32, bias=False))
    model = model.to(torch.bfloat16)
    x = torch.randn(1, 5, 64).to(torch.bfloat16)  # a packed step: rows 1 and 3 are decode rows

    def by_hand(rows: torch.Tensor, op) -> torch.Tensor:
        return op(op(rows, model[0].weight, model[0].bias), model[1].weight, None)

    with torch.inference_mode():
        prompt_path = by_hand(x, kernel.prompt or (lambda t, w, b: F.linear(t, w, b)))
        decode_path = by_hand(x[:, [1, 3]], kernel.op)
        routing = install_row_gemv(kernel, model)
        calls = []
        model[0].register_forward_hook(lambda m, args, out: calls.append(out.shape))
        assert torch.equal(model(x), prompt_path)  # no decode rows
        with routing.decode_rows(torch.tensor([1, 3])):
            mixed = model(x)
        with routing.decode_rows(ALL):
            decode = model(x[:, [1, 3]])
        remove_row_gemv(model)
    assert calls == [torch.Size([1, 5, 96])] * 2 + [torch.Size([1, 2, 96])]
    assert torch.equal(mixed[:, [0, 2, 4]], prompt_path[:, [0, 2, 4]])
    assert torch.equal(mixed[:, [1, 3]], decode) and torch.equal(decode, decode_path)
    assert routing.rows is None  # reset after each forward
    torch.testing.assert_close(decode.float(), prompt_path[:, [1, 3]].float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 0.05), ("float32", 1e-4)])
def test_served_model_with_kernel_matches_torch_linears(dtype, tolerance):
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.backends.torch.backend import TorchBackend
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(DEFAULT_MODEL)
    with_kernel = TorchBackend(path, dtype=dtype, build_env=os.environ)
    assert with_kernel.row_kernel.startswith("mlxcel row kernel")
    plain = TorchBackend(path, dtype=dtype)
    assert plain.row_kernel == "torch.mv"
    remove_row_gemv(plain.base, plain.lm_head)  # torch's own F.linear: the reference path
    ids = Tokenizer(path).encode("The capital of France is")
    texts, worst = [], 0.0
    for backend in (with_kernel, plain):
        seq = backend.new_sequence()
        logits = backend.forward([ForwardRow(ids, seq)])[0]
        out, steps = [int(logits.argmax())], [logits]
        for _ in range(12):
            steps.append(backend.forward([ForwardRow([out[-1]], seq, decode=True)])[0])
            out.append(int(steps[-1].argmax()))
        texts.append((out, steps))
    (a, la), (b, lb) = texts
    assert a == b, "greedy text differs between the kernel and torch's linears"
    for x, y in zip(la[1:], lb[1:]):  # decode steps: the kernel's path
        worst = max(worst, float(np.abs(x - y).max() / np.abs(y).max()))
    assert worst <= tolerance, f"decode logits differ by {worst:.2g} of their range"
    # the prompt's step too (fp32: a few rows, so the kernel's path as well)
    assert float(np.abs(la[0] - lb[0]).max() / np.abs(lb[0]).max()) <= tolerance


def test_fp32_calls_of_few_rows_take_the_row_kernel(kernel):
    """In fp32 a call of up to FEW_ROWS rows takes the row kernel whatever its rows are (torch's
    fp32 GEMM is slower there); a larger call keeps torch's linear for its prompt rows, and its
    decode rows still get the kernel's bits."""
    from mlxcel.backends.torch.row_gemv import FEW_ROWS

    torch.manual_seed(1)
    model = torch.nn.Linear(64, 96, bias=True)
    few, many = torch.randn(1, FEW_ROWS, 64), torch.randn(1, FEW_ROWS + 1, 64)
    with torch.inference_mode():
        routing = install_row_gemv(kernel, model)
        assert torch.equal(model(few), kernel.op(few, model.weight, model.bias))
        assert torch.equal(model(few[:, :1]), kernel.op(few[:, :1], model.weight, model.bias))
        with routing.decode_rows(torch.tensor([0, 5])):
            assert torch.equal(model(few), kernel.op(few, model.weight, model.bias))
            mixed = model(many)
        plain = model(many)
        remove_row_gemv(model)
        want = F.linear(many, model.weight, model.bias)
    assert torch.equal(plain, want)
    assert torch.equal(mixed[:, 1:5], want[:, 1:5]) and torch.equal(mixed[:, 6:], want[:, 6:])
    assert torch.equal(mixed[:, [0, 5]], kernel.op(many[:, [0, 5]], model.weight, model.bias))


def test_without_a_compiler_the_reason_is_given(tmp_path):
    from mlxcel.native_build import BuildUnavailable

    env = {"PATH": str(tmp_path), "MLXCEL_KERNEL_CACHE": str(tmp_path / "cache")}
    with pytest.raises(BuildUnavailable, match="no C\\+\\+ compiler"):
        load_row_kernel(env)


def test_two_callers_at_once_each_get_their_own_answer(kernel):
    """Two engine threads (router mode, a side model) may call the kernel together: one holds
    the helper threads, the other runs alone; neither may see the other's rows."""
    g = torch.Generator().manual_seed(5)
    work = [(torch.randn(1, 576, generator=g), torch.randn(8192, 576, generator=g)) for _ in range(2)]
    work = [(x.to(torch.bfloat16), w.to(torch.bfloat16)) for x, w in work]
    assert_each_caller_gets_its_own([lambda x=x, w=w: kernel.op(x, w, None) for x, w in work], rounds=200)


def test_read_ahead_never_reads_freed_weights(kernel):
    """Between products a helper reads the weights that followed last time into the cache. A
    model unloaded meanwhile frees its weights (large buffers go back to the OS, so a read would
    fault): the look-ahead holds only weak references and each read holds its storage. Run in a
    child process, so a fault shows as a failed exit instead of taking the test run down, with
    glibc told to map every buffer over 64 KiB on its own (freed: unmapped at once)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import gc, os, torch
        from mlxcel.backends.torch.row_gemv import load_row_kernel
        k = load_row_kernel(os.environ, threads=2)
        x = torch.randn(1, 1024).to(torch.bfloat16)
        with torch.inference_mode():
            for round in range(30):
                ws = [torch.ones(2048, 1024, dtype=torch.bfloat16) for _ in range(6)]  # 4 MiB each
                for _ in range(3):  # the order is learnt, then read ahead
                    for w in ws:
                        k.op(x, w, None)
                keep = ws[0]
                del ws, w
                gc.collect()
                for _ in range(50):  # names the freed successors of `keep` again
                    k.op(x, keep, None)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
