"""Recurrent layers' per-sequence state on torch, and the step cache transformers' families read it through.

transformers' recurrent families (LFM2's short convolutions, Mamba 2's SSM mixers) ask their
cache for a layer's state with `get_conv_state` / `get_recurrent_state`, hand the new one back
with `update_conv_state` / `update_recurrent_state`, and on a one-token step update the state
tensor they were given in place. `RecurrentStepCache` answers those calls for one step over
the engine's rows, beside the paged attention it inherits: each row's state is gathered from
its sequence's state slot (engine/kv_block_pool.StateSlots; zero for a sequence with no tokens
yet, so a reused slot needs no clearing) and written back after the forward (`commit`).

Padding: transformers masks padding for left-padded batches only. A right-padded row's
convolution state is taken here at its last real token (the padded tail never reaches a real
token's output through a causal convolution), so a family whose layers keep only convolution
states (LFM2) runs padded steps. A scan's state decays through padded positions even with
their inputs zeroed, so a family with scan states (Mamba 2) never pads: rows of different
lengths run as separate forwards (`pads_rows`). Neither family's steps ever pack.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from mlxcel.backends.torch.paged import PagedStepCache, PagedStorage, StepPlan, _to_device
from mlxcel.engine.backend import KVSpec, LayerKV, ModelInfo, kv_bytes_per_token
from mlxcel.engine.kv_block_pool import SequenceKV, StateSlots

CONV, SCAN = "conv", "scan"  # a layer's state entries: the convolution window, the scan's state


def layer_states(model, device: torch.device) -> dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Which layers keep a recurrent state: layer -> {entry: (one sequence's shape, dtype)},
    read from one token through transformers' own cache (its linear-attention layers)."""
    with torch.inference_mode():
        out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True)
    # a recurrent family's output names it `cache` (Mamba 2's), the rest `past_key_values`
    cache = getattr(out, "past_key_values", None)
    cache = cache if cache is not None else out.cache
    states = {}
    for li, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        entries = {}
        for name, held in ((CONV, layer.conv_states), (SCAN, layer.recurrent_states)):
            if len(held) != 1:  # mlxcel keeps one tensor per entry; a family with more is refused
                raise ValueError(f"layer {li} keeps {len(held)} {name} states; one is supported")
            if held[0] is not None:
                entries[name] = (tuple(held[0].shape[1:]), held[0].dtype)
        states[li] = entries
    return states


def state_bytes(entries: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in entries.values())


def kv_spec(info: ModelInfo, dtype_bytes: int, windows: list[int | None], states: dict) -> KVSpec:
    """Attention layers keep keys and values per token; recurrent layers a state per sequence."""
    attention = info.num_layers - len(states)
    per_layer = kv_bytes_per_token(info, dtype_bytes) // max(info.num_layers, 1) if attention else 0
    return KVSpec(tuple(LayerKV("recurrent", 0, state_bytes=state_bytes(states[li])) if li in states
                        else LayerKV("full" if w is None else "sliding", per_layer, w) for li, w in enumerate(windows)))


class RecurrentStorage:
    """Per recurrent layer and entry, one tensor shaped [state slots, ...], grown (doubling)
    as the slots' high-water mark rises; new slots read as zeros."""

    def __init__(self, slots: StateSlots, layers: dict, device: torch.device) -> None:
        self.slots, self.layers, self.device = slots, layers, device
        self.states: dict[tuple[int, str], torch.Tensor] = {}

    def tensor(self, layer: int, entry: str) -> torch.Tensor:
        need = max(self.slots.high_water, 1)
        have = self.states.get((layer, entry))
        if have is None or have.shape[0] < need:
            shape, dtype = self.layers[layer][entry]
            size = need if have is None else max(need, 2 * have.shape[0])
            grown = torch.zeros((size, *shape), dtype=dtype, device=self.device)
            if have is not None:
                grown[: have.shape[0]] = have
            self.states[(layer, entry)] = grown
        return self.states[(layer, entry)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.states.values())


class StateRows:
    """What every recurrent layer of one forward shares: the rows' state slots, which rows
    start fresh, and each row's real token count."""

    def __init__(self, rows: list[tuple[SequenceKV, int]], device: torch.device) -> None:
        for seq, _ in rows:
            if seq.state is None or seq.state_ahead:
                raise RuntimeError("a recurrent model's row needs its own state slot, and a truncated "
                                   "sequence's state cannot be continued")
        self.slots = _to_device(np.asarray([seq.state for seq, _ in rows], dtype=np.int64), device)
        fresh = np.asarray([seq.length == 0 for seq, _ in rows])
        self.keep = None if not fresh.any() else _to_device(~fresh, device)
        self.n = _to_device(np.asarray([n for _, n in rows], dtype=np.int64), device)


class RecurrentStepCache(PagedStepCache):
    """The transformers cache for one step of a recurrent family: attention layers through the
    paged storage (PagedStepCache), recurrent layers through each row's state slot."""

    def __init__(self, storage: PagedStorage, plan: StepPlan, states: RecurrentStorage, rows: StateRows) -> None:
        super().__init__(storage, plan)
        self.states, self.rows = states, rows
        self.held: dict[tuple[int, str], torch.Tensor] = {}  # this step's [B, ...] states, to commit

    def _state(self, layer: int, entry: str) -> torch.Tensor | None:
        if entry not in self.states.layers.get(layer, {}):
            return None
        key = (layer, entry)
        if key not in self.held:
            got = self.states.tensor(layer, entry).index_select(0, self.rows.slots)
            if self.rows.keep is not None:  # a fresh row starts from zeros, whatever its slot held
                got.mul_(self.rows.keep.view(-1, *([1] * (got.dim() - 1))).to(got.dtype))
            self.held[key] = got
        return self.held[key]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state(layer_idx, CONV)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state(layer_idx, SCAN)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """The held window followed by the step's inputs [B, C, n], which the family convolves;
        each row's new window ends at its own last real token, not at the padded end."""
        state = self._state(layer_idx, CONV)
        full = torch.cat([state.to(conv_states.dtype), conv_states], dim=-1)
        b, c, width = state.shape
        at = self.rows.n[:, None] + torch.arange(width, device=full.device)[None, :]
        self.held[(layer_idx, CONV)] = full.gather(2, at[:, None, :].expand(b, c, width)).to(state.dtype)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.held[(layer_idx, SCAN)] = recurrent_states
        return recurrent_states

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return True  # every row has a state: zeros for a fresh one, the same as none

    def is_recording_past(self, layer_idx: int) -> bool:
        return False  # a state is never rewound (engine/kv_manager: no prefix cache, no shift)

    def commit(self) -> None:
        """Every state the step read or replaced back into its rows' slots (the one-token paths
        update what they read in place)."""
        for (layer, entry), value in self.held.items():
            target = self.states.tensor(layer, entry)
            target.index_copy_(0, self.rows.slots, value.to(target.dtype))
