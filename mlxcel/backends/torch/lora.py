"""LoRA terms on the torch backend: target nn.Linear modules of transformers' model (or their
packed MLX-quantized form, quantized.QuantizedLinear) add their per-row term through a forward hook.

The hook returns the linear's output plus `((x @ A^T) @ B'^T) * s` for every adapter the
step uses, `s` being the rows' [B, 1, 1] scale block; with no adapter in use it returns
None, which leaves the output untouched, so a server at 0.0 computes the base model exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlxcel.backends.torch.quantized import QuantizedLinear
from mlxcel.models.lora import Adapter, by_module, scale_blocks, validate


class TorchLoraTerms:
    """The adapters' terms on one model, and the step's per-adapter scale blocks."""

    def __init__(self, model: torch.nn.Module, adapters: Sequence[Adapter], dtype: torch.dtype,
                 device: torch.device) -> None:
        linears = {name: m for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))}
        shapes = {name: (m.out_features, m.in_features) for name, m in linears.items()}
        for adapter in adapters:
            validate(adapter, shapes)
        self.n = len(adapters)
        self._dtype, self._device = dtype, device
        self._terms = by_module(adapters, lambda a: torch.from_numpy(a).to(device, dtype))
        self._step: dict[int, torch.Tensor] = {}
        for name, terms in self._terms.items():
            linears[name].register_forward_hook(self._hook(terms.terms))

    def begin(self, rows_scales, layout) -> None:
        """The step's scale blocks: [B, 1, 1], or [1, T, 1] over packed rows (base.RowLayout)."""
        self._step = {k: torch.from_numpy(layout.per_token(v.reshape(-1, 1, 1))).to(self._device, self._dtype)
                      for k, v in scale_blocks(rows_scales, self.n).items()}

    def end(self) -> None:
        self._step = {}

    def _hook(self, terms):
        def run(module, args, output):
            if not self._step:
                return None
            x = args[0]
            for k, at, bt in terms:
                s = self._step.get(k)
                if s is not None:
                    output = output + ((x @ at) @ bt) * s
            return output

        return run
