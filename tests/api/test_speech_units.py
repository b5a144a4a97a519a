"""The speech route's pieces without a model: each encoder fed in chunks decodes back to the
samples it was given (exactly for pcm/wav/flac, within codec padding for mp3/opus/aac) and sends
what it can before the end (pcm, mp3, opus, aac); the text is cut into sentences and phoneme
chunks the model takes; a format whose encoder is not installed is not served (a subprocess
without lameenc and av); any JSON body is either a checked request or a typed 400 (a property
test of the route's field parser)."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.api.errors import ApiError
from mlxcel.api.openai import speech, speech_formats
from mlxcel.workers import speech_text
from tests.hidden_packages import env_without

RATE = 24_000


def _tone(n: int) -> np.ndarray:
    return (0.5 * np.sin(np.arange(n) / RATE * 2 * np.pi * 440)).astype(np.float32)


def _encode(fmt: str, pieces: list[np.ndarray]) -> tuple[list[bytes], bytes]:
    enc = speech_formats.encoder(fmt, RATE)
    early = [enc.feed(p) for p in pieces]
    return early, b"".join(early) + enc.finish()


def _decode(fmt: str, data: bytes) -> np.ndarray:
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767
    if fmt == "aac":
        import av

        with av.open(io.BytesIO(data)) as f:
            return np.concatenate([fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)]).astype(np.float32)
    import soundfile as sf

    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == RATE
    return audio


@pytest.mark.parametrize("fmt,slack,streams", [("pcm", 0, True), ("wav", 0, False), ("flac", 0, False),
                                               ("mp3", 2 * 1152, True), ("opus", 960, True), ("aac", 3 * 1024, True)])
def test_encoders_round_trip(fmt, slack, streams):
    pieces = [_tone(12_000), _tone(24_000), _tone(36_000)]
    early, data = _encode(fmt, pieces)
    audio = _decode(fmt, data)
    n = sum(len(p) for p in pieces)
    assert n <= len(audio) <= n + slack
    if slack == 0:
        assert np.abs(audio - speech_formats.pcm16(np.concatenate(pieces)) / 32767).max() < 1e-4
    assert any(early) == streams  # what goes out before the speech is done


def test_samples_are_clipped():
    assert speech_formats.pcm16(np.array([2.0, -3.0, 0.0], np.float32)).tolist() == [32767, -32767, 0]


def test_sentences_and_chunks():
    assert speech_text.sentences("Hi there. How are you?\n\nFine!  Thanks") == ["Hi there.", "How are you?", "Fine!",
                                                                                "Thanks"]
    long = " ".join(["abcdefghi"] * 120)  # 1,199 symbols
    pieces = list(speech_text.fit(long))
    assert all(len(p) <= speech_text.MAX_PHONEMES for p in pieces) and " ".join(pieces) == long
    assert list(speech_text.fit("x" * 1100)) == ["x" * 510, "x" * 510, "x" * 80]  # no space in reach: cut at the limit
    assert list(speech_text.chunks("One. Two three.", lambda s: s.upper())) == ["ONE.", "TWO THREE."]
    assert speech_text.language_of("af_heart") == "a" and speech_text.language_of("jf_alpha") is None


def test_formats_without_their_encoder_are_not_served(tmp_path):
    """The route refuses what `served()` leaves out, naming the rest (tests/e2e/test_speech.py)."""
    code = "from mlxcel.api.openai import speech_formats; print(','.join(speech_formats.served()))"
    out = subprocess.run([sys.executable, "-c", code], env=env_without(tmp_path, "av", "lameenc"), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "opus,flac,wav,pcm"
    assert speech_formats.served() == speech_formats.FORMATS  # here every encoder is installed


_scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                          max_size=3), max_leaves=6)
_fields = {"input": st.text(max_size=20) | st.just("x" * 4097) | _json,
           "voice": st.sampled_from(["af_heart", "", "alloy"]) | st.fixed_dictionaries({"id": st.text(max_size=8)})
           | _json,
           "response_format": st.sampled_from([*speech_formats.FORMATS, "ogg", ""]) | _json,
           "speed": st.floats(0, 5) | st.sampled_from([0.25, 4.0, True, "1"]) | _json,
           "stream_format": st.sampled_from(["audio", "sse", "x"]) | _json,
           "instructions": st.sampled_from(["", "calm"]) | _json}


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional=_fields))
def test_any_body_is_a_checked_request_or_a_typed_400(body):
    try:
        req = speech.parse(body)
    except ApiError as e:
        assert e.status == 400 and e.param in _fields and e.message
        assert e.code == ("field_not_honoured" if e.param == "instructions" else "invalid_parameter")
        return
    assert 0 < len(req.text) <= speech.MAX_INPUT_CHARS and req.text.strip()
    assert isinstance(req.voice, str) and req.voice and req.fmt in speech_formats.served()
    assert 0.25 <= req.speed <= 4.0 and isinstance(req.sse, bool)
