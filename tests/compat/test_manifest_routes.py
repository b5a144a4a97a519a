"""Route claims against the real Litestar router, in both directions.

Every route claim resolves among the mounted routes; an aliased claim's b10621 identity is
not mounted; every mounted b10621 route has an entry claiming it.
"""

from __future__ import annotations

import pytest

from mlxcel.compat import manifest as mf
from mlxcel.compat import surfaces

ROUTES = mf.load_manifest().of_kind("route")


@pytest.fixture(scope="module")
def mounted() -> set[tuple[str, str]]:
    pairs = surfaces.mounted_routes()
    if pairs is None:
        n = sum(1 for e in ROUTES if e["mlxcel"])
        pytest.skip(f"route surface absent: mlxcel.api.app.build_app does not exist yet "
                    f"({n} route claims unverified)")
    return pairs


def _pair(identity: str) -> tuple[str, str]:
    method, path = identity.split(" ", 1)
    return method, path


def test_route_claims_resolve(mounted):
    problems = []
    for entry in ROUTES:
        claim = entry["mlxcel"]
        if claim is None:
            continue
        if _pair(claim["route"]) not in mounted:
            problems.append(f"{entry['id']}: claims {claim['route']}, which is not mounted")
        if entry["state"] == "aliased" and _pair(mf.route_identity(entry)) in mounted:
            problems.append(f"{entry['id']}: aliased, yet the b10621 route itself is mounted")
    assert not problems, "\n".join(problems)


def test_mounted_b10621_routes_are_claimed(mounted):
    claimed = {_pair(e["mlxcel"]["route"]) for e in ROUTES if e["mlxcel"]}
    b10621 = {(e["method"], e["path"]) for e in ROUTES}
    unclaimed = sorted((mounted & b10621) - claimed)
    assert not unclaimed, (f"mounted b10621 routes without a manifest claim: {unclaimed}; "
                           "flip their entries (state and mlxcel.route)")
