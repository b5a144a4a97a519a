"""/v1 errors while no model is loaded, read back through the `openai` SDK in-process:
503 model_not_loaded raises InternalServerError; the body keeps OpenAI's four keys."""

from __future__ import annotations

import asyncio

import httpx
import openai

from mlxcel.api.app import build_litestar
from mlxcel.api.state import AppState
from mlxcel.config.settings import ServerSettings


def test_model_not_loaded_is_internal_server_error_in_the_sdk():
    app = build_litestar(AppState(settings=ServerSettings()))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            try:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            except openai.InternalServerError as e:
                return e
            raise AssertionError("no error raised")

    err = asyncio.run(run())
    assert err.status_code == 503 and err.code == "model_not_loaded"
    assert set(err.body) == {"message", "type", "param", "code"} and err.body["type"] == "server_error"


def test_field_refusal_comes_before_the_model_is_looked_at():
    app = build_litestar(AppState(settings=ServerSettings()))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            try:
                await client.completions.create(model="m", prompt="hi", extra_body={"dimensions": 8})
            except openai.BadRequestError as e:
                return e
            raise AssertionError("no error raised")

    err = asyncio.run(run())
    assert err.code == "field_not_honoured" and err.param == "dimensions"


def test_mid_stream_error_frames_and_api_errors_share_the_code_table():
    """The contract types insufficient_memory as invalid_request_error despite its 503 and
    model_busy as server_error; a stream's error frame and an ApiError read the same table."""
    import json

    from mlxcel.api.errors import ApiError
    from mlxcel.api.openai.generation import error_frame
    from mlxcel.engine.types import TokenEvent

    for code, status, want in (("insufficient_memory", 503, "invalid_request_error"),
                               ("model_busy", 503, "server_error"),
                               ("context_length_exceeded", 400, "invalid_request_error"),
                               ("server_error", 500, "server_error")):
        frame = error_frame(TokenEvent(error="boom", error_code=code))
        assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
        body = json.loads(frame[6:])["error"]
        assert body == {"message": "boom", "type": want, "param": None, "code": code}
        assert ApiError(status, "boom", code=code).type == want
    assert ApiError(404, "x", code="not_in_table").type == "invalid_request_error"
    assert ApiError(502, "x").type == "server_error"


def test_an_engine_error_ending_a_non_streamed_request_keeps_the_contract_status():
    """model_busy (a model unloaded under the request) and insufficient_memory are 503 on a
    non-streamed answer too; an unnamed engine failure stays a 500 server_error."""
    import pytest

    from mlxcel.api.errors import ApiError
    from mlxcel.api.stream_runner import raise_for_error
    from mlxcel.engine.types import TokenEvent

    for code, status, kind in (("model_busy", 503, "server_error"), ("insufficient_memory", 503, "invalid_request_error"),
                               (None, 500, "server_error")):
        with pytest.raises(ApiError) as e:
            raise_for_error(TokenEvent(error="boom", error_code=code))
        assert (e.value.status, e.value.type, e.value.code) == (status, kind, code or "server_error")
    raise_for_error(TokenEvent(text="fine"))  # no error: nothing raised
