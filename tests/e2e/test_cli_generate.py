"""`mlxcel generate`, `mlxcel chat` and `mlxcel run` drive the same engine from a terminal."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import DEFAULT_MODEL, REPO, fixture_path, models_dir

STATS = re.compile(r"^(\d+) tokens in [\d.]+ s \([\d.]+ tokens/s\), prompt (\d+) tokens.*; "
                   r"peak memory (\d+) MiB resident", re.MULTILINE)


def _run(args, stdin=None):
    fixture_path(DEFAULT_MODEL)
    env = {**os.environ, "MLXCEL_MODELS_DIR": str(models_dir())}
    return subprocess.run([sys.executable, "-m", "mlxcel.cli.main", *args], cwd=REPO, env=env,
                          input=stdin, capture_output=True, text=True, timeout=300)


def _template_tokens(messages) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fixture_path(DEFAULT_MODEL)))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def test_generate_uses_the_chat_template_and_reports_speed_and_memory():
    question = "What is the capital of France?"
    r = _run(["generate", "-m", DEFAULT_MODEL, "--offline", "--temp", "0", "-n", "24", "-p", question])
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    stats = STATS.search(r.stderr)
    assert stats, r.stderr
    completion, prompt, rss = (int(g) for g in stats.groups())
    assert prompt == _template_tokens([{"role": "user", "content": question}])  # not the raw prompt's count
    assert 0 < completion <= 24 and rss > 0


def test_chat_slash_commands_from_stdin():
    turns = "/system You answer in one word.\n/system\nWhat is the capital of France?\n/clear\n/help\n/nope\n/exit\n"
    r = _run(["chat", "-m", DEFAULT_MODEL, "--offline", "--temp", "0", "-n", "24"], stdin=turns)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith(f"mlxcel chat: {DEFAULT_MODEL} (llama, ")
    assert "/help for commands" in out
    assert "system message set" in out and "system message: 'You answer in one word.'" in out
    assert "Paris" in out
    assert "conversation cleared (2 messages)" in out  # the question and its answer
    assert "/clear         forget the conversation" in out
    assert "unknown command /nope" in out


def test_run_offline_without_the_model_says_how_to_get_it():
    r = _run(["run", "no-such-model", "--offline"])
    assert r.returncode != 0
    assert "mlx-community/no-such-model is not in the model store" in r.stderr
    assert "mlxcel download mlx-community/no-such-model" in r.stderr


def test_generate_refuses_gguf_reference():
    r = _run(["generate", "-m", "model.gguf", "--offline", "-p", "hi"])
    assert r.returncode != 0
    assert "gguf" in (r.stderr + r.stdout).lower()


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_run_short_name_ctrl_c_stops_the_answer_and_keeps_the_conversation(tmp_path):
    """On a terminal, as a user types: a short name, an answer cut by Ctrl-C, the chat going on."""
    from tests.e2e.pty_driver import PtySession

    name = DEFAULT_MODEL.split("/")[1]  # resolves to the one store entry of that name
    env = {**os.environ, "MLXCEL_MODELS_DIR": str(models_dir()), "MLXCEL_CACHE_DIR": str(tmp_path)}
    with PtySession([sys.executable, "-m", "mlxcel.cli.main", "run", name, "--offline", "--temp", "0",
                     "-n", "400"], cwd=REPO, env=env) as s:
        banner = s.read_until(rb">>> ", 300)
        assert f"mlxcel chat: {name} (llama".encode() in banner
        s.send(b"Write a long story about a dragon.\r")
        s.read_until(rb"dragon\.\r\n[^\r\n>]{20,}", 300)  # the answer is streaming
        s.send(b"\x03")
        assert b"(stopped)" in s.read_until(rb">>> ", 60)
        s.send(b"/clear\r")
        assert b"conversation cleared (2 messages)" in s.read_until(rb">>> ", 30)
        s.send(b"/exit\r")
        assert s.wait(60) == 0
    assert (tmp_path / "chat_history").read_text().splitlines()[:2] == ["Write a long story about a dragon.", "/clear"]
