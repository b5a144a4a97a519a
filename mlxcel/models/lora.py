"""LoRA adapters served unfused: specs, loading, validation, live scales and per-row blocks.

An adapter is a directory: PEFT's layout (adapter_config.json with r / lora_alpha /
target_modules, adapter_model.safetensors holding lora_A [r, in] and lora_B [out, r] per
target linear) or mlx-lm's (adapter_config.json with lora_parameters, adapters.safetensors
holding lora_a [in, r] and lora_b [r, out]). Each target linear adds
`scale * factor * (x @ A^T) @ B^T`, factor being alpha / r (PEFT; alpha / sqrt(r) with
rslora) or mlx-lm's own `scale`. Base weights never change, so scales stay live: the server
holds one default scale per adapter (`LoraSet`), a request snapshots a scale vector when it
is submitted, and the backend turns the rows' vectors into one [B] block per adapter for
each batched forward (`scale_blocks`). Nothing here imports a tensor library.
"""

from __future__ import annotations

import json
import math
import re
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_WEIGHTS = "adapters.safetensors"
CONFIG = "adapter_config.json"
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_MLX_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[ab])$")
# PEFT options that change what a term computes; refused rather than served wrongly
_PEFT_REFUSED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights",
                 "modules_to_save": "modules_to_save (fully replaced modules)", "rank_pattern": "a per-module rank_pattern",
                 "alpha_pattern": "a per-module alpha_pattern", "lora_bias": "LoRA bias terms"}


class LoraError(ValueError):
    """An adapter that cannot be served: says which and why, in one line."""


@dataclass(frozen=True)
class AdapterSpec:
    path: Path
    scale: float = 1.0


def parse_scale(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise LoraError(f"{where}: scale {text!r} is not a number") from None
    if not math.isfinite(value):
        raise LoraError(f"{where}: scale {text!r} must be a finite number")
    return value


def parse_lora(value: str, spelling: str = "--lora") -> list[AdapterSpec]:
    """--lora FNAME[,FNAME...]: each at scale 1.0."""
    items = [p.strip() for p in value.split(",")]
    if not all(items):
        raise LoraError(f"{spelling} {value!r}: empty adapter path")
    return [AdapterSpec(Path(p).expanduser()) for p in items]


def parse_lora_scaled(value: str, spelling: str = "--lora-scaled") -> list[AdapterSpec]:
    """--lora-scaled FNAME:SCALE[,FNAME:SCALE...]; the scale is after the last colon."""
    out = []
    for item in (p.strip() for p in value.split(",")):
        path, sep, scale = item.rpartition(":")
        if not sep or not path:
            raise LoraError(f"{spelling} {item!r}: expected FNAME:SCALE")
        out.append(AdapterSpec(Path(path).expanduser(), parse_scale(scale, f"{spelling} {item}")))
    return out


def check_path(path: Path) -> None:
    """The cheap checks a startup does before loading anything."""
    if not path.exists():
        raise LoraError(f"LoRA adapter {path}: no such file or directory")
    if path.is_file():
        hint = " (a GGUF LoRA file)" if path.suffix.lower() == ".gguf" else ""
        raise LoraError(f"LoRA adapter {path}{hint}: mlxcel loads adapters as directories, PEFT's layout "
                        f"({CONFIG} + {PEFT_WEIGHTS}) or mlx-lm's ({CONFIG} + {MLX_WEIGHTS})")
    if not (path / CONFIG).is_file():
        raise LoraError(f"LoRA adapter {path}: no {CONFIG} in the directory")
    if not (path / PEFT_WEIGHTS).is_file() and not (path / MLX_WEIGHTS).is_file():
        raise LoraError(f"LoRA adapter {path}: neither {PEFT_WEIGHTS} nor {MLX_WEIGHTS} in the directory")


@dataclass
class Adapter:
    """One loaded adapter: module path -> (A [r, in], B scaled by the factor [out, r]), fp32."""

    path: Path
    terms: dict[str, tuple[np.ndarray, np.ndarray]]
    factor: float
    task_name: str = ""  # b10621 reads these from GGUF metadata; a PEFT / mlx-lm directory has none
    prompt_prefix: str = ""


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return {k: np.asarray(v, dtype=np.float32) for k, v in load_file(str(path)).items()}
    except Exception as e:  # a bf16 file: numpy has no bf16, torch reads it
        try:
            from safetensors.torch import load_file as load_torch

            return {k: v.float().numpy() for k, v in load_torch(str(path)).items()}
        except Exception:
            raise LoraError(f"LoRA adapter {path.parent}: cannot read {path.name} ({e})") from None


def load_adapter(path: Path) -> Adapter:
    check_path(path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except ValueError as e:
        raise LoraError(f"LoRA adapter {path}: {CONFIG} is not valid JSON ({e})") from None
    if (path / PEFT_WEIGHTS).is_file():
        return _load_peft(path, config)
    return _load_mlx(path, config)


def _load_peft(path: Path, config: dict) -> Adapter:
    for key, what in _PEFT_REFUSED.items():
        if config.get(key) not in (None, False, {}, [], "none"):
            raise LoraError(f"LoRA adapter {path}: {what} is not supported")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
        raise LoraError(f"LoRA adapter {path}: {CONFIG} needs a positive integer r and a numeric lora_alpha")
    factor = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in _read_safetensors(path / PEFT_WEIGHTS).items():
        m = _PEFT_KEY.match(key)
        if m is None:
            raise LoraError(f"LoRA adapter {path}: tensor {key!r} is not a lora_A / lora_B weight")
        pairs.setdefault(m["module"], {})[m["ab"]] = value
    return Adapter(path, _terms(path, pairs, factor), factor)


def _load_mlx(path: Path, config: dict) -> Adapter:
    params = config.get("lora_parameters") or {}
    r, scale = params.get("rank"), params.get("scale")
    if config.get("fine_tune_type", "lora") != "lora":
        raise LoraError(f"LoRA adapter {path}: fine_tune_type {config.get('fine_tune_type')!r} is not plain LoRA")
    if not isinstance(r, int) or r <= 0 or not isinstance(scale, (int, float)):
        raise LoraError(f"LoRA adapter {path}: {CONFIG} needs lora_parameters with an integer rank and a scale")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in _read_safetensors(path / MLX_WEIGHTS).items():
        m = _MLX_KEY.match(key)
        if m is None:
            raise LoraError(f"LoRA adapter {path}: tensor {key!r} is not a lora_a / lora_b weight")
        # mlx-lm stores x @ a @ b: a [in, r], b [r, out]; transposed into PEFT's orientation
        pairs.setdefault(m["module"], {})[m["ab"].upper()] = value.T
    return Adapter(path, _terms(path, pairs, float(scale)), float(scale))


def _terms(path: Path, pairs: dict[str, dict[str, np.ndarray]], factor: float):
    if not pairs:
        raise LoraError(f"LoRA adapter {path}: no LoRA tensors")
    out = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {path}: {module} has lora_{'B' if 'A' in ab else 'A'} missing")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"LoRA adapter {path}: {module} has A {a.shape} and B {b.shape}, which do not chain")
        out[module] = (np.ascontiguousarray(a), np.ascontiguousarray(b * np.float32(factor)))
    return out


def validate(adapter: Adapter, shapes: Mapping[str, tuple[int, int]]) -> None:
    """Every target must be a linear of the base ([out, in] in `shapes`) that A and B fit."""
    for module, (a, b) in adapter.terms.items():
        if module not in shapes:
            raise LoraError(f"LoRA adapter {adapter.path}: target module {module} is not a linear layer of the model")
        out, inp = shapes[module]
        if a.shape[1] != inp or b.shape[0] != out:
            raise LoraError(f"LoRA adapter {adapter.path}: {module} is [{out}, {inp}] in the model, but the adapter's "
                            f"A is {list(a.shape)} and B is {list(b.shape)}")


def checkpoint_shapes(path: Path, config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """[out, in] of every 2-D `<module>.weight` in a checkpoint's safetensors, read from the
    file headers only (an MLX-quantized weight is unpacked from its bits)."""
    q = config.get("quantization") or {}
    bits = q.get("bits") if isinstance(q, dict) else None
    shapes: dict[str, tuple[int, int]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if not name.endswith(".weight") or not isinstance(meta, dict) or len(meta.get("shape", ())) != 2:
                continue
            out, inp = meta["shape"]
            module = name[: -len(".weight")]
            if meta.get("dtype") == "U32" and bits:
                own = q.get(module)  # mlx-lm's per-layer entry, keyed by module path
                inp = inp * 32 // int(own.get("bits", bits) if isinstance(own, dict) else bits)
            shapes[module] = (int(out), int(inp))
    return shapes


class LoraSet:
    """The server's adapters, in id order, and their live default scales (POST /lora-adapters)."""

    def __init__(self, adapters: Sequence[Adapter], scales: Iterable[float]) -> None:
        self.adapters = list(adapters)
        self._scales = [float(s) for s in scales]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.adapters)

    def snapshot(self) -> tuple[float, ...]:
        with self._lock:
            return tuple(self._scales)

    def set(self, scales: Sequence[float]) -> None:
        with self._lock:
            self._scales = [float(s) for s in scales]

    def resolve(self, requested: Mapping[int, float]) -> tuple[float, ...]:
        """b10621's rule: listed ids take their scale, unlisted drop to 0.0, unknown ids are ignored."""
        return tuple(float(requested.get(i, 0.0)) for i in range(len(self.adapters)))

    def entries(self) -> list[dict[str, Any]]:
        """GET /lora-adapters: one entry per adapter, with the live default scale."""
        scales = self.snapshot()
        return [{"id": i, "path": str(a.path), "scale": scales[i], "task_name": a.task_name,
                 "prompt_prefix": a.prompt_prefix} for i, a in enumerate(self.adapters)]


def parse_request(entries: Any, what: str = "lora") -> dict[int, float]:
    """A list of {id, scale} as b10621 reads it: a missing or mistyped id is -1 (never an
    adapter), a missing or mistyped scale is 0.0; a later entry for an id wins."""
    if not isinstance(entries, list):
        raise LoraError(f"Error: '{what}' must be an array of objects with 'id' and 'scale' fields")
    out: dict[int, float] = {}
    for e in entries:
        e = e if isinstance(e, dict) else {}
        i, s = e.get("id", -1), e.get("scale", 0.0)
        i = i if isinstance(i, int) and not isinstance(i, bool) else (int(i) if isinstance(i, float) else -1)
        s = float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else 0.0
        out[i] = s
    return out


def active(scales: Sequence[float] | None) -> bool:
    return bool(scales) and any(s != 0.0 for s in scales)


def scale_blocks(rows: Sequence[Sequence[float] | None], n_adapters: int) -> dict[int, np.ndarray]:
    """Per adapter some row of the step uses, one fp32 [B] scale vector (0.0 for the other
    rows); empty when no row has a non-zero scale, so the forward is untouched."""
    blocks: dict[int, np.ndarray] = {}
    for i, scales in enumerate(rows):
        for k, s in enumerate(scales or ()):
            if s != 0.0 and k < n_adapters:
                if k not in blocks:
                    blocks[k] = np.zeros(len(rows), dtype=np.float32)
                blocks[k][i] = s
    return blocks


@dataclass
class ModuleTerms:
    """The terms one target linear carries: (adapter index, A^T [in, r], B'^T [r, out])."""

    terms: list[tuple[int, Any, Any]] = field(default_factory=list)


def by_module(adapters: Sequence[Adapter], convert) -> dict[str, ModuleTerms]:
    """module path -> its terms, with A^T and the factor-scaled B^T converted by `convert`
    (fp32 numpy -> the backend's tensor in its compute dtype)."""
    out: dict[str, ModuleTerms] = {}
    for k, adapter in enumerate(adapters):
        for module, (a, b) in adapter.terms.items():
            out.setdefault(module, ModuleTerms()).terms.append((k, convert(np.ascontiguousarray(a.T)),
                                                                convert(np.ascontiguousarray(b.T))))
    return out
