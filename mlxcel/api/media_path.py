"""file:// media URLs under --media-path: name validation, resolution, containment, the read.

The rule, once: the request's path is taken relative to the root first (leading separators
stripped, so an absolute spelling lands under the root instead of replacing it); when that
does not name a file and the path is absolute, it is canonicalized and accepted only if it
lies inside the root. Before either, b10621's filename validation runs on the whole path
(no `..`, no control characters, none of * ? " < > |, no leading/trailing space, no trailing
dot, at most 255 bytes, no Unicode separator look-alikes), and a percent escape for `.`, `/`,
`\\` or NUL is refused (nothing is percent-decoded). The canonical result must stay inside the
canonical root (a symlink out is an escape, one within is followed; an escape is answered
exactly as a missing file is), the last component is
opened with O_NOFOLLOW, and only a regular file is read.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

NO_ROOT = "file:// URLs are not allowed unless --media-path is specified"
# One answer for a missing file and one outside the root (or behind a symlink out), so a
# client cannot probe which paths exist on the server.
UNAVAILABLE = ("file does not exist or cannot be opened under --media-path (file:// paths resolve against the "
               "--media-path directory)")
_FORBIDDEN = set('*?"<>|')
_LOOKALIKES = {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}
_PERCENT = re.compile(r"%(2e|2f|5c|00)", re.IGNORECASE)


class MediaPathRefused(ValueError):
    """A file:// reference that is not read (the message is the client's)."""


def validate_name(ref: str) -> None:
    if len(ref.encode("utf-8", "surrogatepass")) > 255:
        raise MediaPathRefused("invalid file path: longer than 255 bytes")
    if not ref or ref != ref.strip(" ") or ref.endswith("."):
        raise MediaPathRefused("invalid file path: empty, or a leading/trailing space or a trailing '.'")
    if ".." in ref:
        raise MediaPathRefused("invalid file path: '..' is not allowed")
    if any(ord(c) < 32 or ord(c) == 127 or c in _FORBIDDEN or c in _LOOKALIKES for c in ref):
        raise MediaPathRefused("invalid file path: control or reserved characters")
    if _PERCENT.search(ref):
        raise MediaPathRefused("invalid file path: a percent-encoded '.', '/', '\\' or NUL is not allowed")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def resolve(root: Path, ref: str) -> Path:
    """The canonical file `ref` names under `root` (which is canonical); refuses as described."""
    validate_name(ref)
    for candidate in (root / ref.lstrip("/\\"), Path(ref) if ref.startswith("/") else None):
        # os.path.exists, not Path.exists: it answers False for a path it may not stat (EACCES)
        if candidate is not None and os.path.exists(candidate):
            real = candidate.resolve()
            if not _inside(real, root):
                raise MediaPathRefused(UNAVAILABLE)
            return real
    raise MediaPathRefused(UNAVAILABLE)


def read(root: Path | None, url: str, max_bytes: int) -> bytes:
    """The bytes of a file:// URL under `root`, at most `max_bytes`."""
    if root is None:
        raise MediaPathRefused(NO_ROOT)
    path = resolve(root, url[len("file://"):])
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        raise MediaPathRefused(UNAVAILABLE) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaPathRefused("the file path does not name a regular file")
        if st.st_size > max_bytes:
            raise MediaPathRefused(f"the file is larger than the image payload limit of {max_bytes} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise MediaPathRefused(f"the file is larger than the image payload limit of {max_bytes} bytes")
    return data
