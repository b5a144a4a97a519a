"""The one place a validated API request becomes engine input.

Every surface checks its own fields with its own wording, then states what it asked for as
a `Sampling`; `generation_request` turns that into a `GenerationRequest` (the server's
sampling defaults overridden, the seed folded, the logit bias and --ignore-eos resolved,
the request's LoRA scales read), and `reasoning_budget` turns resolved thinking-budget
fields into the engine's `ReasoningBudget`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from mlxcel.api.errors import ApiError
from mlxcel.runtime.served import ServedModel
from mlxcel.engine.reasoning_budget import ReasoningBudget, ReasoningControl
from mlxcel.engine.sampling_params import fold_seed
from mlxcel.engine.types import GenerationRequest


@dataclass
class Sampling:
    """What one row asks of the sampler, already validated by its surface."""

    max_tokens: int
    overrides: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields the request sets
    seed: int | None = None  # the row's own seed (None: the server's)
    bias: dict[int, float] | None = None  # token id -> bias; None: the server's -l set
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    lora: Any = None  # the request's `lora` field as sent (None: the server's scales)
    cache_prompt: bool = True


def generation_request(model: ServedModel, sampling: Sampling, prompt: list[int],
                       **engine: Any) -> GenerationRequest:
    """One engine request; `engine` sets the other GenerationRequest fields (native knobs,
    the thinking budget)."""
    # imported here: lora_adapters reads the served model through openai/generation, which builds on this module
    from mlxcel.api.llamacpp.lora_adapters import request_lora

    overrides = {**sampling.overrides, "logit_bias": model.request_bias(sampling.bias, sampling.ignore_eos)}
    try:
        params = replace(model.defaults, **overrides)
        if sampling.seed is not None:
            params = replace(params, seed=fold_seed(sampling.seed))
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_parameter") from None
    lora, asked = request_lora(model, sampling.lora)
    return GenerationRequest(prompt=prompt, params=params, max_tokens=sampling.max_tokens, stop=list(sampling.stop),
                             ignore_eos=sampling.ignore_eos, cache_prompt=sampling.cache_prompt, lora=lora,
                             lora_asked=asked, **engine)


def reasoning_budget(model: ServedModel, tokens: int, start: str, end: str, message: str,
                     control: ReasoningControl | None = None) -> ReasoningBudget:
    """The thinking budget: `tokens` thinking tokens (-1: no limit) between the `start` and
    `end` tags, then `message` and the end tag forced; `control` ends it on request."""

    def ids(text: str) -> tuple[int, ...]:
        return tuple(model.tokenizer.encode(text, add_special_tokens=False)) if text else ()

    return ReasoningBudget(budget=tokens, open_ids=ids(start), close_ids=ids(end), message_ids=ids(message),
                           control=control)
