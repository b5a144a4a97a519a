"""Property-based fuzz of the multipart routes over HTTP (/v1/audio/transcriptions,
/audio/transcriptions, /v1/audio/translations) on a real Whisper server: forms with the fields the
routes read and odd values, fuzzed audio files (some that decode), parts in any order, broken
delimiters and odd Content-Types. Every case must answer without a 5xx (nor a server error inside
a stream) within CASE_LIMIT_S, and leave /health answering 200. Derandomized in `make test`;
scripts/hardening.py fuzz runs it longer."""

from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import given

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import WHISPER_TINY_EN
from tests.hardening.bodies import FORM_CONTENT_TYPES, audio_forms
from tests.hardening.budget import examples, fuzz_settings
from tests.hardening.test_fuzz_routes import CASE_LIMIT_S, stream_errors

# 300 cases in make test; /audio/transcriptions is the same handler as /v1/audio/transcriptions
ROUTES = {"/v1/audio/transcriptions": 150, "/v1/audio/translations": 100, "/audio/transcriptions": 50}
STATUSES: list[int] = []  # every case's answer, for the last test
pytestmark = pytest.mark.timeout(int(600 * examples(1)))


@pytest.fixture(scope="module")
def server():
    fixture_path(WHISPER_TINY_EN)
    s = ServerProcess(["-m", WHISPER_TINY_EN, "--offline", "--max-queue-depth", "4"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=CASE_LIMIT_S) as c:
        yield c


@pytest.mark.parametrize("path", list(ROUTES))
def test_multipart_route_never_answers_5xx(client, path):

    @fuzz_settings(ROUTES[path], deadline_ms=None)
    @given(audio_forms, FORM_CONTENT_TYPES)
    def case(body, content_type):
        start = time.monotonic()
        r = client.post(path, content=body, headers={"Content-Type": content_type})
        elapsed = time.monotonic() - start
        STATUSES.append(r.status_code)
        assert r.status_code < 500, f"{path} answered {r.status_code}: {r.text[:800]}\nbody: {body[:800]!r}"
        assert elapsed < CASE_LIMIT_S, f"{path} took {elapsed:.1f}s\nbody: {body[:800]!r}"
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert not stream_errors(r.text), f"{path} streamed a server error: {r.text[-800:]}\nbody: {body[:800]!r}"
        assert client.get("/health", timeout=10).status_code == 200

    case()


def test_the_fuzz_reached_whisper_and_the_server_logged_no_unhandled_exception(server, client):
    """After the fuzz (declared last): some cases went past every parser to a transcript, and a
    traceback in the log is a case a handler missed."""
    assert 200 in STATUSES, f"no case reached Whisper: {sorted(set(STATUSES))}"
    assert client.get("/health").status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 200:][:3000]
