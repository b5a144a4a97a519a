"""GBNF read with b10621's rules, then enforced by llguidance on SmolLM2's vocabulary.

Each easy-to-miss rule of upstream's parser gets a test: the accepting ones run strings
through a real matcher (acceptance of a whole string), the refusing ones check the error.
"""

from __future__ import annotations

import pytest

from mlxcel.chat.gbnf import MAX_SOURCE_BYTES, GbnfError, gbnf_to_lark
from tests.conftest import DEFAULT_MODEL, fixture_path


@pytest.fixture(scope="module")
def compiler():
    from mlxcel.engine.grammar import for_tokenizer
    from mlxcel.engine.tokenizer import Tokenizer

    tok = Tokenizer(fixture_path(DEFAULT_MODEL))
    return for_tokenizer(tok, tok.vocab_size)


def accepts(compiler, gbnf: str, text: str) -> bool:
    m = compiler.compile("gbnf", gbnf).matcher()
    hf = compiler._hf
    ids = hf.encode(text, add_special_tokens=False) if text else []
    return all(m.accept(t) for t in ids) and m.is_accepting()


def refused(gbnf: str) -> str:
    with pytest.raises(GbnfError) as e:
        gbnf_to_lark(gbnf, n_vocab=49152)
    return str(e.value)


def test_underscore_is_not_a_name_character_but_dash_and_leading_digit_are(compiler):
    assert "expecting newline or end at _b" in refused('root ::= a_b\na_b ::= "x"')
    assert "expecting ::=" in refused('root ::= "x"\nmy_rule ::= "y"')
    assert accepts(compiler, 'root ::= 1st-rule\n1st-rule ::= "q"', "q")


def test_comment_runs_to_end_of_line_and_counts_as_space(compiler):
    g = 'root ::= "a"# no space before this comment\n  # a whole-line comment\n'
    assert accepts(compiler, g, "a")
    assert accepts(compiler, 'root ::= ("a" # inside a group\n "b")', "ab")


def test_empty_alternative_is_legal_and_load_bearing(compiler):
    g = 'root ::= "x" opt "y"\nopt ::= "-" | '
    assert accepts(compiler, g, "xy") and accepts(compiler, g, "x-y")
    assert not accepts(compiler, g, "x--y")


def test_zero_repetition_erases_the_item(compiler):
    assert accepts(compiler, 'root ::= "a"{0} "b"', "b")
    assert not accepts(compiler, 'root ::= "a"{0} "b"', "ab")
    assert "expecting preceding item" in refused('root ::= "a"{0}*')


def test_oversized_maximum_widens_to_unbounded_oversized_minimum_is_an_error(compiler):
    assert accepts(compiler, 'root ::= "a"{0,5000}', "a" * 40)
    assert "exceeds sane defaults" in refused('root ::= "a"{2001}')
    assert "exceeds sane defaults" in refused('root ::= "a"{2001,}')


def test_repetition_budget_multiplies_across_nesting():
    gbnf_to_lark('root ::= ("a"{1,40}){1,40}')  # 40 rules inside, times 40: within 2000
    assert "multiplied by the new repetition" in refused('root ::= ("a"{1,50}){1,50}')
    assert "multiplied by the new repetition" in refused('root ::= "a"{1,50}{1,50}')


def test_repetition_operators_chain(compiler):
    assert accepts(compiler, 'root ::= "a"+? "b"', "b")
    assert accepts(compiler, 'root ::= "a"+? "b"', "aaab")
    assert accepts(compiler, 'root ::= "ab"{2}{2}', "abababab")
    assert not accepts(compiler, 'root ::= "ab"{2}{2}', "ababab")


def test_dot_matches_any_code_point_including_newline(compiler):
    g = 'root ::= "<" . ">"'
    for text in ("<\n>", "<é>", "<x>"):
        assert accepts(compiler, g, text)
    assert not accepts(compiler, g, "<>")


def test_left_recursion_is_refused_in_every_rule_reachable_or_not():
    assert "left recursion" in refused('root ::= expr\nexpr ::= expr "+" "1" | "1"')
    assert "left recursion" in refused('root ::= "a"\nunused ::= unused "b"')
    # past a rule with an empty alternative (a non-empty one stops the walk)
    gbnf_to_lark('root ::= e "x" root | "y"\ne ::= "z" | ')
    assert "left recursion" in refused('root ::= e root "x" | "y"\ne ::= "z" | ')


def test_definitions_root_and_source_cap():
    assert "Undefined rule identifier 'thing'" in refused("root ::= thing")
    assert "'root' symbol" in refused('start ::= "a"')
    assert "expecting name" in refused('root ::= "a"\n  | "b"')
    assert "unknown escape" in refused(r'root ::= "\q"')
    big = 'root ::= "a"\n' + "# pad\n" * (MAX_SOURCE_BYTES // 6 + 1)
    assert "256 KiB" in refused(big)


def test_classes_escapes_and_negation(compiler):
    g = r'root ::= [a-c\x41\u00e9-] [^\n]'
    assert accepts(compiler, g, "b!") and accepts(compiler, g, "A!") and accepts(compiler, g, "é.")
    assert accepts(compiler, g, "-x")
    assert not accepts(compiler, g, "d!") and not accepts(compiler, g, "a\n")


def test_token_terminals_are_token_level(compiler):
    end = compiler._hf.convert_tokens_to_ids("<|im_end|>")
    m = compiler.compile("gbnf", f'root ::= "a" <[{end}]>').matcher()
    a = compiler._hf.encode("a", add_special_tokens=False)[0]
    assert m.accept(a)
    mask = m.allowed_mask(49152)
    assert mask[end] and mask.sum() == 1
    # the text form names the same token; its negation allows every other token
    m2 = compiler.compile("gbnf", 'root ::= !<|im_end|> "x"').matcher()
    mask2 = m2.allowed_mask(49152)
    assert not mask2[end] and mask2[a]
    assert "invalid token" in refused("root ::= <[4294967296]>")
    with pytest.raises(Exception, match="exactly one token"):
        compiler.compile("gbnf", "root ::= <not a single token>")
