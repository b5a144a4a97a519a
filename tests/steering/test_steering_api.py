"""The management API and the /v1 steering fields against a real server (qwen2-tiny):
the envelope, SAE attach/steering, profiles and clusters surviving a restart, the cluster
document round-trip byte for byte, and the per-request refusals and echo."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.fixtures import QWEN2_TINY, available
from tests.steering.test_sae_units import random_sae

pytestmark = pytest.mark.skipif(not available(QWEN2_TINY), reason="run scripts/fixtures/build_all.py")

CLUSTER = b'{"name": "calm",\n  "features": [{"index": 3, "strength": 20.5}, {"index": 8, "strength": -4}],\n' \
          b'  "sae_id": "tiny", "intensity_range": [0.5, 1.5], "extra": {"kept": "as sent"}}'


def server(state):
    return ServerProcess(["-m", QWEN2_TINY, "--offline", "-c", "1024", "-np", "2", "--state-dir", str(state)],
                         env={"MLXCEL_SAE_DIR": str(state.parent)})  # the test's SAEs lie beside the state


def chat(base, **extra):
    return httpx.post(base + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, **extra})


def test_management_api_and_request_fields_persist_across_restart(tmp_path):
    sae_dir = random_sae(tmp_path / "tiny", d_in=64, d_sae=16, layer=1)
    s = server(tmp_path / "state")
    try:
        api = s.base_url + "/api"
        health = httpx.get(api + "/health/inference").json()
        assert health["success"] and health["data"]["backend"] == "continuous_batching"
        # no SAE attached: a profile request runs unsteered, the dial is not echoed
        plain = chat(s.base_url)
        r = httpx.post(api + "/saes/attach", json={"path": str(sae_dir)})
        assert r.status_code == 201 and r.json()["data"]["layer"] == 1, r.text
        bad = httpx.post(api + "/saes/attach", json={"path": str(tmp_path / "none")}).json()
        assert bad == {"success": False, "data": None, "error": bad["error"]} and bad["error"]["code"] == "sae_not_found"
        r = httpx.put(api + "/saes/tiny/steering", json={"values": {"2": 30}})
        assert r.json()["data"]["steering"] == {"2": 30.0}
        assert httpx.put(api + "/saes/tiny/steering", json={"values": {"99": 1}}).json()["error"]["code"] \
            == "invalid_feature_index"
        r = httpx.post(api + "/profiles", json={"name": "A", "sae_id": "tiny", "steering": {"5": 12}})
        assert r.status_code == 201, r.text
        r = httpx.post(api + "/clusters/import", content=CLUSTER)
        assert r.status_code == 201 and r.json()["data"]["intensity_range"] == [0.5, 1.5], r.text
        assert httpx.put(api + "/clusters/calm/intensity", json={"intensity": 0.75}).json()["data"]["intensity"] == 0.75
        assert httpx.put(api + "/clusters/calm/intensity", json={"intensity": 1.9}).status_code == 400

        r = chat(s.base_url, profile="nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "profile_not_found"
        r = chat(s.base_url, steering_intensity=2.5)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_parameter"
        r = chat(s.base_url, profile="calm", steering_intensity="max")
        assert r.status_code == 200 and r.headers["X-miLLM-Steering-Intensity"] == "1.5"
        off = chat(s.base_url, steering_intensity="off")
        assert off.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        r = chat(s.base_url, return_sae_activations={"top_k": 3, "positions": "prompt"})
        acts = r.json()["millm"]["sae_activations"]
        assert acts["sae_id"] == "tiny" and acts["layer"] == 1 and acts["read_point"] == "post_steering"
        assert [p["position"] for p in acts["positions"]] == list(range(r.json()["usage"]["prompt_tokens"]))
        assert all(len(p["features"]) == 3 for p in acts["positions"])
        assert chat(s.base_url, return_sae_activations={"top_k": 65}).status_code == 400
        assert "millm" not in plain.json()
        assert httpx.post(api + "/profiles/A/activate").json()["data"]["active"] is True
    finally:
        s.stop()
    s = server(tmp_path / "state")
    try:
        api = s.base_url + "/api"
        profiles = {p["name"]: p for p in httpx.get(api + "/profiles").json()["data"]}
        assert profiles["A"]["active"] and profiles["A"]["steering"] == {"5": 12.0}
        assert profiles["calm"]["intensity"] == 0.75
        exported = httpx.get(api + "/clusters/calm/export")
        assert exported.status_code == 200 and exported.content == CLUSTER
    finally:
        s.stop()
