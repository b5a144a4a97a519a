"""Forced tool calls: the grammar of every family format only admits output the tool-call
parser reads as calls whose arguments validate against the tool's schema.

Each test walks the grammar with random choices among the tokens it allows (no model), on
qwen3-tiny's real Qwen vocabulary, so the walks cover the spellings a model could produce.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.openai import tool_grammar as tg
from mlxcel.chat.reasoning import split_reasoning
from mlxcel.chat.tool_calls import parse_tool_calls
from tests.conftest import fixture_path
from tests.fixtures import QWEN3_TINY

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def tok():
    from mlxcel.engine.tokenizer import Tokenizer

    return Tokenizer(fixture_path(QWEN3_TINY))


@pytest.fixture(scope="module")
def compiler(tok):
    from mlxcel.engine.grammar import for_tokenizer

    return for_tokenizer(tok, tok.vocab_size)


def walk(compiler, tok, text: str, rng: random.Random, limit: int = 2000) -> str:
    """Random tokens among the allowed ones until the grammar ends; the decoded text."""
    m = compiler.compile("lark", text).matcher()
    ids: list[int] = []
    eos = tok.eos_token_ids
    for _ in range(limit):
        allowed = np.flatnonzero(m.allowed_mask(tok.vocab_size))
        assert allowed.size, m.error()
        choices = [int(t) for t in allowed if int(t) not in eos]
        if not choices or (len(choices) < allowed.size and rng.random() < 0.5):  # the output may end here
            break
        t = rng.choice(choices)
        assert m.accept(t)
        ids.append(t)
        if m.is_terminated():
            break
    else:
        pytest.fail("the walk did not end")
    return tok.decode(ids, skip_special_tokens=False)


def encode(tok):
    return lambda s: tok.hf.encode(s, add_special_tokens=False)


def check_calls(text: str, name: str | None, single: bool) -> None:
    content, calls = parse_tool_calls(text)
    assert calls and content == "", text
    if single:
        assert len(calls) == 1
    for c in calls:
        assert name is None or c.name == name
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


@pytest.mark.parametrize("fmt", tg.FORMATS)
def test_required_walks_always_parse_and_validate(compiler, tok, fmt):
    rng = random.Random(7)
    for parallel in (False, True):
        text = tg.lark(tg.ToolChoice(tuple(TOOLS), None, parallel), fmt, encode(tok), thinking_open=False)
        for _ in range(10):
            check_calls(walk(compiler, tok, text, rng), None, single=not parallel or fmt == "llama")


@pytest.mark.parametrize("fmt", tg.FORMATS)
def test_named_function_is_the_only_call(compiler, tok, fmt):
    rng = random.Random(3)
    text = tg.lark(tg.parse_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS, True), fmt,
                   encode(tok), thinking_open=False)
    for _ in range(5):
        check_calls(walk(compiler, tok, text, rng), "get_time", single=True)


def test_hermes_markers_are_the_vocabulary_tokens(tok):
    text = tg.lark(tg.ToolChoice(tuple(TOOLS), None, False), "hermes", encode(tok), thinking_open=False)
    assert f"<[{tok.hf.convert_tokens_to_ids('<tool_call>')}]>" in text


def test_an_open_thought_is_closed_before_the_call(compiler, tok):
    rng = random.Random(5)
    text = tg.lark(tg.ToolChoice(tuple(TOOLS), None, False), "hermes", encode(tok), thinking_open=True)
    m = compiler.compile("lark", text).matcher()
    for t in tok.hf.encode("some thought", add_special_tokens=False):  # a thought, then the model goes on
        assert m.accept(t)
    close = tok.hf.convert_tokens_to_ids("</think>")
    assert m.allowed_mask(tok.vocab_size)[close]
    assert m.accept(close)
    rest = []
    while not m.is_terminated():
        allowed = [int(t) for t in np.flatnonzero(m.allowed_mask(tok.vocab_size)) if int(t) not in tok.eos_token_ids]
        rest.append(rng.choice(allowed))
        assert m.accept(rest[-1])
    split = split_reasoning("some thought</think>" + tok.decode(rest, skip_special_tokens=False), "deepseek",
                            primed_open=True)
    assert split.reasoning == "some thought"
    check_calls(split.content, None, single=True)


def test_an_open_command_r7b_thought_is_closed_by_its_own_marker(compiler, tok):
    """Command R7B's close marker, here not one token of the vocabulary: the thought runs
    until that text."""
    from mlxcel.chat.reasoning import COMMAND_R7B

    rng = random.Random(5)
    text = tg.lark(tg.ToolChoice(tuple(TOOLS), None, False), "hermes", encode(tok), thinking_open=True,
                   think_close=COMMAND_R7B.close)
    m = compiler.compile("lark", text).matcher()
    for t in tok.hf.encode("a thought" + COMMAND_R7B.close, add_special_tokens=False):
        assert m.accept(t)
    rest = []
    while not m.is_terminated():
        allowed = [int(t) for t in np.flatnonzero(m.allowed_mask(tok.vocab_size)) if int(t) not in tok.eos_token_ids]
        rest.append(rng.choice(allowed))
        assert m.accept(rest[-1])
    split = split_reasoning("a thought" + COMMAND_R7B.close + tok.decode(rest, skip_special_tokens=False),
                            "deepseek", primed_open=True, markers=COMMAND_R7B)
    assert split.reasoning == "a thought"
    check_calls(split.content, None, single=True)


def test_family_format_from_the_template():
    assert tg.family_format("{{ '<tool_call>' }}") == "hermes"
    assert tg.family_format("[TOOL_CALLS]") == "mistral"
    assert tg.family_format("<|start_header_id|>ipython") == "llama"
    assert tg.family_format(None) == "json"


def test_bad_choices_are_refused():
    with pytest.raises(ApiError) as e:
        tg.parse_choice({"type": "function", "function": {"name": "nope"}}, TOOLS, True)
    assert e.value.param == "tool_choice" and "nope" in e.value.message
    with pytest.raises(ApiError):
        tg.parse_choice("sometimes", TOOLS, True)
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "format": "email"}}}]
    with pytest.raises(ApiError) as e:
        tg.lark(tg.ToolChoice(tuple(bad), None, False), "json", lambda s: [1, 2], False)
    assert e.value.code == "field_not_honoured" and "format" in e.value.message
