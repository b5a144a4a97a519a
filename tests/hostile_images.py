"""Hostile image payloads, each a few KB: what api/media.py must refuse quickly and without
decoding (tests/api/test_media_hostile.py, the routes in tests/e2e/test_vlm_images.py, and the
time and memory figures of scripts/bench/hostile_images.py)."""

from __future__ import annotations

import functools
import io
import random
import struct
import zlib

from PIL import Image


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(side: int = 100_000) -> bytes:
    """A PNG whose header declares side x side grey pixels, with a few bytes of pixel data."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _chunk(b"IEND", b""))


def gif_bomb() -> bytes:
    """A GIF whose logical screen is 65535 x 65535, holding one 1x1 frame."""
    return (b"GIF89a" + struct.pack("<HHBBB", 65535, 65535, 0, 0, 0)
            + b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00" + b"\x3b")


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


@functools.cache
def random_png(side: int = 256) -> bytes:
    rnd = random.Random(0)
    return _save(Image.frombytes("RGB", (side, side), bytes(rnd.getrandbits(8) for _ in range(side * side * 3))),
                 "PNG")


def truncated_png() -> bytes:
    """A real PNG cut off halfway through its pixel data: the header reads, the pixels do not."""
    data = random_png()
    return data[: len(data) // 2]


def png_header_garbage() -> bytes:
    """The PNG signature followed by noise: no header to read."""
    return b"\x89PNG\r\n\x1a\n" + random.Random(1).randbytes(4096)


@functools.cache
def gif_frames_bomb(frames: int = 32, side: int = 1000) -> bytes:
    """An animated GIF: `frames` frames of side x side, each within the per-image pixel cap."""
    first = Image.new("P", (side, side), 0)
    rest = [Image.new("P", (side, side), i % 255 + 1) for i in range(frames - 1)]
    return _save(first, "GIF", save_all=True, append_images=rest, loop=0)


@functools.cache
def webp_frames_bomb(frames: int = 16, side: int = 1000) -> bytes:
    """An animated WebP: `frames` frames of side x side."""
    images = [Image.new("RGB", (side, side), (i * 15 % 256, 0, 0)) for i in range(frames)]
    return _save(images[0], "WEBP", save_all=True, append_images=images[1:])


def text_file() -> bytes:
    return b"This is a text file, whatever its name says.\n" * 20


def tiff_image() -> bytes:
    """A real picture in a format outside the accepted ones."""
    return _save(Image.new("RGB", (32, 32), (1, 2, 3)), "TIFF")


@functools.cache
def big_accepted_png(side: int = 6000) -> bytes:
    """Under every limit (36 MP of one grey value, about 40 KB): the dearest image still decoded."""
    return _save(Image.new("L", (side, side), 7), "PNG")


def extreme_aspect_png() -> bytes:
    """1 x 240: decodes, within every pixel limit, but no dynamic-resolution processor resizes it."""
    return _save(Image.new("RGB", (1, 240), (9, 9, 9)), "PNG")


# name -> (payload builder, words of the refusal)
HOSTILE = {
    "png-bomb": (png_bomb, "exceeds the per-image limit"),
    "gif-bomb": (gif_bomb, "exceeds the per-image limit"),
    "truncated": (truncated_png, "could not be decoded"),
    "png-header-garbage": (png_header_garbage, "could not be decoded"),
    "gif-frames-bomb": (gif_frames_bomb, "animated"),
    "webp-frames-bomb": (webp_frames_bomb, "animated"),
    "text-as-png": (text_file, "could not be decoded"),
    "tiff": (tiff_image, "could not be decoded"),
}
