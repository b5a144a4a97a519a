"""Large matrix products over several CPU threads on MLX's CPU device.

MLX runs every CPU op on its stream's one thread, and the OpenBLAS shim keeps BLAS to one
thread inside it (blas.py: OpenBLAS's own pool fights that thread for the cores). A decode
step is a chain of matrix-vector products bound by memory bandwidth, so one thread leaves
the other cores, and half the bandwidth, idle. Here each large linear (and a tied LM head)
splits its weight by output rows into `parts` pieces: the first runs on the caller's stream,
the others on helper streams (each MLX CPU stream is a thread of its own), and the pieces'
outputs are concatenated. Each output element is the same dot product as before, so the
result is the unsplit product's (tests/models/test_split_products.py).

Measured on the 2-core machine (docs/benchmarks.md, "Round 5"): a synced SmolLM2 decode step
21% faster at one row, 19-26% at 8-16 rows, prefill 8%.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn

# Below this a product is too short for a thread handoff to pay (576x576 fp32 is 1.3 MB).
MIN_WEIGHT_BYTES = 1 << 20

_local = threading.local()


def _helper_streams(n: int) -> list:
    """`n` CPU streams of the calling thread's own (MLX streams belong to their thread)."""
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = []
    while len(streams) < n:
        streams.append(mx.new_stream(mx.cpu))
    return streams[:n]


def _pieces(module, weight: mx.array, parts: int) -> list[mx.array]:
    """The weight's row blocks, as views of it; rebuilt if the weight array was replaced."""
    cached = module.__dict__.get("_mlxcel_pieces")
    if cached is not None and cached[0] is weight:
        return cached[1]
    bounds = [weight.shape[0] * i // parts for i in range(parts + 1)]
    pieces = [weight[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    mx.eval(pieces)
    module.__dict__["_mlxcel_pieces"] = (weight, pieces)
    return pieces


def split_product(module, x: mx.array, weight: mx.array, bias: mx.array | None, parts: int) -> mx.array:
    """x @ weight.T (+ bias) with the weight's row blocks on `parts` streams."""
    pieces = _pieces(module, weight, parts)
    if bias is not None:
        bounds = [p.shape[0] for p in pieces]
        starts = [sum(bounds[:i]) for i in range(parts)]
        biases = [bias[s:s + n] for s, n in zip(starts, bounds)]
    outs = []
    for i, (w, stream) in enumerate(zip(pieces, [None] + _helper_streams(parts - 1))):
        with mx.stream(stream) if stream is not None else nullcontext():
            # addmm keeps the bias inside the product, as nn.Linear does
            outs.append(x @ w.T if bias is None else mx.addmm(biases[i], x, w.T))
    return mx.concatenate(outs, axis=-1)


class SplitLinear(nn.Linear):
    def __call__(self, x):
        bias = self["bias"] if "bias" in self else None
        return split_product(self, x, self["weight"], bias, self._mlxcel_parts)


class SplitEmbedding(nn.Embedding):
    """A tied LM head: the embedding's as_linear is the largest product of a decode step."""

    def as_linear(self, x):
        return split_product(self, x, self.weight, None, self._mlxcel_parts)


def install(model: nn.Module, parts: int) -> int:
    """Split the model's large float linears and tied embeddings over `parts` threads; returns
    how many modules now split (0 when parts < 2). Quantized linears keep their own kernels."""
    if parts < 2:
        return 0
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.Linear and m.weight.nbytes >= MIN_WEIGHT_BYTES:
            m.__class__ = SplitLinear
        elif type(m) is nn.Embedding and m.weight.nbytes >= MIN_WEIGHT_BYTES:
            m.__class__ = SplitEmbedding
        else:
            continue
        object.__setattr__(m, "_mlxcel_parts", parts)
        n += 1
    return n
