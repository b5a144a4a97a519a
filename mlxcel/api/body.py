"""Reading a JSON body into a typed request, with errors in the route's format."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from litestar import Request

from mlxcel.api.errors import ApiError
from mlxcel.config.limits import MAX_CHOICES, MAX_JSON_DEPTH

T = TypeVar("T")

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests deeper than `limit`: strings dropped, then innermost bracket
    pairs peeled one level a round (all in C, so a large flat body costs a few passes)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"").replace(b"{}", b"")
    return bool(brackets)


def decode_json(raw: bytes) -> Any:
    """The body's JSON value; malformed or too deeply nested text is a 400, never a recursion error."""
    if too_deep(raw):
        try:
            msgspec.json.decode(raw)
        except msgspec.DecodeError as e:  # unbalanced: report it as the syntax error it is
            raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            pass
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None


def check_count(body: dict[str, Any], field: str, limit: int, what: str) -> None:
    """Refuse an array field holding more than `limit` rows. A flat array of token ids is one
    prompt, not many, so only arrays without integers count as rows."""
    value = body.get(field)
    if isinstance(value, list) and len(value) > limit and not any(isinstance(v, int) for v in value):
        raise ApiError(400, f"'{field}' holds {len(value)} {what}; at most {limit} are accepted per request",
                       code="invalid_parameter", param=field)


def _check_choices(body: dict[str, Any]) -> None:
    for field in ("n", "n_cmpl"):
        n = body.get(field)
        if isinstance(n, int) and not isinstance(n, bool) and n > MAX_CHOICES:
            raise ApiError(400, f"'{field}' is {n}; at most {MAX_CHOICES} choices are accepted per request",
                           code="invalid_parameter", param=field)


async def read_json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object, its depth and choice count (`n`) checked before any work."""
    body = decode_json(await request.body())
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_request")
    _check_choices(body)
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
