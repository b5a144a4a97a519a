"""Images through /v1/chat/completions on `--backend mlx`, one server per family the MLX backend
serves (models/vision_mlx.py), each the family's tiny fixture in fp32.

A data: image is answered; the same picture sent again is answered the same from the prefix
cache (all but the last prompt token cached: the image's tokens are keyed by the picture); a
different picture after the same text reuses only the text before the image. The language
logits themselves are checked against mlx-vlm in tests/models/test_vlm_mlx.py.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from mlxcel.models.vision_mlx import MLX_VLM_MODULES
from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import VLM_TINY

QUESTION = "What is in this picture?"
MAX_TOKENS = 6


def data_url(seed: int) -> str:
    im = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (60, 90, 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module", params=sorted(MLX_VLM_MODULES))
def server(request):
    fixture_path(VLM_TINY[request.param])
    s = ServerProcess(["-m", VLM_TINY[request.param], "--offline", "--backend", "mlx", "--dtype", "float32",
                       "-np", "1"])
    s.family = request.param
    yield s
    s.stop()


def tokens_before_image(family: str) -> int:
    """Where the image's run starts in the rendered prompt, by the checkpoint's own template."""
    from transformers import AutoTokenizer

    from mlxcel.models.vision import VISION_FAMILIES

    tok = AutoTokenizer.from_pretrained(str(fixture_path(VLM_TINY[family])))
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    return ids.index(tok.convert_tokens_to_ids(VISION_FAMILIES[family].image_token))


def ask(server, url: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_data_image_is_answered_and_its_prompt_cached_by_the_picture(server):
    first = ask(server, data_url(0))
    prompt_n = first["usage"]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] > 0 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = ask(server, data_url(0))
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_n - 1
    other = ask(server, data_url(1))
    # only the text before the image: the image's tokens stand for the other picture
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == tokens_before_image(server.family)
    props = httpx.get(server.base_url + "/props").json()
    assert props["modalities"]["vision"] is True
