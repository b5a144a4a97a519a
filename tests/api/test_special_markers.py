"""Tool-call markers that are special tokens (Llama's `<|python_tag|>`, Mistral's
`[TOOL_CALLS]`) reach the parser as text, and never reach a client as content.

The vocabulary is qwen3-tiny's with the two markers added as special tokens, saved to a
temporary checkpoint directory, so the real tokenizer code paths run.
"""

from __future__ import annotations

import json

import pytest

from mlxcel.api.openai.chat_surface import ChatOutput, Prepared, message
from mlxcel.engine.detokenize import IncrementalDetokenizer
from tests.conftest import fixture_path
from tests.fixtures import QWEN3_TINY

CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from mlxcel.engine.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(fixture_path(QWEN3_TINY)), local_files_only=True)
    hf.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "[TOOL_CALLS]"]})
    path = tmp_path_factory.mktemp("marker-tokenizer")
    hf.save_pretrained(str(path))
    return Tokenizer(path)


def stream(decode, ids):
    d = IncrementalDetokenizer(decode)
    return "".join(d.add(i) for i in ids) + d.flush()


def test_kept_markers_survive_decoding_other_specials_do_not(tok):
    tag = tok.single_special("<|python_tag|>")
    assert tag is not None and tok.single_special("hello") is None
    ids = tok.encode("<|python_tag|>" + CALL + "<|im_end|>", add_special_tokens=False)
    assert tag in ids
    assert stream(tok.decoder(), ids) == CALL  # the plain decode drops every special token
    assert stream(tok.decoder(frozenset({tag})), ids) == "<|python_tag|>" + CALL  # <|im_end|> still dropped


def prep(markers, prompt="<|im_start|>assistant\n"):
    return Prepared(prompt=[], prompt_text=prompt, prefill="", tools=[{"type": "function"}], reasoning_format="auto",
                    parse=True, markers=markers)


def test_python_tag_call_parses_and_the_marker_is_not_content(tok):
    tag = tok.single_special("<|python_tag|>")
    text = stream(tok.decoder(frozenset({tag})), tok.encode("<|python_tag|>" + CALL, add_special_tokens=False))
    out = ChatOutput(prep({"<|python_tag|>": tag}))
    msg = message(out.feed(text) + out.finish())
    assert msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]


def test_mistral_marker_that_does_not_parse_is_dropped_from_content(tok):
    tag = tok.single_special("[TOOL_CALLS]")
    out = ChatOutput(prep({"[TOOL_CALLS]": tag}))
    deltas = out.feed("Hello [TOOL_CALLS]not json") + out.finish()
    msg = message(deltas)
    assert "tool_calls" not in msg and msg["content"] == "Hello not json"
    good = ChatOutput(prep({"[TOOL_CALLS]": tag}))
    msg = message(good.feed('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]') + good.finish())
    assert msg["tool_calls"][0]["function"]["name"] == "f" and msg["content"] is None
