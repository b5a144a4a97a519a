"""The /v1 field contract: every request field is honoured, reported, or refused.

A field listed in the endpoint's request struct is honoured. An output-changing field
the endpoint cannot honour yet is refused with 400 `field_not_honoured` unless it carries
a "no change" value. Anything else is reported in `X-miLLM-Ignored-Fields` (an RFC 8941
list of field locations), never silently dropped.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mlxcel.api.errors import ApiError

IGNORED_FIELDS_HEADER = "X-miLLM-Ignored-Fields"
IGNORED_FIELDS_HEADER_MAX_BYTES = 1024

# Output-changing fields that no endpoint honours yet, with the values that change nothing.
_NO_CHANGE: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),
    "top_logprobs": (),
    "allowed_token_ids": (),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "logit_bias": ({},),
    "n": (1,),
    "profile": (),
    "steering_intensity": (),
    "steering": (),
    "return_sae_activations": (),
    "dimensions": (),
    "extra_messages": (),
    "echo": (False,),
    "best_of": (1,),
    "suffix": (),
}


def check_fields(body: dict[str, Any], struct: type[msgspec.Struct], endpoint: str,
                 refuse: tuple[str, ...] = tuple(_NO_CHANGE)) -> list[str]:
    """Refuse unhonourable fields; return the locations of ignored ones."""
    honoured = set(struct.__struct_fields__)
    ignored: list[str] = []
    for key, value in body.items():
        if key in honoured or value is None:
            continue
        if key in refuse:
            if value in _NO_CHANGE.get(key, ()):
                continue
            raise ApiError(400, f"'{key}' is not honoured on {endpoint} by this server",
                           code="field_not_honoured", param=key)
        ignored.append(key)
    return ignored


def _sf_string(s: str) -> str:
    out = []
    for ch in s:
        o = ord(ch)
        if 0x20 <= o <= 0x7E and ch not in '"\\%':
            out.append(ch)
        else:
            out.extend(f"%{b:02x}" for b in ch.encode("utf-8"))
    return '"' + "".join(out) + '"'


def ignored_fields_header(locations: list[str]) -> dict[str, str]:
    """`X-miLLM-Ignored-Fields` for these locations, capped with a final "+N more"."""
    if not locations:
        return {}
    parts: list[str] = []
    size = 0
    for i, loc in enumerate(locations):
        item = _sf_string(loc)
        rest = len(locations) - i - 1
        tail = len(f', "+{rest} more"') if rest else 0
        if size + len(item) + 2 + tail > IGNORED_FIELDS_HEADER_MAX_BYTES:
            parts.append(f'"+{len(locations) - i} more"')
            break
        parts.append(item)
        size += len(item) + 2
    return {IGNORED_FIELDS_HEADER: ", ".join(parts)}
