/* The three CBLAS entry points that MLX's CPU backend calls (cblas_sgemm, cblas_dgemm,
 * cblas_cgemm), forwarded to OpenBLAS from the scipy-openblas32 wheel, whose symbols carry
 * a prefix (OB_PREFIX, e.g. scipy_) and so never clash with the reference BLAS that MLX's
 * Linux wheel links. Loaded into the global symbol scope before libmlx.so, these
 * definitions win over the reference ones; see mlxcel/backends/mlx/blas.py.
 *
 * Row-major single-row or single-column float products go to sgemv: a decode step is
 * M == 1, and OpenBLAS's sgemm pays packing costs that its sgemv does not.
 *
 * Integers are 32-bit (CBLAS_INT of the reference CBLAS, blasint of scipy-openblas32).
 */
#include <string.h>

#ifndef OB_PREFIX
#error "build with -DOB_PREFIX=<symbol prefix of the OpenBLAS library>"
#endif
#define OB_CAT2(a, b) a##b
#define OB_CAT(a, b) OB_CAT2(a, b)
#define OB(name) OB_CAT(OB_PREFIX, name)

enum { ROW_MAJOR = 101, COL_MAJOR = 102 };
enum { NO_TRANS = 111, TRANS = 112, CONJ_TRANS = 113 };

void OB(cblas_sgemm)(int order, int ta, int tb, int m, int n, int k, float alpha,
                     const float *a, int lda, const float *b, int ldb, float beta,
                     float *c, int ldc);
void OB(cblas_dgemm)(int order, int ta, int tb, int m, int n, int k, double alpha,
                     const double *a, int lda, const double *b, int ldb, double beta,
                     double *c, int ldc);
void OB(cblas_cgemm)(int order, int ta, int tb, int m, int n, int k, const void *alpha,
                     const void *a, int lda, const void *b, int ldb, const void *beta,
                     void *c, int ldc);
void OB(cblas_sgemv)(int order, int trans, int m, int n, float alpha, const float *a,
                     int lda, const float *x, int incx, float beta, float *y, int incy);

/* Calls seen per entry point, so a test can prove that MLX's products came through here. */
static unsigned long shim_calls[4];

unsigned long mlxcel_blas_shim_calls(int which) {
    return (which >= 0 && which < 4) ? __atomic_load_n(&shim_calls[which], __ATOMIC_RELAXED) : 0;
}

/* BLAS says beta == 0 means "C is output only": whatever C held (NaN included) must not
 * leak into the result, so it is cleared here rather than trusted to the gemv's scaling. */
static void clear_strided(float *y, int n, int inc) {
    if (inc == 1) {
        memset(y, 0, (size_t)n * sizeof(float));
    } else {
        for (int i = 0; i < n; i++) y[(long)i * inc] = 0.0f;
    }
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta,
                 float *c, int ldc) {
    __atomic_fetch_add(&shim_calls[0], 1, __ATOMIC_RELAXED);
    int a_t = ta != NO_TRANS, b_t = tb != NO_TRANS;
    if (order == ROW_MAJOR && k > 0 && m == 1 && n > 1) {
        /* c[0, :] = alpha * op(B)^T x + beta * c, x = row 0 of op(A). */
        int incx = a_t ? lda : 1;
        if (beta == 0.0f) clear_strided(c, n, 1);
        if (b_t)  /* B is stored n x k */
            OB(cblas_sgemv)(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
        else      /* B is stored k x n */
            OB(cblas_sgemv)(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
        __atomic_fetch_add(&shim_calls[3], 1, __ATOMIC_RELAXED);
        return;
    }
    if (order == ROW_MAJOR && k > 0 && n == 1 && m > 1) {
        /* c[:, 0] = alpha * op(A) x + beta * c, x = column 0 of op(B); c's stride is ldc. */
        int incx = b_t ? 1 : ldb;
        if (beta == 0.0f) clear_strided(c, m, ldc);
        if (a_t)  /* A is stored k x m */
            OB(cblas_sgemv)(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, incx, beta, c, ldc);
        else      /* A is stored m x k */
            OB(cblas_sgemv)(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, incx, beta, c, ldc);
        __atomic_fetch_add(&shim_calls[3], 1, __ATOMIC_RELAXED);
        return;
    }
    OB(cblas_sgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha,
                 const double *a, int lda, const double *b, int ldb, double beta,
                 double *c, int ldc) {
    __atomic_fetch_add(&shim_calls[1], 1, __ATOMIC_RELAXED);
    OB(cblas_dgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha,
                 const void *a, int lda, const void *b, int ldb, const void *beta,
                 void *c, int ldc) {
    __atomic_fetch_add(&shim_calls[2], 1, __ATOMIC_RELAXED);
    OB(cblas_cgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
