"""What a server configuration will hold in memory, worked out before any weight is read, and
whether the device has room for it.

- weights: every tensor in the safetensors headers, floating ones at the compute dtype the
  chosen backend would use (its own `resolve_dtype`), packed (quantized) ones at their stored size;
- KV: the spec the backend would report (engine/kv_memory.spec_from_config) sized by the KV
  manager's own rule for -c / -np / the prefix-cache budget (engine/kv_memory.pool_bytes);
- available: the host's available RAM on a CPU, the device's free memory on CUDA, MLX's
  recommended working set on Metal.

`mlxcel-server --estimate-memory` prints `render(...)`; startup (`--fit on`, the default) calls
`check_fits`, which refuses in one line, saying by how much, when weights and the slots' KV
exceed what is available (and when an explicit prefix-cache budget does).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from mlxcel.backends.select import Choice
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings
from mlxcel.engine.kv_manager import KVManager
from mlxcel.engine.kv_memory import KVBytes, pool_bytes, slot_share, spec_from_config
from mlxcel.models.checkpoint_config import read_config
from mlxcel.runtime.memory import host_memory
from mlxcel.store.tensor_scan import entries

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_FLOATING = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_MIB = 1 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    choice: Choice
    compute_dtype: str
    weight_bytes: int
    kv: KVBytes
    cache_explicit: bool  # the prefix-cache budget was given (--cache-ram / --prompt-cache-capacity-bytes)
    draft_bytes: int = 0  # a -md draft model's weights and KV pool

    @property
    def required_bytes(self) -> int:
        """Weights and every slot at its full context: what serving needs at the least."""
        return self.total_bytes - self.kv.prefix_cache_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv.capacity_bytes + self.draft_bytes


def weight_bytes(path: Path, compute_dtype: str) -> int:
    """The weights once loaded: floating tensors cast to `compute_dtype`, packed ones as stored."""
    size = ITEMSIZE[compute_dtype]
    total = 0
    try:
        for t in entries(path):
            total += math.prod(t.shape) * size if t.dtype in _FLOATING else t.end - t.start
    except (ValueError, KeyError, OSError) as e:
        raise StartupRefusal(f"{path}: cannot read the safetensors headers: {e}") from None
    return total


def compute_dtype(settings: ServerSettings, path: Path, choice: Choice) -> str:
    """The dtype the chosen backend computes in for this checkpoint (each backend's own rule)."""
    config = json.loads((Path(path) / "config.json").read_text())
    if choice.backend == "torch":
        import torch

        from mlxcel.backends.torch.backend import resolve_dtype

        ckpt = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        return resolve_dtype(settings.backend.dtype, ckpt, torch.device(choice.device))
    import mlx.core as mx

    from mlxcel.backends.mlx.backend import resolve_dtype

    if choice.device == "cpu":  # as runtime/load.py sets it before the backend loads
        mx.set_default_device(mx.cpu)
    return resolve_dtype(settings.backend.dtype, str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"))


def estimate(settings: ServerSettings, path: Path, choice: Choice, cache_budget: int | None,
             draft: Path | None = None) -> MemoryEstimate:
    """The estimate for serving `path` on `choice` with these settings; `cache_budget`: the
    prefix cache's byte budget as runtime/load.cache_budget_bytes resolves it; `draft`: a -md
    draft checkpoint, whose weights and pool (a slot share each, no cache of its own) count too."""
    dtype = compute_dtype(settings, path, choice)
    config = read_config(path)
    n_ctx = settings.engine.ctx_size if settings.engine.ctx_size > 0 else context_length(config)
    n_ctx_slot, parallel = slot_share(n_ctx, settings.engine.parallel, settings.engine.kv_unified)
    manager = KVManager(n_ctx_slot=n_ctx_slot, parallel=parallel,
                        budget_bytes=cache_budget if settings.kv.cache_prompt else 0)
    kv = pool_bytes(manager, _spec(path, dtype, choice))
    draft_bytes = 0
    if draft is not None:  # as engine/speculative.ModelDrafter sizes its pool
        draft_dtype = compute_dtype(settings, draft, choice)
        pool = KVManager(n_ctx_slot=n_ctx_slot, parallel=parallel, budget_bytes=None, headroom=0)
        draft_bytes = weight_bytes(draft, draft_dtype) + pool_bytes(pool, _spec(draft, draft_dtype, choice)).capacity_bytes
    explicit = settings.kv.prompt_cache_capacity_bytes is not None or "cache_ram" in settings.cli_given
    return MemoryEstimate(choice, dtype, weight_bytes(path, dtype), kv, explicit, draft_bytes)


def _spec(path: Path, dtype: str, choice: Choice):
    return spec_from_config(read_config(path), ITEMSIZE[dtype], conv_keeps_kernel=choice.backend == "torch")


def context_length(config: dict) -> int:
    text = {**config.get("text_config", {}), **config}
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        if isinstance(text.get(key), int) and text[key] > 0:
            return text[key]
    return 4096


def available_bytes(choice: Choice) -> tuple[int | None, str]:
    """(bytes available where the model will live, what that figure is); None when unknown."""
    if choice.device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(choice.device))
        return int(free), f"free memory on {choice.device}"
    if choice.device == "metal" and choice.backend == "mlx":
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return int(info["max_recommended_working_set_size"]), "Metal's recommended working set"
    return host_memory()[1], "available RAM"


def mib(n: int) -> str:
    return f"{n / _MIB:,.1f} MiB"


def render(est: MemoryEstimate, available: int | None, where: str) -> list[str]:
    """The --estimate-memory report, one figure a line."""
    kv = est.kv
    cache = "off" if kv.prefix_cache_bytes == 0 else mib(kv.prefix_cache_bytes)
    rows = [
        ("backend", f"{est.choice.backend} on {est.choice.device}, compute dtype {est.compute_dtype}"),
        ("weights", mib(est.weight_bytes)),
        ("KV per token", f"{kv.bytes_per_token:,} bytes"),
        ("KV per slot", f"{mib(kv.per_slot_bytes)} ({kv.n_ctx_slot} tokens of context"
                        + (f", {kv.state_bytes:,} bytes of recurrent state" if kv.state_bytes else "") + ")"),
        ("slots", f"{kv.parallel} = {mib(kv.slots_bytes)}"),
        ("prefix cache", cache),
        *((("draft model", f"{mib(est.draft_bytes)} (weights and KV)"),) if est.draft_bytes else ()),
        ("total", mib(est.total_bytes)),
        (where, mib(available) if available is not None else "unknown"),
    ]
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]


def check_fits(est: MemoryEstimate, available: int | None, where: str) -> str | None:
    """Refuse (StartupRefusal) a configuration whose weights and slots exceed `available`, or
    whose explicit prefix-cache budget then does; a warning line when only mlxcel's default
    prefix-cache budget does not fit, else None."""
    if available is None:
        return None
    kv = est.kv
    need = est.required_bytes if est.required_bytes > available or not est.cache_explicit else est.total_bytes
    cache = need == est.total_bytes and kv.prefix_cache_bytes > 0  # the cache's budget is part of the shortfall
    if need > available:
        raise StartupRefusal(
            f"this configuration needs about {mib(need)} on {est.choice.device} (weights {mib(est.weight_bytes)}, "
            f"KV {mib(kv.slots_bytes)} for {kv.parallel} slot(s) of {kv.n_ctx_slot} tokens"
            + (f", draft model {mib(est.draft_bytes)}" if est.draft_bytes else "")
            + (f", prefix cache {mib(kv.prefix_cache_bytes)}" if cache else "")
            + f"), {mib(need - available)} more than the {mib(available)} of {where}; lower -c or -np"
            + (" or --cache-ram" if cache else "") + ", or pass --fit off to start anyway")
    if est.total_bytes > available:
        return (f"the prefix cache's default budget ({mib(kv.prefix_cache_bytes)}) does not fit beside the weights "
                f"and slots in the {mib(available)} of {where}; it could run out of memory once full (lower --cache-ram)")
    return None
