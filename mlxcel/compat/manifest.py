"""The llama-server b10621 compatibility manifest: its schema, loading and canonical form.

The manifest lives in `compat/llama-server/b10621/`: `pin.json` (the frozen reference, the
inventory counts and the shard ownership map) and one JSON file per area shard. Each shard
holds entries of three kinds (option, route, native_request_field); an entry is its kind's
fact keys followed by the seven policy keys, in that order. This module owns those key
tables, the canonical serialization, entry identities and the inventory counts, so the
validator, the extractor, the doc generator and the tests all read one definition.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 4
RELEASE = "b10621"
PIN_FILE = "pin.json"
# New upstream entries land here; the validator refuses any entry in it.
UNCLASSIFIED = "_unclassified"

STATES = ("supported", "aliased", "not_applicable", "deferred", "by_design")
POLICY_KEYS = ("state", "issue", "test", "notes", "divergence", "rationale", "mlxcel")
KINDS = ("option", "route", "native_request_field")
FACT_KEYS = {
    # help_default: the help text's own "(default: ...)" wording, or null when it states none.
    "option": ("kind", "id", "section", "long", "short", "value_hint", "env", "help_default"),
    "route": ("kind", "id", "method", "path"),
    # in_reference_count: whether the field (with its aliases) is one of the 74 inventoried
    # native fields: the top-level schema fields plus `prompt` and `id_slot`.
    "native_request_field": (
        "kind", "id", "name", "aliases", "type", "limits", "source", "in_reference_count",
    ),
}
# The mlxcel claim block: what the current code accepts. Closed set of nine keys.
CLAIM_KEYS = (
    "accepted_spellings", "accepted_on_one_binary_only", "env", "env_binding", "env_test",
    "defaults", "hidden", "route", "field",
)
CLAIM_KEYS_BY_KIND = {
    "option": frozenset(CLAIM_KEYS[:7]),
    "route": frozenset({"route"}),
    "native_request_field": frozenset({"field", "accepted_spellings"}),
}
BINARIES = ("mlxcel-server", "mlxcel serve")
ENV_BINDINGS = ("parser", "runtime")
RATIONALE_KEYS = ("kind", "reason", "revisit_if")
RATIONALE_KINDS = ("architectural", "policy")

PIN_KEYS = ("schema_version", "reference", "provenance", "counts", "shards")
SHARD_KEYS = ("schema_version", "shard", "entries")


def default_manifest_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "compat" / "llama-server" / RELEASE


def option_id(long: list[str], short: list[str]) -> str:
    return "option:" + (long[0] if long else short[0])


def route_id(method: str, path: str) -> str:
    return f"route:{method} {path}"


def field_id(name: str) -> str:
    return "field:" + name


def option_spellings(entry: dict) -> list[str]:
    return list(entry["long"]) + list(entry["short"])


def field_spellings(entry: dict) -> list[str]:
    return [entry["name"], *entry["aliases"]]


def route_identity(entry: dict) -> str:
    return f"{entry['method']} {entry['path']}"


def skeleton_policy() -> dict:
    """Policy of an entry nobody has classified yet (refused by the validator's state rule)."""
    return {
        "state": None, "issue": None, "test": None, "notes": "", "divergence": [],
        "rationale": None, "mlxcel": None,
    }


def dumps(obj: object) -> str:
    """The one canonical text form of every manifest file."""
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def entry_sort_key(entry: dict) -> tuple:
    kind = entry.get("kind")
    rank = KINDS.index(kind) if kind in KINDS else len(KINDS)
    return (rank, str(entry.get("id")))


def shard_document(name: str, entries: list[dict]) -> dict:
    return {"schema_version": SCHEMA_VERSION, "shard": name,
            "entries": sorted(entries, key=entry_sort_key)}


@dataclass
class Manifest:
    directory: Path
    pin: dict
    shards: dict[str, list[dict]]  # shard name (file stem) -> entries

    def entries(self) -> Iterator[tuple[str, dict]]:
        for name in sorted(self.shards):
            for entry in self.shards[name]:
                yield name, entry

    def of_kind(self, kind: str) -> list[dict]:
        return [e for _, e in self.entries() if e.get("kind") == kind]

    def by_id(self) -> dict[str, dict]:
        return {e["id"]: e for _, e in self.entries()}


def load_manifest(directory: Path | None = None) -> Manifest:
    directory = Path(directory) if directory is not None else default_manifest_dir()
    pin = json.loads((directory / PIN_FILE).read_text(encoding="utf-8"))
    shards = {}
    for path in sorted(directory.glob("*.json")):
        if path.name == PIN_FILE:
            continue
        doc = json.loads(path.read_text(encoding="utf-8"))
        shards[path.stem] = list(doc.get("entries", []))
    return Manifest(directory, pin, shards)


def inventory_counts(entries: list[dict]) -> dict:
    """Count the inventory the way pin.json records it (see docs/llama-server-compat.md)."""
    options = [e for e in entries if e["kind"] == "option"]
    fields = [e for e in entries if e["kind"] == "native_request_field"]
    envs = {e["env"] for e in options if e["env"]}
    return {
        "help_entries": len(options),
        "long_option_spellings": len({s for e in options for s in e["long"]}),
        "short_option_spellings": len({s for e in options for s in e["short"]}),
        "llama_env_vars": len({v for v in envs if v.startswith("LLAMA_")}),
        "other_env_vars": sorted(v for v in envs if not v.startswith("LLAMA_")),
        "routes": len([e for e in entries if e["kind"] == "route"]),
        "native_request_fields": sum(1 + len(e["aliases"]) for e in fields
                                     if e["in_reference_count"]),
        "native_request_field_entries": len(fields),
        "native_request_field_spellings": len({s for e in fields for s in field_spellings(e)}),
    }
