"""GET /v1/cache/stats and POST /v1/cache/reset: the prefix (prompt) cache, seen and emptied.

mlxcel's own routes (b10621 has none), behind the same API-key gate as every other route.
The reset is queued to the engine thread, which owns the KV: it runs between steps, and the
requests running then keep the cached blocks they share (their own references), so they finish
as they would have; only later prompts stop finding the dropped prefixes.
"""

from __future__ import annotations

import asyncio

from litestar import Request, get, post

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.openai.generation import served_model
from mlxcel.api.state import AppState


@get("/v1/cache/stats")
async def cache_stats(app_state: AppState) -> dict:
    model = served_model(app_state, None)
    engine = model.engine
    kv = engine.kv_bytes()
    return {"object": "cache.stats", "model": model.id, "prefix_cache": engine.cache_stats(),
            "kv": {"type_k": app_state.settings.kv.cache_type_k, "type_v": app_state.settings.kv.cache_type_v,
                   "dtype": model.info.dtype, **kv}}


@post("/v1/cache/reset", status_code=200)
async def cache_reset(request: Request, app_state: AppState) -> dict:
    if await request.body():  # no body, or an empty object: a field would be silently ignored
        extra = sorted(await read_json_object(request))
        if extra:
            raise ApiError(400, f"POST /v1/cache/reset takes no fields (got {', '.join(extra)})",
                           code="invalid_request", param=extra[0])
    model = served_model(app_state, None)
    freed = await asyncio.wrap_future(model.engine.submit_cache_reset())
    return {"object": "cache.reset", "model": model.id, "blocks_freed": freed,
            "prefix_cache": model.engine.cache_stats()}


CACHE_ROUTES = [cache_stats, cache_reset]
