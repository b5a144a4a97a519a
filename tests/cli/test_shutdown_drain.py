"""The bounded SIGTERM drain (cli/shutdown.py, --shutdown-timeout): a request still running when
the timeout passes is ended with an error that says the server is shutting down, and the server
exits instead of waiting for it; the engine's leftover requests carry that reason."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from mlxcel.cli.flags import parse_server_args
from mlxcel.cli.shutdown import SHUTDOWN_REASON, DrainingServer
from mlxcel.runtime.host import ModelHost
from tests.runtime.test_model_host import PROMPT, Loader, checkpoint, settings
from tests.engine.harness import request

pytestmark = pytest.mark.timeout(120)


class EndlessStream:
    """An SSE answer that runs until `end(reason)` (what the engine's error event would do)."""

    def __init__(self) -> None:
        self.loop = self.reason = None
        self.ended = asyncio.Event()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.loop = asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await self.ended.wait()
        await send({"type": "http.response.body", "body": f"error: {self.reason}\n\n".encode()})

    def end(self, reason: str) -> None:  # called off the loop, as the engine's shutdown is
        self.reason = reason
        self.loop.call_soon_threadsafe(self.ended.set)


def test_a_request_running_past_the_timeout_ends_with_the_reason():
    app = EndlessStream()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", log_config=None, lifespan="off")
    server = DrainingServer(config, timeout=0.5, on_deadline=app.end)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    got = b""
    with httpx.stream("GET", f"http://127.0.0.1:{sock.getsockname()[1]}/", timeout=30) as r:
        for chunk in r.iter_bytes():
            got += chunk
            if got == b"data: {}\n\n":
                server.should_exit = True  # what SIGTERM's handler sets
    thread.join(30)  # generous: the bound asserted is that it exits at all, with the reason sent
    assert not thread.is_alive()
    assert got.endswith(f"error: {SHUTDOWN_REASON}\n\n".encode())


def test_the_engine_ends_leftover_requests_with_the_shutdown_reason(tmp_path):
    loader = Loader()
    host = ModelHost(settings(), loader=loader, release=lambda: None)
    host.open(checkpoint(tmp_path, "m"))
    hold = loader.backends[0].hold_when(lambda step: any(r.decode for r in step))
    engine = host.model.engine

    async def scenario():
        handle = engine.submit(request(PROMPT, 400))
        events = asyncio.ensure_future(_events(handle))
        await hold.wait()
        closing = asyncio.ensure_future(asyncio.to_thread(host.close, SHUTDOWN_REASON))
        await asyncio.sleep(0.1)
        hold.release()
        await closing
        return await events

    try:
        last = asyncio.run(scenario())[-1]
    finally:
        loader.release_holds()
    assert last.done and last.error == f"{SHUTDOWN_REASON} before this request finished"


async def _events(handle) -> list:
    return [ev async for ev in handle]


def test_the_flag():
    assert parse_server_args(["-m", "x"], {}).server.shutdown_timeout == 30.0
    assert parse_server_args(["-m", "x", "--shutdown-timeout", "5"], {}).server.shutdown_timeout == 5.0
