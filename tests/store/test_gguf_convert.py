"""`mlxcel convert` from GGUF files of every architecture models/gguf_archs.py lists.

No such GGUF ships on PyPI, so the test writes one from a tiny fixture with the `gguf` package,
the way llama.cpp's converter does: tensor names from gguf-py's own name map (not the
converter's tables), its changes to the tensors (a Llama's q/k rows permuted into rotary pairs,
Gemma's and Nemotron's norms stored as 1 + w, experts stacked, Phi-2's q/k/v fused as the
original release has them, InternLM 2's and GPT-NeoX's fused q/k/v regrouped, DeepSeek's
kv_b_proj split per head, Mamba 2's A stored as -exp(A_log), RoPE settings baked into
tensors), its metadata keys, and a
byte-level BPE vocabulary; all in float32, so the round trip is exact. The conversion must then
give the fixture's logits (both fp32 through the MLX backend: max |difference| <= 1e-5) and its
layout keys. Where a GGUF cannot say what the fixture's config.json does, the reference is the
fixture as llama.cpp runs it (a Mistral without its window, Gemma 2's query scale, Qwen 3 MoE's
renormalised routing, SmolLM 3's NoPE every 4th layer, Phi-3.5-MoE without its window, Mamba 2's
placeholder context). Where transformers reads the architecture from GGUF itself, its config
agrees with the converted one.

The architecture cases carry a trimmed vocabulary (a 49k-entry one dominates their cost); one
case per fixture tokenizer carries the whole one and checks the tokenization.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from tests import fixtures
from tests.conftest import fixture_path

# a Llama's rotary pairs are interleaved by llama.cpp's converter (its q/k permutation)
_PERMUTED = ("llama", "granite", "granitemoe", "smollm3", "internlm2")
_FEW_TOKENS = 512
TEXT = "The quick brown fox, 12345 times: <|im_start|>user\nhi<|im_end|>"
_NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3", "nemotron")


def _tensors(src: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, w in mx.load(str(f)).items():
            out[name] = np.asarray(w.astype(mx.float32))
    return out


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stack_experts(tensors: dict) -> dict:
    """One tensor per projection, experts on axis 0, named without the expert index."""
    out, groups = {}, {}
    for name, w in tensors.items():
        m = re.match(r"^(.*\.experts)\.(\d+)\.(.+)$", name)
        if m:
            groups.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = w
        else:
            out[name] = w
    for name, by_expert in groups.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _own_forms(arch: str, config: dict, tensors: dict) -> dict:
    """The families whose tensors llama.cpp's converter reshapes before naming them: InternLM 2's
    grouped q/k/v split, GPT-NeoX's per-head q/k/v regrouped, DBRX's experts stacked, DeepSeek's
    kv_b_proj split per head (its key half transposed), Mamba 2's A stored as -exp(A_log)."""
    out = {}
    heads = config.get("num_attention_heads") or 1
    dim = config["hidden_size"] // heads
    for name, w in tensors.items():
        if arch == "internlm2" and name.endswith("attention.wqkv.weight"):
            kv = config["num_key_value_heads"]
            g = w.reshape(kv, heads // kv + 2, dim, -1)
            stem = name.removesuffix("wqkv.weight")
            out[stem + "wq.weight"], out[stem + "wk.weight"], out[stem + "wv.weight"] = (
                g[:, :-2].reshape(-1, w.shape[1]), g[:, -2].reshape(-1, w.shape[1]), g[:, -1].reshape(-1, w.shape[1]))
        elif arch == "gptneox" and "query_key_value" in name:
            out[name] = w.reshape(heads, 3, dim, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
        elif arch == "dbrx" and ".ffn.experts.mlp." in name:
            e = config["ffn_config"]["moe_num_experts"]
            w = w.reshape(e, -1, w.shape[-1])
            out[name + ".weight"] = w.swapaxes(1, 2) if name.endswith(".w2") else w
        elif arch == "deepseek2" and name.endswith("kv_b_proj.weight"):
            kv_b = w.reshape(heads, -1, w.shape[-1])
            k_b, v_b = np.split(kv_b, [config["qk_nope_head_dim"]], axis=1)
            out[name.replace("kv_b_proj", "k_b_proj")], out[name.replace("kv_b_proj", "v_b_proj")] = \
                k_b.swapaxes(1, 2), v_b
        elif name.endswith("e_score_correction_bias"):
            out[name.replace("e_score_correction_bias", "e_score_correction.bias")] = w
        elif arch == "mamba2" and name.endswith((".A_log", ".D", ".dt_bias", ".conv1d.weight", ".norm.weight")):
            if name.endswith(".A_log"):
                w = -np.exp(w)
            if name.endswith(".conv1d.weight"):
                w = w[:, 0, :]
            if name.endswith("mixer.norm.weight"):
                w = w.reshape(config["n_groups"], -1)
            out[name.replace(".dt_bias", ".dt_proj.bias")] = w[:, None] if name.endswith((".A_log", ".D")) else w
        else:
            out[name] = w
    return out


def llama_cpp_tensors(arch: str, config: dict, tensors: dict) -> dict[str, np.ndarray]:
    """GGUF name -> tensor, as llama.cpp's converter writes the checkpoint's weights."""
    import gguf

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     config["num_hidden_layers"])
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    out = {}
    for name, w in _stack_experts(_own_forms(arch, config, tensors)).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        # gpt-oss's bare expert tensors: [experts, in, out] with gate and up interleaved in out
        if name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias")):
            w = w if name.endswith("_bias") else w.swapaxes(-1, -2)
            kind = "bias" if name.endswith("_bias") else "weight"
            out[f"blk.{layer}.ffn_gate_exps.{kind}"], out[f"blk.{layer}.ffn_up_exps.{kind}"] = w[:, ::2], w[:, 1::2]
            continue
        if name.endswith((".experts.down_proj", ".experts.down_proj_bias")):
            kind = "bias" if name.endswith("_bias") else "weight"
            out[f"blk.{layer}.ffn_down_exps.{kind}"] = w if kind == "bias" else w.swapaxes(-1, -2)
            continue
        if name.endswith(".sinks"):
            name += ".weight"
        if name.endswith("block_sparse_moe.input_linear.weight"):  # Granite MoE: gate and up, fused
            gate, up = np.split(w, 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if arch in _PERMUTED and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _permute(w, heads if "attn_q" in gguf_name else kv)
        if arch in _NORM_PLUS_ONE and gguf_name.endswith("norm.weight"):
            w = w + 1.0
        if gguf_name.endswith("shortconv.conv.weight"):
            w = w[:, 0, :]  # LFM2's depthwise kernel without its channel axis
        out[gguf_name] = w
    if arch == "phi2":  # the original Phi-2 release's fused q/k/v, as its GGUFs have it
        for layer in range(config["num_hidden_layers"]):
            for kind in ("weight", "bias"):
                parts = [out.pop(f"blk.{layer}.attn_{p}.{kind}") for p in "qkv"]
                out[f"blk.{layer}.attn_qkv.{kind}"] = np.concatenate(parts, axis=0)
    return out


def _llama3_divisors(theta: float, dims: int, s: dict) -> np.ndarray:
    """What llama.cpp's converter computes for a Llama 3 RoPE scaling, one frequency at a time."""
    out = []
    low, high, original = s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * theta ** (i / dims)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(s["factor"])
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def _mamba2_hparams(w, c: dict) -> None:
    inner = c["expand"] * c["hidden_size"]
    w.add_uint32("mamba2.context_length", 2**20)  # llama.cpp's placeholder: a recurrent model has no limit
    for key, value in (("embedding_length", c["hidden_size"]), ("feed_forward_length", 0), ("head_count", 0),
                       ("block_count", c["num_hidden_layers"]), ("ssm.conv_kernel", c["conv_kernel"]),
                       ("ssm.inner_size", inner), ("ssm.state_size", c["state_size"]),
                       ("ssm.time_step_rank", inner // c["head_dim"]), ("ssm.group_count", c["n_groups"])):
        w.add_uint32(f"mamba2.{key}", value)
    w.add_float32("mamba2.attention.layer_norm_rms_epsilon", c["layer_norm_epsilon"])


def _deepseek2_hparams(w, c: dict) -> None:
    a = "deepseek2"
    w.add_uint32(f"{a}.leading_dense_block_count", c["first_k_dense_replace"])
    if c.get("q_lora_rank"):
        w.add_uint32(f"{a}.attention.q_lora_rank", c["q_lora_rank"])
    rank, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    for key, value in (("attention.kv_lora_rank", rank), ("attention.key_length", rank + rope),
                       ("attention.value_length", rank), ("attention.key_length_mla", c["qk_nope_head_dim"] + rope),
                       ("attention.value_length_mla", c["v_head_dim"]), ("rope.dimension_count", rope),
                       ("expert_count", c["n_routed_experts"]), ("expert_used_count", c["num_experts_per_tok"]),
                       ("expert_shared_count", c["n_shared_experts"])):
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.expert_weights_scale", c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_bool(f"{a}.expert_weights_norm", True)
    if c.get("n_group") is not None:
        w.add_uint32(f"{a}.expert_group_count", c["n_group"])
        w.add_uint32(f"{a}.expert_group_used_count", c["topk_group"])
    if c["model_type"] == "deepseek_v3":  # a hub V3 config.json says scoring_func sigmoid
        w.add_uint32(f"{a}.expert_gating_func", 2)
    if (c.get("rope_scaling") or {}).get("mscale_all_dim") is not None:
        w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * c["rope_scaling"]["mscale_all_dim"])


def _own_hparams(w, arch: str, c: dict) -> None:
    """The keys the families with their own converter classes add."""
    if arch == "deepseek2":
        _deepseek2_hparams(w, c)
    if arch == "exaone":
        w.add_uint32(f"{arch}.rope.dimension_count", c["head_dim"])
    if arch == "exaone4" and c.get("sliding_window"):
        w.add_uint32(f"{arch}.attention.sliding_window", c["sliding_window"])
        w.add_array(f"{arch}.attention.sliding_window_pattern", [t == "sliding_attention" for t in c["layer_types"]])
    if arch == "phimoe":  # Phi-3's keys: the window (which llama.cpp then ignores) and the original context
        w.add_uint32(f"{arch}.attention.sliding_window", c.get("sliding_window") or 0)
        w.add_uint32(f"{arch}.rope.dimension_count", c["hidden_size"] // c["num_attention_heads"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                     c.get("original_max_position_embeddings", c["max_position_embeddings"]))
    if arch == "gptneox":
        w.add_bool(f"{arch}.use_parallel_residual", c["use_parallel_residual"])
    if arch == "dbrx":
        w.add_float32(f"{arch}.attention.clamp_kqv", c["attn_config"]["clip_qkv"])


def _llama_cpp_view(arch: str, c: dict) -> dict:
    """The config as llama.cpp's converter reads it, where a family names its shape itself."""
    if arch == "dbrx":  # its MLP and experts in ffn_config, a fixed LayerNorm epsilon
        f = c["ffn_config"]
        return {**c, "intermediate_size": f["ffn_hidden_size"], "num_local_experts": f["moe_num_experts"],
                "num_experts_per_tok": f["moe_top_k"], "layer_norm_eps": 1e-5}
    if arch == "deepseek2":  # MLA: one shared latent KV head
        return {**c, "num_key_value_heads": 1}
    return c


def _hparams(w, arch: str, c: dict, raw: dict, ff: int) -> None:
    """The metadata llama.cpp writes for `arch` (its set_gguf_parameters); `ff`: the MLP's size."""
    if arch == "mamba2":
        return _mamba2_hparams(w, c)
    _own_hparams(w, arch, c)
    c = _llama_cpp_view(arch, c)
    ff = c["intermediate_size"] if ff is None else ff
    w.add_uint32(f"{arch}.context_length", c["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", c["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", ff)
    w.add_uint32(f"{arch}.block_count", c["num_hidden_layers"])
    w.add_uint32(f"{arch}.attention.head_count", c["num_attention_heads"])
    kv = c.get("num_key_value_heads", c["num_attention_heads"])
    if arch == "lfm2":  # per layer, 0 on a short-convolution layer
        w.add_array(f"{arch}.attention.head_count_kv", [kv if t == "full_attention" else 0 for t in c["layer_types"]])
        w.add_uint32(f"{arch}.shortconv.l_cache", c["conv_L_cache"])
    else:
        w.add_uint32(f"{arch}.attention.head_count_kv", kv)
    if arch != "gptneox":  # GPT-NeoX's converter leaves the base at llama.cpp's default
        w.add_float32(f"{arch}.rope.freq_base", c["rope_theta"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if "head_dim" in raw and arch != "deepseek2":
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    if "rms_norm_eps" in c or arch == "lfm2":  # LFM2's norm_eps is an RMSNorm's
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.get("rms_norm_eps") or c["norm_eps"])
    else:
        w.add_float32(f"{arch}.attention.layer_norm_epsilon",
                      c.get("layer_norm_eps") or c.get("norm_epsilon") or c["norm_eps"])
    if arch in _PERMUTED:
        w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    if "partial_rotary_factor" in c:
        w.add_uint32(f"{arch}.rope.dimension_count", int(c["partial_rotary_factor"] * head_dim))
    experts = c.get("num_experts") or c.get("num_local_experts")
    if experts:
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", c["num_experts_per_tok"])
    if "moe_intermediate_size" in c or arch == "gpt-oss":
        w.add_uint32(f"{arch}.expert_feed_forward_length", c.get("moe_intermediate_size") or c["intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", c["shared_expert_intermediate_size"])
    if arch in ("gemma2", "gemma3", "cohere2", "gpt-oss") or (arch == "olmo2" and c.get("sliding_window")):
        w.add_uint32(f"{arch}.attention.sliding_window", c["sliding_window"])
    if arch == "olmo2" and c.get("sliding_window"):  # OLMo 3: the layout per layer, true where sliding
        w.add_array(f"{arch}.attention.sliding_window_pattern", [t == "sliding_attention" for t in c["layer_types"]])
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", c["attn_logit_softcapping"])
        w.add_float32(f"{arch}.final_logit_softcapping", c["final_logit_softcapping"])
    if arch in ("command-r", "cohere2"):
        w.add_float32(f"{arch}.logit_scale", c["logit_scale"])
    scaling = c.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":  # baked into per-frequency divisors
        w.add_tensor("rope_freqs.weight", _llama3_divisors(c["rope_theta"], head_dim, scaling))
    if scaling.get("rope_type") == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", scaling["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", scaling["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if key in scaling:
                w.add_float32(f"{arch}.rope.scaling.yarn_{key}", scaling[key])
    if scaling.get("rope_type") == "longrope":  # Phi-3's long RoPE: its factors as tensors
        original = c["original_max_position_embeddings"]
        factor = math.sqrt(1 + math.log(c["max_position_embeddings"] / original) / math.log(original))
        w.add_float32(f"{arch}.rope.scaling.attn_factor", factor)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(scaling[f"{kind}_factor"], dtype=np.float32))
    if arch.startswith("granite"):
        w.add_float32(f"{arch}.attention.scale", c["attention_multiplier"])
        w.add_float32(f"{arch}.embedding_scale", c["embedding_multiplier"])
        w.add_float32(f"{arch}.residual_scale", c["residual_multiplier"])
        w.add_float32(f"{arch}.logit_scale", c["logits_scaling"])


def _vocab(w, src: Path, config: dict, pre: str, whole: bool) -> None:
    """The byte-level BPE vocabulary, as llama.cpp stores it. Not `whole`: only the first
    `_FEW_TOKENS` ids and the merges among them (the architecture cases check logits, not
    tokenization, and a 49k-entry vocabulary dominates their cost)."""
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    size = config["vocab_size"] if whole else _FEW_TOKENS
    by_id = {i: t for t, i in vocab.items() if i < size}
    merges = [m.split(" ") if isinstance(m, str) else m for m in tok["model"]["merges"]]
    kept = set(by_id.values())
    merges = [m for m in merges if whole or {m[0], m[1], m[0] + m[1]} <= kept]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", [by_id.get(i, f"[PAD{i}]") for i in range(size)])
    w.add_array("tokenizer.ggml.token_type", [3 if i in special else 1 if i in by_id else 4 for i in range(size)])
    w.add_array("tokenizer.ggml.merges", [" ".join(m) for m in merges])
    for key in ("bos_token_id", "eos_token_id"):
        if config.get(key) is not None and config[key] < size:
            w.add_uint32(f"tokenizer.ggml.{key}", config[key])


def _quantizable(w: np.ndarray) -> bool:
    return w.ndim >= 2 and w.shape[-1] % 32 == 0  # whole blocks of 32 along each row


def write_gguf(src: Path, arch: str, path: Path, pre: str, *, whole_vocab: bool = True, weights: bool = True,
               quant=None) -> None:
    """The checkpoint `src` as a float32 GGUF of `arch`, keyed as llama.cpp writes it; `pre`:
    llama.cpp's name for the tokenizer's pre-tokenizer. Without `weights`: its vocabulary only.
    `quant`: a GGML type every matrix is stored in instead."""
    import gguf

    from mlxcel.models.checkpoint_config import read_config

    config = read_config(src)
    w = gguf.GGUFWriter(str(path), arch)
    _vocab(w, src, config, pre, whole_vocab)
    if weights:
        tensors = llama_cpp_tensors(arch, config, _tensors(src))
        # the MLP as built (LFM2 adjusts its configured size), else the config's
        ff = tensors["blk.0.ffn_gate.weight"].shape[0] if arch == "lfm2" else config.get("intermediate_size")
        _hparams(w, arch, config, json.loads((src / "config.json").read_text()), ff)
        for name, t in tensors.items():
            if quant is not None and _quantizable(t):
                w.add_tensor(name, gguf.quants.quantize(t, quant), raw_dtype=quant)
            else:
                w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def text_tower(tmp: Path, src: Path, layers: int = 6) -> Path:
    """A multimodal Gemma 3 checkpoint's text tower as a gemma3_text checkpoint (what llama.cpp
    writes to the model GGUF; the image tower goes to a separate mmproj file), its layers repeated
    to `layers`: one full period of Gemma 3's pattern, which mlx-lm's module needs."""
    from safetensors.numpy import save_file

    out = tmp / "text-tower"
    out.mkdir()
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (out / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())["text_config"]
    prefix, have = "language_model.", config["num_hidden_layers"]
    tower = {k.removeprefix(prefix): v for k, v in _tensors(src).items() if k.startswith(prefix)}
    tensors = {k: v for k, v in tower.items() if ".layers." not in k}
    for i in range(layers):
        tensors.update({k.replace(f".layers.{i % have}.", f".layers.{i}."): v for k, v in tower.items()
                        if f".layers.{i % have}." in k})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForCausalLM"],
                                                 "num_hidden_layers": layers, "layer_types": types}))
    return out


def reference(tmp: Path, src: Path, overrides: dict) -> Path:
    """The fixture with `overrides` in its config.json (its other files linked)."""
    if not overrides:
        return src
    out = tmp / "reference"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    (out / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **overrides}))
    return out


Z = fixtures.zoo_fixture
# (GGUF architecture, fixture, converted model_type, what the GGUF cannot carry)
CASES = [
    ("qwen2", fixtures.QWEN2_TINY, "qwen2", {}),
    ("qwen3", fixtures.QWEN3_TINY, "qwen3", {}),
    ("phi3", Z("phi3"), "phi3", {}),
    ("llama", Z("mistral"), "llama", {"sliding_window": None}),  # llama.cpp's llama has no window
    # Llama 3.1's RoPE scaling, which llama.cpp bakes into a rope_freqs tensor
    ("llama", Z("mistral"), "llama", {"sliding_window": None, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}),
    ("llama", Z("mixtral"), "mixtral", {}),
    ("gemma2", Z("gemma2"), "gemma2", {"query_pre_attn_scalar": 16}),  # its head_dim
    ("qwen2moe", Z("qwen2_moe"), "qwen2_moe", {}),
    ("qwen3moe", Z("qwen3_moe"), "qwen3_moe", {"norm_topk_prob": True}),
    ("gemma", Z("gemma"), "gemma", {}),
    ("starcoder2", Z("starcoder2"), "starcoder2", {}),
    ("phi2", Z("phi"), "phi", {}),
    ("command-r", Z("cohere"), "cohere", {}),
    ("cohere2", Z("cohere2"), "cohere2", {}),
    ("olmo2", Z("olmo2"), "olmo2", {}),
    ("olmo2", Z("olmo3"), "olmo3", {}),
    ("granite", Z("granite"), "granite", {}),
    ("granitemoe", Z("granitemoe"), "granitemoe", {}),
    ("stablelm", Z("stablelm"), "stablelm", {}),
    ("gemma3", Z("gemma3"), "gemma3_text", {}),  # its text tower (text_tower)
    # llama.cpp's SmolLM 3 has every 4th layer without RoPE (the zoo's every 2nd)
    ("smollm3", Z("smollm3"), "smollm3", {"no_rope_layer_interval": 4, "no_rope_layers": [1, 1]}),
    ("olmoe", Z("olmoe"), "olmoe", {}),
    ("glm4", Z("glm4"), "glm4", {}),
    ("seed_oss", Z("seed_oss"), "seed_oss", {}),
    ("nemotron", Z("nemotron"), "nemotron", {}),
    ("lfm2", Z("lfm2"), "lfm2", {}),
    ("ernie4_5", Z("ernie4_5"), "ernie4_5", {}),
    ("gpt-oss", Z("gpt_oss"), "gpt_oss", {}),
    ("hunyuan-dense", Z("hunyuan_v1_dense"), "hunyuan_v1_dense", {}),
    ("exaone", Z("exaone"), "exaone", {}),
    # EXAONE 4's Llama 3 RoPE factors, with no original context in the file (the curve gives it)
    ("exaone4", Z("exaone4"), "exaone4", {}),
    ("phimoe", Z("phimoe"), "phimoe", {"sliding_window": None}),  # llama.cpp's phimoe has no window
    ("internlm2", Z("internlm2"), "internlm2", {}),
    ("gptneox", Z("gpt_neox"), "gpt_neox", {}),
    ("dbrx", Z("dbrx"), "dbrx", {}),
    ("deepseek2", Z("deepseek_v2"), "deepseek_v2", {}),  # YaRN, uncompressed queries, softmax routing
    ("deepseek2", Z("deepseek_v3"), "deepseek_v3", {}),  # compressed queries, grouped sigmoid routing
    ("mamba2", Z("mamba2"), "mamba2", {"max_position_embeddings": 2**20}),  # llama.cpp's placeholder
    # a long-context Phi-3 as transformers 5 saves it; llama.cpp keeps the factors as tensors
    ("phi3", Z("phi3"), "phi3", {"max_position_embeddings": 16384, "original_max_position_embeddings": 4096,
                                 "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                     "long_factor": [1.0 + i for i in range(8)],
                                                     "short_factor": [1.0 + i / 10 for i in range(8)]}}),
]
_LAYOUT_KEYS = ("layer_types", "sliding_window", "head_dim", "partial_rotary_factor", "rope_theta", "no_rope_layers",
                "num_experts_per_tok", "max_position_embeddings")
# config keys transformers' own GGUF reader also derives, compared where it reads the architecture
_SHARED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "rope_theta", "rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps",
                "sliding_window", "num_experts", "num_experts_per_tok", "tie_word_embeddings")


def _transformers_agrees(arch: str, gguf_file: Path, config: dict) -> None:
    """transformers' own GGUF reader, where it knows `arch`, derives the same shared keys."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    if arch.replace("moe", "_moe") not in GGUF_SUPPORTED_ARCHITECTURES:
        return
    theirs = load_gguf_checkpoint(str(gguf_file))["config"]
    shared = [k for k in _SHARED_KEYS if k in theirs and k in config]
    assert len(shared) >= 8, shared
    for k in shared:
        if isinstance(config[k], float):
            assert np.float32(theirs[k]) == np.float32(config[k]), k
        else:
            assert theirs[k] == config[k], k


def _case_id(case) -> str:
    rope = case[3].get("rope_parameters", {}).get("rope_type")
    return f"{case[0]}-{case[2]}" + (f"-{rope}" if rope else "")


@pytest.mark.parametrize(("arch", "ref", "model_type", "overrides"), CASES, ids=[_case_id(c) for c in CASES])
def test_gguf_converts_to_the_same_model(tmp_path, arch, ref, model_type, overrides):
    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.models.checkpoint_config import read_config
    from mlxcel.store.convert import convert

    src = fixture_path(ref)
    if arch == "gemma3":
        src = text_tower(tmp_path, src)
    src = reference(tmp_path, src, overrides)  # the checkpoint as llama.cpp converts and runs it
    gguf_file = tmp_path / f"{arch}.gguf"
    write_gguf(src, arch, gguf_file, "smollm", whole_vocab=False)
    out = convert(gguf_file, tmp_path / "store", f"local/{arch}-from-gguf", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type
    want = read_config(src)  # the layout keys a short prompt's logits cannot tell apart
    assert {k: config[k] for k in _LAYOUT_KEYS if k in config and k in want} == \
        {k: want[k] for k in _LAYOUT_KEYS if k in config and k in want}
    _transformers_agrees(arch, gguf_file, config)
    ids = Tokenizer(src).encode(TEXT)
    want = MLXBackend(src, dtype="float32")
    got = MLXBackend(out, dtype="float32")
    a = got.forward_all(ids, got.new_sequence())
    b = want.forward_all(ids, want.new_sequence())
    assert float(np.abs(a - b).max()) <= 1e-5


def dequantized(tmp: Path, src: Path, quant) -> Path:
    """`src` with every matrix as `quant` stores it. Its blocks run along each row, so the row
    permutations and expert stacking of llama.cpp's converter leave them as they are."""
    import gguf
    from safetensors.numpy import save_file

    out = tmp / "dequantized"
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).symlink_to(f.resolve())
    tensors = {k: gguf.quants.dequantize(gguf.quants.quantize(w, quant), quant) if _quantizable(w) else w
               for k, w in _tensors(src).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(("arch", "ref", "quant", "overrides"), [
    ("llama", Z("mistral"), "Q4_0", {"sliding_window": None}),
    ("qwen2moe", Z("qwen2_moe"), "Q8_0", {}),
    ("granitemoe", Z("granitemoe"), "Q4_1", {}),  # packed experts, joined after reading
    ("phi2", Z("phi"), "Q5_0", {}),  # a packed fused q/k/v, split by rows
])
def test_quantized_gguf_converts_to_the_weights_it_stores(tmp_path, arch, ref, quant, overrides):
    """A GGUF as llama.cpp's quantizer leaves it: the conversion serves the dequantized weights."""
    import gguf

    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.store.convert import convert

    qtype = gguf.GGMLQuantizationType[quant]
    src = reference(tmp_path, fixture_path(ref), overrides)
    path = tmp_path / "q.gguf"
    write_gguf(src, arch, path, "smollm", whole_vocab=False, quant=qtype)
    out = convert(path, tmp_path / "store", "local/q", dtype="float32")
    # kept packed, as the file stores them (tests/store/test_gguf_lossless.py checks the bits)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == int(quant[1])
    ids = Tokenizer(src).encode(TEXT)
    got, want, full = (MLXBackend(p, dtype="float32") for p in (out, dequantized(tmp_path, src, qtype), src))
    logits = [b.forward_all(ids, b.new_sequence()) for b in (got, want, full)]
    assert float(np.abs(logits[0] - logits[1]).max()) <= 1e-5
    assert float(np.abs(logits[0] - logits[2]).max()) > 1e-4  # the matrices were stored quantized


@pytest.mark.parametrize(("ref", "pre"), [(fixtures.QWEN2_TINY, "qwen2"), (fixtures.QWEN3_TINY, "qwen2"),
                                          (Z("phi3"), "smollm")])
def test_gguf_vocabulary_tokenizes_as_the_checkpoint(tmp_path, ref, pre):
    """A whole byte-level BPE vocabulary, one per fixture tokenizer (Qwen 2's, Qwen 3's and the
    zoo's SmolLM one): the converted tokenizer splits text, digits and special tokens alike."""
    import gguf

    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.store.gguf_source import write_tokenizer

    src = fixture_path(ref)
    path = tmp_path / "vocab.gguf"
    write_gguf(src, "qwen2", path, pre, weights=False)
    write_tokenizer(gguf.GGUFReader(str(path)), "qwen2", tmp_path / "out")
    assert Tokenizer(tmp_path / "out").encode(TEXT) == Tokenizer(src).encode(TEXT)


def test_an_architecture_without_a_layout_is_refused_with_the_supported_list(tmp_path, capsys):
    import gguf

    from mlxcel.cli.main import main as mlxcel_main
    from mlxcel.models.gguf_archs import GGUF_ARCHITECTURES

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "bloom")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    root = tmp_path / "store"
    assert mlxcel_main(["convert", str(path), "--out-repo", "local/m", "--models-dir", str(root)]) == 1
    assert capsys.readouterr().err == ("mlxcel convert: error: GGUF architecture 'bloom' cannot be converted; "
                                       f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}\n")
    assert not (root / "local" / "m").exists() and not (root / ".staging").exists()


def test_rope_freqs_that_are_not_llama3s_curve_are_refused(tmp_path):
    import gguf

    from mlxcel.store.convert import convert
    from mlxcel.store.gguf_source import GGUFUnsupported

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 64), ("embedding_length", 16), ("block_count", 1),
                       ("attention.head_count", 1)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tensor("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFUnsupported, match=r"^GGUF rope_freqs.weight is not Llama 3's RoPE scaling \(factor 3.0"):
        convert(path, tmp_path / "store", "local/m", dtype="float32")


def test_every_listed_architecture_has_a_layout_and_converts_to_a_served_family():
    from mlxcel.models.gguf_archs import GGUF_ARCHITECTURES, GGUF_EXPORTED_AS, gguf_sources
    from mlxcel.models.registry import FAMILIES
    from mlxcel.store.gguf_source import LAYOUTS

    assert set(LAYOUTS) == set(GGUF_ARCHITECTURES)
    assert {t for types in GGUF_ARCHITECTURES.values() for t in types} <= set(FAMILIES)
    assert all(fam in FAMILIES and gguf_sources(other) for fam, other in GGUF_EXPORTED_AS.items())
    assert {(c[0], c[2]) for c in CASES} == {(a, t) for a, types in GGUF_ARCHITECTURES.items() for t in types}
