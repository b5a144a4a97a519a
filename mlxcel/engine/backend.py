"""The backend contract the engine drives, and the plain data it exchanges.

The engine never touches tensors: it hands a backend rows of (new tokens, the row's block
table) and receives fp32 logits as a numpy array, one row per input row, for the last
position of each. Sampling, stopping and detokenizing stay backend-agnostic. Backends
(mlxcel/backends/) import this module; nothing in the engine imports a backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from mlxcel.engine.kv_block_pool import BlockAllocator, SequenceKV


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
    cache: SequenceKV  # the row's block table and stored tokens (the KV manager's)
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


@dataclass(frozen=True)
class LayerKV:
    """What one layer keeps per token of context. `kind` is how the layer attends:
    "full" (every earlier token), "sliding" (the last `window` tokens), "latent" (every earlier
    token, through multi-head latent attention: the pool keeps each token's compressed latent and
    shared rotary key, not per-head keys and values) or "recurrent" (a fixed-size state per
    sequence rather than per token: `state_bytes`, none per token); `quant` names the quantized
    storage of its keys and values (None: both in the compute dtype)."""

    kind: str = "full"
    bytes_per_token: int = 0
    window: int | None = None
    quant: KVCacheTypes | None = None
    state_bytes: int = 0


@dataclass(frozen=True)
class KVSpec:
    """A backend's per-layer KV needs, which the engine's KV manager sizes its pool from."""

    layers: tuple[LayerKV, ...]

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(layer.kind for layer in self.layers)

    @property
    def state_bytes(self) -> int:
        """Bytes one sequence's recurrent state takes across all layers (0: no recurrent layer)."""
        return sum(layer.state_bytes for layer in self.layers)

    @property
    def recurrent(self) -> bool:
        return "recurrent" in self.kinds

    @classmethod
    def uniform(cls, info: ModelInfo, dtype_bytes: int, types: KVCacheTypes | None = None) -> KVSpec:
        """Every layer stores keys and values per token at `dtype_bytes`, or as `types` quantize
        them; each layer's window comes from the config (layer_types, or a
        sliding_window_pattern of local layers). A multi-head latent attention config
        (kv_lora_rank) stores its latent instead."""
        types = types or KVCacheTypes()
        latent = latent_width(info.config)
        if latent:
            types.refuse_quantized("multi-head latent attention keeps one compressed latent per token")
            return cls(tuple(LayerKV("latent", latent * dtype_bytes) for _ in range(info.num_layers)))
        per_layer = kv_bytes_per_token(info, dtype_bytes, types) // max(info.num_layers, 1)
        windows = layer_windows(info.config, info.num_layers)
        return cls(tuple(LayerKV("full" if w is None else "sliding", per_layer, w, types if types.quantized else None)
                         for w in windows))


# The KV storage modes (--cache-type-k / --cache-type-v). "f16" keeps keys or values in the
# compute dtype (fp16/bf16, or fp32 where the CPU computes in fp32); "int8" keeps int8 values
# and one fp32 absmax scale per token per head, quantized as a block's slots are written and
# dequantized inside attention.
KV_CACHE_TYPES = ("f16", "int8")
INT8_SCALE_BYTES = 4


class KVCacheTypeRefused(ValueError):
    """A KV storage mode this model's layers cannot hold (the message says why)."""


@dataclass(frozen=True)
class KVCacheTypes:
    """How keys (`k`) and values (`v`) are stored, each one of KV_CACHE_TYPES."""

    k: str = "f16"
    v: str = "f16"

    def __post_init__(self) -> None:
        for side, mode in (("K", self.k), ("V", self.v)):
            if mode not in KV_CACHE_TYPES:
                raise KVCacheTypeRefused(f"unknown {side} cache type {mode!r}; the modes are {', '.join(KV_CACHE_TYPES)}")

    @property
    def quantized(self) -> bool:
        return self.k != "f16" or self.v != "f16"

    def refuse_quantized(self, why: str) -> None:
        if self.quantized:
            raise KVCacheTypeRefused(f"--cache-type-k {self.k} --cache-type-v {self.v}: quantized KV storage holds "
                                     f"per-head keys and values of attention layers, and {why}; use f16")


def kv_side_bytes(mode: str, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one token's keys (or values) of one layer take stored in `mode`: the one place
    a KV storage mode's size is defined (KVSpec, the pool's sizing and /props read it)."""
    if mode == "int8":
        return kv_heads * (head_dim + INT8_SCALE_BYTES)
    return kv_heads * head_dim * dtype_bytes


def layer_windows(config: dict, num_layers: int) -> list[int | None]:
    """Each layer's sliding-attention window as the config declares it (None: full attention):
    per layer type where the config lists them, by a period of local layers (Gemma 3's
    sliding_window_pattern), from `max_window_layers` on for Qwen's switch, else on every
    layer (Mistral, Mixtral, Phi-3, Starcoder2 read `sliding_window` that way)."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return [None] * num_layers
    types = config.get("layer_types")
    if types:
        return [window if t == "sliding_attention" else None for t in types[:num_layers]]
    pattern = config.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:
        return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]
    if config.get("use_sliding_window") and isinstance(config.get("max_window_layers"), int):
        return [window if i >= config["max_window_layers"] else None for i in range(num_layers)]
    return [window] * num_layers


class BackendUnavailable(RuntimeError):
    """The backend can run no more steps (a distributed group lost a rank): the engine fails the
    step's rows as unavailable (503), not as a server error, and the process is on its way out."""


class Backend(Protocol):
    """A loaded model the engine runs. The engine's KV manager owns the block pool
    (engine/kv_manager.py): the backend builds storage for the pool it is bound to and reads
    each row's block table from its ForwardRow; it allocates no blocks itself."""

    info: ModelInfo
    kv_spec: KVSpec

    def bind_kv(self, allocator: BlockAllocator) -> None:
        """(Re)build KV storage for the pool `allocator` hands blocks of; only while no
        sequence is live. Storage grows with the allocator's high-water mark. Where the
        allocator has a sliding group (`allocator.sliding`), each sliding layer's storage is over
        that group's pool and reads each row's sliding table (kv_block_pool.layer_groups,
        group_rows); every other layer's, over the allocator's own. A backend with
        recurrent layers keeps their states at each row's `cache.state` slot (allocator.states);
        a row whose sequence is empty starts from a zero state."""

    def forward(self, rows: list[ForwardRow]) -> np.ndarray:
        """Append each row's tokens to its sequence; return [len(rows), vocab] fp32 logits of
        each row's last position."""

    def forward_all(self, tokens: list[int], cache: SequenceKV,
                    lora: tuple[float, ...] | None = None) -> np.ndarray:
        """Like forward for one row (with `lora` as a ForwardRow's), but return logits for every
        position: [n, vocab]."""

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, group: int = 0) -> None:
        """Copy the keys and values of pool slots `src` to slots `dst` in every layer of block
        group `group` (every layer when the pool has one group)."""

    def hidden_states(self, tokens: list[int], cache: SequenceKV) -> np.ndarray:
        """Like forward_all, but the final hidden states (after the model's final norm) of every
        position instead of logits: [n, hidden] fp32. /v1/embeddings pools these."""


def kv_bytes_per_token(info: ModelInfo, dtype_bytes: int, types: KVCacheTypes | None = None) -> int:
    """Bytes one token's keys and values take across all layers, from the checkpoint config,
    stored as `types` says (default: both in the compute dtype, `dtype_bytes` a value)."""
    types = types or KVCacheTypes()
    c = info.config
    heads = c.get("num_attention_heads") or 1
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (c.get("hidden_size", 0) // heads)
    per_layer = kv_side_bytes(types.k, kv_heads, head_dim, dtype_bytes) + kv_side_bytes(types.v, kv_heads, head_dim,
                                                                                         dtype_bytes)
    return info.num_layers * per_layer


def latent_width(config: dict) -> int:
    """Values one token keeps per layer under multi-head latent attention (DeepSeek V2/V3): its
    compressed latent (kv_lora_rank) and the rotary key all heads share (qk_rope_head_dim); 0
    for any other attention. Both backends store exactly these (their MLA paths)."""
    rank = config.get("kv_lora_rank")
    return int(rank) + int(config.get("qk_rope_head_dim") or 0) if rank else 0
