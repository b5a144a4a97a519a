"""How b10621's sampling flags land in `ServerSettings`: the server-wide sampler defaults.

Each honoured flag writes one `SamplingParams` field into `settings.sampling.overrides` (the field names
are the native request's), so a request inherits the value wherever it sends no field of its
own. Value domains follow b10621's argument parser: `--repeat-last-n` and `--dry-penalty-last-n`
take -1 ("the whole context") and nothing lower, `--dry-base 0` keeps the default, `--mirostat`
is 0, 1 or 2. `--samplers` / `--sampler-seq` names that b10621 would drop with a warning are
refused here instead, so a typo never silently shortens the chain. The whole set is checked once
more as a `SamplingParams` when parsing ends (`check_sampling`), so an impossible combination
stops startup rather than the first request.
"""

from __future__ import annotations

import re
from typing import Any

from mlxcel.cli.options_apply import as_float, as_int
from mlxcel.config.refusal import StartupRefusal


def shown(x: float) -> str:
    """A float default as b10621's help prints it (two decimals)."""
    return f"{x:.2f}"


def sampler_letters(samplers: tuple[str, ...]) -> str:
    """A stage order in --sampler-seq's one-letter form."""
    from mlxcel.engine.sampling_params import SAMPLER_CHARS

    letter = {name: ch for ch, name in SAMPLER_CHARS.items()}
    return "".join(letter[name] for name in samplers)


def _store(settings: Any, field: str, value: Any) -> None:
    settings.sampling.overrides[field] = value


def number(field: str, conv: str = "float", *, minimum: float | None = None, allowed: tuple | None = None):
    """A plain numeric sampler default; `minimum`/`allowed` are b10621's refusals."""

    def apply(settings: Any, value: str, spelling: str) -> None:
        v = as_int(value, spelling) if conv == "int" else as_float(value, spelling)
        if minimum is not None and v < minimum:
            raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected >= {minimum:g})")
        if allowed is not None and v not in allowed:
            raise StartupRefusal(f"invalid value for {spelling}: {value!r} "
                                 f"(expected one of: {', '.join(str(a) for a in allowed)})")
        _store(settings, field, v)

    return apply


def apply_dry_base(settings: Any, value: str, spelling: str) -> None:
    # b10621 keeps its default when given 0; a base below 1.0 turns DRY off, as in the chain
    v = as_float(value, spelling)
    if v != 0.0:
        _store(settings, "dry_base", v)


def apply_samplers(settings: Any, value: str, spelling: str) -> None:
    from mlxcel.engine.sampling_params import samplers_from_names

    try:
        _store(settings, "samplers", samplers_from_names(value.split(";"), allow_alt_names=True))
    except ValueError as e:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} ({e})") from None


def apply_sampler_seq(settings: Any, value: str, spelling: str) -> None:
    from mlxcel.engine.sampling_params import samplers_from_chars

    try:
        _store(settings, "samplers", samplers_from_chars(value))
    except ValueError as e:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} ({e})") from None


def apply_dry_sequence_breakers(settings: Any, values: list[str], _spelling: str) -> None:
    """Repeatable: the first occurrence replaces the default set, "none" empties it. Escapes
    (\\n, \\t, ...) are processed once parsing ends, as b10621 does unless --no-escape."""
    out: list[str] = []
    for v in values:
        if v == "none":
            out.clear()
        else:
            out.append(v)
    settings.sampling.dry_sequence_breakers_raw = out


_BIAS = re.compile(r"\s*([+-]?\d+)\s*([+-])(.*)", re.DOTALL)


def parse_logit_bias(text: str) -> tuple[int, float]:
    """`TOKEN_ID(+|-)BIAS`, e.g. `15043+1` or `15043-1.5`."""
    m = _BIAS.fullmatch(text)
    if m is None:
        raise ValueError("invalid input format")
    try:
        bias = float(m.group(3).strip())
    except ValueError:
        raise ValueError("invalid input format") from None
    return int(m.group(1)), -bias if m.group(2) == "-" else bias


def apply_logit_bias(settings: Any, values: list[str], spelling: str) -> None:
    """Repeatable: each occurrence adds one (token, bias); a token named twice adds up."""
    for v in values:
        try:
            settings.sampling.logit_bias.append(parse_logit_bias(v))
        except ValueError as e:
            raise StartupRefusal(f"invalid value for {spelling}: {v!r} ({e}; expected TOKEN_ID+BIAS or "
                                 f"TOKEN_ID-BIAS)") from None


def apply_ignore_eos(settings: Any, value: Any, _spelling: str) -> None:
    settings.sampling.ignore_eos = bool(value)


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\", "a": "\a", "b": "\b",
            "f": "\f", "v": "\v", "?": "?"}


def process_escapes(text: str) -> str:
    """b10621's escape pass over command-line strings: \\n \\r \\t \\' \\" \\\\ and \\xHH;
    an unknown escape is kept as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
                i += 2
                continue
            if nxt == "x" and re.fullmatch(r"[0-9A-Fa-f]{2}", text[i + 2:i + 4]):
                out.append(chr(int(text[i + 2:i + 4], 16)))
                i += 4
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def finish_sampling(settings: Any) -> None:
    """Resolve the breakers' escapes and refuse a default set the chain cannot run with."""
    from mlxcel.engine.sampling_params import SamplingParams

    raw = settings.sampling.dry_sequence_breakers_raw
    if raw is not None:
        settings.sampling.overrides["dry_sequence_breakers"] = tuple(
            process_escapes(b) if settings.sampling.escape else b for b in raw)
    try:
        SamplingParams(**settings.sampling.overrides)
    except ValueError as e:
        raise StartupRefusal(f"invalid sampling defaults: {e}") from None
