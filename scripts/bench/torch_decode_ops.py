"""One call of each fused decode op (kernels/cpu/decode_ops.cpp) against what it replaces, at
a one-token decode step's shapes (SmolLM2-135M: hidden 576, 9 query heads, 3 KV heads, head
size 64, bf16): the family's RMSNorm module, `apply_rotary_pos_emb`, and transformers' SDPA
call over a gathered history of L keys. The two sides alternate for several rounds; prints the
median microseconds per call. Prints text; not a test.

    python -m scripts.bench.torch_decode_ops --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--lengths", type=int, nargs="+", default=[150, 600, 2000])
    args = p.parse_args()

    import types

    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from mlxcel.backends.torch import cpu_kernels, fused_ops

    torch.set_num_threads(args.threads)
    cpu_kernels.load(os.environ, args.threads)
    ops = torch.ops.mlxcel_cpu
    dt = torch.bfloat16
    x = torch.randn(1, 1, 576).to(dt)
    norm = LlamaRMSNorm(576).to(dt)
    q4, k4 = torch.randn(1, 1, 9, 64).to(dt), torch.randn(1, 1, 3, 64).to(dt)
    q, k = q4.transpose(1, 2), k4.transpose(1, 2)
    cos, sin = torch.randn(1, 1, 64).to(dt), torch.randn(1, 1, 64).to(dt)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False, sliding_window=None)
    cases = {
        "RMSNorm": (lambda: norm(x), lambda: ops.rms_norm(x, norm.weight, 1e-5, False)),
        "RoPE (q and k)": (lambda: apply_rotary_pos_emb(q, k, cos, sin),
                           lambda: fused_ops._fused_rope(apply_rotary_pos_emb, q, k, cos, sin)),
    }
    slots = max(args.lengths) + 64
    keys, values = torch.randn(slots, 3, 64).to(dt), torch.randn(slots, 3, 64).to(dt)
    for n in args.lengths:
        table = torch.randperm(slots)[:n][None]  # a paged history: scattered slots
        lengths = torch.tensor([n])
        mask = torch.zeros(1, 1, 1, n, dtype=dt)

        def sdpa(table=table, mask=mask):  # the padded step's path: gather, then SDPA
            kk = keys.index_select(0, table[0]).unsqueeze(0).transpose(1, 2)
            vv = values.index_select(0, table[0]).unsqueeze(0).transpose(1, 2)
            return sdpa_attention_forward(module, q, kk, vv, mask, scaling=0.125)

        def kernel(table=table, lengths=lengths):
            return fused_ops.decode_attention(module, q[:, :, 0], keys, values, table, lengths, 0.125)

        cases[f"attention, L={n}"] = (sdpa, kernel)
    results = {name: ([], []) for name in cases}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (ref, fused) in cases.items():
                results[name][0].append(per_call_us(ref, args.calls))
                results[name][1].append(per_call_us(fused, args.calls))
    print(f"{'op':22s} {'family / SDPA':>14s} {'fused':>8s}  (us per call, median of {args.rounds})")
    for name, (ref, fused) in results.items():
        a, b = statistics.median(ref), statistics.median(fused)
        print(f"{name:22s} {a:14.1f} {b:8.1f}  {a / b:4.1f}x")


if __name__ == "__main__":
    main()
