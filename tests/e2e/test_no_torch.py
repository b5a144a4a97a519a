"""The MLX path without torch: `mlxcel-server` starts, auto-selects MLX, and serves.

torch is made uninstalled for the subprocess, not stubbed (tests/hidden_packages.py): exactly
what a machine without the wheel looks like. transformers then takes its own torch-free path, as
it would there.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, REPO, ServerProcess, fixture_path
from tests.hidden_packages import env_without


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory):
    return env_without(tmp_path_factory.mktemp("no-torch"), "torch")


def test_torch_is_really_hidden(no_torch_env):
    p = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('torch')); import torch"],
                       env=no_torch_env, capture_output=True, text=True, cwd=REPO)
    assert p.stdout.strip() == "None" and "ModuleNotFoundError" in p.stderr


def test_help_and_an_mlx_server_work_without_torch(no_torch_env):
    p = subprocess.run([sys.executable, "-m", "mlxcel.cli.server", "--help"], env=no_torch_env,
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0 and "--backend" in p.stdout, p.stderr
    refused = subprocess.run([sys.executable, "-m", "mlxcel.cli.server", "-m", DEFAULT_MODEL, "--offline",
                              "--backend", "torch"], env=no_torch_env, capture_output=True, text=True, cwd=REPO)
    assert refused.returncode == 1 and "torch is not installed" in refused.stderr

    fixture_path(DEFAULT_MODEL)
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--parallel", "1"], env=no_torch_env)
    try:
        props = httpx.get(server.base_url + "/props").json()
        assert props["backend"]["name"] == "mlx" and props["backend"]["device"] == "cpu"
        assert props["backend"]["reason"].startswith("auto: torch is not installed")
        r = httpx.post(server.base_url + "/completion", json={"prompt": "The capital of France is", "n_predict": 4,
                                                             "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
        assert "torch is not installed, so MLX" in server.log()
    finally:
        server.stop()
