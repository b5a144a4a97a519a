"""miStudio circuit documents: parsing, the evidence ladder, the circuit dial, and binding to SAEs.

A circuit (kind `mistudio.circuit-definition`, schema_version "1") is a multi-layer
intervention: members at several layers, each a feature with an authored strength (or a
cluster whose `expanded_members` carry theirs), edges graded on the evidence ladder, and a
`budget` with the circuit's stored `intensity` and declared `intensity_range`.

Rules (seed 000, "Intensity coupling"): one λ scales every member through its own layer's
SAE; members are re-derived from the authored strengths each time (the dial is absolute);
numeric λ is clamped into the declared range intersected with [CIRCUIT_INTENSITY_MIN,
DIAL_MAX] at both ends, and only an exact 0 / "off" goes below the floor. A circuit whose
layers are only partly covered by attached SAEs serves its bound layers as a cluster slice
(`slice_fallback`), under the cluster rule. The rung (minimum over the edges, 0 without
edges) is described only by the ladder's own phrases.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from mlxcel.steering.intensity import DIAL_MAX

KIND = "mistudio.circuit-definition"
SCHEMA_VERSION = "1"
CIRCUIT_INTENSITY_MIN = 0.0
RUNG_HEADER = "X-miLLM-Circuit-Rung"
RUNG_LANGUAGE = {0: "associated", 1: "suggested (attribution-supported)", 2: "causally validated (edge)",
                 3: "faithfulness-tested (circuit)"}
# Caps on an imported document, checked before any per-member work.
MAX_BYTES = 1 << 20
MAX_LAYERS = 16
MAX_EDGES = 200
MAX_MEMBERS_PER_LAYER = 20
FULL, SLICE = "full", "slice_fallback"


class CircuitError(ValueError):
    pass


@dataclass
class SAERef:
    layer: int | None
    sae_id: str | None
    n_features: int | None
    d_model: int | None


@dataclass
class CircuitDocument:
    name: str
    narrative: str
    members: dict[int, dict[int, float]]  # layer -> {feature index: authored strength}
    saes: list[SAERef]
    rung: int
    edge_count: int
    intensity: float
    intensity_min: float | None
    intensity_max: float | None
    layers: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.layers = sorted(self.members)

    def sae_ref(self, layer: int) -> SAERef | None:
        return next((s for s in self.saes if s.layer == layer), None)


def rung_header(rung: int) -> str:
    """RFC 8941: a bare integer item with a quoted-string `language` parameter."""
    return f'{rung}; language="{RUNG_LANGUAGE[rung]}"'


def _int(v, what: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CircuitError(f"{what} must be an integer >= {lo}")
    return v


def _num(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise CircuitError(f"{what} must be a finite number")
    return float(v)


def _obj(v, what: str) -> dict:
    if not isinstance(v, dict):
        raise CircuitError(f"{what} must be an object")
    return v


def _member_features(m: dict, where: str) -> list[tuple[int, float]]:
    kind = m.get("member_kind", "feature_ref")
    if kind == "feature_ref":
        f = _obj(m.get("feature"), f"{where}.feature")
        return [(_int(f.get("feature_idx"), f"{where}.feature.feature_idx"),
                 _num(f.get("strength"), f"{where}.feature.strength"))]
    if kind == "cluster_ref":
        expanded = m.get("expanded_members")
        if not isinstance(expanded, list) or not expanded:
            raise CircuitError(f"{where}: a cluster_ref member needs its expanded_members snapshot")
        return [(_int(_obj(e, f"{where}.expanded_members[{j}]").get("feature_idx"),
                      f"{where}.expanded_members[{j}].feature_idx"),
                 _num(e.get("strength"), f"{where}.expanded_members[{j}].strength")) for j, e in enumerate(expanded)]
    raise CircuitError(f"{where}.member_kind {kind!r} is not feature_ref or cluster_ref")


def _range(budget: dict) -> tuple[float | None, float | None]:
    rng = budget.get("intensity_range")
    if rng is None or rng == []:
        return None, None
    if not isinstance(rng, list) or len(rng) != 2:
        raise CircuitError("budget.intensity_range must be [min, max]")
    lo, hi = _num(rng[0], "budget.intensity_range[0]"), _num(rng[1], "budget.intensity_range[1]")
    if not 0 <= lo <= hi:
        raise CircuitError("budget.intensity_range needs 0 <= min <= max")
    return lo, hi


def parse_circuit(raw: bytes) -> CircuitDocument:
    """Validate a circuit document; the bytes themselves are kept by the caller as sent."""
    if len(raw) > MAX_BYTES:
        raise CircuitError(f"the circuit document is {len(raw)} bytes; the limit is {MAX_BYTES}")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CircuitError(f"the circuit document is not JSON: {e}") from None
    doc = _obj(doc, "the circuit document")
    if doc.get("kind", KIND) != KIND:
        raise CircuitError(f"kind {doc.get('kind')!r} is not {KIND!r}")
    if str(doc.get("schema_version", SCHEMA_VERSION)).split(".")[0] != SCHEMA_VERSION:
        raise CircuitError(f"schema_version {doc.get('schema_version')!r} is not supported (major {SCHEMA_VERSION})")
    name = doc.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 120:
        raise CircuitError("the circuit document needs a 'name' of 1-120 characters")
    saes_raw = doc.get("saes")
    if not isinstance(saes_raw, list) or not 1 <= len(saes_raw) <= MAX_LAYERS:
        raise CircuitError(f"'saes' must list 1-{MAX_LAYERS} SAE references")
    saes = []
    for i, s in enumerate(saes_raw):
        s = _obj(s, f"saes[{i}]")
        sae_id = s.get("mistudio_sae_id") or s.get("sae_id")
        opt = {k: (None if s.get(k) is None else _int(s[k], f"saes[{i}].{k}")) for k in ("layer", "n_features",
                                                                                      "d_model")}
        saes.append(SAERef(opt["layer"], sae_id if isinstance(sae_id, str) else None, opt["n_features"],
                           opt["d_model"]))
    members_raw = doc.get("members")
    if not isinstance(members_raw, list) or not members_raw:
        raise CircuitError("'members' must be a non-empty list")
    members: dict[int, dict[int, float]] = {}
    for i, m in enumerate(members_raw):
        m = _obj(m, f"members[{i}]")
        layer = _int(m.get("layer"), f"members[{i}].layer")
        at = members.setdefault(layer, {})
        for idx, strength in _member_features(m, f"members[{i}]"):
            at[idx] = at.get(idx, 0.0) + strength  # a feature named twice at a layer adds, as deltas do
    if len(members) > MAX_LAYERS:
        raise CircuitError(f"the circuit spans {len(members)} layers; the limit is {MAX_LAYERS}")
    crowded = [layer for layer, feats in members.items() if len(feats) > MAX_MEMBERS_PER_LAYER]
    if crowded:
        raise CircuitError(f"layer {crowded[0]} has more than {MAX_MEMBERS_PER_LAYER} members")
    edges = doc.get("edges") or []
    if not isinstance(edges, list) or len(edges) > MAX_EDGES:
        raise CircuitError(f"'edges' must be a list of at most {MAX_EDGES}")
    rungs = []
    for i, e in enumerate(edges):
        r = _obj(e, f"edges[{i}]").get("rung", 0)
        if r not in RUNG_LANGUAGE or isinstance(r, bool):
            raise CircuitError(f"edges[{i}].rung must be 0, 1, 2 or 3")
        rungs.append(r)
    budget = doc.get("budget") or {}
    budget = _obj(budget, "budget")
    intensity = _num(budget.get("intensity", 1.0), "budget.intensity")
    if not 0 <= intensity <= DIAL_MAX:
        raise CircuitError(f"budget.intensity must be in 0-{DIAL_MAX:g}")
    lo, hi = _range(budget)
    return CircuitDocument(name=name, narrative=str(doc.get("narrative") or ""), members=members, saes=saes,
                           rung=min(rungs) if rungs else 0, edge_count=len(edges), intensity=intensity,
                           intensity_min=lo, intensity_max=hi)


def circuit_bounds(lo: float | None, hi: float | None, floor: float = CIRCUIT_INTENSITY_MIN,
                   server_max: float = DIAL_MAX) -> tuple[float, float]:
    """The declared range intersected with the configured envelope [floor, server_max]."""
    a = max(floor, lo) if lo is not None else floor
    b = min(server_max, hi) if hi is not None else server_max
    return min(a, b), b


def resolve_circuit(dial: float | str | None, stored: float, lo: float | None, hi: float | None,
                    floor: float = CIRCUIT_INTENSITY_MIN, server_max: float = DIAL_MAX) -> float:
    """λ for a full-mode circuit: clamped at both ends; only an exact 0 / "off" is below the floor."""
    a, b = circuit_bounds(lo, hi, floor, server_max)
    value = stored if dial is None else dial
    if value == "off" or value == 0:
        return 0.0
    if value == "min":
        return a
    if value == "max":
        return b
    return min(max(float(value), a), b)
