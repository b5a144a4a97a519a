"""Upstream fact sources for the extractor: routes and native request fields.

Two interchangeable inputs per fact kind: the pinned llama.cpp source tree (`--source-dir`)
or the saved reference tables (`routes.tsv`, `native-fields.tsv`). Both produce the same
plain rows, in upstream order, so the extractor does not care which one it was given.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

# Non-schema fields the server README documents; with the top-level schema fields and their
# aliases they make the 74 inventoried native fields (see pin.json "provenance").
DOCUMENTED_NON_SCHEMA_FIELDS = ("prompt", "id_slot")

# Routes registered outside tools/server/server.cpp (server-http.cpp's UI asset routes when the
# UI is embedded; the Vertex AI predict route when AIP_MODE=PREDICTION, at its default path).
# The source parser checks that each still appears in the source before adding it.
_EXTRA_ROUTES = (
    ("GET", "/", "server-http.cpp", 'api_prefix + "/",'),
    ("GET", "/index.html", "server-http.cpp", '"/index.html"'),
    ("POST", "/predict", "server-http.cpp", '"/predict"'),
)
_REGISTRATION = re.compile(r"\bctx_http\s*\.\s*(get|post|del)\s*\(\s*\"([^\"]+)\"")
_HTTP_METHOD = {"get": "GET", "post": "POST", "del": "DELETE"}


def routes_from_tsv(path: Path) -> list[tuple[str, str]]:
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        method, route = line.split("\t")
        rows.append((method.strip(), route.strip()))
    return rows


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def routes_from_source(source_dir: Path) -> list[tuple[str, str]]:
    server_dir = Path(source_dir) / "tools" / "server"
    server_cpp = _strip_comments((server_dir / "server.cpp").read_text(encoding="utf-8"))
    rows: list[tuple[str, str]] = []
    for m in _REGISTRATION.finditer(server_cpp):
        # /tools and /cors-proxy are registered in both arms of an if (real or 403 handler).
        row = (_HTTP_METHOD[m.group(1)], m.group(2))
        if row not in rows:
            rows.append(row)
    for method, route, filename, needle in _EXTRA_ROUTES:
        text = _strip_comments((server_dir / filename).read_text(encoding="utf-8"))
        if needle not in text:
            raise ValueError(f"{filename} no longer mentions {needle}: re-check {method} {route}")
        rows.append((method, route))
    return rows


def native_fields_from_tsv(path: Path) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [_field_row(r["field"], r["aliases"], r["type"], r["limits"], r["source"])
            for r in rows]


# The saved table spells the nested source tag in words; the source parser's tag is canonical.
_TSV_SOURCE = {"schema (nested subfield)": "schema-nested"}


def _field_row(name: str, aliases: str, kind: str, limits: str, source: str) -> dict:
    source = _TSV_SOURCE.get(source, source)
    return {
        "name": name,
        "aliases": [a for a in aliases.split(",") if a],
        "type": kind,
        "limits": limits or None,
        "source": source,
        "in_reference_count": source == "schema" or name in DOCUMENTED_NON_SCHEMA_FIELDS,
    }
