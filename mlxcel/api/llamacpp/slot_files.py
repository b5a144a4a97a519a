"""Slot save files under --slot-save-path: names, confinement, format and model identity.

A name must pass b10621's filename rules (`valid_filename`, after its fs_validate_filename)
and, joined to the save directory, must resolve inside it: a symlink whose target leaves the
directory is refused like a bad name. Writes go to a temporary file in the same directory and
are renamed into place, so a reader never sees half a file.

The format is mlxcel's own (upstream writes its KV state, which no other engine can read):

    MAGIC, a 4-byte little-endian header length, a JSON header
    {"format": 1, "fingerprint": ..., "model": ..., "n_tokens": N}, then N uint32 LE token ids.

`fingerprint` hashes the checkpoint's config and tokenizer files, so a stream saved by one
model is refused by another whose token ids would mean different text.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

MAGIC = b"MLXCEL-SLOT\n"
FORMAT = 1
_ILLEGAL = set(':*?"<>|/\\')
_LOOKALIKES = {0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF}  # fullwidth stop, slash / backslash lookalikes, U+FFFD, BOM
IDENTITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                  "merges.txt", "special_tokens_map.json")


class SlotFileError(ValueError):
    pass


def valid_filename(name: str) -> bool:
    """b10621's rules: 1..255 UTF-8 bytes; no control characters, surrogates, path separators,
    Windows-illegal characters or their lookalikes; no leading or trailing space, no trailing
    '.', no '..' anywhere, not '.'."""
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    if not 0 < len(raw) <= 255:
        return False
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or 0xD800 <= c <= 0xDFFF or c in _LOOKALIKES or ch in _ILLEGAL:
            return False
    if name[0] == " " or name[-1] in (" ", ".") or ".." in name or name == ".":
        return False
    return True


def confined_path(root: Path, name: str) -> Path:
    """The save file for `name`, refused unless the name is valid and resolves inside `root`."""
    if not valid_filename(name):
        raise SlotFileError("Invalid filename")
    base = root.resolve()
    path = (base / name).resolve()
    if path.parent != base:
        raise SlotFileError("Invalid filename")
    return path


def fingerprint(checkpoint: Path) -> str:
    h = hashlib.sha256()
    for name in IDENTITY_FILES:
        p = Path(checkpoint) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def write_slot(path: Path, tokens: list[int], *, fingerprint: str, model: str) -> int:
    """Write atomically; returns the bytes written."""
    header = json.dumps({"format": FORMAT, "fingerprint": fingerprint, "model": model,
                         "n_tokens": len(tokens)}).encode()
    data = MAGIC + struct.pack("<I", len(header)) + header + np.asarray(tokens, dtype="<u4").tobytes()
    fd, tmp = tempfile.mkstemp(prefix=".slot-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(data)


def read_slot(path: Path, *, fingerprint: str, n_vocab: int) -> tuple[list[int], int]:
    """The saved tokens and the bytes read; SlotFileError says why a file cannot be restored."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SlotFileError(f"cannot read the file ({e.strerror or e})") from None
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise SlotFileError("not an mlxcel slot file")
    (n_header,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start:start + n_header])
    except ValueError:
        raise SlotFileError("corrupt header") from None
    body = data[start + n_header:]
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SlotFileError("unknown slot file format")
    if header.get("fingerprint") != fingerprint:
        raise SlotFileError(f"saved by another model or tokenizer ({header.get('model')!r})")
    if len(body) != 4 * header.get("n_tokens", -1):
        raise SlotFileError("truncated token stream")
    tokens = np.frombuffer(body, dtype="<u4")
    if tokens.size and int(tokens.max()) >= n_vocab:
        raise SlotFileError("token id outside the model's vocabulary")
    return [int(t) for t in tokens], len(data)
