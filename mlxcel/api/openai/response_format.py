"""`response_format` on /v1/chat/completions: JSON output constrained, then validated.

`parse` reads the field (refusing what cannot be honoured, before any compile), `compile`
turns it into the engine's grammar (cached per schema by the model's compiler), `header`
is `X-miLLM-Constrained`, and `check_output` decides what a finished choice may report:
`finish_reason: "stop"` only for a document that ended itself and validates; a complete
document that fails validation is a 500 `constrained_output_invalid`, never a 200.

The JSON Schema subset is this server's own list, not the constraint library's: keywords
the library would compile without enforcing are refused by name and JSON pointer.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from mlxcel.api.errors import ApiError
from mlxcel.config.limits import echo
from mlxcel.engine.grammar import GrammarError

HEADER = "X-miLLM-Constrained"
MAX_SCHEMA_BYTES = 64 * 1024
MAX_DEPTH = 32
MAX_PROPERTIES = 256

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# keyword -> what its value holds: a schema, a map of schemas, a list of schemas, or data
_SCHEMA, _SCHEMA_MAP, _SCHEMA_LIST, _DATA = "schema", "map", "list", "data"
SUPPORTED: dict[str, str] = {
    "type": _DATA, "properties": _SCHEMA_MAP, "required": _DATA, "additionalProperties": _SCHEMA,
    "items": _SCHEMA, "minItems": _DATA, "maxItems": _DATA, "enum": _DATA, "const": _DATA,
    "minimum": _DATA, "maximum": _DATA, "minLength": _DATA, "maxLength": _DATA, "pattern": _DATA,
    "anyOf": _SCHEMA_LIST, "$ref": _DATA, "$defs": _SCHEMA_MAP,
    # annotations: accepted and ignored
    "title": _DATA, "description": _DATA, "default": _DATA, "examples": _DATA,
}
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
# Fields that cannot coexist with a constrained document on this route.
_CONFLICTS = {
    "stream": lambda v: v is True,
    "stop": lambda v: v not in (None, [], ""),
    "allowed_token_ids": lambda v: v is not None,
}


def _unsupported(message: str) -> ApiError:
    return ApiError(400, message, code="response_format_unsupported", param="response_format")


@dataclass
class Constraint:
    kind: str  # "json_object" | "json_schema"
    schema: Any
    name: str | None = None

    @property
    def header(self) -> dict[str, str]:
        """`X-miLLM-Constrained`: a token, or a token with an RFC 8941 `name` parameter."""
        if self.kind == "json_object":
            return {HEADER: "json_object"}
        name = (self.name or "").replace("\\", "\\\\").replace('"', '\\"')
        return {HEADER: f'json_schema;name="{name}"'}


def _pointer(parts: list[str]) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def _walk(node: Any, path: list[str], depth: int, refused: list[str], defs: dict[str, Any]) -> None:
    """Check one schema position: keywords, value shapes, and the nesting limits."""
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise _unsupported(f"the schema at '{_pointer(path) or '/'}' must be an object or a boolean")
    if depth > MAX_DEPTH:
        raise _unsupported(f"the schema nests deeper than {MAX_DEPTH} levels (at '{_pointer(path)}')")
    for key, value in node.items():
        here = path + [key]
        role = SUPPORTED.get(key)
        if role is None:
            refused.append(f"{key} at {_pointer(here)}")
            continue
        if key == "type":
            names = value if isinstance(value, list) else [value]
            if not names or any(n not in TYPES for n in names):
                raise _unsupported(f"'type' at {_pointer(here)} must be one of {', '.join(TYPES)} (or a list of them)")
        elif key in _COUNTS and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise _unsupported(f"'{key}' at {_pointer(here)} must be a non-negative integer")
        elif key in ("minimum", "maximum") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _unsupported(f"'{key}' at {_pointer(here)} must be a number")
        elif key == "pattern" and not isinstance(value, str):
            raise _unsupported(f"'pattern' at {_pointer(here)} must be a string")
        elif key in ("required", "enum") and not isinstance(value, list):
            raise _unsupported(f"'{key}' at {_pointer(here)} must be an array")
        elif key == "$ref":
            target = value[len("#/$defs/"):] if isinstance(value, str) and value.startswith("#/$defs/") else None
            if target is None or "/" in target or target not in defs:
                refused.append(f"$ref at {_pointer(here)} (only local references into $defs are supported)")
        elif key == "items" and isinstance(value, list):
            refused.append(f"items at {_pointer(here)} (the array form; give one schema)")
        elif role == _SCHEMA:
            _walk(value, here, depth + 1, refused, defs)
        elif role == _SCHEMA_MAP:
            if not isinstance(value, dict):
                raise _unsupported(f"'{key}' at {_pointer(here)} must be an object")
            if key == "properties" and len(value) > MAX_PROPERTIES:
                raise _unsupported(f"'properties' at {_pointer(here)} has {len(value)} entries; "
                                   f"the limit is {MAX_PROPERTIES}")
            for name, sub in value.items():
                _walk(sub, here + [name], depth + 1, refused, defs)
        elif role == _SCHEMA_LIST:
            if not isinstance(value, list) or not value:
                raise _unsupported(f"'{key}' at {_pointer(here)} must be a non-empty array")
            for i, sub in enumerate(value):
                _walk(sub, here + [str(i)], depth + 1, refused, defs)


def check_schema(schema: Any) -> None:
    """Enforce the size, depth and property limits and the keyword subset (400s)."""
    size = len(json.dumps(schema, ensure_ascii=False).encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise _unsupported(f"the schema is {size} bytes; the limit is {MAX_SCHEMA_BYTES} bytes (64 KB)")
    if not isinstance(schema, dict):
        raise _unsupported("response_format.json_schema.schema must be a JSON object")
    defs = schema.get("$defs") if isinstance(schema.get("$defs"), dict) else {}
    refused: list[str] = []
    _walk(schema, [], 1, refused, defs)
    if refused:
        raise _unsupported("response_format.json_schema.schema uses keywords this server does not enforce: "
                           + "; ".join(refused))


def refuse(body: dict[str, Any], endpoint: str) -> None:
    """For routes that cannot constrain (/v1/completions, /v1/embeddings): refuse any
    response_format other than text, before loading anything."""
    value = body.get("response_format")
    if value is None or value == {"type": "text"}:
        return
    raise _unsupported(f"response_format is not supported on {endpoint}; use /v1/chat/completions")


def parse(body: dict[str, Any]) -> Constraint | None:
    """The constraint a chat request asks for (None for absent or text). Refuses bad shapes,
    unsupported schemas and conflicting fields with 400s, before any compile."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError(400, "response_format must be an object with a 'type'", code="invalid_parameter",
                       param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise _unsupported(f"response_format type '{echo(kind)}' is not supported; use text, json_object or "
                           "json_schema")
    for name, conflicts in _CONFLICTS.items():
        if conflicts(body.get(name)):
            raise _unsupported(f"response_format cannot be combined with '{name}'")
    if kind == "json_object":
        return Constraint("json_object", {"type": "object"})
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object with 'name' and 'schema'",
                       code="invalid_parameter", param="response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or any(not " " <= c <= "~" for c in name):
        raise ApiError(400, "response_format.json_schema.name must be 1 to 64 printable ASCII characters",
                       code="invalid_parameter", param="response_format")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise ApiError(400, "response_format.json_schema.strict must be a boolean",
                       code="invalid_parameter", param="response_format")
    schema = spec.get("schema", {})
    check_schema(schema)
    return Constraint("json_schema", schema, name)


async def compile_grammar(constraint: Constraint, model: Any) -> Any:
    """The engine grammar for this constraint (compiled off the event loop, cached)."""
    try:
        return await asyncio.to_thread(model.grammars.compile, "json_schema", constraint.schema)
    except GrammarError as e:
        raise _unsupported(f"the schema cannot be compiled: {e}") from None


def check_output(constraint: Constraint, text: str, finish_reason: str | None) -> None:
    """A choice that ended itself must be a valid document; raise 500 otherwise."""
    if finish_reason != "stop":
        return  # "length": the document is incomplete and is reported as such
    import jsonschema

    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(500, f"the constrained output is not valid JSON: {e}", code="constrained_output_invalid",
                       type="server_error") from None
    try:
        jsonschema.Draft202012Validator(constraint.schema).validate(doc)
    except jsonschema.ValidationError as e:
        where = "/" + "/".join(str(p) for p in e.absolute_path)
        raise ApiError(500, f"the constrained output does not validate at '{where}': {e.message}",
                       code="constrained_output_invalid", type="server_error") from None
