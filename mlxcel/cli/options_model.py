"""The shape of one llama-server option record, and the small vocabulary the table is written in.

An `Option` is one b10621 `--help` entry (or one mlxcel-native option): its spellings, how it
takes a value, its environment binding, b10621's default, its manifest state, and how startup
treats a given value. Exactly one of three things happens to a given option:

- `apply` is set: the value is honoured and lands in `ServerSettings` (states supported,
  aliased, by_design);
- the value satisfies `inert`: it asks for nothing mlxcel does not already do, so it is accepted
  and has no effect;
- otherwise startup stops with `why` (one line), before any model is resolved.

States are the compatibility manifest's five: supported, aliased, not_applicable, deferred,
by_design. A deferred option is refused with "not yet supported"; it is never silently accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUPPORTED = "supported"
ALIASED = "aliased"
NOT_APPLICABLE = "not_applicable"
DEFERRED = "deferred"
BY_DESIGN = "by_design"
STATES = (SUPPORTED, ALIASED, NOT_APPLICABLE, DEFERRED, BY_DESIGN)

# value kinds
FLAG = "flag"  # value-less switch; from the environment only on a truthy value
PAIR = "pair"  # --x / --no-x; from the environment through b10621's boolean rules
VALUE = "value"  # one value
VALUE2 = "value2"  # two values (--control-vector-layer-range START END)

# single-dash negative spellings of bool pairs (the long ones all start with --no-)
NEG_SHORTS = frozenset({"-nkvo", "-nr", "-ndio", "-no-kvu", "-nocb", "-no-ag"})

Inert = Callable[[Any], bool]
Apply = Callable[[Any, Any, str], None]  # (settings, value, spelling)


@dataclass(frozen=True)
class Option:
    entry: str | None  # b10621 help entry id: first long spelling (None = mlxcel-native)
    longs: tuple[str, ...]
    shorts: tuple[str, ...]
    neg_longs: tuple[str, ...]
    neg_shorts: tuple[str, ...]
    kind: str
    metavar: str | None
    env: str | None
    default: str | None  # b10621's default, as text
    state: str
    section: str
    help: str
    hidden: bool
    apply: Apply | None = None
    inert: Inert | None = None
    why: str | None = None
    path_value: bool = False  # completes as a file name in --completion-bash
    repeatable: bool = False  # every occurrence counts (apply receives the list of values)

    @property
    def takes_value(self) -> bool:
        return self.kind in (VALUE, VALUE2)

    @property
    def nargs(self) -> int:
        return {VALUE: 1, VALUE2: 2}.get(self.kind, 0)

    @property
    def key(self) -> str:
        """argparse dest: derived from the first long spelling."""
        return (self.longs or self.neg_longs or self.shorts)[0].lstrip("-").replace("-", "_").replace(".", "_")

    @property
    def spellings(self) -> tuple[str, ...]:
        return self.longs + self.shorts + self.neg_longs + self.neg_shorts

    @property
    def neg_env(self) -> str | None:
        """b10621 also reads LLAMA_ARG_NO_* for a bool pair, meaning false."""
        if self.kind == PAIR and self.env and self.env.startswith("LLAMA_ARG_"):
            return "LLAMA_ARG_NO_" + self.env[len("LLAMA_ARG_") :]
        return None


def own(path: str) -> str:
    """A default the table shows that mlxcel shares with b10621, read from where it is declared
    (a ServerSettings section, "server.port"; deeper paths reach into a section's value), as
    b10621's help prints it: true/false, two decimals for a float."""
    from mlxcel.config.settings import ServerSettings

    value: Any = ServerSettings()
    for name in path.split("."):
        value = getattr(value, name)
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def make(
    spellings: str,
    kind: str = FLAG,
    *,
    section: str,
    state: str,
    mv: str | None = None,
    env: str | None = None,
    default: str | None = None,
    help: str = "",
    apply: Apply | None = None,
    inert: Inert | None = None,
    why: str | None = None,
    hidden: bool | None = None,
    native: bool = False,
    path_value: bool = False,
    repeatable: bool = False,
) -> Option:
    """Build a record from a help-style spelling list such as "-kvo, --kv-offload, -nkvo, --no-kv-offload"."""
    names = [s.strip() for s in spellings.split(",") if s.strip()]
    pos_l, pos_s, neg_l, neg_s = [], [], [], []
    for n in names:
        negative = kind == PAIR and (n.startswith("--no-") or n in NEG_SHORTS)
        if n.startswith("--"):
            (neg_l if negative else pos_l).append(n)
        else:
            (neg_s if negative else pos_s).append(n)
    first_long = next((n for n in names if n.startswith("--")), None)
    if state not in STATES:
        raise ValueError(f"bad state {state!r} for {spellings}")
    if state == DEFERRED and why is None:
        why = "not yet supported by mlxcel"
    elif state == DEFERRED and not why.startswith("not yet supported"):
        why = f"not yet supported by mlxcel; {why}"
    if apply is None and why is None and inert is None:
        raise ValueError(f"{spellings}: an option needs apply, inert or a refusal")
    return Option(
        entry=None if native else (first_long or names[0]),
        longs=tuple(pos_l),
        shorts=tuple(pos_s),
        neg_longs=tuple(neg_l),
        neg_shorts=tuple(neg_s),
        kind=kind,
        metavar=mv,
        env=env,
        default=default,
        state=state,
        section=section,
        help=help,
        hidden=(state == NOT_APPLICABLE) if hidden is None else hidden,
        apply=apply,
        inert=inert,
        why=why,
        path_value=path_value,
        repeatable=repeatable,
    )


# --- inert predicates -------------------------------------------------------------------


def _num(v: str) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def eq(*accepted: str) -> Inert:
    """Inert when the value equals one of `accepted` (numerically when both parse as numbers)."""

    def pred(v: Any) -> bool:
        for a in accepted:
            if v == a:
                return True
            x, y = _num(v), _num(a)
            if x is not None and y is not None and x == y:
                return True
        return False

    return pred


def le(limit: float) -> Inert:
    return lambda v: (_num(v) is not None and _num(v) <= limit)


def lt(limit: float) -> Inert:
    return lambda v: (_num(v) is not None and _num(v) < limit)


def always(_v: Any) -> bool:
    return True


def only_negative_form(v: Any) -> bool:
    """For a bool pair whose --no-x form asks for what mlxcel already is."""
    return v is False


def only_positive_form(v: Any) -> bool:
    return v is True
