"""The thinking-budget tracker: when it forces, what it forces, and when it leaves a row alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.openai.chat_surface import _budget
from mlxcel.engine.reasoning_budget import ReasoningBudget, ReasoningControl

OPEN, CLOSE, MSG = (1,), (2,), (7, 8)


def run(spec: ReasoningBudget, prompt: list[int], sampled: list[int]) -> list[int]:
    """Emit `sampled` tokens in order, except where the tracker forces one."""
    t, out, it = spec.tracker(prompt), [], iter(sampled)
    while True:
        tok = t.forced()
        if tok is None:
            tok = next(it, None)
            if tok is None:
                return out
        t.observe(tok)
        out.append(tok)


def test_primed_prompt_budget_counts_from_the_first_token():
    spec = ReasoningBudget(3, OPEN, CLOSE, MSG)
    assert run(spec, [5, 1], [10, 11, 12, 13, 14]) == [10, 11, 12, 7, 8, 2, 13, 14]


def test_budget_zero_closes_at_once_and_an_unprimed_row_waits_for_the_open_tag():
    spec = ReasoningBudget(0, OPEN, CLOSE, MSG)
    assert run(spec, [1, 2], [10, 1, 11, 12]) == [10, 1, 7, 8, 2, 11, 12]


def test_a_model_that_closes_within_budget_is_untouched_and_never_forced_again():
    spec = ReasoningBudget(3, OPEN, CLOSE, MSG)
    assert run(spec, [1], [10, 2, 11, 1, 12, 13, 14, 15]) == [10, 2, 11, 1, 12, 13, 14, 15]


def test_multi_token_tags():
    spec = ReasoningBudget(2, (1, 3), (2, 4), ())
    assert run(spec, [], [9, 1, 3, 10, 11, 12]) == [9, 1, 3, 10, 11, 2, 4, 12]


def test_control_ends_thinking_on_the_next_step():
    ctl = ReasoningControl()
    spec = ReasoningBudget(-1, OPEN, CLOSE, MSG, control=ctl)
    t = spec.tracker([1])
    for tok in (10, 11):
        assert t.forced() is None
        t.observe(tok)
    ctl.end()
    forced = []
    while (tok := t.forced()) is not None:
        t.observe(tok)
        forced.append(tok)
    assert forced == [7, 8, 2] and t.state == "done"


def _req(**kw):
    base = dict(reasoning_budget_tokens=None, reasoning_budget_message=None, reasoning_budget_start_tag=None,
                reasoning_budget_end_tags=None, reasoning_budget_end_tag=None, reasoning_control=None)
    return SimpleNamespace(**{**base, **kw})


MODEL = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda s, add_special_tokens=False: [ord(c) for c in s]))


def _server(budget: int, message: str):
    """Settings with only their chat section's --reasoning-budget(-message)."""
    return SimpleNamespace(chat=SimpleNamespace(reasoning_budget=budget, reasoning_budget_message=message))


def test_request_fields_win_over_the_server_flags():
    server = _server(4, "!")
    assert _budget(_server(-1, ""), MODEL, _req()) is None
    b = _budget(server, MODEL, _req())
    assert (b.budget, b.message_ids, b.open_ids, b.close_ids) == (4, (33,), tuple(map(ord, "<think>")),
                                                                  tuple(map(ord, "</think>")))
    b = _budget(server, MODEL, _req(reasoning_budget_tokens=0, reasoning_budget_message="",
                                    reasoning_budget_start_tag="<a>", reasoning_budget_end_tag="</a>"))
    assert (b.budget, b.message_ids, b.close_ids) == (0, (), tuple(map(ord, "</a>")))
    armed = _budget(_server(-1, ""), MODEL,
                    _req(reasoning_control=True))
    assert armed.budget == -1 and armed.control is not None
    with pytest.raises(ApiError) as e:
        _budget(server, MODEL, _req(reasoning_budget_tokens=-2))
    assert e.value.param == "reasoning_budget_tokens"


def test_server_flags_and_environment():
    from mlxcel.cli.flags import parse_server_args
    from mlxcel.config.refusal import StartupRefusal

    s = parse_server_args(["-m", "x", "--reasoning-budget", "0", "--reasoning-budget-message", "Enough."], {})
    assert (s.chat.reasoning_budget, s.chat.reasoning_budget_message) == (0, "Enough.")
    assert parse_server_args(["-m", "x"], {"LLAMA_ARG_THINK_BUDGET": "12"}).chat.reasoning_budget == 12
    assert parse_server_args(["-m", "x"], {}).chat.reasoning_budget == -1
    with pytest.raises(StartupRefusal):
        parse_server_args(["-m", "x", "--reasoning-budget", "-5"], {})
