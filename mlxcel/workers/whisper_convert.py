"""Whisper weights between three layouts: CTranslate2's model.bin, transformers' checkpoint and
mlx-whisper's.

- `read_ct2(path)` parses a CTranslate2 `model.bin` (binary version 6, `WhisperSpec`) into
  named numpy arrays; the layout is a header, then (name, rank, dims, dtype, byte count, bytes)
  per variable, then name aliases.
- `ct2_to_hf()` renames those into transformers' `WhisperForConditionalGeneration` names:
  CTranslate2 fuses the self-attention q/k/v (and the cross-attention k/v) projections into one
  matrix whose k bias is all zeros, and Whisper's key projection has no bias, so the split drops it.
- `hf_to_mlx()` renames transformers' names into the OpenAI names mlx-whisper loads, with the
  convolution kernels moved to MLX's [out, width, in] order. The encoder's sinusoidal position
  table is not a parameter in mlx-whisper (it recomputes the same table), so it is left out.
- `write_hf()` / `write_mlx()` write complete checkpoint directories (config, weights, tokenizer
  and feature-extractor files), the configs derived from the tensors' shapes.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np

# CTranslate2's DataType enum: only what a converted Whisper carries
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_LN = {"gamma": "weight", "beta": "bias"}


class ConversionError(ValueError):
    """The source is not a checkpoint this converter understands; the message says why."""


def read_ct2(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """model.bin -> ({name: array}, {alias: target})."""
    data = Path(path).read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize("<" + fmt)
        if pos + size > len(data):
            raise ConversionError(f"{path}: truncated at byte {pos}")
        out = struct.unpack_from("<" + fmt, data, pos)
        pos += size
        return out

    def string() -> str:
        nonlocal pos
        (n,) = take("H")
        raw = data[pos : pos + n]
        pos += n
        return raw.rstrip(b"\0").decode("utf-8")

    (version,) = take("I")
    if version < 4:
        raise ConversionError(f"{path}: CTranslate2 binary version {version} is older than this reader (4+)")
    spec = string()
    take("I")  # spec revision
    if spec != "WhisperSpec":
        raise ConversionError(f"{path}: a {spec!r} model, not a Whisper one")
    (count,) = take("I")
    arrays: dict[str, np.ndarray] = {}
    for _ in range(count):
        name = string()
        (rank,) = take("B")
        dims = take("I" * rank) if rank else ()
        dtype_id, nbytes = take("B")[0], take("I")[0]
        if dtype_id not in _CT2_DTYPES:
            raise ConversionError(f"{path}: {name} has CTranslate2 dtype {dtype_id}, which this reader does not know")
        if pos + nbytes > len(data):
            raise ConversionError(f"{path}: {name} runs past the end of the file")
        arrays[name] = np.frombuffer(data, dtype=_CT2_DTYPES[dtype_id], count=nbytes // np.dtype(
            _CT2_DTYPES[dtype_id]).itemsize, offset=pos).reshape(dims).copy()
        pos += nbytes
    aliases = {}
    if version >= 3:
        (n_alias,) = take("I")
        for _ in range(n_alias):
            alias = string()
            aliases[alias] = string()
    return arrays, aliases


def _layers(arrays: dict, side: str) -> int:
    return len({k.split("/")[1] for k in arrays if re.match(rf"{side}/layer_\d+/", k)})


def ct2_to_hf(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """CTranslate2 Whisper variables -> transformers WhisperForConditionalGeneration state dict."""
    out: dict[str, np.ndarray] = {}
    g = arrays.__getitem__

    def ln(dst: str, src: str) -> None:
        for a, b in _LN.items():
            out[f"{dst}.{b}"] = g(f"{src}/{a}")

    def linear(dst: str, src: str, bias: bool = True) -> None:
        out[f"{dst}.weight"] = g(f"{src}/weight")
        if bias:
            out[f"{dst}.bias"] = g(f"{src}/bias")

    def split(dst: str, src: str, names: tuple[str, ...]) -> None:
        w, b = g(f"{src}/weight"), g(f"{src}/bias")
        n = w.shape[0] // len(names)
        for i, name in enumerate(names):
            out[f"{dst}.{name}.weight"] = w[i * n : (i + 1) * n]
            if name != "k_proj":  # Whisper's key projection has no bias (CTranslate2 stores zeros)
                out[f"{dst}.{name}.bias"] = b[i * n : (i + 1) * n]

    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    out["model.encoder.embed_positions.weight"] = g("encoder/position_encodings/encodings")
    for i in range(_layers(arrays, "encoder")):
        src, dst = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        ln(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        split(f"{dst}.self_attn", f"{src}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
        linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
        ln(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
        linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
        linear(f"{dst}.fc2", f"{src}/ffn/linear_1")
    ln("model.encoder.layer_norm", "encoder/layer_norm")

    out["model.decoder.embed_tokens.weight"] = g("decoder/embeddings/weight")
    out["model.decoder.embed_positions.weight"] = g("decoder/position_encodings/encodings")
    for i in range(_layers(arrays, "decoder")):
        src, dst = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        ln(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        split(f"{dst}.self_attn", f"{src}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
        linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
        ln(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
        linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
        split(f"{dst}.encoder_attn", f"{src}/attention/linear_1", ("k_proj", "v_proj"))
        linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")
        ln(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
        linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
        linear(f"{dst}.fc2", f"{src}/ffn/linear_1")
    ln("model.decoder.layer_norm", "decoder/layer_norm")
    return out


# transformers name pieces -> mlx-whisper (OpenAI) name pieces, applied in order
_HF_TO_MLX = (
    ("model.encoder.layers.", "encoder.blocks."), ("model.decoder.layers.", "decoder.blocks."),
    ("model.encoder.layer_norm.", "encoder.ln_post."), ("model.decoder.layer_norm.", "decoder.ln."),
    ("model.encoder.", "encoder."), ("model.decoder.embed_tokens.", "decoder.token_embedding."),
    ("model.decoder.embed_positions.weight", "decoder.positional_embedding"),
    (".self_attn_layer_norm.", ".attn_ln."), (".encoder_attn_layer_norm.", ".cross_attn_ln."),
    (".final_layer_norm.", ".mlp_ln."), (".self_attn.", ".attn."), (".encoder_attn.", ".cross_attn."),
    (".q_proj.", ".query."), (".k_proj.", ".key."), (".v_proj.", ".value."), (".out_proj.", ".out."),
    (".fc1.", ".mlp1."), (".fc2.", ".mlp2."),
)


def hf_to_mlx(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in state.items():
        if name in ("model.encoder.embed_positions.weight", "proj_out.weight"):
            continue  # recomputed by mlx-whisper / tied to the token embedding
        for a, b in _HF_TO_MLX:
            name = name.replace(a, b)
        if name.endswith(("conv1.weight", "conv2.weight")):
            value = np.ascontiguousarray(value.transpose(0, 2, 1))  # [out, in, width] -> [out, width, in]
        out[name] = value
    return out


def dims(state: dict[str, np.ndarray], n_audio_head: int, n_text_head: int) -> dict:
    """mlx-whisper's ModelDimensions from a transformers state dict's shapes."""
    layers = lambda side: len({k.split(".")[3] for k in state if k.startswith(f"model.{side}.layers.")})  # noqa: E731
    vocab, width = state["model.decoder.embed_tokens.weight"].shape
    return {
        "n_mels": int(state["model.encoder.conv1.weight"].shape[1]),
        "n_audio_ctx": int(state["model.encoder.embed_positions.weight"].shape[0]),
        "n_audio_state": int(state["model.encoder.conv1.weight"].shape[0]),
        "n_audio_head": n_audio_head, "n_audio_layer": layers("encoder"),
        "n_vocab": int(vocab), "n_text_ctx": int(state["model.decoder.embed_positions.weight"].shape[0]),
        "n_text_state": int(width), "n_text_head": n_text_head, "n_text_layer": layers("decoder"),
    }


def hf_config(d: dict, ffn: int, ct2_config: dict) -> dict:
    """transformers' WhisperConfig for these dimensions (Whisper's fixed special-token ids)."""
    eot, sot = 50256, 50257
    return {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
        "vocab_size": d["n_vocab"], "num_mel_bins": d["n_mels"], "d_model": d["n_audio_state"],
        "encoder_layers": d["n_audio_layer"], "encoder_attention_heads": d["n_audio_head"],
        "decoder_layers": d["n_text_layer"], "decoder_attention_heads": d["n_text_head"],
        "encoder_ffn_dim": ffn, "decoder_ffn_dim": ffn, "max_source_positions": d["n_audio_ctx"],
        "max_target_positions": d["n_text_ctx"], "activation_function": "gelu", "scale_embedding": False,
        "tie_word_embeddings": True, "pad_token_id": eot, "bos_token_id": eot, "eos_token_id": eot,
        "decoder_start_token_id": sot, "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin") or []),
        "suppress_tokens": list(ct2_config.get("suppress_ids") or []), "torch_dtype": "float16",
        "use_cache": True, "is_encoder_decoder": True,
    }


def generation_config(cfg: dict, ct2_config: dict) -> dict:
    """The ids after <|endoftext|> / <|startoftranscript|> shift by one on a multilingual
    vocabulary (51865 and up), which carries one more language token."""
    english_only = cfg["vocab_size"] < 51865
    no_ts = 50362 if english_only else 50363
    return {
        "decoder_start_token_id": cfg["decoder_start_token_id"], "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"],
        "begin_suppress_tokens": cfg["begin_suppress_tokens"], "suppress_tokens": cfg["suppress_tokens"],
        "no_timestamps_token_id": no_ts, "max_length": cfg["max_target_positions"],
        "is_multilingual": not english_only, "forced_decoder_ids": [[1, no_ts]] if english_only else None,
        "alignment_heads": [list(h) for h in ct2_config.get("alignment_heads") or []],
    }


PREPROCESSOR = {
    "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "WhisperProcessor",
    "feature_size": 80, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400,
    "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right", "padding_value": 0.0,
    "return_attention_mask": False,
}
TOKENIZER_CONFIG = {
    "tokenizer_class": "WhisperTokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 1024,
    "add_prefix_space": False, "errors": "replace",
}


def convert_ct2(src: Path) -> tuple[dict[str, np.ndarray], dict, dict]:
    """A CTranslate2 Whisper directory -> (transformers state dict, HF config, generation config)."""
    src = Path(src)
    arrays, _ = read_ct2(src / "model.bin")
    ct2_config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    state = ct2_to_hf(arrays)
    heads_a, heads_t = int(arrays["encoder/num_heads"]), int(arrays["decoder/num_heads"])
    d = dims(state, heads_a, heads_t)
    cfg = hf_config(d, int(state["model.encoder.layers.0.fc1.weight"].shape[0]), ct2_config)
    if d["n_mels"] != PREPROCESSOR["feature_size"]:
        raise ConversionError(f"{src}: {d['n_mels']} mel bins; this converter writes the 80-bin feature extractor")
    return state, cfg, generation_config(cfg, ct2_config)


def write_hf(src: Path, out: Path) -> Path:
    """A CTranslate2 Whisper directory -> a transformers checkpoint directory at `out`."""
    from safetensors.numpy import save_file

    state, cfg, gen = convert_ct2(src)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    special = {k: TOKENIZER_CONFIG[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    shutil.copy2(Path(src) / "tokenizer.json", out / "tokenizer.json")
    return out


def load_hf_state(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    from safetensors.numpy import load_file

    cfg = json.loads((Path(path) / "config.json").read_text())
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{path}: no .safetensors weights")
    state: dict[str, np.ndarray] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state, cfg


def mlx_from_hf(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """A transformers Whisper checkpoint -> (mlx-whisper weights, mlx-whisper config)."""
    state, cfg = load_hf_state(path)
    return hf_to_mlx(state), dims(state, int(cfg["encoder_attention_heads"]), int(cfg["decoder_attention_heads"]))


def write_mlx(hf_dir: Path, out: Path) -> Path:
    """A transformers Whisper checkpoint -> the directory mlx-whisper's load_model reads."""
    from safetensors.numpy import save_file

    weights, d = mlx_from_hf(hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "weights.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "whisper", **d}, indent=2) + "\n")
    return out
