"""The management API's one response shape: {success, data, error: {code, message, details}}."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Response

from mlxcel.api.errors import ApiError
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


def fail(status: int, code: str, message: str, details: Any = None) -> Response:
    return Response({"success": False, "data": None,
                     "error": {"code": code, "message": message, "details": details}}, status_code=status)


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
    except ApiError as e:
        return fail(e.status, e.code or "error", e.message)
