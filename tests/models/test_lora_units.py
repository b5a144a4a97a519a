"""LoRA adapter plumbing without a model: spec parsing, directory checks, PEFT and mlx-lm
layouts, shape validation, b10621's scale resolution, per-row scale blocks, and the request
field on the native and /v1 parsers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxcel.models import lora as L

IN, OUT, R = 8, 6, 2


def _peft(tmp_path, name="peft", **config):
    from safetensors.numpy import save_file

    d = tmp_path / name
    d.mkdir()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((R, IN)).astype(np.float32)
    b = rng.standard_normal((OUT, R)).astype(np.float32)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b}, str(d / L.PEFT_WEIGHTS))
    (d / L.CONFIG).write_text(json.dumps({"r": R, "lora_alpha": 4, "target_modules": ["q_proj"], **config}))
    return d, a, b


def test_spec_parsing():
    assert L.parse_lora("a,b") == [L.AdapterSpec(L.Path("a")), L.AdapterSpec(L.Path("b"))]
    assert L.parse_lora_scaled("x:y:0.5,z:2") == [L.AdapterSpec(L.Path("x:y"), 0.5), L.AdapterSpec(L.Path("z"), 2.0)]
    for bad, says in (("a:nan", "finite"), ("a:inf", "finite"), ("a:x", "not a number"), ("a", "FNAME:SCALE")):
        with pytest.raises(L.LoraError, match=says):
            L.parse_lora_scaled(bad)
    with pytest.raises(L.LoraError, match="empty adapter path"):
        L.parse_lora("a,,b")


def test_directory_checks(tmp_path):
    gguf = tmp_path / "adapter.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(L.LoraError, match="GGUF LoRA file.*directories, PEFT's layout"):
        L.check_path(gguf)
    with pytest.raises(L.LoraError, match="no such file"):
        L.check_path(tmp_path / "missing")
    with pytest.raises(L.LoraError, match="no adapter_config.json"):
        L.check_path(tmp_path)


def test_peft_layout_and_validation(tmp_path):
    d, a, b = _peft(tmp_path)
    adapter = L.load_adapter(d)
    got_a, got_b = adapter.terms["model.layers.0.self_attn.q_proj"]
    assert adapter.factor == 2.0
    assert np.array_equal(got_a, a) and np.allclose(got_b, 2.0 * b)
    L.validate(adapter, {"model.layers.0.self_attn.q_proj": (OUT, IN)})
    with pytest.raises(L.LoraError, match=r"is \[7, 8\] in the model"):
        L.validate(adapter, {"model.layers.0.self_attn.q_proj": (OUT + 1, IN)})
    with pytest.raises(L.LoraError, match="is not a linear layer of the model"):
        L.validate(adapter, {"model.layers.0.self_attn.k_proj": (OUT, IN)})
    rs, _, _ = _peft(tmp_path, "rs", use_rslora=True)
    assert L.load_adapter(rs).factor == pytest.approx(4 / np.sqrt(R))
    dora, _, _ = _peft(tmp_path, "dora", use_dora=True)
    with pytest.raises(L.LoraError, match="DoRA is not supported"):
        L.load_adapter(dora)


def test_mlx_lm_layout_reads_as_the_same_terms(tmp_path):
    from safetensors.numpy import save_file

    d, a, b = _peft(tmp_path)
    m = tmp_path / "mlx"
    m.mkdir()
    save_file({"model.layers.0.self_attn.q_proj.lora_a": np.ascontiguousarray(a.T),
               "model.layers.0.self_attn.q_proj.lora_b": np.ascontiguousarray(b.T)}, str(m / L.MLX_WEIGHTS))
    (m / L.CONFIG).write_text(json.dumps({"fine_tune_type": "lora",
                                          "lora_parameters": {"rank": R, "scale": 2.0, "dropout": 0.0}}))
    peft, mlx = L.load_adapter(d), L.load_adapter(m)
    for (pa, pb), (ma, mb) in zip(peft.terms.values(), mlx.terms.values()):
        assert np.array_equal(pa, ma) and np.allclose(pb, mb)


def test_checkpoint_shapes_from_headers(tmp_path):
    from safetensors.numpy import save_file

    save_file({"model.q.weight": np.zeros((6, 8), np.float32), "model.norm.weight": np.zeros(8, np.float32)},
              str(tmp_path / "model.safetensors"))
    save_file({"model.k.weight": np.zeros((6, 2), np.uint32)}, str(tmp_path / "more.safetensors"))
    shapes = L.checkpoint_shapes(tmp_path, {"quantization": {"bits": 4, "group_size": 64}})
    assert shapes == {"model.q": (6, 8), "model.k": (6, 16)}


def test_b10621_resolution_and_request_parsing(tmp_path):
    d, _, _ = _peft(tmp_path)
    ad = L.load_adapter(d)
    s = L.LoraSet([ad, ad, ad], [1.0, 0.5, 0.0])
    assert s.snapshot() == (1.0, 0.5, 0.0)
    # listed ids take their scale, unlisted drop to 0.0, unknown ids are ignored
    assert s.resolve(L.parse_request([{"id": 2, "scale": 0.3}, {"id": 9, "scale": 5}])) == (0.0, 0.0, 0.3)
    # b10621's json_value defaults: a mistyped id is -1 (no adapter), a mistyped scale 0.0; last entry wins
    assert L.parse_request([{"id": "0", "scale": 1}, {"id": 1, "scale": "x"}, 3, {"id": 1, "scale": 2}]) == {
        -1: 0.0, 1: 2.0}
    with pytest.raises(L.LoraError, match="must be an array of objects"):
        L.parse_request({"id": 0})
    assert [e["scale"] for e in s.entries()] == [1.0, 0.5, 0.0]
    assert set(s.entries()[0]) == {"id", "path", "scale", "task_name", "prompt_prefix"}


def test_scale_blocks_only_for_used_adapters():
    assert L.scale_blocks([None, (0.0, 0.0)], 2) == {}
    blocks = L.scale_blocks([(1.0, 0.0), None, (0.5, 0.0)], 2)
    assert list(blocks) == [0] and blocks[0].tolist() == [1.0, 0.0, 0.5]


def test_request_field_on_native_and_v1(tmp_path):
    from mlxcel.api.errors import ApiError
    from mlxcel.api.llamacpp.lora_adapters import request_lora
    from mlxcel.api.llamacpp.render import generation_settings
    from mlxcel.engine.types import GenerationRequest

    d, _, _ = _peft(tmp_path)

    class Model:
        lora = L.LoraSet([L.load_adapter(d)] * 2, [1.0, 1.0])

    assert request_lora(Model, None) == (None, ())
    scales, asked = request_lora(Model, [{"id": 1, "scale": 0.25}, {"id": 7, "scale": 1}])
    assert scales == (0.0, 0.25) and asked == ((1, 0.25), (7, 1.0))
    with pytest.raises(ApiError) as e:
        request_lora(Model, "0:1")
    assert e.value.status == 400 and e.value.message.startswith("Field 'lora': Error: 'lora' must be an array")
    req = GenerationRequest(prompt=[1], lora=scales, lora_asked=asked)
    assert generation_settings(req, stream=False, timings_per_token=False)["lora"] == [
        {"id": 1, "scale": 0.25}, {"id": 7, "scale": 1.0}]


def test_startup_refuses_an_adapter_that_does_not_fit_the_checkpoint(tmp_path):
    """Checked from the safetensors headers before any weight loads, in one line."""
    from types import SimpleNamespace

    from mlxcel.runtime.load import load_for_checkpoint
    from mlxcel.config.refusal import StartupRefusal
    from tests.conftest import DEFAULT_MODEL, fixture_path

    d, _, _ = _peft(tmp_path)  # q_proj [6, 8]: SmolLM2's is [576, 576]
    settings = SimpleNamespace(lora=SimpleNamespace(adapters=[L.AdapterSpec(d)], init_without_apply=False))
    with pytest.raises(StartupRefusal, match=r"q_proj is \[576, 576\] in the model, but the adapter's A is \[2, 8\]"):
        load_for_checkpoint(settings, fixture_path(DEFAULT_MODEL))
    from safetensors.numpy import save_file

    save_file({"base_model.model.model.layers.0.mlp.nope.lora_A.weight": np.zeros((R, 576), np.float32),
               "base_model.model.model.layers.0.mlp.nope.lora_B.weight": np.zeros((576, R), np.float32)},
              str(d / L.PEFT_WEIGHTS))
    with pytest.raises(StartupRefusal, match="target module model.layers.0.mlp.nope is not a linear layer"):
        load_for_checkpoint(settings, fixture_path(DEFAULT_MODEL))
    settings.lora.init_without_apply = True
    save_file({"base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight": np.zeros((R, 576), np.float32),
               "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight": np.zeros((192, R), np.float32)},
              str(d / L.PEFT_WEIGHTS))
    assert load_for_checkpoint(settings, fixture_path(DEFAULT_MODEL)).snapshot() == (0.0,)


def test_cli_specs_through_the_real_parser(tmp_path):
    """--lora adapters first (scale 1.0), then --lora-scaled ones; both repeatable and comma-separated;
    --lora-init-without-apply starts them at 0.0 (load_for_checkpoint, above)."""
    from mlxcel.cli.flags import parse_server_args
    from mlxcel.config.refusal import StartupRefusal

    a, _, _ = _peft(tmp_path, "a")
    b, _, _ = _peft(tmp_path, "b")
    s = parse_server_args(["-m", "x", "--lora-scaled", f"{a}:0.5,{b}:-1", "--lora", f"{b}", "--lora", f"{a}",
                           "--lora-init-without-apply"], {})
    assert [(x.path, x.scale) for x in s.lora.adapters] == [(b, 1.0), (a, 1.0), (a, 0.5), (b, -1.0)]
    assert s.lora.init_without_apply is True
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(StartupRefusal, match="a GGUF LoRA file"):
        parse_server_args(["-m", "x", "--lora", str(gguf)], {})


def test_adapters_without_a_generation_model_are_refused(tmp_path):
    from mlxcel.cli.flags import parse_server_args
    from mlxcel.cli.options_lora import refuse_without_generation
    from mlxcel.config.refusal import StartupRefusal

    d, _, _ = _peft(tmp_path)
    refuse_without_generation(parse_server_args(["-m", "x", "--embeddings"], {}))
    with pytest.raises(StartupRefusal, match="this server runs none"):
        refuse_without_generation(parse_server_args(["-m", "x", "--embeddings", "--lora", str(d)], {}))
