"""Images in native /completion prompts: `{"prompt_string": ..., "multimodal_data": [...]}`.

A prompt object's `multimodal_data` is a list of base64 images, one per media marker
(`<__media__>`, /props `media_marker`) in its `prompt_string`, in order. On a checkpoint with an
image side each marker becomes the checkpoint's placeholder, and the images go through the same
reading, limits and decoding as a chat request's (api/media.py): the request's image count and
pixel limits count every prompt's images together. Without an image side, or under --no-mmproj,
the data is refused as b10621 refuses media it cannot take.
"""

from __future__ import annotations

from typing import Any

from mlxcel.api import media
from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.props import MEDIA_MARKER


def _several(prompt: Any) -> bool:
    """Whether a native `prompt` is several prompts (as tokenize_native_prompts reads it)."""
    return isinstance(prompt, list) and bool(prompt) and not any(
        isinstance(p, int) and not isinstance(p, bool) for p in prompt)


def _blobs(obj: Any, where: str) -> list[str]:
    data = obj.get("multimodal_data") if isinstance(obj, dict) else None
    if not data:
        return []
    if not isinstance(data, list) or not all(isinstance(d, str) and d for d in data):
        raise ApiError(400, f"{where}.multimodal_data must be an array of base64-encoded images",
                       code="invalid_parameter", param="prompt")
    if not isinstance(obj.get("prompt_string"), str):
        raise ApiError(400, f"{where}.prompt_string must be a string holding one {MEDIA_MARKER} per "
                       "multimodal_data item", code="invalid_parameter", param="prompt")
    marks = obj["prompt_string"].count(MEDIA_MARKER)
    if marks != len(data):
        raise ApiError(400, f"{where}.prompt_string has {marks} media marker(s) {MEDIA_MARKER} for {len(data)} "
                       "multimodal_data item(s)", code="invalid_parameter", param="prompt")
    return data


async def gather(model: Any, pol: media.MediaPolicy, prompt: Any) -> tuple[Any, list[list]]:
    """(the prompt with every marker replaced by the placeholder and multimodal_data dropped,
    the decoded images of each prompt in order)."""
    objs = list(prompt) if _several(prompt) else [prompt]
    blobs = [_blobs(o, f"prompt[{i}]" if len(objs) > 1 else "prompt") for i, o in enumerate(objs)]
    n = sum(len(b) for b in blobs)
    if not n:
        return prompt, [[] for _ in objs]
    if not pol.enabled:
        raise ApiError(501, "image input is not supported - hint: media input is turned off on this server "
                       "(--no-mmproj)", code="not_supported", type="not_supported_error")
    if model.vision is None:
        raise ApiError(501, "multimodal_data is not supported: the loaded model has no media tower",
                       code="not_supported", type="not_supported_error")
    if n > pol.max_images:
        raise ApiError(400, f"the request carries {n} images; at most {pol.max_images} are accepted",
                       code="invalid_parameter", param="prompt")
    decoded = await media.load([f"data:application/octet-stream;base64,{b}" for bl in blobs for b in bl], pol)
    images, at = [], 0
    for bl in blobs:
        images.append(decoded[at:at + len(bl)])
        at += len(bl)
    rewritten = [{"prompt_string": o["prompt_string"].replace(MEDIA_MARKER, model.vision.placeholder)}
                 if b else o for o, b in zip(objs, blobs)]
    return (rewritten if _several(prompt) else rewritten[0]), images
