"""The quantized KV modes (--cache-type-k / --cache-type-v int8, turbo4, turbo3) on both backends.

1. Records: bytes per token from the one function that sizes a mode, the int8 quantizer's error
   bound, the turbo codebook (Lloyd-Max for a Gaussian), rotation and packing against the numpy
   reference (engine/kv_turbo.py) on both backends, and the torch kernel
   (kernels/cpu/kv_quant.cpp) against a float64 attention over the dequantized rows.
2. Logits: zoo fixtures (tiny random-weight families) through the paged pool with quantized keys
   and/or values, prefill in chunks and decode steps, within each mode's tolerance of the f16
   pool's logits, the pool holding what kv_spec says per token; latent and recurrent layers, and
   turbo over head sizes that are not powers of two, are refused.
3. Quality on the real SmolLM2-135M: teacher-forced over fixed prose, the mean KL divergence of
   next-token distributions against f16 KV, below each mode's limit, and the greedy token the
   same wherever f16's top two logits are at least DECIDED apart.
4. The engine's batch invariance and prefix-cache identity (tests/models/test_engine.py's tests,
   run here over quantized pools), and /v1/chat/completions over the real server on each backend.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from mlxcel.engine import kv_turbo
from mlxcel.engine.backend import INT8_SCALE_BYTES, ForwardRow, KVCacheTypeRefused, KVCacheTypes, kv_side_bytes
from mlxcel.models.registry import FAMILIES as REGISTRY
from tests import fixtures
from tests.conftest import DEFAULT_MODEL, ServerProcess, fixture_path
from tests.models.test_engine import (  # noqa: F401 - collected here, over this module's `model`
    test_batch_invariance, test_prefix_cache_hit_is_identical_and_opt_out_prefills_cold)

# max |logit difference| against the f16 pool on the zoo fixtures, by the coarser side's mode
# (measured: int8 <= 0.006; turbo4 <= 0.41 (gpt_oss), turbo3 <= 0.14, both nearly all from values)
TOLERANCE = {"int8": 0.02, "turbo4": 0.6, "turbo3": 0.6, "f16": 0.0}
# mean KL limits on SmolLM2: int8 the target (1e-3); turbo4 values beside int8 keys the turbo4
# target (1e-2); turbo4 keys miss that target on this model (measured 0.044 over 512 positions,
# docs/benchmarks.md), so their limit is a regression bound at that level, not the target
KL_LIMIT = {("int8", "int8"): 1e-3, ("int8", "turbo4"): 1e-2, ("turbo4", "turbo4"): 0.07}
# the share of decided positions whose greedy token must be f16's (turbo4 keys: 99.6% measured)
DECIDED_AGREEMENT = {("turbo4", "turbo4"): 0.98}
DECIDED = 1.0  # a position's greedy token is decided where f16's top two logits differ by this much
TEXT = (Path(__file__).parent / "data" / "kv_quality_text.txt").read_text()
INT8 = KVCacheTypes("int8", "int8")
TURBO4, TURBO3 = KVCacheTypes("turbo4", "turbo4"), KVCacheTypes("turbo3", "turbo3")
MODES = [INT8, KVCacheTypes("int8", "f16"), KVCacheTypes("f16", "int8"), TURBO4, TURBO3,
         KVCacheTypes("turbo4", "int8"), KVCacheTypes("f16", "turbo3")]
BACKENDS = ("mlx", "torch")


def _backend(backend: str, path, types: KVCacheTypes | None, dtype: str = "float32"):
    if backend == "mlx":
        from mlxcel.backends.mlx.backend import MLXBackend

        return MLXBackend(path, dtype=dtype, kv_cache=types)
    from mlxcel.backends.torch.backend import TorchBackend

    return TorchBackend(path, dtype=dtype, kv_cache=types, build_env=os.environ)  # with the kernels, as served


# -- records ------------------------------------------------------------------------------------

def test_bytes_per_token_come_from_the_one_sizing_function():
    from mlxcel.engine.backend import KVSpec, ModelInfo

    info = ModelInfo(path=Path("."), model_type="llama", num_layers=30, vocab_size=10, context_length=8,
                     dtype="bfloat16", checkpoint_dtype="bfloat16", quantization=None, backend="mlx", device="cpu",
                     config={"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64})
    assert kv_side_bytes("f16", 3, 64, 2) == 3 * 64 * 2
    assert kv_side_bytes("int8", 3, 64, 2) == 3 * (64 + INT8_SCALE_BYTES)
    f16, int8 = KVSpec.uniform(info, 2), KVSpec.uniform(info, 2, INT8)
    assert f16.bytes_per_token == 30 * 2 * 3 * 64 * 2
    assert int8.bytes_per_token == 30 * 2 * 3 * (64 + INT8_SCALE_BYTES)
    assert KVSpec.uniform(info, 2, KVCacheTypes("int8", "f16")).bytes_per_token == 30 * 3 * (64 + 4 + 128)
    assert all(layer.quant == INT8 for layer in int8.layers) and not any(layer.quant for layer in f16.layers)
    # turbo: dim * bits / 8 code bytes and a 4-byte scale per head; 4 bits at 64 is 3.56x below 2-byte f16
    assert kv_side_bytes("turbo4", 3, 64, 2) == 3 * (32 + 4) and kv_side_bytes("turbo3", 3, 64, 2) == 3 * (24 + 4)
    assert KVSpec.uniform(info, 2, TURBO4).bytes_per_token == 30 * 2 * 3 * 36
    assert f16.bytes_per_token / KVSpec.uniform(info, 2, TURBO4).bytes_per_token >= 3.5
    assert KVSpec.uniform(info, 2, KVCacheTypes("turbo3", "int8")).bytes_per_token == 30 * 3 * (28 + 68)
    with pytest.raises(KVCacheTypeRefused, match="the modes are f16, int8, turbo4, turbo3"):
        KVCacheTypes("q8_0", "f16")
    for name in ("fp16+turbo4", "fp16+turbo3", "turbo4-delegated"):
        with pytest.raises(KVCacheTypeRefused, match=re.escape(name) + ": .*; the modes are f16, int8, turbo4, turbo3"):
            KVCacheTypes("f16", name)
    odd = ModelInfo(**{**info.__dict__, "config": {**info.config, "head_dim": 96}})
    with pytest.raises(KVCacheTypeRefused, match="--cache-type-v turbo3: this model's head_dim 96 is not a power"):
        KVSpec.uniform(odd, 2, KVCacheTypes("int8", "turbo3"))
    assert KVSpec.uniform(odd, 2, INT8).bytes_per_token == 30 * 2 * 3 * (96 + 4)  # int8 takes any head size


def test_turbo_codebook_rotation_and_packing():
    """LEVELS are Lloyd-Max for N(0, 1) (each level the conditional mean of its cell), R is
    orthonormal, pack and unpack are inverse, and the reference quantizer's error is about the
    codebook's (mean squared error per coordinate 0.0095 at 4 bits, 0.0345 at 3)."""
    from math import erf, exp, pi, sqrt

    for bits, mse in ((4, 0.0095), (3, 0.0345)):
        lv, edges = kv_turbo.LEVELS[bits].astype(np.float64), kv_turbo.boundaries(bits).astype(np.float64)
        cells = np.concatenate([[-np.inf], edges, [np.inf]])
        pdf = np.array([exp(-c * c / 2) / sqrt(2 * pi) if np.isfinite(c) else 0.0 for c in cells])
        cdf = np.array([0.5 * (1 + erf(c / sqrt(2))) if np.isfinite(c) else float(c > 0) for c in cells])
        np.testing.assert_allclose((pdf[:-1] - pdf[1:]) / (cdf[1:] - cdf[:-1]), lv, atol=1e-6)
        codes = np.random.default_rng(bits).integers(0, 2 ** bits, (4, 2, 64)).astype(np.uint8)
        assert np.array_equal(kv_turbo.unpack(kv_turbo.pack(codes, bits), bits), codes)
        x = np.random.default_rng(1).standard_normal((400, 64))
        data, scale = kv_turbo.quantize(x, bits)
        err = ((kv_turbo.dequantize(data, scale, bits) - x) ** 2).sum(-1) / (x * x).sum(-1)
        assert data.shape == (400, 64 * bits // 8) and abs(err.mean() - mse) < mse * 0.15, err.mean()
    r = kv_turbo.rotation(64).astype(np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(64), atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [4, 3])
def test_turbo_codecs_match_the_reference(backend, bits):
    """Each backend's quantizer gives the reference's codes (float32 against float64: a
    coordinate within rounding of a boundary may land in the next cell) and scales, and reads
    its records back as the reference does; an all-zero vector stays zero."""
    x = np.random.default_rng(2).standard_normal((60, 2, 64)).astype(np.float32) * 3
    x[1, 1] = 0
    want_data, want_scale = kv_turbo.quantize(x, bits)
    if backend == "mlx":
        import mlx.core as mx

        from mlxcel.backends.mlx.kv_codecs import TurboCodec

        codec = TurboCodec(bits, 64)
        data, scale = codec.quantize(mx.array(x))
        back = np.array(codec.dequantize(data, scale, mx.float32))
        data, scale = np.array(data), np.array(scale)
    else:
        import torch

        from mlxcel.backends.torch.kv_codecs import TurboCodec

        codec = TurboCodec(bits, 64, torch.device("cpu"))
        data, scale = codec.quantize(torch.from_numpy(x))
        back = codec.dequantize(data, scale, torch.float32).numpy()
        data, scale = data.numpy(), scale.numpy()
    assert data.dtype == np.uint8 and data.shape == want_data.shape
    assert (kv_turbo.unpack(data, bits) == kv_turbo.unpack(want_data, bits)).mean() >= 0.999
    np.testing.assert_allclose(scale, want_scale, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(back, kv_turbo.dequantize(data, scale, bits), rtol=0, atol=1e-4)
    assert scale[1, 1] == 0 and not back[1, 1].any()


def test_the_pool_holds_quantized_attention_layers_only():
    from mlxcel.engine.backend import KVSpec, LayerKV
    from mlxcel.engine.kv_manager import KVLayoutUnsupported, check_spec

    check_spec(KVSpec((LayerKV("full", 8, quant=INT8), LayerKV("sliding", 8, 4, quant=INT8))))
    with pytest.raises(KVLayoutUnsupported, match="not latent layers"):
        check_spec(KVSpec((LayerKV("full", 8, quant=INT8), LayerKV("latent", 8, quant=INT8))))


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantizer_error_is_within_half_a_step(backend):
    x = np.random.default_rng(0).standard_normal((5, 3, 64)).astype(np.float32) * 3
    x[1, 2] = 0  # an all-zero vector keeps scale 0 and reads back as zeros
    if backend == "mlx":
        import mlx.core as mx

        from mlxcel.backends.mlx.kv_codecs import quantize_int8

        q, s = (np.array(a) for a in quantize_int8(mx.array(x)))
    else:
        import torch

        from mlxcel.backends.torch.kv_codecs import quantize_int8

        q, s = (a.numpy() for a in quantize_int8(torch.from_numpy(x)))
    assert q.dtype == np.int8 and s.shape == (5, 3) and np.abs(q).max() == 127
    back = q.astype(np.float32) * s[..., None]
    assert np.all(np.abs(back - x) <= s[..., None] / 2 * (1 + 1e-5))
    assert s[1, 2] == 0 and not back[1, 2].any()


def _side(mode: str, x):
    """x [slots, kv_heads, d] stored in `mode`: the kernel's four operands of that side (records,
    scales, levels, signs) and the float64 values they read back as."""
    import torch

    from mlxcel.backends.torch.kv_codecs import TurboCodec, quantize_int8

    if mode == "int8":
        data, scales = quantize_int8(x)
        return (data, scales, None, None), data.double() * scales.double()[..., None]
    if mode in kv_turbo.TURBO_BITS:
        codec = TurboCodec(kv_turbo.TURBO_BITS[mode], x.shape[-1], torch.device("cpu"))
        data, scales = codec.quantize(x)
        back = kv_turbo.dequantize(data.numpy(), scales.numpy(), codec.bits)
        return (data, scales, codec.levels, codec.signs), torch.from_numpy(back)
    return (x, None, None, None), x.double()


def _check_kernel(op, dtype: str, types: KVCacheTypes, window: int, d: int) -> None:
    import torch

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    slots, kvh, heads, rows = 40, 2, 6, 3
    q = torch.randn(rows, heads, d, generator=g).to(dt)
    (k_ops, k), (v_ops, v) = (_side(mode, torch.randn(slots, kvh, d, generator=g).to(dt))
                              for mode in (types.k, types.v))
    table = torch.stack([torch.randperm(slots, generator=g) for _ in range(rows)])
    lengths = torch.tensor([1, 17, 40])
    got = op(q, *k_ops, *v_ops, table, lengths, window, d ** -0.5)
    for i in range(rows):
        first = max(0, int(lengths[i]) - window) if window else 0
        at = table[i, first:int(lengths[i])]
        p = torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), k[at].repeat_interleave(heads // kvh, 1))
                          * d ** -0.5, -1)
        want = torch.einsum("ht,thd->hd", p, v[at].repeat_interleave(heads // kvh, 1))
        step = 2.0 ** -7 if dt is torch.bfloat16 else 1e-5
        err = float((got[i].double() - want).abs().max())
        assert got.dtype == dt and err <= step * float(want.abs().max()) + 1e-6, (i, err)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("types", MODES, ids=lambda t: f"k{t.k}-v{t.v}")
@pytest.mark.parametrize("window,d", [(0, 64), (5, 64), (0, 256), (3, 32)])
def test_kernel_matches_attention_over_the_dequantized_rows(dtype, types, window, d):
    """Head sizes 64 and 256 take the register-blocked AVX-512 form, 32 the portable one."""
    import torch

    from mlxcel.backends.torch import cpu_kernels

    cpu_kernels.load(os.environ)
    _check_kernel(torch.ops.mlxcel_cpu.attention_kv_quant, dtype, types, window, d)


@pytest.fixture(scope="module")
def avx2_op():
    """kv_quant.cpp alone built for AVX2 (its code lookups there), as test_torch_quantized builds quant_rows.cpp."""
    import torch
    from torch.utils import cpp_extension

    from mlxcel import native_build
    from mlxcel.backends.torch.cpu_kernels import HEADERS, KERNEL_DIR, cpu_flags
    from tests.models.test_torch_quantized import ISA_BUILDS

    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2")
    compiler = native_build.find_compiler(os.environ, "CXX", ("c++", "g++", "clang++"), "C++")
    lib_dir = cpp_extension.library_paths()[0]
    flags = ["-O2", *ISA_BUILDS["avx2"], "-std=c++20", "-shared", "-fPIC", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-DMLXCEL_KVQ_LIBRARY=mlxcel_kvq_avx2"]
    sources = [KERNEL_DIR / "kv_quant.cpp", *(KERNEL_DIR / h for h in HEADERS)]

    def command(out: str) -> list[str]:
        return [compiler, *flags, *(f"-I{p}" for p in cpp_extension.include_paths()), str(sources[0]), "-o", out,
                f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]

    key = [*(f.read_bytes() for f in sources), torch.__version__.encode(), compiler.encode(), " ".join(flags).encode()]
    path = native_build.build_cached(native_build.cache_root(os.environ) / "kernels", "test-kvq-avx2", key, command,
                                     "kv_quant.cpp (avx2)", timeout=None)
    torch.ops.load_library(str(path))
    return torch.ops.mlxcel_kvq_avx2.attention_kv_quant


@pytest.mark.parametrize("types", [TURBO4, TURBO3, KVCacheTypes("int8", "turbo4")], ids=lambda t: f"k{t.k}-v{t.v}")
@pytest.mark.parametrize("d", [64, 256])
def test_avx2_build_matches_attention_over_the_dequantized_rows(avx2_op, types, d):
    _check_kernel(avx2_op, "float32", types, 0, d)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("types", MODES, ids=lambda t: f"k{t.k}-v{t.v}")
def test_kernel_stores_new_rows_as_the_torch_quantizer_does(dtype, types):
    """A decode step's write inside the kernel gives the records a prompt step's torch ops store
    (turbo: the same codes but where fp32 rounding puts a coordinate on a boundary's other side)."""
    import torch

    from mlxcel.backends.torch import cpu_kernels

    cpu_kernels.load(os.environ)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(5)
    slots, kvh, heads, d = 12, 2, 4, 64
    pool = {side: tuple(None if t is None else torch.zeros_like(t) if i < 2 else t
                        for i, t in enumerate(_side(mode, torch.zeros(slots, kvh, d).to(dt))[0]))
            for side, mode in (("k", types.k), ("v", types.v))}
    new_k, new_v = (torch.randn(2, kvh, d, generator=g).to(dt) * 5 for _ in range(2))
    at = torch.tensor([3, 7])
    torch.ops.mlxcel_cpu.attention_kv_quant(torch.randn(2, heads, d, generator=g).to(dt), *pool["k"], *pool["v"],
                                            torch.tensor([[3], [7]]), torch.tensor([1, 1]), 0, d ** -0.5, new_k,
                                            new_v, at)
    for side, new, mode in (("k", new_k, types.k), ("v", new_v, types.v)):
        (data, scales, _, _), (want, want_scales, _, _) = pool[side], _side(mode, new)[0]
        if mode in kv_turbo.TURBO_BITS:
            bits = kv_turbo.TURBO_BITS[mode]
            same = kv_turbo.unpack(data[at].numpy(), bits) == kv_turbo.unpack(want.numpy(), bits)
            assert same.mean() >= 0.99
            torch.testing.assert_close(scales[at], want_scales, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(data[at], want) and (scales is None or torch.equal(scales[at], want_scales))


# -- logits on the zoo fixtures ------------------------------------------------------------------

# plain attention, every layer sliding (mistral), soft-capped (gemma2, SDPA's path), sinks (gpt_oss)
FAMILIES = ("mistral", "gemma2", "gpt_oss")
PROMPT = ("The history of the city of Paris begins with a small settlement on an island in the river, "
          "where fishermen and traders built their huts")


def _steps(backend, ids: list[int], decode: int = 6) -> np.ndarray:
    """Logits of a chunked prefill, then `decode` teacher-forced decode steps (as served: decode rows)."""
    seq, out = backend.new_sequence(), []
    prompt, rest = ids[:-decode], ids[-decode:]
    for start in range(0, len(prompt), 16):
        out.append(backend.forward_all(prompt[start:start + 16], seq))
    for token in rest:
        out.append(backend.forward([ForwardRow([token], seq, decode=True)]))
    return np.concatenate(out)


# every family with int8 keys and values on both backends and turbo4 on torch (its SDPA paths for
# soft-capping and sinks), the first family in every pairing (the turbo ones on MLX too but for
# the asymmetric ones: the codecs are the same)
LOGIT_CASES = [(f, b, t) for f in FAMILIES for t in MODES for b in REGISTRY[f].backends
               if t == INT8 or (t == TURBO4 and b == "torch")
               or (f == FAMILIES[0] and (t.k == t.v or "turbo" not in t.k + t.v or b == "torch"))]


@pytest.mark.parametrize("family,backend,types", LOGIT_CASES, ids=[f"{f}-{b}-k{t.k}-v{t.v}" for f, b, t in LOGIT_CASES])
def test_quantized_logits_stay_near_the_f16_pool(family, backend, types):
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(fixtures.zoo_fixture(family))
    ids = Tokenizer(path).encode(PROMPT + " and " + PROMPT)
    want = _steps(_backend(backend, path, None), ids)
    mine = _backend(backend, path, types)
    got = _steps(mine, ids)
    worst = float(np.abs(got - want).max())
    assert worst <= max(TOLERANCE[types.k], TOLERANCE[types.v]), f"max |logit difference| {worst}"
    assert worst > 0  # the records are quantized: something rounds
    if backend == "torch" and family == "mistral":  # its decode rows went through attention_kv_quant
        assert mine._fused_attention != "off"
    stored = [k for k in mine.storage.keys if k is not None]
    assert mine.storage.nbytes == stored[0].shape[0] * mine.kv_spec.bytes_per_token


REFUSED = [(f, why, b) for f, why in (("deepseek_v2", "latent"), ("mamba2", "recurrent")) for b in REGISTRY[f].backends]


@pytest.mark.parametrize("family,why,backend", REFUSED)
def test_quantized_kv_is_refused_where_layers_keep_no_per_head_keys(family, why, backend):
    with pytest.raises(KVCacheTypeRefused, match=why):
        _backend(backend, fixture_path(fixtures.zoo_fixture(family)), INT8 if backend == "mlx" else TURBO4)


# -- quality on SmolLM2 ------------------------------------------------------------------------

def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


_REFERENCE: dict[tuple[str, int], np.ndarray] = {}
# (backend, mode, positions): int8 over the whole text on both backends; turbo4 over its first
# few hundred positions (scripts/bench/kv_modes.py measures every mode over all of it)
QUALITY = [("mlx", INT8, None), ("torch", INT8, None), ("torch", KVCacheTypes("int8", "turbo4"), 384),
           ("torch", TURBO4, 384)]


@pytest.mark.parametrize("backend,types,positions", QUALITY, ids=[f"{b}-{t.k}" for b, t, _ in QUALITY])
def test_kv_quality_on_smollm2(backend, types, positions):
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(DEFAULT_MODEL)
    ids = Tokenizer(path).encode(TEXT)[:positions]
    assert len(ids) > (1000 if positions is None else positions - 1)

    def logits(t):
        b = _backend(backend, path, t)
        seq = b.new_sequence()
        return np.concatenate([b.forward_all(ids[s:s + 256], seq) for s in range(0, len(ids), 256)])

    if (backend, len(ids)) not in _REFERENCE:  # the f16 reference, shared by the modes
        _REFERENCE[backend, len(ids)] = logits(None)
    ref, got = _REFERENCE[backend, len(ids)], logits(types)
    p, q = _log_softmax(ref), _log_softmax(got)
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    assert kl < KL_LIMIT[types.k, types.v], f"mean KL {kl}"
    top2 = np.sort(ref, -1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] >= DECIDED
    assert decided.sum() > len(ids) // 3
    same = ref.argmax(-1)[decided] == got.argmax(-1)[decided]
    assert same.mean() >= DECIDED_AGREEMENT.get((types.k, types.v), 1.0), f"decided agreement {same.mean()}"


# -- the engine over quantized pools -------------------------------------------------------------

ENGINE_CASES = [("mlx", INT8), ("torch", INT8), ("torch", TURBO4), ("mlx", KVCacheTypes("turbo3", "turbo4"))]


@pytest.fixture(scope="module", params=ENGINE_CASES, ids=[f"{b}-k{t.k}-v{t.v}" for b, t in ENGINE_CASES])
def model(request):
    """test_engine's served model over a quantized pool: its batch-invariance and prefix-cache tests run on it."""
    from mlxcel.config.settings import KvSection
    from tests.models.test_engine import make_model

    backend, types = request.param
    m = make_model(backend=backend, kv=KvSection(cache_type_k=types.k, cache_type_v=types.v))
    assert m.engine.kv_policy()["cache_type_k"] == types.k
    yield m
    m.engine.shutdown()


@pytest.fixture(autouse=True)
def cold_prefix_cache(request):
    """Each engine test starts from an empty prompt cache. A cached prefix computed in another
    test's batch holds keys whose last bits follow that batch's shapes (torch fp32 and MLX round a
    row by the call's shape); a quantizer can turn such a last-bit difference into a different
    code, so a "cold" run that reuses it would not be the cold run the identity test means."""
    if "model" in request.fixturenames:
        request.getfixturevalue("model").engine.submit_cache_reset().result(timeout=60)


SERVER_CASES = [("mlx", INT8), ("torch", KVCacheTypes("turbo4", "int8"))]


@pytest.fixture(scope="module", params=SERVER_CASES, ids=[f"{b}-k{t.k}-v{t.v}" for b, t in SERVER_CASES])
def quant_server(request):
    fixture_path(DEFAULT_MODEL)
    backend, types = request.param
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--backend", backend, "-c", "2048", "-np", "2",
                            "--cache-type-k", types.k, "--cache-type-v", types.v])
    server.types = types
    yield server
    server.stop()


def test_chat_completion_over_a_quantized_pool(quant_server):
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=quant_server.base_url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Name a colour."}])
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    kv = httpx.get(quant_server.base_url + "/props", timeout=10).json()["kv_cache"]
    types = quant_server.types
    assert (kv["cache_type_k"], kv["cache_type_v"]) == (types.k, types.v)
    # SmolLM2: 30 layers, 3 KV heads of 64
    assert kv["bytes_per_token"] == 30 * (kv_side_bytes(types.k, 3, 64, 4) + kv_side_bytes(types.v, 3, 64, 4))


def test_estimate_memory_sizes_the_pool_in_the_chosen_modes():
    """--estimate-memory's KV per token is kv_side_bytes' (the pool's own sizing) for the modes given."""
    from tests.e2e.test_memory_plan import cli, estimate_figures

    fixture_path(DEFAULT_MODEL)
    done = cli("--backend", "torch", "--device", "cpu", "--dtype", "float32", "-c", "1024", "-np", "2",
               "--cache-type-k", "turbo4", "--cache-type-v", "int8", "--estimate-memory")
    assert done.returncode == 0, done.stderr
    assert estimate_figures(done.stdout)["per_token"] == 30 * (kv_side_bytes("turbo4", 3, 64, 4)
                                                               + kv_side_bytes("int8", 3, 64, 4))
