"""GBNF as b10621 reads it, lowered to the Lark dialect the constraint library compiles.

The reader follows llama.cpp's grammar parser rule for rule, because a syntax summary gets
the edges wrong: names are ASCII letters, digits and `-` (no `_`, a leading digit is fine);
`#` runs to the end of the line and counts as space; a rule ends at a newline unless inside
parentheses; an empty alternative is legal; `""` and `[]` add nothing; `x{0}` erases x; a
`{m,n}` maximum above 2000 becomes unbounded while a minimum above 2000 is an error; the
repetition budget multiplies through nesting (a group counts the rules it created);
operators chain (`x+?`); `.` is any code point, newline included; `<[id]>`, `<text>` and
their `!` negations are token terminals; every referenced rule must be defined, `root` must
exist, and left recursion is refused over every rule, reachable or not.

Repetitions are expanded exactly as upstream expands them (copies plus generated optional
rules), so the lowered grammar accepts the same language with the same budget. The output
is one Lark rule per GBNF rule, with single-code-point regex terminals.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from mlxcel.config.limits import MAX_GRAMMAR_DEPTH, echo

MAX_REPETITIONS = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
MAX_SOURCE_BYTES = 256 * 1024  # mlxcel's own cap on GBNF source (upstream has none)
MAX_LOWERED_BYTES = 4 * 1024 * 1024  # the lowered grammar handed to the constraint library


class GbnfError(ValueError):
    """The grammar is not one b10621 would accept (or exceeds mlxcel's caps)."""


# Items of one alternative. A literal "ab" is two Chars items, a class [a-z_] one.
@dataclass(frozen=True)
class Chars:
    ranges: tuple[tuple[int, int], ...]
    negated: bool = False


@dataclass(frozen=True)
class AnyChar:
    pass


@dataclass(frozen=True)
class Ref:
    rule: int


@dataclass(frozen=True)
class Token:
    id: int
    negated: bool = False


Item = Chars | AnyChar | Ref | Token
Alternative = list[Item]


def _is_digit(c: str) -> bool:
    return "0" <= c <= "9"


def _is_word(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z") or c == "-" or _is_digit(c)


class _Reader:
    """One pass over the source, building rules as llama.cpp's parser does."""

    def __init__(self, src: str, token_id: Callable[[str], int | None] | None, n_vocab: int | None) -> None:
        self.src = src
        self.token_id = token_id
        self.n_vocab = n_vocab
        self.symbols: dict[str, int] = {}
        self.rules: dict[int, list[Alternative]] = {}
        self.depth = 0  # open parentheses: the reader recurses once per level

    # -- lexical helpers --------------------------------------------------------
    def at(self, pos: int) -> str:
        return self.src[pos] if pos < len(self.src) else ""

    def show(self, pos: int) -> str:
        return self.src[pos:pos + 40]

    def space(self, pos: int, newline_ok: bool) -> int:
        while True:
            c = self.at(pos)
            if c == "#":
                while self.at(pos) not in ("", "\r", "\n"):
                    pos += 1
            elif c in (" ", "\t") or (newline_ok and c in ("\r", "\n")):
                pos += 1
            else:
                return pos

    def name(self, pos: int) -> int:
        end = pos
        while _is_word(self.at(end)):
            end += 1
        if end == pos:
            raise GbnfError(f"expecting name at {self.show(pos)}")
        return end

    def integer(self, pos: int) -> int:
        end = pos
        while _is_digit(self.at(end)):
            end += 1
        if end == pos:
            raise GbnfError(f"expecting integer at {self.show(pos)}")
        return end

    def hex(self, pos: int, size: int) -> tuple[int, int]:
        digits = self.src[pos:pos + size]
        if len(digits) != size or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise GbnfError(f"expecting {size} hex chars at {self.show(pos)}")
        return int(digits, 16), pos + size

    def char(self, pos: int) -> tuple[int, int]:
        c = self.at(pos)
        if c == "\\":
            e = self.at(pos + 1)
            if e in ("x", "u", "U"):
                return self.hex(pos + 2, {"x": 2, "u": 4, "U": 8}[e])
            simple = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
            if e in simple:
                return simple[e], pos + 2
            raise GbnfError(f"unknown escape at {self.show(pos)}")
        if c == "":
            raise GbnfError("unexpected end of input")
        return ord(c), pos + 1

    def token(self, pos: int) -> tuple[int, int]:
        if self.at(pos) != "<":
            raise GbnfError(f"expecting '<' at {self.show(pos)}")
        start, pos = pos, pos + 1
        if self.at(pos) == "[":
            end = self.integer(pos + 1)
            value = int(self.src[pos + 1:end])
            if value > 0xFFFFFFFF or (self.n_vocab is not None and value >= self.n_vocab):
                raise GbnfError(f"invalid token id at {self.show(start)}")
            if self.at(end) != "]":
                raise GbnfError(f"expecting ']' at {self.show(end)}")
            if self.at(end + 1) != ">":
                raise GbnfError(f"expecting '>' at {self.show(end + 1)}")
            return value, end + 2
        while self.at(pos) not in ("", ">"):
            pos += 1
        if self.at(pos) != ">":
            raise GbnfError(f"expecting '>' at {self.show(pos)}")
        text = self.src[start:pos + 1]
        tid = self.token_id(text) if self.token_id is not None else None
        if tid is None:
            raise GbnfError(f"invalid token '{echo(text)}': it must be exactly one token of the model's vocabulary")
        return tid, pos + 1

    # -- symbols -------------------------------------------------------------------
    def symbol(self, name: str) -> int:
        return self.symbols.setdefault(name, len(self.symbols))

    def fresh(self, base: str) -> int:
        sid = len(self.symbols)
        self.symbols[f"{base}_{sid}"] = sid
        return sid

    # -- grammar -------------------------------------------------------------------
    def parse(self) -> None:
        pos = self.space(0, True)
        while self.at(pos):
            pos = self.rule(pos)
        names = {v: k for k, v in self.symbols.items()}
        for sid in sorted(names):
            if sid not in self.rules:
                raise GbnfError(f"Undefined rule identifier '{echo(names[sid])}'")
        if not self.rules:
            raise GbnfError("the grammar has no rules")
        if "root" not in self.symbols:
            raise GbnfError("grammar does not contain a 'root' symbol")

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        name = self.src[pos:end]
        pos = self.space(end, False)
        sid = self.symbol(name)
        if self.src[pos:pos + 3] != "::=":
            raise GbnfError(f"expecting ::= at {self.show(pos)}")
        pos = self.alternates(self.space(pos + 3, True), name, sid, nested=False)
        if self.at(pos) == "\r":
            pos += 2 if self.at(pos + 1) == "\n" else 1
        elif self.at(pos) == "\n":
            pos += 1
        elif self.at(pos):
            raise GbnfError(f"expecting newline or end at {self.show(pos)}")
        return self.space(pos, True)

    def alternates(self, pos: int, name: str, sid: int, nested: bool) -> int:
        alts: list[Alternative] = []
        seq: Alternative = []
        pos = self.sequence(pos, name, seq, nested)
        alts.append(seq)
        while self.at(pos) == "|":
            seq = []
            pos = self.sequence(self.space(pos + 1, True), name, seq, nested)
            alts.append(seq)
        self.rules[sid] = alts
        return pos

    def sequence(self, pos: int, name: str, seq: Alternative, nested: bool) -> int:
        last = len(seq)  # where the item a repetition operator applies to starts
        n_prev = 1  # how many rules that item stands for (the budget multiplies through it)
        while self.at(pos):
            c = self.at(pos)
            if c in "*+?{":
                pos = self.space(pos + 1, nested)
                if c == "{":
                    lo, hi, pos = self.braces(pos, nested)
                else:
                    lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                n_prev = self.repeat(seq, last, n_prev, lo, hi, name, pos)
                continue
            before, last, n_prev = len(self.symbols), len(seq), 1
            if c == '"':
                pos = self.literal(pos + 1, seq, nested)
            elif c == "[":
                pos = self.char_class(pos + 1, seq, nested)
            elif c in ("<", "!"):
                tid, pos = self.token(pos + (c == "!"))
                pos = self.space(pos, nested)
                seq.append(Token(tid, c == "!"))
            elif _is_word(c):
                end = self.name(pos)
                seq.append(Ref(self.symbol(self.src[pos:end])))
                pos = self.space(end, nested)
            elif c == "(":
                if self.depth >= MAX_GRAMMAR_DEPTH:
                    raise GbnfError(f"groups nest deeper than mlxcel's limit of {MAX_GRAMMAR_DEPTH} "
                                    f"at {self.show(pos)}")
                sub = self.fresh(name)
                self.depth += 1
                pos = self.alternates(self.space(pos + 1, True), name, sub, nested=True)
                self.depth -= 1
                n_prev = max(len(self.symbols) - before, 1)
                seq.append(Ref(sub))
                if self.at(pos) != ")":
                    raise GbnfError(f"expecting ')' at {self.show(pos)}")
                pos = self.space(pos + 1, nested)
            elif c == ".":
                seq.append(AnyChar())
                pos = self.space(pos + 1, nested)
            else:
                break
        return pos

    def literal(self, pos: int, seq: Alternative, nested: bool) -> int:
        """A quoted string (after its opening quote): one element per code point."""
        while self.at(pos) != '"':
            if not self.at(pos):
                raise GbnfError("unexpected end of input")
            cp, pos = self.char(pos)
            seq.append(Chars(((cp, cp),)))
        return self.space(pos + 1, nested)

    def char_class(self, pos: int, seq: Alternative, nested: bool) -> int:
        """A [...] class (after its opening bracket)."""
        negated = self.at(pos) == "^"
        pos += negated
        ranges: list[tuple[int, int]] = []
        while self.at(pos) != "]":
            if not self.at(pos):
                raise GbnfError("unexpected end of input")
            lo, pos = self.char(pos)
            hi = lo
            if self.at(pos) == "-" and self.at(pos + 1) != "]":
                if not self.at(pos + 1):
                    raise GbnfError("unexpected end of input")
                hi, pos = self.char(pos + 1)
            ranges.append((lo, hi))
        if ranges:  # "[]" and "[^]" add no element, as upstream
            seq.append(Chars(tuple(ranges), negated))
        return self.space(pos + 1, nested)

    def braces(self, pos: int, nested: bool) -> tuple[int, int | None, int]:
        """A {m}, {m,} or {m,n} repetition (after its opening brace): (min, max or None, pos)."""
        if not _is_digit(self.at(pos)):
            raise GbnfError(f"expecting an int at {self.show(pos)}")
        end = self.integer(pos)
        lo = int(self.src[pos:end])
        pos = self.space(end, nested)
        hi: int | None
        if self.at(pos) == "}":
            hi = lo
        elif self.at(pos) == ",":
            pos = self.space(pos + 1, nested)
            hi = None
            if _is_digit(self.at(pos)):
                end = self.integer(pos)
                hi = int(self.src[pos:end])
                pos = self.space(end, nested)
            if self.at(pos) != "}":
                raise GbnfError(f"expecting '}}' at {self.show(pos)}")
        else:
            raise GbnfError(f"expecting ',' at {self.show(pos)}")
        pos = self.space(pos + 1, nested)
        if lo > MAX_REPETITIONS:
            raise GbnfError("number of repetitions exceeds sane defaults, please reduce the number of repetitions")
        if hi is not None and hi > MAX_REPETITIONS:
            hi = None  # b10621 widens an oversized maximum to unbounded
        if hi is not None and hi < lo:
            raise GbnfError(f"repetition maximum {hi} is below its minimum {lo}")
        return lo, hi, pos

    def repeat(self, seq: Alternative, last: int, n_prev: int, lo: int, hi: int | None, name: str, pos: int) -> int:
        """Apply a repetition to the item seq[last:] (standing for `n_prev` rules): `lo` copies
        inline, then optional ones as fresh rules. Returns the item's new rule count."""
        if last == len(seq):
            raise GbnfError(f"expecting preceding item to */+/?/{{ at {self.show(pos)}")
        total = hi if hi is not None and hi > 0 else (lo if lo > 0 else 1)
        if n_prev * total > MAX_REPETITIONS:
            raise GbnfError("number of rules that are going to be repeated multiplied by the new "
                            "repetition exceeds sane defaults, please reduce the number of "
                            "repetitions or rule complexity")
        item = seq[last:]
        if lo == 0:
            del seq[last:]
        else:
            for _ in range(lo - 1):
                seq.extend(item)
        n_opt = 1 if hi is None else max(hi - lo, 0)
        prev_id = None
        for i in range(n_opt):
            rid = self.fresh(name)
            tail: list[Item] = []
            if hi is None:
                tail = [Ref(rid)]
            elif i > 0:
                tail = [Ref(prev_id)]
            self.rules[rid] = [list(item) + tail, []]
            prev_id = rid
        if n_opt > 0:
            seq.append(Ref(prev_id))
        return n_prev * total


def _check_left_recursion(rules: dict[int, list[Alternative]], names: dict[int, str]) -> None:
    """Upstream's check over every rule: recurse into each leftmost reference, and past it
    while the referenced rule has a directly empty alternative."""
    empty = {sid: any(not alt for alt in alts) for sid, alts in rules.items()}
    in_progress: set[int] = set()
    done: set[int] = set()

    def visit(sid: int) -> bool:
        if sid in in_progress:
            return True
        if sid in done:
            return False
        in_progress.add(sid)
        for alt in rules[sid]:
            for item in alt:
                if not isinstance(item, Ref):
                    break
                if visit(item.rule):
                    return True
                if not empty[item.rule]:
                    break
        in_progress.discard(sid)
        done.add(sid)
        return False

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 4 * len(rules) + 1000))
    try:
        for sid in sorted(rules):
            if visit(sid):
                raise GbnfError(f"unsupported grammar, left recursion detected for nonterminal "
                                f"'{echo(names.get(sid, sid))}'")
    finally:
        sys.setrecursionlimit(old)


def _regex_class(ranges: tuple[tuple[int, int], ...], negated: bool) -> str:
    body = "".join(f"\\x{{{lo:x}}}" if lo == hi else f"\\x{{{lo:x}}}-\\x{{{hi:x}}}" for lo, hi in ranges)
    return f"/[{'^' if negated else ''}{body}]/"


def _lark_item(item: Item) -> str:
    if isinstance(item, Chars):
        return _regex_class(item.ranges, item.negated)
    if isinstance(item, AnyChar):
        return "/(?s:.)/"
    if isinstance(item, Ref):
        return f"r{item.rule}"
    return f"<[{'^' if item.negated else ''}{item.id}]>"


def parse_gbnf(src: str, token_id: Callable[[str], int | None] | None = None,
               n_vocab: int | None = None) -> tuple[dict[int, list[Alternative]], int]:
    """Read `src` with b10621's rules; returns (rule id -> alternatives, the root's id).
    `token_id` resolves a `<text>` terminal to its one token id (None: not one token)."""
    if len(src.encode("utf-8")) > MAX_SOURCE_BYTES:
        raise GbnfError(f"the grammar is larger than mlxcel's limit of {MAX_SOURCE_BYTES // 1024} KiB")
    reader = _Reader(src, token_id, n_vocab)
    reader.parse()
    names = {v: k for k, v in reader.symbols.items()}
    _check_left_recursion(reader.rules, names)
    return reader.rules, reader.symbols["root"]


def gbnf_to_lark(src: str, token_id: Callable[[str], int | None] | None = None,
                 n_vocab: int | None = None) -> str:
    """Validate `src` as b10621 would and lower it to Lark (one rule per GBNF rule)."""
    rules, root = parse_gbnf(src, token_id, n_vocab)
    lines = []
    for sid, alts in sorted(rules.items()):
        body = " | ".join(" ".join(_lark_item(i) for i in alt) for alt in alts)
        lines.append(f"r{sid}: {body}")
    lark = f"start: r{root}\n" + "\n".join(lines) + "\n"
    if len(lark) > MAX_LOWERED_BYTES:
        raise GbnfError(f"the grammar expands past mlxcel's limit of {MAX_LOWERED_BYTES >> 20} MiB")
    return lark
