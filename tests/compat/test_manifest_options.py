"""Option claims against the real flag surface of both server binaries, in both directions.

Every claimed spelling is parsed by the real parser and listed in the dump with the claimed
env binding, default and visibility; an option entry with no claim is accepted by neither
binary; every b10621 entry the surface accepts has an entry that claims it.
"""

from __future__ import annotations

import contextlib
import importlib
import io

import pytest

from mlxcel.compat import manifest as mf
from mlxcel.compat import surfaces

MANIFEST = mf.load_manifest()
OPTIONS = MANIFEST.of_kind("option")
NARGS = {"value": 1, "value2": 2}


@pytest.fixture(scope="module")
def dumps() -> dict[str, dict]:
    out = {b: surfaces.flag_surface(b) for b in mf.BINARIES}
    if all(d is None for d in out.values()):
        n = sum(1 for e in OPTIONS if e["mlxcel"])
        pytest.skip(f"flag surface absent: mlxcel.cli.flags has no dump_flag_surface yet "
                    f"({n} option claims unverified)")
    missing = [b for b, d in out.items() if d is None]
    assert not missing, f"no flag surface dump from {missing}"
    for binary, doc in out.items():
        assert doc["binary"] == binary
    return out


def _by_entry(doc: dict) -> dict[str, dict]:
    return {o["b10621_entry"]: o for o in doc["options"] if o.get("b10621_entry")}


def _binaries_for(claim: dict) -> tuple[str, ...]:
    only = claim.get("accepted_on_one_binary_only")
    return (only,) if only else mf.BINARIES


def test_option_claims_match_flag_surface(dumps):
    problems = []
    for entry in OPTIONS:
        claim = entry["mlxcel"]
        if claim is None:
            continue
        key = entry["long"][0]
        for binary in mf.BINARIES:
            o = _by_entry(dumps[binary]).get(key)
            if binary not in _binaries_for(claim):
                if o is not None:
                    problems.append(f"{entry['id']}: claimed on one binary only, but {binary} "
                                    "accepts it too")
                continue
            if o is None:
                problems.append(f"{entry['id']}: claimed, but {binary} has no such option")
                continue
            accepted = set(surfaces.dump_spellings(o))
            claimed = set(claim["accepted_spellings"])
            if claimed - accepted:
                problems.append(f"{entry['id']}: {binary} does not accept {sorted(claimed - accepted)}")
            unclaimed = (accepted & set(mf.option_spellings(entry))) - claimed
            if unclaimed:
                problems.append(f"{entry['id']}: {binary} accepts {sorted(unclaimed)} "
                                "without a claim")
            for field, dump_key in (("env", "env"), ("defaults", "default"), ("hidden", "hidden")):
                if field in claim and claim[field] != o.get(dump_key):
                    problems.append(f"{entry['id']}: claim {field}={claim[field]!r} but {binary} "
                                    f"says {o.get(dump_key)!r}")
            if "state" in o and o["state"] != entry["state"]:
                problems.append(f"{entry['id']}: manifest state {entry['state']} but the flag "
                                f"table says {o['state']}")
    assert not problems, "\n".join(problems)


def test_unclaimed_options_are_accepted_by_neither_binary(dumps):
    problems = []
    for binary, doc in dumps.items():
        accepted = {s for o in doc["options"] for s in surfaces.dump_spellings(o)}
        for entry in OPTIONS:
            if entry["mlxcel"] is None:
                hit = sorted(accepted & set(mf.option_spellings(entry)))
                if hit:
                    problems.append(f"{entry['id']}: no claim, but {binary} accepts {hit}")
        known = {e["long"][0] for e in OPTIONS}
        for key in _by_entry(doc):
            if key not in known:
                problems.append(f"{binary}: option says b10621_entry={key}, which is no b10621 "
                                "help entry")
    assert not problems, "\n".join(problems)


def test_claimed_spellings_parse(dumps):
    """The real argparse parser takes each claimed spelling (with a placeholder value)."""
    flags = importlib.import_module("mlxcel.cli.flags")
    if not (hasattr(flags, "build_parser") and hasattr(flags, "prepass")):
        pytest.skip("mlxcel.cli.flags exposes no build_parser/prepass pair")
    kinds = {o["b10621_entry"]: o.get("kind") for o in dumps["mlxcel-server"]["options"]}
    problems = []
    for entry in OPTIONS:
        claim = entry["mlxcel"]
        if claim is None or "mlxcel-server" not in _binaries_for(claim):
            continue
        nargs = NARGS.get(kinds.get(entry["long"][0]), 0)
        for spelling in claim["accepted_spellings"]:
            argv = [spelling] + ["1"] * nargs
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    flags.build_parser("mlxcel-server").parse_args(flags.prepass(argv))
            except SystemExit as e:  # --help exits 0; a usage error or refusal does not
                if e.code not in (0, None):
                    problems.append(f"{entry['id']}: {argv} is not parsed ({e})")
    assert not problems, "\n".join(problems)
