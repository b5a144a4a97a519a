"""What both backends share behind the engine's contract (engine/backend.py): how a step's
rows are laid out in one forward, the packed-attention groups, and the steering seam."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel.engine.backend import ForwardRow


@dataclass(frozen=True)
class RowLayout:
    """Where each row's tokens sit in one forward's [batch, tokens] input.

    Padded: row i is batch entry i, right-padded to the longest row (one-token decode rows, or
    one row alone). Packed: rows of different lengths with some longer than one token (a
    prefill chunk beside decode rows) run as one sequence of all their tokens end to end, so
    the whole step is one forward and no row is padded to a chunk's width; attention then
    runs per row (each backend's packed attention)."""

    n: tuple[int, ...]
    packed: bool

    @classmethod
    def of(cls, n) -> RowLayout:
        n = tuple(n)
        return cls(n, len(n) > 1 and max(n) > 1)

    @property
    def starts(self) -> list[int]:
        """Each row's first token index in the packed sequence."""
        return np.concatenate([[0], np.cumsum(self.n)[:-1]]).astype(int).tolist()

    def per_token(self, block: np.ndarray) -> np.ndarray:
        """A per-row [B, 1, ...] block as the input is laid out: unchanged when padded,
        [1, T, ...] (each row's entry repeated over its tokens) when packed."""
        return np.repeat(block[:, 0], self.n, axis=0)[None] if self.packed else block

    def last(self) -> tuple[list[int], list[int]]:
        """(batch index, token index) of each row's last token."""
        if self.packed:
            return [0] * len(self.n), [s + k - 1 for s, k in zip(self.starts, self.n)]
        return list(range(len(self.n))), [k - 1 for k in self.n]

    def padded_groups(self) -> list[list[int]]:
        """Row indices of the padded forwards that replace one packed forward where a family
        cannot pack: the one-token rows together, each longer row alone."""
        one = [i for i, k in enumerate(self.n) if k == 1]
        return ([one] if one else []) + [[i] for i, k in enumerate(self.n) if k > 1]

    def rows(self, x: Any, i: int) -> Any:
        """Row i's [n, ...] entries of a [batch, tokens, ...] tensor."""
        if self.packed:
            s = self.starts[i]
            return x[0, s: s + self.n[i]]
        return x[i, : self.n[i]]


@dataclass
class AttendGroup:
    """Rows of a packed step that attend together: the one-token rows as one padded batch, or
    one longer row. Plain numpy; each backend turns it into its own index tensors."""

    tokens: list[int] | slice  # the queries' token indices in the packed sequence
    read: np.ndarray  # [b, lmax] KV slots of each row's history (padding reads the null block)
    qpos: np.ndarray  # [b, nq] each query's position in its stored history

    def allowed(self, window: int | None) -> np.ndarray:
        """[b, 1, nq, lmax] bool: which stored keys each query may attend."""
        return causal_allowed(self.qpos, self.read.shape[1], window)[:, None]


def contiguous_start(read: np.ndarray) -> int | None:
    """[b, lmax] read slots: the first slot when one row's slots run in order (a fresh pool's
    blocks), so its history is a slice of the pool instead of a gather; else None."""
    if read.shape[0] != 1:
        return None
    slots = read[0]
    return int(slots[0]) if len(slots) < 2 or bool((np.diff(slots) == 1).all()) else None


def causal_allowed(qpos: np.ndarray, lmax: int, window: int | None) -> np.ndarray:
    """[b, nq, lmax] bool: key k is visible to the query at qpos when k <= qpos (and, with a
    sliding window, k > qpos - window)."""
    kpos = np.arange(lmax)[None, None, :]
    allowed = kpos <= qpos[:, :, None]
    if window is not None:
        allowed &= kpos > qpos[:, :, None] - window
    return allowed


def attend_groups(rows: list[tuple[Any, int]], layout: RowLayout, null_slot: int) -> tuple[list[AttendGroup], list[int]]:
    """A packed step's attention groups over (sequence, new tokens) rows (each sequence's
    `length` not yet advanced), and the token order their outputs come out in."""
    offsets = [seq.length for seq, _ in rows]
    starts = layout.starts
    one = [i for i, (_, n) in enumerate(rows) if n == 1]
    groups: list[AttendGroup] = []
    order: list[int] = []
    if one:
        lmax = max(offsets[i] + 1 for i in one)
        read = np.full((len(one), lmax), null_slot, dtype=np.int64)
        for k, i in enumerate(one):
            read[k, : offsets[i] + 1] = rows[i][0].slots(0, offsets[i] + 1)
        groups.append(AttendGroup([starts[i] for i in one], read, np.asarray([[offsets[i]] for i in one])))
        order += [starts[i] for i in one]
    for i, (seq, n) in enumerate(rows):
        if n > 1:
            read = np.asarray(seq.slots(0, offsets[i] + n), dtype=np.int64)[None]
            groups.append(AttendGroup(slice(starts[i], starts[i] + n), read, (offsets[i] + np.arange(n))[None]))
            order += range(starts[i], starts[i] + n)
    return groups, order


def packed_positions(rows: list[tuple[Any, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(KV slots to write, logical RoPE positions) of every token of a packed step, [T] each;
    positions run ahead of the stored length after a context shift."""
    write = np.concatenate([seq.slots(seq.length, seq.length + n) for seq, n in rows]).astype(np.int64)
    pos = np.concatenate([seq.position + np.arange(n) for seq, n in rows]).astype(np.int64)
    return write, pos


def steering_blocks(rows: list[ForwardRow]) -> dict[int, np.ndarray]:
    """Per steered layer, one fp32 [B, 1, hidden] delta block for the step (zeros for rows
    without a delta at that layer, so they pass through unchanged); empty when nobody steers."""
    blocks: dict[int, np.ndarray] = {}
    for i, r in enumerate(rows):
        for li, delta in (r.steering or {}).items():
            if li not in blocks:
                blocks[li] = np.zeros((len(rows), 1, np.shape(delta)[-1]), dtype=np.float32)
            blocks[li][i, 0] = delta
    return blocks


def read_layers(rows: list[ForwardRow]) -> set[int]:
    """The layers whose residuals some row of the step captures."""
    return {li for r in rows if r.capture for li in r.capture}


class RowSteering:
    """The per-row steering and capture seam both backends share: a hook on each steered or
    read layer adds that step's [B, 1, hidden] delta block and keeps the residual before and
    after it for the rows that capture. A backend supplies `hooks` (a LayerHooks registry),
    `_as_delta(block)` (fp32 numpy -> its tensor in the compute dtype) and `_as_numpy(x)`."""

    def _init_steering(self) -> None:
        self._hooked: set[int] = set()
        self._deltas: dict[int, Any] = {}
        self._reads: dict[int, Any] = {}

    def _layer_hook(self, layer: int, hidden: Any) -> Any:
        """Installed once per steered or read layer; free when the step asks nothing of it."""
        delta = self._deltas.get(layer)
        out = hidden if delta is None else hidden + delta
        if layer in self._reads:
            self._reads[layer] = (hidden, out)
        return out

    def _prepare_step(self, rows: list[ForwardRow], layout: RowLayout) -> None:
        """One [B, 1, hidden] delta per steered layer (zeros for rows without one; [1, T, hidden]
        when the rows are packed), and the layers some row reads; both empty when no row asks,
        so the forward is untouched."""
        blocks, read = steering_blocks(rows), read_layers(rows)
        blocks = {li: layout.per_token(b) for li, b in blocks.items()}
        for li in blocks.keys() | read:
            if li not in self._hooked:
                self.hooks.add(li, self._layer_hook)
                self._hooked.add(li)
        self._deltas = {li: self._as_delta(b) for li, b in blocks.items()}
        self._reads = {li: None for li in read}

    def _deliver_reads(self, rows: list[ForwardRow], layout: RowLayout) -> None:
        """Hand each capturing row its [n, hidden] fp32 residuals before / after the delta."""
        reads, self._reads = self._reads, {}
        for i, r in enumerate(rows):
            for li, fn in (r.capture or {}).items():
                pre, post = reads[li]
                fn(list(r.tokens), self._as_numpy(layout.rows(pre, i)), self._as_numpy(layout.rows(post, i)))


