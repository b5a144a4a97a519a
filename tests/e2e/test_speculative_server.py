"""Speculative decoding as a user starts it: -md on the command line, /props, /slots, timings.

One MLX server with the random-weight draft on SmolLM2's vocabulary (json-tools-tiny), so most
drafts are rejected and every request exercises the rollback; the text itself is checked
against plain decoding in tests/models/test_speculative.py.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.conftest import module_server
from tests.fixtures import DEFAULT_MODEL, JSON_TOOLS_TINY, available

pytestmark = pytest.mark.skipif(not available(JSON_TOOLS_TINY), reason="random-weight draft fixture not built")

server = module_server(DEFAULT_MODEL, "--backend", "mlx", "-md", JSON_TOOLS_TINY, "--spec-draft-n-max", "2",
                       "--parallel", "2", "-c", "2048", "--metrics")


def completion(server, **body):
    r = httpx.post(server.base_url + "/completion", json={"temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_props_and_slots_report_the_draft(server):
    props = httpx.get(server.base_url + "/props", timeout=10).json()
    assert props["speculative"] == {"draft_model": "json-tools-tiny", "kind": "draft-simple", "n_max": 2}
    assert all(s["speculative"] is True for s in httpx.get(server.base_url + "/slots", timeout=10).json())


def test_timings_carry_the_draft_counters(server):
    out = completion(server, prompt="The capital of France is", n_predict=12)
    t = out["timings"]
    assert out["tokens_predicted"] == 12 and t["predicted_n"] == 12
    assert t["draft_kind"] == "draft-simple" and t["draft_rounds"] >= 1
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"] <= 2 * t["draft_rounds"]


def test_metrics_count_the_drafts(server):
    before = _spec_metrics(server)
    t = completion(server, prompt="The capital of Spain is", n_predict=12)["timings"]
    after = _spec_metrics(server)
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert moved["llamacpp:spec_decode_num_draft_tokens_total"] == t["draft_n"]
    assert moved["llamacpp:spec_decode_num_accepted_tokens_total"] == t["draft_n_accepted"]
    assert moved["llamacpp:spec_decode_num_drafts_total"] == t["draft_rounds"] >= 1
    per_pos = sum(v for k, v in moved.items() if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos"))
    assert per_pos == t["draft_n_accepted"]


def _spec_metrics(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith("llamacpp:spec_decode")}


def test_grammar_and_stop_hold_under_speculation(server):
    out = completion(server, prompt="Answer:", n_predict=10, grammar='root ::= ("ab" | "b")+')
    assert re.fullmatch(r"(ab|b)+", out["content"]), out["content"]
    out = completion(server, prompt="Count: 1, 2, 3,", n_predict=24, stop=[","])
    assert out["stop_type"] == "word" and out["stopping_word"] == "," and "," not in out["content"]


def test_chat_completions_carry_timings_when_drafted(server):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    assert r["timings"]["draft_kind"] == "draft-simple" and r["timings"]["predicted_n"] == r["usage"]["completion_tokens"]
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as s:
        frames = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    finish = [f for f in frames if f["choices"] and f["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["timings"]["draft_rounds"] >= 1
    assert all("timings" not in f for f in frames if f is not finish[0])
