"""The llama-server b10621 flag surface (minimal: grows into the full option table)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from mlxcel.cli.settings import ServerSettings


class StartupRefusal(SystemExit):
    """A one-line diagnostic that stops startup before anything is loaded."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def build_parser(prog: str = "mlxcel-server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="mlxcel inference server")
    p.add_argument("-m", "--model", help="checkpoint directory, owner/name repo id, or bare name")
    p.add_argument("--model-store-root", type=Path)
    p.add_argument("--offline", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", "--ctx-size", type=int, default=0)
    p.add_argument("-n", "--n-predict", type=int, default=-1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("-a", "--alias")
    return p


def parse_server_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServerSettings:
    environ = os.environ if environ is None else environ
    ns = build_parser().parse_args(list(argv))
    store = ns.model_store_root
    return ServerSettings(
        model=ns.model or environ.get("LLAMA_ARG_MODEL"),
        model_store_root=store,
        default_org=environ.get("MLXCEL_DEFAULT_ORG", "mlx-community"),
        offline=ns.offline,
        host=ns.host,
        port=ns.port,
        ctx_size=ns.ctx_size,
        n_predict=ns.n_predict,
        dtype=ns.dtype,
        alias=sorted(a for a in (ns.alias or "").split(",") if a),
    )
