"""Resumable streams on a real server (a random-weight Qwen2 under uvicorn, two API keys):
a client that leaves mid-stream resumes from its byte offset and gets exactly the rest,
lookup reports the sessions a caller names, DELETE stops the generation and frees its slot,
and one key cannot see, replay or stop another key's stream."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from mlxcel.api.state import AppState
from mlxcel.config.settings import EngineSection, ServerSection, ServerSettings, SourceSection
from mlxcel.runtime.load import load_served_model
from tests.conftest import fixture_path
from tests.e2e.inprocess import AppServer
from tests.fixtures import QWEN2_TINY

ALPHA, BETA = "key-alpha", "key-beta"


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(source=SourceSection(model=QWEN2_TINY),
                              server=ServerSection(api_keys=[ALPHA, BETA]),
                              engine=EngineSection(warmup=False, parallel=1))
    model = load_served_model(settings, fixture_path(QWEN2_TINY))
    s = AppServer(AppState(settings=settings, model=model))
    yield s
    s.stop()
    model.engine.shutdown()


def _client(server, key: str = ALPHA) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


# cache_prompt off: both runs compute the prompt the same way, so greedy decoding matches exactly
CHAT = {"messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 200, "temperature": 0,
        "seed": 7, "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": False}


def _frames(raw: bytes) -> list:
    """The SSE payloads with the per-request identity (id, created) removed."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        data = block.removeprefix("data: ")
        if data == "[DONE]":
            out.append(data)
            continue
        obj = json.loads(data)
        obj.pop("id", None)
        obj.pop("created", None)
        out.append(obj)
    return out


def _replay(c: httpx.Client, conv: str, offset: int = 0) -> bytes:
    r = c.get("/v1/stream", params={"conv_id": conv, "from": offset})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return r.content


def test_resume_from_byte_offset_gets_exactly_the_rest(server):
    with _client(server) as c:
        whole = c.post("/v1/chat/completions", json=CHAT)
        assert whole.status_code == 200
        received = b""
        with c.stream("POST", "/v1/chat/completions", json=CHAT, headers={"X-Conversation-Id": "conv-resume"}) as r:
            assert r.status_code == 200
            for chunk in r.iter_raw():
                received += chunk
                if received.count(b"\n\n") >= 3:
                    break  # leave mid-stream: the connection is closed here
        rest = _replay(c, "conv-resume", len(received))  # follows live output until the stream ends
        full = _replay(c, "conv-resume", 0)
    assert received + rest == full
    assert full.endswith(b"data: [DONE]\n\n")
    # the generation ran to its end after the client left, and matches an uninterrupted run
    assert _frames(full) == _frames(whole.content)
    usage = _frames(full)[-2]["usage"]
    assert usage["completion_tokens"] == CHAT["max_tokens"]


SURFACES = [
    ("/v1/completions", {"prompt": "Once", "max_tokens": 8, "temperature": 0, "stream": True}),
    ("/completion", {"prompt": "Once", "n_predict": 8, "temperature": 0, "stream": True}),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 8, "temperature": 0, "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}),
]


@pytest.mark.parametrize("path, body", SURFACES, ids=[p for p, _ in SURFACES])
def test_every_streaming_surface_is_recorded(server, path, body):
    conv = "conv-surface" + path.replace("/", "-")
    with _client(server) as c:
        r = c.post(path, json=body, headers={"X-Conversation-Id": conv})
        assert r.status_code == 200, r.text
        assert r.content and _replay(c, conv) == r.content
        [status] = c.post("/v1/streams/lookup", json={"conversation_ids": [conv]}).json()
    assert status["conversation_id"] == conv and status["is_done"] is True
    assert status["total_bytes"] == len(r.content)
    assert status["completed_at"] >= status["started_at"] > 0


def test_a_non_streaming_answer_is_not_recorded(server):
    with _client(server) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": False, "stream_options": None},
                   headers={"X-Conversation-Id": "conv-json"})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        assert c.post("/v1/streams/lookup", json={"conversation_ids": ["conv-json"]}).json() == []
        assert c.get("/v1/stream", params={"conv_id": "conv-json"}).status_code == 404


def test_lookup_names_exact_ids_and_model_variants_only(server):
    with _client(server) as c:
        for conv in ("conv-look::org/model-a", "conv-look", "conv-lookalike"):
            c.post("/v1/completions", json=SURFACES[0][1], headers={"X-Conversation-Id": conv})
        found = c.post("/v1/streams/lookup", json={"conversation_ids": ["conv-look", "never-made"]}).json()
        assert sorted(s["conversation_id"] for s in found) == ["conv-look", "conv-look::org/model-a"]
        assert set(found[0]) == {"conversation_id", "is_done", "total_bytes", "started_at", "completed_at"}
        assert c.post("/v1/streams/lookup", json={}).json() == []
        bad = c.post("/v1/streams/lookup", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def _slot_when_idle(c: httpx.Client) -> dict:
    deadline = time.monotonic() + 120  # a bound on a hang, not a performance threshold
    while time.monotonic() < deadline:
        [slot] = c.get("/slots").json()
        if not slot["is_processing"]:
            return slot
        time.sleep(0.05)
    raise AssertionError("the slot never became idle")


def test_delete_cancels_the_generation_and_frees_the_slot(server):
    n_predict = 2000
    body = {"prompt": "Once upon a time", "n_predict": n_predict, "ignore_eos": True, "stream": True}
    with _client(server) as c:
        with c.stream("POST", "/completion", json=body, headers={"X-Conversation-Id": "conv-stop"}) as r:
            frames = r.iter_raw()
            first = next(frames)
            assert first.startswith(b"data: ")
            stop = c.delete("/v1/stream", params={"conv_id": "conv-stop"})
            assert stop.status_code == 204 and stop.content == b""
            tail = b"".join(frames)  # the attached client's stream ends with the session
        assert b'"stop":true' not in first + tail
        slot = _slot_when_idle(c)
        assert slot["next_token"][0]["n_decoded"] < n_predict
        assert c.get("/v1/stream", params={"conv_id": "conv-stop"}).status_code == 404
        assert c.post("/v1/streams/lookup", json={"conversation_ids": ["conv-stop"]}).json() == []
        assert c.delete("/v1/stream", params={"conv_id": "conv-stop"}).status_code == 204  # idempotent


def test_another_key_cannot_see_replay_or_stop_a_stream(server):
    body = {"prompt": "Once", "n_predict": 200, "ignore_eos": True, "stream": True}
    with _client(server, ALPHA) as alpha, _client(server, BETA) as beta:
        with alpha.stream("POST", "/completion", json=body, headers={"X-Conversation-Id": "conv-private"}) as r:
            frames = r.iter_raw()
            mine = next(frames)
            theirs = beta.get("/v1/stream", params={"conv_id": "conv-private"})
            assert theirs.status_code == 404
            assert theirs.json() == {"error": {"code": 404, "message": "Stream not found or expired",
                                               "type": "not_found_error"}}
            assert beta.post("/v1/streams/lookup", json={"conversation_ids": ["conv-private"]}).json() == []
            assert beta.delete("/v1/stream", params={"conv_id": "conv-private"}).status_code == 204
            mine += b"".join(frames)
        final = json.loads(mine.rstrip(b"\n").rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
        assert final["stop"] is True and final["tokens_predicted"] == body["n_predict"]  # ran to its end
        assert _replay(alpha, "conv-private") == mine  # untouched by the other key
        # the same id under the other key is that key's own, separate session
        other = beta.post("/completion", json={**body, "n_predict": 8}, headers={"X-Conversation-Id": "conv-private"})
        assert _replay(beta, "conv-private") == other.content
        assert _replay(alpha, "conv-private") == mine
