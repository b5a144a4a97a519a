"""What an encoder checkpoint declares: its kind (embedder or cross-encoder), its pooling, its
normalize default, its context, and its tokenizer.

Pooling resolves as flag > MLXCEL_EMBEDDING_POOLING > the checkpoint's sentence-transformers
pooling config (modules.json -> 1_Pooling/config.json) > mean. The normalize default is the
checkpoint's own `normalize` flag in config.json: false means none (-1), anything else euclidean.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxcel.models.registry import ENCODER_TYPES
from mlxcel.workers.vectors import POOLINGS

EMBEDDING, RERANKER = "embedding", "reranker"

# sentence-transformers pooling config key -> our kernel
_POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
}


class CheckpointError(ValueError):
    """The checkpoint cannot serve the asked role; the message says why."""


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no readable config.json ({e})") from None


def encoder_kind(path: Path) -> str | None:
    """EMBEDDING for a bare encoder, RERANKER for a one-label sequence classifier, else None."""
    cfg = read_config(path)
    if cfg.get("model_type") not in ENCODER_TYPES:
        return None
    archs = cfg.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        labels = len(cfg.get("id2label") or {}) or cfg.get("num_labels") or 2
        return RERANKER if labels == 1 else None
    return EMBEDDING


def describe(path: Path) -> str:
    cfg = read_config(path)
    archs = ",".join(cfg.get("architectures") or []) or "no architectures"
    return f"model_type {cfg.get('model_type')!r} ({archs})"


def checkpoint_pooling(path: Path) -> str | None:
    modules = path / "modules.json"
    folder = "1_Pooling"
    if modules.is_file():
        for m in json.loads(modules.read_text()):
            if str(m.get("type", "")).endswith("models.Pooling"):
                folder = m.get("path") or folder
    cfg_path = path / folder / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    chosen = [ours for key, ours in _POOLING_KEYS.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _POOLING_KEYS]
    if others or len(chosen) != 1:
        raise CheckpointError(f"{cfg_path}: pooling {sorted(others) or chosen} is not one kernel mlxcel has "
                              f"({', '.join(POOLINGS)}); pass --pooling mean|cls|last")
    return chosen[0]


def resolve_pooling(path: Path, flag: str | None, env: str | None) -> str:
    if flag:
        return flag
    if env:
        if env not in POOLINGS:
            raise CheckpointError(f"MLXCEL_EMBEDDING_POOLING={env!r}: expected one of {', '.join(POOLINGS)}")
        return env
    return checkpoint_pooling(path) or "mean"


def default_normalize(path: Path) -> int:
    return -1 if read_config(path).get("normalize") is False else 2


def context_length(path: Path) -> int:
    """Tokens one input may have: sentence-transformers' max_seq_length when set, else the
    position table."""
    n = int(read_config(path).get("max_position_embeddings") or 512)
    st = path / "sentence_bert_config.json"
    if st.is_file():
        n = min(n, int(json.loads(st.read_text()).get("max_seq_length") or n))
    return n


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (an encoder checkpoint needs the fast tokenizer file)")
    tok = Tokenizer.from_file(str(file))
    tok.no_truncation()  # over-long inputs are refused by the routes, never cut silently
    tok.no_padding()
    return tok
