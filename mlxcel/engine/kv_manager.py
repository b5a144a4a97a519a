"""The engine's one owner of KV memory: the block pool, its sizing, the prefix cache, and every
sequence's block table.

A backend states what each layer keeps per token (`KVSpec`) and builds storage for the pool it
is bound to (`Backend.bind_kv`); it never allocates a block. The manager sizes the pool from the
slots' context shares plus the prefix cache's byte budget, creates each admitted row's sequence
(adopting the longest cached prefix), compacts a sequence on a context shift, and on release
offers its blocks to the prefix cache before giving them back.

Layer kinds: attention layers keep a record per token in the one pool: keys and values
("full", and "sliding", whose attention reads only its window), or
multi-head latent attention's compressed latent ("latent": a smaller record, sized by its
`bytes_per_token`, in the same blocks). Recurrent layers keep a fixed-size state per sequence
instead: the manager gives each live sequence one state slot (kv_block_pool.StateSlots, sized
for the slots plus one scoring pass) beside its block table. A state summarises every token
before it and cannot be shared, rewound or cut, so for such a model the prefix cache is off
(`prefix_cache_off`) and a context shift is refused; the engine disables it
(`RECURRENT_NO_SHIFT`).

Sliding windows: a block goes back to the pool only when no layer of its table reads it. Where
every attention layer slides (Mistral's `sliding_window`), each sequence frees the blocks wholly
behind the widest window as it grows (kv_block_pool), keeping those the window before its
prompt's end reads, so the prefix cache can still resume that prompt; a cached chain whose
window was freed is resumed only where its window is held (kv_prefix_cache). Interleaved
local/global models (Gemma 2/3, gpt-oss, Cohere 2, EXAONE 4, OLMo 3) give their sliding layers a
block group of their own (a second allocator, the same size as the global one, and a second
table per sequence) that frees the same way, while the global layers' table keeps every block;
storage grows with each group's high-water mark, so the sliding group's stays near its windows.
A context shift brings kept early tokens back into the window, so with --context-shift on every
block is kept, as with --swa-full. `window_policy` says which, for /props.
Quantized storage (`LayerKV.quant`, from --cache-type-k / --cache-type-v: engine/backend.py's
KVCacheTypes) changes only what a block's slots hold and how many bytes a token takes: the backend
quantizes a slot as it writes it and dequantizes inside attention, and every copy here (a context
shift's compaction, a partial prefix block's copy) moves the quantized records with their scales.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from mlxcel.engine.backend import Backend, KVSpec
from mlxcel.engine.kv_block_pool import RESERVED, BlockAllocator, SequenceKV, StateSlots
from mlxcel.engine.kv_prefix_cache import PrefixCache

# Token-block size of the paged KV pool and the prefix cache's sharing granularity.
BLOCK_SIZE = 16

HELD_KINDS = frozenset({"full", "sliding", "latent", "recurrent"})
QUANT_KINDS = frozenset({"full", "sliding"})  # layers whose keys and values may be stored quantized

log = logging.getLogger("mlxcel.engine")

# why a model with recurrent layers runs without the prefix cache and without a context shift
RECURRENT_NO_PREFIX = ("its recurrent layers keep one state per sequence, not per token, and no state is "
                       "kept at block boundaries, so a cached prefix could not be resumed")
RECURRENT_NO_SHIFT = ("its recurrent layers' state summarises every token so far and cannot drop some of "
                      "them, so a full context ends the request instead")
# why a model with sliding-window layers keeps the blocks behind its windows
WINDOW_NONE = "no layer of this model has a sliding window"
WINDOW_KEPT_SHIFT = "--context-shift is on: a shift brings kept early tokens back into the window"
WINDOW_KEPT_FULL = "--swa-full is on"
WINDOW_KEPT_DRAFT = "a draft model's sequence rewinds over its rejected drafts"


class KVLayoutUnsupported(ValueError):
    """The backend's layers keep KV in a form this manager does not hold (the message says which)."""


def check_spec(spec: KVSpec) -> None:
    missing = sorted(spec.kinds - HELD_KINDS)
    if missing:
        raise KVLayoutUnsupported(f"the paged KV pool holds {', '.join(sorted(HELD_KINDS))} attention layers; "
                                  f"this model also has {', '.join(missing)} layers")
    quant = sorted({layer.kind for layer in spec.layers if layer.quant and layer.kind not in QUANT_KINDS})
    if quant:
        raise KVLayoutUnsupported(f"quantized KV blocks hold {', '.join(sorted(QUANT_KINDS))} attention layers' keys "
                                  f"and values, not {', '.join(quant)} layers")


def shared_window(spec: KVSpec) -> int | None:
    """The widest window when every attention layer slides (recurrent layers keep no blocks);
    None when some attention layer reads every token, or none slides."""
    attn = [layer for layer in spec.layers if layer.kind != "recurrent"]
    if not attn or any(layer.kind != "sliding" or not layer.window for layer in attn):
        return None
    return max(layer.window for layer in attn)


def sliding_group_window(spec: KVSpec) -> int | None:
    """The widest window of the sliding layers when they sit beside layers that read every
    token (they then keep a block group of their own); None otherwise."""
    sliding = [layer.window for layer in spec.layers if layer.kind == "sliding" and layer.window]
    if not sliding or shared_window(spec) is not None:
        return None
    return max(sliding)


def compacted(seq: SequenceKV, keep: int, discard: int,
              copy_slots: Callable[[np.ndarray, np.ndarray], None]) -> SequenceKV:
    """A context shift over a paged sequence: a new sequence (same allocator) holding seq's
    tokens without [keep, keep + discard), their keys/values copied slot for slot by the
    backend's `copy_slots(src, dst)`. Kept keys keep their rotation; `shift` makes the new
    sequence continue at seq's logical position."""
    kept = list(range(keep)) + list(range(keep + discard, seq.length))
    out = SequenceKV(seq.allocator)
    out.reserve(len(kept))
    copy_slots(seq.slots(0, seq.length)[kept], out.slots(0, len(kept)))
    out.tokens = [seq.tokens[i] for i in kept]
    out.shift = seq.position - len(kept)
    return out


class KVManager:
    """`n_ctx_slot` tokens for each of `parallel` slots, plus the prefix cache's share:
    `budget_bytes` (0: no prefix cache; None: no budget of its own, then `headroom` more slot
    shares are added to the pool for it, and it keeps what the free blocks hold)."""

    def __init__(self, *, n_ctx_slot: int, parallel: int, budget_bytes: int | None,
                 headroom: int = 4, block_size: int = BLOCK_SIZE, keep_window: str | None = None) -> None:
        self.n_ctx_slot, self.parallel = n_ctx_slot, max(1, parallel)
        self.budget_bytes, self.headroom, self.block_size = budget_bytes, headroom, block_size
        self.backend: Backend | None = None
        self.allocator = BlockAllocator(RESERVED + 1, block_size)
        self.prefix_cache = PrefixCache(self.allocator, 0)
        self.recurrent = False  # the bound model has recurrent layers (one state slot per sequence)
        # why sequences keep the blocks behind a window all layers share, if they must
        self.keep_window = keep_window
        self.window_policy: dict = {"free_behind_window": False, "free_behind_window_off_reason": WINDOW_NONE}

    @property
    def state_slots(self) -> int:
        """Recurrent state slots a pool holds: one per engine slot, and one for a scoring or
        embedding pass, which runs on its own sequence beside the live rows."""
        return self.parallel + 1

    @property
    def prefix_cache_off(self) -> str | None:
        """Why the bound model runs without the prefix cache, or None when it has one."""
        if self.recurrent:
            return RECURRENT_NO_PREFIX
        return None if self.budget_bytes != 0 else "--cache-prompt is off or --cache-ram is 0"

    def pool_blocks(self, bytes_per_token: int, budget_bytes: int | None = -1) -> tuple[int, int | None]:
        """(blocks in the pool, the prefix cache's block budget or None) for a backend storing
        `bytes_per_token` across its layers; `budget_bytes` overrides the manager's (-1: not)."""
        budget_bytes = self.budget_bytes if budget_bytes == -1 else budget_bytes
        per_slot = -(-self.n_ctx_slot // self.block_size) + 1
        if budget_bytes == 0:
            budget = 0
        elif budget_bytes is None:
            budget = None
        else:
            budget = max(budget_bytes // (max(bytes_per_token, 1) * self.block_size), 1)
        extra = budget if budget is not None else self.headroom * per_slot * self.parallel
        return RESERVED + per_slot * self.parallel + extra, budget

    def bind(self, backend: Backend) -> None:
        """Size a fresh pool for `backend` and have it build the storage; no sequence may be live."""
        spec = backend.kv_spec
        check_spec(spec)
        self.recurrent = spec.recurrent
        num_blocks, budget = self.pool_blocks(spec.bytes_per_token, 0 if self.recurrent else -1)
        self.allocator = BlockAllocator(num_blocks, self.block_size)
        self._bind_window(spec)
        if self.recurrent:
            self.allocator.states = StateSlots(self.state_slots)
            log.info("recurrent state: %d slots of %d bytes; prefix cache off: %s", self.state_slots,
                     spec.state_bytes, RECURRENT_NO_PREFIX)
        backend.bind_kv(self.allocator)
        self.backend = backend
        self.prefix_cache = PrefixCache(self.allocator, budget)

    def _bind_window(self, spec: KVSpec) -> None:
        """Whether sequences free blocks behind the model's window, and why not (window_policy)."""
        window, group_window = shared_window(spec), sliding_group_window(spec)
        reason = WINDOW_NONE if window is None and group_window is None else self.keep_window
        if reason is None and window is not None:
            self.allocator.window = window
            log.info("sliding window %d on every attention layer: blocks behind it go back to the pool", window)
        elif reason is None:
            self.allocator.sliding = BlockAllocator(self.allocator.num_blocks, self.block_size)
            self.allocator.sliding.window = group_window
            log.info("sliding window %d on some layers: their own block group frees behind it", group_window)
        elif reason is not WINDOW_NONE:
            log.info("sliding-window layers keep every block: %s", reason)
        self.window_policy = {"free_behind_window": reason is None, "free_behind_window_off_reason": reason}

    def unbind(self) -> None:
        """Let go of the backend, its pool and the prefix cache that lived in it (idle sleep)."""
        self.backend = None
        self.allocator = BlockAllocator(RESERVED + 1, self.block_size)
        self.prefix_cache = PrefixCache(self.allocator, 0)

    def new_sequence(self) -> SequenceKV:
        return SequenceKV(self.allocator)

    def start(self, prompt: list[int], use_cache: bool, key: list[int] | None = None) -> tuple[SequenceKV, int]:
        """A new sequence for `prompt`, starting from its longest cached prefix when `use_cache`;
        returns it and how many prompt tokens the cache supplied. `key`: the prompt as the cache
        keys it, where it differs (GenerationRequest.cache_tokens); the sequence holds `prompt`."""
        seq = self.new_sequence()
        seq.claim_state()  # a recurrent model's state slot is the row's from admission on
        if use_cache and self.prefix_cache.enabled:
            seq.prompt_end = len(prompt)  # keep what resuming this prompt from the cache reads
        cached = self.prefix_cache.adopt(seq, key or prompt, self.copy_slots) if use_cache else 0
        if key:
            seq.tokens[:cached] = prompt[:cached]
        return seq, cached

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, group: int = 0) -> None:
        """Copy pool slots in the layers of block group `group` (every layer without groups)."""
        if group:
            self.backend.copy_slots(src, dst, group)
        else:
            self.backend.copy_slots(src, dst)

    def compact(self, seq: SequenceKV, keep: int, discard: int) -> SequenceKV:
        """A context shift: seq without [keep, keep + discard), continuing at its logical
        position; seq is released (never donated: its later blocks no longer match their
        token positions)."""
        if self.recurrent:
            raise KVLayoutUnsupported(f"no context shift for this model: {RECURRENT_NO_SHIFT}")
        if self.allocator.window is not None or self.allocator.sliding is not None:  # kept when it may shift
            raise KVLayoutUnsupported("no context shift over a sequence that frees blocks behind its window")
        out = compacted(seq, keep, discard, self.copy_slots)
        seq.release()
        return out

    def release(self, seq: SequenceKV, donate: bool, key: list[int] | None = None) -> None:
        """Give a sequence's blocks back, offering them to the prefix cache first when `donate`,
        under `key` for the prompt's tokens where it has one (GenerationRequest.cache_tokens)."""
        if donate:
            tokens = seq.tokens if not key else key[:seq.length] + seq.tokens[len(key):]
            self.prefix_cache.insert(tokens, seq.blocks, seq.sliding if self.allocator.sliding else None)
        seq.release()
        self.prefix_cache.trim()

    def storage_mode(self) -> dict:
        """How keys and values are stored and what a token of context costs, for /props."""
        spec = self.backend.kv_spec if self.backend is not None else None
        quant = next((layer.quant for layer in spec.layers if layer.quant), None) if spec else None
        return {"cache_type_k": quant.k if quant else "f16", "cache_type_v": quant.v if quant else "f16",
                "bytes_per_token": spec.bytes_per_token if spec else 0}

    def usage(self) -> dict[str, int]:
        """Block pool occupancy, for /metrics and /props (all zero while unbound); with
        recurrent layers, the state slots in use of those the pool holds; where the sliding layers
        keep a block group of their own, its blocks in use and free."""
        if self.backend is None:
            return {"block_size": self.block_size, "total_blocks": 0, "used_blocks": 0, "cached_blocks": 0,
                    "free_blocks": 0}
        a = self.allocator
        out = {"block_size": a.block_size, "total_blocks": a.num_blocks - RESERVED, "used_blocks": a.used_blocks,
               "cached_blocks": self.prefix_cache.cached_blocks, "free_blocks": a.free_blocks}
        if a.states is not None:
            out.update(state_slots_total=a.states.capacity, state_slots_used=a.states.used,
                       state_bytes_per_slot=self.backend.kv_spec.state_bytes)
        if a.sliding is not None:
            out.update(sliding_used_blocks=a.sliding.used_blocks, sliding_free_blocks=a.sliding.free_blocks)
        return out
