"""A request inside the engine: its asyncio handle and its running row.

`RequestHandle` is the only bridge between the engine thread and asyncio: events are handed to
the request's event loop with `call_soon_threadsafe`. `Row` is what the scheduler, the KV
manager and the output processor each keep about one admitted request; every field is plain
data that the three read and write through their own methods.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxcel.engine.backend import ForwardRow
from mlxcel.engine.detokenize import IncrementalDetokenizer
from mlxcel.engine.kv_block_pool import SequenceKV
from mlxcel.engine.sampling import SamplerState
from mlxcel.engine.stop import StopMatcher
from mlxcel.engine.types import GenerationRequest, TokenEvent


class RequestHandle:
    """The asyncio side of one request: an async iterator of TokenEvents, and cancel()."""

    def __init__(self, request: GenerationRequest, wake: Callable[[], None]) -> None:
        self.request = request
        self._wake = wake  # nudges the engine loop so a cancelled row is reaped promptly
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self.cancelled = False
        self.finished = False
        self.retired = False  # the engine's queue accounting is done with it
        self.final: TokenEvent | None = None  # the last event, once read (None: cancelled or running)

    def push(self, event: TokenEvent) -> None:  # engine thread
        if self.cancelled:
            return  # nobody reads it; the row is reaped at the next step
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the caller's event loop is closed: the request is gone
            self.cancelled = True

    def cancel(self) -> None:
        if not self.finished and not self.cancelled:
            self.cancelled = True
            # a consumer still iterating ends (no done event comes for a reaped row)
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)
            self._wake()

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is None:  # cancel()'s wake-up
            self.finished = True
            raise StopAsyncIteration
        if event.done:
            self.finished = True
            self.final = event
        return event


@dataclass
class Row:
    handle: RequestHandle
    cache: SequenceKV
    pending: list[int]  # prompt tokens not yet run
    sampler: SamplerState
    detok: IncrementalDetokenizer
    stop: StopMatcher
    max_tokens: int
    slot: int = -1
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None
    t_start: float = 0.0
    t_first: float = 0.0
    n_prompt_done: int = 0  # prompt tokens processed so far (the cache-supplied ones included)
    n_cached: int = 0  # prompt tokens the prefix cache supplied
    shifted: bool = False  # a context shift rewrote the KV (it is not offered to the prefix cache)
    done: bool = False  # finished or reaped: it holds no slot and no KV any more
    text: str = ""  # every decoded piece so far (before stop matching): n_indent reads it
    last_nl_pos: int = 0  # where the line n_indent checks next begins in `text`
    has_new_line: bool = False
    grammar: object | None = None  # this row's GrammarMatcher (engine/grammar.py), if constrained
    budget: object | None = None  # this row's BudgetTracker (engine/reasoning_budget.py), if budgeted
    spec: object | None = None  # this row's RowSpec (engine/speculative.py) once it speculated
    lazy_pos: int | None = None  # a KV position queued ahead whose token is not booked yet (decode_pipeline.py)

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request

    @property
    def decoding(self) -> bool:
        return not self.pending


def forward_row(row: Row, tokens: list[int]) -> ForwardRow:
    """The backend's view of one row for a step: its tokens, block table, steering, captures, LoRA scales."""
    req = row.request
    return ForwardRow(tokens, row.cache, req.steering, req.capture, req.lora, decode=not row.pending)
