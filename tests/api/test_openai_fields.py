"""The /v1 field contract's pure parts: the table, the no-change values, locations, the
`X-miLLM-Ignored-Fields` encoding and cap, and `X-miLLM-Strict` parsing."""

from __future__ import annotations

import logging

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.openai import fields as f
from mlxcel.api.openai.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest


def test_every_row_has_every_endpoint_and_a_known_policy():
    for name, row in f.FIELD_TABLE.items():
        assert set(row) == set(f.ENDPOINTS), name
        assert set(row.values()) <= {f.HONOURED, f.REFUSED}, name


def test_table_matches_the_request_structs():
    """A field the table honours on an endpoint is declared by that endpoint's struct;
    a refused one never is (so it cannot be silently read)."""
    from mlxcel.steering.requests import STEERING_FIELDS

    structs = {f.CHAT: ChatCompletionRequest, f.COMPLETIONS: CompletionRequest}
    from mlxcel.api.llamacpp.native_params import OPENAI_SHARED

    # read by the steering surface, and by the native field parser /completion shares
    taken = {f.CHAT: {*STEERING_FIELDS, *OPENAI_SHARED}, f.COMPLETIONS: {"return_sae_activations", *OPENAI_SHARED}}
    for name, row in f.FIELD_TABLE.items():
        for endpoint, struct in structs.items():
            declared = name in struct.__struct_fields__ or name in taken[endpoint]
            if row[endpoint] == f.HONOURED:
                assert declared, (name, endpoint)
            else:
                assert not declared, (name, endpoint)


def test_no_change_values_compare_type_and_value():
    assert f.is_no_change("n", 1) and not f.is_no_change("n", True) and not f.is_no_change("n", 1.0)
    assert f.is_no_change("logprobs", False) and not f.is_no_change("logprobs", 0)
    assert f.is_no_change("response_format", {"type": "text"})
    assert not f.is_no_change("response_format", {"type": "json_object"})
    assert f.is_no_change("tools", []) and f.is_no_change("logit_bias", {}) and f.is_no_change("seed", None)


def test_check_fields_refuses_reports_and_accepts_no_change():
    body = {"messages": [], "user": "u", "foo": 1, "n": 1, "tools": [], "logit_bias": {}, "response_format": None}
    assert f.check_fields(body, ChatCompletionRequest, f.CHAT) == ["user", "foo"]
    with pytest.raises(ApiError) as e:
        f.check_fields({"input": "x", "n": 2}, EmbeddingRequest, f.EMBEDDINGS)
    assert (e.value.status, e.value.code, e.value.param) == (400, "field_not_honoured", "n")
    with pytest.raises(ApiError) as e:
        f.check_fields({"prompt": "x", "top_logprobs": 2}, CompletionRequest, f.COMPLETIONS)
    assert e.value.code == "field_not_honoured"


def test_native_fields_are_read_on_generation_and_reported_in_scoring():
    from mlxcel.api.openai.generation import read_shared

    body = {"messages": [], "repeat_penalty": 1.3, "grammar": "root ::= \"a\"", "mirostat": 2, "foo": 1}
    assert f.check_fields(body, ChatCompletionRequest, f.CHAT) == ["foo"]
    with pytest.raises(ApiError) as e:
        f.check_fields({"input": "x", "repeat_penalty": 1.3}, EmbeddingRequest, f.EMBEDDINGS)
    assert (e.value.code, e.value.param) == ("field_not_honoured", "repeat_penalty")
    shared, unused = read_shared(body, scoring=False)
    assert unused == [] and shared.overrides == {"repeat_penalty": 1.3, "mirostat": 2} and shared.asks_grammar
    assert read_shared(body, scoring=True) == (None, ["repeat_penalty", "mirostat", "grammar"])
    assert read_shared({"messages": []}, scoring=False) == (None, [])
    # /completion's clamps, not a second copy of them
    assert read_shared({"xtc_probability": 7.0}, scoring=False)[0].overrides == {"xtc_probability": 1.0}


def test_nested_locations():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "user", "content": [{"type": "text", "text": "t", "cache_control": {}}], "name": "bob"}]
    assert f.message_locations(msgs, "messages") == ["messages[2].name", "messages[2].content[0].cache_control"]
    assert f.message_locations([{"role": "user", "content": "x", "weight": 1}], "extra_messages[0]") == \
        ["extra_messages[0][0].weight"]
    assert f.object_locations({"include_usage": True, "x": 1}, ["include_usage"], "stream_options") == \
        ["stream_options.x"]


def test_header_is_an_rfc8941_list_with_percent_encoding():
    h = f.ignored_fields_header(["user", "messages[2].name", "caf\u00e9", 'q"uote', "50%"])
    assert h == {"X-miLLM-Ignored-Fields":
                 '"user", "messages[2].name", "caf%c3%a9", "q\\"uote", "50%25"'}
    assert f.ignored_fields_header([]) == {}


def test_header_is_capped_at_1024_bytes_with_plus_n_more():
    locations = [f"field_{i:04d}" for i in range(200)]
    value = f.ignored_fields_header(locations)["X-miLLM-Ignored-Fields"]
    assert len(value.encode()) <= f.IGNORED_FIELDS_HEADER_MAX_BYTES
    items = value.split(", ")
    shown = len(items) - 1
    assert items[-1] == f'"+{200 - shown} more"'
    assert items[:-1] == [f'"{loc}"' for loc in locations[:shown]]
    # one more entry would not have fit
    longer = ", ".join([*items[:-1], f'"{locations[shown]}"', f'"+{200 - shown - 1} more"'])
    assert len(longer) > f.IGNORED_FIELDS_HEADER_MAX_BYTES


@pytest.mark.parametrize("value,strict", [("true", True), ("1", True), ("TRUE", True), ("false", False),
                                          ("0", False)])
def test_strict_header_values(value, strict):
    assert f.strict_mode({"x-millm-strict": value}) is strict
    assert f.strict_mode({}) is False


@pytest.mark.parametrize("value", ["yes", "", "2", "on"])
def test_strict_header_other_values_are_refused_naming_it(value):
    with pytest.raises(ApiError) as e:
        f.strict_mode({"x-millm-strict": value})
    assert e.value.status == 400 and e.value.param == "X-miLLM-Strict" and "X-miLLM-Strict" in e.value.message


def test_settle_unused_logs_locations_only_or_refuses(caplog):
    with caplog.at_level(logging.WARNING, logger="mlxcel.api"):
        h = f.settle_unused(["user", "messages[0].name"], strict=False, endpoint=f.CHAT)
    assert h == {"X-miLLM-Ignored-Fields": '"user", "messages[0].name"'}
    lines = [r.getMessage() for r in caplog.records if "request_fields_unused" in r.getMessage()]
    assert lines == ["request_fields_unused endpoint=/v1/chat/completions locations=user,messages[0].name"]
    with pytest.raises(ApiError) as e:
        f.settle_unused(["user", "messages[0].name"], strict=True, endpoint=f.CHAT)
    assert e.value.code == "unused_fields_refused"
    assert "user" in e.value.message and "messages[0].name" in e.value.message
    assert f.settle_unused([], strict=True, endpoint=f.CHAT) == {}


def test_openai_logit_bias_is_parsed_or_refused():
    import pytest as _pytest

    from mlxcel.api.errors import ApiError
    from mlxcel.api.openai.generation import openai_logit_bias

    assert openai_logit_bias({"3": 5, "7": -100, "0": 0.5}, 10) == {3: 5.0, 7: -100.0, 0: 0.5}
    assert openai_logit_bias(None, 10) == {} and openai_logit_bias({}, 10) == {}
    for bad in ({"10": 1}, {"-1": 1}, {"hello": 1}, {"3": 101}, {"3": True}, {"3": "1"}):
        with _pytest.raises(ApiError) as e:
            openai_logit_bias(bad, 10)
        assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_parameter", "logit_bias")
