"""A request that can never fit the server's slots and queue is refused with a 400 naming why,
on an idle server, in each route's own envelope; one that fits is served whole. The choice cap
answers at once while the server keeps serving others."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import QWEN2_TINY

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def small():
    fixture_path(QWEN2_TINY)
    server = ServerProcess(["-m", QWEN2_TINY, "--offline", "-np", "1", "-c", "512", "--max-queue-depth", "1"])
    yield server
    server.stop()


def test_more_choices_than_slots_and_queue_is_a_400_on_an_idle_server(small):
    r = httpx.post(small.base_url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "n": 3},
                   timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "at most 2" in error["message"], error
    r = httpx.post(small.base_url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "n": 2},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/completion"])
def test_more_prompts_than_slots_and_queue_is_a_400(small, path):
    r = httpx.post(small.base_url + path, json={"prompt": ["a", "b", "c"], "max_tokens": 2}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "at most 2" in error["message"], error
    if path == "/completion":
        assert error["code"] == 400 and error["type"] == "invalid_request_error"


def test_a_huge_n_is_refused_at_once_and_health_stays_up(small):
    start = time.monotonic()
    r = httpx.post(small.base_url + "/v1/chat/completions", json={"messages": HI, "n": 300_000}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert time.monotonic() - start < 5
    assert httpx.get(small.base_url + "/health", timeout=5).status_code == 200


def test_a_deeply_nested_grammar_is_a_400_in_the_native_envelope(small):
    grammar = "root ::= " + "(" * 5000 + '"a"' + ")" * 5000
    r = httpx.post(small.base_url + "/completion", json={"prompt": "hi", "n_predict": 2, "grammar": grammar},
                   timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400 and "nest deeper" in r.json()["error"]["message"]


def test_a_trigger_pattern_past_its_budget_ends_the_request_with_a_400(small):
    body = {"prompt": "The capital of France is", "n_predict": 32, "grammar": 'root ::= "x"',
            "grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "(.*){1,32000}(?!)"}]}
    start = time.monotonic()
    r = httpx.post(small.base_url + "/completion", json=body, timeout=120)
    assert time.monotonic() - start < 30
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400 and "took longer than" in r.json()["error"]["message"]
    assert httpx.get(small.base_url + "/health", timeout=5).status_code == 200
