"""Pipelined greedy decode: the next step's forward is queued before this step's token is read.

The plain engine step syncs every token: it evaluates the logits, copies them to the host,
samples, and only then builds the next forward, so the host's per-token work (graph building,
sampling, detokenizing, stop matching, the event push) adds to the device's compute. When every
decoding row picks its token by a plain argmax, the device can pick it instead: step t+1's
forward is built from step t's device-side argmax and handed to the backend to evaluate
asynchronously, and only then is step t's token read and booked on the host, overlapping the
host work with the next forward.

The forward queued ahead writes one key/value position whose token the host has not seen yet
(`Row.lazy_pos`); booking that token fills it in. When the row stops on it (EOS, a stop
string, n_predict, cancellation) the engine's release truncates that position before the KV
is donated, exactly as if the extra step never ran. Any change to the batch (an admission, a
prompt chunk, a row that is not greedy, a cancelled or finished row) settles the queued step:
its tokens are booked without queueing another, and the plain path takes over.

A backend opts in with `decode_greedy(rows, ids, bias) -> lazy argmax` (the MLX backend does);
the torch backend keeps the plain path. Output is the plain path's, token for token. It is on
wherever the backend offers it, MLX's CPU device included: the overlap needs a free core, and
with large products split over both cores the two paths measure alike there (plain 1.114x,
pipelined 1.106x of mlx_lm.generate, docs/benchmarks.md); with one core per product it measured
~20% faster on an idle machine and 1-7% slower while other processes held every core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mlxcel.engine.requests import forward_row
from mlxcel.engine.sampling_params import SamplingParams

# A token id placed in a sequence's token list while the device still holds the real one.
PLACEHOLDER = -1


def device_greedy(p: SamplingParams) -> bool:
    """Whether the host sampler's pick for these parameters is always the first highest biased
    logit (what a device argmax over logits + logit_bias returns; ignore_eos is such a bias):
    temperature <= 0 with no dynamic range, and every other stage of the chain either off or
    one that always keeps the highest logit (top-k, top-p, min-p and top-n-sigma keep it and
    break ties by the lowest id, as argmax does)."""
    if p.mirostat != 0 or p.n_probs > 0 or p.uses_adaptive_p:
        return False
    # the host adds in float64 before rounding: only biases exact in fp32 give the device's fp32
    # sum bit for bit (+inf never gets here: SamplingParams refuses it)
    if any(v == math.inf or (v != -math.inf and float(np.float32(v)) != v) for v in p.logit_bias.values()):
        return False
    if "temperature" not in p.samplers or p.temperature > 0.0 or p.dynatemp_range > 0.0:
        return False
    penalties_off = p.repeat_last_n == 0 or (p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0
                                              and p.presence_penalty == 0.0)
    xtc_off = p.xtc_probability <= 0.0 or p.xtc_threshold > 0.5
    return penalties_off and not p.dry_enabled and p.typical_p >= 1.0 and xtc_off


def row_greedy(row) -> bool:
    """A decoding row whose next token may be chosen on the device: greedy, with nothing on
    the host that reads the logits or forces a token (grammar, reasoning budget, captures)."""
    req = row.request
    return (not row.pending and row.slot >= 0 and row.next_token is not None and row.grammar is None
            and row.budget is None and not req.capture and req.media is None and device_greedy(req.params))


@dataclass
class _Ahead:
    rows: list  # the scheduler's running Row objects, in batch order
    tokens: object  # the backend's lazy [B] argmax


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class DecodePipeline:
    """The engine's one queued-ahead decode step, if any."""

    def __init__(self) -> None:
        self.ahead: _Ahead | None = None

    def reset(self) -> None:
        """Forget the queued step (a failed step's rows were all finished by the engine)."""
        self.ahead = None

    def step(self, engine) -> bool:
        """Run this engine step pipelined if it can be; False leaves it to the plain path."""
        rows, waiting = engine.scheduler.running, engine.scheduler.waiting
        if self.ahead is not None:
            prev = self.ahead
            self.ahead = None
            if _same(prev.rows, rows) and not waiting and all(self._can_continue(engine, r) for r in rows):
                self.ahead = self._launch(engine, rows, prev.tokens)
            self._book(engine, prev)
            return True
        if rows and not waiting and all(row_greedy(r) for r in rows):
            self.ahead = self._launch(engine, rows, None)
            return True
        return False

    @staticmethod
    def _can_continue(engine, row) -> bool:
        """Queue another step only when its token can be kept: the row is still greedy, its
        in-flight token is not its last (n_predict), and the context has room for both (so the
        engine's context shift never sees the extra position)."""
        return (row_greedy(row) and not row.handle.cancelled and len(row.generated) + 1 < row.max_tokens
                and row.cache.length + 2 <= engine.n_ctx_slot)

    @staticmethod
    def _launch(engine, rows: list, tokens) -> _Ahead:
        """Queue one decode forward: inputs are the rows' host tokens, or `tokens` (the previous
        queued step's lazy argmax) whose positions stay placeholders until booked."""
        if tokens is None:
            fwd = [forward_row(r, [r.next_token]) for r in rows]
        else:
            for r in rows:
                r.lazy_pos = r.cache.length
            fwd = [forward_row(r, [PLACEHOLDER]) for r in rows]
        bias = [r.request.params.logit_bias for r in rows]
        out = engine.backend.decode_greedy(fwd, tokens, bias if any(bias) else None)
        engine.count_forward(len(rows))
        return _Ahead(list(rows), out)

    def _book(self, engine, prev: _Ahead) -> None:
        """Read `prev`'s tokens (waiting for its forward) and hand each live row its token."""
        tokens = np.array(prev.tokens).tolist()
        live = {id(r) for r in engine.scheduler.running}
        for row, token in zip(prev.rows, tokens):
            if id(row) not in live:
                continue  # cancelled while its step was in flight
            if row.lazy_pos is not None:
                row.cache.tokens[row.lazy_pos] = token
            engine.output.take(row, int(token), None)
            row.lazy_pos = None  # still decoding: the queued forward's input is this token
        live = {id(r) for r in engine.scheduler.running}
        if self.ahead is not None and not any(id(r) in live for r in self.ahead.rows):
            self.ahead = None  # every row stopped: the queued step's outputs are never read
