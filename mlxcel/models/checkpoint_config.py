"""A checkpoint's config.json in the form mlxcel and mlx-lm read, whichever transformers wrote it.

transformers 5 saves RoPE settings only under `rope_parameters` (keyed by layer type for
Gemma 3) and Gemma 3's layer pattern only as `layer_types`; mlx-lm's families read top-level
`rope_theta`, `rope_scaling`, `rope_local_base_freq` and `sliding_window_pattern`, and fall
back to their defaults without a word when those are missing (a Llama would rotate with base
10000 whatever it was trained with); it also renamed the expert count of Qwen's MoE families
`num_local_experts` and moved GLM-4's `partial_rotary_factor` under `rope_parameters`.
`normalize_config` adds the top-level keys; it never
changes a key the checkpoint already sets. Both backends read configs through here (MLX hands
mlx-lm the added keys, `mlx_overrides`; transformers 5 reads either form itself, so torch needs
them only for mlxcel's own reads), and `mlxcel convert` writes the normalised form.
"""

from __future__ import annotations

import json
from pathlib import Path


class ConfigRefused(ValueError):
    """A config.json whose settings a family's loader could not take as written (says why)."""


def read_config(path: str | Path) -> dict:
    """The normalised config.json of the checkpoint directory `path`."""
    return normalize_config(json.loads((Path(path) / "config.json").read_text()))


def normalize_config(config: dict) -> dict:
    """`config` with the top-level keys mlx-lm reads, derived from transformers 5's nested ones."""
    config = dict(config)
    if isinstance(config.get("text_config"), dict):
        # a vision-language checkpoint's text tower (Gemma 3's): its keys normalised in place, and
        # its vocabulary also at the top, where mlx-lm's wrapper reads it (else its own default)
        config["text_config"] = normalize_config(config["text_config"])
        if "vocab_size" in config["text_config"]:
            config.setdefault("vocab_size", config["text_config"]["vocab_size"])
    gemma3 = config.get("model_type") == "gemma3_text"
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        full, local = rp["full_attention"], rp.get("sliding_attention") or {}
        _rope_keys(config, full)
        if "rope_theta" in local:
            config.setdefault("rope_local_base_freq", local["rope_theta"])
    elif isinstance(rp, dict):
        _rope_keys(config, rp)
    for alias, key in _ALIASES.get(config.get("model_type"), {}).items():
        if key in config:
            config.setdefault(alias, config[key])
    for common, own in _OWN_NAMES.get(config.get("model_type"), {}).items():
        if own in config:
            config.setdefault(common, config[own])
    if config.get("model_type") == "dbrx" and isinstance(config.get("attn_config"), dict):
        if "kv_n_heads" in config["attn_config"]:  # DBRX keeps its KV head count in its attention block
            config.setdefault("num_key_value_heads", config["attn_config"]["kv_n_heads"])
    if "num_local_experts" in config:  # transformers 5's name; mlx-lm's Qwen MoE families read num_experts
        config.setdefault("num_experts", config["num_local_experts"])
    if config.get("model_type") == "gemma2" and "layer_types" not in config:
        # what transformers builds for a Gemma 2 config without the list: local, global, local, ...
        n = int(config.get("num_hidden_layers") or 0)
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if gemma3 and isinstance(config.get("layer_types"), list):
        period = layer_period(config["layer_types"])
        if period is not None:
            config.setdefault("sliding_window_pattern", period)
    return config


# a family's own names for a key transformers 5 saves under its common name, which that
# family's mlx-lm module reads and has no default for
_ALIASES = {"gpt_neox": {"rotary_emb_base": "rope_theta", "rotary_pct": "partial_rotary_factor"},
            # EXAONE 3's remote-code names, which mlx-lm's exaone reads (transformers maps them itself)
            "exaone": {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps"}}
# a family's own names for the shape keys mlxcel reads under their common names (KV bytes per
# token, context length, layer count); transformers maps them by a class attribute config.json lacks
_OWN_NAMES = {"dbrx": {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                       "max_position_embeddings": "max_seq_len"},
              # a hub EXAONE 3 config.json, which names them the remote code's way
              "exaone": {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon"}}


def _rope_keys(config: dict, block: dict) -> None:
    for key in ("rope_theta", "partial_rotary_factor"):  # GLM-4 keeps its rotary fraction here
        if key in block:
            config.setdefault(key, block[key])
    kind = block.get("rope_type", block.get("type", "default"))
    if kind != "default":
        # with `type` too: the spelling some mlx-lm families require (Phi-3's long RoPE)
        config.setdefault("rope_scaling", {**block, "type": block.get("type", kind)})


def layer_period(types: list) -> int | None:
    """The period of a layer list in which every p-th layer is full attention and the others
    sliding (Gemma 3's `sliding_window_pattern`); None when the list has no such period."""
    if "full_attention" not in types:
        return None
    p = types.index("full_attention") + 1
    periodic = all((t == "full_attention") == ((i + 1) % p == 0) for i, t in enumerate(types))
    return p if periodic and set(types) <= {"full_attention", "sliding_attention"} else None


def mlx_overrides(raw: dict) -> dict:
    """The entries mlx-lm's loader must take over the file's own (`load_model`'s model_config):
    those normalisation adds to the config.json `raw`. A Gemma 3 layer list that no period
    describes is refused, since mlx-lm's gemma3_text can only build a periodic one."""
    config = normalize_config(raw)
    if (config.get("model_type") == "gemma3_text" and isinstance(config.get("layer_types"), list)
            and "sliding_window_pattern" not in config):
        raise ConfigRefused("config.json's layer_types is not every n-th layer full attention, the only pattern "
                            "mlx-lm's gemma3_text builds (--backend torch serves it as written)")
    added = {k: v for k, v in config.items() if k not in raw}
    if isinstance(raw.get("text_config"), dict):  # the text tower's, whole (mlx-lm takes it as one key)
        added["text_config"] = {**config["text_config"], **mlx_overrides(raw["text_config"])}
    return {**added, **_mlx_forms(config)}


def _mlx_forms(config: dict) -> dict:
    """Keys mlx-lm reads in another form than transformers writes them, replacing the file's.
    EXAONE 4: transformers saves `sliding_window_pattern` as a period (4) beside `layer_types`;
    mlx-lm indexes it as a string of L (local) and G (global) layers."""
    types, pattern = config.get("layer_types"), config.get("sliding_window_pattern")
    if config.get("model_type") == "exaone4" and not isinstance(pattern, str) and isinstance(types, list):
        if not config.get("sliding_window"):
            return {"sliding_window_pattern": None}  # no window: every layer global, with RoPE
        period = layer_period(types)
        if period is None:
            raise ConfigRefused("config.json's layer_types is not every n-th layer full attention, the only "
                                "pattern mlx-lm's exaone4 builds (--backend torch serves it as written)")
        return {"sliding_window_pattern": "L" * (period - 1) + "G"}
    return {}
