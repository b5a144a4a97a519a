"""uvicorn's h11 protocol with deadlines for the request header and the request body.

uvicorn (0.54, h11) bounds the header's size (h11_max_incomplete_event_size, 16 KiB by default)
and the idle wait after a response (timeout_keep_alive, from --timeout), but nothing bounds
the time to send a header or a body: a fresh connection that sends nothing, or a few bytes now
and then, stays open for ever, and any byte cancels the keep-alive timer. This protocol adds:

- a header deadline (config/limits.HEADER_TIMEOUT_S), armed when a connection opens and when a
  later request's first byte arrives, cancelled once the header is complete; when it passes the
  connection is closed (no request exists yet to answer);
- a body deadline, armed when a header announcing a body is complete and cancelled when the body
  is: it starts at limits.BODY_TIMEOUT_S and each limits.BODY_MIN_RATE bytes received buy one
  more second, so a large upload on a slow link is served while a body trickled a byte at a
  time is not. When it passes before the response has started the client gets a 408 in its
  route's error format and the connection closes; the handler waiting for the body sees a
  disconnect. Time the server itself stops reading (flow control: the handler has not asked for
  more) is not the client's and restarts the clock.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxcel.api.errors import ApiError, error_body
from mlxcel.config import limits


class DeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request header or body is not complete in time."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._body_start, self._body_bytes = 0.0, 0
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # a later request on a kept-alive connection has begun
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the header is complete (h11 only leaves IDLE on a whole header)
        self._watch_body(len(data))

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_body_clock()
        super().connection_lost(exc)

    # --- the header -----------------------------------------------------------------------

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

    # --- the body -------------------------------------------------------------------------

    def _watch_body(self, received: int) -> None:
        if self.conn.their_state is not h11.SEND_BODY:
            self._stop_body_clock()  # no body, or it is complete
        elif self._body_deadline is None:  # the chunk that completed the header may carry body bytes too
            self._body_start, self._body_bytes = self.loop.time(), received
            self._body_deadline = self.loop.call_later(limits.BODY_TIMEOUT_S, self._body_expired)
        else:
            self._body_bytes += received

    def _stop_body_clock(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_expired(self) -> None:
        self._body_deadline = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:  # the server is not reading: the clock starts again
            self._body_start, self._body_bytes = now, 0
        allowed = limits.BODY_TIMEOUT_S + self._body_bytes / limits.BODY_MIN_RATE
        if now - self._body_start < allowed:
            self._body_deadline = self.loop.call_later(allowed - (now - self._body_start), self._body_expired)
            return
        self.logger.info("answering 408 to a request whose body did not arrive in time (%d bytes in %.1f s)",
                         self._body_bytes, now - self._body_start)
        self._answer_timeout()

    def _answer_timeout(self) -> None:
        """A 408 in the route's error format if the handler has not answered yet, then close; the
        handler's pending read of the body returns a disconnect and its answer goes nowhere."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            path = cycle.scope.get("path", "/")
            err = ApiError(408, "the request body did not arrive in time", code="request_timeout",
                           type="invalid_request_error")
            body = json.dumps(error_body(path, err)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            cycle.response_started = cycle.response_complete = True
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
