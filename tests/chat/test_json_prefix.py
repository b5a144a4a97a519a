"""A cut-off JSON object, closed as far as it got (Anthropic's tool_use input of a call cut
by max_tokens)."""

from __future__ import annotations

import pytest

from mlxcel.chat.json_prefix import object_of_prefix


@pytest.mark.parametrize("text,expected", [
    ('{"city": "Paris"}', {"city": "Paris"}),
    ('{"city": "Par', {"city": "Par"}),  # a string value kept as far as it was written
    ('{"city": "Paris", "coun', {"city": "Paris"}),  # a cut key is dropped with its member
    ('{"city": "Paris", "country":', {"city": "Paris"}),
    ('{"city": "Paris",', {"city": "Paris"}),
    ('{"a": [1, {"b": "x"', {"a": [1, {"b": "x"}]}),
    ('{"a": {"b": tr', {"a": {}}),  # a literal cut short is not guessed
    ('{"q": "say \\"hi', {"q": 'say "hi'}),
    ('{"q": "a\\', {"q": "a"}),  # a cut escape is dropped
    ('{"q": "}]"', {"q": "}]"}),  # brackets inside strings are text
    ('{"', {}),
    ("", {}),
    ("[1, 2", {}),  # not an object
])
def test_object_of_prefix(text, expected):
    assert object_of_prefix(text) == expected


def test_a_long_cut_call_is_read_a_bounded_number_of_times(monkeypatch):
    from mlxcel.chat import json_prefix

    calls = []
    closed = json_prefix._closed
    monkeypatch.setattr(json_prefix, "_closed", lambda text: calls.append(len(text)) or closed(text))
    assert json_prefix.object_of_prefix("[" + "1, " * 5000) == {}  # no prefix is an object
    assert len(calls) <= json_prefix.MAX_TRIES
