"""Where mlxcel keeps its per-user files, by the XDG base-directory convention."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def xdg_cache_dir(environ: Mapping[str, str]) -> Path:
    """$XDG_CACHE_HOME/mlxcel, else ~/.cache/mlxcel (built kernels live here)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(base).expanduser() / "mlxcel"


def user_cache_dir(environ: Mapping[str, str]) -> Path:
    """$MLXCEL_CACHE_DIR, else the XDG cache directory: the model store and the chat history."""
    if environ.get("MLXCEL_CACHE_DIR"):
        return Path(environ["MLXCEL_CACHE_DIR"]).expanduser()
    return xdg_cache_dir(environ)
