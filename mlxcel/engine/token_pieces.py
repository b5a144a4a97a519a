"""The raw bytes each vocabulary entry stands for (llama.cpp's "token piece").

A byte-level BPE token (GPT-2, Llama 3, Qwen, SmolLM) is spelled in the printable
stand-in alphabet of `bytes_to_unicode`; a SentencePiece token (Gemma, Llama 2) spells a
space as U+2581 and a raw byte as `<0xNN>`. Decoding one token through the tokenizer
loses bytes that do not form a whole character, so pieces are rebuilt from the token
spelling instead; special tokens are their literal text, as upstream renders them.
The result is one `bytes` per id, built once per tokenizer.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: stand-in character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kind(hf) -> str:
    """"bytelevel", "sentencepiece" or "other", from the fast tokenizer's decoder."""
    try:
        spec = json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        return "other"
    kinds = [spec.get("type")] + [d.get("type") for d in spec.get("decoders", []) or []]
    if "ByteLevel" in kinds:
        return "bytelevel"
    if "ByteFallback" in kinds or "Metaspace" in kinds or any(
            d.get("type") == "Replace" for d in spec.get("decoders", []) or []):
        return "sentencepiece"
    return "other"


def vocabulary_pieces(hf) -> list[bytes]:
    """Bytes of every token id of a transformers tokenizer, index = id."""
    n = len(hf)
    spellings = hf.convert_ids_to_tokens(list(range(n)))
    special = set(getattr(hf, "all_special_ids", []) or [])
    special.update(getattr(hf, "added_tokens_decoder", {}).keys())
    kind = _decoder_kind(hf)
    table = _byte_decoder()
    out: list[bytes] = []
    for i, s in enumerate(spellings):
        if s is None:
            out.append(b"")
        elif i in special:
            out.append(s.encode("utf-8"))
        elif kind == "bytelevel":
            try:
                out.append(bytes(table[c] for c in s))
            except KeyError:  # a spelling outside the stand-in alphabet: take it literally
                out.append(s.encode("utf-8"))
        elif kind == "sentencepiece":
            m = _BYTE_TOKEN.fullmatch(s)
            out.append(bytes([int(m.group(1), 16)]) if m else s.replace("\u2581", " ").encode("utf-8"))
        else:
            out.append(hf.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                       .encode("utf-8", "surrogatepass"))
    return out


def valid_utf8_prefix(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters, as text (upstream cuts a
    piece's trailing partial character before reporting it as `token`)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", "replace")
