"""The engine: one loop on its own thread turns requests into token events.

Each step plans the rows to run (every decoding row plus prefill chunks under the
`batch_size` token budget), runs one backend forward for all of them, then samples,
detokenizes and stop-checks each row that finished its prompt. The only bridge to
asyncio is `RequestHandle`: events are handed to the request's event loop with
`call_soon_threadsafe`. A request takes the lowest free slot when its first prompt
token is processed, and gives it back when it finishes or is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from mlxcel.backends.base import Backend, ForwardRow
from mlxcel.engine.detokenize import IncrementalDetokenizer
from mlxcel.engine.sampling import SamplerState, sample_row
from mlxcel.engine.stop import StopMatcher
from mlxcel.engine.tokenizer import Tokenizer
from mlxcel.engine.types import EngineError, GenerationRequest, Timings, TokenEvent

log = logging.getLogger("mlxcel.engine")


class RequestHandle:
    """The asyncio side of one request: an async iterator of TokenEvents, and cancel()."""

    def __init__(self, request: GenerationRequest, engine: "Engine") -> None:
        self.request = request
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.cancelled = False
        self.finished = False

    def _push(self, event: TokenEvent) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def cancel(self) -> None:
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._engine._wake()

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event.done:
            self.finished = True
        return event


@dataclass
class _Row:
    handle: RequestHandle
    cache: object
    pending: list[int]
    sampler: SamplerState
    detok: IncrementalDetokenizer
    stop: StopMatcher
    max_tokens: int
    slot: int = -1
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None
    t_start: float = 0.0
    t_first: float = 0.0

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request


class Engine:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, *, n_ctx: int,
                 parallel: int = 4, batch_size: int = 512) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.parallel = max(1, parallel)
        self.batch_size = max(1, batch_size)
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: list[RequestHandle] = []
        self._rows: list[_Row] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mlxcel-engine", daemon=True)

    # -- asyncio side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake()
        self._thread.join(timeout=10)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        n = len(request.prompt)
        if n == 0:
            raise EngineError("the prompt is empty", "invalid_request", 400)
        if n >= self.n_ctx:
            raise EngineError(
                f"request ({n} tokens) exceeds the available context size ({self.n_ctx} tokens), try increasing it",
                "context_length_exceeded", 400, n_prompt_tokens=n, n_ctx=self.n_ctx,
            )
        handle = RequestHandle(request, self)
        self._inbox.put(handle)
        return handle

    def _wake(self) -> None:
        self._inbox.put(None)

    # -- engine thread -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._drain(block=not self._rows and not self._waiting)
            self._admit()
            self._reap_cancelled()
            if self._rows:
                try:
                    self._step()
                except Exception as e:  # a broken step fails its rows, not the server
                    log.exception("engine step failed")
                    for row in list(self._rows):
                        self._finish(row, TokenEvent(error=f"generation failed: {e}", error_code="server_error"))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self) -> None:
        while self._waiting and len(self._rows) < self.parallel:
            handle = self._waiting.pop(0)
            if handle.cancelled:
                handle.finished = True
                continue
            req = handle.request
            room = self.n_ctx - len(req.prompt)
            max_tokens = room if req.max_tokens < 0 else min(req.max_tokens, room)
            self._rows.append(_Row(
                handle=handle, cache=self.backend.new_sequence(), pending=list(req.prompt),
                sampler=SamplerState.create(req.params),
                detok=IncrementalDetokenizer(self.tokenizer.decode),
                stop=StopMatcher(req.stop), max_tokens=max_tokens,
            ))

    def _reap_cancelled(self) -> None:
        for row in [r for r in self._rows if r.handle.cancelled]:
            self._rows.remove(row)
            row.handle.finished = True
        self._waiting = [h for h in self._waiting if not h.cancelled]

    def _free_slot(self) -> int:
        used = {r.slot for r in self._rows}
        return next(i for i in range(self.parallel) if i not in used)

    def _plan(self) -> list[tuple[_Row, list[int]]]:
        plan = [(r, [r.next_token]) for r in self._rows if not r.pending]
        budget = max(self.batch_size - len(plan), 1)
        for r in self._rows:
            if r.pending and budget > 0:
                chunk = r.pending[:budget]
                budget -= len(chunk)
                plan.append((r, chunk))
        return plan

    def _step(self) -> None:
        plan = self._plan()
        now = time.perf_counter()
        for row, _ in plan:
            if row.slot < 0:
                row.slot, row.t_start = self._free_slot(), now
        logits = self.backend.forward([ForwardRow(toks, row.cache) for row, toks in plan])
        for i, (row, toks) in enumerate(plan):
            if row.pending:
                del row.pending[: len(toks)]
                if row.pending:
                    continue
                row.t_first = time.perf_counter()
            self._sample(row, logits[i])

    def _sample(self, row: _Row, logits) -> None:
        req = row.request
        token = sample_row(logits, req.params, row.sampler, history=req.prompt + row.generated).token
        row.generated.append(token)
        if token in self.tokenizer.eos_token_ids and not req.ignore_eos:
            tail = row.stop.feed(row.detok.flush())
            if tail.matched is not None:
                self._finish(row, TokenEvent(text=tail.text, token=token, finish_reason="stop",
                                             stop_type="word", stopping_word=tail.matched))
            else:
                self._finish(row, TokenEvent(text=tail.text + row.stop.flush(), token=token,
                                             finish_reason="stop", stop_type="eos"))
            return
        res = row.stop.feed(row.detok.add(token))
        if res.matched is not None:
            self._finish(row, TokenEvent(text=res.text, token=token, finish_reason="stop",
                                         stop_type="word", stopping_word=res.matched))
            return
        if len(row.generated) >= row.max_tokens:
            tail = row.stop.feed(row.detok.flush())
            if tail.matched is not None:
                self._finish(row, TokenEvent(text=res.text + tail.text, token=token, finish_reason="stop",
                                             stop_type="word", stopping_word=tail.matched))
            else:
                self._finish(row, TokenEvent(text=res.text + tail.text + row.stop.flush(), token=token,
                                             finish_reason="length", stop_type="limit"))
            return
        row.next_token = token
        row.handle._push(TokenEvent(text=res.text, token=token, slot=row.slot,
                                    prompt_tokens=len(req.prompt), completion_tokens=len(row.generated)))

    def _finish(self, row: _Row, event: TokenEvent) -> None:
        now = time.perf_counter()
        event.slot = row.slot
        event.prompt_tokens = len(row.request.prompt)
        event.completion_tokens = len(row.generated)
        t_first = row.t_first or now
        event.timings = Timings(
            prompt_n=len(row.request.prompt), prompt_ms=(t_first - row.t_start) * 1e3,
            predicted_n=len(row.generated), predicted_ms=(now - t_first) * 1e3,
        )
        if row in self._rows:
            self._rows.remove(row)
        row.handle._push(event)
