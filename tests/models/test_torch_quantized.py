"""MLX-quantized checkpoints on the torch backend, weights packed (backends/torch/quantized.py,
quantized_load.py, kernels/cpu/quant_rows.cpp).

Reference: mx.dequantize on the same packed tensors with fp32 scales and biases (exact values
of s * q + z), then a plain product in fp64.
1. The kernel (every bit width and group size, 1 to 40 rows, with and without a bias, fp32 and
   bf16 activations, fp32, bf16 and fp16 scales): within 1e-5 of the largest output (fp32 sums in another order); a row's
   bits do not depend on the other rows of the call. The same for copies built for AVX2 without
   AVX-512 and for no vector extension (the portable form).
2. The chunked path (CUDA's, and the CPU's without a compiler) and the torch unpacking it uses.
3. Served checkpoints (SmolLM2 4-bit in groups of 64, qwen2-tiny 4-bit in groups of 32 and
   with per-layer bits over an 8-bit, group-64 block): logits of the packed model against the same model with every
   packed module replaced by a dense fp32 one holding mx.dequantize's weights, over a prompt
   and 6 greedy decode steps: max |difference| <= 1e-5 of the logits' range (measured: under
   1e-6; fp32 sums in another order) and the same greedy tokens; then a row in a batch of 4
   equals its solo run, a prefix-cache hit the cold run, and a forward hook on a packed linear
   (how LoRA terms attach) still changes the output.
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
import torch

from mlxcel.backends.torch import quantized
from mlxcel.backends.torch.quantized import QuantizedEmbedding, QuantizedLinear, dequantize
from mlxcel.backends.torch.row_gemv import load_row_kernel
from mlxcel.cli.flags import BUILD_ENV
from mlxcel.config.settings import BackendSection, EngineSection, ServerSettings, SourceSection
from tests import fixtures
from tests.conftest import fixture_path
from tests.models.test_engine import run

import mlx.core as mx  # noqa: E402  (the reference: MLX is a dependency wherever the suite runs)

# 8 bits in groups of 64 is the per-layer fixture's block form
MODELS = [fixtures.SMOLLM2_4BIT, fixtures.QWEN2_TINY_4BIT_G32, fixtures.QWEN2_TINY_MIXED]
PROMPT = "The quick brown fox jumps over the lazy dog because it wants to reach the river before sunset"
KERNEL_BOUND = 1e-5  # of the largest output
MODEL_BOUND = 1e-5  # of the logits' range (measured: under 1e-6)
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def kernel():
    return load_row_kernel(os.environ)


def _packed(n: int, k: int, bits: int, group: int, seed: int):
    """mx.quantize's packed tensors for a random [n, k] matrix, and mx.dequantize's fp32 weights."""
    rng = np.random.default_rng(seed)
    q, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)), group_size=group, bits=bits)
    ref = np.array(mx.dequantize(q, s, b, group_size=group, bits=bits)).astype(np.float64)
    words = torch.from_numpy(np.array(q).view(np.int32))
    return words, torch.from_numpy(np.array(s)), torch.from_numpy(np.array(b)), ref


def _close(got: torch.Tensor, want: np.ndarray, bound: float = KERNEL_BOUND) -> None:
    scale = float(np.abs(want).max())
    err = float(np.abs(got.double().numpy() - want).max())
    assert err <= bound * scale, f"max abs error {err} for outputs up to {scale}"


def _check_op(op, bits: int, group: int, rows: int) -> None:
    words, s, b, ref = _packed(67, 256, bits, group, seed=bits * 1000 + group + rows)
    _check_op_on(op, bits, group, rows, words, s, b, ref)
    # bf16 scales and biases, as checkpoints store them, and fp16 ones, as a GGUF converted
    # losslessly has them: the reference from the same rounded values
    for dtype in (torch.bfloat16, torch.float16):
        s16, b16 = s.to(dtype), b.to(dtype)
        ref16 = np.array(mx.dequantize(mx.array(words.numpy().view(np.uint32)), mx.array(s16.float().numpy()),
                                       mx.array(b16.float().numpy()), group_size=group, bits=bits)).astype(np.float64)
        _check_op_on(op, bits, group, rows, words, s16, b16, ref16)


def _check_op_on(op, bits, group, rows, words, s, b, ref) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g)
    bias = torch.randn(67, generator=g)
    with torch.inference_mode():
        _close(op(x, words, s, b, None, bits, group), x.double().numpy() @ ref.T)
        _close(op(x, words, s, b, bias, bits, group), x.double().numpy() @ ref.T + bias.double().numpy())
        xb = x.to(torch.bfloat16)
        got = op(xb, words, s, b, None, bits, group)
        assert got.dtype == torch.bfloat16
        _close(got.float(), xb.double().numpy() @ ref.T, 2 * 2.0 ** -8)  # one bf16 rounding of the output
        # a row's bits alone equal its bits among the others
        alone = op(x[rows // 2:rows // 2 + 1], words, s, b, bias, bits, group)
        assert torch.equal(alone[0], op(x, words, s, b, bias, bits, group)[rows // 2])


@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("group", quantized.GROUP_SIZES)
@pytest.mark.parametrize("bits", quantized.BITS)
def test_kernel_matches_dequantized_reference(kernel, bits, group, rows):
    _check_op(torch.ops.mlxcel_cpu.quant_rows_linear, bits, group, rows)


ISA_BUILDS = {  # quant_rows.cpp alone, as its own torch library, for a narrower CPU than this one
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"],
    "portable": ["-mno-avx", "-mno-avx2", "-mno-fma", "-mno-avx512f"],
}
# each build costs a minute or more of compiling: the suite builds the AVX2 form where the native
# build is AVX-512 (the other x86 kind the project runs on); the portable form (no x86 vector
# extension: the native build on other CPUs) is checked by `MLXCEL_TEST_ALL_ISAS=1 pytest ...`
TESTED_ISAS = sorted(ISA_BUILDS) if os.environ.get("MLXCEL_TEST_ALL_ISAS") else ["avx2"]


@pytest.fixture(scope="module", params=TESTED_ISAS)
def isa_ops(request, kernel):
    """The quantized ops built for `request.param`'s instruction set (cached like the kernels)."""
    from torch.utils import cpp_extension

    from mlxcel import native_build
    from mlxcel.backends.torch.cpu_kernels import HEADERS, KERNEL_DIR, cpu_flags

    isa = request.param
    if isa == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if isa == "avx2" and "avx512f" not in cpu_flags() and not os.environ.get("MLXCEL_TEST_ALL_ISAS"):
        pytest.skip("the native build is this CPU's AVX2 form, tested by test_kernel_matches_dequantized_reference")
    compiler = native_build.find_compiler(os.environ, "CXX", ("c++", "g++", "clang++"), "C++")
    lib_dir = cpp_extension.library_paths()[0]
    library = f"mlxcel_quant_{isa}"
    flags = ["-O2", *ISA_BUILDS[isa], "-std=c++20", "-shared", "-fPIC", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-DMLXCEL_QUANT_LIBRARY={library}"]
    sources = [KERNEL_DIR / "quant_rows.cpp", *(KERNEL_DIR / h for h in HEADERS)]

    def command(out: str) -> list[str]:
        return [compiler, *flags, *(f"-I{p}" for p in cpp_extension.include_paths()), str(sources[0]), "-o", out,
                f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]

    key = [*(f.read_bytes() for f in sources), torch.__version__.encode(), compiler.encode(), " ".join(flags).encode()]
    path = native_build.build_cached(native_build.cache_root(os.environ) / "kernels", f"test-quant-{isa}", key, command,
                                     f"quant_rows.cpp ({isa})", timeout=None)
    torch.ops.load_library(str(path))
    ops = getattr(torch.ops, library)
    assert ops.quant_rows_isa() == isa
    return ops


@pytest.mark.parametrize("bits,group,rows", [(4, 32, 1), (4, 64, 9), (8, 128, 3), (8, 32, 40), (3, 64, 2),
                                             (6, 32, 5)])
def test_narrower_isa_builds_match_dequantized_reference(isa_ops, bits, group, rows):
    _check_op(isa_ops.quant_rows_linear, bits, group, rows)


@pytest.mark.parametrize("bits", quantized.BITS)
def test_torch_unpacking_and_chunked_product_match_the_reference(bits, monkeypatch):
    words, s, b, ref = _packed(300, 128, bits, 32, seed=bits)
    np.testing.assert_allclose(dequantize(words, s, b, bits, 32, torch.float32).numpy(), ref, rtol=0, atol=1e-6)
    monkeypatch.setattr(quantized, "CHUNK_VALUES", 64 * 128)  # five scratch matrices, the last partial
    linear = QuantizedLinear(words, s, b, bits, 32, bias=torch.ones(300))
    x = torch.randn(2, 5, 128)
    with torch.inference_mode():
        got = linear(x)  # no kernel installed: the chunked path
    assert got.shape == (2, 5, 300)
    _close(got, x.double().numpy() @ ref.T + 1.0)
    embed = QuantizedEmbedding(words, s, b, bits, 32, torch.float32)
    ids = torch.tensor([[3, 299, 3], [0, 7, 150]])
    np.testing.assert_allclose(embed(ids).numpy(), ref[ids.numpy()], rtol=0, atol=1e-6)


def test_mismatched_packing_is_refused():
    words, s, b, _ = _packed(8, 64, 4, 32, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedLinear(words, s, b, 8, 32)
    with pytest.raises(ValueError, match="not supported"):
        QuantizedLinear(words, s, b, 4, 16)


# --- served checkpoints ---------------------------------------------------------------------

def _backend(repo_id: str):
    from mlxcel.backends.torch.backend import TorchBackend

    return TorchBackend(fixture_path(repo_id), dtype="float32", build_env=os.environ)


def _dense(module) -> torch.nn.Module:
    """mx.dequantize's fp32 weights of a packed module, as the dense module it replaced."""
    q = mx.array(module.weight.view(torch.uint32).numpy())
    w = mx.dequantize(q, mx.array(module.scales.float().numpy()), mx.array(module.biases.float().numpy()),
                      group_size=module.group, bits=module.bits)
    weight = torch.nn.Parameter(torch.from_numpy(np.array(w)), requires_grad=False)
    if isinstance(module, QuantizedEmbedding):
        dense = torch.nn.Embedding(*weight.shape)
        dense.weight = weight
        if module.embed_scale is not None:
            raise AssertionError("no scaled embedding among these fixtures")
        return dense
    dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None)
    dense.weight = weight
    if module.bias is not None:
        dense.bias = module.bias
    return dense


def _densified(backend):
    """The backend with every packed module replaced by its dense fp32 twin, the kernels reinstalled."""
    model = backend.model
    for name, module in list(model.named_modules()):
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, _dense(module))
    backend.lm_head = model.get_output_embeddings()
    backend.set_row_linears(load_row_kernel(os.environ))
    backend.set_fused_ops(True)
    return backend


def _greedy_logits(backend, ids: list[int], tokens: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """Prompt logits, then DECODE_STEPS decode rows' (fed `tokens`, else its own greedy picks)."""
    from mlxcel.engine.backend import ForwardRow

    seq = backend.new_sequence()
    out = [backend.forward_all(ids, seq)]
    picked = []
    for step in range(DECODE_STEPS):
        token = int(out[-1][-1].argmax()) if tokens is None else tokens[step]
        picked.append(token)
        out.append(backend.forward([ForwardRow([token], seq, decode=True)]))
    return np.concatenate(out), picked


@pytest.mark.parametrize("repo_id", MODELS)
def test_logits_match_the_dequantized_model(repo_id):
    from mlxcel.engine.tokenizer import Tokenizer

    packed = _backend(repo_id)
    assert packed.info.quantization and "quantized kernel" in packed.row_kernel
    assert not any(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.int32 for m in packed.model.modules())
    ids = Tokenizer(fixture_path(repo_id)).encode(PROMPT)
    got, tokens = _greedy_logits(packed, ids)
    want, _ = _greedy_logits(_densified(_backend(repo_id)), ids, tokens)
    span = float(want.max() - want.min())
    worst = float(np.abs(got - want).max())
    assert worst <= MODEL_BOUND * span, f"max abs diff {worst} for logits spanning {span}"
    assert [int(r.argmax()) for r in got[len(ids) - 1:]] == [int(r.argmax()) for r in want[len(ids) - 1:]]


def test_mixed_bits_fixture_has_every_width_and_a_dense_linear():
    packed = _backend(fixtures.QWEN2_TINY_MIXED)
    forms = {(m.bits, m.group) for m in packed.model.modules() if isinstance(m, (QuantizedLinear,
                                                                                   QuantizedEmbedding))}
    assert forms == {(8, 64), (6, 64), (3, 32), (5, 32), (2, 128)}
    assert type(packed.model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    head, embed = packed.model.get_output_embeddings(), packed.model.get_input_embeddings()
    assert isinstance(head, QuantizedLinear) and head.weight.data_ptr() == embed.weight.data_ptr()


def test_a_forward_hook_on_a_packed_linear_changes_the_output():
    """LoRA terms and other per-linear hooks (lora.py) ride on forward hooks."""
    from mlxcel.engine.tokenizer import Tokenizer

    backend = _backend(fixtures.QWEN2_TINY_4BIT_G32)
    ids = Tokenizer(fixture_path(fixtures.QWEN2_TINY_4BIT_G32)).encode(PROMPT)
    base = backend.forward_all(ids, backend.new_sequence())
    v_proj = backend.model.model.layers[1].self_attn.v_proj
    remove = v_proj.register_forward_hook(lambda module, args, out: out + 0.5)
    try:
        hooked = backend.forward_all(ids, backend.new_sequence())
    finally:
        remove.remove()
    assert np.abs(hooked - base).max() > 1e-4
    np.testing.assert_array_equal(backend.forward_all(ids, backend.new_sequence()), base)


def test_lora_terms_on_packed_linears_match_the_dequantized_model():
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.models.lora import checkpoint_shapes, load_adapter

    if not fixtures.lora_available(fixtures.LORA_SMOLLM2):
        pytest.fail("the LoRA fixture is missing: run `make fixtures`")
    adapter = load_adapter(fixtures.models_dir() / fixtures.LORA_SMOLLM2)
    ids = Tokenizer(fixture_path(fixtures.SMOLLM2_4BIT)).encode(PROMPT)
    packed, dense = _backend(fixtures.SMOLLM2_4BIT), _densified(_backend(fixtures.SMOLLM2_4BIT))
    plain = packed.forward_all(ids, packed.new_sequence())[-1]  # before any adapter is attached
    rows = {}
    for name, backend in (("packed", packed), ("dense", dense)):
        backend.attach_lora([adapter])
        rows[name] = [backend.forward([ForwardRow(ids, backend.new_sequence(), lora=(scale,))])[0]
                      for scale in (0.0, 1.0)]
    (off, on), (_, dense_on) = rows["packed"], rows["dense"]
    assert np.abs(on - off).max() > 1e-3  # the adapter acts on the packed q and v projections
    span = float(dense_on.max() - dense_on.min())
    assert np.abs(on - dense_on).max() <= MODEL_BOUND * span
    np.testing.assert_array_equal(off, plain)  # at scale 0 the base model's bits
    # the server validates adapters against the checkpoint's headers, packed widths unpacked
    shapes = checkpoint_shapes(fixture_path(fixtures.QWEN2_TINY_MIXED),
                               json.loads((fixture_path(fixtures.QWEN2_TINY_MIXED) / "config.json").read_text()))
    assert shapes["model.layers.1.mlp.down_proj"] == (64, 128) and shapes["model.layers.0.mlp.up_proj"] == (128, 64)


@pytest.fixture(scope="module", params=[fixtures.QWEN2_TINY_MIXED, fixtures.SMOLLM2_4BIT])
def served(request):
    from mlxcel.runtime.load import load_served_model

    fixture_path(request.param)  # a missing fixture fails loudly
    settings = ServerSettings(source=SourceSection(model=request.param),
                              engine=EngineSection(ctx_size=2048, parallel=4, warmup=False),
                              backend=BackendSection(name="torch", device="cpu",
                                                     build_env={k: os.environ[k] for k in BUILD_ENV if k in os.environ}))
    model = load_served_model(settings, fixture_path(request.param))
    assert model.info.backend == "torch" and model.info.quantization
    yield model
    model.engine.shutdown()


async def _run(model, prompt: list[int], max_tokens: int, cache_prompt: bool = True) -> tuple[list[int], int]:
    tokens, last = await run(model, prompt, max_tokens, ignore_eos=True, cache_prompt=cache_prompt)
    return tokens, last.timings.cache_n


def test_row_in_a_batch_of_four_equals_its_solo_run(served):
    enc = served.tokenizer.encode
    target = enc(PROMPT)
    others = [enc("Hi"), enc("List the planets of the solar system:"), enc(PROMPT + " and " + PROMPT)]

    async def scenario():
        solo = await _run(served, target, 10)
        together = await asyncio.gather(_run(served, target, 10, cache_prompt=False),
                                        *(_run(served, o, 6 + 3 * i) for i, o in enumerate(others)))
        return solo[0], together[0][0]

    solo, batched = asyncio.run(scenario())
    assert batched == solo


def test_prefix_cache_hit_equals_cold_run(served):
    prompt = served.tokenizer.encode("Once more, from the top: " + PROMPT)

    async def scenario():
        return await _run(served, prompt, 8), await _run(served, prompt, 8)

    (cold, cold_cached), (warm, warm_cached) = asyncio.run(scenario())
    assert cold_cached == 0 and warm_cached == len(prompt) - 1
    assert warm == cold
