"""Plain data that crosses the engine boundary: requests in, token events out."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from mlxcel.engine.sampling import ProbsReport
from mlxcel.engine.sampling_params import SamplingParams

_ids = itertools.count(1)


@dataclass
class GenerationRequest:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = -1  # -1: until the context is full
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    id: int = field(default_factory=lambda: next(_ids))
    # native llama-server request knobs (the route fills them; defaults change nothing)
    n_indent: int = 0  # stop when a generated line is indented less than this (0: off)
    t_max_predict_ms: int = -1  # stop at a newline once prediction ran this long (<= 0: off)
    return_progress: bool = False  # emit prompt-progress events during prefill
    cache_prompt: bool = True  # may the prompt cache supply a prefix (the scheduler's call)
    n_keep: int = 0  # prompt tokens kept on a context shift (-1: all); the scheduler's call
    n_discard: int = 0  # tokens dropped per context shift (0: half); the scheduler's call
    id_slot: int = -1  # requested slot (-1: any); the scheduler's call
    # SAE steering for this request's rows: layer -> residual delta (None: unsteered); see ForwardRow
    steering: dict | None = None
    capture: dict | None = None  # layer -> residual reader; see ForwardRow
    # LoRA scale per loaded adapter (models/lora.py); None: the server's live scales, read when
    # the engine accepts the request, so a later POST /lora-adapters never reaches it
    lora: tuple | None = None
    lora_asked: tuple = ()  # the request's own `lora` entries as (id, scale), for generation_settings
    # a CompiledGrammar (engine/grammar.py): every row gets its own matcher at admission
    grammar: object | None = None
    # special tokens whose text the detokenizer keeps (tool-call markers the chat parser reads)
    keep_tokens: frozenset = frozenset()
    reasoning: object | None = None  # a ReasoningBudget (engine/reasoning_budget.py): the thinking budget
    # a request's images (the backend's payload: backends/torch/vlm.Media, backends/mlx/vlm.MLXMedia),
    # carried on each row's sequence
    media: object | None = None
    # the prompt as the prefix cache keys it, where it differs from `prompt`: each image's tokens
    # stand for that image (an image-pad id is the same for every picture). A request with media
    # but no key skips the prompt cache.
    cache_tokens: list[int] | None = None


@runtime_checkable
class PrefixKeyed(Protocol):
    """A media payload whose backend resumes its prompt from the prefix cache, given this key."""

    cache_tokens: list[int]


@dataclass
class Timings:
    cache_n: int = 0  # prompt tokens the prompt cache supplied (the scheduler fills it)
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    # speculative decoding, set only once a verify round ran (engine/speculative.py)
    draft_n: int | None = None  # draft tokens verified
    draft_n_accepted: int | None = None  # of which the target emitted as drafted
    draft_rounds: int | None = None  # verify forwards (mean accepted per round = accepted / rounds)
    draft_kind: str | None = None  # which drafter: draft-simple | ngram-simple


@dataclass
class PromptProgress:
    """Prefill progress of one request, as b10621's `prompt_progress`."""

    total: int
    cache: int
    processed: int
    time_ms: float


@dataclass
class TokenEvent:
    """One step of one request. `text` is newly releasable text (may be empty while a
    stop-string candidate or a partial character is withheld). The last event of a
    request has `finish_reason` set (or `error`)."""

    text: str = ""
    token: int | None = None
    finish_reason: str | None = None  # "stop" | "length"
    stop_type: str = "none"  # b10621: "eos" | "word" | "limit" | "none"
    stopping_word: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    slot: int = -1
    timings: Timings | None = None
    error: str | None = None
    error_code: str | None = None
    probs: ProbsReport | None = None  # the sampled token's probability report (n_probs > 0)
    has_new_line: bool = False  # some emitted text so far contained a newline
    truncate_to: int | None = None  # final only: keep this many characters of the content
    progress: PromptProgress | None = None  # a prompt-progress event (no text, no token)
    truncated: bool = False  # final only: the context bound was reached (shifted or stopped there)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class EngineError(Exception):
    """A request the engine refuses (context overflow, queue full, ...)."""

    def __init__(self, message: str, code: str, status: int = 400, **details) -> None:
        super().__init__(message)
        self.message, self.code, self.status, self.details = message, code, status, details


@dataclass
class SlotInfo:
    """One slot as /slots reports it: who occupies it and how far it got."""

    id: int
    n_ctx: int
    is_processing: bool
    id_task: int = -1
    n_prompt_tokens: int = 0
    n_prompt_tokens_processed: int = 0
    n_prompt_tokens_cache: int = 0
    request: GenerationRequest | None = None  # the current (or last) request's parameters
    has_next_token: bool = False
    has_new_line: bool = False
    n_remain: int = 0
    n_decoded: int = 0


@dataclass
class EngineStats:
    """Counters for /metrics. `*_total` run since start; the bucket fields count since the
    previous `Engine.stats(reset_bucket=True)`, so throughput gauges cover one scrape window."""

    t_start: float = 0.0  # unix time the engine started
    n_prompt_tokens_processed_total: int = 0  # prefilled, so the prompt cache's tokens are not in it
    n_prompt_tokens_cached_total: int = 0  # prompt tokens the prompt cache supplied instead
    t_prompt_processing_total: float = 0.0  # ms
    n_tokens_predicted_total: int = 0
    t_tokens_generation_total: float = 0.0  # ms
    n_prompt_tokens_processed: int = 0
    t_prompt_processing: float = 0.0  # ms
    n_tokens_predicted: int = 0
    t_tokens_generation: float = 0.0  # ms
    n_decode_total: int = 0  # backend forward calls
    n_busy_slots_total: int = 0  # sum over forward calls of the rows in them
    n_tokens_max: int = 0  # the longest sequence seen (prompt + generated)
    n_draft_tokens_total: int = 0  # speculative: draft tokens sent to verification
    n_draft_accepted_total: int = 0  # of which the target emitted as drafted
    n_draft_rounds_total: int = 0  # verify forwards
    n_draft_accepted_per_pos: list[int] = field(default_factory=list)  # accepted tokens by draft position
    n_processing: int = 0  # requests holding a slot now
    n_deferred: int = 0  # requests waiting for a slot now
    kv_cache_tokens: int = 0  # tokens held in live sequences
    kv_cache_capacity: int = 0  # n_ctx * parallel
    kv_blocks_total: int = 0  # the paged pool, in blocks
    kv_blocks_used: int = 0  # referenced by live sequences or the prompt cache
    kv_blocks_cached: int = 0  # held by the prompt cache
    kv_blocks_free: int = 0
    kv_bytes_capacity: int = 0  # the pool at its full size, in bytes (engine/kv_memory.py)
    kv_bytes_used: int = 0
    kv_bytes_cached: int = 0
    kv_bytes_resident: int = 0  # what the backend's storage has allocated so far
    n_rejected_total: int = 0  # refused with queue_full
