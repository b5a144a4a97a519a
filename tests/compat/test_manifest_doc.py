"""docs/llama-server-compat.md's state table is the one the manifest generates."""

from __future__ import annotations

from scripts.compat import gen_compat_doc


def test_compat_doc_table_is_current():
    assert gen_compat_doc.main(["--check"]) == 0, (
        "docs/llama-server-compat.md is stale: run scripts/compat/gen_compat_doc.py")
