"""Backend/device selection and the flags that feed it: --backend, --device (b10621's -dev,
translated), MLXCEL_DEVICE, and -t/--threads (torch's thread count; MLX CPU's threads per large product;
refused for MLX on Metal)."""

from __future__ import annotations

import os

import pytest

from mlxcel.backends.select import BackendRefused, choose
from mlxcel.cli.flags import parse_server_args
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import BackendSection, ServerSettings
from mlxcel.runtime.load import select_backend


def on(backend: str, **kw) -> ServerSettings:
    """Settings asking for `backend`; `kw`: other BackendSection fields."""
    return ServerSettings(backend=BackendSection(name=backend, **kw))


def test_auto_picks_mlx_on_apple_silicon_and_torch_on_a_linux_cpu():
    assert choose("auto", "auto", apple=True, has_torch=True).backend == "mlx"
    assert choose("auto", "auto", apple=True, has_torch=True).device == "metal"
    linux = choose("auto", "auto", apple=False, has_torch=True)  # this machine has no CUDA device
    assert (linux.backend, linux.device) == ("torch", "cpu")  # measured faster than MLX's CPU wheel
    assert linux.reason.startswith("auto: CPU-only")
    assert choose("auto", "cpu", apple=False, has_torch=True).backend == "torch"
    no_torch = choose("auto", "auto", apple=False, has_torch=False)
    assert (no_torch.backend, no_torch.device) == ("mlx", "cpu") and "not installed" in no_torch.reason


def test_explicit_requests_are_honoured_or_refused_never_replaced():
    assert choose("mlx", "cpu", apple=True).device == "cpu"
    assert choose("torch", "cpu", apple=False, has_torch=True).device == "cpu"
    with pytest.raises(BackendRefused, match="no CUDA device"):
        choose("mlx", "cuda:0", apple=False)
    with pytest.raises(BackendRefused, match="only on Apple Silicon"):
        choose("mlx", "metal", apple=False)
    with pytest.raises(BackendRefused, match="torch is not installed"):
        choose("torch", "cpu", apple=False, has_torch=False)
    with pytest.raises(BackendRefused, match="sees no CUDA device"):  # a CPU-only torch build
        choose("torch", "cuda:1", apple=False, has_torch=True)
    with pytest.raises(BackendRefused, match="invalid backend"):
        choose("tensorflow", "auto")


def test_choice_is_idempotent_on_its_own_output():
    first = choose("auto", "auto", apple=False, has_torch=True)
    again = choose(first.backend, first.device, apple=False, has_torch=True)
    assert (again.backend, again.device) == (first.backend, first.device)


def test_device_flag_translates_llama_names_and_refuses_lists():
    for given, want in (("CUDA1", "cuda:1"), ("CPU", "cpu"), ("none", "cpu"), ("MTL0", "metal"), ("cuda:0", "cuda:0"),
                        ("mps", "mps")):
        assert parse_server_args(["-dev", given], {}).backend.device == want
    with pytest.raises(StartupRefusal) as e:
        parse_server_args(["--device", "CUDA0,CUDA1"], {})
    assert "one device" in str(e.value.code)
    with pytest.raises(StartupRefusal):
        parse_server_args(["--device", "tpu"], {})
    assert parse_server_args([], {"MLXCEL_DEVICE": "cpu"}).backend.device == "cpu"
    assert parse_server_args([], {"MLXCEL_DEVICE": "cpu", "LLAMA_ARG_DEVICE": "CUDA0"}).backend.device == "cuda:0"
    assert parse_server_args(["-dev", "mps"], {"MLXCEL_DEVICE": "cpu"}).backend.device == "mps"
    assert parse_server_args(["--backend", "torch"], {}).backend.name == "torch"
    with pytest.raises(StartupRefusal):
        parse_server_args(["--backend", "jax"], {})


def test_threads_flag_reaches_settings_and_each_backend(monkeypatch):
    from mlxcel.backends import select
    from mlxcel.backends.mlx.backend import product_threads

    assert parse_server_args(["-t", "2"], {}).backend.threads == 2
    assert parse_server_args([], {"LLAMA_ARG_THREADS": "3"}).backend.threads == 3
    assert select_backend(on(backend="torch", device="cpu", threads=2)).backend == "torch"
    assert select_backend(on(backend="auto", device="auto", threads=2)).backend == "torch"
    # MLX on the CPU: the threads each large product is split over (split_products.py)
    assert select_backend(on(backend="mlx", device="cpu", threads=4)).backend == "mlx"
    assert product_threads(4) == 4 and product_threads(1) == 1
    assert product_threads(-1) == min(2, os.cpu_count() or 1)
    # MLX on Metal has no CPU thread count to set: refused, naming what to do instead
    monkeypatch.setattr(select, "choose", lambda *a, **k: select.Choice("mlx", "metal", "requested"))
    assert select_backend(on(backend="mlx", device="metal", threads=-1)).device == "metal"
    with pytest.raises(StartupRefusal) as e:
        select_backend(on(backend="mlx", device="metal", threads=4))
    assert "--threads 4" in str(e.value.code) and "--device cpu" in str(e.value.code)


def test_affine_quantized_checkpoints_run_on_torch_off_apple_and_on_mlx_on_apple():
    auto = choose("auto", "auto", apple=False, has_torch=True, quantized="affine")
    assert (auto.backend, auto.device) == ("torch", "cpu") and "MLX-quantized" in auto.reason
    assert choose("torch", "cpu", apple=False, has_torch=True, quantized="affine").backend == "torch"
    mac = choose("auto", "auto", apple=True, has_torch=True, quantized="affine")
    assert (mac.backend, mac.device) == ("mlx", "metal")
    no_torch = choose("auto", "auto", apple=False, has_torch=False, quantized="affine")
    assert (no_torch.backend, no_torch.device) == ("mlx", "cpu") and "torch is not installed" in no_torch.reason


def test_other_quantization_modes_stay_on_mlx():
    auto = choose("auto", "auto", apple=False, has_torch=True, quantized="mxfp4")
    assert (auto.backend, auto.device) == ("mlx", "cpu") and "mxfp4-quantized" in auto.reason
    with pytest.raises(BackendRefused, match="quantized as mxfp4.*--backend mlx"):
        choose("torch", "cpu", apple=False, has_torch=True, quantized="mxfp4")
    with pytest.raises(BackendRefused, match="runs only on the MLX backend"):
        choose("auto", "cuda:0", apple=False, has_torch=True, quantized="mxfp4")


@pytest.mark.parametrize("config, mode", [
    ({}, None),
    ({"quantization": {"bits": 4, "group_size": 64}}, "affine"),
    ({"quantization": {"bits": 4, "group_size": 32, "mode": "mxfp4"}}, "mxfp4"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "gptq"),
])
def test_quantization_mode_names_the_form(config, mode):
    from mlxcel.backends.select import quantization_mode

    assert quantization_mode(config) == mode


def test_a_family_without_a_transformers_class_runs_on_mlx_and_torch_refuses_it_by_name(tmp_path):
    from mlxcel.backends.torch.backend import TorchBackend
    from mlxcel.models.registry import UnsupportedModelType

    (tmp_path / "config.json").write_text('{"model_type": "internlm2"}')
    auto = select_backend(ServerSettings(), tmp_path)
    assert (auto.backend, auto.device) == ("mlx", "cpu") and "internlm2 has no transformers class" in auto.reason
    with pytest.raises(StartupRefusal, match="--backend torch: internlm2 has no transformers class.*--backend mlx"):
        select_backend(on("torch"), tmp_path)
    with pytest.raises(BackendRefused, match="this family runs only on the MLX backend"):
        choose("auto", "cuda:0", apple=False, has_torch=True, mlx_only="internlm2 has no transformers class")
    with pytest.raises(UnsupportedModelType, match="internlm2 has no transformers class.*--backend mlx"):
        TorchBackend(tmp_path)


def test_torch_backend_refuses_a_quantization_it_cannot_run(tmp_path):
    from mlxcel.backends.torch.backend import CheckpointRefused, TorchBackend

    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "quantization": {"bits": 4, "group_size": 32, "mode": "mxfp4"}}')
    with pytest.raises(CheckpointRefused, match="quantized as mxfp4.*--backend mlx"):
        TorchBackend(tmp_path)


def test_auto_reads_the_checkpoint_and_serves_an_mlx_quantized_one_on_torch_off_apple():
    from tests.fixtures import DEFAULT_MODEL, SMOLLM2_4BIT, available, fixture_path

    if not (available(SMOLLM2_4BIT) and available(DEFAULT_MODEL)):
        pytest.skip("run scripts/fixtures/build_all.py")
    quantized = select_backend(ServerSettings(), fixture_path(SMOLLM2_4BIT))
    plain = select_backend(ServerSettings(), fixture_path(DEFAULT_MODEL))
    assert quantized.backend == plain.backend == choose("auto", "auto").backend
    if quantized.backend == "torch" and quantized.device == "cpu":
        assert "MLX-quantized" in quantized.reason
    assert select_backend(on("torch", device="cpu"), fixture_path(SMOLLM2_4BIT)).backend == "torch"
