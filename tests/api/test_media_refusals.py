"""Media refusals decided before anything is read (api/media.check): --no-mmproj, a text-only
checkpoint, other media kinds, images outside `messages`, the image count."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mlxcel.api import media
from mlxcel.api.errors import ApiError
from mlxcel.cli.flags import parse_server_args

VLM = SimpleNamespace(id="qwen2-vl-tiny", vision=SimpleNamespace(placeholder="<|vision_start|><|image_pad|><|vision_end|>"))
TEXT_ONLY = SimpleNamespace(id="qwen3-tiny", vision=None)
# a file:// URL that would be refused if it were read: a refusal before the read names something else
UNREAD = "file:///nonexistent/never-read.png"


def image(url=UNREAD):
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}


def refusal(model, argv, messages, others=()):
    pol = media.policy(parse_server_args(["-m", "x", *argv], {}))
    with pytest.raises(ApiError) as e:
        asyncio.run(media.gather(model, pol, messages, list(others)))
    return e.value.status, e.value.message


def test_no_mmproj_refuses_every_media_part_with_b10621s_clause():
    for spelling in ("--no-mmproj", "--no-mmproj-auto"):
        status, message = refusal(VLM, [spelling], [image()])
        assert status == 501 and message.startswith("image input is not supported - hint: ")
        assert "--no-mmproj" in message


def test_the_default_admits_media_and_reads_it():
    status, message = refusal(VLM, [], [image()])  # admitted: the read itself is what fails
    assert status == 400 and "file:// URLs are not allowed unless --media-path is specified" in message


def test_a_text_only_checkpoint_refuses_before_reading():
    status, message = refusal(TEXT_ONLY, [], [image()])
    assert status == 501 and message.startswith("image input is not supported") and "'qwen3-tiny'" in message


def test_a_multimodal_checkpoint_served_for_text_says_its_tower_is_not_run():
    # Gemma 3's multimodal checkpoint: its text tower is served, its image tower is not
    gemma3 = SimpleNamespace(id="gemma3", vision=None, info=SimpleNamespace(config={
        "model_type": "gemma3", "text_config": {}, "vision_config": {"model_type": "siglip_vision_model"}}))
    status, message = refusal(gemma3, [], [image()])
    assert status == 501 and message.startswith("image input is not supported - hint: ")
    assert "'gemma3' is served for text only" in message and "image tower" in message


def test_audio_video_extra_messages_and_count():
    audio = {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}
    assert refusal(VLM, [], [audio])[1].startswith("audio input is not supported")
    video = {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}
    assert refusal(VLM, [], [video])[1].startswith("video input is not supported")
    status, message = refusal(VLM, [], [{"role": "user", "content": "hi"}], [[image()]])
    assert status == 400 and "extra_messages" in message
    many = {"role": "user", "content": [image()["content"][0]] * (media.MAX_IMAGES + 1)}
    status, message = refusal(VLM, [], [many])
    assert status == 400 and f"at most {media.MAX_IMAGES}" in message


def test_a_data_url_is_checked_against_the_payload_limit_before_decoding():
    pol = media.MediaPolicy(enabled=True, root=None, allow_private=False, max_bytes=8)
    with pytest.raises(ApiError) as e:
        asyncio.run(media.gather(VLM, pol, [image("data:image/png;base64," + "A" * 64)]))
    assert e.value.status == 413
