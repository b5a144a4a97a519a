#!/usr/bin/env python3
"""Regenerate the state table in docs/llama-server-compat.md from the manifest.

The table (entries per state per shard, with the shard's owning issues) sits between two
marker lines; everything else in the page is hand-written. `--check` writes nothing and
exits 1 when the page's table is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from mlxcel.compat import manifest as mf  # noqa: E402

DOC = REPO_ROOT / "docs" / "llama-server-compat.md"
BEGIN = "<!-- BEGIN GENERATED: scripts/compat/gen_compat_doc.py -->"
END = "<!-- END GENERATED -->"


def render_table(manifest: mf.Manifest) -> str:
    owners = {name: spec["owners"] for name, spec in manifest.pin["shards"].items()}
    header = "| Shard | Owners | " + " | ".join(mf.STATES) + " | total |"
    lines = [header, "|" + "---|" * (len(mf.STATES) + 3)]
    totals = dict.fromkeys(mf.STATES, 0)
    for shard in sorted(manifest.shards):
        counts = dict.fromkeys(mf.STATES, 0)
        for entry in manifest.shards[shard]:
            if entry.get("state") in counts:
                counts[entry["state"]] += 1
        for s in mf.STATES:
            totals[s] += counts[s]
        who = ", ".join(f"#{n}" for n in owners.get(shard, [])) or "none"
        lines.append(f"| {shard} | {who} | " + " | ".join(str(counts[s]) for s in mf.STATES)
                     + f" | {len(manifest.shards[shard])} |")
    lines.append("| **all** | | " + " | ".join(f"**{totals[s]}**" for s in mf.STATES)
                 + f" | **{sum(totals.values())}** |")
    kinds = {k: len(manifest.of_kind(k)) for k in mf.KINDS}
    lines.append("")
    lines.append(f"Entries: {kinds['option']} options, {kinds['route']} routes, "
                 f"{kinds['native_request_field']} native request fields.")
    return "\n".join(lines)


def rewrite(text: str, table: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: {DOC} lacks the generated-table markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest-dir", type=Path, default=mf.default_manifest_dir())
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    args = ap.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    new = rewrite(text, render_table(mf.load_manifest(args.manifest_dir)))
    if new == text:
        return 0
    if args.check:
        print(f"{args.doc}: the state table is stale; run scripts/compat/gen_compat_doc.py",
              file=sys.stderr)
        return 1
    args.doc.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
