"""POST /v1/audio/speech in OpenAI's shape, served by the text-to-speech worker (workers/speech.py).

Fields: `input` (1 to 4,096 characters, OpenAI's limit), `voice` (a voice pack of the checkpoint,
by name, or `{"id": name}`), `response_format` (api/openai/speech_formats.py; default mp3),
`speed` (0.25 to 4.0, default 1), `stream_format` (`audio`, the default: the encoded file as a
chunked body, each chunk sent as it is decoded where the format allows; `sse`:
`speech.audio.delta` events carrying base64 pieces of the same bytes, then `speech.audio.done`
with usage), `model` (the worker's name, else 404). `instructions` cannot be honoured (Kokoro takes
no style prompt), so a non-empty one is refused with 400 `field_not_honoured`; any other field is
reported in X-miLLM-Ignored-Fields, or refused under X-miLLM-Strict. Every refusal comes before
the response starts; a full queue is a 503 `queue_full`, checked last, so a request that could
never be served is a 400. A client that goes away takes its job out of the queue, or stops the
worker at its next chunk.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from litestar import Request, Response, post
from litestar.response import Stream

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError, error_type, queue_closed_error, queue_full_error
from mlxcel.api.model_names import check_worker
from mlxcel.api.openai import speech_formats
from mlxcel.api.openai.fields import settle_unused, strict_mode
from mlxcel.api.side_workers import check_queue, worker_queue
from mlxcel.api.state import AppState
from mlxcel.config.limits import echo
from mlxcel.workers.queue import QueueClosed, QueueFull
from mlxcel.workers.speech import MAX_SPEED, MIN_SPEED, SPEECH, Speech, SpeechError

log = logging.getLogger("mlxcel.api")

PATH = "/v1/audio/speech"
MAX_INPUT_CHARS = 4096
FIELDS = ("model", "input", "voice", "response_format", "speed", "instructions", "stream_format")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class SpeechRequest:
    text: str
    voice: str
    fmt: str
    speed: float
    sse: bool


def speaker(state: AppState):
    """The speech worker, or the refusal a server without one gives."""
    if state.speaker is not None:
        return state.speaker
    if state.plan is not None and any(s.kind == SPEECH for s in state.plan.sides):
        if state.load_error:
            raise ApiError(503, f"the Kokoro model failed to load: {state.load_error}", type="unavailable_error")
        raise ApiError(503, "Loading model", code="model_not_loaded", type="unavailable_error")
    raise ApiError(501, "This server does not support speech: start it with -m naming a Kokoro (text-to-speech) "
                   "checkpoint", code="not_supported", type="not_supported_error")


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_parameter", param=param)


def _voice(value: Any) -> str:
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if not isinstance(value, str) or not value:
        raise _bad("'voice' is required: the name of one of the model's voices", "voice")
    return value


def _speed(value: Any) -> float:
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_SPEED <= value <= MAX_SPEED:
        raise _bad(f"'speed' must be a number from {MIN_SPEED} to {MAX_SPEED}, got {echo(repr(value))}", "speed")
    return float(value)


def parse(body: dict[str, Any]) -> SpeechRequest:
    """The request's fields, each checked; the first problem is a 400 naming its field."""
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise _bad("'input' is required: the text to speak, a non-empty string", "input")
    if len(text) > MAX_INPUT_CHARS:
        raise _bad(f"'input' is {len(text)} characters long; at most {MAX_INPUT_CHARS} are accepted", "input")
    fmt = "mp3" if body.get("response_format") is None else body["response_format"]
    served = speech_formats.served()
    if fmt not in served:
        what = "is not served by this server" if fmt in speech_formats.FORMATS else "is not a response format"
        raise _bad(f"response_format {echo(repr(fmt))} {what}; use one of {', '.join(served)}", "response_format")
    stream_format = "audio" if body.get("stream_format") is None else body["stream_format"]
    if stream_format not in ("audio", "sse"):
        raise _bad(f"stream_format {echo(repr(stream_format))} is not supported; use audio or sse", "stream_format")
    if body.get("instructions"):
        raise ApiError(400, "'instructions' is not honoured on /v1/audio/speech by this server: Kokoro takes no "
                       "style prompt; drop it (the voice and speed fields are honoured)", code="field_not_honoured",
                       param="instructions")
    return SpeechRequest(text, _voice(body.get("voice")), fmt, _speed(body.get("speed")), stream_format == "sse")


@post(PATH, status_code=200)
async def speech(request: Request, app_state: AppState) -> Response:
    strict = strict_mode(request.headers)
    worker = speaker(app_state)
    body = await read_json_object(request)
    req = parse(body)
    headers = settle_unused([k for k, v in body.items() if k not in FIELDS and v is not None], strict, PATH)
    check_worker(app_state, worker, body.get("model"))
    try:
        worker.check(req.voice, req.speed)
    except SpeechError as e:
        raise _bad(str(e), e.param) from None
    queue = worker_queue(app_state, SPEECH)
    check_queue(queue)
    job, chunks = _start(queue, worker, req)
    await asyncio.sleep(0)  # the job takes its place in the queue now: a full one is a 503 before the body starts
    if job.done() and isinstance(e := job.exception(), QueueFull):
        raise queue_full_error(e)
    if job.done() and isinstance(e, QueueClosed):
        raise queue_closed_error(e)
    pieces = _pieces(job, chunks)
    if req.sse:
        return Stream(_sse(pieces, req.fmt, worker.sample_rate), media_type="text/event-stream",
                      headers={**headers, **SSE_HEADERS})
    return Stream(_audio(pieces, req.fmt, worker.sample_rate), media_type=speech_formats.MEDIA_TYPES[req.fmt],
                  headers=headers)


def _start(queue, worker, req: SpeechRequest) -> tuple[asyncio.Future, asyncio.Queue]:
    """The job, queued on the worker: each chunk's audio arrives in `chunks` as it is decoded, then None."""
    loop, chunks = asyncio.get_running_loop(), asyncio.Queue()
    stop = threading.Event()
    job = asyncio.ensure_future(queue.run(lambda: worker.start(
        req.text, req.voice, req.speed, on_audio=lambda a: loop.call_soon_threadsafe(chunks.put_nowait, a),
        cancelled=stop.is_set).result(), stop.set))
    job.add_done_callback(lambda _: chunks.put_nowait(None))
    return job, chunks


async def _pieces(job: asyncio.Future, chunks: asyncio.Queue) -> AsyncIterator[np.ndarray | Speech]:
    """Each chunk's audio, then the worker's Speech accounting; a client that goes away takes the
    job out of the queue, or stops the worker at its next chunk."""
    try:
        while (audio := await chunks.get()) is not None:
            yield audio
        yield job.result()
    finally:
        job.cancel()


async def _audio(pieces, fmt: str, rate: int):
    enc = speech_formats.encoder(fmt, rate)
    try:
        async for piece in pieces:
            if not isinstance(piece, Speech) and (data := enc.feed(piece)):
                yield data
    except Exception as e:  # the body has started: a short file is all the client can be told
        log.error("speech synthesis failed mid-stream: %s", e)
        return
    finally:
        await pieces.aclose()  # a client gone between chunks: the job leaves the queue now, not at GC
    if data := enc.finish():
        yield data


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _sse(pieces, fmt: str, rate: int):
    enc = speech_formats.encoder(fmt, rate)
    delta = lambda data: _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
    try:
        async for piece in pieces:
            if isinstance(piece, Speech):
                if data := enc.finish():
                    yield delta(data)
                usage = {"input_tokens": piece.input_tokens, "output_tokens": piece.output_tokens,
                         "total_tokens": piece.input_tokens + piece.output_tokens}
                yield _event({"type": "speech.audio.done", "usage": usage})
            elif data := enc.feed(piece):
                yield delta(data)
    except QueueClosed as e:  # the shutdown drain ran out
        yield _event({"type": "error", "error": {"message": str(e), "type": error_type("model_busy"),
                                                 "code": "model_busy"}})
    except Exception as e:  # the stream has started: the error goes out as an event
        yield _event({"type": "error", "error": {"message": f"speech synthesis failed: {e}", "type": "server_error"}})
    finally:
        await pieces.aclose()


SPEECH_ROUTES = [speech]
