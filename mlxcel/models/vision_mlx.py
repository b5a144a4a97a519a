"""Which vision-language families the MLX backend serves, from config.json alone.

The MLX backend runs a family through mlx-vlm's module for it (backends/mlx/vlm.py); a family
listed in models/vision.py but not here is served on torch only. Backend selection reads
this table, so it never imports MLX or mlx-vlm to ask.
"""

from __future__ import annotations

from mlxcel.models.vision import is_vision

# model_type -> mlx-vlm's family module
MLX_VLM_MODULES: dict[str, str] = {
    "qwen2_vl": "mlx_vlm.models.qwen2_vl",
    "qwen2_5_vl": "mlx_vlm.models.qwen2_5_vl",
    "gemma3": "mlx_vlm.models.gemma3",
    "llava": "mlx_vlm.models.llava",
    "idefics3": "mlx_vlm.models.idefics3",
    "mistral3": "mlx_vlm.models.mistral3",
}


def serves_on_mlx(config: dict) -> bool:
    """Whether the MLX backend runs this vision-language checkpoint."""
    return is_vision(config) and config.get("model_type") in MLX_VLM_MODULES
