"""OpenAI's transcript renderings without a model: SubRip and WebVTT timestamps and cues."""

from __future__ import annotations

from types import SimpleNamespace

from mlxcel.api.openai.audio_formats import srt, timestamp, verbose, vtt

SEGMENTS = [{"id": 0, "start": 0.0, "end": 30.0, "text": " Hello there."},
            {"id": 1, "start": 30.0, "end": 3725.0629, "text": "   "},  # a silent cue is left out
            {"id": 2, "start": 3725.0629, "end": 3726.9996, "text": " Bye."}]


def test_timestamps():
    assert timestamp(0, ",") == "00:00:00,000"
    assert timestamp(3661.5, ",") == "01:01:01,500"
    assert timestamp(59.9996, ".") == "00:01:00.000"  # rounded to the millisecond, carried


def test_srt_and_vtt_cues():
    assert srt(SEGMENTS) == ("1\n00:00:00,000 --> 00:00:30,000\nHello there.\n\n"
                             "2\n01:02:05,063 --> 01:02:07,000\nBye.\n\n")
    assert vtt(SEGMENTS) == ("WEBVTT\n\n00:00:00.000 --> 00:00:30.000\nHello there.\n\n"
                             "01:02:05.063 --> 01:02:07.000\nBye.\n\n")
    assert srt([]) == "" and vtt([]) == "WEBVTT\n\n"


def test_verbose_json_names_the_language():
    t = SimpleNamespace(segments=SEGMENTS[:1], language_name="german", duration=12.34567, text="Hallo.")
    out = verbose(t, "transcribe", {"type": "tokens"})
    assert (out["task"], out["language"], out["duration"], out["text"]) == ("transcribe", "german", 12.346, "Hallo.")
    assert out["segments"][0]["end"] == 30.0 and list(out)[-1] == "usage"
    assert verbose(t, "translate", {})["language"] == "english"
