"""GET /v1/models and /models: the served model in OpenAI's list shape."""

from __future__ import annotations

from litestar import get

from mlxcel.api.errors import ApiError
from mlxcel.api.state import AppState


def _entry(app_state: AppState) -> dict:
    m = app_state.model
    return {"id": m.id, "object": "model", "created": m.created, "owned_by": "llamacpp",
            "aliases": m.aliases}


@get(["/v1/models", "/models"])
async def list_models(app_state: AppState) -> dict:
    data = [_entry(app_state)] if app_state.model else []
    return {"object": "list", "data": data}


@get("/v1/models/{model_id:path}")
async def get_model(app_state: AppState, model_id: str) -> dict:
    name = model_id.lstrip("/")
    if app_state.model is None or not app_state.model.answers_to(name):
        raise ApiError(404, f"The model '{name}' does not exist", code="model_not_found", param="model")
    return _entry(app_state)
