"""Native /completion field parsing: limits, clamps, aliases, nulls, refusals.

Runs against the real default-model tokenizer (no engine is needed to parse a body)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp.native_params import parse_native
from mlxcel.api.llamacpp.schemas import NativeCompletionRequest, NativeStreamOptions, declared_names
from mlxcel.engine.backend import ModelInfo
from mlxcel.engine.sampling_params import RANDOM_SEED, SamplingParams
from mlxcel.engine.tokenizer import Tokenizer
from mlxcel.runtime.served import ServedModel
from tests.conftest import DEFAULT_MODEL, fixture_path

# b10621's 74 counted native fields (native-fields.tsv): 66 schema fields, 6 aliases,
# prompt and id_slot; plus the nested stream_options.include_usage.
B10621_FIELDS = """verbose timings_per_token stream stream_options cache_prompt return_tokens return_progress
sse_ping_interval n_predict max_completion_tokens max_tokens n_indent n_keep n_discard n_cmpl n n_cache_reuse
t_max_predict_ms response_fields top_k top_p min_p top_n_sigma xtc_probability xtc_threshold typical_p
temperature dynatemp_range dynatemp_exponent repeat_last_n repeat_penalty frequency_penalty presence_penalty
dry_multiplier dry_base dry_allowed_length dry_penalty_last_n mirostat mirostat_tau mirostat_eta adaptive_target
adaptive_decay seed n_probs logprobs min_keep backend_sampling post_sampling_probs lora dry_sequence_breakers
json_schema grammar grammar_lazy chat_format reasoning_format generation_prompt parse_tool_calls chat_parser
continue_final_message echo preserved_tokens grammar_triggers reasoning_control reasoning_budget_tokens
reasoning_budget_start_tag reasoning_budget_end_tags reasoning_budget_end_tag reasoning_budget_message logit_bias
ignore_eos stop samplers prompt id_slot""".split()


@pytest.fixture(scope="module")
def model() -> ServedModel:
    path = fixture_path(DEFAULT_MODEL)
    tok = Tokenizer(path)
    info = ModelInfo(path=path, model_type="llama", num_layers=1, vocab_size=tok.vocab_size, context_length=8192,
                     dtype="float32", checkpoint_dtype="bfloat16", quantization=None, backend="mlx", device="cpu")
    return ServedModel(id="m", aliases=[], info=info, tokenizer=tok, engine=None,
                       defaults=SamplingParams(temperature=0.8), n_ctx=8192, n_predict=-1)


def parse(model, **body):
    return parse_native({"prompt": "x", **body}, model, n_parallel=4)


def refused(model, **body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(model, **body)
    assert e.value.status == 400
    return e.value


def test_struct_declares_every_b10621_field():
    assert len(B10621_FIELDS) == 74
    names = declared_names(NativeCompletionRequest)
    assert set(B10621_FIELDS) <= names
    assert "include_usage" in declared_names(NativeStreamOptions)


def test_clamped_fields_clamp(model):
    p = parse(model, top_p=1.5, min_p=-1, temperature=-2, top_k=-5, mirostat=7, xtc_threshold=3,
              adaptive_target=4).template.params
    assert (p.top_p, p.min_p, p.temperature, p.top_k, p.mirostat, p.xtc_threshold, p.adaptive_target) == \
        (1.0, 0.0, 0.0, 0, 2, 1.0, 1.0)


@pytest.mark.parametrize("field,value,bounds", [
    ("n_indent", -1, "0 <= value <= 2147483647"),
    ("n_predict", -2, "-1 <= value <= 2147483647"),
    ("max_tokens", 2**31, "-1 <= value <= 2147483647"),
    ("repeat_last_n", -1, "0 <= value <= 2147483647"),
    ("t_max_predict_ms", -5, "-1 <= value <= 9223372036854775807"),
    ("n_cmpl", 9, "1 <= value <= 4"),
    ("adaptive_decay", 1.0, "0.000000 <= value <= 0.990000"),
])
def test_hard_limits_refuse_with_upstream_wording(model, field, value, bounds):
    err = refused(model, **{field: value})
    assert err.message == f"Field '{field}': Value must be between {bounds}, but got {value}"


def test_n_cmpl_one_accepted_above_refused(model):
    parse(model, n_cmpl=1, n=1)
    assert refused(model, n=2).code == "field_not_honoured"


def test_null_means_absent_and_aliases(model):
    r = parse(model, temperature=None, n_predict=None, max_tokens=7, logprobs=3)
    assert r.template.params.temperature == 0.8
    assert r.template.max_tokens == 7 and r.n_probs == 3 and r.template.params.n_probs == 3
    assert parse(model, n_predict=5, max_completion_tokens=6, max_tokens=7).template.max_tokens == 5
    assert parse(model).template.max_tokens == -1


def test_samplers_both_forms(model):
    assert parse(model, samplers="kt").template.params.samplers == ("top_k", "temperature")
    assert parse(model, samplers=["min_p", "temperature"]).template.params.samplers == ("min_p", "temperature")
    assert "unknown sampler" in refused(model, samplers=["nope"]).message


def test_seed_fold_and_dry_fields(model):
    assert parse(model, seed=-1).template.params.seed is None
    assert parse(model, seed=-2).template.params.seed == RANDOM_SEED - 1
    assert parse(model, dry_base=0.5).template.params.dry_base == 1.75
    assert parse(model, dry_sequence_breakers=["x"]).template.params.dry_sequence_breakers == ("x",)
    assert "non-empty" in refused(model, dry_sequence_breakers=[]).message


def test_ignore_eos_bans_eos_and_logit_bias_resolves(model):
    p = parse(model, ignore_eos=True, logit_bias=[[5, 1.5], ["Paris", False]]).template.params
    for t in model.tokenizer.eos_token_ids:
        assert p.logit_bias[t] == -math.inf
    assert p.logit_bias[5] == 1.5
    for t in model.tokenizer.encode("Paris", add_special_tokens=False):
        assert p.logit_bias[t] == -math.inf


@pytest.mark.parametrize("field,value", [
    ("reasoning_control", True), ("chat_format", 1), ("parse_tool_calls", True), ("reasoning_format", "deepseek"),
    ("chat_parser", "x"), ("generation_prompt", "<|im_start|>assistant"), ("continue_final_message", True),
    ("n_cache_reuse", 8),
])
def test_missing_behaviour_refused_when_asked_for(model, field, value):
    assert refused(model, **{field: value}).code == "field_not_honoured"


def test_no_op_values_and_inert_fields_accepted(model):
    r = parse(model, grammar="", lora=[], echo=True, reasoning_budget_tokens=-1, verbose=True, chat_format=None,
              reasoning_format="none", parse_tool_calls=False, backend_sampling=True, grammar_type="tool_calls",
              stream_options=[1, 2], **{"speculative.n_max": 8, "speculative.type": "draft"})
    assert r.ignored == []


def test_reasoning_budget_fields_build_the_engine_budget(model):
    enc = lambda s: tuple(model.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    b = parse(model, reasoning_budget_tokens=10, reasoning_budget_message="Stop.").template.reasoning
    assert (b.budget, b.open_ids, b.close_ids, b.message_ids) == (10, enc("<think>"), enc("</think>"), enc("Stop."))
    b = parse(model, reasoning_budget_tokens=0, reasoning_budget_start_tag="<r>",
              reasoning_budget_end_tag="</r>").template.reasoning
    assert (b.budget, b.open_ids, b.close_ids, b.message_ids) == (0, enc("<r>"), enc("</r>"), ())
    assert parse(model, reasoning_budget_end_tags=["</a>", "</b>"], reasoning_budget_tokens=1).template \
        .reasoning.close_ids == enc("</a>")
    assert parse(model, reasoning_budget_tokens=-1).template.reasoning is None
    assert refused(model, reasoning_budget_tokens=1, reasoning_budget_end_tags=[""]).param == \
        "reasoning_budget_end_tags"


def test_stream_options_include_usage_type_checked(model):
    assert parse(model, stream_options={"include_usage": True}).template
    assert "include_usage" in refused(model, stream_options={"include_usage": "yes"}).message


def test_type_errors_and_unknown_fields(model):
    refused(model, top_k="many")
    refused(model, stream="yes")
    assert parse(model, frobnicate=1).ignored == ["frobnicate"]


def test_response_fields_and_carried_knobs(model):
    r = parse(model, response_fields=["content"], n_indent=4, t_max_predict_ms=100, cache_prompt=False,
              n_keep=-1, n_discard=8, id_slot=-1, stream=True, return_progress=True)
    t = r.template
    assert r.response_fields == ["content"]
    assert (t.n_indent, t.t_max_predict_ms, t.cache_prompt, t.n_keep, t.n_discard, t.id_slot, t.return_progress) == \
        (4, 100, False, -1, 8, -1, True)
    assert parse(model, id_slot=3).template.id_slot == 3  # pinned to the last of the 4 slots
    for bad in (4, -2):  # a slot that does not exist: refused (upstream would wait forever)
        assert refused(model, id_slot=bad).message == "Invalid slot ID"
    assert parse(model, response_fields="content").response_fields is None  # not a list: whole object
    assert parse(model, return_progress=True).template.return_progress is False  # inert without stream


def test_server_sampling_defaults_are_inherited_unless_the_request_says(model):
    """-l and --ignore-eos (ServedModel) reach a body without the fields; a body's own
    logit_bias replaces the -l set, and its ignore_eos: false drops the EOS ban."""
    from dataclasses import replace

    served = replace(model, defaults=SamplingParams(logit_bias={5: 2.0}, mirostat=2, top_n_sigma=1.5),
                     ignore_eos=True)
    t = parse(served).template
    assert t.ignore_eos is True and t.params.mirostat == 2 and t.params.top_n_sigma == 1.5
    assert t.params.logit_bias[5] == 2.0
    assert all(t.params.logit_bias[e] == -math.inf for e in model.tokenizer.eos_token_ids)
    t = parse(served, ignore_eos=False, logit_bias=[[7, 1.0]]).template
    assert t.ignore_eos is False and dict(t.params.logit_bias) == {7: 1.0}


def test_n_cache_reuse_is_refused_above_zero_naming_the_prefix_cache(model):
    assert parse(model, n_cache_reuse=0).ignored == []
    e = refused(model, n_cache_reuse=256)
    assert (e.code, e.param) == ("field_not_honoured", "n_cache_reuse") and "exact token prefixes" in str(e)


def test_message_delimiters_are_shape_checked_and_change_nothing(model):
    delims = [{"role": "user", "delimiter": "<|im_start|>user"}, {"role": "assistant", "delimiter": "<|im_start|>a"}]
    with_d, without = parse(model, message_delimiters=delims), parse(model)
    assert dataclasses.replace(with_d.template, id=0) == dataclasses.replace(without.template, id=0)
    assert with_d.ignored == []
    for bad in ("user", [1], [{"role": 3}], [{"delimiter": ["x"]}]):
        assert refused(model, message_delimiters=bad).code == "invalid_parameter"


def test_n_probs_is_bounded(model):
    assert parse(model, n_probs=100).n_probs == 100
    for value in (101, 10**6, -1):
        assert refused(model, n_probs=value).param == "n_probs"
