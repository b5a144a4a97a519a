"""GET /health and /v1/health while the model loads: b10621's 503 envelope, exactly."""

from litestar.testing import TestClient

from mlxcel.api.app import build_litestar
from mlxcel.api.state import AppState
from mlxcel.config.settings import ServerSettings


def test_health_is_503_loading_model_until_ready():
    app = build_litestar(AppState(settings=ServerSettings()))
    with TestClient(app) as client:
        for path in ("/health", "/v1/health"):
            r = client.get(path)
            assert r.status_code == 503
            assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
