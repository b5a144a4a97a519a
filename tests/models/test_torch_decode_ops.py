"""mlxcel's fused decode-step ops (kernels/cpu/decode_ops.cpp, backends/torch/fused_ops.py)
against their references, and the served model with them.

References: the families' own RMSNorm modules and `apply_rotary_pos_emb` (RoPE must give their
exact bits; the norms may differ by one last-place step: fp32 sums in another order), and for
attention a float64 softmax over the same bf16/fp32 values (bf16 output: within one rounding
step of the largest output). Then the served SmolLM2 in bf16: the same greedy text with and
without the fused ops, logits within bf16 noise, a decode row's logits bit-identical alone,
beside another decode row and inside a packed step, and the profiler shows which op ran.

The ops are built with the row kernel on first use (tests/models/test_torch_row_kernel.py).
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from mlxcel.backends.torch import cpu_kernels, fused_ops
from tests.conftest import DEFAULT_MODEL, fixture_path
from tests.fixtures import GEMMA3, QWEN2_TINY, QWEN3_TINY

DTYPES = (torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def ops():
    cpu_kernels.load(os.environ)
    return torch.ops.mlxcel_cpu


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm, Gemma3RMSNorm])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norm_matches_the_family_module(ops, cls, dtype):
    g = _gen(1)
    norm = cls(576, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=g).to(dtype)
    x = (torch.randn(3, 7, 576, generator=g) * 4).to(dtype)
    with torch.inference_mode():
        want = norm(x)
        assert fused_ops.install_norms(norm) == 1
        got = norm(x)
        fused_ops.remove_norms(norm)
        assert torch.equal(norm(x), want)  # its own forward back
    step = 2.0 ** -7 if dtype is torch.bfloat16 else 2.0 ** -22
    err = float((got.float() - want.float()).abs().max())
    assert got.dtype == dtype and err <= step * float(want.float().abs().max()), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 9, 3, 64), (2, 7, 4, 1, 256), (3, 5, 8, 8, 32)])
def test_fused_rope_gives_the_eager_bits(ops, dtype, shape):
    b, n, hq, hk, d = shape
    g = _gen(2)
    # the families' layout: [b, n, heads, d] projections viewed as [b, heads, n, d]
    q = torch.randn(b, n, hq, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(b, n, hk, d, generator=g).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(b, n, d, generator=g).to(dtype) for _ in range(2))
    want = apply_rotary_pos_emb(q, k, cos, sin)
    got = fused_ops._fused_rope(apply_rotary_pos_emb, q, k, cos, sin)
    assert all(torch.equal(w, x) for w, x in zip(want, got))
    # a shape the op does not take goes to the family's function
    broadcast = fused_ops._fused_rope(apply_rotary_pos_emb, q, k, cos[:1], sin[:1])
    assert all(torch.equal(w, x) for w, x in zip(apply_rotary_pos_emb(q, k, cos[:1], sin[:1]), broadcast))


def test_rope_is_rebound_only_where_the_probe_agrees(ops):
    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # another RoPE form: pairs (0, 1), (2, 3), ...
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    fake = types.ModuleType("mlxcel_test_fake_family")
    fake.apply_rotary_pos_emb = interleaved
    Layer = type("Layer", (torch.nn.Module,), {"__module__": fake.__name__})
    sys.modules[fake.__name__] = fake
    try:
        model = torch.nn.Sequential(Layer(), LlamaRMSNorm(8))
        done = fused_ops.install_rope(model)
        assert done == ["transformers.models.llama.modeling_llama"]
        assert fake.apply_rotary_pos_emb is interleaved
        assert modeling_llama.apply_rotary_pos_emb is not apply_rotary_pos_emb
        fused_ops.remove_rope(model)
        assert modeling_llama.apply_rotary_pos_emb is apply_rotary_pos_emb
    finally:
        del sys.modules[fake.__name__]
        fused_ops.remove_rope(torch.nn.Sequential(LlamaRMSNorm(8)))


def _reference(q, keys, values, table, lengths, window, scale):
    """float64 softmax attention, one query per row, GQA by head groups."""
    rows, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(rows, heads, values.shape[-1], dtype=torch.float64)
    for i in range(rows):
        n = int(lengths[i])
        first = max(0, n - window) if window else 0
        slots = table[i, first:n]
        k = keys[slots].double().repeat_interleave(group, dim=1)  # [t, heads, d]
        v = values[slots].double().repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,thd->ht", q[i].double(), k) * scale).softmax(-1)
        out[i] = torch.einsum("ht,thd->hd", p, v)
    return out


def _attention_case(seed, rows, heads, kv_heads, dk, dv, dtype, max_len=200, slots=900):
    g = _gen(seed)
    q = torch.randn(rows, heads, dk, generator=g).to(dtype)
    keys = torch.randn(slots, kv_heads, dk, generator=g).to(dtype)
    values = torch.randn(slots, kv_heads, dv, generator=g).to(dtype)
    lengths = torch.randint(1, max_len + 1, (rows,), generator=g)
    table = torch.stack([torch.randperm(slots, generator=g)[:max_len] for _ in range(rows)])
    return q, keys, values, table, lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dk,dv", [(9, 3, 64, 64), (4, 1, 256, 256), (8, 8, 128, 128),
                                                  (6, 2, 48, 40)])
@pytest.mark.parametrize("window", [0, 17])
def test_decode_attention_matches_the_reference(ops, dtype, heads, kv_heads, dk, dv, window):
    q, keys, values, table, lengths = _attention_case(heads * dk + window, 4, heads, kv_heads, dk, dv, dtype)
    _assert_matches_reference(fused_ops.decode_attention, q, keys, values, table, lengths, window)


def _assert_matches_reference(attend, q, keys, values, table, lengths, window):
    """`attend` (a fused_ops attention) within one bf16 step (or fp32 noise) of _reference."""
    dk, dtype = q.shape[-1], q.dtype
    scale = dk ** -0.5
    # an attention module as the torch backend leaves it: a window on sliding layers, else None
    module = types.SimpleNamespace(**{fused_ops.WINDOW_ATTR: window or None})
    with torch.inference_mode():
        got = attend(module, q, keys, values, table, lengths, scale)
    want = _reference(q, keys, values, table.expand(len(q), -1), lengths, window, scale)
    tol = (2.0 ** -7 if dtype is torch.bfloat16 else 1e-5) * float(want.abs().max())
    err = float((got.double() - want).abs().max())
    assert got.dtype == dtype and got.shape == want.shape and err <= tol, err


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_attends_alike_alone_and_among_others(ops, dtype):
    """Long rows split over the helper threads (in pieces where the register form does not
    apply), short ones stay on the caller, and a call of more rows than a decode step takes
    each row whole; a row's bits must not depend on which, nor on the call's other rows
    (engine batch invariance)."""
    q, keys, values, table, lengths = _attention_case(5, 6, 9, 3, 64, 64, dtype, max_len=700, slots=2000)
    lengths[0], lengths[1] = 1, 700
    many = 40  # more rows than kernels/cpu/helpers.h's kPromptRows
    with torch.inference_mode():
        together = ops.decode_attention(q, keys, values, table, lengths, 0, 0.125)
        crowd = ops.decode_attention(q.repeat(many // 6 + 1, 1, 1)[:many], keys, values,
                                     table.repeat(many // 6 + 1, 1)[:many], lengths.repeat(many // 6 + 1)[:many], 0, 0.125)
        for i in range(len(q)):
            alone = ops.decode_attention(q[i:i + 1], keys, values, table[i:i + 1], lengths[i:i + 1], 0, 0.125)
            assert torch.equal(alone[0], together[i]), f"row {i}"
            assert torch.equal(alone[0], crowd[i]), f"row {i} among {many}"


def _prompt_case(seed, tokens, heads, kv_heads, dk, dv, dtype, start=150):
    """A prompt chunk: `tokens` queries at positions start.. over one shared slot table."""
    g = _gen(seed)
    q = torch.randn(tokens, heads, dk, generator=g).to(dtype)
    keys = torch.randn(2000, kv_heads, dk, generator=g).to(dtype)
    values = torch.randn(2000, kv_heads, dv, generator=g).to(dtype)
    table = torch.randperm(2000, generator=g)[: start + tokens].view(1, -1)
    lengths = torch.arange(start + 1, start + tokens + 1)
    return q, keys, values, table, lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dk,dv", [(9, 3, 64, 64), (4, 1, 256, 256), (8, 2, 128, 128),
                                                  (6, 2, 48, 40)])
@pytest.mark.parametrize("window", [0, 100])
def test_prompt_attention_matches_the_reference(ops, dtype, heads, kv_heads, dk, dv, window):
    """Prompt tokens, each over its own prefix of one table (bf16 head sizes 64/128/256 take
    the AMX scores where the CPU has them; the rest the decode rows' form)."""
    q, keys, values, table, lengths = _prompt_case(heads + dk + window, 40, heads, kv_heads, dk, dv, dtype)
    _assert_matches_reference(fused_ops.prompt_attention, q, keys, values, table, lengths, window)


@pytest.mark.parametrize("dk,window", [(64, 0), (128, 0), (256, 37), (48, 0)])
def test_a_prompt_token_attends_alike_in_any_chunk(ops, dk, window):
    """The prompt cache's promise: a token's output bits do not depend on how its prompt was
    chunked (any split, a token alone, with its own table row) nor where it sits in a tile."""
    q, keys, values, table, lengths = _prompt_case(dk, 70, 4, 2, dk, dk, torch.bfloat16)
    with torch.inference_mode():
        whole = ops.prompt_attention(q, keys, values, table, lengths, window, 0.1)
        for cuts in ([1], [16], [17, 33], [69]):
            parts, start = [], 0
            for cut in [*cuts, 70]:
                parts.append(ops.prompt_attention(q[start:cut], keys, values, table, lengths[start:cut], window, 0.1))
                start = cut
            assert torch.equal(torch.cat(parts), whole), cuts
        own = table.expand(5, -1).contiguous()  # one table row per query (one-token prompt rows)
        assert torch.equal(ops.prompt_attention(q[30:35], keys, values, own, lengths[30:35], window, 0.1),
                           whole[30:35])


def test_decode_attention_stores_the_new_keys_first(ops):
    """A padded decode step hands each row's new key and value to the kernel, which stores them
    in the row's slot and then attends: the same as storing by index_copy first."""
    q, keys, values, table, lengths = _attention_case(8, 3, 9, 3, 64, 64, torch.bfloat16)
    write = torch.stack([table[i, int(lengths[i]) - 1] for i in range(3)])  # each row's newest slot
    new_k, new_v = torch.randn(3, 3, 64).to(torch.bfloat16), torch.randn(3, 3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        k_ref, v_ref = keys.clone(), values.clone()
        k_ref.index_copy_(0, write, new_k)
        v_ref.index_copy_(0, write, new_v)
        want = ops.decode_attention(q, k_ref, v_ref, table, lengths, 0, 0.125)
        got = ops.decode_attention(q, keys, values, table, lengths, 0, 0.125, new_k, new_v, write)
        with pytest.raises(RuntimeError, match="write slot out of range"):
            ops.decode_attention(q, keys, values, table, lengths, 0, 0.125, new_k, new_v, write + 10_000)
    assert torch.equal(keys, k_ref) and torch.equal(values, v_ref) and torch.equal(got, want)


def test_decode_attention_refuses_what_it_does_not_take(ops):
    q, keys, values, table, lengths = _attention_case(6, 2, 9, 3, 64, 64, torch.bfloat16)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="slot out of range"):
            ops.decode_attention(q, keys, values, table + 10_000, lengths, 0, 0.125)
        with pytest.raises(RuntimeError, match="outside its table"):
            ops.decode_attention(q, keys, values, table, lengths + 1000, 0, 0.125)
        with pytest.raises(RuntimeError, match="must be"):
            ops.decode_attention(q.float(), keys, values, table, lengths, 0, 0.125)
        with pytest.raises(RuntimeError, match="do not agree"):
            ops.decode_attention(q[:, :8], keys[:, :3], values, table, lengths, 0, 0.125)
        with pytest.raises(RuntimeError, match="bf16 or fp32"):
            ops.rms_norm(torch.ones(4, dtype=torch.float16), torch.ones(4, dtype=torch.float16), 1e-5, False)


def _greedy_with_and_without(backend, prompt: list[int], steps: int):
    """(tokens, decode-step logits) of a greedy run with the fused ops, then one without."""
    from mlxcel.engine.backend import ForwardRow

    runs = []
    try:
        for fused in (True, False):
            backend.set_fused_ops(fused)
            seq = backend.new_sequence()
            out, logits = [int(backend.forward([ForwardRow(prompt, seq)])[0].argmax())], []
            for _ in range(steps):
                logits.append(backend.forward([ForwardRow([out[-1]], seq, decode=True)])[0])
                out.append(int(logits[-1].argmax()))
            runs.append((out, logits))
    finally:
        backend.set_fused_ops(True)
    return runs


def _same_greedy_text(backend, tok, ids: list[int], tolerance: float) -> list[int]:
    """Ten greedy tokens with the fused ops and without: the same text, decode logits within
    `tolerance` of their range; returns the tokens."""
    (a, la), (b, lb) = _greedy_with_and_without(backend, ids, 10)
    assert a == b, f"greedy text differs: {tok.decode(a)!r} vs {tok.decode(b)!r}"
    worst = max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(la, lb))
    assert worst <= tolerance, f"decode logits differ by {worst:.2g} of their range"
    return a


def _op_counts(fn) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


SDPA = "aten::scaled_dot_product_attention"


def test_served_model_with_fused_ops(ops):
    """SmolLM2 bf16 as served (row kernel and fused ops) against the same backend with the
    family's own ops: same greedy text, decode logits close; a decode row's logits are the same
    bits alone, beside another decode row and inside a packed step beside a prefill chunk; the
    profiler shows decode rows' attention taking the kernel in every step, and prompt rows'
    where the AMX tiles run their linears (else SDPA, which prefills faster)."""
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.backends.torch.backend import TorchBackend
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(DEFAULT_MODEL)
    backend = TorchBackend(path, dtype="bfloat16", build_env=os.environ)
    tiles = backend.prompt_linears == "mlxcel AMX tiles"
    mode = "all" if tiles else "decode rows"
    assert backend.fused_ops.endswith(f"row-by-row attention: {mode}"), backend.fused_ops
    layers = backend.info.num_layers
    tok = Tokenizer(path)
    ids = tok.encode("The capital of France is")
    a = _same_greedy_text(backend, tok, ids, tolerance=0.05)

    def decode_step(*others):
        """The first row's logits after a one-token decode step beside `others`' rows."""
        seq = backend.new_sequence()
        backend.forward([ForwardRow(ids, seq)])
        rows = [ForwardRow([a[0]], seq, decode=True)]
        for tokens, decode in others:
            other = backend.new_sequence()
            if decode:
                backend.forward([ForwardRow(tok.encode("Once upon a time there"), other)])
            rows.append(ForwardRow(tokens, other, decode=decode))
        counts = _op_counts(lambda: rows.__setitem__(0, backend.forward(rows)[0]))
        return rows[0], counts

    alone, counts = decode_step()
    assert counts.get("mlxcel_cpu::decode_attention") == layers and SDPA not in counts
    beside, counts = decode_step(([11], True))
    assert counts.get("mlxcel_cpu::decode_attention") == layers and SDPA not in counts
    packed, counts = decode_step((tok.encode("A prompt chunk prefilled in the same step"), False))
    # the decode row through the decode kernel, the prompt chunk through the prompt rows' one
    # (AMX tiles) or SDPA
    assert counts.get("mlxcel_cpu::decode_attention") == layers
    if tiles:
        assert counts.get("mlxcel_cpu::prompt_attention") == layers and SDPA not in counts
    else:
        assert counts.get(SDPA) == layers and "mlxcel_cpu::prompt_attention" not in counts
    assert np.array_equal(alone, beside) and np.array_equal(alone, packed)


def test_served_fp32_model_attends_decode_rows_through_the_kernel_and_prompts_through_sdpa(ops):
    """SmolLM2 in fp32 as served (the CPU default without bf16 instructions): the row kernel and
    the fused norms and RoPE; decode rows attend through the decode kernel in every step, and a
    decode row's logits are the same bits whether a prompt chunk shares its step or not; prompt
    rows through SDPA (fp32's prompt linears are torch's, so there are no chunk-independent bits
    to keep there, and SDPA prefills long prompts faster); the same greedy text as the family's
    own ops, decode logits within 1e-4 of their range."""
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.backends.torch.backend import TorchBackend
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(DEFAULT_MODEL)
    backend = TorchBackend(path, dtype="float32", build_env=os.environ)
    assert backend.row_kernel.startswith("mlxcel row kernel")
    assert backend.prompt_linears == "mlxcel row kernel up to 32 rows, torch above"
    assert backend.fused_ops.endswith("row-by-row attention: decode rows"), backend.fused_ops
    layers = backend.info.num_layers
    tok = Tokenizer(path)
    ids = tok.encode("The capital of France is")
    a = _same_greedy_text(backend, tok, ids, tolerance=1e-4)

    seq, other = backend.new_sequence(), backend.new_sequence()
    counts = _op_counts(lambda: backend.forward([ForwardRow(ids, seq)]))
    assert counts.get(SDPA, 0) >= layers and "mlxcel_cpu::prompt_attention" not in counts
    backend.forward([ForwardRow(tok.encode("Once upon a time there"), other)])
    fork = backend.new_sequence()
    backend.forward([ForwardRow(ids, fork)])
    got = {}
    counts = _op_counts(lambda: got.update(beside=backend.forward([ForwardRow([a[0]], seq, decode=True),
                                                                  ForwardRow([11], other, decode=True)])[0]))
    assert counts.get("mlxcel_cpu::decode_attention") == layers and SDPA not in counts
    counts = _op_counts(lambda: got.update(packed=backend.forward([
        ForwardRow([a[0]], fork, decode=True), ForwardRow(tok.encode(" a prompt chunk"), backend.new_sequence())])[0]))
    assert counts.get("mlxcel_cpu::decode_attention") == layers and counts.get(SDPA) == layers
    assert "mlxcel_cpu::prompt_attention" not in counts
    assert np.array_equal(got["beside"], got["packed"])


@pytest.mark.parametrize("ref", [GEMMA3, QWEN2_TINY, QWEN3_TINY])
def test_other_families_serve_alike_with_fused_ops(ops, ref):
    """Gemma 3 (its offset norm, sliding-window layers, head size 256) and the Qwen families
    (Qwen3's per-head q/k norms): the fused ops all installed, the same greedy tokens from a
    prompt longer than Gemma's 512-token window (its decode rows attend a window's worth), decode
    logits within bf16 noise (Gemma's differ by up to ~5% of their range between the paths)."""
    from mlxcel.backends.torch.backend import TorchBackend

    backend = TorchBackend(fixture_path(ref), dtype="bfloat16", build_env=os.environ)
    mode = "all" if backend.prompt_linears == "mlxcel AMX tiles" else "decode rows"
    assert backend.fused_ops.endswith(f"RoPE in 1 family modules, row-by-row attention: {mode}"), backend.fused_ops
    (a, la), (b, lb) = _greedy_with_and_without(backend, [(i * 37) % 5000 + 100 for i in range(530)], 6)
    assert a == b
    worst = max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(la, lb))
    assert worst <= 0.08, f"decode logits differ by {worst:.3f} of their range"
