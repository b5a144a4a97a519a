// Row-by-row attention over a paged KV cache whose keys, values or both are stored quantized, for
// the torch backend on the CPU. A side is one of (the KV cache's modes, mlxcel/engine/backend.py):
//   plain   the compute dtype (bf16 or fp32) [slots, kv_heads, dim], read as it is;
//   int8    int8 records [slots, kv_heads, dim] and an fp32 absmax scale per slot and head;
//   turbo   uint8 records [slots, kv_heads, dim * bits / 8] of 4- or 3-bit Lloyd-Max codes of the
//           head vector rotated by R = H diag(signs) / sqrt(dim), and an fp32 scale per slot and
//           head (mlxcel/engine/kv_turbo.py defines the codebook, the rotation and the packing).
// Nothing is dequantized ahead: a key's scale multiplies its dot product with the query, a value's
// scale its softmax weight. Turbo keys are never un-rotated: the query is rotated once per head
// (q . k = (R q) . (R k)); turbo values are summed in the rotated space and the one output row is
// un-rotated (R^T sum_t p_t y_t). The only fp32 copies are the query and output rows in flight.
//   attention_kv_quant  one query per row (a decode row, or a prompt token over its own prefix of
//                   a shared table), each over its row's visible slots: fp32 scores, softmax and
//                   weighted sum; a (row, kv head) unit's arithmetic never depends on the others,
//                   so a row's result does not depend on what shares its step. Given the rows'
//                   new keys and values and their slots, it stores them first, quantizing as
//                   backends/torch/paged.py's quantizers do (a decode step's cache write, without a
//                   dozen small ops per layer).
// Reference: the same attention over the dequantized rows (tests/models/test_kv_quant.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "helpers.h"

namespace {

using mlxcel::narrow;
using mlxcel::widen;

inline float value_of(const uint16_t* p, int64_t i) { return widen(p[i]); }
inline float value_of(const float* p, int64_t i) { return p[i]; }
inline void put(uint16_t* p, int64_t i, float v) { p[i] = narrow(v); }
inline void put(float* p, int64_t i, float v) { p[i] = v; }

// In place: x <- H x (Sylvester order, unnormalised), n a power of two.
inline void hadamard(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h <<= 1)
    for (int64_t i = 0; i < n; i += h << 1)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// How a side stores one (slot, kv head) record.
enum class Kind { kPlain, kInt8, kTurbo4, kTurbo3 };

struct Side {
  const uint8_t* data;
  const float* scales;  // int8 and turbo
  const float* signs;   // turbo: the rotation's +-1 pattern [dim]
  alignas(64) float levels[16] = {0};  // turbo: the codebook (8 levels for 3 bits)
  int64_t kv_heads, dim, record;  // record: bytes per (slot, head)
  const uint8_t* row(int64_t slot, int64_t g) const { return data + (slot * kv_heads + g) * record; }
  float scale(int64_t slot, int64_t g) const { return scales ? scales[slot * kv_heads + g] : 1.0f; }
};

// Format tags: a side's element reading, as templates so each pairing compiles to its own loop.
template <typename T>
struct Plain {
  static constexpr bool kRotated = false;
  static void decode(const Side&, const uint8_t* r, float* out, int64_t n) {
    const T* p = reinterpret_cast<const T*>(r);
    for (int64_t j = 0; j < n; ++j) out[j] = value_of(p, j);
  }
};
struct Int8 {
  static constexpr bool kRotated = false;
  static void decode(const Side&, const uint8_t* r, float* out, int64_t n) {
    const int8_t* p = reinterpret_cast<const int8_t*>(r);
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(p[j]);
  }
};
struct Turbo4 {
  static constexpr bool kRotated = true;
  static void decode(const Side& s, const uint8_t* r, float* out, int64_t n) {
    for (int64_t g = 0; g < n; g += 16, r += 8) {
#if defined(__AVX2__) && !defined(__AVX512F__)
      // eight codes a step: each looked up in the two halves of the codebook, then the right one kept
      const __m256 lo_half = _mm256_load_ps(s.levels), hi_half = _mm256_load_ps(s.levels + 8);
      const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r)));
      for (int part = 0; part < 2; ++part) {
        const __m256i idx = part ? _mm256_srli_epi32(w, 4) : _mm256_and_si256(w, _mm256_set1_epi32(15));
        const __m256 high = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
        _mm256_storeu_ps(out + g + 8 * part, _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo_half, idx),
                                                              _mm256_permutevar8x32_ps(hi_half, idx), high));
      }
#else
      for (int i = 0; i < 8; ++i) {
        out[g + i] = s.levels[r[i] & 15];
        out[g + i + 8] = s.levels[r[i] >> 4];
      }
#endif
    }
  }
};
struct Turbo3 {
  static constexpr bool kRotated = true;
  static void decode(const Side& s, const uint8_t* r, float* out, int64_t n) {
    for (int64_t g = 0; g < n; g += 16, r += 6) {
#if defined(__AVX2__) && !defined(__AVX512F__)
      const __m256 book = _mm256_load_ps(s.levels);
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
      for (int part = 0; part < 2; ++part) {
        __m256i idx = _mm256_setzero_si256();
        for (int b = 0; b < 3; ++b) {
          const __m256i plane = _mm256_set1_epi32(r[2 * b + part]);
          idx = _mm256_or_si256(idx, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(plane, lane), one), b));
        }
        _mm256_storeu_ps(out + g + 8 * part, _mm256_permutevar8x32_ps(book, idx));
      }
#else
      for (int i = 0; i < 16; ++i) {
        int c = 0;
        for (int b = 0; b < 3; ++b) c |= ((r[2 * b + (i >> 3)] >> (i & 7)) & 1) << b;
        out[g + i] = s.levels[c];
      }
#endif
    }
  }
};

#if defined(__AVX512F__)
// Sixteen values of record r's group v (unscaled, rotated for turbo), as fp32 lanes.
inline __m512 lanes16(const Side&, const uint8_t* r, int v, Plain<float>*) {
  return _mm512_loadu_ps(reinterpret_cast<const float*>(r) + v * 16);
}
inline __m512 lanes16(const Side&, const uint8_t* r, int v, Plain<uint16_t>*) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r) + v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 lanes16(const Side&, const uint8_t* r, int v, Int8*) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + v * 16))));
}
inline __m512 lanes16(const Side& s, const uint8_t* r, int v, Turbo4*) {
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + v * 8)));
  const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(w, _mm256_set1_epi32(15))),
                                         _mm256_srli_epi32(w, 4), 1);
  return _mm512_permutexvar_ps(idx, _mm512_load_ps(s.levels));
}
inline __m512 lanes16(const Side& s, const uint8_t* r, int v, Turbo3*) {
  uint16_t m[3];
  std::memcpy(m, r + v * 6, sizeof m);
  const __m512i low = _mm512_or_si512(_mm512_maskz_set1_epi32(m[0], 1), _mm512_maskz_set1_epi32(m[1], 2));
  const __m512i idx = _mm512_or_si512(low, _mm512_maskz_set1_epi32(m[2], 4));
  return _mm512_permutexvar_ps(idx, _mm512_load_ps(s.levels));
}

// Query heads [h0, h0 + HB) of kv head g, for dk == dv == 16 * NV: the heads' (fp32, rotated
// where the keys are) query vectors stay in registers and each key and value record is loaded
// (and decoded) once for all of them; a head's arithmetic is the same whichever heads share its
// block. Output rows (in the values' space) go to `o_rows`.
template <typename K, typename V, int NV, int HB>
void heads_block(const float* qf, const Side& keys, const Side& values, float* o_rows, const int64_t* slots,
                 int64_t span, int64_t g, float scale, float* scores) {
  constexpr int64_t D = NV * 16;
  __m512 qv[HB][NV];
  float top[HB], total[HB];
  for (int r = 0; r < HB; ++r) {
    for (int v = 0; v < NV; ++v) qv[r][v] = _mm512_loadu_ps(qf + r * D + v * 16);
    top[r] = -INFINITY;
  }
  for (int64_t t = 0; t < span; ++t) {
    const uint8_t* kr = keys.row(slots[t], g);
    const float ks = keys.scale(slots[t], g) * scale;
    __m512 kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = lanes16(keys, kr, v, static_cast<K*>(nullptr));
    for (int r = 0; r < HB; ++r) {
      __m512 acc = _mm512_mul_ps(qv[r][0], kv[0]);
      for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(qv[r][v], kv[v], acc);
      const float s = _mm512_reduce_add_ps(acc) * ks;
      scores[r * span + t] = s;
      top[r] = std::max(top[r], s);
    }
  }
  for (int r = 0; r < HB; ++r) total[r] = mlxcel::exp_shifted(scores + r * span, span, top[r]);
  __m512 o[HB][NV];
  for (int r = 0; r < HB; ++r)
    for (int v = 0; v < NV; ++v) o[r][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < span; ++t) {
    const uint8_t* vr = values.row(slots[t], g);
    const float vs = values.scale(slots[t], g);
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = lanes16(values, vr, v, static_cast<V*>(nullptr));
    for (int r = 0; r < HB; ++r) {
      const __m512 p = _mm512_set1_ps(scores[r * span + t] * vs);
      for (int v = 0; v < NV; ++v) o[r][v] = _mm512_fmadd_ps(p, vv[v], o[r][v]);
    }
  }
  for (int r = 0; r < HB; ++r) {
    const __m512 sum = _mm512_set1_ps(total[r]);
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o_rows + r * D + v * 16, _mm512_div_ps(o[r][v], sum));
  }
}

// A kv head's group of query heads in register blocks (as many as fit beside a row).
template <typename K, typename V, int NV>
void group_blocks(const float* qf, const Side& keys, const Side& values, float* o_rows, const int64_t* slots,
                  int64_t span, int64_t g, int64_t group, float scale, std::vector<float>& work) {
  constexpr int kFit = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
  constexpr int64_t D = NV * 16;
  int64_t block = 1;
  for (int64_t c = std::min<int64_t>(kFit, group); c > 1; --c)
    if (group % c == 0) {
      block = c;
      break;
    }
  work.resize(kFit * span);
  for (int64_t r0 = 0; r0 < group; r0 += block) {
    const float* q = qf + r0 * D;
    float* o = o_rows + r0 * D;
    if constexpr (kFit >= 4) {
      if (block == 4) { heads_block<K, V, NV, 4>(q, keys, values, o, slots, span, g, scale, work.data()); continue; }
      if (block == 3) { heads_block<K, V, NV, 3>(q, keys, values, o, slots, span, g, scale, work.data()); continue; }
    }
    if constexpr (kFit >= 2) {
      if (block == 2) { heads_block<K, V, NV, 2>(q, keys, values, o, slots, span, g, scale, work.data()); continue; }
    }
    heads_block<K, V, NV, 1>(q, keys, values, o, slots, span, g, scale, work.data());
  }
}
#endif

// q . r and o += w * r over n fp32 values: sixteen partial sums, so compilers vectorise
// without reassociating
inline float dot(const float* q, const float* r, int64_t n) {
  float part[16] = {0};
  for (int64_t j = 0; j < n; ++j) part[j & 15] += q[j] * r[j];
  float s = 0;
  for (float v : part) s += v;
  return s;
}
inline void add_row(float* o, float w, const float* r, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] += w * r[j];
}

// The sum of p[0, n), n a power of two, by halving (p is overwritten)
inline float halving_sum(float* p, int64_t n) {
  for (int64_t h = n / 2; h >= 1; h /= 2)
    for (int64_t j = 0; j < h; ++j) p[j] += p[j + h];
  return p[0];
}

// y <- R y or R^T y in place (turbo's rotation; kv_turbo.rotation)
inline void rotate(float* y, const float* signs, int64_t n) {
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  for (int64_t j = 0; j < n; ++j) y[j] *= signs[j];
  hadamard(y, n);
  for (int64_t j = 0; j < n; ++j) y[j] *= norm;
}
inline void unrotate(float* y, const float* signs, int64_t n) {
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  hadamard(y, n);
  for (int64_t j = 0; j < n; ++j) y[j] *= signs[j] * norm;
}

// The group's query heads over slots[0, span): each head's query (rotated where the keys are)
// and output (rotated where the values are) as fp32 rows in `qf` / `of`, [group, dim].
template <typename K, typename V>
void attend_group(float* qf, float* of, const Side& keys, const Side& values, const int64_t* slots, int64_t span,
                  int64_t g, int64_t group, float scale, std::vector<float>& work) {
  const int64_t dk = keys.dim, dv = values.dim;
#if defined(__AVX512F__)
  if (dk == dv && (dk == 64 || dk == 128 || dk == 256)) {
    if (dk == 64) return group_blocks<K, V, 4>(qf, keys, values, of, slots, span, g, group, scale, work);
    if (dk == 128) return group_blocks<K, V, 8>(qf, keys, values, of, slots, span, g, group, scale, work);
    return group_blocks<K, V, 16>(qf, keys, values, of, slots, span, g, group, scale, work);
  }
#endif
  // records decoded one at a time into fp32 rows, then the vectorisable loops above
  work.resize(span + dk + dv);
  float* p = work.data();
  float* kr = p + span;
  float* vr = kr + dk;
  for (int64_t h = 0; h < group; ++h) {
    float top = -INFINITY;
    for (int64_t t = 0; t < span; ++t) {
      K::decode(keys, keys.row(slots[t], g), kr, dk);
      p[t] = dot(qf + h * dk, kr, dk) * keys.scale(slots[t], g) * scale;
      top = std::max(top, p[t]);
    }
    const float total = mlxcel::exp_shifted(p, span, top);
    float* o = of + h * dv;
    std::fill(o, o + dv, 0.0f);
    for (int64_t t = 0; t < span; ++t) {
      V::decode(values, values.row(slots[t], g), vr, dv);
      add_row(o, p[t] * values.scale(slots[t], g), vr, dv);
    }
    for (int64_t j = 0; j < dv; ++j) o[j] /= total;
  }
}

// The query heads of kv head g in row `q` over slots[first, last): out row written per head.
template <typename T, typename K, typename V>
void attend_unit(const T* q, const Side& keys, const Side& values, T* out, const int64_t* slots, int64_t first,
                 int64_t last, int64_t g, int64_t group, float scale, std::vector<float>& work,
                 std::vector<float>& rows) {
  const int64_t dk = keys.dim, dv = values.dim;
  rows.resize(group * (dk + dv));
  float* qf = rows.data();
  float* of = qf + group * dk;
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t j = 0; j < dk; ++j) qf[h * dk + j] = value_of(q + (g * group + h) * dk, j);
    if constexpr (K::kRotated) rotate(qf + h * dk, keys.signs, dk);
  }
  attend_group<K, V>(qf, of, keys, values, slots + first, last - first, g, group, scale, work);
  for (int64_t h = 0; h < group; ++h) {
    if constexpr (V::kRotated) unrotate(of + h * dv, values.signs, dv);
    for (int64_t j = 0; j < dv; ++j) put(out + (g * group + h) * dv, j, of[h * dv + j]);
  }
}

// One vector x of `dim` into record `rec` of a side (and its scale): copied as it is; as int8
// with scale = absmax / 127 and q = round-half-even(x / max(scale, FLT_MIN)), clamped to +-127;
// or turbo: y = R x, codes of y / max(rms(y), FLT_MIN) against the levels' midpoints, scale
// refit as <y, L[c]> / <L[c], L[c]> (0 where that is 0).
template <typename T>
void write_record(const T* v, Kind kind, const Side& s, uint8_t* rec, float* scale, std::vector<float>& y) {
  const int64_t dim = s.dim;
  if (kind == Kind::kPlain) {
    std::memcpy(rec, v, dim * sizeof(T));
    return;
  }
  if (kind == Kind::kInt8) {
    float top = 0.0f;
    for (int64_t j = 0; j < dim; ++j) top = std::max(top, std::fabs(value_of(v, j)));
    const float sc = top / 127.0f, div = std::max(sc, std::numeric_limits<float>::min());
    int8_t* q = reinterpret_cast<int8_t*>(rec);
    for (int64_t j = 0; j < dim; ++j)
      q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(value_of(v, j) / div), -127.0f, 127.0f));
    *scale = sc;
    return;
  }
  const int n_levels = kind == Kind::kTurbo4 ? 16 : 8;
  y.resize(dim);
  for (int64_t j = 0; j < dim; ++j) y[j] = value_of(v, j);
  rotate(y.data(), s.signs, dim);
  y.resize(3 * dim);
  float* part = y.data() + dim;  // products summed by halving, as the torch and MLX codecs sum them
  for (int64_t j = 0; j < dim; ++j) part[j] = y[j] * y[j];
  const float div = std::max(std::sqrt(halving_sum(part, dim) / dim), std::numeric_limits<float>::min());
  float mid[15];
  for (int i = 0; i + 1 < n_levels; ++i) mid[i] = (s.levels[i] + s.levels[i + 1]) / 2;
  float* num = y.data() + dim;
  float* den = num + dim;
  std::memset(rec, 0, s.record);
  for (int64_t j = 0; j < dim; ++j) {
    const float u = y[j] / div;
    int c = 0;
    while (c + 1 < n_levels && u > mid[c]) ++c;
    num[j] = y[j] * s.levels[c];
    den[j] = s.levels[c] * s.levels[c];
    const int64_t group = j / 16, i = j % 16;
    if (kind == Kind::kTurbo4) {
      rec[group * 8 + (i & 7)] |= static_cast<uint8_t>(c << (i < 8 ? 0 : 4));
    } else {
      for (int b = 0; b < 3; ++b) rec[group * 6 + 2 * b + (i >> 3)] |= static_cast<uint8_t>(((c >> b) & 1) << (i & 7));
    }
  }
  const float n = halving_sum(num, dim), d = halving_sum(den, dim);
  *scale = d > 0 ? n / std::max(d, std::numeric_limits<float>::min()) : 0.0f;
}

// ~32 Ki multiply-adds: below it, a step's units stay on the calling thread
constexpr int64_t kShareFrom = 1 << 15;

template <typename T, typename K, typename V>
void attend_rows(const T* q, const Side& keys, const Side& values, T* out, const int64_t* tab, int64_t row_stride,
                 const int64_t* len, int64_t rows, int64_t heads, int64_t window, float scale) {
  const int64_t kv_heads = keys.kv_heads, group = heads / kv_heads, units = rows * kv_heads;
  const auto first_of = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, len[i] - window) : 0; };
  int64_t work = 0;
  for (int64_t i = 0; i < rows; ++i) work += (len[i] - first_of(i)) * heads * (keys.dim + values.dim);
  const int64_t chunks = work < kShareFrom ? 1 : units;
  const int64_t per = (units + chunks - 1) / chunks;
  mlxcel::parallel(chunks, [&](int64_t c) {
    std::vector<float> scratch, rows_f;
    for (int64_t u = c * per, end = std::min(units, u + per); u < end; ++u) {
      const int64_t i = u / kv_heads, g = u % kv_heads;
      attend_unit<T, K, V>(q + i * heads * keys.dim, keys, values, out + i * heads * values.dim,
                           tab + i * row_stride, first_of(i), len[i], g, group, scale, scratch, rows_f);
    }
  }, rows > mlxcel::kPromptRows);
}

// A side's operands, checked: `data` [slots, kv_heads, record] with `scales` [slots, kv_heads]
// (int8 and turbo), `levels` (turbo: 16 or 8) and `signs` (turbo: [dim]).
Side side_of(const at::Tensor& data, const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& levels,
             const std::optional<at::Tensor>& signs, at::ScalarType dtype, const char* what, Kind* kind) {
  const auto given = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK(data.device().is_cpu() && data.dim() == 3 && data.is_contiguous(), "attention_kv_quant: ", what,
              " must be contiguous [slots, kv_heads, record] on the CPU");
  Side s{reinterpret_cast<const uint8_t*>(data.data_ptr()), nullptr, nullptr,
         {0}, data.size(1), data.size(2), data.size(2) * static_cast<int64_t>(data.element_size())};
  if (!given(scales)) {
    TORCH_CHECK(data.scalar_type() == dtype && !given(levels), "attention_kv_quant: ", what,
                " without scales must be the query's dtype");
    *kind = Kind::kPlain;
    return s;
  }
  TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->dim() == 2 &&
                  scales->size(0) == data.size(0) && scales->size(1) == data.size(1),
              "attention_kv_quant: ", what, " scales must be contiguous fp32 [slots, kv_heads]");
  s.scales = scales->data_ptr<float>();
  if (!given(levels)) {
    TORCH_CHECK(data.scalar_type() == at::kChar, "attention_kv_quant: ", what, " with scales alone must be int8");
    *kind = Kind::kInt8;
    return s;
  }
  TORCH_CHECK(given(signs) && data.scalar_type() == at::kByte && levels->scalar_type() == at::kFloat &&
                  levels->is_contiguous() && (levels->numel() == 16 || levels->numel() == 8) &&
                  signs->scalar_type() == at::kFloat && signs->is_contiguous() && signs->dim() == 1,
              "attention_kv_quant: ", what, " with levels must be uint8 codes with fp32 levels (16 or 8) and signs");
  const int bits = levels->numel() == 16 ? 4 : 3;
  s.dim = signs->numel();
  TORCH_CHECK(s.dim >= 16 && (s.dim & (s.dim - 1)) == 0 && data.size(2) == s.dim * bits / 8, "attention_kv_quant: ",
              what, " records do not hold ", bits, "-bit codes of a power-of-two head of at least 16");
  std::memcpy(s.levels, levels->data_ptr<float>(), levels->numel() * sizeof(float));
  s.signs = signs->data_ptr<float>();
  *kind = bits == 4 ? Kind::kTurbo4 : Kind::kTurbo3;
  return s;
}

template <typename T>
void write_rows(const Side& keys, Kind k_kind, float* key_scales, const Side& values, Kind v_kind, float* value_scales,
                const at::Tensor& new_keys, const at::Tensor& new_values, const at::Tensor& slots, int64_t n_slots) {
  const int64_t rows = slots.numel(), kvh = keys.kv_heads;
  TORCH_CHECK(slots.scalar_type() == at::kLong && new_keys.numel() == rows * kvh * keys.dim &&
                  new_values.numel() == rows * kvh * values.dim,
              "attention_kv_quant: the new keys and values do not match the slots and the cache");
  at::Tensor sc = slots.contiguous(), kc = new_keys.contiguous(), vc = new_values.contiguous();
  const int64_t* at = sc.data_ptr<int64_t>();
  std::vector<float> y;
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(at[i] >= 0 && at[i] < n_slots, "attention_kv_quant: write slot out of range");
    for (int64_t g = 0; g < kvh; ++g) {
      const int64_t r = at[i] * kvh + g;
      write_record(reinterpret_cast<const T*>(kc.data_ptr()) + (i * kvh + g) * keys.dim, k_kind, keys,
                   const_cast<uint8_t*>(keys.row(at[i], g)), key_scales ? key_scales + r : nullptr, y);
      write_record(reinterpret_cast<const T*>(vc.data_ptr()) + (i * kvh + g) * values.dim, v_kind, values,
                   const_cast<uint8_t*>(values.row(at[i], g)), value_scales ? value_scales + r : nullptr, y);
    }
  }
}

// Runs `fn` with the format tags of the keys' and values' kinds.
template <typename T, typename Fn>
void with_formats(Kind k, Kind v, Fn&& fn) {
  const auto with_v = [&](auto* kt) {
    switch (v) {
      case Kind::kPlain: return fn(kt, static_cast<Plain<T>*>(nullptr));
      case Kind::kInt8: return fn(kt, static_cast<Int8*>(nullptr));
      case Kind::kTurbo4: return fn(kt, static_cast<Turbo4*>(nullptr));
      case Kind::kTurbo3: return fn(kt, static_cast<Turbo3*>(nullptr));
    }
  };
  switch (k) {
    case Kind::kPlain: return with_v(static_cast<Plain<T>*>(nullptr));
    case Kind::kInt8: return with_v(static_cast<Int8*>(nullptr));
    case Kind::kTurbo4: return with_v(static_cast<Turbo4*>(nullptr));
    case Kind::kTurbo3: return with_v(static_cast<Turbo3*>(nullptr));
  }
}

at::Tensor attention_kv_quant(const at::Tensor& q, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                              const std::optional<at::Tensor>& key_levels, const std::optional<at::Tensor>& key_signs,
                              const at::Tensor& values, const std::optional<at::Tensor>& value_scales,
                              const std::optional<at::Tensor>& value_levels,
                              const std::optional<at::Tensor>& value_signs, const at::Tensor& table,
                              const at::Tensor& lengths, int64_t window, double scale,
                              const std::optional<at::Tensor>& new_keys, const std::optional<at::Tensor>& new_values,
                              const std::optional<at::Tensor>& write_at) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "attention_kv_quant takes bf16 or fp32 queries");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3, "attention_kv_quant takes q [rows, heads, dim] on the CPU");
  Kind k_kind, v_kind;
  const Side ks = side_of(keys, key_scales, key_levels, key_signs, dtype, "keys", &k_kind);
  const Side vs = side_of(values, value_scales, value_levels, value_signs, dtype, "values", &v_kind);
  TORCH_CHECK(table.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && table.dim() == 2 &&
                  lengths.dim() == 1 && (table.size(0) == q.size(0) || table.size(0) == 1) &&
                  lengths.size(0) == q.size(0),
              "attention_kv_quant takes an int64 slot table [rows or 1, keys] and lengths [rows]");
  const int64_t rows = q.size(0), heads = q.size(1), slots = keys.size(0), kv_heads = ks.kv_heads;
  TORCH_CHECK(q.size(2) == ks.dim && values.size(0) == slots && vs.kv_heads == kv_heads && kv_heads > 0 &&
                  heads % kv_heads == 0,
              "attention_kv_quant: q, keys and values do not agree");
  const auto scales_of = [](const std::optional<at::Tensor>& s) {
    return s.has_value() && s->defined() ? s->data_ptr<float>() : nullptr;
  };
  if (write_at.has_value() && write_at->defined()) {
    TORCH_CHECK(new_keys.has_value() && new_values.has_value() && new_keys->scalar_type() == dtype &&
                    new_values->scalar_type() == dtype,
                "attention_kv_quant: slots need new keys and values of the query's dtype");
    if (dtype == at::kBFloat16)
      write_rows<uint16_t>(ks, k_kind, scales_of(key_scales), vs, v_kind, scales_of(value_scales), *new_keys,
                           *new_values, *write_at, slots);
    else
      write_rows<float>(ks, k_kind, scales_of(key_scales), vs, v_kind, scales_of(value_scales), *new_keys,
                        *new_values, *write_at, slots);
  }
  at::Tensor qc = q.contiguous(), tc = table.contiguous(), lc = lengths.contiguous();
  const int64_t width = tc.size(1), row_stride = tc.size(0) == 1 ? 0 : width;
  const int64_t* tab = tc.data_ptr<int64_t>();
  const int64_t* len = lc.data_ptr<int64_t>();
  std::vector<int64_t> longest(tc.size(0), 0);
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= width, "attention_kv_quant: row ", i, " has length ", len[i],
                " outside its table of ", width);
    longest[row_stride ? i : 0] = std::max(longest[row_stride ? i : 0], len[i]);
  }
  for (int64_t r = 0; r < tc.size(0); ++r)
    for (int64_t t = 0; t < longest[r]; ++t)
      TORCH_CHECK(tab[r * width + t] >= 0 && tab[r * width + t] < slots, "attention_kv_quant: slot out of range");
  at::Tensor out = at::empty({rows, heads, vs.dim}, q.options());
  const auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* qs = reinterpret_cast<const T*>(qc.data_ptr());
    T* os = reinterpret_cast<T*>(out.data_ptr());
    with_formats<T>(k_kind, v_kind, [&](auto* kt, auto* vt) {
      using K = std::remove_pointer_t<decltype(kt)>;
      using V = std::remove_pointer_t<decltype(vt)>;
      attend_rows<T, K, V>(qs, ks, vs, os, tab, row_stride, len, rows, heads, window, static_cast<float>(scale));
    });
  };
  if (dtype == at::kBFloat16) {
    run(static_cast<uint16_t*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr));
  }
  return out;
}

}  // namespace

#ifndef MLXCEL_KVQ_LIBRARY
#define MLXCEL_KVQ_LIBRARY mlxcel_cpu
#endif

TORCH_LIBRARY_FRAGMENT(MLXCEL_KVQ_LIBRARY, lib) {
  lib.def("attention_kv_quant(Tensor q, Tensor(a!) keys, Tensor(b!)? key_scales, Tensor? key_levels, "
          "Tensor? key_signs, Tensor(c!) values, Tensor(d!)? value_scales, Tensor? value_levels, Tensor? value_signs, "
          "Tensor table, Tensor lengths, int window, float scale, Tensor? new_keys=None, Tensor? new_values=None, "
          "Tensor? slots=None) -> Tensor");
  lib.impl("attention_kv_quant", c10::DispatchKey::CPU, &attention_kv_quant);
}
