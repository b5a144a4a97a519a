"""Time and peak memory of refusing each hostile image (tests/hostile_images.py) on the image
path every route shares (api/media.gather: read, header checks, decode), one fresh process per
case so each peak is its own, after one small image has warmed the path (Pillow's plugins, the
worker thread). Prints a Markdown table; the figures go in docs/benchmarks.md.

    python -m scripts.measure_hostile_images
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


def main() -> None:
    from tests.hostile_images import HOSTILE

    print("| case | file bytes | status | time (ms) | peak RSS (MiB) | added over baseline (MiB) |")
    print("|---|---|---|---|---|---|")
    for name in [*HOSTILE, "largest-accepted"]:
        out = subprocess.run([sys.executable, "-c", _CASE, name], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['bytes']} | {r['status']} | {r['ms']:.1f} | {r['peak_mib']:.0f} | {r['added_mib']:.1f} |")


if __name__ == "__main__":
    main()
