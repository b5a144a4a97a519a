"""The encoder workers against the reference implementations, on real and fixture weights.

- all-MiniLM-L6-v2 (real weights): MLX and torch workers against sentence-transformers'
  `encode` on 20 sentences; cosine >= 0.9999 per sentence and max |difference| <= 1e-4.
- the tiny cross-encoder: MLX and torch workers' scores against transformers'
  AutoModelForSequenceClassification logits over the same (query, document) pairs.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.workers.checkpoint import resolve_pooling
from mlxcel.workers.embedding import EmbeddingWorker
from mlxcel.workers.reranking import RerankWorker
from tests.conftest import fixture_path
from tests.fixtures import MINILM, RERANKER_TINY

SENTENCES = [
    "The cat sits on the mat.", "A quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.",
    "Paris is the capital of France.", "I love eating pizza on Fridays.", "The stock market fell sharply today.",
    "Quantum computers use qubits.", "She plays the violin beautifully.", "Rain is expected tomorrow afternoon.",
    "Photosynthesis converts light into chemical energy.", "He forgot his keys at the office.",
    "The museum opens at nine in the morning.", "Machine learning models need data.", "Bonjour, comment ça va ?",
    "Water boils at one hundred degrees Celsius.", "The train to Berlin was delayed by an hour.",
    "Neural networks approximate functions.", "A short one.", "Mountains are covered with snow in winter.",
    "This sentence is slightly longer than the others, with commas, clauses, and a few more words in it.",
]


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(fixture_path(MINILM)), device="cpu")
    return st.encode(SENTENCES, convert_to_numpy=True, batch_size=32)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_minilm_matches_sentence_transformers(reference, backend):
    path = fixture_path(MINILM)
    worker = EmbeddingWorker.load(MINILM, path, pooling=resolve_pooling(path, None, None), normalize=None,
                                  backend=backend)
    assert (worker.pooling, worker.normalize) == ("mean", 2)
    got = np.stack(worker.embed([worker.tokenize(s) for s in SENTENCES]))
    cos = (got * reference).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1))
    assert cos.min() >= 0.9999, cos
    assert np.abs(got - reference).max() <= 1e-4


def test_cross_encoder_scores_match_transformers():
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = fixture_path(RERANKER_TINY)
    query, docs = "what is a cat", SENTENCES[:8]
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**batch).logits[:, 0].numpy()
    for backend in ("mlx", "torch"):
        scores, tokens = RerankWorker.load(RERANKER_TINY, path, backend=backend).score(query, docs)
        np.testing.assert_allclose(scores, expected, atol=1e-5)
        assert tokens == [int(n) for n in batch["attention_mask"].sum(1)]
