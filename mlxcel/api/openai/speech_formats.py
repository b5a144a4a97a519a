"""The audio encodings of POST /v1/audio/speech, fed chunk by chunk as the worker speaks.

OpenAI's `response_format` values and what serves them here:

- `pcm`: raw 16-bit signed little-endian mono samples at the model's rate (24 kHz for Kokoro, as
  OpenAI documents), no header; each chunk goes out as it is decoded.
- `mp3`: LAME through the `lameenc` wheel (constant 64 kbit/s, no Xing header to patch at the
  end), so frames go out as they are encoded.
- `opus`: Opus in an Ogg container, through libsndfile (`soundfile`), which only appends pages.
- `wav` (16-bit PCM) and `flac` (16-bit) through libsndfile: their headers state the length, which
  libsndfile patches when the file is closed, so the file goes out whole once the speech is done.
- `aac`: AAC-LC in ADTS frames through PyAV (FFmpeg's native encoder, bundled by the `av` wheel),
  muxed and sent as they are encoded.

A format whose encoder package is not installed is refused with a 400 naming the served ones.

Samples are clipped to [-1, 1] before they are quantised to 16 bits.
"""

from __future__ import annotations

import io

import numpy as np

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")  # OpenAI's list
_PACKAGES = {"mp3": "lameenc", "aac": "av", "opus": "soundfile", "flac": "soundfile", "wav": "soundfile"}
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
               "pcm": "audio/pcm"}
MP3_KBPS = 64


def served() -> tuple[str, ...]:
    """The formats whose encoder is installed, in OpenAI's order."""
    import importlib.util

    return tuple(f for f in FORMATS if f not in _PACKAGES or importlib.util.find_spec(_PACKAGES[f]) is not None)


def pcm16(audio: np.ndarray) -> np.ndarray:
    return np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")


class _Pcm:
    def feed(self, audio: np.ndarray) -> bytes:
        return pcm16(audio).tobytes()

    def finish(self) -> bytes:
        return b""


class _Mp3:
    def __init__(self, rate: int) -> None:
        import lameenc

        self._lame = lameenc.Encoder()
        self._lame.set_bit_rate(MP3_KBPS)
        self._lame.set_in_sample_rate(rate)
        self._lame.set_channels(1)
        self._lame.set_quality(5)

    def feed(self, audio: np.ndarray) -> bytes:
        return bytes(self._lame.encode(pcm16(audio).tobytes()))

    def finish(self) -> bytes:
        return bytes(self._lame.flush())


class _Sink(io.RawIOBase):
    """A seekable in-memory file for libsndfile; `taken` marks what has already been sent."""

    def __init__(self) -> None:
        super().__init__()
        self.buf, self.pos, self.taken = bytearray(), 0, 0

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:
        data = bytes(b)
        if self.pos < self.taken:
            raise OSError("the encoder rewrote audio that was already sent")
        self.buf[self.pos : self.pos + len(data)] = data
        self.pos += len(data)
        return len(data)

    def read(self, n: int = -1) -> bytes:
        out = bytes(self.buf[self.pos :] if n < 0 else self.buf[self.pos : self.pos + n])
        self.pos += len(out)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.buf) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def take(self) -> bytes:
        out = bytes(self.buf[self.taken :])
        self.taken = len(self.buf)
        return out


class _SoundFile:
    _FORMATS = {"wav": ("WAV", "PCM_16", False), "flac": ("FLAC", "PCM_16", False), "opus": ("OGG", "OPUS", True)}

    def __init__(self, fmt: str, rate: int) -> None:
        import soundfile as sf

        container, subtype, self._incremental = self._FORMATS[fmt]
        self._sink = _Sink()
        self._file = sf.SoundFile(self._sink, "w", rate, 1, subtype, format=container)

    def feed(self, audio: np.ndarray) -> bytes:
        self._file.write(pcm16(audio))
        return self._sink.take() if self._incremental else b""

    def finish(self) -> bytes:
        self._file.close()
        return self._sink.take()


class _Aac:
    def __init__(self, rate: int) -> None:
        import av

        self._av, self._rate = av, rate
        self._sink = _Sink()
        self._out = av.open(self._sink, "w", format="adts")
        self._stream = self._out.add_stream("aac", rate=rate, layout="mono")

    def _mux(self, frame) -> bytes:
        for packet in self._stream.encode(frame):
            self._out.mux(packet)
        return self._sink.take()

    def feed(self, audio: np.ndarray) -> bytes:
        frame = self._av.AudioFrame.from_ndarray(pcm16(audio)[None, :], format="s16", layout="mono")
        frame.sample_rate = self._rate
        return self._mux(frame)

    def finish(self) -> bytes:
        data = self._mux(None)
        self._out.close()
        return data + self._sink.take()


def encoder(fmt: str, rate: int):
    """An encoder for one response: `feed(audio) -> bytes` per chunk, then `finish() -> bytes`."""
    if fmt == "pcm":
        return _Pcm()
    if fmt == "mp3":
        return _Mp3(rate)
    if fmt == "aac":
        return _Aac(rate)
    return _SoundFile(fmt, rate)
