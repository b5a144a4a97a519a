"""One-row linears on the CPU through torch's matrix-vector kernel.

A single-stream decode step multiplies one activation row by every weight matrix. torch's
CPU `linear` sends that to its matrix-matrix path, which on bf16 reads the weights at well
under half the memory bandwidth (docs/benchmarks.md, "Torch CPU decode (round 3)");
`torch.mv` on the same [out, in] weight uses a dot-product kernel that streams each row
once. The modules stay `nn.Linear` (only the instance's `forward` changes), so anything
that finds linears by type or hooks them (LoRA terms, per-layer hooks) still sees them;
more than one row goes through `F.linear` as before.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _row_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.numel() != self.in_features:
        return F.linear(x, self.weight, self.bias)
    y = torch.mv(self.weight, x.reshape(-1))
    if self.bias is not None:
        y = y + self.bias
    return y.view(*x.shape[:-1], self.out_features)


def install_row_gemv(model: torch.nn.Module) -> int:
    """Give every plain nn.Linear of `model` the one-row path; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_row_forward, module)
            count += 1
    return count


def remove_row_gemv(model: torch.nn.Module) -> None:
    """Back to torch's own Linear.forward (benchmarks compare the two)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" in module.__dict__:
            del module.forward
