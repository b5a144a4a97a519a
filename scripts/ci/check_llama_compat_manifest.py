#!/usr/bin/env python3
"""Offline validation of the llama-server b10621 compatibility manifest.

Checks, each reported with the file and entry it concerns:
- schema_version 4 and the closed key sets of pin.json, the shards and every entry
  (fact keys of the entry's kind, then the seven policy keys, in that order);
- the inventory counts: recomputed from the entries, equal to pin.json's, equal to the
  b10621 reference (249 help entries, 323 long spellings, 134 LLAMA_* variables plus HF_TOKEN
  and MTMD_BACKEND_DEVICE, 53 routes, 74 native fields);
- states and their obligations, the divergence rule (a divergence forbids supported), the
  rationale rule (only on by_design, closed key set, kind architectural or policy);
- shard ownership (an entry's issue must be one of its shard's owners) and that nothing is
  left in _unclassified.json;
- the mlxcel claim block's nine keys, their types, and their fit to the entry;
- test pointers `path::function` that resolve to a file and a test function in the repo;
- canonical serialization (the file text is exactly what the canonical dump produces);
- with --check-issues-open, that every deferred entry points at an open issue
  (scripts/ci/open_issues.py: the set comes from --open-issues or `issues list`).
Exit status 0 when clean, 1 with one line per problem otherwise, 2 when --check-issues-open
cannot learn which issues are open.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from mlxcel.compat import manifest as mf  # noqa: E402
from scripts.ci import open_issues as oi  # noqa: E402

# The frozen reference inventory; a pin bump has to change these on purpose.
REFERENCE_COUNTS = {
    "help_entries": 249,
    "long_option_spellings": 323,
    "llama_env_vars": 134,
    "other_env_vars": ["HF_TOKEN", "MTMD_BACKEND_DEVICE"],
    "routes": 53,
    "native_request_fields": 74,
}
_ROUTE_CLAIM = re.compile(r"^(GET|POST|PUT|PATCH|DELETE) /\S*$")
_TEST_POINTER = re.compile(r"^(?P<path>[\w./-]+\.py)::(?P<names>[\w:]+?)(?:\[.*\])?$")


class Problems:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.lines.append(f"{where}: {message}")


def resolve_test(pointer: str, repo_root: Path) -> str | None:
    """None when `path::func` (or `path::Class::method`) exists, else why not."""
    m = _TEST_POINTER.match(pointer)
    if not m:
        return f"test pointer {pointer!r} is not path/to/test_file.py::test_name"
    path = repo_root / m.group("path")
    if not path.is_file():
        return f"test pointer {pointer!r}: no file {m.group('path')}"
    text = path.read_text(encoding="utf-8")
    for name in m.group("names").split("::"):
        if not re.search(rf"^\s*(async\s+)?(def|class)\s+{re.escape(name)}\b", text, re.M):
            return f"test pointer {pointer!r}: {name} is not defined in {m.group('path')}"
    return None


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v for v in value)


def check_claim(where: str, entry: dict, claim: object, repo_root: Path, p: Problems) -> None:
    if not isinstance(claim, dict):
        p.add(where, "mlxcel must be null or an object")
        return
    kind = entry["kind"]
    unknown = sorted(set(claim) - set(mf.CLAIM_KEYS))
    if unknown:
        p.add(where, f"mlxcel has unknown key(s) {unknown}; the recognised keys are "
                     f"{', '.join(mf.CLAIM_KEYS)}")
    misplaced = sorted(set(claim) & set(mf.CLAIM_KEYS) - mf.CLAIM_KEYS_BY_KIND[kind])
    if misplaced:
        p.add(where, f"mlxcel key(s) {misplaced} do not apply to a {kind} entry")
    if "accepted_spellings" in claim:
        spellings = claim["accepted_spellings"]
        own = (mf.option_spellings(entry) if kind == "option" else mf.field_spellings(entry))
        if not _is_str_list(spellings) or not spellings:
            p.add(where, "mlxcel.accepted_spellings must be a non-empty list of strings")
        elif kind == "option" and entry["state"] != "aliased" and set(spellings) - set(own):
            p.add(where, f"mlxcel.accepted_spellings {sorted(set(spellings) - set(own))} are "
                         "not spellings of this b10621 entry")
        elif kind == "native_request_field" and set(spellings) - set(own):
            p.add(where, "mlxcel.accepted_spellings must be the field's b10621 spellings")
    if kind == "option" and "accepted_spellings" not in claim:
        p.add(where, "an option claim must name its accepted_spellings")
    if "accepted_on_one_binary_only" in claim and claim["accepted_on_one_binary_only"] not in (
            None, *mf.BINARIES):
        p.add(where, f"mlxcel.accepted_on_one_binary_only must be null or one of {mf.BINARIES}")
    if "env" in claim:
        env = claim["env"]
        if env is not None and not isinstance(env, str):
            p.add(where, "mlxcel.env must be a string or null")
        elif env is not None and env != entry.get("env") and entry["state"] != "aliased":
            p.add(where, f"mlxcel.env {env} is not this entry's b10621 variable {entry.get('env')}")
    binding = claim.get("env_binding")
    if binding is not None and binding not in mf.ENV_BINDINGS:
        p.add(where, f"mlxcel.env_binding must be one of {mf.ENV_BINDINGS} or null")
    if binding is not None and not claim.get("env"):
        p.add(where, "mlxcel.env_binding needs mlxcel.env")
    if binding == "runtime":
        if not claim.get("env_test"):
            p.add(where, "a runtime env_binding needs an env_test pointer")
    if claim.get("env_test"):
        why = resolve_test(claim["env_test"], repo_root)
        if why:
            p.add(where, why)
    if "defaults" in claim and claim["defaults"] is not None and not isinstance(claim["defaults"], str):
        p.add(where, "mlxcel.defaults must be the default as text, or null")
    if "hidden" in claim and not isinstance(claim["hidden"], bool):
        p.add(where, "mlxcel.hidden must be true or false")
    if "route" in claim:
        route = claim["route"]
        if not isinstance(route, str) or not _ROUTE_CLAIM.match(route):
            p.add(where, "mlxcel.route must read 'METHOD /path'")
        elif entry["state"] == "aliased" and route == mf.route_identity(entry):
            p.add(where, "an aliased route claim must name a different mlxcel route "
                         "(answering the b10621 route itself is supported)")
    if "field" in claim:
        field = claim["field"]
        if not isinstance(field, str) or not field:
            p.add(where, "mlxcel.field must be a field name")
        elif entry["state"] == "aliased" and field in mf.field_spellings(entry):
            p.add(where, "an aliased field claim must name a different mlxcel field "
                         "(accepting the b10621 name itself is supported)")
    if kind == "route" and "route" not in claim:
        p.add(where, "a route claim must name mlxcel.route")
    if kind == "native_request_field" and "field" not in claim:
        p.add(where, "a native field claim must name mlxcel.field")


def check_rationale(where: str, rationale: object, p: Problems) -> None:
    if not isinstance(rationale, dict) or list(rationale) != list(mf.RATIONALE_KEYS):
        p.add(where, f"rationale must be an object with exactly the keys {mf.RATIONALE_KEYS}")
        return
    kind, reason, revisit = rationale["kind"], rationale["reason"], rationale["revisit_if"]
    if kind not in mf.RATIONALE_KINDS:
        p.add(where, f"rationale.kind must be one of {mf.RATIONALE_KINDS}")
    if not isinstance(reason, str) or not reason.strip():
        p.add(where, "rationale.reason must say why the divergence is permanent")
    if kind == "policy" and (not isinstance(revisit, str) or not revisit.strip()):
        p.add(where, "a policy rationale needs revisit_if: what would reopen the decision")
    if kind == "architectural" and revisit is not None:
        p.add(where, "an architectural rationale must have revisit_if null")


def check_entry(where: str, entry: dict, owners: list[int], repo_root: Path,
                p: Problems) -> None:
    kind = entry.get("kind")
    if kind not in mf.KINDS:
        p.add(where, f"unknown kind {kind!r}")
        return
    expected = list(mf.FACT_KEYS[kind]) + list(mf.POLICY_KEYS)
    if list(entry) != expected:
        extra = sorted(set(entry) - set(expected))
        missing = [k for k in expected if k not in entry]
        detail = (f"unknown {extra} " if extra else "") + (f"missing {missing} " if missing else "")
        p.add(where, f"keys must be exactly {expected} in that order ({detail or 'order differs'})")
        return
    state, issue, test = entry["state"], entry["issue"], entry["test"]
    notes, divergence, rationale = entry["notes"], entry["divergence"], entry["rationale"]
    if state not in mf.STATES:
        p.add(where, f"state {state!r} is not one of {mf.STATES}")
        return
    if issue is not None and (not isinstance(issue, int) or isinstance(issue, bool)):
        p.add(where, "issue must be an issue number or null")
    elif issue is not None and issue not in owners:
        p.add(where, f"issue #{issue} does not own this shard (owners: {owners})")
    if not isinstance(notes, str):
        p.add(where, "notes must be a string")
    if not isinstance(divergence, list) or not all(isinstance(d, str) and d.strip()
                                                   for d in divergence):
        p.add(where, "divergence must be a list of non-empty strings")
        divergence = []
    if test is not None:
        why = resolve_test(test, repo_root) if isinstance(test, str) else "test must be a string"
        if why:
            p.add(where, why)
    if state == "supported" and divergence:
        p.add(where, "a supported entry may not record a divergence: classify it aliased, "
                     "not_applicable, deferred or by_design and name the owning issue")
    if state in ("aliased", "not_applicable", "deferred"):
        if issue is None:
            p.add(where, f"a {state} entry needs the issue that owns it")
        if not (isinstance(notes, str) and notes.strip()):
            p.add(where, f"a {state} entry needs notes")
    if state == "by_design":
        if not divergence:
            p.add(where, "a by_design entry must record its divergence (without one it is supported)")
        if not (isinstance(notes, str) and notes.strip()):
            p.add(where, "a by_design entry needs notes")
        if test is None:
            p.add(where, "a by_design entry needs a test that pins the permanent behaviour")
        check_rationale(where, rationale, p)
    elif rationale is not None:
        p.add(where, f"rationale must be null on a {state} entry (only by_design argues permanence)")
    claim = entry["mlxcel"]
    if claim is not None:
        check_claim(where, entry, claim, repo_root, p)
    if state in ("supported", "aliased", "by_design") and claim is None:
        p.add(where, f"a {state} entry needs an mlxcel claim naming what mlxcel accepts")


def check_counts(manifest: mf.Manifest, p: Problems) -> None:
    entries = [e for _, e in manifest.entries() if isinstance(e, dict) and e.get("kind") in mf.KINDS]
    try:
        counted = mf.inventory_counts(entries)
    except (KeyError, TypeError) as e:
        p.add(mf.PIN_FILE, f"counts cannot be computed ({e!r}); fix the entry keys first")
        return
    pinned = manifest.pin.get("counts", {})
    if counted != pinned:
        p.add(mf.PIN_FILE, f"counts {pinned} differ from the entries' own counts {counted}")
    for key, want in REFERENCE_COUNTS.items():
        if counted.get(key) != want:
            p.add(mf.PIN_FILE, f"{key} is {counted.get(key)}; the b10621 reference is {want}")


def check_canonical(path: Path, doc: object, p: Problems) -> None:
    if path.read_text(encoding="utf-8") != mf.dumps(doc):
        p.add(path.name, "not in canonical form (json indent 2, UTF-8, trailing newline, "
                         "entries sorted by kind then id); rerun the extractor")


def validate(manifest_dir: Path, repo_root: Path = REPO_ROOT,
             open_issues: set[int] | None = None) -> list[str]:
    """Problem lines; with `open_issues`, the --check-issues-open gate runs too."""
    p = Problems()
    pin_path = manifest_dir / mf.PIN_FILE
    try:
        manifest = mf.load_manifest(manifest_dir)
    except (OSError, json.JSONDecodeError) as e:
        return [f"{manifest_dir}: cannot load ({e})"]
    pin = manifest.pin
    if list(pin) != list(mf.PIN_KEYS):
        p.add(mf.PIN_FILE, f"keys must be exactly {mf.PIN_KEYS} in that order")
    if pin.get("schema_version") != mf.SCHEMA_VERSION:
        p.add(mf.PIN_FILE, f"schema_version must be {mf.SCHEMA_VERSION}")
    check_canonical(pin_path, pin, p)
    shard_map = pin.get("shards", {})
    for name, spec in shard_map.items():
        owners = spec.get("owners") if isinstance(spec, dict) else None
        if list(spec) != ["owners"] or not owners or not all(isinstance(o, int) for o in owners):
            p.add(mf.PIN_FILE, f"shards[{name}] must be {{\"owners\": [issue, ...]}} with at "
                               "least one owner")
        if name not in manifest.shards:
            p.add(mf.PIN_FILE, f"shard {name} has no file {name}.json")
    seen: dict[str, str] = {}
    for name in sorted(manifest.shards):
        path = manifest_dir / f"{name}.json"
        doc = json.loads(path.read_text(encoding="utf-8"))
        if name == mf.UNCLASSIFIED:
            for entry in doc.get("entries", []):
                p.add(path.name, f"{entry.get('id')} is new upstream and unclassified: move it "
                                 "to its area shard and give it a state")
            continue
        if name not in shard_map:
            p.add(path.name, "shard is not in pin.json's shard map")
        if list(doc) != list(mf.SHARD_KEYS) or doc.get("schema_version") != mf.SCHEMA_VERSION \
                or doc.get("shard") != name:
            p.add(path.name, f"must be {{schema_version: 4, shard: \"{name}\", entries: [...]}}")
        check_canonical(path, doc, p)
        owners = (shard_map.get(name) or {}).get("owners") or []
        for entry in doc.get("entries", []):
            eid = entry.get("id") if isinstance(entry, dict) else None
            where = f"{path.name}: {eid}"
            if eid in seen:
                p.add(where, f"duplicate id (also in {seen[eid]})")
            seen[str(eid)] = path.name
            check_entry(where, entry, owners, repo_root, p)
    check_counts(manifest, p)
    if open_issues is not None:
        p.lines += oi.closed_issue_problems(
            ((f"{shard}.json", e) for shard, e in manifest.entries()
             if shard != mf.UNCLASSIFIED and isinstance(e, dict)), open_issues)
    return p.lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest-dir", type=Path, default=mf.default_manifest_dir())
    ap.add_argument("--repo-root", type=Path, default=REPO_ROOT,
                    help="where test pointers resolve (default: this checkout)")
    ap.add_argument("--check-issues-open", action="store_true",
                    help="also require every deferred entry to point at an open issue")
    ap.add_argument("--open-issues", metavar="N,N,...",
                    help="the open issue numbers for --check-issues-open (default: ask the "
                         "`issues list` command; with neither, the check fails)")
    args = ap.parse_args(argv)
    open_set = None
    if args.open_issues is not None and not args.check_issues_open:
        print("error: --open-issues only feeds --check-issues-open; add that flag",
              file=sys.stderr)
        return 2
    if args.check_issues_open:
        try:
            open_set, source = oi.resolve_open_issues(args.open_issues)
        except oi.OpenIssuesUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"open issues (from {source}): "
              + (", ".join(f"#{n}" for n in sorted(open_set)) or "none"), file=sys.stderr)
    problems = validate(args.manifest_dir, args.repo_root, open_set)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s) in {args.manifest_dir}", file=sys.stderr)
        return 1
    print(f"ok: {args.manifest_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
