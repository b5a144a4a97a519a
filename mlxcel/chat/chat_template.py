"""Render chat messages with the checkpoint's own Jinja template, HF semantics.

Differences from a naive render that matter: `tools` is left undefined (not `[]` or
`None`) when a request carries none, because published templates test definedness to
decide whether to emit a tool preamble; `raise_exception` surfaces a template's own
refusal as a client error; the rendered text already carries BOS when the template
writes it, so it is tokenized without adding special tokens again.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    import json

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    ctx: dict[str, Any] = dict(extra or {})
    ctx.update(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
    )
    if tools:
        ctx["tools"] = tools
    try:
        return _compile(template).render(**ctx)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed to render: {e}") from e


def render_plain(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The fallback for a checkpoint without a template: role-tagged lines."""
    out = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
    return out + ("assistant:" if add_generation_prompt else "")
