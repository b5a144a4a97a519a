"""GET / POST /lora-adapters and the per-request `lora` field (models/lora.py serves the terms).

GET lists the adapters in b10621's entry shape (id, path, scale, task_name, prompt_prefix)
with their live server-default scales. POST takes a JSON array of {id, scale} and replaces
those defaults by b10621's rule: listed ids take their scale, unlisted ones drop to 0.0,
unknown ids are ignored; it answers {"success": true}. The request field resolves the same
way for that request only. Either way a request's scales are fixed when the engine accepts
it, so a POST never changes a generation already running.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, get, post

from mlxcel.api.body import decode_json
from mlxcel.api.errors import ApiError
from mlxcel.api.openai.generation import served_model
from mlxcel.api.state import AppState
from mlxcel.models.lora import LoraError, parse_request
from mlxcel.runtime.served import ServedModel


def request_lora(model: ServedModel, value: Any) -> tuple[tuple[float, ...] | None, tuple]:
    """A request's `lora` value -> (its scale vector, or None for the server's scales; the
    (id, scale) pairs it named, as generation_settings reports them)."""
    if value is None:
        return None, ()
    try:
        asked = parse_request(value)
    except LoraError as e:
        raise ApiError(400, f"Field 'lora': {e}", code="invalid_parameter", param="lora") from None
    scales = model.lora.resolve(asked) if model.lora is not None else None
    return scales, tuple(sorted(asked.items()))


@get("/lora-adapters", sync_to_thread=False)
def get_lora_adapters(app_state: AppState) -> list[dict[str, Any]]:
    model = served_model(app_state, None)
    return model.lora.entries() if model.lora is not None else []


@post("/lora-adapters", status_code=200)
async def post_lora_adapters(request: Request, app_state: AppState) -> dict[str, bool]:
    body = decode_json(await request.body())
    if not isinstance(body, list):
        raise ApiError(400, "Request body must be an array", code="invalid_request")
    model = served_model(app_state, None)
    if model.lora is not None:
        model.lora.set(model.lora.resolve(parse_request(body)))
    return {"success": True}


LORA_ROUTES = [get_lora_adapters, post_lora_adapters]
