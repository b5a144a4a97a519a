"""JSON Schema objects admit only their listed keys under constraint, each at most once.

`close_objects` is checked as a rewrite, then through the compiled grammar on qwen3-tiny's
real Qwen vocabulary: documents are accepted or refused whole, and a property test walks the
grammars of random object schemas (nested, required and optional properties,
`additionalProperties` absent, false, true or a schema) with random allowed tokens, checking
each finished document against the schema (jsonschema) and, independently, that no object
holds a key its schema does not allow or holds one twice.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel.engine.json_schema import close_objects
from tests.conftest import fixture_path
from tests.fixtures import QWEN3_TINY

INT = {"type": "integer", "minimum": 0, "maximum": 99}


@pytest.fixture(scope="module")
def tok():
    from mlxcel.engine.tokenizer import Tokenizer

    return Tokenizer(fixture_path(QWEN3_TINY))


@pytest.fixture(scope="module")
def compiler(tok):
    from mlxcel.engine.grammar import for_tokenizer

    return for_tokenizer(tok, tok.vocab_size)


# -- the rewrite -------------------------------------------------------------------------

@pytest.mark.parametrize("schema,closed", [
    ({"properties": {"a": INT}}, {"properties": {"a": INT}, "additionalProperties": False}),
    ({"type": "object", "properties": {"a": INT}, "required": ["a", "b"]},
     {"type": "object", "properties": {"a": INT, "b": True}, "required": ["a", "b"], "additionalProperties": False}),
    ({"properties": {"a": INT}, "additionalProperties": True},
     {"properties": {"a": INT}, "additionalProperties": True}),
    ({"properties": {"a": INT}, "additionalProperties": INT}, {"properties": {"a": INT}, "additionalProperties": INT}),
    ({"type": "object"}, {"type": "object"}),
    ({"type": "array", "items": {"properties": {"a": INT}}},
     {"type": "array", "items": {"properties": {"a": INT}, "additionalProperties": False}}),
    ({"$defs": {"p": {"properties": {"x": INT}}}, "$ref": "#/$defs/p"},
     {"$defs": {"p": {"properties": {"x": INT}, "additionalProperties": False}}, "$ref": "#/$defs/p"}),
    ({"anyOf": [{"properties": {"a": INT}}, {"type": "null"}]},
     {"anyOf": [{"properties": {"a": INT}, "additionalProperties": False}, {"type": "null"}]}),
    # a property named like a keyword is a name, not a keyword
    ({"properties": {"properties": {"properties": {"a": INT}}}},
     {"properties": {"properties": {"properties": {"a": INT}, "additionalProperties": False}},
      "additionalProperties": False}),
    # merged members: the holder closes over all the names they list
    ({"allOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}}]},
     {"allOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}}], "properties": {"a": True, "b": True},
      "additionalProperties": False}),
    ({"properties": {"a": INT}, "anyOf": [{"required": ["a"]}, {"properties": {"b": INT}}]},
     {"properties": {"a": INT, "b": True}, "anyOf": [{"required": ["a"]}, {"properties": {"b": INT}}],
      "additionalProperties": False}),
    ({"allOf": [{"properties": {"a": INT}}, {"additionalProperties": True}]},
     {"allOf": [{"properties": {"a": INT}}, {"additionalProperties": True}]}),
])
def test_close_objects(schema, closed):
    before = json.dumps(schema)
    assert close_objects(schema) == closed
    assert json.dumps(schema) == before  # the input is left as it was


def test_a_schema_nested_past_the_recursion_limit_is_refused():
    from mlxcel.engine.grammar import GrammarError, check_json_schema_text

    deep: dict = {}
    for _ in range(5000):
        deep = {"properties": {"a": deep}}
    with pytest.raises(ValueError, match="nests too deeply"):
        close_objects(deep)
    text = '{"properties": {"a": ' * 5000 + "{}" + "}}" * 5000
    with pytest.raises(GrammarError, match="nests too deeply"):  # --json-schema's text
        check_json_schema_text(text)


# -- the grammar -------------------------------------------------------------------------

def accepts(compiler, tok, schema, text: str) -> bool:
    m = compiler.compile("json_schema", schema).matcher()
    ids = tok.hf.encode(text, add_special_tokens=False)
    if m.validate(ids) < len(ids):
        return False
    for t in ids:
        m.accept(t)
    return m.is_accepting()


ONLY_A = {"type": "object", "properties": {"a": INT}}


@pytest.mark.parametrize("schema,text,ok", [
    (ONLY_A, '{"a": 1}', True),
    (ONLY_A, "{}", True),
    (ONLY_A, '{"a": 1, "b": 2}', False),
    (ONLY_A, '{"b": 2}', False),
    (ONLY_A, '{"a": 1, "a": 2}', False),
    ({**ONLY_A, "additionalProperties": True}, '{"a": 1, "b": [2]}', True),
    ({**ONLY_A, "additionalProperties": True}, '{"a": 1, "a": 2}', False),
    ({**ONLY_A, "additionalProperties": {"type": "string"}}, '{"a": 1, "b": "x"}', True),
    ({**ONLY_A, "additionalProperties": {"type": "string"}}, '{"a": 1, "b": 2}', False),
    ({"type": "object"}, '{"b": 2}', True),
    # optional properties come in their declared order
    ({"type": "object", "properties": {"a": INT, "b": INT}}, '{"b": 1}', True),
    ({"type": "object", "properties": {"a": INT, "b": INT}}, '{"b": 1, "a": 2}', False),
    ({"type": "object", "properties": {"o": ONLY_A}, "required": ["o"]}, '{"o": {"a": 1, "z": 0}}', False),
    ({"type": "object", "properties": {"a": INT}, "required": ["b"]}, '{"b": "any"}', True),
])
def test_grammar_accepts_only_listed_keys(compiler, tok, schema, text, ok):
    assert accepts(compiler, tok, schema, text) is ok


def test_server_default_schema_text_is_closed_too(compiler, tok):
    from mlxcel.engine.grammar import check_json_schema_text

    text = json.dumps(ONLY_A)  # --json-schema hands the text over as written
    check_json_schema_text(text)
    assert not accepts(compiler, tok, text, '{"a": 1, "b": 2}')


# -- random schemas, random walks ---------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "city", "x y", "é", "properties", "type"])
LEAVES = st.one_of(
    st.just(INT), st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.just({"type": "string", "maxLength": 3}),
    st.lists(st.sampled_from(["p", "q", 1, None]), min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
)
EXTRA = st.one_of(st.none(), st.just(False), st.just(True), LEAVES)  # additionalProperties; None: absent


def _objects(children):
    @st.composite
    def build(draw):
        props = draw(st.dictionaries(NAMES, children, max_size=4))
        schema = {"type": "object", "properties": props}
        required = [n for n in props if draw(st.booleans())]
        if required:
            schema["required"] = required
        extra = draw(EXTRA)
        if extra is not None:
            schema["additionalProperties"] = extra
        return schema
    return build()


def _arrays(children):
    return children.map(lambda s: {"type": "array", "items": s, "maxItems": 2})


SCHEMAS = _objects(st.recursive(LEAVES, lambda kids: st.one_of(_objects(kids), _arrays(kids)), max_leaves=6))


class Obj(list):
    """A parsed object as its (key, value) pairs, in order, duplicates kept."""


def as_pairs(text: str):
    return json.loads(text, object_pairs_hook=Obj)


def unexpected_keys(doc, schema, where="") -> list[str]:
    """Keys the schema does not allow anywhere in `doc`, and listed keys (or any key of a
    closed object) written twice: for the generated subset, independently of close_objects.
    Where the schema allows extra keys it cannot stop one from repeating (the module says why)."""
    if isinstance(doc, Obj):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        closed = extra in (None, False)
        names = [k for k, _ in doc]
        bad = [f"{where}/{k} repeated" for k in set(names) if names.count(k) > 1 and (closed or k in props)]
        for k, v in doc:
            if k in props:
                bad += unexpected_keys(v, props[k], f"{where}/{k}")
            elif closed:
                bad.append(f"{where}/{k} not listed")
            elif isinstance(extra, dict):
                bad += unexpected_keys(v, extra, f"{where}/{k}")
        return bad
    if isinstance(doc, list) and schema.get("type") == "array":
        return [b for i, v in enumerate(doc) for b in unexpected_keys(v, schema["items"], f"{where}/{i}")]
    return []


def walk(compiler, tok, schema, rng: random.Random, closers: np.ndarray, limit: int = 400) -> str | None:
    """Random allowed tokens until the document may end and the walk ends it (None if it runs
    past `limit`);
    a third of the steps prefer a one-character token that closes a value, to keep walks short."""
    m = compiler.compile("json_schema", schema).matcher()
    ids: list[int] = []
    eos = list(tok.eos_token_ids)
    for _ in range(limit):
        allowed = m.allowed_mask(tok.vocab_size)
        assert allowed.any(), m.error()
        if allowed[eos].any() and (m.is_terminated() or rng.random() < 0.5):
            return tok.decode(ids, skip_special_tokens=False)
        allowed[eos] = False
        choices = np.flatnonzero(allowed & closers) if rng.random() < 0.35 else np.array([], dtype=int)
        if choices.size == 0:
            choices = np.flatnonzero(allowed)
        t = int(choices[rng.randrange(choices.size)])
        assert m.accept(t)
        ids.append(t)
    return None


@pytest.fixture(scope="module")
def closers(tok):
    """One-character tokens that end a string, object, array or number."""
    mask = np.zeros(tok.vocab_size, dtype=bool)
    for ch in '"}]0':
        ids = tok.hf.encode(ch, add_special_tokens=False)
        if len(ids) == 1:
            mask[ids[0]] = True
    return mask


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_random_schemas_never_yield_an_unlisted_or_repeated_key(compiler, tok, closers, schema, seed):
    text = walk(compiler, tok, schema, random.Random(seed), closers)
    assert text is not None, "the walk did not end"
    jsonschema.Draft202012Validator(schema).validate(json.loads(text))
    assert unexpected_keys(as_pairs(text), schema) == [], text
