"""Where one-row decode time goes on the torch backend: a torch.profiler table of the ops
(matmuls against everything else) and a cProfile of the Python around them, plus CPU seconds
per token (steadier than wall time on a shared machine). Prints text; not a test.

    python -m scripts.bench.torch_decode_profile -m DIR --dtype bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

MATMUL_OPS = ("mlxcel_cpu::rows_linear", "mlxcel_cpu::decode_attention", "aten::mm", "aten::mv", "aten::addmv_", "mkldnn::_linear_pointwise", "aten::addmm", "aten::bmm", "aten::matmul",
              "aten::linear", "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::scaled_dot_product_attention")
# op self time by what it serves in a decode step (ops not named here count as "other")
CATEGORIES = {
    "linears (mm/mv)": ("mlxcel_cpu::rows_linear", "aten::mm", "aten::mv", "aten::addmv_", "mkldnn::_linear_pointwise", "aten::addmm", "aten::linear",
                        "aten::matmul"),
    "attention (sdpa, kernel)": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                         "aten::_scaled_dot_product_attention_math", "mlxcel_cpu::decode_attention"),
    "KV scatter/gather": ("aten::index_copy_", "aten::index_select", "aten::narrow"),
    "norms, rope, activations": ("mlxcel_cpu::rms_norm", "mlxcel_cpu::rope", "aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt", "aten::silu",
                                 "aten::cat", "aten::neg", "aten::cos", "aten::sin", "aten::div_", "aten::sum",
                                 "aten::embedding"),
    "casts and copies": ("aten::to", "aten::_to_copy", "aten::copy_", "aten::contiguous", "aten::clone",
                         "aten::empty_strided", "aten::empty", "aten::zeros", "aten::masked_fill_", "aten::fill_"),
    "views (strides only)": ("aten::view", "aten::reshape", "aten::transpose", "aten::t", "aten::as_strided",
                             "aten::slice", "aten::_unsafe_view", "aten::unsqueeze", "aten::expand", "aten::select",
                             "aten::alias", "aten::detach"),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--timing-only", action="store_true", help="print the per-token times only")
    p.add_argument("--rows", type=int, default=25, help="rows of the cProfile table")
    p.add_argument("--variant", choices=("fused", "kernel", "gemv", "stock"), default="fused",
                   help="mlxcel's row kernel plus its fused norms, RoPE and decode attention (the server's CPU "
                        "bf16 default), the row kernel alone, one-row linears through torch.mv, or torch's "
                        "Linear.forward")
    args = p.parse_args()

    import torch

    from mlxcel.engine.backend import ForwardRow
    from mlxcel.config.settings import BackendSection, ServerSettings
    from mlxcel.runtime.load import load_backend

    settings = ServerSettings(backend=BackendSection(name="torch", device="cpu", dtype=args.dtype,
                                                     threads=args.threads))
    backend, _ = load_backend(settings, args.model)
    import os

    from mlxcel.backends.torch.row_gemv import load_row_kernel, remove_row_gemv

    backend.set_row_linears(load_row_kernel(os.environ) if args.variant in ("fused", "kernel") else None)
    if args.variant == "fused":
        backend.set_fused_ops(True)
    if args.variant == "stock":
        remove_row_gemv(backend.base, backend.lm_head)
    seq = backend.new_sequence()
    prompt = [(i * 37) % 1000 + 100 for i in range(128)]
    nxt = int(backend.forward([ForwardRow(prompt, seq)])[0].argmax())

    def step():
        nonlocal nxt
        nxt = int(backend.forward([ForwardRow([nxt], seq, decode=True)])[0].argmax())

    for _ in range(4):
        step()
    c, w = time.process_time(), time.perf_counter()
    for _ in range(args.steps):
        step()
    cpu, wall = (time.process_time() - c) / args.steps, (time.perf_counter() - w) / args.steps
    print(f"per token: {cpu * 1e3:.2f} ms CPU, {wall * 1e3:.2f} ms wall ({1 / wall:.1f} tok/s wall)")
    if args.timing_only:
        return

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        w = time.perf_counter()
        for _ in range(args.steps):
            step()
        profiled_wall = (time.perf_counter() - w) / args.steps
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    print(f"torch ops self time: {total / 1e3 / args.steps:.2f} ms/token, of which matmul/attention "
          f"{mm / 1e3 / args.steps:.2f} ms ({100 * mm / max(total, 1):.0f}%)")
    seen = {}
    for e in events:
        cat = next((c for c, ops in CATEGORIES.items() if e.key in ops), "other")
        seen[cat] = seen.get(cat, 0) + e.self_cpu_time_total
    for cat, us in sorted(seen.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:28s} {us / 1e3 / args.steps:7.2f} ms/token ({100 * us / max(total, 1):3.0f}%)")
    print(f"  {'(wall not in torch ops)':28s} {profiled_wall * 1e3 - total / 1e3 / args.steps:7.2f} ms/token of "
          f"{profiled_wall * 1e3:.2f} ms profiled wall: Python, dispatch, numpy, the argmax (the profiler adds "
          f"its own cost per op)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))

    prof2 = cProfile.Profile()
    prof2.enable()
    for _ in range(args.steps):
        step()
    prof2.disable()
    pstats.Stats(prof2).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
    main()
