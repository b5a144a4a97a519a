"""The b10621 sampling flags through the real parser: values, sentinels and refusals.

A request inheriting them end to end is tests/e2e/test_sampling_defaults.py."""

from __future__ import annotations

import pytest

from mlxcel.cli.flags import StartupRefusal, parse_server_args
from mlxcel.cli.options_sampling import parse_logit_bias, process_escapes
from mlxcel.engine.sampling_params import DEFAULT_DRY_SEQUENCE_BREAKERS
from mlxcel.engine.tokenizer import GenerationDefaults
from mlxcel.runtime.load import resolve_sampling_defaults


def parse(*argv: str):
    return parse_server_args(["-m", "x", *argv], {})


def defaults(*argv: str, n_vocab: int = 1000):
    return resolve_sampling_defaults(parse(*argv), GenerationDefaults(), n_vocab)


def test_each_numeric_flag_lands_on_its_sampler_field():
    p = defaults("--top-nsigma", "1.5", "--typical", "0.9", "--repeat-last-n", "-1", "--repeat-penalty", "1.1",
                 "--presence-penalty", "0.2", "--frequency-penalty", "0.3", "--dry-multiplier", "0.5",
                 "--dry-base", "2", "--dry-allowed-length", "3", "--dry-penalty-last-n", "-1",
                 "--dynatemp-range", "0.5", "--dynatemp-exp", "1.5", "--mirostat", "2", "--mirostat-lr", "0.2",
                 "--mirostat-ent", "4", "--xtc-probability", "0.1", "--xtc-threshold", "0.2",
                 "--adaptive-target", "0.5", "--adaptive-decay", "0.8")
    assert (p.top_n_sigma, p.typical_p, p.repeat_last_n, p.repeat_penalty, p.presence_penalty,
            p.frequency_penalty) == (1.5, 0.9, -1, 1.1, 0.2, 0.3)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.5, 2.0, 3, -1)
    assert (p.dynatemp_range, p.dynatemp_exponent, p.mirostat, p.mirostat_eta, p.mirostat_tau) == \
        (0.5, 1.5, 2, 0.2, 4.0)
    assert (p.xtc_probability, p.xtc_threshold, p.adaptive_target, p.adaptive_decay) == (0.1, 0.2, 0.5, 0.8)
    assert defaults("--typical-p", "0.7", "--top-n-sigma", "2").typical_p == 0.7  # the alternative spellings


def test_unset_flags_keep_b10621_defaults():
    p = defaults()
    assert (p.repeat_last_n, p.dry_base, p.mirostat, p.top_n_sigma, p.dry_sequence_breakers) == \
        (64, 1.75, 0, -1.0, DEFAULT_DRY_SEQUENCE_BREAKERS)
    assert defaults("--dry-base", "0").dry_base == 1.75  # 0 keeps the default, as upstream


def test_sampler_order_spellings():
    assert defaults("--samplers", "top_k;temp;nucleus;typical").samplers == ("top_k", "temperature", "top_p", "typ_p")
    assert defaults("--sampler-seq", "kta").samplers == ("top_k", "temperature", "adaptive_p")
    assert defaults("--sampling-seq", "edskypmxt").samplers[0] == "penalties"


def test_breakers_replace_the_defaults_unescape_and_none_clears():
    assert defaults("--dry-sequence-breaker", "\\n", "--dry-sequence-breaker", "END").dry_sequence_breakers == \
        ("\n", "END")
    assert defaults("--dry-sequence-breaker", "none").dry_sequence_breakers == ()
    assert defaults("--no-escape", "--dry-sequence-breaker", "\\n").dry_sequence_breakers == ("\\n",)
    assert process_escapes("a\\tb\\x41\\q") == "a\tbA\\q"


def test_logit_bias_and_ignore_eos():
    s = parse("-l", "15+1", "--logit-bias", "15-0.5", "-l", "7-2", "--ignore-eos")
    assert s.sampling.ignore_eos is True
    p = resolve_sampling_defaults(s, GenerationDefaults(), 1000)
    assert dict(p.logit_bias) == {15: 0.5, 7: -2.0}
    assert parse_logit_bias(" 3 +1e1") == (3, 10.0)
    with pytest.raises(StartupRefusal, match="outside the model's vocabulary"):
        resolve_sampling_defaults(parse("-l", "5000+1"), GenerationDefaults(), 1000)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--samplers", "top_k;bogus"], "unknown sampler name 'bogus'"),
    (["--samplers", "infill"], "infill sampler is not supported"),
    (["--sampler-seq", "kz"], "unknown sampler code 'z'"),
    (["--mirostat", "3"], "expected one of: 0, 1, 2"),
    (["--repeat-last-n", "-2"], "expected >= -1"),
    (["--dry-penalty-last-n", "-5"], "expected >= -1"),
    (["--dry-allowed-length", "-1"], "expected >= 0"),
    (["--repeat-penalty", "0"], "repeat_penalty must be > 0"),
    (["--typical", "lots"], "expected a number"),
    (["-l", "15"], "invalid input format"),
    (["-l", "15*2"], "invalid input format"),
])
def test_refusals(argv, needle):
    with pytest.raises(StartupRefusal, match=needle):
        parse(*argv)


@pytest.mark.parametrize("argv", [["-l", "5+1e308"], ["-l", "5+inf"], ["-l", "5+3e38", "-l", "5+3e38"]])
def test_a_default_bias_past_float32_is_refused_at_startup(argv):
    """Such a default would make every request that keeps it fail in the sampler."""
    from mlxcel.cli.server import check_model_overrides

    with pytest.raises(StartupRefusal, match="--logit-bias 5: a bias above"):
        check_model_overrides(parse(*argv), {"vocab_size": 100})
    check_model_overrides(parse("-l", "5-inf", "-l", "6+3e38"), {"vocab_size": 100})
