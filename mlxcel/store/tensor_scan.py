"""NaN / Inf in a checkpoint's tensors, found one tensor (and one chunk) at a time.

Reads each *.safetensors file's header, then each floating tensor's bytes in chunks of at most
`CHUNK` bytes straight from the file, so a checkpoint of any size is scanned in bounded memory
and without a framework (bf16 is widened to fp32 by a shift). Packed integer tensors
(quantized weights) cannot hold NaN/Inf and are skipped; their float scales are scanned.
`mlxcel inspect --check-tensors` and `mlxcel-server --check-tensors` report what this finds.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHUNK = 16 << 20
_FLOATS = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    end: int


@dataclass(frozen=True)
class BadValues:
    name: str
    nan: int
    inf: int

    def __str__(self) -> str:
        parts = [f"{n} {what}" for n, what in ((self.nan, "NaN"), (self.inf, "Inf")) if n]
        return f"{self.name}: {' and '.join(parts)}"


def entries(path: Path) -> Iterator[TensorEntry]:
    """Every tensor of every *.safetensors file under `path`, in file then header order."""
    for f in sorted(Path(path).glob("*.safetensors")):
        with f.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError(f"{f.name}: not a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > f.stat().st_size - 8:
                raise ValueError(f"{f.name}: header length past the end of the file")
            header = json.loads(fh.read(n))
        base = 8 + n
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            yield TensorEntry(f, name, meta["dtype"], tuple(meta["shape"]), base + start, base + end)


def _as_float(raw: bytes, dtype: str) -> np.ndarray:
    arr = np.frombuffer(raw, dtype=_FLOATS[dtype])
    if dtype == "BF16":  # bf16 is fp32's top half
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def scan(entry: TensorEntry) -> BadValues | None:
    """The NaN and Inf count of one tensor (None when it has none, or is not floating)."""
    if entry.dtype not in _FLOATS:
        return None
    item = np.dtype(_FLOATS[entry.dtype]).itemsize
    step = max(CHUNK // item, 1) * item
    nan = inf = 0
    with entry.file.open("rb") as fh:
        fh.seek(entry.start)
        left = entry.end - entry.start
        while left > 0:
            raw = fh.read(min(step, left))
            if not raw:
                raise ValueError(f"{entry.file.name}: {entry.name} runs past the end of the file")
            left -= len(raw)
            values = _as_float(raw, entry.dtype)
            bad = ~np.isfinite(values)
            if bad.any():
                n = int(np.isnan(values).sum())
                nan, inf = nan + n, inf + int(bad.sum()) - n
    return BadValues(entry.name, nan, inf) if nan or inf else None


def scan_all(path: Path) -> tuple[int, list[BadValues]]:
    """(tensors scanned, those holding NaN or Inf)."""
    count, bad = 0, []
    for entry in entries(path):
        count += 1
        found = scan(entry)
        if found is not None:
            bad.append(found)
    return count, bad
