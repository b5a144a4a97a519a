"""Single-stream decode with and without speculative decoding, A/B interleaved (not a test).

    MLXCEL_MODELS_DIR=models python -m scripts.bench.spec_bench [--backend mlx] [--rounds 3] [--tokens 64]

Runs one greedy completion at a time on the default model (SmolLM2-135M-Instruct): plain, then
SmolLM2 drafting for itself (draft-simple, n_max 3), then the random-weight json-tools-tiny
draft, then ngram-simple, round after round so machine noise spreads over every mode. Prints
decode tok/s (after the first token) and the acceptance counters.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.types import GenerationRequest
from tests.fixtures import DEFAULT_MODEL, JSON_TOOLS_TINY, fixture_path
from tests.models.test_engine import make_model
from tests.models.test_speculative import attach

PROMPT = ("Write the alphabet as a comma-separated list, then write it again: A, B, C, D, E, F, G, H, I, J, K, L, M, "
          "N, O, P, Q, R, S, T, U, V, W, X, Y, Z. Again:")


async def once(model, prompt, tokens):
    h = model.engine.submit(GenerationRequest(prompt=prompt, params=SamplingParams(temperature=0.0), max_tokens=tokens,
                                              ignore_eos=True, cache_prompt=False))
    last = None
    async for ev in h:
        last = ev
    return last.timings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="mlx")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.backend == "mlx":  # as the server does: MLX's CPU matmuls through OpenBLAS
        from mlxcel.backends.mlx.blas import ensure_fast_blas

        print(ensure_fast_blas(os.environ).detail)
    model = make_model(backend=args.backend, parallel=1, ctx_size=2048)
    prompt = model.tokenizer.encode(PROMPT)
    modes = {
        "plain": None,
        "self-draft n_max=3": ("draft-simple", fixture_path(DEFAULT_MODEL), {"n_max": 3}),
        "random-draft n_max=3": ("draft-simple", fixture_path(JSON_TOOLS_TINY), {"n_max": 3}),
        "ngram-simple n=3 m=8": ("ngram-simple", None, {"ngram_size_n": 3, "ngram_size_m": 8}),
    }
    speculators = {}
    for name, mode in modes.items():
        model.engine.speculator = None
        if mode is not None:
            attach(model, mode[0], mode[1], **mode[2])
        speculators[name] = model.engine.speculator
    results = {name: [] for name in modes}
    asyncio.run(once(model, prompt, 8))  # warm-up
    for _ in range(args.rounds):
        for name in modes:
            model.engine.speculator = speculators[name]
            results[name].append(asyncio.run(once(model, prompt, args.tokens)))
    model.engine.shutdown()
    for name, runs in results.items():
        rates = [(t.predicted_n - 1) / (t.predicted_ms / 1e3) for t in runs]
        t = runs[-1]
        acc = (f"accepted {t.draft_n_accepted}/{t.draft_n} in {t.draft_rounds} rounds"
               if t.draft_n is not None else "")
        print(f"{name:24s} decode {statistics.median(rates):6.1f} tok/s (runs {', '.join(f'{r:.1f}' for r in rates)}) "
              f"{acc}")


if __name__ == "__main__":
    main()
