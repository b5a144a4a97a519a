"""The speculative-decoding options at startup: what each honours, accepts inert, or refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.cli.flags import parse_server_args
from mlxcel.cli.options_spec import spec_config
from mlxcel.config.refusal import StartupRefusal
from mlxcel.engine.speculative import DRAFT, NGRAM_SIMPLE


def parse(*args, env=None):
    return parse_server_args(["-m", "x", *args], env or {})


def test_spec_type_selects_an_implemented_drafter_and_refuses_the_rest():
    assert parse().spec.type is None and spec_config(parse(), None) is None
    assert parse("--spec-type", "none").spec.type == "none"
    s = parse("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8")
    c = spec_config(s, None)
    assert (c.kind, c.ngram_size_n, c.ngram_size_m) == (NGRAM_SIMPLE, 3, 8)
    assert parse(env={"LLAMA_ARG_SPEC_TYPE": "draft-simple"}).spec.type == DRAFT
    for other in ("ngram-mod", "draft-mtp", "ngram-cache", "draft-eagle3"):
        with pytest.raises(StartupRefusal, match="does not implement.*draft-simple"):
            parse("--spec-type", other)
    with pytest.raises(StartupRefusal, match="one drafter at a time"):
        parse("--spec-type", "draft-simple,ngram-simple")
    with pytest.raises(StartupRefusal, match="unknown speculative type"):
        parse("--spec-type", "bogus")


def test_draft_model_options_are_honoured():
    s = parse("-md", "some/draft", "--spec-draft-n-max", "5", "--spec-draft-n-min", "2", "--draft-p-min", "0.5",
              "--spec-draft-p-split", "0.3", "-ctkd", "f16", "-ctvd", "f16")
    assert (s.spec.draft_model, s.spec.draft_n_max, s.spec.draft_n_min, s.spec.draft_p_min) == ("some/draft", 5, 2, 0.5)
    assert spec_config(parse("-md", "d", "--spec-type", "none"), Path("/d")) is None  # an explicit none wins
    c = spec_config(s, Path("/store/some/draft"))  # a draft model alone means draft-simple
    assert (c.kind, c.n_max, c.n_min, c.p_min) == (DRAFT, 5, 2, 0.5)
    assert c.props() == {"draft_model": "draft", "kind": DRAFT, "n_max": 5}
    assert parse(env={"LLAMA_ARG_SPEC_DRAFT_N_MAX": "7"}).spec.draft_n_max == 7
    assert parse("-hfd", "org/draft-mlx").spec.draft_hf == "org/draft-mlx"
    with pytest.raises(StartupRefusal, match="GGUF quantization"):
        parse("--spec-draft-hf", "org/draft:Q4_K_M")
    for bad in (("--spec-draft-n-max", "0"), ("--spec-draft-n-min", "-1"), ("--spec-draft-p-min", "1.5"),
                ("--spec-draft-type-k", "q8_0"), ("-ctvd", "bf16")):
        with pytest.raises(StartupRefusal):
            parse(*bad)
    with pytest.raises(StartupRefusal, match="needs a draft checkpoint"):
        spec_config(parse("--spec-type", "draft-simple"), None)
    with pytest.raises(StartupRefusal, match="exceeds --spec-draft-n-max"):
        spec_config(parse("--spec-draft-n-min", "4"), Path("/d"))


def test_other_modes_knobs_are_inert_at_defaults_and_refused_otherwise():
    assert parse("--spec-ngram-mod-n-max", "64", "--spec-ngram-map-k-size-n", "12", "--spec-ngram-map-k4v-min-hits",
                 "1", "--spec-ngram-simple-min-hits", "3").spec.type is None
    for flag, value in (("--spec-ngram-mod-n-min", "8"), ("--spec-ngram-mod-n-match", "4"),
                        ("--spec-ngram-map-k-size-m", "9"), ("--spec-ngram-map-k4v-size-n", "3")):
        with pytest.raises(StartupRefusal, match="only n-gram drafter is ngram-simple"):
            parse(flag, value)
    for flag in ("--lookup-cache-static", "-lcd"):
        with pytest.raises(StartupRefusal, match="ngram-cache.*--spec-type ngram-simple"):
            parse(flag, "cache.bin")


def test_speculation_without_a_generation_model_is_refused():
    from mlxcel.cli.options_spec import refuse_unused

    refuse_unused(parse("--spec-type", "none"), "the router")  # nothing asked: nothing refused
    for args in (("-md", "d"), ("--spec-type", "ngram-simple"), ("-hfd", "o/d")):
        with pytest.raises(StartupRefusal, match="runs the router"):
            refuse_unused(parse(*args), "the router")


def test_a_draft_must_share_the_target_vocabulary():
    from mlxcel.cli.options_spec import check_draft
    from tests.fixtures import DEFAULT_MODEL, QWEN2_TINY, available, fixture_path

    if not (available(DEFAULT_MODEL) and available(QWEN2_TINY)):
        pytest.skip("fixtures not built")
    from mlxcel.runtime.load import select_backend

    s = parse("--backend", "mlx")
    placed = select_backend(s, fixture_path(DEFAULT_MODEL))  # the target's choice, as the CLI settles it
    with pytest.raises(StartupRefusal, match="vocabulary differs from the target's"):
        check_draft(s, fixture_path(DEFAULT_MODEL), fixture_path(QWEN2_TINY), placed)


def test_a_draft_of_an_unsupported_type_is_refused_before_its_load(tmp_path):
    import json

    from mlxcel.backends.select import Choice
    from mlxcel.cli.options_spec import check_draft
    from tests.fixtures import DEFAULT_MODEL, fixture_path

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral_unknown"}))
    with pytest.raises(StartupRefusal, match=r"--spec-draft-model .*'mistral_unknown' is not supported \(nearest "
                                             r"supported: mistral[,)].*docs/models.md"):
        check_draft(parse("--backend", "mlx"), fixture_path(DEFAULT_MODEL), tmp_path, Choice("mlx", "cpu", "requested"))
