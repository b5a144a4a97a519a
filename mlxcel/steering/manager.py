"""The served model's SAEs: attach/detach, live steering values, request resolution, monitoring.

Deltas are computed when values change (Σ clamp(strength) × W_dec[i], per layer) and handed
to requests as `{layer: delta}`; the engine carries them per row, so a batch mixes rows
under different steering. Every public method takes the manager's lock: the management API
and the request path run on different threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from mlxcel.steering import circuits as circ
from mlxcel.steering import intensity as dial
from mlxcel.steering.monitor import HISTORY_MAX, Monitor
from mlxcel.steering.sae import SAE, SAEError, check_compatible, load_sae
from mlxcel.steering.store import Profile



class SteeringError(ValueError):
    def __init__(self, message: str, code: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.code, self.status = message, code, status


def delta_for(sae: SAE, values: dict[int, float], scale: float = 1.0) -> np.ndarray | None:
    """Σ clamp(scale × strength) × W_dec[i]; None when it adds nothing."""
    bad = [i for i in values if not 0 <= i < sae.d_sae]
    if bad:
        raise SteeringError(f"feature index {bad[0]} is outside SAE {sae.sae_id!r} (d_sae {sae.d_sae})",
                            "invalid_feature_index")
    idx = [i for i, s in values.items() if dial.clamp(scale * s) != 0.0]
    if not idx:
        return None
    strengths = np.array([dial.clamp(scale * values[i]) for i in idx], dtype=np.float32)
    return (strengths @ sae.W_dec[idx]).astype(np.float32)


@dataclass
class Attached:
    sae: SAE
    values: dict[int, float] = field(default_factory=dict)
    enabled: bool = True
    delta: np.ndarray | None = None

    def public(self) -> dict:
        return {**self.sae.describe(), "enabled": self.enabled,
                "steering": {str(k): v for k, v in sorted(self.values.items())}}


@dataclass
class Resolved:
    """What one request runs under."""

    steering: dict[int, np.ndarray] | None
    intensity: float | None = None  # the λ to echo (None: no echo)
    rung: int | None = None  # a circuit genuinely steering this request (X-miLLM-Circuit-Rung)


@dataclass
class CircuitServe:
    """How an active circuit serves against the attached SAEs right now."""

    doc: circ.CircuitDocument | None  # None: the stored definition no longer parses
    mode: str | None  # circ.FULL, circ.SLICE, or None (no member layer has an SAE)
    bound: dict[int, SAE]  # layer -> the SAE its members steer through
    unbound: list[int]
    error: str | None = None


class SteeringManager:
    """`cluster_min` / `circuit_min`: CLUSTER_INTENSITY_MIN and CIRCUIT_INTENSITY_MIN."""

    def __init__(self, hidden_size: int, num_layers: int, cluster_min: float = dial.CLUSTER_INTENSITY_MIN,
                 circuit_min: float = circ.CIRCUIT_INTENSITY_MIN, unavailable: str | None = None) -> None:
        self.hidden_size, self.num_layers = hidden_size, num_layers
        self.unavailable = unavailable  # why no SAE can attach to this model (nothing to steer or read then)
        self.cluster_min, self.circuit_min = cluster_min, circuit_min
        self.attached: dict[str, Attached] = {}
        self.monitor: Monitor | None = None
        self.lock = threading.RLock()

    # -- SAEs -----------------------------------------------------------------------------
    def check_available(self) -> None:
        if self.unavailable:
            raise SteeringError(self.unavailable, "not_supported", 501)

    def attach(self, path: str, sae_id: str | None = None) -> Attached:
        self.check_available()
        sae = load_sae(path, sae_id)
        check_compatible(sae, self.hidden_size, self.num_layers)
        with self.lock:
            if sae.sae_id in self.attached:
                raise SAEError(f"an SAE with id {sae.sae_id!r} is already attached", code="sae_already_attached")
            self.attached[sae.sae_id] = a = Attached(sae)
            return a

    def detach(self, sae_id: str) -> None:
        with self.lock:
            self._need(sae_id)
            del self.attached[sae_id]
            if self.monitor is not None and self.monitor.sae.sae_id == sae_id:
                self.monitor = None

    def _need(self, sae_id: str) -> Attached:
        a = self.attached.get(sae_id)
        if a is None:
            raise SteeringError(f"no SAE {sae_id!r} is attached", "sae_not_attached", 404)
        return a

    def get(self, sae_id: str) -> Attached:
        with self.lock:
            return self._need(sae_id)

    def set_values(self, sae_id: str, values: dict[int, float], replace: bool = False) -> Attached:
        with self.lock:
            a = self._need(sae_id)
            merged = dict(values) if replace else {**a.values, **values}
            merged = {i: dial.clamp(s) for i, s in merged.items() if s != 0}
            a.delta = delta_for(a.sae, merged)  # validates indices before anything changes
            a.values = merged
            return a

    def set_enabled(self, sae_id: str, enabled: bool) -> Attached:
        with self.lock:
            a = self._need(sae_id)
            a.enabled = enabled
            return a

    # -- requests -------------------------------------------------------------------------
    def _profile_sae(self, p: Profile) -> SAE:
        if p.sae_id is not None:
            a = self.attached.get(p.sae_id)
            if a is None:
                raise SteeringError(f"profile {p.name!r} is for SAE {p.sae_id!r}, which is not attached; attached: "
                                    f"{', '.join(sorted(self.attached))}", "profile_invalid")
            if p.layer is not None and p.layer != a.sae.layer:
                raise SteeringError(f"profile {p.name!r} is for layer {p.layer}; SAE {p.sae_id!r} is at layer "
                                    f"{a.sae.layer}", "profile_invalid")
            return a.sae
        at_layer = [a for a in self.attached.values() if p.layer is None or a.sae.layer == p.layer]
        if len(at_layer) != 1:
            raise SteeringError(f"profile {p.name!r} names no SAE and {len(at_layer)} attached SAEs match it",
                                "profile_invalid")
        return at_layer[0].sae

    def profile_steering(self, p: Profile, lam: float) -> dict[int, np.ndarray] | None:
        sae = self._profile_sae(p)
        try:
            d = delta_for(sae, p.steering, lam)
        except SteeringError as e:
            raise SteeringError(f"profile {p.name!r}: {e.message}", "profile_invalid") from None
        return None if d is None else {sae.layer: d}

    def live_steering(self) -> dict[int, np.ndarray] | None:
        out: dict[int, np.ndarray] = {}
        for a in self.attached.values():
            if a.enabled and a.delta is not None:
                out[a.sae.layer] = out[a.sae.layer] + a.delta if a.sae.layer in out else a.delta
        return out or None

    def resolve(self, profile: Profile | None, intensity: float | str | None) -> Resolved:
        """The steering one request runs under. `profile`: the named profile, else the active one
        (the route looks both up); None falls back to the live values."""
        with self.lock:
            if not self.attached:
                return Resolved(None)
            if intensity == "off" or intensity == 0:
                # echo 0 only when the dial turns something off: never for an empty base
                base = profile.steering if profile is not None else self.live_steering()
                return Resolved(None, 0.0 if base else None)
            if profile is None:
                live = self.live_steering()
                if intensity is None or live is None:
                    return Resolved(live)
                lam = dial.resolve(intensity, None, None, self.cluster_min)
                scaled = {li: self._scaled_live(li, lam) for li in live}
                return Resolved({li: d for li, d in scaled.items() if d is not None} or None, lam)
            if intensity is None:
                lam = profile.intensity if profile.kind == "cluster" else 1.0
                return Resolved(self.profile_steering(profile, lam))
            lam = dial.resolve(intensity, profile.intensity_min, profile.intensity_max, self.cluster_min)
            steering = self.profile_steering(profile, lam)
            return Resolved(steering, lam if profile.steering else None)

    # -- circuits -------------------------------------------------------------------------
    def bind_circuit(self, raw: bytes) -> CircuitServe:
        """Each member layer binds to an enabled attached SAE at that layer whose width (and
        d_model) match the document; the SAE the document names wins when several do."""
        try:
            doc = circ.parse_circuit(raw)
        except circ.CircuitError as e:
            return CircuitServe(None, None, {}, [], str(e))
        with self.lock:
            bound: dict[int, SAE] = {}
            for layer in doc.layers:
                ref = doc.sae_ref(layer)
                top = max(doc.members[layer])
                fits = [a.sae for a in self.attached.values() if a.enabled and a.sae.layer == layer
                        and top < a.sae.d_sae and (ref is None or ref.n_features in (None, a.sae.d_sae))
                        and (ref is None or ref.d_model in (None, a.sae.d_in))]
                named = [s for s in fits if ref is not None and s.sae_id == ref.sae_id]
                if named or len(fits) == 1:
                    bound[layer] = (named or fits)[0]
        unbound = [layer for layer in doc.layers if layer not in bound]
        mode = None if not bound else (circ.FULL if not unbound else circ.SLICE)
        return CircuitServe(doc, mode, bound, unbound)

    def circuit_steering(self, raw: bytes, stored: float, intensity: float | str | None) -> Resolved:
        """One λ over every bound layer, each member re-derived from its authored strength and
        clamped to ±200. Full mode clamps λ at both ends and reports the rung; a slice
        fallback is a cluster and takes the cluster rule (and no rung)."""
        serve = self.bind_circuit(raw)
        if serve.mode is None:
            return Resolved(None)
        doc = serve.doc
        if serve.mode == circ.FULL:
            lam = circ.resolve_circuit(intensity, stored, doc.intensity_min, doc.intensity_max, self.circuit_min)
        elif intensity is None:
            lam = stored
        else:
            lam = dial.resolve(intensity, doc.intensity_min, doc.intensity_max, self.cluster_min)
        out = {}
        for layer, sae in serve.bound.items():
            d = delta_for(sae, doc.members[layer], lam)
            if d is not None:
                out[layer] = d
        rung = doc.rung if out and serve.mode == circ.FULL else None
        return Resolved(out or None, lam, rung)

    def _scaled_live(self, layer: int, lam: float) -> np.ndarray | None:
        total = None
        for a in self.attached.values():
            if a.enabled and a.sae.layer == layer and a.values:
                d = delta_for(a.sae, a.values, lam)
                if d is not None:
                    total = d if total is None else total + d
        return total

    # -- monitoring -----------------------------------------------------------------------
    def configure_monitor(self, sae_id: str | None, top_k: int = 8, read_point: str = "pre_steering",
                          history: int = HISTORY_MAX) -> Monitor | None:
        with self.lock:
            if sae_id is None:
                self.monitor = None
                return None
            if read_point not in ("pre_steering", "post_steering"):
                raise SteeringError("read_point must be pre_steering or post_steering", "invalid_parameter")
            if not 1 <= top_k <= 64:
                raise SteeringError("top_k must be in 1-64", "invalid_parameter")
            self.monitor = Monitor(self._need(sae_id).sae, top_k, read_point, max(1, min(history, 100_000)))
            return self.monitor

    def monitor_capture(self) -> dict | None:
        """The capture entry user requests carry while monitoring is on (never scoring/embeddings)."""
        m = self.monitor
        return None if m is None or not m.enabled else {m.sae.layer: m.record}
