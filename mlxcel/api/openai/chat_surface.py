"""What a chat request adds around plain generation: tools, template kwargs, reasoning and
tool-call parsing of the output, as OpenAI message fields and stream deltas.

`prepare` renders the prompt (tools only when the request carries some and tool_choice is
not "none"; server and request template kwargs merged, the request winning) and decides how
the output will be parsed. `ChatOutput` turns generated text into deltas; the non-streamed
message is the merge of the same deltas, so both shapes agree byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlxcel.api.engine_request import reasoning_budget
from mlxcel.api.errors import ApiError
from mlxcel.api.openai import tool_grammar as tg
from mlxcel.api.state import AppState
from mlxcel.chat.chat_template import thinking_by_default
from mlxcel.chat.reasoning import FORMATS, THINK, ReasoningStream, ThinkMarkers, markers_for, primed
from mlxcel.chat.tool_calls import MARKERS, ToolCallStream
from mlxcel.engine.grammar import GrammarError
from mlxcel.engine.reasoning_budget import ReasoningBudget, ReasoningControl
from mlxcel.engine.types import GenerationRequest
from mlxcel.runtime.served import ServedModel
from mlxcel.steering.requests import server_steering


@dataclass
class Prepared:
    prompt: list[int]
    prompt_text: str
    prefill: str  # the continued assistant text ("" when not a continuation)
    tools: list[dict] | None
    reasoning_format: str
    parse: bool  # False under --skip-chat-parsing
    forced: tg.ToolChoice | None = None  # tool_choice "required" or a named function
    # tool-call markers that are special tokens: kept in the engine's text for the parser,
    # never shown to a client as content
    markers: dict[str, int] = field(default_factory=dict)
    budget: ReasoningBudget | None = None  # the thinking budget / run-time control, when asked for
    think: ThinkMarkers = THINK  # the thinking markers the template's model writes
    # thinking markers that are special tokens: kept in the engine's text for the reasoning parser
    think_ids: frozenset[int] = frozenset()

    @property
    def keep_tokens(self) -> frozenset[int]:
        return frozenset(self.markers.values()) | self.think_ids


def check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list", code="invalid_parameter", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           code="invalid_parameter", param="tools")
    return tools


def _tool_choice(choice: Any, tools: list[dict], parallel: bool) -> tuple[str, tg.ToolChoice | None]:
    """('auto' | 'none' | 'forced', the forced choice)."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    return "forced", tg.parse_choice(choice, tools, parallel)


def template_history(messages: list[Any]) -> list[Any]:
    """Assistant tool_calls with their JSON-text arguments as objects, as templates expect."""
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn = {**fn, "arguments": json.loads(fn["arguments"])}
                    except json.JSONDecodeError:
                        pass
                    c = {**c, "function": fn}
                calls.append(c)
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def template_kwargs(settings: Any, model: ServedModel, requested: Any, effort: Any) -> dict[str, Any]:
    """The template context extras of one request, as b10621 builds them: the server's kwargs
    (--chat-template-kwargs, --reasoning*) under the request's; a string `enable_thinking` is
    refused; `reasoning_effort: "none"` turns thinking off; and `enable_thinking` is always set,
    under --reasoning auto to whether the template has a thinking mode."""
    kwargs = dict(settings.chat.template_kwargs)
    if requested is not None:
        if not isinstance(requested, dict):
            raise ApiError(400, "chat_template_kwargs must be an object", code="invalid_parameter",
                           param="chat_template_kwargs")
        kwargs.update(requested)
    if isinstance(kwargs.get("enable_thinking"), str):
        raise ApiError(400, 'invalid type for "enable_thinking" (expected boolean, got string)',
                       code="invalid_parameter", param="chat_template_kwargs")
    if effort is not None:
        if not isinstance(effort, str):
            raise ApiError(400, "reasoning_effort must be a string", code="invalid_parameter",
                           param="reasoning_effort")
        if effort == "none":
            kwargs["enable_thinking"] = False
            kwargs.pop("reasoning_effort", None)
        elif effort:
            kwargs["reasoning_effort"] = effort
    if "enable_thinking" not in kwargs:
        tok = model.tokenizer
        kwargs["enable_thinking"] = bool(tok.chat_template) and \
            thinking_by_default(tok.chat_template, tok.bos_token, tok.eos_token)
    return kwargs


def prepare(state: AppState, model: ServedModel, req: Any) -> Prepared:
    from mlxcel.api.openai.chat import render_prompt_text

    settings = state.settings
    if not settings.chat.jinja:
        _refuse_without_jinja(req)
    tools = check_tools(req.tools) if req.tools else None
    forced = None
    if tools:
        mode, forced = _tool_choice(req.tool_choice, tools, req.parallel_tool_calls is not False)
        if mode == "none":
            tools = None
    elif req.tool_choice not in (None, "auto", "none"):
        raise ApiError(400, "tool_choice 'required' or a named function needs 'tools'", code="invalid_parameter",
                       param="tool_choice")
    if forced is not None and settings.chat.skip_parsing:
        raise ApiError(400, "tool_choice 'required' or a named function needs chat parsing, which "
                       "--skip-chat-parsing turns off", code="field_not_honoured", param="tool_choice")
    kwargs = template_kwargs(settings, model, req.chat_template_kwargs, req.reasoning_effort)
    fmt = req.reasoning_format if req.reasoning_format is not None else settings.chat.reasoning_format
    if fmt not in FORMATS:
        raise ApiError(400, f"reasoning_format must be one of {', '.join(FORMATS)}", code="invalid_parameter",
                       param="reasoning_format")
    messages = template_history(req.messages)
    prefill = ""
    if settings.chat.prefill_assistant and messages and isinstance(messages[-1], dict) \
            and messages[-1].get("role") == "assistant":
        prefill = messages[-1].get("content") or ""
        prefill = prefill if isinstance(prefill, str) else ""
    text = render_prompt_text(model, messages, tools=tools, extra=kwargs,
                              prefill_assistant=settings.chat.prefill_assistant)
    prompt = model.tokenizer.encode(text, add_special_tokens=False)
    think = markers_for(model.tokenizer.chat_template)
    budget = _budget(settings, model, req, think)
    parse = not settings.chat.skip_parsing and settings.chat.jinja
    markers = {}
    if parse and tools:
        markers = {m: i for m in MARKERS if (i := model.tokenizer.single_special(m)) is not None}
    think_ids = frozenset()
    if parse and fmt != "none":
        think_ids = frozenset(i for m in (think.open, think.close)
                              if (i := model.tokenizer.single_special(m)) is not None)
    return Prepared(prompt=prompt, prompt_text=text, prefill=prefill, tools=tools, reasoning_format=fmt,
                    parse=parse, forced=forced, markers=markers, budget=budget, think=think, think_ids=think_ids)


def _refuse_without_jinja(req: Any) -> None:
    """--no-jinja: b10621 formats with its built-in formats then, which take no tools."""
    if req.tools:
        raise ApiError(400, "tools param requires --jinja flag", code="invalid_request", param="tools")
    if req.tool_choice is not None and req.tool_choice != "auto":
        raise ApiError(400, "tool_choice param requires --jinja flag", code="invalid_request", param="tool_choice")


INT32_MAX = 2**31 - 1


def _budget(settings: Any, model: ServedModel, req: Any, think: ThinkMarkers = THINK) -> ReasoningBudget | None:
    """The thinking budget of a request: its own fields over --reasoning-budget(-message); its
    tags default to the thinking markers of the template's model."""
    n = req.reasoning_budget_tokens if req.reasoning_budget_tokens is not None else settings.chat.reasoning_budget
    if isinstance(n, bool) or not isinstance(n, int) or not -1 <= n <= INT32_MAX:
        raise ApiError(400, f"Field 'reasoning_budget_tokens': Value must be between -1 <= value <= {INT32_MAX}, "
                       f"but got {n}", code="invalid_parameter", param="reasoning_budget_tokens")
    control = ReasoningControl() if req.reasoning_control else None
    if n < 0 and control is None:
        return None
    ends = req.reasoning_budget_end_tags or ([req.reasoning_budget_end_tag] if req.reasoning_budget_end_tag else [])
    start, end = req.reasoning_budget_start_tag or think.open, (ends[0] if ends else think.close)
    message = req.reasoning_budget_message
    message = settings.chat.reasoning_budget_message if message is None else message
    if not isinstance(end, str) or not end:
        raise ApiError(400, "reasoning_budget_end_tags must be non-empty strings", code="invalid_parameter",
                       param="reasoning_budget_end_tags")
    return reasoning_budget(model, n, start, end, message, control)


@dataclass
class ChatJob:
    """A translated chat request (/v1/messages, /v1/responses) ready for the stream runner."""
    prep: Prepared
    request: GenerationRequest
    headers: dict[str, str]  # the route's field headers plus the live server-steering values


async def job(state: AppState, model: ServedModel, req: Any, field_headers: dict[str, str],
              images: list | None = None, param: str = "messages", logprobs: Any = None) -> ChatJob:
    """Render, validate the sampling and build the engine request (any forced tool-call grammar
    and the reasoning budget from the rendering), and apply the server's steering. `images`:
    decoded pictures whose placeholders `req` already carries (api/media.py)."""
    from mlxcel.api import media
    from mlxcel.api.openai import generation as g

    prep = prepare(state, model, req)
    greq = g.build_request(g.validate_sampling(req, logprobs), model, prep.prompt)  # logprobs: a LogprobsAsk
    greq.grammar = await tool_grammar(prep, model)
    greq.keep_tokens = prep.keep_tokens
    greq.reasoning = prep.budget
    if images:
        await media.attach(model, greq, images, param)
    headers = {**field_headers, **server_steering(state, model, [greq])}
    return ChatJob(prep=prep, request=greq, headers=headers)


async def tool_grammar(prep: Prepared, model: ServedModel) -> Any:
    """The compiled grammar a forced tool_choice decodes under (None when nothing is forced)."""
    if prep.forced is None:
        return None
    import asyncio

    hf = model.tokenizer.hf
    thinking_open = prep.reasoning_format != "none" and primed(prep.prompt_text, prep.think)
    text = tg.lark(prep.forced, tg.family_format(model.tokenizer.chat_template),
                   lambda s: hf.encode(s, add_special_tokens=False), thinking_open, prep.think.close)
    try:
        return await asyncio.to_thread(model.grammars.compile, "lark", text)
    except GrammarError as e:
        raise ApiError(400, f"the tools' parameter schemas cannot be compiled for tool_choice: {e}",
                       code="field_not_honoured", param="tool_choice") from None


class ChatOutput:
    """Generated text in, OpenAI chat deltas out (reasoning, content, tool calls)."""

    def __init__(self, prep: Prepared, *, parallel_tool_calls: bool = True, echo: bool = False) -> None:
        self._parse = prep.parse
        # echoed, the prefill is parsed as output, so the thinking state is the prompt's without it
        context = prep.prompt_text[: len(prep.prompt_text) - len(prep.prefill)] if echo else prep.prompt_text
        self._reason = ReasoningStream(prep.reasoning_format if prep.parse else "none", primed(context, prep.think),
                                       prep.think)
        self._tools = ToolCallStream() if prep.parse and prep.tools else None
        self._parallel = parallel_tool_calls
        self._markers = tuple(prep.markers)
        self._echo = prep.prefill if echo else ""
        self.n_calls = 0
        self.cut_calls: set[str] = set()  # ids of calls cut off by the token limit

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._echo:
            text, self._echo = self._echo + text, ""
        return self._shape(self._reason.feed(text), final=False)

    def finish(self, reason: str | None = None) -> list[dict[str, Any]]:
        """The last deltas; `reason` the engine's finish reason: a call cut off by "length"
        is still a tool call, its arguments the text written so far."""
        deltas = self.feed("") if self._echo else []
        return deltas + self._shape(self._reason.finish(), final=True, cut=reason == "length")

    def _shape(self, split, final: bool, cut: bool = False) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if split.reasoning:
            thought = split.reasoning
            for m in self._markers:
                thought = thought.replace(m, "")
            if thought:
                deltas.append({"reasoning_content": thought})
        if self._tools is None:
            if split.content:
                deltas.append({"content": split.content})
            return deltas
        pieces = self._tools.feed(split.content)
        if final:
            pieces += self._tools.finish(truncated=cut)
        for p in pieces:
            if p.call is None:
                text = p.content
                for m in self._markers:  # a marker of text that did not parse as a call
                    text = text.replace(m, "")
                if text:
                    deltas.append({"content": text})
            elif self._parallel or p.index == 0:
                self.n_calls += 1
                if p.call.truncated:
                    self.cut_calls.add(p.call.id)
                deltas.append({"tool_calls": [{"index": p.index, "id": p.call.id, "type": "function",
                                               "function": {"name": p.call.name, "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": p.index, "function": {"arguments": p.call.arguments}}]})
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.n_calls and reason == "stop" else reason


def message(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-streamed assistant message these deltas add up to."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        content.append(d.get("content", ""))
        reasoning.append(d.get("reasoning_content", ""))
        for tc in d.get("tool_calls", ()):
            slot = calls.setdefault(tc["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] = tc.get("id", slot["id"])
            slot["function"]["name"] += tc.get("function", {}).get("name", "")
            slot["function"]["arguments"] += tc.get("function", {}).get("arguments", "")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(content) or (None if calls else "")}
    if any(reasoning):
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def with_alias(shape: dict[str, Any], policy: str) -> dict[str, Any]:
    """--reasoning-alias-field reasoning: a delta or message carrying reasoning_content also
    carries the same text as `reasoning` (none: b10621's field alone)."""
    if policy == "reasoning" and "reasoning_content" in shape:
        return {**shape, "reasoning": shape["reasoning_content"]}
    return shape
