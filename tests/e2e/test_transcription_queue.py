"""The transcription queue on a real `mlxcel-server -m openai/whisper-tiny.en --max-queue-depth 1`
(issue 25: abandoned long clips delayed everyone after them, and the queue had no bound).

A five-minute clip runs while a second (streamed) one waits; a third request is refused at once
with 503 `queue_full` and Retry-After. The waiting client hangs up and its job leaves the queue;
the running client hangs up and its job stops at its next 30-second window; the next clip is then
served. Every step is read from /metrics (the queue's gauges and counters), never timed. A clip
longer than the documented 600 s is a 400 naming the limit before any model work."""

from __future__ import annotations

import io
import socket
import time

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import WHISPER_TINY_EN


@pytest.fixture(scope="module")
def server():
    fixture_path(WHISPER_TINY_EN)
    s = ServerProcess(["-m", WHISPER_TINY_EN, "--offline", "--max-queue-depth", "1", "--metrics"])
    yield s
    s.stop()


def _wav(seconds: float, rate: int = 16_000) -> bytes:
    import soundfile as sf

    noise = np.random.default_rng(0).normal(0, 0.05, int(seconds * rate)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, noise, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _send(server, clip: bytes, **fields) -> socket.socket:
    """A transcription whose client stays connected until the test hangs up."""
    req = httpx.Request("POST", server.base_url + "/v1/audio/transcriptions", files={"file": ("c.wav", clip)},
                        data=fields)
    head = "".join(f"{k}: {v}\r\n" for k, v in req.headers.items())
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST /v1/audio/transcriptions HTTP/1.1\r\n{head}\r\n".encode() + req.read())
    return sock


def _queue(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    prefix = "mlxcel_transcription_"
    return {line.split()[0][len(prefix):]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def _until(server, **want) -> dict[str, float]:
    deadline = time.monotonic() + 120
    while True:
        got = _queue(server)
        if all(got[k] == v for k, v in want.items()):
            return got
        assert time.monotonic() < deadline, (want, got)
        time.sleep(0.05)


def test_full_queue_refuses_and_gone_clients_free_it(server):
    long_clip = _wav(300)
    running = _send(server, long_clip)
    _until(server, queue_running=1)
    waiting = _send(server, long_clip, stream="true")
    _until(server, queue_waiting=1)
    for fields in ({}, {"stream": "true"}):
        r = httpx.post(server.base_url + "/v1/audio/transcriptions", files={"file": ("c.wav", _wav(1))},
                       data=fields, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "queue_full"
    r = httpx.post(server.base_url + "/v1/audio/transcriptions", files={"file": ("c.wav", _wav(601, rate=100))},
                   timeout=60)
    assert r.status_code == 400, r.text  # one that could never be served is a 400, full queue or not
    assert _queue(server)["requests_rejected_total"] == 2
    waiting.close()
    _until(server, queue_waiting=0, requests_cancelled_total=1, queue_running=1)
    running.close()  # its job stops at the next of its ten 30-second windows
    _until(server, queue_running=0, requests_cancelled_total=2)
    r = httpx.post(server.base_url + "/v1/audio/transcriptions", files={"file": ("c.wav", _wav(1))}, timeout=120)
    assert r.status_code == 200, r.text


def test_audio_longer_than_the_limit_is_a_400_naming_it(server):
    # 601 s at 100 Hz: a header-declared length over the limit in a 120 KB file
    clip = _wav(601, rate=100)
    r = httpx.post(server.base_url + "/v1/audio/transcriptions", files={"file": ("long.wav", clip)}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_audio" and err["param"] == "file"
    assert "601.0 s; at most 600 s of audio are accepted per request" in err["message"]
    assert _queue(server)["queue_running"] == 0  # refused before the queue or the model saw it
