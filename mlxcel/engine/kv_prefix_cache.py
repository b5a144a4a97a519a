"""The prompt-prefix cache: a radix tree over token blocks pointing at shared KV.

Each node is one block: its tokens are the edge label, its block id is the KV those tokens
produced given every token above it. Inner nodes are full blocks; a leaf may be a partial
block (a finished sequence's last, unfilled one). A request adopts the longest chain of
full blocks matching its prompt, shared as they are, then the first tokens of whichever
child block agrees with its prompt longest, copied into a block of its own (full blocks
are immutable, and the copy's tail is the request's to write). So reuse is token by token,
as llama-server's slots reuse a common prefix, always leaving one prompt token to run so
the step yields logits. A sequence donates its blocks back when it ends. The tree holds
one reference per block; eviction drops least-recently-used leaves that no live sequence
shares, under a block budget derived from the byte budget.

Where sequences free blocks behind a sliding window (kv_block_pool: the allocator's `window`),
a donated chain may hold NULL_BLOCK nodes: the tokens are known, their KV is gone. Such a node
holds no reference and counts for no budget. A prompt resumes at a point only when every block
the window before it reads is held, so a match backs off to the last such point. Where the
sliding layers keep a block group of their own (kv_block_pool: the allocator's `sliding`), a
node also holds its block in that group (`sliding`, NULL_BLOCK once freed), the global layers'
block is always held, and the same rule applies to the sliding blocks.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from mlxcel.engine.kv_block_pool import NULL_BLOCK, BlockAllocator, OutOfBlocks, SequenceKV

_clock = itertools.count()


@dataclass
class _Node:
    key: tuple[int, ...]
    block: int
    parent: "_Node | None"
    sliding: int = NULL_BLOCK  # the block in the sliding layers' group, where there is one
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_used: int = 0


class Prefix(NamedTuple):
    """A prompt's cached prefix: shared full blocks (referenced for the caller) covering
    `tokens` tokens, then `tail_tokens` more held by the first slots of `tail_block`; and the
    sliding group's blocks beside them where it has one (else None)."""

    blocks: list[int]
    tokens: int
    tail_block: int = -1
    tail_tokens: int = 0
    sliding: list[int] | None = None
    tail_sliding: int = -1


def common_prefix(a, b) -> int:
    """How many leading tokens two token sequences share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, budget_blocks: int | None) -> None:
        self.allocator = allocator
        self.budget_blocks = budget_blocks  # None: no limit beyond the pool
        self.root = _Node((), -1, None)
        self.cached_blocks = 0
        allocator.evict_hook = self.evict
        if allocator.sliding is not None:
            allocator.sliding.evict_hook = self.evict

    @property
    def enabled(self) -> bool:
        return self.budget_blocks is None or self.budget_blocks > 0

    def match(self, prompt: list[int]) -> Prefix:
        """The longest cached prefix of `prompt`, leaving at least its last token uncached."""
        grouped = self.allocator.sliding is not None
        if not self.enabled:
            return Prefix([], 0, sliding=[] if grouped else None)
        bs = self.allocator.block_size
        node, nodes, now = self.root, [], next(_clock)
        for i in range((len(prompt) - 1) // bs):
            child = node.children.get(tuple(prompt[i * bs:(i + 1) * bs]))
            if child is None:
                break
            child.last_used = now
            nodes.append(child)
            node = child
        n = len(nodes) * bs
        rest = prompt[n:len(prompt) - 1][:bs]  # what a partial copy may still supply
        best, best_n = None, 0
        for child in node.children.values():
            k = common_prefix(child.key, rest)
            if k > best_n and child.block != NULL_BLOCK and (not grouped or child.sliding != NULL_BLOCK):
                best, best_n = child, k
        if best is not None and not self._resumable(nodes, n + best_n):
            best, best_n = None, 0
        while nodes and not self._resumable(nodes, len(nodes) * bs):
            nodes.pop()
        blocks, sliding = [x.block for x in nodes], [x.sliding for x in nodes] if grouped else None
        for b in blocks:
            self.allocator.ref(b)
        for b in sliding or []:
            if b != NULL_BLOCK:
                self.allocator.sliding.ref(b)
        if best is None or len(blocks) * bs < n:
            return Prefix(blocks, len(blocks) * bs, sliding=sliding)
        best.last_used = now
        return Prefix(blocks, n, best.block, best_n, sliding, best.sliding)

    def _resumable(self, nodes: list[_Node], h: int) -> bool:
        """Whether a prompt resumed at token h (nodes: the full blocks before it) finds every
        key a sliding window reads, in the table that frees behind it; always without one."""
        a = self.allocator
        window = a.window if a.window is not None else a.sliding.window if a.sliding is not None else None
        if window is None:
            return True
        held = [x.block if a.window is not None else x.sliding for x in nodes[max(0, h - window + 1) // a.block_size:]]
        return NULL_BLOCK not in held

    def adopt(self, seq: SequenceKV, prompt: list[int], copy_slots: Callable[..., None]) -> int:
        """Start the empty `seq` from `prompt`'s cached prefix: the shared full blocks, then the
        partial match copied slot for slot by the backend's `copy_slots(src, dst)` (and
        `copy_slots(src, dst, 1)` for the sliding group's, where it has one). Returns how many
        prompt tokens the cache supplied."""
        found = self.match(prompt)
        seq.adopt(found.blocks, prompt[:found.tokens], found.sliding)
        if not found.tail_tokens:
            return found.tokens
        n, k, bs = found.tokens, found.tail_tokens, self.allocator.block_size
        tails = [(self.allocator, found.tail_block)]
        if found.sliding is not None:
            tails.append((self.allocator.sliding, found.tail_sliding))
        for allocator, tail in tails:  # seq's new blocks may come from an eviction: not these
            allocator.ref(tail)
        try:
            seq.reserve(k)
        except OutOfBlocks:  # no room for the copy: the prompt is prefilled from the shared blocks on
            return n
        finally:
            for allocator, tail in tails:
                allocator.unref(tail)
        copy_slots(found.tail_block * bs + np.arange(k), seq.slots(n, n + k))
        if found.sliding is not None:  # the sliding layers' copy, in their own group
            copy_slots(found.tail_sliding * bs + np.arange(k), seq.slots(n, n + k, 1), 1)
        seq.tokens.extend(prompt[n:n + k])
        return n + k

    def insert(self, tokens: list[int], blocks: list[int], sliding: list[int] | None = None) -> None:
        """Offer a sequence's blocks (tokens[i*bs:(i+1)*bs] -> blocks[i], and sliding[i] in the
        sliding group where it has one); its last block may be partly filled. Call before the
        sequence drops its own references."""
        if not self.enabled:
            return
        bs = self.allocator.block_size
        node, now = self.root, next(_clock)
        full = min(len(tokens) // bs, len(blocks))
        side = sliding or [NULL_BLOCK] * len(blocks)
        for i in range(full):
            node = self._offer(node, tuple(tokens[i * bs:(i + 1) * bs]), blocks[i], now, side[i])
        rest = tuple(tokens[full * bs:])
        if rest and full == len(tokens) // bs and full < len(blocks):
            self._offer(node, rest, blocks[full], now, side[full])

    def _offer(self, parent: _Node, key: tuple[int, ...], block: int, now: int, sliding: int = NULL_BLOCK) -> _Node:
        """The child of `parent` holding `key`: an existing one that covers it, else a new node
        on `block` (which replaces the partial leaves its key extends)."""
        child = parent.children.get(key) or next((c for c in parent.children.values() if c.key[:len(key)] == key), None)
        same = child is not None and len(child.key) == len(key)  # a longer node needs a block of its length
        if same and child.block == NULL_BLOCK and block != NULL_BLOCK:
            child.block = block  # the KV a freed node lacked
            self.allocator.ref(block)
            self.cached_blocks += 1
        if same and child.sliding == NULL_BLOCK and sliding != NULL_BLOCK:
            child.sliding = sliding  # the sliding layers' KV a freed node lacked
            self.allocator.sliding.ref(sliding)
        if child is None:
            for stale in [c for c in parent.children.values() if len(c.key) < len(key) and key[:len(c.key)] == c.key]:
                self._drop(stale, cascade=False)  # parent gets its replacement
            child = _Node(key, block, parent, sliding=sliding)
            parent.children[key] = child
            if block != NULL_BLOCK:
                self.allocator.ref(block)
                self.cached_blocks += 1
            if sliding != NULL_BLOCK:
                self.allocator.sliding.ref(sliding)
        child.last_used = now
        return child

    def _drop(self, leaf: _Node, cascade: bool = True) -> _Node:
        """Drop a leaf, and (`cascade`) the freed (NULL_BLOCK) nodes it leaves childless above it;
        returns the node the drops stopped under."""
        while True:
            parent = leaf.parent
            del parent.children[leaf.key]
            leaf.parent = None  # detached: a heap entry for it is stale
            if leaf.block != NULL_BLOCK:
                self.allocator.unref(leaf.block)
                self.cached_blocks -= 1
            if leaf.sliding != NULL_BLOCK:
                self.allocator.sliding.unref(leaf.sliding)
            if not cascade or parent is self.root or parent.children or parent.block != NULL_BLOCK:
                return parent
            leaf = parent

    def trim(self) -> None:
        """Evict down to the budget (call once the donor has dropped its own references)."""
        if self.budget_blocks is not None and self.cached_blocks > self.budget_blocks:
            self.evict(self.cached_blocks - self.budget_blocks)

    def evict(self, n: int) -> int:
        """Drop up to `n` least-recently-used leaves that no live sequence shares, one at a
        time: a parent that a drop leaves childless joins the candidates at its own age, so an
        old chain goes before a newer donation. One scan of the tree, then a heap."""
        def unshared(x: _Node) -> bool:
            return not x.children and (x.block == NULL_BLOCK or self.allocator.refs(x.block) == 1)

        heap = [(x.last_used, id(x), x) for x in self._nodes() if unshared(x)]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, leaf = heapq.heappop(heap)
            if leaf.parent is None:
                continue
            freed += leaf.block != NULL_BLOCK  # a freed node costs nothing, and frees nothing
            parent = self._drop(leaf)
            if parent is not self.root and unshared(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def clear(self) -> None:
        self.evict(self.cached_blocks)

    def reset(self) -> int:
        """Drop every node and its reference; returns the blocks let go. A live sequence holds its
        own reference to each block it shares, so it runs on; later prompts no longer find them."""
        freed = self.cached_blocks
        for node in list(self._nodes()):
            if node.block != NULL_BLOCK:
                self.allocator.unref(node.block)
            if node.sliding != NULL_BLOCK:
                self.allocator.sliding.unref(node.sliding)
            node.parent = None
        self.root.children.clear()
        self.cached_blocks = 0
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
