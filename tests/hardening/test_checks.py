"""The hardening suites' own checks catch what they are meant to: a passing soak or fuzz means
nothing if its verdict could not fail."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.hardening import targets
from tests.hardening.soak import Report, _stream_done
from tests.hardening.test_fuzz_routes import stream_errors


def _clean() -> Report:
    return Report(seconds=1, clients=1, statuses=Counter({200: 10}), latencies=[0.1] * 10, rss_warm_mb=500,
                  rss_end_mb=520)


def test_a_clean_report_passes():
    assert _clean().ok(), _clean().problems()


@pytest.mark.parametrize("spoil, words", [
    (lambda r: r.statuses.update({500: 1}), "error answers"),
    (lambda r: r.statuses.update({400: 1}), "error answers"),
    (lambda r: r.lost.append("ReadTimeout"), "lost"),
    (lambda r: r.busy_slots_after.append(2), "slots still busy"),
    (lambda r: setattr(r, "rss_end_mb", 800), "RSS grew"),
])
def test_each_failure_fails_the_soak(spoil, words):
    r = _clean()
    spoil(r)
    assert not r.ok() and words in "; ".join(r.problems())


def test_a_stream_without_its_final_frame_is_incomplete():
    assert _stream_done("/v1/chat/completions", 'data: {"x": 1}\n\ndata: [DONE]\n\n')
    assert not _stream_done("/v1/chat/completions", 'data: {"x": 1}\n\n')
    assert _stream_done("/completion", 'data: {"content": "", "stop": true}\n\n')


def test_a_server_error_inside_a_stream_is_found():
    text = 'data: {"choices": []}\n\ndata: {"error": {"type": "server_error", "message": "boom"}}\n\n'
    assert stream_errors(text) and not stream_errors('data: {"error": {"type": "invalid_request_error"}}\n\n')


def test_a_parser_target_lets_an_undocumented_error_out(monkeypatch):
    def broken(*_a, **_k):
        raise IndexError("a parser bug")

    monkeypatch.setattr(targets, "gbnf_to_lark", broken)
    with pytest.raises(IndexError):
        targets.gbnf(b"root ::= x")


def test_growth_the_prompt_cache_may_make_is_allowed_and_no_more():
    r = _clean()
    r.rss_end_mb = 800
    assert not r.ok()
    r.rss_allowed_mb = 256  # the soak server's --cache-ram, filling after the warm-up
    assert r.ok(), r.problems()
    r.rss_end_mb = 1000
    assert not r.ok()
