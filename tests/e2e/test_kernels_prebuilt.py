"""The install builds mlxcel's native pieces (`mlxcel build-kernels`, run by `make`), so a
started server finds them cached and compiles nothing; a compile that is still needed is
announced before it starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mlxcel import native_build
from tests.conftest import DEFAULT_MODEL, ServerProcess, fixture_path


def build_kernels(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-m", "mlxcel.cli.main", "build-kernels"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_server_after_build_kernels_compiles_nothing():
    fixture_path(DEFAULT_MODEL)
    report = build_kernels(dict(os.environ))  # what the install ran: cached, so this returns at once
    assert "torch CPU kernels: built: " in report, report
    t0 = time.monotonic()
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "--backend", "torch", "--device", "cpu"])
    try:
        started = time.monotonic() - t0
        log = server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    assert "compiling" not in log, log
    assert "mlxcel row kernel" in log, log  # the kernels were loaded, from the cache
    print(f"process start to /health 200: {started:.1f} s")


def test_a_needed_compile_is_announced_first(tmp_path, caplog):
    def command(out: str) -> list[str]:
        return [sys.executable, "-c", f"open({out!r}, 'w').write('x')"]

    caplog.set_level("INFO", logger="mlxcel.native")
    path = native_build.build_cached(tmp_path, "piece", [b"key"], command, "a test piece")
    assert path.is_file() and path.parent == tmp_path
    assert [r.getMessage() for r in caplog.records if "compiling a test piece" in r.getMessage()]
    caplog.clear()
    assert native_build.build_cached(tmp_path, "piece", [b"key"], command, "a test piece") == path
    assert not caplog.records  # cached: nothing compiled, nothing said
