"""Per-request image limits (api/media.gather, config/limits.py): the image count, the per-image
pixel cap and the request's total pixels, all refused from the headers before any image is decoded."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import pytest
from PIL import Image

from mlxcel.api import media
from mlxcel.api.errors import ApiError
from mlxcel.config import limits

VLM = SimpleNamespace(id="qwen2-vl-tiny", vision=SimpleNamespace(placeholder="<image>"))
POL = media.MediaPolicy(enabled=True, root=None, allow_private=False)


def png(w, h):
    """A solid-colour PNG: a few KB on disk, w*h pixels once decoded."""
    buf = io.BytesIO()
    Image.new("L", (w, h), 7).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def request(*urls):
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": "hi"}]}]


def refused(messages, monkeypatch):
    """The refusal of `messages`, with any full decode failing the test: it must come from the headers."""
    def refuse(self, *a, **k):
        raise AssertionError("an image was decoded before the request's limits were checked")
    monkeypatch.setattr(Image.Image, "load", refuse)
    monkeypatch.setattr(Image.Image, "convert", refuse)
    monkeypatch.setattr("PIL.ImageFile.ImageFile.load", refuse)
    with pytest.raises(ApiError) as e:
        asyncio.run(media.gather(VLM, POL, messages))
    return e.value


def test_the_limits_live_in_config_and_are_the_documented_ones():
    assert (limits.MAX_IMAGES, limits.MAX_IMAGE_PIXELS, limits.MAX_REQUEST_IMAGE_PIXELS) == (16, 40_000_000, 64_000_000)
    assert (POL.max_images, POL.max_pixels, POL.max_total_pixels) == (16, 40_000_000, 64_000_000)


def test_more_images_than_the_limit_is_a_400_naming_it(monkeypatch):
    e = refused(request(*[png(8, 8)] * (limits.MAX_IMAGES + 1)), monkeypatch)
    assert e.status == 400 and f"at most {limits.MAX_IMAGES}" in e.message


def test_images_over_the_request_pixel_total_are_refused_before_any_decode(monkeypatch):
    # two images of 36 MP each: each under the per-image cap, together over the request's 64 MP
    big = png(6000, 6000)
    assert len(big) < 200_000
    e = refused(request(big, big), monkeypatch)
    assert e.status == 400 and str(limits.MAX_REQUEST_IMAGE_PIXELS) in e.message and "per request" in e.message


def test_one_image_over_the_per_image_cap_is_refused_from_its_header(monkeypatch):
    e = refused(request(png(7000, 7000)), monkeypatch)
    assert e.status == 400 and "7000x7000" in e.message and str(limits.MAX_IMAGE_PIXELS) in e.message


def test_the_per_image_cap_holds_even_with_pils_bomb_check_turned_off(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    e = refused(request(png(7000, 7000)), monkeypatch)
    assert e.status == 400 and str(limits.MAX_IMAGE_PIXELS) in e.message


def test_a_request_under_both_limits_is_decoded():
    messages, images = asyncio.run(media.gather(VLM, POL, request(png(4000, 4000), png(4000, 4000), png(64, 32))))
    assert [im.size for im in images] == [(4000, 4000), (4000, 4000), (64, 32)]
    assert all(im.mode == "RGB" for im in images)
    assert messages[0]["content"][0] == {"type": "text", "text": "<image>"}
