"""--api-prefix, --reuse-port, GET / and /index.html (the chat page), and POST /predict through the real
`mlxcel-server` (one served model; the other processes never get past binding their port)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import REPO, ServerProcess, fixture_path, free_port
from tests.fixtures import DEFAULT_MODEL, models_dir

NOT_FOUND = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
NATIVE_NOT_FOUND = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}


@pytest.fixture(scope="module")
def prefixed():
    """Vertex AI mode (AIP_HTTP_PORT names the port), every route under /api, SO_REUSEPORT."""
    fixture_path(DEFAULT_MODEL)
    port = free_port()
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port)}
    s = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--api-prefix", "/api", "--reuse-port"],
                      env=env, port=port, health_path="/api/health")
    yield s
    s.stop()


def _cli(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mlxcel.cli.server", "-m", DEFAULT_MODEL, "--offline",
            "--host", "127.0.0.1", "--port", str(port), *extra]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIP_", "LLAMA_ARG_"))}
    return {**env, "MLXCEL_MODELS_DIR": str(models_dir())}


def test_api_prefix_serves_every_route_under_it(prefixed):
    base = prefixed.base_url
    assert httpx.get(base + "/api/health").json() == {"status": "ok"}
    assert httpx.get(base + "/api/v1/models").json()["data"][0]["id"]
    assert httpx.post(base + "/api/tokenize", json={"content": "hello"}).json()["tokens"]
    for path in ("/health", "/v1/models", "/api", "/apiv1/models"):
        r = httpx.get(base + path)
        assert (r.status_code, r.json()) == (404, NOT_FOUND), path


def test_root_and_index_html_serve_the_chat_page_under_the_prefix(prefixed):
    # the page is on by default (--ui) and, like every route, lives under --api-prefix
    for path in ("/api/", "/api/index.html"):
        r = httpx.get(prefixed.base_url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
    for path in ("/", "/index.html"):
        r = httpx.get(prefixed.base_url + path)
        assert (r.status_code, r.json()) == (404, NOT_FOUND), path


def test_predict_fan_out_in_vertex_mode(prefixed):
    body = {"instances": [{"@requestFormat": "tokenize", "content": "hello"}, {"@requestFormat": "health"},
                          {"@requestFormat": "nope"}]}
    r = httpx.post(prefixed.base_url + "/api/predict", json=body, timeout=60)
    assert r.status_code == 200
    p = r.json()["predictions"]
    assert p[0]["tokens"] and p[1] == {"status": "ok"}
    assert p[2]["error"] == {"code": 400, "message": "no handler registered for @requestFormat: nope",
                             "type": "invalid_request_error"}


def test_predict_is_not_mounted_outside_vertex_mode():
    # The app exactly as the server builds it, from a command line without AIP_MODE.
    from mlxcel.api.app import build_app
    from mlxcel.api.state import AppState
    from mlxcel.cli.flags import parse_server_args

    app = build_app(AppState(settings=parse_server_args(["-m", DEFAULT_MODEL], {"AIP_PREDICT_ROUTE": "/predict"})))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/predict", json={"instances": []})

    r = asyncio.run(go())
    assert (r.status_code, r.json()) == (404, NATIVE_NOT_FOUND)


def test_reuse_port_lets_a_second_server_bind_the_same_port(prefixed):
    proc = subprocess.Popen(_cli(prefixed.port, "--reuse-port"), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "listening on" in line:
                break
        assert any(f"listening on http://127.0.0.1:{prefixed.port}" in ln for ln in lines), "".join(lines)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_without_reuse_port_the_second_bind_fails_in_one_line(prefixed):
    r = subprocess.run(_cli(prefixed.port), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {prefixed.port}: "
                      "Address already in use; another process holds it (servers meant to share a port "
                      "must all start with --reuse-port)"], r.stderr
    assert "Traceback" not in r.stderr
