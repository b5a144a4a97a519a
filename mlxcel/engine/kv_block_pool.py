"""KV memory as fixed-size token blocks: the allocator and per-sequence block tables.

The allocator hands out block ids and counts references to them: a block is shared by
every sequence whose table lists it and by the prefix cache when it holds it. A block is
immutable once full, so sharing never needs a copy; new tokens always land in a block
the sequence owns alone (a partly filled block the prefix cache holds is copied, never
shared). Block 0 is never handed out and stays zero (padding reads point
at it); block 1 is scratch (padding writes land there and are never read).

A model with recurrent layers (a fixed-size state per sequence, not per token) also takes one
state slot per live sequence from the allocator's `StateSlots`: claimed with its first tokens
(the KV manager claims it at admission), given back with its blocks. The backend keeps each
recurrent layer's state at the slot's index; a sequence of length 0 reads a zero state, so a
reused slot needs no clearing.

When every attention layer of the model slides (the allocator's `window`, set by the KV manager),
a sequence gives back each block whose tokens no later query can see: before `reserve` makes
room at length L, every block wholly before L - window + 1 is released and its table entry
becomes NULL_BLOCK, which reads as zeros behind the mask. Blocks covering the window before
`prompt_end` are kept, so the prefix cache can resume that prompt. Only positions a rewind
(`truncate`) can no longer reach are freed: a rewind never goes behind the length of the last
`reserve`, and one that would is refused.

The backend owns the storage behind the ids; this module owns only the bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NULL_BLOCK = 0
SCRATCH_BLOCK = 1
RESERVED = 2


class OutOfBlocks(RuntimeError):
    pass


class OutOfStateSlots(OutOfBlocks):
    pass


class StateSlots:
    """Recurrent-state slot ids, one per live sequence: at most `capacity` at once (None: as many
    as asked, for direct drivers of a backend); lowest free id first."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._free: list[int] = []
        self._next = 0  # ids handed out so far: storage must hold this many

    @property
    def used(self) -> int:
        return self._next - len(self._free)

    @property
    def high_water(self) -> int:
        return self._next

    def allocate(self) -> int:
        if self._free:
            self._free.sort(reverse=True)
            return self._free.pop()
        if self.capacity is not None and self._next >= self.capacity:
            raise OutOfStateSlots(f"all {self.capacity} recurrent state slots are in use")
        self._next += 1
        return self._next - 1

    def free(self, slot: int) -> None:
        assert slot not in self._free and 0 <= slot < self._next, f"state slot {slot} freed twice or never allocated"
        self._free.append(slot)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= RESERVED:
            raise ValueError("the KV pool needs more blocks than it reserves")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, RESERVED - 1, -1))  # pop() gives low ids first
        self._refs = np.zeros(num_blocks, dtype=np.int32)
        self.evict_hook = None  # callable(n) -> freed count; set by the prefix cache
        self._high = SCRATCH_BLOCK
        self.states: StateSlots | None = None  # set for a model with recurrent layers
        self.window: int | None = None  # set where sequences free blocks behind a sliding window

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - RESERVED - len(self._free)

    def make_room(self, n: int) -> None:
        """Have the prefix cache free what `n` allocations still lack, in one eviction pass (its
        scan is over every cached block, so a prompt chunk's blocks should not each pay for one)."""
        if n > len(self._free) and self.evict_hook is not None:
            self.evict_hook(n - len(self._free))

    def allocate(self) -> int:
        if not self._free and self.evict_hook is not None:
            self.evict_hook(1)
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks - RESERVED} KV blocks are in use")
        block = self._free.pop()
        self._refs[block] = 1
        self._high = max(self._high, block)
        return block

    def high_water(self) -> int:
        """The highest block id ever handed out (storage must reach it)."""
        return self._high

    def ref(self, block: int) -> None:
        self._refs[block] += 1

    def unref(self, block: int) -> None:
        if block == NULL_BLOCK:  # a freed table entry: never counted
            return
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def refs(self, block: int) -> int:
        return int(self._refs[block])


@dataclass
class SequenceKV:
    """One sequence's block table and the tokens whose keys and values it stores.

    `shift` is how far the RoPE position runs ahead of the stored length after a context
    shift dropped tokens: kept keys keep the rotation they were computed with, so new tokens
    continue from the logical position rather than reusing positions. `state` is the sequence's
    recurrent state slot (None for a model without recurrent layers); `state_ahead` is set once
    a truncation left that state past the stored tokens (a state cannot be rewound)."""

    allocator: BlockAllocator
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    shift: int = 0
    state: int | None = None
    state_ahead: bool = False
    prompt_end: int = 0  # the prefix cache may resume here: the window before it is kept
    freed: int = 0  # leading table entries already checked for freeing

    def claim_state(self) -> None:
        """Take a recurrent state slot, where the model has recurrent layers and none is held."""
        if self.state is None and self.allocator.states is not None:
            self.state = self.allocator.states.allocate()

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def position(self) -> int:
        """The RoPE position of the next token."""
        return len(self.tokens) + self.shift

    def adopt(self, blocks: list[int], tokens: list[int]) -> None:
        """Start from shared full blocks (already referenced for us by the caller); a partial
        block's copy comes after them (PrefixCache.adopt)."""
        assert not self.blocks and len(tokens) == len(blocks) * self.allocator.block_size
        self.blocks = list(blocks)
        self.tokens = list(tokens)

    def reserve(self, n: int) -> None:
        """Make room for `n` more tokens."""
        self.claim_state()
        self.free_behind_window()
        bs = self.allocator.block_size
        need = (self.length + n + bs - 1) // bs - len(self.blocks)
        self.allocator.make_room(need)
        for _ in range(need):
            self.blocks.append(self.allocator.allocate())

    def free_behind_window(self) -> None:
        """Release the blocks no query from the current length on can read (allocator.window),
        except those the window before `prompt_end` covers."""
        window, bs = self.allocator.window, self.allocator.block_size
        if window is None:
            return
        cut = min(max(0, (self.length - window + 1) // bs), len(self.blocks))
        keep = range(max(0, self.prompt_end - window) // bs, -(-self.prompt_end // bs))
        for i in range(self.freed, cut):
            if i not in keep and self.blocks[i] != NULL_BLOCK:
                self.allocator.unref(self.blocks[i])
                self.blocks[i] = NULL_BLOCK
        self.freed = max(self.freed, cut)

    def holds_window(self, n: int) -> bool:
        """Whether a query at position n finds every key its window reads (always, without one)."""
        window, bs = self.allocator.window, self.allocator.block_size
        if window is None or n == 0:
            return True
        return NULL_BLOCK not in self.blocks[max(0, n - window + 1) // bs:(n - 1) // bs + 1]

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Pool slot index of each token position in [start, stop)."""
        bs = self.allocator.block_size
        pos = np.arange(start, stop)
        return np.asarray(self.blocks, dtype=np.int64)[pos // bs] * bs + pos % bs

    def truncate(self, n: int) -> None:
        """Forget positions n onward (a rejected speculative draft): whole blocks past the new
        end go back; the tail of the last kept block is overwritten by the next tokens. Only
        positions this sequence wrote itself are ever dropped, never a shared full block's."""
        if n >= self.length:
            return
        if not self.holds_window(n):
            raise RuntimeError(f"a rewind to {n} tokens reaches blocks freed behind the sliding window")
        if self.state is not None:
            self.state_ahead = True  # its tokens can be trimmed, the state they produced cannot
        keep_blocks = -(-n // self.allocator.block_size)
        for b in self.blocks[keep_blocks:]:
            self.allocator.unref(b)
        del self.blocks[keep_blocks:]
        del self.tokens[n:]
        self.freed = min(self.freed, keep_blocks)

    def release(self) -> None:
        for b in self.blocks:
            self.allocator.unref(b)
        if self.state is not None:
            self.allocator.states.free(self.state)
        self.blocks, self.tokens, self.shift = [], [], 0
        self.state, self.state_ahead = None, False
        self.prompt_end, self.freed = 0, 0


def grown_slots(allocator: "BlockAllocator", have: int) -> int | None:
    """How many token slots a layer's KV storage should hold now that the allocator has handed
    out blocks up to its high-water mark: None while `have` suffices, else at least that many,
    doubling (capped at the pool) so growth is amortised. Both backends' storages use it."""
    need = (max(allocator.high_water(), SCRATCH_BLOCK) + 1) * allocator.block_size
    if have >= need:
        return None
    return max(need, min(2 * max(have, 1), allocator.num_blocks * allocator.block_size))
