"""The per-layer hook point: functions that see (and may replace) a decoder layer's output.

Steering, monitoring and LoRA terms attach here. A hooked layer keeps its class's
behaviour and parameter paths: its class is swapped for a subclass whose `__call__`
runs the original and then the hooks in order, so weights, quantization and attribute
access (`layer.use_sliding`, ...) are untouched. With no hooks registered a layer costs
one empty-list check.
"""

from __future__ import annotations

from typing import Any, Callable

# (layer index, hidden states) -> hidden states; an mx.array on MLX, a torch.Tensor on torch.
# No tensor library is imported here, so either backend can share the registry.
LayerHook = Callable[[int, Any], Any]

_HOOKED_CLASSES: dict[type, type] = {}


def _hooked_class(cls: type) -> type:
    if cls not in _HOOKED_CLASSES:

        def __call__(self, x, *args, **kwargs):
            out = cls.__call__(self, x, *args, **kwargs)
            for hook in self._mlxcel_hooks.get(self._mlxcel_index, ()):
                out = hook(self._mlxcel_index, out)
            return out

        _HOOKED_CLASSES[cls] = type(f"Hooked{cls.__name__}", (cls,), {"__call__": __call__})
    return _HOOKED_CLASSES[cls]


class LayerHooks:
    """The hook registry of one model: layer index -> ordered hooks."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._hooks: dict[int, list[LayerHook]] = {}

    def add(self, layer: int, hook: LayerHook) -> Callable[[], None]:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        self._hooks.setdefault(layer, []).append(hook)

        def remove() -> None:
            hooks = self._hooks.get(layer, [])
            if hook in hooks:
                hooks.remove(hook)
            if not hooks:
                self._hooks.pop(layer, None)

        return remove

    def get(self, layer: int, default=()):
        return self._hooks.get(layer, default)


def install_hooks(model) -> LayerHooks:
    """Make every decoder layer of `model` a hook point; returns the registry."""
    layers = model.layers
    registry = LayerHooks(len(layers))
    for i, layer in enumerate(layers):
        layer.__class__ = _hooked_class(type(layer))
        object.__setattr__(layer, "_mlxcel_index", i)
        object.__setattr__(layer, "_mlxcel_hooks", registry)
    return registry
