"""`mlxcel list`, `mlxcel rm`, `mlxcel download` (alias `pull`), `mlxcel convert`: the model store from the shell
(and `mlxcel list --supported`: the model types mlxcel serves, as docs/models.md lists them).

The store root is `--models-dir` / `--model-store-root`, else MLXCEL_MODELS_DIR, else
MLXCEL_CACHE_DIR, else the default (see mlxcel.store.paths). These subcommands keep the
`--models-dir` spelling, which was never a llama-server surface. The environment is read
here and nowhere below.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mlxcel.store.paths import store_root

DEFAULT_ORG = "mlx-community"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models-dir",
        "--model-store-root",
        dest="models_dir",
        type=Path,
        metavar="DIR",
        help="model store root (default: MLXCEL_MODELS_DIR, else MLXCEL_CACHE_DIR/models, "
        "else ~/.cache/mlxcel/models)",
    )


def _root(args) -> Path:
    return store_root(args.models_dir, os.environ)


def default_org() -> str:
    return os.environ.get("MLXCEL_DEFAULT_ORG") or DEFAULT_ORG


def _fail(cmd: str, message: str) -> int:
    print(f"mlxcel {cmd}: error: {message}", file=sys.stderr)
    return 1


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def cmd_list(args) -> int:
    if args.supported:  # what mlxcel serves, not what the store holds
        from mlxcel.models.catalog import supported_tables

        sys.stdout.write(supported_tables())
        return 0
    from mlxcel.store.store import list_models

    root = _root(args)
    entries = list_models(root)
    if not entries:
        print(f"no models in {root}")
        return 0
    rows = [(e.repo_id, e.model_type or "?", e.quantization or "-", _human(e.size_bytes)) for e in entries]
    header = ("NAME", "TYPE", "QUANT", "SIZE")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for r in [header, *rows]:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}")
    n = len(entries)
    print(f"{n} model{'s' if n != 1 else ''}, {_human(sum(e.size_bytes for e in entries))} in {root}")
    return 0


def cmd_rm(args) -> int:
    from mlxcel.store.repo_id import InvalidRepoId
    from mlxcel.store.store import NotInStore, remove

    root = _root(args)
    status = 0
    for ref in args.repo:
        try:
            path = remove(ref, root, default_org())
        except (NotInStore, InvalidRepoId) as e:
            status = _fail("rm", str(e))
            continue
        print(f"removed {path}")
    return status


def cmd_download(args) -> int:
    from mlxcel.store.repo_id import InvalidRepoId, expand, parse_repo_id
    from mlxcel.store.resolve import refusal, store_entry
    from mlxcel.store.store import DownloadFailed, download

    why = refusal(args.repo, "download")
    if why:
        return _fail("download", why)
    repo_id = expand(args.repo, default_org())
    try:
        parse_repo_id(repo_id)
    except InvalidRepoId as e:
        return _fail("download", str(e))
    root = _root(args)
    present = store_entry(root, repo_id)
    if present is not None and not args.force:
        print(f"{repo_id} is already in the store: {present}")
        return 0
    token = args.hf_token or os.environ.get("HF_TOKEN") or None
    try:
        path = download(repo_id, root, hf_token=token, offline=args.offline)
    except DownloadFailed as e:
        return _fail("download", str(e))
    print(f"downloaded {repo_id} to {path}")
    return 0


def cmd_convert(args) -> int:
    from mlxcel.models.registry import UnsupportedModelType
    from mlxcel.store.convert import ConversionError, convert
    from mlxcel.store.gguf_source import GGUFUnsupported
    from mlxcel.store.repo_id import InvalidRepoId

    root = _root(args)
    try:
        path = convert(
            Path(args.src),
            root,
            args.out_repo,
            dtype=args.dtype,
            quantize=args.quantize,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            force=args.force,
            dequantize=args.dequantize,
        )
    except (ConversionError, GGUFUnsupported, InvalidRepoId, UnsupportedModelType) as e:
        return _fail("convert", str(e))
    print(f"converted {args.src} to {path} (-m {args.out_repo})")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("list", help="list the models in the store")
    p.add_argument("--supported", action="store_true",
                   help="list the model types mlxcel serves, with their backends and features (docs/models.md)")
    _common(p)
    p.set_defaults(func=cmd_list)

    p = subparsers.add_parser("rm", help="remove models from the store")
    p.add_argument("repo", nargs="+", help="owner/name (a bare name expands against MLXCEL_DEFAULT_ORG)")
    _common(p)
    p.set_defaults(func=cmd_rm)

    p = subparsers.add_parser("download", aliases=["pull"], help="download an MLX checkpoint into the store")
    p.add_argument("repo", help="owner/name (a bare name expands against MLXCEL_DEFAULT_ORG)")
    p.add_argument("--offline", action="store_true", help="forbid downloads (the command then fails)")
    p.add_argument("--hf-token", help="HuggingFace token (default: HF_TOKEN)")
    p.add_argument("--force", action="store_true", help="download again even when present")
    _common(p)
    p.set_defaults(func=cmd_download)

    p = subparsers.add_parser(
        "convert", help="convert a GGUF file or a HuggingFace checkpoint into an MLX checkpoint in the store"
    )
    p.add_argument("src", help="a .gguf file or a HuggingFace checkpoint directory")
    p.add_argument("--out-repo", required=True, metavar="OWNER/NAME", help="store entry to create")
    p.add_argument("-q", "--quantize", action="store_true", help="affine-quantize (mlx-community layout)")
    p.add_argument("--q-bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--force", action="store_true", help="replace an existing store entry")
    p.add_argument("--dequantize", action="store_true",
                   help="a GGUF's quantized tensors written dense in --dtype (by default each one MLX's affine "
                        "format holds exactly stays quantized, losslessly)")
    _common(p)
    p.set_defaults(func=cmd_convert)
