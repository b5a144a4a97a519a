"""`tool_choice: "required"` or a named function: a grammar that only admits tool calls.

The grammar spells calls the way the model's family writes them, so the output goes through
the same parser (chat/tool_calls.py) as an unconstrained call and always parses:

- hermes (the template mentions `<tool_call>`): `<tool_call>\\n{json}\\n</tool_call>`, calls
  separated by a newline;
- mistral (`[TOOL_CALLS]`): `[TOOL_CALLS][{json}, ...]`;
- llama (`<|python_tag|>` or Llama 3's `ipython` role): one bare `{"name", "parameters"}` object;
- json (anything else): one `{"name", "arguments"}` object, or an array of them.

Each call object is a JSON Schema: `name` is the tool's name as a constant and the arguments
are the tool's own `parameters` schema, so the arguments validate against it; its objects
admit only their listed properties unless the schema allows more (engine/json_schema.py).
With several tools the call is any one of them; with `parallel_tool_calls` one or more calls
may follow.
A marker that is one token of the vocabulary is referenced by id (the constraint library
treats added tokens as special, not as text). When the prompt leaves a thinking block open
the model first finishes its thought and closes the block, then calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mlxcel.api.errors import ApiError
from mlxcel.api.openai import response_format as rf
from mlxcel.chat.reasoning import CLOSE as THINK_CLOSE
from mlxcel.chat.tool_calls import HERMES_CLOSE, HERMES_OPEN, MISTRAL_TAG, PYTHON_TAG
from mlxcel.config.limits import echo
from mlxcel.engine.grammar import JSON_OPTIONS
from mlxcel.engine.json_schema import close_objects

FORMATS = ("hermes", "mistral", "llama", "json")


def family_format(template: str | None) -> str:
    """The tool-call spelling a chat template teaches its model."""
    t = template or ""
    if HERMES_OPEN in t:
        return "hermes"
    if MISTRAL_TAG in t:
        return "mistral"
    if PYTHON_TAG in t or "ipython" in t:
        return "llama"
    return "json"


@dataclass(frozen=True)
class ToolChoice:
    """What the request forces: `name` None means any of the tools."""

    tools: tuple[dict, ...]
    name: str | None
    parallel: bool


def _refuse(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_parameter", param="tool_choice")


def _parameters(tool: dict) -> Any:
    params = tool["function"].get("parameters")
    if params is None:
        return {"type": "object"}
    try:
        rf.check_schema(params)
    except ApiError as e:
        raise ApiError(400, f"tool '{echo(tool['function']['name'])}': the parameters schema cannot be enforced for "
                       f"tool_choice: {e.message.replace('response_format.json_schema.schema', 'it')}",
                       code="field_not_honoured", param="tool_choice") from None
    return params


def _call_schema(choice: ToolChoice, args_key: str) -> dict:
    options = []
    for tool in choice.tools:
        fn = tool["function"]
        if choice.name is not None and fn["name"] != choice.name:
            continue
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: _parameters(tool)},
                        "required": ["name", args_key], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _marker(text: str, encode) -> str:
    """A lark terminal for a marker: its token id when it is one token, else the text."""
    ids = encode(text)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def _json(schema: dict) -> str:
    """A `%json` item, with the same bounded layout and closed objects response_format
    documents get."""
    return "%json " + json.dumps({**close_objects(schema), "x-guidance": JSON_OPTIONS})


def lark(choice: ToolChoice, fmt: str, encode, thinking_open: bool, think_close: str = THINK_CLOSE) -> str:
    """The grammar text. `encode` maps text to token ids (special tokens parsed)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    rules = []
    if fmt == "hermes":
        rules.append(f'call: {_marker(HERMES_OPEN, encode)} "\\n" obj "\\n" {_marker(HERMES_CLOSE, encode)}')
        rules.append("obj: " + _json(_call_schema(choice, "arguments")))
        body = 'call ("\\n" call)*' if choice.parallel else "call"
    elif fmt == "mistral":
        items = {"type": "array", "items": _call_schema(choice, "arguments"), "minItems": 1}
        if not choice.parallel:
            items["maxItems"] = 1
        rules.append("arr: " + _json(items))
        body = f"{_marker(MISTRAL_TAG, encode)} arr"
    elif fmt == "llama":
        rules.append("obj: " + _json(_call_schema(choice, "parameters")))
        body = "obj"
    else:
        one = _call_schema(choice, "arguments")
        doc = {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if choice.parallel else one
        rules.append("obj: " + _json(doc))
        body = "obj"
    if thinking_open:
        # the rest of the thought (any text; the close marker cannot occur inside it), then the calls
        close = _marker(think_close, encode)
        if close.startswith("<["):  # one token: the thought is any text, then that token
            rules.append("THOUGHT: /(?s:.*)/")
            body = f'THOUGHT {close} /[ \\n]*/ {body}'
        else:  # text: one lexeme that ends at the first close marker (a lexeme ending before it
            # could not be continued by the marker's own characters)
            literal = re.escape(think_close).replace("/", "\\/")
            rules.append(f"THOUGHT: /(?s:.*){literal}/ & ~/(?s:.*{literal}.+)/")
            body = f'THOUGHT /[ \\n]*/ {body}'
    return "\n".join([f"start: {body}", *rules]) + "\n"


def parse_choice(value: Any, tools: list[dict], parallel: bool) -> ToolChoice | None:
    """None for auto / none; a ToolChoice for required or a named function."""
    if value is None or value in ("auto", "none"):
        return None
    if value == "required":
        return ToolChoice(tuple(tools), None, parallel)
    if isinstance(value, dict):
        fn = value.get("function") if value.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _refuse("tool_choice must be 'auto', 'none', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if not any(t["function"]["name"] == name for t in tools):
            raise _refuse(f"tool_choice names '{name}', which is not among 'tools'")
        return ToolChoice(tuple(tools), name, False)
    raise _refuse("tool_choice must be 'auto', 'none', 'required' or a named function")
