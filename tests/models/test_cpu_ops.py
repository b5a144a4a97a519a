"""Leaner CPU graphs for RoPE and RMSNorm (backends/mlx/cpu_ops.py).

They must give MLX's own CPU results bit for bit: the modules alone over every offset form a
step passes (one int, one per row, one per packed token) and partial rotations, tolerance 0.
The whole served model is held to mlx-lm's own model and cache at 1e-4 with the same argmax:
gemma-3-270m matches exactly, SmolLM2 differs by up to 5.1e-5 with or without these modules
(its paged attention reads keys in another memory layout than mlx-lm's cache). And they must
really be leaner: a decode step computes its cos/sin once, not once per layer.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, fixture_path

GEMMA = "google/gemma-3-270m"


def _ops(*arrays) -> list[str]:
    import mlx.core as mx

    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    return re.findall(r'label ="([A-Za-z]+)', f.getvalue())


def test_table_rope_and_compiled_rms_norm_give_the_fast_ops_bits():
    import mlx.core as mx
    import mlx.nn as nn

    from mlxcel.backends.mlx.cpu_ops import CompiledRMSNorm, TableRoPE

    mx.random.seed(1)
    for dims, width, base, scale in ((64, 64, 100000.0, 1.0), (32, 64, 10000.0, 0.25)):
        ref = nn.RoPE(dims, base=base, scale=scale)
        lean = nn.RoPE(dims, base=base, scale=scale)
        lean.__class__ = TableRoPE
        cases = [((1, 9, 1, width), 57), ((1, 9, 7, width), 3),  # one row: an int offset
                 ((3, 3, 1, width), mx.array([5, 9, 700], mx.int32)),  # a batch: one per row
                 ((1, 9, 5, width), mx.array([4], mx.int32)),
                 ((6, 9, 1, width), mx.arange(6, dtype=mx.int32) * 50)]  # packed: one per token
        for shape, offset in cases:
            for dtype in (mx.float32, mx.bfloat16):
                x = mx.random.normal(shape).astype(dtype)
                for _ in range(2):  # the second call reuses the step's tables
                    diff = (ref(x, offset=offset) - lean(x, offset=offset)).astype(mx.float32)
                    assert float(mx.abs(diff).max()) == 0.0
    norm = nn.RMSNorm(576, eps=1e-5)
    norm.weight = mx.random.normal((576,))
    lean_norm = nn.RMSNorm(576, eps=1e-5)
    lean_norm.weight = norm.weight
    lean_norm.__class__ = CompiledRMSNorm
    for shape in ((1, 1, 576), (1, 7, 576), (4, 1, 576), (1, 300, 576)):  # one compiled graph, any shape
        x = mx.random.normal(shape) * 3
        assert float(mx.abs(norm(x) - lean_norm(x)).max()) == 0.0


@pytest.mark.parametrize("ref", [DEFAULT_MODEL, GEMMA])
def test_the_served_model_gives_mlx_lms_logits(ref):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from mlxcel.engine.backend import ForwardRow
    from mlxcel.backends.mlx.backend import MLXBackend

    path = fixture_path(ref)
    backend = MLXBackend(path, dtype="float32", threads=1)  # split products are test_split_products'
    plain, _ = load_model(path)
    plain.set_dtype(mx.float32)
    cache = make_prompt_cache(plain)
    prompt = np.random.default_rng(5).integers(100, 5000, 30).tolist()
    seq = backend.new_sequence()
    ours = backend.forward([ForwardRow(prompt, seq)])[0]
    theirs = np.array(plain(mx.array([prompt]), cache=cache)[0, -1])
    for _ in range(4):
        assert float(np.abs(ours - theirs).max()) <= 1e-4 and ours.argmax() == theirs.argmax()
        tok = int(ours.argmax())
        ours = backend.forward([ForwardRow([tok], seq)])[0]
        theirs = np.array(plain(mx.array([[tok]]), cache=cache)[0, -1])


def test_a_decode_step_computes_its_rotation_tables_once():
    import mlx.core as mx

    from mlxcel.engine.backend import ForwardRow
    from mlxcel.backends.mlx.backend import MLXBackend

    backend = MLXBackend(fixture_path(DEFAULT_MODEL), dtype="float32", threads=1)
    seq = backend.new_sequence()
    backend.forward([ForwardRow(list(range(100, 120)), seq)])
    logits, _ = backend._run([ForwardRow([7], seq)])
    ops = _ops(logits)
    assert backend.info.num_layers > 1 and ops.count("Cos") == 1 and ops.count("Sin") == 1
    mx.eval(logits, *backend.storage.arrays())
