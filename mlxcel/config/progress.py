"""Progress of long work (downloads, conversions, model loads): a bar on a terminal, plain
lines everywhere else.

On a terminal (standard error is a TTY) a tqdm bar redraws in place. Anywhere else (a log file,
a pipe, a service manager's journal) redrawing would fill the file with carriage returns, so
the same progress goes out through logging as whole lines: one when the work starts, at most
one every `PLAIN_INTERVAL_S` seconds while it runs, and one when it ends. Nothing is drawn when
the `mlxcel.progress` logger is off for INFO (--log-disable, a low --verbosity).

Entry points: `Progress` (one task, used as a context manager) and `tqdm_class()` (the class to
hand a library that draws its own bars, such as huggingface_hub's downloads).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm as auto_tqdm

log = logging.getLogger("mlxcel.progress")

PLAIN_INTERVAL_S = 10.0
# a log line has no bar (tqdm uses its count-only format when the total is unknown)
PLAIN_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def on_terminal(stream: TextIO | None = None) -> bool:
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def enabled() -> bool:
    return log.isEnabledFor(logging.INFO)


class _Discard:
    """tqdm's file when the lines go to logging: what it writes itself ('\\r', '\\n') is dropped."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


class LineTqdm(auto_tqdm):
    """tqdm that logs its status as whole lines, rate-limited, and never redraws."""

    def __init__(self, *args: Any, interval: float = PLAIN_INTERVAL_S, **kwargs: Any) -> None:
        self._interval, self._last_line, self._closing, self._last_n = interval, None, False, None
        kwargs.pop("name", None)  # huggingface_hub's own subclass takes a name; plain tqdm refuses it
        kwargs.setdefault("bar_format", PLAIN_FORMAT)
        kwargs.update(file=_Discard(), ascii=True, ncols=None, dynamic_ncols=False, position=None)
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "" or (msg is None and self._last_line is None and not self.n and not self.postfix):
            return True  # tqdm clearing its line, or its opening 0% (the caller says what starts)
        now = time.monotonic()
        if not self._closing and self._last_line is not None and now - self._last_line < self._interval:
            return True
        if self._closing and self._last_n == self.n:  # the last line already said it
            return True
        self._last_line, self._last_n = now, self.n
        line = (str(self) if msg is None else msg).strip()
        if line:
            log.info("%s", line)
        return True

    def clear(self, *args: Any, **kwargs: Any) -> None:
        pass

    def emit(self) -> None:
        """A line now, whatever the interval (a new stage starts)."""
        self._last_line = self._last_n = None
        self.display()

    def close(self) -> None:
        self._closing = True
        super().close()


def tqdm_class(stream: TextIO | None = None) -> type | None:
    """What to pass as a library's `tqdm_class`: None (its own bar) on a terminal, else LineTqdm;
    a class whose bars are off when progress is not wanted at all."""
    if not enabled():
        return _Silent
    return None if on_terminal(stream) else LineTqdm


class _Silent(auto_tqdm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


class Progress:
    """One task's progress. `total` None: a count without a percentage. `stage(text)` names what
    runs now (conversion steps, load phases)."""

    def __init__(self, desc: str, total: float | None = None, unit: str = "it", *, unit_scale: bool = False,
                 stream: TextIO | None = None, interval: float = PLAIN_INTERVAL_S) -> None:
        self.desc = desc
        kwargs = dict(desc=desc, total=total, unit=unit, unit_scale=unit_scale, leave=True)
        if not enabled():
            self.bar = _Silent(**kwargs)
        elif on_terminal(stream):
            self.bar = auto_tqdm(file=sys.stderr if stream is None else stream, **kwargs)
        else:
            self.bar = LineTqdm(interval=interval, **kwargs)

    def update(self, n: float = 1) -> None:
        self.bar.update(n)

    def stage(self, text: str) -> None:
        plain = isinstance(self.bar, LineTqdm)
        self.bar.set_postfix_str(text, refresh=not plain)
        if plain:
            self.bar.emit()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is None:
            self.bar.set_postfix_str("done", refresh=False)
        self.close()
