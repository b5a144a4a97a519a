"""The numerical reference: transformers on torch, fp32, loaded from the same checkpoint."""

from __future__ import annotations

from pathlib import Path


def load_reference(path: Path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if model.config.model_type == "gemma3_text":
        # mlx-lm rounds Gemma's sqrt(hidden) embedding scale to bf16 (the training dtype);
        # transformers keeps it in the compute dtype. Use the same constant on both sides.
        embed = model.get_input_embeddings()
        embed.embed_scale.fill_(float(torch.tensor(model.config.hidden_size**0.5, dtype=torch.bfloat16)))
    return model
