"""Image parts of a chat request: refusals, limits, loading, decoding, the prompt placeholder.

`gather()` runs before anything is rendered. It first decides, without reading any URL or
file, whether the request may carry media at all: a text-only checkpoint and a server
started with --no-mmproj refuse every media part with b10621's `<kind> input is not
supported` clause at HTTP 501 (audio and video parts are refused the same way: no served
checkpoint takes them), and the image count is checked. Then each image is read (a data:
base64 URL; a file:// URL under --media-path, api/media_path.py; an http(s) URL under the
address policy, api/media_fetch.py), bounded by the payload limit, and its header opened with
Pillow, in one of the formats a client sends (PNG, JPEG, GIF, WebP, BMP; not Pillow's many others);
the per-image and per-request pixel limits (config/limits.py) are checked on those header sizes, and
an animated image refused, before any image is decoded; a file that lies about its type or stops
short fails its header read or its decode, and is refused as undecodable. Each image part is
replaced by the checkpoint's placeholder text (models/vision.py), which the chat template renders
in place; the backend later expands it to the image's tokens. `load()` serves the native
/completion's multimodal_data the same way (api/llamacpp/native_media.py). `prepare()` turns the
decoded images into the request's Media.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.api.errors import ApiError
from mlxcel.config.limits import MAX_IMAGES, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_REQUEST_IMAGE_PIXELS, echo

IMAGE_PARTS = ("image_url", "input_image")
# The image formats read. Pillow recognises dozens more (EPS runs Ghostscript, PSD, TIFF and ICO
# carry their own decoders); a picture a client sends is one of these.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
OTHER_MEDIA = {"input_audio": "audio", "audio": "audio", "video_url": "video", "input_video": "video"}


@dataclass(frozen=True)
class MediaPolicy:
    enabled: bool  # --mmproj-auto (default) / --no-mmproj
    root: Path | None  # --media-path
    allow_private: bool  # MLXCEL_ALLOW_PRIVATE_MEDIA_URLS=1
    max_images: int = MAX_IMAGES
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS  # per image
    max_total_pixels: int = MAX_REQUEST_IMAGE_PIXELS  # all of one request's images


def policy(settings: Any) -> MediaPolicy:
    return MediaPolicy(enabled=settings.media.mmproj, root=settings.media.media_path,
                       allow_private=settings.media.allow_private_media_urls)


def _not_supported(kind: str, hint: str) -> ApiError:
    return ApiError(501, f"{kind} input is not supported - hint: {hint}", code="not_supported",
                    type="not_supported_error")


def _no_images_hint(model: Any) -> str:
    """Why a checkpoint served without images takes none: it has no image tower, or (Gemma 3's
    multimodal checkpoint on MLX, or one without its image processor) only its text tower is served."""
    from mlxcel.models.vision import is_vision

    info = getattr(model, "info", None)
    config = getattr(info, "config", None) or {}
    if isinstance(config.get("vision_config"), dict):
        how = ("its images are served on the torch backend from a checkpoint that ships its image processor "
               "(--backend torch)" if is_vision(config) else "see docs/models.md")
        return (f"the loaded checkpoint '{model.id}' is served for text only: mlxcel does not run its image tower "
                f"({config.get('model_type')}) here; {how}")
    return f"the loaded checkpoint '{model.id}' has no image tower; serve a vision-language checkpoint for image input"


def _parts(messages: Any):
    """(message index, part index, part) for every dict part of every list content."""
    for i, m in enumerate(messages or []):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict):
                    yield i, j, part


def has_media(messages: Any) -> bool:
    return any(p.get("type") in IMAGE_PARTS or p.get("type") in OTHER_MEDIA for _, _, p in _parts(messages))


def _url(part: dict) -> str:
    ref = part.get("image_url")
    if isinstance(ref, dict):
        ref = ref.get("url")
    if not isinstance(ref, str) or not ref:
        raise ApiError(400, "an image part needs image_url.url (a data:, file:// or http(s) URL)",
                       code="invalid_parameter", param="messages")
    return ref


def check(model: Any, pol: MediaPolicy, messages: Any, others: list[Any] = ()) -> int:
    """Every refusal that needs no read: returns the number of image parts in `messages`."""
    n = 0
    for conv in [messages, *others]:
        for _, _, part in _parts(conv):
            kind = part.get("type")
            if kind in OTHER_MEDIA:
                raise _not_supported(OTHER_MEDIA[kind], f"the loaded checkpoint '{model.id}' has no {OTHER_MEDIA[kind]} "
                                     "tower")
            if kind in IMAGE_PARTS:
                if not pol.enabled:
                    raise _not_supported("image", "media input is turned off on this server (--no-mmproj)")
                if model.vision is None:
                    raise _not_supported("image", _no_images_hint(model))
                if conv is not messages:
                    raise ApiError(400, "image parts are accepted in messages only, not in extra_messages",
                                   code="field_not_honoured", param="extra_messages")
                n += 1
    if n > pol.max_images:
        raise ApiError(400, f"the request carries {n} images; at most {pol.max_images} are accepted",
                       code="invalid_parameter", param="messages")
    return n


async def _read(url: str, pol: MediaPolicy) -> bytes:
    from mlxcel.api import media_fetch, media_path

    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ApiError(400, "a data: image URL must be base64 (data:<mime>;base64,<data>)",
                           code="invalid_parameter", param="messages")
        if len(payload) * 3 // 4 > pol.max_bytes:
            raise ApiError(413, f"an image is larger than the image payload limit of {pol.max_bytes} bytes",
                           code="payload_too_large", param="messages")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "a data: image URL is not valid base64", code="invalid_parameter",
                           param="messages") from None
    if url.startswith("file://"):
        import anyio

        try:
            return await anyio.to_thread.run_sync(media_path.read, pol.root, url, pol.max_bytes)
        except media_path.MediaPathRefused as e:
            raise ApiError(400, str(e), code="invalid_parameter", param="messages") from None
    try:
        return await media_fetch.fetch(url, allow_private=pol.allow_private, max_bytes=pol.max_bytes)
    except media_fetch.FetchRefused as e:
        raise ApiError(400, str(e), code="invalid_parameter", param="messages") from None


def _undecodable() -> ApiError:
    return ApiError(400, "an image part could not be decoded as an image (PNG, JPEG, GIF, WebP or BMP)",
                    code="invalid_parameter", param="messages")


def probe(data: bytes, pol: MediaPolicy) -> Any:
    """Bytes -> an opened, not yet decoded PIL image whose header size is within the per-image
    cap. Our cap is checked whatever PIL's own global bomb limit is set to (even None)."""
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:  # PIL's own check fired first: still our limit's refusal
        raise ApiError(400, f"an image exceeds the per-image limit of {pol.max_pixels} pixels",
                       code="invalid_parameter", param="messages") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise _undecodable() from None
    if im.width * im.height > pol.max_pixels:
        im.close()
        raise ApiError(400, f"an image of {im.width}x{im.height} exceeds the per-image limit of {pol.max_pixels} "
                       "pixels", code="invalid_parameter", param="messages")
    try:
        # read from the headers (GIF: the second frame's descriptor), no frame decoded
        animated = bool(getattr(im, "is_animated", False))
    except (OSError, ValueError, EOFError):
        animated = True  # frames past the first that do not even parse
    if animated:
        im.close()
        raise ApiError(400, "an animated image is not accepted: send a single frame (PNG, JPEG, WebP, or a "
                       "non-animated GIF)", code="invalid_parameter", param="messages")
    return im


def decode(im: Any) -> Any:
    """A probed image -> a loaded RGB image (the size was checked by probe before this)."""
    from PIL import Image

    try:
        im.load()
        return im.convert("RGB")
    except (OSError, Image.DecompressionBombError, ValueError):
        raise _undecodable() from None
    finally:
        im.close()  # the encoded bytes and the undecoded copy are not held past this


def _check_total(images: list, pol: MediaPolicy) -> None:
    total = sum(im.width * im.height for im in images)
    if total > pol.max_total_pixels:
        raise ApiError(400, f"the request's {len(images)} images total {total} pixels; at most "
                       f"{pol.max_total_pixels} are accepted per request", code="invalid_parameter",
                       param="messages")


async def gather(model: Any, pol: MediaPolicy, messages: list, others: list = ()) -> tuple[list, list]:
    """(messages with each image part replaced by the placeholder text, decoded images in order).
    Every image is read and its header checked, per image and for the request, before any is decoded."""
    if not check(model, pol, messages, others):
        return messages, []
    urls, out = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                urls.append(_url(part))
                part = {"type": "text", "text": model.vision.placeholder}
            parts.append(part)
        out.append({**m, "content": parts})
    return out, await load(urls, pol)


async def load(urls: list[str], pol: MediaPolicy) -> list:
    """The decoded RGB images of `urls` (data:, file://, http(s)), each read and its header
    checked, per image and for the request, before any is decoded."""
    import anyio

    opened = []
    try:
        for url in urls:
            data = await _read(url, pol)
            opened.append(await anyio.to_thread.run_sync(probe, data, pol))
        _check_total(opened, pol)
    except BaseException:
        for im in opened:
            im.close()
        raise
    return [await anyio.to_thread.run_sync(decode, im) for im in opened]


async def prepare(model: Any, prompt: list[int], images: list) -> tuple[list[int], Any]:
    """The expanded prompt and the engine's Media for these images (processor work off the loop)."""
    import anyio

    try:  # a processor refuses what it cannot resize (e.g. Qwen's aspect ratio above 200) with ValueError
        encoded = await anyio.to_thread.run_sync(model.vision.encode, images)
        full = model.vision.expand(prompt, encoded)
    except ValueError as e:
        raise ApiError(400, echo(str(e)), code="invalid_parameter", param="messages") from None
    return full, model.vision.media(full, encoded)


def keyed(greq: Any, payload: Any) -> None:
    """Give an engine request its image payload, and the prefix cache's key where the backend
    resumes an image prompt from the cache (engine.types.PrefixKeyed); else no prompt cache."""
    from mlxcel.engine.types import PrefixKeyed

    greq.media = payload
    greq.cache_tokens = list(payload.cache_tokens) if isinstance(payload, PrefixKeyed) else None
    greq.cache_prompt = greq.cache_prompt and greq.cache_tokens is not None


async def attach(model: Any, greq: Any, images: list, param: str) -> None:
    """Give an engine request built from a placeholder prompt its images: the prompt expanded
    (the context is checked again at the expanded length), the Media and its cache key."""
    from mlxcel.api.openai.generation import check_context

    full, payload = await prepare(model, greq.prompt, images)
    check_context(model, len(full), greq.max_tokens, param)
    greq.prompt = full
    keyed(greq, payload)


def from_anthropic(messages: list) -> list:
    """Anthropic image blocks as image_url parts (base64 -> a data: URL, url -> the URL); the
    other blocks are left for the route's own translation."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        blocks = []
        for b in content:
            if isinstance(b, dict) and b.get("type") == "image":
                src = b.get("source") or {}
                if src.get("type") == "base64":
                    url = f"data:{src.get('media_type') or 'image/png'};base64,{src.get('data') or ''}"
                elif src.get("type") == "url":
                    url = src.get("url")
                else:
                    raise ApiError(400, f"image source type {echo(src.get('type'))!r} is not supported (base64 or url)",
                                   code="invalid_parameter", param="messages")
                b = {"type": "image_url", "image_url": {"url": url}}
            blocks.append(b)
        out.append({**m, "content": blocks})
    return out


def anthropic_has_images(messages: Any) -> bool:
    return any(p.get("type") == "image" for _, _, p in _parts(messages))


def without_images(messages: list) -> list:
    """The messages with their image parts left out: only for checking the rest's shape."""
    return [{**m, "content": [p for p in m["content"] if not (isinstance(p, dict) and p.get("type") in IMAGE_PARTS)]}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]
