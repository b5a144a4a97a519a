"""The router's own endpoints (b10621's router surface), in b10621's shapes and exact refusals.

GET /models and /v1/models list the inventory (?reload=1 rescans the sources first);
POST /models/load and /models/unload start and stop a model; POST /models downloads a
repository into the store and DELETE /models?model= removes a cache model; GET /models/sse
streams every pool event; GET /props without ?model= describes the router itself and /health
answers for the router, which has no model of its own to wait for. The resumable-stream routes
are answered here too, over the session store all models share. Refusals use the native
envelope {"error": {code, message, type}} on every path, as b10621's router answers before any
model sees the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from litestar import Litestar, Request, Response, delete, get, post
from litestar.di import Provide
from litestar.response import Stream

from mlxcel import __version__
from mlxcel.api.openai.models import model_entries
from mlxcel.api.state import AppState
from mlxcel.api.stream_resume import STREAM_ROUTES
from mlxcel.config.limits import ERROR_MESSAGE_CHARS, echo
from mlxcel.config.settings import ServerSettings
from mlxcel.router.pool import RouterError, RouterPool, Slot
from mlxcel.store.repo_id import InvalidRepoId, expand, parse_repo_id
from mlxcel.store.resolve import refusal

TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "server_error", 503: "unavailable_error"}


def error_response(status: int, message: str) -> Response:
    return Response({"error": {"code": status, "message": echo(message, ERROR_MESSAGE_CHARS),
                               "type": TYPES.get(status, "server_error")}},
                    status_code=status)


def _router_error(_request: Request, exc: RouterError) -> Response:
    return error_response(exc.status, exc.message)


async def body_json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise RouterError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RouterError(400, "the request body must be a JSON object")
    return body


def _model_field(body: dict) -> str:
    value = body.get("model")
    return value if isinstance(value, str) else ""


def entry_json(pool: RouterPool, slot: Slot, now: int) -> dict:
    e = slot.entry
    status: dict[str, Any] = {"value": slot.status, "args": pool.args(slot)}
    own = [s for s in e.sections if s.name != "*"]
    if own:
        status["preset"] = own[0].to_ini()
    if slot.status == "unloaded" and slot.exit_code != 0:
        status["exit_code"], status["failed"] = slot.exit_code, True
    out = {"id": e.name, "aliases": list(e.aliases), "tags": list(e.tags), "object": "model", "owned_by": "llamacpp",
           "created": now, "status": status,
           "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
           "source": e.source, "can_remove": e.source == "cache"}
    if slot.status == "downloading":
        out["progress"] = dict(slot.progress)
    if slot.status == "loaded" and slot.child is not None:  # the model's own /v1/models entry fills the rest
        for entry, *_ in model_entries(slot.child.state)[:1]:
            for key, value in entry.items():
                out.setdefault(key, value)
    return out


@get(["/models", "/v1/models"], name="router-models")
async def router_models(pool: RouterPool, reload: str | None = None) -> dict:
    if reload:
        pool.rescan()
        pool.publish("*", "models_reload")
    now = int(time.time())
    return {"data": [entry_json(pool, s, now) for s in pool.slots.values()], "object": "list"}


@get("/v1/models/{model_id:path}", name="router-model")
async def router_model(pool: RouterPool, model_id: str) -> Any:
    slot = pool.find(model_id.lstrip("/"))
    if slot is None:
        return error_response(404, f"model '{model_id.lstrip('/')}' not found")
    return entry_json(pool, slot, int(time.time()))


@post("/models/load", status_code=200)
async def router_load(request: Request, pool: RouterPool) -> Any:
    slot = pool.find(_model_field(await body_json(request)))
    if slot is None:
        return error_response(404, "model is not found")
    if slot.running:
        return error_response(400, "model is already running")
    await pool.load(slot)
    return {"success": True}


@post("/models/unload", status_code=200)
async def router_unload(request: Request, pool: RouterPool) -> Any:
    slot = pool.find(_model_field(await body_json(request)))
    if slot is None:
        return error_response(400, "model is not found")
    if not slot.running and slot.status != "downloading":
        return error_response(400, "model is not running")
    await pool.unload(slot)
    return {"success": True}


@post("/models", status_code=200)
async def router_download(request: Request, pool: RouterPool) -> Any:
    from mlxcel.router.download import ProbeFailed, probe

    name = _model_field(await body_json(request)).strip()
    if not name:
        raise RouterError(400, "model must be a non-empty string")
    why = refusal(name, "model")
    if why:
        raise RouterError(400, why)
    repo_id = expand(name, pool.settings.source.default_org)
    try:
        parse_repo_id(repo_id)
    except InvalidRepoId as e:
        raise RouterError(400, f"model {name!r}: {e}") from None
    if pool.settings.source.offline:
        raise RouterError(400, f"--offline forbids downloading {repo_id}")
    if pool.store_root is None:
        raise RouterError(500, "no model store to download into (--model-store-root)")
    try:
        await asyncio.to_thread(probe, repo_id, pool.settings.source.hf_token)
    except ProbeFailed as e:
        raise RouterError(500, str(e)) from None
    if pool.find(repo_id) is not None or pool.find(name) is not None:
        raise RouterError(400, f"model '{repo_id}' already exists")
    await pool.download(repo_id)
    return {"success": True}


@delete("/models", status_code=200)
async def router_remove(pool: RouterPool, model: str | None = None) -> Any:
    if not model:
        raise RouterError(400, "model must be a non-empty string")
    await pool.remove(model)
    return {"success": True}


@get("/models/sse", name="router-models-sse")
async def router_events(pool: RouterPool) -> Stream:
    queue: asyncio.Queue = asyncio.Queue()
    sub = (asyncio.get_running_loop(), queue)
    pool.subscribers.add(sub)

    async def frames():
        try:
            while True:
                item = await queue.get()
                if item is None:  # the server is shutting down
                    return
                yield f"data: {json.dumps(item, separators=(',', ':'))}\n\n"
        finally:
            pool.subscribers.discard(sub)

    return Stream(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@get("/props", name="router-props")
async def router_props(pool: RouterPool) -> dict:
    return {"role": "router", "max_instances": pool.settings.router.models_max,
            "models_autoload": pool.settings.router.models_autoload, "model_alias": "llama-server", "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0}, "ui_settings": {},
            "build_info": f"mlxcel-{__version__}", "cors_proxy_enabled": False}


@get(["/health", "/v1/health"], name="router-health")
async def router_health() -> dict:
    return {"status": "ok"}


# GET/DELETE /v1/stream and POST /v1/streams/lookup: the router answers them over the session store
# every model records into (pool.streams), so a resume needs no model name
ROUTER_ROUTES = [router_models, router_model, router_load, router_unload, router_download, router_remove,
                 router_events, router_props, router_health]


def build_router_litestar(pool: RouterPool | None) -> Litestar:
    async def startup() -> None:
        if pool is not None:
            pool.spawn(pool.load_startup_models())

    streams_state = AppState(settings=pool.settings if pool is not None else ServerSettings())
    if pool is not None:
        streams_state.streams = pool.streams

    def provide_pool() -> RouterPool | None:
        return pool

    def provide_state() -> AppState:
        return streams_state

    return Litestar(route_handlers=[*ROUTER_ROUTES, *STREAM_ROUTES],
                    dependencies={"pool": Provide(provide_pool, sync_to_thread=False),
                                  "app_state": Provide(provide_state, sync_to_thread=False)},
                    exception_handlers={RouterError: _router_error}, on_startup=[startup],
                    openapi_config=None, logging_config=None, debug=False)  # logging: as in api/app.py
