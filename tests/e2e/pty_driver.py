"""A command on a pseudo-terminal, driven as a user types (for the interactive chat tests)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import termios
import time


class PtySession:
    def __init__(self, argv: list[str], cwd, env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, with the pty as its terminal
            os.chdir(cwd)
            os.execve(argv[0], argv, env)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal with a size
        self.buffer = b""

    def read_until(self, pattern: bytes, timeout: float) -> bytes:
        """Everything up to the end of the first match of `pattern`, consumed."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.buffer, re.DOTALL)
            if m:
                out, self.buffer = self.buffer[: m.end()], self.buffer[m.end():]
                return out
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {pattern!r} within {timeout} s; the terminal shows:\n{self.buffer[-3000:]!r}")
            if select.select([self.fd], [], [], 0.5)[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise EOFError(f"the command ended; the terminal shows:\n{self.buffer[-3000:]!r}")
                self.buffer += chunk

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = 0
                return os.waitstatus_to_exitcode(status)
            try:  # keep the terminal drained, so the child never blocks writing to it
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.buffer += os.read(self.fd, 4096)
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"the command did not end within {timeout} s")

    def __enter__(self) -> PtySession:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pid:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        os.close(self.fd)
