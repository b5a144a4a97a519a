"""GET /v1/models and /models: the served models in OpenAI's list shape.

Beside the chat model, a loaded embedding or reranking worker is listed under its own id.
Each entry carries `capabilities` (completion, embedding, rerank, transcription) so a client can tell which id
to send where; on a plain generation server the array is empty and omitted, keeping the OpenAI
object shape.
"""

from __future__ import annotations

from litestar import get

from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.capabilities import model_capabilities
from mlxcel.api.state import AppState


def _entries(app_state: AppState) -> list[tuple[dict, object]]:
    """(entry, answers_to) per served model."""
    out = []
    m = app_state.model
    if m is not None:
        entry = {"id": m.id, "object": "model", "created": m.created, "owned_by": "llamacpp", "aliases": m.aliases}
        out.append((entry, "chat", m.answers_to))
    for worker, kind in ((app_state.embedder, "embedding"), (app_state.reranker, "rerank"),
                         (app_state.transcriber, "transcription")):
        if worker is not None:
            entry = {"id": worker.id, "object": "model", "created": worker.created, "owned_by": "llamacpp", "aliases": []}
            out.append((entry, kind, lambda name, w=worker: name in (w.id, str(w.path))))
    result = []
    for entry, kind, answers in out:
        caps = model_capabilities(app_state, kind)
        if caps:
            entry["capabilities"] = caps
        result.append((entry, answers))
    return result


@get(["/v1/models", "/models"])
async def list_models(app_state: AppState) -> dict:
    """A steering-locked server lists only the locked model (/api/models/<id>/lock)."""
    lock = app_state.steering_lock
    return {"object": "list", "data": [entry for entry, _ in _entries(app_state) if lock is None or entry["id"] == lock]}


@get("/v1/models/{model_id:path}")
async def get_model(app_state: AppState, model_id: str) -> dict:
    name = model_id.lstrip("/")
    for entry, answers in _entries(app_state):
        if answers(name):
            return entry
    raise ApiError(404, f"The model '{name}' does not exist", code="model_not_found", param="model")
