"""uvicorn's h11 protocol with a deadline for the request header.

uvicorn (0.54, h11) bounds the header's size (h11_max_incomplete_event_size, 16 KiB by default)
and the idle wait after a response (timeout_keep_alive, from --timeout), but nothing bounds
the time to send a header: a fresh connection that sends nothing, or a few bytes now and then,
stays open for ever, and any byte cancels the keep-alive timer. This protocol arms a deadline
(config/limits.HEADER_TIMEOUT_S) when a connection opens and when a later request's first byte
arrives, cancels it once the header is complete, and closes the connection when it passes.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxcel.config import limits


class HeaderDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request header is not complete in time."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # a later request on a kept-alive connection has begun
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the header is complete (h11 only leaves IDLE on a whole header)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_deadline = self.loop.call_later(limits.HEADER_TIMEOUT_S, self._expired)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _expired(self) -> None:
        self._header_deadline = None
        waiting = self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
        if waiting and not self.transport.is_closing():
            self.logger.info("closing a connection whose request header was not complete in %.0f s",
                             limits.HEADER_TIMEOUT_S)
            self.transport.close()
