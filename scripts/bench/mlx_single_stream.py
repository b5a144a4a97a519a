"""Benchmark: MLX single-stream decode, mlxcel's engine against `mlx_lm.generate`.

Not a test. One process, the OpenBLAS shim active (as the server runs), fp32, the same
checkpoint for both sides, a 64-token greedy completion of the same chat prompt. Each round
runs, interleaved so machine noise hits every variant alike:

  generate   mlx_lm.stream_generate (the reference: it queues step t+1 before reading step t)
  forward    mlxcel's MLX backend alone: `backend.forward` over its paged KV at B=1, one
             synced step per token, host argmax (the engine's plain path without the engine)
  plain      Engine.submit + iterate with decode pipelining off (sync every step)
  pipelined  Engine.submit + iterate with decode pipelining on (engine/decode_pipeline.py)
  http       the same prompt ids through a launched mlxcel-server (--backend mlx, -np 1, shim on):
             a streamed native /completion, n_predict 64, ignore_eos (the engine's default
             pipelining choice for the device)

Each figure is wall tokens/s over the whole request (prefill included, like the
"1-stream wall tok/s" of serve_bench); medians over the rounds, and the engine's ratio to
generate. The engine variants also check that their token ids match each other.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python -m scripts.bench.mlx_single_stream \\
        --model models/HuggingFaceTB/SmolLM2-135M-Instruct --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the weather, the sea, and what the message says.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["generate", "forward", "plain", "pipelined", "http"])
    ap.add_argument("--port", type=int, default=18190, help="the launched server's port (http variant)")
    a = ap.parse_args()

    from mlxcel.backends.mlx.blas import ensure_fast_blas  # before anything imports mlx.core

    print(ensure_fast_blas(os.environ).detail, flush=True)
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlxcel.engine.backend import ForwardRow
    from mlxcel.config.settings import BackendSection, EngineSection, ServerSettings, SourceSection
    from mlxcel.engine.sampling_params import SamplingParams
    from mlxcel.engine.types import GenerationRequest
    from mlxcel.runtime.load import load_served_model

    mx.set_default_device(mx.cpu)
    ref_model, ref_tok = load(a.model)
    ref_model.set_dtype(mx.float32)
    ids = ref_tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    sampler = make_sampler(temp=0.0)

    served = load_served_model(ServerSettings(source=SourceSection(model=a.model),
                                              engine=EngineSection(ctx_size=4096, parallel=1, warmup=False),
                                              backend=BackendSection(name="mlx")), Path(a.model))
    engine, backend = served.engine, served.engine.backend
    greedy = SamplingParams(temperature=0.0)

    def generate() -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = [r.token for r in stream_generate(ref_model, ref_tok, ids, max_tokens=a.tokens, sampler=sampler)]
        return len(out) / (time.perf_counter() - t0), out

    def forward() -> tuple[float, list[int]]:
        seq = backend.new_sequence()
        t0 = time.perf_counter()
        logits = backend.forward([ForwardRow(list(ids), seq)])
        out = [int(np.argmax(logits[0]))]
        while len(out) < a.tokens:
            logits = backend.forward([ForwardRow([out[-1]], seq, decode=True)])
            out.append(int(np.argmax(logits[0])))
        dt = time.perf_counter() - t0
        seq.release()
        return len(out) / dt, out

    def run_engine(pipelined: bool) -> tuple[float, list[int]]:
        engine.pipeline_decode = pipelined

        async def go():
            # cache_prompt off: every round prefills cold, as generate does
            h = engine.submit(GenerationRequest(prompt=list(ids), params=greedy, max_tokens=a.tokens,
                                                cache_prompt=False, ignore_eos=True))
            return [ev.token async for ev in h if ev.token is not None]

        t0 = time.perf_counter()
        out = asyncio.run(go())
        return len(out) / (time.perf_counter() - t0), out

    server = launch_server(a) if "http" in a.variants else None

    def http() -> tuple[float, list[int]]:
        import httpx

        body = {"prompt": list(ids), "n_predict": a.tokens, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": False, "stream": True}
        n = 0
        t0 = time.perf_counter()
        with httpx.stream("POST", f"http://127.0.0.1:{a.port}/completion", json=body, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    ev = json.loads(line[5:])
                    n = ev.get("tokens_predicted", n) if ev.get("stop") else n + 1
        return n / (time.perf_counter() - t0), []

    variants = {"http": http, "generate": generate, "forward": forward,
                "plain": lambda: run_engine(False), "pipelined": lambda: run_engine(True)}
    chosen = [v for v in a.variants if v in variants]
    for v in chosen:  # warm-up: kernels, caches, the shim
        variants[v]()
    rates: dict[str, list[float]] = {v: [] for v in chosen}
    tokens: dict[str, list[int]] = {}
    for r in range(a.rounds):
        order = chosen if r % 2 == 0 else chosen[::-1]
        for v in order:
            rate, toks = variants[v]()
            rates[v].append(rate)
            tokens[v] = toks
        print(f"round {r + 1}: " + "  ".join(f"{v} {rates[v][-1]:.2f}" for v in chosen), flush=True)
    engine.shutdown()
    if server is not None:
        server.terminate()
        server.wait(timeout=30)

    med = {v: statistics.median(x) for v, x in rates.items()}
    print(f"\nmedian wall tok/s over {a.rounds} rounds, {a.tokens}-token greedy completion (prompt {len(ids)} tokens):")
    for v in chosen:
        ms = 1e3 / med[v]
        ratio = f"  {med[v] / med['generate']:.3f}x generate" if "generate" in med and v != "generate" else ""
        print(f"  {v:10s} {med[v]:7.2f} tok/s  {ms:6.1f} ms/token{ratio}")
    engine_runs = [tokens[v] for v in ("forward", "plain", "pipelined") if v in tokens]
    if len(engine_runs) > 1:
        print("engine variants' tokens identical:", all(t == engine_runs[0] for t in engine_runs))


def launch_server(a) -> subprocess.Popen:
    """mlxcel-server on the checkpoint (its store is the checkpoint's grandparent folder)."""
    import httpx

    from scripts.bench.serve_bench import MLXCEL_BOOT

    ckpt = Path(a.model).resolve()
    env = dict(os.environ, MLXCEL_MODELS_DIR=str(ckpt.parents[1]))
    cmd = [sys.executable, "-c", MLXCEL_BOOT, "-m", "/".join(ckpt.parts[-2:]), "--offline", "--host",
           "127.0.0.1", "--port", str(a.port), "--backend", "mlx", "-np", "1", "-c", "4096"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"mlxcel-server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{a.port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("mlxcel-server did not become ready")


if __name__ == "__main__":
    main()
