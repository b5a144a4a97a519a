"""Model switching through the openai SDK against a real server (api/model_switch.py).

One server starts on SmolLM2 over a private model store (symlinks to the real fixtures, plus
one broken checkpoint) with a 800 MiB weight budget: SmolLM2 (~520 MiB in fp32) and the tiny
Qwen2 fit, gemma-3-270m (~1 GiB in fp32) does not.
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import DEFAULT_MODEL, GEMMA3, MINILM, QWEN2_TINY, SAE_RANDOM, fixture_path as store_path

BROKEN = "broken/qwen2-no-weights"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    for ref in (DEFAULT_MODEL, QWEN2_TINY, GEMMA3, MINILM):
        (root / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / ref).symlink_to(fixture_path(ref), target_is_directory=True)
    (root / SAE_RANDOM).parent.mkdir(parents=True, exist_ok=True)
    (root / SAE_RANDOM).symlink_to(store_path(SAE_RANDOM), target_is_directory=True)
    broken = root / BROKEN  # a supported config and weights that are not safetensors at all
    broken.mkdir(parents=True)
    (broken / "config.json").write_text((fixture_path(QWEN2_TINY) / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    return root


@pytest.fixture(scope="module")
def server(store):
    # --backend mlx pinned: the memory estimate is at the compute dtype (fp32 on MLX's CPU), so the
    # 800 MiB budget refuses Gemma 3 (~1.1 GB in fp32) there but would admit it in torch's bf16
    s = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--backend", "mlx", "--model-memory-budget", "800",
                       "--graceful-unload-timeout", "120"],
                      # the store links the SAE in; SAEs are read only under these roots, symlinks resolved
                      env={"MLXCEL_MODELS_DIR": str(store), "MLXCEL_SAE_DIR": str(store_path(SAE_RANDOM).parent)})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)


def greedy(client, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.model == model and model in r.system_fingerprint
    return r.choices[0].text


def test_listing_refusals_and_switching(server, client):
    baseline = greedy(client, DEFAULT_MODEL)
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == DEFAULT_MODEL
    assert set(ids[1:]) == {QWEN2_TINY, GEMMA3, BROKEN}  # no embedder, no SAE: not generation checkpoints
    assert client.models.retrieve(QWEN2_TINY).id == QWEN2_TINY

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nobody/nothing", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:  # in the store, not a generation checkpoint
        client.chat.completions.create(model=SAE_RANDOM, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.InternalServerError) as e:  # refused while SmolLM2 still serves
        client.completions.create(model=GEMMA3, prompt="x", max_tokens=1)
    assert e.value.status_code == 503 and e.value.code == "insufficient_memory"
    assert "MiB" in e.value.message and "800" in e.value.message
    with pytest.raises(openai.InternalServerError) as e:  # a BERT embedder: no generation family
        client.completions.create(model=MINILM, prompt="x", max_tokens=1)
    assert e.value.status_code == 500 and e.value.code == "model_load_failed"
    assert greedy(client, DEFAULT_MODEL) == baseline  # nothing was unloaded

    # a load that fails after the unload: 500 model_load_failed, and the previous model is back
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=BROKEN, prompt="x", max_tokens=1)
    assert e.value.status_code == 500 and e.value.code == "model_load_failed"
    assert greedy(client, DEFAULT_MODEL) == baseline

    # switch to the tiny Qwen2 and back: each answers as itself
    chat = client.chat.completions.create(model=QWEN2_TINY, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == QWEN2_TINY and QWEN2_TINY in chat.system_fingerprint
    assert [m.id for m in client.models.list().data][0] == QWEN2_TINY
    tiny = greedy(client, QWEN2_TINY)
    assert tiny != baseline
    assert greedy(client, DEFAULT_MODEL) == baseline


def test_model_busy_during_a_switch_and_running_requests_finish(server, client):
    """A request running when the unload begins finishes in full; meanwhile every request,
    streamed or not, for either model, is refused with 503 model_busy before any stream."""
    assert greedy(client, DEFAULT_MODEL)
    n = 200
    with httpx.stream("POST", server.base_url + "/completion", timeout=300,
                      json={"prompt": PROMPT, "n_predict": n, "ignore_eos": True, "stream": True,
                            "temperature": 0}) as running:
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["stop"] is False
        switched: dict = {}

        def switch() -> None:
            switched["r"] = client.completions.create(model=QWEN2_TINY, prompt=PROMPT, max_tokens=2, temperature=0)

        t = threading.Thread(target=switch)
        t.start()
        busy = None
        for _ in range(2000):  # streamed requests for the loaded model until the switch begins
            try:
                list(client.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=1, stream=True))
            except openai.InternalServerError as e:
                busy = e
                break
            if "r" in switched:
                break
        assert busy is not None, "no request saw the switch"
        assert busy.status_code == 503 and busy.code == "model_busy" and "retry" in busy.message
        assert busy.response.headers["retry-after"] == "1"
        assert QWEN2_TINY in busy.message
        finals = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert finals[-1]["stop"] is True and finals[-1]["tokens_predicted"] == n and finals[-1]["stop_type"] == "limit"
    t.join(timeout=300)
    assert switched["r"].model == QWEN2_TINY
    assert greedy(client, DEFAULT_MODEL)  # and back


def test_steering_lock_pins_the_loaded_model(server, client):
    assert greedy(client, DEFAULT_MODEL)
    api = server.base_url + "/api"
    r = httpx.post(api + "/saes/attach", json={"path": str(store_path(SAE_RANDOM))})
    assert r.status_code == 201, r.text
    sae_id = r.json()["data"]["sae_id"]
    try:
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=QWEN2_TINY, prompt="x", max_tokens=1)
        assert e.value.code == "model_not_found" and "locked" in e.value.message
    finally:
        httpx.delete(f"{api}/saes/{sae_id}")
    assert QWEN2_TINY in [m.id for m in client.models.list().data]
    # the explicit lock of the management API pins the model the same way
    r = httpx.post(f"{api}/models/{DEFAULT_MODEL}/lock")
    assert r.status_code == 200, r.text
    try:
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=QWEN2_TINY, prompt="x", max_tokens=1)
        assert "locked" in e.value.message
    finally:
        httpx.post(f"{api}/models/{DEFAULT_MODEL}/unlock")
    assert QWEN2_TINY in [m.id for m in client.models.list().data]


def test_management_load_unload_and_messages_and_embeddings_switch(server, client):
    """/api/models/<id>/load and /unload run the same switching, answering in the management
    envelope; an unloaded server answers 503 model_not_loaded until a request names a store
    model; /v1/messages and /v1/embeddings switch models like the OpenAI generation routes."""
    api, base = server.base_url + "/api/models", server.base_url
    baseline = greedy(client, DEFAULT_MODEL)

    r = httpx.post(f"{api}/{QWEN2_TINY}/load", timeout=300)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert (r.json()["data"]["id"], r.json()["data"]["status"]) == (QWEN2_TINY, "loaded")
    assert [m.id for m in client.models.list().data][0] == QWEN2_TINY
    r = httpx.post(f"{api}/{GEMMA3}/load", timeout=300)  # refused while the tiny Qwen2 still serves
    assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_memory" and r.json()["data"] is None
    assert httpx.post(f"{api}/{QWEN2_TINY}/load", timeout=300).json()["data"]["status"] == "loaded"  # no-op

    r = httpx.post(f"{api}/{QWEN2_TINY}/unload", timeout=300)
    assert r.status_code == 200 and r.json()["data"]["status"] == "ready", r.text
    assert all(m["status"] != "loaded" for m in httpx.get(api).json()["data"])
    r = httpx.get(server.base_url + "/api/health/inference")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded" and "unloaded" in r.text
    with pytest.raises(openai.InternalServerError) as e:  # a request naming no model
        client.completions.create(model="", prompt="x", max_tokens=1)
    assert e.value.status_code == 503 and e.value.code == "model_not_loaded" and "unloaded" in e.value.message
    r = httpx.post(f"{api}/{QWEN2_TINY}/unload", timeout=300)
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_not_loaded"

    # /v1/messages naming a store model loads it onto the empty server, then switches
    msg = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(base + "/v1/messages", json={"model": QWEN2_TINY, **msg}, timeout=300)
    assert r.status_code == 200 and r.json()["model"] == QWEN2_TINY, r.text
    emb = client.embeddings.create(model=DEFAULT_MODEL, input="hello", encoding_format="float")
    assert emb.model == DEFAULT_MODEL and len(emb.data[0].embedding) == 576  # SmolLM2's hidden size
    r = httpx.post(base + "/v1/messages", json={"model": QWEN2_TINY, **msg}, timeout=300)
    assert r.status_code == 200 and r.json()["model"] == QWEN2_TINY
    r = httpx.post(f"{api}/{DEFAULT_MODEL}/load", timeout=300)
    assert r.status_code == 200 and r.json()["data"]["id"] == DEFAULT_MODEL
    assert greedy(client, DEFAULT_MODEL) == baseline


def test_unload_past_the_graceful_timeout_ends_a_running_stream_with_an_error_event(store):
    """An unload whose graceful timeout (0 s here) runs out ends a running /v1 stream with an SSE
    error event typed from the contract's table (model_busy: server_error), then `data: [DONE]`.
    --context-shift and --ignore-eos make the stream endless, so only the unload can end it."""
    s = ServerProcess(["-m", QWEN2_TINY, "--offline", "--backend", "mlx", "-c", "256", "--context-shift",
                       "--ignore-eos", "--graceful-unload-timeout", "0"], env={"MLXCEL_MODELS_DIR": str(store)})
    try:
        with httpx.stream("POST", s.base_url + "/v1/completions", timeout=300,
                          json={"model": QWEN2_TINY, "prompt": PROMPT, "stream": True}) as running:
            lines = running.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            r = httpx.post(f"{s.base_url}/api/models/{QWEN2_TINY}/unload", timeout=300)
            assert r.status_code == 200 and r.json()["data"]["status"] == "ready", r.text
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["code"] == "model_busy" and err["type"] == "server_error" and err["param"] is None
        assert "unloaded" in err["message"]
        assert all("error" not in json.loads(x) for x in rest[:-2])
    finally:
        s.stop()
