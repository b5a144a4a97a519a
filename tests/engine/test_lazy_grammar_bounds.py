"""Trigger patterns run on the engine thread after every token, so their cost is bounded: a
backtracking pattern answers at once, one that still runs past the per-token budget ends its
row with an error naming it, and the number of triggers is capped at parse time."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from mlxcel.api.errors import ApiError, engine_error
from mlxcel.api.llamacpp import native_grammar as ng
from mlxcel.config.limits import MAX_GRAMMAR_TRIGGERS, TRIGGER_MATCH_BUDGET_S
from mlxcel.engine.grammar import for_tokenizer
from mlxcel.engine.tokenizer import Tokenizer
from tests.conftest import fixture_path
from tests.fixtures import DEFAULT_MODEL

pytestmark = pytest.mark.timeout(60)

GRAMMAR = 'root ::= "<call>" [a-z]+ "</call>"'


@pytest.fixture(scope="module")
def model():
    tok = Tokenizer(fixture_path(DEFAULT_MODEL))
    return SimpleNamespace(tokenizer=tok, grammars=for_tokenizer(tok, tok.vocab_size))


def lazy(model, triggers):
    compiled = model.grammars.compile("gbnf", GRAMMAR)
    return ng.lazy({"grammar_lazy": True, "grammar_triggers": triggers}, model, compiled, frozenset())


def test_a_backtracking_pattern_does_not_stall_the_token_loop(model):
    tok = model.tokenizer
    m = lazy(model, [{"type": 2, "value": "(a|a)*c"}]).matcher()
    start = time.monotonic()
    for t in tok.encode("a" * 60, add_special_tokens=False):
        assert m.accept(t)
    assert m.awaiting and time.monotonic() - start < 2


def test_a_pattern_past_the_budget_ends_the_row_with_its_error(model):
    tok = model.tokenizer
    m = lazy(model, [{"type": 2, "value": "(.*){1,32000}[bc]"}]).matcher()
    ids = tok.encode("a" * 60, add_special_tokens=False)
    start = time.monotonic()
    ok = all(m.accept(t) for t in ids)
    assert not ok  # refused at the first token whose match ran past the budget
    assert time.monotonic() - start < 20 * TRIGGER_MATCH_BUDGET_S + 1
    assert not m.allowed_mask(tok.vocab_size).any()  # the engine ends the row with error()
    assert "took longer than" in m.error() and "(.*){1,32000}[bc]" in m.error()
    # the request's own pattern is at fault: a 400 on every surface, typed as the client's error
    err = engine_error(m.error(), m.error_code)
    assert (err.status, err.code, err.type) == (400, "trigger_pattern_too_slow", "invalid_request_error")


def test_the_number_of_triggers_is_capped(model):
    triggers = [{"type": 1, "value": f"<call{i}>"} for i in range(MAX_GRAMMAR_TRIGGERS + 1)]
    with pytest.raises(ApiError) as e:
        lazy(model, triggers)
    assert (e.value.status, e.value.param) == (400, "grammar_triggers")
    assert lazy(model, triggers[:MAX_GRAMMAR_TRIGGERS]).patterns
