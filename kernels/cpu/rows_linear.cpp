// Few-row linears for the torch backend on the CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]),
// in bf16 (the default where the CPU has bf16 instructions) or fp32 (the default elsewhere).
//
// A decode step multiplies one activation row per sequence by every weight matrix, so its cost
// is reading the weights. torch's bf16 CPU kernels read them at 7-11 GB/s for one row on an
// AVX512 machine, and its fp32 one-row product runs on one thread on an AVX2 one; this one streams four weight rows at a time with a
// prefetch ahead, multiplies bf16 pairs natively (AVX512-BF16, else widened to fp32), sums in
// fp32, rounds bf16 results to bf16 (nearest-even) and splits the output rows with its own
// helper threads (see Helpers). Up to eight activation rows share one pass over the weights,
// and a row's result does not depend on the others in the call. Between products (while the
// caller runs the step's other ops) a helper reads the next products' weights into the cache
// (helpers.h's LookAhead).
// Reference: F.linear in fp32 on the same values (tests/models/test_torch_row_kernel.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "helpers.h"

#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using mlxcel::g_helpers;
using mlxcel::Helpers;
using mlxcel::narrow;
using mlxcel::widen;

// Vec<T>: the vector form of one multiply-add step over weights of type T (uint16_t: bf16 bits;
// float: fp32). step: values per load; Tail: what a load at k - j values from the end needs (a
// mask, or the count left); load(p, tail); madd(acc, w, x).
template <typename T>
struct Vec;

#if defined(__AVX512BW__)
using Acc = __m512;
inline Acc zero() { return _mm512_setzero_ps(); }
inline float reduce(Acc acc) { return _mm512_reduce_add_ps(acc); }

#if defined(__AVX512BF16__)
// Native bf16 pair products (AVX512-BF16): 32 weights per instruction, no widening.
template <>
struct Vec<uint16_t> {
  static constexpr int64_t step = 32;
  using Tail = __mmask32;
  using V = __m512i;
  static Tail tail(int64_t left) { return left >= 32 ? ~Tail(0) : static_cast<Tail>((1ull << left) - 1); }
  static V load(const uint16_t* p, Tail m) { return _mm512_maskz_loadu_epi16(m, p); }
  static Acc madd(Acc acc, V w, V x) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(w), reinterpret_cast<__m512bh&>(x));
  }
};
#else
// AVX512 without bf16 instructions: widen 16 weights to fp32 by a shift, then multiply-add.
template <>
struct Vec<uint16_t> {
  static constexpr int64_t step = 16;
  using Tail = __mmask16;
  using V = __m512;
  static Tail tail(int64_t left) { return left >= 16 ? ~Tail(0) : static_cast<Tail>((1u << left) - 1); }
  static V load(const uint16_t* p, Tail m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
  static Acc madd(Acc acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};
#endif

template <>
struct Vec<float> {
  static constexpr int64_t step = 16;
  using Tail = __mmask16;
  using V = __m512;
  static Tail tail(int64_t left) { return left >= 16 ? ~Tail(0) : static_cast<Tail>((1u << left) - 1); }
  static V load(const float* p, Tail m) { return _mm512_maskz_loadu_ps(m, p); }
  static Acc madd(Acc acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};
#define MLXCEL_ROWS_VECTOR 1

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: eight fp32 lanes (bf16 widened by a shift). No masked loads: a tail shorter than a step
// goes through a zero-padded copy.
using Acc = __m256;
inline Acc zero() { return _mm256_setzero_ps(); }
inline float reduce(Acc v) { return mlxcel::reduce_add8(v); }
using mlxcel::load8;

template <typename T>
struct Vec {
  static constexpr int64_t step = 8;
  using Tail = int64_t;
  using V = __m256;
  static Tail tail(int64_t left) { return left; }
  static V load(const T* p, Tail left) {
    if (left >= 8) return load8(p);
    T pad[8] = {};
    std::memcpy(pad, p, left * sizeof(T));
    return load8(pad);
  }
  static Acc madd(Acc acc, V w, V x) { return _mm256_fmadd_ps(w, x, acc); }
};
#define MLXCEL_ROWS_VECTOR 1
#endif

inline float value(uint16_t v) { return widen(v); }
inline float value(float v) { return v; }
inline uint16_t result(float v, const uint16_t*) { return narrow(v); }
inline float result(float v, const float*) { return v; }

constexpr int64_t kMaxRows = 8;    // activation rows per pass over the weights
// weight rows prefetched ahead: one token's 211 SmolLM2 products read at 16.6 GB/s against 13.3
// without the prefetch (15 paired runs)
constexpr int64_t kAhead = 8;

// Every activation row's result is computed the same way whatever else the call holds: one
// fp32 sum per (row, output) over the same steps in the same order, reduced the same way, so a
// row alone and a row among eight give the same bits (engine batch invariance rests on this).
#if defined(MLXCEL_ROWS_VECTOR)
// One step of k: values [j, j + step) of R weight rows against M activation rows.
template <typename T, int R, int M>
__attribute__((always_inline)) inline void accumulate(Acc (&acc)[R][M], const T* x, const T* w, int64_t k, int64_t j,
                                                      typename Vec<T>::Tail tail) {
  using Lanes = Vec<T>;
  typename Lanes::V xv[M];
  for (int i = 0; i < M; ++i) xv[i] = Lanes::load(x + i * k + j, tail);
  for (int r = 0; r < R; ++r) {
    if ((j * sizeof(T)) % 64 == 0)  // one request per cache line
      _mm_prefetch(reinterpret_cast<const char*>(w + (kAhead + r) * k + j), _MM_HINT_T0);
    const typename Lanes::V wv = Lanes::load(w + r * k + j, tail);
    for (int i = 0; i < M; ++i) acc[r][i] = Lanes::madd(acc[r][i], wv, xv[i]);
  }
}

// Weight rows [0, R) of w against activation rows [0, M) of x; the R * M sums stay in registers.
// The whole steps run in one loop, then the last partial one: the tail's load path (a copy, on
// AVX2) kept out of the loop, where its call made the compiler keep the sums in memory.
template <typename T, int R, int M>
void block(const T* x, const T* w, int64_t k, float* out) {
  using Lanes = Vec<T>;
  Acc acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) acc[r][i] = zero();
  const int64_t whole = k / Lanes::step * Lanes::step;
  for (int64_t j = 0; j < whole; j += Lanes::step) accumulate<T, R, M>(acc, x, w, k, j, Lanes::tail(Lanes::step));
  if (whole < k) accumulate<T, R, M>(acc, x, w, k, whole, Lanes::tail(k - whole));
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) out[i * R + r] = reduce(acc[r][i]);
}
#else
// Portable form: sixteen partial sums per dot product, which compilers vectorise without -ffast-math.
template <typename T, int R, int M>
void block(const T* x, const T* w, int64_t k, float* out) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) {
      float part[16] = {0};
      for (int64_t j = 0; j < k; ++j) part[j & 15] += value(w[r * k + j]) * value(x[i * k + j]);
      float s = 0;
      for (int l = 0; l < 16; ++l) s += part[l];
      out[i * R + r] = s;
    }
}
#endif

// Weight rows per block for m activation rows: four sums in flight for one row, and no more
// than eight accumulators' worth of registers beyond that.
template <typename T>
struct Plan {
  using BlockFn = void (*)(const T*, const T*, int64_t, float*);
  int64_t rows;
  BlockFn full, single;  // a block of `rows` weight rows, and one weight row (a matrix's tail)
};

template <typename T, int M>
Plan<T> plan_for() {
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  return {R, &block<T, R, M>, &block<T, 1, M>};
}

template <typename T>
Plan<T> plan_for_rows(int64_t m) {
  switch (m) {
    case 1: return plan_for<T, 1>();
    case 2: return plan_for<T, 2>();
    case 3: return plan_for<T, 3>();
    case 4: return plan_for<T, 4>();
    case 5: return plan_for<T, 5>();
    case 6: return plan_for<T, 6>();
    case 7: return plan_for<T, 7>();
    default: return plan_for<T, 8>();
  }
}

void set_read_ahead(int64_t bytes) { mlxcel::g_ahead_bytes.store(bytes); }

void set_helpers(int64_t count) {
  if (count > 0 && g_helpers.load() == nullptr) g_helpers.store(new Helpers(static_cast<int>(count)));
}

// ys[rows, n] = xs[rows, k] @ ws[n, k].T (+ bias), the output rows split over the helpers.
template <typename T>
void rows_product(const T* xs, const T* ws, const float* bp, T* ys, int64_t rows, int64_t n, int64_t k) {
  // Chunks of ~64 KiB of weight rows (a multiple of 4, so every plan's blocks align as in one
  // pass over the whole matrix), split over the helpers; each chunk meets every group of eight
  // activation rows while its weights are in the cache, so many rows read the weights once.
  const int64_t chunk_rows = std::max<int64_t>(4, 65536 / (k * static_cast<int64_t>(sizeof(T))) / 4 * 4);
  const int64_t chunks = (n + chunk_rows - 1) / chunk_rows;
  const Helpers::Fn chunk = [&](int64_t c) {
    float out[kMaxRows * 4];
    const int64_t n_end = std::min(n, (c + 1) * chunk_rows);
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
      const int64_t m = std::min(kMaxRows, rows - m0);
      const Plan<T> plan = plan_for_rows<T>(m);
      const T* xm = xs + m0 * k;
      for (int64_t n0 = c * chunk_rows; n0 < n_end; n0 += plan.rows) {
        const int64_t nb = std::min(plan.rows, n_end - n0);
        if (nb == plan.rows) {
          plan.full(xm, ws + n0 * k, k, out);
        } else {
          for (int64_t r = 0; r < nb; ++r) {
            float one[kMaxRows];
            plan.single(xm, ws + (n0 + r) * k, k, one);
            for (int64_t i = 0; i < m; ++i) out[i * nb + r] = one[i];
          }
        }
        for (int64_t i = 0; i < m; ++i)
          for (int64_t r = 0; r < nb; ++r)
            ys[(m0 + i) * n + n0 + r] = result(out[i * nb + r] + (bp ? bp[n0 + r] : 0.0f), ys);
      }
    }
  };
  mlxcel::parallel(chunks, chunk);
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const mlxcel::Linear l = mlxcel::linear_operands(x, weight, bias, /*fp32=*/true);
  if (l.bf16()) {
    rows_product(l.xs(), reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), l.bs(), l.ys(), l.rows,
                 l.n, l.k);
  } else {
    rows_product(l.xf(), weight.data_ptr<float>(), l.bs(), l.yf(), l.rows, l.n, l.k);
  }
  mlxcel::read_ahead_after(weight);
  return l.y;
}

}  // namespace

TORCH_LIBRARY(mlxcel_cpu, lib) {
  lib.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  lib.impl("rows_linear", c10::DispatchKey::CPU, &rows_linear);
  lib.def("set_helpers(int count) -> ()", &set_helpers);
  lib.def("set_read_ahead(int bytes) -> ()", &set_read_ahead);
}
