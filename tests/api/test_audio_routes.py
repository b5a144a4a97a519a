"""The audio routes' capability gate, in process: a server whose chat model has no audio tower
answers b10621's 501 before reading a single field, on both spellings of the shared route and
on /v1/audio/translations; a planned Whisper worker that is still loading answers 503."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from mlxcel.api.app import build_litestar
from mlxcel.api.state import AppState
from mlxcel.cli.flags import parse_server_args
from mlxcel.workers.plan import plan
from tests.conftest import fixture_path
from tests.fixtures import DEFAULT_MODEL, WHISPER_TINY_EN


def _client(argv):
    settings = parse_server_args(argv, {})
    return TestClient(build_litestar(AppState(settings=settings, plan=plan(settings, lambda r, f: fixture_path(r)))))


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/audio/transcriptions", "/v1/audio/translations"])
def test_chat_model_without_audio_refuses_before_any_field_check(path):
    with _client(["-m", DEFAULT_MODEL]) as c:
        for kwargs in ({"content": b"not multipart at all"}, {"data": {"response_format": "srt", "temperature": "x"}}):
            r = c.post(path, **kwargs)
            assert r.status_code == 501, r.text
            assert r.json()["error"]["message"] == "The current model does not support audio input."
            assert r.json()["error"]["type"] == "not_supported_error"


def test_whisper_plan_turns_generation_off_and_answers_503_while_loading():
    settings = parse_server_args(["-m", WHISPER_TINY_EN], {})
    p = plan(settings, lambda r, f: fixture_path(r))
    assert (p.generation, p.restricted_by, [s.kind for s in p.sides]) == (False, "-m", ["transcription"])
    with _client(["-m", WHISPER_TINY_EN]) as c:
        r = c.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")})
        assert r.status_code == 503
        assert c.get("/health").status_code == 503
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 501 and "Whisper" in r.json()["error"]["message"]
