"""The int8 KV mode (--cache-type-k / --cache-type-v int8) on both backends.

1. Records: bytes per token from the one function that sizes a mode, the quantizer's error
   bound, and the torch kernel (kernels/cpu/kv_int8.cpp) against a float64 attention over the
   dequantized rows.
2. Logits: zoo fixtures (tiny random-weight families) through the paged pool with int8 keys
   and/or values, prefill in chunks and decode steps, within TOLERANCE of the f16 pool's logits,
   the pool holding what kv_spec says per token; latent and recurrent layers are refused.
3. Quality on the real SmolLM2-135M: teacher-forced over 1,000+ tokens of fixed prose, the mean KL
   divergence of next-token distributions, int8 against f16 KV, below KL_LIMIT, and the greedy
   token the same wherever f16's top two logits are at least DECIDED apart.
4. The engine's batch invariance and prefix-cache identity (tests/models/test_engine.py's tests,
   run here over an int8 pool), and /v1/chat/completions over the real server on each backend.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mlxcel.engine.backend import INT8_SCALE_BYTES, ForwardRow, KVCacheTypeRefused, KVCacheTypes, kv_side_bytes
from mlxcel.models.registry import FAMILIES as REGISTRY
from tests import fixtures
from tests.conftest import DEFAULT_MODEL, ServerProcess, fixture_path
from tests.models.test_engine import (  # noqa: F401 - collected here, over this module's `model`
    test_batch_invariance, test_prefix_cache_hit_is_identical_and_opt_out_prefills_cold)

TOLERANCE = 0.02  # max |logit difference| against the f16 pool on the zoo fixtures (measured <= 0.006)
KL_LIMIT = 1e-3
DECIDED = 1.0  # a position's greedy token is decided where f16's top two logits differ by this much
TEXT = (Path(__file__).parent / "data" / "kv_quality_text.txt").read_text()
INT8 = KVCacheTypes("int8", "int8")
MODES = [INT8, KVCacheTypes("int8", "f16"), KVCacheTypes("f16", "int8")]
BACKENDS = ("mlx", "torch")


def _backend(backend: str, path, types: KVCacheTypes | None, dtype: str = "float32"):
    if backend == "mlx":
        from mlxcel.backends.mlx.backend import MLXBackend

        return MLXBackend(path, dtype=dtype, kv_cache=types)
    from mlxcel.backends.torch.backend import TorchBackend

    return TorchBackend(path, dtype=dtype, kv_cache=types, build_env=os.environ)  # with the kernels, as served


# -- records ------------------------------------------------------------------------------------

def test_int8_bytes_per_token_come_from_the_one_sizing_function():
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
    with pytest.raises(KVCacheTypeRefused, match="the modes are f16, int8"):
        KVCacheTypes("q8_0", "f16")


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

        from mlxcel.backends.mlx.paged import quantize_int8

        q, s = (np.array(a) for a in quantize_int8(mx.array(x)))
    else:
        import torch

        from mlxcel.backends.torch.paged import quantize_int8

        q, s = (a.numpy() for a in quantize_int8(torch.from_numpy(x)))
    assert q.dtype == np.int8 and s.shape == (5, 3) and np.abs(q).max() == 127
    back = q.astype(np.float32) * s[..., None]
    assert np.all(np.abs(back - x) <= s[..., None] / 2 * (1 + 1e-5))
    assert s[1, 2] == 0 and not back[1, 2].any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("types", MODES, ids=lambda t: f"k{t.k}-v{t.v}")
@pytest.mark.parametrize("window", [0, 5])
def test_kernel_matches_attention_over_the_dequantized_rows(dtype, types, window):
    import torch

    from mlxcel.backends.torch import cpu_kernels
    from mlxcel.backends.torch.paged import quantize_int8

    cpu_kernels.load(os.environ)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    slots, kvh, heads, d, rows = 40, 2, 6, 64, 3
    q = torch.randn(rows, heads, d, generator=g).to(dt)
    stored, deq = {}, {}
    for side, mode in (("k", types.k), ("v", types.v)):
        x = torch.randn(slots, kvh, d, generator=g).to(dt)
        if mode == "int8":
            data, scales = quantize_int8(x)
            stored[side] = (data, scales)
            deq[side] = data.double() * scales.double()[..., None]
        else:
            stored[side] = (x, None)
            deq[side] = x.double()
    table = torch.stack([torch.randperm(slots, generator=g) for _ in range(rows)])
    lengths = torch.tensor([1, 17, 40])
    got = torch.ops.mlxcel_cpu.attention_int8(q, stored["k"][0], stored["k"][1], stored["v"][0], stored["v"][1],
                                              table, lengths, window, d ** -0.5)
    for i in range(rows):
        first = max(0, int(lengths[i]) - window) if window else 0
        at = table[i, first:int(lengths[i])]
        k = deq["k"][at].repeat_interleave(heads // kvh, 1)  # [t, heads, d]
        v = deq["v"][at].repeat_interleave(heads // kvh, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), k) * d ** -0.5, -1)
        want = torch.einsum("ht,thd->hd", p, v)
        step = 2.0 ** -7 if dt is torch.bfloat16 else 1e-5
        err = float((got[i].double() - want).abs().max())
        assert got.dtype == dt and err <= step * float(want.abs().max()) + 1e-6, (i, err)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("types", MODES, ids=lambda t: f"k{t.k}-v{t.v}")
def test_kernel_stores_new_rows_as_the_torch_quantizer_does(dtype, types):
    """A decode step's write inside the kernel gives the records a prompt step's torch ops store."""
    import torch

    from mlxcel.backends.torch import cpu_kernels
    from mlxcel.backends.torch.paged import quantize_int8

    cpu_kernels.load(os.environ)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(5)
    slots, kvh, heads, d = 12, 2, 4, 64
    pool = {}
    for side, mode in (("k", types.k), ("v", types.v)):
        int8 = mode == "int8"
        pool[side] = (torch.zeros(slots, kvh, d, dtype=torch.int8 if int8 else dt),
                      torch.zeros(slots, kvh) if int8 else None)
    new_k, new_v = (torch.randn(2, kvh, d, generator=g).to(dt) * 5 for _ in range(2))
    at = torch.tensor([3, 7])
    torch.ops.mlxcel_cpu.attention_int8(torch.randn(2, heads, d, generator=g).to(dt), pool["k"][0], pool["k"][1],
                                        pool["v"][0], pool["v"][1], torch.tensor([[3], [7]]), torch.tensor([1, 1]), 0,
                                        d ** -0.5, new_k, new_v, at)
    for (data, scales), new in ((pool["k"], new_k), (pool["v"], new_v)):
        if scales is None:
            assert torch.equal(data[at], new)
        else:
            q, s = quantize_int8(new)
            assert torch.equal(data[at], q) and torch.equal(scales[at], s)


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


# every family in both modes' int8/int8, and the one-sided modes on the first
LOGIT_CASES = [(f, b, t) for f in FAMILIES for t in MODES if t == INT8 or f == FAMILIES[0]
               for b in REGISTRY[f].backends]


@pytest.mark.parametrize("family,backend,types", LOGIT_CASES, ids=[f"{f}-{b}-k{t.k}-v{t.v}" for f, b, t in LOGIT_CASES])
def test_int8_logits_stay_near_the_f16_pool(family, backend, types):
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(fixtures.zoo_fixture(family))
    ids = Tokenizer(path).encode(PROMPT + " and " + PROMPT)
    want = _steps(_backend(backend, path, None), ids)
    mine = _backend(backend, path, types)
    got = _steps(mine, ids)
    worst = float(np.abs(got - want).max())
    assert worst <= TOLERANCE, f"max |logit difference| {worst}"
    assert worst > 0  # the records are int8: something rounds
    if backend == "torch" and family == "mistral":  # its decode rows went through attention_int8
        assert mine._fused_attention != "off"
    stored = [k for k in mine.storage.keys if k is not None]
    assert mine.storage.nbytes == stored[0].shape[0] * mine.kv_spec.bytes_per_token


REFUSED = [(f, why, b) for f, why in (("deepseek_v2", "latent"), ("mamba2", "recurrent")) for b in REGISTRY[f].backends]


@pytest.mark.parametrize("family,why,backend", REFUSED)
def test_int8_is_refused_where_layers_keep_no_per_head_keys(family, why, backend):
    with pytest.raises(KVCacheTypeRefused, match=why):
        _backend(backend, fixture_path(fixtures.zoo_fixture(family)), INT8)


# -- quality on SmolLM2 ------------------------------------------------------------------------

def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_kv_quality_on_smollm2(backend):
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(DEFAULT_MODEL)
    ids = Tokenizer(path).encode(TEXT)
    assert len(ids) > 1000

    def logits(types):
        b = _backend(backend, path, types)
        seq = b.new_sequence()
        return np.concatenate([b.forward_all(ids[s:s + 256], seq) for s in range(0, len(ids), 256)])

    ref, got = logits(None), logits(INT8)
    p, q = _log_softmax(ref), _log_softmax(got)
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    assert kl < KL_LIMIT, f"mean KL {kl}"
    top2 = np.sort(ref, -1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] >= DECIDED
    assert decided.sum() > len(ids) // 3
    assert np.array_equal(ref.argmax(-1)[decided], got.argmax(-1)[decided])


# -- the engine over an int8 pool ----------------------------------------------------------------

@pytest.fixture(scope="module", params=BACKENDS)
def model(request):
    """test_engine's served model, its pool int8: its batch-invariance and prefix-cache tests run on it."""
    from mlxcel.config.settings import KvSection
    from tests.models.test_engine import make_model

    m = make_model(backend=request.param, kv=KvSection(cache_type_k="int8", cache_type_v="int8"))
    assert m.engine.kv_policy()["cache_type_k"] == "int8"
    yield m
    m.engine.shutdown()


@pytest.fixture(scope="module", params=BACKENDS)
def int8_server(request):
    fixture_path(DEFAULT_MODEL)
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--backend", request.param, "-c", "2048", "-np", "2",
                            "--cache-type-k", "int8", "--cache-type-v", "int8"])
    yield server
    server.stop()


def test_chat_completion_over_an_int8_pool(int8_server):
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=int8_server.base_url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Name a colour."}])
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    kv = httpx.get(int8_server.base_url + "/props", timeout=10).json()["kv_cache"]
    assert kv["cache_type_k"] == kv["cache_type_v"] == "int8"
    assert kv["bytes_per_token"] == 30 * 2 * 3 * (64 + INT8_SCALE_BYTES)  # SmolLM2: 30 layers, 3 KV heads of 64
