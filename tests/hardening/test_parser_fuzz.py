"""Property-based fuzz of the parsers that read client input (GBNF, JSON Schema, multipart, audio
headers): every input ends in the parser's documented error or a result, within a deadline.

Structured strategies reach past the first syntax check; raw bytes cover the rest. The
coverage-guided run of the same targets is Atheris (test_atheris_smoke below, and
scripts/hardening.py for long runs).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import REPO
from tests.hardening import targets
from tests.hardening.bodies import gbnf_text, json_schemas
from tests.hardening.budget import fuzz_settings

# --- multipart: delimiter lines, headers and bodies in any order, some fields well formed ---
def _part(name: str, body: bytes, filename: bool) -> bytes:
    disp = f'form-data; name="{name}"' + ('; filename="a.wav"' if filename else "")
    return b"--" + targets.BOUNDARY + b"\r\nContent-Disposition: " + disp.encode() + b"\r\n\r\n" + body + b"\r\n"


_mp_pieces = st.one_of(
    st.builds(_part, st.sampled_from(["file", "model", "prompt", "x", ""]), st.binary(max_size=40), st.booleans()),
    st.sampled_from([b"--" + targets.BOUNDARY + b"--\r\n", b"--" + targets.BOUNDARY + b"\r\n", b"\r\n", b"\r\n\r\n",
                     b"Content-Type: audio/wav\r\n", b":", b"\xff\xfe", b"--" + targets.BOUNDARY + b"  \r\n"]),
    st.binary(max_size=30),
)
multipart_bodies = st.lists(_mp_pieces, max_size=10).map(b"".join)


# --- audio: container headers with fuzzed fields, then arbitrary sample bytes ---
def _wav(tag, channels, rate, bits, align, size, tail) -> bytes:
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits)
    return (b"RIFF" + struct.pack("<I", 36 + len(tail)) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", size) + tail)


def _flac(min_block, max_block, rate, channels, bits, total, tail) -> bytes:
    info = struct.pack(">HH", min_block, max_block) + b"\x00" * 6
    packed = (rate << 44) | ((channels - 1) << 41) | ((bits - 1) << 36) | total
    return b"fLaC" + b"\x80\x00\x00\x22" + info + packed.to_bytes(8, "big") + b"\x00" * 16 + tail


_u16, _u32 = st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF)
audio_files = st.one_of(
    st.builds(_wav, st.sampled_from([1, 3, 6, 7, 0xFFFE, 2]), st.integers(0, 9), st.integers(0, 200_000),
              st.sampled_from([0, 8, 16, 24, 32, 64, 12]), st.integers(0, 16), _u32, st.binary(max_size=200)),
    st.builds(_flac, _u16, _u16, st.integers(0, (1 << 20) - 1), st.integers(1, 8), st.integers(1, 32),
              st.integers(0, (1 << 36) - 1), st.binary(max_size=60)),
    st.builds(lambda head, tail: b"ID3" + head + tail, st.binary(min_size=7, max_size=7), st.binary(max_size=60)),
    st.builds(lambda h, tail: h + tail, st.sampled_from([b"\xff\xfb\x90\x64", b"\xff\xf3\x48\xc4", b"\xff\xe2"]),
              st.binary(max_size=400)),
)


@fuzz_settings(400, deadline_ms=2000)
@given(st.one_of(gbnf_text.map(str.encode), st.binary(max_size=200)))
def test_gbnf_parser_raises_only_grammar_errors(data):
    targets.gbnf(data)


@fuzz_settings(150, deadline_ms=5000)
@given(st.one_of(json_schemas.map(lambda s: json.dumps(s).encode()), st.binary(max_size=100)))
def test_json_schema_converter_raises_only_schema_errors(data):
    targets.json_schema(data)


@fuzz_settings(400, deadline_ms=2000)
@given(st.binary(max_size=1).flatmap(lambda cut: multipart_bodies.map(lambda b: cut + b)))
def test_multipart_reader_raises_only_upload_errors(data):
    targets.multipart(data)


@fuzz_settings(300, deadline_ms=5000)
@given(st.one_of(audio_files, st.binary(max_size=200)))
def test_audio_reader_raises_only_upload_errors(data):
    targets.audio(data)


@pytest.mark.skipif(sys.platform != "linux", reason="Atheris is installed on Linux only (pyproject dev extra)")
def test_atheris_runs_each_target_briefly():
    """The coverage-guided fuzzer over the same targets, a few seconds each: a crash exits non-zero
    with the input that caused it (scripts/hardening.py atheris runs it for longer)."""
    for name in targets.TARGETS:
        r = subprocess.run([sys.executable, "-m", "scripts.hardening", "atheris", name, "--seconds", "4"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert "runs in" in r.stderr or "Done" in r.stderr, r.stderr[-2000:]
