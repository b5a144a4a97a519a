// Few-row linears over MLX-quantized weights for the torch backend on the CPU:
// y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]), w never stored dense.
//
// MLX's affine format (mx.quantize): each weight row is cut into groups of `group` values, each
// group has a scale s and bias z (bf16 as mlx-community's checkpoints store them, fp16 as a GGUF
// converted losslessly has them, or fp32), read in that dtype and widened exactly in registers, so a
// 4-bit weight in groups of 32 reads 5 bits; a value is w = s * q + z for an unsigned `bits`-bit
// code q. The codes of a row are one little-endian bit stream (code j at bits [j * bits,
// (j + 1) * bits)) stored as uint32 words, so 4-bit codes are the nibbles of consecutive bytes,
// low nibble first, and 8-bit codes are the bytes.
//
// A decode row's cost is reading the weights, so the codes are unpacked and scaled in registers
// inside the dot product (fp32 accumulate) and each weight row is read once for up to eight
// activation rows; a prompt chunk's rows run here too, eight at a time over each ~32 KiB of
// weight rows while it is in the cache (quantized.py says why). 4-bit: a vector of L bytes widens
// to L 32-bit lanes; its low nibbles are the even codes of 2L values and its high nibbles the odd
// ones, so x is permuted once per call to match (even then odd within each 2L block), here rather
// than by torch ops (a decode step makes ~200 of these calls, and each torch op costs microseconds).
// Between products a helper reads the next products' packed tensors into the cache
// (helpers.h's LookAhead), as the dense row kernel does. 8-bit: L bytes are L codes in order. Other widths
// decode a row into a scratch row first (correct, slower). Every activation row's sum runs in
// the same order whatever else the call holds, so a row's result does not depend on the others.
// Reference: mx.dequantize in fp32 and a plain product (tests/models/test_torch_quantized.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "helpers.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The torch library these ops join; a test builds this file alone under another name (an AVX2
// copy on an AVX-512 machine).
#ifndef MLXCEL_QUANT_LIBRARY
#define MLXCEL_QUANT_LIBRARY mlxcel_cpu
#endif

namespace {

constexpr int64_t kMaxRows = 8;  // activation rows per pass over a weight row

#if defined(__AVX512F__)
#define MLXCEL_QUANT_VECTOR 1
using V = __m512;
constexpr int64_t L = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float f) { return _mm512_set1_ps(f); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
inline __m512i widen_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline V to_float(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
inline __m512i high_nibbles(__m512i v) { return _mm512_srli_epi32(v, 4); }
#elif defined(__AVX2__) && defined(__FMA__)
#define MLXCEL_QUANT_VECTOR 1
using V = __m256;
constexpr int64_t L = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float f) { return _mm256_set1_ps(f); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline float vsum(V v) { return mlxcel::reduce_add8(v); }
inline __m256i widen_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline V to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_srli_epi32(v, 4); }
#else
constexpr int64_t L = 8;  // the portable form's block, for the x layout only
#endif

enum class Param { f32, bf16, f16 };  // the scales' and biases' dtype

struct Operands {
  int64_t rows, n, k, bits, group, row_bytes;
  const uint8_t* w;      // [n, row_bytes]
  const void* scales;    // [n, k / group], in `param`
  const void* biases;    // [n, k / group], the same dtype
  Param param;
  const float* bias;     // [n] or nullptr
  const float* x;        // [rows, k], in the order the path reads (4-bit: permuted)
  float* y;              // [rows, n]
};

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Group g's scale or bias (row-major index) in fp32; bf16 and fp16 widen exactly.
inline float param(const Operands& o, const void* p, int64_t i) {
  switch (o.param) {
    case Param::bf16: return mlxcel::widen(static_cast<const uint16_t*>(p)[i]);
    case Param::f16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// A row's code j, any width up to 8: one or two bytes of the bit stream.
inline uint32_t code_at(const uint8_t* row, int64_t row_bytes, int64_t j, int64_t bits) {
  const int64_t bit = j * bits, byte = bit >> 3, shift = bit & 7;
  uint32_t v = row[byte];
  if (shift + bits > 8 && byte + 1 < row_bytes) v |= static_cast<uint32_t>(row[byte + 1]) << 8;
  return (v >> shift) & ((1u << bits) - 1);
}

// Weight row r decoded to fp32 (the generic path's scratch row).
void decode_row(const Operands& o, int64_t r, float* out) {
  const uint8_t* row = o.w + r * o.row_bytes;
  const int64_t base = r * (o.k / o.group);
  for (int64_t g = 0; g < o.k / o.group; ++g) {
    const float sg = param(o, o.scales, base + g), zg = param(o, o.biases, base + g);
    for (int64_t j = g * o.group; j < (g + 1) * o.group; ++j)
      out[j] = sg * static_cast<float>(code_at(row, o.row_bytes, j, o.bits)) + zg;
  }
}

#if defined(MLXCEL_QUANT_VECTOR)
// Columns j..j+2L of a row as two scaled weight vectors: 4 bits keep them in L bytes, 8 bits in 2L.
template <int Bits>
inline void weights(const uint8_t* row, int64_t j, V sv, V zv, V& w0, V& w1) {
  if constexpr (Bits == 4) {
    const auto q = widen_bytes(row + j / 2);
    w0 = vfma(to_float(low_nibbles(q)), sv, zv);
    w1 = vfma(to_float(high_nibbles(q)), sv, zv);
  } else {
    w0 = vfma(to_float(widen_bytes(row + j)), sv, zv);
    w1 = vfma(to_float(widen_bytes(row + j + L)), sv, zv);
  }
}

// One weight row against M activation rows; two sums in flight per activation row.
template <int Bits, int M>
void row_bits(const Operands& o, int64_t r, const float* xs, float* out) {
  const uint8_t* row = o.w + r * o.row_bytes;
  const int64_t base = r * (o.k / o.group);
  V a0[M], a1[M];
  for (int i = 0; i < M; ++i) a0[i] = a1[i] = vzero();
  for (int64_t g = 0; g < o.k / o.group; ++g) {
    const V sv = vset(param(o, o.scales, base + g)), zv = vset(param(o, o.biases, base + g));
    for (int64_t j = g * o.group; j < (g + 1) * o.group; j += 2 * L) {
      V w0, w1;
      weights<Bits>(row, j, sv, zv, w0, w1);
      for (int i = 0; i < M; ++i) {
        a0[i] = vfma(w0, vload(xs + i * o.k + j), a0[i]);
        a1[i] = vfma(w1, vload(xs + i * o.k + j + L), a1[i]);
      }
    }
  }
  for (int i = 0; i < M; ++i) out[i] = vsum(vadd(a0[i], a1[i]));
}

// A decoded fp32 row against M activation rows (k is a multiple of 32, so of 2L).
template <int M>
void row_dense(const float* w, int64_t k, const float* xs, float* out) {
  V a0[M], a1[M];
  for (int i = 0; i < M; ++i) a0[i] = a1[i] = vzero();
  for (int64_t j = 0; j < k; j += 2 * L) {
    const V w0 = vload(w + j), w1 = vload(w + j + L);
    for (int i = 0; i < M; ++i) {
      a0[i] = vfma(w0, vload(xs + i * k + j), a0[i]);
      a1[i] = vfma(w1, vload(xs + i * k + j + L), a1[i]);
    }
  }
  for (int i = 0; i < M; ++i) out[i] = vsum(vadd(a0[i], a1[i]));
}
#else
// Portable form: 2L partial sums per dot product, in a fixed order.
template <int M>
void row_dense(const float* w, int64_t k, const float* xs, float* out) {
  for (int i = 0; i < M; ++i) {
    float part[2 * L] = {0};
    for (int64_t j = 0; j < k; ++j) part[j % (2 * L)] += w[j] * xs[i * k + j];
    float sum = 0;
    for (int l = 0; l < 2 * L; ++l) sum += part[l];
    out[i] = sum;
  }
}
#endif

using RowFn = void (*)(const Operands&, int64_t, const float*, float*, float*);

// One weight row r against M activation rows at xs; `scratch` holds k floats.
template <int M>
void one_row(const Operands& o, int64_t r, const float* xs, float* out, float* scratch) {
#if defined(MLXCEL_QUANT_VECTOR)
  if (o.bits == 4) return row_bits<4, M>(o, r, xs, out);
  if (o.bits == 8) return row_bits<8, M>(o, r, xs, out);
#endif
  decode_row(o, r, scratch);
  row_dense<M>(scratch, o.k, xs, out);
}

RowFn row_fn(int64_t m) {
  switch (m) {
    case 1: return &one_row<1>;
    case 2: return &one_row<2>;
    case 3: return &one_row<3>;
    case 4: return &one_row<4>;
    case 5: return &one_row<5>;
    case 6: return &one_row<6>;
    case 7: return &one_row<7>;
    default: return &one_row<8>;
  }
}

// Whether the 4-bit vector path reads x permuted (even codes, then odd, within each 2L block).
bool permutes(int64_t bits) {
#if defined(MLXCEL_QUANT_VECTOR)
  return bits == 4;
#else
  (void)bits;
  return false;
#endif
}

// A weight row a few rows ahead of the one being read, requested into the cache (codes, scales
// and biases: three streams the hardware prefetcher follows less well than one).
constexpr int64_t kAheadRows = 4;
inline void prefetch_row(const Operands& o, int64_t r) {
  const auto* row = reinterpret_cast<const char*>(o.w + r * o.row_bytes);
  for (int64_t b = 0; b < o.row_bytes; b += 64) __builtin_prefetch(row + b);
  const int64_t groups = o.k / o.group, width = o.param == Param::f32 ? 4 : 2;
  __builtin_prefetch(static_cast<const char*>(o.scales) + r * groups * width);
  __builtin_prefetch(static_cast<const char*>(o.biases) + r * groups * width);
}

void product(const Operands& o) {
  // chunks of ~32 KiB of packed weight rows, split over the helper threads
  const int64_t chunk_rows = std::max<int64_t>(4, 32768 / std::max<int64_t>(1, o.row_bytes));
  const int64_t chunks = (o.n + chunk_rows - 1) / chunk_rows;
#if defined(MLXCEL_QUANT_VECTOR)
  const bool generic = o.bits != 4 && o.bits != 8;  // one_row decodes into the scratch row
#else
  const bool generic = true;
#endif
  mlxcel::parallel(chunks, [&](int64_t c) {
    std::vector<float> scratch(generic ? o.k : 0);
    float out[kMaxRows];
    const int64_t end = std::min(o.n, (c + 1) * chunk_rows);
    for (int64_t m0 = 0; m0 < o.rows; m0 += kMaxRows) {
      const int64_t m = std::min(kMaxRows, o.rows - m0);
      const RowFn fn = row_fn(m);
      for (int64_t r = c * chunk_rows; r < end; ++r) {
        if (m0 == 0 && r + kAheadRows < end) prefetch_row(o, r + kAheadRows);
        fn(o, r, o.x + m0 * o.k, out, scratch.data());
        for (int64_t i = 0; i < m; ++i) o.y[(m0 + i) * o.n + r] = out[i] + (o.bias ? o.bias[r] : 0.0f);
      }
    }
  }, o.rows > mlxcel::kPromptRows);
}

// x's rows as the path reads them, in fp32: `x` itself when it already is (fp32, contiguous, not
// permuted), else widened and/or permuted into `buf`.
const float* activations(const at::Tensor& x, int64_t rows, int64_t k, bool permute, std::vector<float>& buf) {
  const bool f32 = x.scalar_type() == at::kFloat;
  if (f32 && !permute) return x.data_ptr<float>();
  buf.resize(rows * k);
  const float* xf = f32 ? x.data_ptr<float>() : nullptr;
  const auto* xb = f32 ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto get = [&](int64_t i) { return f32 ? xf[i] : mlxcel::widen(xb[i]); };
  if (!permute) {
    for (int64_t i = 0; i < rows * k; ++i) buf[i] = get(i);
    return buf.data();
  }
  for (int64_t base = 0; base < rows * k; base += 2 * L)  // k is a multiple of 32, so of 2L
    for (int64_t t = 0; t < L; ++t) {
      buf[base + t] = get(base + 2 * t);
      buf[base + L + t] = get(base + 2 * t + 1);
    }
  return buf.data();
}

at::Tensor quant_rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                             const at::Tensor& biases, const std::optional<at::Tensor>& bias, int64_t bits,
                             int64_t group) {
  TORCH_CHECK(bits >= 2 && bits <= 8, "bits must be 2..8");
  TORCH_CHECK(group >= 32 && group % 32 == 0, "group size must be a multiple of 32");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.element_size() == 4,
              "weight must be a contiguous [out, in * bits / 32] matrix of 32-bit words");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
  const int64_t n = weight.size(0), k = x.size(-1);
  TORCH_CHECK(k % group == 0 && weight.size(1) * 32 == k * bits, "x's last dimension does not match the weight");
  const auto sdtype = scales.scalar_type();
  TORCH_CHECK((sdtype == at::kFloat || sdtype == at::kBFloat16 || sdtype == at::kHalf) &&
                  biases.scalar_type() == sdtype && scales.is_contiguous() && biases.is_contiguous() &&
                  scales.numel() == n * (k / group) && biases.numel() == n * (k / group),
              "scales and biases must be contiguous [out, in / group], both fp32, both bf16 or both fp16");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = k == 0 ? 0 : xc.numel() / k;
  thread_local std::vector<float> xbuf;  // the engine thread's, reused call after call
  const float* xs = activations(xc, rows, k, permutes(bits), xbuf);
  std::vector<float> bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias must be [out]");
    at::Tensor b = bias->contiguous();
    if (b.scalar_type() == at::kFloat) {
      bp = b.data_ptr<float>();
    } else {
      at::Tensor b32 = b.to(at::kFloat);
      bf.assign(b32.data_ptr<float>(), b32.data_ptr<float>() + n);
      bp = bf.data();
    }
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  const bool f32 = x.scalar_type() == at::kFloat;
  at::Tensor y = at::empty(shape, x.options());
  std::vector<float> y32(f32 ? 0 : rows * n);  // bf16 results: summed in fp32, rounded once
  const Param p = sdtype == at::kBFloat16 ? Param::bf16 : sdtype == at::kHalf ? Param::f16 : Param::f32;
  const Operands o{rows, n, k, bits, group, k * bits / 8, static_cast<const uint8_t*>(weight.data_ptr()),
                   scales.data_ptr(), biases.data_ptr(), p, bp, xs, f32 ? y.data_ptr<float>() : y32.data()};
  product(o);
  if (!f32) {
    auto* yb = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < rows * n; ++i) yb[i] = mlxcel::narrow(y32[i]);
  }
  if (rows <= mlxcel::kPromptRows) {  // a prompt chunk's helpers are torch's threads, busy with it
    mlxcel::g_look_ahead.note(weight);
    mlxcel::g_look_ahead.note(scales);
    mlxcel::read_ahead_after(biases);
  }
  return y;
}

// Which instruction set this build's unpacking uses (tests check the AVX2 copy is one).
std::string quant_rows_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(MLXCEL_QUANT_VECTOR)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MLXCEL_QUANT_LIBRARY, lib) {
  lib.def("quant_rows_linear(Tensor x, Tensor weight, Tensor scales, Tensor biases, Tensor? bias, int bits, "
          "int group) -> Tensor");
  lib.impl("quant_rows_linear", c10::DispatchKey::CPU, &quant_rows_linear);
  lib.def("quant_rows_isa() -> str", &quant_rows_isa);
}
