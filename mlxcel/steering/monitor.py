"""Monitoring: top-K feature reads of user traffic at one attached SAE.

The engine calls `record` with a row's residuals after each forward (only for user requests;
scoring and embeddings never carry a monitor capture). It keeps a bounded history of
per-position top features and running per-feature statistics (count, mean, std, min, max,
active ratio). Disabling keeps the configuration and what was recorded; `clear_history` and
`reset_statistics` drop them.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from mlxcel.steering.sae import SAE

HISTORY_MAX = 1000
METRICS = ("mean", "max", "active_ratio", "count")


class Monitor:
    def __init__(self, sae: SAE, top_k: int = 8, read_point: str = "pre_steering", history: int = HISTORY_MAX):
        self.sae, self.top_k, self.read_point = sae, top_k, read_point
        self.enabled = True
        self.history: deque = deque(maxlen=history)
        self.lock = threading.Lock()
        self.reset_statistics()

    def reset_statistics(self) -> int:
        d = self.sae.d_sae
        with self.lock:
            had = int(getattr(self, "count", 0))
            self.count, self.since = 0, time.time()
            self.sums, self.squares = np.zeros(d, np.float64), np.zeros(d, np.float64)
            self.maxes, self.mins = np.zeros(d, np.float32), np.zeros(d, np.float32)
            self.fires = np.zeros(d, np.int64)
        return had

    def clear_history(self) -> int:
        with self.lock:
            n = len(self.history)
            self.history.clear()
        return n

    def record(self, tokens: list[int], pre: np.ndarray, post: np.ndarray) -> None:
        if not self.enabled:
            return
        acts = self.sae.encode(pre if self.read_point == "pre_steering" else post)
        k = min(self.top_k, acts.shape[1])
        top = np.argsort(-acts, axis=1)[:, :k]
        now = time.time()
        with self.lock:
            first = self.count == 0
            self.count += acts.shape[0]
            self.sums += acts.sum(axis=0)
            self.squares += (acts.astype(np.float64) ** 2).sum(axis=0)
            self.maxes = np.maximum(self.maxes, acts.max(axis=0))
            self.mins = acts.min(axis=0) if first else np.minimum(self.mins, acts.min(axis=0))
            self.fires += (acts > 0).sum(axis=0)
            for j, tok in enumerate(tokens):
                self.history.append({"timestamp": now, "token_id": int(tok), "top_k": k, "features": [
                    {"index": int(i), "value": float(acts[j, i])} for i in top[j] if acts[j, i] > 0]})

    def state(self) -> dict:
        with self.lock:
            return {"enabled": self.enabled, "sae_id": self.sae.sae_id, "layer": self.sae.layer, "top_k": self.top_k,
                    "read_point": self.read_point, "history_size": self.history.maxlen,
                    "history_count": len(self.history)}

    def recent(self, limit: int) -> list[dict]:
        """Newest first."""
        with self.lock:
            return list(reversed(self.history))[:max(limit, 0)]

    def _row(self, i: int) -> dict:
        n = max(self.count, 1)
        mean = self.sums[i] / n
        return {"feature_idx": int(i), "count": int(self.fires[i]), "mean": float(mean),
                "std": float(np.sqrt(max(self.squares[i] / n - mean * mean, 0.0))), "min": float(self.mins[i]),
                "max": float(self.maxes[i]), "active_ratio": float(self.fires[i] / n)}

    def statistics(self, features: list[int] | None = None) -> dict:
        """Every feature that fired (or the ones asked for)."""
        with self.lock:
            ids = features if features is not None else [int(i) for i in np.flatnonzero(self.fires)]
            return {"features": [self._row(i) for i in ids], "total_activations": self.count,
                    "since": self.since}

    def top(self, k: int, metric: str) -> list[dict]:
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}")
        with self.lock:
            n = max(self.count, 1)
            score = {"mean": self.sums / n, "max": self.maxes, "active_ratio": self.fires / n,
                     "count": self.fires}[metric]
            order = [int(i) for i in np.argsort(-score, kind="stable")[:k] if self.fires[i] > 0]
            return [self._row(i) for i in order]
