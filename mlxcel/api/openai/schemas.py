"""Request structs of the OpenAI-compatible routes: the fields each one honours.

A field declared here is read by its route; `fields.FIELD_TABLE` says which output-changing
fields an endpoint refuses, and anything neither declares is reported as unused.
"""

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
    logit_bias: dict[str, Any] | None = None  # OpenAI's {"token id": bias in -100..100}
    cache_prompt: bool | None = None  # b10621's per-request prompt-cache switch
    lora: Any = None  # b10621's per-request LoRA scales, [{id, scale}, ...] (api/llamacpp/lora_adapters.py)
    # scoring mode (see scoring.py)
    allowed_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[dict[str, Any]]
    extra_messages: list[list[dict[str, Any]]] | None = None  # more conversations, one choice each
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None  # checked by openai/response_format.py
    # the chat surface (api/openai/chat_surface.py)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: Any = None
    reasoning_format: str | None = None
    reasoning_effort: str | None = None
    echo: bool | None = None
    # b10621's thinking budget and run-time control (engine/reasoning_budget.py)
    reasoning_budget_tokens: int | None = None
    reasoning_budget_message: str | None = None
    reasoning_budget_start_tag: str | None = None
    reasoning_budget_end_tags: list[str] | None = None
    reasoning_budget_end_tag: str | None = None  # b10621's one-tag spelling of the above
    reasoning_control: bool | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # a string, a list of strings, a token list, or a list of token lists (checked by the route)
    prompt: str | list[Any]
    logprobs: bool | int | None = None  # an int: alternatives per generated token (0-20); false changes nothing
    echo: bool | None = None  # the prompt (and with logprobs its tokens' logprobs) opens each choice
    add_special_tokens: bool | None = None


# Sampling fields that have no effect in scoring mode (reported when sent).
SCORING_UNUSED = ("top_p", "top_k", "min_p", "stop", "frequency_penalty", "presence_penalty", "logit_bias")


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """What /v1/embeddings reads (the route parses the body itself; this names the fields the
    field contract counts as used). `content` and `embd_normalize` are b10621's spellings."""

    input: Any = None
    content: Any = None
    model: str | None = None
    encoding_format: str | None = None
    embd_normalize: int | None = None
