"""The native llama-server route handlers, in one list for the app to mount."""

from __future__ import annotations

from mlxcel.api.llamacpp.completion import completion
from mlxcel.api.llamacpp.infill import infill
from mlxcel.api.llamacpp.lora_adapters import LORA_ROUTES
from mlxcel.api.llamacpp.metrics import metrics
from mlxcel.api.llamacpp.props import get_props, post_props
from mlxcel.api.llamacpp.slots import get_slots, slot_action
from mlxcel.api.llamacpp.templates import apply_template, chat_input_tokens, responses_input_tokens
from mlxcel.api.llamacpp.tokenize import detokenize, tokenize

NATIVE_ROUTES = [
    completion, infill, tokenize, detokenize, apply_template, chat_input_tokens, responses_input_tokens,
    get_props, post_props, get_slots, slot_action, metrics, *LORA_ROUTES,
]
