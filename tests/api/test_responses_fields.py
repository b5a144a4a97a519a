"""/v1/responses field policy and store: output-changing fields it cannot honour are refused,
unused ones are reported in X-miLLM-Ignored-Fields (refused under X-miLLM-Strict), as on /v1;
stored responses are bounded, oldest evicted first."""

from __future__ import annotations

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.openai.responses import check_fields

BASE = {"model": "m", "input": "hi", "max_output_tokens": 4, "reasoning": {"effort": "low"}}


def test_declared_fields_and_no_change_values_pass_silently():
    assert check_fields(BASE, False) == {}
    no_change = {"background": False, "top_logprobs": 0, "include": [], "truncation": "disabled",
                 "text": {"format": {"type": "text"}}, "conversation": None}
    assert check_fields({**BASE, **no_change}, False) == {}


@pytest.mark.parametrize("field,value", [
    ("background", True), ("conversation", "conv_1"),
    ("truncation", "auto"), ("prompt", {"id": "p"}), ("max_tool_calls", 1),
    ("text", {"format": {"type": "json_schema", "name": "x", "schema": {}}}),
])
def test_output_changing_fields_are_refused_naming_the_field(field, value):
    with pytest.raises(ApiError) as e:
        check_fields({**BASE, field: value}, False)
    assert (e.value.status, e.value.code, e.value.param) == (400, "field_not_honoured", field)


@pytest.mark.parametrize("include,top,expected", [
    (None, None, None), ([], 0, None), (["message.output_text.logprobs"], None, 0),
    (["message.output_text.logprobs"], 5, 5),
    (None, 2, "invalid_parameter"), (["message.output_text.logprobs"], 21, "invalid_parameter"),
    (["message.output_text.logprobs"], False, "invalid_parameter"),
    (["message.output_text.logprobs", "reasoning.encrypted_content"], 1, "field_not_honoured"),
])
def test_logprobs_are_asked_by_include(include, top, expected):
    import msgspec

    from mlxcel.api.openai.responses import ResponsesRequest, _logprobs_ask

    req = msgspec.convert({**BASE, "include": include, "top_logprobs": top}, ResponsesRequest)
    if isinstance(expected, str):
        with pytest.raises(ApiError) as e:
            _logprobs_ask(req)
        assert e.value.code == expected
    else:
        ask = _logprobs_ask(req)
        assert (ask.top if ask is not None else None) == expected


def test_unused_fields_are_reported_or_refused_when_strict():
    body = {**BASE, "user": "u", "text": {"format": {"type": "text"}, "verbosity": "low"},
            "reasoning": {"effort": "low", "summary": "auto"}}
    assert check_fields(body, False) == {
        "X-miLLM-Ignored-Fields": '"reasoning.summary", "user", "text.verbosity"'}
    with pytest.raises(ApiError) as e:
        check_fields(body, True)
    assert e.value.code == "unused_fields_refused" and "text.verbosity" in e.value.message


def test_store_is_bounded_oldest_evicted_first():
    from mlxcel.api.openai.responses import STORE_CAPACITY, ResponseStore

    assert STORE_CAPACITY == 256
    store = ResponseStore(capacity=3)
    for i in range(5):
        store.put({"id": f"resp_{i}"}, [])
    assert list(store.done) == ["resp_2", "resp_3", "resp_4"]
    store.put({"id": "resp_2"}, [])  # stored again: newest
    store.put({"id": "resp_5"}, [])
    assert list(store.done) == ["resp_4", "resp_2", "resp_5"]
