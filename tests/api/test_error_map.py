"""The one engine-error map (api/errors.py): a condition's status is the same on every
surface, at submission or ending a request, and each route family renders it in its own
envelope."""

from __future__ import annotations

import json

from mlxcel.api.errors import ApiError, engine_error, error_body
from mlxcel.api.llamacpp.completion import NativeEncoder
from mlxcel.engine.types import TokenEvent

PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages", "native": "/completion"}


def test_a_condition_has_one_status_at_submission_and_ending_a_request():
    for code, status in (("queue_full", 503), ("model_busy", 503), ("insufficient_memory", 503),
                         ("context_length_exceeded", 400)):
        assert engine_error("boom", code).status == status  # an error event carries no status
        assert engine_error("boom", code, 400 if status == 503 else 500).status == status
    assert engine_error("boom", "invalid_request", 400).status == 400  # unnamed: the engine's own status
    err = engine_error("boom", None)  # an unnamed failure ending a request
    assert (err.status, err.code, err.type) == (500, "server_error", "server_error")


def test_each_family_renders_the_same_status_in_its_envelope():
    err = engine_error("busy", "model_busy")
    assert error_body(PATHS["openai"], err) == {"error": {"message": "busy", "type": "server_error", "param": None,
                                                          "code": "model_busy"}}
    assert error_body(PATHS["anthropic"], err) == {"type": "error", "error": {"type": "server_error",
                                                                             "message": "busy"}}
    assert error_body(PATHS["native"], err) == {"error": {"code": 503, "message": "busy", "type": "unavailable_error"}}
    assert error_body(PATHS["native"], ApiError(500, "x", code="server_error"))["error"]["type"] == "server_error"


def test_a_native_stream_error_frame_carries_the_mapped_status():
    encoder = NativeEncoder(model=None, nreq=None, greqs=[])
    for code, status, kind in (("model_busy", 503, "unavailable_error"), (None, 500, "server_error"),
                               ("constrained_output_invalid", 500, "server_error")):
        frame = encoder.error(TokenEvent(error="boom", error_code=code))
        assert json.loads(frame[6:]) == {"error": {"code": status, "message": "boom", "type": kind}}


def test_refusals_that_clear_by_themselves_say_when_to_retry():
    """queue_full and model_busy (engine, model switch or a side worker's queue) carry Retry-After;
    a 503 that waiting will not cure does not."""
    from mlxcel.api.errors import queue_full_error
    from mlxcel.api.model_switch import busy_error
    from mlxcel.runtime.host import HostBusy
    from mlxcel.workers.queue import QueueFull

    for err in (engine_error("full", "queue_full", 503), engine_error("busy", "model_busy"),
                queue_full_error(QueueFull("transcription", 1)), busy_error(HostBusy("loading", "m", None))):
        assert err.status == 503 and err.headers == {"Retry-After": "1"}, err.code
    assert "Retry-After" not in engine_error("oom", "insufficient_memory").headers
    assert ApiError(503, "x", code="queue_full", headers={"Retry-After": "5"}).headers == {"Retry-After": "5"}
