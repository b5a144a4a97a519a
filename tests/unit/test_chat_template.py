"""Chat template rendering with HF semantics."""

import pytest

from mlxcel.engine.chat_template import TemplateError, render_chat

TOOLS_GUARD = "{% if tools is defined %}TOOLS:{{ tools | length }}|{% endif %}" \
              "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
              "{% if add_generation_prompt %}<assistant>{% endif %}"


def test_tools_undefined_when_absent_or_empty():
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(TOOLS_GUARD, msgs) == "<user>hi<assistant>"
    assert render_chat(TOOLS_GUARD, msgs, tools=[]) == "<user>hi<assistant>"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert render_chat(TOOLS_GUARD, msgs, tools=tools).startswith("TOOLS:1|")


def test_generation_prompt_and_bos():
    t = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert render_chat(t, [{"role": "user", "content": "x"}], bos_token="<s>") == "<s>x>"
    assert render_chat(t, [{"role": "user", "content": "x"}], add_generation_prompt=False, bos_token="<s>") == "<s>x"


def test_raise_exception_is_a_template_error():
    t = "{{ raise_exception('only user turns') }}"
    with pytest.raises(TemplateError, match="only user turns"):
        render_chat(t, [{"role": "user", "content": "x"}])


def test_tojson_keeps_unicode():
    t = "{{ messages[0] | tojson }}"
    assert render_chat(t, [{"role": "user", "content": "é"}]) == '{"role": "user", "content": "é"}'
