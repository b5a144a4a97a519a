"""Resolve a `-m` / `--hf-repo` reference to a checkpoint directory.

A reference is one of: a checkpoint directory (config.json + *.safetensors + tokenizer
files); a repository id `owner/name`, looked up in the model store and downloaded when
missing unless offline; a bare `name`, expanded to `<default_org>/name`. GGUF files, split
GGUF shards, `:<quant>` suffixes and URLs are refused from the string alone, before anything
is read, with one line naming the value, the reason and what to pass instead. Every entry
point (server, generate, chat) goes through here, so they all refuse identically.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from mlxcel.store.repo_id import InvalidRepoId, expand, parse_repo_id


class ModelSourceRefused(ValueError):
    """The reference names something mlxcel will not load (GGUF, shard, URL, ...)."""


class ModelNotAvailable(LookupError):
    """The reference is well-formed but no checkpoint can be had (offline, missing)."""


class AmbiguousName(ModelNotAvailable):
    """A bare name that several store entries answer to (prefer_local)."""


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_QUANT_SUFFIX = re.compile(r"^([^:/\\]+/[^:/\\]+):([^:/\\]+)$")
_HF_HOSTS = {"huggingface.co", "www.huggingface.co", "hf.co"}
# huggingface.co/<owner>/<name>/... except pages that are not repositories
_HF_NON_REPO = {"datasets", "spaces", "docs", "blog", "models", "organizations", "settings", "api"}

_MODEL_FLAGS = {"-m", "--model", "--hf-repo", "-hf", "-hfr"}
REPLACEMENT = "pass an MLX checkpoint directory or an MLX repository id such as mlx-community/<name>"


def _say(flag: str, ref: str, why: str, instead: str) -> str:
    return f"{flag} {ref!r}: {why}; {instead}"


def _hf_url_repo(url: str) -> str | None:
    parts = urlsplit(url)
    if (parts.hostname or "").lower() not in _HF_HOSTS:
        return None
    path = [p for p in parts.path.split("/") if p]
    if len(path) < 2 or path[0] in _HF_NON_REPO:
        return None
    repo = f"{path[0]}/{path[1]}"
    try:
        parse_repo_id(repo)
    except InvalidRepoId:
        return None
    return repo


def refusal(ref: str, flag: str = "-m") -> str | None:
    """The diagnostic for a reference mlxcel refuses by its spelling alone, else None."""
    if not ref.strip():
        return f"{flag}: an empty model reference; {REPLACEMENT}"
    if _URL.match(ref):
        repo = _hf_url_repo(ref)
        why = "mlxcel resolves models by repository id, not by URL"
        if repo and flag in _MODEL_FLAGS:
            return _say(flag, ref, why, f"pass --hf-repo {repo} (or -m {repo}) instead")
        if repo:
            return _say(flag, ref, why, f"pass {repo} instead")
        return _say(flag, ref, why, REPLACEMENT)
    if _SHARD.search(ref):
        return _say(
            flag,
            ref,
            "is one shard of a split GGUF model, and mlxcel loads MLX SafeTensors checkpoints, not GGUF",
            REPLACEMENT,
        )
    if ref.lower().endswith(".gguf"):
        return _say(
            flag,
            ref,
            "is a GGUF file, and mlxcel loads MLX SafeTensors checkpoints, not GGUF",
            "convert it with `mlxcel convert <file> --out-repo <owner>/<name>` and pass -m <owner>/<name>, "
            f"or {REPLACEMENT}",
        )
    m = _QUANT_SUFFIX.match(ref)
    if m:
        return _say(
            flag,
            ref,
            f"the ':{m.group(2)}' suffix selects a GGUF quantization inside a repository, "
            "and an MLX repository holds exactly one checkpoint",
            f"pass {m.group(1)} (or the MLX repository of the quantization you want, e.g. a -4bit one)",
        )
    return None


def _looks_like_path(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~", ".\\")) or ref in (".", "..") or ref.count("/") > 1


def store_entry(root: Path, repo_id: str) -> Path | None:
    """The store directory for `repo_id` when it holds a checkpoint (config.json or *.safetensors)."""
    path = root / repo_id
    if path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.safetensors"))):
        return path
    return None


def resolve_model(
    ref: str,
    *,
    root: Path,
    default_org: str = "mlx-community",
    offline: bool = False,
    hf_token: str | None = None,
    flag: str = "-m",
) -> Path:
    why = refusal(ref, flag)
    if why:
        raise ModelSourceRefused(why)
    path = Path(ref).expanduser()
    if path.exists():
        if path.is_file():
            raise ModelSourceRefused(
                _say(flag, ref, "is a file", "pass the checkpoint directory that holds it (config.json + *.safetensors)")
            )
        if not (path / "config.json").is_file():
            raise ModelNotAvailable(
                _say(flag, ref, "is a directory without config.json, so not a checkpoint", REPLACEMENT)
            )
        return path.resolve()
    if _looks_like_path(ref):
        raise ModelNotAvailable(_say(flag, ref, "no such directory", REPLACEMENT))
    repo_id = expand(ref, default_org)
    try:
        parse_repo_id(repo_id)
    except InvalidRepoId as e:
        raise ModelSourceRefused(f"{flag} {ref!r}: {e}") from None
    root = Path(root)
    found = store_entry(root, repo_id)
    if found is not None:
        return found
    if offline:
        raise ModelNotAvailable(
            _say(
                flag,
                ref,
                f"{repo_id} is not in the model store {root} and --offline forbids downloading it",
                f"run `mlxcel download {repo_id}` while online, or point --model-store-root at a store that has it",
            )
        )
    from mlxcel.store.store import DownloadFailed, download

    try:
        return download(repo_id, root, hf_token=hf_token)
    except DownloadFailed as e:
        raise ModelNotAvailable(f"{flag} {ref!r}: {e}") from None


def short_name_matches(root: Path, name: str) -> list[str]:
    """Store entries `<owner>/<name>` whose name part is `name` (case-insensitive), under any owner."""
    root = Path(root)
    if "/" in name or "\\" in name or not name or not root.is_dir():
        return []
    found = []
    for owner in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for repo in owner.iterdir():
            if repo.name.lower() == name.lower() and store_entry(root, f"{owner.name}/{repo.name}") is not None:
                found.append(f"{owner.name}/{repo.name}")
    return found


def prefer_local(ref: str, root: Path, default_org: str) -> str:
    """What the terminal commands (`mlxcel run`, `chat`, `generate`, `show`) resolve: `ref`, except
    that a bare name missing under `default_org` names the one store entry of that name under
    another owner (`SmolLM2-135M-Instruct` for HuggingFaceTB/SmolLM2-135M-Instruct). Several such
    entries refuse with their ids; none leaves `ref` as it is (a download, where allowed)."""
    if refusal(ref) is not None or "/" in ref or "\\" in ref or Path(ref).expanduser().exists() \
            or store_entry(Path(root), expand(ref, default_org)) is not None:
        return ref
    matches = short_name_matches(root, ref)
    if len(matches) > 1:
        raise AmbiguousName(f"{ref!r} names several models in the store ({', '.join(matches)}); pass owner/name")
    return matches[0] if matches else ref
