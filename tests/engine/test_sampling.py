"""The sampler chain end to end: ordering, mirostat, greedy, seeds, reports, batches."""

import math
from dataclasses import replace

import numpy as np
import pytest

from mlxcel.engine.sampling import (
    LOWEST_LOGPROB, NoCandidatesError, ProbsReport, SamplerState, SamplingRow, sample_batch,
    sample_row,
)
from mlxcel.engine.sampling_dry import DryVocab
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.sampling_stages import softmax

V = 40
TEXT = [chr(ord("a") + i % 26) + ("" if i < 26 else "'") for i in range(V)]


def toy_logits(history):
    """A deterministic stand-in for a model: logits depend on the recent tokens."""
    key = (len(history) * 1009 + sum(history[-3:]) * 31) % (2**32)
    return (np.random.default_rng(key).normal(size=V) * 2.5).astype(np.float32)


def generate(params, n=40, prompt=(1, 2, 3), state=None):
    state = state or SamplerState.create(params)
    history = list(prompt)
    for _ in range(n):
        history.append(sample_row(toy_logits(history), params, state, history).token)
    return "".join(TEXT[t] for t in history[len(prompt):]).encode()


def post_probs(params, logits, history=(), mask=None):
    params = replace(params, n_probs=100, post_sampling_probs=True)
    r = sample_row(np.array(logits, dtype=np.float32), params, SamplerState.create(params),
                   history, mask)
    return dict(r.probs.top)


def open_params(**kw):
    """Every filter off: the chain is temperature then the draw."""
    base = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, seed=1)
    return SamplingParams(**{**base, **kw})


# --- seeds -------------------------------------------------------------------------

def test_same_seed_reproduces_byte_identical_text():
    for params in (SamplingParams(seed=1234), SamplingParams(seed=-2, top_k=0, top_p=0.9),
                   SamplingParams(seed=5, mirostat=2), SamplingParams(seed=5, mirostat=1),
                   SamplingParams(seed=9, xtc_probability=0.5, xtc_threshold=0.05,
                                  dry_multiplier=0.8, dry_sequence_breakers=()),
                   SamplingParams(seed=9, samplers=("top_k", "temperature", "adaptive_p"),
                                  adaptive_target=0.3)):
        assert generate(params) == generate(params)
    assert generate(SamplingParams(seed=1234)) != generate(SamplingParams(seed=1235))
    # -2 folds to 4294967294: the same request spelled either way
    assert generate(SamplingParams(seed=-2)) == generate(SamplingParams(seed=4294967294))


def test_random_seed_draws_a_uint32_and_reports_it():
    state = SamplerState.create(SamplingParams(seed=-1))
    assert 0 <= state.seed <= 0xFFFFFFFF
    replay = SamplingParams(seed=state.seed)
    assert generate(SamplingParams(seed=-1), state=state) == generate(replay)


def test_rows_are_independent_of_their_batch():
    a, b = SamplingParams(seed=11, temperature=1.2), SamplingParams(seed=12, top_k=5)
    alone = [generate(a, n=10), generate(b, n=10)]
    rows = [SamplingRow(p, SamplerState.create(p), [1, 2, 3]) for p in (a, b)]
    for _ in range(10):
        results = sample_batch(np.stack([toy_logits(r.history) for r in rows]), rows)
        for row, res in zip(rows, results):
            row.history = [*row.history, res.token]
    together = ["".join(TEXT[t] for t in r.history[3:]).encode() for r in rows]
    assert together == alone


def test_sample_batch_refuses_a_shape_mismatch():
    p = SamplingParams(seed=1)
    with pytest.raises(ValueError):
        sample_batch(np.zeros((2, V)), [SamplingRow(p, SamplerState.create(p))])


# --- greedy ------------------------------------------------------------------------

def test_greedy_picks_the_argmax_after_the_chain_and_draws_nothing():
    logits = np.array([1.0, 4.0, 3.5, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=0.0, seed=3)
    state = SamplerState.create(params)
    before = state.rng.bit_generator.state
    assert sample_row(logits, params, state).token == 1
    assert state.rng.bit_generator.state == before
    # the repeat penalty runs first: token 1 (4.0 -> 2.0) falls behind token 2
    penalized = SamplingParams(temperature=0.0, repeat_penalty=2.0)
    assert sample_row(logits, penalized, SamplerState.create(penalized), [1]).token == 2


def test_greedy_still_reports_probabilities():
    logits = np.array([1.0, 4.0, 3.5, 0.0], dtype=np.float32)
    pre = SamplingParams(temperature=0.0, n_probs=2)
    r = sample_row(logits, pre, SamplerState.create(pre))
    p = softmax(logits)
    assert r.probs == ProbsReport(False, 1, pytest.approx(p[1]),
                                  ((1, pytest.approx(p[1])), (2, pytest.approx(p[2]))))
    post = SamplingParams(temperature=0.0, n_probs=3, post_sampling_probs=True)
    r = sample_row(logits, post, SamplerState.create(post))
    assert r.probs == ProbsReport(True, 1, 1.0, ((1, 1.0),))


# --- chain order -------------------------------------------------------------------

def test_the_order_of_stages_is_the_order_given():
    logits = [5.0, 4.5, 0.0]
    # penalties first: token 0 (5.0 -> 2.5) loses to token 1 before top_k keeps one
    first = open_params(top_k=1, repeat_penalty=2.0)
    assert sample_row(np.array(logits), first, SamplerState.create(first), [0]).token == 1
    # top_k first: only token 0 is left for the penalty to act on
    later = open_params(top_k=1, repeat_penalty=2.0,
                        samplers=("top_k", "penalties", "temperature"))
    assert sample_row(np.array(logits), later, SamplerState.create(later), [0]).token == 0


def test_a_stage_left_out_of_the_order_does_not_run():
    logits = [2.0, 1.0, 0.0]
    hot = open_params(temperature=0.5)
    assert post_probs(hot, logits) == pytest.approx(dict(enumerate(softmax(np.array(logits) / 0.5))))
    unscaled = open_params(temperature=0.5, samplers=("top_k",))
    assert post_probs(unscaled, logits) == pytest.approx(dict(enumerate(softmax(np.array(logits)))))


def test_default_chain_hand_computed():
    # top_k 3 keeps 0, 1, 2; top_p .95 needs all three; min_p .05 of max keeps all;
    # temperature .8 rescales the three
    logits = np.array([2.0, 1.5, 1.0, -3.0, -4.0])
    got = post_probs(SamplingParams(top_k=3, seed=1), logits)
    want = softmax(logits[:3] / 0.8)
    assert got == pytest.approx({0: want[0], 1: want[1], 2: want[2]})


def test_min_keep_reaches_every_filter_that_takes_it():
    logits = np.log(np.array([0.7, 0.2, 0.06, 0.04]))
    strict = dict(top_p=0.5, min_p=0.5, typical_p=1.0, top_k=0, temperature=1.0, seed=1)
    assert set(post_probs(SamplingParams(**strict), logits)) == {0}
    assert set(post_probs(SamplingParams(**strict, min_keep=3), logits)) == {0, 1, 2}


# --- mirostat ----------------------------------------------------------------------

def test_mirostat_replaces_the_chain():
    logits = [3.0, 2.0, 1.0, 0.0]
    # filters that would leave one token, and a repeat penalty, are all bypassed
    params = SamplingParams(mirostat=2, mirostat_tau=10.0, temperature=1.0, top_k=1,
                            min_p=0.99, repeat_penalty=5.0, seed=1)
    assert post_probs(params, logits, history=[0]) == \
        pytest.approx(dict(enumerate(softmax(np.array(logits)))))
    # logit_bias and temperature still apply under mirostat
    biased = SamplingParams(mirostat=2, mirostat_tau=10.0, temperature=0.5,
                            logit_bias={3: 6.0}, seed=1)
    want = softmax(np.array([3.0, 2.0, 1.0, 6.0]) / 0.5)
    assert post_probs(biased, logits) == pytest.approx(dict(enumerate(want)))


def test_mirostat_v2_updates_mu_from_the_observed_surprise():
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125]))
    params = SamplingParams(mirostat=2, mirostat_tau=1.25, mirostat_eta=0.1,
                            temperature=1.0, seed=7, n_probs=4, post_sampling_probs=True)
    state = SamplerState.create(params)
    assert state.mirostat_mu == 2.5
    r = sample_row(logits, params, state)
    # mu 2.5 keeps surprises 1 and 2 bits: p = 2/3, 1/3 after renormalising
    assert [t for t, _ in r.probs.top] == [0, 1]
    assert dict(r.probs.top) == pytest.approx({0: 2 / 3, 1: 1 / 3})
    surprise = -math.log2(dict(r.probs.top)[r.token])
    assert state.mirostat_mu == pytest.approx(2.5 - 0.1 * (surprise - 1.25))


def test_mirostat_v1_truncates_to_its_k():
    # p_i ~ 1/i**2 over 4 tokens: s_hat = 2; mu = 2 * tau = 2 gives k = 2
    logits = np.array([-2.0 * math.log(i) for i in range(1, 5)], dtype=np.float32)
    params = SamplingParams(mirostat=1, mirostat_tau=1.0, temperature=1.0, seed=1)
    got = post_probs(params, logits)
    assert got == pytest.approx({0: 0.8, 1: 0.2})


# --- masks, bias, reports ----------------------------------------------------------

def test_mask_is_applied_before_everything():
    logits = np.array([9.0, 1.0, 0.5, 0.0], dtype=np.float32)
    mask = np.array([False, True, True, False])
    params = SamplingParams(seed=2, top_k=1)
    assert sample_row(logits, params, SamplerState.create(params), mask=mask).token == 1
    with pytest.raises(NoCandidatesError):
        sample_row(logits, params, SamplerState.create(params), mask=np.zeros(4, bool))


def test_banned_token_is_never_drawn_and_bias_moves_greedy():
    logits = np.array([9.0, 1.0, 0.5], dtype=np.float32)
    banned = SamplingParams(temperature=0.0, logit_bias={0: -math.inf})
    assert sample_row(logits, banned, SamplerState.create(banned)).token == 1
    boosted = SamplingParams(temperature=0.0, logit_bias={2: 9.0})
    assert sample_row(logits, boosted, SamplerState.create(boosted)).token == 2


def test_pre_sampling_report_uses_the_raw_logits():
    logits = np.array([0.0, 2.0, 1.0, -np.inf], dtype=np.float32)
    params = SamplingParams(seed=4, n_probs=10, logit_bias={0: 5.0}, temperature=0.0)
    r = sample_row(logits, params, SamplerState.create(params))
    assert r.token == 0                            # the bias decides the draw...
    p = softmax(logits)                            # ...but not the report
    assert [t for t, _ in r.probs.top] == [1, 2, 0, 3]
    assert r.probs.prob == pytest.approx(p[0])
    j = r.probs.to_json()
    assert j["id"] == 0 and j["logprob"] == pytest.approx(math.log(p[0]))
    assert j["top_logprobs"][0] == {"id": 1, "logprob": pytest.approx(math.log(p[1]))}
    assert j["top_logprobs"][3] == {"id": 3, "logprob": LOWEST_LOGPROB}


def test_post_sampling_report_is_linear_and_drops_zeros():
    logits = np.array([2.0, 1.0, 0.0, -5.0], dtype=np.float32)
    params = SamplingParams(seed=4, n_probs=2, post_sampling_probs=True, top_k=3,
                            top_p=1.0, min_p=0.0, temperature=1.0)
    r = sample_row(logits, params, SamplerState.create(params))
    p = softmax(logits[:3])
    assert [t for t, _ in r.probs.top] == [0, 1]
    assert dict(r.probs.top) == pytest.approx({0: p[0], 1: p[1]})
    j = r.probs.to_json()
    assert set(j) == {"id", "prob", "top_probs"}
    assert j["top_probs"][1] == {"id": 1, "prob": pytest.approx(p[1])}
    assert sample_row(logits, SamplingParams(seed=4), SamplerState.create(SamplingParams())).probs is None
    # a probability that underflows to zero is left out of the report
    assert post_probs(open_params(), [0.0, -1000.0]) == {0: 1.0}


# --- adaptive-p and DRY in the chain -----------------------------------------------

def test_adaptive_p_draws_from_its_transformed_distribution():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(samplers=("temperature", "adaptive_p"), temperature=1.0,
                            adaptive_target=0.3, adaptive_decay=0.5, seed=2)
    got = post_probs(params, logits)
    want = softmax(np.array([0.0, 5.0, 5.0 - 10 * (4 / 9) / (5 / 3)]))
    assert got == pytest.approx(dict(enumerate(want)), abs=1e-6)
    state = SamplerState.create(params)
    assert (state.adaptive_weighted_sum, state.adaptive_total_weight) == (0.6, 2.0)
    r = sample_row(logits, params, state)
    assert state.adaptive_weighted_sum == pytest.approx([0.6, 0.3, 0.1][r.token] + 0.5 * 0.6)
    assert state.adaptive_total_weight == pytest.approx(2.0)


def test_dry_in_the_chain_uses_the_row_history_and_breaker_table():
    a, b, c, y = 0, 1, 2, 3
    history = [a, b, c, c, b, c, y, a, b, c]
    logits = [0.0, 0.0, 5.0, 5.0]
    params = open_params(dry_multiplier=0.8, dry_sequence_breakers=(":",))
    vocab = DryVocab([b"a", b"b", b"c", b"y"], lambda text: [])
    state = SamplerState.create(params, dry_vocab=vocab)
    reported = replace(params, n_probs=4, post_sampling_probs=True)
    r = sample_row(np.array(logits), reported, state, history)
    want = softmax(np.array([0.0, 0.0, 5.0 - 1.4, 5.0 - 0.8]))
    assert dict(r.probs.top) == pytest.approx(dict(enumerate(want)))


def test_dry_with_breakers_needs_the_vocabulary():
    with pytest.raises(ValueError, match="dry_vocab"):
        SamplerState.create(SamplingParams(dry_multiplier=0.8))
    # no breakers, or DRY off: nothing to scan
    SamplerState.create(SamplingParams(dry_multiplier=0.8, dry_sequence_breakers=()))
    SamplerState.create(SamplingParams())
