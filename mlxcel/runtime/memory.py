"""The one memory clean-up after a model (or a sleeping engine's backend) is let go: collect
the dropped objects, then hand the allocators' cached buffers back (MLX's cache, CUDA's).

The model host (runtime/host.py) runs it after every unload and failed load, and hands it to
each engine it loads for --sleep-idle-seconds. `peak_memory_text` says how much was used."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path


def release_memory() -> None:
    gc.collect()
    try:
        # only the frameworks already imported: the MLX path must never load torch
        if "mlx.core" in sys.modules:
            sys.modules["mlx.core"].clear_cache()
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
            sys.modules["torch"].cuda.empty_cache()
    except Exception:  # noqa: BLE001 - freeing caches is best effort
        pass


def peak_memory_text() -> str:
    """The process's peak resident memory, and the framework's own peak where it keeps one (MLX's
    allocator, torch on CUDA): what `mlxcel generate` reports after an answer."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    parts = [f"{_mib(rss)} resident"]
    try:
        mx = sys.modules.get("mlx.core")
        if mx is not None and mx.get_peak_memory() > 0:
            parts.append(f"{_mib(mx.get_peak_memory())} MLX")
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
            parts.append(f"{_mib(torch.cuda.max_memory_allocated())} CUDA")
    except Exception:  # noqa: BLE001 - a report, never a failure
        pass
    return ", ".join(parts)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of host RAM; None where the platform does not say."""
    total = avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if total is None and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            pass
    return total, avail
