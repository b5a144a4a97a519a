"""A checkpoint saved by transformers 5 (RoPE only under `rope_parameters`) serves the same
logits as the same weights with the classic top-level keys, on both backends.

Each variant is a tmp checkpoint: the fixture's files linked, its config.json rewritten. The
RoPE base is moved off the family's default in both spellings, so a loader that missed the
nested key (mlx-lm's llama falls back to 10000, its gemma3_text to 1e6) would answer with the
default's logits, which the tests show differ. The backends are built by the loader the server
uses (runtime.load.load_backend), and the logits are the last prompt position's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlxcel.config.settings import BackendSection, EngineSection, ServerSettings
from mlxcel.models.registry import FAMILIES
from tests.conftest import fixture_path
from tests.fixtures import GEMMA3, LLAMA3_TOOLS_TINY, zoo_fixture

PROMPT = "The history of the city of Paris begins with a small settlement on an island"
BACKENDS = ("mlx", "torch")


def variant(tmp: Path, src: Path, name: str, edit) -> Path:
    out = tmp / name
    out.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def last_logits(path: Path, backend: str) -> np.ndarray:
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.runtime.load import load_backend

    settings = ServerSettings(engine=EngineSection(warmup=False),
                              backend=BackendSection(name=backend, device="cpu", dtype="float32"))
    model, _ = load_backend(settings, path)
    ids = Tokenizer(path).encode(PROMPT)
    assert len(ids) > 8  # RoPE bases differ only away from position 0
    return np.asarray(model.forward([ForwardRow(ids, model.new_sequence())])[0], dtype=np.float32)


def _drop(config: dict, *keys: str) -> None:
    for k in keys:
        config.pop(k, None)


def llama_classic(theta: float):
    def edit(c: dict) -> None:
        _drop(c, "rope_parameters")
        c["rope_theta"] = theta
    return edit


def llama_tf5(theta: float):
    def edit(c: dict) -> None:
        _drop(c, "rope_theta", "rope_scaling")
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return edit


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama_rope_parameters_serve_their_base(tmp_path, backend):
    src = fixture_path(LLAMA3_TOOLS_TINY)
    classic = last_logits(variant(tmp_path, src, "classic", llama_classic(500000.0)), backend)
    tf5 = last_logits(variant(tmp_path, src, "tf5", llama_tf5(500000.0)), backend)
    default = last_logits(variant(tmp_path, src, "base10k", llama_classic(10000.0)), backend)
    assert np.abs(tf5 - classic).max() <= 1e-5
    assert np.abs(default - classic).max() > 1e-3  # the base moves these logits


def gemma_classic(full: float):
    def edit(c: dict) -> None:
        _drop(c, "rope_parameters")
        c["rope_theta"], c["rope_local_base_freq"] = full, 10000.0
    return edit


def gemma_tf5(full: float):
    def edit(c: dict) -> None:
        _drop(c, "rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern")
        c["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": full},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        assert c["layer_types"][5] == "full_attention"  # the period the loader must derive
    return edit


def test_gemma3_rope_parameters_and_layer_types_serve_their_geometry(tmp_path):
    """Gemma 3 on MLX: the full-attention base and the sliding pattern both come from the
    nested / per-layer keys (torch reads those natively; the llama test covers its loader)."""
    src = fixture_path(GEMMA3)
    classic = last_logits(variant(tmp_path, src, "classic", gemma_classic(250000.0)), "mlx")
    tf5 = last_logits(variant(tmp_path, src, "tf5", gemma_tf5(250000.0)), "mlx")
    default = last_logits(variant(tmp_path, src, "default", gemma_classic(1000000.0)), "mlx")
    assert np.abs(tf5 - classic).max() <= 1e-4
    assert np.abs(default - classic).max() > 1e-3


def test_gpt_neox_rotary_names_come_from_rope_parameters():
    """mlx-lm's gpt_neox reads only `rotary_emb_base` / `rotary_pct`, with no default; transformers 5
    writes them as rope_parameters' `rope_theta` / `partial_rotary_factor`."""
    from mlxcel.models.checkpoint_config import normalize_config

    tf5 = {"model_type": "gpt_neox",
           "rope_parameters": {"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.25}}
    got = normalize_config(tf5)
    assert (got["rotary_emb_base"], got["rotary_pct"]) == (5e4, 0.25)
    classic = normalize_config({"model_type": "gpt_neox", "rotary_emb_base": 1e4, "rotary_pct": 0.5,
                                "rope_parameters": {"rope_theta": 5e4, "partial_rotary_factor": 0.25}})
    assert (classic["rotary_emb_base"], classic["rotary_pct"]) == (1e4, 0.5)  # the file's own keys win
    # another family's rotary fraction gets no GPT-NeoX name
    assert "rotary_pct" not in normalize_config({"model_type": "stablelm", "partial_rotary_factor": 0.25})


def test_dbrx_shape_keys_get_their_common_names():
    """mlxcel sizes the KV pool and the context from the common names; DBRX's config.json has its own."""
    from mlxcel.models.checkpoint_config import normalize_config

    got = normalize_config({"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40, "max_seq_len": 32768,
                            "attn_config": {"kv_n_heads": 8, "clip_qkv": 8}})
    assert (got["hidden_size"], got["num_attention_heads"], got["num_hidden_layers"], got["max_position_embeddings"],
            got["num_key_value_heads"]) == (6144, 48, 40, 32768, 8)
    assert "hidden_size" not in normalize_config({"model_type": "llama", "d_model": 64})  # DBRX's names only


@pytest.mark.parametrize("backend", BACKENDS)
def test_exaone_in_the_hubs_key_names_serves_as_transformers_names(tmp_path, backend):
    """A hub EXAONE 3.x config.json names its keys the remote code's way (num_layers,
    layer_norm_epsilon, activation_function, a top-level rope_theta) and its class
    ExaoneForCausalLM; the zoo's checkpoint has transformers' names. Both serve the same logits."""
    from tests.fixtures import zoo_fixture

    def hub(c: dict) -> None:
        c["num_layers"], c["layer_norm_epsilon"] = c.pop("num_hidden_layers"), c.pop("rms_norm_eps")
        c["activation_function"] = c.pop("hidden_act")
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        c["architectures"] = ["ExaoneForCausalLM"]

    src = fixture_path(zoo_fixture("exaone"))
    want = last_logits(variant(tmp_path, src, "as-saved", lambda c: None), backend)
    got = last_logits(variant(tmp_path, src, "hub", hub), backend)
    assert np.abs(got - want).max() <= 1e-5


def _with_text_tower(config: dict) -> dict:
    return {**config.get("text_config", {}), **config}  # a VLM's geometry is its text tower's


# fixtures saved with the classic top-level keys, to which normalisation has nothing to add
CLASSIC = {"llama", "qwen2", "qwen3", "gemma3_text", "internlm2", "internlm3", "mamba2"}


@pytest.mark.parametrize(("family", "backend"), [(t, b) for t in sorted(FAMILIES) for b in FAMILIES[t].backends])
def test_every_served_checkpoint_is_loaded_with_its_normalised_config(family, backend):
    """Whichever family and backend, the config a loaded model runs on (ModelInfo.config: what
    the engine sizes its KV and windows from, and on MLX what mlx-lm built the model from)
    holds every key normalisation derives, with the derived value (MLX: in mlx-lm's form)."""
    from mlxcel.models.checkpoint_config import mlx_overrides, normalize_config
    from mlxcel.runtime.load import load_backend
    from tests.models.test_supported_models import FAMILY_FIXTURES

    path = fixture_path(FAMILY_FIXTURES.get(family) or zoo_fixture(family))
    raw = json.loads((path / "config.json").read_text())
    ours, theirs = _with_text_tower(normalize_config(raw)), _with_text_tower(raw)
    added = {k: v for k, v in ours.items() if k not in theirs}
    assert added or family in CLASSIC
    if backend == "mlx":
        added.update({k: v for k, v in mlx_overrides(raw).items() if k in added})
    settings = ServerSettings(engine=EngineSection(warmup=False),
                              backend=BackendSection(name=backend, device="cpu", dtype="float32"))
    model, _ = load_backend(settings, path)
    assert {k: model.info.config.get(k) for k in added} == added
