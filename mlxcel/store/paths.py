"""Where the model store lives."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mlxcel.config.paths import user_cache_dir


def store_root(explicit: Path | None, environ: Mapping[str, str]) -> Path:
    """--model-store-root, else MLXCEL_MODELS_DIR, else the user cache directory's models/."""
    if explicit:
        return Path(explicit).expanduser()
    if environ.get("MLXCEL_MODELS_DIR"):
        return Path(environ["MLXCEL_MODELS_DIR"]).expanduser()
    return user_cache_dir(environ) / "models"
