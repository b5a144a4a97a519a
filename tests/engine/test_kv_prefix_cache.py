"""The prefix cache's bookkeeping: token-granular reuse over shared full blocks and copied
partial ones, donation of a partly filled last block, references and eviction.

KV contents are stood in for by a numpy array of slot labels, so a copy can be checked slot
for slot; the engine-level tests (tests/models/test_engine.py) check the served tokens."""

from __future__ import annotations

import numpy as np

from mlxcel.engine.kv_block_pool import RESERVED, BlockAllocator, SequenceKV
from mlxcel.engine.kv_prefix_cache import PrefixCache

BS = 4


class Pool:
    """An allocator, a prefix cache over it and a slot array standing in for the KV."""

    def __init__(self, blocks: int = 32, budget: int | None = None) -> None:
        self.alloc = BlockAllocator(blocks, BS)
        self.cache = PrefixCache(self.alloc, budget)
        self.kv = np.full(blocks * BS, -1, dtype=np.int64)  # the token each slot holds
        self.copies: list[tuple[list[int], list[int]]] = []

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.copies.append((list(src), list(dst)))
        self.kv[dst] = self.kv[src]

    def run(self, tokens: list[int]) -> SequenceKV:
        """A sequence that adopted what the cache holds and 'computed' the rest of `tokens`."""
        seq = SequenceKV(self.alloc)
        n = self.cache.adopt(seq, tokens, self.copy_slots)
        seq.reserve(len(tokens) - n)
        self.kv[seq.slots(n, len(tokens))] = tokens[n:]
        seq.tokens.extend(tokens[n:])
        return seq

    def finish(self, seq: SequenceKV) -> None:
        self.cache.insert(seq.tokens, seq.blocks)
        seq.release()
        self.cache.trim()

    def held(self, seq: SequenceKV) -> list[int]:
        return list(self.kv[seq.slots(0, seq.length)])


def test_a_prompt_resumes_inside_a_cached_block_from_a_copy():
    p = Pool()
    first = list(range(100, 111))  # 2 full blocks + 3 tokens
    p.finish(p.run(first))
    assert p.cache.cached_blocks == 3  # the partly filled last block is donated too

    again = first[:6] + [7, 8, 9]  # agrees with the cache for 6 tokens: one full block + 2
    seq = SequenceKV(p.alloc)
    n = p.cache.adopt(seq, again, p.copy_slots)
    assert n == 6 and seq.tokens == again[:6]
    assert p.held(seq) == again[:6]  # the shared block and the copied slots hold the right tokens
    first_block = p.cache.root.children[tuple(first[:BS])].block
    assert seq.blocks[0] == first_block  # full blocks are shared, not copied
    assert len(p.copies) == 1 and len(p.copies[0][0]) == 2
    assert p.alloc.refs(seq.blocks[1]) == 1  # the copy is seq's alone: its tail is seq's to write
    seq.release()


def test_the_last_prompt_token_is_always_left_to_run():
    p = Pool()
    prompt = list(range(1, 11))
    p.finish(p.run(prompt + [50, 51]))
    seq = SequenceKV(p.alloc)
    assert p.cache.adopt(seq, prompt, p.copy_slots) == len(prompt) - 1  # like llama-server's n_past
    seq.release()
    seq = SequenceKV(p.alloc)
    assert p.cache.adopt(seq, prompt[:8], p.copy_slots) == 7  # inside a cached full block: copied, not shared
    assert p.alloc.refs(seq.blocks[-1]) == 1
    seq.release()


def test_a_re_sent_prompt_reuses_all_but_its_last_token_after_a_short_answer():
    p = Pool()
    prompt = list(range(1, 11))
    p.finish(p.run(prompt + [50]))  # 11 tokens: the answer ended inside the third block
    seq = SequenceKV(p.alloc)
    assert p.cache.adopt(seq, prompt, p.copy_slots) == 9
    assert p.held(seq) == prompt[:9]
    seq.release()


def test_a_full_block_replaces_the_partial_leaf_it_extends_and_a_covered_one_is_not_added():
    p = Pool()
    p.finish(p.run([1, 2, 3, 4, 5, 6]))  # partial leaf (5, 6)
    assert p.cache.cached_blocks == 2
    p.finish(p.run([1, 2, 3, 4, 5, 6, 7, 8, 9]))  # (5..8) covers (5, 6); (9,) is the new partial leaf
    keys = sorted(len(k) for k in p.cache.root.children[(1, 2, 3, 4)].children)
    assert keys == [BS]
    assert p.cache.cached_blocks == 3
    p.finish(p.run([1, 2, 3, 4, 5, 6, 7]))  # (5, 6, 7) is covered by the full block: nothing added
    assert p.cache.cached_blocks == 3
    assert p.alloc.used_blocks == 3  # every dropped or uncached block went back to the pool


def test_the_longest_agreeing_child_is_copied():
    p = Pool()
    p.finish(p.run([1, 2, 3, 4, 5, 6, 7, 8, 0]))
    p.finish(p.run([1, 2, 3, 4, 5, 9, 9, 9, 0]))
    seq = SequenceKV(p.alloc)
    assert p.cache.adopt(seq, [1, 2, 3, 4, 5, 6, 7, 1, 1], p.copy_slots) == 7
    assert p.held(seq) == [1, 2, 3, 4, 5, 6, 7]
    seq.release()


def test_partial_leaves_are_evicted_like_any_leaf_and_references_balance():
    p = Pool(blocks=RESERVED + 6, budget=3)
    for i in range(4):
        p.finish(p.run([10 * i + j for j in range(6)]))  # one full block + a partial leaf each
    assert p.cache.cached_blocks <= 3
    assert p.alloc.used_blocks == p.cache.cached_blocks
    p.cache.clear()
    assert p.cache.cached_blocks == 0 and p.alloc.used_blocks == 0


def test_the_copy_is_skipped_when_no_block_is_left():
    p = Pool(blocks=RESERVED + 2)
    p.finish(p.run([1, 2, 3, 4, 5, 6]))  # the pool's two blocks: a full one and a partial leaf
    hold = SequenceKV(p.alloc)
    found = p.cache.match([1, 2, 3, 4, 0])
    hold.adopt(found.blocks, [1, 2, 3, 4])  # a live reader shares the full block
    seq = SequenceKV(p.alloc)
    n = p.cache.adopt(seq, [1, 2, 3, 4, 5, 6, 7], p.copy_slots)
    # the partial leaf is the copy's source, so it is not evicted to make room for the copy
    assert n == BS and seq.length == BS and not p.copies
    assert p.cache.cached_blocks == 2
    for s in (seq, hold):
        s.release()
    assert p.alloc.used_blocks == 2


def test_a_disabled_cache_supplies_nothing():
    p = Pool(budget=0)
    p.finish(p.run([1, 2, 3, 4, 5, 6]))
    seq = SequenceKV(p.alloc)
    assert p.cache.adopt(seq, [1, 2, 3, 4, 5, 6], p.copy_slots) == 0
    assert p.alloc.used_blocks == 0


def test_a_reservation_of_many_blocks_evicts_in_one_pass():
    p = Pool(blocks=RESERVED + 8)
    for i in range(4):
        p.finish(p.run([100 * i + j for j in range(2 * BS)]))  # the cache fills the pool: 8 blocks
    assert p.alloc.free_blocks == 0
    passes = []
    evict = p.cache.evict
    p.alloc.evict_hook = lambda n: passes.append(n) or evict(n)
    seq = SequenceKV(p.alloc)
    seq.reserve(5 * BS)
    assert passes == [5] and len(seq.blocks) == 5 and p.cache.cached_blocks == 3
    seq.release()


def test_freed_blocks_are_token_only_nodes_that_resume_nothing_and_cost_nothing():
    """A sequence that freed blocks behind a sliding window donates them as NULL_BLOCK nodes: they
    hold no reference and count for no budget; a prompt resumes only where the window before the
    resume point is held, and evicting the real blocks drops the freed nodes above them."""
    from mlxcel.engine.kv_block_pool import NULL_BLOCK

    p = Pool()
    p.alloc.window = 2 * BS  # a query at 20 reads from 13 on: blocks 3 onward
    tokens = list(range(100, 100 + 6 * BS))
    seq = SequenceKV(p.alloc)
    for i in range(6):  # one block at a time, as decode steps would
        seq.reserve(BS)
        seq.tokens.extend(tokens[i * BS:(i + 1) * BS])
    assert seq.blocks[:3] == [NULL_BLOCK] * 3 and p.alloc.used_blocks == 3
    p.finish(seq)
    assert p.cache.cached_blocks == 3 and p.alloc.used_blocks == 3
    # the whole stream and more: resumed at its end, where its window is held
    again = p.run(tokens + [7, 8, 9])
    assert again.blocks[:4] == [NULL_BLOCK] * 4 and again.length == len(tokens) + 3
    found = p.cache.match(tokens + [7])
    assert found.tokens == len(tokens)
    for b in found.blocks:  # match referenced them for a caller that adopts none
        p.alloc.unref(b)
    p.finish(again)
    # a prompt that parts inside the freed part resumes nothing
    found = p.cache.match(tokens[:3 * BS + 2] + [1, 2, 3])
    assert found.tokens == 0 and found.tail_tokens == 0
    assert p.cache.cached_blocks == 4  # and the new partial block
    assert p.cache.evict(10) == 4  # the real blocks only; the freed chain above them goes too
    assert not p.cache.root.children and p.alloc.used_blocks == 0
