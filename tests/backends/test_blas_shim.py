"""The OpenBLAS shim under MLX's CPU matmuls: the kernel against numpy, MLX through it, modes.

The kernel tests call the shim's cblas_* directly (loaded privately, so this process's MLX is
untouched) and compare with numpy in float64. The MLX test runs in a subprocess, because
the shim only takes effect when it is loaded before the first `import mlx.core`.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mlxcel.backends.mlx import blas

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS shim is for Linux")

ROW, COL = 101, 102
NO_T, T = 111, 112
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("blas-shim")


@pytest.fixture(scope="module")
def shim(shim_dir) -> ctypes.CDLL:
    try:
        openblas = blas.find_openblas()
        path = blas.build_shim(openblas, blas.find_compiler(os.environ), shim_dir)
    except blas.BlasUnavailable as e:
        pytest.skip(f"shim unavailable here: {e}")
    lib = ctypes.CDLL(str(path))  # RTLD_LOCAL: no interposition in this process
    lib.mlxcel_blas_shim_calls.restype = ctypes.c_ulong
    return lib


def _stored(rows: int, cols: int, ld: int, order: int, dtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """A rows x cols matrix inside a padded buffer with leading dimension ld."""
    def draw(shape):
        x = rng.standard_normal(shape)
        if np.issubdtype(dtype, np.complexfloating):
            x = x + 1j * rng.standard_normal(shape)
        return x.astype(dtype)
    if order == ROW:
        buf = draw((rows, ld))
        return buf, buf[:, :cols]
    buf = draw((cols, ld))  # column-major: column j is buf[j, :rows]
    return buf, buf[:, :rows].T


def _gemm_case(shim, fn, dtype, order, ta, tb, m, n, k, pad, alpha, beta, seed=0):
    rng = np.random.default_rng(seed)
    # op(A) is m x k; A as stored is k x m when transposed.
    a_rows, a_cols = (k, m) if ta == T else (m, k)
    b_rows, b_cols = (n, k) if tb == T else (k, n)
    lead = (lambda r, c: c) if order == ROW else (lambda r, c: r)
    lda, ldb, ldc = lead(a_rows, a_cols) + pad, lead(b_rows, b_cols) + pad, lead(m, n) + pad
    a_buf, a = _stored(a_rows, a_cols, lda, order, dtype, rng)
    b_buf, b = _stored(b_rows, b_cols, ldb, order, dtype, rng)
    c_buf, c = _stored(m, n, ldc, order, dtype, rng)
    if beta == 0:
        c_buf[...] = np.nan  # beta == 0 must ignore whatever C held
    c0 = c.astype(np.complex128 if np.iscomplexobj(c) else np.float64)
    op_a = a.T if ta == T else a
    op_b = b.T if tb == T else b
    want = alpha * (op_a.astype(c0.dtype) @ op_b.astype(c0.dtype))
    if beta != 0:
        want = want + beta * c0
    c_pad_before = c_buf.copy()

    ptr = lambda x: x.ctypes.data_as(ctypes.c_void_p)
    if np.iscomplexobj(c):
        al, be = np.array([alpha], dtype), np.array([beta], dtype)
        fn(order, ta, tb, m, n, k, ptr(al), ptr(a_buf), lda, ptr(b_buf), ldb, ptr(be), ptr(c_buf), ldc)
    else:
        scalar = ctypes.c_float if dtype == np.float32 else ctypes.c_double
        fn(order, ta, tb, m, n, k, scalar(alpha), ptr(a_buf), lda, ptr(b_buf), ldb, scalar(beta),
           ptr(c_buf), ldc)
    got = (c_buf[:, :n] if order == ROW else c_buf[:, :m].T)
    tol = 1e-4 if dtype in (np.float32, np.complex64) else 1e-10
    scale = max(1.0, float(np.abs(want).max()))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=tol * scale * np.sqrt(k), rtol=0)
    # The padding past each row (or column) of C belongs to the caller and must be untouched.
    pad_slice = (slice(None), slice(n if order == ROW else m, None))
    np.testing.assert_array_equal(c_buf[pad_slice], c_pad_before[pad_slice])


SHAPES = [(1, 48, 32), (1, 1, 32), (7, 1, 32), (8, 48, 32), (5, 3, 1)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("ta", [NO_T, T])
@pytest.mark.parametrize("tb", [NO_T, T])
@pytest.mark.parametrize("order", [ROW, COL])
def test_sgemm_matches_numpy(shim, order, ta, tb, m, n, k):
    for pad, alpha, beta in [(0, 1.0, 0.0), (3, 2.0, 0.5)]:
        _gemm_case(shim, shim.cblas_sgemm, np.float32, order, ta, tb, m, n, k, pad, alpha, beta)


def test_single_row_products_take_the_gemv_path(shim):
    before = shim.mlxcel_blas_shim_calls(3)
    _gemm_case(shim, shim.cblas_sgemm, np.float32, ROW, NO_T, T, 1, 48, 32, 0, 1.0, 0.0)
    _gemm_case(shim, shim.cblas_sgemm, np.float32, ROW, T, NO_T, 9, 1, 32, 2, 1.0, 0.0)
    assert shim.mlxcel_blas_shim_calls(3) == before + 2


@pytest.mark.parametrize("ta,tb", [(NO_T, NO_T), (T, T)])
@pytest.mark.parametrize("m,n,k", [(1, 20, 16), (6, 20, 16)])
def test_dgemm_and_cgemm_match_numpy(shim, ta, tb, m, n, k):
    _gemm_case(shim, shim.cblas_dgemm, np.float64, ROW, ta, tb, m, n, k, 2, 1.5, 0.0)
    _gemm_case(shim, shim.cblas_cgemm, np.complex64, ROW, ta, tb, m, n, k, 0, 1.0, 0.25)


MLX_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from mlxcel.backends.mlx import blas
    status = blas.ensure_fast_blas(dict(os.environ, MLXCEL_BLAS="openblas"))
    import mlx.core as mx
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    errs = {}
    def check(name, got, want):
        errs[name] = float(np.abs(np.array(got, dtype=want.dtype) - want).max() / max(1, np.abs(want).max()))
    w = rng.standard_normal((96, 64)).astype(np.float32)   # an nn.Linear weight, out x in
    for rows in (1, 2, 8, 33):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        check(f"linear_{rows}", mx.array(x) @ mx.array(w).T, x.astype(np.float64) @ w.T)
    x = rng.standard_normal((8, 96)).astype(np.float32)
    check("plain_8", mx.array(x) @ mx.array(w), x.astype(np.float64) @ w)
    check("col_1", mx.array(w) @ mx.array(x[0, :64])[:, None], w.astype(np.float64) @ x[0, :64, None])
    big = rng.standard_normal((40, 130)).astype(np.float32)
    sub = mx.array(big)[3:11, 5:69]                          # a strided view
    check("view_8", sub @ mx.array(w).T, big[3:11, 5:69].astype(np.float64) @ w.T)
    bat = rng.standard_normal((3, 4, 64)).astype(np.float32)
    check("batched", mx.array(bat) @ mx.array(w).T, bat.astype(np.float64) @ w.T)
    c = rng.standard_normal((8, 96)).astype(np.float32)
    x8 = rng.standard_normal((8, 64)).astype(np.float32)
    check("addmm", mx.addmm(mx.array(c), mx.array(x8), mx.array(w).T, alpha=2.0, beta=0.5),
          0.5 * c + 2.0 * (x8.astype(np.float64) @ w.T))
    xd = rng.standard_normal((5, 64))
    check("f64", mx.matmul(mx.array(xd, dtype=mx.float64), mx.array(w.astype(np.float64)).T, stream=mx.cpu),
          xd @ w.T.astype(np.float64))
    xc = (rng.standard_normal((4, 64)) + 1j * rng.standard_normal((4, 64))).astype(np.complex64)
    check("c64", mx.array(xc) @ mx.array(w.astype(np.complex64)).T, xc.astype(np.complex128) @ w.T)
    print(json.dumps({"active": status.active, "errs": errs, "calls": blas.shim_calls()}))
""")


def test_mlx_matmuls_through_the_shim_match_numpy(shim, shim_dir):
    env = dict(os.environ, MLXCEL_BLAS_CACHE=str(shim_dir))
    proc = subprocess.run([sys.executable, "-c", MLX_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["active"] is True
    bad = {k: v for k, v in out["errs"].items() if not v < 1e-4}
    assert not bad, out["errs"]
    calls = out["calls"]
    # Every kind of product reached the shim, and decode-shaped ones took the gemv path.
    assert calls["sgemm"] >= 9 and calls["sgemv_path"] >= 2, calls
    assert calls["dgemm"] >= 1 and calls["cgemm"] >= 1, calls


def test_bad_mode_is_refused():
    with pytest.raises(blas.BlasRefusal, match="MLXCEL_BLAS='fast'"):
        blas.ensure_fast_blas({"MLXCEL_BLAS": "fast"})


def test_reference_mode_and_other_platforms_leave_mlx_alone():
    assert not blas.ensure_fast_blas({"MLXCEL_BLAS": "reference"}).active
    assert not blas.ensure_fast_blas({}, platform="darwin").active
    with pytest.raises(blas.BlasRefusal, match="Linux only"):
        blas.ensure_fast_blas({"MLXCEL_BLAS": "openblas"}, platform="darwin")


def test_no_compiler_falls_back_in_auto_and_refuses_in_openblas_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(blas, "_loaded", {})  # the test session itself already loaded the shim
    env = {"PATH": str(tmp_path), "MLXCEL_BLAS_CACHE": str(tmp_path / "cache")}
    status = blas.ensure_fast_blas(env)
    assert not status.active and status.warn and "no C compiler" in status.detail
    with pytest.raises(blas.BlasRefusal, match="no C compiler"):
        blas.ensure_fast_blas(dict(env, MLXCEL_BLAS="openblas"))


def test_loading_after_mlx_core_is_refused(shim_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx.core", sys.modules.get("mlx.core", object()))
    with pytest.raises(blas.BlasUnavailable, match="imported before"):
        blas.load_shim(shim_dir / "unused.so", blas.OpenBLAS(Path("/nonexistent"), Path("/"), "0"))
