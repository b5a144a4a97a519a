"""A real `mlxcel-server -m openai/whisper-tiny.en` process: espeak-ng's spoken sentence comes back
in WAV, MP3 and FLAC with a word error rate of at most 20%; the streamed deltas join to the
non-streamed text (one delta per 30-second window); both routes answer OpenAI's text, srt, vtt and
verbose_json formats (a cue or segment per window);
hostile uploads are refused with a 4xx and 20 of them leave the server's resident memory within
50 MiB; a chat server (no audio tower) answers b10621's 501 before reading a field."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest

from tests.audio.clips import SENTENCE, encode, hostile_flac, overclaiming_wav, spoken, truncated_mp3, wer
from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import WHISPER_TINY_EN

TIMEOUT = 300


@pytest.fixture(scope="module")
def server():
    fixture_path(WHISPER_TINY_EN)
    s = ServerProcess(["-m", WHISPER_TINY_EN, "--offline"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    audio, rate = spoken(tmp_path_factory.mktemp("speech"))
    gap = np.zeros(int(rate * 30.5) - len(audio), dtype=np.float32)  # the second sentence lands in window 2
    return {**{c: encode(audio, rate, c) for c in ("wav", "mp3", "flac")}, "short": encode(audio[: rate // 2], rate, "wav"),
            "two_windows": encode(np.concatenate([audio, gap, audio]), rate, "wav")}


def _post(server, path, data: bytes, name="clip", **fields):
    return httpx.post(server.base_url + path, files={"file": (name, data)}, data=fields, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def wav_text(server, clips):
    r = _post(server, "/v1/audio/transcriptions", clips["wav"], "clip.wav")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "transcript.text.done"
    u = body["usage"]
    assert u["type"] == "tokens" and u["output_tokens"] > 0 and u["input_tokens"] == 1500
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    return body["text"]


def test_wav_transcript_word_error_rate(wav_text):
    assert wer(SENTENCE, wav_text) <= 0.2, wav_text


@pytest.mark.parametrize("container", ["mp3", "flac"])
def test_compressed_containers_on_the_alias(server, clips, container):
    r = _post(server, "/audio/transcriptions", clips[container], f"clip.{container}")  # b10621's alias
    assert r.status_code == 200, r.text
    assert wer(SENTENCE, r.json()["text"]) <= 0.2, r.json()["text"]


def test_stream_deltas_join_to_the_text(server, clips, wav_text):
    events = _stream(server, clips["wav"])
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    assert deltas and events[-1]["type"] == "transcript.text.done"
    assert "".join(deltas) == events[-1]["text"] == wav_text


def _stream(server, data: bytes) -> list[dict]:
    with httpx.stream("POST", server.base_url + "/v1/audio/transcriptions", files={"file": ("c.wav", data)},
                      data={"stream": "true"}, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_stream_sends_one_delta_per_window(server, clips):
    events = _stream(server, clips["two_windows"])
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    done = events[-1]
    assert len(deltas) == 2 and done["type"] == "transcript.text.done" and "".join(deltas) == done["text"]
    assert done["usage"]["input_tokens"] == 3000  # two 30-second windows of 1500 encoder positions
    assert wer(SENTENCE + " " + SENTENCE, done["text"]) <= 0.2, done["text"]


SRT_CUE = re.compile(r"(\d+)\n(\d\d:\d\d:\d\d,\d{3}) --> (\d\d:\d\d:\d\d,\d{3})\n(.+)\n\n")
VTT_CUE = re.compile(r"(\d\d:\d\d:\d\d\.\d{3}) --> (\d\d:\d\d:\d\d\.\d{3})\n(.+)\n\n")


def test_transcription_text_and_verbose_json(server, clips, wav_text):
    r = _post(server, "/v1/audio/transcriptions", clips["wav"], response_format="text")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == wav_text + "\n"
    r = _post(server, "/v1/audio/transcriptions", clips["wav"], response_format="verbose_json")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["task"], body["language"], body["text"]) == ("transcribe", "english", wav_text)
    assert 1 < body["duration"] < 30
    [seg] = body["segments"]  # one 30-second window
    assert seg["id"] == 0 and seg["start"] == 0 and abs(seg["end"] - body["duration"]) < 0.05
    assert seg["text"].strip() == wav_text and seg["tokens"] and seg["avg_logprob"] <= 0
    assert body["usage"]["output_tokens"] == len(seg["tokens"])


def test_transcription_subtitles_one_cue_per_window(server, clips):
    r = _post(server, "/v1/audio/transcriptions", clips["two_windows"], response_format="srt")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    cues = SRT_CUE.findall(r.text)
    assert "".join(m.group(0) for m in SRT_CUE.finditer(r.text)) == r.text  # nothing but cues
    assert [c[:2] for c in cues] == [("1", "00:00:00,000"), ("2", "00:00:30,000")]
    assert cues[0][2] == "00:00:30,000" and "00:00:31,000" < cues[1][2] < "00:00:40,000"
    assert all(wer(SENTENCE, c[3]) <= 0.2 for c in cues), cues
    r = _post(server, "/v1/audio/transcriptions", clips["two_windows"], response_format="vtt")
    assert r.status_code == 200 and r.text.startswith("WEBVTT\n\n")
    vtt = VTT_CUE.findall(r.text[len("WEBVTT\n\n"):])
    assert [(a, b) for a, b, _ in vtt] == [(c[1].replace(",", "."), c[2].replace(",", ".")) for c in cues]
    assert [t for *_, t in vtt] == [c[3] for c in cues]


def test_stream_with_text_format_sends_the_events(server, clips, wav_text):
    with httpx.stream("POST", server.base_url + "/v1/audio/transcriptions", files={"file": ("c.wav", clips["wav"])},
                      data={"stream": "true", "response_format": "text"}, timeout=TIMEOUT) as r:
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["text"] == wav_text


def test_translations_formats(server, clips, wav_text):
    r = _post(server, "/v1/audio/translations", clips["flac"], response_format="verbose_json")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["task"] == "translate" and body["text"] == wav_text  # English-only: the transcript
    assert body["segments"] and body["duration"] > 1
    r = _post(server, "/v1/audio/translations", clips["short"], response_format="text")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    r = _post(server, "/v1/audio/translations", clips["wav"], response_format="xml")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_field_rules(server, clips):
    r = _post(server, "/v1/audio/transcriptions", clips["wav"], response_format="mp4")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = _post(server, "/v1/audio/transcriptions", clips["wav"], response_format="srt", stream="true")
    assert r.status_code == 400 and "does not stream" in r.json()["error"]["message"]
    r = _post(server, "/v1/audio/transcriptions", clips["wav"], temperature="warm")
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = _post(server, "/v1/audio/transcriptions", clips["wav"], max_tokens="-3")
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(server.base_url + "/v1/audio/transcriptions", data={"model": "x"}, files={"other": ("a", b"1")})
    assert r.status_code == 400 and r.json()["error"]["message"] == "No input file found for transcription"
    r = _post(server, "/v1/audio/transcriptions", b"OggS" + bytes(400), "clip.wav")
    assert r.status_code == 400 and "not WAV, MP3 or FLAC" in r.json()["error"]["message"]


def test_mode_surfaces(server):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    caps = httpx.get(server.base_url + "/props").json()["capabilities"]
    assert caps["generation"] is False and caps["restricted_by"] == "-m"
    assert [m["kind"] for m in caps["side_models"]] == ["transcription"]
    models = httpx.get(server.base_url + "/v1/models").json()["data"]
    assert [(m["id"], m["capabilities"]) for m in models] == [(WHISPER_TINY_EN, ["transcription"])]
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 501 and "Whisper" in r.json()["error"]["message"]


def _many_parts():
    return [("field%d" % i, (None, "x")) for i in range(39)] + [("file", ("c.wav", b"RIFF"))]


def _hostile(clips) -> list[tuple[str, dict]]:
    return [
        ("flac-random-body", {"files": {"file": ("x.flac", hostile_flac(clips["flac"]))}}),
        ("wav-overclaiming", {"files": {"file": ("x.wav", overclaiming_wav(clips["wav"]))}}),
        ("mp3-truncated", {"files": {"file": ("x.mp3", truncated_mp3(clips["mp3"]))}}),
        ("40-parts", {"files": _many_parts()}),
        ("30-MiB-part", {"files": {"file": ("x.wav", bytes(30 << 20))}}),
    ]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_hostile_uploads_refused_with_bounded_memory(server, clips, record_property):
    cases = _hostile(clips)
    cold = _rss_kib(server.proc.pid)
    for name, kw in cases:  # each refused, naming the problem; also warms the allocator
        r = httpx.post(server.base_url + "/v1/audio/transcriptions", timeout=TIMEOUT, **kw)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        assert r.json()["error"]["message"], name
        print(f"\n{name}: {r.status_code} in {r.elapsed.total_seconds():.3f} s: {r.json()['error']['message']}")
    before = _rss_kib(server.proc.pid)
    for i in range(20):
        name, kw = cases[i % len(cases)]
        r = httpx.post(server.base_url + "/v1/audio/transcriptions", timeout=TIMEOUT, **kw)
        assert 400 <= r.status_code < 500, (name, r.status_code)
    after = _rss_kib(server.proc.pid)
    growth_mib, from_cold_mib = (after - before) / 1024, (after - cold) / 1024
    record_property("rss_growth_mib", round(growth_mib, 1))
    print(f"\nresident memory over 20 hostile uploads: {growth_mib:+.1f} MiB "
          f"({from_cold_mib:+.1f} MiB counting the first 5 as well)")
    assert growth_mib < 50 and from_cold_mib < 50


def test_chat_server_refuses_audio_before_reading_fields(default_server, clips):
    """The default chat model has no audio tower: b10621's 501, whatever the form says."""
    for path in ("/v1/audio/transcriptions", "/audio/transcriptions"):
        r = httpx.post(default_server.base_url + path, files={"file": ("c.wav", clips["wav"])},
                       data={"response_format": "srt", "temperature": "warm"}, timeout=TIMEOUT)
        assert r.status_code == 501, r.text
        assert r.json()["error"]["message"] == "The current model does not support audio input."
