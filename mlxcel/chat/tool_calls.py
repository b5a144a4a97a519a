"""Tool calls out of generated text: Hermes/Qwen, Command R7B, Llama 3.x, Mistral and plain JSON.

One incremental machine (`ToolCallStream`) does all the parsing; the one-shot
`parse_tool_calls` runs the same machine over the whole text, so a streamed response and
a non-streamed one agree by construction, whatever the chunking. Recognised shapes:

- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated; a
  call is released as soon as its closing tag arrives (an unclosed last one is tried at EOS).
- Command R7B: `<|START_ACTION|>[{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}]<|END_ACTION|>`,
  a list of calls per block, released like Hermes's.
- Llama 3.x: `<|python_tag|>{"name": ..., "parameters": {...}}` (`;`-separated), or the whole
  output being such a JSON object.
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` and the newer
  `[TOOL_CALLS]name[ARGS]{...}`.
- Generic JSON: the whole output (optionally in a ```json fence) is one call object, a list
  of them, or `{"tool_calls": [...]}`.

Text that does not parse as a call stays content, never dropped. Whitespace that only
separates content from calls is not reported as content. Text a model writes after a
complete call (a length stop before its end token) is content after the call; for the
whole-output JSON shape only when each call spells out its arguments, so an answer that
merely opens with a JSON object is not taken for a call.

A generation cut off inside a call (`finish(truncated=True)`, a length stop) still reports
that call once its name is complete: `truncated` set, and `arguments` the text written so
far, not valid JSON (as OpenAI reports a call cut by `max_tokens`, under `finish_reason:
"length"`). A call cut before its name ends stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
ACTION_OPEN, ACTION_CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"
PAIRED = {HERMES_OPEN: HERMES_CLOSE, ACTION_OPEN: ACTION_CLOSE}  # tags that enclose each block of calls
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_MARKERS = (HERMES_OPEN, ACTION_OPEN, PYTHON_TAG, MISTRAL_TAG)
# every marker a family writes; those that are special tokens must reach the parser as text
MARKERS = (HERMES_OPEN, HERMES_CLOSE, ACTION_OPEN, ACTION_CLOSE, PYTHON_TAG, MISTRAL_TAG, MISTRAL_ARGS)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text (a prefix of it when truncated)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    truncated: bool = False

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(obj) -> ToolCall | None:
    """A call object in any of the dialects' spellings, else None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" in obj["function"]:
        obj = obj["function"]
    name = obj.get("name", obj.get("tool_name"))  # tool_name: Command R7B's spelling
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _leading_values(text: str) -> tuple[list, str]:
    """The JSON values that open `text` (separated by whitespace, ';' or ','), and the rest."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        j = i
        while j < n and text[j] in " \t\r\n;,":
            j += 1
        if j >= n:
            return out, ""
        try:
            value, i = dec.raw_decode(text, j)
        except json.JSONDecodeError:
            return out, text[i:]
        out.append(value)


def _json_values(text: str) -> list | None:
    """Consecutive JSON values separated by whitespace, ';' or ','; None if anything else."""
    values, rest = _leading_values(text)
    return None if rest else values


def _leading_calls(text: str, explicit: bool = False) -> tuple[list[ToolCall] | None, str]:
    """The calls that open `text` and the text after them (a model may write on after its
    call, e.g. where generation stopped on a length limit rather than its end token).
    `explicit`: with trailing text, each call must spell out its arguments, so an answer that
    merely opens with some JSON object is not taken for a call."""
    values, rest = _leading_values(text)
    if rest and explicit and not all(_spells_arguments(v) for v in values):
        return None, text
    calls = _calls_from_values(values)
    return (calls, rest) if calls else (None, text)


def _spells_arguments(value) -> bool:
    items = value["tool_calls"] if isinstance(value, dict) and isinstance(value.get("tool_calls"), list) else \
        value if isinstance(value, list) else [value]
    return all(isinstance(v, dict) and (isinstance(v.get("function"), dict) or "arguments" in v or "parameters" in v)
               for v in items)


def _calls_from_values(values: list | None) -> list[ToolCall] | None:
    if not values:
        return None
    flat: list = []
    for v in values:
        if isinstance(v, dict) and isinstance(v.get("tool_calls"), list):
            flat.extend(v["tool_calls"])
        elif isinstance(v, list):
            flat.extend(v)
        else:
            flat.append(v)
    calls = [_call_from(v) for v in flat]
    return None if not calls or any(c is None for c in calls) else calls


# the opening of a call object cut short: its name complete, its arguments begun
_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*)', re.S)


def _cut_calls(text: str) -> list[ToolCall] | None:
    """The calls of text cut off inside a call: the complete ones before it (alone or in an
    array), then the cut one, flagged. None unless the cut call's name is complete."""
    body = text.strip()
    body = body[1:] if body.startswith("[") else body
    calls, rest = _leading_calls(body)
    m = _CUT_CALL.match(rest.lstrip(" \t\r\n,"))
    name = json.loads(m.group(1)) if m else ""
    if not name:  # complete calls in an array cut before its end are still calls
        return calls if calls and not rest.strip(" \t\r\n,") else None
    return [*(calls or []), ToolCall(name=name, arguments=m.group(2), truncated=True)]


def _cut_mistral(text: str) -> list[ToolCall] | None:
    """`[TOOL_CALLS]...` text cut off inside its last call."""
    head, _, last = text.rpartition(MISTRAL_TAG)
    done: list[ToolCall] = []
    if head.strip():
        done, rest = _mistral_calls(head)
        if done is None or rest.strip():
            return None
    if MISTRAL_ARGS in last:  # name[ARGS]{...
        name, _, args = last.partition(MISTRAL_ARGS)
        return [*done, ToolCall(name=name.strip(), arguments=args, truncated=True)] if name.strip() else None
    cut = _cut_calls(last)
    return [*done, *cut] if cut else None


def parse_json_calls(text: str) -> list[ToolCall] | None:
    """The whole text as plain-JSON call(s) (a ```json fence allowed), else None."""
    body = text.strip()
    m = _FENCE.match(body)
    if m:
        body = m.group(1)
    return _calls_from_values(_json_values(body))


def _mistral_calls(text: str) -> tuple[list[ToolCall] | None, str]:
    """The calls of `[TOOL_CALLS]...` text and the text after the last one."""
    calls: list[ToolCall] = []
    rest = ""
    for part in text.split(MISTRAL_TAG):
        if not part.strip():
            continue
        if rest.strip():  # text between two calls: not a call sequence
            return None, text
        if MISTRAL_ARGS in part:  # name[ARGS]{...}
            name, _, args = part.partition(MISTRAL_ARGS)
            values, rest = _leading_values(args)
            one = _call_from({"name": name.strip(), "arguments": values[0]}) if len(values) == 1 else None
            more = [one] if one is not None else None
        else:
            more, rest = _leading_calls(part)
        if more is None:
            return None, text
        calls.extend(more)
    return (calls, rest) if calls else (None, text)


@dataclass
class Piece:
    """One output of the stream: content text, or one complete call (with its index)."""

    content: str = ""
    call: ToolCall | None = None
    index: int = -1


class ToolCallStream:
    """Feed generated text; get content and complete calls back, in order."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet decided
        self._mode = "start"  # start -> text | json (whole output) ; text -> calls
        self._ws = ""  # whitespace held until we know whether calls follow
        self._calls = 0
        self._tail: list[str] = []  # non-call text met after the first call
        self._tag = ""  # the marker that opened call mode
        self._truncated = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return self._drain(final=False)

    def finish(self, truncated: bool = False) -> list[Piece]:
        """The rest, once generation ended; `truncated`: it was cut off (a length stop), so an
        unfinished call is reported as a truncated call."""
        self._truncated = truncated
        return self._drain(final=True)

    @property
    def n_calls(self) -> int:
        return self._calls

    def _call(self, call: ToolCall) -> Piece:
        self._calls += 1
        return Piece(call=call, index=self._calls - 1)

    def _content(self, text: str) -> list[Piece]:
        """Release content, holding back trailing whitespace."""
        if not text:
            return []
        body = text.rstrip()
        out = self._ws + body if body else ""
        self._ws = text[len(body):] if body else self._ws + text
        return [Piece(content=out)] if out else []

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        if self._mode == "start":
            stripped = self._buf.lstrip()
            if not stripped and not final:
                return out
            self._mode = "json" if stripped[:1] in ("{", "[", "`") else "text"
        if self._mode == "json":
            if not final:
                return out
            calls = parse_json_calls(self._buf)
            if calls:
                return [self._call(c) for c in calls]
            calls, rest = _leading_calls(self._buf.lstrip(), explicit=True)
            if calls:
                out = [self._call(c) for c in calls]
                return out + ([Piece(content=rest)] if rest.strip() else [])
            calls = _cut_calls(self._buf) if self._truncated else None
            if calls:
                return [self._call(c) for c in calls]
            self._mode = "text"
        if self._mode == "text":
            hit = min(((self._buf.find(m), m) for m in _MARKERS if m in self._buf), default=None)
            if hit is None:
                keep = 0 if final else _partial_marker_len(self._buf)
                out += self._content(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                if final and self._ws:
                    out.append(Piece(content=self._ws))
                    self._ws = ""
                return out
            pos, self._tag = hit
            out += self._content(self._buf[:pos])
            self._buf = self._buf[pos:]
            self._mode = "calls"
        return out + self._drain_calls(final)

    def _drain_calls(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        if self._tag in PAIRED:
            opener, closer = self._tag, PAIRED[self._tag]
            while True:
                start = self._buf.find(opener)
                end = self._buf.find(closer, start + 1) if start >= 0 else -1
                if start < 0 or end < 0:
                    break
                self._note_tail(self._buf[:start])
                body = self._buf[start + len(opener): end]
                calls = _calls_from_values(_json_values(body))
                if calls:
                    out += [self._call(c) for c in calls]
                else:
                    self._tail.append(self._buf[start: end + len(closer)])
                self._buf = self._buf[end + len(closer):]
            if final:
                start = self._buf.find(opener)
                if start >= 0:
                    self._note_tail(self._buf[:start])
                    body = self._buf[start + len(opener):]
                    calls = _calls_from_values(_json_values(body)) or (_cut_calls(body) if self._truncated else None)
                    if calls:
                        out += [self._call(c) for c in calls]
                    else:
                        self._tail.append(self._buf[start:])
                else:
                    self._note_tail(self._buf)
                self._buf = ""
        elif final:
            body = self._buf[len(self._tag):]
            calls, rest = _mistral_calls(self._buf) if self._tag == MISTRAL_TAG else _leading_calls(body)
            if not calls and self._truncated:
                calls, rest = (_cut_mistral(self._buf) if self._tag == MISTRAL_TAG else _cut_calls(body)), ""
            if calls:
                out += [self._call(c) for c in calls]
                self._note_tail(rest)
            else:
                self._tail.append(self._buf)
            self._buf = ""
        if final:
            tail = "".join(self._tail)
            if tail:
                out.append(Piece(content=(self._ws if self._calls == 0 else "") + tail))
            elif self._calls == 0 and self._ws:
                out.append(Piece(content=self._ws))
            self._ws, self._tail = "", []
        return out

    def _note_tail(self, text: str) -> None:
        if text.strip():
            self._tail.append(text)


def _partial_marker_len(text: str) -> int:
    """How many trailing characters could be the start of a marker."""
    best = 0
    for m in _MARKERS:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


def parse_tool_calls(text: str, truncated: bool = False) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole generation; the same answer the stream gives."""
    s = ToolCallStream()
    pieces = s.feed(text) + s.finish(truncated)
    return "".join(p.content for p in pieces), [p.call for p in pieces if p.call is not None]
