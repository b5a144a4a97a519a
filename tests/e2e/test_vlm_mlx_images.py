"""Images through /v1/chat/completions on `--backend mlx`, every family the MLX backend serves
(models/vision_mlx.py), through one router-mode server over the fixtures' folder, one child per
family, fp32.

Per family: a data: image answers as transformers' greedy generate does; the same picture sent again answers the same from the prefix
cache (all but the last prompt token cached: the image's tokens are keyed by the picture); a
different picture after the same text reuses only the text before the image.
"""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from mlxcel.models.vision_mlx import MLX_VLM_MODULES
from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import VLM_TINY
from tests.vlm_reference import expected_chat_answer, picture, png

QUESTION = "What is in this picture?"
MAX_TOKENS = 6
FAMILIES = sorted(MLX_VLM_MODULES)


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    folder = fixture_path(VLM_TINY["qwen2_vl"]).parent
    s = ServerProcess(["--models-dir", str(folder), "--models-max", str(len(FAMILIES)), "--backend", "mlx",
                       "--dtype", "float32", "-np", "1", "--offline"],
                      env={"MLXCEL_MODELS_DIR": str(tmp_path_factory.mktemp("empty-store"))})
    yield s
    s.stop()


def ask(server, model: str, url: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=180, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def tokens_before_image(path) -> int:
    """Where the first image token sits in the expanded prompt the server builds."""
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.models.vision import VisionInput

    tok = Tokenizer(path)
    vision = VisionInput(path, json.loads((path / "config.json").read_text()), tok.hf, tensors="np")
    text = tok.hf.apply_chat_template([{"role": "user", "content": vision.placeholder + QUESTION}], tokenize=False,
                                      add_generation_prompt=True)
    full = vision.expand(tok.hf.encode(text, add_special_tokens=False), vision.encode([picture(0)]))
    return full.index(vision.image_token_id)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_data_image_answers_and_its_prompt_is_cached_by_the_picture(router, family):
    path = fixture_path(VLM_TINY[family])
    first = ask(router, path.name, data_url(0))
    text, usage = first["choices"][0]["message"]["content"], first["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert (text, usage["prompt_tokens"]) == expected_chat_answer(path, picture(0), QUESTION, MAX_TOKENS)
    again = ask(router, path.name, data_url(0))
    assert again["choices"][0]["message"]["content"] == text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    other = ask(router, path.name, data_url(1))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == tokens_before_image(path)
