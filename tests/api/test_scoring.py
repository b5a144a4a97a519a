"""Scoring mode's distribution and refusals, on plain logits (no model needed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from mlxcel.api.openai.scoring import ScoringSpec, is_scoring, score_logits, scoring_spec


def spec(alternatives=5, allowed=None, temperature=1.0):
    return ScoringSpec(alternatives, None if allowed is None else tuple(allowed), temperature, False)


def test_normalised_over_the_allowed_set_only():
    logits = np.array([5.0, 1.0, 2.0, 3.0, -np.inf], dtype=np.float32)
    s = score_logits(logits, spec(alternatives=2, allowed=[1, 3]))
    assert s.token == 3
    total = sum(math.exp(lp) for _, lp in s.top)
    assert abs(total - 1.0) < 1e-12
    assert s.top[0] == (3, pytest.approx(-math.log1p(math.exp(-2.0))))


def test_temperature_divides_and_zero_means_unscaled():
    logits = np.array([2.0, 0.0], dtype=np.float32)
    hot = score_logits(logits, spec(alternatives=2, temperature=2.0))
    plain = score_logits(logits, spec(alternatives=2, temperature=0.0))
    assert plain.top[0][1] == pytest.approx(-math.log1p(math.exp(-2.0)))
    assert hot.top[0][1] == pytest.approx(-math.log1p(math.exp(-1.0)))


def test_ties_break_by_lowest_id_and_alternatives_are_capped_by_candidates():
    s = score_logits(np.zeros(4, dtype=np.float32), spec(alternatives=20, allowed=[3, 1, 2]))
    assert s.token == 1 and [t for t, _ in s.top] == [1, 2, 3]


def test_minus_inf_outside_the_allowed_set_is_fine():
    logits = np.array([np.nan, np.inf, 1.0, 0.5], dtype=np.float32)
    assert score_logits(logits, spec(allowed=[2, 3])).token == 2


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_plus_inf_reaching_the_answer_is_500(bad):
    logits = np.array([bad, 1.0, 0.5], dtype=np.float32)
    for allowed in (None, [0, 1]):
        with pytest.raises(ApiError) as e:
            score_logits(logits, spec(allowed=allowed))
        assert (e.value.status, e.value.code) == (500, "non_finite_logits")


def test_minus_inf_on_a_reported_token_is_500_but_not_when_unreported():
    logits = np.array([1.0, -np.inf, 0.5], dtype=np.float32)
    assert score_logits(logits, spec(alternatives=2, allowed=[0, 1, 2])).top[1][0] == 2
    with pytest.raises(ApiError) as e:
        score_logits(logits, spec(alternatives=3, allowed=[0, 1, 2]))
    assert e.value.code == "non_finite_logits"


def _completion(**kw):
    body = {"prompt": "x", "max_tokens": 1, "logprobs": 2, **kw}
    return CompletionRequest(**body), body


def _chat(**kw):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True, **kw}
    return ChatCompletionRequest(**body), body


@pytest.mark.parametrize("kw,param", [
    ({"max_tokens": 100}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"stream": True}, "stream"),
    ({"temperature": 0.0005}, "temperature"),
    ({"logprobs": 21}, "logprobs"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_completion_scoring_refusals(kw, param):
    with pytest.raises(ApiError) as e:
        scoring_spec(*_completion(**kw), chat=False)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("field", ["profile", "steering_intensity", "steering", "response_format"])
def test_steering_and_response_format_refused_on_scoring_naming_the_field(field):
    req, body = _chat()
    with pytest.raises(ApiError) as e:
        scoring_spec(req, {**body, field: {"type": "json_object"}}, chat=True)
    assert e.value.param == field and e.value.code == "field_not_honoured"


def test_chat_scoring_spec_and_top_logprobs_needs_logprobs():
    s = scoring_spec(*_chat(top_logprobs=3, allowed_token_ids=[5, 4, 5], max_completion_tokens=1), chat=True)
    assert s.alternatives == 3 and s.allowed == (5, 4) and s.temperature == 1.0
    assert scoring_spec(*_chat(temperature=0), chat=True).alternatives == 0
    req, body = _chat(logprobs=False, top_logprobs=2)
    with pytest.raises(ApiError) as e:
        scoring_spec(req, body, chat=True)
    assert e.value.param == "top_logprobs"
    constrained = scoring_spec(*_chat(logprobs=None, allowed_token_ids=[1]), chat=True)
    assert constrained.alternatives is None


def test_what_counts_as_scoring():
    # logprobs alone asks a generation for its tokens' logprobs (openai/logprobs.py)
    assert not is_scoring({"logprobs": 0}) and not is_scoring({"logprobs": True, "top_logprobs": 2})
    assert is_scoring({"allowed_token_ids": [1]}) and is_scoring({"allowed_token_ids": [1], "logprobs": 2})
