"""Slot save / restore / erase on the engine thread (b10621's POST /slots/:id_slot actions).

A slot's state here is its token stream: the tokens its last request left in its KV
(`Engine.slot_tokens`). KV itself is never written to disk: a restore sets the slot's token
stream and, when the prompt cache is on, prefills those tokens once into it, so the next
request that starts with them adopts the blocks instead of recomputing them. A job waits until
its slot is idle (upstream defers the task the same way); files are the API layer's business
(`api/llamacpp/slot_files.py`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxcel.engine.backend import ForwardRow
from mlxcel.engine.kv_block_pool import OutOfBlocks
from mlxcel.engine.types import EngineError

if TYPE_CHECKING:
    from mlxcel.engine.engine import Engine

log = logging.getLogger("mlxcel.engine")

ACTIONS = ("save", "restore", "erase")
# upstream's one wording for every failed restore
RESTORE_FAILED = "Unable to restore slot, no available space in KV cache or invalid slot save file"


@dataclass
class SlotJob:
    action: str  # save | restore | erase
    slot: int
    tokens: list[int] | None  # restore: the stream to put back
    future: Future


def run_slot_job(engine: Engine, job: SlotJob) -> None:
    if not job.future.set_running_or_notify_cancel():
        return
    try:
        if job.action == "save":
            job.future.set_result(list(engine.slot_tokens.get(job.slot, [])))
        elif job.action == "erase":
            job.future.set_result(len(engine.slot_tokens.pop(job.slot, [])))
        elif job.action == "restore":
            job.future.set_result(_restore(engine, job.slot, list(job.tokens or [])))
        else:
            raise EngineError("Invalid action", "invalid_request", 400)
    except Exception as e:  # a failed action fails its request, not the engine
        job.future.set_exception(e)


def _restore(engine: Engine, slot: int, tokens: list[int]) -> int:
    if len(tokens) > engine.n_ctx_slot:
        raise EngineError(f"{RESTORE_FAILED} ({len(tokens)} tokens do not fit the slot's {engine.n_ctx_slot})",
                          "invalid_request", 400)
    engine.slot_tokens[slot] = tokens
    if engine.kv.prefix_cache.enabled and len(tokens) >= engine.kv.block_size:
        _warm(engine, tokens)
    return len(tokens)


def _warm(engine: Engine, tokens: list[int]) -> None:
    """Prefill the restored stream into the prompt cache (adopting what it already holds)."""
    kv = engine.kv
    seq, done = kv.new_sequence(), False
    try:
        cached = kv.prefix_cache.adopt(seq, tokens, kv.copy_slots)
        for start in range(cached, len(tokens), engine.batch_size):
            engine.backend.forward([ForwardRow(tokens[start:start + engine.batch_size], seq)])
        done = True
    except OutOfBlocks as e:  # the stream is restored; only the warm-up is skipped
        log.warning("slot restore: no KV memory to prefill the restored tokens into the prompt cache (%s)", e)
    finally:
        kv.release(seq, donate=done)
