"""/api/models and /api/health/inference: what is on disk and loaded, the steering lock, and
which inference backend serves.

Load and unload go through the model switching of the /v1 routes (api/model_switch.py): a
load of a store checkpoint unloads the served model first (running requests finish within
the graceful timeout; everything meanwhile gets 503 `model_busy`) and answers the refusals
of a switch (`insufficient_memory`, `unsupported_quantization`, `model_load_failed`) in this
envelope; an unload leaves no generation model, so /v1 requests answer 503 `model_not_loaded`
until a load (or a /v1 request naming a store model, which loads it). A server with no
generation model to switch (--embeddings / --reranking) refuses both with 501. Locking pins
the loaded model for steering: while locked, /v1/models lists only that model and load and
unload are refused (409 `model_locked`). A model is addressed by its id, an alias or its
path, so the route takes the whole rest of the path and reads the action (load, unload,
lock, unlock) off its end.
"""

from __future__ import annotations

from pathlib import Path

from litestar import Response, get, post

from mlxcel.api.errors import ApiError
from mlxcel.api.management.envelope import Refusal, fail, ok, run
from mlxcel.api.state import AppState

BASE = "/api/models"
ACTIONS = ("load", "unload", "lock", "unlock")


def _on_disk(root: Path | None) -> list[tuple[str, Path]]:
    """Checkpoint directories (a config.json) one or two levels under the store root."""
    if root is None or not root.is_dir():
        return []
    found = []
    for config in sorted([*root.glob("*/config.json"), *root.glob("*/*/config.json")]):
        found.append((str(config.parent.relative_to(root)), config.parent))
    return found


def _loaded_entry(state: AppState) -> dict | None:
    m = state.model
    if m is None:
        return None
    return {"id": m.id, "aliases": m.aliases, "path": str(m.info.path), "status": "loaded",
            "locked": state.steering_lock == m.id, "backend": m.info.backend, "device": m.info.device,
            "dtype": m.info.dtype, "quantization": m.info.quantization, "model_type": m.info.model_type,
            "context_length": m.n_ctx}


def list_all(state: AppState) -> list[dict]:
    loaded = _loaded_entry(state)
    out = [loaded] if loaded else []
    here = {loaded["path"]} if loaded else set()
    for worker in (state.embedder, state.reranker):
        if worker is not None:
            out.append({"id": worker.id, "path": str(worker.path), "status": "loaded", "locked": False,
                        "role": "embedding" if worker is state.embedder else "rerank"})
            here.add(str(worker.path))
    out += [{"id": name, "path": str(path), "status": "ready", "locked": False}
            for name, path in _on_disk(state.store_root) if str(path) not in here]
    return out


def _find(state: AppState, ref: str) -> dict:
    m = state.model
    if m is not None and m.answers_to(ref):
        return _loaded_entry(state)
    for entry in list_all(state):
        if ref in (entry["id"], entry["path"]):
            return entry
    raise Refusal(404, "model_not_found", f"no model {ref!r} is loaded or in the model store")


@get(BASE)
async def list_models(app_state: AppState) -> Response:
    return run(lambda: list_all(app_state))


@get(f"{BASE}/{{ref:path}}")
async def get_model(ref: str, app_state: AppState) -> Response:
    return run(lambda: _find(app_state, ref.strip("/")))


async def _load_or_unload(state: AppState, entry: dict, action: str, loaded: bool) -> dict:
    from mlxcel.api.model_switch import load_model, store_checkpoint, unload_model

    if action == "load" and loaded:
        return entry
    if state.switch is None:
        raise Refusal(501, f"model_{action}_unsupported", "this server runs no generation model to switch "
                      "(--embeddings / --reranking mode); restart it with another -m")
    if action == "unload":
        if not loaded:
            raise Refusal(409, "model_not_loaded", f"model {entry['id']!r} is not loaded")
        unloaded = {**entry, "status": "ready", "locked": False}
        await unload_model(state, state.model)
        return unloaded
    path = store_checkpoint(state, entry["id"])
    if path is None or entry.get("role") is not None:
        raise Refusal(404, "model_not_found", f"{entry['id']!r} is not a generation checkpoint of the model store")
    await load_model(state, entry["id"], path)
    return _loaded_entry(state)


@post(f"{BASE}/{{ref:path}}")
async def model_action(ref: str, app_state: AppState) -> Response:
    name, _, action = ref.strip("/").rpartition("/")
    if action in ("load", "unload") and name:
        try:
            entry = _find(app_state, name)
            loaded = entry["status"] == "loaded" and entry.get("role") is None
            data = await _load_or_unload(app_state, entry, action, loaded)
        except Refusal as e:
            return fail(e.status, e.code, e.message, e.details)
        except ApiError as e:  # a switch's refusals (model_busy, insufficient_memory, model_load_failed, ...)
            return fail(e.status, e.code or "error", e.message, headers=e.headers)  # model_busy's Retry-After
        return ok(data)

    def go():
        if action not in ACTIONS or not name:
            raise Refusal(404, "not_found", f"POST /api/models/<model>/<action>: action must be one of "
                          f"{', '.join(ACTIONS)}")
        entry = _find(app_state, name)
        loaded = entry["status"] == "loaded" and entry.get("role") is None
        if not loaded:
            raise Refusal(409, "model_not_loaded", f"model {entry['id']!r} is not loaded; only the loaded model can be "
                          "locked for steering")
        if action == "lock":
            if app_state.steering_lock not in (None, entry["id"]):
                raise Refusal(409, "model_locked", f"model {app_state.steering_lock!r} is locked; unlock it first")
            app_state.steering_lock = entry["id"]
        else:
            app_state.steering_lock = None
        return _loaded_entry(app_state)

    return run(go)


@get("/api/health/inference")
async def health_inference(app_state: AppState) -> Response:
    def go():
        m = app_state.model
        if m is None:
            unloaded = app_state.switch.unloaded if app_state.switch is not None else None
            raise Refusal(503, "model_not_loaded", app_state.load_error or (
                f"{unloaded!r} was unloaded; no model is loaded" if unloaded else "the model is still loading"))
        return {"backend": "continuous_batching", "engine": f"mlxcel-{m.info.backend}",
                "inference_backend": m.info.backend, "device": m.info.device, "dtype": m.info.dtype,
                "model": m.id, "locked_model": app_state.steering_lock, "parallel": m.engine.parallel,
                "per_request_steering": "in_batch",
                "saes_attached": len(m.steering.attached) if m.steering else 0}

    return run(go)


ROUTES = [list_models, get_model, model_action, health_inference]
