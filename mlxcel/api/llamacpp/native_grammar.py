"""The native `grammar` / `json_schema` fields: which constraint a request runs under.

Precedence is b10621's code, not its field description: the schema branch is taken only
when `json_schema` is present and `grammar` is absent (a `grammar` key, even null or "",
blocks it). Otherwise a non-empty string `grammar` is the request's GBNF grammar, and
anything else (absent, "", not a string) leaves the server default (--grammar /
--json-schema) in place. Grammars are compiled off the event loop and cached per source;
an unparsable one is refused with a 400 before anything is queued.

`grammar_lazy` / `grammar_triggers` wrap the grammar so it waits for a trigger
(engine/lazy_grammar.py), and `preserved_tokens` names special tokens written into the text;
both are validated with b10621's refusals. `grammar_type` is inert (native_params.py says why).
"""

from __future__ import annotations

import asyncio
from typing import Any

import regex as rx

from mlxcel.api.errors import ApiError
from mlxcel.config.limits import MAX_GRAMMAR_TRIGGERS, echo
from mlxcel.engine.grammar import GrammarError
from mlxcel.engine.lazy_grammar import LazyGrammar, PATTERN, PATTERN_FULL, TOKEN, WORD
from mlxcel.runtime.served import ServedModel


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


def preserved_tokens(body: dict[str, Any], model: ServedModel) -> frozenset[int]:
    """b10621's `preserved_tokens`: each string that is one token (special spellings
    parsed) names a special token written into the text; longer strings are skipped, as
    upstream skips them."""
    value = body.get("preserved_tokens")
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ApiError(400, "'preserved_tokens' must be an array of strings", code="invalid_request",
                       param="preserved_tokens")
    out = set()
    for text in value:
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            out.add(ids[0])
    return frozenset(out)


def _trigger(t: Any, model: ServedModel, preserved: frozenset[int]) -> tuple[str, Any, dict]:
    """One `grammar_triggers` entry -> ("token", id, report) or ("pattern", (regex, full), report)."""
    def bad(why: str) -> ApiError:
        return ApiError(400, f"grammar_triggers: {why}", code="invalid_request", param="grammar_triggers")

    if not isinstance(t, dict) or isinstance(t.get("type"), bool) or not isinstance(t.get("type"), int) \
            or not isinstance(t.get("value"), str):
        raise bad('each trigger is an object {"type": 0-3, "value": string} (type 0 also needs "token")')
    kind, value = t["type"], t["value"]
    if kind == TOKEN:
        token = t.get("token")
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < model.tokenizer.vocab_size:
            raise bad(f"a token trigger needs \"token\", an id in the vocabulary (got {echo(token)})")
        return "token", token, {"type": TOKEN, "value": value, "token": token}
    if kind == WORD:
        ids = model.tokenizer.encode(value, add_special_tokens=False)
        if len(ids) == 1:  # a one-token word is a token trigger, and must be preserved
            if ids[0] not in preserved:
                raise ApiError(400, f"Grammar trigger word should be marked as preserved token: {echo(value)}",
                               code="invalid_request", param="grammar_triggers")
            return "token", ids[0], {"type": TOKEN, "value": value, "token": ids[0]}
        return "pattern", (rx.compile(rx.escape(value)), False), {"type": WORD, "value": value}
    if kind in (PATTERN, PATTERN_FULL):
        full = kind == PATTERN_FULL  # matched against the whole buffer (upstream anchors it with ^...$)
        try:
            regex = rx.compile(value)
        except rx.error as e:
            raise bad(f"the pattern {echo(value)!r} does not compile: {echo(str(e))}") from None
        return "pattern", (regex, full), {"type": kind, "value": value}
    raise bad(f"unknown trigger type {kind} (0 token, 1 word, 2 pattern, 3 pattern_full)")


def lazy(body: dict[str, Any], model: ServedModel, grammar: Any, preserved: frozenset[int]) -> Any:
    """Wrap the request's grammar when `grammar_lazy` is true (engine/lazy_grammar.py).
    Triggers are validated either way; as upstream, they act only on a lazy grammar, and a
    lazy flag with no grammar constrains nothing."""
    flag = body.get("grammar_lazy")
    if flag is not None and not isinstance(flag, bool):
        raise ApiError(400, "'grammar_lazy' must be a boolean", code="invalid_request", param="grammar_lazy")
    raw = body.get("grammar_triggers")
    if raw is not None and not isinstance(raw, list):
        raise ApiError(400, "'grammar_triggers' must be an array", code="invalid_request", param="grammar_triggers")
    if len(raw or []) > MAX_GRAMMAR_TRIGGERS:
        raise ApiError(400, f"'grammar_triggers' holds {len(raw)} triggers; at most {MAX_GRAMMAR_TRIGGERS} are "
                       "accepted", code="invalid_request", param="grammar_triggers")
    triggers = [_trigger(t, model, preserved) for t in raw or []]
    if not flag:
        return grammar
    if not triggers:
        raise ApiError(400, "Error: no triggers set for lazy grammar!", code="invalid_request", param="grammar_lazy")
    if grammar is None:
        return None
    return LazyGrammar(grammar, frozenset(v for k, v, _ in triggers if k == "token"),
                       tuple(v for k, v, _ in triggers if k == "pattern"), model.tokenizer,
                       tuple(r for _, _, r in triggers))
