"""Stored /v1/responses belong to the API key that created them: with two keys configured,
the other key's retrieve, delete, cancel and previous_response_id are 404 as if the id were
never stored (the same rule as resumable streams); with one key or none, all callers share."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mlxcel.api.app import build_app
from mlxcel.api.errors import ApiError
from mlxcel.api.openai.responses import Live, ResponsesRequest, _conversation, _store
from mlxcel.api.state import AppState
from mlxcel.api.stream_sessions import stream_owner
from mlxcel.config.settings import ServerSection, ServerSettings, SourceSection

ALPHA, BETA = "key-alpha", "key-beta"


def _state(keys: list[str]) -> AppState:
    return AppState(settings=ServerSettings(source=SourceSection(model="unused"), server=ServerSection(api_keys=keys)),
                    model=None)


def _call(state: AppState, method: str, path: str, key: str) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, headers={"Authorization": f"Bearer {key}"})
    return asyncio.run(go())


def _stored(state: AppState, rid: str, key: str) -> None:
    owner = stream_owner(key, state.settings.server.api_keys)
    _store(state).put({"id": rid, "object": "response", "status": "completed"},
                      [{"role": "user", "content": "secret"}], owner)


def test_another_key_cannot_read_delete_or_cancel_a_stored_response():
    state = _state([ALPHA, BETA])
    _stored(state, "resp_a", ALPHA)
    absent = _call(state, "GET", "/v1/responses/resp_never", BETA)
    for method, path in (("GET", "/v1/responses/resp_a"), ("DELETE", "/v1/responses/resp_a"),
                         ("POST", "/v1/responses/resp_a/cancel")):
        r = _call(state, method, path, BETA)
        assert r.status_code == 404, (method, r.text)
        assert r.json()["error"]["code"] == absent.json()["error"]["code"] == "not_found"
        assert "resp_a" in r.json()["error"]["message"]  # the same sentence as for any absent id
    assert _call(state, "GET", "/v1/responses/resp_a", ALPHA).json()["id"] == "resp_a"
    assert _call(state, "DELETE", "/v1/responses/resp_a", ALPHA).json()["deleted"] is True
    assert _call(state, "GET", "/v1/responses/resp_a", ALPHA).status_code == 404


def test_another_key_cannot_cancel_a_running_response():
    class Handle:
        cancelled = False

        def cancel(self):
            Handle.cancelled = True

    state = _state([ALPHA, BETA])
    live = Live(Handle())
    live.owner = stream_owner(ALPHA, state.settings.server.api_keys)
    _store(state).live["resp_run"] = live
    assert _call(state, "POST", "/v1/responses/resp_run/cancel", BETA).status_code == 404
    assert not Handle.cancelled and not live.cancelled


def test_previous_response_id_of_another_key_is_not_found():
    state = _state([ALPHA, BETA])
    _stored(state, "resp_a", ALPHA)
    req = ResponsesRequest(input="next", previous_response_id="resp_a")
    alpha, beta = (stream_owner(k, state.settings.server.api_keys) for k in (ALPHA, BETA))
    assert _conversation(state, req, alpha)[0]["content"] == "secret"
    with pytest.raises(ApiError) as e:
        _conversation(state, req, beta)
    assert (e.value.status, e.value.code) == (404, "previous_response_not_found")


def test_one_key_shares_and_long_ids_are_not_echoed_whole():
    state = _state([ALPHA])
    _stored(state, "resp_a", ALPHA)
    assert _call(state, "GET", "/v1/responses/resp_a", ALPHA).status_code == 200
    r = _call(state, "GET", "/v1/responses/" + "x" * 5000, ALPHA)
    assert r.status_code == 404 and len(r.json()["error"]["message"]) < 200
