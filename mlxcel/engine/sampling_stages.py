"""The sampler stages of b10621's chain, as pure functions on a candidate set.

A `Candidates` value is the surviving token ids with their current logits, plus what is
known of their order. Each stage takes one and returns a new one; stages that draw
random numbers take the generator they draw from. Tokens whose logit is -inf are removed
instead of carried, so every stage sees finite logits only (upstream carries them with
zero probability, which changes no draw). The chain that strings stages together, and
the per-row state, live in `sampling.py`; DRY lives in `sampling_dry.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

# What is known of the candidates' order: ascending ids (the vocabulary, or a masked
# subset of it), descending logits, or neither.
Order = Literal["id", "logit", "none"]

# int(k) of a non-finite or out-of-range float, as x86 release builds of upstream do
# (the conversion yields INT_MIN, so mirostat's max(int(k), 1) then picks 1).
_INT32_LIMIT = 2.0**31


class NoCandidatesError(ValueError):
    """Every token was removed (an all-false mask, or every token banned)."""


@dataclass(frozen=True)
class Candidates:
    ids: np.ndarray      # int64 token ids
    logits: np.ndarray   # float32, finite
    order: Order = "none"

    @classmethod
    def from_logits(cls, logits: np.ndarray, mask: np.ndarray | None = None) -> "Candidates":
        """The whole vocabulary, restricted to `mask` (True = allowed) when given."""
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim != 1:
            raise ValueError(f"expected one row of logits, got shape {logits.shape}")
        if np.isnan(logits).any() or np.isposinf(logits).any():
            raise ValueError("logits contain NaN or +inf")
        keep = logits > -np.inf
        if mask is not None:
            mask = np.asarray(mask, dtype=bool)
            if mask.shape != logits.shape:
                raise ValueError(f"mask shape {mask.shape} does not match logits {logits.shape}")
            keep &= mask
        if keep.all():
            c = cls(np.arange(logits.shape[0], dtype=np.int64), logits.copy(), "id")
        else:
            ids = np.flatnonzero(keep).astype(np.int64)
            c = cls(ids, logits[ids], "id")
        if c.size == 0:
            raise NoCandidatesError("no token is allowed at this step")
        return c

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def take(self, index: np.ndarray | slice, order: Order) -> "Candidates":
        return Candidates(self.ids[index], self.logits[index], order)

    def with_logits(self, logits: np.ndarray) -> "Candidates":
        """New logits for the same ids: drops -inf entries and forgets a logit order."""
        logits = logits.astype(np.float32, copy=False)
        order: Order = "id" if self.order == "id" else "none"
        keep = logits > -np.inf
        if keep.all():
            return Candidates(self.ids, logits, order)
        if not keep.any():
            raise NoCandidatesError("every remaining token was removed")
        return Candidates(self.ids[keep], logits[keep], order)

    def sorted(self) -> "Candidates":
        if self.order == "logit":
            return self
        return self.take(np.argsort(-self.logits, kind="stable"), "logit")

    def positions_of(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in this set, indices into `tokens`) of the distinct `tokens` present."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        if self.order == "id":
            pos = np.minimum(np.searchsorted(self.ids, tokens), self.size - 1)
            hit = self.ids[pos] == tokens
            return pos[hit], np.flatnonzero(hit)
        by_id = np.argsort(tokens, kind="stable")
        j = np.minimum(np.searchsorted(tokens[by_id], self.ids), tokens.size - 1)
        hit = tokens[by_id][j] == self.ids
        return np.flatnonzero(hit), by_id[j[hit]]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities of the given logits (computed in float64 for a stable sum)."""
    x = logits.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def draw_index(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a discrete distribution: the first index whose running sum reaches
    u * total, u uniform in [0, 1) (upstream's single-pass dist selection)."""
    cum = np.cumsum(probs, dtype=np.float64)
    target = rng.random() * cum[-1]
    return min(int(np.searchsorted(cum, target, side="left")), probs.shape[0] - 1)


def apply_logit_bias(c: Candidates, bias: Mapping[int, float] | None) -> Candidates:
    if not bias:
        return c
    toks = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    vals = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))
    pos, idx = c.positions_of(toks)
    if pos.size == 0:
        return c
    logits = c.logits.copy()
    logits[pos] = (logits[pos] + vals[idx]).astype(np.float32)
    if np.isnan(logits[pos]).any() or np.isposinf(logits[pos]).any():
        raise ValueError("logit_bias produced a NaN or +inf logit")
    return c.with_logits(logits)


def penalties(c: Candidates, history: Sequence[int], last_n: int, repeat: float,
              frequency: float, presence: float) -> Candidates:
    """Repetition, frequency and presence penalties over the last `last_n` tokens
    (-1: the whole history). A repeated token's logit is divided by `repeat` when
    positive and multiplied when not, then count*frequency + presence is subtracted."""
    if last_n == 0 or (repeat == 1.0 and frequency == 0.0 and presence == 0.0):
        return c
    window = history if last_n < 0 else history[-last_n:] if len(history) > last_n else history
    if len(window) == 0:
        return c
    toks, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    pos, idx = c.positions_of(toks)
    if pos.size == 0:
        return c
    logits = c.logits.copy()
    cur = logits[pos]
    cur = np.where(cur <= 0, cur * np.float32(repeat), cur / np.float32(repeat))
    cur = cur - (counts[idx].astype(np.float32) * np.float32(frequency) + np.float32(presence))
    logits[pos] = cur
    return c.with_logits(logits)


def top_n_sigma(c: Candidates, n: float) -> Candidates:
    """Keep tokens whose logit is within n population standard deviations of the max."""
    if n <= 0.0 or c.size <= 1:
        return c
    x = c.logits
    mean = x.mean(dtype=np.float64)
    std = math.sqrt(float(((x - mean) ** 2).mean(dtype=np.float64)))
    keep = x >= np.float32(x.max() - n * std)
    return c.take(keep, c.order)


def top_k(c: Candidates, k: int) -> Candidates:
    if k <= 0:
        return c
    k = min(k, c.size)
    if c.order == "logit":
        return c.take(slice(0, k), "logit")
    if k < c.size:
        part = np.argpartition(-c.logits, k - 1)[:k]
        part = part[np.lexsort((part, -c.logits[part]))]
    else:
        part = np.argsort(-c.logits, kind="stable")
    return c.take(part, "logit")


def typical_p(c: Candidates, p: float, min_keep: int) -> Candidates:
    """Locally typical sampling: keep the tokens whose surprise is closest to the
    entropy until their mass exceeds p."""
    if p >= 1.0:
        return c
    probs = softmax(c.logits)
    with np.errstate(divide="ignore"):
        logp = np.log(probs)
    entropy = float(-(probs[probs > 0] * logp[probs > 0]).sum())
    shifted = np.abs(-logp - entropy)
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(probs[order])
    i = np.arange(c.size)
    ok = (cum > p) & ((min_keep == 0) | (i >= min_keep - 1))
    last = int(np.argmax(ok)) + 1 if ok.any() else c.size
    return c.take(order[:last], "none")


def top_p(c: Candidates, p: float, min_keep: int) -> Candidates:
    """Nucleus: the shortest logit-sorted prefix with mass >= p and >= min_keep tokens."""
    if p >= 1.0:
        return c
    probs = softmax(c.logits)

    def cut(order: np.ndarray | None) -> int | None:
        sorted_probs = probs if order is None else probs[order]
        ok = (np.cumsum(sorted_probs) >= p) & (np.arange(sorted_probs.shape[0]) + 1 >= min_keep)
        return int(np.argmax(ok)) + 1 if ok.any() else None

    if c.order == "logit":
        last = cut(None)
        return c.take(slice(0, c.size if last is None else last), "logit")
    for head_size in (256, 4096):
        # most requests are decided by the few most likely tokens: sort those first
        if c.size <= head_size:
            break
        head = np.argpartition(-c.logits, head_size - 1)[:head_size]
        head = head[np.lexsort((head, -c.logits[head]))]
        last = cut(head)
        if last is not None:
            return c.take(head[:last], "logit")
    order = np.argsort(-c.logits, kind="stable")
    last = cut(order)
    return c.take(order[: c.size if last is None else last], "logit")


def min_p(c: Candidates, p: float, min_keep: int) -> Candidates:
    """Keep tokens with probability >= p * the top probability (in logit space:
    logit >= max + ln p), never fewer than min_keep."""
    if p <= 0.0 or c.size == 0:
        return c
    if c.order != "logit":
        threshold = np.float32(c.logits.max() + math.log(p))
        keep = c.logits >= threshold
        n = int(keep.sum())
        if n > 0 and n >= min_keep:
            return c.take(keep, c.order)
    # too few pass for min_keep: keep the min_keep most likely instead
    n_pass = int(np.count_nonzero(c.logits >= np.float32(c.logits.max() + math.log(p))))
    return top_k(c, max(n_pass, min(min_keep, c.size), 1))


def xtc(c: Candidates, probability: float, threshold: float, min_keep: int,
        rng: np.random.Generator) -> Candidates:
    """Exclude Top Choices: with chance `probability`, drop every token at or above
    `threshold` except the least likely of them."""
    if probability <= 0.0 or threshold > 0.5 or c.size < 2:
        return c
    chance = float(rng.random(dtype=np.float32))
    if chance > probability:
        return c
    # the tokens at or above the threshold are a prefix of the logit-sorted order;
    # all of them go except the last of that prefix
    above = np.flatnonzero(softmax(c.logits) >= threshold)
    pos_last = above.size - 1
    if pos_last > 0 and c.size - pos_last >= min_keep:
        # the last in a stable descending sort: lowest logit, latest position among ties
        survivor = above[np.lexsort((-above, c.logits[above]))[0]]
        keep = np.ones(c.size, dtype=bool)
        keep[above] = False
        keep[survivor] = True
        return c.take(keep, c.order)
    return c


def temperature(c: Candidates, temp: float) -> Candidates:
    """Divide logits by temp; temp <= 0 keeps only the first highest-logit token."""
    if temp <= 0.0:
        best = int(np.argmax(c.logits))
        return c.take(slice(best, best + 1), "logit")
    return Candidates(c.ids, (c.logits / np.float32(temp)).astype(np.float32), c.order)


def dynamic_temperature(c: Candidates, temp: float, delta: float, exponent: float) -> Candidates:
    """The temperature stage (upstream temp-ext): with delta > 0 the temperature is
    min_t + (max_t - min_t) * (H / H_max) ** exponent over [max(0, temp - delta),
    temp + delta], H the entropy of the current candidates and H_max = ln(size)."""
    if delta <= 0.0:
        return temperature(c, temp)
    if c.size <= 1:
        return c
    min_temp = max(0.0, temp - delta)
    max_temp = temp + delta
    probs = softmax(c.logits)
    nz = probs[probs > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    normalized = np.float64(entropy / math.log(c.size))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        dyn = float(min_temp + (max_temp - min_temp) * np.power(normalized, exponent))
    return temperature(c, dyn)


def mirostat_v1_top_k(c: Candidates, mu: float, n_vocab: int, m: int = 100) -> int:
    """Mirostat 1.0's k: estimate the Zipf exponent s from the top m probabilities and
    size k so the expected surprise tracks mu (Basu et al., algorithm 1)."""
    lim = min(m - 1, c.size - 1)
    if lim <= 0:
        return 1
    probs = softmax(c.logits).astype(np.float32)
    head = top_k(Candidates(np.arange(c.size), c.logits, c.order), lim + 1).ids
    probs = probs[head]
    i = np.arange(lim, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t = np.log((i + 2) / (i + 1))
        b = np.log(probs[:lim].astype(np.float64) / probs[1:lim + 1])
        s_hat = np.float64((t * b).sum() / (t * t).sum())
        eps = s_hat - 1.0
        base = eps * np.power(2.0, np.float64(mu)) / (1.0 - np.power(np.float64(n_vocab), -eps))
        k = float(np.power(base, 1.0 / s_hat)) if s_hat != 0 else math.nan
    if not math.isfinite(k) or abs(k) >= _INT32_LIMIT:
        return 1
    return max(int(k), 1)


def mirostat_v2_truncate(c: Candidates, mu: float) -> Candidates:
    """Mirostat 2.0: keep the most likely tokens whose surprise -log2 p stays <= mu
    (at least the top one), sorted by logit."""
    with np.errstate(divide="ignore"):
        surprise = -np.log2(softmax(c.logits))
    keep = surprise <= mu
    if not keep.any():
        return top_k(c, 1)
    return c.take(keep, c.order).sorted()


# adaptive-p's transform constants (b10621 llama-sampler.cpp)
_ADAPTIVE_WIDTH = 0.3
_ADAPTIVE_PEAK = 5.0
_ADAPTIVE_SHARPNESS = 10.0


def adaptive_p_logits(probs: np.ndarray, target: float) -> np.ndarray:
    """Logits that peak at probability `target`: quadratic near it, linear in the tails."""
    dist = np.abs((probs - target) / _ADAPTIVE_WIDTH)
    return (_ADAPTIVE_PEAK - _ADAPTIVE_SHARPNESS * dist * dist / (1.0 + dist)).astype(np.float32)
