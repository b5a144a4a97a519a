"""/api/ routes for profiles and clusters, and the list of every management route.

Every route answers the management envelope (envelope.py). Profiles and clusters are
addressed by name. A cluster is imported from its raw document bytes and exported back
byte for byte. SAEs and steering values live in saes.py, circuits in circuits.py,
monitoring in monitoring.py, models and inference health in models.py.
"""

from __future__ import annotations


from litestar import Request, Response, delete, get, post, put

from mlxcel.api.management.circuits import ROUTES as CIRCUIT_ROUTES
from mlxcel.api.management.models import ROUTES as MODEL_ROUTES
from mlxcel.api.management.monitoring import ROUTES as MONITORING_ROUTES
from mlxcel.api.management.saes import ROUTES as SAE_ROUTES
from mlxcel.api.management.envelope import Refusal, fail, need_manager, need_store, read_body, run, values_of
from mlxcel.api.state import AppState
from mlxcel.config.limits import echo
from mlxcel.steering import intensity as dial
from mlxcel.steering.store import Profile

DIAL = "/api"


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
    return Profile(name=name, steering=values_of(body.get("steering", {})), sae_id=body.get("sae_id"), layer=layer,
                   model=body.get("model") or (state.model.id if state.model else None),
                   description=str(body.get("description") or ""))


def _runnable(state: AppState, p: Profile) -> None:
    """Refuse to activate a profile or cluster the attached SAEs cannot run (400 profile_invalid),
    rather than leaving every later request to fail on it."""
    m = state.model.steering if state.model else None
    if m is not None and m.attached:
        m.profile_steering(p, p.intensity if p.kind == "cluster" else 1.0)


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


@post(f"{DIAL}/profiles/save-current")
async def save_current(request: Request, app_state: AppState) -> Response:
    """A new profile from one attached SAE's live values."""
    body = await read_body(request)

    def go():
        manager = need_manager(app_state)
        sae_id = body.get("sae_id")
        if sae_id is None:
            if len(manager.attached) != 1:
                raise Refusal(400, "invalid_parameter", f"name the SAE in 'sae_id' ({len(manager.attached)} are "
                              "attached)")
            sae_id = next(iter(manager.attached))
        a = manager.get(sae_id)
        p = _profile_from({**body, "sae_id": sae_id, "layer": a.sae.layer,
                           "steering": {str(k): v for k, v in a.values.items()}}, app_state)
        created = need_store(app_state).create(p)
        if body.get("activate"):
            created = need_store(app_state).activate(created.name)
        return created.public()

    return run(go, 201)


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
            changes["steering"] = values_of(changes["steering"])
        return need_store(app_state).update(name, **changes).public()

    return run(go)


@delete(f"{DIAL}/profiles/{{name:str}}", status_code=200)
async def delete_profile(name: str, app_state: AppState) -> Response:
    return run(lambda: _need_profile(app_state, name) and need_store(app_state).delete(name) and {"deleted": name})


@post(f"{DIAL}/profiles/{{name:str}}/activate")
async def activate_profile(name: str, app_state: AppState) -> Response:
    def go():
        _runnable(app_state, _need_profile(app_state, name))
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
        _runnable(app_state, _need_profile(app_state, name, "cluster"))
        return need_store(app_state).activate(name).public()

    return run(go)


@put(f"{DIAL}/clusters/{{name:str}}/intensity")
async def set_cluster_intensity(name: str, request: Request, app_state: AppState) -> Response:
    body = await read_body(request)

    def go():
        p = _need_profile(app_state, name, "cluster")
        manager = app_state.model.steering if app_state.model is not None else None
        floor = manager.cluster_min if manager is not None else dial.CLUSTER_INTENSITY_MIN
        value = body.get("intensity")
        if isinstance(value, str) and value in ("min", "max", "off"):
            lam = dial.resolve(value, p.intensity_min, p.intensity_max, floor)
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise Refusal(400, "invalid_parameter", "intensity must be a number or one of off, min, max")
            top = dial.resolve("max", p.intensity_min, p.intensity_max, floor)
            if not 0 <= value <= top:
                raise Refusal(400, "invalid_parameter", f"intensity {value} is outside [0, {top:g}] for {name!r}")
            lam = float(value)
        return need_store(app_state).update(name, intensity=lam).public()

    return run(go)


@get(f"{DIAL}/clusters/{{name:str}}/export")
async def export_cluster(name: str, app_state: AppState) -> Response:
    p = need_store(app_state).get(name) if app_state.steering_store is not None else None
    if p is None or p.kind != "cluster" or p.document is None:
        return fail(404, "cluster_not_found", f"cluster {echo(name)!r} not found")
    return Response(p.document, media_type="application/json")


ROUTES = [*SAE_ROUTES,
          list_profiles, create_profile, import_profile, save_current, deactivate_profiles, get_profile, export_profile,
          update_profile, delete_profile, activate_profile,
          import_cluster, list_clusters, activate_cluster, set_cluster_intensity, export_cluster,
          *CIRCUIT_ROUTES, *MONITORING_ROUTES, *MODEL_ROUTES]
