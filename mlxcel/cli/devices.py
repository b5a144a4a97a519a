"""The devices this machine offers a model: the CPU (its SIMD features and memory), CUDA devices
through torch where it is installed, Metal through MLX where it runs. `--list-devices` and
`mlxcel inspect --list-devices` print them; a framework that is absent is said to be, never
imported to fail.
"""

from __future__ import annotations

import importlib.util
import os
import platform

from mlxcel.native_build import cpu_flags
from mlxcel.runtime.memory import host_memory

# the instruction-set features the kernels and frameworks use, in the order they are printed
SIMD = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
        "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm")


def cpu_features() -> list[str]:
    """The SIMD features /proc/cpuinfo lists (x86 `flags`, arm64 `Features`), in SIMD's order."""
    flags = cpu_flags()
    return [f for f in SIMD if f in flags]


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.1f} GiB"


def device_lines() -> list[str]:
    total, avail = host_memory()
    features = cpu_features()
    lines = [f"cpu: {platform.machine() or '?'}, {os.cpu_count() or '?'} threads, memory {_gib(total)} total, "
             f"{_gib(avail)} available; SIMD: {', '.join(features) or 'none listed'}"]
    if importlib.util.find_spec("torch") is None:
        lines.append("cuda: torch is not installed")
    else:
        import torch

        if not torch.cuda.is_available():
            lines.append(f"cuda: none (torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'})")
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            p = torch.cuda.get_device_properties(i)
            free, size = torch.cuda.mem_get_info(i)
            lines.append(f"cuda:{i}: {p.name}, compute capability {p.major}.{p.minor}, memory {_gib(size)} total, "
                         f"{_gib(free)} free")
    lines.append(_metal_line())
    return lines


def _metal_line() -> str:
    if importlib.util.find_spec("mlx") is None:
        return "metal: MLX is not installed"
    import mlx.core as mx

    if not mx.metal.is_available():
        return "metal: none (MLX runs on the CPU here)"
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return (f"metal: {info.get('device_name', 'Apple GPU')}, memory {_gib(info.get('memory_size'))}, recommended "
            f"working set {_gib(info.get('max_recommended_working_set_size'))}")


def print_devices() -> None:
    for line in device_lines():
        print(line)
