"""`mlxcel generate` and `mlxcel chat` drive the same engine from a terminal."""

import os
import subprocess
import sys

from tests.conftest import DEFAULT_MODEL, REPO, fixture_path, models_dir


def _run(args, stdin=None):
    fixture_path(DEFAULT_MODEL)
    env = {**os.environ, "MLXCEL_MODELS_DIR": str(models_dir())}
    return subprocess.run([sys.executable, "-m", "mlxcel.cli.main", *args], cwd=REPO, env=env,
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_chat_prompt_greedy():
    r = _run(["generate", "-m", DEFAULT_MODEL, "--offline", "--chat", "--temp", "0", "-n", "24",
              "-p", "What is the capital of France?"])
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_chat_reads_turns_until_exit():
    r = _run(["chat", "-m", DEFAULT_MODEL, "--offline", "--temp", "0", "-n", "24"],
             stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_refuses_gguf_reference():
    r = _run(["generate", "-m", "model.gguf", "--offline", "-p", "hi"])
    assert r.returncode != 0
    assert "gguf" in (r.stderr + r.stdout).lower()
