"""The real app under uvicorn in this process, for tests that set ServerSettings directly
(behaviour hanging on settings the command line reaches only through many flags)."""

from __future__ import annotations

import threading
import time

import uvicorn

from mlxcel.api.app import build_app
from mlxcel.api.state import AppState
from tests.conftest import free_port


class AppServer:
    """uvicorn serving `build_app` on a loopback port, in a thread."""

    def __init__(self, state: AppState) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("in-process server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
