"""A real `mlxcel-server -m mlxcel-fixtures/kokoro-tiny` (random weights, Kokoro's 600 samples at
24 kHz per duration frame, a duration head fixed at 2 frames a phoneme token at speed 1): the
OpenAI SDK's `audio.speech.create` and its `with_streaming_response` answer in every served format
and each decodes back (libsndfile for wav/flac/opus, miniaudio and libsndfile for mp3, PyAV for
aac, raw 16-bit LE for pcm) to 24 kHz mono of the length the model produced; `speed` scales that
length as Kokoro's durations do; `stream_format: sse` sends one delta per sentence and the done
event with usage; hostile or unservable requests get a typed 400 in OpenAI's shape; with
--max-queue-depth 0 a second request is refused with 503 `queue_full` while one runs, and a
client that hangs up stops its job (read from /metrics, never timed)."""

from __future__ import annotations

import base64
import io
import json
import socket
import time

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import KOKORO_TINY

RATE = 24_000
FRAME = 600  # samples per duration frame
TIMEOUT = 300


@pytest.fixture(scope="module")
def server():
    fixture_path(KOKORO_TINY)
    s = ServerProcess(["-m", KOKORO_TINY, "--offline", "--max-queue-depth", "0", "--metrics"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def _speak(client, fmt: str, text: str = "Hi.", **kw) -> bytes:
    return client.audio.speech.create(model=KOKORO_TINY, voice="af_heart", input=text, response_format=fmt,
                                      **kw).content


@pytest.fixture(scope="module")
def pcm_samples(client) -> int:
    data = _speak(client, "pcm")
    assert len(data) % 2 == 0
    n = len(data) // 2
    assert n > 0 and n % FRAME == 0 and n // FRAME % 2 == 0  # whole frames, 2 per phoneme token
    assert np.abs(np.frombuffer(data, "<i2")).max() > 0
    return n


def _decode_soundfile(data: bytes) -> tuple[int, int]:
    import soundfile as sf

    audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert audio.shape[1] == 1 and np.abs(audio).max() > 0
    return len(audio), rate


def _decode_mp3(data: bytes) -> tuple[int, int]:
    """miniaudio (dr_mp3) and libsndfile (mpg123) must agree."""
    import miniaudio

    decoded = miniaudio.decode(data, output_format=miniaudio.SampleFormat.SIGNED16, nchannels=1, sample_rate=RATE)
    assert (decoded.num_frames, decoded.sample_rate) == _decode_soundfile(data)
    return decoded.num_frames, decoded.sample_rate


def _decode_aac(data: bytes) -> tuple[int, int]:
    import av

    assert data[0] == 0xFF and data[1] & 0xF0 == 0xF0  # an ADTS sync word
    with av.open(io.BytesIO(data)) as f:
        frames = list(f.decode(audio=0))
    assert {fr.layout.name for fr in frames} == {"mono"} and len({fr.sample_rate for fr in frames}) == 1
    return sum(fr.samples for fr in frames), frames[0].sample_rate


def _decode_opus(data: bytes) -> tuple[int, int]:
    assert data[:4] == b"OggS" and b"OpusHead" in data[:64]
    return _decode_soundfile(data)


# format -> (decoder, extra samples a codec may add: priming and its last frame's padding; -1: +-960)
DECODERS = {"wav": (_decode_soundfile, 0), "flac": (_decode_soundfile, 0), "mp3": (_decode_mp3, 2 * 1152),
            "opus": (_decode_opus, -960), "aac": (_decode_aac, 3 * 1024)}
MEDIA = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac"}


def _check_decodes(fmt: str, data: bytes, pcm_samples: int) -> None:
    decode, slack = DECODERS[fmt]
    n, rate = decode(data)
    assert rate == RATE
    if slack >= 0:
        assert pcm_samples <= n <= pcm_samples + slack
    else:  # Opus: within one 20 ms frame
        assert abs(n - pcm_samples) <= -slack


@pytest.mark.parametrize("fmt", list(DECODERS))
def test_create_in_each_format_decodes_to_the_model_output(client, pcm_samples, fmt):
    _check_decodes(fmt, _speak(client, fmt), pcm_samples)


@pytest.mark.parametrize("fmt", list(DECODERS))
def test_streaming_response_in_each_format(client, pcm_samples, fmt):
    with client.audio.speech.with_streaming_response.create(model=KOKORO_TINY, voice="af_heart", input="Hi.",
                                                            response_format=fmt) as r:
        assert r.headers["content-type"] == MEDIA[fmt]
        data = b"".join(r.iter_bytes())
    _check_decodes(fmt, data, pcm_samples)


def test_speed_scales_the_durations(client, pcm_samples):
    """2 frames a token at speed 1: 1 at speed 2, 4 at speed 0.5."""
    assert len(_speak(client, "pcm", speed=2.0)) // 2 == pcm_samples // 2
    assert len(_speak(client, "pcm", speed=0.5)) // 2 == pcm_samples * 2


def test_streaming_response_and_ignored_field_header(client, pcm_samples):
    with client.audio.speech.with_streaming_response.create(
            model=KOKORO_TINY, voice="af_heart", input="Hi.", response_format="pcm", extra_body={"foo": 1}) as r:
        assert r.headers["content-type"] == "audio/pcm"
        assert r.headers["x-millm-ignored-fields"] == '"foo"'
        data = b"".join(r.iter_bytes())
    assert len(data) // 2 == pcm_samples


def test_sse_sends_a_delta_per_sentence_then_usage(client, pcm_samples):
    with client.audio.speech.with_streaming_response.create(
            model=KOKORO_TINY, voice="bf_emma", input="Hi. Hi.\nHi.", response_format="pcm", stream_format="sse") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    *deltas, done = events
    assert [e["type"] for e in deltas] == ["speech.audio.delta"] * 3 and done["type"] == "speech.audio.done"
    pieces = [base64.b64decode(e["audio"]) for e in deltas]
    assert all(len(p) > 0 and len(p) % (2 * FRAME) == 0 for p in pieces)
    u = done["usage"]
    assert u["input_tokens"] > 0 and u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["output_tokens"] * FRAME * 2 == sum(len(p) for p in pieces)


def _refused(client, **kw) -> openai.BadRequestError:
    body = {"model": KOKORO_TINY, "voice": "af_heart", "input": "Hi.", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(**{k: v for k, v in body.items() if v is not None})
    return e.value


@pytest.mark.parametrize("fields,param,code", [
    ({"input": "x" * 4097}, "input", "invalid_parameter"),
    ({"input": "   "}, "input", "invalid_parameter"),
    ({"voice": "alloy"}, "voice", "invalid_parameter"),
    ({"voice": ""}, "voice", "invalid_parameter"),
    ({"response_format": "ogg"}, "response_format", "invalid_parameter"),
    ({"speed": 0.1}, "speed", "invalid_parameter"),
    ({"speed": 4.5}, "speed", "invalid_parameter"),
    ({"stream_format": "chunks"}, "stream_format", "invalid_parameter"),
    ({"instructions": "Speak like a pirate."}, "instructions", "field_not_honoured"),
])
def test_refusals_are_typed_400s(client, fields, param, code):
    err = _refused(client, **fields)
    assert err.body["param"] == param and err.body["code"] == code, err.body
    assert err.body["type"] == "invalid_request_error" and err.body["message"]
    if param == "response_format":
        assert "mp3, opus, aac, flac, wav, pcm" in err.body["message"]


def test_other_refusals(server, client):
    url = server.base_url + "/v1/audio/speech"
    r = httpx.post(url, json={"voice": "af_heart", "input": "Hi.", "speed": "fast"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speed"
    r = httpx.post(url, json={"voice": "af_heart", "input": "Hi.", "bar": 1}, headers={"X-miLLM-Strict": "true"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unused_fields_refused"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="someone-else", voice="af_heart", input="Hi.")


def test_mode_surfaces(server):
    caps = httpx.get(server.base_url + "/props").json()["capabilities"]
    assert caps["generation"] is False and caps["restricted_by"] == "-m"
    [side] = caps["side_models"]
    assert side["kind"] == "speech" and side["voices"] == ["af_heart", "bf_emma"] and side["sample_rate"] == RATE
    models = httpx.get(server.base_url + "/v1/models").json()["data"]
    assert [(m["id"], m["capabilities"]) for m in models] == [(KOKORO_TINY, ["speech"])]
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 501 and "Kokoro" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")})
    assert r.status_code == 501


def _queue(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    prefix = "mlxcel_speech_"
    return {line.split()[0][len(prefix):]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def _until(server, **want) -> None:
    deadline = time.monotonic() + 120
    while not all(_queue(server).get(k) == v for k, v in want.items()):
        assert time.monotonic() < deadline, (want, _queue(server))
        time.sleep(0.05)


def test_full_queue_refuses_and_a_gone_client_stops_its_job(server, client):
    body = json.dumps({"voice": "af_heart", "input": " ".join(["Hi."] * 40),
                       "response_format": "pcm"}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    _until(server, queue_running=1)
    with pytest.raises(openai.InternalServerError) as e:  # 503
        _speak(client, "pcm")
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    r = httpx.post(server.base_url + "/v1/audio/speech", json={"voice": "af_heart", "input": "Hi.",
                                                               "stream_format": "sse"})
    assert r.status_code == 503 and r.headers["retry-after"]
    sock.close()  # forty sentences, one chunk each: the job stops at its next chunk
    _until(server, queue_running=0, requests_cancelled_total=1)
    assert len(_speak(client, "pcm")) > 0


def test_chat_server_refuses_speech(default_server):
    r = httpx.post(default_server.base_url + "/v1/audio/speech", json={"voice": "af_heart", "input": "Hi."})
    assert r.status_code == 501 and "Kokoro" in r.json()["error"]["message"]
