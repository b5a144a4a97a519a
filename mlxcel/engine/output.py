"""The output processor: from a row's logits to the events its client reads.

For each row that ran in a step it books the prompt progress, samples the next token (grammar
mask, forced reasoning-budget runs and the sampler chain), detokenizes it, matches stop
strings, applies b10621's per-request limits (n_predict, n_indent, t_max_predict_ms, the slot's
context bound) and either pushes the token's event or finishes the row with its timings. What a
finished row leaves behind (its slot and KV) is the engine's `RowSink` to release.
"""

from __future__ import annotations

import time
from typing import Protocol

from mlxcel.engine.detokenize import IncrementalDetokenizer
from mlxcel.engine.kv_block_pool import SequenceKV
from mlxcel.engine.requests import RequestHandle, Row
from mlxcel.engine.sampling import SamplerState, sample_row
from mlxcel.engine.sampling_dry import DryVocab
from mlxcel.engine.stop import StopMatcher
from mlxcel.engine.tokenizer import Tokenizer
from mlxcel.engine.types import EngineStats, GenerationRequest, PromptProgress, Timings, TokenEvent


class RowSink(Protocol):
    """What the engine does with a row the output processor is done with, or whose context is full."""

    def row_done(self, row: Row) -> None:
        """The row finished: free its slot and KV (its final event is pushed after this)."""

    def row_at_bound(self, row: Row) -> None:
        """The row's next token does not fit its slot's context: make room (context shift)."""

    def extra_timings(self, row: Row) -> dict:
        """Timings fields beyond the plain ones (speculative decoding's draft counters)."""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stats: EngineStats, sink: RowSink, *, n_ctx_slot: int,
                 special: bool) -> None:
        self.tokenizer, self.stats, self.sink = tokenizer, stats, sink
        self.n_ctx_slot = n_ctx_slot
        self.special = special  # --special: special tokens are rendered as their text
        self._dry_vocab: DryVocab | None = None

    @property
    def dry_vocab(self) -> DryVocab:
        """DRY's view of the vocabulary, built on first use and kept for the model's life."""
        if self._dry_vocab is None:
            tok = self.tokenizer
            self._dry_vocab = DryVocab(tok.pieces, lambda text: tok.encode(text, add_special_tokens=False))
        return self._dry_vocab

    def open_row(self, handle: RequestHandle, seq: SequenceKV, cached: int, max_tokens: int,
                 n_ctx_train: int) -> Row:
        """A newly admitted request's row: its sampler, detokenizer, stop matcher, grammar and budget."""
        req = handle.request
        self.stats.n_prompt_tokens_cached_total += cached
        return Row(handle=handle, cache=seq, pending=list(req.prompt[cached:]), n_cached=cached,
                   n_prompt_done=cached, sampler=self._sampler_state(req, n_ctx_train),
                   detok=IncrementalDetokenizer(self._decoder(req.keep_tokens)), stop=StopMatcher(req.stop),
                   max_tokens=max_tokens, grammar=req.grammar.matcher() if req.grammar is not None else None,
                   budget=req.reasoning.tracker(req.prompt) if req.reasoning is not None else None)

    def _decoder(self, keep: frozenset[int]):
        """--special shows every special token as text; otherwise only the row's kept markers
        (tool-call markers its output parser needs) survive decoding."""
        if self.special:
            return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decoder(keep)

    def _sampler_state(self, req: GenerationRequest, n_ctx_train: int) -> SamplerState:
        p = req.params
        needs_vocab = p.mirostat == 0 and "dry" in p.samplers and p.dry_enabled and p.dry_sequence_breakers
        return SamplerState.create(p, dry_vocab=self.dry_vocab if needs_vocab else None, n_ctx_train=n_ctx_train)

    def postprocess(self, rows: list[tuple[Row, list[int]]], logits) -> None:
        """After a forward over `rows`: book the prompt chunks run, and sample every row whose
        prompt is done."""
        st = self.stats
        for i, (row, toks) in enumerate(rows):
            if row.pending:
                del row.pending[: len(toks)]
                row.n_prompt_done += len(toks)
                st.n_prompt_tokens_processed_total += len(toks)
                st.n_prompt_tokens_processed += len(toks)
                self.progress(row)
                if row.pending:
                    continue
                row.t_first = time.perf_counter()
                prompt_ms = (row.t_first - row.t_start) * 1e3
                st.t_prompt_processing_total += prompt_ms
                st.t_prompt_processing += prompt_ms
            self.sample(row, logits[i])

    def progress(self, row: Row) -> None:
        req = row.request
        if req.return_progress:
            row.handle.push(TokenEvent(slot=row.slot, prompt_tokens=len(req.prompt), progress=PromptProgress(
                total=len(req.prompt), cache=row.n_cached, processed=row.n_prompt_done,
                time_ms=(time.perf_counter() - row.t_start) * 1e3)))

    def sample(self, row: Row, logits) -> None:
        """Pick the row's next token from its logits (or its forced reasoning run) and book it."""
        req = row.request
        forced = row.budget.forced() if row.budget is not None else None
        if forced is not None:
            self.take(row, forced, None)
            return
        mask = None
        if row.grammar is not None:
            mask = row.grammar.allowed_mask(len(logits))  # None: a lazy grammar not triggered yet
            if mask is not None and not mask.any():
                # a grammar may name its own condition (a lazy grammar's trigger ran past its budget)
                code = getattr(row.grammar, "error_code", None) or "constrained_output_invalid"
                self.finish(row, TokenEvent(error=f"the grammar allows no token here: {row.grammar.error()}",
                                            error_code=code))
                return
        sampled = sample_row(logits, req.params, row.sampler, history=req.prompt + row.generated, mask=mask)
        self.take(row, sampled.token, sampled.probs)

    def take(self, row: Row, token: int, probs) -> None:
        """Book one chosen token: detokenize, stop-check, then finish the row or push its event."""
        req = row.request
        if row.budget is not None:
            row.budget.observe(token)
        row.generated.append(token)
        # the grammar ended the document: this token is its last (EOS was only allowed at an end)
        ended = (row.grammar is not None and token not in self.tokenizer.eos_token_ids
                 and row.grammar.accept(token) and row.grammar.is_terminated())
        self.stats.n_tokens_max = max(self.stats.n_tokens_max, len(req.prompt) + len(row.generated))
        if token in self.tokenizer.eos_token_ids and not req.ignore_eos:
            # upstream appends the end token's piece before it stops: its text under --special
            eos_text = row.detok.add(token) if self.special else ""
            self._end(row, token, probs, "", eos_text + row.detok.flush(), "eos")
            return
        piece = row.detok.add(token)
        res = row.stop.feed(piece)
        if res.matched is not None:
            self.finish(row, TokenEvent(text=res.text, token=token, finish_reason="stop", stop_type="word",
                                        stopping_word=res.matched, probs=probs))
            return
        cut = self._line_limits(row, piece, res.text)
        if ended:  # the document is complete: a stop string its tail would complete is not looked for
            tail = row.stop.feed(row.detok.flush())
            self.finish(row, TokenEvent(text=res.text + tail.text + row.stop.flush(), token=token,
                                        finish_reason="stop", stop_type="eos", probs=probs))
        elif len(row.generated) >= row.max_tokens or cut is not None:
            self._end(row, token, probs, res.text, row.detok.flush(), "limit",
                      truncate_to=cut if cut is not None and cut >= 0 else None)
        else:
            row.next_token = token
            if row.cache.length + 1 > self.n_ctx_slot:  # only reachable with context shift on
                self.sink.row_at_bound(row)
            row.handle.push(TokenEvent(text=res.text, token=token, slot=row.slot, probs=probs,
                                       prompt_tokens=len(req.prompt), completion_tokens=len(row.generated),
                                       has_new_line=row.has_new_line, timings=self.timings(row)))

    def _end(self, row: Row, token: int, probs, text: str, tail: str, stop_type: str,
             truncate_to: int | None = None) -> None:
        """Finish on `token` with the released `text` and the detokenizer's `tail`: a stop string
        completed by the tail wins; else "stop" at an end token, "length" at a limit."""
        res = row.stop.feed(tail)
        if res.matched is not None:
            self.finish(row, TokenEvent(text=text + res.text, token=token, finish_reason="stop", stop_type="word",
                                        stopping_word=res.matched, probs=probs))
            return
        reason = "stop" if stop_type == "eos" else "length"
        self.finish(row, TokenEvent(text=text + res.text + row.stop.flush(), token=token, finish_reason=reason,
                                    stop_type=stop_type, probs=probs, truncate_to=truncate_to))

    def _line_limits(self, row: Row, piece: str, released: str) -> int | None:
        """b10621's n_indent and t_max_predict_ms checks after one token. Returns the
        content length to cut to when the request must stop here, else None."""
        req = row.request
        row.text += piece
        cut = None
        if req.n_indent > 0:
            if row.last_nl_pos > 0:
                pos, text = row.last_nl_pos, row.text
                while pos < len(text) and text[pos] in " \t":
                    pos += 1
                if pos < len(text) and pos - row.last_nl_pos < req.n_indent:
                    cut = pos
            nl = row.text.find("\n", row.last_nl_pos)
            if nl >= 0:
                row.last_nl_pos = nl + 1
        if "\n" in released:
            row.has_new_line = True
            if (cut is None and req.t_max_predict_ms > 0 and row.t_first
                    and (time.perf_counter() - row.t_first) * 1e3 > req.t_max_predict_ms):
                cut = -1
        return cut

    def timings(self, row: Row, now: float | None = None) -> Timings:
        now = time.perf_counter() if now is None else now
        t_first = row.t_first or now
        return Timings(cache_n=row.n_cached, prompt_n=len(row.request.prompt) - row.n_cached,
                       prompt_ms=(t_first - row.t_start) * 1e3, predicted_n=len(row.generated),
                       predicted_ms=(now - t_first) * 1e3, **self.sink.extra_timings(row))

    def account(self, row: Row, timings: Timings) -> None:
        """A request leaves its slot (finished or cancelled): count its generation."""
        st = self.stats
        st.n_tokens_predicted_total += len(row.generated)
        st.n_tokens_predicted += len(row.generated)
        if row.generated:
            st.t_tokens_generation_total += timings.predicted_ms
            st.t_tokens_generation += timings.predicted_ms
        if timings.draft_rounds:
            st.n_draft_tokens_total += timings.draft_n or 0
            st.n_draft_accepted_total += timings.draft_n_accepted or 0
            st.n_draft_rounds_total += timings.draft_rounds

    def finish(self, row: Row, event: TokenEvent) -> None:
        """End the row with `event`, filled in with the row's totals and timings."""
        event.truncated = row.shifted or len(row.request.prompt) + len(row.generated) >= self.n_ctx_slot
        event.slot = row.slot
        event.prompt_tokens = len(row.request.prompt)
        event.completion_tokens = len(row.generated)
        event.has_new_line = event.has_new_line or row.has_new_line
        event.timings = self.timings(row, time.perf_counter())
        self.account(row, event.timings)
        self.sink.row_done(row)
        row.handle.push(event)
