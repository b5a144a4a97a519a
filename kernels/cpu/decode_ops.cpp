// The small per-layer ops of a decode step, fused, for the torch backend on the CPU; prompt
// chunks take them too (row by row, so a prompt token's bits do not depend on its chunk).
//
// With the weights read fast (rows_linear.cpp), a one-token step of a small model spends most of
// its time in transformers' eager ops: an RMSNorm is eight ops, applying RoPE fourteen, and SDPA
// over a short history costs more to set up than to compute. Each
// op here does one of those in one call, row by row, so a row's result never depends on what
// else the call holds:
//   rms_norm          a family's RMSNorm: Llama's form (normalise, round to the input dtype,
//                     times the weight) or Gemma's (times 1 + weight in fp32, then round);
//   rope              q * cos + rotate_half(q) * sin for q and k, rounding after every
//                     product and sum exactly as the eager ops do, so its bits are theirs;
//   decode_attention  one query per row over that row's paged keys and values: fp32 scores,
//                     softmax and weighted sum, read through the row's slot table (after
//                     writing the rows' new keys and values into their slots, when given);
//   prompt_attention  the same for a prompt chunk's tokens, each over its own prefix of one
//                     table: scores from AMX tiles where they apply (prompt_rows_amx).
// References: the families' own modules and transformers' SDPA attention
// (tests/models/test_torch_decode_ops.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "helpers.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using mlxcel::narrow;
using mlxcel::widen;

inline float load(const uint16_t* p, int64_t i) { return widen(p[i]); }
inline float load(const float* p, int64_t i) { return p[i]; }
// the input dtype's rounding of an fp32 value
inline float round_to(float v, const uint16_t*) { return widen(narrow(v)); }
inline float round_to(float v, const float*) { return v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = narrow(v); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }

// sixteen partial sums, so compilers vectorise the reduction without reassociating it
template <typename A, typename B>
float dot(const A* a, const B* b, int64_t n) {
  float part[16] = {0};
  for (int64_t j = 0; j < n; ++j) part[j & 15] += load(a, j) * load(b, j);
  float s = 0;
  for (float v : part) s += v;
  return s;
}

void check_float(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, what, " must be ", dtype, ", not ", t.scalar_type());
}

template <typename T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// ~256 Ki multiply-adds per chunk: a one-token step's ops stay on the calling thread
constexpr int64_t kGrain = 1 << 18;

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps, bool offset) {
  const int64_t per = std::max<int64_t>(1, kGrain / d);
  mlxcel::parallel((rows + per - 1) / per, [&](int64_t c) {
    for (int64_t r = c * per, end = std::min(rows, r + per); r < end; ++r) {
      const T* xr = x + r * d;
      T* yr = y + r * d;
      const float inv = 1.0f / std::sqrt(dot(xr, xr, d) / static_cast<float>(d) + eps);
      for (int64_t j = 0; j < d; ++j) {
        const float h = load(xr, j) * inv;
        // Gemma: (x * inv) * (1 + w) in fp32, rounded once; Llama: round, then times w
        const float v = offset ? h * (1.0f + load(w, j)) : load(w, j) * round_to(h, x);
        store(yr, j, v);
      }
    }
  }, rows > mlxcel::kPromptRows);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "rms_norm takes bf16 or fp32");
  check_float(x, dtype, "x");
  check_float(weight, dtype, "weight");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous(), "weight must be [x.size(-1)]");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t rows = d ? x.numel() / d : 0;
  if (dtype == at::kBFloat16) {
    rms_norm_rows(data<uint16_t>(xc), data<uint16_t>(weight), data<uint16_t>(y), rows, d, static_cast<float>(eps),
                  offset);
  } else {
    rms_norm_rows(data<float>(xc), data<float>(weight), data<float>(y), rows, d, static_cast<float>(eps), offset);
  }
  return y;
}

// x [b, n, heads, dim] rotated by cos/sin [b, n, dim]: each product and the sum round to T
// as the eager `(x * cos) + (rotate_half(x) * sin)` does.
template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* y, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * dim;
    const T* s = sin + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + (t * heads + h) * dim;
      T* yr = y + (t * heads + h) * dim;
      for (int64_t j = 0; j < dim; ++j) {
        const float rot = j < half ? -load(xr, j + half) : load(xr, j - half);
        const float a = round_to(load(xr, j) * load(c, j), x);
        const float b = round_to(rot * load(s, j), x);
        store(yr, j, a + b);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "rope takes bf16 or fp32");
  for (const auto* t : {&q, &k, &cos, &sin}) check_float(*t, dtype, "q, k, cos and sin");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes(),
              "rope takes q, k [batch, tokens, heads, dim] and cos, sin [batch, tokens, dim]");
  const int64_t b = q.size(0), n = q.size(1), dim = q.size(3);
  TORCH_CHECK(k.size(0) == b && k.size(1) == n && k.size(3) == dim && cos.size(0) == b && cos.size(1) == n &&
                  cos.size(2) == dim && dim % 2 == 0,
              "rope: shapes do not agree");
  at::Tensor qc = q.contiguous(), kc = k.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor qo = at::empty(q.sizes(), q.options()), ko = at::empty(k.sizes(), k.options());
  const auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_rows(data<T>(qc), data<T>(cc), data<T>(sc), data<T>(qo), b * n, q.size(2), dim);
    rope_rows(data<T>(kc), data<T>(cc), data<T>(sc), data<T>(ko), b * n, k.size(2), dim);
  };
  if (dtype == at::kBFloat16) {
    run(static_cast<uint16_t*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr));
  }
  return {qo, ko};
}

#if defined(__AVX512F__)
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 without AVX512 (eight lanes): the attention's dot products, value sums and exp below.
#define MLXCEL_DECODE_AVX2 1
using mlxcel::load8;
using mlxcel::reduce_add8;
#endif

using mlxcel::exp_shifted;

// q (fp32) . key over n values
template <typename T>
float dot_key(const float* q, const T* key, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load16(key + j), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(MLXCEL_DECODE_AVX2)
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(key + j), acc);
    return reduce_add8(acc);
  }
#endif
  return dot(q, key, n);
}

// dot_key for NB queries (dk apart) against one key, each key load shared: NB independent sums
// in flight where one alone waits on each multiply-add; each sum runs in dot_key's order.
template <typename T, int NB>
inline void dot_keys(const float* q, const T* key, int64_t dk, float* out) {
#if defined(__AVX512F__)
  if (dk % 16 == 0) {
    __m512 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm512_setzero_ps();
    for (int64_t j = 0; j < dk; j += 16) {
      const __m512 k = load16(key + j);
      for (int b = 0; b < NB; ++b) acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps(q + b * dk + j), k, acc[b]);
    }
    for (int b = 0; b < NB; ++b) out[b] = _mm512_reduce_add_ps(acc[b]);
    return;
  }
#elif defined(MLXCEL_DECODE_AVX2)
  if (dk % 8 == 0) {
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t j = 0; j < dk; j += 8) {
      const __m256 k = load8(key + j);
      for (int b = 0; b < NB; ++b) acc[b] = _mm256_fmadd_ps(_mm256_loadu_ps(q + b * dk + j), k, acc[b]);
    }
    for (int b = 0; b < NB; ++b) out[b] = reduce_add8(acc[b]);
    return;
  }
#endif
  for (int b = 0; b < NB; ++b) out[b] = dot_key(q + b * dk, key, dk);
}

// acc += p * value over n values
template <typename T>
void add_value(float* acc, float p, const T* value, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t j = 0; j < n; j += 16)
      _mm512_storeu_ps(acc + j, _mm512_fmadd_ps(pv, load16(value + j), _mm512_loadu_ps(acc + j)));
    return;
  }
#elif defined(MLXCEL_DECODE_AVX2)
  if (n % 8 == 0) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t j = 0; j < n; j += 8)
      _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(pv, load8(value + j), _mm256_loadu_ps(acc + j)));
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) acc[j] += p * load(value, j);
}

// A history row a few positions ahead, requested into the cache: a paged history is read through
// its slot table and was last touched a token ago (out of the cache since the weights streamed
// through), so without this each row waits on memory (fp32 on AVX2: ~1.5 GB/s, L=150).
constexpr int64_t kAhead = 8;
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 3);
}

// The general form: a row's visible slots in pieces of kPiece, each piece's partial softmax per
// query head (its top score, the sum of exp(score - top), the unnormalised value sum) folded in
// piece order (fold), so a row's bits depend on its own span alone, whichever thread took which
// piece. A piece reads every kv head of a slot together (one contiguous run of the paged row),
// and a one-row step still splits over the threads. One piece is the one-pass softmax exactly.
constexpr int64_t kPiece = 64;

// acc[dv] = the sum over t < span of p[t] * value row t (head offset `off` of the paged rows
// through `slots`), t in order for every lane as add_value sums them, but the sums of a block of
// lanes held in registers across t instead of in memory.
template <typename T>
void weigh_rows(const float* p, const T* values, const int64_t* slots, int64_t span, int64_t vrow, int64_t off,
                int64_t dv, float* acc, bool ahead) {
  int64_t j0 = 0;
#if defined(__AVX512F__)
  for (; j0 + 128 <= dv; j0 += 128) {
    __m512 r[8];
    for (int v = 0; v < 8; ++v) r[v] = _mm512_setzero_ps();
    for (int64_t t = 0; t < span; ++t) {
      if (ahead && t + kAhead < span) prefetch_bytes(values + slots[t + kAhead] * vrow, vrow * sizeof(T));
      const T* row = values + slots[t] * vrow + off + j0;
      const __m512 pv = _mm512_set1_ps(p[t]);
      for (int v = 0; v < 8; ++v) r[v] = _mm512_fmadd_ps(pv, load16(row + 16 * v), r[v]);
    }
    for (int v = 0; v < 8; ++v) _mm512_storeu_ps(acc + j0 + 16 * v, r[v]);
  }
#elif defined(MLXCEL_DECODE_AVX2)
  for (; j0 + 64 <= dv; j0 += 64) {
    __m256 r[8];
    for (int v = 0; v < 8; ++v) r[v] = _mm256_setzero_ps();
    for (int64_t t = 0; t < span; ++t) {
      if (ahead && t + kAhead < span) prefetch_bytes(values + slots[t + kAhead] * vrow, vrow * sizeof(T));
      const T* row = values + slots[t] * vrow + off + j0;
      const __m256 pv = _mm256_set1_ps(p[t]);
      for (int v = 0; v < 8; ++v) r[v] = _mm256_fmadd_ps(pv, load8(row + 8 * v), r[v]);
    }
    for (int v = 0; v < 8; ++v) _mm256_storeu_ps(acc + j0 + 8 * v, r[v]);
  }
#endif
  if (j0 == dv) return;
  std::fill(acc + j0, acc + dv, 0.0f);
  for (int64_t t = 0; t < span; ++t) add_value(acc + j0, p[t], values + slots[t] * vrow + off + j0, dv - j0);
}

// The partial of one row over its slots [a, b) into part: [heads] tops, [heads] totals, then
// [heads, dv] value sums.
template <typename T>
void attend_piece(const T* q, const T* keys, const T* values, const int64_t* slots, int64_t a, int64_t b,
                  int64_t heads, int64_t kv_heads, int64_t dk, int64_t dv, float scale, float* part,
                  std::vector<float>& work) {
  const int64_t span = b - a, group = heads / kv_heads, krow = kv_heads * dk, vrow = kv_heads * dv;
  float* top = part;
  float* total = part + heads;
  float* acc = part + 2 * heads;
  work.resize(heads * (dk + span));
  float* qf = work.data();           // [heads, dk] the queries in fp32
  float* scores = qf + heads * dk;   // [heads, span]
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < dk; ++j) qf[h * dk + j] = load(q + h * dk, j);
    top[h] = -INFINITY;
  }
  for (int64_t t = 0; t < std::min(kAhead, span); ++t) prefetch_bytes(keys + slots[a + t] * krow, krow * sizeof(T));
  float s[4];
  for (int64_t t = 0; t < span; ++t) {
    if (t + kAhead < span) prefetch_bytes(keys + slots[a + t + kAhead] * krow, krow * sizeof(T));
    const T* row = keys + slots[a + t] * krow;
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t r = 0; r < group; r += 4) {  // up to four heads of one kv head at a time
        const int64_t h = g * group + r, nb = std::min<int64_t>(4, group - r);
        switch (nb) {
          case 4: dot_keys<T, 4>(qf + h * dk, row + g * dk, dk, s); break;
          case 3: dot_keys<T, 3>(qf + h * dk, row + g * dk, dk, s); break;
          case 2: dot_keys<T, 2>(qf + h * dk, row + g * dk, dk, s); break;
          default: dot_keys<T, 1>(qf + h * dk, row + g * dk, dk, s); break;
        }
        for (int64_t b = 0; b < nb; ++b) {
          scores[(h + b) * span + t] = s[b] * scale;
          top[h + b] = std::max(top[h + b], s[b] * scale);
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) total[h] = exp_shifted(scores + h * span, span, top[h]);
  for (int64_t t = 0; t < std::min(kAhead, span); ++t) prefetch_bytes(values + slots[a + t] * vrow, vrow * sizeof(T));
  for (int64_t h = 0; h < heads; ++h)  // the first head's pass brings the rows in for the rest
    weigh_rows(scores + h * span, values, slots + a, span, vrow, (h / group) * dv, dv, acc + h * dv, h == 0);
}

// One row's n partials (attend_piece's layout, one after another) folded in order into its
// output [heads, dv]: each step rescales both sides to the larger top.
template <typename T>
void fold(const float* parts, int64_t n, int64_t heads, int64_t dv, T* out, std::vector<float>& work) {
  const int64_t stride = heads * (2 + dv);
  work.resize(dv);
  float* acc = work.data();
  for (int64_t h = 0; h < heads; ++h) {
    float top = parts[h], total = parts[heads + h];
    std::copy_n(parts + 2 * heads + h * dv, dv, acc);
    for (int64_t p = 1; p < n; ++p) {
      const float* part = parts + p * stride;
      const float next = std::max(top, part[h]);
      const float keep = std::exp(top - next), take = std::exp(part[h] - next);
      total = total * keep + part[heads + h] * take;
      const float* add = part + 2 * heads + h * dv;
      for (int64_t j = 0; j < dv; ++j) acc[j] = acc[j] * keep + add[j] * take;
      top = next;
    }
    for (int64_t j = 0; j < dv; ++j) store(out + h * dv, j, acc[j] / total);
  }
}

#if defined(__AVX512F__)
// A paged history is read row by row through its slot table, a token ago at the least (out of
// the cache by now): the rows a few positions ahead are requested early.
constexpr int64_t kAheadRows = 8;
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// Row t of a paged history (its slot table, kv head g) as NV vectors; row t + kAheadRows is
// requested meanwhile.
template <typename T, int NV>
inline void paged_row(const T* base, const int64_t* slots, int64_t t, int64_t span, int64_t kv_heads, int64_t g,
                      __m512 (&out)[NV]) {
  constexpr int64_t D = NV * 16;
  if (t + kAheadRows < span) prefetch_row(base + (slots[t + kAheadRows] * kv_heads + g) * D, D);
  const T* row = base + (slots[t] * kv_heads + g) * D;
  for (int v = 0; v < NV; ++v) out[v] = load16(row + v * 16);
}

// Query heads [h0, h0 + HB) of kv head g, for dk == dv == 16 * NV: the heads' vectors stay in
// registers, and each key and value row is loaded once for all of them.
template <typename T, int NV, int HB>
void attend_heads(const T* q, const T* keys, const T* values, T* out, const int64_t* slots, int64_t first,
                  int64_t span, int64_t g, int64_t h0, int64_t kv_heads, float scale, float* scores, float* row) {
  constexpr int64_t D = NV * 16;
  __m512 qv[HB][NV];
  float top[HB], total[HB];
  for (int r = 0; r < HB; ++r) {
    for (int v = 0; v < NV; ++v) qv[r][v] = load16(q + (h0 + r) * D + v * 16);
    top[r] = -INFINITY;
  }
  for (int64_t t = 0; t < span; ++t) {
    __m512 kv[NV];
    paged_row(keys, slots + first, t, span, kv_heads, g, kv);
    for (int r = 0; r < HB; ++r) {
      __m512 acc = _mm512_mul_ps(qv[r][0], kv[0]);
      for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(qv[r][v], kv[v], acc);
      const float s = _mm512_reduce_add_ps(acc) * scale;
      scores[r * span + t] = s;
      top[r] = std::max(top[r], s);
    }
  }
  for (int r = 0; r < HB; ++r) total[r] = exp_shifted(scores + r * span, span, top[r]);
  __m512 o[HB][NV];
  for (int r = 0; r < HB; ++r)
    for (int v = 0; v < NV; ++v) o[r][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < span; ++t) {
    __m512 vv[NV];
    paged_row(values, slots + first, t, span, kv_heads, g, vv);
    for (int r = 0; r < HB; ++r) {
      const __m512 p = _mm512_set1_ps(scores[r * span + t]);
      for (int v = 0; v < NV; ++v) o[r][v] = _mm512_fmadd_ps(p, vv[v], o[r][v]);
    }
  }
  for (int r = 0; r < HB; ++r) {
    const __m512 sum = _mm512_set1_ps(total[r]);
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(row + v * 16, _mm512_div_ps(o[r][v], sum));
    T* dst = out + (h0 + r) * D;
    for (int64_t j = 0; j < D; ++j) store(dst, j, row[j]);
  }
}

// attend_group for dk == dv == 16 * NV: the group's heads in blocks of as many as fit in
// registers beside a key row (a block's heads compute exactly as they would one by one).
template <typename T, int NV>
void attend_group_fixed(const T* q, const T* keys, const T* values, T* out, const int64_t* slots, int64_t first,
                        int64_t last, int64_t g, int64_t group, int64_t kv_heads, float scale,
                        std::vector<float>& work) {
  constexpr int kFit = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
  int64_t block = 1;
  for (int64_t c = std::min<int64_t>(kFit, group); c > 1; --c)
    if (group % c == 0) {
      block = c;
      break;
    }
  const int64_t span = last - first;
  work.resize(kFit * span + NV * 16);
  float* scores = work.data();
  float* row = scores + kFit * span;
  const T* qg = q + g * group * NV * 16;
  T* og = out + g * group * NV * 16;
  for (int64_t h0 = 0; h0 < group; h0 += block) {
    if constexpr (kFit >= 4) {
      if (block == 4) { attend_heads<T, NV, 4>(qg, keys, values, og, slots, first, span, g, h0, kv_heads, scale, scores, row); continue; }
      if (block == 3) { attend_heads<T, NV, 3>(qg, keys, values, og, slots, first, span, g, h0, kv_heads, scale, scores, row); continue; }
    }
    if constexpr (kFit >= 2) {
      if (block == 2) { attend_heads<T, NV, 2>(qg, keys, values, og, slots, first, span, g, h0, kv_heads, scale, scores, row); continue; }
    }
    attend_heads<T, NV, 1>(qg, keys, values, og, slots, first, span, g, h0, kv_heads, scale, scores, row);
  }
}
#endif

// The register-resident form applies (AVX512, dk == dv of 64, 128 or 256): a (row, kv head)
// unit at a time; else the pieces above.
inline bool register_form(int64_t dk, int64_t dv) {
#if defined(__AVX512F__)
  return dk == dv && (dk == 64 || dk == 128 || dk == 256);
#else
  return false;
#endif
}

#if defined(__AVX512F__)
template <typename T>
void attend_unit(const T* q, const T* keys, const T* values, T* out, const int64_t* slots, int64_t first,
                 int64_t last, int64_t g, int64_t group, int64_t kv_heads, int64_t dk, float scale,
                 std::vector<float>& work) {
  switch (dk) {
    case 64: return attend_group_fixed<T, 4>(q, keys, values, out, slots, first, last, g, group, kv_heads, scale, work);
    case 128: return attend_group_fixed<T, 8>(q, keys, values, out, slots, first, last, g, group, kv_heads, scale, work);
    default: return attend_group_fixed<T, 16>(q, keys, values, out, slots, first, last, g, group, kv_heads, scale, work);
  }
}
#endif

#if MLXCEL_AMX
// o[r] += p[r][t] * v[t] for t in [t0, t1), R query rows at once sharing each value row load;
// then out row r = o[r] / total[r]. Outside a row's own span its p are zero: fma(0, v, o) is o
// exactly (values are finite), so a row's bits are those of summing its span alone.
template <int NV, int R>
void weigh_values(const float* vf, float* const* p, const float* total, int64_t t0, int64_t t1, uint16_t* const* dst) {
  constexpr int64_t D = NV * 16;
  __m512 o[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) o[r][v] = _mm512_setzero_ps();
  for (int64_t t = t0; t < t1; ++t) {
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_ps(vf + t * D + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 pt = _mm512_set1_ps(p[r][t]);
      for (int v = 0; v < NV; ++v) o[r][v] = _mm512_fmadd_ps(pt, vv[v], o[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[D];
    const __m512 sum = _mm512_set1_ps(total[r]);
    for (int v = 0; v < NV; ++v) _mm512_store_ps(row + v * 16, _mm512_div_ps(o[r][v], sum));
    for (int64_t j = 0; j < D; ++j) store(dst[r], j, row[j]);
  }
}

// Prompt rows' attention, query rows [r0, r0 + n) over one slot table, for dk == dv == 16 * NV
// (bf16). A prompt chunk's queries share their keys, so the scores come from AMX tiles: 16
// queries of one head x 16 keys per tile, each score one tile element summed over the head
// dimension in fixed 32-wide steps, so a query's scores do not depend on which queries share
// its tile (a prompt split into other chunks gets the same bits). Then per query: fp32 softmax
// over its span and its values summed in fp32, in key order (weigh_values).
template <int NV>
void prompt_rows_amx(const uint16_t* q, const uint16_t* keys, const uint16_t* values, uint16_t* out,
                     const int64_t* slots, const int64_t* len, int64_t r0, int64_t n, int64_t heads,
                     int64_t kv_heads, int64_t window, float scale) {
  constexpr int64_t D = NV * 16, S = D / 32, kT = 16;  // S tile steps over the head dimension
  constexpr int kRows = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;  // queries per pass over the values
  const int64_t group = heads / kv_heads;
  const auto first_of = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, len[i] - window) : 0; };
  int64_t most = 0, least = INT64_MAX;
  for (int64_t i = r0; i < r0 + n; ++i) {
    most = std::max(most, len[i]);
    least = std::min(least, first_of(i));
  }
  // the key blocks any query sees: [base, base + blocks), keys base * 16 .. on
  const int64_t base = least / kT, blocks = (most + kT - 1) / kT - base, width = blocks * kT;
  // keys as tiles [kv head][key block][step][16 pairs][16 keys] of bf16 pairs; values in fp32
  // [kv head][key][D], both read once here instead of once per query
  std::vector<uint32_t> kp(kv_heads * blocks * S * kT * kT, 0);
  std::vector<float> vf(kv_heads * width * D);
  mlxcel::parallel(kv_heads, [&](int64_t g) {
    for (int64_t j = least; j < most; ++j) {
      const int64_t at = j - base * kT;
      const auto* src = reinterpret_cast<const uint32_t*>(keys + (slots[j] * kv_heads + g) * D);
      uint32_t* dst = kp.data() + (g * blocks + at / kT) * S * kT * kT + at % kT;
      for (int64_t p = 0; p < D / 2; ++p) dst[(p / kT) * kT * kT + (p % kT) * kT] = src[p];
      const uint16_t* v = values + (slots[j] * kv_heads + g) * D;
      for (int64_t d = 0; d < D; ++d) vf[(g * width + at) * D + d] = widen(v[d]);
    }
  }, true);
  const int64_t query_blocks = (n + kT - 1) / kT;
  mlxcel::parallel(heads * query_blocks, [&](int64_t u) {
    const int64_t h = u / query_blocks, t0 = r0 + (u % query_blocks) * kT, g = h / group;
    const int64_t tn = std::min(kT, r0 + n - t0);
    alignas(64) uint16_t qt[kT * D] = {};  // the block's queries of head h, zero past the last
    int64_t block_most = 0, block_least = INT64_MAX;
    for (int64_t r = 0; r < tn; ++r) {
      std::memcpy(qt + r * D, q + ((t0 + r) * heads + h) * D, D * 2);
      block_most = std::max(block_most, len[t0 + r]);
      block_least = std::min(block_least, first_of(t0 + r));
    }
    thread_local std::vector<float> scores;  // [16 queries][width], key j at column j - base * 16
    scores.resize(kT * width);
    mlxcel::amx_configure();
    for (int64_t kb = block_least / kT; kb * kT < block_most; ++kb) {
      _tile_zero(0);
      for (int64_t s = 0; s < S; ++s) {
        _tile_loadd(1, qt + s * 32, D * 2);
        _tile_loadd(2, kp.data() + ((g * blocks + kb - base) * S + s) * kT * kT, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, scores.data() + (kb - base) * kT, width * 4);
    }
    _tile_release();
    float total[kT];
    float* p[kT];
    uint16_t* dst[kT];
    for (int64_t r = 0; r < tn; ++r) {  // each query's softmax over its own span [first, len)
      const int64_t i = t0 + r, first = first_of(i), span = len[i] - first;
      float* row = scores.data() + r * width - base * kT;  // indexed by key
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < span; j += 16) {
        const __mmask16 m = span - j >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (span - j)) - 1);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + first + j), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(row + first + j, m, v);
        top = _mm512_mask_max_ps(top, m, top, v);
      }
      total[r] = exp_shifted(row + first, span, _mm512_reduce_max_ps(top));
      std::fill(row + block_least, row + first, 0.0f);
      std::fill(row + len[i], row + block_most, 0.0f);
      p[r] = row;
      dst[r] = out + (i * heads + h) * D;
    }
    const float* vg = vf.data() + (g * width - base * kT) * D;  // indexed by key
    int64_t r = 0;
    for (; r + kRows <= tn; r += kRows)
      weigh_values<NV, kRows>(vg, p + r, total + r, block_least, block_most, dst + r);
    for (; r < tn; ++r) weigh_values<NV, 1>(vg, p + r, total + r, block_least, block_most, dst + r);
  }, true);
}
#endif

// Each row's new key and value [rows, kv_heads, dim] into its slot first, when given (a decode
// step's cache write, done here instead of as two scatter ops per layer).
void write_slots(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& new_keys, const at::Tensor& new_values,
                 const at::Tensor& slots) {
  const int64_t rows = slots.numel(), per_k = keys.size(1) * keys.size(2), per_v = values.size(1) * values.size(2);
  TORCH_CHECK(slots.scalar_type() == at::kLong && new_keys.scalar_type() == keys.scalar_type() &&
                  new_values.scalar_type() == values.scalar_type() && new_keys.numel() == rows * per_k &&
                  new_values.numel() == rows * per_v,
              "decode_attention: the new keys and values do not match the slots and the cache");
  at::Tensor sc = slots.contiguous(), kc = new_keys.contiguous(), vc = new_values.contiguous();
  const int64_t* at = data<int64_t>(sc);
  const int64_t size = keys.element_size();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(at[i] >= 0 && at[i] < keys.size(0), "decode_attention: write slot out of range");
    std::memcpy(data<char>(keys) + at[i] * per_k * size, data<char>(kc) + i * per_k * size, per_k * size);
    std::memcpy(data<char>(values) + at[i] * per_v * size, data<char>(vc) + i * per_v * size, per_v * size);
  }
}

// decode_attention and prompt_attention: `prompt` takes the AMX scores where they apply.
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& table,
                     const at::Tensor& lengths, int64_t window, double scale, const std::optional<at::Tensor>& new_keys,
                     const std::optional<at::Tensor>& new_values, const std::optional<at::Tensor>& write_at,
                     bool prompt) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "decode_attention takes bf16 or fp32");
  for (const auto* t : {&q, &keys, &values}) check_float(*t, dtype, "q, keys and values");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3 && keys.is_contiguous() && values.is_contiguous(),
              "decode_attention takes q [rows, heads, dim] and contiguous keys, values [slots, kv_heads, dim]");
  TORCH_CHECK(table.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && table.dim() == 2 &&
                  lengths.dim() == 1 && (table.size(0) == q.size(0) || table.size(0) == 1) &&
                  lengths.size(0) == q.size(0),
              "decode_attention takes an int64 slot table [rows or 1, keys] and lengths [rows]");
  const int64_t rows = q.size(0), heads = q.size(1), dk = q.size(2);
  const int64_t slots = keys.size(0), kv_heads = keys.size(1), dv = values.size(2);
  TORCH_CHECK(keys.size(2) == dk && values.size(0) == slots && values.size(1) == kv_heads && kv_heads > 0 &&
                  heads % kv_heads == 0,
              "decode_attention: q, keys and values do not agree");
  if (write_at.has_value() && write_at->defined()) {
    TORCH_CHECK(new_keys.has_value() && new_values.has_value(), "decode_attention: slots need new keys and values");
    write_slots(keys, values, *new_keys, *new_values, *write_at);
  }
  at::Tensor qc = q.contiguous(), tc = table.contiguous(), lc = lengths.contiguous();
  const int64_t width = tc.size(1);
  const int64_t* tab = data<int64_t>(tc);
  const int64_t* len = data<int64_t>(lc);
  // one table row for every query row: a prompt chunk's tokens, each over its own prefix
  const int64_t row_stride = tc.size(0) == 1 ? 0 : width;
  int64_t work = 0;
  std::vector<int64_t> longest(tc.size(0), 0);
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= width, "decode_attention: row ", i, " has length ", len[i],
                " outside its table of ", width);
    int64_t& most = longest[row_stride ? i : 0];
    most = std::max(most, len[i]);
    work += len[i] * heads * (dk + dv);
  }
  for (int64_t r = 0; r < tc.size(0); ++r)
    for (int64_t t = 0; t < longest[r]; ++t)
      TORCH_CHECK(tab[r * width + t] >= 0 && tab[r * width + t] < slots, "decode_attention: slot out of range");
  at::Tensor out = at::empty({rows, heads, dv}, q.options());
#if MLXCEL_AMX
  if (prompt && dtype == at::kBFloat16 && dk == dv && (dk == 64 || dk == 128 || dk == 256) &&
      mlxcel::amx_permitted()) {
    const auto run = [&](auto nv) {
      constexpr int NV = decltype(nv)::value;
      // the rows sharing one table run together; a table per row: each row alone
      const int64_t together = row_stride == 0 ? rows : 1;
      for (int64_t r0 = 0; r0 < rows; r0 += together)
        prompt_rows_amx<NV>(data<uint16_t>(qc), data<uint16_t>(keys), data<uint16_t>(values), data<uint16_t>(out),
                            tab + (row_stride == 0 ? 0 : r0 * width), len, r0, together, heads, kv_heads, window,
                            static_cast<float>(scale));
    };
    if (dk == 64) run(std::integral_constant<int, 4>{});
    if (dk == 128) run(std::integral_constant<int, 8>{});
    if (dk == 256) run(std::integral_constant<int, 16>{});
    return out;
  }
#endif
  const auto first_of = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, len[i] - window) : 0; };
  const auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* qs = data<T>(qc);
    const T* ks = data<T>(keys);
    const T* vs = data<T>(values);
    T* os = data<T>(out);
#if defined(__AVX512F__)
    if (register_form(dk, dv)) {
      // one chunk per (row, kv head) once the step is big enough to share; a unit's arithmetic
      // is the same on any thread
      const int64_t group = heads / kv_heads, units = rows * kv_heads;
      const int64_t chunks = work < kGrain ? 1 : units;
      const int64_t per = (units + chunks - 1) / chunks;
      mlxcel::parallel(chunks, [&](int64_t c) {
        std::vector<float> scratch;
        for (int64_t u = c * per, end = std::min(units, u + per); u < end; ++u) {
          const int64_t i = u / kv_heads, g = u % kv_heads;
          attend_unit(qs + i * heads * dk, ks, vs, os + i * heads * dv, tab + i * row_stride, first_of(i), len[i], g,
                      group, kv_heads, dk, static_cast<float>(scale), scratch);
        }
      }, rows > mlxcel::kPromptRows);
      return;
    }
#endif
    const int64_t stride = heads * (2 + dv);
    const auto piece = [&](int64_t i, int64_t p, float* part, std::vector<float>& scratch) {
      const int64_t a = first_of(i) + p * kPiece;
      attend_piece(qs + i * heads * dk, ks, vs, tab + i * row_stride, a, std::min(len[i], a + kPiece), heads,
                   kv_heads, dk, dv, static_cast<float>(scale), part, scratch);
    };
    const auto pieces = [&](int64_t i) { return (len[i] - first_of(i) + kPiece - 1) / kPiece; };
    if (rows > mlxcel::kPromptRows) {  // a prompt chunk: a row per unit, its pieces in turn
      mlxcel::parallel(rows, [&](int64_t i) {
        std::vector<float> parts(pieces(i) * stride), scratch;
        for (int64_t p = 0; p < pieces(i); ++p) piece(i, p, parts.data() + p * stride, scratch);
        fold(parts.data(), pieces(i), heads, dv, os + i * heads * dv, scratch);
      }, true);
      return;
    }
    // a decode step: every piece of every row a unit (once there is enough to share), folded after
    std::vector<int64_t> row_of, index;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t p = 0; p < pieces(i); ++p) row_of.push_back(i), index.push_back(p);
    const int64_t units = static_cast<int64_t>(row_of.size());
    std::vector<float> parts(units * stride);
    const int64_t chunks = work < kGrain / 8 ? 1 : units;
    const int64_t per = (units + chunks - 1) / chunks;
    mlxcel::parallel(chunks, [&](int64_t c) {
      std::vector<float> scratch;
      for (int64_t u = c * per, end = std::min(units, u + per); u < end; ++u)
        piece(row_of[u], index[u], parts.data() + u * stride, scratch);
    });
    std::vector<float> scratch;
    for (int64_t u = 0; u < units; u += pieces(row_of[u]))
      fold(parts.data() + u * stride, pieces(row_of[u]), heads, dv, os + row_of[u] * heads * dv, scratch);
  };
  if (dtype == at::kBFloat16) {
    run(static_cast<uint16_t*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr));
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& table,
                            const at::Tensor& lengths, int64_t window, double scale,
                            const std::optional<at::Tensor>& new_keys, const std::optional<at::Tensor>& new_values,
                            const std::optional<at::Tensor>& write_at) {
  return attention(q, keys, values, table, lengths, window, scale, new_keys, new_values, write_at, false);
}

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& table,
                            const at::Tensor& lengths, int64_t window, double scale) {
  return attention(q, keys, values, table, lengths, window, scale, std::nullopt, std::nullopt, std::nullopt, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlxcel_cpu, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps, bool offset) -> Tensor");
  lib.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  lib.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  lib.impl("rope", c10::DispatchKey::CPU, &rope);
  lib.def("decode_attention(Tensor q, Tensor(a!) keys, Tensor(b!) values, Tensor table, Tensor lengths, int window, "
          "float scale, Tensor? new_keys=None, Tensor? new_values=None, Tensor? slots=None) -> Tensor");
  lib.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  lib.def("prompt_attention(Tensor q, Tensor keys, Tensor values, Tensor table, Tensor lengths, int window, "
          "float scale) -> Tensor");
  lib.impl("prompt_attention", c10::DispatchKey::CPU, &prompt_attention);
}
