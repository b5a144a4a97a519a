"""One-row linears on the CPU: the single-stream decode step's weight reads.

A single-stream decode step multiplies one activation row by every weight matrix, so its cost
is reading the weights. torch's CPU `linear` sends that to its matrix-matrix path, which in
bf16 reads the weights well under the memory bandwidth; `torch.mv` on the same [out, in]
weight does better, and mlxcel's own kernel (kernels/cpu/bf16_rows.cpp, built once per machine
with the system C++ compiler against the installed torch) better still (docs/benchmarks.md,
"Torch CPU decode", rounds 3 and 6). The modules stay `nn.Linear` (only the instance's
`forward` changes), so anything that finds linears by type or hooks them (LoRA terms, per-layer
hooks) still sees them; more than one row goes through `F.linear` as before.
"""

from __future__ import annotations

import platform
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from mlxcel import native_build

KERNEL_SOURCE = Path(__file__).resolve().parents[3] / "kernels" / "cpu" / "bf16_rows.cpp"

RowOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class RowKernel:
    op: RowOp  # (x [.., in] holding one row, weight [out, in], bias [out] or None) -> [.., out], bf16
    path: Path
    threads: int  # the calling thread plus the kernel's own helpers


def _mv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.mv(weight, x.reshape(-1))
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def _row_forward(self: torch.nn.Linear, x: torch.Tensor, op: RowOp) -> torch.Tensor:
    if x.numel() != self.in_features:
        return F.linear(x, self.weight, self.bias)
    return op(x, self.weight, self.bias)


def install_row_gemv(model: torch.nn.Module, kernel: RowKernel | None = None) -> int:
    """Give every plain nn.Linear of `model` the one-row path (mlxcel's kernel for bf16 weights
    when one is given, torch.mv otherwise); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            fits = kernel is not None and module.weight.dtype == torch.bfloat16 and module.weight.is_contiguous()
            module.forward = types.MethodType(partial(_row_forward, op=kernel.op if fits else _mv), module)
            count += 1
    return count


def remove_row_gemv(model: torch.nn.Module) -> None:
    """Back to torch's own Linear.forward (benchmarks compare the two)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" in module.__dict__:
            del module.forward


def _cpu_flags() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()


def build_row_kernel(environ: Mapping[str, str]) -> Path:
    """Compile kernels/cpu/bf16_rows.cpp for this CPU and torch unless cached; raises
    native_build.BuildUnavailable with the reason when it cannot be had."""
    from torch.utils import cpp_extension

    if not KERNEL_SOURCE.is_file():
        raise native_build.BuildUnavailable(f"the kernel source {KERNEL_SOURCE} is not installed")
    compiler = native_build.find_compiler(environ, "CXX", ("c++", "g++", "clang++"), "C++")
    lib_dir = cpp_extension.library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -march=native: the cache key carries this CPU's flags, so another CPU builds its own
    flags = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-pthread", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    key = [KERNEL_SOURCE.read_bytes(), torch.__version__.encode(), compiler.encode(), " ".join(flags).encode(),
           _cpu_flags(), lib_dir.encode()]

    def command(out: str) -> list[str]:
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        return [compiler, *flags, *includes, str(KERNEL_SOURCE), "-o", out, f"-L{lib_dir}", "-lc10", "-ltorch_cpu",
                f"-Wl,-rpath,{lib_dir}"]

    cache = Path(environ["MLXCEL_KERNEL_CACHE"]) if environ.get("MLXCEL_KERNEL_CACHE") else \
        native_build.cache_root(environ) / "kernels"
    return native_build.build_cached(cache, "mlxcel-bf16-rows", key, command, "the bf16 row kernel")


def load_row_kernel(environ: Mapping[str, str], threads: int | None = None) -> RowKernel:
    """Build (or reuse) and load the kernel, splitting each product over `threads` (default:
    torch's thread count; the first load in a process fixes it); raises
    native_build.BuildUnavailable."""
    path = build_row_kernel(environ)
    if not hasattr(torch.ops.mlxcel_cpu, "rows_linear"):
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise native_build.BuildUnavailable(f"loading {path} failed: {e}") from None
    threads = torch.get_num_threads() if threads is None else threads
    torch.ops.mlxcel_cpu.set_helpers(max(0, threads - 1))
    return RowKernel(torch.ops.mlxcel_cpu.rows_linear, path, threads)
