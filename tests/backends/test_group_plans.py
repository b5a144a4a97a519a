"""The engine over a GroupBackend, with a follower replaying rank 0's plans in a thread.

Both ranks run the engine tier's fake backend (tests/engine/fake_backend.py), whose picks depend
on what its KV storage holds at the slots each row's block table names: a follower that rebuilt
a table or a position wrongly would read other tokens (or nothing) and pick differently. The
collective is a queue between the two threads, so no runtime is needed; the backends' own
collectives are tested with real ranks (test_group_shards.py, tests/e2e/test_distributed.py).
"""

from __future__ import annotations

import asyncio
import queue
import threading

import numpy as np
import pytest

from mlxcel.backends.group import GroupBackend, RankSize, follow
from mlxcel.config.distributed import GroupSpec
from tests.engine.fake_backend import FakeBackend, reference
from tests.engine.harness import collect, engine_on, prompt, request

pytestmark = pytest.mark.timeout(60)


class Loopback:
    """Rank 0's broadcasts into a queue its one follower reads; `fail_after` broadcasts, the
    next one raises as a dead peer's would."""

    def __init__(self, rank: int, pipe: queue.Queue, fail_after: int | None = None) -> None:
        self.rank, self.size, self.pipe, self.fail_after, self.sent = rank, 2, pipe, fail_after, 0

    def broadcast_bytes(self, data):
        if self.rank:
            return self.pipe.get(timeout=30)
        if self.fail_after is not None and self.sent >= self.fail_after:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        self.sent += 1
        self.pipe.put(data)
        return data

    def close(self) -> None:
        pass


class Recording(FakeBackend):
    """The fake, keeping every forward's picks (a follower's results are otherwise dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.picks: list[list[int]] = []

    def forward(self, rows):
        out = super().forward(rows)
        self.picks.append([int(np.argmax(o)) for o in out])
        return out


def group_of(fail_after: int | None = None):
    pipe: queue.Queue = queue.Queue()
    local, follower = Recording(), Recording()
    failures: list[str] = []
    group = GroupBackend(local, Loopback(0, pipe, fail_after), GroupSpec(tp_size=2, timeout_s=30),
                         [RankSize(0, 1, 1), RankSize(1, 1, 1)], failures.append)
    thread = threading.Thread(target=follow, args=(follower, Loopback(1, pipe)), daemon=True)
    thread.start()
    return group, local, follower, failures, thread


def test_a_follower_replays_every_step_with_the_same_tables_and_picks():
    group, local, follower, failures, thread = group_of()
    a, b = prompt(100, 40), prompt(200, 23)

    async def scenario(engine):
        first = await asyncio.gather(collect(engine.submit(request(a, 12))), collect(engine.submit(request(b, 9))))
        again = await collect(engine.submit(request(a, 12)))  # from the prefix cache: a copied partial block
        return first, again

    with engine_on(group) as engine:
        (ra, rb), again = asyncio.run(scenario(engine))
    group.close()
    thread.join(timeout=10)
    assert ra.tokens == reference(a, 12) and rb.tokens == reference(b, 9) and again.tokens == ra.tokens
    assert again.last.timings.cache_n > 0
    assert follower.picks == local.picks and len(local.picks) > 10
    assert follower.poison_reads == local.poison_reads == 0
    assert not thread.is_alive() and failures == []


def test_a_lost_rank_fails_the_step_as_unavailable_and_calls_the_exit_once():
    group, local, follower, failures, thread = group_of(fail_after=3)

    async def scenario(engine):
        return [ev async for ev in engine.submit(request(prompt(100, 8), 20))]

    with engine_on(group) as engine:
        events = asyncio.run(scenario(engine))
        later = asyncio.run(scenario(engine))
    assert events[-1].error_code == later[-1].error_code == "model_busy"
    assert "distributed group failed" in events[-1].error and "Connection closed by peer" in events[-1].error
    assert len(failures) == 1 and group.failed is not None
