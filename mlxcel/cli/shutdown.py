"""A bounded drain on SIGTERM/SIGINT.

uvicorn stops accepting connections on a signal and then waits for running requests, for ever
unless `timeout_graceful_shutdown` is set, after which it cancels their tasks (a stream just
stops, with no reason given). `DrainingServer` bounds the wait by --shutdown-timeout: when it
passes, `on_deadline` ends the engine's remaining requests (and the side workers' queued and
running jobs) with an error saying the server is shutting down, so each client gets that error
(a 503 or an SSE error frame); uvicorn cancels only what is still running END_GRACE_S later.

The drain is logged when it starts and when it ends. A drain that a signal started is the
signal's whole effect: `run` then returns normally (exit status 0) so the caller's own cleanup
runs, instead of uvicorn's re-raising the signal, which would kill the process before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator

import uvicorn

log = logging.getLogger("mlxcel.server")

END_GRACE_S = 5.0  # after the deadline: time for the error events to reach their clients
SHUTDOWN_REASON = "the server is shutting down (--shutdown-timeout ran out)"


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, timeout: float, on_deadline: Callable[[str], None]) -> None:
        config.timeout_graceful_shutdown = timeout + END_GRACE_S
        super().__init__(config)
        self.drain_timeout, self.on_deadline = timeout, on_deadline

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # handled by the drain: uvicorn must not raise it again

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        why = ", ".join(signal.Signals(s).name for s in self._captured_signals) or "exit requested"
        log.info("shutdown (%s): no new connections; %d requests running get up to %g s (--shutdown-timeout)",
                 why, len(self.server_state.tasks), self.drain_timeout)
        start = time.monotonic()
        timer = loop.call_later(self.drain_timeout, self._deadline, loop)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
        log.info("shutdown complete after %.1f s", time.monotonic() - start)

    def _deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.server_state.tasks:
            log.warning("shutdown: %d requests still running after %g s; ending them with an error",
                        len(self.server_state.tasks), self.drain_timeout)
        loop.run_in_executor(None, self.on_deadline, SHUTDOWN_REASON)  # joins the engine thread: not on the loop
