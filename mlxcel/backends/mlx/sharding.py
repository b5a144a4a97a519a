"""Splitting a loaded mlx-lm family over an `mx.distributed` group: tensor or pipeline parallel.

Tensor parallel (`tensor_parallel`): every decoder layer's attention heads and MLP columns split
over the group the way mlx-lm's `Model.shard` splits them: q/k/v and gate/up become mlx.nn's
AllToShardedLinear (each rank computes its own heads and columns), o_proj and down_proj
ShardedToAllLinear (each rank's partial product, then one all_sum). Each rank's attention then
writes only its own KV heads, so its paged pool (paged.py sizes its arrays from the keys it is
handed) holds its share of the KV. Where heads and columns divide evenly mlx-lm's own `shard`
runs (quantized linears included); where they do not (SmolLM2: 9 query and 3 KV heads over 2
ranks) the split is by whole KV-head groups (backends/distributed.head_split, the arithmetic
the torch shards use too) into the same mlx.nn layers. Embeddings, norms and the LM head stay
whole on every rank.

Pipeline parallel (`pipeline_parallel`): stage s keeps the contiguous layers
backends/distributed.stage_layers gives it (stage 0 the first) and drops the others' weights.
The split is at the layer seam, so any family whose stack calls its layers in order needs no
pipeline method of its own (mlx-lm has one for a few families, not for llama): a layer another
stage holds passes its input through, keeping the attributes the family's stack reads of it;
the first layer a stage holds replaces its input with the activations received from the stage
before; the last sends its output on (tied into the graph with mx.depends, so evaluating the
step performs the send). The last stage sends to rank 0, whose last layer's output becomes what
it receives, so the final norm and LM head run on rank 0, where the engine samples. Rank 0's own
send is evaluated before that receive is queued: a receive has no inputs to order it after the
send by, and queued first it would wait for a stage that waits for rank 0.

Families outside SHARDABLE (tensor) or with recurrent / latent layers (pipeline) are refused by
name before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from mlxcel.backends.distributed import GroupRefused, column_split, head_split, stage_layers
from mlxcel.engine.backend import KVSpec
from mlxcel.models.registry import Family, decoder_stack

# mlx-lm modules whose Model has `shard` over q/k/v/o_proj and gate/up/down_proj with
# `n_heads` / `n_kv_heads` attributes: the layout both split paths rely on
SHARDABLE = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


@dataclass(frozen=True)
class ShardInfo:
    """What this rank holds of the model."""

    mode: str  # "tp" | "pp"
    rank: int
    size: int
    kv_heads: tuple[int, int] = (1, 1)  # (this rank's KV heads, the model's): its pool's share
    layers: range = range(0)  # the decoder layers this rank runs (pipeline parallel)
    split: str = ""  # "mlx-lm" (Model.shard) | "kv-groups" (uneven heads) | "layers"


def apply(model: nn.Module, family: Family, joined) -> ShardInfo:
    """Split `model` for this rank of `joined` (distributed.MLXGroup): --tp-size or --pp-size.
    A rank other than 0 never runs the LM head (its steps stop at the decoder stack), so an
    untied head's weights are dropped there."""
    if joined.spec.tp_size > 1:
        info = tensor_parallel(model, family, joined.group)
    else:
        info = pipeline_parallel(model, family, joined.group)
    head = getattr(model, "lm_head", None)
    if info.rank != 0 and isinstance(head, nn.Module):
        _drop(head)
    return info


def _drop(module: nn.Module) -> None:
    """Replace the module's weights with empty arrays: never read, never materialized."""
    module.update(tree_map(lambda _: mx.zeros((0,)), module.parameters()))


def local_kv_spec(spec: KVSpec, shard: ShardInfo | None) -> KVSpec:
    """What this rank's KV pool holds per token: its share of the heads (tensor parallel) or
    only its layers (pipeline parallel)."""
    if shard is None:
        return spec
    if shard.mode == "tp":
        mine, total = shard.kv_heads
        return KVSpec(tuple(replace(layer, bytes_per_token=layer.bytes_per_token * mine // total)
                            for layer in spec.layers))
    return KVSpec(tuple(layer if i in shard.layers else replace(layer, bytes_per_token=0)
                        for i, layer in enumerate(spec.layers)))


# -- tensor parallel ----------------------------------------------------------------------------
def tensor_parallel(model: nn.Module, family: Family, group) -> ShardInfo:
    n, r = group.size(), group.rank()
    if family.mlx_module not in SHARDABLE or not hasattr(model, "shard"):
        raise GroupRefused(f"--tp-size {n}: {family.model_type} is not split by tensor parallel on the MLX backend "
                           "(its layouts: llama, mistral, qwen2, qwen3); use --pp-size, or --backend torch")
    attn = model.layers[0].self_attn
    heads, kv = attn.n_heads, attn.n_kv_heads
    split = head_split(family.model_type, heads, kv, n, r)  # refuses fewer KV heads than ranks
    gate = model.layers[0].mlp.gate_proj
    inner = gate.weight.shape[0] if isinstance(gate, nn.Linear) else None
    if heads % n == 0 and kv % n == 0 and (inner is None or inner % n == 0):
        model.shard(group)  # mlx-lm's own split
        return ShardInfo("tp", r, n, (kv // n, kv), split="mlx-lm")
    for layer in model.layers:
        _split_attention(layer.self_attn, split.kv_heads, n, group, family.model_type)
        _split_mlp(layer.mlp, n, r, group, family.model_type)
    return ShardInfo("tp", r, n, (len(split.kv_heads), kv), split="kv-groups")


def _plain(linear, model_type: str) -> nn.Linear:
    if not isinstance(linear, nn.Linear):
        raise GroupRefused(f"{model_type}'s heads or MLP columns do not divide evenly over --tp-size, and a quantized "
                           "checkpoint is split only evenly; use a --tp-size that divides them, or --pp-size")
    return linear


def _columns(linear, keep: range, n: int, group, model_type: str) -> nn.AllToShardedLinear:
    """Output rows `keep` of `linear`, on this rank."""
    w = _plain(linear, model_type).weight
    out = nn.AllToShardedLinear(w.shape[1], len(keep) * n, bias="bias" in linear, group=group)
    out.update({"weight": w[keep.start:keep.stop],
                **({"bias": linear.bias[keep.start:keep.stop]} if "bias" in linear else {})})
    return out


def _rows(linear, keep: range, n: int, group, model_type: str) -> nn.ShardedToAllLinear:
    """Input columns `keep` of `linear`, on this rank; the ranks' partial products are summed."""
    w = _plain(linear, model_type).weight
    out = nn.ShardedToAllLinear(len(keep) * n, w.shape[0], bias="bias" in linear, group=group)
    out.update({"weight": w[:, keep.start:keep.stop], **({"bias": linear.bias} if "bias" in linear else {})})
    return out


def _split_attention(attn, kv: range, n: int, group, model_type: str) -> None:
    per = attn.n_heads // attn.n_kv_heads  # query heads per KV head (GQA)
    dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads
    q = range(kv.start * per * dim, kv.stop * per * dim)
    k = range(kv.start * dim, kv.stop * dim)
    attn.q_proj = _columns(attn.q_proj, q, n, group, model_type)
    attn.k_proj = _columns(attn.k_proj, k, n, group, model_type)
    attn.v_proj = _columns(attn.v_proj, k, n, group, model_type)
    attn.o_proj = _rows(attn.o_proj, q, n, group, model_type)
    attn.n_heads, attn.n_kv_heads = len(kv) * per, len(kv)


def _split_mlp(mlp, n: int, r: int, group, model_type: str) -> None:
    keep = column_split(_plain(mlp.gate_proj, model_type).weight.shape[0], n, r)
    mlp.gate_proj = _columns(mlp.gate_proj, keep, n, group, model_type)
    mlp.up_proj = _columns(mlp.up_proj, keep, n, group, model_type)
    mlp.down_proj = _rows(mlp.down_proj, keep, n, group, model_type)


# -- pipeline parallel --------------------------------------------------------------------------
_SKIPPED: dict[type, type] = {}
_STAGED: dict[type, type] = {}


def _skip(layer: nn.Module) -> None:
    """A layer another stage holds: its input passes through; its weights are dropped (never
    read: the checkpoint loads lazily), its other attributes (`use_sliding`, ...) stay."""
    cls = type(layer)
    if cls not in _SKIPPED:
        _SKIPPED[cls] = type(f"Skipped{cls.__name__}", (cls,), {"__call__": lambda self, x, *a, **k: x})
    _drop(layer)
    layer.__class__ = _SKIPPED[cls]


class _StageInput(nn.Module):
    """A later stage's token embedding: its input is received, so only the shape and compute
    dtype of the first stage's embeddings matter (`width` is cast with the model's dtype)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.width = mx.zeros((hidden,))

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.broadcast_to(self.width, (*ids.shape, self.width.shape[0]))


def _staged(cls: type) -> type:
    """`cls` with a receive before it and / or a send after it (`_mlxcel_pipe`: src, dst, group,
    and whether the send is evaluated at once)."""
    if cls not in _STAGED:

        def __call__(self, x, *args, **kwargs):
            src, dst, group, now = self._mlxcel_pipe
            if src is not None:
                x = mx.distributed.recv_like(x, src, group=group)
            out = cls.__call__(self, x, *args, **kwargs)
            if dst is not None:
                sent = mx.distributed.send(out, dst, group=group)
                if now:
                    mx.eval(sent)
                out = mx.depends(out, sent)
            return out

        _STAGED[cls] = type(f"Staged{cls.__name__}", (cls,), {"__call__": __call__})
    return _STAGED[cls]


def _stage(layer: nn.Module, src: int | None, dst: int | None, group, now: bool = False) -> None:
    layer.__class__ = _staged(type(layer))
    object.__setattr__(layer, "_mlxcel_pipe", (src, dst, group, now))


def pipeline_parallel(model: nn.Module, family: Family, group) -> ShardInfo:
    n, r = group.size(), group.rank()
    if "recurrent" in family.attention or "latent" in family.attention:
        raise GroupRefused(f"--pp-size {n}: {family.model_type}'s recurrent or latent layers are not split by the MLX "
                           "backend's pipeline; serve it on one process")
    layers = model.layers
    own = stage_layers(len(layers), n, r)
    for i in range(len(layers)):
        if i not in own:
            _skip(layers[i])
    first, last = own.start, own.stop - 1
    if r > 0:  # the embeddings run on the first stage only
        stack = decoder_stack(model)
        for name, child in stack.children().items():
            if isinstance(child, nn.Embedding):
                setattr(stack, name, _StageInput(child.weight.shape[1]))
    if r == 0:
        # rank 0 sends on at once, then its (skipped) last layer takes the last stage's output
        _stage(layers[last], None, 1, group, now=True)
        _stage(layers[-1], n - 1, None, group)
    else:
        _stage(layers[first], r - 1, (r + 1) % n if first == last else None, group)
        if first != last:
            _stage(layers[last], None, (r + 1) % n, group)
    return ShardInfo("pp", r, n, layers=own, split="layers")
