"""/v1 errors while no model is loaded, read back through the `openai` SDK in-process:
503 model_not_loaded raises InternalServerError; the body keeps OpenAI's four keys."""

from __future__ import annotations

import asyncio

import httpx
import openai

from mlxcel.api.app import build_litestar
from mlxcel.api.state import AppState
from mlxcel.cli.settings import ServerSettings


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
