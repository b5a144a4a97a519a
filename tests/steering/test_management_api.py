"""The rest of the management API against one real server (qwen2-tiny, a MiniLM embedder
beside it, an API key): SAE compatibility, batch steering and the `live` report, enable /
disable / clear, monitoring (configure, enable, history, statistics, top; scoring records
nothing), profiles save-current and export -> import, models list / load / unload / lock /
unlock (a locked server lists only that model in /v1/models and refuses load and unload), inference health."""

from __future__ import annotations

import httpx
import pytest

from mlxcel.backends.select import choose
from tests.conftest import ServerProcess
from tests.fixtures import MINILM, QWEN2_TINY, QWEN3_TINY, available
from tests.steering.test_circuits_units import circuit_doc
from tests.steering.test_sae_units import random_sae

pytestmark = pytest.mark.skipif(not (available(QWEN2_TINY) and available(MINILM)),
                                reason="run scripts/fixtures/build_all.py")
KEY = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    s = ServerProcess(["-m", QWEN2_TINY, "--offline", "-c", "1024", "-np", "2", "--state-dir", str(state),
                       "--embedding-model", MINILM, "--api-key", "sekrit"],
                      env={"MLXCEL_SAE_DIR": str(tmp_path_factory.getbasetemp())})  # the tests' SAEs lie under it
    yield s
    s.stop()


def call(srv, method, path, **kw):
    r = httpx.request(method, srv.base_url + path, headers=KEY, timeout=120, **kw)
    body = r.json()
    assert set(body) == {"success", "data", "error"} or path.startswith("/v1"), body
    return r, body


def chat(srv, **extra):
    return httpx.post(srv.base_url + "/v1/chat/completions", headers=KEY, timeout=120, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0, **extra})


def test_the_api_is_behind_the_key(srv):
    assert httpx.get(srv.base_url + "/api/saes").status_code == 401
    r, body = call(srv, "GET", "/api/health/inference")
    assert body["data"]["inference_backend"] == choose("auto", "auto").backend  # the server runs on auto
    assert body["data"]["per_request_steering"] == "in_batch"  # on either backend


def test_compatibility_batch_steering_and_live(srv, tmp_path):
    good = random_sae(tmp_path / "good", d_in=64, d_sae=16, layer=1)
    wide = random_sae(tmp_path / "wide", d_in=32, d_sae=16, layer=1)
    r, body = call(srv, "POST", "/api/saes/compatibility", json={"path": str(good)})
    assert body["data"]["compatible"] and body["data"]["errors"] == [] and body["data"]["sae"]["layer"] == 1
    r, body = call(srv, "POST", "/api/saes/compatibility", json={"path": str(wide)})
    assert not body["data"]["compatible"] and "d_in 32" in body["data"]["errors"][0]
    r, body = call(srv, "POST", "/api/saes/compatibility", json={"path": str(tmp_path / "none")})
    assert r.status_code == 404 and body["error"]["code"] == "sae_not_found"

    assert call(srv, "POST", "/api/saes/attach", json={"path": str(good)})[0].status_code == 201
    r, body = call(srv, "POST", "/api/saes/steering/batch", json={"steering": {"2": 30, "5": -300}})
    assert body["data"]["steering"] == {"2": 30.0, "5": -200.0} and body["data"]["live"] is True
    r, body = call(srv, "POST", "/api/saes/good/steering/batch",
                   json={"steering": [{"feature_idx": 7, "value": 4}]})
    assert body["data"]["steering"] == {"2": 30.0, "5": -200.0, "7": 4.0}
    r, body = call(srv, "POST", "/api/saes/good/steering/batch", json={"steering": {"99": 1}})
    assert r.status_code == 400 and body["error"]["code"] == "invalid_feature_index"
    assert call(srv, "GET", "/api/saes/steering")[1]["data"]["values"] == {"good": {"2": 30.0, "5": -200.0, "7": 4.0}}
    assert call(srv, "DELETE", "/api/saes/good/steering/5")[1]["data"]["steering"] == {"2": 30.0, "7": 4.0}
    assert call(srv, "POST", "/api/saes/steering/disable")[1]["data"][0]["live"] is False
    assert call(srv, "POST", "/api/saes/steering/enable")[1]["data"][0]["enabled"] is True

    # an active profile is the steering base: the live values are reported as not live
    r, body = call(srv, "POST", "/api/profiles/save-current", json={"name": "snap", "description": "d"})
    assert r.status_code == 201 and body["data"]["steering"] == {"2": 30.0, "7": 4.0}
    call(srv, "POST", "/api/profiles/snap/activate")
    assert call(srv, "GET", "/api/saes/good/steering")[1]["data"]["live"] is False
    assert call(srv, "GET", "/api/saes/steering")[1]["data"]["base"] == "profile:snap"
    call(srv, "POST", "/api/profiles/deactivate")
    exported = call(srv, "GET", "/api/profiles/snap/export")[1]["data"]
    call(srv, "DELETE", "/api/profiles/snap")
    r, body = call(srv, "POST", "/api/profiles/import", json=exported)
    assert r.status_code == 201 and call(srv, "GET", "/api/profiles/snap/export")[1]["data"] == exported
    assert call(srv, "DELETE", "/api/saes/steering")[1]["data"][0]["steering"] == {}

    # monitoring reads user traffic, never scoring
    r, body = call(srv, "POST", "/api/monitoring/history")
    assert r.status_code == 405 and body["error"]["code"] == "method_not_allowed"  # the envelope, even here
    r, body = call(srv, "GET", "/api/monitoring/history")
    assert r.status_code == 409 and body["error"]["code"] == "monitoring_not_configured"
    r, body = call(srv, "POST", "/api/monitoring/configure", json={"top_k": 3, "history_size": 50})
    assert body["data"]["enabled"] and body["data"]["sae_id"] == "good" and body["data"]["history_size"] == 50
    assert call(srv, "POST", "/api/monitoring/configure", json={"top_k": 65})[0].status_code == 400
    score = httpx.post(srv.base_url + "/v1/completions", headers=KEY, timeout=60,
                       json={"prompt": "hi", "max_tokens": 1, "logprobs": 1, "allowed_token_ids": [1, 2]})
    assert score.status_code == 200
    assert call(srv, "GET", "/api/monitoring/history")[1]["data"]["total"] == 0
    r = chat(srv)
    n = r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"] - 1  # last token unread
    history = call(srv, "GET", "/api/monitoring/history?limit=1000")[1]["data"]
    assert history["total"] == n and all(len(rec["features"]) <= 3 for rec in history["records"])
    stats = call(srv, "GET", "/api/monitoring/statistics")[1]["data"]
    assert stats["total_activations"] == n and stats["features"]
    top = call(srv, "POST", "/api/monitoring/statistics/top", json={"k": 2, "metric": "max"})[1]["data"]
    assert len(top["features"]) <= 2 and top["metric"] == "max"
    assert [f["max"] for f in top["features"]] == sorted((f["max"] for f in stats["features"]), reverse=True)[:2]
    assert call(srv, "GET", "/api/monitoring/top?k=2&metric=max")[1]["data"] == top
    assert call(srv, "POST", "/api/monitoring/enable", json={"enabled": False})[1]["data"]["enabled"] is False
    chat(srv)
    assert call(srv, "GET", "/api/monitoring/history")[1]["data"]["total"] == min(n, 50)
    assert call(srv, "DELETE", "/api/monitoring/history")[1]["data"]["cleared"] == n
    assert call(srv, "DELETE", "/api/monitoring/statistics")[1]["data"]["cleared"] == n
    call(srv, "POST", "/api/monitoring/configure", json={"enabled": False})
    call(srv, "DELETE", "/api/saes/good")


def test_per_sae_and_per_feature_routes_profile_update_and_clusters(srv, tmp_path):
    """The routes the test above leaves out: per-SAE enable/disable and compatibility, one
    feature at a time, profile get/update, clusters list/activate (refused when the attached
    SAE cannot run it), circuits get/delete; every answer in the envelope."""
    sae = random_sae(tmp_path / "m", d_in=64, d_sae=16, layer=1)
    assert call(srv, "POST", "/api/saes/attach", json={"path": str(sae)})[0].status_code == 201
    try:
        r, body = call(srv, "GET", "/api/saes/m/compatibility")
        assert body["data"]["compatible"] and body["data"]["sae"]["d_sae"] == 16
        r, body = call(srv, "GET", "/api/saes/nope/compatibility")
        assert r.status_code == 404 and body["error"]["code"] == "sae_not_attached"
        assert set(body["error"]) == {"code", "message", "details"}
        assert call(srv, "POST", "/api/saes/m/steering/3", json={"strength": 250})[1]["data"]["steering"] == \
            {"3": 200.0}  # clamped to ±200
        r, body = call(srv, "POST", "/api/saes/m/steering/16", json={"strength": 1})
        assert r.status_code == 400 and body["error"]["code"] == "invalid_feature_index"
        r, body = call(srv, "POST", "/api/saes/m/disable")
        assert body["data"]["enabled"] is False and body["data"]["live"] is False
        assert call(srv, "POST", "/api/saes/m/enable")[1]["data"]["live"] is True
        assert call(srv, "POST", "/api/saes/m/explode")[0].status_code == 404

        r, body = call(srv, "POST", "/api/profiles", json={"name": "P2", "sae_id": "m", "steering": {"1": 2}})
        assert r.status_code == 201
        r, body = call(srv, "PUT", "/api/profiles/P2", json={"description": "new", "steering": {"4": -3}})
        assert body["data"]["description"] == "new" and body["data"]["steering"] == {"4": -3.0}
        assert call(srv, "GET", "/api/profiles/P2")[1]["data"]["steering"] == {"4": -3.0}
        assert call(srv, "GET", "/api/profiles/none")[0].status_code == 404

        wide = b'{"name": "wide", "sae_id": "m", "features": [{"index": 40, "strength": 1}]}'
        fits = b'{"name": "fits", "sae_id": "m", "features": {"2": 8}, "intensity": 0.5}'
        for doc in (wide, fits):
            assert call(srv, "POST", "/api/clusters/import", content=doc)[0].status_code == 201
        assert call(srv, "POST", "/api/clusters/import", content=b"{}")[1]["error"]["code"] == "invalid_cluster"
        listed = call(srv, "GET", "/api/clusters")[1]["data"]
        assert {c["name"] for c in listed} >= {"wide", "fits"} and all(c["kind"] == "cluster" for c in listed)
        r, body = call(srv, "POST", "/api/clusters/wide/activate")  # feature 40 is past the SAE's width
        assert r.status_code == 400 and body["error"]["code"] == "profile_invalid"
        assert call(srv, "POST", "/api/clusters/P2/activate")[0].status_code == 404  # a profile, not a cluster
        assert call(srv, "POST", "/api/clusters/fits/activate")[1]["data"]["active"] is True
        assert call(srv, "GET", "/api/saes/steering")[1]["data"]["base"] == "profile:fits"
        r, body = call(srv, "PUT", "/api/clusters/fits/intensity", json={"intensity": "min"})
        assert body["data"]["intensity"] == 0.5  # undeclared range: CLUSTER_INTENSITY_MIN
        r, body = call(srv, "DELETE", "/api/saes/m")  # the active cluster runs through it
        assert r.status_code == 409 and body["error"]["code"] == "profile_active" and "fits" in body["error"]["message"]
        assert chat(srv).status_code == 200  # still attached, still serving
        call(srv, "POST", "/api/profiles/deactivate")
        for name in ("P2", "wide", "fits"):
            assert call(srv, "DELETE", f"/api/profiles/{name}")[0].status_code == 200

        r, body = call(srv, "POST", "/api/circuits/import", content=circuit_doc(name="gone"))
        assert r.status_code == 201
        assert call(srv, "GET", "/api/circuits/gone")[1]["data"]["name"] == "gone"
        assert call(srv, "DELETE", "/api/circuits/gone")[1]["data"] == {"deleted": "gone"}
        r, body = call(srv, "GET", "/api/circuits/gone")
        assert r.status_code == 404 and body["error"]["code"] == "circuit_not_found"
    finally:
        call(srv, "DELETE", "/api/saes/m")


def test_models_list_lock_and_refused_switching(srv):
    listed = lambda: [m["id"] for m in httpx.get(srv.base_url + "/v1/models", headers=KEY).json()["data"]]  # noqa: E731
    unlocked = listed()  # the chat model and the embedder, then the store's switchable checkpoints
    assert unlocked[0] == QWEN2_TINY and QWEN3_TINY in unlocked
    r, body = call(srv, "GET", "/api/models")
    models = {m["id"]: m for m in body["data"]}
    assert models[QWEN2_TINY]["status"] == "loaded" and models[QWEN3_TINY]["status"] == "ready"
    r, body = call(srv, "POST", f"/api/models/{QWEN2_TINY}/lock")
    assert body["data"]["locked"] is True
    assert listed() == [QWEN2_TINY]
    assert call(srv, "POST", f"/api/models/{QWEN2_TINY}/load")[1]["data"]["status"] == "loaded"
    r, body = call(srv, "POST", f"/api/models/{QWEN3_TINY}/load")  # locked: no switch
    assert r.status_code == 409 and body["error"]["code"] == "model_locked"
    r, body = call(srv, "POST", f"/api/models/{QWEN3_TINY}/lock")
    assert r.status_code == 409 and body["error"]["code"] == "model_not_loaded"
    r, body = call(srv, "POST", f"/api/models/{QWEN2_TINY}/unload")
    assert r.status_code == 409 and body["error"]["code"] == "model_locked"
    assert call(srv, "POST", f"/api/models/{QWEN2_TINY}/unlock")[1]["data"]["locked"] is False
    assert listed() == unlocked
    assert call(srv, "GET", "/api/health/inference")[1]["data"]["locked_model"] is None
