"""Splitting a loaded mlx-lm family over an `mx.distributed` group: tensor or pipeline parallel.

Tensor parallel (`tensor_parallel`): every decoder layer's attention heads and MLP columns split
over the group, the way mlx-lm's `Model.shard` does it: q/k/v and gate/up become mlx.nn's
AllToShardedLinear (each rank computes its heads' / columns' outputs), o_proj and down_proj
ShardedToAllLinear (each rank's partial product, then one all_sum). Each rank's attention then
writes only its own KV heads, so the paged pool (paged.py sizes its arrays from the keys it is
handed) holds 1/N of the KV. Where the heads divide evenly, mlx-lm's own `shard` runs; where they
do not (SmolLM2: 9 query and 3 KV heads over 2 ranks), mlxcel splits by whole KV-head groups,
rank r taking the r-th of N near-equal runs of KV heads with their query heads, into the same
mlx.nn layers. Embeddings, norms and the LM head stay whole on every rank.

Pipeline parallel (`pipeline_parallel`): each rank keeps a contiguous run of decoder layers and
drops the others' weights; in mlx-lm's order rank 0 holds the last layers (where the logits are
made, and rank 0 is the one that samples) and rank N-1 the first. Layers are swapped in place at
the layer seam, so any family whose stack calls its layers in order works without a pipeline
method of its own: a layer this rank does not hold passes its input through; the first layer it
holds replaces its input with the activations received from rank r+1; the last sends its output
to rank r-1, tied into the graph with mx.depends so evaluating the step performs the send.

A family outside SHARDABLE (tensor) or with recurrent / latent layers (pipeline) is refused by
name before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from mlxcel.engine.backend import KVSpec
from mlxcel.models.registry import DOCS_PAGE, Family, UnsupportedModelType

# mlx-lm modules whose Model has `shard` over q/k/v/o_proj and gate/up/down_proj with
# `n_heads` / `n_kv_heads` attributes: the layout both split paths below rely on
SHARDABLE = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


@dataclass(frozen=True)
class ShardInfo:
    """What this rank holds of the model."""

    mode: str  # "tp" | "pp"
    rank: int
    size: int
    kv_heads: tuple[int, int] = (1, 1)  # (this rank's KV heads, the model's): the KV pool's share
    layers: tuple[int, int] = (0, 0)  # [lo, hi): the decoder layers this rank runs
    split: str = ""  # "mlx-lm" (Model.shard) | "kv-groups" (uneven heads) | "layers"


def apply(model: nn.Module, family: Family, joined) -> ShardInfo:
    """Split `model` for this rank of `joined` (distributed.MLXGroup): --tp-size or --pp-size."""
    spec = joined.spec
    if spec.tp_size > 1 and spec.pp_size > 1:
        raise UnsupportedModelType(f"--tp-size {spec.tp_size} with --pp-size {spec.pp_size}: the MLX backend splits "
                                   "a model one way at a time; use one of them")
    if spec.tp_size > 1:
        return tensor_parallel(model, family.mlx_module, family.model_type, joined.group)
    return pipeline_parallel(model, family.model_type, family.attention, joined.group)


def local_kv_spec(spec: KVSpec, shard: ShardInfo | None) -> KVSpec:
    """What this rank's KV pool holds per token: its share of the heads (tensor parallel) or
    only its layers (pipeline parallel)."""
    if shard is None:
        return spec
    if shard.mode == "tp":
        mine, total = shard.kv_heads
        return KVSpec(tuple(replace(layer, bytes_per_token=layer.bytes_per_token * mine // total)
                            for layer in spec.layers))
    lo, hi = shard.layers
    return KVSpec(tuple(layer if lo <= i < hi else replace(layer, bytes_per_token=0)
                        for i, layer in enumerate(spec.layers)))


def run_sizes(total: int, n: int) -> list[int]:
    """`total` as n near-equal runs, the longer ones first."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _bounds(total: int, n: int, r: int) -> tuple[int, int]:
    sizes = run_sizes(total, n)
    lo = sum(sizes[:r])
    return lo, lo + sizes[r]


def tensor_parallel(model: nn.Module, module_name: str, model_type: str, group) -> ShardInfo:
    n, r = group.size(), group.rank()
    if module_name not in SHARDABLE or not hasattr(model, "shard"):
        raise UnsupportedModelType(f"{model_type} cannot be split by --tp-size on the MLX backend (tensor parallel "
                                   f"covers the llama, mistral, qwen2 and qwen3 layouts); use --pp-size; see {DOCS_PAGE}")
    attn = model.layers[0].self_attn
    heads, kv = attn.n_heads, attn.n_kv_heads
    if kv < n:
        raise UnsupportedModelType(f"--tp-size {n} exceeds {model_type}'s {kv} KV heads (each rank needs at least "
                                   f"one); use --tp-size {kv} or less, or --pp-size")
    width = model.layers[0].mlp.gate_proj
    inner = width.weight.shape[0] if isinstance(width, nn.Linear) else None
    if heads % n == 0 and kv % n == 0 and (inner is None or inner % n == 0):
        model.shard(group)  # mlx-lm's own split (quantized linears included)
        return ShardInfo("tp", r, n, (kv // n, kv), split="mlx-lm")
    for layer in model.layers:
        _split_attention(layer.self_attn, n, r, group, model_type)
        _split_mlp(layer.mlp, n, r, group, model_type)
    lo, hi = _bounds(kv, n, r)
    return ShardInfo("tp", r, n, (hi - lo, kv), split="kv-groups")


def _plain(linear, model_type: str) -> nn.Linear:
    if not isinstance(linear, nn.Linear):
        raise UnsupportedModelType(f"{model_type}'s heads or MLP columns do not divide evenly over --tp-size, and "
                                   "a quantized checkpoint splits only evenly; use a --tp-size that divides them")
    return linear


def _columns(linear, lo: int, hi: int, n: int, group, model_type: str) -> nn.AllToShardedLinear:
    """Output rows [lo, hi) of `linear` on this rank."""
    w = _plain(linear, model_type).weight
    out = nn.AllToShardedLinear(w.shape[1], (hi - lo) * n, bias="bias" in linear, group=group)
    out.update({"weight": w[lo:hi], **({"bias": linear.bias[lo:hi]} if "bias" in linear else {})})
    return out


def _rows(linear, lo: int, hi: int, n: int, group, model_type: str) -> nn.ShardedToAllLinear:
    """Input columns [lo, hi) of `linear` on this rank; the partial products are summed."""
    w = _plain(linear, model_type).weight
    out = nn.ShardedToAllLinear((hi - lo) * n, w.shape[0], bias="bias" in linear, group=group)
    out.update({"weight": w[:, lo:hi], **({"bias": linear.bias} if "bias" in linear else {})})
    return out


def _split_attention(attn, n: int, r: int, group, model_type: str) -> None:
    per = attn.n_heads // attn.n_kv_heads  # query heads per KV head (GQA)
    dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads
    lo, hi = _bounds(attn.n_kv_heads, n, r)
    attn.q_proj = _columns(attn.q_proj, lo * per * dim, hi * per * dim, n, group, model_type)
    attn.k_proj = _columns(attn.k_proj, lo * dim, hi * dim, n, group, model_type)
    attn.v_proj = _columns(attn.v_proj, lo * dim, hi * dim, n, group, model_type)
    attn.o_proj = _rows(attn.o_proj, lo * per * dim, hi * per * dim, n, group, model_type)
    attn.n_heads, attn.n_kv_heads = (hi - lo) * per, hi - lo


def _split_mlp(mlp, n: int, r: int, group, model_type: str) -> None:
    lo, hi = _bounds(_plain(mlp.gate_proj, model_type).weight.shape[0], n, r)
    mlp.gate_proj = _columns(mlp.gate_proj, lo, hi, n, group, model_type)
    mlp.up_proj = _columns(mlp.up_proj, lo, hi, n, group, model_type)
    mlp.down_proj = _rows(mlp.down_proj, lo, hi, n, group, model_type)


_SKIP_CLASSES: dict[type, type] = {}
_STAGE_CLASSES: dict[type, type] = {}


def _skip(layer: nn.Module) -> None:
    """A decoder layer another rank holds: its input passes through, and its weights are dropped
    (never read: the checkpoint loads lazily) while the attributes the family's stack reads of it
    (`use_sliding`, ...) stay."""
    cls = type(layer)
    if cls not in _SKIP_CLASSES:
        _SKIP_CLASSES[cls] = type(f"Skipped{cls.__name__}", (cls,), {"__call__": lambda self, x, *a, **k: x})
    layer.update(tree_map(lambda _: mx.zeros((0,)), layer.parameters()))
    layer.__class__ = _SKIP_CLASSES[cls]


def _stage_class(cls: type) -> type:
    """`cls` with the pipeline's receive before it and/or send after it (set per layer)."""
    if cls not in _STAGE_CLASSES:

        def __call__(self, x, *args, **kwargs):
            src, dst, group = self._mlxcel_pipe
            if src is not None:
                x = mx.distributed.recv_like(x, src, group=group)
            out = cls.__call__(self, x, *args, **kwargs)
            if dst is not None:
                out = mx.depends(out, mx.distributed.send(out, dst, group=group))
            return out

        _STAGE_CLASSES[cls] = type(f"Stage{cls.__name__}", (cls,), {"__call__": __call__})
    return _STAGE_CLASSES[cls]


def pipeline_parallel(model: nn.Module, model_type: str, attention: frozenset | tuple, group) -> ShardInfo:
    n, r = group.size(), group.rank()
    if "recurrent" in attention or "latent" in attention:
        raise UnsupportedModelType(f"{model_type}'s recurrent or latent layers are not split by --pp-size on the "
                                   f"MLX backend; see {DOCS_PAGE}")
    layers = model.layers
    if len(layers) < n:
        raise UnsupportedModelType(f"--pp-size {n} exceeds {model_type}'s {len(layers)} decoder layers; use "
                                   f"--pp-size {len(layers)} or less")
    sizes = run_sizes(len(layers), n)
    hi = len(layers) - sum(sizes[:r])  # rank 0 holds the last run (mlx-lm's order)
    lo = hi - sizes[r]
    for i in range(len(layers)):
        if not lo <= i < hi:
            _skip(layers[i])
    first, last = layers[lo], layers[hi - 1]
    for layer in {id(first): first, id(last): last}.values():
        layer.__class__ = _stage_class(type(layer))
        object.__setattr__(layer, "_mlxcel_pipe", (None, None, group))
    if r < n - 1:
        object.__setattr__(first, "_mlxcel_pipe", (r + 1, None, group))
    if r > 0:
        src = first._mlxcel_pipe[0] if last is first else None
        object.__setattr__(last, "_mlxcel_pipe", (src, r - 1, group))
    return ShardInfo("pp", r, n, layers=(lo, hi), split="layers")
