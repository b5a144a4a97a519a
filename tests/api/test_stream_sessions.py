"""The resumable-stream store and its routes without a model: front-drop with a small
buffer, TTL sweeps on a fake clock, the completed-session cap, replacement, owner scoping,
b10621's error shapes, and the ASGI hook keeping a client's disconnect from the route."""

from __future__ import annotations

import asyncio

import pytest
from litestar.testing import TestClient

from mlxcel.api.app import build_litestar
from mlxcel.api.state import AppState
from mlxcel.api.stream_resume import StreamRecorder
from mlxcel.api.stream_sessions import OffsetLost, StreamLimits, StreamStore, stream_owner
from mlxcel.config.settings import ServerSettings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _read(session, offset: int) -> bytes:
    return b"".join([chunk async for chunk in session.follow(offset)])


def test_front_drop_keeps_the_newest_bytes_and_refuses_lost_offsets():
    store = StreamStore(StreamLimits(max_bytes=16))
    s = store.open("", "c")
    s.append(b"0123456789")
    s.append(b"abcdefghij")
    assert (s.dropped, s.total_bytes) == (4, 20)
    s.finish()
    assert asyncio.run(_read(s, 4)) == b"456789abcdefghij"
    assert asyncio.run(_read(s, 15)) == b"fghij"
    assert asyncio.run(_read(s, 20)) == b""
    with pytest.raises(OffsetLost):
        asyncio.run(_read(s, 3))


def test_a_chunk_larger_than_the_buffer_keeps_its_tail():
    s = StreamStore(StreamLimits(max_bytes=4)).open("", "c")
    s.append(b"ab")
    s.append(b"0123456789")
    assert (s.dropped, s.total_bytes) == (8, 12)
    s.finish()
    assert asyncio.run(_read(s, 8)) == b"6789"


def test_a_follower_gets_live_bytes_until_the_session_finishes():
    async def scenario() -> bytes:
        s = StreamStore().open("", "c")
        s.append(b"a")
        reader = asyncio.create_task(_read(s, 0))
        for part in (b"b", b"c"):
            await asyncio.sleep(0)
            s.append(part)
        s.finish()
        return await reader

    assert asyncio.run(scenario()) == b"abc"


def test_finished_sessions_expire_after_the_ttl_at_the_next_sweep():
    clock = Clock()
    store = StreamStore(StreamLimits(ttl_s=300, gc_interval_s=60), clock=clock)
    done, live = store.open("", "done"), store.open("", "live")
    done.finish()
    clock.now += 299
    assert store.get("", "done") is done
    clock.now += 2  # past the TTL, but the last sweep was 2 s ago
    assert store.get("", "done") is done
    clock.now += 60  # the next sweep
    assert store.get("", "done") is None
    assert store.get("", "live") is live  # a running stream never expires
    clock.now += 10_000
    assert store.get("", "live") is live


def test_at_most_max_completed_finished_sessions_are_kept_oldest_first():
    clock = Clock()
    store = StreamStore(StreamLimits(max_completed=2), clock=clock)
    for name in ("a", "b", "c"):
        store.open("", name).finish()
        clock.now += 1
    running = store.open("", "d")
    assert [store.get("", n) is not None for n in "abcd"] == [False, True, True, True]
    running.finish()
    assert store.get("", "b") is None and len(store) == 2


def test_a_new_stream_on_a_conversation_stops_the_previous_one():
    store = StreamStore()
    first = store.open("", "c")
    stopped = []
    first.on_cancel = lambda: stopped.append(True)
    second = store.open("", "c")
    assert stopped == [True] and first.done and first.cancelled
    assert store.get("", "c") is second and not second.done


def test_lookup_is_scoped_to_the_owner_and_matches_model_variants():
    store = StreamStore()
    for owner, cid in (("k1", "c"), ("k1", "c::org/m"), ("k1", "cx"), ("k2", "c")):
        store.open(owner, cid)
    assert [s["conversation_id"] for s in store.lookup("k1", ["c"])] == ["c", "c::org/m"]
    assert [s["conversation_id"] for s in store.lookup("k2", ["c", "cx"])] == ["c"]
    store.stop("k2", "cx")  # not k2's: a no-op
    assert store.get("k1", "cx") is not None


def test_owner_is_shared_with_one_key_and_per_key_with_several():
    assert stream_owner("a", []) == stream_owner("a", ["a"]) == ""
    assert stream_owner("a", ["a", "b"]) != stream_owner("b", ["a", "b"])
    assert "secret-one" not in stream_owner("secret-one", ["secret-one", "b"])  # a digest, not the key


def _routes(store: StreamStore) -> TestClient:
    return TestClient(build_litestar(AppState(settings=ServerSettings(), streams=store)))


def test_route_errors_have_b10621s_shapes():
    store = StreamStore(StreamLimits(max_bytes=8))
    s = store.open("", "c")
    s.append(b"data: 0123456789\n\n")
    with _routes(store) as client:
        def err(r):
            return r.status_code, r.json()["error"]["message"], r.json()["error"]["type"]

        assert err(client.get("/v1/stream")) == (400, "Missing conversation id in path", "invalid_request_error")
        assert err(client.get("/v1/stream?conv_id=nope")) == (404, "Stream not found or expired", "not_found_error")
        for bad in ("x", "-1", "1.5"):
            assert err(client.get(f"/v1/stream?conv_id=c&from={bad}")) == (400, "Invalid 'from' offset",
                                                                          "invalid_request_error")
        lost = client.get("/v1/stream?conv_id=c&from=9")
        assert lost.json() == {"error": {"code": 400, "message": "Stream offset lost, please restart",
                                         "type": "invalid_request_error"}}
        s.finish()
        kept = client.get("/v1/stream?conv_id=c&from=10")
        assert kept.status_code == 200 and kept.content == b"456789\n\n"
        assert err(client.delete("/v1/stream")) == (400, "Missing conversation id in path", "invalid_request_error")
        for _ in range(2):
            r = client.delete("/v1/stream?conv_id=c")
            assert r.status_code == 204 and r.content == b""
        assert store.get("", "c") is None


class _SseRoute:
    """A stand-in route: answers SSE, writes one frame, then waits for a disconnect."""

    def __init__(self) -> None:
        self.saw_disconnect = asyncio.Event()
        self.wrote = asyncio.Event()

    async def __call__(self, scope, receive, send):
        assert (await receive())["type"] == "http.request"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        self.wrote.set()
        assert (await receive())["type"] == "http.disconnect"
        self.saw_disconnect.set()


def test_the_hook_hides_a_client_disconnect_until_the_session_is_stopped():
    async def scenario() -> None:
        route = _SseRoute()
        state = AppState(settings=ServerSettings())
        app = StreamRecorder(route, state)
        gone = asyncio.Event()
        inbox = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            if inbox:
                return inbox.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"x-conversation-id", b"c")]}
        client = asyncio.create_task(app(scope, receive, send))
        await route.wrote.wait()
        gone.set()  # the client leaves
        await client  # its side ends ...
        assert not route.saw_disconnect.is_set()  # ... the route is not told
        session = state.streams.get("", "c")
        assert not session.done and session.total_bytes == len(b"data: 1\n\n")
        assert sent[0]["status"] == 200
        state.streams.stop("", "c")  # DELETE: now the route sees its disconnect
        await asyncio.wait_for(route.saw_disconnect.wait(), 30)

    asyncio.run(scenario())
