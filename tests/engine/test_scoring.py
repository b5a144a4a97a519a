"""The engine's side passes (scoring, embeddings): each runs on a sequence of its own in
batch_size chunks and gives every block back."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.fake_backend import next_token
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
