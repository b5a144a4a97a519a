// Prompt rows' bf16 linears on Intel AMX tiles: y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]).
//
// Why not torch's own bf16 linear: it is fast, but a row's last bits depend on how many rows
// the call holds (its kernels block the work by the call's shape), so a prompt prefilled as one
// chunk and the same prompt prefilled as a cached prefix plus the rest got KV a few bf16 steps
// apart from layer 0 on, and greedy text could differ with and without the prompt cache.
// Here every output is one fp32 accumulator tile element
// summed over the same 32-wide steps of k in the same order, whatever the call's row count and
// wherever the row sits in its tile, so a row's result is the same alone or among 500.
//
// Layout: the weight is the tiles' A operand as it lies in memory (16 weight rows x 32 k), the
// activations are packed per call into the B operand's pair-interleaved form (16 k pairs x 16
// rows), so C holds 16 outputs x 16 rows; four C tiles (32 x 32) per pass over k. Edges (rows
// or k beyond the matrix) read zero-padded copies, never past the tensors. Work is split over
// torch's own threads (helpers.h, `parallel`'s prompt form).
// Reference: F.linear in fp32 on the same bf16 values (tests/models/test_torch_prompt_tiles.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "helpers.h"

namespace {

#if MLXCEL_AMX
constexpr int64_t kT = 16;   // tile rows, and outputs / activation rows per tile
constexpr int64_t kK = 32;   // bf16 values of k per tile step (64 bytes)
// k steps per block (see tiles): 8 KiB of weight tiles, which stay in L1 beside the streamed
// activation tiles; SmolLM2's 210 products at 512 rows took 1.34 and 1.61x torch's time with 4,
// 2.0-2.2x with 8 or 16 (scripts/bench/torch_prompt_products.py)
constexpr int64_t kBlock = 4;

// r[i][j] -> r[j][i] for a 16 x 16 block of 32-bit values (four rounds of shuffles).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane L: rows i, i+1 at columns 4L..4L+3
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4g + e], lane L: column 4L + e of rows 4g..4g+3
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {  // then the lanes gathered across the four row groups
    t[e] = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
    t[4 + e] = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    t[8 + e] = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    t[12 + e] = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm512_shuffle_f32x4(t[e], t[8 + e], 0x88);
    r[8 + e] = _mm512_shuffle_f32x4(t[e], t[8 + e], 0xDD);
    r[4 + e] = _mm512_shuffle_f32x4(t[4 + e], t[12 + e], 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(t[4 + e], t[12 + e], 0xDD);
  }
}

// Sixteen fp32 values to bf16, nearest-even as mlxcel::narrow (NaN -> 0x7fc0).
inline __m256i narrow16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

// x [rows, k] -> tiles [row block][k step][16 pairs][16 rows] of bf16 pairs, zero past either
// edge; row blocks rounded up to pairs, as each pass takes two.
std::vector<uint32_t> pack_rows(const uint16_t* x, int64_t rows, int64_t k, int64_t row_blocks, int64_t steps) {
  std::vector<uint32_t> out(row_blocks * steps * kT * kT, 0);
  const mlxcel::Helpers::Fn block = [&](int64_t mb) {
    for (int64_t s = 0; s < steps; ++s) {
      uint32_t* tile = out.data() + (mb * steps + s) * kT * kT;
      const int64_t cols = std::min(kK, k - s * kK);
      const uint16_t* src = x + mb * kT * k + s * kK;
      if (cols == kK && (mb + 1) * kT <= rows) {  // a whole tile: 16 rows of 16 pairs, transposed
        __m512 r[kT];
        for (int64_t mi = 0; mi < kT; ++mi) r[mi] = _mm512_castsi512_ps(_mm512_loadu_si512(src + mi * k));
        transpose16(r);
        for (int64_t p = 0; p < kT; ++p) _mm512_storeu_si512(tile + p * kT, _mm512_castps_si512(r[p]));
        continue;
      }
      for (int64_t mi = 0; mi < kT && mb * kT + mi < rows; ++mi) {
        uint32_t pairs[kT] = {};
        std::memcpy(pairs, src + mi * k, cols * 2);  // little-endian: element 2p in the low half
        for (int64_t p = 0; p < kT; ++p) tile[p * kT + mi] = pairs[p];
      }
    }
  };
  mlxcel::parallel((rows + kT - 1) / kT, block, true);
  return out;
}

void tiles(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t rows, int64_t n, int64_t k) {
  const int64_t steps = (k + kK - 1) / kK;
  const int64_t row_blocks = ((rows + kT - 1) / kT + 1) / 2 * 2;
  const std::vector<uint32_t> xp = pack_rows(x, rows, k, row_blocks, steps);
  const int64_t out_pairs = (n + 2 * kT - 1) / (2 * kT);
  // one chunk: 32 outputs from n0 for every row; tile registers 0-3 the sums (outputs x rows),
  // 4-5 weight tiles, 6-7 activation tiles
  const mlxcel::Helpers::Fn chunk = [&](int64_t c) {
    mlxcel::amx_configure();
    const int64_t n0 = c * 2 * kT;
    // where each weight tile (2 per step) is read: the matrix itself (16 rows a row apart), or
    // a zero-padded copy where the tile crosses an edge (the last rows, a ragged last step)
    thread_local std::vector<uint16_t> edge;
    thread_local std::vector<const uint16_t*> src;
    thread_local std::vector<int64_t> stride;
    edge.resize(2 * steps * kT * kK);
    src.resize(2 * steps);
    stride.resize(2 * steps);
    for (int t = 0; t < 2; ++t)
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t base = n0 + t * kT, cols = std::min(kK, k - s * kK), i = t * steps + s;
        if (base + kT <= n && cols == kK) {
          src[i] = w + base * k + s * kK;
          stride[i] = k * 2;
          continue;
        }
        uint16_t* tile = edge.data() + i * kT * kK;
        std::memset(tile, 0, kT * kK * 2);
        for (int64_t r = 0; r < kT && base + r < n; ++r) std::memcpy(tile + r * kK, w + (base + r) * k + s * kK, cols * 2);
        src[i] = tile;
        stride[i] = kK * 2;
      }
    // k in blocks of kBlock steps, so the pass's weight tiles for a block can stay in L1 while
    // every row pair meets them; the fp32 sums wait in `sums` between blocks (stored exactly, so
    // the order of additions, and the bits, are those of one pass over k)
    thread_local std::vector<float> sums;
    sums.resize(row_blocks / 2 * 4 * kT * kT);
    for (int64_t s0 = 0; s0 < steps; s0 += kBlock) {
      const int64_t s1 = std::min(steps, s0 + kBlock);
      for (int64_t mb = 0; mb < row_blocks; mb += 2) {
        const uint32_t* x0 = xp.data() + mb * steps * kT * kT;
        const uint32_t* x1 = x0 + steps * kT * kT;
        float* acc = sums.data() + mb / 2 * 4 * kT * kT;
        if (s0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, acc, 64);
          _tile_loadd(1, acc + kT * kT, 64);
          _tile_loadd(2, acc + 2 * kT * kT, 64);
          _tile_loadd(3, acc + 3 * kT * kT, 64);
        }
        for (int64_t s = s0; s < s1; ++s) {
          _tile_loadd(4, src[s], stride[s]);
          _tile_loadd(5, src[steps + s], stride[steps + s]);
          _tile_loadd(6, x0 + s * kT * kT, 64);
          _tile_loadd(7, x1 + s * kT * kT, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, acc, 64);
        _tile_stored(1, acc + kT * kT, 64);
        _tile_stored(2, acc + 2 * kT * kT, 64);
        _tile_stored(3, acc + 3 * kT * kT, 64);
      }
    }
    _tile_release();
    for (int64_t mb = 0; mb < row_blocks; mb += 2) {
      const float* acc = sums.data() + mb / 2 * 4 * kT * kT;
      // acc tile 2 t + b holds outputs n0 + 16 t + i (its rows) x activation rows 16 (mb + b) + j
      // (its columns): transposed, each activation row's 16 sums are rounded and written as
      // one run of y's row
      for (int t = 0; t < 2; ++t) {
        const int64_t o = n0 + t * kT;
        if (o >= n) break;
        const __mmask16 keep = static_cast<__mmask16>((1u << std::min<int64_t>(kT, n - o)) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + o) : _mm512_setzero_ps();
        for (int b = 0; b < 2; ++b) {
          __m512 r[kT];
          for (int64_t i = 0; i < kT; ++i) r[i] = _mm512_loadu_ps(acc + (2 * t + b) * kT * kT + i * kT);
          transpose16(r);
          for (int64_t j = 0; j < kT && (mb + b) * kT + j < rows; ++j)
            _mm256_mask_storeu_epi16(y + ((mb + b) * kT + j) * n + o, keep, narrow16(_mm512_add_ps(r[j], add)));
        }
      }
    }
  };
  mlxcel::parallel(out_pairs, chunk, true);
}
#endif

bool tiles_available() {
#if MLXCEL_AMX
  return mlxcel::amx_permitted();
#else
  return false;
#endif
}

at::Tensor tiles_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(tiles_available(), "this CPU (or this build) has no AMX bf16 tiles");
  mlxcel::Linear l = mlxcel::linear_operands(x, weight, bias);
#if MLXCEL_AMX
  tiles(l.xs(), reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), l.bs(), l.ys(), l.rows, l.n, l.k);
#endif
  return l.y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlxcel_cpu, lib) {
  lib.def("tiles_available() -> bool", &tiles_available);
  lib.def("tiles_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  lib.impl("tiles_linear", c10::DispatchKey::CPU, &tiles_linear);
}
