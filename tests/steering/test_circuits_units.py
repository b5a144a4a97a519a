"""Circuit documents, the evidence ladder, the circuit dial (both ends clamped), binding to
attached SAEs (full / slice_fallback / none), and circuits in the SQLite store."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxcel.steering import circuits as circ
from mlxcel.steering.manager import SteeringManager, delta_for
from mlxcel.steering.store import Profile, SteeringStore
from tests.steering.test_sae_units import random_sae


def circuit_doc(name="loop", rng=(0.5, 1.5), edges=(2, 3), intensity=1.0, extra=None) -> bytes:
    doc = {"kind": "mistudio.circuit-definition", "schema_version": "1", "name": name,
           "saes": [{"layer": 0, "mistudio_sae_id": "s0", "n_features": 32, "d_model": 64},
                    {"layer": 1, "mistudio_sae_id": "s1", "n_features": 32, "d_model": 64}],
           "members": [{"layer": 0, "member_kind": "feature_ref", "feature": {"feature_idx": 3, "strength": 40.0}},
                       {"layer": 1, "member_kind": "cluster_ref", "cluster_name": "c",
                        "expanded_members": [{"feature_idx": 5, "strength": -30.0},
                                             {"feature_idx": 7, "strength": 150.0}]}],
           "edges": [{"up": {"layer": 0, "feature_idx": 3}, "down": {"layer": 1, "feature_idx": 5}, "rung": r}
                     for r in edges],
           "budget": {"intensity": intensity, **({"intensity_range": list(rng)} if rng else {})},
           "provenance": {"source_note": "test"}, **(extra or {})}
    return json.dumps(doc, indent=1).encode()


def test_parse_members_rung_and_range():
    doc = circ.parse_circuit(circuit_doc())
    assert doc.layers == [0, 1] and doc.members == {0: {3: 40.0}, 1: {5: -30.0, 7: 150.0}}
    assert (doc.rung, doc.edge_count, doc.intensity_min, doc.intensity_max) == (2, 2, 0.5, 1.5)
    assert circ.parse_circuit(circuit_doc(edges=())).rung == 0  # no edges: mined only
    assert circ.parse_circuit(circuit_doc(edges=(3, 1, 2))).rung == 1  # the weakest edge


@pytest.mark.parametrize("raw, match", [
    (b"[]", "must be an object"),
    (b"{", "not JSON"),
    (circuit_doc(extra={"kind": "mistudio.cluster-definition"}), "kind"),
    (circuit_doc(extra={"schema_version": "2"}), "schema_version"),
    (circuit_doc(extra={"members": []}), "members"),
    (circuit_doc(extra={"members": [{"layer": 0, "member_kind": "cluster_ref"}]}), "expanded_members"),
    (circuit_doc(extra={"edges": [{"rung": 4}]}), "rung"),
    (circuit_doc(extra={"edges": [{"rung": 0}] * 201}), "at most 200"),
    (circuit_doc(rng=(1.5, 0.5)), "min <= max"),
    (circuit_doc(extra={"members": [{"layer": 0, "feature": {"feature_idx": i, "strength": 1}} for i in range(21)]}),
     "more than 20"),
])
def test_bad_documents_are_refused_with_the_reason(raw, match):
    with pytest.raises(circ.CircuitError, match=match):
        circ.parse_circuit(raw)


def test_rung_language_never_says_causal_below_rung_2():
    assert all("causal" not in circ.RUNG_LANGUAGE[r] for r in (0, 1))
    assert circ.rung_header(2) == '2; language="causally validated (edge)"'


def test_circuit_dial_clamps_both_ends_and_only_exact_zero_goes_below_the_floor():
    r = lambda d, lo=0.5, hi=1.5, stored=1.0: circ.resolve_circuit(d, stored, lo, hi)  # noqa: E731
    assert r(0.1) == 0.5 and r(1.9) == 1.5 and r(0.8) == 0.8
    assert r(0) == 0.0 and r("off") == 0.0 and r("min") == 0.5 and r("max") == 1.5
    assert r(None, stored=0.2) == 0.5  # the stored dial is clamped too
    assert r("min", lo=None, hi=None) == 0.0  # no declared range: min is off (CIRCUIT_INTENSITY_MIN 0)
    assert r("max", lo=None, hi=None) == 2.0
    assert circ.resolve_circuit(0.1, 1.0, None, None, floor=0.3) == 0.3  # the configured floor


@pytest.fixture
def manager(tmp_path):
    m = SteeringManager(64, 2)
    m.attach(str(random_sae(tmp_path / "s0", d_in=64, d_sae=32, layer=0, seed=1)))
    m.attach(str(random_sae(tmp_path / "s1", d_in=64, d_sae=32, layer=1, seed=2)))
    return m


def test_full_mode_scales_every_member_through_its_own_layer_and_clamps_members(manager):
    raw = circuit_doc()
    serve = manager.bind_circuit(raw)
    assert serve.mode == circ.FULL and {k: s.sae_id for k, s in serve.bound.items()} == {0: "s0", 1: "s1"}
    r = manager.circuit_steering(raw, 1.0, 1.5)
    assert r.rung == 2 and r.intensity == 1.5 and set(r.steering) == {0, 1}
    s0, s1 = manager.get("s0").sae, manager.get("s1").sae
    assert np.allclose(r.steering[0], delta_for(s0, {3: 60.0}))
    # 150 × 1.5 = 225 is clamped to 200 while -30 keeps scaling: re-derived from the authored strengths
    assert np.allclose(r.steering[1], -45.0 * s1.W_dec[5] + 200.0 * s1.W_dec[7], atol=1e-4)
    assert manager.circuit_steering(raw, 1.0, 0.1).intensity == 0.5  # floor clamp
    off = manager.circuit_steering(raw, 1.0, "off")
    assert off.steering is None and off.rung is None and off.intensity == 0.0


def test_slice_fallback_uses_the_cluster_rule_and_reports_no_rung(manager):
    manager.detach("s1")
    raw = circuit_doc()
    serve = manager.bind_circuit(raw)
    assert serve.mode == circ.SLICE and serve.unbound == [1]
    r = manager.circuit_steering(raw, 1.0, 0.1)
    assert r.rung is None and r.intensity == 0.1 and set(r.steering) == {0}  # below the floor is honoured
    assert manager.circuit_steering(raw, 1.0, "min").intensity == 0.5  # CLUSTER_INTENSITY_MIN
    manager.detach("s0")
    assert manager.circuit_steering(raw, 1.0, 1.0) == manager.circuit_steering(raw, 1.0, None)
    assert manager.bind_circuit(raw).mode is None and manager.circuit_steering(raw, 1.0, 1.0).steering is None


def test_an_sae_of_another_width_does_not_bind(tmp_path):
    m = SteeringManager(64, 2)
    m.attach(str(random_sae(tmp_path / "s0", d_in=64, d_sae=16, layer=0)))
    assert m.bind_circuit(circuit_doc()).mode is None


def test_circuits_persist_rename_on_conflict_and_one_row_is_active(tmp_path):
    store = SteeringStore(tmp_path / "state")
    a = store.create_circuit("loop", circuit_doc(), 1.0, None)
    b = store.create_circuit("loop", circuit_doc(), 1.0, None)
    assert (a.name, b.name) == ("loop", "loop (2)") and a.id.startswith("circ_")
    store.create(Profile(name="P", steering={1: 2.0}))
    store.activate("P")
    store.activate_circuit(a.id)
    assert store.active() is None and store.active_circuit().id == a.id
    store.set_circuit_intensity(a.id, 0.75)
    store.close()
    again = SteeringStore(tmp_path / "state")
    row = again.circuit("loop")
    assert row.id == a.id and row.active and row.intensity == 0.75 and row.document == circuit_doc()
    again.activate("P")
    assert again.active_circuit() is None and again.schema_version == 3


def test_dial_floors_come_from_the_environment_and_reach_the_rules(tmp_path):
    from mlxcel.cli.flags import StartupRefusal, parse_server_args

    s = parse_server_args(["-m", "x"], {"CLUSTER_INTENSITY_MIN": "0.2", "CIRCUIT_INTENSITY_MIN": "0.4"})
    assert (s.steering.cluster_intensity_min, s.steering.circuit_intensity_min) == (0.2, 0.4)
    assert parse_server_args(["-m", "x"], {}).steering.circuit_intensity_min == 0.0
    with pytest.raises((StartupRefusal, SystemExit)):
        parse_server_args(["-m", "x"], {"CIRCUIT_INTENSITY_MIN": "high"})
    m = SteeringManager(64, 2, cluster_min=0.2, circuit_min=0.4)
    m.attach(str(random_sae(tmp_path / "s0", d_in=64, d_sae=32, layer=0, seed=1)))
    m.attach(str(random_sae(tmp_path / "s1", d_in=64, d_sae=32, layer=1, seed=2)))
    assert m.circuit_steering(circuit_doc(rng=None), 1.0, "min").intensity == 0.4
    assert m.circuit_steering(circuit_doc(rng=None), 1.0, 0.1).intensity == 0.4
    cluster = Profile(name="c", steering={1: 2.0}, sae_id="s0", kind="cluster")
    assert m.resolve(cluster, "min").intensity == 0.2
