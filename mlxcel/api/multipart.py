"""A bounded, streaming multipart/form-data reader for the audio upload routes.

The body is consumed chunk by chunk as it arrives; nothing is held beyond the limits: at most
`max_body_bytes` in all, at most `max_parts` parts, at most `max_part_bytes` per part, at most `max_header_bytes` of part
headers, and only the last `file` part is kept (an earlier one is dropped the moment another
begins). Breaking a limit raises `UploadError` at once, so a 30 MiB part is refused after
25 MiB were read, not after it all arrived.

Duplicate rules are the transcription route's (b10621's): a text field sent twice falls back
to its default (`Form.text` answers None for it, and `Form.duplicates` names it), a repeated
`file` keeps the last one.
"""

from __future__ import annotations

from mlxcel.config.limits import echo
from dataclasses import dataclass, field

MAX_PARTS = 32
MAX_PART_BYTES = 25 << 20
MAX_TEXT_BYTES = 1 << 20  # a text field (prompt, language, ...) larger than this is refused
MAX_HEADER_BYTES = 16 << 10
MAX_PREAMBLE_BYTES = 64 << 10
MAX_BODY_BYTES = MAX_PART_BYTES + (1 << 20)  # one file at its limit plus the text fields and headers


class UploadError(ValueError):
    """The upload is refused; `status` is the HTTP status, the message names the problem."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class FilePart:
    filename: str
    content_type: str
    data: bytes | bytearray


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    duplicates: set[str] = field(default_factory=set)
    file: FilePart | None = None
    parts: int = 0

    def text(self, name: str) -> str | None:
        """The field's value; None when absent or sent more than once (the default applies)."""
        return None if name in self.duplicates else self.fields.get(name)


def boundary_of(content_type: str | None) -> bytes:
    if not content_type:
        raise UploadError("the request must be multipart/form-data (no Content-Type header)")
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise UploadError(f"the request must be multipart/form-data, not {echo(kind.strip())!r}")
    for key, value in _params(params).items():
        if key == "boundary" and 0 < len(value) <= 70:
            return value.encode("latin-1")
    raise UploadError("multipart/form-data without a valid boundary parameter")


def _params(text: str) -> dict[str, str]:
    """`; a=b; c="d"` -> {a: b, c: d} (quoted values may contain ';' and escaped quotes)."""
    out, i, n = {}, 0, len(text)
    while i < n:
        while i < n and text[i] in " ;\t":
            i += 1
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip().lower()
        i = eq + 1
        if i < n and text[i] == '"':
            i += 1
            buf = []
            while i < n and text[i] != '"':
                if text[i] == "\\" and i + 1 < n:
                    i += 1
                buf.append(text[i])
                i += 1
            value, i = "".join(buf), i + 1
        else:
            end = text.find(";", i)
            end = n if end < 0 else end
            value, i = text[i:end].strip(), end
        out[key] = value
    return out


class MultipartReader:
    """Feed the body with `feed(chunk)`, then `finish()` for the parsed Form."""

    def __init__(self, boundary: bytes, *, max_parts: int = MAX_PARTS, max_part_bytes: int = MAX_PART_BYTES,
                 max_text_bytes: int = MAX_TEXT_BYTES, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.delim = b"\r\n--" + boundary
        self.max_parts, self.max_part_bytes, self.max_text_bytes = max_parts, max_part_bytes, max_text_bytes
        self.max_body_bytes, self.seen = max_body_bytes, 0
        self.form = Form()
        self.buf = bytearray(b"\r\n")  # lets the first delimiter match like every later one
        self.state = "preamble"  # preamble -> delimiter -> headers -> body -> delimiter ... -> done
        self.name: str | None = None
        self.filename: str | None = None
        self.ctype = ""
        self.data = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.seen += len(chunk)
        if self.seen > self.max_body_bytes:
            raise UploadError(f"the request body is larger than {self.max_body_bytes >> 20} MiB", status=413)
        if self.state == "done":
            return  # an epilogue after the closing delimiter is ignored
        self.buf += chunk
        while self._step():
            pass

    def finish(self) -> Form:
        if self.state != "done":
            raise UploadError("the multipart body ended before its closing boundary")
        return self.form

    def _step(self) -> bool:
        """Advance as far as the buffer allows; True when another step may make progress."""
        if self.state == "preamble":
            at = self.buf.find(self.delim)
            if at < 0:
                if len(self.buf) > MAX_PREAMBLE_BYTES:
                    raise UploadError("no multipart boundary found at the start of the body")
                return False
            del self.buf[:at]
            self.state = "delimiter"
            return True
        if self.state == "delimiter":  # the buffer starts with a delimiter: `--` ends, CRLF opens a part
            rest = len(self.delim)
            if len(self.buf) < rest + 2:
                return False
            if self.buf[rest : rest + 2] == b"--":
                self.state, self.buf = "done", bytearray()
                return False
            line_end = self.buf.find(b"\r\n", rest)
            if line_end < 0:
                if len(self.buf) - rest > 256:
                    raise UploadError("malformed multipart delimiter line")
                return False
            if self.buf[rest:line_end].strip(b" \t"):  # only transport padding may follow the boundary
                raise UploadError("malformed multipart delimiter line")
            del self.buf[: line_end + 2]
            self.form.parts += 1
            if self.form.parts > self.max_parts:
                raise UploadError(f"the form has more than {self.max_parts} parts", status=413)
            self.state = "headers"
            return True
        if self.state == "headers":
            if self.buf[:2] == b"\r\n":
                raise UploadError(f"multipart part {self.form.parts} has no headers (no Content-Disposition)")
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER_BYTES:
                    raise UploadError(f"multipart part {self.form.parts} has more than {MAX_HEADER_BYTES} bytes "
                                      f"of headers")
                return False
            self._start_part(bytes(self.buf[:end]))
            del self.buf[: end + 4]
            self.state = "body"
            return True
        if self.state == "body":
            at = self.buf.find(self.delim)
            upto = at if at >= 0 else max(0, len(self.buf) - len(self.delim))  # a delimiter may straddle chunks
            self._append(self.buf[:upto])
            del self.buf[:upto]
            if at < 0:
                return False
            self._end_part()
            self.state = "delimiter"
            return True
        return False

    def _start_part(self, raw: bytes) -> None:
        headers = {}
        for line in raw.decode("latin-1").split("\r\n"):
            key, sep, value = line.partition(":")
            if not sep:
                raise UploadError(f"multipart part {self.form.parts} has a malformed header line")
            headers[key.strip().lower()] = value.strip()
        disposition = headers.get("content-disposition", "")
        kind, _, params = disposition.partition(";")
        p = _params(params)
        if kind.strip().lower() != "form-data" or "name" not in p:
            raise UploadError(f"multipart part {self.form.parts} has no form-data Content-Disposition with a name")
        self.name, self.filename, self.ctype = p["name"], p.get("filename"), headers.get("content-type", "")
        if self.name == "file":
            self.form.file = None  # a repeated file keeps the last one: drop the earlier bytes now
        self.data = bytearray()

    def _append(self, piece) -> None:
        if not piece:
            return
        limit = self.max_part_bytes if self.name == "file" else self.max_text_bytes
        if len(self.data) + len(piece) > limit:
            what = "file" if self.name == "file" else f"field {self.name!r}"
            raise UploadError(f"the multipart {what} is larger than {limit >> 20} MiB" if limit >= 1 << 20 else
                              f"the multipart {what} is larger than {limit} bytes", status=413, param=self.name)
        self.data += piece

    def _end_part(self) -> None:
        if self.name == "file":
            self.form.file = FilePart(self.filename or "", self.ctype, self.data)  # no copy of up to 25 MiB
        elif self.name in self.form.fields or self.name in self.form.duplicates:
            self.form.duplicates.add(self.name)
        else:
            try:
                self.form.fields[self.name] = self.data.decode("utf-8")
            except UnicodeDecodeError:
                raise UploadError(f"the multipart field {echo(self.name)!r} is not UTF-8 text",
                                  param=self.name) from None
        self.data = bytearray()
