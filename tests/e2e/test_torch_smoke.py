"""A smoke subset of the e2e suite on `--backend torch`: the small set scripts/bench/gpu_check.sh
runs on a CUDA machine (the full default-model matrix runs on both backends through the
`default_server` fixture; MLXCEL_TEST_BACKENDS=torch narrows it to torch).

MLXCEL_TEST_DEVICE picks the device (default cpu); gpu_check.sh sets it to cuda.
"""

from __future__ import annotations

import os
import re

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, ServerProcess, fixture_path


@pytest.fixture(scope="module")
def torch_server():
    fixture_path(DEFAULT_MODEL)
    device = os.environ.get("MLXCEL_TEST_DEVICE", "cpu")
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--backend", "torch", "--device", device])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(torch_server):
    from openai import OpenAI

    return OpenAI(base_url=torch_server.base_url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def test_props_and_log_name_the_torch_backend(torch_server):
    backend = httpx.get(torch_server.base_url + "/props").json()["backend"]
    assert backend["name"] == "torch" and backend["device"].startswith(os.environ.get("MLXCEL_TEST_DEVICE", "cpu"))
    assert backend["reason"] == "requested"
    log = torch_server.log()
    assert "backend torch on" in log
    # one line format from start to end: Litestar must not replace the CLI's logging when it starts
    loaded = next(line for line in log.splitlines() if " loaded: " in line)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} I model ", loaded), loaded
    if backend["device"] == "cpu" and backend["compute_dtype"] in ("bfloat16", "float32"):
        # the CI machine kind has a C++ compiler: the served model runs mlxcel's row kernel
        assert f"decode rows' {backend['compute_dtype']} linears via mlxcel row kernel" in log


def test_chat_greedy_answers_paris(client):
    r = client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_tokens=40,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


def test_stream_concatenates_to_non_stream(client):
    kwargs = dict(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Name three colors."}],
                  temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full


def test_native_completion(torch_server):
    r = httpx.post(torch_server.base_url + "/completion", timeout=120,
                   json={"prompt": "The capital of France is", "n_predict": 8, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["tokens_predicted"] == 8 and "Paris" in body["content"]
