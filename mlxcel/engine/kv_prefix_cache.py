"""The prompt-prefix cache: a radix tree over full token blocks pointing at shared KV.

Each node is one full block: its `block_size` tokens are the edge label, its block id is
the KV those tokens produced given every token above it. A request adopts the longest
chain of blocks matching its prompt (always leaving at least one prompt token to run, so
the step yields logits) and donates its own full blocks back when it ends. The tree holds
one reference per block; eviction drops least-recently-used leaves that no live sequence
shares, under a block budget derived from the byte budget.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from mlxcel.engine.kv_block_pool import BlockAllocator

_clock = itertools.count()


@dataclass
class _Node:
    key: tuple[int, ...]
    block: int
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_used: int = 0


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, budget_blocks: int | None) -> None:
        self.allocator = allocator
        self.budget_blocks = budget_blocks  # None: no limit beyond the pool
        self.root = _Node((), -1, None)
        self.cached_blocks = 0
        allocator.evict_hook = self.evict

    @property
    def enabled(self) -> bool:
        return self.budget_blocks is None or self.budget_blocks > 0

    def match(self, prompt: list[int]) -> tuple[list[int], int]:
        """Blocks for the longest cached prefix of `prompt` (referenced for the caller) and
        the number of tokens they cover."""
        if not self.enabled:
            return [], 0
        bs = self.allocator.block_size
        node, blocks, now = self.root, [], next(_clock)
        for i in range((len(prompt) - 1) // bs):
            child = node.children.get(tuple(prompt[i * bs:(i + 1) * bs]))
            if child is None:
                break
            child.last_used = now
            self.allocator.ref(child.block)
            blocks.append(child.block)
            node = child
        return blocks, len(blocks) * bs

    def insert(self, tokens: list[int], blocks: list[int]) -> None:
        """Offer a sequence's full blocks (tokens[i*bs:(i+1)*bs] -> blocks[i])."""
        if not self.enabled:
            return
        bs = self.allocator.block_size
        node, now = self.root, next(_clock)
        for i in range(min(len(tokens) // bs, len(blocks))):
            key = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                child = _Node(key, blocks[i], node)
                node.children[key] = child
                self.allocator.ref(blocks[i])
                self.cached_blocks += 1
            child.last_used = now
            node = child
        if self.budget_blocks is not None and self.cached_blocks > self.budget_blocks:
            self.evict(self.cached_blocks - self.budget_blocks)

    def evict(self, n: int) -> int:
        """Drop up to `n` least-recently-used leaves that no live sequence shares."""
        freed = 0
        while freed < n:
            leaves = [x for x in self._nodes() if not x.children and self.allocator.refs(x.block) == 1]
            if not leaves:
                break
            leaves.sort(key=lambda x: x.last_used)
            for leaf in leaves[: n - freed]:
                del leaf.parent.children[leaf.key]
                self.allocator.unref(leaf.block)
                self.cached_blocks -= 1
                freed += 1
        return freed

    def clear(self) -> None:
        self.evict(self.cached_blocks)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
