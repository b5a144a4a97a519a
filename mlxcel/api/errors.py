"""Errors in each route family's own format.

`/v1/*` answers OpenAI's `{"error": {message, type, param, code}}` so SDK exception
classes map; `/api/*` the management envelope `{success, data, error}`; native llama-server routes answer b10621's `{"error": {code, message, type}}`.
Which one is decided by the request path, so a handler raises one `ApiError` and the
exception handler renders it for its caller. Layers below the API raise their own refusal types
(steering's `RequestRefused`), which render the same way.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException

from mlxcel.steering.requests import RequestRefused
from mlxcel.config.limits import ERROR_MESSAGE_CHARS, echo
from mlxcel.workers.queue import QueueClosed, QueueFull

log = logging.getLogger("mlxcel.api")

# b10621's error types by status, used for the native envelope.
_NATIVE_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error",
}


# The OpenAI `type` of each /v1 error code, from the contract's error table. Non-streamed errors
# (ApiError's default) and mid-stream SSE error frames both read it; a code not listed takes
# its type from the status.
CODE_TYPES = {
    "model_not_loaded": "server_error", "model_not_found": "invalid_request_error",
    "context_length_exceeded": "invalid_request_error", "invalid_feature_index": "invalid_request_error",
    "queue_full": "server_error", "field_not_honoured": "invalid_request_error",
    "unused_fields_refused": "invalid_request_error", "response_format_unsupported": "invalid_request_error",
    "no_chat_template": "invalid_request_error", "constrained_output_invalid": "server_error",
    "invalid_scoring_request": "invalid_request_error", "profile_not_found": "invalid_request_error",
    "invalid_parameter": "invalid_request_error", "unsupported_quantization": "invalid_request_error",
    "insufficient_memory": "invalid_request_error", "model_load_failed": "server_error",
    "model_busy": "server_error", "server_error": "server_error",
    "trigger_pattern_too_slow": "invalid_request_error",
}


def error_type(code: str | None, status: int = 500) -> str:
    """The OpenAI error type for `code`, or by status when the table does not name it."""
    return CODE_TYPES.get(code or "") or ("invalid_request_error" if status < 500 else "server_error")


# Refusals that clear by themselves (a queue drains, a model switch ends): the seconds a 503 with
# one of these codes tells the client to wait (`Retry-After`) before trying again.
RETRY_AFTER_S = {"queue_full": 1, "model_busy": 1}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None,
                 type: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = echo(message, ERROR_MESSAGE_CHARS)  # whatever client text it quotes, a bounded answer
        param = None if param is None else echo(param)  # a field name the client chose
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or error_type(code, status)
        self.headers = headers or {}
        if status == 503 and code in RETRY_AFTER_S:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S[code]))


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/chat/completions",)


def error_body(path: str, err: ApiError) -> dict[str, Any]:
    if path.startswith("/v1/messages"):  # Anthropic's envelope, which its SDK parses
        return {"type": "error", "error": {"type": err.type, "message": err.message}}
    if is_openai_path(path):
        return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    if path.startswith("/api/"):  # the management envelope (api/management/envelope.py)
        return {"success": False, "data": None,
                "error": {"code": err.code or err.type, "message": err.message, "details": None}}
    return {"error": {"code": err.status, "message": err.message, "type": native_type(err)}}


def native_type(err: ApiError) -> str:
    """The error's type in b10621's native envelope: by status where it names one."""
    return _NATIVE_TYPES.get(err.status) or err.type


def api_error_handler(request: Request, exc: ApiError) -> Response:
    return Response(error_body(request.url.path, exc), status_code=exc.status, headers=exc.headers)


def refusal_handler(request: Request, exc: RequestRefused) -> Response:
    """A domain layer's refusal of a request field, answered as the ApiError it stands for."""
    return api_error_handler(request, ApiError(exc.status, exc.message, code=exc.code, param=exc.param))


def http_exception_handler(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "error"
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    message = exc.detail or phrase
    if status == 404 and message == phrase:  # no route matched: b10621's wording for that case
        message = "File Not Found"
    err = ApiError(status, message, code=code,
                   type="invalid_request_error" if status < 500 else "server_error")
    return Response(error_body(request.url.path, err), status_code=status, headers=exc.headers or None)


def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    err = ApiError(500, "internal server error", code="internal_error", type="server_error")
    return Response(error_body(request.url.path, err), status_code=500)


# The one map from an engine condition to an HTTP status, the same on every surface; each
# route's envelope then renders it. A code not named keeps the status it came with.
ENGINE_STATUS = {"model_busy": 503, "insufficient_memory": 503, "queue_full": 503, "context_length_exceeded": 400,
                 "trigger_pattern_too_slow": 400}


def engine_error(message: str, code: str | None, status: int = 500) -> ApiError:
    """An engine refusal (at submission: its own status) or a request-ending error event
    (no status: 500) as the ApiError every surface raises for it."""
    code = code or "server_error"
    return ApiError(ENGINE_STATUS.get(code, status), message, code=code)


def queue_full_error(e: QueueFull) -> ApiError:
    """A side worker's full queue: the same 503 `queue_full` as the engine's."""
    return ApiError(503, str(e), code="queue_full")


def queue_closed_error(e: QueueClosed) -> ApiError:
    """A side worker's job ended by the shutdown drain: the engine's shutdown error (503 `model_busy`)."""
    return ApiError(503, str(e), code="model_busy")
