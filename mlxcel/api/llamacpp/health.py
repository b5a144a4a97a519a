"""GET /health and /v1/health exactly as b10621: 200 {"status": "ok"} once the model is
loaded, 503 with the "Loading model" envelope before. Under --embeddings / --reranking there is
no chat model; the answer then reports on the side worker(s) the mode selected."""

from __future__ import annotations

from litestar import Response, get

from mlxcel.api.state import AppState
from mlxcel.workers.load import side_workers_ready


async def _health(app_state: AppState) -> Response:
    plan = app_state.plan
    if plan is not None and plan.restricted_by:  # --embeddings / --reranking: report on that worker
        ready = side_workers_ready(app_state)
    else:
        ready = app_state.model is not None
    if not ready:
        return Response({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
                        status_code=503)
    return Response({"status": "ok"})


health = get(["/health", "/v1/health"], name="health")(_health)


def health_alias(path: str):
    """The same answer on another path (Vertex AI's AIP_HEALTH_ROUTE)."""
    return get(path, name="health-alias")(_health)
