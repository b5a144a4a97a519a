"""The mode switch: option parsing, startup refusals naming the flag, pooling precedence."""

import json
import subprocess
import sys

import pytest

from mlxcel.cli.flags import parse_server_args
from mlxcel.config.refusal import StartupRefusal
from mlxcel.workers.checkpoint import EMBEDDING, RERANKER, encoder_kind
from mlxcel.workers.plan import plan
from tests.conftest import REPO, fixture_path
from tests.fixtures import DEFAULT_MODEL, KOKORO_TINY, MINILM, RERANKER_TINY, models_dir


def _plan(argv, environ=None):
    settings = parse_server_args(argv, environ or {})
    return settings, plan(settings, lambda ref, flag: fixture_path(ref))


def test_checkpoint_kinds():
    assert encoder_kind(fixture_path(MINILM)) == EMBEDDING
    assert encoder_kind(fixture_path(RERANKER_TINY)) == RERANKER
    assert encoder_kind(fixture_path(DEFAULT_MODEL)) is None


def test_embeddings_mode_selects_the_worker_and_turns_generation_off():
    for spelling in ("--embedding", "--embeddings"):
        _, p = _plan(["-m", MINILM, spelling])
        assert (p.generation, p.restricted_by) == (False, "--embeddings")
        assert [(s.kind, s.model_id, s.pooling) for s in p.sides] == [(EMBEDDING, MINILM, "mean")]


def test_rank_pooling_is_the_reranking_mode():
    s, p = _plan(["-m", RERANKER_TINY, "--pooling", "rank"])
    assert s.workers.reranking and p.restricted_by == "--reranking" and p.sides[0].kind == RERANKER
    _, p = _plan(["-m", RERANKER_TINY, "--rerank"])
    assert p.sides[0].kind == RERANKER


def test_side_model_beside_a_chat_model_keeps_generation():
    _, p = _plan(["-m", DEFAULT_MODEL, "--embedding-model", MINILM, "--reranker-model", RERANKER_TINY])
    assert p.generation and p.restricted_by is None and {s.kind for s in p.sides} == {EMBEDDING, RERANKER}


def test_pooling_precedence_flag_then_env_then_checkpoint():
    assert _plan(["-m", MINILM, "--embeddings"])[1].sides[0].pooling == "mean"  # 1_Pooling/config.json
    env = {"MLXCEL_EMBEDDING_POOLING": "max"}
    assert _plan(["-m", MINILM, "--embeddings"], env)[1].sides[0].pooling == "max"
    assert _plan(["-m", MINILM, "--embeddings", "--pooling", "cls"], env)[1].sides[0].pooling == "cls"
    assert _plan(["-m", MINILM, "--embeddings", "--pooling", "last"])[1].sides[0].pooling == "last"


@pytest.mark.parametrize("argv, needle", [
    (["-m", DEFAULT_MODEL, "--embeddings"], "--embeddings: "),
    (["-m", MINILM, "--reranking"], "--reranking: "),
    (["-m", DEFAULT_MODEL, "--embedding-model", RERANKER_TINY], "--embedding-model: "),
    (["--embeddings"], "--embeddings needs a checkpoint"),
    (["-m", DEFAULT_MODEL, "--embeddings", "--embedding-model", MINILM], "would not be served"),
    (["-m", DEFAULT_MODEL, "--pooling", "mean"], "no embedding model is served"),
    (["-m", DEFAULT_MODEL, "--embd-normalize", "1"], "no embedding model is served"),
    (["-m", KOKORO_TINY, "--backend", "torch"], "Kokoro checkpoint, which mlxcel serves on MLX"),
])
def test_a_mode_nothing_can_serve_is_refused_naming_the_flag(argv, needle):
    with pytest.raises(StartupRefusal) as e:
        _plan(argv)
    assert needle in str(e.value)


def test_a_kokoro_checkpoint_selects_the_speech_worker():
    _, p = _plan(["-m", KOKORO_TINY])
    assert (p.generation, p.restricted_by, [s.kind for s in p.sides]) == (False, "-m", ["speech"])


def test_pooling_none_refused_at_parse_with_the_reason():
    with pytest.raises((StartupRefusal, SystemExit)):
        parse_server_args(["-m", MINILM, "--embeddings", "--pooling", "none"], {})


def test_server_refuses_a_chat_checkpoint_for_embeddings_before_loading():
    fixture_path(DEFAULT_MODEL)
    out = subprocess.run([sys.executable, "-m", "mlxcel.cli.server", "-m", DEFAULT_MODEL, "--embeddings", "--offline"],
                         cwd=REPO, env={"MLXCEL_MODELS_DIR": str(models_dir()), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--embeddings" in out.stderr and "not an embedding checkpoint" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "mlxcel.cli.server", "-m", MINILM, "--pooling", "none"],
                         cwd=REPO, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "one vector per token" in out.stderr, out.stderr


def test_checkpoint_normalize_flag_sets_the_default(tmp_path):
    from mlxcel.workers.checkpoint import default_normalize

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert default_normalize(tmp_path) == 2
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "normalize": False}))
    assert default_normalize(tmp_path) == -1
