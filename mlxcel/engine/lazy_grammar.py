"""Lazy grammars: generation runs free until a trigger fires, then the grammar constrains it.

b10621's `grammar_lazy` with `grammar_triggers`. While the grammar waits, no token is masked
and every generated token's text (special tokens spelled out) is appended to a buffer. A
trigger fires on:
- a trigger token (type 0, or a one-token word marked preserved): the grammar starts with
  that token, as a token terminal when the grammar has one there, else as its text;
- a word (type 1) or pattern (type 2) found anywhere in the buffer: the grammar is fed the
  buffer from where the match starts;
- a full pattern (type 3) matching the whole buffer: the grammar is fed the buffer from
  the first non-empty capture group (the whole buffer when no group captured).
The matcher advances by whole tokens, so text fed from a match that starts inside a token
is re-tokenized before it is replayed. Patterns are compiled by the `regex` package (re's
syntax; b10621 uses std::regex, the common syntax is shared), whose matching takes a timeout:
all of a row's patterns get TRIGGER_MATCH_BUDGET_S per token, and a row whose patterns run past
it ends with an error rather than stalling the engine thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import regex as rx

from mlxcel.config.limits import TRIGGER_MATCH_BUDGET_S
from mlxcel.engine.detokenize import IncrementalDetokenizer

TOKEN, WORD, PATTERN, PATTERN_FULL = 0, 1, 2, 3


@dataclass(frozen=True)
class LazyGrammar:
    """A compiled grammar plus its triggers; hands each row a `LazyMatcher`."""

    grammar: Any  # engine.grammar.CompiledGrammar
    trigger_tokens: frozenset[int]
    patterns: tuple[tuple[rx.Pattern, bool], ...]  # (regex, must match the whole buffer)
    tokenizer: Any  # engine.tokenizer.Tokenizer
    reported: tuple[dict, ...] = ()  # the triggers as b10621 reports them (generation_settings)

    @property
    def kind(self) -> str:
        return self.grammar.kind

    @property
    def source(self) -> str:
        return self.grammar.source

    def matcher(self) -> "LazyMatcher":
        return LazyMatcher(self.grammar.matcher(), self)


class LazyMatcher:
    """One row's state: waiting (no mask) until a trigger fires, then the grammar's matcher."""

    def __init__(self, inner: Any, lazy: LazyGrammar) -> None:
        self._inner = inner
        self._lazy = lazy
        self.awaiting = True
        self._buffer = ""
        self._failed = ""  # why the trigger patterns could not be matched (then no token is allowed)
        tok = lazy.tokenizer
        self._detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=False))

    def allowed_mask(self, n_vocab: int) -> np.ndarray | None:
        if self._failed:
            return np.zeros(n_vocab, dtype=bool)
        return None if self.awaiting else self._inner.allowed_mask(n_vocab)

    def accept(self, token: int) -> bool:
        if not self.awaiting:
            return self._inner.accept(token)
        tok = self._lazy.tokenizer
        if token in self._lazy.trigger_tokens:
            self._fire()
            if self._inner.validate([token]) == 1:
                return self._inner.accept(token)
            return self._replay(tok.encode(tok.decode([token], skip_special_tokens=False),
                                           add_special_tokens=False, parse_special=False))
        self._buffer += self._detok.add(token)
        deadline = time.monotonic() + TRIGGER_MATCH_BUDGET_S
        for regex, full in self._lazy.patterns:
            try:
                start = _start(regex, full, self._buffer, max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                self._failed = (f"the grammar trigger patterns took longer than {TRIGGER_MATCH_BUDGET_S * 1e3:g} ms "
                                f"to match (at {regex.pattern!r}); simplify them")
                return False
            if start is not None:
                text = self._buffer[start:]
                self._fire()
                return self._replay(tok.encode(text, add_special_tokens=False))
        return True

    def _fire(self) -> None:
        self.awaiting = False
        self._buffer = ""

    def _replay(self, tokens: list[int]) -> bool:
        for t in tokens:
            if not self._inner.accept(t):
                return False
        return True

    def is_terminated(self) -> bool:
        return not self.awaiting and self._inner.is_terminated()

    def is_accepting(self) -> bool:
        return self.awaiting or self._inner.is_accepting()

    def error(self) -> str:
        return self._failed or ("" if self.awaiting else self._inner.error())

    @property
    def error_code(self) -> str | None:
        """The request's own pattern is at fault, not the output: a client error."""
        return "trigger_pattern_too_slow" if self._failed else None


def _start(regex: rx.Pattern, full: bool, buffer: str, timeout: float) -> int | None:
    """Where the constrained text starts in `buffer` when the trigger matches, else None;
    TimeoutError past `timeout` seconds."""
    if not full:
        m = regex.search(buffer, timeout=timeout)
        return None if m is None else m.start()
    m = regex.fullmatch(buffer, timeout=timeout)
    if m is None:
        return None
    for i in range(1, (m.re.groups or 0) + 1):
        if m.start(i) >= 0 and m.end(i) > m.start(i):
            return m.start(i)
    return 0
