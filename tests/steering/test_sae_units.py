"""SAE loading and refusals, steering deltas, the intensity rules, and the SQLite store."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxcel.steering import intensity as dial
from mlxcel.steering.manager import SteeringError, SteeringManager, delta_for
from mlxcel.steering.sae import SAEError, check_compatible, load_sae, save_sae
from mlxcel.steering.store import MIGRATIONS, Profile, SteeringStore


def random_sae(path, d_in=64, d_sae=32, layer=1, seed=0, **cfg):
    rng = np.random.default_rng(seed)
    W_dec = rng.standard_normal((d_sae, d_in)).astype(np.float32)
    save_sae(path, {"d_in": d_in, "d_sae": d_sae, "hook_name": f"blocks.{layer}.hook_resid_post",
                    "hook_layer": layer, **cfg},
             {"W_enc": W_dec.T, "W_dec": W_dec, "b_enc": np.zeros(d_sae), "b_dec": np.zeros(d_in)})
    return path


def test_load_saelens_layout_and_encode(tmp_path):
    sae = load_sae(random_sae(tmp_path / "s"))
    assert (sae.layer, sae.d_in, sae.d_sae, sae.activation, sae.sae_id) == (1, 64, 32, "relu", "s")
    x = sae.W_dec[3:4] * 5  # a residual along feature 3's decoder direction
    assert int(np.argmax(sae.encode(x)[0])) == 3


def test_resid_pre_reads_the_previous_layer_output_and_embeddings_are_refused(tmp_path):
    p = random_sae(tmp_path / "pre", hook_name="blocks.2.hook_resid_pre", hook_layer=2)
    assert load_sae(p).layer == 1
    p0 = random_sae(tmp_path / "pre0", hook_name="blocks.0.hook_resid_pre", hook_layer=0)
    with pytest.raises(SAEError, match="embeddings"):
        load_sae(p0)


def test_jumprelu_needs_threshold_and_thresholds(tmp_path):
    with pytest.raises(SAEError, match="threshold"):
        load_sae(random_sae(tmp_path / "j", architecture="jumprelu"))


def test_shape_mismatch_and_missing_files_are_refused(tmp_path):
    p = random_sae(tmp_path / "bad")
    cfg = json.loads((p / "cfg.json").read_text())
    (p / "cfg.json").write_text(json.dumps({**cfg, "d_sae": 33}))
    with pytest.raises(SAEError, match="W_enc has shape"):
        load_sae(p)
    with pytest.raises(SAEError, match="not a SAELens"):
        load_sae(tmp_path / "nothing")


def test_compatibility_check_names_the_mismatch(tmp_path):
    sae = load_sae(random_sae(tmp_path / "s", layer=5))
    check_compatible(sae, 64, 6)
    with pytest.raises(SAEError, match="hidden size is 576"):
        check_compatible(sae, 576, 6)
    with pytest.raises(SAEError, match=r"layers 0\.\.1"):
        check_compatible(sae, 64, 2)


def test_delta_is_clamped_sum_of_decoder_rows(tmp_path):
    sae = load_sae(random_sae(tmp_path / "s"))
    d = delta_for(sae, {1: 2.0, 4: -500.0})
    np.testing.assert_allclose(d, 2.0 * sae.W_dec[1] - 200.0 * sae.W_dec[4], rtol=1e-6)
    assert delta_for(sae, {1: 0.0}) is None
    with pytest.raises(SteeringError, match="outside"):
        delta_for(sae, {32: 1.0})


def test_intensity_parse_and_cluster_rules():
    assert dial.parse_intensity(1.5) == 1.5 and dial.parse_intensity("min") == "min"
    for bad in (2.5, -0.1, "loud", True, float("nan")):
        with pytest.raises(dial.IntensityError):
            dial.parse_intensity(bad)
    assert dial.resolve("min", None, None) == dial.CLUSTER_INTENSITY_MIN == 0.5
    assert dial.resolve("max", 0.5, 1.5) == 1.5 and dial.resolve("max", 0.5, 3.0) == 2.0
    assert dial.resolve(1.8, 0.5, 1.5) == 1.5  # capped at the declared maximum
    assert dial.resolve(0.1, 0.5, 1.5) == 0.1  # below the floor is honoured (cluster rule)
    assert dial.resolve("off", 0.5, 1.5) == 0.0
    assert dial.resolve("min", 2.5, 3.0) == 2.0  # min/max stay inside the [0, 2] envelope


def test_manager_resolution_scales_cluster_by_dial(tmp_path):
    m = SteeringManager(64, 4)
    m.attach(str(random_sae(tmp_path / "s")))
    c = Profile(name="c", steering={2: 10.0}, sae_id="s", kind="cluster", intensity=0.5,
                intensity_min=0.25, intensity_max=1.5)
    sae = m.attached["s"].sae
    stored = m.resolve(c, None)
    np.testing.assert_allclose(stored.steering[1], 5.0 * sae.W_dec[2], rtol=1e-6)
    assert stored.intensity is None  # no dial sent, no echo
    dialed = m.resolve(c, 2.0)
    assert dialed.intensity == 1.5
    np.testing.assert_allclose(dialed.steering[1], 15.0 * sae.W_dec[2], rtol=1e-6)
    assert m.resolve(c, "off").steering is None
    bad = Profile(name="b", steering={99: 1.0}, sae_id="s")
    with pytest.raises(SteeringError) as e:
        m.resolve(bad, None)
    assert e.value.code == "profile_invalid"
    assert m.resolve(bad, "off").steering is None  # off never validates the base
    assert SteeringManager(64, 4).resolve(bad, None).steering is None  # no SAE: unsteered


def test_store_persists_across_reopen_and_migrates(tmp_path):
    s = SteeringStore(tmp_path)
    assert s.schema_version == len(MIGRATIONS)
    s.create(Profile(name="a", steering={3: 1.5}, sae_id="x", layer=1))
    doc = b'{"name": "clu",  "features": [{"index": 1, "strength": 4}], "intensity_range": [0.5, 1.5]}'
    d = dial.parse_cluster(doc)
    s.create(Profile(name=d.name, steering=d.steering, kind="cluster", document=doc,
                     intensity_min=d.intensity_min, intensity_max=d.intensity_max))
    s.activate("a")
    s.close()
    s2 = SteeringStore(tmp_path)
    assert s2.active().name == "a" and s2.get("a").steering == {3: 1.5}
    assert s2.get("clu").document == doc and s2.get("clu").intensity_max == 1.5
    assert [p.name for p in s2.list("cluster")] == ["clu"]
