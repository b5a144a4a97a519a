"""The scheduler: which requests hold a slot, and what each step runs.

It owns the waiting queue and the running rows. Admission takes waiting requests FIFO into free
slots (a request pinned to a busy slot with `id_slot` waits without blocking the rest) and has
the KV manager start each one's sequence from the prefix cache. Each step it produces a
`StepPlan`: every decoding row's next token, then prompt chunks under the `batch_size` token
budget, so a chunk shares the forward with the decode rows instead of stalling them. A row
takes the lowest free slot when its first prompt token runs. When a row's context reaches its
slot's bound with context shift on, the scheduler has the KV manager drop tokens after n_keep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlxcel.engine.kv_block_pool import SequenceKV
from mlxcel.engine.kv_manager import KVManager
from mlxcel.engine.requests import RequestHandle, Row
from mlxcel.engine.types import GenerationRequest, SlotInfo

# (handle, its sequence, prompt tokens the cache supplied, max tokens) -> the running row
OpenRow = Callable[[RequestHandle, SequenceKV, int, int], Row]


def cacheable(req: GenerationRequest) -> bool:
    """Whether the request's prompt may come from, and go back to, the prefix cache: asked for,
    and its images (if any) keyed by their content."""
    return req.cache_prompt and (req.media is None or req.cache_tokens is not None)


@dataclass
class StepPlan:
    """One step's forward: (row, its tokens) in batch order, decode rows one token, prompt rows
    a chunk; and the decoding rows whose draft is verified in the same forward instead."""

    rows: list[tuple[Row, list[int]]] = field(default_factory=list)
    drafted: list[tuple[Row, list[int]]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.rows and not self.drafted


class Scheduler:
    def __init__(self, kv: KVManager, *, parallel: int, n_ctx_slot: int, batch_size: int,
                 cont_batching: bool, context_shift: bool, keep: int) -> None:
        self.kv = kv
        self.parallel, self.n_ctx_slot = parallel, n_ctx_slot
        self.batch_size, self.cont_batching = max(1, batch_size), cont_batching
        self.context_shift = context_shift  # at the bound: drop tokens after n_keep instead of stopping
        self.keep = keep  # the server's default n_keep (--keep)
        self.waiting: list[RequestHandle] = []
        self.running: list[Row] = []
        self.last_by_slot: dict[int, SlotInfo] = {}  # what last ran on each idle slot (/slots)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def claimed_slots(self) -> set[int]:
        """Slots a row holds, or that a pinned row (id_slot) will take at its first token."""
        return {r.slot if r.slot >= 0 else r.request.id_slot for r in self.running} - {-1}

    def _next_admissible(self) -> RequestHandle | None:
        claimed = self.claimed_slots()
        for handle in self.waiting:
            pin = handle.request.id_slot
            if handle.cancelled or pin < 0 or pin not in claimed:
                self.waiting.remove(handle)
                return handle
        return None

    def max_tokens(self, req: GenerationRequest) -> int:
        """Tokens the row may generate: n_predict, bounded by the slot's room unless the context
        shifts at the bound (then only n_predict limits it)."""
        if self.context_shift:
            return req.max_tokens if req.max_tokens >= 0 else 2**62
        room = self.n_ctx_slot - len(req.prompt)
        return room if req.max_tokens < 0 else min(req.max_tokens, room)

    def admit(self, open_row: OpenRow, drop: Callable[[RequestHandle], None]) -> None:
        """Move waiting requests into free slots; `drop` takes a request cancelled while queued."""
        while self.waiting and len(self.running) < self.parallel:
            handle = self._next_admissible()
            if handle is None:
                return
            if handle.cancelled:
                drop(handle)
                continue
            req = handle.request
            seq, cached = self.kv.start(req.prompt, cacheable(req), req.cache_tokens)
            if req.media is not None:  # the VLM backend splices it during prefill (backends/*/vlm.py)
                seq.media = req.media
            self.running.append(open_row(handle, seq, cached, self.max_tokens(req)))

    def cancelled(self) -> tuple[list[Row], list[RequestHandle]]:
        """Take every cancelled row and queued request out; the caller releases them."""
        rows = [r for r in self.running if r.handle.cancelled]
        for r in rows:
            self.running.remove(r)
        handles = [h for h in self.waiting if h.cancelled]
        for h in handles:
            self.waiting.remove(h)
        return rows, handles

    def schedule(self, drafted: list[tuple[Row, list[int]]] = ()) -> StepPlan:
        """This step's one forward: every decoding row, then prefill chunks under the
        `batch_size` token budget. Without continuous batching, prompts run only when nothing is
        decoding. Rows with a draft are verified in the same forward (`drafted`)."""
        verifying = {id(r) for r, _ in drafted}
        rows = [(r, [r.next_token]) for r in self.running if r.decoding and id(r) not in verifying]
        budget = max(self.batch_size - len(rows) - sum(len(d) + 1 for _, d in drafted), 1)
        if not ((rows or drafted) and not self.cont_batching):
            for r in self.running:
                if r.pending and budget > 0:
                    chunk = r.pending[:budget]
                    budget -= len(chunk)
                    rows.append((r, chunk))
        return StepPlan(rows, list(drafted))

    def claim_slots(self, plan: StepPlan, now: float) -> list[Row]:
        """Rows running their first prompt token take the lowest free slot (a pinned row its
        own); returns them."""
        started = []
        for row, _ in plan.rows:
            if row.slot < 0:
                row.slot = row.request.id_slot if row.request.id_slot >= 0 else min(
                    set(range(self.parallel)) - self.claimed_slots())
                row.t_start = now
                started.append(row)
        return started

    def shift_context(self, row: Row) -> None:
        """b10621's context shift: keep the first n_keep tokens, drop n_discard after them
        (default half the rest), keep going. Kept keys keep their rotation; positions go on."""
        req, seq = row.request, row.cache
        n_keep = req.n_keep if req.n_keep != 0 else self.keep
        if n_keep < 0:
            n_keep = len(req.prompt)
        n_keep = max(0, min(n_keep, self.n_ctx_slot - 4))
        n_left = seq.length - n_keep
        n_discard = req.n_discard if req.n_discard > 0 else n_left // 2
        n_discard = max(1, min(n_discard, n_left))
        row.cache = self.kv.compact(seq, n_keep, n_discard)
        row.shifted = True

    def remove(self, row: Row) -> bool:
        """Take a finished row out, remembering it as its slot's last request; False when it
        was already gone."""
        if row.slot >= 0:
            self.last_by_slot[row.slot] = self.slot_info(row, processing=False)
        if row not in self.running:
            return False
        self.running.remove(row)
        return True

    def slot_info(self, row: Row, processing: bool) -> SlotInfo:
        req = row.request
        return SlotInfo(
            id=row.slot, n_ctx=self.n_ctx_slot, is_processing=processing, id_task=req.id,
            n_prompt_tokens=len(req.prompt), n_prompt_tokens_processed=row.n_prompt_done,
            n_prompt_tokens_cache=row.n_cached, request=req, has_next_token=processing,
            has_new_line=row.has_new_line, n_remain=max(row.max_tokens - len(row.generated), 0),
            n_decoded=len(row.generated))

    def slots(self) -> list[SlotInfo]:
        """A snapshot of every slot: the live request on it, else what last ran there."""
        rows = {r.slot: r for r in list(self.running) if r.slot >= 0}
        out = []
        for i in range(self.parallel):
            row = rows.get(i)
            if row is not None:
                out.append(self.slot_info(row, processing=True))
            elif i in self.last_by_slot:
                last = self.last_by_slot[i]
                out.append(SlotInfo(**{**vars(last), "is_processing": False, "has_next_token": False}))
            else:
                out.append(SlotInfo(id=i, n_ctx=self.n_ctx_slot, is_processing=False))
        return out
