"""Parse `llama-server --help` into option facts, one per help entry, in help order.

Layout of the help text (common/arg.cpp's printer): an entry starts in column 0 with `-`;
its argument column is padded to column 40 and the description starts there, unless the
arguments are 40 characters or longer, in which case the whole first line is arguments and
the description starts on the next line. Continuation lines are indented. Section banners
look like `----- common params -----`.
"""

from __future__ import annotations

import re

DESC_COLUMN = 40
_BANNER = re.compile(r"^-----\s+(.*?)\s+params\s+-----\s*$")
_ITEM_SPLIT = re.compile(r",\s+")
_ENV = re.compile(r"\(env: ([A-Za-z0-9_]+)\)")
_DEFAULT = re.compile(r"\bdefault: ([^,)]*)")


def _split_args(args: str) -> tuple[list[str], list[str], str | None]:
    long: list[str] = []
    short: list[str] = []
    hint = None
    for item in _ITEM_SPLIT.split(args.strip()):
        words = item.split(" ", 1)
        spelling = words[0]
        if spelling.startswith("--"):
            long.append(spelling)
        elif spelling.startswith("-"):
            short.append(spelling)
        else:
            raise ValueError(f"unexpected argument item {item!r} in {args!r}")
        if len(words) > 1 and words[1].strip():
            hint = words[1].strip()
    return long, short, hint


def _help_default(description: str) -> str | None:
    m = _DEFAULT.search(description)
    return m.group(1).strip() if m else None


def parse_help(text: str) -> list[dict]:
    """Return one dict per entry: section, long, short, value_hint, env, help_default."""
    entries: list[dict] = []
    section = None
    current = None
    desc: list[str] = []

    def close() -> None:
        if current is None:
            return
        joined = " ".join(part.strip() for part in desc if part.strip())
        envs = _ENV.findall(joined)
        if len(envs) > 1:
            raise ValueError(f"entry {current['long'] or current['short']} names two env vars")
        current["env"] = envs[0] if envs else None
        current["help_default"] = _help_default(_ENV.sub("", joined))
        entries.append(current)

    for line in text.splitlines():
        banner = _BANNER.match(line)
        if banner:
            close()
            current, desc = None, []
            section = banner.group(1)
            continue
        if line.startswith("-"):
            close()
            if len(line) > DESC_COLUMN and line[DESC_COLUMN - 1] == " ":
                args, first = line[:DESC_COLUMN], line[DESC_COLUMN:]
            else:
                args, first = line, ""
            long, short, hint = _split_args(args)
            if section is None:
                raise ValueError("help entry before any section banner")
            current = {"section": section, "long": long, "short": short, "value_hint": hint}
            desc = [first]
            continue
        if current is not None and line.startswith(" "):
            desc.append(line)
        elif not line.strip():
            # A blank line ends the entry; an indented whitespace-only line is kept above.
            if current is not None and not line:
                close()
                current, desc = None, []
        else:
            raise ValueError(f"unrecognised help line: {line!r}")
    close()
    return entries
