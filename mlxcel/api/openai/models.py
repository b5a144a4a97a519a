"""GET /v1/models and /models: the served models in OpenAI's list shape.

Beside the chat model, a loaded embedding or reranking worker is listed under its own id.
/v1/models then lists the other generation checkpoints of the model store, which a request
may name to switch to (api/model_switch.py). A steering-locked server (the lock of
/api/models/<id>/lock, or SAEs attached) lists only the locked model; /models keeps b10621's
list of what is loaded.
Each entry carries `capabilities` (completion, embedding, rerank, transcription) so a client can tell which id
to send where; on a plain generation server the array is empty and omitted, keeping the OpenAI
object shape.
"""

from __future__ import annotations

from pathlib import Path

from litestar import get

from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.capabilities import model_capabilities
from mlxcel.api.model_switch import steering_locked, store_models
from mlxcel.api.state import AppState


def _entries(app_state: AppState, store: bool = False) -> list[tuple[dict, object]]:
    """(entry, answers_to) per served model; `store`: the switchable store models too."""
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
    if store and app_state.switch is not None and not steering_locked(app_state):
        loaded = Path(m.info.path).resolve() if m is not None else None
        for repo_id, path in store_models(app_state):
            if path.resolve() != loaded:
                entry = {"id": repo_id, "object": "model", "created": int(path.stat().st_mtime),
                         "owned_by": repo_id.split("/")[0], "aliases": []}
                result.append((entry, lambda name, r=repo_id: name == r))
    return result


def _listing(app_state: AppState, store: bool) -> dict:
    lock = app_state.steering_lock
    return {"object": "list",
            "data": [entry for entry, _ in _entries(app_state, store) if lock is None or entry["id"] == lock]}


@get("/models")
async def list_loaded_models(app_state: AppState) -> dict:
    return _listing(app_state, store=False)


@get("/v1/models")
async def list_models(app_state: AppState) -> dict:
    """A steering-locked server lists only the locked model (/api/models/<id>/lock)."""
    return _listing(app_state, store=True)


@get("/v1/models/{model_id:path}")
async def get_model(app_state: AppState, model_id: str) -> dict:
    name = model_id.lstrip("/")
    for entry, answers in _entries(app_state, store=True):
        if answers(name):
            return entry
    raise ApiError(404, f"The model '{name}' does not exist", code="model_not_found", param="model")
