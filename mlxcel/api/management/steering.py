"""/api/ routes for SAEs, steering values, monitoring, profiles, clusters and inference health.

Every route answers the management envelope (envelope.py). Profiles and clusters are
addressed by name. A cluster is imported from its raw document bytes and exported back
byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Request, Response, delete, get, post, put

from mlxcel.api.management.circuits import ROUTES as CIRCUIT_ROUTES
from mlxcel.api.management.envelope import Refusal, fail, need_manager, need_store, read_body, run
from mlxcel.api.state import AppState
from mlxcel.steering import intensity as dial
from mlxcel.steering.store import Profile

DIAL = "/api"


def _values(raw: Any) -> dict[int, float]:
    if not isinstance(raw, dict):
        raise Refusal(400, "invalid_parameter", "steering values must be an object {feature index: strength}")
    out: dict[int, float] = {}
    for k, v in raw.items():
        try:
            i = int(k)
        except ValueError:
            raise Refusal(400, "invalid_feature_index", f"feature index {k!r} is not an integer") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Refusal(400, "invalid_parameter", f"strength of feature {k} must be a number")
        out[i] = float(v)
    return out


# -- SAEs and steering ---------------------------------------------------------------------
@get(f"{DIAL}/saes")
async def list_saes(app_state: AppState) -> Response:
    return run(lambda: [a.public() for a in need_manager(app_state).attached.values()])


@post(f"{DIAL}/saes/attach")
async def attach_sae(request: Request, app_state: AppState) -> Response:
    body = await read_body(request)

    def go():
        ref = body.get("path") or body.get("sae")
        if not isinstance(ref, str) or not ref:
            raise Refusal(400, "invalid_parameter", "attach needs 'path' (a SAELens directory) or 'sae' (a store entry)")
        path = Path(ref).expanduser()
        if "sae" in body and not path.is_absolute() and app_state.store_root is not None:
            path = app_state.store_root / ref
        return need_manager(app_state).attach(str(path), body.get("sae_id")).public()

    return run(go, 201)


@delete(f"{DIAL}/saes/{{sae_id:str}}", status_code=200)
async def detach_sae(sae_id: str, app_state: AppState) -> Response:
    return run(lambda: need_manager(app_state).detach(sae_id) or {"sae_id": sae_id, "attached": False})


@get(f"{DIAL}/saes/{{sae_id:str}}/steering")
async def get_steering(sae_id: str, app_state: AppState) -> Response:
    return run(lambda: need_manager(app_state).get(sae_id).public())


@put(f"{DIAL}/saes/{{sae_id:str}}/steering")
async def set_steering(sae_id: str, request: Request, app_state: AppState) -> Response:
    body = await read_body(request)
    return run(lambda: need_manager(app_state).set_values(sae_id, _values(body.get("values", {})),
                                                      replace=bool(body.get("replace", False))).public())


@post(f"{DIAL}/saes/{{sae_id:str}}/steering/{{feature:int}}")
async def set_feature(sae_id: str, feature: int, request: Request, app_state: AppState) -> Response:
    body = await read_body(request)
    return run(lambda: need_manager(app_state).set_values(sae_id, _values({str(feature): body.get("strength")})).public())


@delete(f"{DIAL}/saes/{{sae_id:str}}/steering", status_code=200)
async def clear_steering(sae_id: str, app_state: AppState) -> Response:
    return run(lambda: need_manager(app_state).set_values(sae_id, {}, replace=True).public())


@post(f"{DIAL}/saes/{{sae_id:str}}/{{action:str}}")
async def enable_sae(sae_id: str, action: str, app_state: AppState) -> Response:
    if action not in ("enable", "disable"):
        return fail(404, "not_found", f"unknown action {action!r}")
    return run(lambda: need_manager(app_state).set_enabled(sae_id, action == "enable").public())


# -- monitoring ----------------------------------------------------------------------------
@post(f"{DIAL}/monitoring/configure")
async def configure_monitoring(request: Request, app_state: AppState) -> Response:
    body = await read_body(request)

    def go():
        m = need_manager(app_state).configure_monitor(body.get("sae_id"), int(body.get("top_k", 8)),
                                                  body.get("read_point", "pre_steering"), int(body.get("history", 1000)))
        return {"enabled": m is not None, "sae_id": None if m is None else m.sae.sae_id,
                "top_k": None if m is None else m.top_k, "read_point": None if m is None else m.read_point}

    return run(go)


@get(f"{DIAL}/monitoring/history")
async def monitoring_history(app_state: AppState, limit: int = 100) -> Response:
    def go():
        m = need_manager(app_state).monitor
        if m is None:
            raise Refusal(409, "monitoring_disabled", "monitoring is not configured")
        with m.lock:
            return list(m.history)[-max(limit, 0):]

    return run(go)


@get(f"{DIAL}/monitoring/statistics")
async def monitoring_statistics(app_state: AppState, top: int = 20) -> Response:
    def go():
        m = need_manager(app_state).monitor
        if m is None:
            raise Refusal(409, "monitoring_disabled", "monitoring is not configured")
        return m.statistics(top)

    return run(go)


# -- profiles ------------------------------------------------------------------------------
def _need_profile(state: AppState, name: str, kind: str | None = None) -> Profile:
    p = need_store(state).get(name)
    if p is None or (kind is not None and p.kind != kind):
        raise Refusal(404, f"{kind or 'profile'}_not_found", f"{kind or 'profile'} {name!r} not found")
    return p


def _profile_from(body: dict, state: AppState) -> Profile:
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise Refusal(400, "invalid_parameter", "a profile needs a non-empty 'name'")
    layer = body.get("layer")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise Refusal(400, "invalid_parameter", "layer must be an integer")
    return Profile(name=name, steering=_values(body.get("steering", {})), sae_id=body.get("sae_id"), layer=layer,
                   model=body.get("model") or (state.model.id if state.model else None),
                   description=str(body.get("description") or ""))


@get(f"{DIAL}/profiles")
async def list_profiles(app_state: AppState) -> Response:
    return run(lambda: [p.public() for p in need_store(app_state).list()])


@post(f"{DIAL}/profiles")
async def create_profile(request: Request, app_state: AppState) -> Response:
    body = await read_body(request)
    return run(lambda: need_store(app_state).create(_profile_from(body, app_state)).public(), 201)


@post(f"{DIAL}/profiles/import")
async def import_profile(request: Request, app_state: AppState) -> Response:
    body = await read_body(request)
    return run(lambda: need_store(app_state).create(_profile_from(body, app_state)).public(), 201)


@post(f"{DIAL}/profiles/deactivate")
async def deactivate_profiles(app_state: AppState) -> Response:
    return run(lambda: need_store(app_state).activate(None) or {"active": None})


@get(f"{DIAL}/profiles/{{name:str}}")
async def get_profile(name: str, app_state: AppState) -> Response:
    return run(lambda: _need_profile(app_state, name).public())


@get(f"{DIAL}/profiles/{{name:str}}/export")
async def export_profile(name: str, app_state: AppState) -> Response:
    def go():
        p = _need_profile(app_state, name)
        return {k: v for k, v in p.public().items() if k in ("name", "description", "model", "sae_id", "layer",
                                                             "steering")}
    return run(go)


@put(f"{DIAL}/profiles/{{name:str}}")
async def update_profile(name: str, request: Request, app_state: AppState) -> Response:
    body = await read_body(request)

    def go():
        _need_profile(app_state, name)
        changes = {k: v for k, v in body.items() if k in ("name", "description", "sae_id", "layer", "steering")}
        if "steering" in changes:
            changes["steering"] = _values(changes["steering"])
        return need_store(app_state).update(name, **changes).public()

    return run(go)


@delete(f"{DIAL}/profiles/{{name:str}}", status_code=200)
async def delete_profile(name: str, app_state: AppState) -> Response:
    return run(lambda: _need_profile(app_state, name) and need_store(app_state).delete(name) and {"deleted": name})


@post(f"{DIAL}/profiles/{{name:str}}/activate")
async def activate_profile(name: str, app_state: AppState) -> Response:
    def go():
        p = _need_profile(app_state, name)
        m = app_state.model.steering if app_state.model else None
        if m is not None and m.attached:
            m.profile_steering(p, p.intensity if p.kind == "cluster" else 1.0)  # refuse one the SAEs cannot run
        return need_store(app_state).activate(name).public()

    return run(go)


# -- clusters ------------------------------------------------------------------------------
@post(f"{DIAL}/clusters/import")
async def import_cluster(request: Request, app_state: AppState) -> Response:
    raw = await request.body()

    def go():
        try:
            doc = dial.parse_cluster(raw)
        except ValueError as e:
            raise Refusal(400, "invalid_cluster", str(e)) from None
        p = Profile(name=doc.name, steering=doc.steering, sae_id=doc.sae_id, layer=doc.layer,
                    model=app_state.model.id if app_state.model else None, description=doc.description,
                    kind="cluster", intensity=doc.intensity, intensity_min=doc.intensity_min,
                    intensity_max=doc.intensity_max, document=bytes(raw))
        return need_store(app_state).create(p).public()

    return run(go, 201)


@get(f"{DIAL}/clusters")
async def list_clusters(app_state: AppState) -> Response:
    return run(lambda: [p.public() for p in need_store(app_state).list("cluster")])


@post(f"{DIAL}/clusters/{{name:str}}/activate")
async def activate_cluster(name: str, app_state: AppState) -> Response:
    def go():
        _need_profile(app_state, name, "cluster")
        return need_store(app_state).activate(name).public()

    return run(go)


@put(f"{DIAL}/clusters/{{name:str}}/intensity")
async def set_cluster_intensity(name: str, request: Request, app_state: AppState) -> Response:
    body = await read_body(request)

    def go():
        p = _need_profile(app_state, name, "cluster")
        value = body.get("intensity")
        if isinstance(value, str) and value in ("min", "max", "off"):
            lam = dial.resolve(value, p.intensity_min, p.intensity_max)
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise Refusal(400, "invalid_parameter", "intensity must be a number or one of off, min, max")
            top = dial.resolve("max", p.intensity_min, p.intensity_max)
            if not 0 <= value <= top:
                raise Refusal(400, "invalid_parameter", f"intensity {value} is outside [0, {top:g}] for {name!r}")
            lam = float(value)
        return need_store(app_state).update(name, intensity=lam).public()

    return run(go)


@get(f"{DIAL}/clusters/{{name:str}}/export")
async def export_cluster(name: str, app_state: AppState) -> Response:
    p = need_store(app_state).get(name) if app_state.steering_store is not None else None
    if p is None or p.kind != "cluster" or p.document is None:
        return fail(404, "cluster_not_found", f"cluster {name!r} not found")
    return Response(p.document, media_type="application/json")


# -- health --------------------------------------------------------------------------------
@get(f"{DIAL}/health/inference")
async def health_inference(app_state: AppState) -> Response:
    def go():
        m = app_state.model
        if m is None:
            raise Refusal(503, "model_not_loaded", app_state.load_error or "the model is still loading")
        return {"backend": "continuous_batching", "engine": f"mlxcel-{m.info.backend}", "device": m.info.device,
                "model": m.id, "parallel": m.engine.parallel, "per_request_steering": "in_batch",
                "saes_attached": len(m.steering.attached) if m.steering else 0}

    return run(go)


ROUTES = [list_saes, attach_sae, detach_sae, get_steering, set_steering, set_feature, clear_steering, enable_sae,
          configure_monitoring, monitoring_history, monitoring_statistics,
          list_profiles, create_profile, import_profile, deactivate_profiles, get_profile, export_profile,
          update_profile, delete_profile, activate_profile,
          import_cluster, list_clusters, activate_cluster, set_cluster_intensity, export_cluster, health_inference,
          *CIRCUIT_ROUTES]
