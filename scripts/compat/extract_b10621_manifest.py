#!/usr/bin/env python3
"""Regenerate the facts of the llama-server b10621 manifest from upstream.

Options come from `llama-server --help` (the binary, or a saved help text); routes and native
request fields from the pinned sources (`--source-dir`) or the saved reference tables.
Facts are rewritten wholesale; the seven policy keys are preserved by entry id, and an entry
keeps the shard it was classified into. Entries new upstream land in `_unclassified.json`,
which the validator refuses until a person classifies them. pin.json's counts are recomputed;
its reference block, provenance and shard owner map are kept. The output is canonical and
sorted, so running the extractor twice changes nothing.

With `--archive`, the archive must match the pinned SHA-256 and the `--llama-server` binary
must be byte-identical to one of its members, both checked before the binary is executed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from mlxcel.compat import manifest as mf  # noqa: E402
from scripts.compat import fact_sources  # noqa: E402
from scripts.compat.help_parse import parse_help  # noqa: E402
from scripts.compat.source_fields import native_fields_from_source  # noqa: E402


# Written into a fresh pin.json; afterwards pin.json's own block is kept as it is.
PINNED_REFERENCE = {
    "project": "ggml-org/llama.cpp",
    "binary": "llama-server",
    "release": mf.RELEASE,
    "version": "0.3.0",
    "published": "2026-08-25",
    "commit": "c1d0e7a004015f23bc0233470b747b596f29b264",
    "archive": "llama-b10621-bin-macos-arm64.tar.gz",
    "archive_sha256": "429c8270608600188035e5e92f7d78dffb7900904fe7dd7e6a84f48068cd13cf",
}


class ExtractError(Exception):
    """A refusal with a one-line reason (bad archive, mismatched binary, unparsable input)."""


def _sha256(data_or_path) -> str:
    h = hashlib.sha256()
    if isinstance(data_or_path, bytes):
        h.update(data_or_path)
        return h.hexdigest()
    with open(data_or_path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_archive(archive: Path, binary: Path, expected_sha256: str) -> str:
    """Check the archive digest, then find the binary among its members; return that member."""
    digest = _sha256(archive)
    if digest != expected_sha256:
        raise ExtractError(f"{archive}: SHA-256 {digest} is not the pinned {expected_sha256}")
    want = _sha256(binary)
    with tarfile.open(archive, mode="r:*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            fh = tar.extractfile(member)
            if fh is not None and _sha256(fh.read()) == want:
                return member.name
    raise ExtractError(f"{binary} is not byte-identical to any member of {archive}")


def help_from_binary(binary: Path) -> str:
    env = dict(os.environ)
    libdir = str(binary.resolve().parent)
    for var in ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH"):
        env[var] = libdir + (os.pathsep + env[var] if env.get(var) else "")
    proc = subprocess.run([str(binary), "--help"], capture_output=True, text=True, env=env,
                          timeout=120)
    if proc.returncode != 0:
        raise ExtractError(f"{binary} --help exited {proc.returncode}: {proc.stderr.strip()[:300]}")
    return proc.stdout


def option_facts(help_text: str) -> list[dict]:
    facts = []
    for row in parse_help(help_text):
        facts.append({"kind": "option", "id": mf.option_id(row["long"], row["short"]), **row})
    if facts and not any(f["id"] == "option:--rpc" for f in facts):
        # llama-server lists --rpc only when ggml has the RPC backend, as release builds do.
        print("warning: the help has no --rpc entry: this llama-server was built without the "
              "RPC backend (cmake -DGGML_RPC=ON, as upstream's release builds are); "
              "option:--rpc will be dropped", file=sys.stderr)
    return facts


def route_facts(rows: list[tuple[str, str]]) -> list[dict]:
    return [{"kind": "route", "id": mf.route_id(m, p), "method": m, "path": p} for m, p in rows]


def field_facts(rows: list[dict]) -> list[dict]:
    return [{"kind": "native_request_field", "id": mf.field_id(r["name"]), **r} for r in rows]


def _ordered(facts: dict, policy: dict) -> dict:
    keys = mf.FACT_KEYS[facts["kind"]]
    out = {k: facts[k] for k in keys}
    skeleton = mf.skeleton_policy()
    out.update({k: policy.get(k, skeleton[k]) for k in mf.POLICY_KEYS})
    return out


def merge(facts: list[dict], old: mf.Manifest | None) -> dict[str, list[dict]]:
    """Place each fact entry in its old shard with its old policy; new ones go unclassified."""
    seen: set[str] = set()
    placed: dict[str, list[dict]] = {}
    old_home = {}
    if old is not None:
        old_home = {e["id"]: (shard, e) for shard, e in old.entries()}
        for shard in old.shards:
            if shard != mf.UNCLASSIFIED:
                placed[shard] = []
    for fact in facts:
        if fact["id"] in seen:
            raise ExtractError(f"duplicate upstream entry {fact['id']}")
        seen.add(fact["id"])
        shard, prev = old_home.get(fact["id"], (mf.UNCLASSIFIED, {}))
        placed.setdefault(shard, []).append(_ordered(fact, prev))
    gone = sorted(set(old_home) - seen)
    if gone:
        print(f"note: {len(gone)} entries are gone upstream and were dropped: "
              + ", ".join(gone[:10]), file=sys.stderr)
    return placed


def build_pin(old_pin: dict | None, entries: list[dict], shard_names: list[str]) -> dict:
    old_pin = old_pin or {}
    owners = old_pin.get("shards", {})
    return {
        "schema_version": mf.SCHEMA_VERSION,
        "reference": old_pin.get("reference") or PINNED_REFERENCE,
        "provenance": old_pin.get("provenance", ""),
        "counts": mf.inventory_counts(entries),
        # A brand-new shard starts with no owners: a person has to name them.
        "shards": {name: {"owners": owners.get(name, {}).get("owners", [])}
                   for name in sorted(shard_names) if name != mf.UNCLASSIFIED},
    }


def render(placed: dict[str, list[dict]], pin: dict) -> dict[str, str]:
    """File name -> canonical text for the whole manifest directory."""
    files = {mf.PIN_FILE: mf.dumps(pin)}
    for shard, entries in placed.items():
        if shard == mf.UNCLASSIFIED and not entries:
            continue
        files[f"{shard}.json"] = mf.dumps(mf.shard_document(shard, entries))
    return files


def extract(help_text: str, routes: list[tuple[str, str]], fields: list[dict],
            manifest_dir: Path) -> dict[str, str]:
    old = mf.load_manifest(manifest_dir) if (manifest_dir / mf.PIN_FILE).exists() else None
    facts = option_facts(help_text) + route_facts(routes) + field_facts(fields)
    placed = merge(facts, old)
    entries = [e for es in placed.values() for e in es]
    pin = build_pin(old.pin if old else None, entries, list(placed))
    return render(placed, pin)


def write_tree(manifest_dir: Path, files: dict[str, str], check: bool) -> list[str]:
    """Write (or, with check, only compare) the files; return the names that differ."""
    changed = []
    existing = {p.name for p in manifest_dir.glob("*.json")} if manifest_dir.exists() else set()
    for name in sorted(set(files) | existing):
        path = manifest_dir / name
        new = files.get(name)
        old = path.read_text(encoding="utf-8") if path.exists() else None
        if new == old:
            continue
        changed.append(name)
        if check:
            continue
        if new is None:
            path.unlink()
        else:
            manifest_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(new, encoding="utf-8")
    return changed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--llama-server", type=Path, help="llama-server binary to run with --help")
    src.add_argument("--help-text", type=Path, help="saved `llama-server --help` output")
    p.add_argument("--archive", type=Path,
                   help="release archive; verified against pin.json before the binary runs")
    p.add_argument("--source-dir", type=Path, help="pinned llama.cpp source tree")
    p.add_argument("--routes-tsv", type=Path, help="saved route table (METHOD<TAB>PATH)")
    p.add_argument("--native-fields-tsv", type=Path, help="saved native field table")
    p.add_argument("--manifest-dir", type=Path, default=mf.default_manifest_dir())
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when the manifest differs from the extraction")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if (args.source_dir is None) == (args.routes_tsv is None and args.native_fields_tsv is None):
            raise ExtractError("give --source-dir, or both --routes-tsv and --native-fields-tsv")
        if args.source_dir is None and (args.routes_tsv is None or args.native_fields_tsv is None):
            raise ExtractError("--routes-tsv and --native-fields-tsv go together")
        if args.llama_server is not None:
            if args.archive is not None:
                pin = mf.load_manifest(args.manifest_dir).pin
                member = verify_archive(args.archive, args.llama_server,
                                        pin["reference"]["archive_sha256"])
                print(f"verified: {args.llama_server} is archive member {member}", file=sys.stderr)
            else:
                print(f"warning: running {args.llama_server} unverified (no --archive)",
                      file=sys.stderr)
            help_text = help_from_binary(args.llama_server)
        else:
            if args.archive is not None:
                raise ExtractError("--archive verifies a binary; it needs --llama-server")
            help_text = args.help_text.read_text(encoding="utf-8")
        if args.source_dir is not None:
            routes = fact_sources.routes_from_source(args.source_dir)
            fields = native_fields_from_source(args.source_dir)
        else:
            routes = fact_sources.routes_from_tsv(args.routes_tsv)
            fields = fact_sources.native_fields_from_tsv(args.native_fields_tsv)
        files = extract(help_text, routes, fields, args.manifest_dir)
    except (ExtractError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    changed = write_tree(args.manifest_dir, files, args.check)
    verb = "differ" if args.check else "rewritten"
    print(f"{len(changed)} file(s) {verb}" + (": " + ", ".join(changed) if changed else ""),
          file=sys.stderr)
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
