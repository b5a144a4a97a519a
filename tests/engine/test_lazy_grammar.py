"""Lazy grammars (engine/lazy_grammar.py) and their native fields (api/llamacpp/native_grammar.py)
over SmolLM2's real tokenizer and llguidance: nothing is masked until a trigger fires, then
the grammar holds from where the trigger starts; b10621's refusals for bad triggers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp import native_grammar as ng
from mlxcel.engine.grammar import for_tokenizer
from mlxcel.engine.tokenizer import Tokenizer
from tests.conftest import fixture_path
from tests.fixtures import DEFAULT_MODEL

GRAMMAR = 'root ::= "<call>" [a-z]+ "</call>"'


@pytest.fixture(scope="module")
def model():
    tok = Tokenizer(fixture_path(DEFAULT_MODEL))
    return SimpleNamespace(tokenizer=tok, grammars=for_tokenizer(tok, tok.vocab_size))


def lazy(model, triggers, preserved=(), grammar=GRAMMAR):
    pre = ng.preserved_tokens({"preserved_tokens": list(preserved)}, model)
    compiled = model.grammars.compile("gbnf", grammar)
    return ng.lazy({"grammar_lazy": True, "grammar_triggers": triggers}, model, compiled, pre)


def feed(matcher, tokenizer, text):
    for t in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept(t), text


@pytest.mark.parametrize("trigger", [
    {"type": 1, "value": "<call>"},  # a word (several tokens)
    {"type": 2, "value": r"<c[a-z]+>"},  # a pattern anywhere
    {"type": 3, "value": r"[\s\S]*?(<call>)[\s\S]*"},  # the whole buffer; fed from group 1
])
def test_free_until_the_trigger_then_constrained(model, trigger):
    tok = model.tokenizer
    m = lazy(model, [trigger]).matcher()
    feed(m, tok, "Sure, I will call it: ")
    assert m.awaiting and m.allowed_mask(tok.vocab_size) is None and m.is_accepting()
    feed(m, tok, "<call>ab")
    assert not m.awaiting
    mask = m.allowed_mask(tok.vocab_size)
    assert mask[tok.encode("c", add_special_tokens=False)[0]] and not mask[tok.encode(" Hello", add_special_tokens=False)[0]]
    feed(m, tok, "c</call>")
    assert m.is_terminated()


def test_a_match_inside_a_token_is_retokenized(model):
    tok = model.tokenizer
    m = lazy(model, [{"type": 1, "value": "<call>"}]).matcher()
    # "x<call>" may end a token mid-trigger; whatever the split, the grammar sees "<call>..."
    feed(m, tok, "x<call>zz</call>")
    assert m.is_terminated()


def test_token_trigger_and_one_token_word_needs_preserving(model):
    tok = model.tokenizer
    im_start = tok.encode("<|im_start|>", add_special_tokens=False)
    assert len(im_start) == 1
    grammar = 'root ::= <|im_start|> "done"'
    m = lazy(model, [{"type": 0, "value": "<|im_start|>", "token": im_start[0]}], grammar=grammar).matcher()
    feed(m, tok, "hello ")
    assert m.awaiting
    assert m.accept(im_start[0]) and not m.awaiting
    feed(m, tok, "done")
    assert m.is_terminated()
    with pytest.raises(ApiError) as e:  # a one-token word must be preserved, as b10621 says
        lazy(model, [{"type": 1, "value": "<|im_start|>"}], grammar=grammar)
    assert e.value.message == "Grammar trigger word should be marked as preserved token: <|im_start|>"
    g = lazy(model, [{"type": 1, "value": "<|im_start|>"}], preserved=["<|im_start|>"], grammar=grammar)
    assert g.trigger_tokens == frozenset(im_start) and g.reported[0]["type"] == 0


@pytest.mark.parametrize("body,needle", [
    ({"grammar_lazy": True}, "no triggers set for lazy grammar"),
    ({"grammar_lazy": True, "grammar_triggers": []}, "no triggers set for lazy grammar"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "(unclosed"}]}, "does not compile"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 7, "value": "x"}]}, "unknown trigger type 7"),
    ({"grammar_lazy": True, "grammar_triggers": ["<call>"]}, "each trigger is an object"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 0, "value": "x"}]}, "needs \"token\""),
    ({"grammar_lazy": "yes", "grammar_triggers": [{"type": 1, "value": "ab"}]}, "must be a boolean"),
])
def test_refusals(model, body, needle):
    compiled = model.grammars.compile("gbnf", GRAMMAR)
    with pytest.raises(ApiError) as e:
        ng.lazy(body, model, compiled, frozenset())
    assert e.value.status == 400 and needle in e.value.message


def test_not_lazy_keeps_the_grammar_and_preserved_tokens_resolve(model):
    compiled = model.grammars.compile("gbnf", GRAMMAR)
    assert ng.lazy({"grammar_triggers": [{"type": 1, "value": "<call>"}]}, model, compiled, frozenset()) is compiled
    pre = ng.preserved_tokens({"preserved_tokens": ["<|im_start|>", "two words"]}, model)
    assert pre == frozenset(model.tokenizer.encode("<|im_start|>", add_special_tokens=False))
    tok = model.tokenizer
    ids = tok.encode("a<|im_start|>b", add_special_tokens=False)
    assert tok.decode(ids) == "ab" and tok.decoder(pre)(ids) == "a<|im_start|>b"
    with pytest.raises(ApiError):
        ng.preserved_tokens({"preserved_tokens": "x"}, model)
