"""Plain data that crosses the engine boundary: requests in, token events out."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from mlxcel.engine.sampling_params import SamplingParams

_ids = itertools.count(1)


@dataclass
class GenerationRequest:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = -1  # -1: until the context is full
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    id: int = field(default_factory=lambda: next(_ids))


@dataclass
class Timings:
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0


@dataclass
class TokenEvent:
    """One step of one request. `text` is newly releasable text (may be empty while a
    stop-string candidate or a partial character is withheld). The last event of a
    request has `finish_reason` set (or `error`)."""

    text: str = ""
    token: int | None = None
    finish_reason: str | None = None  # "stop" | "length"
    stop_type: str = "none"  # b10621: "eos" | "word" | "limit" | "none"
    stopping_word: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    slot: int = -1
    timings: Timings | None = None
    error: str | None = None
    error_code: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class EngineError(Exception):
    """A request the engine refuses (context overflow, queue full, ...)."""

    def __init__(self, message: str, code: str, status: int = 400, **details) -> None:
        super().__init__(message)
        self.message, self.code, self.status, self.details = message, code, status, details
