"""The one memory clean-up after a model (or a sleeping engine's backend) is let go: collect
the dropped objects, then hand the allocators' cached buffers back (MLX's cache, CUDA's).

The model host (runtime/host.py) runs it after every unload and failed load, and hands it to
each engine it loads for --sleep-idle-seconds."""

from __future__ import annotations

import gc
import sys


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
