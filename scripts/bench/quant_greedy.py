"""Greedy text of an MLX-quantized checkpoint, served packed, against the same weights dequantized.

Loads the checkpoint twice on the torch backend (CPU, fp32 activations): as served (packed
weights through kernels/cpu/quant_rows.cpp) and with every packed module replaced by a dense
fp32 one holding its dequantized weights (w = s * q + z, quantized.dequantize), the dense
row kernel then running its products. Both decode the 20 reference prompts of
tests/models/test_torch_parity.py greedily, each prompt alone (a prefill, then one decode row
per token). Prints how many continuations are identical and, for each that differs, the first
differing token with both models' top-2 logit margins there: the two sum in different orders,
so a near-tie may flip. Not a test.

    python -m scripts.bench.quant_greedy -m models/qbench/SmolLM2-135M-Instruct-Q4_1
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np


def densify(backend) -> None:
    """Replace every packed module of `backend.model` by a dense fp32 twin and reinstall the kernels."""
    import torch

    from mlxcel.backends.torch.quantized import QuantizedEmbedding, QuantizedLinear
    from mlxcel.backends.torch.row_gemv import load_row_kernel

    model = backend.model
    for name, m in list(model.named_modules()):
        if not isinstance(m, (QuantizedLinear, QuantizedEmbedding)):
            continue
        w = torch.nn.Parameter(m.dequantized() if isinstance(m, QuantizedLinear) else
                               _dequantized_rows(m), requires_grad=False)
        if isinstance(m, QuantizedEmbedding):
            if m.embed_scale is not None:
                raise SystemExit("a scaled embedding (Gemma): not handled here")
            dense = torch.nn.Embedding(*w.shape)
        else:
            dense = torch.nn.Linear(w.shape[1], w.shape[0], bias=m.bias is not None)
            if m.bias is not None:
                dense.bias = m.bias
        dense.weight = w
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, dense)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    backend.lm_head = model.get_output_embeddings()
    backend.set_row_linears(load_row_kernel(os.environ))
    backend.set_fused_ops(True)


def _dequantized_rows(m):
    import torch

    from mlxcel.backends.torch.quantized import dequantize

    return dequantize(m.weight, m.scales, m.biases, m.bits, m.group, torch.float32)


def greedy(backend, ids: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    from mlxcel.engine.backend import ForwardRow

    seq = backend.new_sequence()
    logits = backend.forward([ForwardRow(ids, seq)])[0]
    out, rows = [], []
    for _ in range(steps):
        rows.append(np.asarray(logits))
        out.append(int(logits.argmax()))
        logits = backend.forward([ForwardRow([out[-1]], seq, decode=True)])[0]
    seq.release()
    return out, rows


def margin(row: np.ndarray) -> float:
    top2 = np.sort(row)[-2:]
    return float(top2[1] - top2[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=None, help="greedy tokens per prompt (default: the test's)")
    args = p.parse_args()

    from mlxcel.backends.torch.backend import TorchBackend
    from mlxcel.engine.tokenizer import Tokenizer
    from tests.models.test_torch_parity import GREEDY_PROMPTS, GREEDY_TOKENS

    steps = args.tokens or GREEDY_TOKENS
    tok = Tokenizer(args.model)
    prompts = [tok.encode(t) for t in GREEDY_PROMPTS]
    packed = TorchBackend(args.model, dtype="float32", build_env=os.environ)
    print(f"packed: {packed.info.quantization}, {packed.row_kernel}")
    got = [greedy(packed, ids, steps) for ids in prompts]
    del packed
    dense = TorchBackend(args.model, dtype="float32", build_env=os.environ)
    densify(dense)
    want = [greedy(dense, ids, steps) for ids in prompts]
    same = 0
    for text, (a, arows), (b, brows) in zip(GREEDY_PROMPTS, got, want):
        if a == b:
            same += 1
            continue
        j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        print(f"{text!r}: first differs at token {j}: packed {tok.decode(a)!r} vs dense {tok.decode(b)!r}; "
              f"top-2 margin there: dense {margin(brows[j]):.3e}, packed {margin(arows[j]):.3e}")
    print(f"{same}/{len(GREEDY_PROMPTS)} greedy continuations ({steps} tokens) identical to the dequantized fp32 model's")


if __name__ == "__main__":
    main()
