"""N ranks as one backend: rank 0's `GroupBackend` and the other ranks' `follow` loop.

The engine on rank 0 drives a GroupBackend exactly as it drives a local backend (the contract in
engine/backend.py). Each call reserves the rows' blocks on rank 0's pool first, so the block
tables are final, then broadcasts them as a Plan (backends/distributed.py) and runs rank 0's own
shard; every follower decodes the same plan, rebuilds the rows over a `ReplicaAllocator` (a pool
that hands out nothing: the tables come with the plan) and runs its shard of the same call. The
shards' collectives inside that forward (all-reduces, pipeline sends) pair up because every rank
makes the same calls in the same order; rank 0's result is the step's logits.

Failure is bounded: every collective has the group's timeout, so a dead or silent rank turns the
call into GroupFailed (the engine answers 503) and `on_failure` (the CLI's exit). An idle rank 0
pings the group every heartbeat, so a rank that dies between requests is found too, and a
watchdog fails the group if a call outlives the timeout twice over (a collective that never
returns). A follower exits when rank 0's plans stop coming.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mlxcel.backends.distributed import (BindPlan, Collective, CopyPlan, ForwardPlan, GroupFailed, PingPlan, Plan,
                                         PlanRow, StopPlan, as_index, check_membership, decode_plan, encode_plan)
from mlxcel.config.distributed import GroupSpec
from mlxcel.engine.backend import Backend, ForwardRow
from mlxcel.engine.kv_block_pool import SCRATCH_BLOCK, BlockAllocator, SequenceKV

log = logging.getLogger("mlxcel.group")


@dataclass(frozen=True)
class RankSize:
    """What one rank holds, as /props and /metrics report it."""

    rank: int
    weight_bytes: int
    kv_bytes_per_token: int


def exchange_sizes(collective: Collective, weight_bytes: int, kv_bytes_per_token: int) -> list[RankSize]:
    got = collective.all_gather_bytes(struct.pack("<qq", weight_bytes, kv_bytes_per_token))
    return [RankSize(r, *struct.unpack("<qq", b)) for r, b in enumerate(got)]


def join(local: Backend, collective: Collective, fingerprint: bytes) -> list[RankSize]:
    """Every rank, after loading its shard: agree on the checkpoint and settings, then tell each
    other what each holds. Raises GroupFailed on a mismatch (on every rank)."""
    check_membership(collective, fingerprint)
    return exchange_sizes(collective, int(getattr(local, "weight_nbytes", 0)), local.kv_spec.bytes_per_token)


class ReplicaAllocator(BlockAllocator):
    """A follower's copy of rank 0's block pool: same geometry, but it allocates and counts
    nothing, since every table arrives complete in the plan; `high` is rank 0's high-water mark."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None) -> None:
        super().__init__(num_blocks, block_size)
        self.window = window
        self.high = SCRATCH_BLOCK

    def allocate(self) -> int:
        raise RuntimeError("a follower's block pool hands out no blocks: rank 0's plan carries every table")

    def ref(self, block: int) -> None:
        pass

    def unref(self, block: int) -> None:
        pass

    def make_room(self, n: int) -> None:
        pass

    def high_water(self) -> int:
        return self.high


def _highs(allocator: BlockAllocator) -> list[int]:
    return [allocator.group(g).high_water() for g in range(allocator.groups)]


def _plan_row(row: ForwardRow) -> PlanRow:
    seq = row.cache
    return PlanRow(list(row.tokens), list(seq.blocks), list(seq.sliding), seq.length, seq.shift, seq.state,
                   row.decode)


class GroupBackend:
    """The engine's backend on rank 0: each call broadcast as a plan, then run on rank 0's shard."""

    def __init__(self, local: Backend, collective: Collective, spec: GroupSpec, sizes: list[RankSize],
                 on_failure: Callable[[str], None]) -> None:
        self.local, self.collective, self.spec, self.sizes = local, collective, spec, sizes
        self.info = local.info
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._copies: list[CopyPlan] = []  # made since the last plan went out
        self._failed: str | None = None
        self._busy_since: float | None = None
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="mlxcel-group-watch", daemon=True)
        self._monitor.start()

    # -- the backend contract -----------------------------------------------------------------
    @property
    def kv_spec(self):
        return self.local.kv_spec

    def __getattr__(self, name: str):
        # what the server reads off a backend besides the contract (weight_nbytes, device,
        # kv_nbytes, row_kernel ...) is rank 0's shard's
        # decode_greedy would run rank 0's shard alone, outside a plan: the engine's pipelined
        # decode is for local backends, so a group steps through forward
        if name in ("local", "decode_greedy"):
            raise AttributeError(name)
        return getattr(self.local, name)

    def bind_kv(self, allocator: BlockAllocator) -> None:
        sliding = allocator.sliding
        plan = BindPlan(allocator.num_blocks, allocator.block_size, allocator.window,
                        sliding.num_blocks if sliding is not None else None,
                        sliding.window if sliding is not None else None)
        self._copies = []  # a new pool: nothing copied in the old one matters
        self._call(plan, lambda: self.local.bind_kv(allocator))
        self.allocator = allocator

    def forward(self, rows: list[ForwardRow]) -> np.ndarray:
        _refuse_row_extras(rows)
        for r in rows:  # the tables are final before they travel
            r.cache.reserve(len(r.tokens))
        plan = ForwardPlan("last", [_plan_row(r) for r in rows], _highs(rows[0].cache.allocator), self._take_copies())
        return self._call(plan, lambda: self.local.forward(rows))

    def forward_all(self, tokens: list[int], cache: SequenceKV, lora: tuple[float, ...] | None = None) -> np.ndarray:
        if lora is not None and any(lora):
            raise GroupFailed("LoRA scales are not served across a distributed group")
        cache.reserve(len(tokens))
        plan = ForwardPlan("all", [_plan_row(ForwardRow(tokens, cache))], _highs(cache.allocator), self._take_copies())
        return self._call(plan, lambda: self.local.forward_all(tokens, cache))

    def hidden_states(self, tokens: list[int], cache: SequenceKV) -> np.ndarray:
        cache.reserve(len(tokens))
        plan = ForwardPlan("hidden", [_plan_row(ForwardRow(tokens, cache))], _highs(cache.allocator),
                           self._take_copies())
        return self._call(plan, lambda: self.local.hidden_states(tokens, cache))

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, group: int = 0) -> None:
        """Copied here now; the followers copy before their next step (it travels with that
        step's plan), so a copy never waits on the group: a lost rank shows in the step."""
        self.local.copy_slots(src, dst, group)
        self._copies.append(CopyPlan(as_index(src), as_index(dst), group, _highs(self.allocator)))

    def _take_copies(self) -> list[CopyPlan]:
        copies, self._copies = self._copies, []
        return copies

    # -- the group ----------------------------------------------------------------------------
    def describe(self) -> dict:
        """The group as /props reports it: its shape, and what each rank holds."""
        return {**self.spec.describe(), "failed": self._failed,
                "ranks": [{"rank": s.rank, "weight_bytes": s.weight_bytes, "kv_bytes_per_token": s.kv_bytes_per_token}
                          for s in self.sizes]}

    @property
    def failed(self) -> str | None:
        return self._failed

    def close(self, reason: str = "rank 0 is shutting down") -> None:
        """Tell the followers to exit, then leave the group (best effort: a failed group is gone)."""
        if self._closed.is_set():
            return
        # a step stuck in a collective holds the lock (MLX's have no timeout): wait for it no longer
        # than the watchdog would, which keeps running until then
        held = self._lock.acquire(timeout=2 * self.spec.timeout_s)
        self._closed.set()
        if held:
            try:
                if self._failed is None:
                    self.collective.broadcast_bytes(encode_plan(StopPlan(reason)))
            except Exception:  # noqa: BLE001 - a follower already gone cannot be told
                pass
            finally:
                self._lock.release()
        try:
            self.collective.close()
        except Exception:  # noqa: BLE001
            pass

    def _call(self, plan: Plan, run: Callable[[], object]):
        with self._lock:
            if self._failed is not None:
                raise GroupFailed(self._failed)
            self._busy_since = time.monotonic()
            try:
                self.collective.broadcast_bytes(encode_plan(plan))
                return run()
            except Exception as e:
                # a step that failed on rank 0 alone leaves the followers' collectives unmatched:
                # whatever went wrong, the group cannot continue in step
                raise self._fail(f"the distributed group failed during a step ({_first_line(e)}); the server is "
                                 "exiting") from e
            finally:
                self._busy_since = None
                self._last = time.monotonic()

    def _fail(self, reason: str) -> GroupFailed:
        if self._failed is None:
            self._failed = reason
            log.error("%s", reason)
            self._on_failure(reason)
        return GroupFailed(self._failed)

    def _watch(self) -> None:
        """Ping the group while idle; fail it if a call hangs past twice the timeout."""
        beat = self.spec.heartbeat_s
        while not self._closed.wait(min(beat, 1.0)):
            if self._failed is not None:
                return
            busy = self._busy_since
            now = time.monotonic()
            if busy is not None and now - busy > 2 * self.spec.timeout_s:
                self._fail(f"a distributed step has not finished in {now - busy:.0f} s (timeout "
                           f"{self.spec.timeout_s:g} s): a rank stopped answering")
                return
            if busy is None and now - self._last >= beat and self._lock.acquire(blocking=False):
                try:
                    self.collective.broadcast_bytes(encode_plan(PingPlan()))
                except Exception as e:  # noqa: BLE001 - a dead peer shows here between requests
                    self._fail(f"a rank of the distributed group stopped answering ({_first_line(e)}); the server "
                               "is exiting")
                finally:
                    self._last = time.monotonic()
                    self._lock.release()


def _first_line(e: Exception) -> str:
    """The runtime's error without its advice paragraphs (gloo appends several)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(". This is typically")[0]


def _refuse_row_extras(rows: list[ForwardRow]) -> None:
    for r in rows:
        if r.steering or r.capture or (r.lora is not None and any(r.lora)):
            raise ValueError("per-request steering, activation capture and LoRA scales are not served across a "
                             "distributed group (--tp-size / --pp-size); serve the model on one process for them")


def _replica(plan: BindPlan) -> ReplicaAllocator:
    allocator = ReplicaAllocator(plan.num_blocks, plan.block_size, plan.window)
    if plan.sliding_blocks is not None:
        allocator.sliding = ReplicaAllocator(plan.sliding_blocks, plan.block_size, plan.sliding_window)
    return allocator


def _set_highs(allocator: ReplicaAllocator, highs: list[int]) -> None:
    for g, high in enumerate(highs):
        allocator.group(g).high = high


def _rows(allocator: ReplicaAllocator, plan: ForwardPlan) -> list[ForwardRow]:
    rows = []
    for p in plan.rows:
        seq = SequenceKV(allocator, blocks=list(p.blocks), tokens=[0] * p.length, shift=p.shift, state=p.state,
                         sliding=list(p.sliding), freed=len(p.blocks))
        rows.append(ForwardRow(list(p.tokens), seq, decode=p.decode))
    return rows


def follow(local: Backend, collective: Collective) -> str:
    """A follower rank's life: run each plan rank 0 broadcasts on this rank's shard until a stop
    plan (its reason is returned). A collective error (rank 0 gone, the timeout) propagates."""
    allocator: ReplicaAllocator | None = None
    while True:
        plan = decode_plan(collective.broadcast_bytes(None))
        if isinstance(plan, StopPlan):
            return plan.reason
        if isinstance(plan, PingPlan):
            continue
        if isinstance(plan, BindPlan):
            allocator = _replica(plan)
            local.bind_kv(allocator)
            continue
        if allocator is None:
            raise GroupFailed(f"rank 0 sent a {type(plan).__name__} before binding the block pool")
        for copy in plan.copies:
            _set_highs(allocator, copy.high)
            local.copy_slots(np.asarray(copy.src, dtype=np.int64), np.asarray(copy.dst, dtype=np.int64), copy.group)
        _set_highs(allocator, plan.high)
        rows = _rows(allocator, plan)
        if plan.mode == "last":
            local.forward(rows)
        elif plan.mode == "all":
            local.forward_all(rows[0].tokens, rows[0].cache)
        else:
            local.hidden_states(rows[0].tokens, rows[0].cache)
