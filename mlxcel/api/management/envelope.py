"""The management API's one response shape, {success, data, error: {code, message, details}},
and what every management route shares: the JSON body, the served model's SAEs, the store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Request, Response

from mlxcel.api.body import decode_json
from mlxcel.api.errors import ApiError
from mlxcel.config.limits import ERROR_MESSAGE_CHARS, echo
from mlxcel.steering.circuits import CircuitError
from mlxcel.steering.intensity import IntensityError
from mlxcel.steering.manager import SteeringError
from mlxcel.steering.sae import SAEError
from mlxcel.steering.store import ProfileExists


class Refusal(Exception):
    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details


def ok(data: Any, status: int = 200) -> Response:
    return Response({"success": True, "data": data, "error": None}, status_code=status)


def fail(status: int, code: str, message: str, details: Any = None,
         headers: dict[str, str] | None = None) -> Response:
    return Response({"success": False, "data": None,
                     "error": {"code": code, "message": echo(message, ERROR_MESSAGE_CHARS), "details": details}},
                    status_code=status,
                    headers=headers)


def run(fn: Callable[[], Any], status: int = 200) -> Response:
    """Call fn; its value is the data, its known errors become the envelope's error."""
    try:
        return ok(fn(), status)
    except Refusal as e:
        return fail(e.status, e.code, e.message, e.details)
    except SteeringError as e:
        return fail(e.status, e.code, e.message)
    except SAEError as e:
        return fail(404 if e.code == "sae_not_found" else 400, e.code, str(e))
    except ProfileExists as e:
        return fail(409, "profile_exists", str(e))
    except IntensityError as e:
        return fail(400, "invalid_parameter", str(e))
    except CircuitError as e:
        return fail(400, "invalid_circuit", str(e))
    except ApiError as e:
        return fail(e.status, e.code or "error", e.message)


async def read_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    # ApiError, not Refusal: handlers read the body outside `run`, and the app's handler renders
    # an ApiError in this same envelope
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_request")
    return body


def need_manager(state):
    if state.model is None or state.model.steering is None:
        raise Refusal(503, "model_not_loaded", "no model is loaded")
    return state.model.steering


def need_store(state):
    if state.steering_store is None:
        raise Refusal(503, "state_unavailable", "the server has no state directory open")
    return state.steering_store


def values_of(raw: Any) -> dict[int, float]:
    if not isinstance(raw, dict):
        raise Refusal(400, "invalid_parameter", "steering values must be an object {feature index: strength}")
    out: dict[int, float] = {}
    for k, v in raw.items():
        try:
            i = int(k)
        except ValueError:
            raise Refusal(400, "invalid_feature_index", f"feature index {k!r} is not an integer") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Refusal(400, "invalid_parameter", f"strength of feature {k} must be a number")
        out[i] = float(v)
    return out
