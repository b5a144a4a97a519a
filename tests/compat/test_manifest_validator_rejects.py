"""The validator's own negative coverage: each rule rejects a mutated throwaway copy.

Every case copies the committed manifest to a temporary directory, applies one mutation,
rewrites the touched file canonically (so only the intended rule can fire, unless the case is
about serialization) and asserts the validator reports a problem naming that rule.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.compat import manifest as mf
from scripts.ci import check_llama_compat_manifest as check

ROOT = Path(__file__).resolve().parents[2]
SOURCE = mf.default_manifest_dir()


def _load(d: Path, shard: str) -> dict:
    return json.loads((d / f"{shard}.json").read_text(encoding="utf-8"))


def _save(d: Path, shard: str, doc: dict) -> None:
    (d / f"{shard}.json").write_text(mf.dumps(doc), encoding="utf-8")


def _entry(doc: dict, eid: str) -> dict:
    return next(e for e in doc["entries"] if e["id"] == eid)


def _edit(shard: str, eid: str, **changes):
    def mutate(d: Path) -> None:
        doc = _load(d, shard)
        _entry(doc, eid).update(changes)
        _save(d, shard, doc)
    return mutate


def _edit_claim(shard: str, eid: str, **changes):
    def mutate(d: Path) -> None:
        doc = _load(d, shard)
        _entry(doc, eid)["mlxcel"].update(changes)
        _save(d, shard, doc)
    return mutate


def _rename_key(shard: str, eid: str, old: str, new: str):
    def mutate(d: Path) -> None:
        doc = _load(d, shard)
        entries = doc["entries"]
        i = next(i for i, e in enumerate(entries) if e["id"] == eid)
        entries[i] = {(new if k == old else k): v for k, v in entries[i].items()}
        _save(d, shard, doc)
    return mutate


def _move_to_unclassified(d: Path) -> None:
    doc = _load(d, "speculative")
    entry = doc["entries"].pop()
    _save(d, "speculative", doc)
    _save(d, mf.UNCLASSIFIED, mf.shard_document(mf.UNCLASSIFIED, [entry]))


def _drop_entry(d: Path) -> None:
    doc = _load(d, "speculative")
    doc["entries"].pop()
    _save(d, "speculative", doc)


def _pin(mutate_pin):
    def mutate(d: Path) -> None:
        pin = json.loads((d / mf.PIN_FILE).read_text(encoding="utf-8"))
        mutate_pin(pin)
        (d / mf.PIN_FILE).write_text(mf.dumps(pin), encoding="utf-8")
    return mutate


def _non_canonical(d: Path) -> None:
    path = d / "authentication.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4) + "\n")


BD = ("sampling-and-grammar", "option:--temp")
DEFERRED = ("speculative", "option:--spec-type")
SUPPORTED = ("transport-tls-cors", "option:--host")
RATIONALE_OK = {"kind": "policy", "reason": "r", "revisit_if": "x"}

CASES = {
    "unknown state": (_edit(*DEFERRED, state="partial"), "is not one of"),
    "supported with divergence": (_edit(*SUPPORTED, divergence=["differs"]),
                                  "may not record a divergence"),
    "deferred without issue": (_edit(*DEFERRED, issue=None), "needs the issue"),
    "deferred without notes": (_edit(*DEFERRED, notes=""), "needs notes"),
    "issue outside shard owners": (_edit(*DEFERRED, issue=9), "does not own this shard"),
    "rationale on deferred": (_edit(*DEFERRED, rationale=RATIONALE_OK),
                              "rationale must be null"),
    "by_design without divergence": (_edit(*BD, divergence=[]), "must record its divergence"),
    "by_design without test": (_edit(*BD, test=None), "needs a test"),
    "by_design bad rationale kind": (_edit(*BD, rationale={**RATIONALE_OK, "kind": "taste"}),
                                     "rationale.kind"),
    "policy rationale without revisit_if": (
        _edit(*BD, rationale={**RATIONALE_OK, "revisit_if": None}), "needs revisit_if"),
    "architectural rationale with revisit_if": (
        _edit(*BD, rationale={**RATIONALE_OK, "kind": "architectural"}), "revisit_if null"),
    "rationale extra key": (_edit(*BD, rationale={**RATIONALE_OK, "why": "x"}),
                            "exactly the keys"),
    "misspelled policy key": (_rename_key(*DEFERRED, "divergence", "divergance"),
                              "keys must be exactly"),
    "unknown claim key": (_edit_claim(*SUPPORTED, divergence=[]), "unknown key"),
    "claim key of another kind": (_edit_claim(*SUPPORTED, route="GET /health"),
                                  "do not apply to a option"),
    "claimed spelling not b10621": (_edit_claim(*SUPPORTED, accepted_spellings=["--hots"]),
                                    "are not spellings"),
    "runtime env binding without test": (
        _edit_claim(*SUPPORTED, env_binding="runtime", env_test=None), "needs an env_test"),
    "supported without claim": (_edit(*SUPPORTED, mlxcel=None), "needs an mlxcel claim"),
    "test pointer to missing file": (_edit(*DEFERRED, test="tests/compat/nope.py::test_x"),
                                     "no file"),
    "test pointer to missing function": (
        _edit(*DEFERRED, test="tests/compat/test_manifest_valid.py::test_nope"),
        "is not defined"),
    "aliased route claim equal to b10621": (
        _edit("routes", "route:GET /health", state="aliased"), "different mlxcel route"),
    "unclassified entry": (_move_to_unclassified, "unclassified"),
    "count drift": (_drop_entry, "counts"),
    "shard without owners": (_pin(lambda p: p["shards"]["speculative"].update(owners=[])),
                             "at least one owner"),
    "wrong schema_version": (_pin(lambda p: p.update(schema_version=3)), "schema_version"),
    "non-canonical file": (_non_canonical, "canonical"),
}


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    target = tmp_path / "b10621"
    shutil.copytree(SOURCE, target)
    return target


def test_committed_copy_is_clean(copy):
    assert check.validate(copy, ROOT) == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_rejects(case, copy):
    mutate, needle = CASES[case]
    mutate(copy)
    problems = check.validate(copy, ROOT)
    assert problems, f"{case}: the validator accepted the mutated manifest"
    assert any(needle in p for p in problems), f"{case}: no problem mentions {needle!r}: {problems}"


def test_script_exit_status_on_a_broken_copy(copy):
    CASES["supported with divergence"][0](copy)
    proc = subprocess.run(
        [sys.executable, "scripts/ci/check_llama_compat_manifest.py", "--manifest-dir", str(copy)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "aliased, not_applicable, deferred or by_design" in proc.stderr
