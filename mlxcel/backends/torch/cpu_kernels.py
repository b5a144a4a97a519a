"""mlxcel's CPU kernels for the torch backend: one library, compiled once per machine.

kernels/cpu/ holds the sources: rows_linear.cpp (decode rows' bf16 / fp32 linears) and
bf16_tiles.cpp (prompt rows' bf16 linears on AMX tiles), which row_gemv.py wires,
quant_rows.cpp (few-row linears over MLX-quantized weights, quantized.py wires it), and
decode_ops.cpp (fused norms, RoPE and row-by-row attention, fused_ops.py wires them) with
kv_int8.cpp (that attention over int8 keys or values), sharing helpers.h. They are built
together with the system C++ compiler against the
installed torch (mlxcel/native_build.py), registered as `torch.ops.mlxcel_cpu.*`.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path

import torch

from mlxcel import native_build
from mlxcel.native_build import cpu_flags

KERNEL_DIR = Path(__file__).resolve().parents[3] / "kernels" / "cpu"
SOURCES = ("rows_linear.cpp", "bf16_tiles.cpp", "decode_ops.cpp", "quant_rows.cpp", "kv_int8.cpp")
HEADERS = ("amx.h", "helpers.h")


def build(environ: Mapping[str, str], timeout: float | None = native_build.COMPILE_TIMEOUT_S) -> Path:
    """Compile kernels/cpu for this CPU and torch unless cached (a compile past `timeout` goes
    on in the background); raises native_build.BuildUnavailable with the reason when it cannot
    be had."""
    from torch.utils import cpp_extension

    files = [KERNEL_DIR / name for name in SOURCES + HEADERS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise native_build.BuildUnavailable(f"the kernel sources {', '.join(missing)} are not installed")
    compiler = native_build.find_compiler(environ, "CXX", ("c++", "g++", "clang++"), "C++")
    lib_dir = cpp_extension.library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -march=native: the cache key carries this CPU's flags, so another CPU builds its own;
    # no contraction into fused multiply-adds, so decode_ops' RoPE rounds as torch's eager ops
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC", "-pthread", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    key = [*(f.read_bytes() for f in files), torch.__version__.encode(), compiler.encode(), " ".join(flags).encode(),
           " ".join(sorted(cpu_flags())).encode() or platform.processor().encode(), lib_dir.encode()]

    def command(out: str) -> list[str]:
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        return [compiler, *flags, *includes, *(str(KERNEL_DIR / s) for s in SOURCES), "-o", out, f"-L{lib_dir}",
                "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]

    cache = Path(environ["MLXCEL_KERNEL_CACHE"]) if environ.get("MLXCEL_KERNEL_CACHE") else \
        native_build.cache_root(environ) / "kernels"
    return native_build.build_cached(cache, "mlxcel-cpu-kernels", key, command, "mlxcel's CPU kernels", timeout)


def load(environ: Mapping[str, str], threads: int | None = None) -> tuple[Path, int]:
    """Build (or reuse) and load the library, the kernels splitting work over `threads` (default:
    torch's thread count; the first load in a process fixes it); returns its path and that
    count; raises native_build.BuildUnavailable."""
    path = build(environ)
    if not hasattr(torch.ops.mlxcel_cpu, "rows_linear"):
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise native_build.BuildUnavailable(f"loading {path} failed: {e}") from None
    threads = torch.get_num_threads() if threads is None else threads
    torch.ops.mlxcel_cpu.set_helpers(max(0, threads - 1))
    return path, threads
