"""Pure pieces of the native routes: projection, timings, Prometheus text, pieces."""

from __future__ import annotations

import pytest

from mlxcel.api.llamacpp.metrics import render_prometheus
from mlxcel.api.llamacpp.render import project, timings_json
from mlxcel.api.llamacpp.tokenize import piece_json
from mlxcel.engine.token_pieces import valid_utf8_prefix
from mlxcel.engine.tokenizer import Tokenizer
from mlxcel.engine.types import EngineStats, Timings
from tests.conftest import fixture_path
from tests.fixtures import DEFAULT_MODEL, GEMMA3, QWEN2_TINY


def test_project_keeps_listed_paths_under_their_full_name():
    obj = {"content": "x", "generation_settings": {"n_predict": 5}, "timings": {"cache_n": 0}, "n": 1}
    out = project(obj, ["content", "generation_settings/n_predict", "missing", "content/deeper", ""])
    assert out == {"content": "x", "generation_settings/n_predict": 5}
    assert project(obj, None) is obj


def test_timings_derivations():
    t = timings_json(Timings(cache_n=2, prompt_n=10, prompt_ms=80.0, predicted_n=5, predicted_ms=40.0), 10)
    assert t["prompt_n"] == 8 and t["prompt_per_token_ms"] == 10.0 and t["prompt_per_second"] == 100.0
    assert t["predicted_per_token_ms"] == 10.0 and t["predicted_per_second"] == 100.0
    assert list(t)[0] == "cache_n"
    one = timings_json(Timings(prompt_n=1, prompt_ms=0.0, predicted_n=1, predicted_ms=0.0), 1)
    assert one["predicted_per_second"] == 0.0 and one["prompt_per_second"] == 0.0


def test_prometheus_families_name_for_name():
    st = EngineStats(n_prompt_tokens_processed_total=10, n_prompt_tokens_cached_total=7,
                     t_prompt_processing_total=2500.7, n_tokens_predicted_total=4,
                     t_tokens_generation_total=1000.0, n_prompt_tokens_processed=10, t_prompt_processing=500.0,
                     n_tokens_predicted=4, t_tokens_generation=0.0, n_decode_total=4, n_busy_slots_total=6,
                     n_tokens_max=14, n_processing=1, n_deferred=2, kv_cache_tokens=5, kv_cache_capacity=10)
    text = render_prometheus(st)
    values = {line.split()[0]: line.split()[1] for line in text.splitlines() if not line.startswith("#")}
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    upstream = ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
                "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max",
                "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                "spec_decode_num_drafts_total", "prompt_tokens_seconds", "predicted_tokens_seconds",
                "requests_processing", "requests_deferred", "n_busy_slots_per_decode")
    assert list(values)[:15] == [f"llamacpp:{n}" for n in upstream]
    assert [types[f"llamacpp:{n}"] for n in upstream] == ["counter"] * 10 + ["gauge"] * 5
    assert values["llamacpp:prompt_tokens_cached_total"] == "7"
    assert values["llamacpp:prompt_seconds_total"] == "2.5"
    assert values["llamacpp:n_busy_slots_per_decode"] == "1.5"
    assert values["llamacpp:prompt_tokens_seconds"] == "20"
    assert values["llamacpp:predicted_tokens_seconds"] == "0"  # no time in the window
    assert values["llamacpp:requests_deferred"] == "2"
    assert values["mlxcel_kv_cache_usage_ratio"] == "0.5"
    spec = ("draft_tokens", "accepted_tokens", "drafts")
    assert all(values[f"llamacpp:spec_decode_num_{n}_total"] == "0" for n in spec)
    assert "per_pos" not in text and text.endswith("\n")  # no draft, no per-position series


def test_prometheus_speculative_counters():
    st = EngineStats(n_draft_tokens_total=9, n_draft_accepted_total=4, n_draft_rounds_total=5,
                     n_draft_accepted_per_pos=[3, 1])
    text = render_prometheus(st)
    assert "llamacpp:spec_decode_num_draft_tokens_total 9\n" in text
    assert "llamacpp:spec_decode_num_accepted_tokens_total 4\n" in text
    assert "llamacpp:spec_decode_num_drafts_total 5\n" in text
    assert "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter" in text
    assert 'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3' in text
    assert 'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1' in text


def test_piece_json_and_utf8_prefix():
    assert piece_json("é".encode()) == "é"
    assert piece_json(b"\xe6\x97") == [230, 151]
    assert valid_utf8_prefix(b"ab\xe6\x97") == "ab"


@pytest.mark.parametrize("ref", [DEFAULT_MODEL, GEMMA3, QWEN2_TINY])
def test_pieces_reassemble_text_byte_for_byte(ref):
    tok = Tokenizer(fixture_path(ref))
    text = "Grüße, 東京 🎉 <b>\n\tend"
    ids = tok.encode(text, add_special_tokens=False, parse_special=False)
    assert b"".join(tok.pieces[i] for i in ids).decode("utf-8") == text
