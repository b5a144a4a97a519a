"""Compiling mlxcel's small native pieces once per machine, into a cache folder.

Two pieces are built on the user's machine rather than shipped: the BLAS shim under MLX's CPU
matmuls (backends/mlx/blas.py) and the torch backend's CPU kernels (kernels/cpu/,
backends/torch/cpu_kernels.py). Both are compiled with the system compiler the first time they
are needed, keyed by everything that changes the binary, and renamed into place so a concurrent
start never loads a half-written file. Callers pass the environment mapping in; nothing here
reads os.environ.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

COMPILE_TIMEOUT_S = 180

log = logging.getLogger("mlxcel.native")


class BuildUnavailable(Exception):
    """The piece cannot be built here; the message is the one-line reason."""


def find_compiler(environ: Mapping[str, str], variable: str = "CC",
                  names: Sequence[str] = ("cc", "gcc", "clang"), language: str = "C") -> str:
    """$variable if set, else the first of `names` on PATH."""
    candidates = ([environ[variable]] if environ.get(variable) else []) + list(names)
    for name in candidates:
        path = shutil.which(name, path=environ.get("PATH"))
        if path:
            return path
    raise BuildUnavailable(f"no {language} compiler found (tried {', '.join(['$' + variable, *names])})")


def cache_root(environ: Mapping[str, str]) -> Path:
    """$XDG_CACHE_HOME/mlxcel, else ~/.cache/mlxcel."""
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or tempfile.gettempdir()) / ".cache")
    return Path(base) / "mlxcel"


def build_cached(out_dir: Path, stem: str, key: Sequence[bytes], command: Callable[[str], list[str]],
                 what: str) -> Path:
    """The library `command(output_path)` builds, reused while `key` is unchanged."""
    digest = hashlib.sha256(b"\0".join(key)).hexdigest()[:16]
    target = out_dir / f"{stem}-{digest}.so"
    if target.is_file():
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildUnavailable(f"cannot create the build cache {out_dir}: {e}") from None
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    # said before the wait: `mlxcel build-kernels` (run by the install) leaves nothing to do here
    log.info("compiling %s for this machine (once; up to a few minutes) into %s", what, out_dir)
    try:
        proc = subprocess.run(command(tmp), capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise BuildUnavailable(f"compiling {what} failed: {e}") from None
    if proc.returncode != 0:
        os.unlink(tmp)
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.strip().splitlines()
        raise BuildUnavailable(f"compiling {what} failed (exit {proc.returncode}): {(errors or ['no output'])[0]}")
    os.replace(tmp, target)
    return target
