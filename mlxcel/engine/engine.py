"""The engine: one loop on its own thread turns requests into token events.

Each step reads schedule -> run -> postprocess. The scheduler (scheduler.py) admits waiting
requests into slots and plans the step's one forward (every decoding row plus prompt chunks
under the `batch_size` token budget); the backend runs it, packing rows of different lengths;
the output processor (output.py) samples, detokenizes and stop-checks each row whose prompt is
done and pushes its events. KV memory is the KV manager's (kv_manager.py): admission adopts the
longest cached prefix, release donates the row's blocks back. Speculative decoding
(speculative.py) and the pipelined greedy decode (decode_pipeline.py) plug into the step
through the same three parts. Scoring, embedding and slot jobs run on this thread between
steps. The only bridge to asyncio is `RequestHandle` (requests.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from mlxcel.engine.backend import Backend, BackendUnavailable, ForwardRow
from mlxcel.engine.decode_pipeline import DecodePipeline
from mlxcel.engine.kv_block_pool import OutOfBlocks
from mlxcel.engine.kv_manager import RECURRENT_NO_SHIFT, WINDOW_KEPT_FULL, WINDOW_KEPT_SHIFT, KVManager
from mlxcel.engine.kv_memory import slot_share, usage_bytes
from mlxcel.engine.output import OutputProcessor
from mlxcel.engine.requests import RequestHandle, Row, forward_row
from mlxcel.engine.sampling import ProbsReport, prompt_reports
from mlxcel.engine.scheduler import Scheduler, cacheable
from mlxcel.engine.sleep import IdleSleeper
from mlxcel.engine.slot_actions import SlotJob, run_slot_job
from mlxcel.engine.tokenizer import Tokenizer
from mlxcel.engine.types import EngineError, EngineStats, GenerationRequest, SlotInfo, TokenEvent

log = logging.getLogger("mlxcel.engine")


@dataclass
class _ScoreJob:
    """One unsteered pass over a prompt on a fresh sequence: the next-token logits (scoring),
    with `hidden` the final hidden states of every position (embeddings), or with `n_probs`
    the report of every prompt token after the first (/v1/completions echo)."""

    prompt: list[int]
    future: Future
    capture: dict | None = None  # residual reads (per-request SAE activations); never steering
    hidden: bool = False
    lora: tuple | None = None  # the server's LoRA scales when the pass was queued
    n_probs: int = 0  # above 0: each prompt token's probability report instead of the last logits


@dataclass
class _CacheReset:
    """Empty the prefix cache, on the engine thread (it owns the KV); resolves to the blocks let go."""

    future: Future


def _too_long(n: int, n_ctx_slot: int, what: str = "request") -> EngineError:
    return EngineError(f"{what} ({n} tokens) exceeds the available context size ({n_ctx_slot} tokens)"
                       + (", try increasing it" if what == "request" else ""),
                       "context_length_exceeded", 400, n_prompt_tokens=n, n_ctx=n_ctx_slot)


class Engine:
    """`n_ctx` is the total context; each of the `parallel` slots gets an equal share, or the
    whole of it with `kv_unified` (the paged pool grows with use, so that costs no memory up front).
    `cache_budget_bytes`: the prefix cache's byte budget (None: bounded only by the pool,
    0: no prefix cache)."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, *, n_ctx: int,
                 parallel: int = 4, kv_unified: bool = False, batch_size: int = 512, cache_prompt: bool = True,
                 cache_budget_bytes: int | None = 2048 << 20, cont_batching: bool = True,
                 max_queue_depth: int = 64, context_shift: bool = False, keep: int = 0,
                 special: bool = False, swa_full: bool = False, sleep_idle_seconds: int = -1,
                 reload: Callable[[], Backend] | None = None, release_memory: Callable[[], None] | None = None,
                 speculator=None) -> None:
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        # what the memory estimate sizes too
        self.n_ctx_slot, self.parallel = slot_share(n_ctx, parallel, kv_unified)
        self.batch_size = max(1, batch_size)
        self.max_queue_depth = max_queue_depth  # waiting requests beyond the free slots; -1: unbounded
        self.speculator = speculator  # engine/speculative.Speculator (--spec-type / -md), or None
        # --swa-full, or a context shift (it brings kept early tokens back into the window), keeps
        # the blocks behind an all-sliding model's window
        kept = WINDOW_KEPT_FULL if swa_full else WINDOW_KEPT_SHIFT if context_shift else None
        self.kv = KVManager(n_ctx_slot=self.n_ctx_slot, parallel=self.parallel,
                            budget_bytes=cache_budget_bytes if cache_prompt else 0, keep_window=kept)
        self.context_shift_requested = context_shift  # a recurrent model turns it off (adopt_backend)
        self.scheduler = Scheduler(self.kv, parallel=self.parallel, n_ctx_slot=self.n_ctx_slot,
                                   batch_size=self.batch_size, cont_batching=cont_batching,
                                   context_shift=context_shift, keep=keep)
        self.counters = EngineStats(t_start=time.time(), kv_cache_capacity=self.n_ctx_slot * self.parallel)
        self.output = OutputProcessor(tokenizer, self.counters, self, n_ctx_slot=self.n_ctx_slot, special=special)
        self.backend: Backend | None = None
        self.adopt_backend(backend)
        # greedy rows queue their next forward before the host books the token (engine/decode_pipeline.py),
        # wherever the backend can pick a token on its device
        self.pipeline_decode = hasattr(backend, "decode_greedy")
        self._pipe = DecodePipeline()
        self._outstanding = 0  # submitted and not yet retired (queued or holding a slot)
        self._count_lock = threading.Lock()
        # --sleep-idle-seconds: free the model when idle, reload it on the next work (engine/sleep.py)
        # (`reload` and `release_memory` come from the host that loaded the model: runtime/host.py)
        self.sleeper = (IdleSleeper(sleep_idle_seconds, reload, release_memory)
                        if sleep_idle_seconds >= 0 and reload else None)
        self._inbox: queue.Queue = queue.Queue()
        self._stopping = False
        self._stop_reason: str | None = None  # why leftover requests end, when shutdown gave one
        # each slot's token stream: what its last request left in its KV (save / restore / erase)
        self.slot_tokens: dict[int, list[int]] = {}
        self._slot_jobs: list[SlotJob] = []  # waiting for their slot to be idle, as upstream defers them
        self.lora = None  # the served LoRA adapters' live scales (models/lora.LoraSet), if any
        self._thread = threading.Thread(target=self._run, name="mlxcel-engine", daemon=True)

    # -- the model and its KV ------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.sleeper is not None and self.sleeper.asleep

    def drop_backend(self) -> None:
        """Sleep: let go of the weights, the KV pool and the prompt cache that lived in it."""
        self._pipe.reset()  # a step queued ahead holds the old pool's arrays
        self.backend = None
        self.kv.unbind()

    def adopt_backend(self, backend: Backend) -> None:
        """Start or wake: a loaded backend, its KV pool sized for the slots and the prompt cache."""
        self.kv.bind(backend)
        self.backend = backend
        self.scheduler.context_shift = self.context_shift_requested and not self.kv.recurrent
        if self.context_shift_requested and self.kv.recurrent:
            log.warning("--context-shift is off for %s: %s", backend.info.model_type, RECURRENT_NO_SHIFT)

    def kv_policy(self) -> dict:
        """For /props beside the pool's occupancy: whether the prefix cache and the context shift
        are on, whether sequences free the blocks behind a sliding window, and why not where any
        is off."""
        shift = self.scheduler.context_shift
        return {"prefix_cache": self.kv.prefix_cache_off is None, "prefix_cache_off_reason": self.kv.prefix_cache_off,
                "context_shift": shift,
                "context_shift_off_reason": None if shift else RECURRENT_NO_SHIFT if self.kv.recurrent
                else "--context-shift is off", **self.kv.window_policy, **self.kv.storage_mode()}

    def kv_usage(self) -> dict[str, int]:
        """Block pool occupancy, for /metrics and /props (all zero while asleep)."""
        return self.kv.usage()

    def kv_bytes(self) -> dict[str, int]:
        """The pool in bytes, for /metrics and /props: bytes per token, its capacity, what live
        sequences and the prefix cache hold, and what the backend's storage has allocated so far,
        in bytes and token slots (it grows toward the capacity as blocks are first used)."""
        b = self.backend
        return {**usage_bytes(self.kv), "resident_bytes": int(getattr(b, "kv_nbytes", 0)) if b is not None else 0,
                "resident_tokens": int(getattr(b, "kv_slots", 0)) if b is not None else 0}

    def cache_stats(self) -> dict:
        """The prefix cache: on or off (and why), its budget and what it holds, and the prompt
        tokens it has supplied since start."""
        pc, bpt = self.kv.prefix_cache, self.kv_bytes()["bytes_per_token"]
        budget = pc.budget_blocks
        return {"enabled": self.kv.prefix_cache_off is None, "off_reason": self.kv.prefix_cache_off,
                "block_size": self.kv.block_size, "cached_blocks": pc.cached_blocks,
                "cached_bytes": pc.cached_blocks * self.kv.block_size * bpt,
                "budget_blocks": budget, "budget_bytes": None if budget is None else budget * self.kv.block_size * bpt,
                "prompt_tokens_cached_total": self.counters.n_prompt_tokens_cached_total}

    def submit_cache_reset(self) -> Future:
        """Queue emptying the prefix cache; it runs on the engine thread between steps, so running
        requests keep the blocks they share (their own references) and finish as they would."""
        job = _CacheReset(Future())
        self._inbox.put(job)
        return job.future

    # -- asyncio side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, reason: str | None = None) -> None:
        """Stop the engine thread; requests still held end with an error event (`reason`, else
        the model-unloaded one)."""
        self._stop_reason = self._stop_reason or reason
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

    def _retire(self, handle: RequestHandle) -> None:
        """A request leaves the engine (finished or dropped): free its place in the queue."""
        with self._count_lock:
            if not handle.retired:
                handle.retired = True
                self._outstanding -= 1

    def submit(self, request: GenerationRequest) -> RequestHandle:
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue every row of one request, or none: a request that can never fit the slots and
        the queue together is a 400, one that does not fit now a 503, and neither holds places."""
        for request in requests:
            n = len(request.prompt)
            if n == 0:
                raise EngineError("the prompt is empty", "invalid_request", 400)
            if n >= self.n_ctx_slot:
                raise _too_long(n, self.n_ctx_slot)
        capacity = self.parallel + self.max_queue_depth
        if self.max_queue_depth >= 0 and len(requests) > capacity:
            raise EngineError(f"the request asks for {len(requests)} generations (choices times prompts); this "
                              f"server holds at most {capacity} at once ({self.parallel} slots and "
                              f"{self.max_queue_depth} queue places)", "invalid_request", 400)
        with self._count_lock:
            if self.max_queue_depth >= 0 and self._outstanding + len(requests) > capacity:
                self.counters.n_rejected_total += 1
                raise EngineError(f"the server is busy: {self.max_queue_depth} requests are already waiting "
                                  "for a slot; retry later", "queue_full", 503)
            self._outstanding += len(requests)
        handles = [self._handle(request) for request in requests]
        for handle in handles:
            self._inbox.put(handle)
        return handles

    def _handle(self, request: GenerationRequest) -> RequestHandle:
        if self.lora is not None:
            if request.lora is None:  # snapshot now: a later change of the server's scales never reaches it
                request.lora = self.lora.snapshot()
            if any(request.lora):  # adapted KV must never be shared with another request's prefix
                request.cache_prompt = False
        return RequestHandle(request, self._wake)

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
            raise _too_long(n, self.n_ctx_slot)
        job = _ScoreJob(list(prompt), Future(), capture, lora=self.lora.snapshot() if self.lora is not None else None)
        self._inbox.put(job)
        return job.future

    def submit_prompt_probs(self, prompt: list[int], n_probs: int) -> Future:
        """Queue one pass over the prompt; the future resolves to the probability report of
        each prompt token after the first (len(prompt) - 1 of them), as sampling reports a
        generated token's with `n_probs` alternatives: from the position before it, raw logits."""
        if not prompt:
            raise EngineError("the prompt is empty", "invalid_request", 400)
        if len(prompt) > self.n_ctx_slot:
            raise _too_long(len(prompt), self.n_ctx_slot)
        job = _ScoreJob(list(prompt), Future(), lora=self.lora.snapshot() if self.lora is not None else None,
                        n_probs=max(n_probs, 1))
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
            raise _too_long(n, self.n_ctx_slot, "input")
        job = _ScoreJob(list(prompt), Future(), hidden=True)
        self._inbox.put(job)
        return job.future

    def score(self, prompt: list[int]) -> np.ndarray:
        """Blocking form of `submit_score` (not for the event loop's thread)."""
        return self.submit_score(prompt).result()

    def slots(self) -> list[SlotInfo]:
        """A snapshot of every slot: the live request on it, else what last ran there."""
        return self.scheduler.slots()

    def stats(self, reset_bucket: bool = False) -> EngineStats:
        """The /metrics counters; `reset_bucket` starts a new throughput window."""
        st = self.counters
        rows = list(self.scheduler.running)
        kv, kvb = self.kv_usage(), self.kv_bytes()
        queued = max(self._outstanding - len(rows), 0)
        snap = EngineStats(**{**vars(st), "n_draft_accepted_per_pos": list(st.n_draft_accepted_per_pos),
                              "n_processing": sum(r.slot >= 0 for r in rows),
                              "n_deferred": queued + sum(r.slot < 0 for r in rows),
                              "kv_cache_tokens": sum(r.n_prompt_done + len(r.generated) for r in rows),
                              "kv_blocks_total": kv["total_blocks"], "kv_blocks_used": kv["used_blocks"],
                              "kv_blocks_cached": kv["cached_blocks"], "kv_blocks_free": kv["free_blocks"],
                              "kv_bytes_capacity": kvb["capacity_bytes"], "kv_bytes_used": kvb["used_bytes"],
                              "kv_bytes_cached": kvb["cached_bytes"], "kv_bytes_resident": kvb["resident_bytes"]})
        if reset_bucket:
            st.n_prompt_tokens_processed = st.n_tokens_predicted = 0
            st.t_prompt_processing = st.t_tokens_generation = 0.0
        return snap

    # -- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._fail_leftovers()

    def _fail_leftovers(self) -> None:
        """On shutdown, every request still held ends with an error event rather than hanging
        its client (a model switch whose graceful timeout ran out)."""
        self._drain(block=False)
        why = self._stop_reason or "the model was unloaded"
        for row in list(self.scheduler.running):
            self.output.finish(row, TokenEvent(error=f"{why} before this request finished", error_code="model_busy"))
        for h in self.scheduler.waiting:
            self._retire(h)
            h.push(TokenEvent(error=f"{why} before this request started", error_code="model_busy"))
        self.scheduler.waiting.clear()

    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stopping:
            self._drain(block=not sched.busy)
            if self.sleeper is not None:
                if sched.waiting or self._slot_jobs:
                    self._wake_up()
                self.sleeper.tick(self, idle=not (sched.busy or self._slot_jobs))
            self._slot_actions()
            sched.admit(self._open_row, self._drop)
            self._reap_cancelled()
            if sched.running:
                try:
                    self._step()
                except Exception as e:  # a broken step fails its rows, not the server
                    self._fail_step(e)

    def _fail_step(self, error: Exception) -> None:
        log.exception("engine step failed")
        self._pipe.reset()
        # a backend that can run no more steps: the rows end unavailable (503), as on an unload
        code = "model_busy" if isinstance(error, BackendUnavailable) else "server_error"
        for row in list(self.scheduler.running):
            try:
                self.output.finish(row, TokenEvent(error=f"generation failed: {error}", error_code=code))
            except Exception:  # the loop outlives any one row's cleanup
                log.exception("failing a row after a broken step failed too")
                self.scheduler.remove(row)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(item, _ScoreJob):
                    self._wake_up()
                    self._score(item)
                elif isinstance(item, SlotJob):
                    self._slot_jobs.append(item)
                elif isinstance(item, _CacheReset):
                    item.future.set_result(self.kv.prefix_cache.reset())
                elif item is not None:
                    self.scheduler.waiting.append(item)
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
        seq = self.kv.new_sequence()
        try:
            job.future.set_result(self._pass(job, seq))
        except OutOfBlocks as e:
            what = "embedding" if job.hidden else "scoring"
            job.future.set_exception(EngineError(f"no KV memory left for the {what} pass: {e}",
                                                 "insufficient_memory", 503))
        except BackendUnavailable as e:  # the backend is gone: unavailable, not a server error
            job.future.set_exception(EngineError(str(e), "model_busy", 503))
        except Exception as e:  # a failed pass fails its request, not the engine
            log.exception("%s forward failed", "embedding" if job.hidden else "scoring")
            job.future.set_exception(e)
        finally:
            seq.release()

    def _pass(self, job: _ScoreJob, seq) -> np.ndarray | list[ProbsReport]:
        """The forward of a `_ScoreJob`, chunk by chunk; each chunk's logits are reduced before the
        next runs, so a prompt's reports never hold [n, vocab] at once."""
        logits, hidden, reports = None, [], []
        for start in range(0, len(job.prompt), self.batch_size):
            chunk = job.prompt[start:start + self.batch_size]
            if job.hidden:
                hidden.append(self.backend.hidden_states(chunk, seq))
            elif job.n_probs:
                every = self.backend.forward_all(chunk, seq, lora=job.lora)
                reports += prompt_reports(every, job.prompt[start + 1:start + 1 + len(chunk)], job.n_probs)
            else:
                logits = self.backend.forward([ForwardRow(chunk, seq, None, job.capture, job.lora)])
        if job.hidden:
            return np.concatenate(hidden).astype(np.float32)
        return reports if job.n_probs else np.array(logits[0], dtype=np.float32, copy=True)

    def _slot_actions(self) -> None:
        busy = self.scheduler.claimed_slots()
        for job in [j for j in self._slot_jobs if j.slot not in busy]:
            self._slot_jobs.remove(job)
            run_slot_job(self, job)

    def _open_row(self, handle: RequestHandle, seq, cached: int, max_tokens: int) -> Row:
        return self.output.open_row(handle, seq, cached, max_tokens, self.backend.info.context_length)

    def _drop(self, handle: RequestHandle) -> None:
        """A request cancelled before it ran."""
        handle.finished = True
        self._retire(handle)

    def _reap_cancelled(self) -> None:
        rows, handles = self.scheduler.cancelled()
        for row in rows:
            self.output.account(row, self.output.timings(row))
            self.scheduler.remove(row)
            self._release(row)
            row.handle.finished = True
            self._retire(row.handle)
        for h in handles:
            self._retire(h)

    def _step(self) -> None:
        """schedule -> run -> postprocess (the pipelined greedy decode, when every row allows
        it, does the same three with the next forward queued ahead)."""
        if self.pipeline_decode and self.speculator is None and self._pipe.step(self):
            return
        spec = self.speculator
        drafted = spec.draft(self, [r for r in self.scheduler.running if r.decoding]) if spec is not None else []
        plan = self.scheduler.schedule(drafted)
        if plan.empty:
            return
        for row in self.scheduler.claim_slots(plan, time.perf_counter()):
            self.output.progress(row)
        verify, spans = spec.verify_rows(plan.drafted) if plan.drafted else ([], [])
        logits = self.backend.forward([forward_row(row, toks) for row, toks in plan.rows] + verify)
        self.count_forward(len(plan.rows) + len(spans))
        self.output.postprocess(plan.rows, logits)
        if spans:
            spec.accept(self, spans, logits[len(plan.rows):])

    def count_forward(self, n_rows: int) -> None:
        """One decode forward over `n_rows` rows ran (the /metrics busy-slot average)."""
        self.counters.n_decode_total += 1
        self.counters.n_busy_slots_total += n_rows

    # -- the output processor's RowSink -------------------------------------------------
    def row_done(self, row: Row) -> None:
        if self.scheduler.remove(row):
            self._release(row)
        self._retire(row.handle)

    def row_at_bound(self, row: Row) -> None:
        self.scheduler.shift_context(row)

    def extra_timings(self, row: Row) -> dict:
        return self.speculator.timings(row) if self.speculator is not None else {}

    def _release(self, row: Row) -> None:
        """Give the row's KV back, offering its blocks to the prefix cache first."""
        row.done = True
        if row.lazy_pos is not None:  # the row stopped on a token whose successor was queued ahead
            row.cache.truncate(row.lazy_pos)
            row.lazy_pos = None
        if self.speculator is not None:
            self.speculator.before_release(row)  # trims a mid-verification KV first
        if row.slot >= 0:
            self.slot_tokens[row.slot] = list(row.cache.tokens)
        self.kv.release(row.cache, donate=cacheable(row.request) and not row.shifted, key=row.request.cache_tokens)
