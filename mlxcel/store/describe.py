"""What a checkpoint in the store is, read from its files without loading a weight: the
architecture, the parameter count (from the safetensors headers), the quantization, the context
length, the dtype, and the chat template. `mlxcel show` prints it; the API's /v1/models meta
(api/openai/model_meta.py) counts weights with the same `weight_counts`, and its docstring
says how size and n_params are counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from mlxcel.store.tensor_scan import entries

_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length", "max_seq_len")


@dataclass(frozen=True)
class CheckpointSummary:
    path: Path
    model_type: str | None
    architectures: list[str]
    parameters: int | None  # None: the headers do not say (a packed weight without a declared width)
    quantization: str | None  # "4-bit, group 64", or None for full precision
    context_length: int | None
    dtype: str | None
    size_bytes: int
    chat_template: str | None  # the checkpoint's own template text


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else {}


def context_length(config: dict) -> int | None:
    for source in (config, _text_config(config)):
        for key in _CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def quantization(config: dict) -> str | None:
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    bits = q.get("bits")
    method = q.get("quant_method") or q.get("mode")
    label = f"{bits}-bit" if bits else str(method or "quantized")
    if q.get("group_size"):
        label += f", group {q['group_size']}"
    if method and bits:
        label += f" ({method})"
    return label


_PACKED = {"U32", "U8", "I32"}  # the dtypes MLX packs quantized values into
_BITS_PER_WORD = {"U32": 32, "I32": 32, "U8": 8}


def _module_bits(quant: dict, module: str) -> int | None:
    own = quant.get(module)
    if isinstance(own, dict) and "bits" in own:
        return int(own["bits"])
    return int(quant["bits"]) if "bits" in quant else None


def weight_counts(path: Path, config: dict) -> tuple[int | None, int | None]:
    """(n_params, size in bytes) from the safetensors headers; (None, None) without any, or when
    one is unreadable (a listing reports what it cannot know as null, it does not fail)."""
    try:
        tensors = {e.name: e for e in entries(path)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # json's decode error is a ValueError
        return None, None
    if not tensors:
        return None, None
    quant = config.get("quantization") or config.get("quantization_config") or {}
    quantized = {name.removesuffix(".weight") for name, t in tensors.items()
                 if name.endswith(".weight") and t.dtype in _PACKED
                 and name.removesuffix(".weight") + ".scales" in tensors}
    n_params: int | None = 0
    size = 0
    for name, t in tensors.items():
        size += t.end - t.start
        module, _, leaf = name.rpartition(".")
        if n_params is None or (module in quantized and leaf in ("scales", "biases")):
            continue
        count = math.prod(t.shape)
        if module in quantized and leaf == "weight":
            bits = _module_bits(quant, module)
            if bits is None:  # packed without a declared width: the count is unknowable
                n_params = None
                continue
            count = count * _BITS_PER_WORD[t.dtype] // bits
        n_params += count
    return n_params, size


def chat_template(path: Path) -> str | None:
    """The template a tokenizer would load: chat_template.jinja, else chat_template.json, else
    tokenizer_config.json's `chat_template` (a named list: the "default" one, else the first)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            value = json.loads((path / name).read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default") or next(iter(named.values()), None)
        if isinstance(value, str) and value:
            return value
    return None


def describe(path: Path) -> CheckpointSummary:
    config = json.loads((path / "config.json").read_text())
    text = _text_config(config)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return CheckpointSummary(
        path=path,
        model_type=config.get("model_type"),
        architectures=list(config.get("architectures") or []),
        parameters=weight_counts(path, config)[0],
        quantization=quantization(config),
        context_length=context_length(config),
        dtype=config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype"),
        size_bytes=size,
        chat_template=chat_template(path),
    )
