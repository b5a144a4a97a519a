"""Model switching: a /v1 request naming another model of the store loads it first.

The server holds one generation model. A request that names a different checkpoint of the
model store (never a download, never a filesystem path) is checked while the loaded model
still serves (`runtime.capacity.check_loadable`: not a checkpoint, a quantization the backend cannot
run, weights over the memory budget), and a refusal answers with its own status and the
loaded model stays. Otherwise the switch runs in two phases, during both of which every
request is refused with 503 `model_busy` (retry once it finishes) rather than starting a
second switch or running on a half-moved model:

1. unloading: the requests already running finish first, for up to
   --graceful-unload-timeout seconds; whatever is left then ends with an error event; the
   engine stops and the weights are dropped;
2. loading: the named checkpoint loads through the composition root (`runtime.load`), and the
   request that asked runs on it. A load that fails after the unload answers 500
   `model_load_failed`; the previous model is then loaded back so the server keeps serving.

While the server is locked to the loaded model for steering (/api/models/<id>/lock, or SAEs
attached), /v1/models lists only that model and a request naming another one gets 404.

The phases, the drain, the restore and the memory clean-up are the model host's
(`runtime.host.ModelHost`, `state.host`); this module decides what a request's model name asks
for and answers the host's errors (`HostBusy`, `LoadFailed`, `LoadRefused`) with the statuses
and codes above.

The management API drives the same machinery (`load_model`, `unload_model`): a load is a
switch (or, with no model loaded, phase 2 alone), an unload is phase 1 alone and leaves the
server with no generation model, so a request that names none answers 503 `model_not_loaded`
until a load, while a /v1 request naming a store model loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxcel.api.errors import ApiError
from mlxcel.api.model_names import accepts, not_found
from mlxcel.api.state import AppState
from mlxcel.config.limits import echo
from mlxcel.models.registry import UnsupportedModelType, family_for
from mlxcel.runtime.capacity import LoadRefused
from mlxcel.runtime.host import HostBusy, LoadFailed, ModelHost
from mlxcel.runtime.served import ServedModel
from mlxcel.store.repo_id import InvalidRepoId, expand, parse_repo_id
from mlxcel.store.resolve import refusal
from mlxcel.store.store import list_models


def busy_error(e: HostBusy) -> ApiError:
    return ApiError(503, e.message, code="model_busy", type="server_error")


def check_not_busy(state: AppState) -> None:
    host = state.switch
    if host is not None:
        try:
            host.check_not_busy()
        except HostBusy as e:
            raise busy_error(e) from None


def store_checkpoint(state: AppState, name: str) -> Path | None:
    """The store directory `name` names (`owner/name`, or a bare name under the default
    organisation) when it holds a checkpoint; paths, URLs and GGUF spellings never resolve."""
    root = state.store_root
    if root is None or not name or refusal(name) is not None or name.startswith((".", "/", "~")):
        return None
    repo_id = expand(name, state.settings.source.default_org)
    try:
        owner, repo = parse_repo_id(repo_id)
    except InvalidRepoId:
        return None
    path = Path(root) / owner / repo
    if not (path / "config.json").is_file():
        return None
    return path


def steering_locked(state: AppState) -> bool:
    """The server is pinned to its model for steering: locked through /api/models/<id>/lock,
    or SAEs attached (a switch would drop them)."""
    model = state.model
    steering = model.steering if model is not None else None
    return state.steering_lock is not None or bool(steering is not None and steering.attached)


def store_models(state: AppState) -> list[tuple[str, Path]]:
    """The generation checkpoints of the store a request may switch to, by repository id."""
    if state.store_root is None:
        return []
    out = []
    for entry in list_models(Path(state.store_root)):
        try:
            family_for(json.loads((entry.path / "config.json").read_text()))
        except (OSError, ValueError, UnsupportedModelType):
            continue
        out.append((entry.repo_id, entry.path))
    return out


async def model_for(state: AppState, name: str | None) -> ServedModel:
    """The served model for a /v1 request naming `name`, switching to it when it is another
    checkpoint of the store."""
    from mlxcel.api.openai.generation import served_model

    check_not_busy(state)
    current = state.model
    if current is None and state.switch is not None and state.switch.unloaded and name:
        path = store_checkpoint(state, name)  # unloaded through the management API: load on demand
        if path is None:
            raise ApiError(404, f"The model '{echo(name)}' does not exist", code="model_not_found", param="model")
        return await _host_load(state.host, name, path)
    if current is None or current.answers_to(name) or state.switch is None:
        return served_model(state, name)
    served_model(state, None)  # side-worker-only servers refuse here
    path = store_checkpoint(state, name)
    if path is None or path.resolve() == Path(current.info.path).resolve():
        if path is not None or accepts(state, lambda _: False, name, current.id):  # another spelling, or any name
            return current
        raise not_found(name)
    if steering_locked(state):
        raise ApiError(404, f"The model '{echo(name)}' is not available: the server is locked to '{current.id}' for "
                       "steering (unlock it and detach its SAEs to switch models)",
                       code="model_not_found", param="model")
    del current  # the switch frees the loaded model's memory: no reference may outlive it here
    return await _host_load(state.host, name, path)


async def load_model(state: AppState, name: str, path: Path) -> ServedModel:
    """The management API's load of store checkpoint `path` (requested as `name`): the loaded
    model answers as it is; otherwise a switch, or a plain load when none is loaded."""
    check_not_busy(state)
    current = state.model
    if current is not None and (current.answers_to(name) or path.resolve() == Path(current.info.path).resolve()):
        return current
    if steering_locked(state):
        raise ApiError(409, f"the server is locked to '{current.id if current else state.steering_lock}' for "
                       "steering; unlock it and detach its SAEs to load another model", code="model_locked")
    if current is None and state.load_error is None and state.switch.unloaded is None:
        raise ApiError(503, "the model is still loading", code="model_not_loaded", type="server_error")
    del current  # as in model_for: the switch frees the loaded model's memory
    return await _host_load(state.host, name, path)


async def unload_model(state: AppState, current: ServedModel) -> None:
    """Phase 1 of a switch alone: running requests finish first (up to the graceful timeout),
    then the engine stops and the weights are dropped. No model is loaded afterwards."""
    if steering_locked(state):
        raise ApiError(409, f"'{current.id}' is locked for steering; unlock it and detach its SAEs to unload it",
                       code="model_locked")
    check_not_busy(state)
    del current  # the host frees its memory once the engine stops
    await state.host.unload()


async def _host_load(host: ModelHost, name: str, path: Path) -> ServedModel:
    """The host's load (a switch when a model is held), its errors in the API's statuses."""
    try:
        return await host.load(path, name)
    except LoadRefused as e:
        raise ApiError(e.status, e.message, code=e.code, param="model",
                       type="invalid_request_error" if e.status < 500 else "server_error") from None
    except HostBusy as e:
        raise busy_error(e) from None
    except LoadFailed as e:
        raise ApiError(500, e.message, code="model_load_failed", type="server_error", param="model") from None
