"""Per-token log-probabilities of a /v1 generation in OpenAI's shapes.

A chat request with `logprobs: true` (and `top_logprobs`), or a text completion with an
integer `logprobs`, asks every engine row for the report native `n_probs` gets
(engine/sampling.py: the softmax of the raw logits, before the sampling chain, as b10621's
OpenAI-compatible routes report it), so the numbers are the native route's. This module
turns those reports into chat's `logprobs.content[]` and the legacy completions object
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), the prompt's part of `echo`
included (the engine's `submit_prompt_probs`). Scoring mode (`allowed_token_ids`) is
scoring.py's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mlxcel.api.errors import ApiError, engine_error
from mlxcel.api.llamacpp.render import kept_probs
from mlxcel.api.stream_runner import Run
from mlxcel.engine.sampling import ProbsReport
from mlxcel.engine.token_pieces import valid_utf8_prefix
from mlxcel.engine.types import EngineError, TokenEvent
from mlxcel.runtime.served import ServedModel

MAX_TOP = 20  # OpenAI's bound on top_logprobs (and on the legacy integer logprobs)


@dataclass(frozen=True)
class LogprobsAsk:
    top: int  # alternatives reported per token, 0-20
    as_token_ids: bool  # vLLM's return_tokens_as_token_ids: tokens spelled "token_id:N"

    def overrides(self) -> dict[str, Any]:
        """The SamplingParams fields that make the engine report each token: with no
        alternatives asked it still reports one, left out of the answer."""
        return {"n_probs": max(self.top, 1), "post_sampling_probs": False}


def _refuse(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_parameter", param=param)


def ask_of(req: Any, *, chat: bool, n_probs: int | None = None) -> LogprobsAsk | None:
    """What a generation request asks (None: no logprobs), its bounds checked. `n_probs` is
    b10621's native spelling, read on its OpenAI routes too: on chat it asks what `logprobs:
    true` with that many `top_logprobs` asks, unless `logprobs: true` is sent (then it is unused,
    see `n_probs_unused`); on text completions it is the integer `logprobs` and wins over it (its
    alias upstream). 0 asks for nothing, as natively; it has the native bounds (0..MAX_N_PROBS),
    not 20."""
    as_ids = bool(req.return_tokens_as_token_ids)
    if chat:
        if req.top_logprobs is not None and req.logprobs is not True:
            raise _refuse("top_logprobs needs logprobs: true", "top_logprobs")
        if req.logprobs is not True:
            return LogprobsAsk(n_probs, as_ids) if n_probs else None
        top, param = req.top_logprobs or 0, "top_logprobs"
    else:
        if n_probs is not None:
            return LogprobsAsk(n_probs, as_ids) if n_probs else None
        if type(req.logprobs) is not int:
            return None
        top, param = req.logprobs, "logprobs"
    if not 0 <= top <= MAX_TOP:
        raise _refuse(f"{param} must be between 0 and {MAX_TOP}", param)
    return LogprobsAsk(top, as_ids)


def n_probs_unused(req: Any, n_probs: int | None, *, chat: bool) -> list[str]:
    """`n_probs` beside chat's `logprobs: true` changes nothing (upstream takes top_logprobs)."""
    return ["n_probs"] if chat and n_probs is not None and req.logprobs is True else []


def _piece(model: ServedModel, token: int) -> bytes:
    pieces = model.tokenizer.pieces
    return pieces[token] if 0 <= token < len(pieces) else b""


def _text(model: ServedModel, ask: LogprobsAsk, token: int) -> str:
    """A token as reported: its text (whole characters only, as native `token`) or its id."""
    return f"token_id:{token}" if ask.as_token_ids else valid_utf8_prefix(_piece(model, token))


def chat_content(model: ServedModel, ask: LogprobsAsk, reports: list[ProbsReport]) -> list[dict[str, Any]]:
    """`logprobs.content`: one entry per token, its alternatives best first."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": _text(model, ask, token), "logprob": logprob, "bytes": list(_piece(model, token))}

    out = []
    for r in reports:
        body = r.to_json()  # the native numbers, log(p) of the same probabilities
        out.append({**entry(r.token, body["logprob"]),
                    "top_logprobs": [entry(e["id"], e["logprob"]) for e in body["top_logprobs"][:ask.top]]})
    return out


@dataclass
class CompletionLogprobs:
    """One choice's legacy `logprobs` object, built up as its tokens come; `offset` is where
    the next token starts in the prompt-and-completion text (OpenAI's `text_offset`)."""

    offset: int
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def take(self) -> dict[str, Any]:
        """The entries added since the last take (a stream chunk's), as the wire object."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def add_reports(model: ServedModel, ask: LogprobsAsk, acc: CompletionLogprobs,
                reports: list[ProbsReport]) -> None:
    """Generated (or prompt) tokens with their reports; alternatives sharing a text keep the
    most probable one."""
    for r in reports:
        body = r.to_json()
        top: dict[str, float] = {}
        for e in body["top_logprobs"][:ask.top]:
            top.setdefault(_text(model, ask, e["id"]), e["logprob"])
        acc.add(_text(model, ask, r.token), body["logprob"], top)


async def echo_logprobs(model: ServedModel, ask: LogprobsAsk, prompt: list[int]) -> CompletionLogprobs:
    """The prompt's part of an echoed choice: its first token has no logprob (nothing
    precedes it), each later one the report from the position before it."""
    try:
        future = model.engine.submit_prompt_probs(prompt, ask.overrides()["n_probs"])
        reports = await asyncio.wrap_future(future)
    except EngineError as e:
        raise engine_error(e.message, e.code, e.status) from None
    acc = CompletionLogprobs(offset=0)
    acc.add(_text(model, ask, prompt[0]), None, None)
    add_reports(model, ask, acc, reports)
    return acc


class _Pending:
    """Reports of tokens whose text has not gone out yet (held back by a stop-string candidate,
    a partial character or the chat parser): they ride on the next chunk that does."""

    def __init__(self, model: ServedModel, ask: LogprobsAsk) -> None:
        self.model, self.ask = model, ask
        self.pending: dict[int, list[ProbsReport]] = {}

    def _due(self, index: int, ev: TokenEvent, emit: bool) -> list[ProbsReport] | None:
        held = self.pending.setdefault(index, [])
        if ev.probs is not None:
            held.append(ev.probs)
        if ev.done:
            held[:] = kept_probs(self.model, held, ev)
        if not emit:
            return None
        self.pending[index] = []
        return held


class ChatLogprobs(_Pending):
    """`choices[].logprobs` of a chat completion, streamed (per chunk) or whole."""

    def event(self, ev: TokenEvent, emit: bool) -> dict[str, Any] | None:
        """The object for the chunk going out with this event (`emit`), else None (held)."""
        due = self._due(0, ev, emit)
        return None if due is None else {"content": chat_content(self.model, self.ask, due)}

    def whole(self, run: Run) -> dict[str, Any]:
        return {"content": chat_content(self.model, self.ask, kept_probs(self.model, run.probs, run.final))}


class TextLogprobs(_Pending):
    """`choices[].logprobs` of a text completion, one accumulator per choice (its offsets
    run on across chunks; an echoed prompt's entries come first)."""

    def __init__(self, model: ServedModel, ask: LogprobsAsk, choices: list[CompletionLogprobs]) -> None:
        super().__init__(model, ask)
        self.choices = choices

    def opening(self, index: int) -> dict[str, Any]:
        """The echoed prompt's entries (the stream's first chunk of the choice)."""
        return self.choices[index].take()

    def event(self, index: int, ev: TokenEvent, emit: bool) -> dict[str, Any] | None:
        due = self._due(index, ev, emit)
        if due is None:
            return None
        add_reports(self.model, self.ask, self.choices[index], due)
        return self.choices[index].take()

    def whole(self, index: int, run: Run) -> dict[str, Any]:
        acc = self.choices[index]
        add_reports(self.model, self.ask, acc, kept_probs(self.model, run.probs, run.final))
        return acc.take()
