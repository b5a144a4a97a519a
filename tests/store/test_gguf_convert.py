"""`mlxcel convert` from GGUF files of the Qwen and Phi-3 architectures.

No such GGUF ships on PyPI, so the test writes one from a tiny fixture with the `gguf` package, in llama.cpp's layout (names, metadata keys, a byte-level BPE vocabulary with its
merges), in float32 so the round trip is exact; the conversion must then give the fixture's
logits (both fp32 through the MLX backend: max |difference| <= 1e-5) and its tokenization.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests import fixtures
from tests.conftest import fixture_path

# HF stem under model.layers.N. -> llama.cpp stem under blk.N.
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          # Phi-3's fused projections
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    stem, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[stem]}.{kind}"


def _tensors(src: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, w in mx.load(str(f)).items():
            out[name] = np.asarray(w.astype(mx.float32))
    return out


def write_gguf(src: Path, arch: str, path: Path, pre: str) -> None:
    """The checkpoint `src` as a float32 GGUF of `arch`, keyed as llama.cpp writes it; `pre`:
    llama.cpp's name for the tokenizer's pre-tokenizer."""
    import gguf

    from mlxcel.models.checkpoint_config import read_config

    config = read_config(src)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    tok = json.loads((src / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    w.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    w.add_uint32(f"{arch}.attention.head_count", config["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    size = config["vocab_size"]
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3 if i in special else 1 if i in by_id else 4 for i in range(size)])
    w.add_array("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_uint32("tokenizer.ggml.bos_token_id", config["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", config["eos_token_id"])
    for name, t in _tensors(src).items():
        w.add_tensor(_gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(("arch", "ref", "pre"), [("qwen2", fixtures.QWEN2_TINY, "qwen2"),
                                                 ("qwen3", fixtures.QWEN3_TINY, "qwen2"),
                                                 ("phi3", fixtures.zoo_fixture("phi3"), "smollm")])
def test_gguf_converts_to_the_same_model(tmp_path, arch, ref, pre):
    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.store.convert import convert

    src = fixture_path(ref)
    gguf_file = tmp_path / f"{arch}.gguf"
    write_gguf(src, arch, gguf_file, pre)
    out = convert(gguf_file, tmp_path / "store", f"local/{arch}-from-gguf", dtype="float32")
    assert json.loads((out / "config.json").read_text())["model_type"] == arch
    text = "The quick brown fox, 12345 times: <|im_start|>user\nhi<|im_end|>"
    ids = Tokenizer(src).encode(text)
    assert Tokenizer(out).encode(text) == ids
    want = MLXBackend(src, dtype="float32")
    got = MLXBackend(out, dtype="float32")
    a = got.forward_all(ids, got.new_sequence())
    b = want.forward_all(ids, want.new_sequence())
    assert float(np.abs(a - b).max()) <= 1e-5
