"""OpenAI's `response_format` renderings of a finished transcript: `text`, `srt`, `vtt`, `verbose_json`.

`json` stays with the route (the transcription route answers b10621's transcript-event object,
the translation route OpenAI's `{"text"}`). A cue or segment is one decoded Whisper window (the
worker decodes without timestamps, so a window is the finest span it knows the time of).
"""

from __future__ import annotations

from typing import Any

from litestar import Response

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
STREAMED = ("json", "text")  # OpenAI streams transcript events for these; subtitles need the whole clip
TEXT_TYPE = "text/plain; charset=utf-8"


def timestamp(seconds: float, decimal: str) -> str:
    """HH:MM:SS plus milliseconds after `decimal` ("," in SubRip, "." in WebVTT)."""
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def _cues(segments: list[dict]) -> list[tuple[float, float, str]]:
    return [(s["start"], s["end"], s["text"].strip()) for s in segments if s["text"].strip()]


def srt(segments: list[dict]) -> str:
    return "".join(f"{i}\n{timestamp(a, ',')} --> {timestamp(b, ',')}\n{text}\n\n"
                   for i, (a, b, text) in enumerate(_cues(segments), 1))


def vtt(segments: list[dict]) -> str:
    return "WEBVTT\n\n" + "".join(f"{timestamp(a, '.')} --> {timestamp(b, '.')}\n{text}\n\n"
                                  for a, b, text in _cues(segments))


def verbose(t: Any, task: str, usage: dict) -> dict:
    """OpenAI's verbose_json: task, language by name (a translation's is English), duration in
    seconds, text, segments, usage."""
    segments = [{**s, "start": round(s["start"], 3), "end": round(s["end"], 3)} for s in t.segments]
    language = "english" if task == "translate" else t.language_name
    return {"task": task, "language": language, "duration": round(t.duration, 3), "text": t.text,
            "segments": segments, "usage": usage}


def render(fmt: str, t: Any, task: str, usage: dict) -> Response:
    """The response for every format but `json`."""
    if fmt == "text":
        return Response(t.text + "\n", media_type=TEXT_TYPE)
    if fmt == "srt":
        return Response(srt(t.segments), media_type=TEXT_TYPE)
    if fmt == "vtt":
        return Response(vtt(t.segments), media_type=TEXT_TYPE)
    return Response(verbose(t, task, usage))
