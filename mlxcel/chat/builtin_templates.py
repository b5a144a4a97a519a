"""b10621's built-in chat formats, written as Jinja, for `--chat-template NAME`.

llama-server accepts a short name in place of a template and then formats the conversation
with a fixed C++ formatter instead of a Jinja template. Each entry here is our own Jinja
rendering of one of those formats (same roles, markers, whitespace and trimming), so a
named format goes through the one renderer (chat_template.py) like any checkpoint template.

Upstream's formatters write no BOS: the rendered prompt is tokenized with special tokens
added, so BOS comes from the vocabulary's own add-BOS rule. `with_bos` reproduces that
for a tokenizer that adds BOS (mlxcel tokenizes rendered prompts without special tokens).
Names upstream knows that are not written here are refused by name at startup.
"""

from __future__ import annotations

MARKER = "{#- mlxcel built-in chat format: "


def _simple(turn: str, gen: str = "") -> str:
    """One turn string per message (`R` = role, `C` = content as Jinja expressions), then
    the generation prompt."""
    body = "{%- for m in messages %}{{ " + turn + " }}{% endfor %}"
    tail = "{%- if add_generation_prompt %}{{ " + gen + " }}{% endif %}" if gen else ""
    return body + tail


R, C, CT = "m['role']", "m['content']", "(m['content']|trim)"


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    c = CT if strip else C
    sys_turn = f"'<<SYS>>\\n' + {c} + '\\n<</SYS>>\\n\\n'" if system else f"{c} + '\\n'"
    reopen = "'<s>[INST] '" if bos_inside else "'[INST] '"
    return ("{%- set ns = namespace(inside=true) %}{{ '[INST] ' }}"
            "{%- for m in messages %}"
            "{%- if not ns.inside %}{{ " + reopen + " }}{% set ns.inside = true %}{% endif %}"
            "{%- if m['role'] == 'system' %}{{ " + sys_turn + " }}"
            "{%- elif m['role'] == 'user' %}{{ " + c + " + ' [/INST]' }}"
            "{%- else %}{{ " + c + " + '</s>' }}{% set ns.inside = false %}{% endif %}"
            "{%- endfor %}")


def _mistral(lead: str, trail: str, trim_reply: bool) -> str:
    reply = CT if trim_reply else C
    return ("{%- set ns = namespace(inside=false) %}"
            "{%- for m in messages %}"
            "{%- if not ns.inside %}{{ '" + lead + "[INST]" + trail + "' }}{% set ns.inside = true %}{% endif %}"
            "{%- if m['role'] == 'system' %}{{ " + C + " + '\\n\\n' }}"
            "{%- elif m['role'] == 'user' %}{{ " + C + " + '" + lead + "[/INST]' }}"
            "{%- else %}{{ '" + trail + "' + " + reply + " + '</s>' }}{% set ns.inside = false %}{% endif %}"
            "{%- endfor %}")


def _mistral_v7(sp: str) -> str:
    return ("{%- for m in messages %}"
            "{%- if m['role'] == 'system' %}{{ '[SYSTEM_PROMPT]" + sp + "' + " + C + " + '[/SYSTEM_PROMPT]' }}"
            "{%- elif m['role'] == 'user' %}{{ '[INST]" + sp + "' + " + C + " + '[/INST]' }}"
            "{%- else %}{{ '" + sp + "' + " + C + " + '</s>' }}{% endif %}"
            "{%- endfor %}")


def _by_role(system: str, user: str, other: str, gen: str = "", assistant_only: bool = False) -> str:
    """A format whose turn depends on the role: system / user / assistant (or any other role,
    unless `assistant_only`)."""
    last = "{%- elif m['role'] == 'assistant' %}" if assistant_only else "{%- else %}"
    return ("{%- for m in messages %}"
            "{%- if m['role'] == 'system' %}{{ " + system + " }}"
            "{%- elif m['role'] == 'user' %}{{ " + user + " }}"
            + last + "{{ " + other + " }}{% endif %}"
            "{%- endfor %}"
            + ("{%- if add_generation_prompt %}{{ " + gen + " }}{% endif %}" if gen else ""))


# system text is folded into the next user turn (the format has no system role)
_GEMMA = ("{%- set ns = namespace(system='') %}"
          "{%- for m in messages %}"
          "{%- if m['role'] == 'system' %}{% set ns.system = ns.system + (m['content']|trim) %}"
          "{%- else %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
          "{{ '<start_of_turn>' + role + '\\n' }}"
          "{%- if ns.system and role != 'model' %}{{ ns.system + '\\n\\n' }}{% set ns.system = '' %}{% endif %}"
          "{{ (m['content']|trim) + '<end_of_turn>\\n' }}{% endif %}"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

_ORION = ("{%- set ns = namespace(system='') %}"
          "{%- for m in messages %}"
          "{%- if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] %}"
          "{%- elif m['role'] == 'user' %}{{ 'Human: ' }}"
          "{%- if ns.system %}{{ ns.system + '\\n\\n' }}{% set ns.system = '' %}{% endif %}"
          "{{ m['content'] + '\\n\\nAssistant: </s>' }}"
          "{%- else %}{{ m['content'] + '</s>' }}{% endif %}"
          "{%- endfor %}")

_MONARCH = _simple("('' if loop.first else '<s>') + " + R + " + '\\n' + " + C + " + '</s>\\n'", "'<s>assistant\\n'")

_BAILING = _simple("'<role>' + ('HUMAN' if m['role'] == 'user' else m['role']|upper) + '</role>' + " + C,
                   "'<role>ASSISTANT</role>'")

_DS_END = "<｜end▁of▁sentence｜>"

BUILTIN: dict[str, str] = {
    "chatml": _simple("'<|im_start|>' + " + R + " + '\\n' + " + C + " + '<|im_end|>\\n'", "'<|im_start|>assistant\\n'"),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "llama3": _simple("'<|start_header_id|>' + " + R + " + '<|end_header_id|>\\n\\n' + " + CT + " + '<|eot_id|>'",
                      "'<|start_header_id|>assistant<|end_header_id|>\\n\\n'"),
    "llama4": _simple("'<|header_start|>' + " + R + " + '<|header_end|>\\n\\n' + " + CT + " + '<|eot|>'",
                      "'<|header_start|>assistant<|header_end|>\\n\\n'"),
    "mistral-v1": _mistral(" ", " ", trim_reply=False),
    "mistral-v3": _mistral("", " ", trim_reply=True),
    "mistral-v3-tekken": _mistral("", "", trim_reply=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _simple("'<|' + " + R + " + '|>\\n' + " + C + " + '<|end|>\\n'", "'<|assistant|>\\n'"),
    "phi4": _simple("'<|im_start|>' + " + R + " + '<|im_sep|>' + " + C + " + '<|im_end|>'",
                    "'<|im_start|>assistant<|im_sep|>'"),
    "zephyr": _simple("'<|' + " + R + " + '|>\\n' + " + C + " + '<|endoftext|>\\n'", "'<|assistant|>\\n'"),
    "falcon3": _simple("'<|' + " + R + " + '|>\\n' + " + C + " + '\\n'", "'<|assistant|>\\n'"),
    "granite": _simple("'<|start_of_role|>' + " + R + " + '<|end_of_role|>' + " + C + " + '<|end_of_text|>\\n'",
                       "'<|start_of_role|>assistant<|end_of_role|>'"),
    "megrez": _simple("'<|role_start|>' + " + R + " + '<|role_end|>' + " + C + " + '<|turn_end|>'",
                      "'<|role_start|>assistant<|role_end|>'"),
    "gpt-oss": _simple("'<|start|>' + " + R + " + '<|message|>' + " + C
                       + " + ('<|return|>' if m['role'] == 'assistant' else '<|end|>')", "'<|start|>assistant'"),
    "monarch": _MONARCH,
    "gemma": _GEMMA,
    "orion": _ORION,
    "bailing": _BAILING,
    "openchat": _by_role(C + " + '<|end_of_turn|>'",
                         "'GPT4 Correct User: ' + " + C + " + '<|end_of_turn|>'",
                         "'GPT4 Correct ' + (m['role'][:1]|upper) + m['role'][1:] + ': ' + " + C
                         + " + '<|end_of_turn|>'", "'GPT4 Correct Assistant:'"),
    "vicuna": _by_role(C + " + '\\n\\n'", "'USER: ' + " + C + " + '\\n'", "'ASSISTANT: ' + " + C + " + '</s>\\n'",
                       "'ASSISTANT:'", assistant_only=True),
    "vicuna-orca": _by_role("'SYSTEM: ' + " + C + " + '\\n'", "'USER: ' + " + C + " + '\\n'",
                            "'ASSISTANT: ' + " + C + " + '</s>\\n'", "'ASSISTANT:'", assistant_only=True),
    "deepseek": _by_role(C, "'### Instruction:\\n' + " + C + " + '\\n'",
                         "'### Response:\\n' + " + C + " + '\\n<|EOT|>\\n'", "'### Response:\\n'", assistant_only=True),
    "deepseek2": _by_role(C + " + '\\n\\n'", "'User: ' + " + C + " + '\\n\\n'",
                          "'Assistant: ' + " + C + " + '" + _DS_END + "'", "'Assistant:'", assistant_only=True),
    "deepseek3": _by_role(C + " + '\\n\\n'", "'<｜User｜>' + " + C,
                          "'<｜Assistant｜>' + " + C + " + '" + _DS_END + "'", "'<｜Assistant｜>'", assistant_only=True),
    "command-r": _by_role("'<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + " + CT + " + '<|END_OF_TURN_TOKEN|>'",
                          "'<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + " + CT + " + '<|END_OF_TURN_TOKEN|>'",
                          "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + " + CT + " + '<|END_OF_TURN_TOKEN|>'",
                          "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'", assistant_only=True),
    "exaone3": _by_role("'[|system|]' + " + CT + " + '[|endofturn|]\\n'", "'[|user|]' + " + CT + " + '\\n'",
                        "'[|assistant|]' + " + CT + " + '[|endofturn|]\\n'", "'[|assistant|]'", assistant_only=True),
    "minicpm": _by_role(CT, "'<用户>' + " + CT + " + '<AI>'", CT),
    "smolvlm": "{{ '<|im_start|>' }}" + _by_role(C + " + '\\n\\n'", "'User: ' + " + C + " + '<end_of_utterance>\\n'",
                                                  "'Assistant: ' + " + C + " + '<end_of_utterance>\\n'",
                                                  "'Assistant:'"),
}


def template(name: str) -> str | None:
    """The Jinja text of a built-in format, marked as one (None: not shipped)."""
    text = BUILTIN.get(name)
    return None if text is None else f"{MARKER}{name} #}}" + text


def with_bos(text: str, adds_bos: bool) -> str:
    """A built-in format made to start with BOS when the tokenizer would add one; any other
    template is returned as it is (it writes BOS itself when its checkpoint wants one)."""
    if adds_bos and text.startswith(MARKER):
        return "{{ bos_token }}" + text
    return text
