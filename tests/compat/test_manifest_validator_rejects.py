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
from scripts.ci import open_issues as oi

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
DEFERRED = ("runtime-and-context", "field:message_delimiters")


def _as_deferred(**changes):
    """The sample entry made deferred (the committed manifest may hold none), then changed."""
    return _edit(*DEFERRED, state="deferred", divergence=[], **changes)

SUPPORTED = ("transport-tls-cors", "option:--host")
RATIONALE_OK = {"kind": "policy", "reason": "r", "revisit_if": "x"}

CASES = {
    "unknown state": (_edit(*DEFERRED, state="partial"), "is not one of"),
    "supported with divergence": (_edit(*SUPPORTED, divergence=["differs"]),
                                  "may not record a divergence"),
    "deferred without issue": (_as_deferred(issue=None), "needs the issue"),
    "deferred without notes": (_as_deferred(notes=""), "needs notes"),
    "issue outside shard owners": (_as_deferred(issue=9), "does not own this shard"),
    "rationale on deferred": (_as_deferred(rationale=RATIONALE_OK),
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
    "test pointer to missing file": (_as_deferred(test="tests/compat/nope.py::test_x"),
                                     "no file"),
    "test pointer to missing function": (
        _as_deferred(test="tests/compat/test_manifest_valid.py::test_nope"),
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


# --check-issues-open: issue 2 is in these shards' owner sets, so pointing an entry at it passes
# the ownership rule and only the open-issue gate can object.
CLOSED = 2


# A deferred entry in a shard the closed issue owns. Made in the copy rather than picked from
# the committed manifest, which may hold no deferred entry at all once the work has landed.
DEFERRED_CASE = ("runtime-and-context", "field:n_cache_reuse")


def _with_a_deferred_entry(copy: Path) -> None:
    _edit(*DEFERRED_CASE, state="deferred", divergence=[])(copy)


GATED = {
    "deferred": DEFERRED_CASE,
}
UNGATED = {
    "aliased": ("model-source", "option:--model"),
    "not_applicable": ("runtime-and-context", "option:--cache-idle-slots"),
    "by_design": ("runtime-and-context", "option:--parallel"),
    "supported": SUPPORTED,
}


def _open_set(d: Path) -> set[int]:
    """Every issue the copy mentions, except the one these cases treat as closed."""
    m = mf.load_manifest(d)
    mentioned = {e["issue"] for _, e in m.entries() if isinstance(e["issue"], int)}
    mentioned |= {n for spec in m.pin["shards"].values() for n in spec["owners"]}
    return mentioned - {CLOSED}


def test_committed_copy_passes_the_open_issue_gate(copy):
    assert check.validate(copy, ROOT, _open_set(copy)) == []


@pytest.mark.parametrize("state", sorted(GATED))
def test_open_issue_gate_rejects_a_closed_issue(state, copy):
    shard, eid = GATED[state]
    if state == "deferred":
        _with_a_deferred_entry(copy)
    assert _entry(_load(copy, shard), eid)["state"] == state
    _edit(shard, eid, issue=CLOSED)(copy)
    assert check.validate(copy, ROOT) == [], "the structural rules alone must accept this copy"
    problems = check.validate(copy, ROOT, _open_set(copy))
    assert problems == [f"{shard}.json: {eid}: {'an' if state[0] == 'a' else 'a'} {state} entry "
                        f"points at issue #{CLOSED}, which is not open (open: "
                        + ", ".join(f"#{n}" for n in sorted(_open_set(copy)))
                        + "); re-home it to the open issue that owns the remaining work"]


@pytest.mark.parametrize("state", sorted(UNGATED))
def test_open_issue_gate_ignores_by_design_and_supported(state, copy):
    shard, eid = UNGATED[state]
    assert _entry(_load(copy, shard), eid)["state"] == state
    _edit(shard, eid, issue=CLOSED)(copy)
    assert check.validate(copy, ROOT, _open_set(copy)) == []


def _script(copy: Path, *args: str, path: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/ci/check_llama_compat_manifest.py", "--manifest-dir",
         str(copy), *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": path})


def _fake_tracker(bin_dir: Path, body: str) -> str:
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "issues"
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)
    return str(bin_dir)


def test_open_issue_gate_script_with_explicit_set(copy, tmp_path):
    _with_a_deferred_entry(copy)
    _edit(*GATED["deferred"], issue=CLOSED)(copy)
    open_arg = ",".join(str(n) for n in sorted(_open_set(copy)))
    proc = _script(copy, "--check-issues-open", "--open-issues", open_arg, path=str(tmp_path))
    assert proc.returncode == 1
    assert f"{GATED['deferred'][1]}: a deferred entry points at issue #2" in proc.stderr
    proc = _script(copy, "--check-issues-open", "--open-issues", open_arg + ",2",
                   path=str(tmp_path))
    assert proc.returncode == 0, proc.stderr


def test_open_issue_gate_reads_the_tracker_tool(copy, tmp_path):
    listing = "".join(f"# issue {n}: filed by a session · open\\n> # a title\\n\\n"
                      for n in sorted(_open_set(copy)))
    path = _fake_tracker(tmp_path / "bin", f'[ "$1" = list ] || exit 9\nprintf "{listing}"\n')
    assert _script(copy, "--check-issues-open", path=path).returncode == 0
    _with_a_deferred_entry(copy)
    _edit(*GATED["deferred"], issue=CLOSED)(copy)
    proc = _script(copy, "--check-issues-open", path=path)
    assert proc.returncode == 1
    assert "field:n_cache_reuse: a deferred entry points at issue #2" in proc.stderr


@pytest.mark.parametrize("args,tracker,message", [
    (["--check-issues-open"], None, "pass --open-issues N,N,... or run where the `issues` "
                                    "command is on PATH (it is not)"),
    (["--check-issues-open"], "echo down >&2; exit 3", "`issues list` exited 3: down"),
    (["--check-issues-open"], "echo something else", "output format is not understood"),
    (["--check-issues-open", "--open-issues", "4,x"], None, "'x' is not an issue number"),
    (["--open-issues", "4"], None, "only feeds --check-issues-open"),
])
def test_open_issue_gate_never_passes_without_an_open_set(args, tracker, message, copy,
                                                          tmp_path):
    path = _fake_tracker(tmp_path / "bin", tracker) if tracker else str(tmp_path)
    proc = _script(copy, *args, path=path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


def test_tracker_listing_parse():
    text = ("# issue 3: filed by a session · open\n> # issue 9: a quoted title\n\n"
            "# issue 2: filed by a session · closed\n# issue 12: no state word\n")
    assert oi.parse_tracker_listing(text) == {3, 12}
    assert oi.parse_tracker_listing("") == set()
    with pytest.raises(oi.OpenIssuesUnavailable):
        oi.parse_tracker_listing("3 4 5\n")
