"""`python -m mlxcel.cli.flags_check ARGS...`: parse a server command line and print the result.

The same parse path `mlxcel-server` runs first, without resolving or loading a model: it prints
the resolved ServerSettings as JSON (secrets replaced by [redacted]) and exits 0, or refuses
with one line on stderr and exit status 1. Tests drive the real flag surface through it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from mlxcel.cli.flags import parse_server_args


def settings_json(settings) -> str:
    data = dataclasses.asdict(settings)  # nested: one object per settings section
    secrets = set(settings.logging.secrets)
    data["logging"]["secrets"] = ["[redacted]"] * len(secrets)
    data["server"]["api_keys"] = ["[redacted]"] * len(settings.server.api_keys)
    if data["source"].get("hf_token"):
        data["source"]["hf_token"] = "[redacted]"
    return json.dumps(data, default=lambda v: str(v) if isinstance(v, Path) else repr(v), sort_keys=True)


def main(argv: list[str] | None = None, prog: str = "mlxcel-server") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--prog"]:
        prog, argv = argv[1], argv[2:]
    settings = parse_server_args(argv, prog=prog)
    sys.stdout.write(settings_json(settings) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
