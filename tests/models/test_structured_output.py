"""Constrained generation on the real checkpoint, through the engine.

Fifty documents sampled at temperature 0.8 with different seeds, ten rows per batch (each
row carries its own matcher through the shared forward), must all end themselves, parse
and validate against a schema with nested objects, enums, bounded arrays and patterns.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from mlxcel.config.settings import EngineSection, ServerSettings, SourceSection
from mlxcel.chat.chat_template import render_chat
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.types import GenerationRequest
from tests.conftest import DEFAULT_MODEL, fixture_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
N_DOCS, BATCH = 30, 10


@pytest.fixture(scope="module")
def model():
    from mlxcel.runtime.load import load_served_model

    settings = ServerSettings(source=SourceSection(model=DEFAULT_MODEL),
                              engine=EngineSection(ctx_size=8192, parallel=BATCH, warmup=False))
    m = load_served_model(settings, fixture_path(DEFAULT_MODEL))
    yield m
    m.engine.shutdown()


def chat_prompt(model, text: str) -> list[int]:
    tok = model.tokenizer
    rendered = render_chat(tok.chat_template, [{"role": "user", "content": text}], add_generation_prompt=True,
                           bos_token=tok.bos_token, eos_token=tok.eos_token)
    return tok.encode(rendered, add_special_tokens=False)


async def generate(model, prompt, grammar, seed, max_tokens=300):
    req = GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0.8, seed=seed),
                            max_tokens=max_tokens, grammar=grammar)
    parts, last = [], None
    async for ev in model.engine.submit(req):
        parts.append(ev.text)
        last = ev
    assert last.error is None, last.error
    return "".join(parts), last


def test_thirty_sampled_documents_parse_and_validate(model):
    grammar = model.grammars.compile("json_schema", SCHEMA)
    assert model.grammars.compile("json_schema", SCHEMA) is grammar  # compiled once, cached
    prompt = chat_prompt(model, "Describe one user of our web app as a JSON object.")

    async def batch(seeds):
        return await asyncio.gather(*(generate(model, prompt, grammar, s) for s in seeds))

    docs = []
    for start in range(0, N_DOCS, BATCH):
        docs += asyncio.run(batch(range(start, start + BATCH)))
    assert len(docs) == N_DOCS
    for text, ev in docs:
        assert ev.finish_reason == "stop", (ev.finish_reason, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in docs}) > 1  # the seeds did sample differently


def test_gbnf_grammar_in_a_batch_with_unconstrained_rows(model):
    grammar = model.grammars.compile("gbnf", 'root ::= ("yes" | "no") "." [ ]? [0-9]{2}')
    prompt = chat_prompt(model, "Is the sky blue? Answer yes or no.")

    async def mixed():
        return await asyncio.gather(generate(model, prompt, grammar, 1, 40), generate(model, prompt, None, 2, 12),
                                    generate(model, prompt, grammar, 3, 40))

    (a, ea), (_, eb), (c, ec) = asyncio.run(mixed())
    import re

    for text, ev in ((a, ea), (c, ec)):
        assert ev.finish_reason == "stop" and ev.stop_type == "eos"
        assert re.fullmatch(r"(yes|no)\. ?[0-9]{2}", text), text
    assert eb.completion_tokens > 0


def test_length_cut_reports_length(model):
    grammar = model.grammars.compile("json_schema", SCHEMA)
    text, ev = asyncio.run(generate(model, chat_prompt(model, "A user as JSON."), grammar, 7, max_tokens=5))
    assert ev.finish_reason == "length" and ev.completion_tokens == 5
    assert text.startswith("{")


def test_json_schema_flag_default_compiles_against_the_vocabulary(model):
    from mlxcel.cli.flags import parse_server_args
    from mlxcel.runtime.load import load_default_grammar

    settings = parse_server_args(["-m", DEFAULT_MODEL, "--json-schema", json.dumps({"enum": ["a", "b"]})], {})
    assert settings.sampling.grammar[0] == "json_schema"
    saved = model.default_grammar
    try:
        load_default_grammar(settings, model)
        assert model.default_grammar.kind == "json_schema"
        bad = parse_server_args(["-m", DEFAULT_MODEL, "--grammar", "root ::= bad_name"], {})
        load_default_grammar(bad, model)  # logged, not raised: each request is refused instead
        assert "expecting newline or end" in model.default_grammar_error
    finally:
        model.default_grammar, model.default_grammar_error = saved, None
