"""Google Cloud Vertex AI custom-container variables (AIP_*), read in the CLI layer.

With AIP_MODE=PREDICTION, b10621 (and mlxcel) listen on AIP_HTTP_PORT (default 8080, with a
warning when that overrides --port), add AIP_HEALTH_ROUTE as a GET alias of /health, and mount
the prediction fan-out at AIP_PREDICT_ROUTE (default /predict). Routes get a leading slash if
missing. With AIP_MODE unset (or anything else) the variables are inert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxcel.config.refusal import StartupRefusal


def _route(value: str | None, default: str | None) -> str | None:
    if not value:
        return default
    return value if value.startswith("/") else "/" + value


def apply_vertex_env(settings: Any, environ: Mapping[str, str]) -> None:
    if environ.get("AIP_MODE", "") != "PREDICTION":
        return
    raw_port = environ.get("AIP_HTTP_PORT") or "8080"
    try:
        port = int(raw_port)
    except ValueError:
        raise StartupRefusal(f"AIP_HTTP_PORT={raw_port}: expected a port number") from None
    if port != settings.server.port:
        settings.notices.append(f"Vertex AI: AIP_HTTP_PORT {port} overrides the server port {settings.server.port}")
    settings.server.port = port
    settings.server.vertex_predict_route = _route(environ.get("AIP_PREDICT_ROUTE"), "/predict")
    settings.server.vertex_health_route = _route(environ.get("AIP_HEALTH_ROUTE"), None)
