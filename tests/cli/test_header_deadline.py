"""The request-header deadline (cli/http_protocol.py) on a real uvicorn server over loopback:
a connection that sends nothing, or only part of a header, is closed once the deadline passes;
a complete request is served, and a kept-alive connection is not cut while it waits idle."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from mlxcel.cli.http_protocol import HeaderDeadlineProtocol
from mlxcel.config import limits

DEADLINE_S = 0.5
WAIT_S = 15.0  # generous: the assertion is that the server closes, not how quickly


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def port(monkeypatch):
    monkeypatch.setattr(limits, "HEADER_TIMEOUT_S", DEADLINE_S)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=HeaderDeadlineProtocol, timeout_keep_alive=30,
                                           log_level="warning", log_config=None, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _closed_by_server(conn: socket.socket) -> bool:
    """True once the server closes the connection (recv returns EOF) within WAIT_S."""
    conn.settimeout(WAIT_S)
    try:
        while True:
            data = conn.recv(4096)
            if not data:
                return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def _answer(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"ok"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_a_silent_connection_is_closed(port):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        assert _closed_by_server(conn)


def test_a_trickled_partial_header_is_closed(port):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        time.sleep(DEADLINE_S / 2)
        conn.sendall(b"X-Slow: 1\r\n")  # a byte now and then does not extend the deadline
        assert _closed_by_server(conn)


def test_a_complete_request_is_served_and_kept_alive_past_the_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(WAIT_S)
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(conn).endswith(b"ok")
        time.sleep(DEADLINE_S * 3)  # idle between requests: governed by timeout_keep_alive (30 s)
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(conn).endswith(b"ok")
        conn.sendall(b"GET / HTTP/1.1\r\n")  # a later request's partial header: the deadline again
        assert _closed_by_server(conn)


def test_the_server_is_started_with_the_protocol():
    from mlxcel.cli.flags import parse_server_args, uvicorn_kwargs

    assert uvicorn_kwargs(parse_server_args(["-m", "x"], {}))["http"] is HeaderDeadlineProtocol
