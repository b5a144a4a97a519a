"""LoRA terms on the MLX backend: target linears of an mlx-lm model add their per-row term.

A target linear keeps its class's behaviour and parameter paths (quantized ones included):
its class is swapped for a subclass whose `__call__` runs the original and then adds
`((x @ A^T) @ B'^T) * s` for every adapter the step uses, `s` being the rows' [B, 1, 1]
scale block ([1, T, 1] when the step's rows are packed). A step whose rows all sit at 0.0
adds nothing at all, so the forward is the base model's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models.lora import Adapter, LoraError, by_module, scale_blocks, validate

_LORA_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _LORA_CLASSES:

        def __call__(self, x):
            y = cls.__call__(self, x)
            return self._mlxcel_lora.add(self._mlxcel_lora_key, x, y)

        _LORA_CLASSES[cls] = type(f"Lora{cls.__name__}", (cls,), {"__call__": __call__})
    return _LORA_CLASSES[cls]


def _linear_shape(m: nn.Module) -> tuple[int, int] | None:
    if isinstance(m, nn.QuantizedLinear):
        out, packed = m.weight.shape
        return out, packed * 32 // m.bits
    if isinstance(m, nn.Linear):
        return tuple(m.weight.shape)
    return None


class MLXLoraTerms:
    """The adapters' terms on one model, and the step's per-adapter scale blocks."""

    def __init__(self, model: nn.Module, adapters: Sequence[Adapter], dtype) -> None:
        linears = {name: m for name, m in model.named_modules() if _linear_shape(m) is not None}
        shapes = {name: _linear_shape(m) for name, m in linears.items()}
        for adapter in adapters:
            validate(adapter, shapes)
        self.n = len(adapters)
        self._dtype = dtype
        self._terms = by_module(adapters, lambda a: mx.array(a).astype(dtype))
        self._step: dict[int, mx.array] = {}
        for name in self._terms:
            m = linears[name]
            if hasattr(m, "_mlxcel_lora"):
                raise LoraError(f"{name} already carries LoRA terms")
            m.__class__ = _lora_class(type(m))
            object.__setattr__(m, "_mlxcel_lora", self)
            object.__setattr__(m, "_mlxcel_lora_key", name)

    def begin(self, rows_scales, layout) -> None:
        """The step's scale blocks: [B, 1, 1], or [1, T, 1] over packed rows (base.RowLayout)."""
        self._step = {k: mx.array(layout.per_token(v.reshape(-1, 1, 1))).astype(self._dtype)
                      for k, v in scale_blocks(rows_scales, self.n).items()}

    def end(self) -> None:
        self._step = {}

    def add(self, key: str, x: mx.array, y: mx.array) -> mx.array:
        if not self._step:
            return y
        for k, at, bt in self._terms[key].terms:
            s = self._step.get(k)
            if s is not None:
                y = y + ((x @ at) @ bt) * s
        return y
