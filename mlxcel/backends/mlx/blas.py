"""Routing MLX's CPU matmuls to OpenBLAS on Linux.

MLX's Linux wheel links a bundled reference BLAS (mlx_cpu.libs/libblas-*.so), and its CPU
backend reaches BLAS only through cblas_sgemm, cblas_dgemm and cblas_cgemm. The reference
sgemm has no blocking or vectorisation worth the name, so an 8-row decode step costs nearly
eight 1-row steps. This module builds a tiny C shim (blas_shim/shim.c) that defines those
three symbols on top of OpenBLAS from the scipy-openblas32 wheel, and loads it into the
process's global symbol scope. libmlx.so binds its cblas_* references when it is loaded,
searching the global scope before its own dependencies, so the shim must be loaded before
the first `import mlx.core`; afterwards interposition is impossible and we say so.

The shim is compiled once per (source, OpenBLAS library, compiler) with the system C compiler
into a cache folder (mlxcel/native_build.py). Without a compiler or the wheel, the reference
BLAS stays and the caller logs the one-line reason; `MLXCEL_BLAS=openblas` turns that fallback
into a refusal.

Modes (the CLI passes the environment mapping in; nothing here reads os.environ):
  auto       Linux: use the shim when it can be built, else the reference BLAS (default)
  openblas   Linux: use the shim or refuse to start
  reference  leave MLX's own BLAS alone
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mlxcel import native_build

MODES = ("auto", "openblas", "reference")
SHIM_SOURCE = Path(__file__).with_name("blas_shim") / "shim.c"
# scipy-openblas32's exported names all carry this prefix (scipy_cblas_sgemm, ...).
OPENBLAS_PREFIX = "scipy_"
# OpenBLAS's own thread pool fights MLX's CPU stream thread for the cores: on 2 cores a
# 576x1536 product took 15-30 ms with 2 OpenBLAS threads against 0.3-0.9 ms with one.
OPENBLAS_THREADS = 1

# Handles kept for the life of the process: dlclose on a shim MLX is bound to would crash.
_loaded: dict[str, ctypes.CDLL] = {}


class BlasUnavailable(Exception):
    """The shim cannot be built or loaded; the message is the one-line reason."""


class BlasRefusal(Exception):
    """A configuration we refuse (bad MLXCEL_BLAS value, or `openblas` that cannot be had)."""


@dataclass(frozen=True)
class BlasStatus:
    active: bool
    detail: str  # one line for the log: what runs MLX's matmuls, and why
    warn: bool = False  # the fallback to the slow reference BLAS, worth a warning


@dataclass(frozen=True)
class OpenBLAS:
    library: Path
    include_dir: Path
    version: str


def find_openblas() -> OpenBLAS:
    try:
        import scipy_openblas32
    except ImportError as e:
        raise BlasUnavailable(f"the scipy-openblas32 wheel is not installed ({e})") from None
    lib = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    if not lib.is_file():
        raise BlasUnavailable(f"scipy-openblas32 has no library at {lib}")
    return OpenBLAS(lib, Path(scipy_openblas32.get_include_dir()), scipy_openblas32.__version__)


def find_compiler(environ: Mapping[str, str]) -> str:
    try:
        return native_build.find_compiler(environ)
    except native_build.BuildUnavailable as e:
        raise BlasUnavailable(str(e)) from None


def cache_dir(environ: Mapping[str, str]) -> Path:
    if environ.get("MLXCEL_BLAS_CACHE"):
        return Path(environ["MLXCEL_BLAS_CACHE"])
    return native_build.cache_root(environ) / "blas"


def build_shim(openblas: OpenBLAS, compiler: str, out_dir: Path,
               timeout: float | None = native_build.COMPILE_TIMEOUT_S) -> Path:
    """Compile the shim unless an identical build is cached; returns the .so path."""
    st = openblas.library.stat()
    key = [SHIM_SOURCE.read_bytes(), str(openblas.library).encode(), str(st.st_size).encode(),
           str(st.st_mtime_ns).encode(), compiler.encode(), OPENBLAS_PREFIX.encode()]

    def command(out: str) -> list[str]:
        return [compiler, "-O2", "-shared", "-fPIC", f"-DOB_PREFIX={OPENBLAS_PREFIX}", "-o", out,
                str(SHIM_SOURCE), str(openblas.library), f"-Wl,-rpath,{openblas.library.parent}"]

    try:
        return native_build.build_cached(out_dir, "mlxcel-blas-shim", key, command, "the BLAS shim", timeout)
    except native_build.BuildUnavailable as e:
        raise BlasUnavailable(str(e)) from None


def load_shim(shim: Path, openblas: OpenBLAS, threads: int = OPENBLAS_THREADS) -> str:
    """Put the shim's cblas_* in the global scope; returns OpenBLAS's core name."""
    if "mlx.core" in sys.modules:
        raise BlasUnavailable("mlx.core was imported before the BLAS shim could be loaded")
    try:
        ob = ctypes.CDLL(str(openblas.library), mode=ctypes.RTLD_GLOBAL)
        _loaded["shim"] = ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise BlasUnavailable(f"loading the BLAS shim failed: {e}") from None
    _loaded["openblas"] = ob
    getattr(ob, f"{OPENBLAS_PREFIX}openblas_set_num_threads")(ctypes.c_int(threads))
    corename = getattr(ob, f"{OPENBLAS_PREFIX}openblas_get_corename")
    corename.restype = ctypes.c_char_p
    return (corename() or b"?").decode()


def shim_calls() -> dict[str, int] | None:
    """Products routed through the loaded shim so far (None when none is loaded)."""
    shim = _loaded.get("shim")
    if shim is None:
        return None
    fn = shim.mlxcel_blas_shim_calls
    fn.restype = ctypes.c_ulong
    return {name: fn(i) for i, name in enumerate(("sgemm", "dgemm", "cgemm", "sgemv_path"))}


def ensure_fast_blas(environ: Mapping[str, str], platform: str = sys.platform) -> BlasStatus:
    """Activate the OpenBLAS shim per MLXCEL_BLAS; call before anything imports mlx.core.

    Returns what will run MLX's CPU matmuls; raises BlasRefusal for a bad MLXCEL_BLAS value
    or for `openblas` mode when the shim cannot be had. Idempotent.
    """
    mode = environ.get("MLXCEL_BLAS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise BlasRefusal(f"MLXCEL_BLAS={environ['MLXCEL_BLAS']!r} is not one of {', '.join(MODES)}")
    if mode == "reference":
        return BlasStatus(False, "BLAS: MLX's bundled BLAS (MLXCEL_BLAS=reference)")
    if platform != "linux":
        if mode == "openblas":
            raise BlasRefusal(f"MLXCEL_BLAS=openblas applies to Linux only, not {platform}")
        return BlasStatus(False, f"BLAS: MLX's own ({platform} needs no shim)")
    if "shim" in _loaded:
        return BlasStatus(True, "BLAS: OpenBLAS shim already loaded")
    try:
        openblas = find_openblas()
        shim = build_shim(openblas, find_compiler(environ), cache_dir(environ))
        core = load_shim(shim, openblas)
    except BlasUnavailable as e:
        if mode == "openblas":
            raise BlasRefusal(f"MLXCEL_BLAS=openblas but {e}") from None
        return BlasStatus(False, f"BLAS: MLX's bundled reference BLAS, matmuls will be slow: {e}", warn=True)
    return BlasStatus(True, f"BLAS: OpenBLAS {openblas.version} ({core}, {OPENBLAS_THREADS} thread) "
                            f"via {shim}")
