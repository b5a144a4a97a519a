"""The native `grammar` / `json_schema` fields: which constraint a request runs under.

Precedence is b10621's code, not its field description: the schema branch is taken only
when `json_schema` is present and `grammar` is absent (a `grammar` key, even null or "",
blocks it). Otherwise a non-empty string `grammar` is the request's GBNF grammar, and
anything else (absent, "", not a string) leaves the server default (--grammar /
--json-schema) in place. Grammars are compiled off the event loop and cached per source;
an unparsable one is refused with a 400 before anything is queued.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mlxcel.api.errors import ApiError
from mlxcel.api.state import ServedModel
from mlxcel.engine.grammar import GrammarError


def requested(body: dict[str, Any]) -> tuple[str, Any] | None:
    """(kind, source) the request names, or None to keep the server default."""
    if body.get("json_schema") is not None and "grammar" not in body:
        return "json_schema", body["json_schema"]
    grammar = body.get("grammar")
    if isinstance(grammar, str) and grammar:
        return "gbnf", grammar
    return None


async def resolve(body: dict[str, Any], model: ServedModel) -> Any:
    """The CompiledGrammar this request runs under (None: unconstrained)."""
    choice = requested(body)
    if choice is None:
        if model.default_grammar_error is not None:
            raise ApiError(400, f"Failed to initialize samplers: failed to parse grammar: {model.default_grammar_error}",
                           code="invalid_request", param="grammar")
        return model.default_grammar
    kind, source = choice
    if kind == "json_schema" and not isinstance(source, (dict, bool)):
        raise ApiError(400, '"json_schema": the schema must be a JSON object', code="invalid_parameter",
                       param="json_schema")
    if source is False:
        raise ApiError(400, '"json_schema": the schema false accepts no document', code="invalid_parameter",
                       param="json_schema")
    if source is True:
        source = {}
    try:
        return await asyncio.to_thread(model.grammars.compile, kind, source)
    except GrammarError as e:
        if kind == "json_schema":
            raise ApiError(400, f'"json_schema": {e}', code="invalid_parameter", param="json_schema") from None
        raise ApiError(400, f"Failed to initialize samplers: failed to parse grammar: {e}",
                       code="invalid_request", param="grammar") from None
