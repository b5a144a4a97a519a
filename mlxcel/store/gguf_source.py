"""Reading a GGUF file into a HuggingFace-layout checkpoint (config, tensors, tokenizer).

mlxcel never serves GGUF; this module exists only so `mlxcel convert` can turn one into a
SafeTensors checkpoint. It is torch-free: tensors are dequantized with the `gguf` package in
numpy, renamed through an explicit per-architecture table, and undone where llama.cpp's
converter changed them (llama's rotary permutation of q/k, Gemma's `1 + w` norm weights).
An architecture missing from the tables is refused, never guessed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np


class GGUFUnsupported(ValueError):
    """The GGUF file describes something this converter has no table for."""


# GGUF per-layer tensor stem -> HF stem (under model.layers.N.), per architecture.
_LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    "gemma3": {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
}

# Qwen 2 and 3 use Llama's names (Qwen 2's biases ride on the same stems; Qwen 3 adds the
# per-head q/k norms) and llama.cpp leaves their q/k rows in HF's order
_LAYER_NAMES["qwen2"] = dict(_LAYER_NAMES["llama"])
_LAYER_NAMES["qwen3"] = {**_LAYER_NAMES["llama"], "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

# Phi-3 keeps transformers' fused projections: q/k/v in one tensor, gate and up in another
_LAYER_NAMES["phi3"] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Pre-tokenizers the transformers GGUF tokenizer builder does not know. SmolLM splits every
# digit before the byte-level GPT-2 regex (its tokenizer.json does the same).
_PRE_TOKENIZERS: dict[str, Callable[[], object]] = {}


def _smollm_pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


_PRE_TOKENIZERS["smollm"] = _smollm_pre_tokenizer


def _meta(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _decoder_config(reader, a: str, has_output: bool) -> dict:
    """The geometry every Llama-shaped GGUF architecture records under its own prefix `a`."""
    hidden = int(_meta(reader, f"{a}.embedding_length"))
    heads = int(_meta(reader, f"{a}.attention.head_count"))
    head_dim = _meta(reader, f"{a}.attention.key_length", _meta(reader, f"{a}.rope.dimension_count", hidden // heads))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(_meta(reader, f"{a}.feed_forward_length")),
        "num_hidden_layers": int(_meta(reader, f"{a}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(reader, f"{a}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(_meta(reader, f"{a}.context_length")),
        "rms_norm_eps": float(_meta(reader, f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta(reader, f"{a}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": not has_output,
    }


def _llama_config(reader, has_output: bool) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_decoder_config(reader, "llama", has_output),
            "attention_bias": False, "mlp_bias": False}


def _qwen2_config(reader, has_output: bool) -> dict:
    # Qwen 2's q/k/v biases are part of the architecture, not a config switch
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_decoder_config(reader, "qwen2", has_output)}


def _qwen3_config(reader, has_output: bool) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_decoder_config(reader, "qwen3", has_output),
            "attention_bias": False}


def _gemma3_config(reader, has_output: bool) -> dict:
    a = "gemma3"
    layers = int(_meta(reader, f"{a}.block_count"))
    head_dim = int(_meta(reader, f"{a}.attention.key_length"))
    # GGUF does not record the local/global layout, the local rope base or the query scale;
    # these are the Gemma 3 architecture constants (every 6th layer global, local base 1e4).
    pattern = 6
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(_meta(reader, f"{a}.embedding_length")),
        "intermediate_size": int(_meta(reader, f"{a}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": int(_meta(reader, f"{a}.attention.head_count")),
        "num_key_value_heads": int(_meta(reader, f"{a}.attention.head_count_kv")),
        "head_dim": head_dim,
        "max_position_embeddings": int(_meta(reader, f"{a}.context_length")),
        "rms_norm_eps": float(_meta(reader, f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta(reader, f"{a}.rope.freq_base")),
        "rope_local_base_freq": 10000.0,
        "sliding_window": int(_meta(reader, f"{a}.attention.sliding_window")),
        "sliding_window_pattern": pattern,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": not has_output,
    }


def _phi3_config(reader, has_output: bool) -> dict:
    # a long-context Phi-3's rope_factors_* tensors have no mapping and refuse the file by name
    window = _meta(reader, "phi3.attention.sliding_window")
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **_decoder_config(reader, "phi3", has_output),
            "sliding_window": int(window) if window else None}


_CONFIGS = {"llama": _llama_config, "gemma3": _gemma3_config, "qwen2": _qwen2_config, "qwen3": _qwen3_config,
            "phi3": _phi3_config}


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves each head's rotary halves; put them back in HF's half-split order.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _fix_tensor(arch: str, stem: str, w: np.ndarray, config: dict) -> np.ndarray:
    if arch == "llama" and stem == "attn_q":
        return _unpermute_rotary(w, config["num_attention_heads"])
    if arch == "llama" and stem == "attn_k":
        return _unpermute_rotary(w, config["num_key_value_heads"])
    if arch == "gemma3" and stem.endswith("norm"):
        return w - 1.0  # llama.cpp stores Gemma's (1 + w) scale; HF stores w
    return w


_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def read_tensors(reader, arch: str, config: dict) -> dict[str, np.ndarray]:
    import gguf

    table = _LAYER_NAMES[arch]
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        m = _BLOCK.match(t.name)
        if m:
            layer, stem, kind = m.groups()
            if stem not in table:
                raise GGUFUnsupported(f"GGUF tensor {t.name!r} has no mapping for architecture {arch!r}")
            w = _fix_tensor(arch, stem, w, config)
            out[f"model.layers.{layer}.{table[stem]}.{kind}"] = w
        elif t.name in _GLOBAL_NAMES:
            stem = t.name.split(".")[0]
            out[_GLOBAL_NAMES[t.name]] = _fix_tensor(arch, stem, w, config)
        elif t.name == "rope_freqs.weight":
            continue  # recomputed from rope_theta at load time
        else:
            raise GGUFUnsupported(f"GGUF tensor {t.name!r} has no mapping for architecture {arch!r}")
    return out


def _tokenizer_dict(reader) -> dict:
    keys = {
        "tokenizer.ggml.model": "tokenizer_type",
        "tokenizer.ggml.pre": "pre_tokenizer_type",
        "tokenizer.ggml.tokens": "tokens",
        "tokenizer.ggml.scores": "scores",
        "tokenizer.ggml.token_type": "token_type",
        "tokenizer.ggml.merges": "merges",
        "tokenizer.ggml.add_space_prefix": "add_prefix_space",
    }
    return {name: _meta(reader, key) for key, name in keys.items() if key in reader.fields}


def write_tokenizer(reader, arch: str, out_dir: Path) -> dict:
    """Write tokenizer.json / tokenizer_config.json; returns the special token ids."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tdict = _tokenizer_dict(reader)
    backend, _ = convert_gguf_tokenizer(arch, tdict)
    pre = _PRE_TOKENIZERS.get(tdict.get("pre_tokenizer_type"))
    if pre is not None:
        backend.pre_tokenizer = pre()
    tokens = tdict["tokens"]
    ids = {
        name: _meta(reader, f"tokenizer.ggml.{key}")
        for name, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("unk", "unknown_token_id"),
            ("pad", "padding_token_id"),
        )
    }
    add_bos = bool(_meta(reader, "tokenizer.ggml.add_bos_token", tdict.get("tokenizer_type") == "llama"))
    if add_bos and ids["bos"] is not None:
        from tokenizers import processors

        bos = tokens[ids["bos"]]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])]
        )
    elif tdict.get("tokenizer_type") != "gpt2":
        backend.post_processor = None
    special = {f"{k}_token": tokens[v] for k, v in ids.items() if v is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    template = _meta(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = add_bos
    # Portable across transformers 4 and 5, and the template where every loader looks for it.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("model_max_length", None)
    if template:
        cfg["chat_template"] = template
    cfg["add_eos_token"] = bool(_meta(reader, "tokenizer.ggml.add_eos_token", False))
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return {k: v for k, v in ids.items() if v is not None}


def gguf_to_hf(gguf_path: Path, out_dir: Path) -> dict:
    """Write config.json, model.safetensors (fp32), tokenizer and generation config; return config."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = str(_meta(reader, "general.architecture"))
    if arch not in _CONFIGS:
        raise GGUFUnsupported(
            f"GGUF architecture {arch!r} cannot be converted; supported: {', '.join(sorted(_CONFIGS))}"
        )
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = _CONFIGS[arch](reader, has_output)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = read_tensors(reader, arch, config)
    config["vocab_size"] = int(tensors["model.embed_tokens.weight"].shape[0])
    ids = write_tokenizer(reader, arch, out_dir)
    for k, v in ids.items():
        config[f"{k}_token_id"] = int(v)
    config["torch_dtype"] = "float32"
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[f"{k}_token_id"] for k in ("bos", "eos", "pad") if f"{k}_token_id" in config}
    gen = {f"{k}_token_id": v for k, v in gen.items()}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return config
