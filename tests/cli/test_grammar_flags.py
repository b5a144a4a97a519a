"""--grammar, --grammar-file, --json-schema and --json-schema-file at startup."""

from __future__ import annotations

import json

import pytest

from mlxcel.cli.flags import parse_server_args
from mlxcel.config.refusal import StartupRefusal


def test_json_schema_file_is_read_and_a_malformed_schema_aborts(tmp_path):
    good = tmp_path / "s.json"
    good.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    s = parse_server_args(["-m", "x", "-jf", str(good)], {})
    assert s.sampling.grammar == ("json_schema", good.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text("{\"type\": ")
    with pytest.raises(StartupRefusal, match="invalid JSON schema"):
        parse_server_args(["-m", "x", "--json-schema-file", str(bad)], {})
    with pytest.raises(StartupRefusal, match="invalid JSON schema"):
        parse_server_args(["-m", "x", "-j", "[1, 2"], {})
    with pytest.raises(StartupRefusal, match="failed to open file"):
        parse_server_args(["-m", "x", "-jf", str(tmp_path / "missing.json")], {})


def test_grammar_flags_defer_parsing_to_model_load(tmp_path):
    # GBNF needs the vocabulary (token terminals): even a malformed grammar starts the parse
    assert parse_server_args(["-m", "x", "--grammar", "root ::= a_b"], {}).sampling.grammar == ("gbnf", "root ::= a_b")
    f = tmp_path / "g.gbnf"
    f.write_text('root ::= "a"\n')
    assert parse_server_args(["-m", "x", "--grammar-file", str(f)], {}).sampling.grammar == ("gbnf", 'root ::= "a"\n')
    assert parse_server_args(["-m", "x", "--grammar", ""], {}).sampling.grammar is None
    with pytest.raises(StartupRefusal, match="failed to open file"):
        parse_server_args(["-m", "x", "--grammar-file", str(tmp_path / "nope.gbnf")], {})
