"""Request structs of the native llama-server routes.

`NativeCompletionRequest` declares every b10621 /completion field (native-fields.tsv: 66
schema fields, their 6 aliases, `prompt` and `id_slot`, plus the nested
`stream_options.include_usage`), each as its own struct field so an alias is a field of
the same name. Every field defaults to None: the body's nulls are dropped before
conversion, so None always means "not sent" and the server default applies.
`native_params.py` turns one of these into engine types.
"""

from __future__ import annotations

from typing import Any

import msgspec


class NativeStreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class NativeCompletionRequest(msgspec.Struct, kw_only=True):
    # response shape
    verbose: bool | None = None
    timings_per_token: bool | None = None
    stream: bool | None = None
    stream_options: NativeStreamOptions | None = None
    cache_prompt: bool | None = None
    return_tokens: bool | None = None
    return_progress: bool | None = None
    sse_ping_interval: int | None = None
    response_fields: Any = None
    # length and shape of the generation
    n_predict: int | None = None
    max_completion_tokens: int | None = None  # alias of n_predict
    max_tokens: int | None = None  # alias of n_predict
    n_indent: int | None = None
    n_keep: int | None = None
    n_discard: int | None = None
    n_cmpl: int | None = None
    n: int | None = None  # alias of n_cmpl
    n_cache_reuse: int | None = None
    t_max_predict_ms: int | None = None
    # sampling
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    typical_p: float | None = None
    temperature: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    repeat_last_n: int | None = None
    repeat_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: Any = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    adaptive_target: float | None = None
    adaptive_decay: float | None = None
    seed: int | None = None
    n_probs: int | None = None
    logprobs: int | None = None  # alias of n_probs
    min_keep: int | None = None
    backend_sampling: bool | None = None
    post_sampling_probs: bool | None = None
    logit_bias: Any = None
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None
    samplers: Any = None
    lora: Any = None  # [{id, scale}, ...]: this request's LoRA scales (api/llamacpp/lora_adapters.py)
    # grammars, chat parsing: refused when they ask for a change (see native_params)
    json_schema: Any = None
    grammar: Any = None  # alias handled with json_schema
    grammar_lazy: bool | None = None
    grammar_type: Any = None
    chat_format: Any = None
    reasoning_format: Any = None
    generation_prompt: Any = None
    parse_tool_calls: bool | None = None
    chat_parser: Any = None
    continue_final_message: Any = None
    echo: bool | None = None
    preserved_tokens: Any = None
    grammar_triggers: Any = None
    reasoning_control: bool | None = None
    reasoning_budget_tokens: int | None = None
    reasoning_budget_start_tag: Any = None
    reasoning_budget_end_tags: Any = None
    reasoning_budget_end_tag: Any = None  # alias of reasoning_budget_end_tags
    reasoning_budget_message: Any = None
    # read by the handler, outside the schema
    prompt: Any = None
    id_slot: int | None = None
    message_delimiters: Any = None
    # upstream compiles these out (#if 0): accepted and inert there, so here too
    speculative_n_max: Any = msgspec.field(default=None, name="speculative.n_max")
    speculative_n_min: Any = msgspec.field(default=None, name="speculative.n_min")
    speculative_p_min: Any = msgspec.field(default=None, name="speculative.p_min")
    speculative_type: Any = msgspec.field(default=None, name="speculative.type")
    speculative_ngram_size_n: Any = msgspec.field(default=None, name="speculative.ngram_size_n")
    speculative_ngram_size_m: Any = msgspec.field(default=None, name="speculative.ngram_size_m")
    speculative_ngram_m_hits: Any = msgspec.field(default=None, name="speculative.ngram_m_hits")
    # the router's model selector; a single-model server checks it names the loaded model
    model: str | None = None


def declared_names(struct: type[msgspec.Struct]) -> frozenset[str]:
    """The JSON names a struct declares (renames applied)."""
    return frozenset(msgspec.structs.fields(struct)[i].encode_name
                     for i in range(len(msgspec.structs.fields(struct))))
