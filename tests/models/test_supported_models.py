"""What mlxcel serves: the registry's refusal line, config normalisation, docs/models.md and
`mlxcel list --supported` (both rendered from the registry), and the tables' claims held
against the backends and the fixture checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxcel.models.catalog import FEATURES, generation_table, supported_tables, worker_table
from mlxcel.models.checkpoint_config import ConfigRefused, layer_period, mlx_overrides, normalize_config
from mlxcel.models.registry import (DOCS_PAGE, FAMILIES, UnsupportedModelType, family_for, nearest_families,
                                    unsupported_message)
from scripts import gen_models_doc
from tests import fixtures
from tests.conftest import REPO, fixture_path


@pytest.mark.parametrize(("model_type", "nearest"), [
    ("ministral", ["llama"]),  # Llama's lineage (kin)
    ("mistral_unknown", ["mistral", "mistral3"]),  # a shared name stem
    ("llama4", ["llama"]),
    ("gemma4", ["gemma", "gemma2", "gemma3"]),
    ("qwen3_vl", ["qwen2_vl", "qwen2_5_vl", "qwen3"]),
    ("lama", ["llama", "llava"]),  # a close name
    ("rwkv7", []),
])
def test_nearest_families(model_type, nearest):
    assert nearest_families(model_type) == nearest


def test_the_transformers_class_counts_as_lineage():
    assert nearest_families("custom", ["MistralForCausalLM"]) == ["mistral", "mistral3"]
    assert nearest_families("custom", ["MinistralForCausalLM"]) == ["llama"]


def test_refusal_is_one_line_naming_type_nearest_and_docs():
    with pytest.raises(UnsupportedModelType) as e:
        family_for({"model_type": "gemma4"})
    msg = str(e.value)
    assert msg.startswith("model_type 'gemma4' is not supported")
    assert "nearest supported: gemma, gemma2, gemma3" in msg and DOCS_PAGE in msg and "\n" not in msg
    assert "no supported family is close" in unsupported_message({"model_type": "rwkv7"})
    assert "--embeddings / --reranking" in unsupported_message({"model_type": "bert"})
    assert "transcription" in unsupported_message({"model_type": "whisper"})


# ---- normalisation -----------------------------------------------------------------------------


def test_transformers5_rope_parameters_reach_the_top_level():
    got = normalize_config({"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert got["rope_theta"] == 5e5 and "rope_scaling" not in got
    scaled = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "original_max_position_embeddings": 8192}
    got = normalize_config({"model_type": "llama", "rope_parameters": scaled})
    assert got["rope_theta"] == 5e5 and got["rope_scaling"] == {**scaled, "type": "llama3"}  # mlx-lm's spelling too
    # a key the checkpoint sets itself is kept
    kept = normalize_config({"model_type": "llama", "rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}})
    assert kept["rope_theta"] == 1e4


def test_gemma3_nested_rope_and_layer_types():
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    got = normalize_config({"model_type": "gemma3_text", "layer_types": types, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert (got["rope_theta"], got["rope_local_base_freq"], got["sliding_window_pattern"]) == (1e6, 1e4, 6)
    assert got["rope_scaling"]["rope_type"] == "linear"
    assert layer_period(types) == 6 and layer_period(["full_attention"] * 2) == 1
    assert layer_period(["sliding_attention", "full_attention", "full_attention"]) is None


def test_transformers5_expert_count_rotary_fraction_and_gemma2_layers():
    got = normalize_config({"model_type": "qwen3_moe", "num_local_experts": 8,
                            "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}})
    assert (got["num_experts"], got["partial_rotary_factor"]) == (8, 0.5)
    assert normalize_config({"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts": 4})["num_experts"] == 4
    assert normalize_config({"model_type": "gemma2", "num_hidden_layers": 3})["layer_types"] == [
        "sliding_attention", "full_attention", "sliding_attention"]


@pytest.mark.parametrize(("config", "windows"), [
    ({"sliding_window": 8}, [8, 8, 8, 8]),  # Mistral: every layer
    ({"sliding_window": 8, "use_sliding_window": False}, [None] * 4),  # Qwen with the switch off
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}, [None, None, 8, 8]),
    ({"sliding_window": 8, "sliding_window_pattern": 2}, [8, None, 8, None]),
    ({"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"] * 2}, [None, 8, None, 8]),
    ({"sliding_window": None}, [None] * 4),
])
def test_layer_windows_read_the_config_as_transformers_does(config, windows):
    from mlxcel.engine.backend import layer_windows

    assert layer_windows(config, 4) == windows


def test_mlx_overrides_are_the_added_keys_and_refuse_an_unperiodic_gemma3():
    raw = {"model_type": "llama", "rope_parameters": {"rope_theta": 5e5}}
    assert mlx_overrides(raw) == {"rope_theta": 5e5}
    assert mlx_overrides({"model_type": "llama", "rope_theta": 1e4}) == {}
    odd = {"model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention", "full_attention"]}
    with pytest.raises(ConfigRefused, match="--backend torch"):
        mlx_overrides(odd)


def test_multimodal_text_tower_is_normalised_in_place():
    """Gemma 3's multimodal config.json: its text_config is normalised as a gemma3_text one, and
    its vocabulary also lands at the top, where mlx-lm's gemma3 reads it (else 262208)."""
    text = {"model_type": "gemma3_text", "vocab_size": 100, "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    raw = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 32}}
    got = normalize_config(raw)
    assert got["vocab_size"] == 100 and raw["text_config"] is text and "rope_theta" not in text
    tc = got["text_config"]
    assert (tc["rope_theta"], tc["rope_local_base_freq"], tc["sliding_window_pattern"]) == (1e6, 1e4, 2)
    over = mlx_overrides(raw)
    assert over["vocab_size"] == 100 and over["text_config"] == tc


def test_exaone_names_both_ways_and_exaone4_pattern_for_mlx():
    # EXAONE 3: transformers' names for mlx-lm, the hub's remote-code names for mlxcel's reads
    got = normalize_config({"model_type": "exaone", "num_hidden_layers": 2, "rms_norm_eps": 1e-5})
    assert (got["num_layers"], got["layer_norm_epsilon"]) == (2, 1e-5)
    got = normalize_config({"model_type": "exaone", "num_layers": 32, "layer_norm_epsilon": 1e-6})
    assert (got["num_hidden_layers"], got["rms_norm_eps"]) == (32, 1e-6)
    # EXAONE 4: transformers' period becomes mlx-lm's L/G string; no window: every layer global
    types = ["sliding_attention"] * 3 + ["full_attention"]
    raw = {"model_type": "exaone4", "sliding_window": 4096, "sliding_window_pattern": 4, "layer_types": types * 2}
    assert mlx_overrides(raw)["sliding_window_pattern"] == "LLLG"
    assert mlx_overrides({**raw, "sliding_window": None})["sliding_window_pattern"] is None
    assert "sliding_window_pattern" not in mlx_overrides({**raw, "sliding_window_pattern": "LLLG"})
    with pytest.raises(ConfigRefused, match="exaone4"):
        mlx_overrides({**raw, "layer_types": types + ["full_attention"] * 4})


def _states_the_same(raw: dict, got: dict) -> bool:
    """Every key of `raw` has its value in `got`; a nested config (text_config) may gain keys."""
    return all(_states_the_same(v, got[k]) if isinstance(v, dict) and isinstance(got.get(k), dict)
               else got.get(k, object()) == v for k, v in raw.items())


def test_every_fixture_config_is_unchanged_where_it_states_a_key():
    for ref in (*fixtures.ALL, *(fixtures.zoo_fixture(t) for t in fixtures.ZOO_TYPES)):
        path = fixture_path(ref)
        if not (path / "config.json").is_file():
            continue
        raw = json.loads((path / "config.json").read_text())
        assert _states_the_same(raw, normalize_config(raw)), ref


# ---- docs/models.md and `mlxcel list --supported` ----------------------------------------------


def test_models_doc_is_current():
    assert gen_models_doc.main(["--check"]) == 0, "docs/models.md is stale: run scripts/gen_models_doc.py"


def test_list_supported_prints_the_docs_tables():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "mlxcel.cli.main", "list", "--supported"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout == supported_tables()
    doc = (REPO / DOCS_PAGE).read_text()
    for table in (generation_table(), worker_table()):
        assert "\n".join(table) in doc and "\n".join(table) in p.stdout
    for model_type in FAMILIES:
        assert f"\n| {model_type} |" in p.stdout


def test_every_backend_has_the_seams_the_feature_columns_claim():
    """LoRA and steering hooks are backend seams (the engine runs drafting and the prefix cache
    over any backend), so every backend a family runs on must implement both."""
    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.backends.rows import RowSteering
    from mlxcel.backends.torch.backend import TorchBackend
    from mlxcel.backends.torch.vlm import TorchVLMBackend

    assert FEATURES == ("LoRA", "steering hooks", "speculative drafting", "prefix cache")
    for cls in (MLXBackend, TorchBackend, TorchVLMBackend):
        assert callable(getattr(cls, "attach_lora", None)) and issubclass(cls, RowSteering), cls


FAMILY_FIXTURES = {"llama": fixtures.DEFAULT_MODEL, "gemma3_text": fixtures.GEMMA3, "qwen2": fixtures.QWEN2_TINY,
                   "qwen3": fixtures.QWEN3_TINY,
                   **{t: ref for t, ref in fixtures.VLM_TINY.items() if t != "gemma3"},
                   **{t: fixtures.zoo_fixture(t) for t in fixtures.ZOO_TYPES}}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_attention_column_covers_the_fixture(model_type):
    from mlxcel.engine.backend import latent_width, layer_windows
    from mlxcel.models.checkpoint_config import read_config

    # a family without a fixture of its own is held against its zoo checkpoint
    path = fixture_path(FAMILY_FIXTURES.get(model_type) or fixtures.zoo_fixture(model_type))
    if "recurrent" in FAMILIES[model_type].attention:
        # which layers keep a state is the module's to say: the MLX backend reads it from there
        from mlxcel.backends.mlx.backend import MLXBackend

        assert MLXBackend(path, dtype="float32").kv_spec.kinds == set(FAMILIES[model_type].attention)
        return
    config = read_config(path)
    config = {**config.get("text_config", {}), **config}
    windows = layer_windows(config, int(config["num_hidden_layers"]))
    kinds = {"latent"} if latent_width(config) else {"full" if w is None else "sliding" for w in windows}
    assert kinds <= set(FAMILIES[model_type].attention)
