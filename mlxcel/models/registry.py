"""The family registry: `model_type` -> the module that implements its forward pass.

An explicit table, not an import-by-name fallback: a checkpoint whose `model_type` is not
listed here is refused with a message naming the supported types. mlx-lm's per-family
modules are the maintained reference implementations; a family file of our own goes here
only when a family needs one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Family:
    model_type: str
    mlx_module: str | None  # module exposing `Model` and `ModelArgs`; None: torch backend only
    hf_architecture: str  # transformers class used as the numerical reference


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "mlx_lm.models.llama", "LlamaForCausalLM"),
        Family("qwen2", "mlx_lm.models.qwen2", "Qwen2ForCausalLM"),
        Family("qwen3", "mlx_lm.models.qwen3", "Qwen3ForCausalLM"),
        Family("gemma3_text", "mlx_lm.models.gemma3_text", "Gemma3ForCausalLM"),
        # vision-language (models/vision.py): transformers' family code on the torch backend only
        Family("qwen2_vl", None, "Qwen2VLForConditionalGeneration"),
    )
}


# model_type values the encoder workers load (models/bert.py); listed apart from FAMILIES, and
# here rather than beside the MLX code, so reading a checkpoint's kind needs no MLX
ENCODER_TYPES = ("bert",)


class UnsupportedModelType(ValueError):
    pass


def family_for(config: dict) -> Family:
    model_type = config.get("model_type")
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise UnsupportedModelType(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    return fam


def mlx_module(config: dict) -> ModuleType:
    fam = family_for(config)
    if fam.mlx_module is None:
        raise UnsupportedModelType(f"{fam.model_type} is a vision-language checkpoint, which only the torch backend "
                                   f"serves: use --backend torch")
    return importlib.import_module(fam.mlx_module)


def decoder_stack(model):
    """The module of an mlx-lm family `Model` that maps token ids to the final hidden states:
    embeddings, every decoder layer and the final norm, without the LM head. Every family
    listed above keeps it in `model.model`, called as `(inputs, cache=...)`."""
    inner = getattr(model, "model", None)
    if inner is None or not callable(inner):
        raise UnsupportedModelType(f"{type(model).__module__} has no decoder stack at `.model`; "
                                   "its hidden states cannot be read")
    return inner
