"""The thinking-block splitter on outputs recorded from real reasoning checkpoints."""

from __future__ import annotations

import random

import pytest

from pathlib import Path

from mlxcel.chat.reasoning import COMMAND_R7B, THINK, ReasoningStream, markers_for, primed, split_reasoning

QWEN3 = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\n2 plus 2 equals 4."
R1_PRIMED = "Okay, simple arithmetic: 2 + 2 = 4.\n</think>\n\n2 plus 2 equals 4."  # prompt ended in <think>\n
UNCLOSED = "<think>\nLet me think about this carefully and"
NO_THINK = "Paris is the capital."

CASES = [
    # (label, text, primed, fmt, content, reasoning)
    ("qwen3 none", QWEN3, False, "none", QWEN3, ""),
    ("qwen3 deepseek", QWEN3, False, "deepseek", "2 plus 2 equals 4.", "The user asks 2+2. That is 4."),
    ("qwen3 auto", QWEN3, False, "auto", "2 plus 2 equals 4.", "The user asks 2+2. That is 4."),
    ("qwen3 legacy", QWEN3, False, "deepseek-legacy", QWEN3, "The user asks 2+2. That is 4."),
    ("r1 primed deepseek", R1_PRIMED, True, "deepseek", "2 plus 2 equals 4.", "Okay, simple arithmetic: 2 + 2 = 4."),
    ("r1 primed legacy", R1_PRIMED, True, "deepseek-legacy", "<think>" + R1_PRIMED, "Okay, simple arithmetic: 2 + 2 = 4."),
    ("r1 primed none", R1_PRIMED, True, "none", R1_PRIMED, ""),
    ("unclosed at length", UNCLOSED, False, "deepseek", "", "Let me think about this carefully and"),
    ("no think block", NO_THINK, False, "deepseek", NO_THINK, ""),
    ("empty think (enable_thinking off)", "<think>\n\n</think>\n\nHi!", False, "deepseek", "Hi!", ""),
]


# Command R7B writes its plan between its own pair of markers
R7B = "<|START_THINKING|>The user wants 2+2. It is 4.<|END_THINKING|>2 plus 2 equals 4."


def _r7b(text: str) -> str:
    return text.replace("<think>", COMMAND_R7B.open).replace("</think>", COMMAND_R7B.close)


# the same outputs written with Command R7B's markers split the same way under its pair
CASES = [(*c, THINK) for c in CASES] + [
    (f"{label} r7b", _r7b(text), is_primed, fmt, _r7b(content), reasoning, COMMAND_R7B)
    for label, text, is_primed, fmt, content, reasoning in CASES] + [
    ("r7b deepseek", R7B, False, "deepseek", "2 plus 2 equals 4.", "The user wants 2+2. It is 4.", COMMAND_R7B),
    ("r7b legacy", R7B, False, "deepseek-legacy", R7B, "The user wants 2+2. It is 4.", COMMAND_R7B),
    # the other family's markers are text
    ("think under r7b", QWEN3, False, "deepseek", QWEN3.strip(), "", COMMAND_R7B),
]


@pytest.mark.parametrize("label,text,is_primed,fmt,content,reasoning,markers", CASES, ids=[c[0] for c in CASES])
def test_split_and_stream_agree(label, text, is_primed, fmt, content, reasoning, markers):
    whole = split_reasoning(text, fmt, is_primed, markers)
    assert (whole.content, whole.reasoning) == (content, reasoning)
    rng = random.Random(label)
    for _ in range(20):
        s = ReasoningStream(fmt, is_primed, markers)
        c = r = ""
        i = 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            part = s.feed(text[i:j])
            c, r, i = c + part.content, r + part.reasoning, j
        part = s.finish()
        assert (c + part.content, r + part.reasoning) == (content, reasoning)


def test_template_picks_the_markers():
    templates = Path(__file__).parent / "templates"
    assert markers_for((templates / "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja").read_text()) is COMMAND_R7B
    assert markers_for((templates / "Qwen-Qwen3-0.6B.jinja").read_text()) is THINK
    assert markers_for(None) is THINK
    assert primed("<|CHATBOT_TOKEN|><|START_THINKING|>", COMMAND_R7B)
    assert not primed("<|CHATBOT_TOKEN|><|START_THINKING|>")  # <think> by default
    assert not primed("<|START_THINKING|>plan<|END_THINKING|>", COMMAND_R7B)


def test_primed_detection():
    assert primed("<|im_start|>assistant\n<think>\n")
    assert not primed("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not primed("<|im_start|>assistant\n")


def test_unknown_format_refused():
    with pytest.raises(ValueError):
        ReasoningStream("bogus")
