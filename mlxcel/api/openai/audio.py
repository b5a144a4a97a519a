"""POST /v1/audio/transcriptions (and b10621's /audio/transcriptions alias) and mlxcel's own
POST /v1/audio/translations, served by the Whisper worker.

The shared route answers b10621's transcript-event object
(`{"type": "transcript.text.done", "text", "usage"}`), or with `stream` equal to the literal
"true" `transcript.text.delta` frames, the done frame and `data: [DONE]`. Its field rules are
upstream's: the capability refusal (a chat model without an audio tower: 501 "The current model
does not support audio input.") comes before any field is read, `temperature` / `max_tokens`
arrive as strings and a value that does not parse is a 400, a text
field sent twice falls back to its default, a repeated `file` keeps the last, unknown fields are
ignored. The Whisper worker decodes a 30-second window at a time, and each window's text is sent
as one delta as soon as it is decoded (their concatenation is the non-streamed `text`).
`response_format` also takes OpenAI's `text`, `srt`, `vtt` and `verbose_json` (b10621 takes json
only; api/openai/audio_formats.py renders them); `text` streams as json does, the subtitle and
verbose shapes need the whole clip, so they refuse `stream`.

/v1/audio/translations answers OpenAI's `json` (`{"text"}`) and the same four. On an English-only
checkpoint (tiny.en and friends) the model hears English only, so its translation is its
transcript; a multilingual checkpoint runs Whisper's translate task.

The upload is read and bounded by api/multipart.py and checked by api/audio_upload.py before the
decoder or the model sees a byte of it.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading

from litestar import Request, Response, post
from litestar.response import Stream

from mlxcel.api.audio_upload import decode, inspect
from mlxcel.api.openai import audio_formats
from mlxcel.api.errors import ApiError, error_type
from mlxcel.api.multipart import MAX_BODY_BYTES, Form, MultipartReader, UploadError, boundary_of
from mlxcel.api.side_workers import check_queue, generation_refusal, run_queued, worker_queue
from mlxcel.api.state import AppState
from mlxcel.config.limits import echo
from mlxcel.workers.queue import QueueClosed
from mlxcel.workers.whisper import TRANSCRIPTION, WhisperError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DRAIN_LIMIT = 64 << 20  # after a refusal, read (and drop) this much more so the client sees the answer
# Litestar's backstop only: the reader refuses past MAX_BODY_BYTES and then drains, so the client
# reads the 413 instead of a reset connection
BODY_LIMIT = MAX_BODY_BYTES + DRAIN_LIMIT


def transcriber(state: AppState):
    """The Whisper worker, or the refusal a server without one gives (before any field check)."""
    worker = getattr(state, "transcriber", None)
    if worker is not None:
        return worker
    if state.plan is not None and any(s.kind == TRANSCRIPTION for s in state.plan.sides):
        if state.load_error:
            raise ApiError(503, f"the Whisper model failed to load: {state.load_error}", type="unavailable_error")
        raise ApiError(503, "Loading model", code="model_not_loaded", type="unavailable_error")
    refusal = generation_refusal(state)
    if refusal is not None:
        raise refusal
    raise ApiError(501, "The current model does not support audio input.", code="not_supported",
                   type="not_supported_error")


async def read_form(request: Request) -> Form:
    """The multipart body within the limits; on a refusal the rest of the body (up to
    DRAIN_LIMIT) is read and dropped first, so the client is answered instead of cut off."""
    stream = request.stream()
    try:
        reader = MultipartReader(boundary_of(request.headers.get("content-type")))
        async for chunk in stream:
            reader.feed(chunk)
        return reader.finish()
    except UploadError as e:
        drained = 0
        async for chunk in stream:
            drained += len(chunk)
            if drained > DRAIN_LIMIT:
                break
        raise ApiError(e.status, str(e), code="invalid_upload", param=e.param) from None


def _float(form: Form, name: str, default: float) -> float:
    raw = form.text(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ApiError(400, f"'{name}' must be a number, got {echo(raw)!r}", code="invalid_parameter",
                       param=name) from None
    if not math.isfinite(value) or value < 0:
        raise ApiError(400, f"'{name}' must be a finite number >= 0, got {echo(raw)!r}", code="invalid_parameter",
                       param=name)
    return value


def _count(form: Form, name: str) -> int | None:
    raw = form.text(name)
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise ApiError(400, f"'{name}' must be a non-negative integer, got {echo(raw)!r}", code="invalid_parameter",
                       param=name)
    return int(raw)


async def _prepare(worker, form: Form, task: str, queue) -> tuple:
    """Every refusal the request can earn, before decoding starts: (audio, transcription options).
    A full queue is checked last, so a request that could never be served is a 400, not a 503."""
    if form.file is None:
        raise ApiError(400, "No input file found for transcription", code="invalid_request_error", param="file")
    options = {"task": task, "language": form.text("language") or None, "prompt": form.text("prompt"),
               "temperature": _float(form, "temperature", 0.0), "max_tokens": _count(form, "max_tokens")}
    try:
        worker.check(options["language"])
    except WhisperError as e:
        raise ApiError(400, str(e), code="invalid_parameter", param="language") from None
    try:
        clip = inspect(form.file.data)
        check_queue(queue)
        audio = await asyncio.to_thread(decode, form.file.data, clip)
    except UploadError as e:
        raise ApiError(e.status, str(e), code="invalid_audio", param=e.param) from None
    return audio, options


async def _transcribe(request: Request, state: AppState, worker, form: Form, task: str):
    """The transcript, in the transcription queue's turn; a client that goes away takes its job out
    of the queue, or stops it at the next window (api/side_workers.py)."""
    queue = worker_queue(state, TRANSCRIPTION)
    audio, options = await _prepare(worker, form, task, queue)
    stop = threading.Event()
    return await run_queued(request, queue, lambda: worker.transcribe(audio, cancelled=stop.is_set, **options),
                            stop.set)


def _format(form: Form, streamed: bool) -> str:
    fmt = form.text("response_format") or "json"
    if fmt not in audio_formats.FORMATS:
        raise ApiError(400, f"response_format {echo(fmt)!r} is not supported; use one of {', '.join(audio_formats.FORMATS)}",
                       code="invalid_parameter", param="response_format")
    if streamed and fmt not in audio_formats.STREAMED:
        raise ApiError(400, f"response_format {echo(fmt)!r} needs the whole clip and does not stream; use json or text "
                       "with `stream`", code="invalid_parameter", param="response_format")
    return fmt


def _usage(t) -> dict:
    return {"type": "tokens", "input_tokens": t.input_tokens, "output_tokens": t.output_tokens,
            "total_tokens": t.input_tokens + t.output_tokens, "input_tokens_details": {"cached_tokens": 0}}


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@post(["/v1/audio/transcriptions", "/audio/transcriptions"], status_code=200, request_max_body_size=BODY_LIMIT)
async def transcriptions(request: Request, app_state: AppState) -> Response:
    worker = transcriber(app_state)
    form = await read_form(request)
    if form.file is None:
        raise ApiError(400, "No input file found for transcription", code="invalid_request_error", param="file")
    fmt = _format(form, streamed := form.text("stream") == "true")
    if not streamed:
        t = await _transcribe(request, app_state, worker, form, "transcribe")
        if fmt != "json":
            return audio_formats.render(fmt, t, "transcribe", _usage(t))
        return Response({"type": "transcript.text.done", "text": t.text, "usage": _usage(t)})
    queue = worker_queue(app_state, TRANSCRIPTION)
    audio, options = await _prepare(worker, form, "transcribe", queue)  # a full queue: 503 before the stream
    return Stream(_frames(queue, worker, audio, options), media_type="text/event-stream", headers=SSE_HEADERS)


async def _frames(queue, worker, audio, options):
    """One transcript.text.delta per window as the worker decodes it, then the done frame; a
    client that goes away takes the job out of the queue, or stops the worker at the next window."""
    loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
    stop = threading.Event()
    job = asyncio.ensure_future(queue.run(lambda: worker.transcribe(
        audio, on_delta=lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d), cancelled=stop.is_set,
        **options), stop.set))
    job.add_done_callback(lambda _: deltas.put_nowait(None))
    try:
        while (delta := await deltas.get()) is not None:
            yield _sse({"type": "transcript.text.delta", "delta": delta})
        try:
            t = job.result()
        except QueueClosed as e:  # the shutdown drain ran out
            yield _sse({"error": {"message": str(e), "type": error_type("model_busy"), "code": "model_busy"}})
            return
        except Exception as e:  # the stream has started: the error goes out as a frame
            yield _sse({"error": {"message": f"transcription failed: {e}", "type": "server_error"}})
            return
        yield _sse({"type": "transcript.text.done", "text": t.text, "usage": _usage(t)})
        yield b"data: [DONE]\n\n"
    finally:
        job.cancel()  # the client left: out of the queue, or stopped at the next window


@post("/v1/audio/translations", status_code=200, request_max_body_size=BODY_LIMIT)
async def translations(request: Request, app_state: AppState) -> Response:
    worker = transcriber(app_state)
    form = await read_form(request)
    fmt = _format(form, False)
    if form.text("stream") == "true":
        raise ApiError(400, "/v1/audio/translations does not stream; drop `stream`", code="invalid_parameter",
                       param="stream")
    t = await _transcribe(request, app_state, worker, form, "translate")
    if fmt == "json":
        return Response({"text": t.text})
    return audio_formats.render(fmt, t, "translate", _usage(t))


AUDIO_ROUTES = [transcriptions, translations]
