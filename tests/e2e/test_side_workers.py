"""A real `mlxcel-server --embeddings` process with a reranker beside it: the OpenAI SDK's
embeddings call (float and its default base64 transport), the native route, rerank, /health,
and the generation 501, end to end over HTTP."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import MINILM, RERANKER_TINY


@pytest.fixture(scope="module")
def server():
    fixture_path(MINILM), fixture_path(RERANKER_TINY)
    s = ServerProcess(["-m", MINILM, "--embeddings", "--reranker-model", RERANKER_TINY, "--offline"])
    yield s
    s.stop()


def test_openai_sdk_embeddings(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    default = client.embeddings.create(model=MINILM, input=["The cat sits.", "Dogs bark."])  # base64 on the wire
    floats = client.embeddings.create(model=MINILM, input=["The cat sits.", "Dogs bark."], encoding_format="float")
    for a, b in zip(default.data, floats.data):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
        assert abs(np.linalg.norm(b.embedding) - 1.0) < 1e-5
    native = httpx.post(server.base_url + "/embeddings", json={"content": "The cat sits."}).json()
    np.testing.assert_allclose(native[0]["embedding"][0], floats.data[0].embedding, atol=1e-6)


def test_openai_sdk_embeddings_contract(server):
    """Through the SDK: the context limit with its figures, refused fields, the ignored-fields header."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MINILM, input=["short", "word " * 300])
    assert e.value.code == "context_length_exceeded" and "302 tokens" in e.value.message and "256" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MINILM, input="x", dimensions=8)
    assert (e.value.code, e.value.param) == ("field_not_honoured", "dimensions")
    raw = client.embeddings.with_raw_response.create(model=MINILM, input="x", user="u", encoding_format="base64")
    assert raw.headers["x-millm-ignored-fields"] == '"user"'
    vec = np.frombuffer(base64.b64decode(raw.http_response.json()["data"][0]["embedding"]), dtype="<f4")
    floats = client.embeddings.create(model=MINILM, input="x", encoding_format="float").data[0].embedding
    np.testing.assert_allclose(vec, floats, atol=1e-6)


def test_rerank_health_and_generation_refusal(server):
    r = httpx.post(server.base_url + "/v1/rerank", json={"query": "cat", "documents": ["a cat", "stocks"]})
    assert r.status_code == 200 and r.json()["object"] == "list" and len(r.json()["results"]) == 2
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"]


def test_side_workers_answer_to_their_own_names_only(server):
    """As chat does: a foreign model name is a 404 (--any-model-name would serve it)."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert (e.value.code, e.value.param) == ("model_not_found", "model")
    r = httpx.post(server.base_url + "/v1/rerank", json={"model": "rerank-v3", "query": "cat", "documents": ["a"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.base_url + "/v1/rerank", json={"model": RERANKER_TINY, "query": "cat", "documents": ["a"]})
    assert r.status_code == 200 and r.json()["model"] == RERANKER_TINY
    assert "x-millm-model-substituted" not in r.headers
