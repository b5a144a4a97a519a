"""Thinking blocks out of generated text, placed as `--reasoning-format` says.

The marker pair is `<think>` / `</think>` (Qwen3, DeepSeek-R1 and their derivatives), or
Command R7B's `<|START_THINKING|>` / `<|END_THINKING|>` where the chat template names that
pair (`markers_for`, as b10621 picks its Command R7B format from the template). A block
opens either in the output itself (the open marker first, after whitespace) or in the
prompt: a generation prompt that ends inside an open block "primes" it, and the model then
only ever writes the close marker.

Placement per format (b10621's table):
- `none`: no split; everything is content, markers included.
- `deepseek` (and `auto`, which resolves to it): thoughts -> reasoning, the answer (leading
  whitespace trimmed) -> content.
- `deepseek-legacy`: thoughts -> reasoning, and content keeps the whole text with markers
  (a primed open marker is re-emitted so the content reads as a complete block).

`ReasoningStream` is incremental; `split_reasoning` runs it over a whole text, so the
streamed and non-streamed shapes agree byte for byte by construction.
"""

from __future__ import annotations

from mlxcel.config.limits import echo
from dataclasses import dataclass

FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")


@dataclass(frozen=True)
class ThinkMarkers:
    open: str
    close: str


THINK = ThinkMarkers("<think>", "</think>")
COMMAND_R7B = ThinkMarkers("<|START_THINKING|>", "<|END_THINKING|>")
OPEN, CLOSE = THINK.open, THINK.close


def markers_for(template: str | None) -> ThinkMarkers:
    """The thinking markers the model of this chat template writes: Command R7B's pair where
    the template writes both of its markers, else `<think>`."""
    if template and COMMAND_R7B.open in template and COMMAND_R7B.close in template:
        return COMMAND_R7B
    return THINK


def primed(prompt_text: str, markers: ThinkMarkers = THINK) -> bool:
    """Does the rendered prompt end inside an open thinking block?"""
    return prompt_text.rfind(markers.open) > prompt_text.rfind(markers.close)


def resolve(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown reasoning format {echo(fmt)!r} (expected one of {', '.join(FORMATS)})")
    return "deepseek" if fmt == "auto" else fmt


@dataclass
class Split:
    content: str = ""
    reasoning: str = ""


def _partial(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningStream:
    def __init__(self, fmt: str, primed_open: bool = False, markers: ThinkMarkers = THINK) -> None:
        self.fmt = resolve(fmt)
        self.open, self.close = markers.open, markers.close
        self._state = "think" if primed_open else "start"  # start | think | answer
        self._buf = ""
        self._ws = ""  # trailing reasoning whitespace, held until more thought arrives
        self._lead = True  # still trimming the leading whitespace of the current part
        if primed_open and self.fmt == "deepseek-legacy":
            self._pending_content = self.open
        else:
            self._pending_content = ""

    @property
    def thinking(self) -> bool:
        return self._state == "think"

    def feed(self, text: str) -> Split:
        if self.fmt == "none":
            return Split(content=text)
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> Split:
        if self.fmt == "none":
            return Split()
        return self._drain(final=True)

    def _drain(self, final: bool) -> Split:
        out = Split(content=self._pending_content)
        self._pending_content = ""
        legacy = self.fmt == "deepseek-legacy"
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(self.open):
                    if legacy:
                        out.content += self._buf[: len(self._buf) - len(stripped) + len(self.open)]
                    self._buf = stripped[len(self.open):]
                    self._state, self._lead = "think", True
                    continue
                if not final and (not stripped or self.open.startswith(stripped)):
                    return out
                self._state, self._lead = "answer", False
                continue
            if self._state == "think":
                pos = self._buf.find(self.close)
                upto = pos if pos >= 0 else len(self._buf) - (0 if final else _partial(self._buf, self.close))
                piece = self._buf[:upto]
                if legacy:
                    out.content += piece
                self._think(piece, out)
                self._buf = self._buf[upto:]
                if pos < 0:
                    return out
                if legacy:
                    out.content += self.close
                self._buf = self._buf[len(self.close):]
                self._ws, self._state, self._lead = "", "answer", not legacy
                continue
            # answer
            if self._lead:
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    return out
                self._buf, self._lead = stripped, False
            out.content += self._buf
            self._buf = ""
            return out

    def _think(self, piece: str, out: Split) -> None:
        if self._lead:
            piece = piece.lstrip()
            if not piece:
                return
            self._lead = False
        body = piece.rstrip()
        if body:
            out.reasoning += self._ws + body
            self._ws = piece[len(body):]
        else:
            self._ws += piece


def split_reasoning(text: str, fmt: str, primed_open: bool = False, markers: ThinkMarkers = THINK) -> Split:
    s = ReasoningStream(fmt, primed_open, markers)
    a, b = s.feed(text), s.finish()
    return Split(content=a.content + b.content, reasoning=a.reasoning + b.reasoning)
