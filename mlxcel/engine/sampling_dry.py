"""DRY ("Don't Repeat Yourself") penalties and their sequence-breaker token data.

DRY finds, for each token that would extend a repeat of the text's most recent tokens,
the length of the longest such repeat in the last `dry_penalty_last_n` tokens, and
lowers that token's logit by multiplier * base ** (length - allowed_length). Sequence
breakers cut the scan: a repeat never reaches back across one.

Breakers are strings; like b10621 we turn them into token data by scanning the
vocabulary once per (vocabulary, breaker set): a token whose text contains a breaker is
a single-token breaker (a head with an empty tail); a token whose text ends with a
proper prefix of a breaker is a head whose tail is the tokenization of the rest.
`DryVocab` holds what that scan needs and caches its result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from mlxcel.engine.sampling_stages import Candidates

# b10621's bounds on breaker processing: bytes per breaker, tokens per tail.
MAX_BREAKER_BYTES = 40
MAX_TAIL_TOKENS = 20
# ln(FLT_MAX): the penalty exponent is clamped so base ** exponent stays finite.
_FLOAT_MAX_LOG = 88.7228391

# head token id -> the tails (token tuples) that complete a breaker after it
BreakerTable = Mapping[int, tuple[tuple[int, ...], ...]]


@dataclass
class DryVocab:
    """What DRY needs from a tokenizer, built once per loaded model.

    `pieces[i]` is token i's text as bytes, special tokens rendered (upstream's
    detokenize of the single token); `tokenize` encodes text without special tokens or BOS.
    """

    pieces: Sequence[bytes | str]
    tokenize: Callable[[str], Sequence[int]]
    _tables: dict[tuple[str, ...], BreakerTable] = field(default_factory=dict, repr=False)

    def breaker_table(self, breakers: Sequence[str]) -> BreakerTable:
        key = tuple(breakers)
        table = self._tables.get(key)
        if table is None:
            table = build_breaker_table(key, self.pieces, self.tokenize)
            self._tables[key] = table
        return table


def build_breaker_table(breakers: Sequence[str], pieces: Sequence[bytes | str],
                        tokenize: Callable[[str], Sequence[int]]) -> BreakerTable:
    words = [p.encode("utf-8") if isinstance(p, str) else bytes(p) for p in pieces]
    table: dict[int, list[tuple[int, ...]]] = {}

    def add(head: int, tail: tuple[int, ...]) -> None:
        tails = table.setdefault(head, [])
        if tail not in tails:
            tails.append(tail)

    for breaker in breakers:
        raw = breaker.encode("utf-8")[:MAX_BREAKER_BYTES]
        if not raw:
            continue
        first = raw[0]
        for tid, word in enumerate(words):
            if raw in word:
                add(tid, ())
                continue
            pos = word.find(first)
            while pos >= 0:
                # the token ends with raw[:n]: the rest of the breaker may follow as tokens
                n = len(word) - pos
                if n < len(raw) and raw.startswith(word[pos:]):
                    rest = raw[n:].decode("utf-8", errors="ignore")
                    tail = tuple(int(t) for t in tokenize(rest))[:MAX_TAIL_TOKENS]
                    add(tid, tail)
                pos = word.find(first, pos + 1)
    return {head: tuple(tails) for head, tails in table.items()}


def _z_function(seq: Sequence[int]) -> list[int]:
    """z[k] = length of the longest common prefix of seq and seq[k:] (z[0] = len)."""
    n = len(seq)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and seq[z[k]] == seq[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


def dry_repeat_lengths(history: Sequence[int], *, allowed_length: int, penalty_last_n: int,
                       breakers: BreakerTable, n_ctx_train: int | None = None) -> dict[int, int]:
    """For each token that would extend a repeat of the text's end, the longest such
    repeat length (only lengths >= allowed_length are listed)."""
    span = (n_ctx_train if n_ctx_train is not None else len(history)) \
        if penalty_last_n == -1 else max(penalty_last_n, 0)
    n = min(len(history), span)
    if n_ctx_train is not None:
        n = min(n, n_ctx_train)
    if n <= allowed_length:
        return {}
    # newest first: rev[0] is the last token
    rev = [int(t) for t in history[len(history) - n:]][::-1]

    # a breaker inside the window caps how far back a repeat may reach
    rep_limit = n
    for i, tok in enumerate(rev):
        tails = breakers.get(tok)
        if not tails:
            continue
        longest = -1
        for tail in tails:
            length = len(tail)
            if longest < length <= i and all(tail[o] == rev[i - o - 1] for o in range(length)):
                longest = length
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return {}

    z = _z_function(rev)
    longest_for: dict[int, int] = {}
    for k in range(1, n):
        length = min(z[k], rep_limit)
        if length >= allowed_length:
            # the token that followed that earlier occurrence would extend the repeat
            tok = rev[k - 1]
            if longest_for.get(tok, -1) < length:
                longest_for[tok] = length
    return longest_for


def dry(c: Candidates, history: Sequence[int], *, multiplier: float, base: float,
        allowed_length: int, penalty_last_n: int, breakers: BreakerTable,
        n_ctx_train: int | None = None) -> Candidates:
    """Apply DRY penalties; disabled when multiplier == 0, base < 1 or penalty_last_n == 0."""
    if multiplier == 0.0 or base < 1.0 or penalty_last_n == 0:
        return c
    lengths = dry_repeat_lengths(history, allowed_length=allowed_length,
                                 penalty_last_n=penalty_last_n, breakers=breakers,
                                 n_ctx_train=n_ctx_train)
    # single-token breakers are never penalised themselves
    lengths = {t: n for t, n in lengths.items() if () not in breakers.get(t, ())}
    if not lengths:
        return c
    # computed in single precision as upstream does (base 2 gives 128, not 127)
    max_exponent = int(np.float32(_FLOAT_MAX_LOG) / np.log(np.float32(base))) \
        if base > 1.000001 else 0
    toks = np.fromiter(lengths.keys(), dtype=np.int64, count=len(lengths))
    penalty = np.empty(len(lengths), dtype=np.float64)
    for j, length in enumerate(lengths.values()):
        exponent = length - allowed_length
        if max_exponent > 0 and exponent > max_exponent:
            exponent = max_exponent
        penalty[j] = multiplier * base**exponent
    pos, idx = c.positions_of(toks)
    if pos.size == 0:
        return c
    logits = c.logits.copy()
    logits[pos] = (logits[pos] - penalty[idx]).astype(np.float32)
    return c.with_logits(logits)
