"""The terminal commands around a server and the store: `mlxcel --version`, `show`, `ps`; and
what a server started with -v says: the listening line with the load state, the load's
progress as plain lines in its log file, and one line per request."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, REPO, fixture_path, models_dir, module_server
from tests.fixtures import SMOLLM2_4BIT

KEY = "ps-test-key"
server = module_server(DEFAULT_MODEL, "--backend", "mlx", "-v", "--api-key", KEY)


def _mlxcel(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}
    return subprocess.run([sys.executable, "-m", "mlxcel.cli.main", *args], cwd=REPO, capture_output=True, text=True,
                          env={**env, "MLXCEL_MODELS_DIR": str(models_dir())}, timeout=120)


def test_version():
    from mlxcel import __version__

    r = _mlxcel("--version")
    assert r.returncode == 0 and r.stdout == f"version: {__version__} (mlxcel)\ncompatible with: llama-server b10621\n"


def _show(name: str) -> dict[str, str]:
    r = _mlxcel("show", name)
    assert r.returncode == 0, r.stderr
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in r.stdout.splitlines())


def test_show_reads_the_checkpoint_without_loading_it():
    fixture_path(DEFAULT_MODEL)
    fixture_path(SMOLLM2_4BIT)
    full, quant = _show(DEFAULT_MODEL), _show(SMOLLM2_4BIT)
    assert full["architecture"] == "llama (LlamaForCausalLM)"
    assert full["parameters"] == "135M (134,515,008)"
    assert quant["parameters"] == full["parameters"]  # packed 4-bit words count as the values they hold
    assert full["quantization"] == "none" and quant["quantization"] == "4-bit, group 64 (affine)"
    assert full["context length"] == "8192" and full["dtype"] == "bfloat16"
    assert full["chat template"].startswith("yes, ") and full["template starts"].startswith("{% for message in")
    assert _show(DEFAULT_MODEL.split("/")[1]) == full  # the short name
    missing = _mlxcel("show", "no-such-model")
    assert missing.returncode == 1 and "no-such-model is not in the model store" in missing.stderr


def test_ps_asks_the_running_server(server):
    port = str(server.port)
    refused = _mlxcel("ps", "--port", port)
    assert refused.returncode == 1 and "--api-key" in refused.stderr
    r = _mlxcel("ps", "--port", port, "--api-key", KEY)
    assert r.returncode == 0, r.stderr
    props = httpx.get(server.base_url + "/props", headers={"Authorization": f"Bearer {KEY}"}).json()
    lines = r.stdout.splitlines()
    assert lines[0] == f"server http://127.0.0.1:{port}: ready"
    assert lines[1].split() == ["MODEL", "BACKEND", "DTYPE", "CONTEXT", "SLOTS", "SIZE"]
    row = lines[2].split()
    assert row[:5] == [DEFAULT_MODEL, "mlx/cpu", props["backend"]["dtype"],
                       str(props["default_generation_settings"]["n_ctx"]), f"0/{props['total_slots']}"]
    nobody = _mlxcel("ps", "--port", "9")  # the discard port: nothing serves HTTP there
    assert nobody.returncode == 1 and "no server answers at http://127.0.0.1:9" in nobody.stderr


def test_log_says_listening_loading_and_ready_without_carriage_returns(server):
    log = server.log_path.read_text()
    assert "\r" not in log
    listening = log.index(f"listening on http://127.0.0.1:{server.port}; loading the model")
    loading = [m.start() for m in re.finditer(r"loading SmolLM2-135M-Instruct: +\d+% ", log)]
    ready = log.index(f"ready: serving requests on http://127.0.0.1:{server.port}")
    assert loading and listening < loading[0] < loading[-1] < ready
    assert re.search(r"loading SmolLM2-135M-Instruct: 100% 4/4 .*done\]", log)
    assert "backend mlx on cpu: the model runs with MLX on the CPU (as --backend/--device asked)" in log


@pytest.mark.parametrize("stream", [False, True])
def test_verbose_logs_one_line_per_request(server, stream):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    kwargs = dict(model=DEFAULT_MODEL, messages=[{"role": "user", "content": f"Say hello ({stream})"}],
                  max_tokens=6, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        usage = chunks[-1].usage
    else:
        usage = client.chat.completions.create(**kwargs).usage
    expected = (f"request: POST /v1/chat/completions 200, tokens in {usage.prompt_tokens} "
                f"out {usage.completion_tokens}, ")
    deadline = time.monotonic() + 30  # the line is written once the response has gone out
    while not (lines := [ln for ln in server.log_path.read_text().splitlines() if expected in ln]):
        assert time.monotonic() < deadline, f"no request line with {expected!r}"
        time.sleep(0.05)
    assert re.search(r", \d+(?: ms|\.\d\d s), slot \d+$", lines[-1]), lines
