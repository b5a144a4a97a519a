"""Each sampler stage as a pure function, against hand-computed expectations."""

import math

import numpy as np
import pytest

from mlxcel.engine.sampling_dry import DryVocab, _z_function, build_breaker_table, dry, dry_repeat_lengths
from mlxcel.engine.sampling_stages import (
    Candidates, NoCandidatesError, adaptive_p_logits, apply_logit_bias, draw_index,
    dynamic_temperature, min_p, mirostat_v1_top_k, mirostat_v2_truncate, penalties, softmax,
    temperature, top_k, top_n_sigma, top_p, typical_p, xtc,
)


def cand(logits, mask=None):
    return Candidates.from_logits(np.array(logits, dtype=np.float32), mask)


def from_probs(probs):
    return cand(np.log(np.array(probs, dtype=np.float64)))


def as_dict(c):
    return {int(i): float(x) for i, x in zip(c.ids, c.logits)}


class FixedRandom:
    """Stands in for a Generator where a stage's single draw must be a chosen value."""

    def __init__(self, *values):
        self.values = list(values)

    def random(self, dtype=None):
        return self.values.pop(0)


# --- candidate set -----------------------------------------------------------------

def test_candidates_drop_masked_and_minus_inf_tokens():
    c = cand([1.0, -np.inf, 3.0, 2.0], mask=np.array([True, True, True, False]))
    assert list(c.ids) == [0, 2] and c.order == "id"
    with pytest.raises(NoCandidatesError):
        cand([1.0, 2.0], mask=np.array([False, False]))
    with pytest.raises(ValueError):
        cand([1.0, np.nan])
    with pytest.raises(ValueError):
        cand([1.0, 2.0], mask=np.array([True]))


def test_logit_bias_adds_and_bans():
    c = apply_logit_bias(cand([1.0, 2.0, 3.0]), {0: 5.0, 2: -math.inf, 7: 1.0})
    assert as_dict(c) == {0: 6.0, 1: 2.0}
    with pytest.raises(NoCandidatesError):
        apply_logit_bias(cand([1.0]), {0: -math.inf})


# --- penalties ---------------------------------------------------------------------

def test_penalties_hand_computed():
    history = [0, 1, 1, 3, 3, 3]
    c = penalties(cand([2.0, -1.0, 0.5, 3.0]), history, 64, 2.0, 0.5, 0.25)
    # positive logits are divided, non-positive multiplied, then count*freq + presence off
    assert as_dict(c) == pytest.approx({0: 1.0 - 0.75, 1: -2.0 - 1.25, 2: 0.5, 3: 1.5 - 1.75})
    # only the last 2 tokens count: [3, 3]
    c = penalties(cand([2.0, -1.0, 0.5, 3.0]), history, 2, 2.0, 0.5, 0.25)
    assert as_dict(c) == pytest.approx({0: 2.0, 1: -1.0, 2: 0.5, 3: 1.5 - 1.25})
    # -1: the whole history; 0: disabled; neutral values: disabled
    assert as_dict(penalties(cand([2.0, -1.0, 0.5, 3.0]), history, -1, 2.0, 0.5, 0.25)) == \
        as_dict(penalties(cand([2.0, -1.0, 0.5, 3.0]), history, 64, 2.0, 0.5, 0.25))
    assert as_dict(penalties(cand([2.0, 3.0]), [0], 0, 2.0, 1.0, 1.0)) == {0: 2.0, 1: 3.0}
    assert as_dict(penalties(cand([2.0, 3.0]), [0], 64, 1.0, 0.0, 0.0)) == {0: 2.0, 1: 3.0}


def test_penalties_on_a_logit_sorted_subset():
    c = top_k(cand([2.0, -1.0, 0.5, 3.0]), 3)            # ids 3, 0, 2
    c = penalties(c, [0, 3, 3], 64, 2.0, 0.0, 0.0)
    assert as_dict(c) == pytest.approx({3: 1.5, 0: 1.0, 2: 0.5})


# --- truncation --------------------------------------------------------------------

def test_top_k():
    c = top_k(cand([1.0, 5.0, 3.0, 4.0, 2.0]), 3)
    assert list(c.ids) == [1, 3, 2] and c.order == "logit"
    assert list(top_k(cand([1.0, 5.0]), 0).ids) == [0, 1]
    assert list(top_k(cand([1.0, 5.0]), 10).ids) == [1, 0]


def test_top_p():
    probs = [0.15, 0.5, 0.05, 0.3]
    assert list(top_p(from_probs(probs), 0.75, 0).ids) == [1, 3]
    assert list(top_p(from_probs(probs), 0.81, 0).ids) == [1, 3, 0]
    assert list(top_p(from_probs(probs), 0.4, 0).ids) == [1]
    assert list(top_p(from_probs(probs), 0.4, 3).ids) == [1, 3, 0]     # min_keep
    assert top_p(from_probs(probs), 1.0, 0).size == 4


def test_top_p_large_vocab_matches_a_full_sort():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=5000).astype(np.float32) * 4
    for p in (0.3, 0.9, 0.999):
        got = top_p(cand(logits), p, 0)
        order = np.argsort(-logits, kind="stable")
        cum = np.cumsum(softmax(logits[order]))
        n = int(np.argmax(cum >= p)) + 1
        assert list(got.ids) == list(order[:n])


def test_min_p():
    probs = [0.15, 0.5, 0.05, 0.3]
    # threshold 0.2 * 0.5 = 0.1: keeps 0.15, 0.5, 0.3 in their order
    c = min_p(from_probs(probs), 0.2, 0)
    assert list(c.ids) == [0, 1, 3]
    assert list(min_p(from_probs(probs), 0.5, 0).ids) == [1, 3]    # threshold 0.25
    assert list(min_p(from_probs(probs), 0.5, 3).ids) == [1, 3, 0]  # min_keep
    assert list(min_p(from_probs(probs), 0.99, 0).ids) == [1]
    assert min_p(from_probs(probs), 0.0, 0).size == 4


def test_typical_p_hand_computed():
    # p = .6, .3, .1: entropy 0.8979; |-ln p - H| = 0.387, 0.306, 1.405
    probs = [0.6, 0.3, 0.1]
    assert list(typical_p(from_probs(probs), 0.2, 0).ids) == [1]  # drops the most likely
    assert list(typical_p(from_probs(probs), 0.5, 0).ids) == [1, 0]
    assert list(typical_p(from_probs(probs), 0.2, 2).ids) == [1, 0]  # min_keep
    assert list(typical_p(from_probs(probs), 0.95, 0).ids) == [1, 0, 2]
    assert typical_p(from_probs(probs), 1.0, 0).size == 3


def test_top_n_sigma_hand_computed():
    # mean 4.8, population std sqrt(90.8 / 5) = 4.2615
    logits = [10.0, 9.0, 5.0, 0.0, 0.0]
    assert sorted(top_n_sigma(cand(logits), 1.0).ids) == [0, 1]   # >= 5.74
    assert sorted(top_n_sigma(cand(logits), 2.0).ids) == [0, 1, 2]  # >= 1.48
    assert top_n_sigma(cand(logits), -1.0).size == 5
    assert top_n_sigma(cand(logits), 0.0).size == 5


def test_xtc_removes_top_choices_but_the_last():
    probs = [0.3, 0.1, 0.4, 0.2]
    # at or above 0.15: .4, .3, .2 -> all go but the least likely of them (.2)
    c = xtc(from_probs(probs), 1.0, 0.15, 0, FixedRandom(0.0))
    assert sorted(c.ids) == [1, 3]
    # only one token above the threshold: nothing to exclude
    assert xtc(from_probs(probs), 1.0, 0.35, 0, FixedRandom(0.0)).size == 4
    # min_keep: 4 - 2 = 2 survivors < 3
    assert xtc(from_probs(probs), 1.0, 0.15, 3, FixedRandom(0.0)).size == 4


def test_xtc_probability_is_the_chance_of_acting():
    probs = [0.3, 0.1, 0.4, 0.2]
    assert xtc(from_probs(probs), 0.5, 0.15, 0, FixedRandom(0.6)).size == 4  # 0.6 > 0.5
    assert xtc(from_probs(probs), 0.5, 0.15, 0, FixedRandom(0.5)).size == 2  # 0.5 <= 0.5
    # disabled: no draw is made at all (FixedRandom() would raise on a draw)
    assert xtc(from_probs(probs), 0.0, 0.15, 0, FixedRandom()).size == 4
    assert xtc(from_probs(probs), 1.0, 0.51, 0, FixedRandom()).size == 4
    assert xtc(from_probs([1.0]), 1.0, 0.15, 0, FixedRandom()).size == 1


# --- temperature -------------------------------------------------------------------

def test_temperature():
    assert as_dict(temperature(cand([1.0, 2.0, -4.0]), 0.5)) == {0: 2.0, 1: 4.0, 2: -8.0}
    greedy = temperature(cand([1.0, 3.0, 3.0, 2.0]), 0.0)
    assert list(greedy.ids) == [1]   # the first highest logit
    assert list(temperature(cand([1.0, 3.0]), -1.0).ids) == [1]


def test_dynamic_temperature_hand_computed():
    # logits 2, 1, 0 -> p = .6652, .2447, .0900; H = 0.83236; H / ln 3 = 0.75766
    # temp 1 +- 0.5: exponent 1 -> 0.5 + 1.0 * 0.75766; exponent 2 -> 0.5 + 0.75766**2
    for exponent, t in ((1.0, 1.25766), (2.0, 1.07405)):
        c = dynamic_temperature(cand([2.0, 1.0, 0.0]), 1.0, 0.5, exponent)
        assert as_dict(c) == pytest.approx({0: 2.0 / t, 1: 1.0 / t, 2: 0.0}, abs=1e-4)
    # range 0: plain temperature; one candidate: untouched
    assert as_dict(dynamic_temperature(cand([2.0, 1.0]), 0.5, 0.0, 1.0)) == {0: 4.0, 1: 2.0}
    assert as_dict(dynamic_temperature(cand([2.0]), 0.5, 0.3, 1.0)) == {0: 2.0}


# --- mirostat ----------------------------------------------------------------------

def test_mirostat_v1_k_on_a_zipf_distribution():
    # p_i ~ 1 / i**2 gives s_hat = 2, eps = 1, k = (2**mu / (1 - 1/N)) ** (1/2) with N = 4
    c = cand([-2.0 * math.log(i) for i in range(1, 5)])
    assert mirostat_v1_top_k(c, 2.0, 4) == 2     # sqrt(4 / 0.75) = 2.31
    assert mirostat_v1_top_k(c, 4.0, 4) == 4     # sqrt(16 / 0.75) = 4.62
    assert mirostat_v1_top_k(c, 0.0, 4) == 1     # sqrt(1 / 0.75) = 1.15
    assert mirostat_v1_top_k(cand([1.0]), 5.0, 4) == 1


def test_mirostat_v2_truncates_by_surprise():
    # surprises (bits): 1, 2, 3, 3
    c = from_probs([0.125, 0.5, 0.125, 0.25])
    assert list(mirostat_v2_truncate(c, 2.5).ids) == [1, 3]
    assert sorted(mirostat_v2_truncate(c, 3.5).ids) == [0, 1, 2, 3]
    assert list(mirostat_v2_truncate(c, 0.5).ids) == [1]   # never empty


# --- adaptive-p ------------------------------------------------------------------

def test_adaptive_p_transform_peaks_at_the_target():
    # distance |p - .3| / .3 = 1, 0, 2/3 -> 5 - 10 d^2 / (1 + d)
    got = adaptive_p_logits(np.array([0.6, 0.3, 0.1]), 0.3)
    assert got == pytest.approx([0.0, 5.0, 5.0 - 10 * (4 / 9) / (5 / 3)], abs=1e-5)


# --- the draw ----------------------------------------------------------------------

def test_draw_index_takes_the_first_index_reaching_u_times_total():
    probs = np.array([0.2, 0.5, 0.3])
    assert draw_index(probs, FixedRandom(0.0)) == 0
    assert draw_index(probs, FixedRandom(0.19)) == 0
    assert draw_index(probs, FixedRandom(0.21)) == 1
    assert draw_index(probs, FixedRandom(0.71)) == 2
    assert draw_index(probs, FixedRandom(0.9999999)) == 2


# --- DRY ---------------------------------------------------------------------------

A, B, C, Y = 0, 1, 2, 3
SEQ = [A, B, C, C, B, C, Y, A, B, C]   # "a b c c b c y a b c"


def test_z_function_matches_a_naive_scan():
    rng = np.random.default_rng(3)
    for _ in range(50):
        seq = list(rng.integers(0, 3, size=int(rng.integers(1, 30))))
        naive = [len(seq)] + [
            next((n for n in range(len(seq) - k) if seq[n] != seq[n + k]), len(seq) - k)
            for k in range(1, len(seq))]
        assert _z_function(seq) == naive


def test_dry_repeat_lengths_hand_computed():
    # "a b c" (end) also follows "a" at the start and was followed by "c": c extends 3;
    # "b c" was followed by "y": y extends 2; "c" alone (length 1) is under allowed_length
    kw = dict(allowed_length=2, penalty_last_n=64, breakers={})
    assert dry_repeat_lengths(SEQ, **kw) == {C: 3, Y: 2}
    assert dry_repeat_lengths(SEQ, **{**kw, "allowed_length": 3}) == {C: 3}
    # only the last 4 tokens "y a b c": no repeat
    assert dry_repeat_lengths(SEQ, **{**kw, "penalty_last_n": 4}) == {}
    # -1: the training context (4 here), or the whole history when unknown
    assert dry_repeat_lengths(SEQ, **{**kw, "penalty_last_n": -1}, n_ctx_train=4) == {}
    assert dry_repeat_lengths(SEQ, **{**kw, "penalty_last_n": -1}) == {C: 3, Y: 2}


def test_dry_sequence_breakers_cap_the_scan():
    kw = dict(allowed_length=2, penalty_last_n=64)
    # single-token breaker "a" two tokens back: repeats may reach back 2 tokens at most
    assert dry_repeat_lengths(SEQ, breakers={A: ((),)}, **kw) == {C: 2, Y: 2}
    # two-token breaker "y a", whose head is 3 back: limit 3 - 1 = 2
    assert dry_repeat_lengths(SEQ, breakers={Y: ((A,),)}, **kw) == {C: 2, Y: 2}
    # breaker "y b" does not match the text ("y a"): no limit
    assert dry_repeat_lengths(SEQ, breakers={Y: ((B,),)}, **kw) == {C: 3, Y: 2}
    # a limit under allowed_length switches DRY off for this step
    assert dry_repeat_lengths(SEQ, breakers={B: ((),)}, **kw) == {}


def test_dry_penalties_hand_computed():
    logits = [0.0, 0.0, 5.0, 5.0]
    kw = dict(multiplier=0.8, base=1.75, allowed_length=2, penalty_last_n=64)
    c = dry(cand(logits), SEQ, breakers={}, **kw)
    # c: 0.8 * 1.75 ** (3 - 2); y: 0.8 * 1.75 ** 0
    assert as_dict(c) == pytest.approx({0: 0.0, 1: 0.0, 2: 5.0 - 1.4, 3: 5.0 - 0.8})
    # a single-token breaker is never penalised itself
    c = dry(cand(logits), SEQ, breakers={Y: ((),)}, **kw)
    assert as_dict(c) == pytest.approx({0: 0.0, 1: 0.0, 2: 5.0 - 1.4, 3: 5.0})
    for off in ({"multiplier": 0.0}, {"base": 0.99}, {"penalty_last_n": 0}):
        assert as_dict(dry(cand(logits), SEQ, breakers={}, **{**kw, **off})) == as_dict(cand(logits))


def test_dry_exponent_is_clamped_to_keep_the_penalty_finite():
    # base 2: exponent capped at int(88.72 / ln 2) = 128
    c = dry(cand([0.0, 0.0]), [1] * 300, multiplier=0.5, base=2.0, allowed_length=2,
            penalty_last_n=-1, breakers={})
    assert as_dict(c)[1] == pytest.approx(-0.5 * 2.0**128, rel=1e-6)


def test_breaker_table_scans_the_vocabulary():
    pieces = [b"a", b"b:", b"\n\n", b"x", b"ab", b"c", b"xa", b"bc"]
    tokenize = lambda text: [{"a": 0, "b": 1, "c": 5, "bc": 7}[text]] if text in ("a", "b", "c", "bc") \
        else [{"a": 0, "b": 1, "c": 5}[ch] for ch in text]
    assert build_breaker_table(["\n", ":"], pieces, tokenize) == {1: ((),), 2: ((),)}
    # "abc": "ab" ends with "ab" (tail "c"), "xa" and "a" end with "a" (tail "bc"),
    # "bc" contains no "a" and is no prefix; "abc" inside a token would be a single-token breaker
    table = build_breaker_table(["abc"], pieces, tokenize)
    assert table == {0: ((7,),), 4: ((5,),), 6: ((7,),)}
    assert build_breaker_table([""], pieces, tokenize) == {}


def test_dry_vocab_caches_per_breaker_set():
    calls = []
    vocab = DryVocab([b"a", b":"], lambda t: calls.append(t) or [0])
    first = vocab.breaker_table((":",))
    assert vocab.breaker_table((":",)) is first and first == {1: ((),)}
    assert vocab.breaker_table(("\n",)) == {}
