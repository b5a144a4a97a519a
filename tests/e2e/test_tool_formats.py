"""A tool round trip on every tool-call format, through the `openai` SDK, streamed and not.

Each format has a fixture whose tokenizer carries the family's markers as special tokens
and whose chat template renders tools, assistant calls and tool results (qwen3-tiny for
Hermes; scripts/fixtures/build_tool_formats.py for Llama 3.x, Mistral and plain JSON).
The weights are random, so the call is handed to the model as in test_chat_surface: a
trailing assistant message the model continues, parsed as output under `echo: true`. One
greedy token follows the call, so the parser also meets text after a call; that token is
the content, whatever it is (a random model may well write a stray close tag). A forced
`tool_choice: required` run shows the grammar spells each family's call so it parses.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from mlxcel.engine.tokenizer import Tokenizer
from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import JSON_TOOLS_TINY, LLAMA3_TOOLS_TINY, MISTRAL_TOOLS_TINY, QWEN3_TINY

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": PARAMS}}]
ASK = {"role": "user", "content": "Weather in Paris?"}
RESULT = '{"temp_c": 21}'

# (case, fixture, the call as the family writes it, its special-token markers)
CASES = [
    ("hermes", QWEN3_TINY, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     ["<tool_call>", "</tool_call>"]),
    ("llama-json", LLAMA3_TOOLS_TINY, '{"name": "get_weather", "parameters": {"city": "Paris"}}', []),
    ("llama-python-tag", LLAMA3_TOOLS_TINY, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     ["<|python_tag|>"]),
    ("mistral", MISTRAL_TOOLS_TINY, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     ["[TOOL_CALLS]"]),
    ("mistral-args", MISTRAL_TOOLS_TINY, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', ["[TOOL_CALLS]", "[ARGS]"]),
    ("generic-json", JSON_TOOLS_TINY, '{"name": "get_weather", "arguments": {"city": "Paris"}}', []),
]
# every marker any family writes: none may reach a client as content
LEAKS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "<|eom_id|>", "[TOOL_CALLS]", "[ARGS]")
# the family's rendering of a tool result
RESULT_TURN = {QWEN3_TINY: "<tool_response>", LLAMA3_TOOLS_TINY: "<|start_header_id|>ipython<|end_header_id|>",
               MISTRAL_TOOLS_TINY: "[TOOL_RESULTS]", JSON_TOOLS_TINY: "Result of "}


class Servers:
    """One server per fixture model, started on first use and kept for the module."""

    def __init__(self) -> None:
        self.running: dict[str, ServerProcess] = {}

    def get(self, ref: str) -> ServerProcess:
        if ref not in self.running:
            fixture_path(ref)
            self.running[ref] = ServerProcess(["-m", ref, "--offline"])
        return self.running[ref]

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()


@pytest.fixture(scope="module")
def servers():
    s = Servers()
    yield s
    s.stop()


def _client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("case,ref,call,markers", CASES, ids=[c[0] for c in CASES])
def test_tool_round_trip_streamed_and_not(servers, case, ref, call, markers):
    server = servers.get(ref)
    client = _client(server)
    # the markers are single special tokens of the vocabulary, as the model would write them
    if ref != QWEN3_TINY:  # Qwen's <tool_call> is an added token the checkpoint does not flag special
        tok = Tokenizer(fixture_path(ref))
        assert all(tok.single_special(m) is not None for m in markers), markers
    for m in markers:
        one = httpx.post(server.base_url + "/tokenize", json={"content": m}).json()["tokens"]
        assert len(one) == 1 and one[0] in httpx.post(server.base_url + "/tokenize",
                                                      json={"content": call}).json()["tokens"], m
    kw = dict(model=ref, messages=[ASK, {"role": "assistant", "content": call}], tools=TOOLS, max_tokens=1,
              temperature=0, extra_body={"echo": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    msg = full.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})], msg
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    # content is the model's own token after the call (the same request without tools shows
    # it), never the call's text or markers
    raw = client.chat.completions.create(**{k: v for k, v in kw.items() if k != "tools"}).choices[0].message.content
    assert raw.startswith(call)
    assert (msg.content or "").strip() == raw[len(call):].strip()
    # streamed: a header delta with id and name, then the arguments; one index, one id
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == ""
    assert {tc.index for tc in calls} == {0} and {tc.id for tc in calls if tc.id} == {calls[0].id}
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris"}
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (msg.content or "")
    assert full.choices[0].finish_reason == chunks[-1].choices[0].finish_reason
    # the result goes back under its tool_call_id; the template renders call and result
    history = [ASK, {"role": "assistant", "content": None, "tool_calls": [msg.tool_calls[0].model_dump()]},
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": RESULT}]
    applied = httpx.post(server.base_url + "/apply-template", json={"messages": history, "tools": TOOLS})
    prompt = applied.json()["prompt"]
    assert RESULT_TURN[ref] in prompt and '"city": "Paris"' in prompt and "temp_c" in prompt
    if ref in (MISTRAL_TOOLS_TINY, JSON_TOOLS_TINY):  # these templates write the id back
        assert msg.tool_calls[0].id in prompt
    final = client.chat.completions.create(model=ref, messages=history, tools=TOOLS, max_tokens=2, temperature=0)
    assert final.choices[0].message.role == "assistant"
    assert final.usage.prompt_tokens == len(httpx.post(server.base_url + "/tokenize",
                                                       json={"content": prompt}).json()["tokens"])


FORCED = [LLAMA3_TOOLS_TINY, MISTRAL_TOOLS_TINY, JSON_TOOLS_TINY]


@pytest.mark.parametrize("ref", FORCED, ids=["llama", "mistral", "generic-json"])
def test_required_tool_choice_parses_in_each_format(servers, ref):
    client = _client(servers.get(ref))
    r = client.chat.completions.create(model=ref, messages=[ASK], tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not any(m in (choice.message.content or "") for m in LEAKS)
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), PARAMS)


@pytest.mark.parametrize("ref,marker,end", [(LLAMA3_TOOLS_TINY, "<|python_tag|>", "<|eom_id|>"),
                                            (MISTRAL_TOOLS_TINY, "[TOOL_CALLS]", "</s>")])
def test_kept_marker_reaches_the_parser_and_other_specials_do_not(ref, marker, end):
    # what the engine decodes a generated call with when the request carries tools
    tok = Tokenizer(fixture_path(ref))
    ids = tok.encode(marker + '{"a": 1}' + end, add_special_tokens=False)
    assert tok.decoder(frozenset({tok.single_special(marker)}))(ids) == marker + '{"a": 1}'
    assert tok.decoder()(ids) == '{"a": 1}'
