"""The intensity dial λ and miStudio cluster documents.

Rules (seed 000, "Intensity coupling"): a request's `steering_intensity` is a number in
[0, 2] or "off" / "min" / "max". On a cluster base, "min"/"max" are the declared
intensity_range intersected with [0, DIAL_MAX] (undeclared: CLUSTER_INTENSITY_MIN and the
server maximum); a numeric λ is capped at the range's maximum and honoured below its floor.
0 / "off" turns steering off for the request without looking at the base. A plain profile
base has the undeclared range. Each scaled strength is clamped to ±STRENGTH_LIMIT.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

STRENGTH_LIMIT = 200.0
DIAL_MAX = 2.0
CLUSTER_INTENSITY_MIN = 0.5
SYMBOLS = ("off", "min", "max")


class IntensityError(ValueError):
    pass


def parse_intensity(value) -> float | str:
    """Validate a request's steering_intensity: a float in [0, 2] or a symbol."""
    if isinstance(value, str):
        if value in SYMBOLS:
            return value
        raise IntensityError(f"steering_intensity {value!r} is not one of {', '.join(SYMBOLS)} or a number in 0-2")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise IntensityError("steering_intensity must be a number in 0-2 or one of off, min, max")
    if not 0 <= value <= DIAL_MAX:
        raise IntensityError(f"steering_intensity {value} is outside 0-{DIAL_MAX:g}")
    return float(value)


def resolve(dial: float | str, lo: float | None, hi: float | None, floor_default: float = CLUSTER_INTENSITY_MIN,
            server_max: float = DIAL_MAX) -> float:
    """λ for a dial against a declared range (lo/hi None: undeclared)."""
    floor = max(0.0, lo) if lo is not None else floor_default
    ceil = min(DIAL_MAX, hi) if hi is not None else server_max
    floor = min(floor, ceil)  # a range declared above the [0, 2] envelope meets it at its top
    if dial == "off":
        return 0.0
    if dial == "min":
        return floor
    if dial == "max":
        return ceil
    return min(float(dial), ceil)


def clamp(strength: float) -> float:
    return max(-STRENGTH_LIMIT, min(STRENGTH_LIMIT, float(strength)))


@dataclass
class ClusterDocument:
    name: str
    steering: dict[int, float]
    sae_id: str | None
    layer: int | None
    description: str
    intensity: float
    intensity_min: float | None
    intensity_max: float | None


def parse_cluster(raw: bytes) -> ClusterDocument:
    """Read the fields mlxcel uses from a miStudio cluster document; the bytes are kept as sent.

    Accepted: {"name", "description"?, "sae_id"?, "layer"?, "features": [{"index" | "feature_index",
    "strength"}] or {index: strength}, "intensity"?, "intensity_range"?: [min, max] | {"min", "max"}}.
    """
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"the cluster document is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str) or not doc["name"]:
        raise ValueError("the cluster document needs a non-empty string 'name'")
    feats = doc.get("features")
    steering: dict[int, float] = {}
    if isinstance(feats, dict):
        items = list(feats.items())
    elif isinstance(feats, list):
        items = []
        for i, f in enumerate(feats):
            if not isinstance(f, dict):
                raise ValueError(f"features[{i}] must be an object")
            items.append((f.get("index", f.get("feature_index")), f.get("strength")))
    else:
        raise ValueError("the cluster document needs 'features' (a list or an object)")
    for idx, strength in items:
        try:
            i, s = int(idx), float(strength)
        except (TypeError, ValueError):
            raise ValueError(f"feature {idx!r}: index must be an integer and strength a number") from None
        if i < 0 or not math.isfinite(s):
            raise ValueError(f"feature {idx!r}: index must be >= 0 and strength finite")
        steering[i] = s
    rng = doc.get("intensity_range")
    lo = hi = None
    if isinstance(rng, dict):
        lo, hi = rng.get("min"), rng.get("max")
    elif isinstance(rng, list) and len(rng) == 2:
        lo, hi = rng
    elif rng is not None:
        raise ValueError("intensity_range must be [min, max] or {min, max}")
    if rng is not None:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)) or not 0 <= lo <= hi:
            raise ValueError("intensity_range needs numbers 0 <= min <= max")
        lo, hi = float(lo), float(hi)
    intensity = doc.get("intensity", 1.0)
    if isinstance(intensity, bool) or not isinstance(intensity, (int, float)) or not 0 <= intensity <= DIAL_MAX:
        raise ValueError(f"intensity must be a number in 0-{DIAL_MAX:g}")
    layer = doc.get("layer")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise ValueError("layer must be an integer")
    return ClusterDocument(name=doc["name"], steering=steering, sae_id=doc.get("sae_id"), layer=layer,
                           description=str(doc.get("description") or ""), intensity=float(intensity),
                           intensity_min=lo, intensity_max=hi)
