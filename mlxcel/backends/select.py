"""Backend and device selection: (--backend, --device) -> the concrete pair the model loads on.

`auto` picks MLX on Apple Silicon (Metal runs MLX's own quantized kernels), torch where CUDA is
present, and on a CPU-only machine torch when it is installed (measured faster than MLX's
Linux CPU wheel, docs/benchmarks.md), MLX-quantized checkpoints included: torch keeps their
weights packed and multiplies them in mlxcel's kernels (backends/torch/quantized.py), where
MLX's Linux CPU wheel runs its quantized products many times slower than its fp32 ones. A
quantization mode other than MLX's affine one (mxfp4, nvfp4, mxfp8) runs only on MLX. Without
torch it picks MLX and says so. An explicit request that cannot be honoured is refused with the reason, never
replaced. torch is imported only when torch may be chosen, so the MLX path (`--backend mlx`,
or auto on a Mac) never loads it.
"""

from __future__ import annotations

import importlib.util
import platform
import re
from dataclasses import dataclass

BACKENDS = ("auto", "mlx", "torch")
DEVICE_FORMS = "auto, cpu, cuda, cuda:N, mps, metal"
_DEVICE = re.compile(r"^(auto|cpu|mps|metal|cuda(:\d+)?)$")


class BackendRefused(ValueError):
    pass


@dataclass(frozen=True)
class Choice:
    backend: str  # mlx | torch
    device: str  # mlx: cpu | metal; torch: cpu | cuda:N | mps
    reason: str  # one line for the startup log


def apple_silicon(system: str | None = None, machine: str | None = None) -> bool:
    return (system or platform.system()) == "Darwin" and (machine or platform.machine()) == "arm64"


def torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def quantization_mode(config: dict) -> str | None:
    """The checkpoint's quantization as choose() takes it: None (unquantized), "affine" (MLX's
    affine form, which both backends run), or another mode's name (MLX only); a
    `quantization_config` without MLX's block (GPTQ, bitsandbytes, ...) is named by its method."""
    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:
        return str(q.get("mode") or "affine")
    other = q or config.get("quantization_config")
    if not other:
        return None
    return str(other.get("quant_method") or other.get("mode") or "unknown") if isinstance(other, dict) else str(other)


def check_device(device: str) -> str:
    if not _DEVICE.match(device):
        raise BackendRefused(f"invalid device {device!r} (expected one of: {DEVICE_FORMS})")
    return device


def _torch_device(device: str) -> str:
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda:0"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if device == "metal":
        device = "mps"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BackendRefused(f"--device {device}: this torch build sees no CUDA device "
                                 f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'})")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise BackendRefused(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return f"cuda:{index}"
    if device == "mps" and not torch.backends.mps.is_available():
        raise BackendRefused("--device mps: torch reports no MPS device on this machine")
    return device


def _mlx_device(device: str, apple: bool) -> str:
    if device.startswith("cuda"):
        raise BackendRefused(f"--device {device}: the MLX backend has no CUDA device; use --backend torch")
    if device in ("metal", "mps"):
        if not apple:
            raise BackendRefused(f"--device {device}: Metal exists only on Apple Silicon; use --device cpu")
        return "metal"
    if device == "auto":
        return "metal" if apple else "cpu"
    return "cpu"


def choose(backend: str, device: str, *, apple: bool | None = None, has_torch: bool | None = None,
           quantized: str | None = None, vision: bool = False, vision_mlx: bool = False,
           mlx_only: str | None = None) -> Choice:
    """The concrete backend and device for the flags; idempotent on its own output.

    `quantized`: the checkpoint's quantization_mode(): "affine" runs on both backends, another
    mode only on MLX.
    `vision`: a vision-language checkpoint (models/vision.py); `vision_mlx`: one whose family
    the MLX backend serves too (models/vision_mlx.py), else only torch serves it.
    `mlx_only`: why only MLX serves the checkpoint's family (registry.mlx_only), else None."""
    if backend not in BACKENDS:
        raise BackendRefused(f"invalid backend {backend!r} (expected one of: {', '.join(BACKENDS)})")
    check_device(device)
    apple = apple_silicon() if apple is None else apple
    if vision and not vision_mlx and backend == "mlx":
        raise BackendRefused("--backend mlx: this vision-language family is served only by the torch backend; "
                             "use --backend torch")
    mlx_quantized = quantized is not None and quantized != "affine"  # a form only MLX runs
    if vision and vision_mlx and backend == "auto":
        return _auto_vision_mlx(device, apple, quantized, has_torch)
    if vision and backend == "auto":
        if quantized or not (torch_installed() if has_torch is None else has_torch):
            raise BackendRefused("this vision-language checkpoint needs the torch backend"
                                 + (", which cannot load a quantized vision-language checkpoint" if quantized
                                    else ", and torch is not installed (pip install 'mlxcel[torch]')"))
        return Choice("torch", _torch_device(device), "auto: a vision-language checkpoint runs on torch")
    if backend == "mlx":
        return Choice("mlx", _mlx_device(device, apple), "requested")
    if backend == "torch":
        if mlx_only:
            raise BackendRefused(f"--backend torch: {mlx_only}; serve it with --backend mlx")
        if mlx_quantized:
            raise BackendRefused(f"--backend torch: this checkpoint is quantized as {quantized}, which the torch "
                                 "backend cannot run (it runs MLX's affine quantization); serve it with --backend mlx, "
                                 "or point -m at the unquantized checkpoint")
        if not (torch_installed() if has_torch is None else has_torch):
            raise BackendRefused("--backend torch: torch is not installed (pip install 'mlxcel[torch]', or a CUDA "
                                 "build of torch 2.13 from download.pytorch.org for NVIDIA GPUs)")
        return Choice("torch", _torch_device(device), "requested")
    # auto
    if device in ("metal",) or (apple and device in ("auto", "cpu", "mps")):
        return Choice("mlx", _mlx_device(device, apple), "auto: Apple Silicon runs MLX")
    if mlx_quantized or mlx_only:
        what = f"this {quantized}-quantized checkpoint" if mlx_quantized else "this family"
        if device.startswith("cuda") or (device == "mps" and not apple):
            raise BackendRefused(f"--device {device}: {what} runs only on the MLX backend, which has no such "
                                 f"device here")
        return Choice("mlx", _mlx_device(device, apple),
                      f"auto: {quantized}-quantized checkpoint, which only MLX runs" if mlx_quantized
                      else f"auto: {mlx_only}")
    has_torch = torch_installed() if has_torch is None else has_torch
    if not has_torch:
        if device.startswith("cuda") or device == "mps":
            raise BackendRefused(f"--device {device} needs the torch backend, and torch is not installed")
        return Choice("mlx", "cpu", "auto: torch is not installed, so MLX on the CPU")
    chosen = _torch_device(device)
    if chosen == "cpu" and quantized:
        return Choice("torch", "cpu", "auto: MLX-quantized checkpoint on a CPU-only machine: torch keeps the weights "
                                      "packed and runs them in mlxcel's kernels, where MLX's CPU wheel runs quantized "
                                      "products slower than its fp32 ones")
    if chosen == "cpu":
        return Choice("torch", "cpu", "auto: CPU-only machine, torch decodes faster here than MLX's CPU wheel")
    why = "auto: CUDA present" if chosen.startswith("cuda") else "auto: torch on MPS"
    return Choice("torch", chosen, why)


def _auto_vision_mlx(device: str, apple: bool, quantized: str | None, has_torch: bool | None) -> Choice:
    """auto for a vision-language family both backends serve: MLX on Apple Silicon (as for text),
    and wherever torch cannot take it (not installed, or a quantized checkpoint, whose vision
    tower torch cannot load); otherwise torch, which decodes faster on a CPU-only machine and
    runs CUDA."""
    if device == "metal" or (apple and device in ("auto", "cpu", "mps")):
        return Choice("mlx", _mlx_device(device, apple), "auto: Apple Silicon runs MLX (mlx-vlm's vision towers)")
    has_torch = torch_installed() if has_torch is None else has_torch
    if quantized or not has_torch:
        if device.startswith("cuda") or device == "mps":
            raise BackendRefused(f"--device {device}: this vision-language checkpoint runs here only on the MLX "
                                 "backend, which has no such device")
        why = "a quantized vision-language checkpoint, which torch cannot load" if quantized else \
            "torch is not installed"
        return Choice("mlx", _mlx_device(device, apple), f"auto: {why}, so MLX")
    return Choice("torch", _torch_device(device), "auto: a vision-language checkpoint runs on torch off Apple Silicon")
