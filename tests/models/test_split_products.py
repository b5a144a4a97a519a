"""Large products split over CPU threads on MLX (backends/mlx/split_products.py, --threads).

Splitting a weight by output rows leaves every output element the same dot product, so a
split model must give the unsplit model's logits: prefills, decode steps of one and of three
rows, through the tied LM head, on SmolLM2 and gemma-3-270m. Tolerance 5e-4 absolute with the
same argmax, as for packed steps. Measured: prefills bit-identical; three-row steps differ by up
to 9.5e-5 (OpenBLAS blocks a few-row product's sum differently for a narrower weight).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, fixture_path

GEMMA = "google/gemma-3-270m"
TOL = 5e-4


def _pair(ref):
    from mlxcel.backends.mlx.backend import MLXBackend

    path = fixture_path(ref)
    return MLXBackend(path, dtype="float32", threads=1), MLXBackend(path, dtype="float32", threads=2)


def _steps(backend, prompts, decode=4):
    """Prefill each prompt alone, then decode all rows together (B > 1) and the first alone."""
    from mlxcel.engine.backend import ForwardRow

    seqs = [backend.new_sequence() for _ in prompts]
    out = [backend.forward([ForwardRow(p, s)]) for p, s in zip(prompts, seqs)]
    nxt = [int(o[0].argmax()) for o in out]
    for _ in range(decode):
        logits = backend.forward([ForwardRow([t], s) for t, s in zip(nxt, seqs)])
        out.append(logits)
        nxt = [int(row.argmax()) for row in logits]
    out.append(backend.forward([ForwardRow([nxt[0]], seqs[0])]))
    return out


@pytest.mark.parametrize("ref", [DEFAULT_MODEL, GEMMA])
def test_split_products_give_the_unsplit_logits(ref):
    from mlxcel.backends.mlx.split_products import SplitEmbedding, SplitLinear

    one, two = _pair(ref)
    assert one.split_modules == 0 and two.split_modules > 0
    kinds = {type(m) for _, m in two.model.named_modules()}
    assert SplitLinear in kinds and SplitEmbedding in kinds  # the MLPs and the tied LM head
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 5000, n).tolist() for n in (40, 7, 19)]
    a, b = _steps(one, prompts), _steps(two, prompts)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert float(np.abs(x - y).max()) <= TOL and (x.argmax(-1) == y.argmax(-1)).all()
    # the split path really ran: every split module holds its two row blocks
    split = [m for _, m in two.model.named_modules() if getattr(m, "_mlxcel_parts", 1) == 2]
    assert len(split) == two.split_modules
    assert all(len(m.__dict__["_mlxcel_pieces"][1]) == 2 for m in split)


def test_a_split_linear_with_bias_and_three_threads_matches_nn_linear():
    import mlx.core as mx
    import mlx.nn as nn

    from mlxcel.backends.mlx.split_products import MIN_WEIGHT_BYTES, install

    mx.random.seed(0)
    out_dim = MIN_WEIGHT_BYTES // (4 * 256) + 5  # just past the threshold, rows not divisible by 3
    ref, split = nn.Linear(256, out_dim, bias=True), nn.Linear(256, out_dim, bias=True)
    split.update(ref.parameters())
    small = nn.Linear(16, 16)
    model = nn.Sequential(split, small)
    assert install(model, 3) == 1 and small._mlxcel_parts == 1  # below the threshold: one thread
    x = mx.random.normal((2, 3, 16))
    assert float(mx.abs(small(x) - (x @ small.weight.T + small.bias)).max()) <= 1e-6
    for rows in (1, 5):
        x = mx.random.normal((rows, 256))
        want, got = ref(x), split(x)
        assert got.shape == want.shape == (rows, out_dim)
        assert float(mx.abs(got - want).max()) <= TOL
    # a weight replaced after install (a reload) is split afresh, not served from stale blocks
    split.weight = split.weight * 2
    assert float(mx.abs(split(x) - (x @ (ref.weight * 2).T + ref.bias)).max()) <= 1e-4
