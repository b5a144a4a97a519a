"""Every count a client controls is bounded when the body is read, before any per-row work:
`n`, prompt and conversation arrays, embedding inputs, rerank documents, and the JSON's own
nesting. Each refusal is a 400 in the route's own envelope."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from mlxcel.api.app import build_litestar
from mlxcel.api.body import too_deep
from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp import rerank
from mlxcel.api.llamacpp.embedding import prompt_field
from mlxcel.api.state import AppState
from mlxcel.config.limits import MAX_CHOICES, MAX_INPUTS, MAX_JSON_DEPTH, MAX_PROMPTS
from mlxcel.config.settings import ServerSettings

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _post(path: str, *, json=None, content: bytes | None = None) -> httpx.Response:
    app = build_litestar(AppState(settings=ServerSettings()))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            if content is not None:
                return await http.post(path, content=content, headers={"content-type": "application/json"})
            return await http.post(path, json=json)

    return asyncio.run(run())


@pytest.mark.parametrize("n", [MAX_CHOICES + 1, 300_000, 2**63, 2**70])
def test_n_above_the_cap_is_a_400_naming_it(n):
    start = time.monotonic()
    r = _post("/v1/chat/completions", json={**CHAT, "n": n})
    assert time.monotonic() - start < 5
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("invalid_parameter", "n", "invalid_request_error")
    assert str(MAX_CHOICES) in error["message"]


def test_n_cmpl_above_the_cap_is_a_400_in_the_native_envelope():
    r = _post("/completion", json={"prompt": "hi", "n_cmpl": 2**63})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400 and str(MAX_CHOICES) in r.json()["error"]["message"]


def test_too_many_prompts_on_v1_completions_is_refused_before_tokenizing():
    start = time.monotonic()
    r = _post("/v1/completions", json={"prompt": ["x"] * 100_000})
    assert time.monotonic() - start < 5
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "invalid_parameter")
    assert str(MAX_PROMPTS) in error["message"]


def test_one_long_token_prompt_is_not_counted_as_many_prompts():
    # a flat token-id array is one prompt: past the count check, it fails later for want of a model
    r = _post("/v1/completions", json={"prompt": [1] * (MAX_PROMPTS + 10)})
    assert r.status_code != 400 or "at most" not in r.text


def test_too_many_native_prompts_is_a_400_in_the_native_envelope():
    r = _post("/completion", json={"prompt": ["x"] * (MAX_PROMPTS + 1)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert str(MAX_PROMPTS) in error["message"]


def test_too_many_extra_conversations_is_a_400():
    r = _post("/v1/chat/completions", json={**CHAT, "extra_messages": [CHAT["messages"]] * (MAX_PROMPTS + 1)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "extra_messages"


def test_embedding_inputs_and_rerank_documents_are_bounded():
    with pytest.raises(ApiError) as e:
        prompt_field({"input": ["x"] * (MAX_INPUTS + 1)})
    assert (e.value.status, e.value.param) == (400, "input")
    assert prompt_field({"input": ["x"] * MAX_INPUTS})[0] == "input"
    with pytest.raises(ApiError) as e:
        rerank.parse({"query": "q", "documents": ["d"] * (MAX_INPUTS + 1)})
    assert (e.value.status, e.value.param) == (400, "documents")


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/completion", "/v1/embeddings",
                                  "/lora-adapters", "/api/monitoring/configure"])
def test_deeply_nested_json_is_a_400_not_a_500(path):
    r = _post(path, content=_nested(100_000))
    assert r.status_code == 400, (path, r.status_code, r.text)
    assert "nests deeper" in r.text


def test_the_nesting_error_takes_each_route_familys_envelope():
    assert set(_post("/v1/chat/completions", content=_nested(5000)).json()["error"]) == {
        "message", "type", "param", "code"}
    assert _post("/v1/messages", content=_nested(5000)).json()["type"] == "error"
    assert _post("/completion", content=_nested(5000)).json()["error"]["code"] == 400


def test_depth_scan():
    assert not too_deep(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    assert too_deep(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    # brackets inside strings, escaped quotes included, are not nesting
    assert not too_deep(b'{"a": "' + b"[" * 500 + b'\\"' + b"{" * 500 + b'"}')
    assert not too_deep(b"[" + b",".join([b"[1, {}]"] * 10_000) + b"]")


def test_unbalanced_brackets_stay_a_syntax_error():
    r = _post("/v1/chat/completions", content=b"[" * 200)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_a_management_body_that_is_not_json_is_a_400_in_the_envelope():
    r = _post("/api/monitoring/configure", content=b"{")
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and r.json()["error"]["code"] == "invalid_json"


def test_prompts_times_n_and_n_probs_are_bounded():
    """Prompts x n engine rows are bounded as n is; n_probs has a bound on every route."""
    from mlxcel.api.openai.completions import _check_rows
    from mlxcel.config.limits import MAX_CHOICES

    _check_rows({"prompt": ["a"] * 8, "n": MAX_CHOICES // 8})
    _check_rows({"prompt": [1, 2, 3], "n": MAX_CHOICES})  # token ids: one prompt
    with pytest.raises(ApiError) as e:
        _check_rows({"prompt": ["a"] * 8, "n": MAX_CHOICES // 8 + 1})
    assert e.value.status == 400 and e.value.param == "n"
