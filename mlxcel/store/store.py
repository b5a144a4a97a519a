"""The model store's contents: listing, removing and downloading `<owner>/<name>` snapshots.

A directory counts as a model only when it holds a checkpoint (config.json or a
*.safetensors file), so a half-finished download is never offered. Downloads land in a
staging directory and are renamed into place when complete. Removal is containment-checked:
a name can never delete anything outside the store root.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxcel.config.progress import tqdm_class
from mlxcel.store.repo_id import expand, parse_repo_id
from mlxcel.store.resolve import store_entry

log = logging.getLogger("mlxcel.store")

STAGING = ".staging"

# What an MLX snapshot needs; GGUF, PyTorch and TF weights in the same repository are skipped.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py", "*.md"]


class DownloadFailed(RuntimeError):
    pass


class NotInStore(LookupError):
    pass


@dataclass(frozen=True)
class StoreEntry:
    repo_id: str
    path: Path
    size_bytes: int
    model_type: str | None
    quantization: str | None


def _describe(path: Path) -> tuple[str | None, str | None]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    q = config.get("quantization")
    quant = f"{q.get('bits')}bit" if isinstance(q, dict) and q.get("bits") else None
    return config.get("model_type"), quant


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def list_models(root: Path) -> list[StoreEntry]:
    """Every `<owner>/<name>` under `root` that holds a checkpoint, sorted by id."""
    entries = []
    if not root.is_dir():
        return entries
    for owner in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for repo in sorted(p for p in owner.iterdir() if p.is_dir() and not p.name.startswith(".")):
            repo_id = f"{owner.name}/{repo.name}"
            if store_entry(root, repo_id) is None:
                continue
            model_type, quant = _describe(repo)
            entries.append(StoreEntry(repo_id, repo, _size(repo), model_type, quant))
    return entries


def cache_list_text(root: Path) -> str:
    """b10621's --cache-list shape: a count line, then one numbered repository id per line."""
    entries = list_models(root)
    lines = [f"number of models in cache: {len(entries)}"]
    lines += [f"{i:4d}. {e.repo_id}" for i, e in enumerate(entries, 1)]
    return "\n".join(lines) + "\n"


def _contained(root: Path, path: Path) -> bool:
    root_r, path_r = root.resolve(), path.resolve()
    return path_r != root_r and root_r in path_r.parents


def remove(ref: str, root: Path, default_org: str = "mlx-community") -> Path:
    """Delete `<root>/<owner>/<name>` (a bare name is expanded); return the removed path."""
    repo_id = expand(ref, default_org)
    owner, name = parse_repo_id(repo_id)
    path = root / owner / name
    if path.is_symlink() or not path.is_dir():
        raise NotInStore(f"{repo_id} is not in the model store {root}")
    if not _contained(root, path):
        raise NotInStore(f"{repo_id} resolves outside the model store {root}; refusing to delete it")
    shutil.rmtree(path)
    try:
        (root / owner).rmdir()  # drop the owner directory once it is empty
    except OSError:
        pass
    return path


def _snapshot_download(repo_id: str, local_dir: Path, hf_token: str | None) -> None:
    from huggingface_hub import snapshot_download

    # a bar on a terminal, plain periodic lines in a log (config/progress.py)
    snapshot_download(repo_id=repo_id, local_dir=str(local_dir), token=hf_token, allow_patterns=DOWNLOAD_PATTERNS,
                      tqdm_class=tqdm_class())


def download(
    repo_id: str,
    root: Path,
    *,
    hf_token: str | None = None,
    offline: bool = False,
    fetch: Callable[[str, Path, str | None], None] = _snapshot_download,
) -> Path:
    """Fetch `repo_id` into `<root>/<owner>/<name>` and return it; refused when offline."""
    owner, name = parse_repo_id(repo_id)
    if offline:
        raise DownloadFailed(f"--offline forbids downloading {repo_id}")
    target = root / owner / name
    # A stable staging name lets an interrupted download resume where it stopped.
    staging = root / STAGING / f"{owner}--{name}"
    staging.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s from Hugging Face into %s", repo_id, target)
    try:
        fetch(repo_id, staging, hf_token)
    except Exception as e:  # the hub client raises many types; all mean "no checkpoint"
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise DownloadFailed(f"downloading {repo_id} failed: {type(e).__name__}: {first_line}") from None
    if not (staging / "config.json").is_file() or not any(staging.glob("*.safetensors")):
        shutil.rmtree(staging, ignore_errors=True)
        raise DownloadFailed(f"{repo_id} has no config.json + *.safetensors, so it is not an MLX checkpoint")
    shutil.rmtree(staging / ".cache", ignore_errors=True)  # the hub client's resume metadata
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    try:
        (root / STAGING).rmdir()
    except OSError:
        pass
    return target
