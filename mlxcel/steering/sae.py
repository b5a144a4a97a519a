"""One sparse autoencoder in SAELens layout: loading, the model compatibility check, encode.

A SAELens directory holds `cfg.json` (d_in, d_sae, hook_name, hook_layer, ...) and
`sae_weights.safetensors` with W_enc [d_in, d_sae], W_dec [d_sae, d_in], b_enc [d_sae],
b_dec [d_in] and, for JumpReLU SAEs, threshold [d_sae]. mlxcel attaches an SAE at the
*output* of a decoder layer: `blocks.L.hook_resid_post` is layer L's output, and
`blocks.L.hook_resid_pre` is layer L-1's output (L = 0 would be the embeddings, which are
never steered, so it is refused).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WEIGHTS_FILE = "sae_weights.safetensors"
CONFIG_FILE = "cfg.json"
_HOOK = re.compile(r"^blocks\.(\d+)\.hook_resid_(pre|post)$")
ACTIVATIONS = ("relu", "jumprelu", "topk")


class SAEError(ValueError):
    """An SAE that cannot be loaded or attached; the message says why."""

    def __init__(self, message: str, code: str = "sae_invalid") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class SAE:
    sae_id: str
    path: Path
    layer: int  # the decoder layer whose output this SAE reads and steers
    d_in: int
    d_sae: int
    W_enc: np.ndarray  # [d_in, d_sae] float32
    W_dec: np.ndarray  # [d_sae, d_in] float32
    b_enc: np.ndarray
    b_dec: np.ndarray
    threshold: np.ndarray | None = None
    activation: str = "relu"
    k: int = 0  # for activation "topk"
    hook_name: str = ""
    cfg: dict = field(default_factory=dict, repr=False)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Feature activations [n, d_sae] of residuals x [n, d_in]."""
        pre = (np.asarray(x, np.float32) - self.b_dec) @ self.W_enc + self.b_enc
        if self.activation == "jumprelu":
            return np.where(pre > self.threshold, pre, 0.0).astype(np.float32)
        acts = np.maximum(pre, 0.0)
        if self.activation == "topk" and 0 < self.k < self.d_sae:
            drop = np.argpartition(acts, -self.k, axis=-1)[:, : -self.k]
            np.put_along_axis(acts, drop, 0.0, axis=-1)
        return acts

    def describe(self) -> dict:
        return {"sae_id": self.sae_id, "path": str(self.path), "layer": self.layer, "d_in": self.d_in,
                "d_sae": self.d_sae, "hook_name": self.hook_name, "activation": self.activation}


def _layer_of(cfg: dict) -> tuple[int, str]:
    hook = str(cfg.get("hook_name") or "")
    m = _HOOK.match(hook)
    if m:
        block, where = int(m.group(1)), m.group(2)
        if "hook_layer" in cfg and int(cfg["hook_layer"]) != block:
            raise SAEError(f"cfg.json: hook_layer {cfg['hook_layer']} disagrees with hook_name {hook!r}")
        if where == "pre":
            if block == 0:
                raise SAEError("blocks.0.hook_resid_pre reads the embeddings, which are never steered")
            return block - 1, hook
        return block, hook
    if hook:
        raise SAEError(f"cfg.json: hook_name {hook!r} is not a residual stream hook "
                       "(supported: blocks.N.hook_resid_post, blocks.N.hook_resid_pre)")
    if isinstance(cfg.get("hook_layer"), int):
        return int(cfg["hook_layer"]), f"blocks.{cfg['hook_layer']}.hook_resid_post"
    raise SAEError("cfg.json names neither hook_name nor hook_layer")


def load_sae(path: str | Path, sae_id: str | None = None) -> SAE:
    """Load a SAELens directory; refuse anything malformed with a message naming it."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise SAEError(f"{path} is not a SAELens SAE directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})",
                       code="sae_not_found")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except ValueError as e:
        raise SAEError(f"{path / CONFIG_FILE}: not JSON ({e})") from None
    layer, hook = _layer_of(cfg)
    w = load_file(str(path / WEIGHTS_FILE))
    missing = [k for k in ("W_enc", "W_dec", "b_enc", "b_dec") if k not in w]
    if missing:
        raise SAEError(f"{WEIGHTS_FILE} lacks {', '.join(missing)}")
    W_enc, W_dec = w["W_enc"].astype(np.float32), w["W_dec"].astype(np.float32)
    d_in, d_sae = int(cfg.get("d_in", W_enc.shape[0])), int(cfg.get("d_sae", W_enc.shape[1]))
    shapes = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_in), "b_enc": (d_sae,), "b_dec": (d_in,)}
    for name, shape in shapes.items():
        if tuple(w[name].shape) != shape:
            raise SAEError(f"{name} has shape {tuple(w[name].shape)}, cfg.json implies {shape}")
    activation = str(cfg.get("architecture") or cfg.get("activation_fn_str") or "relu").lower()
    activation = {"standard": "relu", "gated": "relu"}.get(activation, activation)
    if activation not in ACTIVATIONS:
        raise SAEError(f"activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    threshold = w.get("threshold")
    if activation == "jumprelu" and threshold is None:
        raise SAEError("a JumpReLU SAE needs a 'threshold' tensor")
    k = int((cfg.get("activation_fn_kwargs") or {}).get("k", cfg.get("k", 0)) or 0)
    return SAE(sae_id=sae_id or cfg.get("sae_id") or path.name, path=path, layer=layer, d_in=d_in, d_sae=d_sae,
               W_enc=W_enc, W_dec=W_dec, b_enc=w["b_enc"].astype(np.float32), b_dec=w["b_dec"].astype(np.float32),
               threshold=None if threshold is None else threshold.astype(np.float32), activation=activation,
               k=k, hook_name=hook, cfg=cfg)


def check_compatible(sae: SAE, hidden_size: int, num_layers: int) -> None:
    """Refuse an SAE the loaded model cannot host."""
    if sae.d_in != hidden_size:
        raise SAEError(f"SAE {sae.sae_id!r} has d_in {sae.d_in}, the model's hidden size is {hidden_size}",
                       code="sae_incompatible")
    if not 0 <= sae.layer < num_layers:
        raise SAEError(f"SAE {sae.sae_id!r} reads layer {sae.layer}; the model has layers 0..{num_layers - 1}",
                       code="sae_incompatible")


def save_sae(path: Path, cfg: dict, tensors: dict[str, np.ndarray]) -> None:
    """Write a SAELens directory (fixture builders and tests use this)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
