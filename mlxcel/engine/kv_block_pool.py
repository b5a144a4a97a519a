"""KV memory as fixed-size token blocks: the allocator and per-sequence block tables.

The allocator hands out block ids and counts references to them: a block is shared by
every sequence whose table lists it and by the prefix cache when it holds it. A block is
immutable once full, so sharing never needs a copy; new tokens always land in a block
the sequence owns alone (a partly filled block the prefix cache holds is copied, never
shared). Block 0 is never handed out and stays zero (padding reads point
at it); block 1 is scratch (padding writes land there and are never read).

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
    continue from the logical position rather than reusing positions."""

    allocator: BlockAllocator
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    shift: int = 0

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
        bs = self.allocator.block_size
        need = (self.length + n + bs - 1) // bs - len(self.blocks)
        self.allocator.make_room(need)
        for _ in range(need):
            self.blocks.append(self.allocator.allocate())

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
        keep_blocks = -(-n // self.allocator.block_size)
        for b in self.blocks[keep_blocks:]:
            self.allocator.unref(b)
        del self.blocks[keep_blocks:]
        del self.tokens[n:]

    def release(self) -> None:
        for b in self.blocks:
            self.allocator.unref(b)
        self.blocks, self.tokens, self.shift = [], [], 0


def grown_slots(allocator: "BlockAllocator", have: int) -> int | None:
    """How many token slots a layer's KV storage should hold now that the allocator has handed
    out blocks up to its high-water mark: None while `have` suffices, else at least that many,
    doubling (capped at the pool) so growth is amortised. Both backends' storages use it."""
    need = (max(allocator.high_water(), SCRATCH_BLOCK) + 1) * allocator.block_size
    if have >= need:
        return None
    return max(need, min(2 * max(have, 1), allocator.num_blocks * allocator.block_size))
