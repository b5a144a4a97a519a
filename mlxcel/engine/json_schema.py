"""Which keys a JSON Schema object admits under constraint: the listed ones, unless it says more.

JSON Schema leaves an object open when `additionalProperties` is absent, and the constraint
library follows the letter of that, so a model asked for `{"a": ...}` may go on writing keys
no one asked for (and, being unlisted, the same one again) until its token limit. b10621's
converter, like OpenAI's strict mode, closes an object after its listed properties unless
the schema allows more. `close_objects` rewrites a schema to that reading before it is
compiled, for every route that constrains to a schema (response_format, the native
`json_schema` field and `--json-schema`, forced tool calls):

- an object schema that lists `properties` and has neither `additionalProperties` nor
  `unevaluatedProperties` gets `additionalProperties: false` (`patternProperties` still
  apply); a name in `required` that is not listed becomes listed, with any value;
- `additionalProperties: true` or a schema keeps the object open, as written;
- an object that lists nothing (`{"type": "object"}`) stays open, as upstream;
- members the library merges into their holder (`allOf` members, and `anyOf` / `oneOf`
  members beside listed properties) are not closed one by one, which would refuse each
  other's keys: the holder is closed over the union of the names they all list, unless one
  of them opens the object or hides its names behind a `$ref` or a nested combinator.

Listed properties come in their declared order, each at most once (the library's layout), so
a closed object never repeats a key. Where the schema allows extra keys, the grammar cannot
stop an extra key from repeating. The input is not modified.
"""

from __future__ import annotations

from typing import Any

# keyword -> how its value holds subschemas
_ONE = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("prefixItems", "items")
_OPENERS = ("additionalProperties", "unevaluatedProperties")
_OPAQUE = (*_OPENERS, "patternProperties", "$ref", "allOf", "anyOf", "oneOf")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` with every object that lists properties closed after them. Raises
    ValueError for a schema nested past Python's recursion limit (the routes' bodies are
    bounded well below it; a `--json-schema` file is not)."""
    try:
        return _close(schema, merged=False)
    except RecursionError:
        raise ValueError("the schema nests too deeply") from None


def _close(node: Any, merged: bool) -> Any:
    """`merged`: the node's keys join a holder's, and the holder decides the closing."""
    if not isinstance(node, dict):
        return node
    lists = isinstance(node.get("properties"), dict)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _MAP and isinstance(value, dict):
            out[key] = {name: _close(sub, False) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_close(sub, True) for sub in value]
        elif key in ("anyOf", "oneOf") and isinstance(value, list):
            out[key] = [_close(sub, lists) for sub in value]
        elif key in _LIST and isinstance(value, list):
            out[key] = [_close(sub, False) for sub in value]
        elif key in _ONE:
            out[key] = _close(value, False)
        else:
            out[key] = value
    if merged or any(k in out for k in _OPENERS):
        return out
    names = _listed_names(out)
    return out if names is None else _closed(out, names)


def _listed_names(node: dict[str, Any]) -> list[str] | None:
    """The property names `node` lists itself and through the members merged into it; None
    when it lists none, or a merged member leaves the object open or cannot be read."""
    own = node.get("properties")
    lists = isinstance(own, dict)
    if lists and "$ref" in node:
        return None  # the referenced schema is closed on its own; closing here too would refuse its keys
    names = list(own) if lists else []
    groups = [node.get("allOf")] + ([node.get("anyOf"), node.get("oneOf")] if lists else [])
    for members in groups:
        for member in members if isinstance(members, list) else []:
            if not isinstance(member, dict):
                continue  # true adds nothing; false refuses everything anyway
            if any(k in member for k in _OPAQUE):
                return None
            listed = member.get("properties")
            names += [n for n in listed if n not in names] if isinstance(listed, dict) else []
    return names if lists or names else None


def _closed(node: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`node` admitting exactly `names` (and any unlisted required name), nothing else."""
    props = dict(node.get("properties") or {})
    required = node.get("required")
    wanted = names + ([r for r in required if isinstance(r, str)] if isinstance(required, list) else [])
    for name in wanted:
        props.setdefault(name, True)
    return {**node, "properties": props, "additionalProperties": False}
