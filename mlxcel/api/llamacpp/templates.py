"""Prompt inspection without generating: /apply-template and the input_tokens counters.

All of them render through the same chat-template path /v1/chat/completions prefills
with, so a count is the number of tokens that request would really prefill. The
Responses-shaped pair goes through /v1/responses' own translation (openai/responses.py),
so previous_response_id, tools and function-call items are counted as that route sends them.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, post

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.openai.chat import render_prompt_text
from mlxcel.api.openai.chat_surface import check_tools, template_history, template_kwargs
from mlxcel.api.openai.generation import served_model
from mlxcel.api.openai.responses import count_input_tokens, response_owner
from mlxcel.api.state import AppState


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be an array of messages", code="invalid_parameter", param="messages")
    return messages


def _render(app_state: AppState, body: dict[str, Any]) -> tuple[Any, str]:
    """As chat renders it: assistant tool_calls arguments as objects, the request's tools, the
    template kwargs (server's, then the request's chat_template_kwargs and reasoning_effort)."""
    model = served_model(app_state, None)
    tools = check_tools(body["tools"]) if body.get("tools") and body.get("tool_choice") != "none" else None
    kwargs = template_kwargs(app_state.settings, model, body.get("chat_template_kwargs"), body.get("reasoning_effort"))
    text = render_prompt_text(model, template_history(_messages(body)), tools=tools, extra=kwargs,
                              prefill_assistant=app_state.settings.chat.prefill_assistant)
    return model, text


@post("/apply-template", status_code=200)
async def apply_template(request: Request, app_state: AppState) -> dict:
    _, text = _render(app_state, await read_json_object(request))
    return {"prompt": text}


@post(["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"], status_code=200)
async def chat_input_tokens(request: Request, app_state: AppState) -> dict:
    model, text = _render(app_state, await read_json_object(request))
    return {"input_tokens": len(model.tokenizer.encode(text, add_special_tokens=False))}


@post(["/responses/input_tokens", "/v1/responses/input_tokens"], status_code=200)
async def responses_input_tokens(request: Request, app_state: AppState) -> dict:
    body = await read_json_object(request)
    return {"input_tokens": count_input_tokens(app_state, body, response_owner(request, app_state))}
