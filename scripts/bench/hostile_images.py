"""Time and peak memory of refusing each hostile image (tests/hostile_images.py) on the image
path every route shares (api/media.gather: read, header checks, decode), one fresh process per
case so each peak is its own, after one small image has warmed the path (Pillow's plugins, the
worker thread). With `--url` (a served vision-language checkpoint) and `--pid` (its process),
each case is also sent to every route that takes images, timing each round trip and reading the
server's resident and peak memory after each case. Prints Markdown tables; the figures go in
docs/benchmarks.md.

    python -m scripts.bench.hostile_images [--url http://127.0.0.1:8080 --pid PID]
"""

from __future__ import annotations

import json
import subprocess
import sys

_CASE = r"""
import asyncio, base64, json, resource, sys, time
from types import SimpleNamespace
from mlxcel.api import media
from mlxcel.api.errors import ApiError
from tests import hostile_images as h
name = sys.argv[1]
data = h.big_accepted_png() if name == "largest-accepted" else h.HOSTILE[name][0]()
url = "data:image/png;base64," + base64.b64encode(data).decode()
vlm = SimpleNamespace(id="vlm", vision=SimpleNamespace(placeholder="<image>"))
pol = media.MediaPolicy(enabled=True, root=None, allow_private=False)
messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
from PIL import Image
Image.init()  # every plugin imported, as after the first unidentified image of a server
warm = "data:image/png;base64," + base64.b64encode(h.random_png(8)).decode()  # the worker thread, once
asyncio.run(media.gather(vlm, pol, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": warm}}]}]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    asyncio.run(media.gather(vlm, pol, messages))
    status = 200
except ApiError as e:
    status = e.status
dt = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"bytes": len(data), "status": status, "ms": dt * 1000, "peak_mib": after / 1024,
                  "added_mib": (after - before) / 1024}))
"""


ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/completion")


def _memory_mib(pid: int) -> tuple[float, float]:
    """(resident, peak resident) of process `pid`, from /proc."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def served(url: str, pid: int) -> None:
    import time

    import httpx

    from tests.e2e.test_vlm_images import _route_request
    from tests.hostile_images import HOSTILE

    for route in ROUTES:  # each route's first request, refused, outside the figures
        httpx.post(url + route, json=_route_request(route, HOSTILE["text-as-png"][0]())[1], timeout=60)
    rss, peak = _memory_mib(pid)
    print(f"\nserver after warm-up: RSS {rss:.0f} MiB, peak {peak:.0f} MiB\n")
    print("| case | statuses | round trip (ms) | server RSS (MiB) | server peak (MiB) |")
    print("|---|---|---|---|---|")
    for name, (build, _) in HOSTILE.items():
        data, times, statuses = build(), [], set()
        for route in ROUTES:
            t0 = time.perf_counter()
            statuses.add(httpx.post(url + route, json=_route_request(route, data)[1], timeout=60).status_code)
            times.append((time.perf_counter() - t0) * 1000)
        rss, peak = _memory_mib(pid)
        print(f"| {name} | {sorted(statuses)} | {min(times):.0f}-{max(times):.0f} | {rss:.0f} | {peak:.0f} |")


def main() -> None:
    import argparse

    from tests.hostile_images import HOSTILE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server with a vision-language checkpoint")
    ap.add_argument("--pid", type=int, help="that server's process id (for its memory)")
    args = ap.parse_args()

    print("| case | file bytes | status | time (ms) | peak RSS (MiB) | added over baseline (MiB) |")
    print("|---|---|---|---|---|---|")
    for name in [*HOSTILE, "largest-accepted"]:
        out = subprocess.run([sys.executable, "-c", _CASE, name], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['bytes']} | {r['status']} | {r['ms']:.1f} | {r['peak_mib']:.0f} | {r['added_mib']:.1f} |")
    if args.url:
        served(args.url.rstrip("/"), args.pid)


if __name__ == "__main__":
    main()
