"""The GBNF reader recurses once per nested group, so nesting is bounded: past the limit the
grammar is refused with the parser's own error (a 400 on every route), never a RecursionError."""

from __future__ import annotations

import pytest

from mlxcel.chat.gbnf import GbnfError, gbnf_to_lark
from mlxcel.config.limits import MAX_GRAMMAR_DEPTH


def nested(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def test_groups_up_to_the_limit_are_read():
    assert gbnf_to_lark(nested(MAX_GRAMMAR_DEPTH)).startswith("start:")


@pytest.mark.parametrize("depth", [MAX_GRAMMAR_DEPTH + 1, 5_000, 100_000])
def test_deeper_groups_are_a_grammar_error(depth):
    with pytest.raises(GbnfError, match=f"limit of {MAX_GRAMMAR_DEPTH}"):
        gbnf_to_lark(nested(depth))


def test_sibling_groups_do_not_add_up():
    src = "root ::= " + " ".join(["((" + '"a"' + "))"] * (4 * MAX_GRAMMAR_DEPTH))
    assert gbnf_to_lark(src).startswith("start:")
