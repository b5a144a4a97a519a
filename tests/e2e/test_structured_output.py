"""Structured output through real servers: response_format on /v1 (the shared default
server, through the openai SDK) and the native grammar surface (two servers started with
a --grammar default and with a malformed --grammar-file)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import DEFAULT_MODEL

JUDGE = {"type": "object", "properties": {"label": {"enum": ["humor", "not_humor"]}},
         "required": ["label"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Is this a joke: 'I told my wife she draws her eyebrows too high. She looked surprised.'"}]


def judge_format(name="judge_v1", schema=JUDGE):
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


def test_json_schema_constrains_validates_and_names_itself(openai_client):
    raw = openai_client.chat.completions.with_raw_response.create(
        model=DEFAULT_MODEL, messages=MESSAGES, response_format=judge_format(), temperature=0, max_tokens=40)
    assert raw.headers["X-miLLM-Constrained"] == 'json_schema;name="judge_v1"'
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), JUDGE)


def test_json_object_and_length_cut(openai_client):
    raw = openai_client.chat.completions.with_raw_response.create(
        model=DEFAULT_MODEL, messages=MESSAGES, response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    assert raw.headers["X-miLLM-Constrained"] == "json_object"
    choice = raw.parse().choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    cut = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, temperature=0,
                                                response_format={"type": "json_object"}, max_tokens=2)
    assert cut.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra,needle", [
    ({"stream": True}, "stream"), ({"stop": ["}"]}, "stop"), ({"extra_body": {"allowed_token_ids": [1]}},
                                                              "allowed_token_ids"),
])
def test_conflicting_fields_refused_before_generation(openai_client, extra, needle):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES,
                                              response_format=judge_format(), max_tokens=5, **extra)
    assert e.value.code == "response_format_unsupported" and needle in e.value.message


def test_refused_keyword_named_with_pointer_and_completions_refuses(openai_client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES,
                                              response_format=judge_format(schema=schema), max_tokens=5)
    assert e.value.code == "response_format_unsupported"
    assert "multipleOf at /properties/n/multipleOf" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=2,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert e.value.code == "response_format_unsupported"


# -- native routes ---------------------------------------------------------------------

YES_NO = 'root ::= "yes" | "no"'


@pytest.fixture(scope="module")
def grammar_server():
    fixture_path(DEFAULT_MODEL)
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--grammar", YES_NO, "-np", "2"])
    yield server
    server.stop()


def complete(server, **body):
    r = httpx.post(server.base_url + "/completion", json={"prompt": "Answer:", "n_predict": 12, "temperature": 0.8,
                                                         "seed": 3, **body}, timeout=120)
    return r


def test_native_precedence_with_a_grammar_default(grammar_server):
    # no request grammar: the --grammar default applies, and is reported as sent
    r = complete(grammar_server)
    assert r.status_code == 200, r.text
    assert r.json()["content"] in ("yes", "no") and r.json()["stop_type"] == "eos"
    assert r.json()["generation_settings"]["grammar"] == YES_NO
    # json_schema alone: the schema branch
    r = complete(grammar_server, json_schema={"enum": ["maybe"]})
    assert r.json()["content"] == '"maybe"'
    assert r.json()["generation_settings"]["grammar"] == ""
    # "grammar": "" blocks the schema branch and leaves the default in place; so does a
    # non-string grammar
    for g in ("", 5, None):
        r = complete(grammar_server, grammar=g, json_schema={"enum": ["maybe"]})
        assert r.status_code == 200 and r.json()["content"] in ("yes", "no"), (g, r.text)
    # a request grammar replaces the default
    r = complete(grammar_server, grammar='root ::= [0-9]{3} "!"')
    assert len(r.json()["content"]) == 4 and r.json()["content"][:3].isdigit()
    # unparsable grammars and schemas are refused up front
    r = complete(grammar_server, grammar="root ::= a_b")
    assert r.status_code == 400 and "failed to parse grammar" in r.text
    r = complete(grammar_server, json_schema="not a schema")
    assert r.status_code == 400 and "json_schema" in r.text


def test_malformed_grammar_file_refuses_each_constrained_request(tmp_path):
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= item+\nitem_list ::= \"x\"\n")
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--grammar-file", str(bad), "-np", "1"])
    try:
        assert "failed to parse the --grammar default" in server.log()
        r = complete(server)
        assert r.status_code == 400 and "failed to parse grammar" in r.text
        # a request that brings its own constraint runs
        r = complete(server, json_schema={"type": "boolean"})
        assert r.status_code == 200 and r.json()["content"] in ("true", "false")
    finally:
        server.stop()


COUNT = "1, 2, 3, 4, 5,"


def native(server, **body):
    r = httpx.post(server.base_url + "/completion", json={"prompt": COUNT, "n_predict": 16, "temperature": 0, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("triggers,preserved,grammar,cut", [
    ([{"type": 1, "value": ", 9"}], [], 'root ::= ", 9, nine!"', ", 9"),  # a word (two tokens)
    ([{"type": 2, "value": r",\s9"}], [], 'root ::= ", 9, nine!"', ", 9"),  # a pattern anywhere
    ([{"type": 3, "value": r"[\s\S]*?(, 9)[\s\S]*"}], [], 'root ::= ", 9, nine!"', ", 9"),  # whole buffer, group 1
    ([{"type": 1, "value": ","}], [","], 'root ::= ", and so on!"', ","),  # one preserved token: a token trigger
])
def test_lazy_grammar_runs_free_until_its_trigger(default_server, triggers, preserved, grammar, cut):
    free = native(default_server)["content"]
    assert cut in free  # greedy counting goes on past 9
    out = native(default_server, grammar=grammar, grammar_lazy=True, grammar_triggers=triggers,
                 preserved_tokens=preserved)
    literal = grammar.split('"')[1]
    assert out["content"] == free[: free.index(cut) + len(cut)] + literal[len(cut):]
    assert out["stop_type"] == "eos"
    settings = out["generation_settings"]
    assert settings["grammar_lazy"] is True and settings["grammar"] == grammar
    if preserved:
        token = httpx.post(default_server.base_url + "/tokenize", json={"content": ","}).json()["tokens"]
        assert settings["grammar_triggers"] == [{"type": 0, "value": ",", "token": token[0]}]
        assert settings["preserved_tokens"] == token


def test_preserved_tokens_are_written_into_the_text(default_server):
    grammar = 'root ::= "a" <|im_start|> "b"'
    assert native(default_server, grammar=grammar)["content"] == "ab"  # a special token is left out
    out = native(default_server, grammar=grammar, preserved_tokens=["<|im_start|>"])
    assert out["content"] == "a<|im_start|>b"


@pytest.mark.parametrize("body,needle", [
    ({"grammar": 'root ::= "x"', "grammar_lazy": True}, "no triggers set for lazy grammar"),
    ({"grammar": 'root ::= "x"', "grammar_lazy": True, "grammar_triggers": [{"type": 1, "value": ","}]},
     "Grammar trigger word should be marked as preserved token: ,"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "(x"}]}, "does not compile"),
])
def test_lazy_grammar_refusals(default_server, body, needle):
    r = httpx.post(default_server.base_url + "/completion", json={"prompt": COUNT, "n_predict": 2, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_grammar_type_is_inert(default_server):
    """grammar_type only makes b10621 prefill the chat parser's generation_prompt, which is "" on
    /completion: the same grammar with or without it gives the same text."""
    grammar = 'root ::= "1" ", " "2"'
    plain = native(default_server, grammar=grammar)
    typed = native(default_server, grammar=grammar, grammar_type="tool_calls")
    assert typed["content"] == plain["content"] == "1, 2"
