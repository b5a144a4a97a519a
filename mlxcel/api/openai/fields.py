"""The /v1 field contract: every request field is honoured, reported, or refused.

`FIELD_TABLE` is the contract, one row per output-changing field and one column per
endpoint: a field an endpoint cannot honour is refused with 400 `field_not_honoured`
(unless it carries a "no change" value), before the model is even looked at. A field the
endpoint's request struct declares is honoured. Anything else, nested keys included
(`messages[2].name`), is reported in `X-miLLM-Ignored-Fields` (an RFC 8941 list of
locations) and in one `request_fields_unused` warning, or refused with 400
`unused_fields_refused` under `X-miLLM-Strict: true`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.native_params import OPENAI_SHARED
from mlxcel.config.limits import ERROR_MESSAGE_CHARS, echo

log = logging.getLogger("mlxcel.api")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)

HONOURED = "honoured"
REFUSED = "refused"
H, R = HONOURED, REFUSED

IGNORED_FIELDS_HEADER = "X-miLLM-Ignored-Fields"
IGNORED_FIELDS_HEADER_MAX_BYTES = 1024
STRICT_HEADER = "X-miLLM-Strict"

# The seed's table for a transformers-class engine (its GGUF columns do not apply: mlxcel
# refuses GGUF models). Rows below the blank line are mlxcel's own: fields of other APIs
# that would change the output and that no endpoint honours yet.
FIELD_TABLE: dict[str, dict[str, str]] = {
    #                         chat       completions   embeddings
    "logprobs":              {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},  # openai/logprobs.py
    "allowed_token_ids":     {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},  # scoring mode
    "top_logprobs":          {CHAT: H, COMPLETIONS: R, EMBEDDINGS: R},  # completions: logprobs is the count
    "response_format":       {CHAT: H, COMPLETIONS: R, EMBEDDINGS: R},  # chat: openai/response_format.py
    "seed":                  {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},
    "n":                     {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},  # chat: not streaming
    "max_completion_tokens": {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},
    "profile":               {CHAT: H, COMPLETIONS: R, EMBEDDINGS: R},  # chat: mlxcel/steering
    "steering_intensity":    {CHAT: H, COMPLETIONS: R, EMBEDDINGS: R},
    "steering":              {CHAT: R, COMPLETIONS: R, EMBEDDINGS: R},
    "dimensions":            {CHAT: R, COMPLETIONS: R, EMBEDDINGS: R},
    "tools":                 {CHAT: H, COMPLETIONS: R, EMBEDDINGS: R},
    "tool_choice":           {CHAT: H, COMPLETIONS: R, EMBEDDINGS: R},
    "logit_bias":            {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},

    "extra_messages":        {CHAT: H, COMPLETIONS: R, EMBEDDINGS: R},
    "return_sae_activations": {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},  # mlxcel/steering/requests.py
    "cache_prompt":          {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},  # b10621's per-request switch
    "lora":                  {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},  # b10621's per-request adapter scales
    "parallel_tool_calls":   {CHAT: H, COMPLETIONS: R, EMBEDDINGS: R},
    "functions":             {CHAT: R, COMPLETIONS: R, EMBEDDINGS: R},
    "function_call":         {CHAT: R, COMPLETIONS: R, EMBEDDINGS: R},
    "echo":                  {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R},
    "best_of":               {CHAT: R, COMPLETIONS: R, EMBEDDINGS: R},
    "suffix":                {CHAT: R, COMPLETIONS: R, EMBEDDINGS: R},
}

# b10621's native sampler and grammar fields (repeat_penalty, mirostat*, dry_*, xtc_*, grammar,
# json_schema, ignore_eos, ...): its OpenAI routes read them as /completion does, and so do these,
# through the same parser (api/llamacpp/native_params.py: parse_shared).
FIELD_TABLE.update({name: {CHAT: H, COMPLETIONS: H, EMBEDDINGS: R} for name in OPENAI_SHARED})

# Values that change nothing, accepted wherever the field is refused (an explicit null too).
NO_CHANGE: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "logprobs": (False,),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "logit_bias": ({},),
    "tool_choice": ("none",),  # with no tools, "none" is what happens anyway
    "echo": (False,),
    "best_of": (1,),
}

# Keys of a chat message (and of a content part) the prompt renderer reads.
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "reasoning_content"})
CONTENT_PART_KEYS = frozenset({"type", "text"})


def policy(field: str, endpoint: str) -> str | None:
    row = FIELD_TABLE.get(field)
    return row[endpoint] if row else None


def is_no_change(field: str, value: Any) -> bool:
    """`value` is one of the field's no-change values (type and value: `true` is not `1`)."""
    return value is None or any(type(value) is type(v) and value == v for v in NO_CHANGE.get(field, ()))


def check_fields(body: Mapping[str, Any], struct: type[msgspec.Struct], endpoint: str) -> list[str]:
    """Refuse what `endpoint` cannot honour; return the top-level locations it does not use."""
    declared = set(struct.__struct_fields__)
    unused: list[str] = []
    for key, value in body.items():
        if value is None:
            continue
        if policy(key, endpoint) == REFUSED:
            if is_no_change(key, value):
                continue
            raise ApiError(400, f"'{echo(key)}' is not honoured on {endpoint} by this server",
                           code="field_not_honoured", param=key)
        if key not in declared and policy(key, endpoint) != HONOURED:
            unused.append(key)
    return unused


def message_locations(messages: Any, prefix: str) -> list[str]:
    """Unused keys inside chat messages and their content parts, e.g. `messages[2].name`."""
    out: list[str] = []
    if not isinstance(messages, list):
        return out
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        for key, value in m.items():
            if key not in MESSAGE_KEYS and value is not None:
                out.append(f"{prefix}[{i}].{key}")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text":
                    out.extend(f"{prefix}[{i}].content[{j}].{k}" for k, v in part.items()
                               if k not in CONTENT_PART_KEYS and v is not None)
    return out


def object_locations(value: Any, known: Iterable[str], prefix: str) -> list[str]:
    """Unused keys of a nested object field (e.g. `stream_options.foo`)."""
    if not isinstance(value, dict):
        return []
    known = set(known)
    return [f"{prefix}.{k}" for k, v in value.items() if k not in known and v is not None]


def strict_mode(headers: Mapping[str, str]) -> bool:
    """`X-miLLM-Strict`: true/1 refuse unused fields, false/0/absent report them."""
    raw = headers.get(STRICT_HEADER.lower())
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise ApiError(400, f"{STRICT_HEADER} must be true, 1, false or 0 (got {echo(raw)!r})",
                   code="invalid_parameter", param=STRICT_HEADER)


def settle_unused(locations: list[str], strict: bool, endpoint: str) -> dict[str, str]:
    """Refuse (strict) or report the unused locations; the headers to send when reported."""
    if not locations:
        return {}
    if strict:
        raise ApiError(400, f"{STRICT_HEADER} is set and these request fields are not used on {endpoint}: "
                       + ", ".join(echo(loc) for loc in locations), code="unused_fields_refused",
                       param=echo(locations[0]))
    log.warning("request_fields_unused endpoint=%s locations=%s", endpoint,
                echo(",".join(locations), ERROR_MESSAGE_CHARS))
    return ignored_fields_header(locations)


def _sf_string(s: str) -> str:
    """An RFC 8941 sf-string; characters outside printable ASCII (and `%`) percent-encoded."""
    out = []
    for ch in s:
        if 0x20 <= ord(ch) <= 0x7E and ch != "%":
            out.append("\\" + ch if ch in '"\\' else ch)
        else:
            out.extend(f"%{b:02x}" for b in ch.encode("utf-8"))
    return '"' + "".join(out) + '"'


def ignored_fields_header(locations: list[str]) -> dict[str, str]:
    """`X-miLLM-Ignored-Fields` for these locations, at most 1,024 bytes: when they do not
    all fit, as many as fit are followed by a final `"+N more"`."""
    if not locations:
        return {}
    items = [_sf_string(loc) for loc in locations]
    full = ", ".join(items)
    if len(full) <= IGNORED_FIELDS_HEADER_MAX_BYTES:
        return {IGNORED_FIELDS_HEADER: full}
    kept: list[str] = []
    for i, item in enumerate(items):
        more = f'"+{len(items) - i - 1} more"'
        if len(", ".join([*kept, item, more])) > IGNORED_FIELDS_HEADER_MAX_BYTES:
            break
        kept.append(item)
    return {IGNORED_FIELDS_HEADER: ", ".join([*kept, f'"+{len(items) - len(kept)} more"'])}
