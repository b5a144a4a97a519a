"""One encoder forward pass on either backend, behind one small interface.

`mlx` runs mlxcel's own BERT module (mlxcel/models/bert.py); `torch` runs transformers'
AutoModel / AutoModelForSequenceClassification on CPU. Both take right-padded int arrays and
return numpy, so the workers above pool, normalize and score identically on either. Calls are
serialized by a lock: the routes run them on worker threads and one forward at a time is what
a single encoder device can usefully do.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

BACKENDS = ("mlx", "torch")


def pad(batch: list[tuple[list[int], list[int]]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[(ids, type_ids)] -> right-padded ids, type_ids, attention mask, each [B, T] int32."""
    width = max(len(ids) for ids, _ in batch)
    ids = np.full((len(batch), width), pad_id, dtype=np.int32)
    types = np.zeros((len(batch), width), dtype=np.int32)
    mask = np.zeros((len(batch), width), dtype=np.int32)
    for i, (row, row_types) in enumerate(batch):
        ids[i, : len(row)] = row
        types[i, : len(row_types)] = row_types
        mask[i, : len(row)] = 1
    return ids, types, mask


class Encoder:
    def __init__(self, path: Path, backend: str = "mlx", *, classifier: bool = False) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown encoder backend {backend!r} (expected one of {', '.join(BACKENDS)})")
        self.backend, self.classifier = backend, classifier
        self._lock = threading.Lock()
        if backend == "mlx":
            from mlxcel.models.bert import load_bert

            self._model = load_bert(path)
        else:
            import torch  # noqa: F401  (the optional extra; a clear ImportError if absent)
            from transformers import AutoModel, AutoModelForSequenceClassification

            cls = AutoModelForSequenceClassification if classifier else AutoModel
            self._model = cls.from_pretrained(str(path), dtype="float32").eval()

    def hidden(self, ids: np.ndarray, types: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Last hidden states [B, T, H]."""
        with self._lock:
            if self.backend == "mlx":
                import mlx.core as mx

                out = self._model(mx.array(ids), mx.array(types), mx.array(mask))
                return np.array(out.astype(mx.float32))
            import torch

            with torch.no_grad():
                out = self._model(input_ids=torch.from_numpy(ids).long(), token_type_ids=torch.from_numpy(types).long(),
                                  attention_mask=torch.from_numpy(mask).long())
            return out.last_hidden_state.float().numpy()

    def logits(self, ids: np.ndarray, types: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Sequence-classification logits [B, num_labels]."""
        with self._lock:
            if self.backend == "mlx":
                import mlx.core as mx

                out = self._model.classify(mx.array(ids), mx.array(types), mx.array(mask))
                return np.array(out.astype(mx.float32))
            import torch

            with torch.no_grad():
                out = self._model(input_ids=torch.from_numpy(ids).long(), token_type_ids=torch.from_numpy(types).long(),
                                  attention_mask=torch.from_numpy(mask).long())
            return out.logits.float().numpy()
