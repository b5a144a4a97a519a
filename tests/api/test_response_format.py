"""response_format parsing: the keyword subset, the limits, the conflicts, the header."""

from __future__ import annotations

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.openai import response_format as rf

REFUSED_KEYWORDS = {
    "multipleOf": 3, "not": {"type": "null"}, "uniqueItems": True, "allOf": [{"type": "string"}],
    "oneOf": [{"type": "string"}], "if": {"type": "string"}, "then": {}, "else": {}, "format": "email",
    "patternProperties": {"^x": {}}, "dependentRequired": {"a": ["b"]}, "$schema": "https://json-schema.org/draft/2020-12/schema",
}


def body(schema, **extra):
    return {"messages": [], "response_format": {"type": "json_schema", "json_schema": {"name": "judge_v1", "schema": schema}},
            **extra}


def refusal(b) -> ApiError:
    with pytest.raises(ApiError) as e:
        rf.parse(b)
    return e.value


@pytest.mark.parametrize("keyword", sorted(REFUSED_KEYWORDS))
def test_each_refused_keyword_is_named_with_its_pointer(keyword):
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "x~y/z": {keyword: REFUSED_KEYWORDS[keyword]}}}}}
    e = refusal(body(schema))
    assert e.status == 400 and e.code == "response_format_unsupported" and e.param == "response_format"
    assert f"{keyword} at /properties/inner/properties/x~0y~1z/{keyword}" in e.message


def test_every_refused_keyword_is_listed_in_one_refusal():
    e = refusal(body({"type": "object", **REFUSED_KEYWORDS}))
    for keyword in REFUSED_KEYWORDS:
        assert f"{keyword} at /{keyword.replace('/', '~1')}" in e.message


def test_remote_ref_refused_local_defs_ref_accepted():
    e = refusal(body({"$ref": "https://example.com/s.json"}))
    assert "$ref at /$ref" in e.message
    ok = rf.parse(body({"$defs": {"item": {"type": "string", "pattern": "^[a-z]+$"}},
                        "type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3}))
    assert ok.kind == "json_schema" and ok.name == "judge_v1"


def test_supported_subset_and_annotations_accepted():
    schema = {"title": "t", "description": "d", "type": "object", "additionalProperties": {"type": "integer"},
              "properties": {"n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9, "default": 1, "examples": [2]},
                             "s": {"type": "string", "minLength": 1, "maxLength": 5, "enum": ["a", "bb"]},
                             "c": {"const": {"multipleOf": "data, not a keyword"}},
                             "u": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
              "required": ["n"]}
    assert rf.parse(body(schema)).schema == schema
    strict_false = body(schema)
    strict_false["response_format"]["json_schema"]["strict"] = False
    assert rf.parse(strict_false).kind == "json_schema"


def test_size_depth_and_property_limits_apply_before_compile():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(257)}}
    assert "limit is 256" in refusal(body(wide)).message
    deep: dict = {"type": "integer"}
    for _ in range(32):
        deep = {"type": "array", "items": deep}
    assert "deeper than 32" in refusal(body(deep)).message
    big = {"type": "string", "description": "x" * (64 * 1024)}
    assert "limit is 65536 bytes" in refusal(body(big)).message


@pytest.mark.parametrize("field,value", [("stream", True), ("stop", ["}"]), ("stop", "\n"),
                                         ("allowed_token_ids", [1, 2])])
def test_conflicting_fields_refused(field, value):
    e = refusal(body({"type": "object"}, **{field: value}))
    assert e.code == "response_format_unsupported" and field in e.message


def test_text_is_no_constraint_and_other_routes_refuse():
    assert rf.parse({"response_format": {"type": "text"}}) is None
    assert rf.parse({}) is None
    assert rf.parse({"response_format": {"type": "json_object"}}).schema == {"type": "object"}
    rf.refuse({"response_format": {"type": "text"}}, "/v1/completions")
    with pytest.raises(ApiError) as e:
        rf.refuse({"response_format": {"type": "json_object"}}, "/v1/completions")
    assert e.value.code == "response_format_unsupported"


def parse_sf_item(value: str) -> tuple[str, dict[str, str]]:
    """A small RFC 8941 Item parser: a token, then ;key="string" parameters."""
    import re

    token = r"[A-Za-z*][A-Za-z0-9_\-.:%*/!#$&'+^`|~]*"
    m = re.fullmatch(rf"({token})((?:;[a-z*][a-z0-9_\-.*]*=(?:\"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\"\\])*\"|{token}))*)",
                     value)
    assert m, f"not an RFC 8941 item: {value!r}"
    params = {}
    for k, v in re.findall(r";([a-z*][a-z0-9_\-.*]*)=(\"(?:[^\"\\]|\\.)*\"|[^;]+)", m.group(2)):
        params[k] = re.sub(r"\\(.)", r"\1", v[1:-1]) if v.startswith('"') else v
    return m.group(1), params


def test_constrained_header_values_are_rfc8941_items():
    assert parse_sf_item(rf.Constraint("json_object", {}).header[rf.HEADER]) == ("json_object", {})
    value = rf.Constraint("json_schema", {}, "judge_v1").header[rf.HEADER]
    assert value == 'json_schema;name="judge_v1"'
    assert parse_sf_item(value) == ("json_schema", {"name": "judge_v1"})
    tricky = rf.Constraint("json_schema", {}, 'a"b\\c').header[rf.HEADER]
    assert parse_sf_item(tricky) == ("json_schema", {"name": 'a"b\\c'})


def test_check_output_validates_complete_documents_only():
    c = rf.Constraint("json_schema", {"type": "object", "required": ["a"]}, "n")
    rf.check_output(c, '{"a": 1}', "stop")
    rf.check_output(c, '{"a": 1', "length")  # incomplete, reported as length
    for text in ('{"b": 1}', '{"a": '):
        with pytest.raises(ApiError) as e:
            rf.check_output(c, text, "stop")
        assert e.value.status == 500 and e.value.code == "constrained_output_invalid"
