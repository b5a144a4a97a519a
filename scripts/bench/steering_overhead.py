"""Steering overhead: decode tok/s at N concurrent clients with one SAE attached, steering
active vs unsteered, in one server run.

Not a test. Launches one mlxcel-server (or uses --url), attaches the trained SAE fixture,
then alternates phases: "unsteered" (the SAE attached, its steering values cleared) and
"steered" (live steering on --features features at --strength), each phase N clients
streaming greedy /v1/chat/completions. The phases alternate for --rounds rounds so drift on a
shared machine hits both alike. Decode tok/s of a phase = completion tokens after each
request's first token / (last finish - first first-token). Prints one JSON object with both
figures and steered / unsteered; the acceptance bar of issue 6 is a ratio of at least 0.90.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m scripts.bench.steering_overhead \\
        --models-dir /work/main/models

A tiny smoke run (seconds, not a measurement):
    python -m scripts.bench.steering_overhead --models-dir /work/main/models \\
        --concurrency 2 --rounds 1 --requests-per-client 1 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scripts.bench.serve_bench import MLXCEL_BOOT, PROMPTS

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SAE = "mlxcel-fixtures/sae-smollm2-l15-topk1024"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, state: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-c", MLXCEL_BOOT, "-m", str(args.models_dir / args.model), "--offline",
           "--host", "127.0.0.1", "--port", str(port), "-np", str(args.concurrency),
           "-c", str(args.concurrency * args.slot_ctx), "--state-dir", str(state), "--backend", args.backend]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.ready_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); log: {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the server was not ready after {args.ready_timeout}s; log: {log}")


def api(url: str, method: str, path: str, **kw) -> dict:
    r = httpx.request(method, url + "/api" + path, timeout=60, **kw)
    body = r.json()
    if not body.get("success"):
        raise RuntimeError(f"{method} /api{path}: {r.status_code} {body.get('error')}")
    return body["data"]


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(first token time, end time, completion tokens) of one streamed greedy chat."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    first, tokens = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return first or end, end, tokens


async def phase(url: str, concurrency: int, per_client: int, max_tokens: int) -> tuple[int, float]:
    """(decode tokens, decode seconds) of one phase: `concurrency` clients, back to back."""
    async with httpx.AsyncClient(timeout=600) as client:
        async def one_client(c: int):
            return [await stream_one(client, url, PROMPTS[(c + k) % len(PROMPTS)], max_tokens)
                    for k in range(per_client)]

        runs = [s for batch in await asyncio.gather(*(one_client(c) for c in range(concurrency))) for s in batch]
    decoded = sum(max(n - 1, 0) for _, _, n in runs)
    return decoded, max(end for _, end, _ in runs) - min(first for first, _, _ in runs)


def probe(url: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 16, "temperature": 0})
    return r.json()["choices"][0]["message"]["content"]


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc = None
        url = args.url
        if url is None:
            proc, url = launch(args, Path(tmp) / "state", Path(tmp) / "server.log")
        try:
            sae = api(url, "POST", "/saes/attach", json={"path": str(args.models_dir / args.sae),
                                                          "sae_id": "bench"})
            values = {str(i): args.strength for i in range(args.features)}
            modes = {"unsteered": lambda: api(url, "DELETE", "/saes/bench/steering"),
                     "steered": lambda: api(url, "PUT", "/saes/bench/steering", json={"values": values,
                                                                                      "replace": True})}
            texts = {}
            for name, set_mode in modes.items():  # warm both paths; check steering changes the output
                set_mode()
                texts[name] = probe(url)
            totals = {name: [0, 0.0] for name in modes}
            for r in range(args.rounds):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for name in order:
                    modes[name]()
                    tokens, seconds = asyncio.run(phase(url, args.concurrency, args.requests_per_client,
                                                        args.max_tokens))
                    totals[name][0] += tokens
                    totals[name][1] += seconds
            api(url, "DELETE", "/saes/bench")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    tok_s = {name: (t / s if s > 0 else 0.0) for name, (t, s) in totals.items()}
    return {"model": args.model, "sae": args.sae, "sae_layer": sae["layer"], "d_sae": sae["d_sae"],
            "concurrency": args.concurrency, "rounds": args.rounds, "requests_per_client": args.requests_per_client,
            "max_tokens": args.max_tokens, "steered_features": args.features, "strength": args.strength,
            "decode_tok_s": tok_s, "decode_tokens": {n: t for n, (t, _) in totals.items()},
            "ratio_steered_over_unsteered": tok_s["steered"] / tok_s["unsteered"] if tok_s["unsteered"] else None,
            "steering_changed_output": texts["steered"] != texts["unsteered"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models-dir", type=Path, default=Path("models"))
    p.add_argument("--model", default=MODEL, help="checkpoint under --models-dir")
    p.add_argument("--sae", default=SAE, help="SAELens directory under --models-dir")
    p.add_argument("--url", help="use a running mlxcel-server instead of launching one")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--features", type=int, default=8, help="steer features 0..N-1")
    p.add_argument("--strength", type=float, default=4.0)
    p.add_argument("--slot-ctx", type=int, default=1024, help="context per slot")
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--backend", default="auto", choices=("auto", "mlx", "torch"), help="the launched server's --backend")
    print(json.dumps(run(p.parse_args()), indent=2))


if __name__ == "__main__":
    main()
