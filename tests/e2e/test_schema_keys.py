"""Schema-constrained output on the default model: objects hold only the keys their schema
lists (response_format, the native `json_schema` field, forced tool calls), and a forced
call cut by `max_tokens` comes back as a tool call under `finish_reason: "length"`.

The schemas leave `additionalProperties` out, as clients usually do: the object still closes
after its listed properties (engine/json_schema.py).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures import DEFAULT_MODEL

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ONLY_A = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}}}
ABC = [{"role": "user", "content": "Write a JSON object with the keys a, b and c, each a number."}]


def forced_call(client, max_tokens: int, **extra):
    # no prompt cache: each budget computes the same logits, so greedy writes the same call
    return client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=WEATHER, tool_choice="required",
                                          max_tokens=max_tokens, temperature=0, extra_body={"cache_prompt": False},
                                          **extra)


def squeeze(text: str) -> str:
    return "".join(text.split())


def test_required_tool_choice_gives_a_complete_call_in_64_tokens(openai_client):
    choice = forced_call(openai_client, 64).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert list(json.loads(call.function.arguments)) == ["city"]


def _cut_call(client, budget: int, stream: bool) -> tuple[list[str], str, str | None, str]:
    """(names, arguments, finish_reason, content) of the forced call under `budget` tokens."""
    if not stream:
        choice = forced_call(client, budget).choices[0]
        calls = choice.message.tool_calls or []
        return ([c.function.name for c in calls], "".join(c.function.arguments for c in calls), choice.finish_reason,
                choice.message.content or "")
    names, args, finish, content = [], "", None, ""
    for chunk in forced_call(client, budget, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                names += [tc.function.name] if tc.function.name else []
                args += tc.function.arguments or ""
    return names, args, finish, content


def test_call_cut_by_max_tokens_is_a_truncated_tool_call(openai_client):
    full = forced_call(openai_client, 64)
    complete = squeeze(full.choices[0].message.tool_calls[0].function.arguments)
    # the same greedy call under smaller budgets, down to one cut inside its arguments
    for budget in range(full.usage.completion_tokens - 1, 0, -1):
        names, args, finish, content = _cut_call(openai_client, budget, stream=False)
        assert finish == "length" and names == ["get_weather"] and content == "", (budget, names, args, content)
        assert complete.startswith(squeeze(args))
        if squeeze(args) != complete:
            break
    else:
        pytest.fail("no budget cut the call inside its arguments")
    assert _cut_call(openai_client, budget, stream=True) == (names, args, finish, content)


def test_response_format_object_holds_only_listed_keys(openai_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "only_a", "schema": ONLY_A}}
    choice = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=ABC, response_format=fmt,
                                                   temperature=0, max_tokens=40).choices[0]
    assert choice.finish_reason == "stop", choice
    assert set(json.loads(choice.message.content)) <= {"a"}


def test_native_json_schema_object_holds_only_listed_keys(default_server):
    r = httpx.post(default_server.base_url + "/completion", timeout=120, json={
        "prompt": 'A JSON object with the keys "a", "b" and "c": ', "json_schema": ONLY_A, "n_predict": 40,
        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop_type"] == "eos", body
    assert set(json.loads(body["content"])) <= {"a"}


@pytest.fixture(scope="module")
def cut_budget(openai_client) -> int:
    """A token budget that cuts the forced call inside its arguments, found on chat."""
    full = forced_call(openai_client, 64)
    for budget in range(full.usage.completion_tokens - 1, 0, -1):
        names, args, _, _ = _cut_call(openai_client, budget, stream=False)
        try:
            json.loads(args)
        except ValueError:
            assert names == ["get_weather"] and args.strip().startswith("{"), (budget, names, args)
            return budget
    pytest.fail("no budget cut the call inside its arguments")


def _sse_events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_return_a_cut_call_as_an_incomplete_function_call(default_server, cut_budget, stream):
    fn = WEATHER[0]["function"]
    r = httpx.post(default_server.base_url + "/v1/responses", timeout=120, json={
        "input": ASK, "tools": [{"type": "function", **fn}], "tool_choice": "required",
        "max_output_tokens": cut_budget, "temperature": 0, "stream": stream})
    assert r.status_code == 200, r.text
    resp = _sse_events(r)[-1]["response"] if stream else r.json()
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = resp["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "incomplete"
    assert item["arguments"].strip().startswith("{")
    if stream:
        kinds = [e["type"] for e in _sse_events(r)]
        assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.incomplete"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_return_a_cut_call_as_tool_use_under_max_tokens(default_server, cut_budget, stream):
    fn = WEATHER[0]["function"]
    r = httpx.post(default_server.base_url + "/v1/messages", timeout=120, json={
        "messages": ASK, "tools": [{"name": fn["name"], "description": fn["description"],
                                    "input_schema": fn["parameters"]}],
        "tool_choice": {"type": "any"}, "max_tokens": cut_budget, "temperature": 0, "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        assert body["stop_reason"] == "max_tokens"
        [block] = body["content"]
        assert block["type"] == "tool_use" and block["name"] == "get_weather"
        assert isinstance(block["input"], dict) and set(block["input"]) <= {"city"}  # as far as it got
        return
    events = _sse_events(r)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [(b["type"], b["name"]) for b in starts] == [("tool_use", "get_weather")]
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert partial.strip().startswith("{")
    [delta] = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "max_tokens"
