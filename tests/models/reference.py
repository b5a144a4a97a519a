"""The numerical reference: transformers on torch, fp32, loaded from the same checkpoint."""

from __future__ import annotations

import inspect
from pathlib import Path


def load_reference(path: Path):
    import torch
    import transformers

    # a multimodal checkpoint (Gemma 3's) loads as its ForConditionalGeneration class, whose
    # text-only forward is the reference for its text tower
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    text = model.config.get_text_config()
    if text.model_type == "gemma3_text":
        # mlx-lm rounds Gemma's sqrt(hidden) embedding scale to bf16 (the training dtype);
        # transformers keeps it in the compute dtype. Use the same constant on both sides.
        embed = model.get_input_embeddings()
        embed.embed_scale.fill_(float(torch.tensor(text.hidden_size**0.5, dtype=torch.bfloat16)))
    return model


class Stepper:
    """A reference run with its own KV cache: each call appends tokens and returns their
    [n, vocab] fp32 logits."""

    def __call__(self, ids: list[int]):
        raise NotImplementedError


class TransformersStepper(Stepper):
    def __init__(self, path: Path) -> None:
        self.model, self.past = load_reference(path), None
        # transformers 5 renames the argument `cache` family by family; its deprecated alias does
        # not reach Mamba2's layers, so the new name is used wherever the forward takes it
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def __call__(self, ids: list[int]):
        import torch

        with torch.no_grad():
            out = self.model(torch.tensor([ids]), **{self.cache_arg: self.past}, use_cache=True)
        # a recurrent family's output names its state `cache` (transformers' Mamba2), the rest `past_key_values`
        past = getattr(out, "past_key_values", None)
        self.past = past if past is not None else getattr(out, "cache", None)
        return out.logits[0].float().numpy()


class MLXLMStepper(Stepper):
    """mlx-lm's own module and KV cache, for a family transformers has no class for: what it
    checks is mlxcel's paged engine around the module, not the module itself."""

    def __init__(self, path: Path) -> None:
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model

        self.model, _ = load_model(Path(path))
        self.cache = make_prompt_cache(self.model)

    def __call__(self, ids: list[int]):
        import mlx.core as mx
        import numpy as np

        logits = self.model(mx.array([ids]), cache=self.cache)[0].astype(mx.float32)
        return np.array(logits)


def reference_stepper(path: Path, hf_architecture: str | None) -> Stepper:
    return TransformersStepper(path) if hf_architecture is not None else MLXLMStepper(path)
