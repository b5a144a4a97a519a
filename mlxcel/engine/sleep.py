"""--sleep-idle-seconds: the engine frees its model after an idle window and reloads it on the
next piece of work.

Everything that touches the weights runs on the engine thread, so the engine can swap its
backend there with nothing in flight: it sleeps only from its idle arm (no row, no waiting
request, no slot job), drops the backend (weights and KV pool) and the prompt cache whose blocks
lived in that pool, and the first request, score or slot job that arrives reloads it before it
is handled. Waking is therefore that request's own latency, as upstream's blocking wake is.
Tokenizer, templates and counters stay, so the routes that read only them answer without waking.
Both the reload and the memory clean-up after the drop come from the host that loaded the model
(runtime/host.py), injected as callables: the engine sits below it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxcel.engine.engine import Engine

log = logging.getLogger("mlxcel.engine")


class IdleSleeper:
    """`seconds` < 0 disables; 0 sleeps as soon as the engine is idle (upstream's own gate).
    `reload` builds a fresh backend; `release_memory` frees what the dropped one held (None:
    nothing beyond dropping the references)."""

    def __init__(self, seconds: int, reload: Callable[[], Any],
                 release_memory: Callable[[], None] | None = None) -> None:
        self.seconds = seconds
        self.reload = reload
        self.release_memory = release_memory
        self.asleep = False
        self._idle_since: float | None = None

    def tick(self, engine: Engine, idle: bool) -> None:
        """Called every loop turn: start, keep or reset the idle clock; sleep when it runs out."""
        if not idle or self.asleep:
            self._idle_since = None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since >= self.seconds:
            self._sleep(engine)

    def _sleep(self, engine: Engine) -> None:
        engine.drop_backend()
        if self.release_memory is not None:
            self.release_memory()
        self.asleep = True
        log.info("idle for %ds: the model is unloaded until the next request", self.seconds)

    def ensure_awake(self, engine: Engine) -> None:
        if not self.asleep:
            return
        t0 = time.perf_counter()
        engine.adopt_backend(self.reload())
        self.asleep = False
        self._idle_since = None
        log.info("woke up: the model reloaded in %.2f s", time.perf_counter() - t0)
