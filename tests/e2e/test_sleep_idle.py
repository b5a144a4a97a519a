"""--sleep-idle-seconds through the real CLI and server: the model unloads when idle (0 = at once),
routes that need no model answer without waking it, and a completion wakes it and gets the same
greedy text as before the sleep."""

from __future__ import annotations

import time

import httpx

from tests.conftest import module_server
from tests.fixtures import QWEN2_TINY

server = module_server(QWEN2_TINY, "--sleep-idle-seconds", "0", "--parallel", "1", "--no-warmup", "--metrics")


def wait_asleep(server) -> None:
    deadline = time.monotonic() + 60
    while not httpx.get(server.base_url + "/props").json()["is_sleeping"]:
        assert time.monotonic() < deadline, "the server never went to sleep"
        time.sleep(0.1)


def test_sleep_and_wake(server):
    wait_asleep(server)
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.post(server.base_url + "/tokenize", json={"content": "hello"}).json()["tokens"]
    assert "llamacpp:requests_processing 0" in httpx.get(server.base_url + "/metrics").text
    assert httpx.get(server.base_url + "/props").json()["is_sleeping"] is True  # none of those woke it
    body = {"prompt": "hello there", "n_predict": 6, "temperature": 0, "return_tokens": True}
    first = httpx.post(server.base_url + "/completion", json=body, timeout=120).json()
    assert len(first["tokens"]) == 6
    wait_asleep(server)  # 0 seconds: asleep again as soon as it is idle
    again = httpx.post(server.base_url + "/completion", json=body, timeout=120).json()
    assert again["tokens"] == first["tokens"] and again["content"] == first["content"]
