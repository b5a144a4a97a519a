"""/v1/embeddings served by the loaded generation model (no embedding worker), through the
openai SDK against the real default server (SmolLM2, on each backend of the default matrix).

Reference: transformers' AutoModel on the same checkpoint in fp32, `last_hidden_state` (the
final hidden states after the final norm) mean-pooled over the tokens. Tolerance: cosine
>= 0.9999 and max abs difference <= 1e-3 per component (the MLX and torch fp32 kernels sum
in different orders; the hidden states' components are O(1)-O(10)). A server computing in bf16
(torch's CPU default where the CPU has native bf16) rounds every activation to 8 mantissa bits
(~0.4% relative), so there: cosine >= 0.999 and max abs difference <= 0.25.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import DEFAULT_MODEL, fixture_path

# the last one spans two prefill chunks (--batch-size 512): the hidden states are stitched across them
TEXTS = ["The cat sits on the mat.", "Stock prices fell sharply today.", "Bonjour, comment allez-vous ?",
         " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))]
TOLERANCE = {"float32": (0.9999, 1e-3), "bfloat16": (0.999, 0.25)}  # dtype -> (min cosine, max abs)


@pytest.fixture(scope="module")
def reference():
    import torch
    import transformers

    path = fixture_path(DEFAULT_MODEL)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for text in TEXTS:
            ids = tok(text, return_tensors="pt").input_ids
            res = model(input_ids=ids, output_hidden_states=True)
            last = res.last_hidden_state[0]
            assert torch.equal(last, res.hidden_states[-1][0])  # what "last hidden layer" means here
            out[text] = (ids.shape[1], last.double().mean(dim=0).numpy())
    return out


def _cos(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_vectors_match_transformers_in_input_order(default_server, openai_client, reference):
    min_cosine, max_abs = TOLERANCE[default_server.dtype]
    r = openai_client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS, encoding_format="float")
    assert r.model == DEFAULT_MODEL and [d.index for d in r.data] == list(range(len(TEXTS)))
    assert reference[TEXTS[-1]][0] > 512
    assert r.usage.prompt_tokens == sum(reference[t][0] for t in TEXTS)
    for d, text in zip(r.data, TEXTS):
        got, want = np.asarray(d.embedding), reference[text][1]
        assert got.shape == want.shape == (576,)
        assert _cos(got, want) >= min_cosine, (text, _cos(got, want))
        assert np.abs(got - want).max() <= max_abs, (text, np.abs(got - want).max())
    # order is the input's: reversed input, reversed vectors
    rev = openai_client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[::-1], encoding_format="float").data
    for a, b in zip(rev, r.data[::-1]):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-5)
    one = openai_client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[1], encoding_format="float").data
    assert len(one) == 1 and _cos(np.asarray(one[0].embedding), reference[TEXTS[1]][1]) >= min_cosine


def test_base64_equals_float_and_normalize_on_request(default_server, openai_client):
    floats = openai_client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[:2], encoding_format="float").data
    default = openai_client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS[:2]).data  # the SDK asks base64 and decodes it
    raw = httpx.post(default_server.base_url + "/v1/embeddings",
                     json={"input": TEXTS[0], "encoding_format": "base64"}, timeout=120).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(vec, np.asarray(floats[0].embedding, dtype=np.float32))
    for a, b in zip(default, floats):
        np.testing.assert_array_equal(np.asarray(a.embedding, np.float32), np.asarray(b.embedding, np.float32))
    assert abs(np.linalg.norm(floats[0].embedding) - 1.0) > 1e-2  # not normalized by default
    unit = httpx.post(default_server.base_url + "/v1/embeddings",
                      json={"input": TEXTS[0], "embd_normalize": 2}, timeout=120).json()["data"][0]["embedding"]
    np.testing.assert_allclose(unit, np.asarray(floats[0].embedding) / np.linalg.norm(floats[0].embedding),
                               atol=1e-6)


def test_context_limit_and_field_contract(default_server, openai_client):
    n_ctx = httpx.get(default_server.base_url + "/props").json()["default_generation_settings"]["n_ctx"]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.embeddings.create(model=DEFAULT_MODEL, input=["short", [1] * (n_ctx + 1)])
    assert e.value.code == "context_length_exceeded" and e.value.param == "input"
    assert f"maximum context length is {n_ctx} tokens" in e.value.message
    assert f"input[1] has {n_ctx + 1} tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # the embeddings column of fields.FIELD_TABLE
        openai_client.embeddings.create(model=DEFAULT_MODEL, input="x", dimensions=8)
    assert (e.value.code, e.value.param) == ("field_not_honoured", "dimensions")
    raw = openai_client.embeddings.with_raw_response.create(model=DEFAULT_MODEL, input="x", user="u", encoding_format="float")
    assert raw.headers["x-millm-ignored-fields"] == '"user"'
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.embeddings.create(model="nobody/nothing", input="x")
    assert e.value.code == "model_not_found"


def test_native_embedding_routes_still_need_the_flag(default_server):
    """b10621 refuses its native embedding routes unless started with --embeddings; so does mlxcel."""
    for path in ("/embedding", "/embeddings"):
        r = httpx.post(default_server.base_url + path, json={"content": "x"}, timeout=60)
        assert r.status_code == 501 and "Start it with `--embeddings`" in r.json()["error"]["message"], r.text


def test_torch_backend_hidden_states_match_the_reference(reference):
    """The torch backend's hidden_states (the same seam the engine job calls) on fp32."""
    from mlxcel.backends.torch.backend import TorchBackend
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(DEFAULT_MODEL)
    backend = TorchBackend(path, dtype="float32")
    tok = Tokenizer(path)
    for text in TEXTS[:2]:
        seq = backend.new_sequence()
        try:
            got = backend.hidden_states(tok.encode(text), seq).astype(np.float64).mean(axis=0)
        finally:
            seq.release()
        want = reference[text][1]
        min_cosine, max_abs = TOLERANCE["float32"]
        assert _cos(got, want) >= min_cosine and np.abs(got - want).max() <= max_abs
