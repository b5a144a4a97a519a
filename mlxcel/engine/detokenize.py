"""Incremental detokenizing: text as tokens arrive, never half a UTF-8 character.

Each step decodes a short window that starts a little before the newest tokens, so a
tokenizer that drops a leading space on the first token of a decode (SentencePiece's
Metaspace) still renders the space. Text ending in U+FFFD is held back until the next
token completes the character. The concatenation of every `add` plus `flush` equals a
one-shot decode of all tokens.
"""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start: context for the next delta
        self._read = 0  # tokens whose text has been emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]
