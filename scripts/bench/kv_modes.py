"""KV storage modes against f16 on one checkpoint, straight through the backend interface (no
HTTP): bytes per token of context and the most slots x context a memory budget holds, prefill
and single-stream decode speed at each context length, and the quality of each quantized mode
against f16 (mean KL divergence of next-token distributions, teacher-forced over
tests/models/data/kv_quality_text.txt, and greedy agreement). Not a test. The modes run
interleaved, best of --repeats each, so a busy machine's noise falls on all of them. A mode is
"K" (keys and values alike) or "K,V". Prints JSON lines.

    python -m scripts.bench.kv_modes -m models/HuggingFaceTB/SmolLM2-135M-Instruct --backend torch \
        --modes f16 int8 turbo4 turbo3 turbo4,int8 --contexts 512 4096 16384
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parents[2] / "tests" / "models" / "data" / "kv_quality_text.txt"


def load(args, types):
    from mlxcel.config.settings import BackendSection, KvSection, ServerSettings
    from mlxcel.runtime.load import load_backend

    settings = ServerSettings(backend=BackendSection(name=args.backend, dtype=args.dtype, threads=args.threads,
                                                     build_env=dict(os.environ)),
                              kv=KvSection(cache_type_k=types.k, cache_type_v=types.v))
    return load_backend(settings, args.model)[0]


def speeds(backend, context: int, steps: int) -> tuple[float, float]:
    """(prefill tokens per second of a `context`-token prompt in 512-token chunks, decode
    tokens per second after it), one row."""
    from mlxcel.engine.backend import ForwardRow

    seq = backend.new_sequence()
    prompt = [(i * 37) % 1000 + 100 for i in range(context)]
    t0 = time.perf_counter()
    for s in range(0, context, 512):
        backend.forward_all(prompt[s:s + 512], seq)
    prefill = context / (time.perf_counter() - t0)
    token = 200
    backend.forward([ForwardRow([token], seq, decode=True)])  # warm
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(backend.forward([ForwardRow([token], seq, decode=True)])[0].argmax())
    dt = time.perf_counter() - t0
    seq.release()
    return prefill, steps / dt


def mode_types(mode: str):
    from mlxcel.engine.backend import KVCacheTypes

    k, _, v = mode.partition(",")
    return KVCacheTypes(k, v or k)


def teacher_forced(backend, ids: list[int]) -> np.ndarray:
    seq = backend.new_sequence()
    out = np.concatenate([backend.forward_all(ids[s:s + 256], seq) for s in range(0, len(ids), 256)])
    seq.release()
    return out


def quality(ref: np.ndarray, got: np.ndarray, decided_margin: float = 1.0) -> dict:
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = log_softmax(ref), log_softmax(got)
    top2 = np.sort(ref, -1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] >= decided_margin
    same = ref.argmax(-1) == got.argmax(-1)
    return {"positions": len(ref), "mean_kl": float((np.exp(p) * (p - q)).sum(-1).mean()),
            "greedy_agreement": float(same.mean()), "decided_positions": int(decided.sum()),
            "decided_agreement": float(same[decided].mean())}


def main() -> None:
    from mlxcel.engine.tokenizer import Tokenizer

    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--backend", default="torch", choices=("mlx", "torch"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=-1)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["f16", "int8"])
    p.add_argument("--skip-quality", action="store_true", help="speeds only")
    p.add_argument("--budget-gib", type=float, default=8.0, help="KV memory for the slots x context figure")
    args = p.parse_args()

    backends = {m: load(args, mode_types(m)) for m in args.modes}
    ids = Tokenizer(args.model).encode(TEXT.read_text())
    ref = None if args.skip_quality else teacher_forced(backends[args.modes[0]], ids)
    for mode, b in backends.items():
        per_token = b.kv_spec.bytes_per_token
        row = {"backend": args.backend, "dtype": b.info.dtype, "mode": mode, "bytes_per_token": per_token,
               f"tokens_in_{args.budget_gib:g}_gib": int(args.budget_gib * 2 ** 30 // per_token)}
        if ref is not None and mode != args.modes[0]:
            row.update(quality(ref, teacher_forced(b, ids)))
        print(json.dumps(row), flush=True)
    for context in args.contexts:
        best = {m: (0.0, 0.0) for m in args.modes}
        for _ in range(args.repeats):
            for mode, b in backends.items():
                got = speeds(b, context, args.steps)
                best[mode] = tuple(max(x, y) for x, y in zip(best[mode], got))
        print(json.dumps({"backend": args.backend, "context": context,
                          **{f"prefill_tok_s_{m}": round(v[0], 1) for m, v in best.items()},
                          **{f"decode_tok_s_{m}": round(v[1], 2) for m, v in best.items()}}), flush=True)


if __name__ == "__main__":
    main()
