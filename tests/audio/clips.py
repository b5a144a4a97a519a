"""Test audio: a sentence spoken by espeak-ng, re-encoded as WAV, MP3 and FLAC with soundfile,
the hostile uploads built from those genuine files, and the word error rate."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

SENTENCE = "Open the window and let the fresh air into the room."
FORMATS = {"wav": ("WAV", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "flac": ("FLAC", "PCM_16")}


def spoken(tmp: Path, sentence: str = SENTENCE) -> tuple[np.ndarray, int]:
    """espeak-ng's rendering of `sentence` (float32 mono, its own rate); skips without espeak-ng."""
    import soundfile as sf

    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng; .ci/run installs it)")
    out = tmp / "spoken.wav"
    subprocess.run([exe, "-v", "en-us", "-s", "140", "-w", str(out), sentence], check=True, capture_output=True)
    audio, rate = sf.read(str(out), dtype="float32")
    return audio, rate


def encode(audio: np.ndarray, rate: int, container: str) -> bytes:
    import soundfile as sf

    fmt, subtype = FORMATS[container]
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def wer(reference: str, hypothesis: str) -> float:
    """Word-level Levenshtein distance over the reference length."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(1, len(ref))


def hostile_flac(genuine_flac: bytes, body_bytes: int = 12 << 20) -> bytes:
    """fLaC + the genuine STREAMINFO block (marked last) + a random body."""
    head = bytearray(genuine_flac[:42])
    head[4] |= 0x80
    body = np.random.default_rng(7).integers(0, 256, body_bytes, dtype=np.uint8).tobytes()
    return bytes(head) + body


def overclaiming_wav(genuine_wav: bytes) -> bytes:
    """The data chunk's size field claims ten times what the file holds."""
    data = bytearray(genuine_wav)
    at = data.find(b"data")
    size = int.from_bytes(data[at + 4 : at + 8], "little")
    data[at + 4 : at + 8] = (size * 10).to_bytes(4, "little")
    return bytes(data)


def truncated_mp3(genuine_mp3: bytes) -> bytes:
    return genuine_mp3[: len(genuine_mp3) // 2 + 37]
