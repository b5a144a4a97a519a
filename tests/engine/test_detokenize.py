"""Incremental detokenizing equals a one-shot decode, and never emits half a character."""

import random

import pytest

from mlxcel.engine.detokenize import IncrementalDetokenizer
from tests.conftest import DEFAULT_MODEL, fixture_path


@pytest.fixture(scope="module")
def tok():
    from mlxcel.engine.tokenizer import Tokenizer

    return Tokenizer(fixture_path(DEFAULT_MODEL))


TEXTS = ["Hello, world! naïve café — 東京 🚀🚀 done.", "  leading spaces\n\nand\ttabs", "emoji 👩‍👩‍👧 family"]


@pytest.mark.parametrize("text", TEXTS)
def test_concatenation_equals_one_shot(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok.decode)
    pieces = [d.add(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_random_token_streams(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(40)]
        d = IncrementalDetokenizer(tok.decode)
        assert "".join([d.add(t) for t in ids] + [d.flush()]) == tok.decode(ids)
