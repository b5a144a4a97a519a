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
is re-tokenized before it is replayed. Patterns are Python regular expressions (b10621
uses std::regex; the common syntax is shared).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel.engine.detokenize import IncrementalDetokenizer

TOKEN, WORD, PATTERN, PATTERN_FULL = 0, 1, 2, 3


@dataclass(frozen=True)
class LazyGrammar:
    """A compiled grammar plus its triggers; hands each row a `LazyMatcher`."""

    grammar: Any  # engine.grammar.CompiledGrammar
    trigger_tokens: frozenset[int]
    patterns: tuple[tuple[re.Pattern, bool], ...]  # (regex, must match the whole buffer)
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
        tok = lazy.tokenizer
        self._detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=False))

    def allowed_mask(self, n_vocab: int) -> np.ndarray | None:
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
        for regex, full in self._lazy.patterns:
            start = _start(regex, full, self._buffer)
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
        return "" if self.awaiting else self._inner.error()


def _start(regex: re.Pattern, full: bool, buffer: str) -> int | None:
    """Where the constrained text starts in `buffer` when the trigger matches, else None."""
    if not full:
        m = regex.search(buffer)
        return None if m is None else m.start()
    m = regex.fullmatch(buffer)
    if m is None:
        return None
    for i in range(1, (m.re.groups or 0) + 1):
        if m.start(i) >= 0 and m.end(i) > m.start(i):
            return m.start(i)
    return 0
