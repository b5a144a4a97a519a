"""`mlxcel inspect`: a checkpoint's description, --check-tensors on copies of a tiny checkpoint
with a planted NaN / Inf and with a config whose shapes disagree with the weights, the server's
--check-tensors refusing such a copy, and --list-devices."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from mlxcel.store.tensor_scan import entries
from tests.conftest import REPO, fixture_path
from tests.fixtures import QWEN2_TINY, QWEN2_VL_TINY, models_dir


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxcel.cli.main", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "MLXCEL_MODELS_DIR": str(models_dir())}, timeout=300)


@pytest.fixture
def copy(tmp_path):
    dst = tmp_path / "qwen2-tiny"
    shutil.copytree(fixture_path(QWEN2_TINY), dst)
    return dst


def plant(path, value: float, name_part: str = "mlp.down_proj") -> str:
    """Write `value` over the first element of the first floating tensor whose name holds `name_part`."""
    entry = next(e for e in entries(path) if name_part in e.name and e.dtype in ("BF16", "F16", "F32"))
    raw = {"F32": struct.pack("<f", value), "F16": struct.pack("<e", value),
           "BF16": struct.pack("<f", value)[2:]}[entry.dtype]
    with entry.file.open("r+b") as fh:
        fh.seek(entry.start)
        fh.write(raw)
    return entry.name


def test_a_clean_checkpoint_is_described_and_passes(copy):
    done = run("inspect", str(copy), "--check-tensors")
    assert done.returncode == 0, done.stderr
    rows = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert rows["architecture"].startswith("qwen2") and rows["quantization"] == "none"
    assert rows["dtype"] and rows["parameters"]
    assert rows["tensors"].endswith("checked, ok")


@pytest.mark.parametrize(("value", "what"), [(float("nan"), "1 NaN"), (float("-inf"), "1 Inf")])
def test_check_tensors_finds_a_planted_bad_value(copy, value, what):
    name = plant(copy, value)
    done = run("inspect", str(copy), "--check-tensors")
    assert done.returncode == 1
    assert f"values: {name}: {what}" in done.stdout
    assert "1 problem(s)" in done.stdout


def test_check_tensors_finds_shapes_the_model_does_not_expect(copy):
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] += 8  # every MLP weight now disagrees with the model built from it
    (copy / "config.json").write_text(json.dumps(config))
    done = run("inspect", str(copy), "--check-tensors")
    assert done.returncode == 1
    shape = [line for line in done.stdout.splitlines() if line.startswith("shape: ")]
    assert shape and all("the model expects" in line for line in shape)
    assert any("mlp.down_proj.weight: shape (64, 128), the model expects (64, 136)" in line for line in shape)


def test_the_server_refuses_a_bad_checkpoint_under_check_tensors(copy):
    name = plant(copy, float("nan"))
    done = subprocess.run([sys.executable, "-m", "mlxcel.cli.server", "-m", str(copy), "--backend", "mlx",
                           "--check-tensors", "--offline"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --check-tensors:") and name in line


def test_list_devices_names_the_cpu_and_each_framework():
    done = run("inspect", "--list-devices")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cpu: ") and "SIMD:" in lines[0] and "available" in lines[0]
    assert any(line.startswith("cuda") for line in lines) and any(line.startswith("metal") for line in lines)
    server = subprocess.run([sys.executable, "-m", "mlxcel.cli.server", "--list-devices"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert server.returncode == 0 and server.stdout.splitlines()[0].startswith("cpu: ")


def test_a_family_mlx_does_not_build_has_its_values_checked_and_says_its_shapes_were_not():
    done = run("inspect", str(fixture_path(QWEN2_VL_TINY)), "--check-tensors")
    assert done.returncode == 0, done.stdout
    assert "shapes not checked: qwen2_vl is a vision-language checkpoint" in done.stdout
    assert done.stdout.splitlines()[-1].endswith("checked, ok")


def test_inspect_without_a_checkpoint_is_an_error():
    done = run("inspect")
    assert done.returncode == 1 and "name a checkpoint" in done.stderr
