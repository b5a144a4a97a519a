"""Appliers for the chat-template options and --log-prompts-dir (options_table.py's rows call them)."""

from __future__ import annotations

from mlxcel.chat import builtin_templates
from mlxcel.cli import options_apply as a
from mlxcel.config.refusal import StartupRefusal

CHAT_TEMPLATE_NAMES = frozenset(
    "bailing bailing-think bailing2 chatglm3 chatglm4 chatml command-r deepseek deepseek-ocr deepseek2 "
    "deepseek3 exaone-moe exaone3 exaone4 falcon3 gemma gigachat glmedge gpt-oss granite granite-4.0 "
    "granite-4.1 grok-2 hunyuan-dense hunyuan-moe hunyuan-vl kimi-k2 llama2 llama2-sys llama2-sys-bos "
    "llama2-sys-strip llama3 llama4 megrez minicpm mistral-v1 mistral-v3 mistral-v3-tekken mistral-v7 "
    "mistral-v7-tekken monarch openchat orion pangu-embedded phi3 phi4 rwkv-world seed_oss smolvlm "
    "solar-open vicuna vicuna-orca yandex zephyr".split()
)


def chat_template(from_file: bool):
    """Jinja text inline or from a file, or one of b10621's built-in template names (the
    format written as Jinja: chat/builtin_templates.py)."""

    def apply(settings, value: str, spelling: str) -> None:
        text = a.read_text(value, spelling) if from_file else value
        name = text.strip()
        if name in CHAT_TEMPLATE_NAMES:
            text = builtin_templates.template(name)
        if not text.strip():
            raise StartupRefusal(f"{spelling}: the chat template is empty")
        import jinja2

        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        except jinja2.TemplateSyntaxError as e:
            raise StartupRefusal(f"{spelling}: the chat template is not valid Jinja (line {e.lineno}: "
                                   f"{e.message})") from None
        if from_file:
            settings.chat.template_file = text
        else:
            settings.chat.template = text

    return apply


def log_prompts_dir(settings, value: str, spelling: str) -> None:
    raise StartupRefusal(
        f"{spelling} {value}: mlxcel never writes request prompts to disk; for request-level debugging use "
        f"--log-file PATH with --verbosity 4"
    )
