"""Fuzz targets for the parsers that read client input: one function each, taking raw bytes.

Each target feeds its input to one parser and lets only that parser's documented error out;
anything else (IndexError, RecursionError, UnicodeDecodeError, ...) escapes and is the finding.
The Hypothesis tests (test_parser_fuzz.py) and the Atheris runner (scripts/hardening.py) share
these, so a crash either finds is reproduced by calling the target on the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from mlxcel.api.audio_upload import decode, inspect
from mlxcel.api.errors import ApiError
from mlxcel.api.multipart import MultipartReader, UploadError, boundary_of
from mlxcel.api.openai.response_format import check_schema
from mlxcel.chat.gbnf import GbnfError, gbnf_to_lark
from mlxcel.engine.grammar import GrammarError, check_json_schema_text

BOUNDARY = b"fuzzbound"


def gbnf(data: bytes) -> None:
    """GBNF text (as a client sends it in `grammar`) lowered to Lark: GbnfError or success."""
    try:
        gbnf_to_lark(data.decode("utf-8", "replace"), token_id=lambda s: 7 if s == "<tok>" else None, n_vocab=100)
    except GbnfError:
        pass


def json_schema(data: bytes) -> None:
    """A response_format schema: the route's checks (ApiError 400), then the schema front end
    (GrammarError). Non-JSON input is not this target's concern: the body decoder refuses it."""
    try:
        schema = json.loads(data)
    except (ValueError, RecursionError):
        return
    try:
        check_schema(schema)
    except ApiError as e:
        if e.status != 400:
            raise
        return
    try:
        check_json_schema_text(json.dumps(schema))
    except GrammarError:
        pass


def multipart(data: bytes) -> None:
    """A multipart body under a fixed boundary, fed in two chunks split at a data-chosen point
    (the reader must not care where chunks end), then the Content-Type parser on the first line."""
    cut = data[0] % (len(data) + 1) if data else 0
    try:
        reader = MultipartReader(BOUNDARY, max_part_bytes=1 << 16, max_body_bytes=1 << 20)
        reader.feed(data[:cut])
        reader.feed(data[cut:])
        reader.finish()
    except UploadError:
        pass
    try:
        boundary_of(data.split(b"\n", 1)[0].decode("latin-1"))
    except UploadError:
        pass


def audio(data: bytes) -> None:
    """An uploaded file's header reader, then (for a header it accepts) the decoder itself."""
    try:
        clip = inspect(data)
    except UploadError:
        return
    if clip.frames > 16000 * 5:
        return  # decoding is bounded by the header check; keeping it short keeps the fuzz fast
    try:
        decode(data, clip)
    except UploadError:
        pass


TARGETS: dict[str, Callable[[bytes], None]] = {
    "gbnf": gbnf, "json_schema": json_schema, "multipart": multipart, "audio": audio,
}


def _wav_seed() -> bytes:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000)
        w.writeframes(b"\x01\x00" * 800)
    return buf.getvalue()


def _multipart_seed() -> bytes:
    b = b"--" + BOUNDARY
    return (b + b'\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n' + b
            + b'\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
            + _wav_seed() + b"\r\n" + b + b"--\r\n")


# Valid inputs the coverage-guided fuzzer starts from and mutates.
SEEDS: dict[str, list[bytes]] = {
    "gbnf": [b'root ::= item+ ("," item)*\nitem ::= [a-z]{1,3} | "x" | <tok> | !<[3]> # c\n',
             b'root ::= (. | [^\\n])?'],
    "json_schema": [json.dumps({"type": "object", "required": ["a"], "$defs": {"n": {"enum": [1, 2]}},
                                "properties": {"a": {"type": "string", "maxLength": 3},
                                               "b": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}).encode(),
                    b'{"anyOf": [{"type": "integer", "minimum": 0}, {"const": null}]}'],
    "multipart": [_multipart_seed()],
    "audio": [_wav_seed(), b"ID3\x03\x00\x00\x00\x00\x00\x00\xff\xfb\x90\x64" + b"\x00" * 413],
}
