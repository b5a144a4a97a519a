"""b10621's built-in chat formats, as our Jinja, against hand-written renderings.

Each expectation spells out the format for one short conversation (a system turn, a user
turn, an assistant reply, a second user turn, then the generation prompt), written from
the format's description: role markers, separators, which turns are trimmed, where BOS
and EOS markers go, and whether a generation prompt is added at all.
"""

from __future__ import annotations

import pytest

from mlxcel.chat.builtin_templates import BUILTIN, template, with_bos
from mlxcel.chat.chat_template import render_chat
from mlxcel.cli.options_chat import CHAT_TEMPLATE_NAMES

CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Yo"},
    {"role": "user", "content": "Q"},
]
DS_END = "<｜end▁of▁sentence｜>"

EXPECTED = {
    "chatml": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
              "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n",
    # llama2 has no system block: the system text opens the first instruction
    "llama2": "[INST] S\nHi [/INST]Yo</s>[INST] Q [/INST]",
    "llama2-sys": "[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST]Yo</s>[INST] Q [/INST]",
    "llama2-sys-bos": "[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST]Yo</s><s>[INST] Q [/INST]",
    "llama2-sys-strip": "[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST]Yo</s>[INST] Q [/INST]",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi"
              "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|><|start_header_id|>user"
              "<|end_header_id|>\n\nQ<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama4": "<|header_start|>system<|header_end|>\n\nS<|eot|><|header_start|>user<|header_end|>\n\nHi<|eot|>"
              "<|header_start|>assistant<|header_end|>\n\nYo<|eot|><|header_start|>user<|header_end|>\n\nQ<|eot|>"
              "<|header_start|>assistant<|header_end|>\n\n",
    "mistral-v1": " [INST] S\n\nHi [/INST] Yo</s> [INST] Q [/INST]",
    "mistral-v3": "[INST] S\n\nHi[/INST] Yo</s>[INST] Q[/INST]",
    "mistral-v3-tekken": "[INST]S\n\nHi[/INST]Yo</s>[INST]Q[/INST]",
    "mistral-v7": "[SYSTEM_PROMPT] S[/SYSTEM_PROMPT][INST] Hi[/INST] Yo</s>[INST] Q[/INST]",
    "mistral-v7-tekken": "[SYSTEM_PROMPT]S[/SYSTEM_PROMPT][INST]Hi[/INST]Yo</s>[INST]Q[/INST]",
    "phi3": "<|system|>\nS<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nYo<|end|>\n<|user|>\nQ<|end|>\n<|assistant|>\n",
    "phi4": "<|im_start|>system<|im_sep|>S<|im_end|><|im_start|>user<|im_sep|>Hi<|im_end|><|im_start|>assistant"
            "<|im_sep|>Yo<|im_end|><|im_start|>user<|im_sep|>Q<|im_end|><|im_start|>assistant<|im_sep|>",
    "zephyr": "<|system|>\nS<|endoftext|>\n<|user|>\nHi<|endoftext|>\n<|assistant|>\nYo<|endoftext|>\n"
              "<|user|>\nQ<|endoftext|>\n<|assistant|>\n",
    "falcon3": "<|system|>\nS\n<|user|>\nHi\n<|assistant|>\nYo\n<|user|>\nQ\n<|assistant|>\n",
    "granite": "<|start_of_role|>system<|end_of_role|>S<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hi"
               "<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Yo<|end_of_text|>\n<|start_of_role|>user"
               "<|end_of_role|>Q<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>",
    "megrez": "<|role_start|>system<|role_end|>S<|turn_end|><|role_start|>user<|role_end|>Hi<|turn_end|>"
              "<|role_start|>assistant<|role_end|>Yo<|turn_end|><|role_start|>user<|role_end|>Q<|turn_end|>"
              "<|role_start|>assistant<|role_end|>",
    "gpt-oss": "<|start|>system<|message|>S<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant<|message|>Yo"
               "<|return|><|start|>user<|message|>Q<|end|><|start|>assistant",
    # no <s> before the first turn (the tokenizer's BOS stands there)
    "monarch": "system\nS</s>\n<s>user\nHi</s>\n<s>assistant\nYo</s>\n<s>user\nQ</s>\n<s>assistant\n",
    # no system role: the system text heads the next user turn; the assistant is the "model"
    "gemma": "<start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n"
             "<start_of_turn>user\nQ<end_of_turn>\n<start_of_turn>model\n",
    "orion": "Human: S\n\nHi\n\nAssistant: </s>Yo</s>Human: Q\n\nAssistant: </s>",
    "bailing": "<role>SYSTEM</role>S<role>HUMAN</role>Hi<role>ASSISTANT</role>Yo<role>HUMAN</role>Q"
               "<role>ASSISTANT</role>",
    "openchat": "S<|end_of_turn|>GPT4 Correct User: Hi<|end_of_turn|>GPT4 Correct Assistant: Yo<|end_of_turn|>"
                "GPT4 Correct User: Q<|end_of_turn|>GPT4 Correct Assistant:",
    "vicuna": "S\n\nUSER: Hi\nASSISTANT: Yo</s>\nUSER: Q\nASSISTANT:",
    "vicuna-orca": "SYSTEM: S\nUSER: Hi\nASSISTANT: Yo</s>\nUSER: Q\nASSISTANT:",
    "deepseek": "S### Instruction:\nHi\n### Response:\nYo\n<|EOT|>\n### Instruction:\nQ\n### Response:\n",
    "deepseek2": f"S\n\nUser: Hi\n\nAssistant: Yo{DS_END}User: Q\n\nAssistant:",
    "deepseek3": f"S\n\n<｜User｜>Hi<｜Assistant｜>Yo{DS_END}<｜User｜>Q<｜Assistant｜>",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>S<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>"
                 "Hi<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Yo<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Q<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "exaone3": "[|system|]S[|endofturn|]\n[|user|]Hi\n[|assistant|]Yo[|endofturn|]\n[|user|]Q\n[|assistant|]",
    "minicpm": "S<用户>Hi<AI>Yo<用户>Q<AI>",
    "smolvlm": "<|im_start|>S\n\nUser: Hi<end_of_utterance>\nAssistant: Yo<end_of_utterance>\nUser: Q"
               "<end_of_utterance>\nAssistant:",
    "deepseek-ocr": "SHiYoQ",  # the texts alone, no markers and no generation prompt
    # chatglm3 puts a space after each role line's newline; chatglm4 a newline after the generation prompt
    "chatglm3": "[gMASK]sop<|system|>\n S<|user|>\n Hi<|assistant|>\n Yo<|user|>\n Q<|assistant|>",
    "chatglm4": "[gMASK]<sop><|system|>\nS<|user|>\nHi<|assistant|>\nYo<|user|>\nQ<|assistant|>\n",
    "glmedge": "<|system|>\nS<|user|>\nHi<|assistant|>\nYo<|user|>\nQ<|assistant|>",
    "exaone4": "[|system|]S[|endofturn|]\n[|user|]Hi\n[|assistant|]Yo[|endofturn|]\n[|user|]Q\n[|assistant|]",
    "exaone-moe": "<|system|>\nS<|endofturn|>\n<|user|>\nHi<|endofturn|>\n<|assistant|>\nYo<|endofturn|>\n"
                  "<|user|>\nQ<|endofturn|>\n<|assistant|>\n",
    "rwkv-world": "System: S\n\nUser: Hi\n\nAssistant: Yo\n\nUser: Q\n\nAssistant:",
    "gigachat": "<s>S<|message_sep|>user<|role_sep|>Hi<|message_sep|>available functions<|role_sep|>[]<|message_sep|>"
                "assistant<|role_sep|>Yo<|message_sep|>user<|role_sep|>Q<|message_sep|>available functions"
                "<|role_sep|>[]<|message_sep|>assistant<|role_sep|>",
    # no system turn at all
    "yandex": " Пользователь: Hi\n\n Ассистент: Yo\n\n Пользователь: Q\n\n Ассистент:[SEP]",
    "bailing-think": "<role>SYSTEM</role>S<role>HUMAN</role>Hi<role>ASSISTANT</role>Yo<role>HUMAN</role>Q"
                     "<role>ASSISTANT</role><think>",
    "bailing2": "<role>SYSTEM</role>S<|role_end|><role>HUMAN</role>Hi<|role_end|><role>ASSISTANT</role>Yo<|role_end|>"
                "<role>HUMAN</role>Q<|role_end|><role>ASSISTANT</role>",
    # the hunyuan formats have no generation prompt
    "hunyuan-moe": "<|startoftext|>S<|extra_4|><|startoftext|>Hi<|extra_0|>Yo<|eos|><|startoftext|>Q<|extra_0|>",
    "hunyuan-dense": "S<｜hy_place▁holder▁no▁3｜><｜hy_User｜>Hi<｜hy_Assistant｜><｜hy_Assistant｜>Yo"
                     "<｜hy_place▁holder▁no▁2｜><｜hy_User｜>Q<｜hy_Assistant｜>",
    "hunyuan-vl": "<｜hy_begin▁of▁sentence｜>S<｜hy_place▁holder▁no▁3｜>Hi<｜hy_User｜>Yo<｜hy_Assistant｜>Q<｜hy_User｜>",
    "kimi-k2": "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
               "<|im_assistant|>assistant<|im_middle|>Yo<|im_end|><|im_user|>user<|im_middle|>Q<|im_end|>"
               "<|im_assistant|>assistant<|im_middle|>",
    "seed_oss": "<seed:bos>system\nS<seed:eos><seed:bos>user\nHi<seed:eos><seed:bos>assistant\nYo<seed:eos>"
                "<seed:bos>user\nQ<seed:eos><seed:bos>assistant\n",
    "grok-2": "System: S<|separator|>\n\nHuman: Hi<|separator|>\n\nAssistant: Yo<|separator|>\n\nHuman: Q<|separator|>"
              "\n\nAssistant:",
    "pangu-embedded": "[unused9]系统：S[unused10][unused9]用户：Hi[unused10][unused9]助手：Yo[unused10]"
                      "[unused9]用户：Q[unused10][unused9]助手：",
    "solar-open": "<|begin|>system<|content|>S<|end|><|begin|>user<|content|>Hi<|end|><|begin|>assistant<|content|>Yo"
                  "<|end|><|begin|>user<|content|>Q<|end|><|begin|>assistant",
}
EXPECTED["granite-4.0"] = EXPECTED["granite-4.1"] = EXPECTED["granite"]


def test_every_upstream_name_is_shipped_and_has_an_expectation():
    assert set(BUILTIN) == CHAT_TEMPLATE_NAMES
    assert set(EXPECTED) == set(BUILTIN)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_format_renders_the_conversation(name):
    assert render_chat(template(name), CONVERSATION, bos_token="<s>", eos_token="</s>") == EXPECTED[name]


@pytest.mark.parametrize("name,expected", [
    # trimmed formats drop the whitespace around a turn's text, the others keep it byte for byte
    ("llama3", "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"),
    ("chatml", "<|im_start|>user\n Hi \n<|im_end|>\n"),
    ("command-r", "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"),
    ("llama2-sys-strip", "[INST] Hi [/INST]"),
    ("llama2-sys", "[INST]  Hi \n [/INST]"),
    ("mistral-v3", "[INST]  Hi \n[/INST]"),
])
def test_trimming_follows_the_format(name, expected):
    msgs = [{"role": "user", "content": " Hi \n"}]
    assert render_chat(template(name), msgs, add_generation_prompt=False) == expected


@pytest.mark.parametrize("name,msgs,expected", [
    # a default system turn when the conversation does not open with one
    ("bailing2", [{"role": "user", "content": "Hi"}],
     "<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>Hi<|role_end|><role>ASSISTANT</role>"),
    ("pangu-embedded", [{"role": "user", "content": "Hi"}],
     "[unused9]系统：[unused10][unused9]用户：Hi[unused10][unused9]助手："),
    ("gigachat", [{"role": "user", "content": "Hi"}],
     "<s>user<|role_sep|>Hi<|message_sep|>available functions<|role_sep|>[]<|message_sep|>assistant<|role_sep|>"),
    # a system turn counts only as the first message; tool turns where the format has them
    ("hunyuan-dense", [{"role": "user", "content": "Hi"}, {"role": "system", "content": "S"}],
     "<｜hy_User｜>Hi<｜hy_Assistant｜>"),
    ("hunyuan-vl", [{"role": "user", "content": "Hi"}, {"role": "system", "content": "S"}],
     "<｜hy_begin▁of▁sentence｜>Hi<｜hy_User｜>"),
    ("kimi-k2", [{"role": "tool", "content": "42"}],
     "<|im_system|>tool<|im_middle|>42<|im_end|><|im_assistant|>assistant<|im_middle|>"),
    ("exaone4", [{"role": "tool", "content": " 42 "}], "[|tool|]42[|endofturn|]\n[|assistant|]"),
    ("granite-4.0", [{"role": "assistant_tool_call", "content": "[]"}],
     "<|start_of_role|>assistant<|end_of_role|><|tool_call|>[]<|end_of_text|>\n"
     "<|start_of_role|>assistant<|end_of_role|>"),
    ("granite", [{"role": "assistant_tool_call", "content": "[]"}],
     "<|start_of_role|>assistant_tool_call<|end_of_role|><|tool_call|>[]<|end_of_text|>\n"
     "<|start_of_role|>assistant<|end_of_role|>"),
    # seed_oss trims replies only; grok-2 trims all but replies
    ("seed_oss", [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": " Yo "}],
     "<seed:bos>user\n Hi <seed:eos><seed:bos>assistant\nYo<seed:eos><seed:bos>assistant\n"),
    ("grok-2", [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": " Yo "}],
     "Human: Hi<|separator|>\n\nAssistant:  Yo <|separator|>\n\nAssistant:"),
])
def test_format_edges(name, msgs, expected):
    assert render_chat(template(name), msgs) == expected


def test_rwkv_world_prompts_the_reply_after_a_last_user_turn_only():
    user = [{"role": "user", "content": "Hi"}]
    assert render_chat(template("rwkv-world"), user, add_generation_prompt=False) == "User: Hi\n\nAssistant:"
    reply = [*user, {"role": "assistant", "content": "Yo"}]
    assert render_chat(template("rwkv-world"), reply) == "User: Hi\n\nAssistant: Yo\n\n"


def test_mistral_v3_trims_replies_only():
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Yo \n"}]
    assert render_chat(template("mistral-v3"), msgs) == "[INST] Hi[/INST] Yo</s>"
    assert render_chat(template("mistral-v1"), msgs) == " [INST] Hi [/INST]  Yo \n</s>"


def test_bos_comes_from_the_tokenizer_rule():
    text = template("chatml")
    msgs = [{"role": "user", "content": "Hi"}]
    assert render_chat(with_bos(text, True), msgs, bos_token="<s>").startswith("<s><|im_start|>user")
    assert render_chat(with_bos(text, False), msgs, bos_token="<s>").startswith("<|im_start|>user")
    # a checkpoint's own template writes BOS itself when it wants one: left as it is
    own = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert with_bos(own, True) == own


def test_prompt_tokens_match_upstreams_tokenize_with_special_tokens():
    """Upstream tokenizes a built-in format's text with special tokens added; rendering with
    `with_bos` then tokenizing without them gives the same ids, with and without a BOS rule."""
    from mlxcel.engine.tokenizer import Tokenizer
    from tests.conftest import fixture_path
    from tests.fixtures import GEMMA3, QWEN3_TINY

    msgs = [{"role": "user", "content": "Hi"}]
    for model, adds in ((GEMMA3, True), (QWEN3_TINY, False)):
        tok = Tokenizer(fixture_path(model))
        assert tok.adds_bos is adds
        rendered = render_chat(with_bos(template("gemma"), tok.adds_bos), msgs, bos_token=tok.bos_token)
        assert tok.encode(rendered, add_special_tokens=False) == tok.encode(EXPECTED_GEMMA_ONE_TURN)


EXPECTED_GEMMA_ONE_TURN = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
