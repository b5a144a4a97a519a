"""b10621's native response pieces: timings, probabilities, generation_settings, the
per-token and final completion objects, and the `response_fields` projection.

Pure functions over engine types; the routes decide which to send when.
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.sampling import ProbsReport
from mlxcel.engine.sampling_params import RANDOM_SEED, SamplingParams
from mlxcel.engine.token_pieces import valid_utf8_prefix
from mlxcel.engine.types import GenerationRequest, PromptProgress, Timings, TokenEvent
from mlxcel.runtime.served import ServedModel


def timings_json(t: Timings, tokens_evaluated: int) -> dict[str, Any]:
    """`prompt_n` counts the prompt tokens actually evaluated (the cache supplied the rest);
    the per-token prediction figures divide by predicted_n - 1 because predicted_ms is
    measured from the first token."""
    prompt_n = max(tokens_evaluated - t.cache_n, 0)

    def per(ms: float, n: int) -> tuple[float, float]:
        return (ms / n if n > 0 else 0.0), (1e3 / ms * n if ms > 0 and n > 0 else 0.0)

    p_tok, p_sec = per(t.prompt_ms, prompt_n)
    g_tok, g_sec = per(t.predicted_ms, t.predicted_n - 1)
    out = {
        "cache_n": t.cache_n,
        "prompt_n": prompt_n, "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": p_tok, "prompt_per_second": p_sec,
        "predicted_n": t.predicted_n, "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": g_tok, "predicted_per_second": g_sec,
    }
    if t.draft_n is not None:  # only once a verify round ran, as b10621 gates its pair
        out.update(draft_n=t.draft_n, draft_n_accepted=t.draft_n_accepted, draft_rounds=t.draft_rounds,
                   draft_kind=t.draft_kind)
    return out


def progress_json(p: PromptProgress) -> dict[str, Any]:
    return {"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms}


def probs_json(model: ServedModel, report: ProbsReport) -> dict[str, Any]:
    """One `completion_probabilities` entry with each token's text and raw bytes."""
    pieces = model.tokenizer.pieces
    key, top_key = ("prob", "top_probs") if report.post_sampling else ("logprob", "top_logprobs")
    body = report.to_json()

    def named(tok: int, entry: dict[str, Any]) -> dict[str, Any]:
        raw = pieces[tok] if 0 <= tok < len(pieces) else b""
        return {"id": tok, "token": valid_utf8_prefix(raw), "bytes": list(raw), key: entry[key]}

    out = named(report.token, body)
    out[top_key] = [named(e["id"], e) for e in body[top_key]]
    return out


def kept_probs(model: ServedModel, probs: list[ProbsReport], ev: TokenEvent) -> list[ProbsReport]:
    """A finished row's reports less those of the tokens that spelled a matched stop word
    (their text is not in the content), as upstream drops them."""
    if not probs or ev.stop_type != "word":
        return probs
    n_stop = len(model.tokenizer.encode(ev.stopping_word, add_special_tokens=False))
    return probs[: max(len(probs) - n_stop, 0)]


def seed_json(params: SamplingParams) -> int:
    return RANDOM_SEED if params.seed is None else params.seed


def generation_settings(req: GenerationRequest, *, stream: bool, timings_per_token: bool,
                        metrics_only: bool = False) -> dict[str, Any]:
    """b10621's task_params view of what this request resolved to. Keys for features this
    server does not have (backend_sampling, speculative.*) are omitted, not invented;
    `metrics_only` is the /props and /slots subset."""
    p = req.params
    out: dict[str, Any] = {
        "seed": seed_json(p), "temperature": p.temperature, "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
        "top_n_sigma": p.top_n_sigma, "xtc_probability": p.xtc_probability, "xtc_threshold": p.xtc_threshold,
        "typical_p": p.typical_p, "repeat_last_n": p.repeat_last_n, "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
        "dry_multiplier": p.dry_multiplier, "dry_base": p.dry_base, "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
    }
    if not metrics_only:
        out["dry_sequence_breakers"] = list(p.dry_sequence_breakers)
    out.update({"mirostat": p.mirostat, "mirostat_tau": p.mirostat_tau, "mirostat_eta": p.mirostat_eta})
    if not metrics_only:
        out["stop"] = list(req.stop)
    out.update({"max_tokens": req.max_tokens, "n_predict": req.max_tokens, "n_keep": req.n_keep,
                "n_discard": req.n_discard, "ignore_eos": req.ignore_eos, "stream": stream})
    if not metrics_only:
        out["logit_bias"] = [{"bias": b, "token": t} for t, b in p.logit_bias.items()]
    out.update({"n_probs": p.n_probs, "min_keep": p.min_keep})
    if not metrics_only:
        # a GBNF grammar is reported as sent; a schema is not converted to GBNF here
        gbnf = req.grammar.source if getattr(req.grammar, "kind", None) == "gbnf" else ""
        triggers = list(getattr(req.grammar, "reported", ()))  # a LazyGrammar (engine/lazy_grammar.py)
        out.update({"grammar": gbnf, "grammar_lazy": bool(triggers), "grammar_triggers": triggers,
                    "preserved_tokens": sorted(req.keep_tokens)})
    out.update({
        "chat_format": "Content-only", "generation_prompt": "", "reasoning_format": "none",
        "reasoning_in_content": False, "samplers": list(p.samplers),
        "timings_per_token": timings_per_token, "post_sampling_probs": p.post_sampling_probs,
        "lora": [{"id": i, "scale": s} for i, s in req.lora_asked],  # as b10621: the request's own entries
    })
    return out


def partial_json(model: ServedModel, ev: TokenEvent, *, index: int, timings_per_token: bool) -> dict[str, Any]:
    """One streamed token (or prompt-progress) frame. Partial frames never name the slot
    (upstream's -1); `tokens_predicted` is the row's generated-token count."""
    out: dict[str, Any] = {
        "index": index, "content": ev.text, "tokens": [ev.token] if ev.token is not None else [],
        "stop": False, "id_slot": -1, "tokens_predicted": ev.completion_tokens,
        "tokens_evaluated": ev.prompt_tokens,
    }
    if timings_per_token and ev.timings is not None:
        out["timings"] = timings_json(ev.timings, ev.prompt_tokens)
    if ev.progress is not None:
        out["prompt_progress"] = progress_json(ev.progress)
    if ev.probs is not None:
        out["completion_probabilities"] = [probs_json(model, ev.probs)]
    return out


def final_json(model: ServedModel, req: GenerationRequest, ev: TokenEvent, *, index: int, content: str,
               tokens: list[int], stream: bool, timings_per_token: bool,
               probs: list[ProbsReport] | None = None) -> dict[str, Any]:
    tokens_evaluated, predicted = ev.prompt_tokens, ev.completion_tokens
    out: dict[str, Any] = {
        "index": index, "content": content, "tokens": tokens, "id_slot": ev.slot, "stop": True,
        "model": model.id, "tokens_predicted": predicted, "tokens_evaluated": tokens_evaluated,
        "generation_settings": generation_settings(req, stream=stream, timings_per_token=timings_per_token),
        "prompt": model.tokenizer.decode(req.prompt, skip_special_tokens=False),
        "has_new_line": ev.has_new_line, "truncated": ev.truncated, "stop_type": ev.stop_type,
        "stopping_word": ev.stopping_word,
        # the slot's cache occupancy after the request, as upstream reports it
        "tokens_cached": max(tokens_evaluated + predicted - 1, 0),
        "timings": timings_json(ev.timings or Timings(), tokens_evaluated),
    }
    if probs:
        out["completion_probabilities"] = [probs_json(model, p) for p in probs]
    return out


def project(obj: dict[str, Any], paths: list[str] | None) -> dict[str, Any]:
    """`response_fields`: keep the listed paths; a path with '/' is walked and stored under
    the whole path string; missing or non-object walks are left out without an error."""
    if paths is None:
        return obj
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = obj
        ok = True
        for key in path.split("/"):
            if isinstance(cur, dict) and key in cur:
                cur = cur[key]
            else:
                ok = False
                break
        if ok:
            out[path] = cur
    return out
