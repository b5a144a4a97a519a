"""`mlxcel`: subcommands over the model store and the engine.

Each subcommand lives in its own module and registers an argparse subparser; this file
only dispatches, and sets up what every subcommand but `serve` shares: `--version`, and
logging at INFO on standard error (progress lines and load messages; results go to stdout).
"""

from __future__ import annotations

import argparse
import importlib
import logging
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
    "run": "mlxcel.cli.generate_cmds",
    "show": "mlxcel.cli.inspect_cmds",
    "ps": "mlxcel.cli.inspect_cmds",
    "inspect": "mlxcel.cli.inspect_model",
    "build-kernels": "mlxcel.cli.build_cmds",
}


class PrintVersion(argparse.Action):
    """--version as `mlxcel serve --version` prints it (argparse's own action would reflow it)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from mlxcel.cli.introspect import print_version

        print_version()
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        from mlxcel.cli.server import main as server_main

        return server_main(argv[1:], prog="mlxcel serve")
    parser = argparse.ArgumentParser(prog="mlxcel")
    parser.add_argument("-V", "--version", action=PrintVersion, nargs=0, help="print the version and exit")
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
    configure_cli_logging()
    return int(args.func(args) or 0)


def configure_cli_logging() -> None:
    """Messages alone on standard error, INFO and up; the HTTP client's per-request lines stay out.
    Logging someone else set up (a test harness, a program calling `main`) is left as it is."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
