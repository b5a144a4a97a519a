"""A deterministic stand-in for a model backend, and a tokenizer for it.

Everything that knows the Backend protocol (mlxcel/engine/backend.py) lives here, so a change
of the protocol is adapted in this one file.

The "model": the next token is a hash of the whole token history (`next_token`). The backend
keeps a storage array (pool slot -> the token written there), writes each forwarded token
through its sequence's block table, and computes every row's logits only from what it reads
back through that table. A wrong block table, a bad prefix-cache copy or a bad compaction
therefore changes the tokens served. Freshly allocated blocks are poisoned, so a position
nobody wrote never reads as right by luck.

With `recurrent=True` it is a recurrent model instead: the hash is carried as a per-sequence
state (FNV-1a folds token by token) in the row's state slot, and logits come from that state
alone, as a recurrent layer's output does. A sequence's first forward starts from the hash's
seed; every later one reads its slot, which holds poison until it was first written, so two
rows sharing a slot, or a row reading another's, serve wrong tokens.

With `window=w` it is a sliding-window model: the hash covers only the last w tokens, read back
through the block table as a sliding layer reads them, so a block freed too early (its table
entry reads the null block) serves wrong tokens. With `interleaved=True` as well it has a
sliding layer and a full-attention one: the hash covers the whole history and then its last w
tokens again, the first read through the global layers' table, the second through the sliding
layers' (their own block group where the pool has one, kept in storage of its own).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from mlxcel.engine.backend import ForwardRow, KVSpec, LayerKV, ModelInfo
from mlxcel.engine.kv_block_pool import BlockAllocator, SequenceKV, StateSlots, grown_slots

VOCAB = 512
EOS = 1  # never the argmax of `next_token`: generations end by length, shift or cancel
FIRST_WORD = 2  # ids below this are special
POISON = -7  # what a freshly allocated slot holds until a token is written to it
FNV_SEED = 0xCBF29CE484222325
STATE_BYTES = 32
KV_BYTES_PER_TOKEN = 64


def next_token(history) -> int:
    """The fake model: an FNV-1a hash of every token so far picks the next one."""
    return _pick(fold(FNV_SEED, history))


def fold(h: int, tokens) -> int:
    """The fake model's state after `tokens`, from state `h` (FNV-1a, one token at a time)."""
    for t in tokens:
        h = ((h ^ (int(t) & 0xFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def _pick(h: int) -> int:
    return FIRST_WORD + h % (VOCAB - FIRST_WORD)


def reference(prompt: list[int], n: int, *, n_ctx_slot: int | None = None, keep: int = 0,
              discard: int = 0, window: int | None = None, interleaved: bool = False) -> list[int]:
    """What a correct engine serves for `prompt` under greedy sampling: `n` tokens, each the
    model's pick given the history before it. With `n_ctx_slot`, a full context drops
    [keep, keep + discard) before the next token is appended (a context shift; discard 0:
    half of what follows the kept tokens). With `window`, each pick sees only the last `window`;
    `interleaved` as well, the whole history and then the last `window`."""
    kv, out = list(prompt), []
    while True:
        t = next_token(kv + kv[-window:] if interleaved else kv[-window:] if window else kv)
        out.append(t)
        if len(out) == n:
            return out
        if n_ctx_slot is not None and len(kv) + 1 > n_ctx_slot:
            drop = discard or (len(kv) - keep) // 2
            kv = kv[:keep] + kv[keep + drop:]
        kv.append(t)


def logits_for(token: int) -> np.ndarray:
    """One row of fp32 logits whose argmax is `token` (with a runner-up, so it is not one-hot)."""
    row = np.zeros(VOCAB, dtype=np.float32)
    row[FIRST_WORD + (token + 1 - FIRST_WORD) % (VOCAB - FIRST_WORD)] = 0.5
    row[token] = 1.0
    return row


@dataclass(frozen=True)
class StepRow:
    """One row of one forward, as the fake saw it: the sequence's first token (tests give each
    request a distinct one), how many tokens it appended, whether it was a decode row, the
    sequence's length before the step, and the sequence's tag (a compaction makes a new one)."""

    first: int
    n: int
    decode: bool
    start: int
    uid: int


class Hold:
    """A point where the engine thread stops inside a forward until the test releases it."""

    def __init__(self, predicate: Callable[[list[StepRow]], bool]) -> None:
        self.predicate = predicate
        self.step: list[StepRow] = []  # the rows of the forward it stopped
        self.reached = threading.Event()
        self.released = threading.Event()

    async def wait(self, timeout: float = 10) -> None:
        """Await (without blocking the event loop) the engine reaching this hold."""
        assert await asyncio.to_thread(self.reached.wait, timeout), "the engine never reached the hold"

    def release(self) -> None:
        self.released.set()


class FakeBackend:
    """Implements the Backend protocol: info, kv_spec, bind_kv, forward, forward_all,
    hidden_states, copy_slots. No `decode_greedy`: the engine takes its plain (unpipelined)
    decode path."""

    def __init__(self, context_length: int = 4096, recurrent: bool = False, window: int | None = None,
                 interleaved: bool = False) -> None:
        self.info = ModelInfo(path=Path("/nonexistent/fake-model"), model_type="fake", num_layers=1,
                              vocab_size=VOCAB, context_length=context_length, dtype="float32",
                              checkpoint_dtype="float32", quantization=None, backend="fake", device="cpu")
        self.recurrent, self.window = recurrent, window
        self.kv_spec = KVSpec((LayerKV("recurrent", 0, state_bytes=STATE_BYTES) if recurrent
                               else LayerKV("sliding", KV_BYTES_PER_TOKEN, window) if window
                               else LayerKV("full", KV_BYTES_PER_TOKEN),))
        self.interleaved = interleaved
        if interleaved:
            half = KV_BYTES_PER_TOKEN // 2
            self.kv_spec = KVSpec((LayerKV("sliding", half, window), LayerKV("full", half)))
        self.sliding_used: list[int] = []  # the sliding group's blocks in use as each forward starts
        self.sliding_storage = np.zeros(0, dtype=np.int64)  # the sliding group's slots, where it has one
        self.used_blocks: list[int] = []  # the pool's blocks in use as each forward starts
        self.states: dict[int, int] = {}  # state slot -> its state (recurrent); POISON until written
        self.state_rows: list[tuple[int, int]] = []  # (forwards so far, state slot) of every recurrent row run
        self.allocator: BlockAllocator | None = None
        self.storage = np.zeros(0, dtype=np.int64)
        self.steps: list[list[StepRow]] = []  # every forward's rows, in order
        self.compactions: list[tuple[list[int], list[int]]] = []  # (tokens before, after); the harness records them
        self.poison_reads = 0  # positions read that no token was ever written to
        self._holds: list[Hold] = []  # pending, in the order they are to be reached
        self._reached: list[Hold] = []
        self._lock = threading.Lock()
        self._uids = itertools.count(1)

    # -- the Backend protocol -----------------------------------------------------
    def bind_kv(self, allocator: BlockAllocator) -> None:
        """Storage for the engine's pool; every block it hands out is poisoned first."""
        self.allocator = allocator
        allocate = allocator.allocate

        def poisoned() -> int:
            block = allocate()
            self._poison(block)
            return block

        allocator.allocate = poisoned
        self.storage = np.zeros(0, dtype=np.int64)
        self.sliding_storage = np.zeros(0, dtype=np.int64)
        if allocator.sliding is not None:
            allocate_sliding = allocator.sliding.allocate

            def poisoned_sliding() -> int:
                block = allocate_sliding()
                self._poison(block, 1)
                return block

            allocator.sliding.allocate = poisoned_sliding
        if self.recurrent:
            self.states = {}
            if allocator.states is None:  # a direct driver's pool, as the real backends do
                allocator.states = StateSlots()
            claim = allocator.states.allocate

            def poisoned_state() -> int:
                slot = claim()
                self.states[slot] = POISON
                return slot

            allocator.states.allocate = poisoned_state

    def forward(self, rows: list[ForwardRow]) -> np.ndarray:
        step = [StepRow(self._first(r.cache, r.tokens), len(r.tokens), r.decode, r.cache.length,
                        self._uid(r.cache)) for r in rows]
        self._maybe_hold(step)
        self.steps.append(step)
        self.used_blocks.append(self.allocator.used_blocks)
        if self.allocator.sliding is not None:
            self.sliding_used.append(self.allocator.sliding.used_blocks)
        if self.recurrent:
            return np.stack([logits_for(_pick(self._advance(row.cache, row.tokens))) for row in rows])
        # a speculative verify row (a view of its sequence at a fixed length) reads up to its own end
        ends = [r.cache.length + len(r.tokens) for r in rows]
        for row in rows:  # every row's KV is written before any is read, as in one real forward
            self._write(row.cache, row.tokens)
        out = np.empty((len(rows), VOCAB), dtype=np.float32)
        for i, row in enumerate(rows):
            out[i] = logits_for(next_token(self._read(row.cache, ends[i])))
        return out

    def forward_all(self, tokens: list[int], cache: SequenceKV, lora: tuple[float, ...] | None = None) -> np.ndarray:
        if self.recurrent:
            return np.stack([logits_for(_pick(self._advance(cache, [t]))) for t in tokens])
        start = cache.length
        self._write(cache, tokens)
        return np.stack([logits_for(next_token(self._read(cache, p + 1))) for p in range(start, cache.length)])

    def hidden_states(self, tokens: list[int], cache: SequenceKV) -> np.ndarray:
        # a 4-wide "hidden state" per position: the pick and the history length it came from
        logits = self.forward_all(tokens, cache)
        start = cache.length - len(tokens)
        return np.asarray([[float(np.argmax(row)), float(start + i + 1), 0.0, 1.0] for i, row in enumerate(logits)],
                          dtype=np.float32)

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, group: int = 0) -> None:
        self._grow()
        storage = self.sliding_storage if group else self.storage
        storage[np.asarray(dst)] = storage[np.asarray(src)]

    # -- test controls ----------------------------------------------------------------
    def hold_when(self, predicate: Callable[[list[StepRow]], bool]) -> "Hold":
        """The first forward (after earlier holds were reached) whose rows satisfy `predicate`
        blocks before running until the returned hold is released: the engine's state is then
        frozen for the test to inspect or to submit and cancel against."""
        hold = Hold(predicate)
        with self._lock:
            self._holds.append(hold)
        return hold

    def release_all(self) -> None:
        with self._lock:
            holds, self._holds = self._holds, []
        for h in holds + self._reached:
            h.release()

    @property
    def forwards(self) -> int:
        return len(self.steps)

    def rows_of(self, first: int) -> list[tuple[int, StepRow]]:
        """(step index, row) of every step row of the requests whose prompt starts with `first`."""
        return [(i, r) for i, step in enumerate(self.steps) for r in step if r.first == first]

    # -- internals ----------------------------------------------------------------------
    def _maybe_hold(self, step: list[StepRow]) -> None:
        with self._lock:
            hold = self._holds[0] if self._holds and self._holds[0].predicate(step) else None
            if hold is not None:
                self._holds.pop(0)
                self._reached.append(hold)
        if hold is not None:
            hold.step = step
            hold.reached.set()
            # bounded: a test that never releases fails on its own assertions, not by hanging
            hold.released.wait(timeout=30)

    def _uid(self, seq: SequenceKV) -> int:
        """Which sequence a step row belongs to, for the tests (a compaction makes a new one)."""
        if not hasattr(seq, "fake_uid"):
            seq.fake_uid = next(self._uids)
        return seq.fake_uid

    @staticmethod
    def _first(seq: SequenceKV, tokens: list[int]) -> int:
        return seq.tokens[0] if seq.tokens else tokens[0]

    def _grow(self) -> None:
        size = grown_slots(self.allocator, len(self.storage))
        if size is not None:
            grown = np.full(size, POISON, dtype=np.int64)
            grown[: len(self.storage)] = self.storage
            self.storage = grown
        if self.allocator.sliding is not None:
            size = grown_slots(self.allocator.sliding, len(self.sliding_storage))
            if size is not None:
                grown = np.full(size, POISON, dtype=np.int64)
                grown[: len(self.sliding_storage)] = self.sliding_storage
                self.sliding_storage = grown

    def _poison(self, block: int, group: int = 0) -> None:
        self._grow()
        bs = self.allocator.block_size
        (self.sliding_storage if group else self.storage)[block * bs:(block + 1) * bs] = POISON

    def _write(self, seq: SequenceKV, tokens: list[int]) -> None:
        start = seq.length
        seq.reserve(len(tokens))
        self._grow()
        self.storage[seq.slots(start, start + len(tokens))] = tokens
        if self.allocator.sliding is not None:
            self.sliding_storage[seq.slots(start, start + len(tokens), 1)] = tokens
        seq.tokens.extend(tokens)

    def _advance(self, seq: SequenceKV, tokens: list[int]) -> int:
        """A recurrent row's step: its state (the seed for an empty sequence) folded over its
        new tokens, written back to its slot; the tokens are booked as the real backends do."""
        seq.reserve(len(tokens))
        self.state_rows.append((len(self.steps), seq.state))
        h = FNV_SEED if seq.length == 0 else self.states[seq.state]
        if h == POISON:
            self.poison_reads += 1
        h = fold(h, tokens)
        self.states[seq.state] = h
        seq.tokens.extend(tokens)
        return h

    def _read(self, seq: SequenceKV, stop: int) -> np.ndarray:
        """The history a query after position stop - 1 attends: all of it, or its window; both
        when interleaved, the window through the sliding group's table where there is one."""
        if self.interleaved:
            start = max(0, stop - self.window)
            group = 1 if self.allocator.sliding is not None else 0
            local = (self.sliding_storage if group else self.storage)[seq.slots(start, stop, group)]
            history = np.concatenate([self.storage[seq.slots(0, stop)], local])
        else:
            history = self.storage[seq.slots(max(0, stop - self.window) if self.window else 0, stop)]
        self.poison_reads += int(np.count_nonzero(history == POISON))
        return history


class FakeTokenizer:
    """What the engine calls on a tokenizer: token i reads as " w{i}" (specials as "<s{i}>",
    dropped unless kept), EOS is id 1."""

    eos_token_ids = frozenset({EOS})
    vocab_size = VOCAB

    @staticmethod
    def _text(i: int) -> str:
        return f"<s{i}>" if i < FIRST_WORD else f" w{i}"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self._text(i) for i in ids if not (skip_special_tokens and i < FIRST_WORD))

    def decoder(self, keep: frozenset[int] = frozenset()):
        return lambda ids: "".join(self._text(i) for i in ids if i >= FIRST_WORD or i in keep)

    @property
    def pieces(self) -> list[bytes]:
        return [self._text(i).encode() for i in range(VOCAB)]

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        return [int(w[1:]) for w in text.split() if w.startswith("w") and w[1:].isdigit()]
