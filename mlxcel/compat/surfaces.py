"""What mlxcel actually exposes, read in the manifest's vocabulary.

Three surfaces the manifest's claims are held against: the flag surface of both server binaries
(the hidden `--dump-flag-surface` JSON), the routes mounted in the Litestar app, and the keys
the native request struct `NativeCompletionRequest` accepts. Each reader returns None when
the module that would provide the surface does not exist yet, so a test can tell "not built"
from "built and disagreeing".
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import re

IGNORED_METHODS = frozenset({"OPTIONS", "HEAD"})  # answered for every path, never registered
_PATH_PARAM = re.compile(r"\{(\w+)(?::[^}]*)?\}")


def _missing(exc: ModuleNotFoundError, prefix: str) -> bool:
    return bool(exc.name) and (exc.name == prefix or exc.name.startswith(prefix + ".")
                               or prefix.startswith(exc.name + "."))


def _dump_via(entry, argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            entry(argv)
        except SystemExit as e:
            if e.code not in (0, None):
                raise AssertionError(f"--dump-flag-surface exited {e.code}: {out.getvalue()[-300:]}")
    return json.loads(out.getvalue())


def flag_surface(binary: str) -> dict | None:
    """The dump of `mlxcel-server` or `mlxcel serve`; None while the flag surface lacks it."""
    try:
        flags = importlib.import_module("mlxcel.cli.flags")
    except ModuleNotFoundError as e:
        if _missing(e, "mlxcel.cli.flags"):
            return None
        raise
    if not hasattr(flags, "dump_flag_surface"):
        return None
    try:
        if binary == "mlxcel-server":
            main = importlib.import_module("mlxcel.cli.server").main
            return _dump_via(main, ["--dump-flag-surface"])
        main = importlib.import_module("mlxcel.cli.main").main
        return _dump_via(main, ["serve", "--dump-flag-surface"])
    except ModuleNotFoundError as e:
        if not _missing(e, "mlxcel.cli.server"):
            raise
    # The entry-point module is not there yet: the same parser, called the way it would call it.
    return _dump_via(lambda argv: flags.parse_server_args(argv, {}, prog=binary),
                     ["--dump-flag-surface"])


def dump_spellings(option: dict) -> list[str]:
    return list(option["long"]) + list(option["short"]) + list(option.get("multi_dash", []))


def normalize_path(path: str) -> str:
    """Litestar's `/slots/{id_slot:int}` in b10621's spelling `/slots/:id_slot`."""
    return _PATH_PARAM.sub(lambda m: ":" + m.group(1), path)


def mounted_routes() -> set[tuple[str, str]] | None:
    """(METHOD, path) pairs mounted by `mlxcel.api.app.build_litestar`, plus those the router mode
    app mounts (`mlxcel.router.routes`) and the chat page's (`mlxcel.api.webui`, on by default);
    None while the first is absent."""
    try:
        app_module = importlib.import_module("mlxcel.api.app")
    except ModuleNotFoundError as e:
        if _missing(e, "mlxcel.api.app"):
            return None
        raise
    build_app = getattr(app_module, "build_litestar", None)
    if build_app is None:
        return None
    required = [p.name for p in inspect.signature(build_app).parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required == ["state"]:
        # Routing needs no model: an AppState whose model is still absent mounts every route.
        # Vertex AI mode is on so its POST /predict counts, as b10621's own inventory counts it.
        from mlxcel.api.state import AppState
        from mlxcel.config.settings import ServerSection, ServerSettings

        app = build_app(AppState(settings=ServerSettings(server=ServerSection(vertex_predict_route="/predict"))))
    elif not required:
        app = build_app()
    else:
        raise AssertionError(
            "mlxcel.api.app.build_litestar needs arguments " + ", ".join(required)
            + "; the route claims need an app that can be built without a model")
    apps = [app]
    with contextlib.suppress(ModuleNotFoundError):  # router mode mounts its own app (mlxcel/router)
        apps.append(importlib.import_module("mlxcel.router.routes").build_router_litestar(None))
    pairs = set()
    for route in (r for a in apps for r in a.routes):
        for method in getattr(route, "methods", ()):
            if method not in IGNORED_METHODS:
                pairs.add((method, normalize_path(route.path)))
    with contextlib.suppress(ModuleNotFoundError):  # the chat page, an ASGI layer ahead of both apps
        pairs |= {("GET", p) for p in importlib.import_module("mlxcel.api.webui.routes").PAGE_PATHS}
    return pairs


def _struct_keys(cls, prefix: str = "") -> set[str]:
    """JSON keys of a struct, nested structs' keys spelled `outer.inner`."""
    import typing

    import msgspec

    keys = set()
    for f in msgspec.structs.fields(cls):
        keys.add(prefix + f.encode_name)
        for t in (f.type, *typing.get_args(f.type)):
            if isinstance(t, type) and issubclass(t, msgspec.Struct):
                keys |= _struct_keys(t, prefix + f.encode_name + ".")
    return keys


def native_request_fields() -> set[str] | None:
    """JSON keys `NativeCompletionRequest` accepts; None until the struct exists."""
    import msgspec

    try:
        api = importlib.import_module("mlxcel.api")
    except ModuleNotFoundError as e:
        if _missing(e, "mlxcel.api"):
            return None
        raise
    for info in pkgutil.walk_packages(api.__path__, prefix="mlxcel.api."):
        module = importlib.import_module(info.name)
        cls = getattr(module, "NativeCompletionRequest", None)
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
            return _struct_keys(cls)
    return None
