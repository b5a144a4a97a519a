"""Memory decisions the CLI settles before the load thread starts, once the backend is chosen:
MLXCEL_WIRED_LIMIT (MLX's wired memory limit, Metal only), --check-tensors, and the memory
estimate: printed and exit 0 under --estimate-memory, checked against the device under
--fit on (the default), where a configuration that cannot fit is refused in one line.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from mlxcel.backends.select import Choice
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings

if TYPE_CHECKING:
    from mlxcel.runtime.served import Startup

log = logging.getLogger("mlxcel.server")

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def wired_limit_from(environ: Mapping[str, str]) -> int | None:
    """MLXCEL_WIRED_LIMIT, parsed (None when unset); applied on Metal or refused once the backend
    is chosen (apply_wired_limit)."""
    raw = environ.get("MLXCEL_WIRED_LIMIT")
    return parse_wired_limit(raw) if raw else None


def parse_wired_limit(raw: str) -> int:
    """MLXCEL_WIRED_LIMIT's value: bytes, or a size with K/M/G/T (powers of 1024)."""
    m = _SIZE.match(raw)
    if not m:
        raise StartupRefusal(f"MLXCEL_WIRED_LIMIT={raw!r}: expected a size in bytes, or with K, M, G or T (e.g. 24G)")
    return int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))


def apply_wired_limit(settings: ServerSettings, choice: Choice) -> None:
    """Set MLX's wired limit on Metal; refuse it anywhere else, saying why."""
    limit = settings.backend.wired_limit_bytes
    if limit is None:
        return
    if choice.backend != "mlx" or choice.device != "metal":
        raise StartupRefusal(f"MLXCEL_WIRED_LIMIT is set, but this server runs {choice.backend} on {choice.device}: a "
                             "wired limit pins MLX's buffers in Apple silicon's unified memory, which only the MLX "
                             "backend on Metal has; unset it")
    import mlx.core as mx

    mx.set_wired_limit(limit)
    log.info("MLX wired memory limit: %d MiB (MLXCEL_WIRED_LIMIT)", limit >> 20)


def check_tensors(settings: ServerSettings, path: Path) -> None:
    if not settings.engine.check_tensors:
        return
    from mlxcel.runtime.tensor_check import check_tensors as run

    report = run(path)
    if not report.ok:
        lines = report.lines()
        raise StartupRefusal(f"--check-tensors: {path.name} has {len(report.shape_problems) + len(report.bad_values)} "
                             f"bad tensor(s): {'; '.join(lines[:3])}" + ("; ..." if len(lines) > 3 else "")
                             + " (`mlxcel inspect --check-tensors` lists them all)")
    log.info("--check-tensors: %d tensors of %s checked, shapes and values ok%s", report.tensors, path.name,
             f" ({report.shapes_unchecked})" if report.shapes_unchecked else "")


def refuse_without_model(settings: ServerSettings, serving: str) -> None:
    """The memory options name one -m model; refuse them where none is loaded at startup."""
    asked = [name for name, on in (("--estimate-memory", settings.engine.estimate_memory),
                                   ("--check-tensors", settings.engine.check_tensors),
                                   ("MLXCEL_WIRED_LIMIT", settings.backend.wired_limit_bytes is not None)) if on]
    if asked:
        raise StartupRefusal(f"{asked[0]} applies to the -m generation model, and this server {serving}; drop it")


def plan_memory(settings: ServerSettings, path: Path, startup: Startup) -> None:
    """Everything above, in order, before any weight is read."""
    choice = startup.placement
    apply_wired_limit(settings, choice)
    check_tensors(settings, path)
    if not (settings.engine.estimate_memory or settings.engine.fit):
        return
    from mlxcel.runtime.estimate import available_bytes, check_fits, estimate, render
    from mlxcel.runtime.load import cache_budget_bytes

    spec = startup.speculative
    draft = spec.draft_model if spec is not None else None
    est = estimate(settings, path, choice, cache_budget_bytes(settings), draft)
    available, where = available_bytes(choice)
    if settings.engine.estimate_memory:
        sys.stdout.write("\n".join(render(est, available, where)) + "\n")
        sys.stdout.flush()
        raise SystemExit(0)
    warning = check_fits(est, available, where)
    if warning:
        log.warning("%s", warning)
