"""The embedding and rerank workers' fair queues over HTTP (the real app under uvicorn on
loopback, with stand-in workers that block until released, so the queue's state is set by the
test and read from its counters, never timed): with --max-queue-depth 1, a third request is
refused at once with 503 `queue_full` and Retry-After in the route's own envelope; a waiting
request whose client hangs up leaves the queue without running; the running one then answers."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from mlxcel.api.state import AppState
from mlxcel.config.settings import EngineSection, ServerSettings
from tests.e2e.inprocess import AppServer


class _Vocab:
    def get_vocab_size(self) -> int:
        return 100


class StandIn:
    """An embedder and a reranker in one: each call blocks until `gate` is set."""

    id = "stand-in"
    tokenizer = _Vocab()

    def __init__(self) -> None:
        self.gate, self.calls = threading.Event(), 0

    def tokenize(self, text: str) -> list[int]:
        return [1, 2, 3]

    def _wait(self) -> None:
        self.calls += 1
        assert self.gate.wait(60)

    def embed(self, prompts, mode=None, cancelled=None):
        self._wait()
        return [np.full(4, 0.5, dtype=np.float32) for _ in prompts]

    def score(self, query, docs, cancelled=None):
        self._wait()
        return [1.0] * len(docs), [3] * len(docs)


@pytest.fixture()
def served():
    worker = StandIn()
    state = AppState(settings=ServerSettings(engine=EngineSection(max_queue_depth=1)), model=None)
    state.embedder = state.reranker = worker
    server = AppServer(state)
    yield server, state, worker
    worker.gate.set()
    server.stop()


def _send(port: int, path: str, body: dict) -> socket.socket:
    """A request whose client stays connected (or hangs up) as the test decides."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _until(check) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, "the queue never reached the expected state"
        time.sleep(0.01)


CASES = [  # route, body, queue kind, the error body's (code, type) in that route's envelope
    ("/v1/embeddings", {"input": "hi"}, "embedding", ("queue_full", "server_error")),
    ("/embedding", {"content": "hi"}, "embedding", (503, "unavailable_error")),
    ("/rerank", {"query": "q", "documents": ["a", "b"]}, "reranker", (503, "unavailable_error")),
    ("/v1/rerank", {"query": "q", "texts": ["a"]}, "reranker", ("queue_full", "server_error")),
]


@pytest.mark.parametrize("path,body,kind,error", CASES)
def test_full_queue_is_503_with_retry_after_and_a_gone_client_leaves_it(served, path, body, kind, error):
    server, state, worker = served
    running = _send(server.port, path, body)
    _until(lambda: kind in state.worker_queues and state.worker_queues[kind].running == 1)
    queue = state.worker_queues[kind]
    waiting = _send(server.port, path, body)
    _until(lambda: queue.waiting == 1)
    r = httpx.post(server.base_url + path, json=body, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert (r.json()["error"]["code"], r.json()["error"]["type"]) == error
    assert "queue is full" in r.json()["error"]["message"] and queue.rejected_total == 1
    waiting.close()  # the waiting client hangs up: its job leaves the queue unrun
    _until(lambda: queue.waiting == 0)
    assert queue.cancelled_total == 1
    worker.gate.set()
    reply = running.makefile("rb").readline()
    running.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply
    _until(lambda: queue.running == 0)
    assert worker.calls == 1  # the abandoned request never reached the worker
