// Row-by-row attention over a paged KV cache whose keys, values or both are stored int8 (the KV
// cache's int8 mode: int8 records [slots, kv_heads, dim] and an fp32 absmax scale per slot and
// head), for the torch backend on the CPU. Nothing is dequantized ahead: a key's scale multiplies
// its dot product with the query, a value's scale its softmax weight, so the only fp32 copies are
// the one query and one output row in flight. A side stored in the compute dtype is read as it is.
//   attention_int8  one query per row (a decode row, or a prompt token over its own prefix of a
//                   shared table), each over its row's visible slots: fp32 scores, softmax and
//                   weighted sum; a (row, kv head) unit's arithmetic never depends on the others,
//                   so a row's result does not depend on what shares its step. Given the rows'
//                   new keys and values and their slots, it stores them first, quantizing an
//                   int8 side exactly as the torch ops of backends/torch/paged.quantize_int8 do
//                   (a decode step's cache write, without a dozen small ops per layer).
// Reference: the same attention over the dequantized rows (tests/models/test_kv_int8.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "helpers.h"

namespace {

using mlxcel::narrow;
using mlxcel::widen;

inline float value_of(const uint16_t* p, int64_t i) { return widen(p[i]); }
inline float value_of(const float* p, int64_t i) { return p[i]; }
inline float value_of(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
inline void put(uint16_t* p, int64_t i, float v) { p[i] = narrow(v); }
inline void put(float* p, int64_t i, float v) { p[i] = v; }

// One side of the cache: its records, and their scales where stored int8 (else a scale of 1).
template <typename E>
struct Side {
  const E* data;
  const float* scales;
  int64_t kv_heads, dim;
  const E* row(int64_t slot, int64_t g) const { return data + (slot * kv_heads + g) * dim; }
  float scale(int64_t slot, int64_t g) const { return scales ? scales[slot * kv_heads + g] : 1.0f; }
};

// q . r over n values: sixteen partial sums, so compilers vectorise without reassociating
template <typename E>
float dot_row(const float* q, const E* r, int64_t n) {
  float part[16] = {0};
  for (int64_t j = 0; j < n; ++j) part[j & 15] += q[j] * value_of(r, j);
  float s = 0;
  for (float v : part) s += v;
  return s;
}

#if defined(__AVX512F__)
inline float dot_row(const float* q, const int8_t* r, int64_t n) {
  if (n % 16 != 0) {
    float part[16] = {0};
    for (int64_t j = 0; j < n; ++j) part[j & 15] += q[j] * static_cast<float>(r[j]);
    float s = 0;
    for (float v : part) s += v;
    return s;
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 k = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + j))));
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), k, acc);
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

// o += w * r over n values
template <typename E>
inline void add_row(float* o, float w, const E* r, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] += w * value_of(r, j);
}

#if defined(__AVX512F__)
inline __m512 lanes16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 lanes16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 lanes16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Query heads [h0, h0 + HB) of kv head g, for dk == dv == 16 * NV: the heads' vectors stay in
// registers and each key and value row is loaded (and widened from int8) once for all of them;
// a head's arithmetic is the same whichever heads share its block.
template <typename T, typename K, typename V, int NV, int HB>
void heads_block(const T* q, const Side<K>& keys, const Side<V>& values, T* out, const int64_t* slots,
                 int64_t span, int64_t g, int64_t h0, float scale, float* scores) {
  constexpr int64_t D = NV * 16;
  __m512 qv[HB][NV];
  float top[HB], total[HB];
  for (int r = 0; r < HB; ++r) {
    for (int v = 0; v < NV; ++v) qv[r][v] = lanes16(q + (h0 + r) * D + v * 16);
    top[r] = -INFINITY;
  }
  for (int64_t t = 0; t < span; ++t) {
    const K* kr = keys.row(slots[t], g);
    const float ks = keys.scale(slots[t], g) * scale;
    __m512 kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = lanes16(kr + v * 16);
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
    const V* vr = values.row(slots[t], g);
    const float vs = values.scale(slots[t], g);
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = lanes16(vr + v * 16);
    for (int r = 0; r < HB; ++r) {
      const __m512 p = _mm512_set1_ps(scores[r * span + t] * vs);
      for (int v = 0; v < NV; ++v) o[r][v] = _mm512_fmadd_ps(p, vv[v], o[r][v]);
    }
  }
  alignas(64) float row[D];
  for (int r = 0; r < HB; ++r) {
    const __m512 sum = _mm512_set1_ps(total[r]);
    for (int v = 0; v < NV; ++v) _mm512_store_ps(row + v * 16, _mm512_div_ps(o[r][v], sum));
    for (int64_t j = 0; j < D; ++j) put(out + (h0 + r) * D, j, row[j]);
  }
}

// A kv head's group of query heads in register blocks (as many as fit beside a row).
template <typename T, typename K, typename V, int NV>
void group_blocks(const T* q, const Side<K>& keys, const Side<V>& values, T* out, const int64_t* slots,
                  int64_t span, int64_t g, int64_t group, float scale, std::vector<float>& work) {
  constexpr int kFit = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
  int64_t block = 1;
  for (int64_t c = std::min<int64_t>(kFit, group); c > 1; --c)
    if (group % c == 0) {
      block = c;
      break;
    }
  work.resize(kFit * span);
  for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += block) {
    if constexpr (kFit >= 4) {
      if (block == 4) { heads_block<T, K, V, NV, 4>(q, keys, values, out, slots, span, g, h0, scale, work.data()); continue; }
      if (block == 3) { heads_block<T, K, V, NV, 3>(q, keys, values, out, slots, span, g, h0, scale, work.data()); continue; }
    }
    if constexpr (kFit >= 2) {
      if (block == 2) { heads_block<T, K, V, NV, 2>(q, keys, values, out, slots, span, g, h0, scale, work.data()); continue; }
    }
    heads_block<T, K, V, NV, 1>(q, keys, values, out, slots, span, g, h0, scale, work.data());
  }
}
#endif

// The query heads of kv head g in row `q` over slots[first, last): out row written per head.
template <typename T, typename K, typename V>
void attend_unit(const T* q, const Side<K>& keys, const Side<V>& values, T* out, const int64_t* slots, int64_t first,
                 int64_t last, int64_t g, int64_t group, float scale, std::vector<float>& work) {
  const int64_t span = last - first, dk = keys.dim, dv = values.dim;
#if defined(__AVX512F__)
  if (dk == dv && (dk == 64 || dk == 128 || dk == 256)) {
    if (dk == 64) return group_blocks<T, K, V, 4>(q, keys, values, out, slots + first, span, g, group, scale, work);
    if (dk == 128) return group_blocks<T, K, V, 8>(q, keys, values, out, slots + first, span, g, group, scale, work);
    return group_blocks<T, K, V, 16>(q, keys, values, out, slots + first, span, g, group, scale, work);
  }
#endif
  work.resize(span + dk + dv);
  float* p = work.data();
  float* qf = p + span;
  float* o = qf + dk;
  for (int64_t head = g * group; head < (g + 1) * group; ++head) {
    for (int64_t j = 0; j < dk; ++j) qf[j] = value_of(q + head * dk, j);
    float top = -INFINITY;
    for (int64_t t = 0; t < span; ++t) {
      const int64_t slot = slots[first + t];
      p[t] = dot_row(qf, keys.row(slot, g), dk) * keys.scale(slot, g) * scale;
      top = std::max(top, p[t]);
    }
    const float total = mlxcel::exp_shifted(p, span, top);
    std::fill(o, o + dv, 0.0f);
    for (int64_t t = 0; t < span; ++t) {
      const int64_t slot = slots[first + t];
      add_row(o, p[t] * values.scale(slot, g), values.row(slot, g), dv);
    }
    for (int64_t j = 0; j < dv; ++j) put(out + head * dv, j, o[j] / total);
  }
}

// x's n vectors of `dim` into `slot`s of one side: copied as they are, or as int8 with
// scale = absmax / 127 and q = round-half-even(x / max(scale, FLT_MIN)), clamped to +-127.
template <typename T>
void write_side(const T* x, const int64_t* slot, int64_t n, int64_t kv_heads, int64_t dim, void* data, float* scales) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < kv_heads; ++g) {
      const T* v = x + (i * kv_heads + g) * dim;
      const int64_t at = slot[i] * kv_heads + g;
      if (scales == nullptr) {
        std::memcpy(static_cast<T*>(data) + at * dim, v, dim * sizeof(T));
        continue;
      }
      float top = 0.0f;
      for (int64_t j = 0; j < dim; ++j) top = std::max(top, std::fabs(value_of(v, j)));
      const float scale = top / 127.0f, div = std::max(scale, std::numeric_limits<float>::min());
      int8_t* q = static_cast<int8_t*>(data) + at * dim;
      for (int64_t j = 0; j < dim; ++j)
        q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(value_of(v, j) / div), -127.0f, 127.0f));
      scales[at] = scale;
    }
}

// ~32 Ki multiply-adds: below it, a step's units stay on the calling thread
constexpr int64_t kShareFrom = 1 << 15;

template <typename T, typename K, typename V>
void attend_rows(const T* q, const Side<K>& keys, const Side<V>& values, T* out, const int64_t* tab,
                 int64_t row_stride, const int64_t* len, int64_t rows, int64_t heads, int64_t window, float scale) {
  const int64_t kv_heads = keys.kv_heads, group = heads / kv_heads, units = rows * kv_heads;
  const auto first_of = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, len[i] - window) : 0; };
  int64_t work = 0;
  for (int64_t i = 0; i < rows; ++i) work += (len[i] - first_of(i)) * heads * (keys.dim + values.dim);
  const int64_t chunks = work < kShareFrom ? 1 : units;
  const int64_t per = (units + chunks - 1) / chunks;
  mlxcel::parallel(chunks, [&](int64_t c) {
    std::vector<float> scratch;
    for (int64_t u = c * per, end = std::min(units, u + per); u < end; ++u) {
      const int64_t i = u / kv_heads, g = u % kv_heads;
      attend_unit(q + i * heads * keys.dim, keys, values, out + i * heads * values.dim, tab + i * row_stride,
                  first_of(i), len[i], g, group, scale, scratch);
    }
  }, rows > mlxcel::kPromptRows);
}

void check_side(const at::Tensor& data, const std::optional<at::Tensor>& scales, at::ScalarType dtype,
                const char* what) {
  TORCH_CHECK(data.device().is_cpu() && data.dim() == 3 && data.is_contiguous(), "attention_int8: ", what,
              " must be contiguous [slots, kv_heads, dim] on the CPU");
  if (scales.has_value() && scales->defined()) {
    TORCH_CHECK(data.scalar_type() == at::kChar, "attention_int8: ", what, " with scales must be int8");
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->dim() == 2 &&
                    scales->size(0) == data.size(0) && scales->size(1) == data.size(1),
                "attention_int8: ", what, " scales must be contiguous fp32 [slots, kv_heads]");
  } else {
    TORCH_CHECK(data.scalar_type() == dtype, "attention_int8: ", what, " without scales must be the query's dtype");
  }
}

template <typename E>
Side<E> side(const at::Tensor& data, const std::optional<at::Tensor>& scales) {
  const bool q = scales.has_value() && scales->defined();
  return {reinterpret_cast<const E*>(data.data_ptr()), q ? scales->data_ptr<float>() : nullptr, data.size(1),
          data.size(2)};
}

void write_rows(const at::Tensor& keys, const std::optional<at::Tensor>& key_scales, const at::Tensor& values,
                const std::optional<at::Tensor>& value_scales, const at::Tensor& new_keys, const at::Tensor& new_values,
                const at::Tensor& slots, at::ScalarType dtype) {
  const int64_t rows = slots.numel(), kvh = keys.size(1), dk = keys.size(2), dv = values.size(2);
  TORCH_CHECK(slots.scalar_type() == at::kLong && new_keys.scalar_type() == dtype && new_values.scalar_type() == dtype &&
                  new_keys.numel() == rows * kvh * dk && new_values.numel() == rows * kvh * dv,
              "attention_int8: the new keys and values do not match the slots and the cache");
  at::Tensor sc = slots.contiguous(), kc = new_keys.contiguous(), vc = new_values.contiguous();
  const int64_t* at = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(at[i] >= 0 && at[i] < keys.size(0), "attention_int8: write slot out of range");
  const auto scales_of = [](const std::optional<at::Tensor>& s) {
    return s.has_value() && s->defined() ? s->data_ptr<float>() : nullptr;
  };
  const auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    write_side(reinterpret_cast<const T*>(kc.data_ptr()), at, rows, kvh, dk, keys.data_ptr(), scales_of(key_scales));
    write_side(reinterpret_cast<const T*>(vc.data_ptr()), at, rows, kvh, dv, values.data_ptr(),
               scales_of(value_scales));
  };
  if (dtype == at::kBFloat16) {
    run(static_cast<uint16_t*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr));
  }
}

at::Tensor attention_int8(const at::Tensor& q, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                          const at::Tensor& values, const std::optional<at::Tensor>& value_scales,
                          const at::Tensor& table, const at::Tensor& lengths, int64_t window, double scale,
                          const std::optional<at::Tensor>& new_keys, const std::optional<at::Tensor>& new_values,
                          const std::optional<at::Tensor>& write_at) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "attention_int8 takes bf16 or fp32 queries");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3, "attention_int8 takes q [rows, heads, dim] on the CPU");
  check_side(keys, key_scales, dtype, "keys");
  check_side(values, value_scales, dtype, "values");
  TORCH_CHECK(table.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && table.dim() == 2 &&
                  lengths.dim() == 1 && (table.size(0) == q.size(0) || table.size(0) == 1) &&
                  lengths.size(0) == q.size(0),
              "attention_int8 takes an int64 slot table [rows or 1, keys] and lengths [rows]");
  const int64_t rows = q.size(0), heads = q.size(1), dk = q.size(2);
  const int64_t slots = keys.size(0), kv_heads = keys.size(1), dv = values.size(2);
  TORCH_CHECK(keys.size(2) == dk && values.size(0) == slots && values.size(1) == kv_heads && kv_heads > 0 &&
                  heads % kv_heads == 0,
              "attention_int8: q, keys and values do not agree");
  if (write_at.has_value() && write_at->defined()) {
    TORCH_CHECK(new_keys.has_value() && new_values.has_value(), "attention_int8: slots need new keys and values");
    write_rows(keys, key_scales, values, value_scales, *new_keys, *new_values, *write_at, dtype);
  }
  at::Tensor qc = q.contiguous(), tc = table.contiguous(), lc = lengths.contiguous();
  const int64_t width = tc.size(1), row_stride = tc.size(0) == 1 ? 0 : width;
  const int64_t* tab = tc.data_ptr<int64_t>();
  const int64_t* len = lc.data_ptr<int64_t>();
  std::vector<int64_t> longest(tc.size(0), 0);
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= width, "attention_int8: row ", i, " has length ", len[i],
                " outside its table of ", width);
    longest[row_stride ? i : 0] = std::max(longest[row_stride ? i : 0], len[i]);
  }
  for (int64_t r = 0; r < tc.size(0); ++r)
    for (int64_t t = 0; t < longest[r]; ++t)
      TORCH_CHECK(tab[r * width + t] >= 0 && tab[r * width + t] < slots, "attention_int8: slot out of range");
  at::Tensor out = at::empty({rows, heads, dv}, q.options());
  const bool k8 = keys.scalar_type() == at::kChar, v8 = values.scalar_type() == at::kChar;
  const auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* qs = reinterpret_cast<const T*>(qc.data_ptr());
    T* os = reinterpret_cast<T*>(out.data_ptr());
    const auto go = [&](const auto& ks, const auto& vs) {
      attend_rows(qs, ks, vs, os, tab, row_stride, len, rows, heads, window, static_cast<float>(scale));
    };
    if (k8 && v8) go(side<int8_t>(keys, key_scales), side<int8_t>(values, value_scales));
    if (k8 && !v8) go(side<int8_t>(keys, key_scales), side<T>(values, value_scales));
    if (!k8 && v8) go(side<T>(keys, key_scales), side<int8_t>(values, value_scales));
    if (!k8 && !v8) go(side<T>(keys, key_scales), side<T>(values, value_scales));
  };
  if (dtype == at::kBFloat16) {
    run(static_cast<uint16_t*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlxcel_cpu, lib) {
  lib.def("attention_int8(Tensor q, Tensor(a!) keys, Tensor(b!)? key_scales, Tensor(c!) values, "
          "Tensor(d!)? value_scales, Tensor table, Tensor lengths, int window, float scale, Tensor? new_keys=None, "
          "Tensor? new_values=None, Tensor? slots=None) -> Tensor");
  lib.impl("attention_int8", c10::DispatchKey::CPU, &attention_int8);
}
