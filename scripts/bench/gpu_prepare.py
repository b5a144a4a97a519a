"""Pack what the CUDA check needs into `.gpu/` (git-ignored), here, where the package index is
reachable: the lent GPU machine reaches nothing, runs Python 3.12 with its own CUDA torch and
transformers, and takes at most 64 MiB of files per call (the device tool's README).

    python -m scripts.bench.gpu_prepare     # then, through the device tool, carrying `.gpu`:
                                            #   bash scripts/bench/gpu_check.sh
.gpu/ (in .gitignore, so it travels only when a call carries it) holds
- wheels/: mlxcel's runtime and test requirements with what they need, for the target Python,
  minus the MLX packages (the torch path runs without them) and minus the large wheels that
  machine's image already has (DEVICE_HAS); pip there installs from this folder alone, keeping
  what is installed where it satisfies the requirement;
- requirements.txt: those requirements, transformers pinned to the version tested here;
- model/: the default model's config and tokenizer, without weights: gpu_check.sh builds a
  random-weight twin from them (scripts/fixtures/build_random_twin.py), since the real weights
  are larger than a call may carry.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from tests.fixtures import DEFAULT_MODEL, models_dir

REPO = Path(__file__).resolve().parents[2]
LIMIT_MIB = 64  # what one device call carries, the working tree included
# Wheels over 1 MB of packages the GPU image holds (the device tool's KINDS.md, 2026-11-17):
# left behind to stay under the limit. Where that machine's version does not satisfy a
# requirement, pip there fails by name and this list loses the entry.
DEVICE_HAS = ("numpy", "hf-xet", "tokenizers", "pygments")
MLX_ONLY = ("mlx", "mlx-lm", "mlx-cpu", "mlx-metal", "scipy-openblas32")
TEST_NEEDS = ("pytest", "pytest-timeout", "openai", "httpx")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
             "manylinux1_x86_64")


def requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def requirements() -> list[str]:
    """mlxcel's dependencies that the torch path and the smoke tests use, transformers pinned."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = [r for r in project["dependencies"] if requirement_name(r) not in MLX_ONLY]
    tests = [r for r in project["optional-dependencies"]["dev"] if requirement_name(r) in TEST_NEEDS]
    pinned = [f"transformers=={version('transformers')}" if requirement_name(r) == "transformers" else r
              for r in runtime]
    return pinned + tests


def wheel_name(path: Path) -> str:
    return path.name.split("-")[0].lower().replace("_", "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-version", default="3.12", help="the target machine's Python (default: the GPU image's)")
    ap.add_argument("--out", type=Path, default=REPO / ".gpu")
    a = ap.parse_args()

    out = a.out
    shutil.rmtree(out, ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    reqs = requirements()
    (out / "requirements.txt").write_text("\n".join(reqs) + "\n")
    tag = a.python_version.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", a.python_version,
           "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3", "--abi", "none",
           *[x for p in PLATFORMS for x in ("--platform", p)], "-d", str(out / "wheels"), *reqs]
    subprocess.run(cmd, check=True)
    for w in (out / "wheels").glob("*.whl"):
        if wheel_name(w) in DEVICE_HAS + MLX_ONLY:
            w.unlink()

    src = models_dir() / DEFAULT_MODEL
    if not (src / "config.json").is_file():
        raise SystemExit(f"{src}: the default model is missing; run `make fixtures` first")
    (out / "model").mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")) and f.name[0] != ".":
            shutil.copy2(f, out / "model" / f.name)

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((REPO / f.decode()).stat().st_size for f in tracked if f and (REPO / f.decode()).is_file())
    packed = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    total = (tree + packed) / 2**20
    print(f"{out}: {len(list((out / 'wheels').glob('*.whl')))} wheels, {packed / 2**20:.1f} MiB; "
          f"with the tracked tree {total:.1f} MiB of the {LIMIT_MIB} MiB a call carries")
    if total > LIMIT_MIB - 2:
        raise SystemExit("too large to carry: leave out more wheels the GPU image has (DEVICE_HAS)")


if __name__ == "__main__":
    main()
