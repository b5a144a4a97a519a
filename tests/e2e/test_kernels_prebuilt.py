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


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


def test_a_killed_build_takes_its_compiler_along_and_leaves_nothing_behind(tmp_path, caplog):
    pid_file = tmp_path / "compiler.pid"
    slow = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = ("import sys; from pathlib import Path; from mlxcel import native_build\n"
              f"native_build.build_cached(Path({str(tmp_path / 'cache')!r}), 'piece', [b'k'], "
              f"lambda out: [sys.executable, '-c', {slow!r}], 'a test piece')")
    server = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 60
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline and server.poll() is None
        time.sleep(0.05)
    compiler = int(pid_file.read_text())
    assert list((tmp_path / "cache").glob(".build-*.so"))  # the half-written output
    server.kill()
    server.wait()
    deadline = time.monotonic() + 10
    while not _gone(compiler):
        assert time.monotonic() < deadline, "the compiler outlived the killed server"
        time.sleep(0.05)

    caplog.set_level("INFO", logger="mlxcel.native")
    fast = [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write('x')"]
    path = native_build.build_cached(tmp_path / "cache", "piece", [b"k"], lambda out: [*fast, out], "a test piece")
    assert path.read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [path.name]
    assert any("left by a compile that was killed" in r.getMessage() for r in caplog.records)


def test_a_compile_past_its_limit_finishes_in_the_background(tmp_path):
    cmd = "import sys, time; time.sleep(1.5); open(sys.argv[1], 'w').write('done')"

    def command(out: str) -> list[str]:
        return [sys.executable, "-c", cmd, out]

    try:
        native_build.build_cached(tmp_path, "piece", [b"k"], command, "a test piece", timeout=0.2)
    except native_build.BuildUnavailable as e:
        assert "goes on in the background" in str(e)
    else:
        raise AssertionError("a compile past its limit returned a library")
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("piece-*.so")):
        assert time.monotonic() < deadline, "the background compile never installed its library"
        time.sleep(0.05)
    # the finished build is kept: the next start reuses it without compiling
    again = native_build.build_cached(tmp_path, "piece", [b"k"], lambda out: ["false"], "a test piece", timeout=0.2)
    assert again.read_text() == "done"
