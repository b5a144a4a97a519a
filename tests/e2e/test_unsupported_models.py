"""A checkpoint whose model_type mlxcel does not serve, at every entry point.

The checkpoint is made here: a fixture's tokenizer files and a config.json naming
`mistral_unknown`, with a weight file that is not safetensors at all (or none), so a refusal
that read any weight could not come out as the one line. `mlxcel-server` and `mlxcel generate`
exit with status 1 and that line alone; a model switch answers HTTP 500 model_load_failed with
the same text while the loaded model keeps serving; in router mode that model fails to load
with it and the others still answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxcel.models.registry import unsupported_message
from tests.conftest import REPO, ServerProcess, fixture_path, free_port
from tests.fixtures import LLAMA3_TOOLS_TINY, models_dir

UNKNOWN = "mistral_unknown"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def unsupported_checkpoint(path: Path, weights: str = "corrupt") -> Path:
    src = fixture_path(LLAMA3_TOOLS_TINY)
    path.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, path / name)
    config = json.loads((src / "config.json").read_text())
    config.update(model_type=UNKNOWN, architectures=["MistralUnknownForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    if weights == "corrupt":
        (path / "model.safetensors").write_bytes(b"not a safetensors file")
    return path


def expected_line(path: Path) -> str:
    return unsupported_message(json.loads((path / "config.json").read_text()))


def test_the_line_names_the_type_the_nearest_family_and_the_docs(tmp_path):
    line = expected_line(unsupported_checkpoint(tmp_path / "ckpt"))
    assert f"'{UNKNOWN}'" in line and "nearest supported: mistral" in line and "docs/models.md" in line


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "MLXCEL_MODELS_DIR": str(models_dir())}
    start = time.monotonic()
    p = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return p, time.monotonic() - start


@pytest.mark.parametrize(("weights", "extra"), [("corrupt", []), ("none", ["--backend", "torch"])])
def test_server_exits_with_one_line(tmp_path, weights, extra):
    ckpt = unsupported_checkpoint(tmp_path / "ckpt", weights)
    p, took = _run(["-m", "mlxcel.cli.server", "-m", str(ckpt), "--host", "127.0.0.1", "--port", str(free_port()),
                    *extra])
    assert p.returncode == 1, p.stderr
    assert p.stdout == ""
    assert p.stderr.splitlines() == [f"error: {expected_line(ckpt)}"]
    assert took < 30  # refused before any backend or weight is touched


def test_generate_exits_with_the_same_line(tmp_path):
    ckpt = unsupported_checkpoint(tmp_path / "ckpt")
    p, _ = _run(["-m", "mlxcel.cli.main", "generate", "-m", str(ckpt), "-p", "hi", "--offline"])
    assert p.returncode == 1
    assert p.stderr.splitlines() == [f"error: {expected_line(ckpt)}"]


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_a_switch_answers_the_same_line_and_keeps_serving(tmp_path):
    store = tmp_path / "store"
    (store / LLAMA3_TOOLS_TINY).parent.mkdir(parents=True)
    (store / LLAMA3_TOOLS_TINY).symlink_to(fixture_path(LLAMA3_TOOLS_TINY), target_is_directory=True)
    ckpt = unsupported_checkpoint(store / "zoo" / "mistral-unknown")
    server = ServerProcess(["-m", LLAMA3_TOOLS_TINY, "--offline", "--backend", "mlx"],
                           env={"MLXCEL_MODELS_DIR": str(store)})
    try:
        body = {"prompt": "a", "max_tokens": 2, "temperature": 0}
        r = httpx.post(server.base_url + "/v1/completions", json={**body, "model": "zoo/mistral-unknown"}, timeout=120)
        err = _error(r, 500)
        assert (err["code"], err["message"]) == ("model_load_failed", expected_line(ckpt))
        r = httpx.post(server.base_url + "/v1/completions", json={**body, "model": LLAMA3_TOOLS_TINY}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == LLAMA3_TOOLS_TINY, r.text
    finally:
        server.stop()


def test_router_fails_that_model_and_serves_the_others(tmp_path):
    mdir = tmp_path / "models"
    shutil.copytree(fixture_path(LLAMA3_TOOLS_TINY), mdir / "tiny")
    ckpt = unsupported_checkpoint(mdir / "unknown")
    server = ServerProcess(["--models-dir", str(mdir), "--model-store-root", str(tmp_path / "store"),
                            "--backend", "mlx"])
    try:
        r = httpx.post(server.base_url + "/v1/completions", json={"model": "unknown", "prompt": "a"}, timeout=120)
        assert _error(r, 500)["message"] == f"model name=unknown failed to load: {expected_line(ckpt)}"
        status = {m["id"]: m["status"] for m in httpx.get(server.base_url + "/models", timeout=30).json()["data"]}
        assert (status["unknown"]["value"], status["unknown"]["failed"]) == ("unloaded", True)
        r = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
