"""Render chat messages with the checkpoint's own Jinja template, HF semantics.

Differences from a naive render that matter: `tools` is left undefined (not `[]` or
`None`) when a request carries none, because published templates test definedness to
decide whether to emit a tool preamble; `raise_exception` surfaces a template's own
refusal as a client error; the rendered text already carries BOS when the template
writes it, so it is tokenized without adding special tokens again.

The context is b10621's: `date_string` ("26 Jul 2024" style) and `datetime` ("Jul 26 2024")
are today's (Llama 3.1/3.3 print `date_string`, 3.2 calls `strftime_now`); a boolean
`reasoning_effort` / `preserve_reasoning` is also offered under the other names templates read
(`reasoning_strength`; `preserve_thinking`, `clear_thinking`, `truncate_history_thinking`,
`drop_thinking`); the caller's `extra` (template kwargs) wins over all of them.
`thinking_by_default` is `--reasoning auto`: whether the template has a thinking mode at all.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxcel.chat.reasoning import markers_for, primed


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


def base_context(extra: dict[str, Any] | None, now: datetime | None = None) -> dict[str, Any]:
    """Today's dates and the reasoning aliases under the caller's template kwargs."""
    now = now or datetime.now()
    ctx: dict[str, Any] = {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}
    ctx.update(extra or {})
    effort, keep = ctx.get("reasoning_effort"), ctx.get("preserve_reasoning")
    if isinstance(effort, str) and effort:
        ctx.setdefault("reasoning_strength", effort)
    if isinstance(keep, bool):
        for name, value in (("preserve_thinking", keep), ("clear_thinking", not keep),
                            ("truncate_history_thinking", not keep), ("drop_thinking", not keep)):
            ctx.setdefault(name, value)
    return ctx


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict] | None = None,
    extra: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> str:
    ctx = base_context(extra, now)
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


@lru_cache(maxsize=16)
def thinking_by_default(template: str, bos_token: str | None = None, eos_token: str | None = None) -> bool:
    """b10621's `--reasoning auto`: thinking is on when the template has a thinking mode, read
    here as a one-turn probe that renders differently with `enable_thinking` true and false, or
    that leaves a thinking block open for the answer (DeepSeek-R1 distills, QwQ)."""
    probe = [{"role": "user", "content": "test"}]
    try:
        on, off = (render_chat(template, probe, bos_token=bos_token, eos_token=eos_token,
                               extra={"enable_thinking": flag}) for flag in (True, False))
    except TemplateError:
        return False
    return on != off or primed(on, markers_for(template))


def render_plain(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The fallback for a checkpoint without a template: role-tagged lines."""
    out = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
    return out + ("assistant:" if add_generation_prompt else "")
