"""Linear layers over oneDNN-packed bf16 weights, for CPU decode in bf16.

The linears are about 80% of a one-row decode step's CPU time, and torch's stock bf16
`linear` runs a few-row product well below the memory bandwidth; oneDNN's prepacked-weight
kernel (the one Inductor uses when it freezes a CPU graph) was 1.1x to 2x faster in
interleaved single-matmul runs on this (shared, loaded) 2-core machine, and 1.15x to 1.2x
on whole SmolLM2 decode steps (`python -m scripts.bench.torch_decode_profile --ab-packing`). The families' modules are kept: each `nn.Linear`
only has its class swapped for one whose forward calls the packed kernel when the input has
at most PACKED_MAX_ROWS rows. Up to there the packed kernel's bf16 results equal the stock
kernel's bit for bit (measured); above it they can differ in the last place, so bigger
inputs (prefill chunks) keep the stock kernel and a prompt-cache hit still reproduces a cold
prefill exactly. The dense weight therefore stays: packing costs one more copy of the
linear weights in memory.
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_MAX_ROWS = 16


class PackedLinear(nn.Linear):
    """An nn.Linear with a second copy of its weight in oneDNN's blocked bf16 layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] > PACKED_MAX_ROWS:
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU whose oneDNN build has bf16 kernels."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Swap every bf16 nn.Linear of `model` for a PackedLinear; returns how many were packed."""
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.dtype != torch.bfloat16:
            continue
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
        module.__class__ = PackedLinear
        module.packed = packed
        count += 1
    return count
