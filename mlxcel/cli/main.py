"""`mlxcel`: subcommands over the model store and the engine.

Each subcommand lives in its own module and registers an argparse subparser; this file
only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing `add_parser(subparsers)`; each parser sets `func`.
SUBCOMMANDS = {
    "serve": "mlxcel.cli.serve_cmd",
    "list": "mlxcel.cli.store_cmds",
    "rm": "mlxcel.cli.store_cmds",
    "download": "mlxcel.cli.store_cmds",
    "convert": "mlxcel.cli.store_cmds",
    "generate": "mlxcel.cli.generate_cmds",
    "chat": "mlxcel.cli.generate_cmds",
    "build-kernels": "mlxcel.cli.build_cmds",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        from mlxcel.cli.server import main as server_main

        return server_main(argv[1:], prog="mlxcel serve")
    parser = argparse.ArgumentParser(prog="mlxcel")
    sub = parser.add_subparsers(dest="command", required=True)
    seen = set()
    for name, module in SUBCOMMANDS.items():
        if name == "serve" or module in seen:
            continue
        seen.add(module)
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    sub.add_parser("serve", help="run the server (same flags as mlxcel-server)")
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
