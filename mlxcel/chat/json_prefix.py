"""The object a JSON text cut short would have been, as far as it got.

A tool call cut off by the token limit carries its arguments as a prefix of a JSON object.
Routes whose wire shape holds the arguments as an object rather than as text (Anthropic's
`tool_use.input`) need an object: `object_of_prefix` keeps every member the prefix completes
and closes what is still open; a string value cut mid-way is kept as far as it was written.
"""

from __future__ import annotations

import json
from typing import Any

_CLOSE = {"{": "}", "[": "]"}


def _state(text: str) -> tuple[list[str], bool]:
    """The brackets still open at the end of `text`, and whether it ends inside a string."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in _CLOSE:
            stack.append(_CLOSE[ch])
        elif ch in "}]" and stack:
            stack.pop()
    return stack, in_string


def _closed(text: str) -> Any:
    stack, in_string = _state(text)
    if in_string:
        text = text[:-1] if text.endswith("\\") else text
        text += '"'
    text = text.rstrip()
    text = text[:-1] if text.endswith(",") else text
    try:
        return json.loads(text + "".join(reversed(stack)))
    except ValueError:
        return None


MAX_TRIES = 64  # each try re-reads the prefix: a bound keeps a long cut call linear


def object_of_prefix(text: str) -> dict[str, Any]:
    """The longest prefix of `text` that closes into a JSON object, closed ({} when none does):
    the whole text, else the text before one of its last separators (a member ends there)."""
    text = text.strip()
    # before a comma (the member ends there), or just after an opening bracket (it closes empty)
    ends = [len(text)] + [i + (text[i] != ",") for i in range(len(text) - 1, 0, -1) if text[i] in ",{["]
    for end in ends[:MAX_TRIES]:
        value = _closed(text[:end])
        if isinstance(value, dict):
            return value
    return {}
