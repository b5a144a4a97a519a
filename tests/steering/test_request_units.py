"""The per-request steering surface, mostly without a server: every `return_sae_activations` refusal
and limit, the `millm` object's positions and read points, the dial echo's absence rules, the
`steering_intensity` refusal code, and the concurrent-operator-wins rule (a request's own
steering never touches, and is never touched by, the server's steering state). One test uses the
shared default server for the chat refusals that precede any SAE lookup."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.engine.types import GenerationRequest
from mlxcel.steering import requests as steer
from mlxcel.steering.requests import RequestRefused
from mlxcel.steering.manager import SteeringManager
from mlxcel.steering.store import Profile, SteeringStore
from tests.steering.test_sae_units import random_sae


@pytest.fixture
def manager(tmp_path):
    m = SteeringManager(64, 4)
    m.attach(str(random_sae(tmp_path / "s", d_in=64, d_sae=32, layer=1)))
    return m


def refused(manager, spec, n_prompt=5, max_tokens=10) -> RequestRefused:
    with pytest.raises(RequestRefused) as e:
        steer.activation_reader(manager, spec, n_prompt, max_tokens)
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_parameter", "return_sae_activations")
    return e.value


def test_every_activation_refusal_is_a_400_before_generation(manager, tmp_path):
    assert "none is attached" in refused(SteeringManager(64, 4), {}).message
    assert "none is attached" in refused(None, {}).message
    assert "unknown keys: colour" in refused(manager, {"colour": 1}).message
    assert "no SAE 'x'" in refused(manager, {"sae_id": "x"}).message
    assert "feature index 32 is outside" in refused(manager, {"features": [0, 32]}).message
    for bad in ([], [-1], [True], "3"):
        refused(manager, {"features": bad})
    assert "SAE_ACTIVATIONS_MAX_TOP_K (64)" in refused(manager, {"top_k": 65}).message
    for bad in (0, -1, 2.0, True):
        refused(manager, {"top_k": bad})
    refused(manager, {"read_point": "unsteered"})  # reported on scoring passes, never asked for
    for bad in ("first", {"start": 3, "end": 2}, {"start": -1, "end": 2}, {"start": 0}, {"start": 0, "end": 1, "x": 0}):
        refused(manager, {"positions": bad})
    manager.attach(str(random_sae(tmp_path / "t", d_in=64, d_sae=32, layer=2)))
    message = refused(manager, {}).message  # several attached: the candidates are named
    assert "needs sae_id" in message and "s, t" in message


def test_the_worst_case_entry_limit_counts_max_tokens_in_full(tmp_path):
    m = SteeringManager(64, 4)
    m.attach(str(random_sae(tmp_path / "w", d_in=64, d_sae=128, layer=1)))
    limit = steer.SAE_ACTIVATIONS_MAX_ENTRIES
    assert limit == 65_536 and steer.SAE_ACTIVATIONS_MAX_TOP_K == 64
    # exactly at the limit is served; one position more is refused, naming the limit
    steer.activation_reader(m, {"top_k": 64, "positions": "completion"}, 10, limit // 64)
    assert "SAE_ACTIVATIONS_MAX_ENTRIES (65536)" in refused(m, {"top_k": 64, "positions": "completion"}, 10,
                                                            limit // 64 + 1).message
    refused(m, {"top_k": 64, "positions": "all"}, 1, limit // 64)  # all: prompt + max_tokens
    refused(m, {"top_k": 64, "positions": {"start": 0, "end": limit // 64 + 1}})
    # features narrow k: 2 candidates x 32,768 positions fit
    steer.activation_reader(m, {"top_k": 64, "features": [1, 2], "positions": "completion"}, 1, limit // 2)


def test_positions_read_points_and_the_millm_object(manager):
    sae = manager.attached["s"].sae
    rng = np.random.default_rng(0)
    pre = rng.standard_normal((6, 64)).astype(np.float32)
    post = pre + 3.0 * sae.W_dec[7]
    tokens = [10, 11, 12, 13, 14, 15]  # 4 prompt tokens, 2 generated ones that were fed back

    def render(**spec):
        reader = steer.activation_reader(manager, spec, 4, 3)
        reader.read(tokens[:4], pre[:4], post[:4])  # prefill, then one decode step at a time
        for j in (4, 5):
            reader.read(tokens[j:j + 1], pre[j:j + 1], post[j:j + 1])
        return reader.render()

    out = render(top_k=2, positions="completion")
    assert set(out) == {"sae_id", "layer", "read_point", "positions", "note"}
    assert (out["sae_id"], out["layer"], out["read_point"]) == ("s", 1, "post_steering")
    assert [(p["position"], p["token_id"]) for p in out["positions"]] == [(4, 14), (5, 15)]
    assert all(set(f) == {"index", "value"} and len(p["features"]) == 2 for p in out["positions"] for f in p["features"])
    assert [p["position"] for p in render(positions="prompt")["positions"]] == [0, 1, 2, 3]
    assert [p["position"] for p in render(positions="all")["positions"]] == list(range(6))
    assert [p["position"] for p in render(positions="last")["positions"]] == [5]
    assert [p["position"] for p in render(positions={"start": 2, "end": 5})["positions"]] == [2, 3, 4]
    assert [p["position"] for p in render(positions={"start": 5, "end": 99})["positions"]] == [5]
    # features restrict the candidates; the values are the SAE's encoding at the read point
    post_read = render(features=[7, 3], top_k=1, positions="last")
    pre_read = render(features=[7, 3], top_k=1, positions="last", read_point="pre_steering")
    assert pre_read["read_point"] == "pre_steering" and "not an unsteered counterfactual" in post_read["note"]
    for read, x in ((post_read, post), (pre_read, pre)):
        acts = sae.encode(x[5:6])[0]
        best = 7 if acts[7] >= acts[3] else 3
        assert read["positions"][0]["features"] == [{"index": best, "value": pytest.approx(float(acts[best]))}]
    scoring = steer.scoring_reader(manager, {"positions": "prompt"}, 4)
    assert scoring.render()["read_point"] == "unsteered"


def request(fields, manager, store):
    greq = GenerationRequest(prompt=[1, 2, 3], max_tokens=4)
    headers, _ = steer.apply(steer.take_fields(dict(fields)), manager, store, greq)
    return greq, headers


def test_the_dial_echo_is_absent_exactly_when_the_dial_changes_nothing(manager, tmp_path):
    store = SteeringStore(tmp_path / "state")
    store.create(Profile(name="empty", steering={}, sae_id="s"))
    store.create(Profile(name="A", steering={5: 40.0}, sae_id="s"))
    echo = steer.INTENSITY_HEADER
    assert request({"steering_intensity": 1.0}, SteeringManager(64, 4), store)[1] == {}  # no SAE attached
    assert request({"steering_intensity": 1.0}, manager, store)[1] == {}  # no live values: an empty base
    assert request({"steering_intensity": "off"}, manager, store)[1] == {}
    assert request({"profile": "empty", "steering_intensity": "off"}, manager, store)[1] == {}
    assert request({"profile": "empty", "steering_intensity": 1.0}, manager, store)[1] == {}
    assert request({"profile": "A", "steering_intensity": "off"}, manager, store)[1] == {echo: "0.0"}
    assert request({"profile": "A", "steering_intensity": 1.25}, manager, store)[1] == {echo: "1.25"}
    assert request({"profile": "A"}, manager, store)[1] == {}  # no dial sent
    manager.set_values("s", {2: 30.0})
    assert request({"steering_intensity": "max"}, manager, store)[1] == {echo: "2.0"}
    manager.set_enabled("s", False)  # steering disabled and a dial-only request
    assert request({"steering_intensity": 1.0}, manager, store)[1] == {}
    with pytest.raises(RequestRefused) as e:
        request({"profile": "nope", "steering_intensity": 1.0}, manager, store)
    assert (e.value.status, e.value.code) == (404, "profile_not_found")


@pytest.mark.parametrize("bad", [2.01, -0.5, "MAX", "", True, {"x": 1}, [1], float("inf")])
def test_a_bad_steering_intensity_is_invalid_parameter(bad):
    with pytest.raises(RequestRefused) as e:
        steer.take_fields({"steering_intensity": bad})
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_parameter", "steering_intensity")


def test_a_request_never_undoes_a_concurrent_operator_change(manager, tmp_path):
    store = SteeringStore(tmp_path / "state")
    store.create(Profile(name="A", steering={5: 40.0}, sae_id="s"))
    manager.set_values("s", {2: 30.0})
    live_before = manager.live_steering()[1].copy()
    greq, _ = request({"profile": "A", "steering_intensity": 0.5}, manager, store)  # admitted, generating
    own = greq.steering[1].copy()
    assert manager.attached["s"].values == {2: 30.0}  # the request's profile was never written into the server
    manager.set_values("s", {9: -12.0}, replace=True)  # the operator acts while the request runs
    assert manager.attached["s"].values == {9: -12.0}  # and stays live: there is no restore to revert it
    assert not np.array_equal(manager.live_steering()[1], live_before)
    np.testing.assert_array_equal(greq.steering[1], own)  # the running request keeps exactly its own delta


def test_chat_refusals_that_come_before_any_sae_is_looked_at(default_server):
    """On the shared default server (no SAE attached): the one-position-axis refusals of
    return_sae_activations on chat, and a steering field on a chat scoring request."""
    import httpx

    def chat(**extra):
        r = httpx.post(default_server.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, **extra})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    acts = {"return_sae_activations": {"top_k": 2}}
    for extra in ({"n": 2}, {"extra_messages": [[{"role": "user", "content": "yo"}]]}):
        err = chat(**acts, **extra)
        assert (err["code"], err["param"]) == ("invalid_parameter", "return_sae_activations")
        assert "one position axis" in err["message"]
    assert "none is attached" in chat(**acts)["message"]
    for field, value in (("profile", "A"), ("steering_intensity", 0.5)):
        err = chat(max_tokens=1, logprobs=True, allowed_token_ids=[1, 2], **{field: value})
        assert (err["code"], err["param"]) == ("field_not_honoured", field) and "never steered" in err["message"]


def test_the_rung_is_absent_when_a_circuit_does_not_steer(tmp_path):
    """An unparseable stored definition, and "min" on a circuit with no declared range (the
    floor CIRCUIT_INTENSITY_MIN is 0, so min is off): no steering, no rung."""
    from tests.steering.test_circuits_units import circuit_doc

    m = SteeringManager(64, 2)
    m.attach(str(random_sae(tmp_path / "s0", d_in=64, d_sae=32, layer=0, seed=1)))
    m.attach(str(random_sae(tmp_path / "s1", d_in=64, d_sae=32, layer=1, seed=2)))
    assert m.circuit_steering(circuit_doc(), 1.0, None).rung == 2  # the control: it steers in full
    broken = m.circuit_steering(b'{"kind": "mistudio.circuit-definition"', 1.0, None)
    assert (broken.steering, broken.rung, broken.intensity) == (None, None, None)
    floor = m.circuit_steering(circuit_doc(rng=None), 1.0, "min")
    assert (floor.steering, floor.rung, floor.intensity) == (None, None, 0.0)


def test_an_sae_is_attached_from_a_directory_or_a_store_entry(tmp_path):
    from mlxcel.api.management.envelope import Refusal
    from mlxcel.api.management.saes import _path
    from mlxcel.api.state import AppState
    from mlxcel.config.settings import ServerSettings

    state = AppState(settings=ServerSettings(), store_root=tmp_path)
    assert _path({"sae": "org/my-sae"}, state) == tmp_path.resolve() / "org/my-sae"  # a model-store entry
    # a SAELens directory, read only under the store root or MLXCEL_SAE_DIR (tests/steering/test_sae_paths.py)
    assert _path({"path": str(tmp_path / "sae")}, state) == tmp_path.resolve() / "sae"
    for bad in ({}, {"path": ""}, {"sae": 3}, {"path": "/data/sae"}, {"sae": "/abs/sae"}):
        with pytest.raises(Refusal) as e:
            _path(bad, state)
        assert (e.value.status, e.value.code) == (400, "invalid_parameter")


def test_monitoring_reads_its_read_point_keeps_running_statistics_and_bounds_its_history(manager):
    from mlxcel.steering.monitor import Monitor

    sae = manager.attached["s"].sae
    rng = np.random.default_rng(1)
    pre = rng.standard_normal((5, 64)).astype(np.float32)
    post = pre + 4.0 * sae.W_dec[9]
    seen = {}
    for point in ("pre_steering", "post_steering"):
        m = Monitor(sae, top_k=3, read_point=point, history=4)
        m.record([1, 2, 3], pre[:3], post[:3])
        m.record([4, 5], pre[3:], post[3:])
        read = pre if point == "pre_steering" else post
        # encoded per record, as the monitor does: a product's rounding depends on its row count
        acts = np.concatenate([sae.encode(read[:3]), sae.encode(read[3:])])
        assert len(m.recent(100)) == 4 and m.recent(1)[0]["token_id"] == 5  # bounded, newest first
        stats = {r["feature_idx"]: r for r in m.statistics()["features"]}
        assert m.statistics()["total_activations"] == 5  # the statistics are not bounded by the history
        for i, row in stats.items():
            assert row["max"] == pytest.approx(float(acts[:, i].max()))
            assert row["mean"] == pytest.approx(float(acts[:, i].mean()), rel=1e-5, abs=1e-6)
        seen[point] = stats
    assert seen["pre_steering"] != seen["post_steering"]
