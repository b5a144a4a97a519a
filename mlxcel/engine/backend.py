"""The backend contract the engine drives, and the plain data it exchanges.

The engine never touches tensors: it hands a backend rows of (new tokens, the row's block
table) and receives fp32 logits as a numpy array, one row per input row, for the last
position of each. Sampling, stopping and detokenizing stay backend-agnostic. Backends
(mlxcel/backends/) import this module; nothing in the engine imports a backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    model_type: str
    num_layers: int
    vocab_size: int
    context_length: int
    dtype: str  # the compute dtype actually in use, e.g. "float32"
    checkpoint_dtype: str  # what the weights are stored as
    quantization: str | None  # e.g. "4bit-g64", None for unquantized
    backend: str
    device: str
    config: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class ForwardRow:
    tokens: list[int]  # tokens to append to this row's sequence
    cache: Any  # the backend's per-sequence cache (SequenceCache on MLX)
    # layer -> residual delta [hidden] added at that layer's output, every position (SAE steering)
    steering: dict[int, np.ndarray] | None = None
    # layer -> fn(tokens, pre [n, hidden], post [n, hidden]): this row's residuals at that
    # layer's output before and after its steering delta, called after the forward
    capture: dict[int, Callable[[list[int], np.ndarray, np.ndarray], None]] | None = None
    # this row's LoRA scale per loaded adapter (None: all 0.0); see models/lora.py
    lora: tuple[float, ...] | None = None
    # a generated token (a decode step), not prompt tokens: a backend may compute decode rows by
    # a path of their own, as long as it is the same whatever else the step holds
    decode: bool = False


class Backend(Protocol):
    info: ModelInfo
    allocator: Any  # the BlockAllocator behind the paged KV (the prefix cache shares it)
    kv_bytes_per_token: int  # at the compute dtype, all layers

    def new_sequence(self) -> Any:
        """A fresh, empty per-sequence KV cache."""

    def forward(self, rows: list[ForwardRow]) -> np.ndarray:
        """Append each row's tokens to its cache; return [len(rows), vocab] fp32 logits of
        each row's last position."""

    def forward_all(self, tokens: list[int], cache: Any) -> np.ndarray:
        """Like forward for one row, but return logits for every position: [n, vocab]."""

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the keys and values of pool slots `src` to slots `dst` in every layer."""

    def compact(self, seq: Any, keep: int, discard: int) -> Any:
        """A context shift: a new sequence holding seq's tokens without [keep, keep + discard),
        continuing at seq's logical position (the caller releases seq)."""

    def configure_kv(self, num_blocks: int, block_size: int) -> None:
        """(Re)build the paged KV pool; only while no sequence is live."""

    def hidden_states(self, tokens: list[int], cache: Any) -> np.ndarray:
        """Like forward_all, but the final hidden states (after the model's final norm) of every
        position instead of logits: [n, hidden] fp32. /v1/embeddings pools these."""


def kv_bytes_per_token(info: ModelInfo, dtype_bytes: int) -> int:
    """Bytes one token's keys and values take across all layers, from the checkpoint config."""
    c = info.config
    heads = c.get("num_attention_heads") or 1
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (c.get("hidden_size", 0) // heads)
    return 2 * info.num_layers * kv_heads * head_dim * dtype_bytes
