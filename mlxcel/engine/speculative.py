"""Speculative decoding: propose a few tokens per decoding row, verify them in one target forward.

Each engine step, the speculator picks the decoding rows that may speculate, asks its drafter
for up to `n_max` tokens per row (a small draft checkpoint run greedily and batched over the
rows, or an n-gram lookup in the row's own context), and then runs the target once over every
drafted row's [last, d1..dk], each position a one-token row at its own offset of the row's
sequence, so each is computed as a plain decode step computes it. The row's own sampler chain
samples every position in order through the engine's ordinary per-token path (grammar, budget,
stops, EOS and n_predict included): a sampled token equal to the draft is accepted and the next
position is sampled; the first one that differs is emitted in the draft's place and ends the
round. The target's KV for rejected positions is trimmed off the row's block table; the draft
model's own cache is re-synchronised with the row's context before its next round, and starts
from the draft's own prefix cache (what earlier rows computed, as the target's prompt cache
does; not for a request with cache_prompt false), so a warm prompt is not prefilled on the
draft again. Because every emitted token is sampled from the target's logits with the row's own
state, the text is the text plain decoding gives: greedy picks the same tokens and seeded
sampling makes the same random draws in the same order (as far as the backend computes a row
the same whatever the batch holds: exact at fp32; torch at bf16 sums attention over the batch's
padded key length, so a near-tie can resolve differently, as it can beside a longer row in
plain batching).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxcel.engine.backend import ForwardRow
from mlxcel.engine.kv_manager import WINDOW_KEPT_DRAFT, KVManager
from mlxcel.engine.kv_prefix_cache import common_prefix

DRAFT, NGRAM_SIMPLE = "draft-simple", "ngram-simple"


@dataclass(frozen=True)
class SpecConfig:
    """The resolved --spec-* configuration (the CLI builds it; None anywhere means no speculation)."""

    kind: str  # DRAFT | NGRAM_SIMPLE
    n_max: int = 3  # --spec-draft-n-max: draft tokens per round (draft model)
    n_min: int = 0  # --spec-draft-n-min: a shorter draft is dropped
    p_min: float = 0.0  # --spec-draft-p-min: stop drafting when the draft's top probability is lower
    ngram_size_n: int = 12  # --spec-ngram-simple-size-n: the looked-up n-gram's length
    ngram_size_m: int = 48  # --spec-ngram-simple-size-m: the longest continuation copied
    draft_model: Path | None = None  # the draft checkpoint (DRAFT)

    def props(self) -> dict:
        """/props `speculative`: the draft's basename only (never a full path), kind, n_max."""
        n_max = self.n_max if self.kind == DRAFT else self.ngram_size_m
        return {"draft_model": self.draft_model.name if self.draft_model is not None else None,
                "kind": self.kind, "n_max": n_max}


@dataclass
class RowSpec:
    """One row's speculation state: its draft cache (draft model only) and its counters."""

    seq: object | None = None  # the draft backend's sequence for this row
    shared: int = 0  # its leading tokens in blocks the draft's prefix cache shares (never written)
    cache: bool = True  # may the draft's prefix cache supply and keep its tokens (the request's cache_prompt)
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens the verification emitted as they were
    rounds: int = 0  # verify forwards
    keep: int | None = None  # target KV length to trim to if the row ends mid-verification


def _count_position(counters, i: int, n_draft: int) -> None:
    """/metrics' accepted-per-draft-position counter (position 0: the first drafted token)."""
    per_pos = counters.n_draft_accepted_per_pos
    if len(per_pos) < n_draft:
        per_pos.extend([0] * (n_draft - len(per_pos)))
    per_pos[i] += 1


def ngram_simple_draft(context: list[int], last: int, size_n: int, size_m: int) -> list[int]:
    """b10621's ngram-simple proposal: the n-gram ending in `last` (the n-1 context tokens before
    it plus `last`) is searched backwards in `context`, skipping the current position; the
    tokens that followed the latest earlier occurrence (at most size_m, at least size_n of
    them) are the draft. Too short a context, no match, or too short a continuation: none."""
    cur = len(context)
    if size_n < 1 or cur <= size_n + size_m + 1:
        return []
    pattern = np.asarray(context[cur - size_n + 1:] + [last])
    ctx = np.asarray(context)
    for j in range(cur - size_n - 1, 0, -1):
        if ctx[j] == pattern[0] and np.array_equal(ctx[j:j + size_n], pattern):
            n = min(size_m, cur - (j + size_n))
            return context[j + size_n:j + size_n + n] if n >= size_n else []
    return []


class NgramDrafter:
    """Prompt lookup: no model, the row's own context proposes its continuation."""

    kind = NGRAM_SIMPLE

    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    def propose(self, items: list[tuple[object, list[int], int, int]]) -> list[list[int]]:
        c = self.config
        return [ngram_simple_draft(ctx, last, c.ngram_size_n, c.ngram_size_m)[:limit]
                for _, ctx, last, limit in items]

    def release(self, spec: RowSpec) -> None:
        pass


class ModelDrafter:
    """A small checkpoint on the same backend kind and vocabulary, run greedily. Its KV lives
    in its own paged pool sized for every slot's full share, so it is bounded; a row's draft
    sequence goes to the draft's prefix cache when the row ends, which keeps it in the pool's
    free blocks until they are needed (no budget of its own)."""

    kind = DRAFT

    def __init__(self, backend, config: SpecConfig, *, n_ctx_slot: int, parallel: int, batch_size: int,
                 block_size: int, target_vocab: int) -> None:
        self.backend, self.config, self.batch_size = backend, config, max(1, batch_size)
        self.target_vocab = target_vocab  # a padded draft head may name ids the target cannot embed
        # the draft's sequence rewinds over its rejected drafts: it keeps the blocks behind a window
        self.kv = KVManager(n_ctx_slot=n_ctx_slot, parallel=parallel, budget_bytes=None, headroom=0,
                            block_size=block_size, keep_window=WINDOW_KEPT_DRAFT)
        self.kv.bind(backend)

    def propose(self, items: list[tuple[RowSpec, list[int], int, int]]) -> list[list[int]]:
        """items: (row state, the row's KV tokens, its pending token, draft limit) per row."""
        c, be = self.config, self.backend
        feeds = []
        for spec, ctx, last, _ in items:
            full = ctx + [last]
            if spec.seq is not None and common_prefix(spec.seq.tokens, full) < spec.shared:
                self.release(spec)  # a context shift rewrote tokens the cache's blocks hold: start over
            if spec.seq is None:
                spec.seq, cached = self.kv.start(full, spec.cache)
                spec.shared = cached - cached % self.kv.block_size  # a copied tail is the row's own
            keep = min(common_prefix(spec.seq.tokens, full), len(full) - 1)
            spec.seq.truncate(keep)
            missing = full[keep:]
            for start in range(0, len(missing) - 1, self.batch_size):  # catch up, chunked like a prefill
                be.forward([ForwardRow(missing[start:min(start + self.batch_size, len(missing) - 1)], spec.seq)])
            feeds.append(missing[-1])
        drafts: list[list[int]] = [[] for _ in items]
        active = list(range(len(items)))
        logits = be.forward([ForwardRow([feeds[i]], items[i][0].seq, decode=True) for i in active])
        while active:
            nxt = []
            for j, i in enumerate(active):
                row_logits = logits[j]
                tok = int(np.argmax(row_logits))
                if tok >= self.target_vocab:
                    continue
                if c.p_min > 0:
                    z = np.exp(row_logits - row_logits[tok])
                    if 1.0 / float(z.sum()) < c.p_min:
                        continue
                drafts[i].append(tok)
                if len(drafts[i]) < items[i][3]:
                    nxt.append(i)
            active = nxt
            if active:
                logits = be.forward([ForwardRow([drafts[i][-1]], items[i][0].seq, decode=True) for i in active])
        return drafts

    def release(self, spec: RowSpec) -> None:
        if spec.seq is not None:
            self.kv.release(spec.seq, donate=spec.cache)
            spec.seq, spec.shared = None, 0


class _At:
    """A verify position: `seq` seen as if it held `length` tokens, so a one-token forward row
    writes its K/V at that position and attends to everything before it (the block table is
    the sequence's own; the caller reserved room and records the tokens)."""

    def __init__(self, seq, length: int) -> None:
        self.seq, self.length, self.allocator, self.tokens = seq, length, seq.allocator, []

    @property
    def position(self) -> int:
        return self.length + self.seq.shift

    def slots(self, start: int, stop: int, group: int = 0):
        return self.seq.slots(start, stop, group)

    def reserve(self, n: int) -> None:
        pass


class Speculator:
    """The engine's speculation seam: `draft` before the step's plan, `verify_rows` joining the
    decode forward, `accept` after it, `before_release` when a row leaves."""

    def __init__(self, config: SpecConfig, drafter) -> None:
        self.config, self.drafter = config, drafter

    def limit(self, engine, row) -> int:
        """How many draft tokens this row may verify now (0: it decodes plainly this step).
        Rows whose forward reads residuals do not speculate (a rejected position's read would
        reach the reader); room is kept for the emitted token and a context shift, and
        nothing is drafted past n_predict."""
        req = row.request
        if req.capture or row.next_token is None:
            return 0
        cap = self.config.n_max if self.config.kind == DRAFT else self.config.ngram_size_m
        room = engine.n_ctx_slot - row.cache.length - 2
        remaining = row.max_tokens - len(row.generated) - 1
        return max(0, min(cap, room, remaining))

    def draft(self, engine, rows: list) -> list[tuple[object, list[int]]]:
        """Drafts for this step's decoding rows: (row, [d1..dk]) for each row that speculates."""
        items, owners = [], []
        n_min = self.config.n_min if self.config.kind == DRAFT else 0  # b10621's n-gram drafters ignore it
        for row in rows:
            limit = self.limit(engine, row)
            if limit <= 0 or limit < n_min:
                continue
            if row.spec is None:
                row.spec = RowSpec(cache=row.request.cache_prompt)
            items.append((row.spec, row.cache.tokens, row.next_token, limit))
            owners.append(row)
        if not items:
            return []
        return [(row, d) for row, d in zip(owners, self.drafter.propose(items)) if d and len(d) >= n_min]

    def verify_rows(self, drafted: list[tuple[object, list[int]]]) -> tuple[list, list]:
        """The forward rows that verify every drafted row's [last, d1..dk], each position its own
        one-token row at its own offset of the row's sequence (so each is computed exactly as a
        plain decode step would compute it; the engine runs them in its decode forward), and the
        spans `accept` reads their logits by."""
        batch, spans = [], []
        for row, draft in drafted:
            seq, toks = row.cache, [row.next_token] + draft
            base = seq.length
            seq.reserve(len(toks))
            spans.append((row, draft, base, len(batch)))
            batch += [ForwardRow([t], _At(seq, base + j), row.request.steering, None, row.request.lora, decode=True)
                      for j, t in enumerate(toks)]
            seq.tokens.extend(toks)  # every position's K/V is written by this forward
        return batch, spans

    def accept(self, engine, spans: list, logits) -> None:
        """Each drafted row samples its positions in order with its own chain until a sampled
        token differs from the draft (it is emitted instead) or the row ends; the KV of the
        positions it did not keep is trimmed."""
        for row, draft, base, at in spans:
            self._accept(engine, row, draft, base, logits[at:at + len(draft) + 1])

    def _accept(self, engine, row, draft: list[int], base: int, logits) -> None:
        seq, spec = row.cache, row.spec
        spec.rounds += 1
        spec.drafted += len(draft)
        i = 0
        for i in range(len(draft) + 1):
            spec.keep = base + 1 + i  # the KV a row ending at this position keeps
            engine.output.sample(row, logits[i])
            if row.handle.finished or row.done:
                return  # the row finished and was released (trimmed first, through before_release)
            if i == len(draft) or row.next_token != draft[i]:
                break
            spec.accepted += 1
            _count_position(engine.counters, i, len(draft))
        spec.keep = None
        seq.truncate(base + 1 + i)

    def before_release(self, row) -> None:
        """A row leaves: trim a mid-verification KV to what was emitted, free its draft cache."""
        spec = row.spec
        if spec is None:
            return
        if spec.keep is not None:
            row.cache.truncate(spec.keep)
            spec.keep = None
        self.drafter.release(spec)

    def timings(self, row) -> dict:
        """The row's draft counters for its Timings, only once a verify round ran."""
        spec = row.spec
        if spec is None or spec.rounds == 0:
            return {}
        return {"draft_n": spec.drafted, "draft_n_accepted": spec.accepted, "draft_rounds": spec.rounds,
                "draft_kind": self.config.kind}
