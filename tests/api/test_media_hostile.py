"""Hostile images (api/media.load): decompression bombs, truncated files, files lying about
their type, animation-frame bombs and formats outside the accepted ones, each refused with a
400 naming why, by data: URL and by file:// under --media-path alike. Bombs and animations are
refused from their headers, before any frame is decoded. (Their time and peak memory:
scripts/bench/hostile_images.py, docs/benchmarks.md.)"""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import pytest
from PIL import Image

from mlxcel.api import media
from mlxcel.api.errors import ApiError
from tests.hostile_images import HOSTILE, big_accepted_png

VLM = SimpleNamespace(id="vlm", vision=SimpleNamespace(placeholder="<image>"))
FROM_HEADERS = ("png-bomb", "gif-bomb", "gif-frames-bomb", "webp-frames-bomb", "png-header-garbage", "text-as-png",
                "tiff")


def request(url: str) -> list:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "hi"}]}]


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    for name, (build, _) in HOSTILE.items():
        (root / f"{name}.png").write_bytes(build())  # every one named .png, whatever it holds
    return root


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("via", ["data", "file"])
def test_a_hostile_image_is_a_400_naming_why(name, via, media_root, monkeypatch):
    build, words = HOSTILE[name]
    if name in FROM_HEADERS:
        def refuse(self, *a, **k):
            raise AssertionError("a hostile image was decoded")
        monkeypatch.setattr("PIL.ImageFile.ImageFile.load", refuse)
    url = (f"file://{name}.png" if via == "file" else
           "data:image/png;base64," + base64.b64encode(build()).decode())
    pol = media.MediaPolicy(enabled=True, root=media_root, allow_private=False)
    with pytest.raises(ApiError) as e:
        asyncio.run(media.gather(VLM, pol, request(url)))
    assert e.value.status == 400 and words in e.value.message, e.value.message


def test_the_largest_image_under_the_limits_is_still_decoded():
    pol = media.MediaPolicy(enabled=True, root=None, allow_private=False)
    url = "data:image/png;base64," + base64.b64encode(big_accepted_png()).decode()
    _, [im] = asyncio.run(media.gather(VLM, pol, request(url)))
    assert im.size == (6000, 6000) and im.mode == "RGB"


def test_a_single_frame_gif_is_accepted():
    import io

    buf = io.BytesIO()
    Image.new("P", (40, 30), 3).save(buf, "GIF")
    pol = media.MediaPolicy(enabled=True, root=None, allow_private=False)
    _, [im] = asyncio.run(media.gather(VLM, pol, request("data:image/gif;base64,"
                                                         + base64.b64encode(buf.getvalue()).decode())))
    assert im.size == (40, 30)
