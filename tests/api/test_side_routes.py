"""The embedding and rerank routes, mode gating, /health, /props and /v1/models, in process
over the real MiniLM checkpoint and the tiny cross-encoder (no model is mocked).

One app serves `--embeddings -m MiniLM --reranker-model tiny` (generation off); a second,
plain one has a chat plan with no workers, for the 501s that name the missing mode flag.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from litestar.testing import TestClient

from mlxcel.api.app import build_litestar
from mlxcel.api.state import AppState
from mlxcel.cli.flags import parse_server_args
from mlxcel.workers.load import load_side_workers
from mlxcel.workers.plan import plan
from mlxcel.workers.vectors import normalize
from tests.conftest import fixture_path
from tests.fixtures import MINILM, RERANKER_TINY

DOCS = ["A cat is a small domesticated feline.", "Stock prices fell today.", "Cats purr when happy.", "Rain."]


def _state(argv: list[str]) -> AppState:
    settings = parse_server_args(argv, {})
    p = plan(settings, lambda ref, flag: fixture_path(ref))
    state = AppState(settings=settings, plan=p)
    load_side_workers(state, settings)
    return state


@pytest.fixture(scope="module")
def state():
    return _state(["-m", MINILM, "--embeddings", "--reranker-model", RERANKER_TINY])


@pytest.fixture(scope="module")
def client(state):
    with TestClient(build_litestar(state)) as c:
        yield c


def _direct(state, text, mode=None):
    return state.embedder.embed([state.embedder.tokenize(text)], mode)[0]


def test_native_shape_is_a_bare_array_of_arrays(client, state):
    for path in ("/embedding", "/embeddings"):
        for key in ("content", "input"):
            r = client.post(path, json={key: ["hello world", "second"]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert [e["index"] for e in body] == [0, 1]
            assert len(body[0]["embedding"]) == 1 and len(body[0]["embedding"][0]) == 384
            np.testing.assert_allclose(body[0]["embedding"][0], _direct(state, "hello world"), atol=1e-6)


def test_openai_shape_float_and_base64(client, state):
    r = client.post("/v1/embeddings", json={"input": "hello world", "model": MINILM})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list" and body["model"] == MINILM
    assert body["data"][0]["object"] == "embedding" and body["data"][0]["index"] == 0
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}  # [CLS] hello world [SEP]
    np.testing.assert_allclose(body["data"][0]["embedding"], _direct(state, "hello world"), atol=1e-6)
    r = client.post("/v1/embeddings", json={"input": ["a", "b"], "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][1]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, _direct(state, "b"), atol=1e-6)
    # `content` on the OpenAI path answers the native shape, as b10621 does
    assert isinstance(client.post("/v1/embeddings", json={"content": "x"}).json(), list)


def test_token_id_prompts_are_embedded_as_given(client, state):
    ids = state.embedder.tokenize("hello world")
    r = client.post("/embedding", json={"content": [ids, "hello world"]})
    a, b = (e["embedding"][0] for e in r.json())
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("mode", [-1, 0, 1, 2, 3])
def test_per_request_embd_normalize(client, state, mode):
    raw = _direct(state, "normalize me", -1)
    for path in ("/embedding", "/v1/embeddings"):
        body = client.post(path, json={"input": "normalize me", "embd_normalize": mode}).json()
        got = body[0]["embedding"][0] if path == "/embedding" else body["data"][0]["embedding"]
        np.testing.assert_allclose(got, normalize(raw, mode), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path, body, status, message", [
    ("/embedding", {}, 400, '"input" or "content" must be provided'),
    ("/v1/embeddings", {"model": MINILM}, 400, '"input" or "content" must be provided'),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, 400, "'dimensions' is not honoured on /v1/embeddings"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400, "float or base64"),
    ("/embedding", {"content": []}, 400, "Input content cannot be empty"),
    ("/embedding", {"content": "x", "embd_normalize": "2"}, 400, "'embd_normalize' must be an integer"),
    ("/embedding", {"content": [[1, 99999999]]}, 400, "out of the vocabulary"),
    ("/v1/embeddings", {"input": "word " * 300}, 400, "context of 256 tokens"),
])
def test_embedding_errors(client, path, body, status, message):
    r = client.post(path, json=body)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text


def test_rerank_jina_envelope_and_echo(client, state):
    scores, tokens = state.reranker.score("cats", DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        body = client.post(path, json={"query": "cats", "documents": DOCS, "top_n": 3}).json()
        assert set(body) == {"model", "object", "usage", "results"} and body["object"] == "list"
        assert body["model"] == RERANKER_TINY
        assert body["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}
        assert [r["index"] for r in body["results"]] == order[:3]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in order[:3]])
        assert all(set(r) == {"index", "relevance_score"} for r in body["results"])
    echoed = client.post("/rerank", json={"query": "cats", "documents": DOCS, "return_documents": True}).json()
    assert [r["document"]["text"] for r in echoed["results"]] == [DOCS[i] for i in order]
    both = client.post("/rerank", json={"query": "cats", "documents": DOCS, "texts": DOCS}).json()
    assert isinstance(both, dict) and len(both["results"]) == 4


def test_rerank_tei_bare_array_and_echo(client, state):
    scores, _ = state.reranker.score("cats", DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    body = client.post("/v1/rerank", json={"query": "cats", "texts": DOCS}).json()
    assert isinstance(body, list) and [r["index"] for r in body] == order
    assert all(set(r) == {"index", "score"} for r in body)
    body = client.post("/rerank", json={"query": "cats", "texts": DOCS, "return_text": True}).json()
    assert [r["text"] for r in body] == [DOCS[i] for i in order]


@pytest.mark.parametrize("body, message", [
    ({"documents": DOCS}, '"query" must be provided'),
    ({"query": 3, "documents": DOCS}, '"query" must be a string'),
    ({"query": "q", "documents": []}, '"documents" must be a non-empty string array'),
    ({"query": "q", "texts": ["a", 1]}, '"documents" must be a non-empty string array'),
    ({"query": "q"}, '"documents" must be a non-empty string array'),
])
def test_rerank_shape_errors(client, body, message):
    r = client.post("/rerank", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"] == message


@pytest.mark.parametrize("path, body", [
    ("/completion", {"prompt": "hi"}), ("/completions", {"prompt": "hi"}),
    ("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_generation_routes_answer_501_naming_the_flag(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 501 and "Start it without `--embeddings`" in r.text, r.text


def test_health_props_and_models_report_the_workers(client):
    assert client.get("/health").json() == {"status": "ok"}
    caps = client.get("/props").json()["capabilities"]
    assert caps["generation"] is False and caps["restricted_by"] == "--embeddings"
    assert [(m["id"], m["kind"], m["pooling"], m["embd_normalize"]) for m in caps["side_models"]] == [
        (MINILM, "embedding", "mean", 2), (RERANKER_TINY, "rerank", "rank", None)]
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["capabilities"]) for m in models] == [(MINILM, ["embedding"]), (RERANKER_TINY, ["rerank"])]
    assert client.get(f"/v1/models/{RERANKER_TINY}").json()["capabilities"] == ["rerank"]
    # b10621's meta block from each worker's own checkpoint: BERT's WordPiece and 512 positions,
    # the worker's context capped by sentence-transformers' max_seq_length
    minilm = models[0]["meta"]
    assert (minilm["vocab_type"], minilm["n_vocab"], minilm["n_embd"]) == (3, 30522, 384)
    assert (minilm["n_ctx_train"], minilm["n_ctx"]) == (512, 256)
    native = client.get("/models").json()
    assert [(m["name"], m["capabilities"]) for m in native["models"]] == [(MINILM, ["embedding"]),
                                                                          (RERANKER_TINY, ["rerank"])]


def test_reranking_mode_with_a_flag_override():
    state = _state(["-m", RERANKER_TINY, "--reranking", "--embedding-model", MINILM, "--pooling", "cls",
                    "--embd-normalize", "-1"])
    with TestClient(build_litestar(state)) as c:
        assert c.post("/completion", json={"prompt": "x"}).json()["error"]["message"] == \
            "This server does not support completions. Start it without `--reranking`"
        side = c.get("/props").json()["capabilities"]["side_models"][0]
        assert (side["pooling"], side["embd_normalize"]) == ("cls", -1)
        vec = c.post("/embedding", json={"content": "x"}).json()[0]["embedding"][0]
        assert abs(np.linalg.norm(vec) - 1.0) > 1e-3  # -1: not normalized


def test_health_waits_for_the_worker_and_plain_server_501s_side_routes():
    settings = parse_server_args(["-m", MINILM, "--embeddings"], {})
    state = AppState(settings=settings, plan=plan(settings, lambda ref, flag: fixture_path(ref)))
    with TestClient(build_litestar(state)) as c:
        assert c.get("/health").status_code == 503  # planned, not loaded yet
    plain = AppState(settings=parse_server_args(["-m", MINILM], {}))
    with TestClient(build_litestar(plain)) as c:
        r = c.post("/embedding", json={"content": "x"})
        assert r.status_code == 501 and "Start it with `--embeddings`" in r.text
        r = c.post("/v1/rerank", json={"query": "x", "documents": ["a"]})
        assert r.status_code == 501 and "Start it with `--reranking`" in r.text
        assert c.get("/v1/models").json()["data"] == []


def test_embeddings_field_contract_column():
    """The embeddings column of fields.FIELD_TABLE: every field it refuses is a 400
    field_not_honoured naming it (a no-change value passes), before the worker is looked at;
    an unused field is reported, or refused under X-miLLM-Strict."""
    from mlxcel.api.openai.fields import EMBEDDINGS, FIELD_TABLE, NO_CHANGE, REFUSED
    from tests.e2e.test_openai_contract import CHANGING

    plain = AppState(settings=parse_server_args(["-m", MINILM], {}))  # no worker: refusals come first
    with TestClient(build_litestar(plain)) as c:
        for field, row in FIELD_TABLE.items():
            assert row[EMBEDDINGS] == REFUSED, field
            values = CHANGING[field][0]
            value = next(iter(values.values())) if isinstance(values, dict) and "/v1/chat/completions" in values \
                else values
            r = c.post("/v1/embeddings", json={"input": "x", field: value})
            err = r.json()["error"]
            assert r.status_code == 400 and (err["code"], err["param"]) == ("field_not_honoured", field), (field, r.text)
            for ok in NO_CHANGE.get(field, ()) + (None,):  # no change: on to the generation model (not loaded)
                r = c.post("/v1/embeddings", json={"input": "x", field: ok})
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded", (field, ok)


def test_embedding_worker_wins_over_the_generation_model():
    """-m <chat model> --embedding-model MiniLM: /v1/embeddings is MiniLM's (its 384-d unit
    vectors), even though the generation model could embed too (here it is not even loaded)."""
    from tests.fixtures import DEFAULT_MODEL

    state = _state(["-m", DEFAULT_MODEL, "--embedding-model", MINILM])
    assert state.model is None and state.embedder is not None
    with TestClient(build_litestar(state)) as c:
        body = c.post("/v1/embeddings", json={"input": ["hello world", "x"]}).json()
        assert body["model"] == MINILM and len(body["data"]) == 2
        np.testing.assert_allclose(body["data"][0]["embedding"], _direct(state, "hello world"), atol=1e-6)


def test_embeddings_report_unused_fields_and_strict_refuses(client):
    r = client.post("/v1/embeddings", json={"input": "x", "user": "u", "foo": 1})
    assert r.status_code == 200 and r.headers["x-millm-ignored-fields"] == '"user", "foo"'
    r = client.post("/v1/embeddings", json={"input": "x", "user": "u"}, headers={"X-miLLM-Strict": "true"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unused_fields_refused"
    assert "x-millm-ignored-fields" not in client.post("/v1/embeddings", json={"input": "x", "model": "m"}).headers


def test_embeddings_context_limit_names_the_figures(client):
    r = client.post("/v1/embeddings", json={"input": ["short", "word " * 300]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "input 1 has 302 tokens" in err["message"] and "context of 256 tokens" in err["message"]
