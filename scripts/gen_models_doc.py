#!/usr/bin/env python3
"""Write docs/models.md from the family registry (mlxcel/models/catalog.py renders it).

`--check` writes nothing and exits 1 when the committed page differs from the generated one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from mlxcel.models.catalog import models_doc  # noqa: E402

DOC = REPO_ROOT / "docs" / "models.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/models.md is stale; write nothing")
    args = ap.parse_args(argv)
    text = models_doc()
    current = DOC.read_text() if DOC.is_file() else None
    if args.check:
        if current != text:
            print(f"{DOC.relative_to(REPO_ROOT)} is stale: run scripts/gen_models_doc.py", file=sys.stderr)
            return 1
        return 0
    if current != text:
        DOC.write_text(text)
        print(f"wrote {DOC.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
