"""Checkpoints in transformers' own layout where an mlx-lm family's loader expects another.

mlx-lm's gpt_oss sanitize takes OpenAI's MXFP4 expert blocks or an MLX conversion; a checkpoint
transformers saved unquantized (a BF16 release, or the zoo's) stores each layer's experts as bare
[experts, in, out] tensors (`experts.gate_up_proj`, `experts.down_proj`, no `.weight`), which
it would leave unmatched. Those become the [experts, out, in] `.weight` tensors the sanitize
then splits (gate/up interleaved along `out`) as it does a dequantized release.
"""

from __future__ import annotations

# model_type -> the bare expert tensors' name endings in transformers' layout
BARE_EXPERTS = {"gpt_oss": (".experts.gate_up_proj", ".experts.down_proj")}


def with_transformers_layout(model_cls: type, model_type: str) -> type:
    """`model_cls`, or a subclass whose sanitize first takes transformers' layout; the subclass
    keeps the family's module name (packed.install finds the family module through it)."""
    names = BARE_EXPERTS.get(model_type)
    if names is None or not hasattr(model_cls, "sanitize"):
        return model_cls

    def sanitize(self, weights):
        renamed = {(k + ".weight" if k.endswith(names) else k): (v.swapaxes(-1, -2) if k.endswith(names) else v)
                   for k, v in weights.items()}
        return model_cls.sanitize(self, renamed)

    return type(model_cls.__name__, (model_cls,), {"sanitize": sanitize, "__module__": model_cls.__module__})
