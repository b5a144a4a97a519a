"""/api/saes: attach and detach SAEs, check compatibility, and set the live steering values.

Live values are per attached SAE ({feature index: strength}, each clamped to ±200). Every
steering answer says whether the values are actually `live`: an active profile or circuit
is the steering base of requests instead, and a disabled SAE steers nothing. Steering is
carried per batch row by the MLX backend; on a backend that does not apply it, attaching is
refused rather than accepted and ignored.

An SAE is read only from under a configured directory: MLXCEL_SAE_DIR or the model store
root. The canonical path (symlinks followed) must lie inside one of them, so an HTTP client,
with or without an API key, cannot make the server open an arbitrary path; a path outside is
refused with one message whether or not it exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Request, Response, delete, get, post, put

from mlxcel.api.management.envelope import Refusal, fail, need_manager, read_body, run, values_of
from mlxcel.api.state import AppState
from mlxcel.config.limits import echo
from mlxcel.steering.sae import SAEError, check_compatible, load_sae
from mlxcel.steering.manager import SteeringError

BASE = "/api/saes"


OUTSIDE = ("the SAE path is not under MLXCEL_SAE_DIR or the model store root; SAEs are read only from "
           "under those directories")


def sae_roots(state: AppState) -> list[Path]:
    """The canonical directories SAEs may be read from."""
    roots = [state.settings.steering.sae_dir, state.store_root]
    return [Path(r).expanduser().resolve() for r in roots if r is not None]


def _path(body: dict, state: AppState) -> Path:
    ref = body.get("path") or body.get("sae")
    if not isinstance(ref, str) or not ref:
        raise Refusal(400, "invalid_parameter", "needs 'path' (a SAELens directory) or 'sae' (a model-store entry)")
    roots = sae_roots(state)
    path = Path(ref).expanduser()
    if not path.is_absolute():  # 'sae' names a store entry; a relative 'path' is under MLXCEL_SAE_DIR first
        base = state.store_root if "sae" in body else (roots[0] if roots else None)
        if base is None:
            raise Refusal(400, "invalid_parameter", OUTSIDE)
        path = Path(base) / ref
    real = path.resolve()
    if not any(real == root or root in real.parents for root in roots):
        raise Refusal(400, "invalid_parameter", OUTSIDE)
    return real


def _base(state: AppState) -> str:
    """What requests steer from when they name no profile."""
    store = state.steering_store
    if store is not None:
        if (p := store.active()) is not None:
            return f"profile:{p.name}"
        if (c := store.active_circuit()) is not None:
            return f"circuit:{c.name}"
    return "live"


def _answer(state: AppState, attached) -> dict:
    return {**attached.public(), "live": attached.enabled and _base(state) == "live"}


def _batch(raw: Any) -> dict[int, float]:
    """{index: value} or [{feature_idx, value | strength}]."""
    if isinstance(raw, list):
        out = {}
        for i, item in enumerate(raw):
            if not isinstance(item, dict) or "feature_idx" not in item:
                raise Refusal(400, "invalid_parameter", f"steering[{i}] must be {{feature_idx, value}}")
            out[str(item["feature_idx"])] = item.get("value", item.get("strength"))
        raw = out
    return values_of(raw)


def _only_sae(state: AppState, body: dict) -> str:
    sae_id = body.get("sae_id")
    attached = need_manager(state).attached
    if sae_id is None:
        if len(attached) != 1:
            raise Refusal(400, "invalid_parameter", f"name the SAE in 'sae_id' ({len(attached)} are attached: "
                          f"{', '.join(sorted(attached))})")
        sae_id = next(iter(attached))
    return sae_id


@get(BASE)
async def list_saes(app_state: AppState) -> Response:
    return run(lambda: [_answer(app_state, a) for a in need_manager(app_state).attached.values()])


@post(f"{BASE}/attach")
async def attach_sae(request: Request, app_state: AppState) -> Response:
    body = await read_body(request)

    def go():
        manager = need_manager(app_state)
        manager.check_available()  # before the path is looked at: no SAE attaches here at all
        return _answer(app_state, manager.attach(str(_path(body, app_state)), body.get("sae_id")))

    return run(go, 201)


@post(f"{BASE}/compatibility")
async def compatibility(request: Request, app_state: AppState) -> Response:
    """Would this SAE attach to the loaded model? {compatible, errors, warnings, sae}."""
    body = await read_body(request)

    def go():
        manager = need_manager(app_state)
        if manager.unavailable:
            return {"compatible": False, "errors": [manager.unavailable], "warnings": [], "sae": None}
        try:
            sae = load_sae(_path(body, app_state), body.get("sae_id"))
        except SAEError as e:
            if e.code == "sae_not_found":
                raise
            return {"compatible": False, "errors": [str(e)], "warnings": [], "sae": None}
        errors, warnings = [], []
        try:
            check_compatible(sae, manager.hidden_size, manager.num_layers)
        except SAEError as e:
            errors.append(str(e))
        if sae.sae_id in manager.attached:
            errors.append(f"an SAE with id {sae.sae_id!r} is already attached")
        same_layer = sorted(a.sae.sae_id for a in manager.attached.values() if a.sae.layer == sae.layer)
        if same_layer:
            warnings.append(f"layer {sae.layer} already has {', '.join(same_layer)} attached; their deltas add")
        trained_on = sae.cfg.get("model_name")
        if isinstance(trained_on, str) and trained_on and not app_state.model.answers_to(trained_on) \
                and Path(trained_on).name != Path(str(app_state.model.info.path)).name:
            warnings.append(f"the SAE was trained on {trained_on!r}, the loaded model is {app_state.model.id!r}")
        return {"compatible": not errors, "errors": errors, "warnings": warnings, "sae": sae.describe()}

    return run(go)


@get(f"{BASE}/{{sae_id:str}}/compatibility")
async def attached_compatibility(sae_id: str, app_state: AppState) -> Response:
    def go():
        sae = need_manager(app_state).get(sae_id).sae  # attached SAEs passed the check when they attached
        return {"compatible": True, "errors": [], "warnings": [], "sae": sae.describe()}

    return run(go)


@get(f"{BASE}/steering")
async def steering_overview(app_state: AppState) -> Response:
    def go():
        attached = need_manager(app_state).attached.values()
        return {"enabled": any(a.enabled and a.values for a in attached), "base": _base(app_state),
                "values": {a.sae.sae_id: {str(k): v for k, v in sorted(a.values.items())} for a in attached}}

    return run(go)


@post(f"{BASE}/steering/batch")
async def batch_any(request: Request, app_state: AppState) -> Response:
    body = await read_body(request)
    return run(lambda: _answer(app_state, need_manager(app_state).set_values(
        _only_sae(app_state, body), _batch(body.get("steering", {})), replace=bool(body.get("replace", False)))))


@post(f"{BASE}/steering/{{action:str}}")
async def enable_all(action: str, app_state: AppState) -> Response:
    if action not in ("enable", "disable"):
        return fail(404, "not_found", f"unknown action {echo(action)!r}")

    def go():
        manager = need_manager(app_state)
        return [_answer(app_state, manager.set_enabled(sae_id, action == "enable"))
                for sae_id in list(manager.attached)]

    return run(go)


@delete(f"{BASE}/steering", status_code=200)
async def clear_all(app_state: AppState) -> Response:
    def go():
        manager = need_manager(app_state)
        return [_answer(app_state, manager.set_values(sae_id, {}, replace=True)) for sae_id in list(manager.attached)]

    return run(go)


def _still_runnable_without(state: AppState, manager, sae_id: str) -> None:
    """Refuse (409 profile_active) to detach an SAE the active profile or cluster needs: after
    the detach every request without steering fields of its own would fail on that profile."""
    active = state.steering_store.active() if state.steering_store is not None else None
    if active is None:
        return
    with manager.lock:  # requests resolve under this lock, so none sees the trial detach
        saved = dict(manager.attached)
        del manager.attached[sae_id]
        try:
            manager.profile_steering(active, active.intensity if active.kind == "cluster" else 1.0)
        except SteeringError:
            raise Refusal(409, "profile_active", f"SAE {sae_id!r} is needed by the active {active.kind} "
                          f"{active.name!r}; deactivate it first (POST /api/profiles/deactivate)") from None
        finally:
            manager.attached.clear()
            manager.attached.update(saved)


@delete(f"{BASE}/{{sae_id:str}}", status_code=200)
async def detach_sae(sae_id: str, app_state: AppState) -> Response:
    def go():
        manager = need_manager(app_state)
        manager.get(sae_id)  # 404 sae_not_attached first
        _still_runnable_without(app_state, manager, sae_id)
        manager.detach(sae_id)
        return {"sae_id": sae_id, "attached": False}

    return run(go)


@get(f"{BASE}/{{sae_id:str}}/steering")
async def get_steering(sae_id: str, app_state: AppState) -> Response:
    return run(lambda: _answer(app_state, need_manager(app_state).get(sae_id)))


@put(f"{BASE}/{{sae_id:str}}/steering")
async def set_steering(sae_id: str, request: Request, app_state: AppState) -> Response:
    body = await read_body(request)
    return run(lambda: _answer(app_state, need_manager(app_state).set_values(
        sae_id, values_of(body.get("values", {})), replace=bool(body.get("replace", False)))))


@post(f"{BASE}/{{sae_id:str}}/steering/batch")
async def set_batch(sae_id: str, request: Request, app_state: AppState) -> Response:
    body = await read_body(request)
    return run(lambda: _answer(app_state, need_manager(app_state).set_values(
        sae_id, _batch(body.get("steering", {})), replace=bool(body.get("replace", False)))))


@post(f"{BASE}/{{sae_id:str}}/steering/{{feature:int}}")
async def set_feature(sae_id: str, feature: int, request: Request, app_state: AppState) -> Response:
    body = await read_body(request)
    value = body.get("strength", body.get("value"))
    return run(lambda: _answer(app_state, need_manager(app_state).set_values(sae_id, values_of({str(feature): value}))))


@delete(f"{BASE}/{{sae_id:str}}/steering/{{feature:int}}", status_code=200)
async def clear_feature(sae_id: str, feature: int, app_state: AppState) -> Response:
    def go():
        manager = need_manager(app_state)
        rest = {i: s for i, s in manager.get(sae_id).values.items() if i != feature}
        return _answer(app_state, manager.set_values(sae_id, rest, replace=True))

    return run(go)


@delete(f"{BASE}/{{sae_id:str}}/steering", status_code=200)
async def clear_steering(sae_id: str, app_state: AppState) -> Response:
    return run(lambda: _answer(app_state, need_manager(app_state).set_values(sae_id, {}, replace=True)))


@post(f"{BASE}/{{sae_id:str}}/{{action:str}}")
async def enable_sae(sae_id: str, action: str, app_state: AppState) -> Response:
    if action not in ("enable", "disable"):
        return fail(404, "not_found", f"unknown action {echo(action)!r}")
    return run(lambda: _answer(app_state, need_manager(app_state).set_enabled(sae_id, action == "enable")))


ROUTES = [list_saes, attach_sae, compatibility, attached_compatibility, steering_overview, batch_any, enable_all,
          clear_all, detach_sae, get_steering, set_steering, set_batch, set_feature, clear_feature, clear_steering,
          enable_sae]
