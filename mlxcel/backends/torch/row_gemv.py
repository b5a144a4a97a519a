"""The language model's linears on the CPU, chosen by what a row is.

A decode step multiplies one activation row per sequence by every weight matrix, so its cost
is reading the weights. torch's CPU `linear` reads bf16 weights well under the memory bandwidth
for a few rows; mlxcel's own kernel (kernels/cpu/rows_linear.cpp) reads them faster (a decode
token's products: 12.4 GB/s against torch.mv's 8.9 on an AVX512-BF16 CPU, docs/benchmarks.md).
Its sums run in another order than torch's, so a row's last bits differ between the paths; to
keep a sequence's tokens independent of what shares its step, the path follows what a row *is*:
every decode row (`ForwardRow.decode`) takes the row kernel, alone, beside other decode rows, or
inside a packed step beside a prefill chunk.
The backend says which rows those are around each forward (`RowRouting.rows`).

Prompt rows take mlxcel's AMX tile kernel where the CPU has one (kernels/cpu/bf16_tiles.cpp):
torch's bf16 `linear` gives a row other bits when the call holds another number of rows, so a
prompt prefilled whole and the same prompt after a cached prefix got different KV; the tile
kernel's rows do not depend on the call's shape (about torch's time up to ~64 rows, 1.3-1.6x it
at 512; docs/benchmarks.md). Without AMX prompt rows keep torch's `linear`.

The modules stay `nn.Linear` (only the instance's `forward` changes), so anything that finds
linears by type or hooks them (LoRA terms, per-layer hooks) still sees them. The row kernel takes
fp32 weights too (the CPU default without AMX tiles, where torch runs a one-row fp32
product on one thread; docs/benchmarks.md). In fp32 a call of up to FEW_ROWS rows (a short
prompt chunk, a step's last tokens for the LM head, a small packed step) takes the row kernel
whatever its rows are: torch's fp32 GEMM ran 1.2-2.4x slower than it for 8-32 rows there, and as
fast at 64 (SmolLM2's products on an AVX2 CPU); a prompt token's fp32 bits already depended on
its chunk's size, and a decode row's stay the kernel's. Larger fp32 calls keep torch's `linear`.
Without the kernels (no compiler) a one-row input runs `torch.mv` (`addmv` with a bias), which
gave torch's `linear` bits for that row in bf16 here (tested) and reads bf16 faster.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mlxcel.backends.torch import cpu_kernels

RowOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
ALL = "all"  # RowRouting.rows: every row of the input is a decode row
FEW_ROWS = 32  # fp32 calls of up to this many rows take the row kernel, prompt rows too


@dataclass(frozen=True)
class RowKernel:
    op: RowOp  # (x [.., in], weight [out, in], bias [out] or None) -> [.., out], bf16 or fp32, row by row
    prompt: RowOp | None  # the same for prompt rows (AMX tiles), None where the CPU has no AMX
    path: Path
    threads: int  # the calling thread plus the kernel's own helpers


class RowRouting:
    """Which rows of the current forward's flattened [tokens, in] input are decode rows: None
    (none: torch's linear), ALL, or a LongTensor of row indices."""

    def __init__(self, kernel: RowKernel | None) -> None:
        self.kernel = kernel
        self.rows: torch.Tensor | str | None = None

    @contextmanager
    def decode_rows(self, rows: torch.Tensor | str | None):
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None


def prompt_tiles(kernel: RowKernel | None, dtype: torch.dtype) -> RowOp | None:
    """The AMX tile op that runs prompt rows of `dtype` weights, if any (the tiles take bf16 only)."""
    return kernel.prompt if kernel is not None and dtype == torch.bfloat16 else None


def few_rows(kernel: RowKernel | None, dtype: torch.dtype) -> int:
    """How many rows a call of `dtype` weights may have and still take the row kernel whatever
    its rows are: FEW_ROWS in fp32 (torch's GEMM is slower there), else 0."""
    return FEW_ROWS if kernel is not None and dtype == torch.float32 else 0


def prompt_linears(kernel: RowKernel | None, dtype: torch.dtype) -> str:
    """What runs prompt rows' linears of `dtype` weights, in the startup log's words."""
    if prompt_tiles(kernel, dtype) is not None:
        return "mlxcel AMX tiles"
    return f"mlxcel row kernel up to {FEW_ROWS} rows, torch above" if few_rows(kernel, dtype) else "torch"


def _mv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # addmv adds the bias before rounding, as linear does (mv + bias would round twice)
    y = torch.mv(weight, x.reshape(-1)) if bias is None else torch.addmv(bias, weight, x.reshape(-1))
    return y.view(*x.shape[:-1], weight.shape[0])


def _row_forward(module: torch.nn.Linear, routing: RowRouting, kernel: bool):
    """The instance forward of one linear; weight and bias are read once here (a step calls
    ~200 of these, and each module attribute lookup costs a microsecond)."""
    weight, bias, in_features, out_features = module.weight, module.bias, module.in_features, module.out_features
    k = routing.kernel if kernel else None
    op = k.op if k is not None else None
    prompt = prompt_tiles(k, weight.dtype)
    few = few_rows(k, weight.dtype) * in_features or -1  # in elements; -1: no call is few enough

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = routing.rows if kernel else None
        if rows is None:
            if prompt is not None:
                return prompt(x, weight, bias)
            if x.numel() <= few:
                return op(x, weight, bias)
            if x.numel() == in_features:
                return _mv(x, weight, bias)
            return F.linear(x, weight, bias)
        if isinstance(rows, str) or x.numel() <= few:
            return op(x, weight, bias)
        y = F.linear(x, weight, bias) if prompt is None else prompt(x, weight, bias)
        y.view(-1, out_features)[rows] = op(x.reshape(-1, in_features)[rows], weight, bias)
        return y

    return forward


def install_row_gemv(kernel: RowKernel | None, *roots: torch.nn.Module) -> RowRouting:
    """Give every plain nn.Linear under `roots` the decode-row path (mlxcel's kernel where the
    weight is bf16 or fp32 and a kernel is given; torch.mv for one row otherwise); returns the routing
    the backend sets per forward."""
    routing = RowRouting(kernel)
    for root in roots:
        for module in root.modules():
            if type(module) is torch.nn.Linear:
                fits = (kernel is not None and module.weight.dtype in (torch.bfloat16, torch.float32)
                        and module.weight.is_contiguous())
                module.forward = _row_forward(module, routing, fits)
    return routing


def remove_row_gemv(*roots: torch.nn.Module) -> None:
    """Back to torch's own Linear.forward (benchmarks compare the two)."""
    for root in roots:
        for module in root.modules():
            if type(module) is torch.nn.Linear and "forward" in module.__dict__:
                del module.forward


def load_row_kernel(environ: Mapping[str, str], threads: int | None = None, prompt: bool = True) -> RowKernel:
    """Build (or reuse) and load the kernels, splitting each product over `threads` (default:
    torch's thread count; the first load in a process fixes it), with the prompt rows' tile
    kernel when `prompt` and the CPU has AMX; raises native_build.BuildUnavailable."""
    path, threads = cpu_kernels.load(environ, threads)
    ops = torch.ops.mlxcel_cpu
    return RowKernel(ops.rows_linear, ops.tiles_linear if prompt and ops.tiles_available() else None, path, threads)
