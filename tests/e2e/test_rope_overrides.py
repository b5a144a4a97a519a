"""RoPE overrides reach the real MLX families: the flags through the real parser, the model
through the real loader, logits read back. The control arm (--rope-freq-base equal to the
checkpoint's rope_theta) must be identical: that separates "the override moved the rotation"
from "the override plumbing perturbs the model"."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxcel.cli.flags import parse_server_args
from mlxcel.runtime.load import load_backend
from tests.conftest import fixture_path
from tests.fixtures import QWEN2_TINY, QWEN3_TINY

PROMPT = list(range(100, 164))


def logits(ref: str, *argv: str, backend: str = "mlx") -> np.ndarray:
    path = fixture_path(ref)
    settings = parse_server_args(["-m", str(path), "--backend", backend, *argv], {})
    backend, _ = load_backend(settings, path)
    seq = backend.new_sequence()
    out = backend.forward_all(PROMPT, seq)
    seq.release()
    return out


@pytest.mark.parametrize(("ref", "backend"), [(QWEN2_TINY, "mlx"), (QWEN3_TINY, "mlx"), (QWEN2_TINY, "torch")])
def test_overrides_move_the_rotation_and_the_control_does_not(ref, backend):
    theta = json.loads((fixture_path(ref) / "config.json").read_text())["rope_parameters"]["rope_theta"]
    base = logits(ref, backend=backend)
    assert np.array_equal(logits(ref, "--rope-freq-base", str(theta), backend=backend), base)
    for argv in (["--rope-freq-base", "10000"], ["--rope-scale", "4"], ["--rope-scaling", "yarn", "--rope-scale", "4"]):
        moved = logits(ref, *argv, backend=backend)
        assert np.array_equal(moved[0], base[0]), argv  # position 0 is not rotated
        assert not np.allclose(moved[-1], base[-1]), argv
