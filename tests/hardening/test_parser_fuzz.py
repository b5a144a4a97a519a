"""Property-based fuzz of the parsers that read client input (GBNF, JSON Schema, multipart, audio
headers): every input ends in the parser's documented error or a result, within a deadline.

Structured strategies reach past the first syntax check; raw bytes cover the rest. The
coverage-guided run of the same targets is Atheris (test_atheris_smoke below, and
scripts/hardening.py for long runs).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import REPO
from tests.hardening import targets
from tests.hardening.bodies import audio_files, gbnf_text, json_schemas, multipart_bodies
from tests.hardening.budget import fuzz_settings

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
