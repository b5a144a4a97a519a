"""One engine condition, one HTTP status, on every generation surface (api/errors.py's map),
each in its route's own envelope: OpenAI's, Anthropic's and llama-server's native one.

Two servers on the tiny Qwen2 (its vocabulary has FIM markers, so /infill is served too),
one slot each, the slot held by an endless native stream (--context-shift --ignore-eos):
- with --max-queue-depth 0, every other request is refused at submission: queue_full;
- with a queue, requests wait behind it, and an unload whose graceful timeout (0 s) runs out
  ends every one of them with the engine's model_busy event.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import QWEN2_TINY

HI = [{"role": "user", "content": "hi"}]
# route -> a small request body
SURFACES = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"messages": HI, "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/completion": {"prompt": "hi", "n_predict": 4},
    "/infill": {"input_prefix": "def f(", "input_suffix": "):\n", "n_predict": 4},
}
ENDLESS = ["-m", QWEN2_TINY, "--offline", "-np", "1", "-c", "512", "--context-shift", "--ignore-eos"]


def check_envelope(path: str, body: dict, status: int, code: str) -> None:
    """The error body of `path` in its own family's envelope."""
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "server_error", body
        assert set(body["error"]) == {"type", "message"}
    elif path.startswith("/v1/"):
        assert body["error"]["code"] == code and body["error"]["type"] == "server_error", body
    else:
        assert body["error"] == {"code": status, "message": body["error"]["message"], "type": "unavailable_error"}


class Holder:
    """An endless native stream occupying the server's one slot."""

    def __init__(self, base: str) -> None:
        self.cm = httpx.stream("POST", base + "/completion", timeout=300,
                               json={"prompt": "The capital of France is", "n_predict": -1, "stream": True})
        self.response = self.cm.__enter__()
        self.lines = self.response.iter_lines()
        assert json.loads(next(line for line in self.lines if line.startswith("data: "))[6:])["stop"] is False

    def rest(self) -> list[str]:
        return [line[6:] for line in self.lines if line.startswith("data: ")]

    def close(self) -> None:
        self.cm.__exit__(None, None, None)


@pytest.fixture()
def served(request):
    fixture_path(QWEN2_TINY)
    server = ServerProcess([*ENDLESS, *request.param])
    yield server
    server.stop()


@pytest.mark.parametrize("served", [["--max-queue-depth", "0"]], indirect=True)
def test_queue_full_is_503_on_every_surface_streamed_or_not(served):
    holder = Holder(served.base_url)
    try:
        for path, body in SURFACES.items():
            for stream in (False, True):
                r = httpx.post(served.base_url + path, json={**body, "stream": stream}, timeout=60)
                assert r.status_code == 503 and r.headers["retry-after"] == "1", (path, stream, r.text)
                check_envelope(path, r.json(), 503, "queue_full")
    finally:
        holder.close()


def _post(base: str, path: str, body: dict) -> tuple[int, object]:
    r = httpx.post(base + path, json=body, timeout=300)
    return r.status_code, r.json()


def _stream(base: str, path: str, body: dict) -> tuple[int, list[str]]:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=300) as r:
        return r.status_code, [line for line in r.iter_lines() if line]


def _deferred(base: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("llamacpp:requests_deferred "):
            return float(line.split()[1])
    raise KeyError("llamacpp:requests_deferred")


def _last_data(lines: list[str]) -> dict:
    return json.loads(next(line for line in reversed(lines) if line.startswith("data: {"))[6:])


@pytest.mark.parametrize("served", [["--metrics", "--graceful-unload-timeout", "0"]], indirect=True)
def test_model_busy_ending_a_request_is_503_on_every_surface(served):
    base = served.base_url
    holder = Holder(base)
    try:
        with ThreadPoolExecutor(max_workers=2 * len(SURFACES)) as pool:
            answers = {path: pool.submit(_post, base, path, body) for path, body in SURFACES.items()}
            streams = {path: pool.submit(_stream, base, path, body) for path, body in SURFACES.items()}
            deadline = time.monotonic() + 120
            while _deferred(base) < 2 * len(SURFACES):  # every request waits behind the holder
                assert time.monotonic() < deadline, "the requests did not all queue"
                time.sleep(0.2)
            r = httpx.post(f"{base}/api/models/{QWEN2_TINY}/unload", timeout=300)
            assert r.status_code == 200, r.text
            for path, future in answers.items():
                status, body = future.result(timeout=120)
                assert status == 503, (path, body)
                check_envelope(path, body, 503, "model_busy")
            for path, future in streams.items():  # accepted, then ended by the error in the stream's format
                status, lines = future.result(timeout=120)
                assert status == 200, (path, lines)
                if path.startswith("/v1/chat") or path == "/v1/completions":
                    assert lines[-1] == "data: [DONE]"
                    assert _last_data(lines)["error"]["code"] == "model_busy"
                elif path == "/v1/messages":
                    assert lines[-2:] == ["event: error", lines[-1]] and _last_data(lines)["type"] == "error"
                elif path == "/v1/responses":
                    assert _last_data(lines)["type"] == "error" and _last_data(lines)["code"] == "model_busy"
                else:
                    assert _last_data(lines)["error"]["code"] == 503 == json.loads(lines[-1][6:])["error"]["code"]
        # the running stream too: the native frame carries the same status as a native error body
        assert json.loads(holder.rest()[-1])["error"] == {"code": 503, "type": "unavailable_error",
                                                          "message": "the model was unloaded before this request "
                                                                     "finished"}
    finally:
        holder.close()
