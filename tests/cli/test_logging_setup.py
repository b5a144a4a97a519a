"""--log-* options applied to Python logging: destination, format, verbosity, redaction."""

from __future__ import annotations

import io
import logging
import stat

import pytest

from mlxcel.cli.flags import parse_server_args
from mlxcel.cli.logging_setup import configure_logging, level_for


@pytest.fixture(autouse=True)
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_every_line_is_redacted(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("file-secret-1\n")
    s = parse_server_args(["--api-key", "cli-secret", "--api-key-file", str(keys), "--hf-token", "hf_tok"],
                          {"LLAMA_API_KEY": "ignored-by-cli", "HF_TOKEN": "hf_env"})
    out = io.StringIO()
    configure_logging(s, stream=out)
    logging.getLogger("mlxcel.test").info("keys cli-secret file-secret-1 hf_tok hf_env ignored-by-cli end")
    line = out.getvalue()
    for secret in ("cli-secret", "file-secret-1", "hf_tok", "hf_env", "ignored-by-cli"):
        assert secret not in line
    assert line.count("[redacted]") == 5 and line.rstrip().endswith("end")


def test_prefix_and_timestamps_can_be_turned_off():
    s = parse_server_args(["--no-log-prefix", "--no-log-timestamps"], {})
    out = io.StringIO()
    configure_logging(s, stream=out)
    logging.getLogger("mlxcel.test").warning("plain")
    assert out.getvalue() == "plain\n"
    s = parse_server_args([], {})
    out = io.StringIO()
    configure_logging(s, stream=out)
    logging.getLogger("mlxcel.test").warning("tagged")
    assert out.getvalue().rstrip().endswith(" W tagged")


def test_verbosity_precedence():
    assert level_for(parse_server_args(["-lv", "2"], {"LLAMA_ARG_LOG_VERBOSITY": "5"})) == logging.WARNING
    assert level_for(parse_server_args([], {"LLAMA_ARG_LOG_VERBOSITY": "1"})) == logging.ERROR
    assert level_for(parse_server_args(["-v", "-lv", "1"], {})) == logging.DEBUG
    assert level_for(parse_server_args([], {})) == logging.INFO


def test_log_file_receives_redacted_lines_without_colors(tmp_path):
    path = tmp_path / "server.log"
    s = parse_server_args(["--log-file", str(path), "--api-key", "abc123", "--log-colors", "auto"], {})
    configure_logging(s)
    logging.getLogger("mlxcel.test").error("key=abc123")
    for h in logging.getLogger().handlers:
        h.flush()
    text = path.read_text()
    assert "abc123" not in text and "[redacted]" in text and "\033[" not in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_log_disable_wins(tmp_path):
    path = tmp_path / "server.log"
    s = parse_server_args(["--log-disable", "--log-file", str(path)], {})
    assert configure_logging(s) is None
    logging.getLogger("mlxcel.test").error("nothing")
    assert not path.exists()
