"""RoPE override flags -> the config entries a family builds its rotation from (pure logic)."""

from __future__ import annotations

import pytest

from mlxcel.cli.flags import StartupRefusal, parse_server_args
from mlxcel.config.rope import RopeOverrides
from mlxcel.models.rope_overrides import RopeRefused, config_overrides

PLAIN = {"rope_theta": 10000.0, "max_position_embeddings": 8192}
LLAMA3 = {**PLAIN, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
YARN = {**PLAIN, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 24, "mscale": 0.7}}


def rope(*argv: str) -> RopeOverrides:
    return parse_server_args(["-m", "x", *argv], {}).backend.rope


def test_sentinels_ask_for_nothing():
    o = rope("--rope-freq-base", "0", "--rope-freq-scale", "0", "--yarn-orig-ctx", "0", "--yarn-beta-fast", "-1")
    assert not o.requested and config_overrides(PLAIN, o) == {}


def test_freq_base_and_linear_scale():
    assert config_overrides(PLAIN, rope("--rope-freq-base", "5e5")) == {"rope_theta": 5e5}
    # a bare scale on a plain checkpoint is linear (b10621's default scheme)
    assert config_overrides(PLAIN, rope("--rope-scale", "4")) == {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert config_overrides(PLAIN, rope("--rope-freq-scale", "0.5"))["rope_scaling"]["factor"] == 2.0
    assert config_overrides(PLAIN, rope("--rope-scaling", "linear"))["rope_scaling"]["factor"] == 1.0
    assert config_overrides(LLAMA3, rope("--rope-scaling", "none")) == {"rope_scaling": {"rope_type": "default"}}
    # transformers >= 5 nests the block: its default rotation is the plain one
    nested = {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    assert config_overrides(nested, rope("--rope-scale", "2"))["rope_scaling"]["rope_type"] == "linear"


def test_yarn_knobs_against_another_rotation_configure_nothing():
    assert config_overrides(PLAIN, rope("--yarn-beta-fast", "16")) == {}
    assert config_overrides(PLAIN, rope("--rope-scaling", "linear", "--yarn-orig-ctx", "4096")) == \
        {"rope_scaling": {"rope_type": "linear", "factor": 1.0}}


def test_yarn_forced_and_tuned():
    got = config_overrides(PLAIN, rope("--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-beta-slow", "2"))
    assert got["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                                   "beta_fast": 32, "beta_slow": 2.0}
    # the checkpoint's own YaRN block is tuned: its factor and knobs stay unless overridden
    got = config_overrides(YARN, rope("--yarn-orig-ctx", "2048", "--rope-freq-scale", "0.125"))["rope_scaling"]
    assert (got["factor"], got["original_max_position_embeddings"], got["beta_fast"], got["mscale"]) == \
        (8.0, 2048, 24, 0.7)
    assert config_overrides(YARN, rope("--yarn-ext-factor", "1.0", "--yarn-attn-factor", "1"))["rope_scaling"][
        "factor"] == 4.0


@pytest.mark.parametrize(("config", "argv", "needle"), [
    (LLAMA3, ["--rope-scale", "2"], "llama3 RoPE scheme"),
    (YARN, ["--yarn-ext-factor", "0.5"], "always use 1.0"),
    (YARN, ["--yarn-attn-factor", "2"], "no parameter for another value"),
])
def test_refusals(config, argv, needle):
    with pytest.raises(RopeRefused, match=needle):
        config_overrides(config, rope(*argv))


@pytest.mark.parametrize(("argv", "needle"), [
    (["--rope-scaling", "dynamic"], "expected one of: none, linear, yarn"),
    (["--rope-scale", "0"], "expected a number > 0"),
    (["--rope-scale", "2", "--rope-freq-scale", "0.5"], "give one"),
])
def test_flag_refusals(argv, needle):
    with pytest.raises(StartupRefusal, match=needle):
        rope(*argv)


def test_startup_check_refuses_before_the_load():
    from mlxcel.cli.server import check_model_overrides

    settings = parse_server_args(["-m", "x", "--rope-scale", "2"], {})
    with pytest.raises(StartupRefusal, match="llama3 RoPE scheme"):
        check_model_overrides(settings, LLAMA3)
    with pytest.raises(StartupRefusal, match="outside the model's vocabulary"):
        check_model_overrides(parse_server_args(["-m", "x", "-l", "50+1"], {}), {**PLAIN, "vocab_size": 10})


def test_transformers_rope_parameters():
    from mlxcel.models.rope_overrides import hf_rope_parameters

    plain = {"rope_theta": 1e6, "rope_type": "default"}
    assert hf_rope_parameters(plain, {"rope_theta": 1e4}) == {"rope_theta": 1e4, "rope_type": "default"}
    assert hf_rope_parameters(plain, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}) == \
        {"rope_theta": 1e6, "rope_type": "linear", "factor": 4.0}
    gemma = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": dict(plain)}
    got = hf_rope_parameters(gemma, {"rope_theta": 5e5})
    assert got["sliding_attention"]["rope_theta"] == 1e4 and got["full_attention"]["rope_theta"] == 5e5
