"""POST /models: check a repository name against the hub, then fetch it file by file with progress.

The probe is the hub's model-info call, made synchronously before the route answers (b10621's
validate-then-download order), so a misspelt or unreachable repository is the request's own
error. The fetch lists the snapshot's files, keeps the ones an MLX checkpoint needs
(store.DOWNLOAD_PATTERNS) and downloads them one by one, reporting each file's url with its
bytes done and total; store.download stages and renames the result. The hub endpoint is
huggingface_hub's own (HF_ENDPOINT, read by that library).
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path

from mlxcel.store.store import DOWNLOAD_PATTERNS

Progress = Callable[[str, int, int], None]


class ProbeFailed(RuntimeError):
    pass


def probe(repo_id: str, hf_token: str | None) -> None:
    """The repository exists and is readable, or ProbeFailed with the hub's reason in one line."""
    from huggingface_hub import HfApi

    try:
        HfApi(token=hf_token).model_info(repo_id)
    except Exception as e:  # noqa: BLE001 - the hub client raises many types; all mean "cannot download"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ProbeFailed(f"model validation failed, unable to download {repo_id}: {type(e).__name__}: "
                          f"{first}") from None


def fetch_with_progress(progress: Progress) -> Callable[[str, Path, str | None], None]:
    """A `fetch` for store.download that reports (url, done, total) around every file."""
    def fetch(repo_id: str, local_dir: Path, hf_token: str | None) -> None:
        from huggingface_hub import HfApi, hf_hub_download, hf_hub_url

        info = HfApi(token=hf_token).model_info(repo_id, files_metadata=True)
        wanted = [s for s in info.siblings or [] if any(fnmatch(s.rfilename, p) for p in DOWNLOAD_PATTERNS)]
        for s in wanted:
            url = hf_hub_url(repo_id, s.rfilename, revision=info.sha)
            total = int(s.size or 0)
            progress(url, 0, total)
            hf_hub_download(repo_id, s.rfilename, revision=info.sha, local_dir=str(local_dir), token=hf_token)
            done = (Path(local_dir) / s.rfilename).stat().st_size
            progress(url, done, max(total, done))

    return fetch
