"""Pooling kernels and every --embd-normalize value against hand-computed arithmetic."""

import numpy as np
import pytest

from mlxcel.workers.vectors import normalize, pool

V = np.array([3.0, -4.0, 0.5, 0.0], dtype=np.float32)


@pytest.mark.parametrize("mode, expected", [
    (-1, [3.0, -4.0, 0.5, 0.0]),                                   # none
    (0, [3.0 * 32760 / 4, -32760.0, 0.5 * 32760 / 4, 0.0]),        # max-abs into int16 range
    (1, [3.0 / 7.5, -4.0 / 7.5, 0.5 / 7.5, 0.0]),                  # taxicab: |3|+|4|+|0.5|
    (2, [3.0 / 25.25 ** 0.5, -4.0 / 25.25 ** 0.5, 0.5 / 25.25 ** 0.5, 0.0]),  # euclidean
    (3, [x / (27 + 64 + 0.125) ** (1 / 3) for x in (3.0, -4.0, 0.5, 0.0)]),  # p-norm, p = 3
])
def test_normalize_domain(mode, expected):
    np.testing.assert_allclose(normalize(V, mode), np.array(expected, dtype=np.float32), rtol=1e-6)


@pytest.mark.parametrize("mode", [-1, 0, 1, 2, 3, 7])
def test_zero_vector_stays_zeros(mode):
    out = normalize(np.zeros(5, dtype=np.float32), mode)
    assert np.isfinite(out).all() and not out.any()


def test_pooling_kernels_respect_the_mask():
    hidden = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)  # [B=2, T=3, H=2]
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    np.testing.assert_allclose(pool(hidden, mask, "mean"), [[2.0, 3.0], [7.0, 8.0]])
    np.testing.assert_allclose(pool(hidden, mask, "cls"), [[0.0, 1.0], [6.0, 7.0]])
    np.testing.assert_allclose(pool(hidden, mask, "last"), [[4.0, 5.0], [8.0, 9.0]])
    np.testing.assert_allclose(pool(hidden, mask, "max"), [[4.0, 5.0], [8.0, 9.0]])
    with pytest.raises(ValueError):
        pool(hidden, mask, "none")
