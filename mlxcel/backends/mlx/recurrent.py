"""Recurrent layers' per-sequence state on MLX, and the per-step view mlx-lm's families read it through.

mlx-lm's recurrent families (LFM2's short convolutions, Mamba 2's SSM layers) keep a layer's
state in an ArraysCache: a short list of [batch, ...] arrays the layer reads by index and
replaces, with `lengths` (each row's real tokens in a right-padded step), `advance` and
`make_mask`. `RecurrentBatchView` honours that protocol for one step over the engine's rows:
each row's state comes from its sequence's state slot (engine/kv_block_pool.StateSlots; zero
for a sequence with no tokens yet, so a reused slot needs no clearing) and goes back there
after the forward (`StateStep.commit`). Such a model's steps are always padded, never packed:
a packed step runs every row as one sequence, which a recurrence cannot separate. Whenever a
step is padded `lengths` is set, so the family masks padded positions out of the convolution
input and the scan and takes each row's new state at its last real token.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.engine.backend import KVSpec, LayerKV, ModelInfo, kv_bytes_per_token
from mlxcel.engine.kv_block_pool import SequenceKV, StateSlots


def layer_states(model) -> dict[int, tuple[int, int]]:
    """Which layers keep a recurrent state: layer -> (its entries, bytes one sequence's state
    takes), read from one token through mlx-lm's own cache (its ArraysCache layers)."""
    from mlx_lm.models.cache import ArraysCache

    caches = model.make_cache()
    model(mx.array([[0]]), cache=caches)
    out = {}
    for li, c in enumerate(caches):
        if isinstance(c, ArraysCache):
            mx.eval([a for a in c.cache if a is not None])
            out[li] = (len(c.cache), sum(a.nbytes for a in c.cache if a is not None))
    return out


def kv_spec(info: ModelInfo, dtype_bytes: int, windows: list[int | None], states: dict[int, tuple[int, int]]) -> KVSpec:
    """Attention layers keep keys and values per token; recurrent layers a state per sequence."""
    per_layer = kv_bytes_per_token(info, dtype_bytes) // max(info.num_layers, 1)
    return KVSpec(tuple(LayerKV("recurrent", 0, state_bytes=states[li][1]) if li in states
                        else LayerKV("full" if w is None else "sliding", per_layer, w) for li, w in enumerate(windows)))


class RecurrentStorage:
    """Per recurrent layer, one array per state entry shaped [state slots, ...]: created from
    the first state the layer writes, grown (doubling) as the slots' high-water mark rises."""

    def __init__(self, slots: StateSlots, layers: dict[int, tuple[int, int]]) -> None:
        self.slots = slots
        self.states: dict[int, list[mx.array | None]] = {li: [None] * n for li, (n, _) in layers.items()}

    def read(self, layer: int, index: int, step: StateStep) -> mx.array | None:
        """Each row's state entry, [B, ...]; None when every row starts fresh (the family
        builds zeros itself)."""
        arr = self.states[layer][index]
        if arr is None or step.all_fresh:
            return None
        got = arr[step.slots]
        if step.keep is None:
            return got
        return mx.where(step.keep.reshape((-1,) + (1,) * (got.ndim - 1)), got, mx.zeros_like(got))

    def write(self, layer: int, index: int, step: StateStep, value: mx.array) -> None:
        entries = self.states[layer]
        arr = entries[index]
        need = self.slots.high_water
        if arr is None:
            arr = mx.zeros((need,) + value.shape[1:], value.dtype)
        elif arr.shape[0] < need:
            grow = max(need, 2 * arr.shape[0]) - arr.shape[0]
            arr = mx.concatenate([arr, mx.zeros((grow,) + arr.shape[1:], arr.dtype)])
        arr[step.slots] = value.astype(arr.dtype)
        entries[index] = arr

    def arrays(self) -> list[mx.array]:
        return [a for entries in self.states.values() for a in entries if a is not None]


class StateStep:
    """What every recurrent layer of one padded forward shares: the rows' state slots, which
    rows start fresh, and each row's real token count where the step is padded."""

    def __init__(self, rows: list[tuple[SequenceKV, int]]) -> None:
        for seq, _ in rows:
            if seq.state is None or seq.state_ahead:
                raise RuntimeError("a recurrent model's row needs its own state slot, and a truncated "
                                   "sequence's state cannot be continued")
        fresh = np.asarray([seq.length == 0 for seq, _ in rows])
        self.slots = mx.array(np.asarray([seq.state for seq, _ in rows], dtype=np.int32))
        self.all_fresh = bool(fresh.all())
        self.keep = None if not fresh.any() else mx.array(~fresh)
        n = [k for _, k in rows]
        self.lengths = mx.array(np.asarray(n, dtype=np.int32)) if min(n) < max(n) else None

    def commit(self, views: list) -> None:
        """Store what each recurrent layer's view was given during the forward."""
        for view in views:
            if isinstance(view, RecurrentBatchView):
                for index, value in view.written.items():
                    view.storage.write(view.layer, index, self, value)


class RecurrentBatchView:
    """One recurrent layer's cache, as mlx-lm's ArraysCache protocol reads it, for one step."""

    def __init__(self, storage: RecurrentStorage, layer: int, step: StateStep) -> None:
        self.storage, self.layer, self.step = storage, layer, step
        self.cache = [storage.read(layer, i, step) for i in range(len(storage.states[layer]))]
        self.lengths = step.lengths  # advance() counts it down per layer call, so each view has its own
        self.written: dict[int, mx.array] = {}

    def __getitem__(self, index: int):
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.cache[index] = value
        self.written[index] = value

    def advance(self, n: int) -> None:
        if self.lengths is not None:
            self.lengths = self.lengths - n

    def make_mask(self, n: int, **_) -> mx.array | None:
        """[B, n] True at each row's real tokens; None when no row is padded."""
        if self.lengths is None:
            return None
        return mx.arange(n)[None, :] < self.lengths[:, None]
