"""Chat output shaping: parsed generations as OpenAI deltas/messages and Anthropic blocks."""

from __future__ import annotations

import json

from mlxcel.api.anthropic.messages import _blocks
from mlxcel.api.openai.chat_surface import ChatOutput, Prepared, message

QWEN3_CALL = ("<think>\nNeed the weather tool.\n</think>\n\n<tool_call>\n"
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def _prep(fmt="auto", tools=True, parse=True, prompt="<|im_start|>assistant\n"):
    return Prepared(prompt=[], prompt_text=prompt, prefill="", tools=[{"type": "function"}] if tools else None,
                    reasoning_format=fmt, parse=parse)


def _run(prep, text, step=3):
    out = ChatOutput(prep)
    deltas = []
    for i in range(0, len(text), step):
        deltas += out.feed(text[i:i + step])
    return out, deltas + out.finish()


def test_reasoning_then_tool_call_message():
    out, deltas = _run(_prep(), QWEN3_CALL)
    msg = message(deltas)
    assert msg["content"] is None and msg["reasoning_content"] == "Need the weather tool."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


def test_skip_chat_parsing_keeps_everything_as_content():
    _, deltas = _run(_prep(parse=False), QWEN3_CALL)
    assert message(deltas) == {"role": "assistant", "content": QWEN3_CALL}


def test_parallel_tool_calls_false_keeps_the_first():
    two = QWEN3_CALL + '\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    out = ChatOutput(_prep(), parallel_tool_calls=False)
    msg = message(out.feed(two) + out.finish())
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


def test_anthropic_blocks_in_model_order():
    _, deltas = _run(_prep(), "<think>\nhm\n</think>\n\nSure.\n" + QWEN3_CALL.split("\n\n", 1)[1])
    blocks = _blocks(deltas)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[1]["text"] == "Sure." and blocks[2]["input"] == {"city": "Paris"}
    assert blocks[2]["id"].startswith("call_")


def test_call_cut_by_length_is_a_tool_call_under_finish_reason_length():
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    out = ChatOutput(_prep())
    msg = message(out.feed(cut) + out.finish("length"))
    assert msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Pa')]
    assert out.finish_reason("length") == "length"
    ended = ChatOutput(_prep())  # the same text ended by the model itself is not a call
    msg = message(ended.feed(cut) + ended.finish("stop"))
    assert msg["content"] == cut and "tool_calls" not in msg
