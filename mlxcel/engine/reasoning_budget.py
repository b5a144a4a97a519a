"""The thinking budget: after N thinking tokens, force the budget message and the close tag.

A request carries a `ReasoningBudget` (token ids of the open tag, the close tag and the
message, the budget, and optionally a `ReasoningControl` a route can trip at run time). The
engine gives each row a `BudgetTracker`, which watches the row's tokens:

- idle -> thinking when the open tag's tokens are generated, or from the first token when
  the prompt itself ends inside an open block (the template primed it);
- thinking -> forcing when N thinking tokens were generated (N = 0: at once), or when the
  control was tripped (`reasoning_end`); the forced run is message + close tag, injected one
  token per step in place of sampling, so it flows through detokenizing, stop matching and
  streaming exactly like sampled tokens (streamed and non-streamed outputs agree);
- thinking -> done when the model writes the close tag itself (within budget: untouched).

Only one block is budgeted: once done, a row is never forced again.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ReasoningControl:
    """A run-time switch shared by the rows of one completion: `end()` asks every row still
    thinking to close its block now (set from the event loop, read by the engine thread)."""

    def __init__(self) -> None:
        self.ended = False

    def end(self) -> None:
        self.ended = True


@dataclass(frozen=True)
class ReasoningBudget:
    budget: int  # thinking tokens allowed; -1: no limit (only a control can end thinking)
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    message_ids: tuple[int, ...] = ()
    control: ReasoningControl | None = field(default=None, compare=False)

    def tracker(self, prompt: list[int]) -> "BudgetTracker":
        return BudgetTracker(self, _inside(prompt, self.open_ids, self.close_ids))


def _rfind(seq: list[int], sub: tuple[int, ...]) -> int:
    n = len(sub)
    if not n:
        return -1
    for i in range(len(seq) - n, -1, -1):
        if tuple(seq[i:i + n]) == sub:
            return i
    return -1


def _inside(prompt: list[int], open_ids: tuple[int, ...], close_ids: tuple[int, ...]) -> bool:
    """Does the prompt end inside an open block?"""
    return _rfind(prompt, open_ids) > _rfind(prompt, close_ids)


class BudgetTracker:
    """One row's thinking state (engine thread)."""

    def __init__(self, spec: ReasoningBudget, primed: bool) -> None:
        self.spec = spec
        self.state = "thinking" if primed else "idle"  # idle | thinking | forcing | done
        self.count = 0  # thinking tokens generated in the current block
        self._queue: list[int] = []
        self._recent: list[int] = []  # the last tokens, to spot a tag spread over several

    def forced(self) -> int | None:
        """The token to emit in place of sampling this step, if any."""
        if self.state == "thinking":
            spent = 0 <= self.spec.budget <= self.count
            tripped = self.spec.control is not None and self.spec.control.ended
            if spent or tripped:
                self._queue = list(self.spec.message_ids + self.spec.close_ids)
                self.state = "forcing"
        if self.state == "forcing":
            return self._queue.pop(0) if self._queue else None
        return None

    def observe(self, token: int) -> None:
        """A token was emitted (sampled or forced)."""
        self._recent = (self._recent + [token])[-max(len(self.spec.open_ids), len(self.spec.close_ids), 1):]
        if self.state == "idle":
            if _ends_with(self._recent, self.spec.open_ids):
                self.state, self.count = "thinking", 0
        elif self.state == "thinking":
            if _ends_with(self._recent, self.spec.close_ids):
                self.state = "done"
            else:
                self.count += 1
        elif self.state == "forcing" and not self._queue:
            self.state = "done"


def _ends_with(seq: list[int], tail: tuple[int, ...]) -> bool:
    return bool(tail) and len(seq) >= len(tail) and tuple(seq[-len(tail):]) == tail
