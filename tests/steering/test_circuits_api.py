"""Circuits, per-request activations and suppression against a real server (qwen2-tiny with a
MiniLM embedder beside it, two random SAEs at layers 0 and 1):

- an imported circuit steers through both layers; `X-miLLM-Circuit-Rung` and
  `X-miLLM-Steering-Intensity` parse as RFC 8941 Items and are absent exactly when the seed
  says (off, slice fallback, no SAE on any member layer, no dial sent);
- `return_sae_activations` on streamed chat (last chunk before [DONE]) and on /v1/completions
  (streamed, not streamed, scoring with read_point "unsteered");
- embeddings, completion scoring and chat scoring are identical with and without active
  steering, and scoring responses carry `X-miLLM-Steering: none`;
- the circuit, its dial and its active flag survive a restart; export is byte for byte.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.fixtures import MINILM, QWEN2_TINY, available
from tests.steering.sfv import parse_item
from tests.steering.test_circuits_units import circuit_doc
from tests.steering.test_sae_units import random_sae

pytestmark = pytest.mark.skipif(not (available(QWEN2_TINY) and available(MINILM)),
                                reason="run scripts/fixtures/build_all.py")
RUNG, DIAL, STEERING = "X-miLLM-Circuit-Rung", "X-miLLM-Steering-Intensity", "X-miLLM-Steering"


def server(state):
    return ServerProcess(["-m", QWEN2_TINY, "--offline", "-c", "1024", "-np", "2", "--state-dir", str(state),
                          "--embedding-model", MINILM], env={"MLXCEL_SAE_DIR": str(state.parent)})


def chat(base, **extra):
    return httpx.post(base + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6, "temperature": 0, **extra})


def sse(base, path, body):
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        return r.headers, frames


SCORED = list(range(100))  # allowed_token_ids: what makes a request a scoring one


def measures(base):
    """What must not move under steering: embeddings, completion scoring, chat scoring."""
    emb = httpx.post(base + "/v1/embeddings", json={"input": ["hello world"]}, timeout=60)
    score = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": "The sky is", "max_tokens": 1, "logprobs": 5, "temperature": 0, "allowed_token_ids": SCORED})
    chat_score = chat(base, max_tokens=1, logprobs=True, top_logprobs=5, allowed_token_ids=SCORED)
    for r in (emb, score, chat_score):
        assert r.status_code == 200, r.text
    assert STEERING not in emb.headers  # embeddings run on their own model, which never has an SAE
    assert score.headers[STEERING] == "none" and chat_score.headers[STEERING] == "none"
    return (emb.json()["data"], score.json()["choices"], chat_score.json()["choices"])


def rung_of(r):
    value, params = parse_item(r.headers[RUNG])
    return value, params


def test_circuit_activations_suppression_and_headers(tmp_path):
    s0 = random_sae(tmp_path / "s0", d_in=64, d_sae=32, layer=0, seed=1)
    s1 = random_sae(tmp_path / "s1", d_in=64, d_sae=32, layer=1, seed=2)
    doc = circuit_doc()
    s = server(tmp_path / "state")
    try:
        base, api = s.base_url, s.base_url + "/api"
        plain = chat(base)
        assert RUNG not in plain.headers and DIAL not in plain.headers
        for path in (s0, s1):
            assert httpx.post(api + "/saes/attach", json={"path": str(path)}).status_code == 201
        before = measures(base)

        r = httpx.post(api + "/circuits/import", content=doc)
        assert r.status_code == 201, r.text
        c = r.json()["data"]
        assert (c["rung"], c["rung_language"], c["serving_mode"], c["layers"]) == (
            2, "causally validated (edge)", "full", [0, 1])
        assert httpx.get(api + "/circuits/active").json() == {"success": True, "data": None, "error": None}
        r = httpx.post(api + "/circuits/import?activate=true", content=circuit_doc(name="mined", edges=()))
        assert r.status_code == 409 and r.json()["error"]["code"] == "unvalidated_circuit"  # and not imported
        assert [c["name"] for c in httpx.get(api + "/circuits").json()["data"]] == ["loop"]
        low = httpx.post(api + "/circuits/import", content=circuit_doc(name="mined", edges=()))
        refused = httpx.post(api + f"/circuits/{low.json()['data']['id']}/activate")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "unvalidated_circuit"
        r = httpx.post(api + f"/circuits/{c['id']}/activate")
        assert r.status_code == 200 and r.json()["data"]["steering"]["rung"] == 2, r.text

        steered = chat(base)
        assert rung_of(steered) == (2, {"language": "causally validated (edge)"})
        assert DIAL not in steered.headers  # no dial sent: no echo
        assert steered.json()["choices"][0]["message"] != plain.json()["choices"][0]["message"]
        clamped = chat(base, steering_intensity=0.1)  # below the declared floor: clamped to 0.5
        assert parse_item(clamped.headers[DIAL]) == (0.5, {}) and rung_of(clamped)[0] == 2
        assert parse_item(chat(base, steering_intensity="max").headers[DIAL]) == (1.5, {})
        off = chat(base, steering_intensity="off")
        assert RUNG not in off.headers and parse_item(off.headers[DIAL]) == (0.0, {})
        assert off.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        assert measures(base) == before  # suppressed for their own rows while the circuit steers

        # activations: streamed chat ends with one choices: [] chunk carrying millm, before [DONE]
        headers, frames = sse(base, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "return_sae_activations": {"sae_id": "s1", "top_k": 2, "positions": "all"}})
        assert rung_of(httpx.Response(200, headers=headers))[0] == 2
        assert frames[-1] == "[DONE]"
        last = json.loads(frames[-2])
        assert last["choices"] == [] and last["millm"]["sae_activations"]["layer"] == 1
        assert all("millm" not in json.loads(f) for f in frames[:-2])
        assert all(len(p["features"]) == 2 for p in last["millm"]["sae_activations"]["positions"])
        # text completions: not streamed, streamed, scoring
        body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0,
                "return_sae_activations": {"sae_id": "s0", "positions": "completion", "top_k": 1}}
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        acts = r.json()["millm"]["sae_activations"]
        n_prompt = r.json()["usage"]["prompt_tokens"]
        assert [p["position"] for p in acts["positions"]] == [n_prompt, n_prompt + 1]  # the last token is unread
        assert r.headers[RUNG].startswith("2;")  # the active circuit steers text completions too
        _, frames = sse(base, "/v1/completions", body)
        assert json.loads(frames[-2])["millm"]["sae_activations"] == acts
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": "The sky is", "max_tokens": 1, "logprobs": 2, "allowed_token_ids": SCORED,
            "return_sae_activations": {"sae_id": "s0", "positions": "prompt"}})
        assert r.json()["millm"]["sae_activations"]["read_point"] == "unsteered" and r.headers[STEERING] == "none"
        assert RUNG not in r.headers
        for bad in ({"prompt": ["a", "b"]}, {"return_sae_activations": {"top_k": 65, "sae_id": "s0"}},
                    {"return_sae_activations": {"sae_id": "s0"}, "max_tokens": 70000},
                    {"return_sae_activations": {"top_k": 2}}):  # several SAEs attached: sae_id needed
            r = httpx.post(base + "/v1/completions", json={**body, **bad}, timeout=60)
            assert r.status_code == 400, (bad, r.text)
        assert "s0" in r.json()["error"]["message"] and "s1" in r.json()["error"]["message"]

        # one member layer loses its SAE: the circuit falls back to its slice, and the rung goes
        assert httpx.delete(api + "/saes/s1").status_code == 200
        active = httpx.get(api + "/circuits/active").json()["data"]
        assert active["serving_mode"] == "slice_fallback" and active["steering"] is None
        fallback = chat(base, steering_intensity=0.1)
        assert RUNG not in fallback.headers and parse_item(fallback.headers[DIAL]) == (0.1, {})
        r = httpx.put(api + "/circuits/active/intensity", json={"intensity": 0.75})
        assert r.json()["data"]["intensity"] == 0.75
        assert httpx.put(api + "/circuits/active/intensity", json={"intensity": 1.6}).status_code == 400
    finally:
        s.stop()
    s = server(tmp_path / "state")
    try:
        base, api = s.base_url, s.base_url + "/api"
        active = httpx.get(api + "/circuits/active").json()["data"]
        assert active["name"] == "loop" and active["intensity"] == 0.75 and active["serving_mode"] is None
        assert active["steering"] is None
        r = chat(base, steering_intensity=1.0)
        assert RUNG not in r.headers and DIAL not in r.headers  # no SAE on any member layer
        assert httpx.get(api + "/circuits/loop/export").content == doc
        assert [c["name"] for c in httpx.get(api + "/circuits").json()["data"]] == ["loop", "mined"]
    finally:
        s.stop()
