"""Native /completion request fields from the pinned sources (tools/server/server-schema.cpp).

Reads the body of `make_llama_cmpl_schema`: each `new field_<type>("name", ...)` is a field
(nested when it is an `add_subfield` argument), `->add_alias("x")` adds a spelling, and
`->set_hard_limits(a, b)` / `->set_limits(a, b)` record a refused or clamped range. Commented
code and `#if 0` blocks do not count. The few fields read outside the schema are listed
explicitly and checked to still be read where they were.
"""

from __future__ import annotations

import re
from pathlib import Path

from scripts.compat.fact_sources import DOCUMENTED_NON_SCHEMA_FIELDS, _strip_comments

# name, type, file under tools/server that reads it, source tag
OUTSIDE_SCHEMA = (
    ("prompt", "json", "server-context.cpp", "handler"),
    ("id_slot", "num", "server-context.cpp", "handler"),
    ("message_delimiters", "json", "server-context.cpp", "handler"),
    ("grammar_type", "str", "server-schema.cpp", "handler-internal"),
)
_EVENT = re.compile(
    r"new\s+field_(?P<type>\w+)\s*\(\s*\"(?P<name>[^\"]+)\""
    r"|->\s*add_alias\s*\(\s*\"(?P<alias>[^\"]+)\"\s*\)"
    r"|->\s*set_(?P<hard>hard_)?limits\s*\("
)
_IF0 = re.compile(r"^[ \t]*#if 0\b.*?^[ \t]*#endif[^\n]*$", re.S | re.M)


def _balanced_args(text: str, start: int) -> str:
    depth = 1
    i = start
    while depth:
        ch = text[i]
        depth += ch == "("
        depth -= ch == ")"
        i += 1
    return " ".join(text[start:i - 1].split())


def _schema_body(src: str) -> str:
    m = re.search(r"make_llama_cmpl_schema\s*\([^)]*\)\s*\{", src)
    if m is None:
        raise ValueError("server-schema.cpp: make_llama_cmpl_schema not found")
    end = re.compile(r"^\}", re.M).search(src, m.end())
    return src[m.end(): end.start() if end else len(src)]


def native_fields_from_source(source_dir: Path) -> list[dict]:
    server_dir = Path(source_dir) / "tools" / "server"
    src = _IF0.sub("", (server_dir / "server-schema.cpp").read_text(encoding="utf-8"))
    body = _schema_body(_strip_comments(src))
    rows: list[dict] = []
    parent = None
    for m in _EVENT.finditer(body):
        if m.group("name"):
            nested = re.search(r"add_subfield\s*\(\s*\(\s*$", body[:m.start()]) is not None
            name = m.group("name")
            if nested:
                if parent is None:
                    raise ValueError(f"subfield {name} without a parent field")
                name = f"{parent}.{name}"
            else:
                parent = name
            rows.append({"name": name, "aliases": [], "type": m.group("type"), "limits": None,
                         "source": "schema-nested" if nested else "schema"})
        elif m.group("alias"):
            rows[-1]["aliases"].append(m.group("alias"))
        else:
            args = _balanced_args(body, m.end())
            rows[-1]["limits"] = f"{'hard' if m.group('hard') else 'clamp'} [{args}]"
    for name, kind, filename, tag in OUTSIDE_SCHEMA:
        text = _strip_comments((server_dir / filename).read_text(encoding="utf-8"))
        if f'"{name}"' not in text:
            raise ValueError(f"{filename} no longer reads {name!r}: re-check the field list")
        rows.append({"name": name, "aliases": [], "type": kind, "limits": None, "source": tag})
    for row in rows:
        row["in_reference_count"] = (row["source"] == "schema"
                                     or row["name"] in DOCUMENTED_NON_SCHEMA_FIELDS)
    return rows
