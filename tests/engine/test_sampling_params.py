"""SamplingParams, the seed fold, sampler-order names and logit_bias resolution."""

import math

import pytest

from mlxcel.engine.sampling_params import (
    DEFAULT_DRY_SEQUENCE_BREAKERS, DEFAULT_SAMPLERS, SamplingParams, fold_seed,
    resolve_logit_bias, samplers_from_chars, samplers_from_names,
)


@pytest.mark.parametrize("raw, folded", [
    (None, None), (-1, None), (4294967295, None), (-2, 4294967294), (0, 0), (42, 42),
    (-(2**31), 2**31), (4294967294, 4294967294), (7.0, 7),
])
def test_fold_seed(raw, folded):
    assert fold_seed(raw) == folded


@pytest.mark.parametrize("raw", [-(2**31) - 1, 2**32, True, 1.5, "3", float("nan")])
def test_fold_seed_refuses_outside_the_domain(raw):
    with pytest.raises(ValueError):
        fold_seed(raw)


def test_params_fold_their_seed_and_keep_b10621_defaults():
    p = SamplingParams(seed=-2)
    assert p.seed == 4294967294
    assert SamplingParams(seed=4294967295).seed is None
    d = SamplingParams()
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.typical_p, d.top_n_sigma) == \
        (0.8, 40, 0.95, 0.05, 1.0, -1.0)
    assert (d.repeat_last_n, d.repeat_penalty, d.frequency_penalty, d.presence_penalty) == \
        (64, 1.0, 0.0, 0.0)
    assert (d.dry_multiplier, d.dry_base, d.dry_allowed_length, d.dry_penalty_last_n) == \
        (0.0, 1.75, 2, 64)
    assert d.dry_sequence_breakers == DEFAULT_DRY_SEQUENCE_BREAKERS == ("\n", ":", '"', "*")
    assert (d.xtc_probability, d.xtc_threshold, d.min_keep) == (0.0, 0.1, 0)
    assert (d.mirostat, d.mirostat_tau, d.mirostat_eta) == (0, 5.0, 0.1)
    assert (d.dynatemp_range, d.dynatemp_exponent) == (0.0, 1.0)
    assert (d.adaptive_target, d.adaptive_decay) == (-1.0, 0.9)
    assert d.samplers == DEFAULT_SAMPLERS
    assert (d.seed, d.n_probs, d.post_sampling_probs, dict(d.logit_bias)) == (None, 0, False, {})


@pytest.mark.parametrize("kwargs", [
    {"samplers": ("top_k", "bogus")}, {"samplers": ("infill",)}, {"mirostat": 3},
    {"n_probs": -1}, {"min_keep": -1}, {"repeat_last_n": -2}, {"dry_penalty_last_n": -2},
    {"logit_bias": {-1: 1.0}}, {"logit_bias": {1: float("nan")}}, {"seed": 2**32},
    {"repeat_penalty": 0.0}, {"top_p": float("nan")},
])
def test_params_refuse_what_the_chain_cannot_run(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_logit_bias_is_read_only():
    p = SamplingParams(logit_bias={3: 1.5})
    with pytest.raises(TypeError):
        p.logit_bias[3] = 2.0  # type: ignore[index]


def test_sampler_orders():
    assert samplers_from_chars("edskypmxt") == DEFAULT_SAMPLERS
    assert samplers_from_names(["top_k", "temperature"]) == ("top_k", "temperature")
    assert samplers_from_names(["top-k", "temp", "nucleus"], allow_alt_names=True) == \
        ("top_k", "temperature", "top_p")
    assert samplers_from_chars("kta") == ("top_k", "temperature", "adaptive_p")
    with pytest.raises(ValueError):
        samplers_from_names(["top-k"])  # alt names only where allowed
    with pytest.raises(ValueError):
        samplers_from_chars("kq")
    with pytest.raises(ValueError, match="infill"):
        samplers_from_chars("i")


def _tokenize(text):
    # a toy tokenizer: one token per character, id = code point
    return [ord(ch) for ch in text]


def test_logit_bias_pairs():
    raw = [[5, 1.5], ["ab", -2], [7, False], [8, True], [9999, 1.0], [-1, 1.0],
           [2.0, 1.0], ["x"], "junk", [6, "str"]]
    assert resolve_logit_bias(raw, _tokenize, n_vocab=1000) == {
        5: 1.5, ord("a"): -2.0, ord("b"): -2.0, 7: -math.inf}


def test_logit_bias_object():
    raw = {"15": 1.0, "ab": False, " 3": 2, "+4": 0.5, "-4": 1.0, "": 0.25,
           "99999": 1.0, "t": True}
    assert resolve_logit_bias(raw, _tokenize, n_vocab=1000) == {
        15: 1.0, ord("a"): -math.inf, ord("b"): -math.inf, 3: 2.0, 4: 0.5, 0: 0.25}


def test_logit_bias_repeated_ids_add_up():
    assert resolve_logit_bias([[5, 1.0], [5, 0.5], ["aa", 1.0]], _tokenize, n_vocab=200) == {
        5: 1.5, ord("a"): 2.0}
    assert resolve_logit_bias({"5": 1.0, "a": False, "aa": 3.0}, _tokenize, n_vocab=200)[
        ord("a")] == -math.inf
    assert resolve_logit_bias(None, _tokenize, n_vocab=10) == {}


@pytest.mark.parametrize("bias", [{5: math.inf}, {5: 6e38}, resolve_logit_bias([[5, 3e38], [5, 3e38]], _tokenize,
                                                                               n_vocab=10)])
def test_a_bias_past_float32s_range_is_refused(bias):
    """+inf (1e308 rounds to it, as upstream's C float does) or a sum past float32's largest value
    makes the biased logit +inf, which no sampler can draw from: refused (a 400), not run."""
    with pytest.raises(ValueError, match="logit_bias for token 5"):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={5: -math.inf, 6: 3.4e38}).logit_bias[5] == -math.inf
