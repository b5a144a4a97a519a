"""Reading a JSON body into a typed request, with errors in the route's format."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from litestar import Request

from mlxcel.api.errors import ApiError

T = TypeVar("T")


async def read_json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_request")
    return body


def convert(body: dict[str, Any], cls: type[T]) -> T:
    try:
        return msgspec.convert(body, cls, strict=True)
    except msgspec.ValidationError as e:
        param = None
        msg = str(e)
        if "at `$." in msg:
            param = msg.split("at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
        raise ApiError(400, f"invalid request: {msg}", code="invalid_parameter", param=param) from None
