"""Two threads calling one kernel at once (two engine threads in router mode): each must get
the answer it gets alone, and neither may hang."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def assert_each_caller_gets_its_own(calls: list[Callable[[], torch.Tensor]], rounds: int) -> None:
    """Run every call `rounds` times, each on its own thread, all at once; each result must
    equal that call's result run alone first."""
    with torch.inference_mode():
        want = [call() for call in calls]
    bad: list[int] = []

    def caller(i: int) -> None:
        with torch.inference_mode():
            for _ in range(rounds):
                if not torch.equal(calls[i](), want[i]):
                    bad.append(i)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller is stuck"
    assert not bad
