"""Native request field claims against `NativeCompletionRequest`, in both directions."""

from __future__ import annotations

import pytest

from mlxcel.compat import manifest as mf
from mlxcel.compat import surfaces

FIELDS = mf.load_manifest().of_kind("native_request_field")


@pytest.fixture(scope="module")
def accepted() -> set[str]:
    names = surfaces.native_request_fields()
    if names is None:
        n = sum(1 for e in FIELDS if e["mlxcel"])
        pytest.skip(f"native field surface absent: no NativeCompletionRequest under mlxcel.api "
                    f"({n} field claims unverified)")
    return names


def _claimed_names(entry: dict) -> set[str]:
    claim = entry["mlxcel"]
    return {claim["field"], *claim.get("accepted_spellings", [])}


def test_field_claims_are_accepted(accepted):
    problems = []
    for entry in FIELDS:
        if entry["mlxcel"] is None:
            continue
        missing = sorted(_claimed_names(entry) - accepted)
        if missing:
            problems.append(f"{entry['id']}: claims {missing}, not accepted by the struct")
        if entry["state"] == "aliased" and set(mf.field_spellings(entry)) & accepted:
            problems.append(f"{entry['id']}: aliased, yet the struct accepts the b10621 name")
    assert not problems, "\n".join(problems)


def test_accepted_b10621_fields_are_claimed(accepted):
    b10621 = {s for e in FIELDS for s in mf.field_spellings(e)}
    claimed = {s for e in FIELDS if e["mlxcel"] for s in _claimed_names(e)}
    unclaimed = sorted((accepted & b10621) - claimed)
    assert not unclaimed, (f"NativeCompletionRequest accepts b10621 fields without a manifest "
                           f"claim: {unclaimed}; flip their entries")
