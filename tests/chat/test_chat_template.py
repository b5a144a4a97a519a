"""Chat template rendering with HF semantics."""

import pytest

from mlxcel.chat.chat_template import TemplateError, render_chat

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


def test_trailing_assistant_prefill_and_two_trailing_assistants_refused():
    # --prefill-assistant (default): the trailing assistant turn is a prefix the model continues;
    # two of them are refused with b10621's wording; --no-prefill-assistant answers it instead
    from types import SimpleNamespace

    from mlxcel.api.errors import ApiError
    from mlxcel.api.openai.chat import render_prompt_text

    tok = SimpleNamespace(chat_template=TOOLS_GUARD, bos_token=None, eos_token=None)
    model = SimpleNamespace(tokenizer=tok)
    user, partial = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}
    assert render_prompt_text(model, [user, partial]) == "<user>hi<assistant>Hel"
    assert render_prompt_text(model, [user, partial], prefill_assistant=False) == \
        "<user>hi<assistant>Hel<assistant>"
    with pytest.raises(ApiError) as e:
        render_prompt_text(model, [user, partial, {"role": "assistant", "content": "lo"}])
    assert e.value.status == 400
    assert e.value.message == "Cannot have 2 or more assistant messages at the end of the list."


def test_trailing_reasoning_is_continued_only_inside_a_primed_thinking_block():
    # reasoning_content reaches the template (the contract honours it); a trailing assistant
    # message carrying only reasoning continues the thought the template opened, and every
    # other shape is refused rather than dropped
    from types import SimpleNamespace

    from mlxcel.api.errors import ApiError
    from mlxcel.api.openai.chat import render_prompt_text
    from mlxcel.api.openai.fields import message_locations

    primed_t = "{% for m in messages %}<{{ m.role }}>{{ m.reasoning_content or '' }}|{{ m.content }}{% endfor %}" \
               "{% if add_generation_prompt %}<assistant><think>\n{% endif %}"
    user = {"role": "user", "content": "hi"}
    thought = {"role": "assistant", "content": "", "reasoning_content": "Hmm, so"}
    history = [user, {"role": "assistant", "content": "ok", "reasoning_content": "r0"}, user]

    def model(t):
        return SimpleNamespace(tokenizer=SimpleNamespace(chat_template=t, bos_token=None, eos_token=None))

    assert message_locations(history, "messages") == []
    assert render_prompt_text(model(primed_t), history) == "<user>|hi<assistant>r0|ok<user>|hi<assistant><think>\n"
    assert render_prompt_text(model(primed_t), [user, thought]) == "<user>|hi<assistant><think>\nHmm, so"
    for t, msg in [(TOOLS_GUARD, thought), (primed_t, {**thought, "content": "and"})]:
        with pytest.raises(ApiError) as e:
            render_prompt_text(model(t), [user, msg])
        assert e.value.status == 400 and "reasoning_content" in e.value.message
