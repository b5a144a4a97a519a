"""How a generation request is steered: the per-request surface of /v1/chat/completions
(`profile`, `steering_intensity`, `return_sae_activations`, the `X-miLLM-Steering-Intensity`
echo, the `X-miLLM-Circuit-Rung` header of a request an active circuit genuinely steers) and the
server's steering that every other generation route carries.

`take_fields` removes these fields from the body before the field contract sees it (they are
honoured here), `apply` resolves them against the served model's SAEs and the profile store
and writes the result into the engine request, and `ActivationReader` collects one request's
SAE activations from the rows' residual reads and renders the `millm` object.

`server_steering` is the one call a generation route without per-request fields makes (native
/completion and /infill, /v1/responses, /v1/messages): the live values, the active profile or
the active circuit reach its rows, monitoring reads them, and the rung header comes back.
`refuse_fields` turns the /v1 per-request fields away on those routes (the seed gives them to
chat, and activations to chat and text completions, only), so none is silently dropped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxcel.engine.types import GenerationRequest
from mlxcel.steering import circuits as circ
from mlxcel.steering import intensity as dial
from mlxcel.steering.manager import SteeringError, SteeringManager
from mlxcel.steering.sae import SAE
from mlxcel.steering.store import SteeringStore

INTENSITY_HEADER = "X-miLLM-Steering-Intensity"
STEERING_HEADER = "X-miLLM-Steering"  # "none" on scoring responses: every attached SAE was suppressed
UNSTEERED = {STEERING_HEADER: "none"}
SAE_ACTIVATIONS_MAX_TOP_K = 64
SAE_ACTIVATIONS_MAX_ENTRIES = 65_536
FIELDS = ("profile", "steering_intensity", "return_sae_activations")
_POSITIONS = ("last", "prompt", "completion", "all")
_NOTE = {"post_steering": "post_steering is what the model computed at this layer for this request, after this "
                          "layer's steering delta; it is not an unsteered counterfactual",
         "pre_steering": "pre_steering removes only this layer's own delta; steering at earlier layers and tokens "
                         "generated under steering still shape it",
         "unsteered": "a scoring pass is never steered: every attached SAE was suppressed for it, so this is the "
                      "unmodified model's activation at this layer"}


class RequestRefused(ValueError):
    """A steering field this request cannot have. The API answers it as its own error with this
    status, code and parameter (api/errors.py)."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


@dataclass
class SteeringFields:
    profile: str | None = None
    intensity: float | str | None = None
    activations: dict | None = None


# The chat fields this module takes out of a request body before the field contract sees it.
STEERING_FIELDS = ("profile", "steering_intensity", "return_sae_activations")


def take_fields(body: dict[str, Any]) -> SteeringFields:
    """Pop and validate the steering fields (null means absent)."""
    f = SteeringFields()
    profile = body.pop("profile", None)
    if profile is not None and not isinstance(profile, str):
        raise RequestRefused(400, "profile must be a string", code="invalid_parameter", param="profile")
    f.profile = profile
    raw = body.pop("steering_intensity", None)
    if raw is not None:
        try:
            f.intensity = dial.parse_intensity(raw)
        except dial.IntensityError as e:
            raise RequestRefused(400, str(e), code="invalid_parameter", param="steering_intensity") from None
    f.activations = take_activations(body)
    return f


def take_activations(body: dict[str, Any]) -> dict | None:
    """Pop `return_sae_activations` (chat and text completions); null means absent."""
    acts = body.pop("return_sae_activations", None)
    if acts is not None and not isinstance(acts, dict):
        raise RequestRefused(400, "return_sae_activations must be an object", code="invalid_parameter",
                             param="return_sae_activations")
    return acts


def _bad(message: str, param: str = "return_sae_activations") -> RequestRefused:
    return RequestRefused(400, message, code="invalid_parameter", param=param)


@dataclass
class ActivationReader:
    """One request's SAE activations, read from its rows' residuals (engine thread)."""

    sae: SAE
    positions: str | tuple[int, int]
    features: list[int] | None
    top_k: int
    read_point: str
    n_prompt: int
    unsteered: bool = False  # a scoring pass: reported as read_point "unsteered"
    rows: list[tuple[int, list[tuple[int, float]]]] = field(default_factory=list)  # (token, top features)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, tokens: list[int], pre: np.ndarray, post: np.ndarray) -> None:
        acts = self.sae.encode(post if self.read_point == "post_steering" else pre)
        cand = np.asarray(self.features, dtype=np.int64) if self.features is not None else None
        sub = acts[:, cand] if cand is not None else acts
        k = min(self.top_k, sub.shape[1])
        order = np.argsort(-sub, axis=1, kind="stable")[:, :k]
        with self.lock:
            for j, tok in enumerate(tokens):
                idx = order[j]
                ids = cand[idx] if cand is not None else idx
                self.rows.append((int(tok), [(int(i), float(sub[j, c])) for i, c in zip(ids, idx)]))

    def render(self) -> dict:
        with self.lock:
            total = len(self.rows)
            if self.positions == "all":
                span = range(total)
            elif self.positions == "prompt":
                span = range(min(self.n_prompt, total))
            elif self.positions == "completion":
                span = range(self.n_prompt, total)
            elif self.positions == "last":
                span = range(total - 1, total) if total else range(0)
            else:
                start, end = self.positions
                span = range(max(start, 0), min(end, total))
            out = [{"position": p, "token_id": self.rows[p][0],
                    "features": [{"index": i, "value": v} for i, v in self.rows[p][1]]} for p in span]
        point = "unsteered" if self.unsteered else self.read_point
        return {"sae_id": self.sae.sae_id, "layer": self.sae.layer, "read_point": point,
                "positions": out, "note": _NOTE[point]}

    def capture(self) -> dict:
        return {self.sae.layer: self.read}


def activation_reader(manager: SteeringManager | None, spec: dict, n_prompt: int, max_tokens: int) -> ActivationReader:
    """Validate `return_sae_activations` and build its reader; every refusal is a 400 before generation."""
    attached = {} if manager is None else dict(manager.attached)
    if not attached:
        raise _bad("return_sae_activations needs an attached SAE; none is attached")
    unknown = sorted(set(spec) - {"sae_id", "features", "top_k", "positions", "read_point"})
    if unknown:
        raise _bad(f"return_sae_activations has unknown keys: {', '.join(unknown)}")
    sae_id = spec.get("sae_id")
    if sae_id is None:
        if len(attached) > 1:
            raise _bad(f"return_sae_activations needs sae_id: several SAEs are attached ({', '.join(sorted(attached))})")
        sae_id = next(iter(attached))
    if sae_id not in attached:
        raise _bad(f"no SAE {sae_id!r} is attached; attached: {', '.join(sorted(attached))}")
    sae = attached[sae_id].sae
    features = spec.get("features")
    if features is not None:
        if not isinstance(features, list) or not features or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in features):
            raise _bad("return_sae_activations.features must be a non-empty list of feature indices")
        past = [i for i in features if not 0 <= i < sae.d_sae]
        if past:
            raise _bad(f"feature index {past[0]} is outside SAE {sae_id!r} (d_sae {sae.d_sae})")
    top_k = spec.get("top_k", 8)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise _bad("return_sae_activations.top_k must be a positive integer")
    if top_k > SAE_ACTIVATIONS_MAX_TOP_K:
        raise _bad(f"return_sae_activations.top_k {top_k} is over SAE_ACTIVATIONS_MAX_TOP_K "
                   f"({SAE_ACTIVATIONS_MAX_TOP_K})")
    read_point = spec.get("read_point", "post_steering")
    if read_point not in ("post_steering", "pre_steering"):
        raise _bad("return_sae_activations.read_point must be post_steering or pre_steering")
    positions = spec.get("positions", "completion")
    if isinstance(positions, dict):
        start, end = positions.get("start"), positions.get("end")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)) or not 0 <= start <= end \
                or set(positions) - {"start", "end"}:
            raise _bad("return_sae_activations.positions {start, end} needs integers 0 <= start <= end")
        n_pos = end - start
        positions = (start, end)
    elif positions in _POSITIONS:
        n_pos = {"last": 1, "prompt": n_prompt, "completion": max(max_tokens, 0),
                 "all": n_prompt + max(max_tokens, 0)}[positions]
    else:
        raise _bad(f"return_sae_activations.positions must be one of {', '.join(_POSITIONS)} or {{start, end}}")
    k = min(top_k, len(features) if features is not None else sae.d_sae)
    if n_pos * k > SAE_ACTIVATIONS_MAX_ENTRIES:
        raise _bad(f"return_sae_activations could return {n_pos} positions x {k} features = {n_pos * k} entries, "
                   f"over SAE_ACTIVATIONS_MAX_ENTRIES ({SAE_ACTIVATIONS_MAX_ENTRIES})")
    return ActivationReader(sae, positions, features, top_k, read_point, n_prompt)


def scoring_reader(manager: SteeringManager | None, spec: dict, n_prompt: int) -> ActivationReader:
    """The reader of a scoring pass: one forward over the prompt, nothing generated, unsteered."""
    reader = activation_reader(manager, spec, n_prompt, 1)
    reader.unsteered = True
    return reader


def apply(fields: SteeringFields, manager: SteeringManager | None, store: SteeringStore | None,
          greq: GenerationRequest) -> tuple[dict[str, str], ActivationReader | None]:
    """Resolve this request's steering into `greq`; returns the response headers and the
    activation reader (None when not asked)."""
    headers: dict[str, str] = {}
    profile, circuit = None, None
    if fields.profile is not None:
        profile = store.get(fields.profile) if store is not None else None
        if profile is None:
            raise RequestRefused(404, f"profile {fields.profile!r} not found", code="profile_not_found",
                                 param="profile")
    elif store is not None and manager is not None and manager.attached:
        profile = store.active()
        circuit = store.active_circuit() if profile is None else None
    reader = None
    if fields.activations is not None:
        reader = activation_reader(manager, fields.activations, len(greq.prompt), greq.max_tokens)
    steering, lam = None, None
    if manager is not None:
        try:
            if circuit is not None:
                resolved = manager.circuit_steering(circuit.document, circuit.intensity, fields.intensity)
            else:
                resolved = manager.resolve(profile, fields.intensity)
        except SteeringError as e:
            raise RequestRefused(e.status, e.message, code=e.code,
                                 param="profile" if fields.profile else None) from None
        steering, lam = resolved.steering, resolved.intensity
        if resolved.rung is not None:
            headers[circ.RUNG_HEADER] = circ.rung_header(resolved.rung)
    if fields.intensity is not None and lam is not None:
        headers[INTENSITY_HEADER] = sf_decimal(lam)
    capture: dict = {}
    monitor = manager.monitor_capture() if manager is not None else None
    for source in (monitor, {reader.sae.layer: reader.read} if reader is not None else None):
        for layer, fn in (source or {}).items():
            capture[layer] = _both(capture[layer], fn) if layer in capture else fn
    greq.steering = steering
    greq.capture = capture or None
    if steering is not None or reader is not None:
        greq.cache_prompt = False  # steered KV must never be shared with another request's prefix
    return headers, reader


def server_steering(app_state: Any, model: Any, greqs: list[GenerationRequest]) -> dict[str, str]:
    """Write the server's steering into every row of a request that carries no steering fields
    of its own; returns the response headers (the rung header when a circuit steers)."""
    headers: dict[str, str] = {}
    for greq in greqs:
        row_headers, _ = apply(SteeringFields(), model.steering, app_state.steering_store, greq)
        headers.update(row_headers)
    return headers


def refuse_fields(body: dict[str, Any], route: str) -> None:
    """400 `field_not_honoured` for a per-request steering field on a route that does not take
    one (null means absent)."""
    for name in (*FIELDS, "steering"):
        if body.get(name) is not None:
            raise RequestRefused(400, f"'{name}' is not honoured on {route} by this server; per-request steering "
                                 "is taken by /v1/chat/completions (return_sae_activations also by /v1/completions)",
                                 code="field_not_honoured", param=name)


def sf_decimal(x: float) -> str:
    """An RFC 8941 decimal: at most three fractional digits, at least one."""
    text = f"{round(float(x), 3):.3f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _both(a, b):
    def read(tokens, pre, post):
        a(tokens, pre, post)
        b(tokens, pre, post)

    return read
