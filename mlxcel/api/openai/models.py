"""GET /v1/models and /models: the served models in b10621's list shape.

Beside the chat model, a loaded embedding or reranking worker is listed under its own id.
/v1/models then lists the other generation checkpoints of the model store, which a request
may name to switch to (api/model_switch.py). A steering-locked server (the lock of
/api/models/<id>/lock, or SAEs attached) lists only the locked model; /models keeps b10621's
list of what is loaded.

Every data entry has b10621's keys: id, aliases, tags (--tags, on the -m model), object,
created, owned_by ("llamacpp" for what is loaded; a store checkpoint not loaded says its
repository owner, the /v1 contract's listing) and `meta`, the checkpoint facts of
model_meta.py plus the slot context (n_ctx, null when not loaded) and /props' model_ftype.
Next to `data`, the Ollama-style `models` block names the same entries with b10621's
placeholder values, except details.format, which says what the weights really are.
Each entry also carries mlxcel's `capabilities` (completion, embedding, rerank,
transcription) so a client can tell which id to send where; on a plain generation server the
array is empty and omitted.
"""

from __future__ import annotations

from pathlib import Path

from litestar import get

from mlxcel.api.llamacpp.capabilities import model_capabilities
from mlxcel.api.llamacpp.props import model_ftype
from mlxcel.api.model_switch import steering_locked, store_models
from mlxcel.api.model_names import accepts, not_found, worker_answers
from mlxcel.api.openai.model_meta import checkpoint_meta
from mlxcel.api.state import AppState


def _entry(model_id: str, created: int, owned_by: str, path: Path, *, aliases: list[str] = (),
           tags: list[str] = (), n_ctx: int | None = None, ftype: str | None = None) -> dict:
    meta = checkpoint_meta(path)
    meta.update(n_ctx=n_ctx, ftype=ftype)
    return {"id": model_id, "aliases": list(aliases), "tags": list(tags), "object": "model", "created": created,
            "owned_by": owned_by, "meta": meta}


def model_entries(app_state: AppState, store: bool = False) -> list[tuple[dict, str, object, Path]]:
    """(entry, kind, answers_to, checkpoint path) per served model; `store`: the switchable store
    models too."""
    out = []
    m = app_state.model
    if m is not None:
        entry = _entry(m.id, m.created, "llamacpp", m.info.path, aliases=m.aliases, tags=m.tags,
                       n_ctx=m.n_ctx, ftype=model_ftype(m))
        if m.info.context_length:  # what the backend loaded wins over config.json's spelling
            entry["meta"]["n_ctx_train"] = m.info.context_length
        out.append((entry, "chat", m.answers_to, Path(m.info.path)))
    for worker, kind in ((app_state.embedder, "embedding"), (app_state.reranker, "rerank"),
                         (app_state.transcriber, "transcription"), (app_state.speaker, "speech")):
        if worker is not None:
            entry = _entry(worker.id, worker.created, "llamacpp", worker.path, n_ctx=getattr(worker, "n_ctx", None))
            out.append((entry, kind, worker_answers(app_state, worker), Path(worker.path)))
    for entry, kind, _, _ in out:
        caps = model_capabilities(app_state, kind)
        if caps:
            entry["capabilities"] = caps
    if store and app_state.switch is not None and not steering_locked(app_state):
        loaded = Path(m.info.path).resolve() if m is not None else None
        for repo_id, path in store_models(app_state):
            if path.resolve() != loaded:
                entry = _entry(repo_id, int(path.stat().st_mtime), repo_id.split("/")[0], path)
                out.append((entry, "chat", lambda name, r=repo_id: name == r, path))
    return out


def _ollama(entry: dict, kind: str, path: Path) -> dict:
    """One entry of the Ollama-compatible block, b10621's placeholders kept."""
    return {"name": entry["id"], "model": entry["id"], "modified_at": "", "size": "", "digest": "",
            "type": "model", "description": "", "tags": [""],
            "capabilities": ["completion"] if kind == "chat" else [kind], "parameters": "",
            "details": {"parent_model": "", "format": "gguf" if path.suffix == ".gguf" else "safetensors", "family": "",
                        "families": [""], "parameter_size": "", "quantization_level": ""}}


def _listing(app_state: AppState, store: bool) -> dict:
    lock = app_state.steering_lock
    listed = [(entry, kind, path) for entry, kind, _, path in model_entries(app_state, store)
              if lock is None or entry["id"] == lock]
    return {"models": [_ollama(*one) for one in listed], "object": "list", "data": [entry for entry, _, _ in listed]}


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
    entries = model_entries(app_state, store=True)
    for entry, _kind, answers, _path in entries:
        if answers(name):
            return entry
    if entries and accepts(app_state, lambda _: False, name, entries[0][0]["id"]):
        return entries[0][0]  # --any-model-name: the first served model answers
    raise not_found(name)
