"""GET /metrics: Prometheus text, b10621's `llamacpp:` families name for name.

Gated by --metrics (upstream's 501 otherwise). Counters run since start; the two
throughput gauges cover the window since the previous scrape (each scrape starts a new
window, as upstream resets its bucket). Prompt tokens split as upstream's do: prefilled ones
in `prompt_tokens_total`, those the prompt cache supplied in `prompt_tokens_cached_total`. The
three `spec_decode_*_total` counters are always there (zero without a draft); the per-position
one appears once a draft token was accepted. mlxcel's own families follow the upstream ones.
"""

from __future__ import annotations

from litestar import Response, get

from mlxcel.api.errors import ApiError
from mlxcel.api.openai.generation import served_model
from mlxcel.api.side_workers import generation_refusal, worker_queue
from mlxcel.api.state import AppState
from mlxcel.engine.types import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4"


def _num(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def metric_families(st: EngineStats) -> list[tuple[str, str, str, float | int]]:
    """b10621's families as (name, type, help, value), in its order: counters, then gauges."""
    prompt_rate = 1e3 / st.t_prompt_processing * st.n_prompt_tokens_processed \
        if st.n_prompt_tokens_processed and st.t_prompt_processing > 0 else 0.0
    gen_rate = 1e3 / st.t_tokens_generation * st.n_tokens_predicted \
        if st.n_tokens_predicted and st.t_tokens_generation > 0 else 0.0
    return [
        ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens prefilled (the prompt cache's tokens are not in it).",
         st.n_prompt_tokens_processed_total),
        ("llamacpp:prompt_tokens_cached_total", "counter", "Prompt tokens the prompt cache supplied.",
         st.n_prompt_tokens_cached_total),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt process time", int(st.t_prompt_processing_total) / 1e3),
        ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.",
         st.n_tokens_predicted_total),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time",
         int(st.t_tokens_generation_total) / 1e3),
        ("llamacpp:n_decode_total", "counter", "Total number of llama_decode() calls", st.n_decode_total),
        ("llamacpp:n_tokens_max", "counter", "Largest observed n_tokens.", st.n_tokens_max),
        ("llamacpp:spec_decode_num_draft_tokens_total", "counter", "Speculative: draft tokens sent to verification.",
         st.n_draft_tokens_total),
        ("llamacpp:spec_decode_num_accepted_tokens_total", "counter",
         "Speculative: draft tokens the target model kept.", st.n_draft_accepted_total),
        ("llamacpp:spec_decode_num_drafts_total", "counter", "Speculative: verification forwards.",
         st.n_draft_rounds_total),
        ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", prompt_rate),
        ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.", gen_rate),
        ("llamacpp:requests_processing", "gauge", "Number of requests processing.", st.n_processing),
        ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", st.n_deferred),
        ("llamacpp:n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call",
         st.n_busy_slots_total / max(st.n_decode_total, 1)),
    ]


def own_families(st: EngineStats) -> list[tuple[str, str, str, float | int]]:
    """mlxcel's engine families, after the upstream ones: the paged KV pool and the refusals."""
    return [
        ("mlxcel_kv_cache_tokens", "gauge", "Tokens held in the KV cache of live sequences.", st.kv_cache_tokens),
        ("mlxcel_kv_cache_usage_ratio", "gauge", "KV cache tokens over the context of all slots.",
         st.kv_cache_tokens / st.kv_cache_capacity if st.kv_cache_capacity else 0.0),
        ("mlxcel_kv_blocks_total", "gauge", "Blocks in the paged KV pool.", st.kv_blocks_total),
        ("mlxcel_kv_blocks_used", "gauge", "KV blocks referenced by live sequences or the prompt cache.",
         st.kv_blocks_used),
        ("mlxcel_kv_blocks_cached", "gauge", "KV blocks held by the prompt cache.", st.kv_blocks_cached),
        ("mlxcel_kv_blocks_free", "gauge", "KV blocks free for allocation.", st.kv_blocks_free),
        ("mlxcel_requests_rejected_total", "counter", "Requests refused because the wait queue was full.",
         st.n_rejected_total),
        ("mlxcel_kv_bytes_capacity", "gauge", "Bytes the paged KV pool takes at its full size.", st.kv_bytes_capacity),
        ("mlxcel_kv_bytes_used", "gauge", "KV bytes held by live sequences or the prompt cache.", st.kv_bytes_used),
        ("mlxcel_kv_bytes_cached", "gauge", "KV bytes held by the prompt cache.", st.kv_bytes_cached),
        ("mlxcel_kv_bytes_resident", "gauge", "KV bytes the backend's storage has allocated so far.",
         st.kv_bytes_resident),
    ]


def kv_mode_lines(app_state: AppState, dtype: str) -> list[str]:
    """The KV storage mode as an info-style gauge: the types as labels, value 1."""
    kv, name = app_state.settings.kv, "mlxcel_kv_cache_mode"
    return [f"# HELP {name} The KV cache's storage mode (--cache-type-k / -v) and the dtype it is kept in.",
            f"# TYPE {name} gauge", f'{name}{{type_k="{kv.cache_type_k}",type_v="{kv.cache_type_v}",dtype="{dtype}"}} 1']


def queue_families(state: AppState) -> list[tuple[str, str, str, float | int]]:
    """Each planned side worker's fair queue (api/side_workers.py): its waiting and running jobs, and
    the jobs refused as full or dropped because their client went away."""
    out = []
    for kind in sorted({s.kind for s in state.plan.sides} if state.plan is not None else ()):
        q = worker_queue(state, kind)
        out += [(f"mlxcel_{kind}_queue_waiting", "gauge", f"{kind} requests waiting for the worker.", q.waiting),
                (f"mlxcel_{kind}_queue_running", "gauge", f"{kind} requests running.", q.running),
                (f"mlxcel_{kind}_requests_rejected_total", "counter", f"{kind} requests refused: queue full.",
                 q.rejected_total),
                (f"mlxcel_{kind}_requests_cancelled_total", "counter",
                 f"{kind} requests dropped or stopped because the client went away.", q.cancelled_total)]
    return out


def group_lines(model) -> list[str]:
    """A distributed group's shape and what each rank holds (--tp-size / --pp-size); none for one process."""
    group = model.group
    if group is None:
        return []
    spec, lines = group.spec, []
    for name, help_text, value in (
            ("mlxcel_group_ranks", "Ranks in the distributed group serving the model.", spec.world),
            ("mlxcel_group_tp_size", "Tensor-parallel ranks per pipeline stage (--tp-size).", spec.tp_size),
            ("mlxcel_group_pp_size", "Pipeline stages (--pp-size).", spec.pp_size),
            ("mlxcel_group_failed", "1 once the group lost a rank (the server is exiting).", int(group.failed is not None))):
        lines += _line(name, "gauge", help_text, value)
    for name, help_text, field in (
            ("mlxcel_group_rank_weight_bytes", "Bytes of weights each rank holds.", "weight_bytes"),
            ("mlxcel_group_rank_kv_bytes_per_token", "KV bytes per token each rank's pool holds.", "kv_bytes_per_token")):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{rank="{s.rank}"}} {getattr(s, field)}' for s in group.sizes]
    return lines


def _per_position(st: EngineStats) -> list[str]:
    """The labelled accepted-per-draft-position counter, once speculation has accepted anything."""
    name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
    if not st.n_draft_accepted_per_pos:
        return []
    return [f"# HELP {name} Speculative: draft tokens kept, by draft position.", f"# TYPE {name} counter",
            *(f'{name}{{position="{i}"}} {n}' for i, n in enumerate(st.n_draft_accepted_per_pos))]


def _line(name: str, kind: str, help_text: str, value: float | int) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_num(value)}"]


def render_prometheus(st: EngineStats | None, extra: list | None = None) -> str:
    """The engine's families (none on a server without a generation model), then `extra`."""
    lines = []
    if st is not None:
        for family in metric_families(st):
            lines += _line(*family)
        lines += _per_position(st)
        for family in own_families(st):
            lines += _line(*family)
    for family in extra or []:
        lines += _line(*family)
    return "\n".join(lines) + "\n"


@get("/metrics")
async def metrics(app_state: AppState) -> Response:
    if not app_state.settings.server.metrics:
        raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                       code="not_supported", type="not_supported_error")
    if generation_refusal(app_state) is not None:  # --embeddings, --reranking, a Whisper -m: workers only
        return Response(render_prometheus(None, queue_families(app_state)), media_type=CONTENT_TYPE)
    model = served_model(app_state, None)
    st = model.engine.stats(reset_bucket=True)
    extra = kv_mode_lines(app_state, model.info.dtype) + group_lines(model)
    text = render_prometheus(st, queue_families(app_state)) + "\n".join(extra) + "\n"
    return Response(text, media_type=CONTENT_TYPE,
                    headers={"Process-Start-Time-Unix": str(int(st.t_start))})
