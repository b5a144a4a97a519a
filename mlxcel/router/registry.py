"""The router's model inventory: which names exist, where their checkpoints are, what they carry.

Three sources, later ones winning a name (b10621's precedence): the model store ("cache",
its `<owner>/<name>` generation checkpoints, removable), --models-dir ("models_dir", each
direct subdirectory holding a config.json is a model named by the directory; a symlink that
resolves outside the directory is skipped, so the directory cannot smuggle in a path), and
--models-preset ("preset", sections with `model =` or `hf-repo =`; a section without either
overlays its configuration onto the discovered model of the same name). Names and aliases must
not collide; a collision is refused, never resolved by picking one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel.models.registry import UnsupportedModelType, family_for
from mlxcel.router.preset import Preset, PresetSection
from mlxcel.store.repo_id import InvalidRepoId, expand, parse_repo_id
from mlxcel.store.store import list_models

log = logging.getLogger("mlxcel.router")

CACHE, MODELS_DIR, PRESET = "cache", "models_dir", "preset"


class RegistryError(ValueError):
    """The sources contradict each other (a name twice, an alias clash, a preset naming nothing)."""


@dataclass
class ModelEntry:
    name: str
    source: str  # cache | models_dir | preset
    path: Path | None  # the checkpoint directory (None: an hf-repo preset whose snapshot is not in the store)
    repo_id: str | None = None  # cache entries and hf-repo presets: the store's owner/name
    aliases: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    sections: list[PresetSection] = field(default_factory=list)  # the preset sections applied, global first
    load_on_startup: bool = False


def _generation_checkpoint(path: Path) -> bool:
    try:
        family_for(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, UnsupportedModelType):
        return False
    return True


def scan_cache(root: Path | None) -> list[ModelEntry]:
    if root is None:
        return []
    return [ModelEntry(e.repo_id, CACHE, e.path, repo_id=e.repo_id) for e in list_models(Path(root))
            if _generation_checkpoint(e.path)]


def scan_models_dir(directory: Path | None) -> list[ModelEntry]:
    if directory is None or not directory.is_dir():
        return []
    base = directory.resolve()
    out = []
    for child in sorted(directory.iterdir()):
        if child.name.startswith("."):
            continue
        real = child.resolve()
        if child.is_symlink() and base not in real.parents:
            log.warning("--models-dir: skipping %s, a link resolving outside %s", child.name, directory)
            continue
        if real.is_dir() and (real / "config.json").is_file():
            out.append(ModelEntry(child.name, MODELS_DIR, real))
    return out


def discover(store_root: Path | None, models_dir: Path | None, preset: Preset | None,
             default_org: str = "mlx-community") -> dict[str, ModelEntry]:
    """Every model the router serves, by name, with its preset sections and aliases applied."""
    found: dict[str, ModelEntry] = {}
    for entry in scan_cache(store_root) + scan_models_dir(models_dir):
        found[entry.name] = entry  # models_dir wins over the cache
    if preset is not None:
        for name, sec in preset.sections.items():
            if sec.model is not None:
                path = Path(sec.model).expanduser()
                if not (path / "config.json").is_file():
                    raise RegistryError(f"--models-preset {preset.path}: [{name}] model = {sec.model}: not a "
                                        "checkpoint directory (no config.json)")
                found[name] = ModelEntry(name, PRESET, path.resolve())
            elif sec.hf_repo is not None:
                repo_id = expand(sec.hf_repo, default_org)
                try:
                    parse_repo_id(repo_id)
                except InvalidRepoId as e:
                    raise RegistryError(f"--models-preset {preset.path}: [{name}] hf-repo: {e}") from None
                path = Path(store_root) / repo_id if store_root is not None else None
                found[name] = ModelEntry(name, PRESET, path if path is not None and (path / "config.json").is_file()
                                         else None, repo_id=repo_id)
            elif name not in found:
                raise RegistryError(f"--models-preset {preset.path}: [{name}] sets neither model nor hf-repo and "
                                    "names no model of --models-dir or the model store")
        for entry in found.values():
            own = preset.sections.get(entry.name)
            entry.sections = [preset.global_] + ([own] if own is not None else [])
            entry.aliases = own.listed("alias") if own is not None else []
            entry.tags = own.listed("tags") if own is not None else []
            entry.load_on_startup = own is not None and own.load_on_startup
    _check_names(found)
    return found


def _check_names(found: dict[str, ModelEntry]) -> None:
    owner: dict[str, str] = {}
    for entry in found.values():
        for alias in entry.aliases:
            if alias in found and alias != entry.name:
                raise RegistryError(f"alias {alias!r} of model {entry.name!r} is the name of another model")
            if alias in owner and owner[alias] != entry.name:
                raise RegistryError(f"alias {alias!r} of model {entry.name!r} is also an alias of {owner[alias]!r}")
            owner[alias] = entry.name


def lookup(found: dict[str, ModelEntry], name: str) -> ModelEntry | None:
    """The entry `name` names, by its name or one of its aliases."""
    if name in found:
        return found[name]
    for entry in found.values():
        if name in entry.aliases:
            return entry
    return None
