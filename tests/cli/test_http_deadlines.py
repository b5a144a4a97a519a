"""The request header and body deadlines (cli/http_protocol.py) on a real uvicorn server over
loopback: a connection that sends nothing, or only part of a header, is closed once the header
deadline passes; a body trickled slower than the body deadline allows is answered 408 in the
route's error format and closed; a complete request is served, a body that keeps up with the
minimum rate is served past the base deadline, and a kept-alive connection is not cut while it
waits idle."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from mlxcel.cli.http_protocol import DeadlineProtocol
from mlxcel.config import limits

DEADLINE_S = 0.5
WAIT_S = 15.0  # generous: the assertion is that the server closes, not how quickly
RATE = 100  # bytes of body that buy one more second


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:  # the whole body first, as a route handler reads it
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def port(monkeypatch):
    monkeypatch.setattr(limits, "HEADER_TIMEOUT_S", DEADLINE_S)
    monkeypatch.setattr(limits, "BODY_TIMEOUT_S", DEADLINE_S)
    monkeypatch.setattr(limits, "BODY_MIN_RATE", RATE)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=DeadlineProtocol, timeout_keep_alive=30,
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


def _post_head(path: str, length: int) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


def _read_all(conn: socket.socket) -> bytes:
    """Everything until the server closes (a timeout here fails: the connection was held)."""
    conn.settimeout(WAIT_S)
    data = b""
    while chunk := conn.recv(4096):
        data += chunk
    return data


@pytest.mark.parametrize("path, envelope", [("/v1/chat/completions", lambda e: e["code"] == "request_timeout"),
                                            ("/completion", lambda e: e["code"] == 408)])
def test_a_trickled_body_is_answered_408_and_closed(port, path, envelope):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(_post_head(path, 1000))
        for _ in range(4):  # a byte now and then: far below the minimum rate
            conn.sendall(b"{")
            time.sleep(DEADLINE_S / 2)
        answer = _read_all(conn)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert envelope(json.loads(body)["error"]), body


def test_a_body_that_keeps_up_with_the_minimum_rate_is_served_past_the_base_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(WAIT_S)
        conn.sendall(_post_head("/", 1000) + b"x" * 600)  # 600 bytes buy 6 s beyond the base 0.5 s
        time.sleep(DEADLINE_S * 3)
        conn.sendall(b"x" * 400)
        assert _answer(conn).startswith(b"HTTP/1.1 200")


def test_the_server_is_started_with_the_protocol():
    from mlxcel.cli.flags import parse_server_args, uvicorn_kwargs

    assert uvicorn_kwargs(parse_server_args(["-m", "x"], {}))["http"] is DeadlineProtocol
