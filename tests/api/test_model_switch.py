"""The checks a model switch makes before touching the loaded model (runtime.check_loadable)
and how a request's model name resolves in the store (api/model_switch.store_checkpoint)."""

from __future__ import annotations

import pytest

from mlxcel.api.model_switch import store_checkpoint
from mlxcel.api.state import AppState
from mlxcel.config.settings import BackendSection, EngineSection, ServerSettings, SourceSection
from mlxcel.runtime.capacity import LoadRefused, check_loadable, estimated_bytes
from tests.conftest import fixture_path
from tests.fixtures import DEFAULT_MODEL, MINILM, QWEN2_TINY, SMOLLM2_4BIT, models_dir


def test_names_resolve_only_to_store_checkpoints():
    state = AppState(settings=ServerSettings(source=SourceSection(default_org="mlxcel-fixtures")),
                     store_root=models_dir())
    assert store_checkpoint(state, QWEN2_TINY) == models_dir() / QWEN2_TINY
    assert store_checkpoint(state, "qwen2-tiny") == models_dir() / QWEN2_TINY  # bare name: the default org
    for name in ("nobody/nothing", str(fixture_path(QWEN2_TINY)), "../models/" + QWEN2_TINY, "./x",
                 "https://huggingface.co/" + QWEN2_TINY, QWEN2_TINY + ":Q4_K_M", "model.gguf", "",
                 "mlxcel-fixtures/sae-smollm2-l10-random64"):  # the last: in the store, no config.json
        assert store_checkpoint(state, name) is None, name


def test_weights_are_estimated_at_the_compute_dtype():
    path = fixture_path(DEFAULT_MODEL)  # bfloat16 on disk
    stored = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert estimated_bytes(path, "float32") == 2 * stored
    assert estimated_bytes(path, "bfloat16") == stored
    quant = fixture_path(SMOLLM2_4BIT)  # packed: as stored
    assert estimated_bytes(quant, "float32") == sum(f.stat().st_size for f in quant.glob("*.safetensors"))


def test_refusals_before_the_unload(tmp_path):
    with pytest.raises(LoadRefused) as e:
        check_loadable(ServerSettings(engine=EngineSection(model_memory_budget_mib=100),
                                      backend=BackendSection(name="mlx")), fixture_path(DEFAULT_MODEL), None)
    assert (e.value.status, e.value.code) == (503, "insufficient_memory") and "100 MiB" in e.value.message
    mxfp4 = tmp_path / "mxfp4"  # a quantization mode only MLX runs
    mxfp4.mkdir()
    (mxfp4 / "config.json").write_text('{"model_type": "llama", "quantization": {"bits": 4, "group_size": 32, '
                                       '"mode": "mxfp4"}}')
    (mxfp4 / "model.safetensors").write_bytes(b"")
    with pytest.raises(LoadRefused) as e:
        check_loadable(ServerSettings(backend=BackendSection(name="torch", device="cpu")), mxfp4, None)
    assert (e.value.status, e.value.code) == (400, "unsupported_quantization")
    with pytest.raises(LoadRefused) as e:
        check_loadable(ServerSettings(backend=BackendSection(name="mlx")), fixture_path(MINILM), None)
    assert (e.value.status, e.value.code) == (500, "model_load_failed") and "bert" in e.value.message
    assert check_loadable(ServerSettings(engine=EngineSection(model_memory_budget_mib=100),
                                         backend=BackendSection(name="mlx")), fixture_path(QWEN2_TINY),
                          None) > 0


def test_switch_flags():
    from mlxcel.cli.flags import parse_server_args

    s = parse_server_args(["-m", "x"], {})
    assert (s.engine.graceful_unload_timeout, s.engine.model_memory_budget_mib) == (30.0, None)
    s = parse_server_args(["-m", "x", "--model-memory-budget", "800"], {"GRACEFUL_UNLOAD_TIMEOUT": "2.5"})
    assert (s.engine.graceful_unload_timeout, s.engine.model_memory_budget_mib) == (2.5, 800)
    assert parse_server_args(["-m", "x", "--graceful-unload-timeout", "0"], {}).engine.graceful_unload_timeout == 0.0
