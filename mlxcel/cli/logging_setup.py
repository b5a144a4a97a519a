"""Where and how the server logs: the --log-* options, applied to Python's `logging`.

- Destination, highest first: --log-disable (no output at all), --log-file (the command line
  beats LLAMA_ARG_LOG_FILE, folded by the flag surface), else standard error (b10621's stream).
- A log file is validated and created while the command line is classified, before any model
  is resolved: a symbolic link, a directory, a missing parent directory, or a path that cannot
  be opened for append stops startup. The file is created 0600 and an existing file is
  tightened to 0600, so a log never ends up world-readable.
- Verbosity: -v beats --verbosity N (the command line beats LLAMA_ARG_LOG_VERBOSITY); b10621's
  threshold maps 0-1 to ERROR, 2 to WARNING, 3 to INFO, 4 and above to DEBUG.
- Every line passes a redaction pass: API keys (flags, key files, LLAMA_API_KEY) and the
  Hugging Face token are replaced by [redacted] in the fully formatted line.

Entry point: `configure_logging(settings)`; uvicorn must then run with `log_config=None` so its
loggers propagate here.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any

from mlxcel.config.refusal import StartupRefusal

REDACTED = "[redacted]"
_COLORS = {"E": "\033[31m", "W": "\033[33m", "D": "\033[90m"}
_RESET = "\033[0m"


def _open_append(path: Path) -> int:
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def prepare_log_file(path: Path) -> None:
    """Refuse an unusable --log-file destination; create it (0600) or tighten it to 0600."""
    if path.is_symlink():
        raise StartupRefusal(f"--log-file {path}: refusing a symbolic link")
    if path.is_dir():
        raise StartupRefusal(f"--log-file {path}: is a directory")
    if not path.parent.is_dir():
        raise StartupRefusal(f"--log-file {path}: parent directory {path.parent} does not exist")
    try:
        fd = _open_append(path)
    except OSError as e:
        raise StartupRefusal(f"--log-file {path}: cannot open for append ({e.strerror or e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StartupRefusal(f"--log-file {path}: not a regular file")
    finally:
        os.close(fd)


class RedactingFormatter(logging.Formatter):
    """Formats like llama.cpp's logger (optional timestamp, optional level tag) and redacts secrets."""

    def __init__(self, secrets: list[str], *, prefix: bool, timestamps: bool, colors: bool) -> None:
        super().__init__()
        self.secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
        self.prefix, self.timestamps, self.colors = prefix, timestamps, colors

    def redact(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, REDACTED)
        return text

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        parts = []
        if self.timestamps:
            parts.append(self.formatTime(record, "%Y-%m-%d %H:%M:%S") + f".{int(record.msecs):03d}")
        tag = record.levelname[:1]
        if self.prefix:
            parts.append(tag)
        line = " ".join(parts + [msg])
        if self.colors and tag in _COLORS:
            line = _COLORS[tag] + line + _RESET
        return self.redact(line)


def level_for(settings: Any) -> int:
    if settings.logging.verbose:
        return logging.DEBUG
    v = settings.logging.verbosity
    if v <= 1:
        return logging.ERROR
    if v == 2:
        return logging.WARNING
    if v == 3:
        return logging.INFO
    return logging.DEBUG


def configure_logging(settings: Any, *, stream=None) -> logging.Handler | None:
    """Install the one root handler the flags describe; returns it (None with --log-disable)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    if settings.logging.disable:
        root.addHandler(logging.NullHandler())
        root.setLevel(logging.CRITICAL + 1)
        return None
    if settings.logging.file is not None:
        prepare_log_file(Path(settings.logging.file))
        handler: logging.Handler = logging.StreamHandler(os.fdopen(_open_append(Path(settings.logging.file)), "a",
                                                                   buffering=1, encoding="utf-8"))
        is_tty = False
    else:
        stream = stream or sys.stderr
        handler = logging.StreamHandler(stream)
        is_tty = hasattr(stream, "isatty") and stream.isatty()
    colors = settings.logging.colors == "on" or (settings.logging.colors == "auto" and is_tty)
    handler.setFormatter(RedactingFormatter(settings.logging.secrets, prefix=settings.logging.prefix,
                                            timestamps=settings.logging.timestamps, colors=colors))
    level = level_for(settings)
    handler.setLevel(level)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "litestar"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    return handler
