"""The engine: one loop on its own thread turns requests into token events.

Each step plans the rows to run (every decoding row plus prompt chunks under the `batch_size`
token budget) as one forward, which the backend packs when row lengths differ, then samples,
detokenizes and stop-checks each row that finished its prompt. KV lives in a paged block
pool (kv_block_pool.py); admission adopts the longest cached prefix (kv_prefix_cache.py)
and release donates the row's blocks back. The only bridge to asyncio is `RequestHandle`:
events are handed to the request's event loop with `call_soon_threadsafe`. A request
takes the lowest free slot when its first prompt token is processed, and gives it back
when it finishes or is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from mlxcel.engine.backend import Backend, ForwardRow
from mlxcel.engine.decode_pipeline import DecodePipeline
from mlxcel.engine.detokenize import IncrementalDetokenizer
from mlxcel.engine.kv_block_pool import RESERVED, BlockAllocator, OutOfBlocks
from mlxcel.engine.kv_prefix_cache import PrefixCache
from mlxcel.engine.sampling import SamplerState, sample_row
from mlxcel.engine.stop import StopMatcher
from mlxcel.engine.sampling_dry import DryVocab
from mlxcel.engine.sleep import IdleSleeper
from mlxcel.engine.slot_actions import SlotJob, run_slot_job
from mlxcel.engine.tokenizer import Tokenizer
from mlxcel.engine.types import (
    EngineError, EngineStats, GenerationRequest, PromptProgress, SlotInfo, Timings, TokenEvent,
)

log = logging.getLogger("mlxcel.engine")


class RequestHandle:
    """The asyncio side of one request: an async iterator of TokenEvents, and cancel()."""

    def __init__(self, request: GenerationRequest, engine: "Engine") -> None:
        self.request = request
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self.cancelled = False
        self.finished = False
        self.retired = False  # the engine's queue accounting is done with it

    def _push(self, event: TokenEvent) -> None:  # engine thread
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
            self._engine._wake()

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
    n_prompt_done: int = 0  # prompt tokens processed so far (the cache-supplied ones included)
    n_cached: int = 0  # prompt tokens the prefix cache supplied
    shifted: bool = False  # a context shift rewrote the KV (it is not offered to the prefix cache)
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


@dataclass
class _ScoreJob:
    """One unsteered pass over a prompt on a fresh sequence: the next-token logits (scoring),
    or with `hidden` the final hidden states of every position (embeddings)."""

    prompt: list[int]
    future: Future
    capture: dict | None = None  # residual reads (per-request SAE activations); never steering
    hidden: bool = False
    lora: tuple | None = None  # the server's LoRA scales when the pass was queued


# Token-block size of the paged KV pool and the prefix cache's sharing granularity.
BLOCK_SIZE = 16


class Engine:
    """`n_ctx` is the total context; each of the `parallel` slots gets an equal share.
    `cache_budget_bytes`: the prefix cache's byte budget (None: bounded only by the pool,
    0: no prefix cache)."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, *, n_ctx: int,
                 parallel: int = 4, batch_size: int = 512, cache_prompt: bool = True,
                 cache_budget_bytes: int | None = 2048 << 20, cont_batching: bool = True,
                 max_queue_depth: int = 64, context_shift: bool = False, keep: int = 0,
                 special: bool = False, sleep_idle_seconds: int = -1,
                 reload: Callable[[], Backend] | None = None, speculator=None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.parallel = max(1, parallel)
        self.n_ctx = n_ctx
        self.n_ctx_slot = max(n_ctx // self.parallel, 2)
        self.batch_size = max(1, batch_size)
        self.cont_batching = cont_batching
        self.max_queue_depth = max_queue_depth  # waiting requests beyond the free slots; -1: unbounded
        self.context_shift = context_shift  # at the bound: drop tokens after n_keep instead of stopping
        self.keep = keep  # the server's default n_keep (--keep)
        self.special = special  # --special: special tokens are rendered as their text
        self.speculator = speculator  # engine/speculative.Speculator (--spec-type / -md), or None
        # greedy rows queue their next forward before the host books the token (engine/decode_pipeline.py),
        # wherever the backend can pick a token on its device
        self.pipeline_decode = hasattr(backend, "decode_greedy")
        self._pipe = DecodePipeline()
        self._outstanding = 0  # submitted and not yet retired (queued or holding a slot)
        self._count_lock = threading.Lock()
        self._cache_prompt, self._cache_budget = cache_prompt, cache_budget_bytes
        self.prefix_cache = self._configure_kv(cache_prompt, cache_budget_bytes)
        # --sleep-idle-seconds: free the model when idle, reload it on the next work (engine/sleep.py)
        self.sleeper = IdleSleeper(sleep_idle_seconds, reload) if sleep_idle_seconds >= 0 and reload else None
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: list[RequestHandle] = []
        self._rows: list[_Row] = []
        self._stopping = False
        self._dry_vocab: DryVocab | None = None
        self._stats = EngineStats(t_start=time.time(), kv_cache_capacity=self.n_ctx_slot * self.parallel)
        self._last_by_slot: dict[int, SlotInfo] = {}
        # each slot's token stream: what its last request left in its KV (save / restore / erase)
        self.slot_tokens: dict[int, list[int]] = {}
        self._slot_jobs: list[SlotJob] = []  # waiting for their slot to be idle, as upstream defers them
        self.lora = None  # the served LoRA adapters' live scales (models/lora.LoraSet), if any
        self._thread = threading.Thread(target=self._run, name="mlxcel-engine", daemon=True)

    def _configure_kv(self, cache_prompt: bool, budget_bytes: int | None) -> PrefixCache:
        """Size the block pool: every slot's full share, plus the prefix cache's budget."""
        per_slot = -(-self.n_ctx_slot // BLOCK_SIZE) + 1
        if not cache_prompt or budget_bytes == 0:
            budget_blocks = 0
        elif budget_bytes is None:
            budget_blocks = None
        else:
            per_block = max(self.backend.kv_bytes_per_token, 1) * BLOCK_SIZE
            budget_blocks = max(budget_bytes // per_block, 1)
        extra = budget_blocks if budget_blocks is not None else 4 * per_slot * self.parallel
        self.backend.configure_kv(num_blocks=RESERVED + per_slot * self.parallel + extra, block_size=BLOCK_SIZE)
        return PrefixCache(self.backend.allocator, budget_blocks)

    @property
    def is_sleeping(self) -> bool:
        return self.sleeper is not None and self.sleeper.asleep

    def drop_backend(self) -> None:
        """Sleep: let go of the weights, the KV pool and the prompt cache that lived in it."""
        self._pipe.reset()  # a step queued ahead holds the old pool's arrays
        self.backend = None
        self.prefix_cache = PrefixCache(BlockAllocator(RESERVED + 1, BLOCK_SIZE), 0)

    def adopt_backend(self, backend: Backend) -> None:
        """Wake: a freshly loaded backend, its KV pool sized as at start."""
        self.backend = backend
        self.prefix_cache = self._configure_kv(self._cache_prompt, self._cache_budget)

    def kv_usage(self) -> dict[str, int]:
        """Block pool occupancy, for /metrics and /props (all zero while asleep)."""
        if self.backend is None:
            return {"block_size": BLOCK_SIZE, "total_blocks": 0, "used_blocks": 0, "cached_blocks": 0,
                    "free_blocks": 0}
        a = self.backend.allocator
        return {"block_size": a.block_size, "total_blocks": a.num_blocks - RESERVED, "used_blocks": a.used_blocks,
                "cached_blocks": self.prefix_cache.cached_blocks, "free_blocks": a.free_blocks}

    # -- asyncio side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake()
        self._thread.join(timeout=10)

    @property
    def outstanding(self) -> int:
        """Requests accepted and not yet finished (queued or holding a slot)."""
        return self._outstanding

    def drain(self, timeout: float, poll: float = 0.05) -> bool:
        """Wait (blocking; not on the event loop) until every accepted request has finished,
        at most `timeout` seconds; whether the engine is idle. New requests are the caller's
        to keep out (a model switch refuses them with model_busy before draining)."""
        deadline = time.monotonic() + max(timeout, 0)
        while self._outstanding > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True

    def _queued(self) -> int:
        """Requests accepted but not yet holding a slot."""
        return max(self._outstanding - len(self._rows), 0)

    def _retire(self, handle: RequestHandle) -> None:
        """A request leaves the engine (finished or dropped): free its place in the queue."""
        with self._count_lock:
            if not handle.retired:
                handle.retired = True
                self._outstanding -= 1

    def submit(self, request: GenerationRequest) -> RequestHandle:
        n = len(request.prompt)
        if n == 0:
            raise EngineError("the prompt is empty", "invalid_request", 400)
        if n >= self.n_ctx_slot:
            raise EngineError(
                f"request ({n} tokens) exceeds the available context size ({self.n_ctx_slot} tokens), try increasing it",
                "context_length_exceeded", 400, n_prompt_tokens=n, n_ctx=self.n_ctx_slot,
            )
        with self._count_lock:
            if self.max_queue_depth >= 0 and self._outstanding >= self.parallel + self.max_queue_depth:
                self._stats.n_rejected_total += 1
                raise EngineError(f"the server is busy: {self.max_queue_depth} requests are already waiting "
                                  "for a slot; retry later", "queue_full", 503)
            self._outstanding += 1
        if self.lora is not None:
            if request.lora is None:  # snapshot now: a later change of the server's scales never reaches it
                request.lora = self.lora.snapshot()
            if any(request.lora):  # adapted KV must never be shared with another request's prefix
                request.cache_prompt = False
        handle = RequestHandle(request, self)
        self._inbox.put(handle)
        return handle

    def _wake(self) -> None:
        self._inbox.put(None)

    def submit_score(self, prompt: list[int], capture: dict | None = None) -> Future:
        """Queue one scoring forward; the future resolves to the next-token logits
        ([vocab] fp32). It runs on the engine thread between steps, so it never races
        the step loop, and on its own sequence, so no other row's batch shape touches it."""
        n = len(prompt)
        if n == 0:
            raise EngineError("the prompt is empty", "invalid_request", 400)
        if n >= self.n_ctx_slot:
            raise EngineError(
                f"request ({n} tokens) exceeds the available context size ({self.n_ctx_slot} tokens), try increasing it",
                "context_length_exceeded", 400, n_prompt_tokens=n, n_ctx=self.n_ctx_slot,
            )
        job = _ScoreJob(list(prompt), Future(), capture, lora=self.lora.snapshot() if self.lora is not None else None)
        self._inbox.put(job)
        return job.future

    def submit_slot_action(self, action: str, slot: int, tokens: list[int] | None = None) -> Future:
        """Queue a slot save / restore / erase; it runs on the engine thread once the slot is
        idle. The future resolves to the slot's tokens (save), the restored count (restore) or
        the erased count (erase)."""
        if not 0 <= slot < self.parallel:
            raise EngineError("Invalid slot ID", "invalid_request", 400)
        job = SlotJob(action, slot, tokens, Future())
        self._inbox.put(job)
        return job.future

    def submit_hidden(self, prompt: list[int]) -> Future:
        """Queue one embedding pass; the future resolves to the prompt's final hidden states
        ([n, hidden] fp32, after the model's final norm). Like `submit_score` it runs on the
        engine thread on its own sequence, and carries no steering: every attached SAE is
        suppressed for this pass only. The whole context is usable (nothing is generated)."""
        n = len(prompt)
        if n == 0:
            raise EngineError("the input is empty", "invalid_request", 400)
        if n > self.n_ctx_slot:
            raise EngineError(f"input ({n} tokens) exceeds the available context size ({self.n_ctx_slot} tokens)",
                              "context_length_exceeded", 400, n_prompt_tokens=n, n_ctx=self.n_ctx_slot)
        job = _ScoreJob(list(prompt), Future(), hidden=True)
        self._inbox.put(job)
        return job.future

    def score(self, prompt: list[int]) -> np.ndarray:
        """Blocking form of `submit_score` (not for the event loop's thread)."""
        return self.submit_score(prompt).result()

    def slots(self) -> list[SlotInfo]:
        """A snapshot of every slot: the live request on it, else what last ran there."""
        rows = {r.slot: r for r in list(self._rows) if r.slot >= 0}
        out = []
        for i in range(self.parallel):
            row = rows.get(i)
            if row is not None:
                out.append(self._slot_info(row, processing=True))
            elif i in self._last_by_slot:
                last = self._last_by_slot[i]
                out.append(SlotInfo(**{**vars(last), "is_processing": False, "has_next_token": False}))
            else:
                out.append(SlotInfo(id=i, n_ctx=self.n_ctx_slot, is_processing=False))
        return out

    def stats(self, reset_bucket: bool = False) -> EngineStats:
        """The /metrics counters; `reset_bucket` starts a new throughput window."""
        st = self._stats
        rows = list(self._rows)
        kv = self.kv_usage()
        snap = EngineStats(**{**vars(st), "n_processing": sum(r.slot >= 0 for r in rows),
                              "n_deferred": self._queued() + sum(r.slot < 0 for r in rows),
                              "kv_cache_tokens": sum(r.n_prompt_done + len(r.generated) for r in rows),
                              "kv_blocks_total": kv["total_blocks"], "kv_blocks_used": kv["used_blocks"],
                              "kv_blocks_cached": kv["cached_blocks"], "kv_blocks_free": kv["free_blocks"]})
        if reset_bucket:
            st.n_prompt_tokens_processed = st.n_tokens_predicted = 0
            st.t_prompt_processing = st.t_tokens_generation = 0.0
        return snap

    def _slot_info(self, row: _Row, processing: bool) -> SlotInfo:
        req = row.request
        return SlotInfo(
            id=row.slot, n_ctx=self.n_ctx_slot, is_processing=processing, id_task=req.id,
            n_prompt_tokens=len(req.prompt), n_prompt_tokens_processed=row.n_prompt_done,
            n_prompt_tokens_cache=row.n_cached, request=req, has_next_token=processing,
            has_new_line=row.has_new_line, n_remain=max(row.max_tokens - len(row.generated), 0),
            n_decoded=len(row.generated))

    @property
    def dry_vocab(self) -> DryVocab:
        """DRY's view of the vocabulary, built on first use and kept for the model's life."""
        if self._dry_vocab is None:
            tok = self.tokenizer
            self._dry_vocab = DryVocab(tok.pieces, lambda text: tok.encode(text, add_special_tokens=False))
        return self._dry_vocab

    # -- engine thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._fail_leftovers()

    def _fail_leftovers(self) -> None:
        """On shutdown, every request still held ends with an error event rather than hanging
        its client (a model switch whose graceful timeout ran out)."""
        self._drain(block=False)
        for row in list(self._rows):
            self._finish(row, TokenEvent(error="the model was unloaded before this request finished",
                                         error_code="model_busy"))
        for h in self._waiting:
            self._retire(h)
            h._push(TokenEvent(error="the model was unloaded before this request started", error_code="model_busy"))
        self._waiting.clear()

    def _loop(self) -> None:
        while not self._stopping:
            self._drain(block=not self._rows and not self._waiting)
            if self.sleeper is not None:
                if self._waiting or self._slot_jobs:
                    self._wake_up()
                self.sleeper.tick(self, idle=not (self._rows or self._waiting or self._slot_jobs))
            self._slot_actions()
            self._admit()
            self._reap_cancelled()
            if self._rows:
                try:
                    self._step()
                except Exception as e:  # a broken step fails its rows, not the server
                    log.exception("engine step failed")
                    self._pipe.reset()
                    for row in list(self._rows):
                        try:
                            self._finish(row, TokenEvent(error=f"generation failed: {e}", error_code="server_error"))
                        except Exception:  # the loop outlives any one row's cleanup
                            log.exception("failing a row after a broken step failed too")
                            if row in self._rows:
                                self._rows.remove(row)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(item, _ScoreJob):
                    self._wake_up()
                    self._score(item)
                elif isinstance(item, SlotJob):
                    self._slot_jobs.append(item)
                elif item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _wake_up(self) -> None:
        if self.sleeper is None:
            return
        try:
            self.sleeper.ensure_awake(self)
        except Exception:  # stay asleep; the work that needed the model fails on its own
            log.exception("reloading the model after sleep failed")

    def _score(self, job: _ScoreJob) -> None:
        """Prefill the prompt in `batch_size` chunks on a fresh sequence; keep the last logits
        (or, for an embedding pass, every chunk's hidden states)."""
        if not job.future.set_running_or_notify_cancel():
            return
        seq = self.backend.new_sequence()
        try:
            logits, hidden = None, []
            for start in range(0, len(job.prompt), self.batch_size):
                chunk = job.prompt[start:start + self.batch_size]
                if job.hidden:
                    hidden.append(self.backend.hidden_states(chunk, seq))
                else:
                    logits = self.backend.forward([ForwardRow(chunk, seq, None, job.capture, job.lora)])
            job.future.set_result(np.concatenate(hidden).astype(np.float32) if job.hidden
                                  else np.array(logits[0], dtype=np.float32, copy=True))
        except OutOfBlocks as e:
            what = "embedding" if job.hidden else "scoring"
            job.future.set_exception(EngineError(f"no KV memory left for the {what} pass: {e}",
                                                 "insufficient_memory", 503))
        except Exception as e:  # a failed pass fails its request, not the engine
            log.exception("%s forward failed", "embedding" if job.hidden else "scoring")
            job.future.set_exception(e)
        finally:
            seq.release()

    def _slot_actions(self) -> None:
        busy = self._claimed_slots()
        for job in [j for j in self._slot_jobs if j.slot not in busy]:
            self._slot_jobs.remove(job)
            run_slot_job(self, job)

    def _claimed_slots(self) -> set[int]:
        """Slots a row holds, or that a pinned row (id_slot) will take at its first token."""
        return {r.slot if r.slot >= 0 else r.request.id_slot for r in self._rows} - {-1}

    def _next_admissible(self) -> RequestHandle | None:
        """FIFO, except that a request pinned to a busy slot waits without blocking the rest."""
        claimed = self._claimed_slots()
        for handle in self._waiting:
            pin = handle.request.id_slot
            if handle.cancelled or pin < 0 or pin not in claimed:
                self._waiting.remove(handle)
                return handle
        return None

    def _admit(self) -> None:
        while self._waiting and len(self._rows) < self.parallel:
            handle = self._next_admissible()
            if handle is None:
                return
            if handle.cancelled:
                handle.finished = True
                self._retire(handle)
                continue
            req = handle.request
            room = self.n_ctx_slot - len(req.prompt)
            if self.context_shift:  # the bound shifts instead of stopping: only n_predict limits
                max_tokens = req.max_tokens if req.max_tokens >= 0 else 2**62
            else:
                max_tokens = room if req.max_tokens < 0 else min(req.max_tokens, room)
            seq = self.backend.new_sequence()
            if req.media is not None:  # the VLM backend splices it during prefill (backends/torch/vlm.py)
                seq.media = req.media
            cached = 0
            if req.cache_prompt and req.media is None:
                cached = self.prefix_cache.adopt(seq, req.prompt, self.backend.copy_slots)
            self._rows.append(_Row(
                handle=handle, cache=seq, pending=list(req.prompt[cached:]), n_cached=cached,
                n_prompt_done=cached, sampler=self._sampler_state(req),
                detok=IncrementalDetokenizer(self._decoder(req.keep_tokens)),
                stop=StopMatcher(req.stop), max_tokens=max_tokens,
                grammar=req.grammar.matcher() if req.grammar is not None else None,
                budget=req.reasoning.tracker(req.prompt) if req.reasoning is not None else None,
            ))

    def _decoder(self, keep: frozenset[int]):
        """--special shows every special token as text; otherwise only the row's kept markers
        (tool-call markers its output parser needs) survive decoding."""
        if self.special:
            return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decoder(keep)

    def _sampler_state(self, req: GenerationRequest) -> SamplerState:
        p = req.params
        needs_vocab = p.mirostat == 0 and "dry" in p.samplers and p.dry_enabled and p.dry_sequence_breakers
        return SamplerState.create(p, dry_vocab=self.dry_vocab if needs_vocab else None,
                                   n_ctx_train=self.backend.info.context_length)

    def _reap_cancelled(self) -> None:
        for row in [r for r in self._rows if r.handle.cancelled]:
            self._account(row, self._timings(row))
            self._rows.remove(row)
            self._release(row)
            row.handle.finished = True
            self._retire(row.handle)
        for h in [h for h in self._waiting if h.cancelled]:
            self._waiting.remove(h)
            self._retire(h)

    def _free_slot(self, row: _Row) -> int:
        if row.request.id_slot >= 0:
            return row.request.id_slot  # admission kept it free for this row
        used = self._claimed_slots()
        return next(i for i in range(self.parallel) if i not in used)

    def _shift_context(self, row: _Row) -> None:
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
        row.cache = self.backend.compact(seq, n_keep, n_discard)
        seq.release()  # never donated: its later blocks no longer match their token positions
        row.shifted = True

    def _release(self, row: _Row) -> None:
        """Give the row's KV back, offering its full blocks to the prefix cache first."""
        if row.lazy_pos is not None:  # the row stopped on a token whose successor was queued ahead
            row.cache.truncate(row.lazy_pos)
            row.lazy_pos = None
        if self.speculator is not None:
            self.speculator.before_release(row)  # trims a mid-verification KV first
        if row.slot >= 0:
            self.slot_tokens[row.slot] = list(row.cache.tokens)
        if row.request.cache_prompt and not row.shifted and row.request.media is None:
            self.prefix_cache.insert(row.cache.tokens, row.cache.blocks)
        row.cache.release()
        self.prefix_cache.trim()

    def _plan(self, drafted: list[tuple[_Row, list[int]]] = ()) -> list[tuple[_Row, list[int]]]:
        """This step's one forward: every decoding row, then prefill chunks under the
        `batch_size` token budget (the backend packs rows of different lengths, so a chunk
        costs the decode rows nothing). Without continuous batching, prompts are only processed
        when nothing is decoding. Rows with a draft are verified in the same forward instead
        (`_forward`'s `drafted`)."""
        verifying = {id(r) for r, _ in drafted}
        plan = [(r, [r.next_token]) for r in self._rows if not r.pending and id(r) not in verifying]
        budget = max(self.batch_size - len(plan) - sum(len(d) + 1 for _, d in drafted), 1)
        if (plan or drafted) and not self.cont_batching:
            return plan
        for r in self._rows:
            if r.pending and budget > 0:
                chunk = r.pending[:budget]
                budget -= len(chunk)
                plan.append((r, chunk))
        return plan

    def _step(self) -> None:
        if self.pipeline_decode and self.speculator is None and self._pipe.step(self):
            return
        spec = self.speculator
        drafted = spec.draft(self, [r for r in self._rows if not r.pending]) if spec is not None else []
        plan = self._plan(drafted)
        if plan or drafted:
            self._forward(plan, drafted)

    def _forward(self, plan: list[tuple[_Row, list[int]]], drafted=()) -> None:
        """The step's one backend forward over `plan` and the drafted rows' verify positions
        (engine/speculative.py), which are sampled after the plan's rows."""
        now = time.perf_counter()
        for row, _ in plan:
            if row.slot < 0:
                row.slot, row.t_start = self._free_slot(row), now
                self._progress(row)
        verify, spans = self.speculator.verify_rows(drafted) if drafted else ([], [])
        logits = self.backend.forward([self._forward_row(row, toks) for row, toks in plan] + verify)
        self._stats.n_decode_total += 1
        self._stats.n_busy_slots_total += len(plan) + len(spans)
        for i, (row, toks) in enumerate(plan):
            if row.pending:
                del row.pending[: len(toks)]
                row.n_prompt_done += len(toks)
                self._stats.n_prompt_tokens_processed_total += len(toks)
                self._stats.n_prompt_tokens_processed += len(toks)
                self._progress(row)
                if row.pending:
                    continue
                row.t_first = time.perf_counter()
                prompt_ms = (row.t_first - row.t_start) * 1e3
                self._stats.t_prompt_processing_total += prompt_ms
                self._stats.t_prompt_processing += prompt_ms
            self._sample(row, logits[i])
        if spans:
            self.speculator.accept(self, spans, logits[len(plan):])

    @staticmethod
    def _forward_row(row: _Row, tokens: list[int]) -> ForwardRow:
        """The backend's view of one row for a step: its tokens, KV, steering, captures, LoRA scales."""
        req = row.request
        return ForwardRow(tokens, row.cache, req.steering, req.capture, req.lora, decode=not row.pending)

    def _progress(self, row: _Row) -> None:
        if row.request.return_progress:
            row.handle._push(TokenEvent(slot=row.slot, prompt_tokens=len(row.request.prompt), progress=PromptProgress(
                total=len(row.request.prompt), cache=row.n_cached, processed=row.n_prompt_done,
                time_ms=(time.perf_counter() - row.t_start) * 1e3)))

    def _line_limits(self, row: _Row, piece: str, released: str) -> int | None:
        """b10621's n_indent and t_max_predict_ms checks after one token. Returns the
        content length to cut to when the request must stop here, else None."""
        req = row.request
        row.text += piece
        cut = None
        if req.n_indent > 0:
            if row.last_nl_pos > 0:
                pos, text = row.last_nl_pos, row.text
                while pos < len(text) and text[pos] in " \t":
                    pos += 1
                if pos < len(text) and pos - row.last_nl_pos < req.n_indent:
                    cut = pos
            nl = row.text.find("\n", row.last_nl_pos)
            if nl >= 0:
                row.last_nl_pos = nl + 1
        if "\n" in released:
            row.has_new_line = True
            if (cut is None and req.t_max_predict_ms > 0 and row.t_first
                    and (time.perf_counter() - row.t_first) * 1e3 > req.t_max_predict_ms):
                cut = -1
        return cut

    def _sample(self, row: _Row, logits) -> None:
        req = row.request
        # a spent thinking budget (or a reasoning_end) injects its forced run in place of sampling
        forced = row.budget.forced() if row.budget is not None else None
        if forced is not None:
            token, probs = forced, None
        else:
            mask = None
            if row.grammar is not None:
                mask = row.grammar.allowed_mask(len(logits))  # None: a lazy grammar not triggered yet
                if mask is not None and not mask.any():
                    self._finish(row, TokenEvent(error=f"the grammar allows no token here: {row.grammar.error()}",
                                                 error_code="constrained_output_invalid"))
                    return
            sampled = sample_row(logits, req.params, row.sampler, history=req.prompt + row.generated, mask=mask)
            token, probs = sampled.token, sampled.probs
        self._take(row, token, probs)

    def _take(self, row: _Row, token: int, probs) -> None:
        """Book one chosen token: detokenize, stop-check, then finish the row or push its event."""
        req = row.request
        if row.budget is not None:
            row.budget.observe(token)
        row.generated.append(token)
        # the grammar ended the document: this token is its last (EOS was only allowed at an end)
        ended = (row.grammar is not None and token not in self.tokenizer.eos_token_ids
                 and row.grammar.accept(token) and row.grammar.is_terminated())
        self._stats.n_tokens_max = max(self._stats.n_tokens_max, len(req.prompt) + len(row.generated))
        if token in self.tokenizer.eos_token_ids and not req.ignore_eos:
            # upstream appends the end token's piece before it stops: its text under --special
            eos_text = row.detok.add(token) if self.special else ""
            tail = row.stop.feed(eos_text + row.detok.flush())
            if tail.matched is not None:
                self._finish(row, TokenEvent(text=tail.text, token=token, finish_reason="stop",
                                             stop_type="word", stopping_word=tail.matched, probs=probs))
            else:
                self._finish(row, TokenEvent(text=tail.text + row.stop.flush(), token=token,
                                             finish_reason="stop", stop_type="eos", probs=probs))
            return
        piece = row.detok.add(token)
        res = row.stop.feed(piece)
        if res.matched is not None:
            self._finish(row, TokenEvent(text=res.text, token=token, finish_reason="stop",
                                         stop_type="word", stopping_word=res.matched, probs=probs))
            return
        cut = self._line_limits(row, piece, res.text)
        if ended:
            tail = row.stop.feed(row.detok.flush())
            self._finish(row, TokenEvent(text=res.text + tail.text + row.stop.flush(), token=token,
                                         finish_reason="stop", stop_type="eos", probs=probs))
            return
        if len(row.generated) >= row.max_tokens or cut is not None:
            tail = row.stop.feed(row.detok.flush())
            if tail.matched is not None:
                self._finish(row, TokenEvent(text=res.text + tail.text, token=token, finish_reason="stop",
                                             stop_type="word", stopping_word=tail.matched, probs=probs))
            else:
                self._finish(row, TokenEvent(text=res.text + tail.text + row.stop.flush(), token=token,
                                             finish_reason="length", stop_type="limit", probs=probs,
                                             truncate_to=cut if cut is not None and cut >= 0 else None))
            return
        row.next_token = token
        if row.cache.length + 1 > self.n_ctx_slot:  # only reachable with context shift on
            self._shift_context(row)
        row.handle._push(TokenEvent(text=res.text, token=token, slot=row.slot, probs=probs,
                                    prompt_tokens=len(req.prompt), completion_tokens=len(row.generated),
                                    has_new_line=row.has_new_line, timings=self._timings(row)))

    def _account(self, row: _Row, timings: Timings) -> None:
        """A request leaves its slot (finished or cancelled): count its generation."""
        st = self._stats
        st.n_tokens_predicted_total += len(row.generated)
        st.n_tokens_predicted += len(row.generated)
        if row.generated:
            st.t_tokens_generation_total += timings.predicted_ms
            st.t_tokens_generation += timings.predicted_ms
        if row.slot >= 0:
            self._last_by_slot[row.slot] = self._slot_info(row, processing=False)

    def _timings(self, row: _Row, now: float | None = None) -> Timings:
        now = time.perf_counter() if now is None else now
        t_first = row.t_first or now
        extra = self.speculator.timings(row) if self.speculator is not None else {}
        return Timings(cache_n=row.n_cached, prompt_n=len(row.request.prompt) - row.n_cached, prompt_ms=(t_first - row.t_start) * 1e3,
                       predicted_n=len(row.generated), predicted_ms=(now - t_first) * 1e3, **extra)

    def _finish(self, row: _Row, event: TokenEvent) -> None:
        now = time.perf_counter()
        event.truncated = row.shifted or len(row.request.prompt) + len(row.generated) >= self.n_ctx_slot
        event.slot = row.slot
        event.prompt_tokens = len(row.request.prompt)
        event.completion_tokens = len(row.generated)
        event.has_new_line = event.has_new_line or row.has_new_line
        event.timings = self._timings(row, now)
        self._account(row, event.timings)
        if row in self._rows:
            self._rows.remove(row)
            self._release(row)
        self._retire(row.handle)
        row.handle._push(event)
