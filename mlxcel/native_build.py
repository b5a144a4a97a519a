"""Compiling mlxcel's small native pieces once per machine, into a cache folder.

Two pieces are built on the user's machine rather than shipped: the BLAS shim under MLX's CPU
matmuls (backends/mlx/blas.py) and the torch backend's CPU kernels (kernels/cpu/,
backends/torch/cpu_kernels.py). Both are compiled with the system compiler the first time they
are needed, keyed by everything that changes the binary, and renamed into place so a concurrent
start never loads a half-written file. Callers pass the environment mapping in; nothing here
reads os.environ.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from mlxcel.config.paths import xdg_cache_dir

COMPILE_TIMEOUT_S = 180
_PR_SET_PDEATHSIG = 1

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


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo's `flags`, or `Features` on arm64); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cache_root(environ: Mapping[str, str]) -> Path:
    """$XDG_CACHE_HOME/mlxcel, else ~/.cache/mlxcel."""
    return xdg_cache_dir(environ)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers(out_dir: Path) -> list[Path]:
    """Remove half-written outputs of compiles whose process is gone (a server killed mid-build)."""
    removed = []
    for path in out_dir.glob(".build-*.so"):
        m = re.match(r"\.build-(\d+)-", path.name)
        if m is None or not _alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _die_with_parent() -> None:
    # the compiler is killed with the process that started it, even by SIGKILL (Linux only)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _finish(proc: subprocess.Popen, tmp: str, target: Path, what: str) -> str | None:
    """Wait for the compiler; the installed library's path, or the first error line."""
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        os.unlink(tmp)
        errors = [ln for ln in stderr.splitlines() if "error" in ln] or stderr.strip().splitlines()
        return f"compiling {what} failed (exit {proc.returncode}): {(errors or ['no output'])[0]}"
    os.replace(tmp, target)
    return None


def _background(proc: subprocess.Popen, tmp: str, target: Path, what: str) -> None:
    error = _finish(proc, tmp, target, what)
    if error:
        log.warning("%s", error)
    else:
        log.info("%s finished compiling in the background into %s; the next start uses it", what, target)


def build_cached(out_dir: Path, stem: str, key: Sequence[bytes], command: Callable[[str], list[str]],
                 what: str, timeout: float | None = COMPILE_TIMEOUT_S) -> Path:
    """The library `command(output_path)` builds, reused while `key` is unchanged.

    A compile past `timeout` raises BuildUnavailable but keeps running in the background and
    installs its result when done, so a slow machine's work is not lost; None waits as long as
    it takes (the install)."""
    digest = hashlib.sha256(b"\0".join(key)).hexdigest()[:16]
    target = out_dir / f"{stem}-{digest}.so"
    if target.is_file():
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildUnavailable(f"cannot create the build cache {out_dir}: {e}") from None
    for path in sweep_leftovers(out_dir):
        log.info("removed %s, left by a compile that was killed", path.name)
    fd, tmp = tempfile.mkstemp(prefix=f".build-{os.getpid()}-", suffix=".so", dir=out_dir)
    os.close(fd)
    # said before the wait: `mlxcel build-kernels` (run by the install) leaves nothing to do here
    log.info("compiling %s for this machine (once; up to a few minutes) into %s", what, out_dir)
    try:
        proc = subprocess.Popen(command(tmp), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    except OSError as e:
        os.unlink(tmp)
        raise BuildUnavailable(f"compiling {what} failed: {e}") from None
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        threading.Thread(target=_background, args=(proc, tmp, target, what), daemon=True,
                         name="mlxcel-compile").start()
        raise BuildUnavailable(f"compiling {what} is taking over {timeout:.0f} s; it goes on in the background "
                               "and the next start uses it (or run `mlxcel build-kernels` now)") from None
    except BaseException:
        proc.kill()
        proc.wait()
        os.unlink(tmp)
        raise
    error = _finish(proc, tmp, target, what)
    if error:
        raise BuildUnavailable(error)
    return target
