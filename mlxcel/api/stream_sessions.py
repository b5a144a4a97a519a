"""Resumable stream sessions: the server-side copy of one streaming answer's SSE bytes.

A streaming request that carries `X-Conversation-Id` gets a `StreamSession`; every byte the
route writes goes into it, and whoever reads the stream (the original client, or a later
`GET /v1/stream?conv_id=&from=N`) follows the session from a byte offset. The buffer keeps
the newest `max_bytes` (older bytes are dropped from the front, and an offset below the
dropped prefix can no longer be replayed). A finished session stays replayable for `ttl_s`
seconds; at most `max_completed` finished sessions are kept, oldest evicted first.

Sessions are keyed by (owner, conversation id). The owner is empty unless several API keys
are configured, in which case it is a digest of the key that created the session, so one key
cannot see, replay or stop another key's streams (a deliberate difference from b10621, which
treats all keys as one trust domain).

`StreamStore` is the registry (one per served app, on `AppState.streams`); it sweeps expired
sessions at most once per `gc_interval_s`, on any access, so no background task is needed.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

# b10621's constants, plus mlxcel's own cap on retained finished sessions.
STREAM_MAX_BYTES = 4 * 1024 * 1024
STREAM_TTL_S = 300.0
STREAM_GC_INTERVAL_S = 60.0
STREAM_MAX_COMPLETED = 256


@dataclass(frozen=True)
class StreamLimits:
    """The store's bounds; tests shorten them by building a store with their own."""

    max_bytes: int = STREAM_MAX_BYTES
    ttl_s: float = STREAM_TTL_S
    gc_interval_s: float = STREAM_GC_INTERVAL_S
    max_completed: int = STREAM_MAX_COMPLETED


class OffsetLost(Exception):
    """The requested offset lies in the part of the buffer that was dropped."""


def stream_owner(presented_key: str, configured_keys: Sequence[str]) -> str:
    """Who a session belongs to: nobody in particular with zero or one key, else the key."""
    if len(configured_keys) <= 1:
        return ""
    return hashlib.sha256(presented_key.encode()).hexdigest()


class StreamSession:
    """One stream's bytes: a front-dropping buffer, followers woken on every append."""

    def __init__(self, conversation_id: str, owner: str, max_bytes: int, clock: Callable[[], float]) -> None:
        self.conversation_id, self.owner = conversation_id, owner
        self.max_bytes = max_bytes
        self._clock = clock
        self.started_at = int(clock())
        self.completed_at = 0  # unix seconds once finished
        self.done = False
        self.cancelled = False
        self.dropped = 0  # bytes dropped from the front
        self._buf = bytearray()
        self._wake = asyncio.Event()
        self.on_cancel: Callable[[], None] | None = None  # stops the producing generation
        self.on_done: Callable[[StreamSession], None] | None = None  # the store's bookkeeping
        self.producer: Any = None  # the task writing this session, kept alive past a disconnect

    @property
    def total_bytes(self) -> int:
        return self.dropped + len(self._buf)

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self._buf += data
        excess = len(self._buf) - self.max_bytes
        if excess > 0:
            del self._buf[:excess]
            self.dropped += excess
        self._notify()

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.completed_at = int(self._clock())
        self._notify()
        if self.on_done is not None:
            self.on_done(self)

    def cancel(self) -> None:
        """Stop the generation (as a client disconnect would without a session) and finish."""
        if not self.cancelled:
            self.cancelled = True
            if self.on_cancel is not None:
                self.on_cancel()
        self.finish()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def follow(self, offset: int, stop: asyncio.Event | None = None) -> AsyncIterator[bytes]:
        """The bytes from `offset` on: what is buffered, then live output until the session
        finishes (or `stop` is set). Raises OffsetLost if `offset` was dropped, including when
        a slow reader falls more than the buffer behind."""
        while True:
            if offset < self.dropped:
                raise OffsetLost(offset)
            end = self.total_bytes
            if offset < end:
                chunk = bytes(self._buf[offset - self.dropped:])
                offset = end
                yield chunk
                continue
            if self.done or (stop is not None and stop.is_set()):
                return
            wake = asyncio.ensure_future(self._wake.wait())
            waits = {wake}
            if stop is not None:
                waits.add(asyncio.ensure_future(stop.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    def status(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id, "is_done": self.done, "total_bytes": self.total_bytes,
                "started_at": self.started_at, "completed_at": self.completed_at}


class StreamStore:
    """All sessions of one server, keyed by (owner, conversation id)."""

    def __init__(self, limits: StreamLimits | None = None, clock: Callable[[], float] = time.time) -> None:
        self.limits = limits or StreamLimits()
        self._clock = clock
        self._sessions: dict[tuple[str, str], StreamSession] = {}
        self._last_sweep = clock()

    def open(self, owner: str, conversation_id: str) -> StreamSession:
        """A fresh session for this conversation; one it replaces is stopped (one live
        session per conversation, as upstream)."""
        self._maybe_sweep()
        session = StreamSession(conversation_id, owner, self.limits.max_bytes, self._clock)
        session.on_done = self._finished
        previous = self._sessions.pop((owner, conversation_id), None)
        self._sessions[(owner, conversation_id)] = session
        if previous is not None:
            previous.cancel()
        return session

    def get(self, owner: str, conversation_id: str) -> StreamSession | None:
        self._maybe_sweep()
        return self._sessions.get((owner, conversation_id))

    def lookup(self, owner: str, conversation_ids: list[str]) -> list[dict[str, Any]]:
        """Status of the caller's sessions named by these ids, exactly or as `<id>::<model>`."""
        self._maybe_sweep()
        mine = [s for (o, _), s in self._sessions.items() if o == owner]
        out = []
        for cid in conversation_ids:
            for s in mine:
                if s.conversation_id == cid or s.conversation_id.startswith(cid + "::"):
                    out.append(s.status())
        return out

    def stop(self, owner: str, conversation_id: str) -> None:
        """Evict the session and cancel its generation; unknown ids are a no-op."""
        session = self._sessions.pop((owner, conversation_id), None)
        if session is not None:
            session.cancel()

    def __len__(self) -> int:
        return len(self._sessions)

    def _finished(self, session: StreamSession) -> None:
        finished = [s for s in self._sessions.values() if s.done]
        for s in sorted(finished, key=lambda s: s.completed_at)[: max(len(finished) - self.limits.max_completed, 0)]:
            self._evict(s)

    def _evict(self, session: StreamSession) -> None:
        key = (session.owner, session.conversation_id)
        if self._sessions.get(key) is session:
            del self._sessions[key]

    def _maybe_sweep(self) -> None:
        now = self._clock()
        if now - self._last_sweep < self.limits.gc_interval_s:
            return
        self._last_sweep = now
        for s in [s for s in self._sessions.values() if s.done and s.completed_at <= now - self.limits.ttl_s]:
            self._evict(s)
