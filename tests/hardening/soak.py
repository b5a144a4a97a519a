"""A soak: many concurrent clients with mixed routes against one loopback server, then a report.

Each client loops until the deadline, picking (from a seeded RNG) a streaming or plain request
on one of the generation routes, a side route, a stream it drops after a few frames (a client
disconnect), or a request it cancels while it runs. Every request that was neither dropped nor
cancelled must complete with a non-5xx status and a whole answer; afterwards every slot must be
idle, and the server's RSS must not have grown past a generous bound since the warm-up.
Used by test_soak.py (short) and scripts/hardening.py soak (long).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HI = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
RSS_GROWTH = 1.25  # end RSS / post-warm-up RSS: far above noise, far below a per-request leak
RSS_SLACK_MB = 64.0  # allocator slack on a small process
# The prompt cache's budget (--cache-ram, MiB). Its KV blocks become resident as the cache first
# fills them, long after the warm-up on a model with large KV rows (SmolLM2: 46 KB a token), so the
# end RSS may exceed the warm one by up to this much without a leak; kept small so a leak still shows.
PROMPT_CACHE_MIB = 256
# Tokens a request asks for when its client will drop or cancel it, and the grace after the soak
# for every slot to be idle: a row nobody stopped runs for many times the grace.
ABANDONED_TOKENS = 3000
IDLE_GRACE_S = 5.0


@dataclass
class Report:
    seconds: float
    clients: int
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # requests that should have completed and did not
    dropped: int = 0  # disconnects and cancellations, on purpose
    rss_warm_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_allowed_mb: float = 0.0  # growth the server may make by design (the prompt cache filling)
    busy_slots_after: list[int] = field(default_factory=list)

    def status_classes(self) -> dict[str, int]:
        out: Counter = Counter()
        for code, n in self.statuses.items():
            out[f"{code // 100}xx"] += n
        return dict(sorted(out.items()))

    def p(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        s = sorted(self.latencies)
        return s[min(len(s) - 1, int(q * len(s)))]

    def problems(self) -> list[str]:
        out = []
        if any(code >= 400 for code in self.statuses):  # every request the soak sends is valid
            out.append(f"error answers: {dict(self.statuses)}")
        if self.lost:
            out.append(f"{len(self.lost)} lost requests, e.g. {self.lost[:5]}")
        if self.busy_slots_after:
            out.append(f"slots still busy after the soak: {self.busy_slots_after}")
        if self.rss_end_mb > self.rss_warm_mb * RSS_GROWTH + RSS_SLACK_MB + self.rss_allowed_mb:
            out.append(f"RSS grew from {self.rss_warm_mb:.0f} MB to {self.rss_end_mb:.0f} MB")
        if sum(self.statuses.values()) == 0:
            out.append("no request completed")
        return out

    def ok(self) -> bool:
        return not self.problems()

    def summary(self) -> str:
        total = sum(self.statuses.values()) + len(self.lost) + self.dropped
        return "\n".join([
            f"soak: {self.seconds:.0f} s, {self.clients} clients, {total} requests "
            f"({sum(self.statuses.values())} answered, {self.dropped} dropped or cancelled on purpose, "
            f"{len(self.lost)} lost)",
            f"status classes: {self.status_classes()}   by kind: {dict(sorted(self.kinds.items()))}",
            f"latency (answered): p50 {self.p(0.5) * 1000:.0f} ms, p99 {self.p(0.99) * 1000:.0f} ms, "
            f"max {max(self.latencies, default=0) * 1000:.0f} ms",
            f"server RSS: {self.rss_warm_mb:.0f} MB after warm-up, {self.rss_end_mb:.0f} MB at the end",
            "result: " + ("ok" if self.ok() else "; ".join(self.problems())),
        ])


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` (Linux /proc, else ps)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout
    return int(out.strip() or 0) / 1024


# --- one request of each kind: True when it completed whole, raises when it failed ----------

def _stream_done(path: str, text: str) -> bool:
    if path == "/completion":
        return '"stop": true' in text or '"stop":true' in text
    if path == "/v1/messages":
        return "message_stop" in text
    if path == "/v1/responses":  # max_output_tokens reached ends it as incomplete, not failed
        return '"response.completed"' in text or '"response.incomplete"' in text
    return "data: [DONE]" in text


async def _plain(c: httpx.AsyncClient, path: str, body: dict, rep: Report) -> None:
    start = time.monotonic()
    r = await c.post(path, json=body)
    rep.statuses[r.status_code] += 1
    if r.status_code == 200:
        rep.latencies.append(time.monotonic() - start)
        r.json()  # a whole JSON document, or this raises and the request counts as lost


async def _stream(c: httpx.AsyncClient, path: str, body: dict, rep: Report, drop_after: int | None) -> None:
    start = time.monotonic()
    async with c.stream("POST", path, json={**body, "stream": True}) as r:
        chunks = []
        async for chunk in r.aiter_text():
            chunks.append(chunk)
            if drop_after is not None and len(chunks) >= drop_after:
                rep.dropped += 1
                return  # leaving the block closes the connection mid-stream: a client disconnect
        rep.statuses[r.status_code] += 1
        text = "".join(chunks)
        if r.status_code == 200:
            rep.latencies.append(time.monotonic() - start)
            if not _stream_done(path, text):
                rep.lost.append(f"{path} stream ended without its final frame: {text[-200:]!r}")


ROUTES = [("/v1/chat/completions", "chat"), ("/v1/completions", "prompt"), ("/completion", "native"),
          ("/v1/messages", "anthropic"), ("/v1/responses", "responses")]


_LENGTH = {"chat": "max_tokens", "prompt": "max_tokens", "native": "n_predict", "anthropic": "max_tokens",
           "responses": "max_output_tokens"}


def _body(shape: str, n: int) -> dict:
    """A request of `shape` for `n` tokens, with only the fields its route honours."""
    if shape in ("chat", "anthropic"):
        body = {"messages": HI}
    elif shape == "responses":
        body, n = {"input": "Tell me a story.", "store": False}, max(n, 16)  # the route's minimum
    else:
        body = {"prompt": "Once upon a time"}
    return {**body, _LENGTH[shape]: n}


async def _one(c: httpx.AsyncClient, rng: random.Random, rep: Report) -> None:
    roll = rng.random()
    path, shape = rng.choice(ROUTES)
    body = _body(shape, rng.randint(1, 24))
    # far longer than the soak's grace for idle slots: a row left running after its client went is seen
    longer = _body(shape, ABANDONED_TOKENS)
    if roll < 0.10:
        rep.kinds["side"] += 1
        side = rng.choice([("GET", "/health", None), ("GET", "/slots", None), ("GET", "/v1/models", None),
                           ("POST", "/tokenize", {"content": "hello world"})])
        r = await c.request(side[0], side[1], json=side[2])
        rep.statuses[r.status_code] += 1
    elif roll < 0.20:
        rep.kinds["disconnect"] += 1
        await _stream(c, path, longer, rep, drop_after=rng.randint(1, 3))
    elif roll < 0.30:
        rep.kinds["cancel"] += 1
        task = asyncio.ensure_future(_plain(c, path, longer, rep))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        if task.done():
            task.result()
        else:
            task.cancel()  # the client abandons the request: the connection closes under the server
            rep.dropped += 1
            await asyncio.gather(task, return_exceptions=True)
    elif roll < 0.65:
        rep.kinds["stream"] += 1
        await _stream(c, path, body, rep, drop_after=None)
    else:
        rep.kinds["plain"] += 1
        await _plain(c, path, body, rep)


async def _client(base_url: str, seed: int, deadline: float, rep: Report) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
        while time.monotonic() < deadline:
            try:
                await _one(c, rng, rep)
            except (httpx.HTTPError, ValueError) as e:  # a request that should have completed did not
                rep.lost.append(f"{type(e).__name__}: {e}"[:300])


async def _idle_slots(base_url: str, wait_s: float) -> list[int]:
    """Ids of slots still processing once `wait_s` has passed (polled: a dropped stream's
    row may take a token or two to notice its client is gone)."""
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as c:
        while True:
            busy = [s["id"] for s in (await c.get("/slots")).json() if s.get("is_processing")]
            if not busy or time.monotonic() > deadline:
                return busy
            await asyncio.sleep(0.25)


async def run_soak(base_url: str, pid: int, seconds: float, clients: int, warmup_s: float) -> Report:
    rep = Report(seconds=seconds, clients=clients, rss_allowed_mb=PROMPT_CACHE_MIB)
    warm = Report(seconds=warmup_s, clients=clients)  # the warm-up's answers are not counted
    end = time.monotonic() + warmup_s
    await asyncio.gather(*[_client(base_url, 1000 + i, end, warm) for i in range(clients)])
    rep.lost += warm.lost
    rep.statuses.update({k: v for k, v in warm.statuses.items() if k >= 500})
    await _idle_slots(base_url, 60)  # the warm-up's abandoned rows: a failure shows in the soak's check
    rep.rss_warm_mb = rss_mb(pid)
    end = time.monotonic() + seconds
    await asyncio.gather(*[_client(base_url, i, end, rep) for i in range(clients)])
    rep.busy_slots_after = await _idle_slots(base_url, IDLE_GRACE_S)
    rep.rss_end_mb = rss_mb(pid)
    return rep


# 4096 tokens per slot: room for an abandoned request's ABANDONED_TOKENS after its prompt
SERVER_ARGS = ["-np", "4", "-c", "16384", "--max-queue-depth", "64", "--cache-ram", str(PROMPT_CACHE_MIB)]


def soak_report(seconds: float, clients: int, warmup_s: float | None = None, model: str | None = None) -> Report:
    """Start the soak's own server (`model` from the fixture store, qwen2-tiny by default), soak
    it, stop it; the report."""
    from tests.conftest import ServerProcess, fixture_path
    from tests.fixtures import QWEN2_TINY

    model = model or QWEN2_TINY
    fixture_path(model)
    server = ServerProcess(["-m", model, "--offline", *SERVER_ARGS])
    try:
        warm = warmup_s if warmup_s is not None else min(30.0, max(5.0, seconds / 10))
        return asyncio.run(run_soak(server.base_url, server.proc.pid, seconds, clients, warm))
    finally:
        server.stop()


if __name__ == "__main__":
    print(soak_report(float(sys.argv[1]) if len(sys.argv) > 1 else 30, 16).summary())
