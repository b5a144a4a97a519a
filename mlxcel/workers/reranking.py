"""The reranking worker: a cross-encoder scoring (query, document) pairs.

The score is the classification head's single raw logit for the pair, as b10621's rank pooling
returns it (no sigmoid). The pair is tokenized by the checkpoint's own tokenizer template
([CLS] query [SEP] document [SEP] with segment ids), and a pair longer than the context is
refused, never truncated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel.workers import checkpoint as ck
from mlxcel.workers.embedding import BATCH, InputTooLong, batches
from mlxcel.workers.encoder import Encoder, pad


@dataclass
class RerankWorker:
    id: str
    path: Path
    n_ctx: int
    encoder: Encoder
    tokenizer: object
    created: int = field(default_factory=lambda: int(time.time()))

    kind = ck.RERANKER

    @classmethod
    def load(cls, model_id: str, path: Path, *, backend: str = "mlx") -> "RerankWorker":
        return cls(model_id, path, ck.context_length(path), Encoder(path, backend, classifier=True),
                   ck.load_tokenizer(path))

    def score(self, query: str, documents: list[str],
              cancelled: Callable[[], bool] = lambda: False) -> tuple[list[float], list[int]]:
        """One score per document, plus the tokens each pair took; `cancelled` is polled between
        batches (embedding.Stopped)."""
        pairs = []
        for i, doc in enumerate(documents):
            enc = self.tokenizer.encode(query, doc)
            if len(enc.ids) > self.n_ctx:
                raise InputTooLong(f"document {i} with the query has {len(enc.ids)} tokens, more than the "
                                   f"reranker's context of {self.n_ctx} tokens")
            pairs.append((enc.ids, enc.type_ids))
        scores: list[float] = []
        for start in batches(len(pairs), cancelled):
            ids, types, mask = pad(pairs[start : start + BATCH])
            scores.extend(float(x) for x in self.encoder.logits(ids, types, mask)[:, 0])
        return scores, [len(p[0]) for p in pairs]
