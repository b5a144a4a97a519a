"""LoRA adapters on a real server, per backend: the fixture adapter (scripts/fixtures/build_lora.py)
loaded with --lora --lora-init-without-apply next to the plain default server.

Greedy /completion with n_probs throughout, so "identical" covers the probabilities too.
A server whose adapter sits at 0.0 answers byte-identically to one without it; a request's
own `lora` changes that request only; POST /lora-adapters moves the server default; two
concurrent requests at different scales in one batch each match their solo output; /v1
reads the same field; malformed bodies get b10621's answers.
"""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, ServerProcess
from tests.fixtures import LORA_SMOLLM2, fixture_path, lora_available

PROMPT = "The capital of France is"
BODY = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "n_probs": 3, "cache_prompt": False}


@pytest.fixture(scope="module")
def lora_server(default_server):
    if not lora_available(LORA_SMOLLM2):
        pytest.fail(f"fixture adapter {LORA_SMOLLM2} is missing: run `make fixtures`")
    device = os.environ.get("MLXCEL_TEST_DEVICE", "cpu") if default_server.backend == "torch" else "cpu"
    s = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--backend", default_server.backend, "--device", device,
                       "--lora", str(fixture_path(LORA_SMOLLM2)), "--lora-init-without-apply"])
    s.base = default_server
    yield s
    s.stop()


def _complete(server, **extra) -> dict:
    r = httpx.post(server.base_url + "/completion", json={**BODY, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _out(res: dict) -> tuple:
    return res["content"], res["completion_probabilities"]


def _post_scales(server, body):
    return httpx.post(server.base_url + "/lora-adapters", json=body, timeout=30)


def test_get_lists_adapters_in_b10621_shape(lora_server):
    r = httpx.get(lora_server.base_url + "/lora-adapters", timeout=30)
    assert r.status_code == 200
    assert r.json() == [{"id": 0, "path": str(fixture_path(LORA_SMOLLM2)), "scale": 0.0, "task_name": "",
                         "prompt_prefix": ""}]
    assert httpx.get(lora_server.base.base_url + "/lora-adapters", timeout=30).json() == []


def test_scales_live_per_request_and_by_post(lora_server):
    base = _out(_complete(lora_server.base))
    assert _out(_complete(lora_server)) == base  # adapter at 0.0: byte-identical to no adapter
    adapted_res = _complete(lora_server, lora=[{"id": 0, "scale": 1.0}])
    adapted = _out(adapted_res)
    assert adapted[0] != base[0]
    assert adapted_res["generation_settings"]["lora"] == [{"id": 0, "scale": 1.0}]
    assert _out(_complete(lora_server)) == base  # the per-request scale left the server default alone
    assert _out(_complete(lora_server, lora=[{"id": 5, "scale": 1.0}])) == base  # unknown ids are ignored

    try:
        assert _post_scales(lora_server, [{"id": 0, "scale": 1.0}]).json() == {"success": True}
        assert httpx.get(lora_server.base_url + "/lora-adapters", timeout=30).json()[0]["scale"] == 1.0
        assert _out(_complete(lora_server)) == adapted
        assert _out(_complete(lora_server, lora=[])) == base  # listed nothing: every adapter at 0.0
        # /v1 reads the same field
        r = httpx.post(lora_server.base_url + "/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "lora": [{"id": 0, "scale": 0.0}]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == base[0]
        assert "X-miLLM-Ignored-Fields" not in r.headers
        assert _post_scales(lora_server, []).json() == {"success": True}  # unlisted drop to 0.0
        assert _out(_complete(lora_server)) == base
    finally:
        _post_scales(lora_server, [])


def _text_and_ids(res: dict) -> tuple:
    return res["content"], [p["id"] for p in res["completion_probabilities"]]


def test_concurrent_rows_keep_their_own_scales(lora_server):
    """Same text and tokens as alone (a batched matmul may round the last bits differently,
    as it does without adapters, so probabilities are not compared bit for bit here)."""
    solo = {s: _text_and_ids(_complete(lora_server, lora=[{"id": 0, "scale": s}], n_predict=24)) for s in (1.0, 0.0)}
    assert solo[1.0][0] != solo[0.0][0]
    results: dict[float, tuple] = {}
    barrier = threading.Barrier(2)

    def run(scale):
        barrier.wait()
        results[scale] = _text_and_ids(_complete(lora_server, lora=[{"id": 0, "scale": scale}], n_predict=24))

    threads = [threading.Thread(target=run, args=(s,)) for s in solo]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo


def test_malformed_bodies(lora_server):
    r = _post_scales(lora_server, {"id": 0, "scale": 1.0})
    assert r.status_code == 400
    assert r.json()["error"] == {"code": 400, "message": "Request body must be an array",
                                 "type": "invalid_request_error"}
    r = httpx.post(lora_server.base_url + "/completion", json={**BODY, "lora": {"id": 0}}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("Field 'lora': Error: 'lora' must be an array of objects with "
                                            "'id' and 'scale' fields")
