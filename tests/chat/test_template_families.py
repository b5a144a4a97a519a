"""Published chat templates rendered as b10621 renders them (tests/chat/templates/README.md).

The prompt ending under `--reasoning on|off|auto` and the per-request switches
(`chat_template_kwargs.enable_thinking`, `reasoning_effort: "none"`) is what b10621's
/apply-template answers: the template's own rendering with `enable_thinking` always a boolean,
true under `auto` exactly when the template has a thinking mode. The Llama 3.x templates print
today's date (`date_string`, `strftime_now`).
"""

from __future__ import annotations

from datetime import date, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.openai.chat import render_prompt_text
from mlxcel.api.openai.chat_surface import template_kwargs
from mlxcel.chat.chat_template import render_chat, thinking_by_default
from mlxcel.cli.flags import parse_server_args

TEMPLATES = Path(__file__).parent / "templates"
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
QWEN_TURN = "<|im_start|>assistant\n"
R1_TURN = "<｜Assistant｜><think>\n"
COHERE_TURN = "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
LLAMA_TURN = "<|start_header_id|>assistant<|end_header_id|>\n\n"

# family: (thinking on / auto ending, thinking off ending)
ENDINGS = {
    "Qwen-Qwen3-0.6B": (QWEN_TURN, QWEN_TURN + "<think>\n\n</think>\n\n"),
    # the checkpoints' own templates below have no switch: they always prime (or never close) the block
    "Qwen-QwQ-32B": (QWEN_TURN + "<think>\n", QWEN_TURN + "<think>\n"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (R1_TURN, R1_TURN),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (R1_TURN, R1_TURN),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": (COHERE_TURN, COHERE_TURN),
    "meta-llama-Llama-3.1-8B-Instruct": (LLAMA_TURN, LLAMA_TURN),
    "meta-llama-Llama-3.2-3B-Instruct": (LLAMA_TURN, LLAMA_TURN),
}
# Command-R7B's own template has no thinking switch and primes no block: auto leaves thinking off
THINKING = {name for name in ENDINGS if not name.startswith(("meta-llama", "CohereForAI"))}


def _model(name: str) -> SimpleNamespace:
    tok = SimpleNamespace(chat_template=(TEMPLATES / f"{name}.jinja").read_text(), bos_token="<s>", eos_token="</s>")
    return SimpleNamespace(tokenizer=tok)


def _prompt(name: str, reasoning: str | None = None, requested=None, effort=None) -> str:
    argv = ["-m", "x"] + (["--reasoning", reasoning] if reasoning else [])
    settings = parse_server_args(argv, {})
    model = _model(name)
    kwargs = template_kwargs(settings, model, requested, effort)
    return render_prompt_text(model, list(ASK), extra=kwargs)


@pytest.mark.parametrize("name", sorted(ENDINGS))
def test_thinking_mode_detected(name):
    tok = _model(name).tokenizer
    assert thinking_by_default(tok.chat_template, tok.bos_token, tok.eos_token) is (name in THINKING)


@pytest.mark.parametrize("name", sorted(ENDINGS))
@pytest.mark.parametrize("reasoning", [None, "auto", "on", "off"])
def test_reasoning_flag_prompt_ending(name, reasoning):
    on, off = ENDINGS[name]
    prompt = _prompt(name, reasoning)
    expected = off if reasoning == "off" else on
    assert prompt.endswith(expected), prompt[-120:]
    if expected != off:
        assert not prompt.endswith(off)


@pytest.mark.parametrize("name", sorted(THINKING))
def test_request_switches_override_the_server(name):
    on, off = ENDINGS[name]
    assert _prompt(name, "on", requested={"enable_thinking": False}).endswith(off)
    assert _prompt(name, "off", requested={"enable_thinking": True}).endswith(on)
    assert _prompt(name, "on", effort="none").endswith(off)  # OpenAI's "no reasoning"
    assert _prompt(name, None, effort="high").endswith(on)


def test_string_enable_thinking_is_refused():
    with pytest.raises(ApiError) as e:
        _prompt("Qwen-Qwen3-0.6B", requested={"enable_thinking": "false"})
    assert e.value.status == 400 and "expected boolean, got string" in e.value.message


def test_command_r7b_renders_tools_and_history():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    history = ASK + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Paris?"}]
    model = _model("CohereForAI-c4ai-command-r7b-12-2024-tool_use")
    text = render_prompt_text(model, history, tools=tools, extra={"enable_thinking": True})
    assert "get_weather" in text and "Hello!" in text and text.endswith(COHERE_TURN)


@pytest.mark.parametrize("name", ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct"])
def test_llama3_prints_todays_date(name):
    before = date.today()
    prompt = _prompt(name)
    dates = {d.strftime("%d %b %Y") for d in (before, date.today())}
    assert any(f"Today Date: {d}\n" in prompt for d in dates), prompt[:200]
    fixed = render_chat(_model(name).tokenizer.chat_template, ASK, now=datetime(2025, 3, 4))
    assert "Today Date: 04 Mar 2025\n" in fixed
    # a request can still name its own date, as b10621's kwargs override its context
    assert "Today Date: 01 Jan 2030\n" in _prompt(name, requested={"date_string": "01 Jan 2030"})


def test_strftime_now_and_the_date_globals():
    before = date.today()
    out = render_chat("{{ strftime_now('%Y-%m-%d') }}|{{ date_string }}|{{ datetime }}", ASK)
    today, dstr, dt = out.split("|")
    assert today in {before.isoformat(), date.today().isoformat()}
    day = date.fromisoformat(today)
    assert (dstr, dt) == (day.strftime("%d %b %Y"), day.strftime("%b %d %Y"))


def test_reasoning_aliases_for_templates_that_read_other_names():
    t = "{{ reasoning_strength }}|{{ preserve_thinking }}|{{ clear_thinking }}|{{ drop_thinking }}"
    assert render_chat(t, ASK, extra={"reasoning_effort": "low", "preserve_reasoning": True}) == "low|True|False|False"
    assert render_chat(t, ASK, extra={"reasoning_effort": "low", "reasoning_strength": "high",
                                      "preserve_reasoning": False}) == "high|False|True|True"
