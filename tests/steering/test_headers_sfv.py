"""The steering headers are RFC 8941 Items: the strict parser accepts what mlxcel sends for
every rung and every λ the dial can resolve to, and refuses the forms a loose formatter
would produce (so the e2e header checks in test_circuits_api.py can fail)."""

from __future__ import annotations

import pytest

from mlxcel.steering import circuits as circ
from mlxcel.steering.requests import sf_decimal
from tests.steering.sfv import parse_item


@pytest.mark.parametrize("rung", sorted(circ.RUNG_LANGUAGE))
def test_every_rung_header_is_an_integer_with_a_quoted_language(rung):
    assert parse_item(circ.rung_header(rung)) == (rung, {"language": circ.RUNG_LANGUAGE[rung]})


def test_every_dial_echo_is_an_sf_decimal():
    for i in range(0, 2001):
        lam = i / 1000
        value, params = parse_item(sf_decimal(lam))
        assert value == round(lam, 3) and params == {}
    assert parse_item(sf_decimal(1 / 3)) == (0.333, {})


@pytest.mark.parametrize("bad", [
    "2; language=causally validated (edge)",  # an unquoted phrase
    '2; Language="x"',  # keys are lowercase
    "0.1234",  # four fractional digits
    "1.",  # a decimal needs a fractional digit
    "1e3",
    '"unterminated',
    "2 3",
    '"tab\there"',
])
def test_the_parser_refuses_what_rfc_8941_refuses(bad):
    with pytest.raises(ValueError):
        parse_item(bad)
