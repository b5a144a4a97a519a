"""Shared test plumbing: where fixtures live, and a real server on a loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxcel.backends.mlx.blas import ensure_fast_blas
from tests import fixtures
from tests.fixtures import DEFAULT_MODEL, models_dir

# In-process tests compute with the same BLAS the server uses (loaded before mlx.core is).
ensure_fast_blas(os.environ)

REPO = fixtures.REPO_ROOT

# In-process torch (the model tests) gets what mlxcel-server sets up: sleeping OpenMP workers.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def fixture_path(ref: str) -> Path:
    """The fixture's checkpoint directory; a missing fixture fails loudly (never skips)."""
    if not fixtures.available(ref):
        pytest.fail(f"fixture model {ref} is missing from {models_dir()}: run `make fixtures`")
    return fixtures.fixture_path(ref)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`mlxcel-server` in a subprocess, as a user would start it."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, ready_timeout: float = 180,
                 port: int | None = None, health_path: str = "/health") -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.health_path = health_path
        full_env = {**os.environ, "MLXCEL_MODELS_DIR": str(models_dir()), **(env or {})}
        self.log_path = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"mlxcel-server-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcel.cli.server", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + self.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def module_server(ref: str, *args: str):
    """A module-scoped fixture serving `ref` (offline) with extra command-line `args`."""

    @pytest.fixture(scope="module")
    def server():
        fixture_path(ref)
        s = ServerProcess(["-m", ref, "--offline", *args])
        yield s
        s.stop()

    return server


def default_compute_dtype(backend: str, device: str = "cpu", checkpoint_dtype: str = "bfloat16") -> str:
    """The dtype a backend computes in when --dtype is left at auto (MLX: fp32 on a CPU;
    torch: bf16 on a CPU with native bf16, else fp32; the checkpoint's on CUDA)."""
    if backend == "mlx":
        return "float32" if device == "cpu" else checkpoint_dtype
    import torch

    from mlxcel.backends.torch.backend import resolve_dtype

    return resolve_dtype("auto", checkpoint_dtype, torch.device(device))


def default_backends(environ=None) -> list[str]:
    """The backends the default-model e2e tests run on: both, unless MLXCEL_TEST_BACKENDS
    (comma-separated) narrows the matrix (e.g. `torch` on a GPU machine)."""
    environ = os.environ if environ is None else environ
    wanted = [b.strip() for b in environ.get("MLXCEL_TEST_BACKENDS", "mlx,torch").split(",") if b.strip()]
    unknown = set(wanted) - {"mlx", "torch"}
    if unknown or not wanted:
        raise pytest.UsageError(f"MLXCEL_TEST_BACKENDS={environ.get('MLXCEL_TEST_BACKENDS')!r}: expected mlx and/or torch")
    return wanted


@pytest.fixture(scope="session", params=default_backends())
def default_server(request):
    """The default model served as a user would start it, once per backend (`--backend` pinned,
    so the matrix holds on any machine); pytest runs every test of one backend before
    starting the other, so one server is up at a time. `.backend` names the one serving."""
    fixture_path(DEFAULT_MODEL)
    device = os.environ.get("MLXCEL_TEST_DEVICE", "cpu") if request.param == "torch" else "cpu"
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--backend", request.param, "--device", device])
    server.backend, server.dtype = request.param, default_compute_dtype(request.param, device)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def openai_client(default_server):
    from openai import OpenAI

    return OpenAI(base_url=default_server.base_url + "/v1", api_key="not-needed", max_retries=0, timeout=120)
