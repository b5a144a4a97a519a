"""/api/monitoring: configure which attached SAE is read, switch reading on and off, and read
back the history, the running statistics and the top features (mlxcel/steering/monitor.py).

Monitoring reads user traffic only: scoring passes and embeddings never carry its capture.
"""

from __future__ import annotations

from litestar import Request, Response, delete, get, post

from mlxcel.api.management.envelope import Refusal, need_manager, read_body, run
from mlxcel.api.state import AppState
from mlxcel.steering.monitor import HISTORY_MAX, METRICS

BASE = "/api/monitoring"


def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise Refusal(400, "invalid_parameter", f"{key} must be an integer in {lo}-{hi}")
    return v


def _monitor(state: AppState):
    m = need_manager(state).monitor
    if m is None:
        raise Refusal(409, "monitoring_not_configured", "monitoring is not configured; POST /api/monitoring/configure "
                      "with an attached sae_id first")
    return m


def _state(state: AppState) -> dict:
    mgr = need_manager(state)
    m = mgr.monitor
    if m is None:
        return {"enabled": False, "configured": False, "sae_attached": bool(mgr.attached), "sae_id": None}
    return {**m.state(), "configured": True, "sae_attached": True}


@get(BASE)
async def monitoring_state(app_state: AppState) -> Response:
    return run(lambda: _state(app_state))


@post(f"{BASE}/configure")
async def configure_monitoring(request: Request, app_state: AppState) -> Response:
    body = await read_body(request)

    def go():
        mgr = need_manager(app_state)
        sae_id = body.get("sae_id")
        if sae_id is None and body.get("enabled", True) and len(mgr.attached) == 1:
            sae_id = next(iter(mgr.attached))
        if body.get("enabled") is False:
            sae_id = None
        mgr.configure_monitor(sae_id, _int(body, "top_k", 8, 1, 64), body.get("read_point", "pre_steering"),
                              _int(body, "history_size", _int(body, "history", HISTORY_MAX, 1, 100_000), 1, 100_000))
        return _state(app_state)

    return run(go)


@post(f"{BASE}/enable")
async def enable_monitoring(request: Request, app_state: AppState) -> Response:
    body = await read_body(request)

    def go():
        enabled = body.get("enabled", True)
        if not isinstance(enabled, bool):
            raise Refusal(400, "invalid_parameter", "enabled must be true or false")
        _monitor(app_state).enabled = enabled
        return _state(app_state)

    return run(go)


@get(f"{BASE}/history")
async def monitoring_history(app_state: AppState, limit: int = 50) -> Response:
    def go():
        if not 1 <= limit <= 100_000:
            raise Refusal(400, "invalid_parameter", "limit must be in 1-100000")
        records = _monitor(app_state).recent(limit)
        return {"records": records, "total": len(records)}

    return run(go)


@delete(f"{BASE}/history", status_code=200)
async def clear_history(app_state: AppState) -> Response:
    return run(lambda: {"cleared": _monitor(app_state).clear_history()})


@get(f"{BASE}/statistics")
async def monitoring_statistics(app_state: AppState, features: str | None = None) -> Response:
    def go():
        m = _monitor(app_state)
        ids = None
        if features:
            try:
                ids = [int(f) for f in features.split(",")]
            except ValueError:
                raise Refusal(400, "invalid_parameter", "features must be comma-separated feature indices") from None
            bad = [i for i in ids if not 0 <= i < m.sae.d_sae]
            if bad:
                raise Refusal(400, "invalid_feature_index", f"feature index {bad[0]} is outside SAE "
                              f"{m.sae.sae_id!r} (d_sae {m.sae.d_sae})")
        return m.statistics(ids)

    return run(go)


@delete(f"{BASE}/statistics", status_code=200)
async def reset_statistics(app_state: AppState) -> Response:
    return run(lambda: {"cleared": _monitor(app_state).reset_statistics()})


async def _top(app_state: AppState, k: int, metric: str) -> Response:
    def go():
        if not 1 <= k <= 1000:
            raise Refusal(400, "invalid_parameter", "k must be in 1-1000")
        if metric not in METRICS:
            raise Refusal(400, "invalid_parameter", f"metric must be one of {', '.join(METRICS)}")
        return {"features": _monitor(app_state).top(k, metric), "metric": metric, "k": k}

    return run(go)


@post(f"{BASE}/statistics/top")
async def top_features(request: Request, app_state: AppState) -> Response:
    body = await read_body(request)
    k = body.get("k", 10)
    return await _top(app_state, k if isinstance(k, int) and not isinstance(k, bool) else -1,
                      body.get("metric", "mean"))


@get(f"{BASE}/top")
async def top_features_get(app_state: AppState, k: int = 10, metric: str = "mean") -> Response:
    return await _top(app_state, k, metric)


ROUTES = [monitoring_state, configure_monitoring, enable_monitoring, monitoring_history, clear_history,
          monitoring_statistics, reset_statistics, top_features, top_features_get]
