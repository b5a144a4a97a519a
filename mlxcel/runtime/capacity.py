"""Whether a model switch can load a checkpoint, decided while the loaded model still serves:
not a generation checkpoint, a quantization the backend cannot run, weights over the memory
budget. A refusal carries the HTTP status and code the API answers with."""

from __future__ import annotations

import json
from pathlib import Path

from mlxcel.backends.select import Choice
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings
from mlxcel.models.registry import UnsupportedModelType, family_for
from mlxcel.runtime.estimate import available_bytes
from mlxcel.runtime.load import select_backend
from mlxcel.runtime.served import ServedModel


class LoadRefused(Exception):
    """A model switch refused before the loaded model is touched: HTTP status, code, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def estimated_bytes(path: Path, compute_dtype: str | None) -> int:
    """The weights' size once loaded: the safetensors bytes, rescaled to the compute dtype
    when unquantized weights are cast (bf16 on disk -> fp32 on a CPU doubles them)."""
    stored = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    config = json.loads((Path(path) / "config.json").read_text())
    if config.get("quantization") or config.get("quantization_config"):
        return stored
    ckpt = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    src, dst = _ITEMSIZE.get(ckpt, 4), _ITEMSIZE.get(compute_dtype or ckpt, 4)
    return stored * dst // src


def check_loadable(settings: ServerSettings, path: Path, current: ServedModel | None,
                   placed: Choice | None = None) -> int:
    """Everything a switch to `path` can be refused for while `current` (the loaded model, or
    None) still serves: not a generation checkpoint, a quantization this backend cannot run,
    weights larger than the memory budget. Returns the estimate. `placed`: the backend and device
    settled at startup, which the switch target would be loaded on."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise LoadRefused(500, "model_load_failed", f"{path} has no readable config.json ({e})") from None
    try:
        family_for(config)  # on config.json alone, whichever backend would load it
    except UnsupportedModelType as e:
        raise LoadRefused(500, "model_load_failed", str(e)) from None
    if not any(Path(path).glob("*.safetensors")):
        raise LoadRefused(500, "model_load_failed", f"{path} holds no *.safetensors weights")
    quant = config.get("quantization")
    try:
        choice = select_backend(settings, Path(path), placed)
    except StartupRefusal as e:
        code = "unsupported_quantization" if quant else "model_load_failed"
        raise LoadRefused(400 if quant else 500, code, str(e)) from None
    dtype = current.info.dtype if current is not None and not quant else None
    need = estimated_bytes(path, dtype)
    if settings.engine.model_memory_budget_mib is not None:
        budget, where = settings.engine.model_memory_budget_mib << 20, "the --model-memory-budget"
    else:
        free = available_bytes(choice)[0]
        if free is None:
            return need
        freed = estimated_bytes(current.info.path, current.info.dtype) if current is not None else 0
        budget, where = free + freed, f"the free memory on {choice.device} (after unloading the loaded model)"
    if need > budget:
        raise LoadRefused(503, "insufficient_memory",
                          f"{path.name} needs about {need >> 20} MiB for its weights on {choice.device}, more than "
                          f"{where} of {budget >> 20} MiB")
    return need
