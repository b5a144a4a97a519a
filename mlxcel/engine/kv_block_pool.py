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

Where only some layers slide (Gemma 2/3, gpt-oss: local layers interleaved with global ones),
the sliding layers' storage is a block group of its own: a second allocator (the allocator's
`sliding`, whose `window` is set) and a second table per sequence (`SequenceKV.sliding`), entry
for entry beside the global layers' table. The global table keeps every block; the sliding one
frees behind the window as above. A backend gives each layer its group's table (`group_rows`,
`layer_groups`); both tables grow together, so the sliding pool never holds more blocks than the
global one.

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
        self.sliding: BlockAllocator | None = None  # the sliding layers' own group (interleaved models)

    @property
    def groups(self) -> int:
        """Block groups: 2 where the sliding layers keep their own blocks, else 1."""
        return 1 if self.sliding is None else 2

    def group(self, g: int) -> BlockAllocator:
        return self.sliding if g else self

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
    sliding: list[int] = field(default_factory=list)  # the sliding layers' table (allocator.sliding)

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

    def adopt(self, blocks: list[int], tokens: list[int], sliding: list[int] | None = None) -> None:
        """Start from shared full blocks (already referenced for us by the caller), and the
        sliding group's beside them where it has one; a partial block's copy comes after them
        (PrefixCache.adopt)."""
        assert not self.blocks and len(tokens) == len(blocks) * self.allocator.block_size
        assert (self.allocator.sliding is None) == (sliding is None) and len(sliding or blocks) == len(blocks)
        self.blocks = list(blocks)
        self.sliding = list(sliding or [])
        self.tokens = list(tokens)

    def reserve(self, n: int) -> None:
        """Make room for `n` more tokens."""
        self.claim_state()
        self.free_behind_window()
        bs = self.allocator.block_size
        total = (self.length + n + bs - 1) // bs
        for table, allocator in self._tables():
            need = total - len(table)
            allocator.make_room(need)
            for _ in range(need):
                table.append(allocator.allocate())

    def _tables(self) -> list[tuple[list[int], BlockAllocator]]:
        """Each block group's table and allocator: the global one, then the sliding one if any."""
        a = self.allocator
        return [(self.blocks, a)] if a.sliding is None else [(self.blocks, a), (self.sliding, a.sliding)]

    def _windowed(self) -> tuple[list[int], BlockAllocator] | None:
        """The table that frees behind a window and its allocator (which holds the window)."""
        a = self.allocator
        return (self.blocks, a) if a.window is not None else (self.sliding, a.sliding) if a.sliding else None

    def free_behind_window(self) -> None:
        """Release the blocks no query from the current length on can read (the windowed
        table's allocator.window), except those the window before `prompt_end` covers."""
        windowed = self._windowed()
        if windowed is None:
            return
        table, allocator = windowed
        window, bs = allocator.window, allocator.block_size
        cut = min(max(0, (self.length - window + 1) // bs), len(table))
        keep = range(max(0, self.prompt_end - window) // bs, -(-self.prompt_end // bs))
        for i in range(self.freed, cut):
            if i not in keep and table[i] != NULL_BLOCK:
                allocator.unref(table[i])
                table[i] = NULL_BLOCK
        self.freed = max(self.freed, cut)

    def holds_window(self, n: int) -> bool:
        """Whether a query at position n finds every key its window reads (always, without one)."""
        windowed = self._windowed()
        if windowed is None or n == 0:
            return True
        table, allocator = windowed
        window, bs = allocator.window, allocator.block_size
        return NULL_BLOCK not in table[max(0, n - window + 1) // bs:(n - 1) // bs + 1]

    def slots(self, start: int, stop: int, group: int = 0) -> np.ndarray:
        """Pool slot index of each token position in [start, stop), in block group `group`'s pool."""
        bs = self.allocator.block_size
        pos = np.arange(start, stop)
        return np.asarray(self.sliding if group else self.blocks, dtype=np.int64)[pos // bs] * bs + pos % bs

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
        for table, allocator in self._tables():
            for b in table[keep_blocks:]:
                allocator.unref(b)
            del table[keep_blocks:]
        del self.tokens[n:]
        self.freed = min(self.freed, keep_blocks)

    def release(self) -> None:
        for table, allocator in self._tables():
            for b in table:
                allocator.unref(b)
        if self.state is not None:
            self.allocator.states.free(self.state)
        self.blocks, self.sliding, self.tokens, self.shift = [], [], [], 0
        self.state, self.state_ahead = None, False
        self.prompt_end, self.freed = 0, 0


class GroupView:
    """A sequence as one block group's layers read it (a backend's step plan): the same tokens
    and positions, that group's table and allocator."""

    def __init__(self, seq: SequenceKV, group: int) -> None:
        self.seq, self.group = seq, group
        self.allocator = seq.allocator.group(group)

    @property
    def length(self) -> int:
        return self.seq.length

    @property
    def position(self) -> int:
        return self.seq.position

    def slots(self, start: int, stop: int) -> np.ndarray:
        return self.seq.slots(start, stop, self.group)


def group_rows(rows: list[tuple[SequenceKV, int]], group: int) -> list[tuple[SequenceKV | GroupView, int]]:
    """A step's (sequence, new tokens) rows as block group `group` reads them."""
    return rows if group == 0 else [(GroupView(seq, group), n) for seq, n in rows]


def layer_groups(allocator: BlockAllocator, windows: list[int | None]) -> list[int]:
    """Each layer's block group: 1 for a sliding layer where the sliding layers keep their own
    blocks (allocator.sliding), else 0."""
    return [1 if allocator.sliding is not None and w else 0 for w in windows]


def grown_slots(allocator: "BlockAllocator", have: int) -> int | None:
    """How many token slots a layer's KV storage should hold now that the allocator has handed
    out blocks up to its high-water mark: None while `have` suffices, else at least that many,
    doubling (capped at the pool) so growth is amortised. Both backends' storages use it."""
    need = (max(allocator.high_water(), SCRATCH_BLOCK) + 1) * allocator.block_size
    if have >= need:
        return None
    return max(need, min(2 * max(have, 1), allocator.num_blocks * allocator.block_size))
