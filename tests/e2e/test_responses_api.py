"""/v1/responses through the `openai` SDK's responses client, on qwen3-tiny."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import module_server
from tests.fixtures import QWEN3_TINY


server = module_server(QWEN3_TINY)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_text_response_stream_and_retrieve(client):
    kw = dict(model=QWEN3_TINY, input="Say hi.", instructions="Be brief.", max_output_tokens=5, temperature=0)
    r = client.responses.create(**kw)
    assert r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 5
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=QWEN3_TINY, input="My name is Ada.", max_output_tokens=3)
    second = client.responses.create(model=QWEN3_TINY, input="What is my name?", max_output_tokens=3,
                                     previous_response_id=first.id)
    alone = client.responses.create(model=QWEN3_TINY, input="What is my name?", max_output_tokens=3)
    # the earlier turn (input and output) is part of the prompt
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=QWEN3_TINY, input="x", max_output_tokens=1, previous_response_id="resp_nope")


def test_delete_then_retrieve_is_404(client):
    r = client.responses.create(model=QWEN3_TINY, input="x", max_output_tokens=1)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_store_false_keeps_nothing_and_input_tokens_counts(server, client):
    r = client.responses.create(model=QWEN3_TINY, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    n = httpx.post(server.base_url + "/v1/responses/input_tokens", json={"input": "x"}).json()
    assert n["input_tokens"] == r.usage.input_tokens
    # the unversioned path serves the same API
    assert httpx.post(server.base_url + "/responses", timeout=120,
                      json={"input": "x", "max_output_tokens": 1}).json()["object"] == "response"


def test_named_function_tool_choice_is_forced(client):
    tools = [{"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}]
    r = client.responses.create(model=QWEN3_TINY, input="Time?", tools=tools, max_output_tokens=100,
                                tool_choice={"type": "function", "name": "get_time"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"] and '"tz"' in calls[0].arguments


def test_input_tokens_counts_what_the_request_prefills(client, server):
    tools = [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    first = client.responses.create(model=QWEN3_TINY, input="Hi.", max_output_tokens=2, temperature=0)
    turn = {"input": "And now?", "previous_response_id": first.id, "tools": tools, "instructions": "Be brief."}
    r = client.responses.create(model=QWEN3_TINY, max_output_tokens=1, temperature=0, **turn)
    for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
        counted = httpx.post(server.base_url + path, json=turn).json()
        assert counted == {"input_tokens": r.usage.input_tokens}
    missing = httpx.post(server.base_url + "/v1/responses/input_tokens", json={**turn, "previous_response_id": "x"})
    assert missing.status_code == 404


def _check_stream(events):
    """Every event naming an output item names it at the index and with the id the final
    response gives it; the streamed deltas of each item join to its final text."""
    final = events[-1].response
    by_index = {i: item for i, item in enumerate(final.output)}
    joined: dict[int, str] = {}
    for e in events:
        if getattr(e, "output_index", None) is None:
            continue
        item_id = e.item.id if hasattr(e, "item") else e.item_id
        assert by_index[e.output_index].id == item_id, (e.type, e.output_index)
        if e.type.endswith(".delta"):
            joined[e.output_index] = joined.get(e.output_index, "") + e.delta
    for i, item in by_index.items():
        text = {"reasoning": lambda: item.content[0].text, "message": lambda: item.content[0].text,
                "function_call": lambda: item.arguments}[item.type]()
        assert joined.get(i, "") == text, (item.type, joined.get(i), text)
    return final


def test_streamed_reasoning_and_tool_call_events_match_the_final_output(client):
    # a continued assistant prefix leaves a thought open: a reasoning item, then the answer
    think = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "<think>\nThe user wants"}]
    events = list(client.responses.create(model=QWEN3_TINY, input=think, max_output_tokens=12, temperature=0,
                                          stream=True))
    final = _check_stream(events)
    assert final.output[0].type == "reasoning" and any(e.type == "response.reasoning_text.delta" for e in events)
    assert client.responses.retrieve(final.id).output == final.output
    # a forced call streams as function_call_arguments deltas; its result goes back as input
    tools = [{"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}]
    events = list(client.responses.create(model=QWEN3_TINY, input="Time?", tools=tools, max_output_tokens=100,
                                          tool_choice={"type": "function", "name": "get_time"}, stream=True))
    final = _check_stream(events)
    call = next(o for o in final.output if o.type == "function_call")
    assert call.name == "get_time" and any(e.type == "response.function_call_arguments.done" for e in events)
    r = client.responses.create(model=QWEN3_TINY, previous_response_id=final.id, max_output_tokens=2, temperature=0,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert r.status in ("completed", "incomplete") and r.previous_response_id == final.id


def test_cancel_answers_the_stored_response_and_unknown_ids_are_404(client, server):
    r = client.responses.create(model=QWEN3_TINY, input="Hi.", max_output_tokens=2, temperature=0)
    assert client.responses.cancel(r.id).id == r.id
    missing = httpx.post(server.base_url + "/v1/responses/resp_nope/cancel")
    assert missing.status_code == 404


def test_cancel_stops_a_running_stream_and_stores_it_cancelled(client):
    """POST .../cancel on a running response stops its generation: the stream ends with no
    completed/incomplete event, and the cancel and a later retrieve answer status "cancelled"
    with the text streamed so far. Greedy on the random tiny model never picks EOS, so the
    stream would otherwise run its full 3000 tokens."""
    events: list = []
    running, ended = threading.Event(), threading.Event()

    def read() -> None:
        try:
            for e in client.responses.create(model=QWEN3_TINY, input="Count to a thousand.",
                                             max_output_tokens=3000, temperature=0, stream=True):
                events.append(e)
                if e.type.endswith(".delta"):
                    running.set()
        finally:
            running.set()
            ended.set()

    t = threading.Thread(target=read)
    t.start()
    running.wait(timeout=120)
    assert events and events[0].type == "response.created" and not ended.is_set()
    rid = events[0].response.id
    cancelled = client.responses.cancel(rid)
    t.join(timeout=120)
    assert ended.is_set()
    kinds = [e.type for e in events]
    assert not {"response.completed", "response.incomplete"} & set(kinds)
    assert cancelled.id == rid and cancelled.status == "cancelled" and cancelled.usage is None
    got = client.responses.retrieve(rid)
    assert got.status == "cancelled"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed and got.output_text == cancelled.output_text == streamed


def test_unused_fields_reported_and_unhonoured_ones_refused(server):
    url = server.base_url + "/v1/responses"
    r = httpx.post(url, timeout=120, json={"model": QWEN3_TINY, "input": "x", "max_output_tokens": 1, "user": "u"})
    assert r.status_code == 200 and r.headers["x-millm-ignored-fields"] == '"user"'
    refused = httpx.post(url, json={"input": "x", "text": {"format": {"type": "json_object"}}})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "field_not_honoured"
    strict = httpx.post(url, json={"input": "x", "user": "u"}, headers={"X-miLLM-Strict": "true"})
    assert strict.status_code == 400 and strict.json()["error"]["code"] == "unused_fields_refused"
