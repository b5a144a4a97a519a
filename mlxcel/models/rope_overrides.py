"""b10621's RoPE overrides (--rope-scaling, --rope-scale / --rope-freq-scale, --rope-freq-base,
--yarn-*) turned into the config entries a family builds its rotation from.

The overrides rewrite `rope_theta` and the `rope_scaling` block before the model is
constructed, which is where llama.cpp applies them (at model load, before any KV exists).
On MLX every family in `registry.FAMILIES` builds its rotation through mlx-lm's
`initialize_rope` from exactly these two entries (`config_overrides`); after the load,
`verify` reads the built rotation back and refuses if it is not the one asked for, so a family
that computes its frequencies some other way is reported rather than silently ignored. On torch
the same override becomes transformers' `rope_parameters` (`hf_rope_parameters`), checked on
the loaded model's config.

What cannot be honoured is refused with the reason: a bare scale against a checkpoint's
banded (llama3) or other non-linear scheme (the two cannot be composed), and the YaRN
extrapolation mix / attention factor at values neither YaRN table has a parameter for.
The --yarn-* knobs against a rotation that is not YaRN configure nothing, as in b10621.
"""

from __future__ import annotations

from typing import Any

from mlxcel.config.rope import RopeOverrides


class RopeRefused(ValueError):
    pass


def checkpoint_block(config: dict) -> tuple[str, dict]:
    """The checkpoint's own scheme ("none" for the plain rotation) and its block."""
    block = config.get("rope_scaling")
    if block is None and isinstance(config.get("rope_parameters"), dict):
        block = config["rope_parameters"]  # transformers >= 5 nests it here
    block = dict(block or {})
    kind = block.get("type") or block.get("rope_type") or "default"
    return ("none" if kind == "default" else str(kind)), block


def config_overrides(config: dict, o: RopeOverrides) -> dict[str, Any]:
    """The `model_config` entries that make the family build the requested rotation."""
    if not o.requested:
        return {}
    ckpt_kind, block = checkpoint_block(config)
    kind = o.scaling or ckpt_kind
    if kind != "yarn" and not o.moves_rotation:
        return {}
    if o.scaling is None and o.freq_scale > 0:
        if ckpt_kind == "none":
            kind = "linear"  # b10621: linear unless the model names a scheme
        elif ckpt_kind not in ("linear", "yarn"):
            raise RopeRefused(
                f"--rope-scale/--rope-freq-scale: this checkpoint declares a {ckpt_kind} RoPE scheme, which a "
                f"plain scale cannot be composed with; name the rotation you want (--rope-scaling linear or none)")
    out: dict[str, Any] = {}
    if o.freq_base > 0:
        out["rope_theta"] = float(o.freq_base)
    # the --yarn-* knobs tune a YaRN rotation only; against any other they ask for nothing,
    # exactly as b10621 reads them only under its YaRN scaling type
    if kind == "none" and o.scaling == "none":
        out["rope_scaling"] = {"rope_type": "default"}
    elif kind == "linear":
        factor = 1.0 / o.freq_scale if o.freq_scale > 0 else float(
            block.get("factor", 1.0) if ckpt_kind == "linear" else 1.0)
        out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif kind == "yarn":
        out["rope_scaling"] = _yarn_block(config, block if ckpt_kind == "yarn" else {}, o)
    return out


def _yarn_block(config: dict, block: dict, o: RopeOverrides) -> dict[str, Any]:
    for name, value in (("--yarn-ext-factor", o.yarn_ext_factor), ("--yarn-attn-factor", o.yarn_attn_factor)):
        if value >= 0 and value != 1.0:
            raise RopeRefused(f"{name} {value:g}: the YaRN tables here (mlx-lm's, transformers') always use 1.0 "
                              f"and have no parameter for another value; pass 1.0 or leave it at -1")
    factor = 1.0 / o.freq_scale if o.freq_scale > 0 else float(block.get("factor", 1.0))
    orig = (o.yarn_orig_ctx if o.yarn_orig_ctx > 0 else block.get("original_max_position_embeddings")
            or config.get("max_position_embeddings") or 4096)
    out = {k: block[k] for k in ("mscale", "mscale_all_dim") if k in block}
    out.update({
        "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(orig),
        "beta_fast": o.yarn_beta_fast if o.yarn_beta_fast >= 0 else block.get("beta_fast", 32),
        "beta_slow": o.yarn_beta_slow if o.yarn_beta_slow >= 0 else block.get("beta_slow", 1),
    })
    return out


def verify(model: Any, overrides: dict[str, Any], model_type: str) -> None:
    """Read the built rotation of a full-attention layer back: the family's arguments must carry
    the override and its rotation must match one built from them, probed at a long position.
    A family that did not take the rewrite is refused by name rather than served unscaled."""
    if not overrides:
        return
    import mlx.core as mx
    from mlx_lm.models.rope_utils import initialize_rope

    args = getattr(model, "args", None)
    rope = None
    for layer in getattr(model, "layers", []):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and not getattr(attn, "is_sliding", False):
            rope = getattr(attn, "rope", None)
            break
    ok = rope is not None and args is not None and all(getattr(args, k, None) == v for k, v in overrides.items())
    if ok:
        dims = int(getattr(rope, "dims", 0) or getattr(rope, "dim", 0))
        ref = initialize_rope(dims, args.rope_theta, getattr(args, "rope_traditional", False), args.rope_scaling,
                              getattr(args, "max_position_embeddings", None))
        probe = mx.arange(2 * dims, dtype=mx.float32).reshape(1, 1, 2, dims) / dims
        ok = type(ref) is type(rope) and bool(mx.allclose(rope(probe, offset=3000), ref(probe, offset=3000)))
    if not ok:
        raise RopeRefused(f"the {model_type} family did not build the requested RoPE override "
                          f"({', '.join(f'{k}={v}' for k, v in overrides.items())}); it cannot be honoured here")


def hf_rope_parameters(current: dict, overrides: dict[str, Any]) -> dict:
    """The same override as transformers' `rope_parameters` (the torch backend). A config keyed
    by layer type (Gemma 3) takes it on its full-attention layers only, as on MLX."""
    nested = isinstance(current.get("full_attention"), dict)
    block = dict(current["full_attention"] if nested else current)
    theta = block.get("rope_theta")
    scaling = overrides.get("rope_scaling")
    if scaling is not None:
        block = {"rope_theta": theta, **{k: v for k, v in scaling.items() if k != "type"}}
    if "rope_theta" in overrides:
        block["rope_theta"] = overrides["rope_theta"]
    return {**current, "full_attention": block} if nested else block
