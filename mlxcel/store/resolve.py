"""Resolve a `-m` reference to a checkpoint directory (interface; implemented by the store work)."""

from __future__ import annotations

from pathlib import Path


class ModelSourceRefused(ValueError):
    """The reference names something mlxcel will not load (GGUF, shard, URL, ...)."""


class ModelNotAvailable(LookupError):
    """The reference is well-formed but no checkpoint can be had (offline, missing)."""


def resolve_model(
    ref: str,
    *,
    root: Path,
    default_org: str = "mlx-community",
    offline: bool = False,
    hf_token: str | None = None,
) -> Path:
    p = Path(ref).expanduser()
    if p.is_dir():
        return p
    candidate = root / (ref if "/" in ref else f"{default_org}/{ref}")
    if (candidate / "config.json").is_file():
        return candidate
    raise ModelNotAvailable(f"model {ref!r} not found in {root}")
