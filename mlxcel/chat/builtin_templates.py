"""b10621's built-in chat formats, written as Jinja, for `--chat-template NAME`.

llama-server accepts a short name in place of a template and then formats the conversation
with a fixed C++ formatter instead of a Jinja template. Each entry here is our own Jinja
rendering of one of those formats (same roles, markers, whitespace and trimming), so a
named format goes through the one renderer (chat_template.py) like any checkpoint template.

Upstream's formatters write no BOS: the rendered prompt is tokenized with special tokens
added, so BOS comes from the vocabulary's own add-BOS rule. `with_bos` reproduces that
for a tokenizer that adds BOS (mlxcel tokenizes rendered prompts without special tokens).
Every name upstream knows is written here (tests check the two lists agree).
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


def _roles(turns: dict[str, str], gen: str = "", other: str = "") -> str:
    """One turn expression per named role; any other role writes `other` (nothing when empty)."""
    arms = "".join(("{%- if " if i == 0 else "{%- elif ") + f"m['role'] == '{role}' %}}{{{{ {expr} }}}}"
                   for i, (role, expr) in enumerate(turns.items()))
    rest = "{%- else %}{{ " + other + " }}" if other else ""
    tail = "{%- if add_generation_prompt %}{{ " + gen + " }}{% endif %}" if gen else ""
    return "{%- for m in messages %}" + arms + rest + "{% endif %}{%- endfor %}" + tail


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

_GRANITE_ROLE = ("('<|start_of_role|>assistant<|end_of_role|><|tool_call|>' if m['role'] == 'assistant_tool_call' "
                 "else '<|start_of_role|>' + m['role'] + '<|end_of_role|>')")

# a first system turn is written without a role header
_GIGACHAT = ("{{ '<s>' }}"
             "{%- for m in messages %}"
             "{%- if loop.first and m['role'] == 'system' %}{{ m['content'] + '<|message_sep|>' }}"
             "{%- elif m['role'] == 'user' %}{{ 'user<|role_sep|>' + m['content'] + '<|message_sep|>"
             "available functions<|role_sep|>[]<|message_sep|>' }}"
             "{%- elif m['role'] == 'assistant' %}{{ 'assistant<|role_sep|>' + m['content'] + '<|message_sep|>' }}"
             "{% endif %}{%- endfor %}"
             "{%- if add_generation_prompt %}{{ 'assistant<|role_sep|>' }}{% endif %}")

# "Assistant:" follows a last user turn whatever add_generation_prompt says
_RWKV = _roles({"system": "'System: ' + " + CT + " + '\\n\\n'",
                "user": "'User: ' + " + CT + " + '\\n\\n' + ('Assistant:' if loop.last else '')",
                "assistant": "'Assistant: ' + " + CT + " + '\\n\\n'"})

_BAILING2 = ("{%- if not (messages and messages[0]['role'] == 'system') %}"
             "{{ '<role>SYSTEM</role>detailed thinking off<|role_end|>' }}{% endif %}"
             + _simple("'<role>' + ('HUMAN' if m['role'] == 'user' else m['role']|upper) + '</role>' + " + C
                       + " + '<|role_end|>'", "'<role>ASSISTANT</role>'"))

_HY = {"a": "<｜hy_Assistant｜>", "u": "<｜hy_User｜>", "sys": "<｜hy_place▁holder▁no▁3｜>",
       "end": "<｜hy_place▁holder▁no▁2｜>", "bos": "<｜hy_begin▁of▁sentence｜>"}
# a system turn counts only as the first message
_HUNYUAN_DENSE = ("{%- for m in messages %}"
                  "{%- if loop.first and m['role'] == 'system' %}{{ " + C + " + '" + _HY["sys"] + "' }}{% endif %}"
                  "{%- if m['role'] == 'assistant' %}{{ '" + _HY["a"] + "' + " + C + " + '" + _HY["end"] + "' }}"
                  "{%- elif m['role'] == 'user' %}{{ '" + _HY["u"] + "' + " + C + " + '" + _HY["a"] + "' }}"
                  "{% endif %}{%- endfor %}")
# the role marker follows the text it closes
_HUNYUAN_VL = ("{{ '" + _HY["bos"] + "' }}{%- for m in messages %}"
               "{%- if loop.first and m['role'] == 'system' %}{{ " + C + " + '" + _HY["sys"] + "' }}"
               "{%- elif m['role'] == 'user' %}{{ " + C + " + '" + _HY["u"] + "' }}"
               "{%- elif m['role'] == 'assistant' %}{{ " + C + " + '" + _HY["a"] + "' }}"
               "{% endif %}{%- endfor %}")

_KIMI_HEAD = {"system": "<|im_system|>system", "user": "<|im_user|>user",
              "assistant": "<|im_assistant|>assistant", "tool": "<|im_system|>tool"}
_KIMI = _roles({role: f"'{head}<|im_middle|>' + {C} + '<|im_end|>'" for role, head in _KIMI_HEAD.items()},
               "'<|im_assistant|>assistant<|im_middle|>'", other=C + " + '<|im_end|>'")

_PANGU_ROLE = {"system": "系统", "user": "用户", "assistant": "助手", "tool": "工具", "function": "方法"}
# an empty system turn opens a conversation that does not start with one
_PANGU = ("{%- if messages and messages[0]['role'] != 'system' %}{{ '[unused9]系统：[unused10]' }}{% endif %}"
          + _roles({role: f"'[unused9]{name}：' + {C} + '[unused10]'" for role, name in _PANGU_ROLE.items()},
                   "'[unused9]助手：'"))

_EXAONE4 = _roles({"system": "'[|system|]' + " + CT + " + '[|endofturn|]\\n'",
                   "user": "'[|user|]' + " + CT + " + '\\n'",
                   "assistant": "'[|assistant|]' + " + CT + " + '[|endofturn|]\\n'",
                   "tool": "'[|tool|]' + " + CT + " + '[|endofturn|]\\n'"}, "'[|assistant|]'")
_EXAONE_MOE = _roles({role: f"'<|{role}|>\\n' + {CT} + '<|endofturn|>\\n'"
                      for role in ("system", "user", "assistant", "tool")}, "'<|assistant|>\\n'")

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
    "granite": _simple("'<|start_of_role|>' + " + R + " + '<|end_of_role|>' + ('<|tool_call|>' if m['role'] == "
                       "'assistant_tool_call' else '') + " + C + " + '<|end_of_text|>\\n'",
                       "'<|start_of_role|>assistant<|end_of_role|>'"),
    "granite-4.0": _simple(_GRANITE_ROLE + " + " + C + " + '<|end_of_text|>\\n'",
                           "'<|start_of_role|>assistant<|end_of_role|>'"),
    "granite-4.1": _simple(_GRANITE_ROLE + " + " + C + " + '<|end_of_text|>\\n'",
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
    "deepseek-ocr": _simple(C),
    "chatglm3": "{{ '[gMASK]sop' }}" + _simple("'<|' + " + R + " + '|>\\n ' + " + C, "'<|assistant|>'"),
    "chatglm4": "{{ '[gMASK]<sop>' }}" + _simple("'<|' + " + R + " + '|>\\n' + " + C, "'<|assistant|>\\n'"),
    "glmedge": _simple("'<|' + " + R + " + '|>\\n' + " + C, "'<|assistant|>'"),
    "exaone4": _EXAONE4,
    "exaone-moe": _EXAONE_MOE,
    "rwkv-world": _RWKV,
    "gigachat": _GIGACHAT,
    "yandex": _roles({"user": "' Пользователь: ' + " + C + " + '\\n\\n'",
                      "assistant": "' Ассистент: ' + " + C + " + '\\n\\n'"}, "' Ассистент:[SEP]'"),
    "bailing-think": _simple("'<role>' + ('HUMAN' if m['role'] == 'user' else m['role']|upper) + '</role>' + " + C,
                             "'<role>ASSISTANT</role><think>'"),
    "bailing2": _BAILING2,
    "hunyuan-moe": _roles({"system": "'<|startoftext|>' + " + C + " + '<|extra_4|>'",
                           "assistant": C + " + '<|eos|>'"}, other="'<|startoftext|>' + " + C + " + '<|extra_0|>'"),
    "hunyuan-dense": _HUNYUAN_DENSE,
    "hunyuan-vl": _HUNYUAN_VL,
    "kimi-k2": _KIMI,
    "seed_oss": _simple("'<seed:bos>' + " + R + " + '\\n' + (" + CT + " if m['role'] == 'assistant' else " + C
                        + ") + '<seed:eos>'", "'<seed:bos>assistant\\n'"),
    "grok-2": _roles({"system": "'System: ' + " + CT + " + '<|separator|>\\n\\n'",
                      "user": "'Human: ' + " + CT + " + '<|separator|>\\n\\n'",
                      "assistant": "'Assistant: ' + " + C + " + '<|separator|>\\n\\n'"}, "'Assistant:'"),
    "pangu-embedded": _PANGU,
    "solar-open": _simple("'<|begin|>' + " + R + " + '<|content|>' + " + C + " + '<|end|>'", "'<|begin|>assistant'"),
    "smolvlm": "{{ '<|im_start|>' }}" + _by_role(C + " + '\\n\\n'", "'User: ' + " + C + " + '<end_of_utterance>\\n'",
                                                  "'Assistant: ' + " + C + " + '<end_of_utterance>\\n'",
                                                  "'Assistant:'"),
}


def template(name: str) -> str:
    """The Jinja text of a built-in format, marked as one."""
    return f"{MARKER}{name} #}}" + BUILTIN[name]


def with_bos(text: str, adds_bos: bool) -> str:
    """A built-in format made to start with BOS when the tokenizer would add one; any other
    template is returned as it is (it writes BOS itself when its checkpoint wants one)."""
    if adds_bos and text.startswith(MARKER):
        return "{{ bos_token }}" + text
    return text
