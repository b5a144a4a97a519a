"""/api/circuits: import miStudio circuit documents, list, activate, dial, export.

A circuit is addressed by its id (`circ_…`) or its name. Import keeps the raw bytes, which
export returns unchanged. Activating a circuit below rung 2 needs
`acknowledge_unvalidated=true`, because its evidence is not causal. Every view reports how the
circuit would serve against the attached SAEs now (`serving_mode` full / slice_fallback /
null) and, for the active one, whether it is genuinely steering (`steering`, the same fact the
`X-miLLM-Circuit-Rung` header carries).
"""

from __future__ import annotations

from litestar import Request, Response, delete, get, post, put

from mlxcel.api.management.envelope import Refusal, fail, need_store, read_body, run
from mlxcel.api.state import AppState
from mlxcel.config.limits import echo
from mlxcel.steering import circuits as circ
from mlxcel.steering.store import CircuitRow

BASE = "/api/circuits"


def _flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "false").lower()
    if value not in ("true", "1", "false", "0"):
        raise Refusal(400, "invalid_parameter", f"{name} must be true or false")
    return value in ("true", "1")


def _manager(state: AppState):
    return state.model.steering if state.model is not None else None


def view(row: CircuitRow, state: AppState) -> dict:
    m = _manager(state)
    try:
        doc, error = circ.parse_circuit(row.document), None
    except circ.CircuitError as e:
        doc, error = None, str(e)
    serve = m.bind_circuit(row.document) if m is not None and doc is not None else None
    out = {"id": row.id, "name": row.name, "active": row.active, "intensity": row.intensity, "model": row.model,
           "created": row.created, "updated": row.updated, "error": error}
    if doc is not None:
        out.update({"rung": doc.rung, "rung_language": circ.RUNG_LANGUAGE[doc.rung], "layers": doc.layers,
                    "edge_count": doc.edge_count, "narrative": doc.narrative,
                    "intensity_range": None if doc.intensity_min is None else [doc.intensity_min, doc.intensity_max],
                    "members": {str(layer): {str(i): s for i, s in sorted(f.items())}
                                for layer, f in sorted(doc.members.items())}})
    out.update({"serving_mode": serve.mode if serve else None, "serveable": bool(serve and serve.mode == circ.FULL),
                "bound": {str(layer): sae.sae_id for layer, sae in sorted(serve.bound.items())} if serve else {},
                "unbound_layers": serve.unbound if serve else (doc.layers if doc else [])})
    if row.active:
        steering = m.circuit_steering(row.document, row.intensity, None) if m is not None and doc else None
        out["steering"] = None if steering is None or steering.rung is None else {
            "rung": steering.rung, "rung_language": circ.RUNG_LANGUAGE[steering.rung],
            "header": circ.rung_header(steering.rung), "intensity": steering.intensity}
    return out


def _need(state: AppState, ref: str) -> CircuitRow:
    row = need_store(state).circuit(ref)
    if row is None:
        raise Refusal(404, "circuit_not_found", f"circuit {echo(ref)!r} not found")
    return row


def _activate(state: AppState, row: CircuitRow, acknowledged: bool) -> dict:
    doc = circ.parse_circuit(row.document)
    if doc.rung < 2 and not acknowledged:
        raise Refusal(409, "unvalidated_circuit", f"circuit {row.name!r} is at rung {doc.rung} "
                      f"({circ.RUNG_LANGUAGE[doc.rung]}), below causal validation; activate it with "
                      "acknowledge_unvalidated=true", {"rung": doc.rung})
    m = _manager(state)
    serve = m.bind_circuit(row.document) if m is not None else None
    if serve is None or serve.mode is None:
        raise Refusal(422, "sae_set_incomplete", f"circuit {row.name!r} has no attached SAE on any of its layers "
                      f"({', '.join(map(str, doc.layers))})",
                      [{"layer": layer, "sae_id": (doc.sae_ref(layer).sae_id if doc.sae_ref(layer) else None),
                        "feature_idx": sorted(doc.members[layer])} for layer in doc.layers])
    return view(need_store(state).activate_circuit(row.id), state)


@post(f"{BASE}/import")
async def import_circuit(request: Request, app_state: AppState) -> Response:
    raw = await request.body()

    def go():
        conflict = request.query_params.get("on_conflict", "rename")
        if conflict not in ("rename", "error"):
            raise Refusal(400, "invalid_parameter", "on_conflict must be rename or error")
        activate, ack = _flag(request, "activate"), _flag(request, "acknowledge_unvalidated")
        try:
            doc = circ.parse_circuit(raw)
        except circ.CircuitError as e:
            raise Refusal(400, "invalid_circuit", str(e)) from None
        model = app_state.model.id if app_state.model else None
        row = need_store(app_state).create_circuit(doc.name, bytes(raw), doc.intensity, model,
                                                   rename=conflict == "rename")
        if not activate:
            return view(row, app_state)
        try:
            return _activate(app_state, row, ack)
        except Refusal:
            need_store(app_state).delete_circuit(row.id)  # import-and-activate is one step: undo the import
            raise

    return run(go, 201)


@get(BASE)
async def list_circuits(app_state: AppState, min_rung: int = 0) -> Response:
    return run(lambda: [v for v in (view(r, app_state) for r in need_store(app_state).circuits())
                        if (v.get("rung") or 0) >= min_rung])


@get(f"{BASE}/active")
async def active_circuit(app_state: AppState) -> Response:
    def go():
        row = need_store(app_state).active_circuit()
        return None if row is None else view(row, app_state)

    return run(go)


@post(f"{BASE}/deactivate")
async def deactivate_circuits(app_state: AppState) -> Response:
    return run(lambda: need_store(app_state).activate_circuit(None) or {"active": None})


@put(f"{BASE}/{{ref:str}}/intensity")
async def set_intensity(ref: str, request: Request, app_state: AppState) -> Response:
    body = await read_body(request)

    def go():
        row = need_store(app_state).active_circuit() if ref == "active" else _need(app_state, ref)
        if row is None:
            raise Refusal(404, "circuit_not_found", "no circuit is active")
        doc = circ.parse_circuit(row.document)
        m = _manager(app_state)
        floor = m.circuit_min if m is not None else circ.CIRCUIT_INTENSITY_MIN
        lo, hi = circ.circuit_bounds(doc.intensity_min, doc.intensity_max, floor)
        value = body.get("intensity")
        if value in ("off", "min", "max"):
            lam = {"off": 0.0, "min": lo, "max": hi}[value]
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= hi:
            raise Refusal(400, "invalid_parameter", f"intensity must be a number in [0, {hi:g}] or one of off, "
                          f"min, max for circuit {row.name!r}")
        else:
            lam = float(value)
        return view(need_store(app_state).set_circuit_intensity(row.id, lam), app_state)

    return run(go)


@get(f"{BASE}/{{ref:str}}")
async def get_circuit(ref: str, app_state: AppState) -> Response:
    return run(lambda: view(_need(app_state, ref), app_state))


@post(f"{BASE}/{{ref:str}}/activate")
async def activate_circuit(ref: str, request: Request, app_state: AppState) -> Response:
    return run(lambda: _activate(app_state, _need(app_state, ref), _flag(request, "acknowledge_unvalidated")))


@post(f"{BASE}/{{ref:str}}/deactivate")
async def deactivate_circuit(ref: str, app_state: AppState) -> Response:
    def go():
        row = _need(app_state, ref)
        if row.active:
            need_store(app_state).activate_circuit(None)
        return view(_need(app_state, ref), app_state)

    return run(go)


@delete(f"{BASE}/{{ref:str}}", status_code=200)
async def delete_circuit(ref: str, app_state: AppState) -> Response:
    return run(lambda: need_store(app_state).delete_circuit(_need(app_state, ref).id) and {"deleted": ref})


@get(f"{BASE}/{{ref:str}}/export")
async def export_circuit(ref: str, app_state: AppState) -> Response:
    row = app_state.steering_store.circuit(ref) if app_state.steering_store is not None else None
    if row is None:
        return fail(404, "circuit_not_found", f"circuit {echo(ref)!r} not found")
    return Response(row.document, media_type="application/json")


ROUTES = [import_circuit, list_circuits, active_circuit, deactivate_circuits, set_intensity, get_circuit,
          activate_circuit, deactivate_circuit, delete_circuit, export_circuit]
