"""GET /health and /v1/health exactly as b10621: 200 {"status": "ok"} once the model is
loaded, 503 with the "Loading model" envelope before."""

from __future__ import annotations

from litestar import Response, get

from mlxcel.api.state import AppState


@get(["/health", "/v1/health"])
async def health(app_state: AppState) -> Response:
    if app_state.model is None:
        return Response({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
                        status_code=503)
    return Response({"status": "ok"})
