"""The llama-server b10621 flag surface of `mlxcel-server` and `mlxcel serve`.

Flow of `parse_server_args(argv, environ)`:

1. `--dump-flag-surface` anywhere before `--` prints the surface as JSON and exits 0.
2. `prepass` rewrites llama.cpp spellings argparse cannot take as-is: multi-letter single-dash
   options (`-ngl 99`, `-fa on`, `-nocb`) become their long spelling, `--ctx_size` becomes
   `--ctx-size` (b10621 folds `_` to `-`), and a value-taking option and its value are joined
   as `--opt=value` so a value that starts with `-` is never read as an option. It knows which
   options take a value from the table, and stops at `--`.
3. argparse parses the result (usage errors become a one-line refusal, exit status 1).
4. Print-and-exit options run: --version, --completion-bash, --cache-list (--help is argparse's).
5. The environment fills every option not given on the command line (command line beats
   environment): a value-taking option reads its variable as-is; a value-less flag fires only
   on b10621's case-sensitive truthy set (on, enabled, true, 1); a --x/--no-x pair parses
   on/enabled/true/1 vs off/disabled/false/0 (anything else refuses) and a set LLAMA_ARG_NO_*
   means false whatever its value.
6. Each given option is classified (options_model.py): honoured into `ServerSettings`, accepted
   as inert, or refused with one line, all before any model is resolved.

## `--dump-flag-surface` format (hidden; consumed by the compatibility manifest tests)

    {"binary": "mlxcel-server" | "mlxcel serve",
     "options": [{"long": ["--ctx-size"], "short": ["-c"], "multi_dash": [],
                  "env": "LLAMA_ARG_CTX_SIZE", "neg_env": null, "takes_value": true,
                  "kind": "value", "default": "0", "hidden": false, "state": "supported",
                  "b10621_entry": "--ctx-size"}, ...]}

One object per accepted b10621 help entry, in help order, then mlxcel-native options with
`b10621_entry: null`. `long` and `short` hold every spelling, negative forms included; `short`
holds one-letter spellings and `multi_dash` the multi-letter single-dash ones (`-ngl`, `-nocb`).
`default` is b10621's default as text (null when it has none or it is "unspecified");
`state` is the manifest state; `kind` is flag | pair | value | value2.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.cli.memory_plan import wired_limit_from
from mlxcel.cli.options_model import FLAG, PAIR, VALUE2, Option
from mlxcel.cli.options_table import BY_SPELLING, SECTIONS, TABLE
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings
from mlxcel.router.preset import TRANSLATED, PresetSection

__all__ = ["StartupRefusal", "parse_server_args", "build_parser", "prepass", "dump_flag_surface", "uvicorn_kwargs"]

TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")
PRINT_AND_EXIT = ("--version", "--completion-bash", "--cache-list")
_BY_KEY = {o.key: o for o in TABLE}


@dataclass(frozen=True)
class Given:
    """One option as the user gave it: the value and where it came from (a spelling or VAR=value)."""

    value: Any
    source: str
    from_env: bool = False


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D102 - argparse hook
        raise StartupRefusal(f"{message} (run with -h for usage)")


class _Record(argparse.Action):
    """Stores Given(value, spelling); a pair's two halves share one dest."""

    def __init__(self, option_strings, dest, const=None, nargs=None, **kw):
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        setattr(namespace, self.dest, Given(value, option_string or self.dest))


class _Append(argparse.Action):
    """A repeatable option (-l, --dry-sequence-breaker): Given holds every value, in order."""

    def __call__(self, parser, namespace, values, option_string=None):
        prev = getattr(namespace, self.dest, None)
        seen = prev.value if isinstance(prev, Given) else []
        setattr(namespace, self.dest, Given([*seen, values], option_string or self.dest))


def _help_text(o: Option) -> str:
    if o.hidden:
        return argparse.SUPPRESS
    text = o.help or ""
    if o.state == "deferred":
        text = (text + " " if text else "") + "[not yet supported by mlxcel]"
    if o.env:
        text += f" (env: {o.env})"
    return text.replace("%", "%%")


def build_parser(prog: str = "mlxcel-server") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, add_help=False, allow_abbrev=False, usage="%(prog)s [options]",
                description="mlxcel inference server (llama-server b10621 compatible command line)")
    groups = {s: p.add_argument_group(s) for s in SECTIONS}
    for o in TABLE:
        g = groups[o.section]
        help_ = _help_text(o)
        if o.entry == "--help":
            g.add_argument(*o.shorts, *o.longs, action="help", help=help_)
        elif o.kind == FLAG:
            g.add_argument(*o.shorts, *o.longs, dest=o.key, action=_Record, nargs=0, const=True,
                           default=argparse.SUPPRESS, help=help_)
        elif o.kind == PAIR:
            g.add_argument(*o.shorts, *o.longs, dest=o.key, action=_Record, nargs=0, const=True,
                           default=argparse.SUPPRESS, help=help_)
            g.add_argument(*o.neg_shorts, *o.neg_longs, dest=o.key, action=_Record, nargs=0, const=False,
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            metavar = tuple(o.metavar.split()) if o.kind == VALUE2 else o.metavar
            g.add_argument(*o.shorts, *o.longs, dest=o.key, action=_Append if o.repeatable else _Record, nargs=2 if o.kind == VALUE2 else None,
                           metavar=metavar, default=argparse.SUPPRESS, help=help_)
    return p


def _canonical(o: Option, positive: bool) -> str:
    return (o.longs if positive else o.neg_longs)[0] if (o.longs if positive else o.neg_longs) else (
        (o.shorts if positive else o.neg_shorts)[0])


def prepass(argv: Sequence[str]) -> list[str]:
    """Rewrite llama.cpp spellings into ones argparse reads unambiguously (see module doc)."""
    out: list[str] = []
    i = 0
    args = list(argv)
    while i < len(args):
        tok = args[i]
        i += 1
        if tok == "--":
            out.extend(args[i - 1 :])
            break
        if not tok.startswith("-") or tok == "-":
            out.append(tok)
            continue
        name, eq, inline = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if name.startswith("--"):
            name = name.replace("_", "-")
        hit = BY_SPELLING.get(name)
        if hit is None:
            if name.startswith("--") or len(tok) <= 2:
                out.append(tok)  # argparse reports it (or it is a one-letter short argparse knows)
                continue
            raise StartupRefusal(f"invalid argument: {tok}")
        o, positive = hit
        # keep a long spelling as written (diagnostics name it); single-dash ones become long
        spelling = name if name.startswith("--") else _canonical(o, positive)
        if o.nargs == 1:
            if eq:
                out.append(f"{spelling}={inline}")
            elif i < len(args):
                out.append(f"{spelling}={args[i]}")
                i += 1
            else:
                out.append(spelling)  # argparse: "expected one argument"
        elif o.nargs == 2:
            out.append(spelling)
            out.extend(args[i : i + 2])
            i += 2
        else:
            if eq:
                raise StartupRefusal(f"{name} takes no value (got {tok!r})")
            out.append(spelling)
    return out


def dump_flag_surface(binary: str) -> dict:
    options = []
    for o in TABLE:
        singles = o.shorts + o.neg_shorts
        options.append({
            "long": list(o.longs + o.neg_longs),
            "short": [s for s in singles if len(s) == 2],
            "multi_dash": [s for s in singles if len(s) > 2],
            "env": o.env,
            "neg_env": o.neg_env,
            "takes_value": o.takes_value,
            "kind": o.kind,
            "default": o.default,
            "hidden": o.hidden,
            "state": o.state,
            "b10621_entry": o.entry,
        })
    return {"binary": binary, "options": options}


def _from_environment(o: Option, environ: Mapping[str, str]) -> Given | None:
    if o.kind == PAIR and o.neg_env and o.neg_env in environ:
        return Given(False, f"{o.neg_env}={environ[o.neg_env]}", True)
    if not o.env or o.env not in environ:
        return None
    raw = environ[o.env]
    source = f"{o.env}={raw}"
    if o.kind == FLAG:
        return Given(True, source, True) if raw in TRUTHY else None
    if o.kind == PAIR:
        if raw in TRUTHY:
            return Given(True, source, True)
        if raw in FALSEY:
            return Given(False, source, True)
        raise StartupRefusal(f'error while handling environment variable "{o.env}": invalid boolean value {raw!r}')
    return Given(raw, source, True)


def _describe(o: Option, g: Given) -> str:
    """How a diagnostic names the option: the spelling (and value) the user wrote."""
    if g.from_env:
        return f"{g.source} ({o.entry or o.longs[0]})"
    if o.kind in (FLAG, PAIR):
        return g.source
    value = " ".join(g.value) if isinstance(g.value, list) else g.value
    return f"{g.source} {value}"


def _classify(o: Option, g: Given, settings: ServerSettings) -> None:
    if o.apply is not None:
        # apply functions name the option in their own diagnostics
        o.apply(settings, g.value, f"{g.source.split('=', 1)[0]} ({o.entry})" if g.from_env else g.source)
        return
    if o.inert is not None and o.inert(g.value):
        return
    raise StartupRefusal(f"{_describe(o, g)}: {o.why}")


def model_settings(base: ServerSettings, sections: list[PresetSection]) -> ServerSettings:
    """A router model's settings: a clone of the router's with its preset sections' keys applied
    in order (the global section first), each value through its option's own apply function, so
    a preset value is validated exactly as the flag is; an option the router was started with
    (command line or environment) wins, upstream's order."""
    out = copy.deepcopy(base)
    out.router.models_dir = out.router.models_preset = None
    for sec in sections:
        for key, value in sec.values.items():
            opt_key = TRANSLATED.get(key)
            if opt_key is None or opt_key in base.cli_given:
                continue
            try:
                _classify(_BY_KEY[opt_key], Given(value, f"{key} in [{sec.name}]"), out)
            except StartupRefusal as e:
                raise StartupRefusal(f"--models-preset: {e}") from None
    return out


def _parse_given(argv: Sequence[str], prog: str) -> dict[str, Given]:
    ns = build_parser(prog).parse_args(prepass(argv))
    return {k: v for k, v in vars(ns).items() if isinstance(v, Given)}


def _print_and_exit(given: dict[str, Given], prog: str, environ: Mapping[str, str]) -> None:
    from mlxcel.cli import introspect

    if "version" in given:
        introspect.print_version()
    elif "completion_bash" in given:
        introspect.print_completion_bash(prog)
    elif "list_devices" in given:
        from mlxcel.cli.devices import print_devices

        print_devices()
    elif "cache_list" in given:
        root = given.get("model_store_root")
        introspect.print_cache_list(root.value if root else None, environ)
    else:
        return
    raise SystemExit(0)


# The variables native builds read (mlxcel/native_build.py, backends/torch/row_gemv.py).
BUILD_ENV = ("CC", "CXX", "PATH", "HOME", "XDG_CACHE_HOME", "MLXCEL_KERNEL_CACHE")


def parse_server_args(
    argv: Sequence[str], environ: Mapping[str, str] | None = None, *, prog: str = "mlxcel-server"
) -> ServerSettings:
    """Parse a llama-server command line plus environment into ServerSettings, or refuse."""
    environ = os.environ if environ is None else environ
    argv = list(argv)
    head = argv[: argv.index("--")] if "--" in argv else argv
    if "--dump-flag-surface" in head:
        binary = "mlxcel serve" if prog.startswith("mlxcel serve") else "mlxcel-server"
        sys.stdout.write(json.dumps(dump_flag_surface(binary)) + "\n")
        raise SystemExit(0)

    cli = _parse_given(argv, prog)
    _print_and_exit(cli, prog, environ)

    settings = ServerSettings()
    settings.source.default_org = environ.get("MLXCEL_DEFAULT_ORG", settings.source.default_org)
    given: dict[str, tuple[Option, Given]] = {}
    for o in TABLE:
        env_g = _from_environment(o, environ)
        g = cli.get(o.key)
        if g is not None and env_g is not None:
            settings.notices.append(f"{env_g.source.split('=', 1)[0]} is set but {g.source} on the command line wins")
        g = g or env_g
        if g is not None:
            given[o.key] = (o, g)

    # --load-mode is the authority when present: the three deprecated spellings are not classified.
    skip = {"mlock", "mmap", "direct_io"} if "load_mode" in given else set()
    for key, (o, g) in given.items():
        if key not in skip:
            _classify(o, g, settings)
    settings.cli_given = frozenset(given)  # a router preset yields to these (mlxcel/router/preset.py)

    settings.workers.pooling_env = environ.get("MLXCEL_EMBEDDING_POOLING") or None
    settings.backend.build_env = {k: environ[k] for k in BUILD_ENV if k in environ}
    settings.media.allow_private_media_urls = environ.get("MLXCEL_ALLOW_PRIVATE_MEDIA_URLS", "") == "1"
    settings.backend.wired_limit_bytes = wired_limit_from(environ)
    settings.steering.sae_dir = Path(environ["MLXCEL_SAE_DIR"]).expanduser() if environ.get("MLXCEL_SAE_DIR") else None
    if environ.get("CLUSTER_INTENSITY_MIN"):
        settings.steering.cluster_intensity_min = _dial_floor("CLUSTER_INTENSITY_MIN", environ["CLUSTER_INTENSITY_MIN"])
    if environ.get("CIRCUIT_INTENSITY_MIN"):
        settings.steering.circuit_intensity_min = _dial_floor("CIRCUIT_INTENSITY_MIN", environ["CIRCUIT_INTENSITY_MIN"])
    if "device" not in given and environ.get("MLXCEL_DEVICE"):  # mlxcel's own variable, below LLAMA_ARG_DEVICE
        from mlxcel.cli.options_apply import apply_device

        apply_device(settings, environ["MLXCEL_DEVICE"], "MLXCEL_DEVICE")
    _finish(settings, environ)
    return settings


def _dial_floor(var: str, raw: str) -> float:
    """A steering dial floor (mlxcel/steering/intensity.py): a number in 0-2."""
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 2:
        raise StartupRefusal(f"{var}={raw!r}: the steering dial floor must be a number in 0-2")
    return value


def _finish(settings: ServerSettings, environ: Mapping[str, str]) -> None:
    from mlxcel.cli.logging_setup import prepare_log_file
    from mlxcel.cli.options_sampling import finish_sampling
    from mlxcel.cli.vertex_env import apply_vertex_env

    finish_sampling(settings)

    if settings.source.hf_repo:
        if settings.source.model and settings.source.model != settings.source.hf_repo:
            settings.notices.append(f"--hf-repo {settings.source.hf_repo} supersedes -m {settings.source.model}")
        settings.source.model = settings.source.hf_repo
    for var in ("HF_TOKEN", "LLAMA_API_KEY"):
        if environ.get(var) and environ[var] not in settings.logging.secrets:
            settings.logging.secrets.append(environ[var])
    if bool(settings.server.ssl_key_file) != bool(settings.server.ssl_cert_file):
        raise StartupRefusal("TLS needs both --ssl-key-file and --ssl-cert-file")
    for path in (settings.server.ssl_key_file, settings.server.ssl_cert_file):
        if path is not None and not path.is_file():
            raise StartupRefusal(f"TLS file not found: {path}")
    if settings.logging.file is not None and not settings.logging.disable:
        prepare_log_file(settings.logging.file)
    apply_vertex_env(settings, environ)
    from mlxcel.router.mode import check_router_mode

    check_router_mode(settings)


def uvicorn_kwargs(settings: ServerSettings) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config` / `uvicorn.run` that the flag surface decides.

    A --host ending in .sock binds that Unix socket (host and port are then unused); TLS comes
    from --ssl-key-file / --ssl-cert-file; --timeout bounds how long a connection may sit idle
    between requests (uvicorn has no separate read/write timeout), and the request header must
    be complete within config/limits.HEADER_TIMEOUT_S and its body within BODY_TIMEOUT_S (extended
    by the bytes received; cli/http_protocol.py).
    """
    from mlxcel.cli.http_protocol import DeadlineProtocol

    timeout = settings.server.timeout
    kw: dict[str, Any] = {"timeout_keep_alive": timeout if timeout > 0 else 3600, "log_config": None,
                          "http": DeadlineProtocol}
    if settings.server.unix_socket:
        kw["uds"] = settings.server.unix_socket
    else:
        kw["host"] = settings.server.host
        kw["port"] = settings.server.port
    if settings.server.ssl_key_file and settings.server.ssl_cert_file:
        kw["ssl_keyfile"] = str(settings.server.ssl_key_file)
        kw["ssl_certfile"] = str(settings.server.ssl_cert_file)
    return kw
