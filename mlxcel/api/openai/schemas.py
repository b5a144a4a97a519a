"""Request structs of the OpenAI-compatible routes (the fields each one honours)."""

from __future__ import annotations

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    cache_prompt: bool | None = None  # b10621's per-request prompt-cache switch


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[dict[str, Any]]
    # the chat surface (api/openai/chat_surface.py)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: Any = None
    reasoning_format: str | None = None
    reasoning_effort: str | None = None
    echo: bool | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # a string, a list of strings, a token list, or a list of token lists (checked by the route)
    prompt: str | list[Any]
