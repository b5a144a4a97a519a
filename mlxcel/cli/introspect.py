"""The print-and-exit options: --version, --completion-bash, --cache-list.

They run after the command line parses and before anything else (no model, no logging), print
to stdout, and exit 0, as b10621's parser-level handlers do.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from mlxcel import __version__
from mlxcel.cli.options_table import TABLE
from mlxcel.store.paths import store_root


def print_version() -> None:
    sys.stdout.write(f"version: {__version__} (mlxcel)\ncompatible with: llama-server b10621\n")


def completion_bash(prog: str) -> str:
    """A source-able script: visible spellings only; path-valued options complete file names."""
    command = "mlxcel" if prog.startswith("mlxcel serve") else "mlxcel-server"
    fn = "_mlxcel_serve" if command == "mlxcel" else "_mlxcel_server"
    visible = [o for o in TABLE if not o.hidden]
    opts = " ".join(s for o in visible for s in o.spellings)
    paths = "|".join(s for o in visible if o.path_value for s in o.longs + o.shorts)
    lines = ["# bash completion for " + (f"`{prog}` (registered on `mlxcel`)" if command == "mlxcel" else command)]
    lines += [
        f"{fn}() {{",
        '    local cur prev opts',
        '    COMPREPLY=()',
        '    cur="${COMP_WORDS[COMP_CWORD]}"',
        '    prev="${COMP_WORDS[COMP_CWORD-1]}"',
        f'    opts="{opts}"',
        '    case "$prev" in',
        f'        {paths})',
        '            COMPREPLY=( $(compgen -f -- "$cur") )',
        '            return 0',
        '            ;;',
        '    esac',
        '    COMPREPLY=( $(compgen -W "$opts" -- "$cur") )',
        '    return 0',
        '}',
        f"complete -F {fn} {command}",
    ]
    return "\n".join(lines) + "\n"


def print_completion_bash(prog: str) -> None:
    sys.stdout.write(completion_bash(prog))


def cached_models(root: Path) -> list[str]:
    """`owner/name` ids of store entries that hold a checkpoint (config.json or *.safetensors)."""
    found = []
    if not root.is_dir():
        return found
    for owner in sorted(p for p in root.iterdir() if p.is_dir()):
        for name in sorted(p for p in owner.iterdir() if p.is_dir()):
            if (name / "config.json").is_file() or any(name.glob("*.safetensors")):
                found.append(f"{owner.name}/{name.name}")
    return found


def print_cache_list(explicit_root: str | None, environ: Mapping[str, str]) -> None:
    root = store_root(Path(explicit_root) if explicit_root else None, environ)
    models = cached_models(root)
    out = [f"number of models in cache: {len(models)}"]
    out += [f"{i:4d}. {m}" for i, m in enumerate(models, start=1)]
    sys.stdout.write("\n".join(out) + "\n")
