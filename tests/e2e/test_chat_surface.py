"""Tool calls and reasoning on /v1/chat/completions, through the `openai` SDK, on qwen3-tiny.

qwen3-tiny has random weights, so the model never writes a call or a thinking block of its
own accord. The tests hand it one through the continued-prefill path: a trailing assistant
message is a prefix the model continues, and `echo: true` parses that prefix as output, so
the same parser that reads a real model's call reads this one. Greedy decoding keeps the
streamed and non-streamed runs on the same tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import QWEN3_TINY

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = {"role": "user", "content": "Weather in Paris?"}


@pytest.fixture(scope="module")
def server():
    fixture_path(QWEN3_TINY)
    s = ServerProcess(["-m", QWEN3_TINY, "--offline", "--chat-template-kwargs", '{"enable_thinking": true}'])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _both(client, **kw):
    full = client.chat.completions.create(model=QWEN3_TINY, temperature=0, **kw)
    chunks = list(client.chat.completions.create(model=QWEN3_TINY, temperature=0, stream=True, **kw))
    return full, chunks


# the tool round trip itself, on every format, is tests/e2e/test_tool_formats.py


def test_tools_change_the_prompt_and_none_removes_them(client):
    base = client.chat.completions.create(model=QWEN3_TINY, messages=[ASK], max_tokens=1)
    with_tools = client.chat.completions.create(model=QWEN3_TINY, messages=[ASK], tools=TOOLS, max_tokens=1)
    none = client.chat.completions.create(model=QWEN3_TINY, messages=[ASK], tools=TOOLS, tool_choice="none",
                                          max_tokens=1)
    assert with_tools.usage.prompt_tokens > base.usage.prompt_tokens == none.usage.prompt_tokens


BOUNDED = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": BOUNDED}},
                {"type": "function", "function": {"name": "get_time", "parameters": {
                    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
                    "additionalProperties": False}}}]


def _valid(name, arguments):
    schema = next(t["function"]["parameters"] for t in FORCED_TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


def test_required_tool_choice_always_produces_valid_calls(client):
    # 50 sampled runs of a random-weight model: 25 choices of one request, 25 streamed requests
    kw = dict(model=QWEN3_TINY, messages=[ASK], tools=FORCED_TOOLS, tool_choice="required", max_tokens=300,
              temperature=1.0)
    full = client.chat.completions.create(n=25, seed=11, **kw)
    for choice in full.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            _valid(call.function.name, call.function.arguments)
    for seed in range(25):
        chunks = list(client.chat.completions.create(stream=True, seed=seed, **kw))
        calls = {}
        for c in chunks:
            for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                slot = calls.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                slot["arguments"] += tc.function.arguments or ""
        assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        for call in calls.values():
            _valid(call["name"], call["arguments"])


def test_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(model=QWEN3_TINY, messages=[ASK], tools=FORCED_TOOLS, max_tokens=300,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    _valid("get_time", calls[0].function.arguments)


def test_forced_tool_choice_refusals(server):
    url = server.base_url + "/v1/chat/completions"
    unknown = httpx.post(url, json={"messages": [ASK], "tools": TOOLS, "max_tokens": 1,
                                    "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tool_choice"
    no_tools = httpx.post(url, json={"messages": [ASK], "tool_choice": "required", "max_tokens": 1})
    assert no_tools.status_code == 400 and no_tools.json()["error"]["param"] == "tool_choice"
    both = httpx.post(url, json={"messages": [ASK], "tools": TOOLS, "tool_choice": "required", "max_tokens": 1,
                                 "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("fmt", ["none", "deepseek", "deepseek-legacy", "auto"])
def test_reasoning_streamed_equals_non_streamed(client, fmt):
    # the prefix leaves a thinking block open, so the greedy continuation is all thought
    kw = dict(messages=[ASK, {"role": "assistant", "content": "<think>\nThe user wants"}], max_tokens=8,
              extra_body={"reasoning_format": fmt})
    full, chunks = _both(client, **kw)
    msg = full.choices[0].message
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert content == (msg.content or "")
    assert reasoning == (getattr(msg, "reasoning_content", None) or "")
    # --reasoning-alias-field defaults to reasoning: the same text under both names
    assert getattr(msg, "reasoning", None) == getattr(msg, "reasoning_content", None)
    assert "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices) == reasoning
    if fmt == "none":
        assert reasoning == "" and content
    else:
        assert reasoning
        if fmt == "deepseek-legacy":  # the primed open marker is re-emitted, the thoughts stay in content
            assert content.startswith("<think>") and reasoning in content
        else:
            assert content == ""


def test_enable_thinking_kwarg_per_request_overrides_server(client):
    on = client.chat.completions.create(model=QWEN3_TINY, messages=[ASK], max_tokens=1)
    off = client.chat.completions.create(model=QWEN3_TINY, messages=[ASK], max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the template writes an empty <think></think> block when thinking is off
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_skip_chat_parsing_reports_raw_text():
    fixture_path(QWEN3_TINY)
    s = ServerProcess(["-m", QWEN3_TINY, "--offline", "--skip-chat-parsing", "--no-prefill-assistant"])
    try:
        r = httpx.post(s.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [ASK], "tools": TOOLS, "max_tokens": 2, "temperature": 0}).json()
        msg = r["choices"][0]["message"]
        assert "tool_calls" not in msg and "reasoning_content" not in msg
        # --no-prefill-assistant: a trailing assistant turn is answered, not continued
        both = httpx.post(s.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [ASK, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
            "max_tokens": 1})
        assert both.status_code == 200
    finally:
        s.stop()


MESSAGE = " Budget spent."
PRIMED = [ASK, {"role": "assistant", "content": "<think>\n"}]  # the prefix leaves a thinking block open


def _forced_len():
    from mlxcel.engine.tokenizer import Tokenizer

    tok = Tokenizer(fixture_path(QWEN3_TINY))
    return sum(len(tok.encode(s, add_special_tokens=False)) for s in (MESSAGE, "</think>"))


def test_reasoning_budget_ends_thinking_after_n_tokens(client):
    n, forced = 6, _forced_len()
    budget = {"reasoning_budget_tokens": n, "reasoning_budget_message": MESSAGE}
    raw = dict(model=QWEN3_TINY, messages=PRIMED, max_tokens=n + forced, temperature=0)
    budgeted = client.chat.completions.create(extra_body={"reasoning_format": "none", **budget}, **raw)
    free = client.chat.completions.create(extra_body={"reasoning_format": "none"}, **raw)
    text = budgeted.choices[0].message.content
    # exactly n sampled thinking tokens, then the message and the close tag, forced
    assert budgeted.usage.completion_tokens == n + forced
    assert text.endswith(MESSAGE + "</think>")
    assert free.choices[0].message.content.startswith(text[: -len(MESSAGE + "</think>")])
    assert not free.choices[0].message.content.endswith(MESSAGE + "</think>")
    # parsed: the message closes the thoughts, the answer follows; streamed == non-streamed
    full, chunks = _both(client, messages=PRIMED, max_tokens=n + forced + 5, extra_body=budget)
    msg = full.choices[0].message
    assert msg.reasoning_content.endswith(MESSAGE.strip())
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices) == \
        msg.reasoning_content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (msg.content or "")


def test_reasoning_budget_zero_leaves_only_the_message(client):
    r = client.chat.completions.create(model=QWEN3_TINY, messages=PRIMED, max_tokens=12, temperature=0,
                                       extra_body={"reasoning_budget_tokens": 0, "reasoning_budget_message": MESSAGE})
    assert r.choices[0].message.reasoning_content == MESSAGE.strip()


def test_reasoning_control_ends_a_running_thought(client, server):
    stream = client.chat.completions.create(
        model=QWEN3_TINY, messages=PRIMED, max_tokens=300, temperature=0, stream=True,
        extra_body={"reasoning_format": "none", "reasoning_control": True, "reasoning_budget_message": MESSAGE})
    it = iter(stream)
    first = next(it)
    url = server.base_url + "/v1/chat/completions/control"
    assert httpx.post(url, json={"id": first.id, "action": "reasoning_end"}).json() == {"success": True}
    text = "".join(c.choices[0].delta.content or "" for c in it if c.choices)
    assert MESSAGE + "</think>" in text
    # the contract around it
    assert httpx.post(url, json={"action": "reasoning_end"}).status_code == 400
    assert httpx.post(url, json={"id": first.id, "action": "nap"}).status_code == 400
    done = httpx.post(url, json={"id": first.id, "action": "reasoning_end"}).json()
    assert done["success"] is False and done["message"]


# a template that primes the thinking block itself (the checkpoint's does not)
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_template_file_budget_flags_and_no_alias(tmp_path):
    fixture_path(QWEN3_TINY)
    f = tmp_path / "thinking.jinja"
    f.write_text(THINKING_TEMPLATE)
    s = ServerProcess(["-m", QWEN3_TINY, "--offline", "--chat-template-file", str(f), "--reasoning-budget", "3",
                       "--reasoning-budget-message", MESSAGE, "--reasoning-alias-field", "none"])
    try:
        applied = httpx.post(s.base_url + "/apply-template", json={"messages": [ASK]}).json()
        assert applied["prompt"] == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
        body = httpx.post(s.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [ASK], "max_tokens": 3 + _forced_len() + 3, "temperature": 0}).json()
        msg = body["choices"][0]["message"]
        # the server's budget closed the primed block after three tokens, with the server's message
        assert msg["reasoning_content"].endswith(MESSAGE.strip()) and "reasoning" not in msg
        props = httpx.get(s.base_url + "/props").json()
        assert props["chat_template"] == THINKING_TEMPLATE
    finally:
        s.stop()
