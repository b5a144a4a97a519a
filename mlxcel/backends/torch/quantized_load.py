"""Loading an MLX-quantized checkpoint into transformers' model class, the weights kept packed.

transformers builds the family's model on the meta device (no memory); every module the
checkpoint quantized (a `<path>.scales` tensor beside its weight, as mlx-lm writes them) is
replaced by quantized.py's packed form, reading its bits and group size from the config's
`quantization` block (a per-layer entry keyed by the module path where mlx-lm wrote one, else
the block's own) and checking them against the tensors' shapes; the remaining parameters load
in the compute dtype, a tied LM head shares the embedding's packed tensors, and the
non-persistent buffers (RoPE frequencies) are computed by the family's own initialiser. A
checkpoint tensor nothing takes, or a parameter nothing fills, refuses the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mlxcel.backends.select import quantization_mode
from mlxcel.backends.torch.quantized import QuantizedEmbedding, QuantizedLinear


class QuantizedLoadRefused(ValueError):
    """The checkpoint's quantized layout does not fit the family's modules (said why)."""


def is_mlx_quantized(config: dict) -> bool:
    """MLX's affine quantization, the form this backend runs packed."""
    return quantization_mode(config) == "affine"


def layer_spec(config: dict, path: str) -> tuple[int, int]:
    """(bits, group size) of the module at `path`: its per-layer entry, else the block's."""
    q = config["quantization"]
    own = q.get(path)
    if isinstance(own, dict):
        return int(own.get("bits", q["bits"])), int(own.get("group_size", q["group_size"]))
    return int(q["bits"]), int(q["group_size"])


class _Tensors:
    """The checkpoint's tensors by name, read lazily from its safetensors files."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._files = {}
        self.where: dict[str, object] = {}
        for f in sorted(path.glob("*.safetensors")):
            handle = safe_open(str(f), framework="pt")
            self._files[f] = handle
            for key in handle.keys():
                self.where[key] = handle
        self.taken: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        self.taken.add(key)
        return self.where[key].get_tensor(key)

    def left(self) -> list[str]:
        # mlx-lm drops RoPE's frequency buffers; older checkpoints may still carry them
        return sorted(k for k in self.where if k not in self.taken and not k.endswith("rotary_emb.inv_freq"))


def _packed(tensors: _Tensors, config: dict, path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    bits, group = layer_spec(config, path)
    weight = tensors.get(f"{path}.weight")
    if weight.element_size() != 4:
        raise QuantizedLoadRefused(f"{path}.weight is {weight.dtype}, not MLX's packed 32-bit words")
    return weight, tensors.get(f"{path}.scales"), tensors.get(f"{path}.biases"), bits, group


def _replace(model: torch.nn.Module, tensors: _Tensors, config: dict, dtype: torch.dtype) -> list[str]:
    """Swap every quantized module for its packed form; returns their paths."""
    modules = dict(model.named_modules())
    paths = sorted({k[: -len(".scales")] for k in tensors.where if k.endswith(".scales")})
    for path in paths:
        module = modules.get(path)
        parent_path, _, attr = path.rpartition(".")
        parent = modules.get(parent_path)
        if module is None or parent is None:
            raise QuantizedLoadRefused(f"the checkpoint quantizes {path}, which the "
                                       f"{config.get('model_type')} class does not have")
        try:
            if isinstance(module, torch.nn.Linear):
                bias = tensors.get(f"{path}.bias").to(dtype) if module.bias is not None else None
                new = QuantizedLinear(*_packed(tensors, config, path), bias=bias)
                shape = (module.out_features, module.in_features)
                got = (new.out_features, new.in_features)
            elif isinstance(module, torch.nn.Embedding):
                new = QuantizedEmbedding(*_packed(tensors, config, path), dtype=dtype,
                                         embed_scale=getattr(module, "embed_scale", None))
                shape, got = (module.num_embeddings, module.embedding_dim), (new.num_embeddings, new.embedding_dim)
            else:
                raise QuantizedLoadRefused(f"{path} is quantized in the checkpoint but is a {type(module).__name__}, "
                                           "which the torch backend cannot run packed")
        except (ValueError, KeyError) as e:
            if isinstance(e, QuantizedLoadRefused):
                raise
            raise QuantizedLoadRefused(f"{path}: {e}") from None
        if got != shape:
            raise QuantizedLoadRefused(f"{path}: the packed weight is {got[0]}x{got[1]} with the config's "
                                       f"{new.bits}-bit, group {new.group} quantization; the model wants "
                                       f"{shape[0]}x{shape[1]}")
        setattr(parent, attr, new)
    return paths


def _tie_head(model: torch.nn.Module, tensors: _Tensors) -> None:
    """A tied checkpoint's LM head over a quantized embedding: the embedding's packed tensors."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return
    names = {id(m): n for n, m in model.named_modules()}
    head_path = names.get(id(head))
    if head_path is None or f"{head_path}.weight" in tensors:
        return  # the checkpoint carries its own head
    if isinstance(embed, QuantizedEmbedding):
        parent_path, _, attr = head_path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, QuantizedLinear.tied(embed))


def _load_dense(model: torch.nn.Module, tensors: _Tensors, dtype: torch.dtype) -> None:
    """Every parameter and persistent buffer still on the meta device, from the checkpoint."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for key, p in list(module._parameters.items()):
            if p is not None and p.is_meta and f"{prefix}{key}" in tensors:
                value = tensors.get(f"{prefix}{key}")
                value = value.to(dtype) if value.is_floating_point() else value
                module._parameters[key] = torch.nn.Parameter(value, requires_grad=False)
        for key, b in list(module._buffers.items()):
            if b is not None and b.is_meta and f"{prefix}{key}" in tensors:
                module._buffers[key] = tensors.get(f"{prefix}{key}").to(b.dtype)


def _init_buffers(model) -> None:
    """Non-persistent buffers (RoPE's frequencies) computed by the family's initialiser, as
    transformers' own loading does after a meta-device build."""
    for module in model.modules():
        metas = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        for k in metas:
            module._buffers[k] = torch.empty_like(module._buffers[k], device="cpu")
        model._init_weights(module)


def load_quantized(path: Path, config: dict, dtype: torch.dtype, implementation: str, hf_config=None):
    """transformers' model for the MLX-quantized checkpoint at `path`, its quantized modules
    packed (quantized.py), the rest in `dtype`; raises QuantizedLoadRefused."""
    import transformers

    if hf_config is None:
        hf_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    # MLX's block has no `quant_method`; transformers would look for a quantizer of that name
    for attr in ("quantization_config", "quantization"):
        if hasattr(hf_config, attr):
            delattr(hf_config, attr)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                              attn_implementation=implementation)
    tensors = _Tensors(path)
    _replace(model, tensors, config, dtype)
    _tie_head(model, tensors)
    _load_dense(model, tensors, dtype)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if isinstance(head, torch.nn.Linear) and isinstance(embed, torch.nn.Embedding) and head.weight.is_meta:
            head.weight = embed.weight
    _init_buffers(model)
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise QuantizedLoadRefused(f"{path}: the checkpoint lacks {len(missing)} weights the "
                                   f"{model.config.model_type} class needs (first: {missing[0]})")
    left = tensors.left()
    if left:
        raise QuantizedLoadRefused(f"{path}: {len(left)} checkpoint tensors fit no module of the "
                                   f"{model.config.model_type} class (first: {left[0]})")
    return model.eval()
