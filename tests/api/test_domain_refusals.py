"""A layer below the API refuses a request field with its own exception type (steering's
`RequestRefused`); the API renders it exactly as the `ApiError` it stands for, in every route
family's envelope."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from mlxcel.api.app import build_litestar
from mlxcel.api.errors import ApiError, api_error_handler, refusal_handler
from mlxcel.api.state import AppState
from mlxcel.config.settings import ServerSettings
from mlxcel.steering.requests import RequestRefused


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/steering", "/completion"])
def test_a_refusal_renders_as_its_api_error(path):
    request = SimpleNamespace(url=SimpleNamespace(path=path))
    refused = RequestRefused(404, "profile 'x' not found", code="profile_not_found", param="profile")
    got = refusal_handler(request, refused)
    want = api_error_handler(request, ApiError(404, "profile 'x' not found", code="profile_not_found",
                                               param="profile"))
    assert (got.status_code, got.content, got.headers) == (want.status_code, want.content, want.headers)


def test_a_steering_field_refusal_reaches_the_client_in_openai_shape():
    app = build_litestar(AppState(settings=ServerSettings()))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "steering_intensity": "MAX"})

    r = asyncio.run(run())
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "invalid_parameter", "steering_intensity")
