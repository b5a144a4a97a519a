"""What the KV cache costs in bytes, from a KVSpec and the KV manager's sizing alone.

The startup estimate (runtime/estimate.py, before any weight is read) and the running
engine's report (/props, /metrics) both come through `pool_bytes`, so the two differ only
where the spec they start from differs. A KV storage mode that changes what a layer keeps per
token changes that layer's `LayerKV.bytes_per_token` (and a recurrent layer its `state_bytes`);
nothing here needs to know the mode. `spec_from_config` builds the spec a backend would report
from config.json alone, at a given element size.

The pool's blocks cover: every slot's context share (one block more than it needs, for the
partial last block), the prefix cache's budget (or, with no budget of its own, `headroom` more
slot shares) and the reserved null/scratch blocks. Recurrent layers add one state per state
slot (the engine's slots plus one scoring pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlxcel.engine.backend import KVCacheTypes, KVSpec, LayerKV, ModelInfo, layer_windows
from mlxcel.engine.kv_block_pool import RESERVED
from mlxcel.engine.kv_manager import KVManager


@dataclass(frozen=True)
class KVBytes:
    """A pool's byte budget: what each part of the pool takes when every block is in use."""

    bytes_per_token: int  # across every layer that keeps a record per token
    block_size: int
    n_ctx_slot: int
    parallel: int
    pool_blocks: int  # every block, the reserved ones included
    slot_blocks: int  # one slot's share
    state_bytes: int  # one sequence's recurrent state across layers (0: none)
    state_slots: int  # recurrent states the pool holds (0: none)

    def _blocks(self, n: int) -> int:
        return n * self.block_size * self.bytes_per_token

    @property
    def per_slot_bytes(self) -> int:
        """One slot at its full context share, with its recurrent state."""
        return self._blocks(self.slot_blocks) + self.state_bytes

    @property
    def slots_bytes(self) -> int:
        return self.per_slot_bytes * self.parallel

    @property
    def prefix_cache_bytes(self) -> int:
        """The blocks beyond the slots' shares and the reserved ones: the prefix cache's."""
        return self._blocks(self.pool_blocks - RESERVED - self.slot_blocks * self.parallel)

    @property
    def capacity_bytes(self) -> int:
        """Every block and every state slot: what the pool takes once it has grown to its size."""
        return self._blocks(self.pool_blocks) + self.state_bytes * self.state_slots


def slot_share(n_ctx: int, parallel: int, kv_unified: bool = False) -> tuple[int, int]:
    """(each slot's context, the slot count) for a total context `n_ctx` over `parallel` slots;
    with `kv_unified` each slot may reach the whole context."""
    parallel = max(1, parallel)
    return max(n_ctx if kv_unified else n_ctx // parallel, 2), parallel


def pool_bytes(manager: KVManager, spec: KVSpec) -> KVBytes:
    """The byte budget of the pool `manager` builds for a backend reporting `spec` (as
    KVManager.bind sizes it: no prefix cache for a model with recurrent layers)."""
    blocks, _ = manager.pool_blocks(spec.bytes_per_token, 0 if spec.recurrent else -1)
    per_slot = -(-manager.n_ctx_slot // manager.block_size) + 1
    return KVBytes(bytes_per_token=spec.bytes_per_token, block_size=manager.block_size,
                   n_ctx_slot=manager.n_ctx_slot, parallel=manager.parallel, pool_blocks=blocks,
                   slot_blocks=per_slot, state_bytes=spec.state_bytes,
                   state_slots=manager.state_slots if spec.recurrent else 0)


def usage_bytes(manager: KVManager) -> dict[str, int]:
    """The bound pool's bytes for /props and /metrics: its capacity, what live sequences and the
    prefix cache hold now, and the prefix cache's part of that (all zero while unbound)."""
    if manager.backend is None:
        return {"bytes_per_token": 0, "capacity_bytes": 0, "used_bytes": 0, "cached_bytes": 0}
    spec = manager.backend.kv_spec
    per_block = manager.block_size * spec.bytes_per_token
    a = manager.allocator
    states = a.states.used * spec.state_bytes if a.states is not None else 0
    return {"bytes_per_token": spec.bytes_per_token, "capacity_bytes": pool_bytes(manager, spec).capacity_bytes,
            "used_bytes": a.used_blocks * per_block + states,
            "cached_bytes": manager.prefix_cache.cached_blocks * per_block}


def spec_from_config(config: dict, dtype_bytes: int, conv_keeps_kernel: bool = False,
                     types: KVCacheTypes | None = None) -> KVSpec:
    """The KVSpec a backend reports for this checkpoint config at `dtype_bytes` per element,
    without loading it: keys and values per layer (sliding windows as the config declares
    them), a latent per layer for multi-head latent attention, a fixed state for the recurrent
    layers of the families that have them. `conv_keeps_kernel`: the backend's convolution state
    holds the kernel's full width (transformers' layout, the torch backend's), not one less
    (mlx-lm's). `types`: how the attention layers store keys and values (default: f16)."""
    text = {**config.get("text_config", {}), **config}
    layers = int(text.get("num_hidden_layers") or text.get("n_layer") or text.get("num_layers") or 0)
    info = ModelInfo(path=Path("."), model_type=str(text.get("model_type")), num_layers=layers, vocab_size=0,
                     context_length=0, dtype="", checkpoint_dtype="", quantization=None, backend="", device="",
                     config=text)
    recurrent = recurrent_layers(text, layers, dtype_bytes, conv_keeps_kernel)
    if not recurrent:
        return KVSpec.uniform(info, dtype_bytes, types)
    attention = [i for i in range(layers) if i not in recurrent]
    per_layer = KVSpec.uniform(info, dtype_bytes).bytes_per_token // max(layers, 1) if attention else 0
    windows = layer_windows(text, layers)
    return KVSpec(tuple(LayerKV("recurrent", 0, state_bytes=recurrent[i]) if i in recurrent
                        else LayerKV("full" if windows[i] is None else "sliding", per_layer, windows[i])
                        for i in range(layers)))


def recurrent_layers(config: dict, layers: int, dtype_bytes: int, conv_keeps_kernel: bool = False) -> dict[int, int]:
    """Layer -> bytes of one sequence's state, for the recurrent families the registry serves
    (LFM2's short convolutions, Mamba 2's SSM with its convolution); {} for any other."""
    kind = config.get("model_type")
    if kind == "lfm2":
        full = set(config.get("full_attn_idxs") or [])
        if not full and config.get("layer_types"):
            full = {i for i, t in enumerate(config["layer_types"]) if t == "full_attention"}
        width = int(config.get("conv_L_cache") or 3) - (0 if conv_keeps_kernel else 1)
        state = width * int(config["hidden_size"]) * dtype_bytes
        return {i: state for i in range(layers) if i not in full}
    if kind == "mamba2":
        heads, head_dim = int(config["num_heads"]), int(config["head_dim"])
        groups, d_state = int(config.get("n_groups") or 1), int(config["state_size"])
        width = int(config.get("conv_kernel") or 4) - (0 if conv_keeps_kernel else 1)
        conv = width * (heads * head_dim + 2 * groups * d_state)
        return {i: (conv + heads * head_dim * d_state) * dtype_bytes for i in range(layers)}
    return {}

