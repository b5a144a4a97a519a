"""Where the model store lives."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def store_root(explicit: Path | None, environ: Mapping[str, str]) -> Path:
    """--model-store-root, else MLXCEL_MODELS_DIR, else MLXCEL_CACHE_DIR/models, else ~/.cache."""
    if explicit:
        return Path(explicit).expanduser()
    if environ.get("MLXCEL_MODELS_DIR"):
        return Path(environ["MLXCEL_MODELS_DIR"]).expanduser()
    if environ.get("MLXCEL_CACHE_DIR"):
        return Path(environ["MLXCEL_CACHE_DIR"]).expanduser() / "models"
    return Path.home() / ".cache" / "mlxcel" / "models"
