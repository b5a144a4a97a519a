"""The upload checks in front of the audio decoder: the streaming multipart reader's limits and
duplicate rules, container identification by content, the header walks (WAV chunks, MP3 frames,
FLAC metadata chain) and their bounds, and the bounded decode with its block-wise resampler."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mlxcel.api import audio_upload as au
from mlxcel.api.multipart import MultipartReader, UploadError, boundary_of

B = b"XyZb0undary"


def _body(parts: list[tuple[str, bytes, str | None]], boundary: bytes = B) -> bytes:
    out = b""
    for name, data, filename in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += b"--" + boundary + b"\r\nContent-Disposition: " + disp.encode() + b"\r\n\r\n" + data + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


def _parse(body: bytes, step: int | None = None, **limits):
    reader = MultipartReader(B, **limits)
    step = step or len(body)
    for i in range(0, len(body), step):
        reader.feed(body[i : i + step])
    return reader.finish()


def test_fields_and_file_survive_any_chunking():
    body = _body([("model", b"whisper", None), ("file", b"\r\n--Xy\r\nbytes", "a.wav"), ("stream", b"true", None)])
    for step in (1, 3, 7, 64, None):
        form = _parse(body, step)
        assert form.fields == {"model": "whisper", "stream": "true"} and form.parts == 3
        assert form.file.data == b"\r\n--Xy\r\nbytes" and form.file.filename == "a.wav"


def test_duplicate_text_field_falls_back_and_last_file_wins():
    form = _parse(_body([("prompt", b"a", None), ("prompt", b"b", None), ("file", b"one", "1.wav"),
                         ("file", b"two", "2.wav"), ("response_format", b"json", None)]))
    assert form.text("prompt") is None and "prompt" in form.duplicates
    assert form.file.data == b"two" and form.text("response_format") == "json"


def test_part_count_and_size_limits_stop_the_read():
    with pytest.raises(UploadError) as e:
        _parse(_body([(f"f{i}", b"x", None) for i in range(33)]))
    assert e.value.status == 413 and "32 parts" in str(e.value)
    _parse(_body([(f"f{i}", b"x", None) for i in range(32)]))
    reader = MultipartReader(B, max_part_bytes=1000)
    head = _body([("file", b"", "a.wav")]).split(b"\r\n--" + B + b"--")[0]
    reader.feed(head)
    with pytest.raises(UploadError) as e:
        for _ in range(100):  # refused as soon as the part passes the limit, not at the end
            reader.feed(b"\0" * 100)
    assert e.value.status == 413 and e.value.param == "file"
    with pytest.raises(UploadError):
        _parse(_body([("prompt", b"x" * 2000, None)]), max_text_bytes=1000)
    many = _body([("file", b"x" * 900, "a.wav")] * 5)  # each file part within its limit, the body not
    with pytest.raises(UploadError, match="request body is larger"):
        _parse(many, 100, max_part_bytes=1000, max_body_bytes=3000)


@pytest.mark.parametrize("body, needle", [
    (_body([("a", b"1", None)])[:-8], "closing boundary"),
    (b"--" + B + b"\r\nX-Nothing: 1\r\n\r\nv\r\n--" + B + b"--", "Content-Disposition"),
    (b"junk" * 20000, "no multipart boundary"),
    (b"--" + B + b"\r\n" + b"H" * 20000, "bytes of headers"),
    (b"--" + B + b"garbage\r\n", "delimiter"),
])
def test_malformed_bodies_name_the_problem(body, needle):
    with pytest.raises(UploadError) as e:
        _parse(body)
    assert needle in str(e.value)


def test_content_type_and_boundary():
    assert boundary_of('multipart/form-data; boundary="ab;c"') == b"ab;c"
    for bad in (None, "application/json", "multipart/form-data"):
        with pytest.raises(UploadError):
            boundary_of(bad)


# --- containers --------------------------------------------------------------------------

def _tone(seconds=1.0, rate=22050, channels=1):
    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return np.stack([x] * channels, axis=1) if channels > 1 else x, rate


def _encode(x, rate, fmt, subtype):
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.fixture(scope="module")
def genuine():
    x, rate = _tone(1.0, 22050, 2)
    return {"wav": _encode(x, rate, "WAV", "PCM_16"), "flac": _encode(x, rate, "FLAC", "PCM_16"),
            "mp3": _encode(x, rate, "MP3", "MPEG_LAYER_III")}


def test_geometry_is_read_from_each_header(genuine):
    for name, data in genuine.items():
        clip = au.inspect(data)
        assert (clip.rate, clip.channels) == (22050, 2), name
        assert abs(clip.seconds - 1.0) < 0.1, (name, clip.seconds)
        audio = au.decode(data, clip)
        assert audio.dtype == np.float32 and abs(len(audio) - 16000) < 1600, (name, len(audio))


def test_container_is_identified_by_content():
    for data in (b"OggS" + bytes(100), b"\0" * 100, b"<html>", b"ID3\x04\x00\x00\x00\x00\x00\x05" + b"hello"):
        with pytest.raises(UploadError) as e:
            au.inspect(data)
        assert e.value.status == 400
    with pytest.raises(UploadError, match="empty"):
        au.inspect(b"")


def _patch(data: bytes, at: int, value: int, size: int) -> bytes:
    out = bytearray(data)
    out[at : at + size] = value.to_bytes(size, "little")
    return bytes(out)


def test_wav_bounds(genuine):
    wav = genuine["wav"]
    with pytest.raises(UploadError, match="192000"):
        au.inspect(_patch(wav, 24, 384_000, 4))
    with pytest.raises(UploadError, match="channels"):
        au.inspect(_patch(_patch(wav, 22, 9, 2), 32, 18, 2))
    data_at = wav.find(b"data")
    with pytest.raises(UploadError, match="declares"):
        au.inspect(_patch(wav, data_at + 4, 10 * len(wav), 4))
    with pytest.raises(UploadError, match="truncated WAV"):
        au.inspect(wav[:30])
    long = b"RIFF\0\0\0\0WAVEfmt " + (16).to_bytes(4, "little") + bytes.fromhex("0100 0100 401f0000 401f0000 0100 0800")
    n = 8000 * 601
    with pytest.raises(UploadError, match="600 s"):
        au.inspect(long + b"data" + n.to_bytes(4, "little") + bytes(n))


def test_flac_chain_is_walked_before_decoding(genuine):
    flac = genuine["flac"]
    head = bytearray(flac[:42])
    head[4] |= 0x80
    body = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    body = b"\x00" + body  # not a frame sync
    with pytest.raises(UploadError, match="no audio frame follows"):
        au.inspect(bytes(head) + body)
    unmarked = flac[:42] + b"\x05\xff\xff\xff" + bytes(10)  # a block claiming 16 MiB past the end
    with pytest.raises(UploadError, match="past the end"):
        au.inspect(unmarked)
    with pytest.raises(UploadError, match="STREAMINFO"):
        au.inspect(b"fLaC\x84\x00\x00\x10" + bytes(16))
    big = bytearray(flac)
    big[18:20] = bytes([0x2E, 0xE0])  # sample rate 192001 = 0x2EE01 in STREAMINFO's 20-bit field
    big[20] = 0x10 | (big[20] & 0x0F)
    with pytest.raises(UploadError, match="sample rate"):
        au.inspect(bytes(big))


def test_mp3_frames_are_walked(genuine):
    mp3 = genuine["mp3"]
    with pytest.raises(UploadError, match="truncated mp3|no frame header"):
        au.inspect(mp3[: len(mp3) // 2 + 37])
    with pytest.raises(UploadError, match="no frame header"):
        au.inspect(mp3[:400] + b"garbage" * 50 + mp3[400:])
    clip = au.inspect(mp3)
    for tail in (b"APETAGEX" + bytes(24), bytes(300), b"TAG" + bytes(125)):  # tags and padding after the frames
        assert au.inspect(mp3 + tail) == clip


def _flac_total(flac: bytes, total: int) -> bytes:
    """STREAMINFO's total-samples field (the low 36 bits of file bytes 18..25) rewritten."""
    out = bytearray(flac)
    bits = int.from_bytes(out[18:26], "big")
    out[18:26] = ((bits >> 36 << 36) | total).to_bytes(8, "big")
    return bytes(out)


def test_decoder_output_is_rechecked_against_the_header(genuine):
    understated = _flac_total(genuine["flac"], 1000)
    clip = au.inspect(understated)
    assert clip.frames == 1000
    assert len(au.decode(understated, clip)) <= (1000 + 4096) * 16000 // 22050 + 1  # never past the header
    with pytest.raises(UploadError, match="does not state"):
        au.inspect(_flac_total(genuine["flac"], 0))
    for name, data in genuine.items():  # a header claim shorter than the stream stops the decode at the claim
        claim = au.Clip(name, 22050, 2, 2000)
        with pytest.raises(UploadError, match="runs longer"):
            au.decode(data, claim)
    with pytest.raises(UploadError, match="decoder reports"):
        au.decode(genuine["wav"], au.Clip("WAV", 44100, 2, 22050))


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000, 96000])
def test_blockwise_resampling_equals_whole_signal(rate):
    from scipy.signal import resample_poly

    x = np.random.default_rng(rate).standard_normal(rate * 5 + 123).astype(np.float32) * 0.2
    data = _encode(x, rate, "WAV", "FLOAT")
    got = au.decode(data, au.inspect(data))
    from math import gcd

    g = gcd(rate, 16000)
    want = resample_poly(x, 16000 // g, rate // g) if rate != 16000 else x
    assert len(got) == len(want)
    np.testing.assert_allclose(got, want, atol=2e-6)
