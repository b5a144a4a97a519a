"""Change the policy of manifest entries by id, writing the canonical form back.

    python -m scripts.compat.classify 'route:GET /tools' 'route:POST /tools' \
        --state not_applicable --issue 4 --test tests/api/test_http_gate.py::test_tools_and_cors_proxy_stubs \
        --notes '...' --claim route=self

`--claim route=self` claims the entry's own method/path; `--claim field=self` its field name;
`--claim none` drops the claim. Only the policy keys change; facts are the extractor's.
"""

from __future__ import annotations

import argparse
import sys

from mlxcel.compat import manifest as mf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="classify")
    p.add_argument("ids", nargs="+")
    p.add_argument("--state", choices=["supported", "aliased", "not_applicable", "deferred", "by_design"])
    p.add_argument("--issue", type=int)
    p.add_argument("--test")
    p.add_argument("--notes")
    p.add_argument("--divergence", action="append", help="repeat for several; 'none' clears")
    p.add_argument("--claim", choices=["route=self", "field=self", "none"])
    args = p.parse_args(argv)
    m = mf.load_manifest()
    wanted = set(args.ids)
    touched: set[str] = set()
    for shard, entry in m.entries():
        if entry["id"] not in wanted:
            continue
        wanted.discard(entry["id"])
        touched.add(shard)
        for key in ("state", "issue", "test", "notes"):
            if getattr(args, key) is not None:
                entry[key] = getattr(args, key)
        if args.divergence is not None:
            entry["divergence"] = [] if args.divergence == ["none"] else args.divergence
        if args.claim == "none":
            entry["mlxcel"] = None
        elif args.claim == "route=self":
            entry["mlxcel"] = {**(entry["mlxcel"] or {}), "route": f"{entry['method']} {entry['path']}"}
        elif args.claim == "field=self":
            entry["mlxcel"] = {**(entry["mlxcel"] or {}), "field": entry["name"]}
    if wanted:
        print(f"unknown ids: {sorted(wanted)}", file=sys.stderr)
        return 1
    for shard in touched:
        path = m.directory / f"{shard}.json"
        path.write_text(mf.dumps(mf.shard_document(shard, m.shards[shard])), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
