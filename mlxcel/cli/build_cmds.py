"""`mlxcel build-kernels`: compile mlxcel's native pieces for this machine now, so a started
server finds them cached and compiles nothing. The install (`make serve`, `make test`) runs it.

It builds what this machine can use: the torch backend's CPU kernels where torch is installed,
and on Linux the OpenBLAS shim under MLX's CPU matrix products. A piece that cannot be built
(no compiler, say) is reported and skipped; the server then runs the slower fallback and says
why, as it would without this step.
"""

from __future__ import annotations

import argparse
import os
import sys

from mlxcel import native_build


def add_parser(sub) -> None:
    p = sub.add_parser("build-kernels", help="compile the torch CPU kernels and the MLX BLAS shim for this machine "
                                             "(cached per machine; the install runs it)")
    p.set_defaults(func=run)


def _torch_kernels() -> str:
    try:
        from mlxcel.backends.torch import cpu_kernels
    except ImportError:
        return "skipped: torch is not installed"
    try:
        return f"built: {cpu_kernels.build(os.environ, timeout=None)}"
    except native_build.BuildUnavailable as e:
        return f"not built ({e}); the torch backend will use torch's own kernels"


def _blas_shim() -> str:
    if sys.platform != "linux":
        return f"skipped: {sys.platform} needs no shim"
    from mlxcel.backends.mlx import blas

    try:
        shim = blas.build_shim(blas.find_openblas(), blas.find_compiler(os.environ), blas.cache_dir(os.environ),
                               timeout=None)
    except blas.BlasUnavailable as e:
        return f"not built ({e}); MLX's CPU products will use its bundled BLAS"
    return f"built: {shim}"


def run(args: argparse.Namespace) -> int:
    print(f"torch CPU kernels: {_torch_kernels()}", flush=True)
    print(f"BLAS shim: {_blas_shim()}", flush=True)
    return 0
