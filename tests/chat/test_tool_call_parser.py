"""The tool-call parser on outputs recorded from real checkpoints, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from mlxcel.chat.tool_calls import ToolCallStream, parse_tool_calls

# (label, generated text, expected content, expected [(name, args)])
RECORDED = [
    ("qwen2.5-7b hermes one call",
     '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n'
     "</tool_call>",
     "", [("get_current_weather", {"location": "Paris, France", "unit": "celsius"})]),
    ("qwen3-8b hermes parallel calls after text",
     "I'll check both cities.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tokyo\"}}\n"
     "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Berlin\"}}\n</tool_call>",
     "I'll check both cities.", [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Berlin"})]),
    ("hermes unclosed at EOS",
     '<tool_call>\n{"name": "search", "arguments": {"q": "mlx"}}',
     "", [("search", {"q": "mlx"})]),
    ("llama-3.1-8b bare json",
     '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
     "", [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ("llama-3.2-3b python_tag",
     '<|python_tag|>{"type": "function", "name": "calc", "parameters": {"expr": "2+2"}}',
     "", [("calc", {"expr": "2+2"})]),
    ("llama-3.3 python_tag two calls",
     '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
     "", [("a", {}), ("b", {"x": 1})]),
    ("mistral-7b-v0.3",
     '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
     "", [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    ("mistral-small-2501 name[ARGS]",
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
     "", [("get_weather", {"city": "Rome"})]),
    # Command R7B's action block, as its chat template writes earlier calls back (not recorded)
    ("command-r7b action block after text",
     'Checking.<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Oslo"}},\n'
     '    {"tool_call_id": "1", "tool_name": "get_time", "parameters": {}}\n]<|END_ACTION|>',
     "Checking.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("command-r7b broken action stays content", "<|START_ACTION|>[oops]<|END_ACTION|>",
     "<|START_ACTION|>[oops]<|END_ACTION|>", []),
    ("generic fenced json",
     '```json\n{"name": "lookup", "arguments": "{\\"id\\": 7}"}\n```',
     "", [("lookup", {"id": 7})]),
    ("generic tool_calls wrapper",
     '{"tool_calls": [{"name": "x", "arguments": {"a": [1, 2]}}]}',
     "", [("x", {"a": [1, 2]})]),
    ("plain answer", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("json answer that is not a call", '{"answer": 42}', '{"answer": 42}', []),
    ("broken hermes stays content", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("text mentioning a tag-like prefix", "Use <tool to go\n", "Use <tool to go\n", []),
    # a call the model wrote on after (a length stop before its end token): the call, then content
    ("python_tag call then text", '<|python_tag|>{"name": "a", "parameters": {"x": 1}} so', " so", [("a", {"x": 1})]),
    ("mistral array then text", '[TOOL_CALLS][{"name": "a", "arguments": {}}]ok', "ok", [("a", {})]),
    ("mistral [ARGS] then text", '[TOOL_CALLS]a[ARGS]{"x": 2} hm', " hm", [("a", {"x": 2})]),
    ("bare json call then text", '{"name": "a", "arguments": {"x": 3}}\nDone', "\nDone", [("a", {"x": 3})]),
    ("json answer that only names something, then text", '{"name": "Bob"} is it', '{"name": "Bob"} is it', []),
    ("mistral text between calls stays content", '[TOOL_CALLS][{"name": "a", "arguments": {}}] x [TOOL_CALLS][]',
     '[TOOL_CALLS][{"name": "a", "arguments": {}}] x [TOOL_CALLS][]', []),
]


@pytest.mark.parametrize("label,text,content,calls", RECORDED, ids=[r[0] for r in RECORDED])
def test_parse_recorded_outputs(label, text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("label,text,content,calls", RECORDED, ids=[r[0] for r in RECORDED])
def test_streaming_in_random_chunks_equals_one_shot(label, text, content, calls):
    rng = random.Random(label)
    for _ in range(20):
        s = ToolCallStream()
        pieces, i = [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            pieces += s.feed(text[i:j])
            i = j
        pieces += s.finish()
        assert "".join(p.content for p in pieces) == content
        assert [(p.call.name, json.loads(p.call.arguments)) for p in pieces if p.call] == calls
        assert [p.index for p in pieces if p.call] == list(range(len(calls)))


def test_hermes_call_released_before_the_generation_ends():
    s = ToolCallStream()
    out = s.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_')
    assert [p.call.name for p in out if p.call] == ["f"]


def test_content_streams_before_any_marker():
    s = ToolCallStream()
    assert "".join(p.content for p in s.feed("Hello there, ")) == "Hello there,"


# (label, text cut by a length stop, expected content, expected [(name, arguments text, truncated)])
CUT = [
    ("json cut in the arguments", '{"name": "get_weather", "arguments": {"city": "Pa',
     "", [("get_weather", '{"city": "Pa', True)]),
    ("json cut before the arguments' value", '{\n    "name": "get_weather",\n    "arguments": ',
     "", [("get_weather", "", True)]),
    ("json array: one call done, the next cut", '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q',
     "", [("a", "{}", False), ("b", '{"q', True)]),
    ("json array cut after its last call", '[{"name": "a", "arguments": {"x": 1}}\n',
     "", [("a", '{"x": 1}', False)]),
    ("hermes: second call cut", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {"y', "", [("a", '{"x": 1}', False), ("b", '{"y', True)]),
    ("hermes after text", 'Checking. <tool_call>{"name": "c", "arguments": {"z": [1, ', "Checking.",
     [("c", '{"z": [1,', True)]),
    ("llama python_tag", '<|python_tag|>{"name": "f", "parameters": {"k": tr', "", [("f", '{"k": tr', True)]),
    ("mistral array", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q',
     "", [("a", "{}", False), ("b", '{"q', True)]),
    ("mistral name[ARGS]", '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"z', "", [("a", "{}", False), ("b", '{"z', True)]),
    # no complete name: nothing to call, so the text stays content
    ("json cut in the name", '{"name": "get_w', '{"name": "get_w', []),
    ("hermes cut in the name", '<tool_call>\n{"name": "ge', '<tool_call>\n{"name": "ge', []),
    ("plain answer", "The weather in Paris is", "The weather in Paris is", []),
]


@pytest.mark.parametrize("label,text,content,calls", CUT, ids=[c[0] for c in CUT])
def test_call_cut_by_length_is_a_truncated_call(label, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, truncated=True)
    assert got_content == content
    assert [(c.name, c.arguments, c.truncated) for c in got_calls] == calls
    rng = random.Random(label)  # streamed in random chunks: the same answer
    s = ToolCallStream()
    pieces, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        pieces += s.feed(text[i:j])
        i = j
    pieces += s.finish(truncated=True)
    assert "".join(p.content for p in pieces) == content
    assert [(p.call.name, p.call.arguments, p.call.truncated) for p in pieces if p.call] == calls


@pytest.mark.parametrize("label,text,content,calls", CUT[:-3], ids=[c[0] for c in CUT[:-3]])
def test_an_unfinished_call_that_ended_itself_stays_unparsed(label, text, content, calls):
    # an end token inside a call is not a cut: no call is made up from a broken one
    got_content, got_calls = parse_tool_calls(text)
    assert all(not c.truncated for c in got_calls)
    assert len(got_calls) < len(calls) or got_content
