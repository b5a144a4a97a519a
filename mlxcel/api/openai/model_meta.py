"""The `meta` block of checkpoint facts a b10621 /v1/models data entry carries.

b10621 reads these from the GGUF it loaded; mlxcel reads them from the checkpoint directory:
config.json for the shape (n_vocab, n_ctx_train, n_embd), the tokenizer files for the
vocabulary type, and the safetensors headers (never the tensor data) for n_params and size.

- size: the bytes of every tensor payload in the directory's *.safetensors files (headers
  excluded), so quantization scales and biases count, as a GGUF's block scales do.
- n_params: the logical element count. A quantized weight is stored as U32 words packing
  32 / bits values each, so its elements are unpacked by the bit width config.json declares
  (per module where the quantization block overrides it); the `.scales` / `.biases` beside a
  quantized weight are quantization data, not parameters, and are left out.

A fact the checkpoint does not state is null rather than guessed.
"""

from __future__ import annotations

import json
import mmap
import re
from functools import lru_cache
from pathlib import Path

from mlxcel.models.checkpoint_config import normalize_config
from mlxcel.store.describe import weight_counts

# b10621's llama_vocab_type numbering
VOCAB_SPM, VOCAB_BPE, VOCAB_WPM, VOCAB_UGM = 1, 2, 3, 4


def _config_value(config: dict, *keys: str) -> int | None:
    """The first key present in config.json, or its text_config (vision-language checkpoints)."""
    for scope in (config, config.get("text_config") or {}):
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


# tokenizers serializes the model block as {"type": ..., <options>..., "vocab": ...}: its type and
# byte_fallback sit at the block's head, so a scan finds them without parsing a 30 MB vocabulary
_MODEL_TYPE = re.compile(rb'"model"\s*:\s*\{\s*"type"\s*:\s*"(\w+)"')
_BYTE_FALLBACK = re.compile(rb'"byte_fallback"\s*:\s*(true|false)')
_HEAD = 4096


def _tokenizer_model(tok: Path) -> tuple[str | None, bool]:
    """(the tokenizer.json model type, its byte_fallback); a full parse when the scan misses."""
    with tok.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as raw:
        found = _MODEL_TYPE.search(raw)
        if found is not None:
            head = raw[found.end(): found.end() + _HEAD]
            cut = head.find(b'"vocab"')
            fallback = _BYTE_FALLBACK.search(head[: cut if cut >= 0 else None])
            return found.group(1).decode(), fallback is not None and fallback.group(1) == b"true"
    model = json.loads(tok.read_text()).get("model") or {}
    return model.get("type"), bool(model.get("byte_fallback"))


def vocab_type(path: Path) -> int | None:
    """The tokenizer's algorithm in b10621's numbering: a byte-fallback BPE (Llama 2, Gemma)
    is SentencePiece's, a plain BPE is GPT-2's; WordPiece and Unigram map to WPM and UGM."""
    tok = path / "tokenizer.json"
    if tok.is_file():
        try:
            kind, byte_fallback = _tokenizer_model(tok)
        except (OSError, ValueError):
            return None
        if kind == "BPE":
            return VOCAB_SPM if byte_fallback else VOCAB_BPE
        return {"WordPiece": VOCAB_WPM, "Unigram": VOCAB_UGM}.get(kind)
    if (path / "tokenizer.model").is_file():
        return VOCAB_SPM
    return None


@lru_cache(maxsize=64)
def _cached(path: str, stamp: tuple) -> dict:
    p = Path(path)
    try:
        # normalised as the backends load it: a family's own names for the shape keys (DBRX's
        # max_seq_len) count under the common ones
        config = normalize_config(json.loads((p / "config.json").read_text()))
    except (OSError, ValueError):
        config = {}
    n_params, size = weight_counts(p, config)
    return {
        "vocab_type": vocab_type(p),
        "n_vocab": _config_value(config, "vocab_size", "n_vocab"),
        "n_ctx_train": _config_value(config, "max_position_embeddings", "n_positions", "max_target_positions",
                                     "n_text_ctx"),
        "n_embd": _config_value(config, "hidden_size", "d_model", "n_embd", "n_text_state"),
        "n_params": n_params,
        "size": size,
    }


def checkpoint_meta(path: Path) -> dict:
    """The checkpoint facts of one directory, re-read only when its weight files change."""
    p = Path(path)
    if not p.is_dir():
        return dict.fromkeys(("vocab_type", "n_vocab", "n_ctx_train", "n_embd", "n_params", "size"))
    stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(p.glob("*.safetensors")))
    return dict(_cached(str(p.resolve()), stamp))
