"""Micro benchmark: MLX decode-step time at batch 1/4/8, with and without the OpenBLAS shim.

Not a test. Measures the raw model call `model(tokens[B, 1], cache=...)` over a plain
mlx-lm KV cache holding B rows of identical length (so no masks or padding are involved),
plus `mlx_lm.generate`'s own 64-token greedy completion in fp32 as the reference figure
that the server's single-stream decode is compared with.

Each BLAS mode runs in its own subprocess, because the shim only takes effect when loaded
before the first `import mlx.core`.

    python -m scripts.bench.mlx_forward_bench --model /work/main/models/HuggingFaceTB/SmolLM2-135M-Instruct

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, when set on the machine, slow OpenBLAS down; unset
them on the benchmark's command line (`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the weather, the sea, and what the message says.")


def measure(model_dir: str, batches: list[int], steps: int, context: int, gen_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    mx.set_default_device(mx.cpu)
    model, tokenizer = load(model_dir)
    model.set_dtype(mx.float32)
    out: dict = {"decode": {}}
    for b in batches:
        cache = make_prompt_cache(model)
        prompt = mx.array([[(7 * i + 11 * r) % 1000 + 100 for i in range(context)] for r in range(b)])
        mx.eval(model(prompt, cache=cache))
        tok = mx.array([[42]] * b)
        for _ in range(3):  # warm the kernels for this shape
            mx.eval(model(tok, cache=cache))
        t0 = time.perf_counter()
        for _ in range(steps):
            mx.eval(model(tok, cache=cache))
        dt = (time.perf_counter() - t0) / steps
        out["decode"][b] = {"step_ms": dt * 1e3, "tok_s": b / dt}

    # mlx_lm.generate's loop, greedy, fp32, wall time including prefill.
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    sampler = make_sampler(temp=0.0)
    for _ in stream_generate(model, tokenizer, ids, max_tokens=4, sampler=sampler):
        pass  # warm-up
    t0 = time.perf_counter()
    last = None
    for last in stream_generate(model, tokenizer, ids, max_tokens=gen_tokens, sampler=sampler):
        pass
    wall = time.perf_counter() - t0
    out["generate"] = {"prompt_tokens": last.prompt_tokens, "tokens": last.generation_tokens,
                       "prefill_tok_s": last.prompt_tps, "decode_tok_s": last.generation_tps,
                       "wall_tok_s": last.generation_tokens / wall}
    return out


def child(args) -> None:
    status = None
    if args.blas != "mlx-default":
        from mlxcel.backends.mlx.blas import ensure_fast_blas
        status = ensure_fast_blas({**os.environ, "MLXCEL_BLAS": args.blas})
    res = measure(args.model, args.batch, args.steps, args.context, args.gen_tokens)
    res["blas"] = status.detail if status else "mlx default"
    print("RESULT " + json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    ap.add_argument("--context", type=int, default=64, help="tokens already in each row's cache")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["reference", "openblas"],
                    choices=["reference", "openblas"])
    ap.add_argument("--blas", help=argparse.SUPPRESS)  # set in the child process
    args = ap.parse_args()
    if args.blas:
        child(args)
        return
    results = {}
    for mode in args.modes:
        cmd = [sys.executable, "-m", "scripts.bench.mlx_forward_bench", "--model", args.model,
               "--batch", *map(str, args.batch), "--steps", str(args.steps), "--context", str(args.context),
               "--gen-tokens", str(args.gen_tokens), "--blas", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"{mode} run failed:\n{proc.stderr[-2000:]}")
        results[mode] = json.loads(lines[-1][7:])
        print(f"[{mode}] {results[mode]['blas']}")
    print(f"\ndecode step, SmolLM-style raw forward, fp32, {args.context} cached tokens per row")
    print(f"{'B':>3} " + " ".join(f"{m + ' ms':>16} {m + ' tok/s':>18}" for m in results))
    for b in args.batch:
        row = " ".join(f"{results[m]['decode'][str(b)]['step_ms']:16.2f} {results[m]['decode'][str(b)]['tok_s']:18.1f}"
                       for m in results)
        print(f"{b:>3} {row}")
    for m, r in results.items():
        one = r["decode"][str(args.batch[0])]["tok_s"]
        print(f"[{m}] aggregate B={args.batch[-1]} / B={args.batch[0]}: "
              f"{r['decode'][str(args.batch[-1])]['tok_s'] / one:.2f}x")
    print("\nmlx_lm stream_generate, greedy, fp32")
    for m, r in results.items():
        g = r["generate"]
        print(f"[{m}] prompt {g['prompt_tokens']} tok, prefill {g['prefill_tok_s']:.1f} tok/s, "
              f"decode {g['decode_tok_s']:.1f} tok/s, {g['tokens']} tokens wall incl. prefill {g['wall_tok_s']:.1f} tok/s")


if __name__ == "__main__":
    main()
