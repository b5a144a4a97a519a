"""--chat-template, --chat-template-file and --reasoning-alias-field at startup."""

from __future__ import annotations

import pytest

from mlxcel.chat import builtin_templates
from mlxcel.cli.flags import parse_server_args
from mlxcel.cli.options_chat import CHAT_TEMPLATE_NAMES
from mlxcel.config.refusal import StartupRefusal

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def test_inline_and_file_templates_are_read(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    s = parse_server_args(["-m", "x", "--chat-template-file", str(f)], {})
    assert (s.chat.template, s.chat.template_file) == (None, TEMPLATE)
    both = parse_server_args(["-m", "x", "--chat-template", "{{ 'inline' }}", "--chat-template-file", str(f)], {})
    assert both.chat.template == "{{ 'inline' }}"  # the runtime prefers the inline one
    assert parse_server_args(["-m", "x"], {"LLAMA_ARG_CHAT_TEMPLATE": TEMPLATE}).chat.template == TEMPLATE


@pytest.mark.parametrize("args,match", [
    (["--chat-template", "{% for %}"], "not valid Jinja"),
    (["--chat-template", "  "], "empty"),
])
def test_refused_templates(args, match):
    with pytest.raises(StartupRefusal, match=match):
        parse_server_args(["-m", "x", *args], {})


def test_file_refusals(tmp_path):
    with pytest.raises(StartupRefusal, match="failed to open file"):
        parse_server_args(["-m", "x", "--chat-template-file", str(tmp_path / "missing.jinja")], {})


def test_builtin_names_select_the_shipped_formats(tmp_path):
    # a name, inline or as a file's whole text, selects the format written as Jinja
    s = parse_server_args(["-m", "x", "--chat-template", "chatml"], {})
    assert s.chat.template == builtin_templates.template("chatml")
    named = tmp_path / "n.txt"
    named.write_text("llama3\n")
    s = parse_server_args(["-m", "x", "--chat-template-file", str(named)], {})
    assert s.chat.template_file == builtin_templates.template("llama3")


def test_every_upstream_name_starts():
    for name in sorted(CHAT_TEMPLATE_NAMES):
        assert parse_server_args(["-m", "x", "--chat-template", name], {}).chat.template == \
            builtin_templates.template(name)


def test_no_jinja_and_kv_unified_are_honoured():
    s = parse_server_args(["-m", "x"], {})
    assert (s.chat.jinja, s.engine.kv_unified) == (True, False)
    s = parse_server_args(["-m", "x", "--no-jinja", "-kvu"], {})
    assert (s.chat.jinja, s.engine.kv_unified) == (False, True)
    s = parse_server_args(["-m", "x"], {"LLAMA_ARG_JINJA": "0", "LLAMA_ARG_KV_UNIFIED": "1"})
    assert (s.chat.jinja, s.engine.kv_unified) == (False, True)
    assert parse_server_args(["-m", "x", "--kv-unified", "--no-kv-unified"], {}).engine.kv_unified is False


def test_reasoning_alias_field_policy():
    assert parse_server_args(["-m", "x"], {}).chat.reasoning_alias_field == "reasoning"
    assert parse_server_args(["-m", "x", "--reasoning-alias-field", "none"], {}).chat.reasoning_alias_field == "none"
    with pytest.raises(StartupRefusal):
        parse_server_args(["-m", "x", "--reasoning-alias-field", "thoughts"], {})


def test_reasoning_flags_write_the_template_kwargs():
    # --reasoning / --reasoning-effort / --reasoning-preserve fill the same map as
    # --chat-template-kwargs, under the keys b10621 writes; the dedicated flag wins a collision
    s = parse_server_args(["-m", "x", "--reasoning", "off", "--reasoning-effort", "high", "--reasoning-preserve"], {})
    assert s.chat.template_kwargs == {"enable_thinking": False, "reasoning_effort": "high",
                                      "preserve_reasoning": True}
    assert parse_server_args(["-m", "x", "-rea", "on"], {}).chat.template_kwargs == {"enable_thinking": True}
    # auto / default leave the template's own default alone
    assert parse_server_args(["-m", "x", "--reasoning", "auto", "--reasoning-effort", "default"],
                             {}).chat.template_kwargs == {}
    assert parse_server_args(["-m", "x"], {"LLAMA_ARG_REASONING": "off"}).chat.template_kwargs == {
        "enable_thinking": False}
    both = parse_server_args(["-m", "x", "--reasoning", "on", "--chat-template-kwargs",
                              '{"enable_thinking": false, "custom": 1}'], {})
    assert both.chat.template_kwargs == {"enable_thinking": True, "custom": 1}
    reverse = parse_server_args(["-m", "x", "--chat-template-kwargs", '{"enable_thinking": false}',
                                 "--reasoning", "on"], {})
    assert reverse.chat.template_kwargs == {"enable_thinking": True}
    with pytest.raises(StartupRefusal):
        parse_server_args(["-m", "x", "--reasoning", "maybe"], {})


def test_reasoning_format_flag_and_environment():
    # the server-wide placement every chat request uses unless it sends its own reasoning_format
    for fmt in ("none", "deepseek", "deepseek-legacy", "auto"):
        assert parse_server_args(["-m", "x", "--reasoning-format", fmt], {}).chat.reasoning_format == fmt
    assert parse_server_args(["-m", "x"], {"LLAMA_ARG_THINK": "none"}).chat.reasoning_format == "none"
    assert parse_server_args(["-m", "x"], {}).chat.reasoning_format == "auto"
    with pytest.raises(StartupRefusal):
        parse_server_args(["-m", "x", "--reasoning-format", "r1"], {})
