"""Prompt inspection without generating: /apply-template and the input_tokens counters.

All of them render through the same chat-template path /v1/chat/completions prefills
with, so a count is the number of tokens that request would really prefill. The
Responses-shaped pair translates `instructions` and `input` (a string, or message items
with text parts) into chat messages; items it cannot translate are refused.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, post

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.openai.chat import render_prompt, render_prompt_text
from mlxcel.api.openai.generation import served_model
from mlxcel.api.state import AppState

_TEXT_PARTS = ("input_text", "output_text", "text")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be an array of messages", code="invalid_parameter", param="messages")
    return messages


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI Responses request's `instructions` + `input` as chat messages."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise ApiError(400, "previous_response_id and conversation are not supported by this server",
                       code="field_not_honoured", param="previous_response_id")
    out: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError(400, "'input' must be a string or an array of items", code="invalid_parameter", param="input")
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
            raise ApiError(400, f"input[{i}] is not a message item; only message items can be counted here",
                           code="invalid_parameter", param="input")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"input[{i}].content holds a part that is not text",
                                   code="invalid_parameter", param="input")
                texts.append(part["text"])
            content = "".join(texts)
        role = "system" if item["role"] == "developer" else item["role"]
        out.append({"role": role, "content": content})
    return out


@post("/apply-template", status_code=200)
async def apply_template(request: Request, app_state: AppState) -> dict:
    body = await read_json_object(request)
    model = served_model(app_state, None)
    return {"prompt": render_prompt_text(model, _messages(body))}


@post(["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"], status_code=200)
async def chat_input_tokens(request: Request, app_state: AppState) -> dict:
    body = await read_json_object(request)
    model = served_model(app_state, None)
    return {"input_tokens": len(render_prompt(model, _messages(body)))}


@post(["/responses/input_tokens", "/v1/responses/input_tokens"], status_code=200)
async def responses_input_tokens(request: Request, app_state: AppState) -> dict:
    body = await read_json_object(request)
    model = served_model(app_state, None)
    return {"input_tokens": len(render_prompt(model, responses_messages(body)))}
