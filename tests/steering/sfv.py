"""A strict RFC 8941 parser for one Item (bare item plus parameters), for the header tests.

Follows the RFC's parsing algorithm (section 4.2) for Items: integers (at most 15 digits),
decimals (at most 12 integer and 3 fractional digits), strings, tokens and booleans, each
with `;key=value` parameters. Anything else raises ValueError.
"""

from __future__ import annotations

import string

_KEY_START = string.ascii_lowercase + "*"
_KEY = string.ascii_lowercase + string.digits + "_-.*"
_TCHAR = "!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits + ":/"


class _P:
    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def take(self) -> str:
        c = self.peek()
        self.i += 1
        return c


def _bare(p: _P):
    c = p.peek()
    if c == "-" or c.isdigit():
        return _number(p)
    if c == '"':
        return _string(p)
    if c == "?":
        p.take()
        v = p.take()
        if v not in ("0", "1"):
            raise ValueError("a boolean is ?0 or ?1")
        return v == "1"
    if c and (c.isalpha() or c == "*"):
        start = p.i
        while p.peek() and p.peek() in _TCHAR:
            p.take()
        return ("token", p.s[start:p.i])
    raise ValueError(f"no bare item at {p.i}")


def _number(p: _P):
    sign = -1 if p.peek() == "-" else 1
    if sign < 0:
        p.take()
    digits, dot = "", None
    while p.peek() and (p.peek().isdigit() or (p.peek() == "." and dot is None)):
        if p.peek() == ".":
            if len(digits) > 12:
                raise ValueError("a decimal has at most 12 integer digits")
            dot = len(digits)
        digits += p.take()
    if not digits or not digits[0].isdigit():
        raise ValueError("a number needs a digit")
    if dot is None:
        if len(digits) > 15:
            raise ValueError("an integer has at most 15 digits")
        return sign * int(digits)
    frac = len(digits) - dot - 1
    if not 1 <= frac <= 3:
        raise ValueError("a decimal has 1-3 fractional digits")
    return sign * float(digits)


def _string(p: _P) -> str:
    p.take()
    out = []
    while True:
        c = p.take()
        if c == "":
            raise ValueError("unterminated string")
        if c == "\\":
            nxt = p.take()
            if nxt not in ('"', "\\"):
                raise ValueError("only \\\" and \\\\ escapes exist")
            out.append(nxt)
        elif c == '"':
            return "".join(out)
        elif not 0x20 <= ord(c) <= 0x7E:
            raise ValueError("strings are printable ASCII")
        else:
            out.append(c)


def parse_item(text: str) -> tuple[object, dict[str, object]]:
    p = _P(text.strip(" "))
    value = _bare(p)
    params: dict[str, object] = {}
    while p.peek() == ";":
        p.take()
        while p.peek() == " ":
            p.take()
        if not p.peek() or p.peek() not in _KEY_START:
            raise ValueError("a parameter key starts with a lowercase letter or *")
        start = p.i
        while p.peek() and p.peek() in _KEY:
            p.take()
        key = p.s[start:p.i]
        params[key] = True
        if p.peek() == "=":
            p.take()
            params[key] = _bare(p)
    if p.i != len(p.s):
        raise ValueError(f"trailing characters at {p.i}: {p.s[p.i:]!r}")
    return value, params
