"""Model store: root selection, `-m` resolution and refusals, and the list/rm/download/convert CLI."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mlxcel.cli.main import main as mlxcel_main
from mlxcel.store.paths import store_root
from mlxcel.store.repo_id import InvalidRepoId, parse_repo_id
from mlxcel.store.resolve import ModelNotAvailable, ModelSourceRefused, resolve_model
from mlxcel.store.store import DownloadFailed, cache_list_text, download, list_models, remove


def make_checkpoint(path: Path, model_type: str = "llama", quant: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type}
    if quant:
        config["quantization"] = quant
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"\0" * 16)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "store"
    r.mkdir()
    return r


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    for var in ("MLXCEL_MODELS_DIR", "MLXCEL_CACHE_DIR", "MLXCEL_DEFAULT_ORG", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)


# --- store root -----------------------------------------------------------------------------


def test_store_root_order(tmp_path):
    env = {"MLXCEL_MODELS_DIR": "/m", "MLXCEL_CACHE_DIR": "/c"}
    assert store_root(tmp_path / "x", env) == tmp_path / "x"
    assert store_root(None, env) == Path("/m")
    assert store_root(None, {"MLXCEL_CACHE_DIR": "/c"}) == Path("/c/models")
    assert store_root(None, {"XDG_CACHE_HOME": "/x"}) == Path("/x/mlxcel/models")
    assert store_root(None, {}) == Path.home() / ".cache" / "mlxcel" / "models"


# --- refusals, exact diagnostics --------------------------------------------------------------

REPLACEMENT = "pass an MLX checkpoint directory or an MLX repository id such as mlx-community/<name>"


@pytest.mark.parametrize(
    "ref, expected",
    [
        (
            "model.Q4_K_M.gguf",
            "-m 'model.Q4_K_M.gguf': is a GGUF file, and mlxcel loads MLX SafeTensors checkpoints, not GGUF; "
            "convert it with `mlxcel convert <file> --out-repo <owner>/<name>` and pass -m <owner>/<name>, "
            f"or {REPLACEMENT}",
        ),
        (
            "/models/big-00002-of-00004.gguf",
            "-m '/models/big-00002-of-00004.gguf': is one shard of a split GGUF model, and mlxcel loads "
            f"MLX SafeTensors checkpoints, not GGUF; {REPLACEMENT}",
        ),
        (
            "https://huggingface.co/mlx-community/Qwen3-0.6B-4bit/resolve/main/model.safetensors",
            "-m 'https://huggingface.co/mlx-community/Qwen3-0.6B-4bit/resolve/main/model.safetensors': "
            "mlxcel resolves models by repository id, not by URL; "
            "pass --hf-repo mlx-community/Qwen3-0.6B-4bit (or -m mlx-community/Qwen3-0.6B-4bit) instead",
        ),
        (
            "http://example.com/model",
            "-m 'http://example.com/model': mlxcel resolves models by repository id, not by URL; " + REPLACEMENT,
        ),
        (
            "ggml-org/gemma-3-1b-it-GGUF:Q4_K_M",
            "-m 'ggml-org/gemma-3-1b-it-GGUF:Q4_K_M': the ':Q4_K_M' suffix selects a GGUF quantization inside "
            "a repository, and an MLX repository holds exactly one checkpoint; pass ggml-org/gemma-3-1b-it-GGUF "
            "(or the MLX repository of the quantization you want, e.g. a -4bit one)",
        ),
    ],
)
def test_refusals_exact(ref, expected, root):
    with pytest.raises(ModelSourceRefused) as e:
        resolve_model(ref, root=root)
    assert str(e.value) == expected
    assert "\n" not in str(e.value)


def test_gguf_refused_before_reading(tmp_path, root):
    # Refused by its name even though the file exists and is no GGUF at all.
    f = tmp_path / "real.gguf"
    f.write_text("not read")
    with pytest.raises(ModelSourceRefused, match="is a GGUF file"):
        resolve_model(str(f), root=root)


def test_flag_name_in_diagnostic(root):
    with pytest.raises(ModelSourceRefused) as e:
        resolve_model("owner/name:Q8_0", root=root, flag="--hf-repo", offline=True)
    assert str(e.value).startswith("--hf-repo 'owner/name:Q8_0': the ':Q8_0' suffix")
    with pytest.raises(ModelSourceRefused) as e:
        resolve_model("hf://a/b", root=root, flag="--hf-repo", offline=True)
    assert str(e.value).startswith("--hf-repo 'hf://a/b': mlxcel resolves models by repository id")


# --- resolution ---------------------------------------------------------------------------------


def test_checkpoint_directory(tmp_path, root):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    assert resolve_model(str(ckpt), root=root) == ckpt.resolve()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotAvailable, match="without config.json"):
        resolve_model(str(empty), root=root)
    with pytest.raises(ModelSourceRefused, match="is a file"):
        resolve_model(str(ckpt / "model.safetensors"), root=root)
    with pytest.raises(ModelNotAvailable, match="no such directory"):
        resolve_model(str(tmp_path / "missing"), root=root)


def test_repo_id_in_store(root):
    entry = make_checkpoint(root / "owner" / "name")
    assert resolve_model("owner/name", root=root, offline=True) == entry


def test_bare_name_expands_default_org(root):
    entry = make_checkpoint(root / "mlx-community" / "tiny")
    assert resolve_model("tiny", root=root, offline=True) == entry
    other = make_checkpoint(root / "myorg" / "tiny")
    assert resolve_model("tiny", root=root, default_org="myorg", offline=True) == other


def test_incomplete_entry_does_not_count(root):
    (root / "owner" / "half").mkdir(parents=True)
    (root / "owner" / "half" / "README.md").write_text("partial")
    with pytest.raises(ModelNotAvailable) as e:
        resolve_model("owner/half", root=root, offline=True)
    assert "--offline forbids downloading it" in str(e.value)
    assert list_models(root) == []


def test_offline_missing_repo(root):
    with pytest.raises(ModelNotAvailable) as e:
        resolve_model("Qwen3-0.6B-4bit", root=root, offline=True)
    assert str(e.value) == (
        f"-m 'Qwen3-0.6B-4bit': mlx-community/Qwen3-0.6B-4bit is not in the model store {root} and --offline "
        "forbids downloading it; run `mlxcel download mlx-community/Qwen3-0.6B-4bit` while online, or point "
        "--model-store-root at a store that has it"
    )


@pytest.mark.parametrize("bad", ["a/b/c/../d", "owner/..", "-x/y", "a b/c", "owner/na--me"])
def test_invalid_repo_ids(bad, root):
    with pytest.raises((ModelSourceRefused, ModelNotAvailable)):
        resolve_model(bad, root=root, offline=True)


def test_parse_repo_id():
    assert parse_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB", "SmolLM2-135M-Instruct")
    for bad in ("x", "a/b/c", "../x", "a/..", "a/.hidden"):
        with pytest.raises(InvalidRepoId):
            parse_repo_id(bad)


# --- download (no network: the fetch seam writes what a hub snapshot would) ------------------


def test_download_offline_refused(root):
    with pytest.raises(DownloadFailed, match="--offline forbids downloading owner/name"):
        download("owner/name", root, offline=True, fetch=lambda *a: pytest.fail("fetched while offline"))


def test_download_publishes_complete_snapshot(root):
    seen = {}

    def fetch(repo_id, local_dir, token):
        seen.update(repo=repo_id, token=token)
        make_checkpoint(local_dir)
        (local_dir / ".cache").mkdir()

    path = download("owner/name", root, hf_token="secret", fetch=fetch)
    assert path == root / "owner" / "name"
    assert seen == {"repo": "owner/name", "token": "secret"}
    assert (path / "config.json").is_file() and not (path / ".cache").exists()
    assert not (root / ".staging").exists()


def test_download_without_checkpoint_is_not_published(root):
    def fetch(repo_id, local_dir, token):
        (local_dir / "model.gguf").write_bytes(b"gguf")

    with pytest.raises(DownloadFailed, match="not an MLX checkpoint"):
        download("owner/gguf-only", root, fetch=fetch)
    assert not (root / "owner" / "gguf-only").exists()


def test_download_error_becomes_download_failed(root):
    def fetch(repo_id, local_dir, token):
        raise ConnectionError("hub unreachable")

    with pytest.raises(DownloadFailed, match="downloading owner/name failed: ConnectionError: hub unreachable"):
        download("owner/name", root, fetch=fetch)


# --- list / rm helpers --------------------------------------------------------------------------


def test_list_and_cache_list(root):
    make_checkpoint(root / "b" / "two", quant={"bits": 4, "group_size": 64})
    make_checkpoint(root / "a" / "one", model_type="qwen3")
    (root / ".staging" / "x--y").mkdir(parents=True)
    entries = list_models(root)
    assert [e.repo_id for e in entries] == ["a/one", "b/two"]
    assert entries[0].model_type == "qwen3" and entries[1].quantization == "4bit"
    assert cache_list_text(root) == "number of models in cache: 2\n   1. a/one\n   2. b/two\n"


def test_rm_contained(tmp_path, root):
    make_checkpoint(root / "owner" / "name")
    assert remove("owner/name", root) == root / "owner" / "name"
    assert not (root / "owner").exists()
    outside = make_checkpoint(tmp_path / "outside" / "x")
    (root / "evil").mkdir()
    (root / "evil" / "link").symlink_to(outside)
    with pytest.raises(LookupError):
        remove("evil/link", root)
    assert outside.exists()
    with pytest.raises(InvalidRepoId):
        remove("../outside", root)


# --- CLI -------------------------------------------------------------------------------------------


def test_cli_list_uses_env_and_flag(root, tmp_path, monkeypatch, capsys):
    make_checkpoint(root / "owner" / "name")
    monkeypatch.setenv("MLXCEL_MODELS_DIR", str(root))
    assert mlxcel_main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    size = sum(f.stat().st_size for f in (root / "owner" / "name").iterdir())  # config.json + weights
    assert lines[0].split() == ["NAME", "TYPE", "QUANT", "SIZE"]
    assert lines[1].split() == ["owner/name", "llama", "-", str(size), "B"]
    assert lines[2] == f"1 model, {size} B in {root}"
    other = tmp_path / "other"
    other.mkdir()
    assert mlxcel_main(["list", "--models-dir", str(other)]) == 0
    assert capsys.readouterr().out == f"no models in {other}\n"
    assert mlxcel_main(["list", "--model-store-root", str(root)]) == 0
    assert "owner/name" in capsys.readouterr().out


def test_cli_rm(root, capsys):
    make_checkpoint(root / "mlx-community" / "tiny")
    assert mlxcel_main(["rm", "tiny", "--models-dir", str(root)]) == 0
    assert "removed" in capsys.readouterr().out
    assert mlxcel_main(["rm", "tiny", "--models-dir", str(root)]) == 1
    assert capsys.readouterr().err == f"mlxcel rm: error: mlx-community/tiny is not in the model store {root}\n"


def test_cli_download_offline_and_refusals(root, capsys, monkeypatch):
    monkeypatch.setenv("MLXCEL_DEFAULT_ORG", "myorg")
    assert mlxcel_main(["download", "tiny", "--offline", "--models-dir", str(root)]) == 1
    assert capsys.readouterr().err == "mlxcel download: error: --offline forbids downloading myorg/tiny\n"
    assert mlxcel_main(["download", "https://huggingface.co/a/b", "--models-dir", str(root)]) == 1
    assert capsys.readouterr().err == (
        "mlxcel download: error: download 'https://huggingface.co/a/b': mlxcel resolves models by "
        "repository id, not by URL; pass a/b instead\n"
    )
    make_checkpoint(root / "myorg" / "tiny")
    assert mlxcel_main(["download", "tiny", "--offline", "--models-dir", str(root)]) == 0
    assert "already in the store" in capsys.readouterr().out


def test_cli_convert_errors(root, tmp_path, capsys):
    assert mlxcel_main(["convert", str(tmp_path / "nope"), "--out-repo", "a/b", "--models-dir", str(root)]) == 1
    assert "does not exist" in capsys.readouterr().err
    src = make_checkpoint(tmp_path / "src", model_type="rwkv")
    assert mlxcel_main(["convert", str(src), "--out-repo", "a/b", "--models-dir", str(root)]) == 1
    assert "model_type 'rwkv' is not supported" in capsys.readouterr().err
    assert mlxcel_main(["convert", str(src), "--out-repo", "bad", "--models-dir", str(root)]) == 1
    assert "is not a repository id" in capsys.readouterr().err
    make_checkpoint(root / "a" / "b")
    assert mlxcel_main(["convert", str(src), "--out-repo", "a/b", "--models-dir", str(root)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert not (root / ".staging").exists()


# --- short names (`mlxcel run`, `chat`, `generate`, `show`) ------------------------------------


def test_prefer_local_short_names(root):
    from mlxcel.store.resolve import AmbiguousName, prefer_local

    make_checkpoint(root / "someone" / "Tiny")
    assert prefer_local("tiny", root, "mlx-community") == "someone/Tiny"  # the one entry of that name
    make_checkpoint(root / "mlx-community" / "tiny")
    assert prefer_local("tiny", root, "mlx-community") == "tiny"  # the default organisation's wins, as -m reads it
    assert prefer_local("other", root, "mlx-community") == "other"  # unknown: left for resolve (a download)
    assert prefer_local("someone/Tiny", root, "x") == "someone/Tiny"
    make_checkpoint(root / "third" / "tiny")
    with pytest.raises(AmbiguousName, match="someone/Tiny, third/tiny"):
        prefer_local("tiny", root, "elsewhere")


def test_download_draws_progress_as_plain_lines_off_a_terminal(root, monkeypatch, caplog):
    """huggingface_hub gets a tqdm class that logs lines (config/progress.py), never redraws."""
    import huggingface_hub

    from mlxcel.config.progress import LineTqdm

    seen = {}

    def snapshot_download(repo_id, local_dir, token, allow_patterns, tqdm_class):
        seen["tqdm_class"] = tqdm_class
        make_checkpoint(Path(local_dir))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    caplog.set_level("INFO")
    download("owner/name", root)
    assert seen["tqdm_class"] is LineTqdm
    assert f"downloading owner/name from Hugging Face into {root / 'owner' / 'name'}" in caplog.text
