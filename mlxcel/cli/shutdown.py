"""A bounded drain on SIGTERM/SIGINT.

uvicorn stops accepting connections on a signal and then waits for running requests, for ever
unless `timeout_graceful_shutdown` is set, after which it cancels their tasks (a stream just
stops, with no reason given). `DrainingServer` bounds the wait by --shutdown-timeout: when it
passes, `on_deadline` ends the engine's remaining requests with an error event saying the server
is shutting down, so each client gets that error (a 503 or an SSE error frame); uvicorn cancels
only what is still running END_GRACE_S later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn

log = logging.getLogger("mlxcel.server")

END_GRACE_S = 5.0  # after the deadline: time for the error events to reach their clients
SHUTDOWN_REASON = "the server is shutting down (--shutdown-timeout ran out)"


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, timeout: float, on_deadline: Callable[[str], None]) -> None:
        config.timeout_graceful_shutdown = timeout + END_GRACE_S
        super().__init__(config)
        self.drain_timeout, self.on_deadline = timeout, on_deadline

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.drain_timeout, self._deadline, loop)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.server_state.tasks:
            log.warning("shutdown: %d requests still running after %.0f s; ending them with an error",
                        len(self.server_state.tasks), self.drain_timeout)
        loop.run_in_executor(None, self.on_deadline, SHUTDOWN_REASON)  # joins the engine thread: not on the loop
