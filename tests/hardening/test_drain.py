"""SIGTERM under load: the real server with --shutdown-timeout 2 is signalled while generation
streams run, more wait in the engine's queue, and an embedding job runs with another queued
behind it. New connections are refused from then on; when the timeout passes every request
still in flight ends with an error naming the shutdown (an SSE error frame, or a 503), none is
left hanging; the process logs the signal and the end of the drain and exits with status 0.

The requests are far longer than the drain (thousands of tokens, thousands of embedding
inputs), so they are still running when the timeout passes on any machine this runs on; the
wait for the exit is a hang guard, not a speed check."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from mlxcel.cli.shutdown import END_GRACE_S, SHUTDOWN_REASON
from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import MINILM, QWEN2_TINY

pytestmark = pytest.mark.timeout(300)
DRAIN_S = 2
HI = [{"role": "user", "content": "hi"}]
LONG = 4000  # tokens: the slot's whole context (8192 over 2 slots)


def _stream(base: str, out: dict, started: threading.Event) -> None:
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=60,
                          json={"messages": HI, "max_tokens": LONG, "stream": True}) as r:
            text = ""
            for chunk in r.iter_text():
                text += chunk
                started.set()
        out.update(status=r.status_code, text=text)
    except httpx.HTTPError as e:  # a timeout here is a hung connection
        out.update(status=None, text=repr(e))
    started.set()


def _post(base: str, path: str, body: dict, out: dict) -> None:
    try:
        r = httpx.post(base + path, json=body, timeout=60)
        out.update(status=r.status_code, text=r.text)
    except httpx.HTTPError as e:
        out.update(status=None, text=repr(e))


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if line and line[0] != "#")}


def _until(check, what: str) -> None:
    deadline = time.monotonic() + 120
    while not check():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.1)


def _refused(base: str) -> bool:
    """A new request during the drain: refused at connect, or answered 503."""
    try:
        return httpx.get(base + "/health", timeout=5).status_code == 503
    except httpx.TransportError:
        return True


def test_sigterm_under_load_ends_every_request_with_the_shutdown_error_and_exits():
    fixture_path(QWEN2_TINY)
    fixture_path(MINILM)
    server = ServerProcess(["-m", QWEN2_TINY, "--offline", "-np", "2", "-c", "8192", "--metrics",
                            "--shutdown-timeout", str(DRAIN_S), "--embedding-model", MINILM])
    base, results, threads = server.base_url, {}, []

    def start(name: str, fn, *args) -> None:
        results[name] = {}
        threads.append(threading.Thread(target=fn, args=(*args, results[name]), daemon=True))
        threads[-1].start()

    try:
        streams = [threading.Event() for _ in range(3)]  # two run, one waits for a slot
        for i, started in enumerate(streams):
            results[f"stream{i}"] = {}
            threads.append(threading.Thread(target=_stream, args=(base, results[f"stream{i}"], started), daemon=True))
            threads[-1].start()
        start("plain", _post, base, "/v1/chat/completions", {"messages": HI, "max_tokens": LONG})
        # 2048 inputs of 200 tokens: hundreds of batches, then a second job queued behind them
        many = {"input": [[1000 + (i + j) % 500 for j in range(200)] for i in range(2048)]}
        start("embedding", _post, base, "/v1/embeddings", many)
        _until(lambda: _metrics(base).get("mlxcel_embedding_queue_running") == 1, "an embedding job running")
        start("embedding_queued", _post, base, "/v1/embeddings", {"input": "a short one"})
        _until(lambda: all(e.is_set() for e in streams[:2]), "two streams running")
        _until(lambda: (m := _metrics(base))["llamacpp:requests_deferred"] == 2
               and m["mlxcel_embedding_queue_waiting"] == 1, "a stream, a request and an embedding queued")
        server.proc.send_signal(signal.SIGTERM)
        refused = False
        while server.proc.poll() is None and not refused:
            refused = _refused(base)
        server.proc.wait(timeout=DRAIN_S + END_GRACE_S + 60)  # a hang guard (see the module docstring)
        for t in threads:
            t.join(timeout=30)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert refused, "a new request was served after SIGTERM"
    assert server.proc.returncode == 0, log[-3000:]
    for name, got in results.items():
        assert got.get("status") is not None, f"{name}: no answer: {got}"
        assert SHUTDOWN_REASON in got["text"], f"{name} did not end with the shutdown error: {got['text'][-500:]}"
    for name in ("stream0", "stream1", "stream2"):
        frames = [json.loads(line[5:]) for line in results[name]["text"].splitlines()
                  if line.startswith("data:") and line != "data: [DONE]"]
        assert results[name]["status"] == 200 and frames[-1]["error"]["code"] == "model_busy", frames[-1]
    for name in ("plain", "embedding", "embedding_queued"):
        assert results[name]["status"] == 503, results[name]
        assert json.loads(results[name]["text"])["error"]["code"] == "model_busy", results[name]
    assert "before this request started" in results["embedding_queued"]["text"]
    assert "shutdown (SIGTERM)" in log and "shutdown complete" in log, log[-3000:]
