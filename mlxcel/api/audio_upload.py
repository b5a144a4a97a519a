"""What an uploaded audio clip must be before a decoder sees it, and the bounded decode.

`inspect(data)` identifies the container from its own magic bytes (RIFF/WAVE, MP3 with or
without an ID3v2 tag, FLAC; anything else is refused on content, whatever the client named it)
and walks its structure without decoding: the WAV chunk list, every MP3 frame header, the FLAC
metadata-block chain up to the first frame. It returns the geometry the header declares and
refuses, as an `UploadError` naming the problem, a sample rate above 192 kHz, more than 8
channels, more than 600 s (config/limits.py's MAX_AUDIO_SECONDS), a chunk or frame that runs past the end of the file, or a chain
that does not lead to audio. The walk touches each header once, so a hostile file costs a scan
of at most 25 MiB and no allocation sized by its fields.

`decode(data, clip)` then runs libsndfile (through `soundfile`) block by block, re-checking
what it actually produces against the header (rate, channels, length: a compressed file whose
header understates its length stops at the cap instead of growing), down-mixes to mono and
resamples to 16 kHz block by block, so memory is bounded by the 16 kHz output (600 s is 38 MB).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from math import ceil, gcd

import numpy as np

from mlxcel.api.multipart import UploadError
from mlxcel.config.limits import MAX_AUDIO_SECONDS as MAX_SECONDS

MAX_RATE = 192_000
MAX_CHANNELS = 8
TARGET_RATE = 16_000
_MAX_WAV_CHUNKS = 1024
_MAX_FLAC_BLOCKS = 1024


@dataclass(frozen=True)
class Clip:
    container: str  # "wav", "mp3" or "flac"
    rate: int
    channels: int
    frames: int  # what the header declares

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


def _bounds(container: str, rate: int, channels: int, frames: int) -> Clip:
    if not 0 < rate <= MAX_RATE:
        raise UploadError(f"{container}: sample rate {rate} Hz is outside 1..{MAX_RATE} Hz", param="file")
    if not 0 < channels <= MAX_CHANNELS:
        raise UploadError(f"{container}: {channels} channels (at most {MAX_CHANNELS})", param="file")
    if frames > MAX_SECONDS * rate:
        raise UploadError(f"{container}: the clip lasts {frames / rate:.1f} s; at most {MAX_SECONDS} s of audio are "
                          f"accepted per request", param="file")
    return Clip(container, rate, channels, frames)


def _id3_end(data: bytes) -> int:
    """Bytes taken by a leading ID3v2 tag (0 when there is none)."""
    if data[:3] != b"ID3" or len(data) < 10:
        return 0
    size = data[6:10]
    if any(b & 0x80 for b in size):
        raise UploadError("mp3: the ID3v2 tag's size is not syncsafe", param="file")
    n = (size[0] << 21) | (size[1] << 14) | (size[2] << 7) | size[3]
    end = 10 + n + (10 if data[5] & 0x10 else 0)
    if end > len(data):
        raise UploadError(f"truncated file: the ID3v2 tag claims {end} bytes, the file has {len(data)}", param="file")
    return end


def inspect(data: bytes) -> Clip:
    if len(data) == 0:
        raise UploadError("the uploaded file is empty", param="file")
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return _wav(data)
    start = _id3_end(data)
    if data[start : start + 4] == b"fLaC":
        return _flac(data, start)
    if start or _mp3_header(data, 0) is not None:
        return _mp3(data, start)
    raise UploadError("the uploaded file is not WAV, MP3 or FLAC audio (identified by its content)", param="file")


# --- WAV ---------------------------------------------------------------------------------

_WAV_CODECS = {1: (8, 16, 24, 32), 3: (32, 64), 6: (8,), 7: (8,)}  # PCM, float, A-law, mu-law


def _wav(data: bytes) -> Clip:
    pos, fmt = 12, None
    for _ in range(_MAX_WAV_CHUNKS):
        if pos + 8 > len(data):
            raise UploadError("truncated WAV: no data chunk before the end of the file", param="file")
        cid, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        body = pos + 8
        if cid == b"fmt ":
            if size < 16 or body + size > len(data):
                raise UploadError("truncated WAV: the fmt chunk is incomplete", param="file")
            tag, channels = int.from_bytes(data[body : body + 2], "little"), int.from_bytes(data[body + 2 : body + 4], "little")
            rate = int.from_bytes(data[body + 4 : body + 8], "little")
            align, bits = int.from_bytes(data[body + 12 : body + 14], "little"), int.from_bytes(data[body + 14 : body + 16], "little")
            if tag == 0xFFFE and size >= 40:  # WAVE_FORMAT_EXTENSIBLE: the codec is the sub-format GUID's head
                tag = int.from_bytes(data[body + 24 : body + 26], "little")
            if tag not in _WAV_CODECS or bits not in _WAV_CODECS[tag]:
                raise UploadError(f"WAV: format tag {tag} with {bits}-bit samples is not a supported encoding "
                                  f"(PCM 8/16/24/32, float 32/64, A-law, mu-law)", param="file")
            fmt = (rate, channels, align)
            if channels == 0 or align != channels * bits // 8:
                raise UploadError(f"WAV: block align {align} does not match {channels} channels of {bits} bits",
                                  param="file")
        elif cid == b"data":
            if fmt is None:
                raise UploadError("WAV: the data chunk comes before any fmt chunk", param="file")
            present = len(data) - body
            if size > present:
                raise UploadError(f"truncated WAV: the data chunk declares {size} bytes but the file holds {present}",
                                  param="file")
            rate, channels, align = fmt
            return _bounds("WAV", rate, channels, size // align)
        elif body + size > len(data):
            raise UploadError(f"truncated WAV: chunk {cid!r} claims {size} bytes past the end of the file", param="file")
        pos = body + size + (size & 1)  # chunks are word-aligned
    raise UploadError(f"WAV: more than {_MAX_WAV_CHUNKS} chunks before the data chunk", param="file")


# --- MP3 ---------------------------------------------------------------------------------

_MP3_BITRATES = {  # kbps by (MPEG-1?, layer) and bitrate index 1..14
    (True, 1): (32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_BITRATES[(False, 3)] = _MP3_BITRATES[(False, 2)]
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits


def _mp3_header(data: bytes, pos: int) -> tuple[int, int, int, int] | None:
    """(frame bytes, samples, rate, channels) of a valid MPEG audio frame header at pos, else None."""
    if pos + 4 > len(data) or data[pos] != 0xFF or data[pos + 1] & 0xE0 != 0xE0:
        return None
    b1, b2, b3 = data[pos + 1], data[pos + 2], data[pos + 3]
    version, layer_bits, rate_i, br_i = (b1 >> 3) & 3, (b1 >> 1) & 3, (b2 >> 2) & 3, b2 >> 4
    if version == 1 or layer_bits == 0 or rate_i == 3 or br_i in (0, 15):  # reserved / free-format / bad
        return None
    layer, mpeg1 = 4 - layer_bits, version == 3
    rate = _MP3_RATES[version][rate_i]
    bitrate = _MP3_BITRATES[(mpeg1, layer)][br_i - 1] * 1000
    padding = (b2 >> 1) & 1
    if layer == 1:
        return (12 * bitrate // rate + padding) * 4, 384, rate, 1 if b3 >> 6 == 3 else 2
    samples = 1152 if layer == 2 or mpeg1 else 576
    return samples // 8 * bitrate // rate + padding, samples, rate, 1 if b3 >> 6 == 3 else 2


def _mp3(data: bytes, start: int) -> Clip:
    end = len(data) - (128 if data[-128:-125] == b"TAG" else 0)  # a trailing ID3v1 tag
    first = _mp3_header(data, start)
    if first is None:
        raise UploadError(f"mp3: no MPEG audio frame header at byte {start}", param="file")
    _, _, rate, channels = first
    pos, samples = start, 0
    while pos < end:
        head = _mp3_header(data, pos)
        if head is None:
            if data[pos : pos + 8] == b"APETAGEX" or data[pos : pos + 11] == b"LYRICSBEGIN" or not any(data[pos:end]):
                break  # trailing tags or zero padding after the last frame
            raise UploadError(f"mp3: corrupt stream, no frame header at byte {pos}", param="file")
        size, n, frame_rate, _ = head
        if frame_rate != rate:
            raise UploadError(f"mp3: the frame at byte {pos} changes the sample rate", param="file")
        if pos + size > end:
            raise UploadError(f"truncated mp3: the frame at byte {pos} needs {size} bytes, {end - pos} remain",
                              param="file")
        pos, samples = pos + size, samples + n
        if samples > MAX_SECONDS * rate:
            break  # _bounds names it
    return _bounds("mp3", rate, channels, samples)


# --- FLAC --------------------------------------------------------------------------------

def _flac(data: bytes, start: int) -> Clip:
    pos, info, last = start + 4, None, False
    for count in range(_MAX_FLAC_BLOCKS):
        if pos + 4 > len(data):
            raise UploadError("truncated FLAC: the metadata chain runs past the end of the file", param="file")
        head = data[pos]
        last, kind, size = bool(head & 0x80), head & 0x7F, int.from_bytes(data[pos + 1 : pos + 4], "big")
        if kind == 127:
            raise UploadError(f"FLAC: invalid metadata block type at byte {pos}", param="file")
        if count == 0 and (kind != 0 or size != 34):
            raise UploadError("FLAC: the first metadata block is not a 34-byte STREAMINFO", param="file")
        if kind == 0 and count > 0:
            raise UploadError("FLAC: a second STREAMINFO block", param="file")
        if pos + 4 + size > len(data):
            raise UploadError(f"truncated FLAC: metadata block at byte {pos} claims {size} bytes past the end of "
                              f"the file", param="file")
        if kind == 0:
            info = data[pos + 4 : pos + 4 + 34]
        pos += 4 + size
        if last:
            break
    if not last:
        raise UploadError(f"FLAC: more than {_MAX_FLAC_BLOCKS} metadata blocks", param="file")
    if pos + 2 > len(data) or data[pos] != 0xFF or data[pos + 1] & 0xFE != 0xF8:
        raise UploadError(f"FLAC: no audio frame follows the metadata (no frame sync at byte {pos})", param="file")
    min_block, max_block = int.from_bytes(info[0:2], "big"), int.from_bytes(info[2:4], "big")
    if min_block < 16 or max_block < min_block:
        raise UploadError(f"FLAC: STREAMINFO block sizes {min_block}..{max_block} are invalid", param="file")
    bits = int.from_bytes(info[10:18], "big")
    rate, channels = bits >> 44, ((bits >> 41) & 7) + 1
    sample_bits, total = ((bits >> 36) & 31) + 1, bits & ((1 << 36) - 1)
    if sample_bits < 4:
        raise UploadError(f"FLAC: {sample_bits}-bit samples are invalid", param="file")
    if total == 0:  # legal for a streamed encoder, but then nothing bounds the decode ahead of time
        raise UploadError("FLAC: STREAMINFO does not state the clip's length (total samples 0); re-encode the "
                          "file with its length", param="file")
    return _bounds("FLAC", rate, channels, total)


# --- decode ------------------------------------------------------------------------------

def _resample_plan(rate: int) -> tuple[int, int, int, int]:
    """(up, down, block, context): blocks and context are multiples of `down`, so each block's
    output starts on an exact output sample and the blocks join into the whole-signal result;
    the context covers the polyphase filter's half length (10 * max(up, down) taps at the
    upsampled rate)."""
    g = gcd(rate, TARGET_RATE)
    up, down = TARGET_RATE // g, rate // g
    context = down * ceil((10 * max(up, down) / up + 8) / down)
    block = down * max(1, 65536 // down)
    return up, down, block, context


def decode(data: bytes, clip: Clip) -> np.ndarray:
    """The clip as mono float32 at 16 kHz; an UploadError when the decoder disagrees with the
    header or produces more than the bounds allow."""
    import soundfile as sf
    from scipy.signal import resample_poly

    up, down, block, context = _resample_plan(clip.rate)
    cap = min(MAX_SECONDS * clip.rate, clip.frames + 4096)  # room for an mp3 decoder's priming, not more
    out: list[np.ndarray] = []
    pending = np.zeros(0, dtype=np.float32)  # source-rate mono samples not yet resampled
    left = 0  # context samples at the head of `pending` already resampled
    produced = 0

    def flush(final: bool) -> None:
        nonlocal pending, left
        while len(pending) >= left + block + context or (final and len(pending) > left):
            window = pending if final and len(pending) < left + block + context else pending[: left + block + context]
            take = min(block, len(window) - left)
            y = resample_poly(window, up, down) if (up, down) != (1, 1) else window
            a = left * up // down
            out.append(np.asarray(y[a : a + ceil(take * up / down)], dtype=np.float32))
            pending = pending[left + take - context :] if len(pending) > left + take else pending[:0]
            left = context if len(pending) else 0
            if final and not len(pending):
                break

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.samplerate != clip.rate or f.channels != clip.channels:
                raise UploadError(f"{clip.container}: the decoder reports {f.samplerate} Hz x {f.channels} channels, "
                                  f"the header {clip.rate} Hz x {clip.channels}", param="file")
            while True:
                chunk = f.read(block, dtype="float32", always_2d=True)
                if not len(chunk):
                    break
                produced += len(chunk)
                if produced > cap:
                    raise UploadError(f"{clip.container}: the decoded audio runs longer than the header declares "
                                      f"or than the {MAX_SECONDS} s accepted per request", param="file")
                pending = np.concatenate([pending, chunk.mean(axis=1, dtype=np.float32)])
                flush(final=False)
    except sf.LibsndfileError as e:
        raise UploadError(f"{clip.container}: the audio could not be decoded ({e})", param="file") from None
    flush(final=True)
    if produced == 0:
        raise UploadError(f"{clip.container}: the file holds no audio samples", param="file")
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
