"""The server's steering reaches every generation route, not only /v1/chat/completions and
/v1/completions: native /completion, /completions and /infill, /v1/responses, /responses and
/v1/messages (qwen2-tiny, random SAEs at layers 0 and 1, one server for the module).

Measurement: each route's greedy text under the live values, an active profile and an active
circuit differs from its unsteered text, and equals what its /v1 twin generates for the same
prompt under the same steering (native /completion and /completions = /v1/completions;
/v1/responses and /v1/messages = /v1/chat/completions), so every route is steered the same
way chat is. Clearing the values gives back the unsteered text byte for byte. The rung header
of an active circuit rides on every route's answer, streamed or not. The per-request steering
fields, which the seed gives to /v1 chat (and activations to text completions) only, are
refused with 400 on the other routes. /v1/embeddings, served by the generation model, is the
exception the seed names: never steered.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.fixtures import QWEN2_TINY, available
from tests.steering.sfv import parse_item
from tests.steering.test_circuits_units import circuit_doc
from tests.steering.test_sae_units import random_sae

pytestmark = pytest.mark.skipif(not available(QWEN2_TINY), reason="run scripts/fixtures/build_all.py")
RUNG = "X-miLLM-Circuit-Rung"
N = 6
USER = "Tell me about the sea"
TEXT = "Once upon a time"
INFILL = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n"}

# route -> (path, body, how to read the generated text)
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": USER}], "max_tokens": N},
             lambda j: j["choices"][0]["message"]["content"]),
    "responses": ("/v1/responses", {"input": USER, "max_output_tokens": N},
                  lambda j: "".join(p["text"] for item in j["output"] if item["type"] == "message"
                                    for p in item["content"])),
    "responses_alias": ("/responses", {"input": USER, "max_output_tokens": N},
                        lambda j: "".join(p["text"] for item in j["output"] if item["type"] == "message"
                                          for p in item["content"])),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": USER}], "max_tokens": N},
                 lambda j: "".join(b["text"] for b in j["content"] if b["type"] == "text")),
    "v1_completions": ("/v1/completions", {"prompt": TEXT, "max_tokens": N}, lambda j: j["choices"][0]["text"]),
    "completion": ("/completion", {"prompt": TEXT, "n_predict": N}, lambda j: j["content"]),
    "completions": ("/completions", {"prompt": TEXT, "n_predict": N}, lambda j: j["content"]),
    "infill": ("/infill", {**INFILL, "n_predict": N}, lambda j: j["content"]),
}
CHAT_FAMILY = ("chat", "responses", "responses_alias", "messages")
TEXT_FAMILY = ("v1_completions", "completion", "completions")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("every-route")
    saes = [random_sae(tmp / f"s{layer}", d_in=64, d_sae=32, layer=layer, seed=layer + 1) for layer in (0, 1)]
    s = ServerProcess(["-m", QWEN2_TINY, "--offline", "-c", "1024", "-np", "2", "--state-dir", str(tmp / "state")],
                      env={"MLXCEL_SAE_DIR": str(tmp)})
    yield s, saes
    s.stop()


def call(base, route):
    path, body, _ = ROUTES[route]
    return httpx.post(base + path, json={**body, "temperature": 0}, timeout=120)


def texts(base):
    out = {}
    for route, (_, _, read) in ROUTES.items():
        r = call(base, route)
        assert r.status_code == 200, (route, r.text)
        out[route] = read(r.json())
    return out


def same_as_twins(t):
    assert len({t[r] for r in CHAT_FAMILY}) == 1, t
    assert len({t[r] for r in TEXT_FAMILY}) == 1, t


def differs(t, plain):
    for route in ROUTES:
        assert t[route] != plain[route], (route, t[route])


def test_per_request_steering_fields_are_refused_off_v1_chat(srv):
    s, _ = srv
    for route in ("completion", "infill", "responses", "messages"):
        for field, value in (("profile", "A"), ("steering_intensity", 0.5),
                             ("return_sae_activations", {"top_k": 2}), ("steering", {"1": 2})):
            path, body, _ = ROUTES[route]
            r = httpx.post(s.base_url + path, json={**body, field: value}, timeout=60)
            assert r.status_code == 400, (route, field, r.text)
            assert f"'{field}' is not honoured" in r.json()["error"]["message"], (route, r.text)
    # null is an absent field
    assert httpx.post(s.base_url + "/completion", json={"prompt": TEXT, "n_predict": 1, "profile": None},
                      timeout=60).status_code == 200


def test_live_values_steer_every_route_as_they_steer_chat(srv):
    s, (_, s1) = srv
    api = s.base_url + "/api"
    plain = texts(s.base_url)
    same_as_twins(plain)
    assert httpx.post(api + "/saes/attach", json={"path": str(s1)}).status_code == 201
    assert httpx.put(api + "/saes/s1/steering", json={"values": {"2": 30}}).json()["data"]["live"] is True
    steered = texts(s.base_url)
    same_as_twins(steered)
    differs(steered, plain)
    # a streamed native answer is steered too
    with httpx.stream("POST", s.base_url + "/completion", timeout=120,
                      json={"prompt": TEXT, "n_predict": N, "temperature": 0, "stream": True}) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(f["content"] for f in frames if not f.get("stop")) == steered["completion"]
    assert httpx.delete(api + "/saes/s1/steering").status_code == 200
    assert texts(s.base_url) == plain  # no values: byte-identical to unsteered


def test_active_profile_and_circuit_steer_every_route(srv):
    s, (s0, _) = srv
    api = s.base_url + "/api"
    plain = {r: ROUTES[r][2](call(s.base_url, r).json()) for r in ROUTES}

    r = httpx.post(api + "/profiles", json={"name": "P", "sae_id": "s1", "steering": {"5": 25}})
    assert r.status_code == 201, r.text
    assert httpx.post(api + "/profiles/P/activate").json()["data"]["active"] is True
    under_profile = texts(s.base_url)
    same_as_twins(under_profile)
    differs(under_profile, plain)
    assert httpx.post(api + "/profiles/deactivate").status_code == 200

    assert httpx.post(api + "/saes/attach", json={"path": str(s0)}).status_code == 201
    r = httpx.post(api + "/circuits/import?activate=true", content=circuit_doc())
    assert r.status_code == 201, r.text
    answers = {route: call(s.base_url, route) for route in ROUTES}
    for route, a in answers.items():
        assert parse_item(a.headers[RUNG]) == (2, {"language": "causally validated (edge)"}), route
    under_circuit = {route: ROUTES[route][2](a.json()) for route, a in answers.items()}
    same_as_twins(under_circuit)
    differs(under_circuit, plain)
    for route in ("completion", "infill", "responses", "messages"):  # streamed answers carry the header too
        path, body, _ = ROUTES[route]
        with httpx.stream("POST", s.base_url + path, json={**body, "temperature": 0, "stream": True},
                          timeout=120) as r:
            assert r.status_code == 200 and parse_item(r.headers[RUNG])[0] == 2, route
            r.read()
    assert httpx.post(api + "/circuits/deactivate").status_code == 200
    after = call(s.base_url, "completion")
    assert RUNG not in after.headers and after.json()["content"] == plain["completion"]


def test_embeddings_are_never_steered(srv):
    """/v1/embeddings from the generation model runs with every attached SAE suppressed: under
    live values that change the completions, its vectors are bit-identical to the unsteered ones."""
    s, (_, s1) = srv
    api = s.base_url + "/api"

    def embed():
        r = httpx.post(s.base_url + "/v1/embeddings", json={"input": [USER, TEXT]}, timeout=120)
        assert r.status_code == 200, r.text
        return [d["embedding"] for d in r.json()["data"]]

    plain, plain_text = embed(), ROUTES["v1_completions"][2](call(s.base_url, "v1_completions").json())
    r = httpx.post(api + "/saes/attach", json={"path": str(s1)})
    # an earlier test of the module may have left it attached
    assert r.status_code == 201 or r.json()["error"]["code"] == "sae_already_attached", r.text
    assert httpx.put(api + "/saes/s1/steering", json={"values": {"2": 30}}).json()["data"]["live"] is True
    try:
        assert ROUTES["v1_completions"][2](call(s.base_url, "v1_completions").json()) != plain_text
        assert embed() == plain
        # and they are not user traffic: monitoring records nothing for them
        r = httpx.post(api + "/monitoring/configure", json={"sae_id": "s1", "top_k": 2})
        assert r.json()["data"]["enabled"] is True, r.text
        embed()
        assert httpx.get(api + "/monitoring/history").json()["data"]["total"] == 0
    finally:
        httpx.post(api + "/monitoring/configure", json={"enabled": False})
        assert httpx.delete(api + "/saes/s1/steering").status_code == 200
