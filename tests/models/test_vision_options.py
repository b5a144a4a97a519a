"""Image options and VLM selection: the token-budget arithmetic, its application counter, the
startup refusals of --image-*-tokens / --mtmd-batch-max-tokens / --media-path / --no-mmproj, and
the backend choice for a vision-language checkpoint."""

from __future__ import annotations

import pytest

from mlxcel.backends.select import BackendRefused, choose
from mlxcel.cli.flags import parse_server_args
from mlxcel.config.refusal import StartupRefusal
from mlxcel.models import vision
from mlxcel.models.registry import UnsupportedModelType, mlx_module
from mlxcel.models.vision import BudgetRefused, ImageBudget, VisionInput, budget_pixels


def qwen2_vl_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=4 * 784, max_pixels=64 * 784)


def test_budget_arithmetic_is_b10621s():
    assert budget_pixels(10, 14, 2) == 10 * 14 * 14 * 2 * 2
    assert budget_pixels(0, 14, 2) is None and budget_pixels(-1, 14, 2) is None and budget_pixels(None, 14, 2) is None


def test_a_dynamic_processor_takes_the_bounds_and_counts_it():
    p = qwen2_vl_processor()
    budget = ImageBudget(8, 32)
    budget.apply(p)
    assert (p.size["shortest_edge"], p.size["longest_edge"], budget.applications) == (8 * 784, 32 * 784, 1)
    p, budget = qwen2_vl_processor(), ImageBudget(None, 16)  # the minimum stays the checkpoint's
    budget.apply(p)
    assert (p.size["shortest_edge"], p.size["longest_edge"]) == (4 * 784, 16 * 784)
    p, budget = qwen2_vl_processor(), ImageBudget(0, -5)  # <= 0: nothing requested, nothing moved
    budget.apply(p)
    assert (p.size["longest_edge"], budget.applications) == (64 * 784, 0)


def test_a_resolved_maximum_below_the_minimum_is_refused():
    with pytest.raises(BudgetRefused, match="below the minimum"):
        ImageBudget(100, None).apply(qwen2_vl_processor())  # 100 tokens above the checkpoint's 64


def test_a_fixed_geometry_checkpoint_with_a_budget_is_refused(tmp_path, monkeypatch):
    import json
    from types import SimpleNamespace

    from mlxcel.models.vision_layouts import llava_run

    monkeypatch.setitem(vision.VISION_FAMILIES, "fixed_vl", vision.VisionFamily(
        "fixed_vl", "<image>", "<image>", "<image>", llava_run))
    # a processor that resizes to one geometry: no pixel bounds to move
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "SiglipImageProcessor", "size": {"height": 224, "width": 224}}))
    config = {"model_type": "fixed_vl", "image_token_id": 5}
    tok = SimpleNamespace(convert_tokens_to_ids=lambda t: 5, encode=lambda text, **k: [])
    VisionInput(tmp_path, config, tok)  # no budget asked: served
    with pytest.raises(BudgetRefused, match=f"{tmp_path.name}: .*fixed geometry.*--image-max-tokens"):
        VisionInput(tmp_path, config, tok, ImageBudget(None, 16))


def test_image_token_flags():
    s = parse_server_args(["-m", "x", "--image-min-tokens", "8", "--image-max-tokens", "32"], {})
    assert (s.media.image_min_tokens, s.media.image_max_tokens) == (8, 32)
    s = parse_server_args(["-m", "x", "--image-min-tokens", "0"], {"LLAMA_ARG_IMAGE_MAX_TOKENS": "-1"})
    assert (s.media.image_min_tokens, s.media.image_max_tokens) == (None, None)
    assert parse_server_args(["-m", "x"], {"LLAMA_ARG_IMAGE_MAX_TOKENS": "16"}).media.image_max_tokens == 16
    with pytest.raises(StartupRefusal, match="--image-max-tokens 8 is below --image-min-tokens 32"):
        parse_server_args(["-m", "x", "--image-max-tokens", "8", "--image-min-tokens", "32"], {})
    with pytest.raises(StartupRefusal):
        parse_server_args(["-m", "x", "--image-min-tokens", "many"], {})


def test_mtmd_batch_max_tokens_is_inert_at_1024_only():
    parse_server_args(["-m", "x", "--mtmd-batch-max-tokens", "1024"], {})
    with pytest.raises(StartupRefusal, match="one vision-tower forward"):
        parse_server_args(["-m", "x", "--mtmd-batch-max-tokens", "512"], {})


def test_mmproj_switch_and_media_path(tmp_path):
    assert parse_server_args(["-m", "x"], {}).media.mmproj is True
    for spelling in ("--no-mmproj", "--no-mmproj-auto"):
        assert parse_server_args(["-m", "x", spelling], {}).media.mmproj is False
    assert parse_server_args(["-m", "x"], {"LLAMA_ARG_MMPROJ_AUTO": "0"}).media.mmproj is False
    assert parse_server_args(["-m", "x", "--media-path", str(tmp_path)], {}).media.media_path == tmp_path.resolve()
    with pytest.raises(StartupRefusal, match="not a directory"):
        parse_server_args(["-m", "x", "--media-path", str(tmp_path / "nope")], {})


def test_a_vlm_runs_on_torch_unless_mlx_serves_its_family():
    with pytest.raises(BackendRefused, match="--backend torch"):
        choose("mlx", "cpu", vision=True)
    for apple in (True, False):
        c = choose("auto", "cpu", apple=apple, has_torch=True, vision=True)
        assert (c.backend, c.device) == ("torch", "cpu") and "vision-language" in c.reason
    with pytest.raises(BackendRefused, match="torch is not installed"):
        choose("auto", "cpu", has_torch=False, vision=True)
    # a family mlx-vlm serves: MLX when asked, auto on a Mac, and where torch cannot take it
    assert choose("mlx", "cpu", vision=True, vision_mlx=True).backend == "mlx"
    assert choose("auto", "auto", apple=True, has_torch=True, vision=True, vision_mlx=True).backend == "mlx"
    assert choose("auto", "cpu", apple=False, has_torch=False, vision=True, vision_mlx=True).backend == "mlx"
    assert choose("auto", "cpu", apple=False, has_torch=True, quantized="affine", vision=True,
                  vision_mlx=True).backend == "mlx"
    c = choose("auto", "cpu", apple=False, has_torch=True, vision=True, vision_mlx=True)
    assert (c.backend, c.device) == ("torch", "cpu")
    with pytest.raises(UnsupportedModelType, match="--backend torch"):
        mlx_module({"model_type": "qwen2_vl"})


def test_a_budget_on_a_text_only_checkpoint_is_refused_at_load(tmp_path):
    from types import SimpleNamespace

    from mlxcel.runtime.load import load_vision

    text_only = SimpleNamespace(info=SimpleNamespace(config={"model_type": "qwen3"}, backend="torch"))
    assert load_vision(parse_server_args(["-m", "x"], {}), tmp_path, text_only, None) is None
    with pytest.raises(StartupRefusal, match="takes no images, so --image-max-tokens has nothing to bound"):
        load_vision(parse_server_args(["-m", "x", "--image-max-tokens", "64"], {}), tmp_path, text_only, None)
