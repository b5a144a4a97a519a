"""Imports between mlxcel's packages go one way: down.

The layers, bottom to top (a package may import its own layer's modules and any lower layer):

    config, mlxcel      the resolved settings and plain values; the root holds only the version
    models, native_build  family registry, LoRA, vision, RoPE logic; building native pieces
    chat, store         chat templates, tool calls, reasoning tags, GBNF; the model store
    engine              scheduler, KV, sampling, stop, detokenize (and the backend contract)
    steering            SAEs, steering deltas, profiles
    backends            mlx and torch: load, KV storage, forward
    workers             side workers: embedding, reranking, Whisper
    runtime             the composition root and the served model it builds
    api                 HTTP routes
    router              many models behind one server
    cli                 argv and the environment -> settings; starts everything
    compat              reads every surface (CLI, API, router) to check the manifest

Two packages of one layer do not import each other. Every import counts: at module level,
inside a function, and under `if TYPE_CHECKING:`, as does `importlib.import_module` with a
literal name. The modules are parsed, never imported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlxcel"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "mlxcel"),
    ("models", "native_build"),
    ("chat", "store"),
    ("engine",),
    ("steering",),
    ("backends",),
    ("workers",),
    ("runtime",),
    ("api",),
    ("router",),
    ("cli",),
    ("compat",),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


@dataclass(frozen=True)
class Edge:
    path: Path  # the importing file
    line: int
    module: str  # the module (or package) it imports, absolute

    def __str__(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line} -> {self.module}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


def _literal_import(node: ast.Call) -> str | None:
    """`importlib.import_module("mlxcel...")` / `__import__("mlxcel...")` with a literal name."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
        value = node.args[0].value
        return value if isinstance(value, str) else None
    return None


def imports_of(path: Path) -> list[Edge]:
    """Every mlxcel module `path` imports, relative imports resolved."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    out: list[Edge] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import name` imports the module pkg.name when there is one
            names = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
        elif isinstance(node, ast.Call):
            literal = _literal_import(node)
            names = [literal] if literal else []
        out += [Edge(path, node.lineno, n) for n in dict.fromkeys(names) if n.split(".")[0] == "mlxcel"]
    return out


def package_of(module: str) -> str:
    """The layered package a module belongs to: mlxcel.<first part>, or the root itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mlxcel"


def all_edges() -> list[Edge]:
    return [e for path in sorted(PACKAGE.rglob("*.py")) for e in imports_of(path)]


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    missing = sorted(packages - set(LAYER))
    if missing:
        pytest.fail(f"packages with no layer in LAYERS (tests/test_import_layers.py): {', '.join(missing)}",
                    pytrace=False)


def test_imports_only_go_down():
    wrong = []
    for edge in all_edges():
        src, dst = package_of(module_name(edge.path)), package_of(edge.module)
        if src == dst or dst not in LAYER:
            continue
        if LAYER[dst] > LAYER[src]:
            wrong.append(f"{edge}  ({src} imports the higher layer {dst})")
        elif LAYER[dst] == LAYER[src]:
            wrong.append(f"{edge}  ({src} imports {dst}, of its own layer)")
    if wrong:
        pytest.fail("imports against the layer order (tests/test_import_layers.py):\n" + "\n".join(wrong),
                    pytrace=False)


def test_config_imports_nothing_of_mlxcel():
    """The configuration sits under everything, so it may import no other part of mlxcel."""
    files = [*sorted((PACKAGE / "config").rglob("*.py")), PACKAGE / "__init__.py"]
    wrong = [str(e) for f in files for e in imports_of(f) if package_of(e.module) not in ("config",)]
    if wrong:
        pytest.fail("mlxcel/config imports other parts of mlxcel:\n" + "\n".join(wrong), pytrace=False)
