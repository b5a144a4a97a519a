"""`StartupRefusal`: the one way the CLI layer stops startup.

A refusal is one line on stderr (`error: ...`) and exit status 1, b10621's own status for an
invalid argument. It is raised before any model is resolved, so nothing is loaded.
"""

from __future__ import annotations


class StartupRefusal(SystemExit):
    """A one-line diagnostic that stops startup before anything is loaded (exit status 1)."""

    def __init__(self, message: str) -> None:
        self.message = " ".join(str(message).split())  # always one line
        super().__init__(f"error: {self.message}")
