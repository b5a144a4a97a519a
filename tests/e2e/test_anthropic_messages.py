"""/v1/messages and /v1/messages/count_tokens through the `anthropic` SDK, on qwen3-tiny.

Random weights never call a tool on their own, so tool use is driven through a continued
assistant prefix (Anthropic's prefill): the model's output after it must still parse, and
a call in the prefix is what the parse of the previous turn would have produced.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.conftest import module_server
from tests.fixtures import QWEN3_TINY

TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK = {"role": "user", "content": "Weather in Paris?"}
GREEDY = {"temperature": 0}  # this SDK version no longer takes temperature as an argument


server = module_server(QWEN3_TINY)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


def _streamed_events(server, body):
    """The SSE events of a streamed /v1/messages request, checked against Anthropic's order:
    message_start, then per block content_block_start / _delta... / _stop with its own index
    in order, then message_delta and message_stop; each frame's event name is its type."""
    r = httpx.post(server.base_url + "/v1/messages", timeout=120, json={**body, "stream": True})
    frames = [f for f in r.text.split("\n\n") if f.strip()]
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert [f.split("\n", 1)[0] for f in frames] == [f"event: {e['type']}" for e in events]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    blocks = kinds[1:-2]
    starts = [i for i, k in enumerate(blocks) if k == "content_block_start"]
    assert not blocks or starts[0] == 0, kinds
    for n, (a, b) in enumerate(zip(starts, starts[1:] + [len(blocks)])):
        assert blocks[a + 1:b - 1] == ["content_block_delta"] * (b - a - 2) and blocks[b - 1] == "content_block_stop"
        assert {events[1 + i]["index"] for i in range(a, b)} == {n}
    return events, r.text


def test_text_message_and_stream_agree(client, server):
    kw = dict(model=QWEN3_TINY, max_tokens=6, system="Be brief.", messages=[ASK], extra_body=GREEDY)
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 6
    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    assert final.stop_reason == msg.stop_reason
    events, _ = _streamed_events(server, {"model": QWEN3_TINY, "max_tokens": 6, "system": "Be brief.",
                                          "messages": [ASK], "temperature": 0})
    assert events[-2]["delta"]["stop_reason"] == msg.stop_reason and events[-2]["usage"]["output_tokens"] > 0


def test_count_tokens_matches_usage(client):
    counted = client.messages.count_tokens(model=QWEN3_TINY, messages=[ASK], system="Be brief.")
    msg = client.messages.create(model=QWEN3_TINY, max_tokens=1, system="Be brief.", messages=[ASK])
    assert counted.input_tokens == msg.usage.input_tokens
    with_tools = client.messages.count_tokens(model=QWEN3_TINY, messages=[ASK], tools=TOOLS)
    assert with_tools.input_tokens > client.messages.count_tokens(model=QWEN3_TINY, messages=[ASK]).input_tokens


def test_tool_use_round_trip(client):
    # the tool_use block of a previous turn plus its tool_result render and generate
    history = [ASK,
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Checking."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"}]}]
    msg = client.messages.create(model=QWEN3_TINY, max_tokens=3, tools=TOOLS, messages=history, extra_body=GREEDY)
    assert msg.stop_reason in ("max_tokens", "end_turn", "tool_use")
    counted = client.messages.count_tokens(model=QWEN3_TINY, messages=history, tools=TOOLS)
    assert counted.input_tokens == msg.usage.input_tokens


def test_stop_sequence_reports_the_matched_string(client, server):
    # find what greedy decoding writes, then stop on a piece of it
    probe = client.messages.create(model=QWEN3_TINY, max_tokens=8, messages=[ASK], extra_body=GREEDY)
    text = "".join(b.text for b in probe.content if b.type == "text")
    word = text[1:3]  # greedy random weights may write only whitespace; any two characters do
    assert len(word) == 2, text
    msg = client.messages.create(model=QWEN3_TINY, max_tokens=8, messages=[ASK], extra_body=GREEDY,
                                 stop_sequences=["\x00never", word])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word
    # streamed: the same reason and matched string in message_delta
    events, raw = _streamed_events(server, {"model": QWEN3_TINY, "max_tokens": 8, "messages": [ASK], "temperature": 0,
                                            "stop_sequences": ["\x00never", word]})
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": word}, raw
    streamed = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert streamed == "".join(b.text for b in msg.content if b.type == "text")


def test_bad_request_uses_anthropic_envelope(server):
    r = httpx.post(server.base_url + "/v1/messages", json={"messages": [ASK]})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


BOUNDED = [{"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_choice_always_uses_the_tool(client, choice):
    # random weights never call on their own: the grammar makes the call, streamed and not
    kw = dict(model=QWEN3_TINY, max_tokens=200, tools=BOUNDED, tool_choice=choice, messages=[ASK])
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" and isinstance(u.input.get("city"), str) for u in uses)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and any(b.type == "tool_use" for b in final.content)


def test_thinking_budget_tokens_is_enforced(client, server):
    # the prefill leaves a thinking block open; without a budget greedy random weights think on
    kw = dict(model=QWEN3_TINY, max_tokens=16, extra_body=GREEDY,
              messages=[ASK, {"role": "assistant", "content": "<think>\nThe user wants"}])
    free = client.messages.create(**kw)
    capped = client.messages.create(thinking={"type": "enabled", "budget_tokens": 3}, **kw)
    thought = [b.thinking for b in free.content if b.type == "thinking"]
    capped_thought = [b.thinking for b in capped.content if b.type == "thinking"]
    assert thought and capped_thought and len(capped_thought[0]) < len(thought[0])
    assert thought[0].startswith(capped_thought[0])
    # streamed: a thinking block first (thinking_delta), the same thoughts as the message
    events, _ = _streamed_events(server, {"model": QWEN3_TINY, "max_tokens": 16, "temperature": 0,
                                          "thinking": {"type": "enabled", "budget_tokens": 3},
                                          "messages": kw["messages"]})
    assert events[1]["type"] == "content_block_start" and events[1]["content_block"]["type"] == "thinking"
    assert "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "thinking_delta") == capped_thought[0]


def test_unused_fields_are_reported_or_refused_when_strict(server):
    body = {"model": QWEN3_TINY, "max_tokens": 1, "messages": [ASK], "service_tier": "auto"}
    r = httpx.post(server.base_url + "/v1/messages", timeout=120, json=body)
    assert r.status_code == 200 and r.headers["x-millm-ignored-fields"] == '"service_tier"'
    strict = httpx.post(server.base_url + "/v1/messages", json=body, headers={"X-miLLM-Strict": "1"})
    assert strict.status_code == 400 and strict.json()["type"] == "error"
    assert "service_tier" in strict.json()["error"]["message"]
