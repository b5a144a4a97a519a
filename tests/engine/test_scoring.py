"""The engine's side passes (scoring, embeddings): each runs on a sequence of its own in
batch_size chunks and gives every block back."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.fake_backend import logits_for, next_token
from tests.engine.harness import engine_on, prompt

# a regression that never resolves a pass fails here instead of hanging the tier
pytestmark = pytest.mark.timeout(30)


def test_scoring_and_embedding_passes_run_chunked_on_their_own_sequence():
    p = prompt(100, 50)
    with engine_on(batch_size=16) as engine:
        logits = engine.submit_score(p).result(timeout=10)  # blocking is fine: no event loop here
        hidden = engine.submit_hidden(p).result(timeout=10)
        usage = engine.kv_usage()
    assert int(np.argmax(logits)) == next_token(p)
    # the fake's hidden state is its pick after each prefix: every position, in order, across
    # the 16-token chunks
    assert hidden.shape == (50, 4)
    assert hidden[:, 0].astype(int).tolist() == [next_token(p[:i + 1]) for i in range(50)]
    assert usage["used_blocks"] == 0  # neither pass kept a block or donated to the prefix cache
    assert [r.n for _, r in engine.backend.rows_of(100)] == [16, 16, 16, 2]  # the scoring forwards


def test_prompt_probs_report_every_prompt_token_from_the_position_before():
    p = prompt(100, 40)
    with engine_on(batch_size=16) as engine:
        reports = engine.submit_prompt_probs(p, 2).result(timeout=10)
        usage = engine.kv_usage()
    assert [r.token for r in reports] == p[1:]  # across the 16-token chunks, the first token has none
    want = [sample_report(logits_for(next_token(p[:i + 1])), p[i + 1]) for i in range(len(p) - 1)]
    assert [(r.prob, r.top) for r in reports] == [(w.prob, w.top) for w in want]
    assert all(not r.post_sampling and len(r.top) == 2 for r in reports)
    assert usage["used_blocks"] == 0


def sample_report(logits, token):
    """The report sampling gives a generated `token` drawn from `logits` with n_probs 2."""
    from mlxcel.engine.sampling import SamplerState, sample_row
    from mlxcel.engine.sampling_params import SamplingParams

    mask = np.zeros(logits.shape[0], dtype=bool)
    mask[token] = True  # force the draw: the report reads the raw logits, not the mask
    return sample_row(logits, SamplingParams(n_probs=2), SamplerState.create(SamplingParams(seed=0)), mask=mask).probs
