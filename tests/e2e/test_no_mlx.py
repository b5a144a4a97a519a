"""The torch path without MLX: `mlxcel-server --backend torch` starts and serves where mlx,
mlx-lm and mlx-whisper are not installed (a CUDA machine's Python with only a CUDA torch, such
as the one scripts/bench/gpu_check.sh runs on).

MLX is made uninstalled for the subprocess the way tests/e2e/test_no_torch.py hides torch
(tests/hidden_packages.py).
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, REPO, ServerProcess, fixture_path
from tests.hidden_packages import env_without


@pytest.fixture(scope="module")
def no_mlx_env(tmp_path_factory):
    return env_without(tmp_path_factory.mktemp("no-mlx"), "mlx", "mlx_lm", "mlx_whisper")


def test_mlx_is_really_hidden(no_mlx_env):
    p = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('mlx')); import mlx.core"],
                       env=no_mlx_env, capture_output=True, text=True, cwd=REPO)
    assert p.stdout.strip() == "None" and "ModuleNotFoundError" in p.stderr


def test_a_torch_server_works_without_mlx(no_mlx_env):
    fixture_path(DEFAULT_MODEL)
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--backend", "torch", "--parallel", "1"],
                           env=no_mlx_env)
    try:
        assert httpx.get(server.base_url + "/props").json()["backend"]["name"] == "torch"
        r = httpx.post(server.base_url + "/completion", json={"prompt": "The capital of France is", "n_predict": 4,
                                                             "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()
