"""What the CUDA check carries to the GPU machine (scripts/bench/gpu_prepare.py) and the
random-weight twin it serves there (scripts/fixtures/build_random_twin.py)."""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import version

import pytest

from scripts.bench.gpu_prepare import MLX_ONLY, requirement_name, requirements
from scripts.fixtures.build_random_twin import build_random_twin
from tests.conftest import REPO, fixture_path
from tests.fixtures import MARKER, QWEN2_TINY


def test_requirements_leave_out_mlx_and_pin_the_tested_transformers():
    reqs = requirements()
    names = {requirement_name(r) for r in reqs}
    assert not names & set(MLX_ONLY)
    assert f"transformers=={version('transformers')}" in reqs
    # what the server and the smoke tests import there
    assert {"litestar", "uvicorn", "msgspec", "llguidance", "openai", "pytest", "httpx"} <= names


def test_gpu_check_script_parses():
    p = subprocess.run(["bash", "-n", str(REPO / "scripts/bench/gpu_check.sh")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_random_twin_keeps_config_and_tokenizer_and_draws_its_own_weights(tmp_path):
    pytest.importorskip("torch")
    from safetensors.torch import load_file

    src = fixture_path(QWEN2_TINY)
    a = build_random_twin(src, tmp_path / "a", seed=0, dtype="float32")
    b = build_random_twin(src, tmp_path / "b", seed=0, dtype="float32")
    c = build_random_twin(src, tmp_path / "c", seed=1, dtype="float32")
    assert (a / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (a / MARKER).is_file() and not (a / "model.safetensors.index.json").exists()
    want, got = json.loads((src / "config.json").read_text()), json.loads((a / "config.json").read_text())
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert got[key] == want[key]
    wa, wb, wc = (load_file(str(d / "model.safetensors")) for d in (a, b, c))
    source = {}
    for f in src.glob("*.safetensors"):
        source.update(load_file(str(f)))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert set(wa) <= set(source) and wa[name].shape == source[name].shape
    assert wa[name].equal(wb[name])  # the seed decides
    assert not wa[name].equal(wc[name]) and not wa[name].equal(source[name].float())
