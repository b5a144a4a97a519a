"""The OpenAI wire formats of /v1/chat/completions and /v1/completions: how a row's events
become `chat.completion.chunk` / `text_completion` frames (then `data: [DONE]`), and how the
rows' results become the non-streamed body. The stream runner (api/stream_runner.py) drives
them; the routes build them with what their validation produced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxcel.api.llamacpp.render import timings_json
from mlxcel.api.openai import response_format as rf
from mlxcel.api.openai.chat_surface import ChatOutput, message, with_alias
from mlxcel.api.openai.generation import error_frame, usage
from mlxcel.api.openai.logprobs import ChatLogprobs, TextLogprobs
from mlxcel.api.stream_runner import Encoder, Run, sse
from mlxcel.engine.requests import RequestHandle
from mlxcel.engine.types import TokenEvent
from mlxcel.steering.requests import ActivationReader

DONE = b"data: [DONE]\n\n"


def drafted(ev: TokenEvent) -> bool:
    """A speculated request carries b10621's top-level `timings` object (with the draft counters);
    upstream puts it on every chat completion, mlxcel only where a verify round ran (or where
    `timings_per_token` asks for it)."""
    return ev.timings is not None and ev.timings.draft_n is not None


def with_timings(chunk: dict[str, Any], ev: TokenEvent, asked: bool) -> dict[str, Any]:
    """b10621's `timings` on a chunk (or body): where the request sent `timings_per_token`, on
    every event that carries figures; else only on a speculated request's last."""
    if ev.timings is not None and (asked or (ev.done and drafted(ev))):
        chunk["timings"] = timings_json(ev.timings, ev.prompt_tokens)
    return chunk


class ChatEncoder(Encoder):
    """Chat completion choices, one `ChatOutput` parser per row (streaming has one row)."""

    trailer = DONE

    def __init__(self, base: dict[str, Any], fingerprint: str, outputs: list[ChatOutput], *, alias: str,
                 include_usage: bool = False, reader: ActivationReader | None = None,
                 constraint: rf.Constraint | None = None,
                 on_begin: Callable[[list[RequestHandle]], None] | None = None,
                 logprobs: ChatLogprobs | None = None, timings: bool = False) -> None:
        self.base, self.fingerprint, self.outputs, self.alias = base, fingerprint, outputs, alias
        self.timings = timings  # timings_per_token
        self.include_usage, self.reader, self.constraint = include_usage, reader, constraint
        self.logprobs = logprobs
        self.on_begin = on_begin  # arms reasoning_control under the completion id

    def begin(self, handles: list[RequestHandle]) -> None:
        if self.on_begin is not None:
            self.on_begin(handles)

    def _chunk(self, **fields: Any) -> dict[str, Any]:
        return {**self.base, "object": "chat.completion.chunk", **fields}

    def opening(self) -> list[bytes]:
        return [sse(self._chunk(system_fingerprint=self.fingerprint, choices=[
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))]

    def error(self, ev: TokenEvent) -> bytes:
        return error_frame(ev)

    def frames(self, index: int, ev: TokenEvent) -> list[bytes]:
        out = self.outputs[0]
        deltas = out.feed(ev.text) + (out.finish(ev.finish_reason) if ev.done else [])
        # the tokens' logprobs ride on the first chunk that goes out with (or after) their text
        logprobs = self.logprobs.event(ev, bool(deltas) or ev.done) if self.logprobs is not None else None
        frames = []
        for i, delta in enumerate(deltas if not ev.done else [*deltas, {}]):
            last = ev.done and i == len(deltas)  # the empty delta after the last one carries the finish
            choice = {"index": 0, "delta": with_alias(delta, self.alias),
                      "finish_reason": out.finish_reason(ev.finish_reason) if last else None}
            if self.logprobs is not None:
                choice["logprobs"], logprobs = logprobs, None
            chunk = self._chunk(system_fingerprint=self.fingerprint, choices=[choice])
            if last:
                chunk["usage"] = usage([ev])
            if last or self.timings:
                with_timings(chunk, ev, self.timings)
            frames.append(sse(chunk))
        if ev.done and self.include_usage:
            frames.append(sse(self._chunk(choices=[], usage=usage([ev]))))
        if ev.done and self.reader is not None:  # the activations: one last chunk before [DONE]
            frames.append(sse(self._chunk(choices=[], millm={"sae_activations": self.reader.render()})))
        return frames

    def body(self, runs: list[Run]) -> dict[str, Any]:
        finals = [r.final for r in runs]
        if self.constraint is not None:
            for r in runs:
                rf.check_output(self.constraint, r.text, r.final.finish_reason)
        choices = [{"index": i, "message": with_alias(message(o.feed(r.text) + o.finish(r.final.finish_reason)),
                                                      self.alias),
                    "logprobs": self.logprobs.whole(r) if self.logprobs is not None else None,
                    "finish_reason": o.finish_reason(r.final.finish_reason)}
                   for i, (r, o) in enumerate(zip(runs, self.outputs))]
        body = {**self.base, "object": "chat.completion", "system_fingerprint": self.fingerprint,
                "choices": choices, "usage": usage(finals)}
        with_timings(body, finals[0], self.timings)
        if self.reader is not None:
            body["millm"] = {"sae_activations": self.reader.render()}
        return body


class CompletionEncoder(Encoder):
    """Text completion choices, one per row in prompt order; streamed rows interleave. With
    `echo`, each choice's text (and logprobs) open with its prompt's."""

    trailer = DONE

    def __init__(self, base: dict[str, Any], fingerprint: str, *, include_usage: bool = False,
                 reader: ActivationReader | None = None, echo: list[str] | None = None,
                 logprobs: TextLogprobs | None = None, timings: bool = False) -> None:
        self.base, self.fingerprint, self.timings = base, fingerprint, timings
        self.include_usage, self.reader, self.echo, self.logprobs = include_usage, reader, echo, logprobs
        self.finals: list[TokenEvent] = []

    def _choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self) -> list[bytes]:
        return [sse({**self.base, "system_fingerprint": self.fingerprint, "choices": [self._choice(
            i, text, self.logprobs.opening(i) if self.logprobs is not None else None, None)]})
            for i, text in enumerate(self.echo or [])]

    def error(self, ev: TokenEvent) -> bytes:
        return error_frame(ev)

    def frames(self, index: int, ev: TokenEvent) -> list[bytes]:
        if ev.done:
            self.finals.append(ev)
        emit = bool(ev.text) or ev.done
        logprobs = self.logprobs.event(index, ev, emit) if self.logprobs is not None else None
        if not emit:
            return []
        return [sse(with_timings({**self.base, "system_fingerprint": self.fingerprint,
                                  "choices": [self._choice(index, ev.text, logprobs, ev.finish_reason)]},
                                 ev, self.timings))]

    def closing(self, finished: bool) -> list[bytes]:
        frames = []
        if self.include_usage:
            frames.append(sse({**self.base, "choices": [], "usage": usage(self.finals)}))
        if self.reader is not None:  # the activations: one last chunk before [DONE]
            frames.append(sse({**self.base, "choices": [], "millm": {"sae_activations": self.reader.render()}}))
        return frames

    def body(self, runs: list[Run]) -> dict[str, Any]:
        out = {**self.base, "system_fingerprint": self.fingerprint,
               "choices": [self._choice(i, (self.echo[i] if self.echo else "") + r.text,
                                        self.logprobs.whole(i, r) if self.logprobs is not None else None,
                                        r.final.finish_reason) for i, r in enumerate(runs)],
               "usage": usage([r.final for r in runs])}
        with_timings(out, runs[0].final, self.timings)
        if self.reader is not None:
            out["millm"] = {"sae_activations": self.reader.render()}
        return out
