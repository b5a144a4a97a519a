// Few-row bf16 linears for the torch backend on the CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]).
//
// A decode step multiplies one activation row per sequence by every weight matrix, so its cost
// is reading the weights. torch's bf16 CPU kernels read them at 7-11 GB/s for one row here
// (docs/benchmarks.md, round 6); this one streams four weight rows at a time with a prefetch
// ahead, multiplies bf16 pairs natively (AVX512-BF16, else widened to fp32), sums in fp32,
// rounds to bf16 (nearest-even) and splits the output rows with its own helper threads (see
// Helpers). Up to eight activation rows share one pass over the weights, and a row's result
// does not depend on the others in the call. Reference: F.linear in fp32 on the same bf16
// values (tests/models/test_torch_row_kernel.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

inline float widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t narrow(float f) {  // round to nearest even, as torch's own conversion does
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512BF16__)
// Native bf16 pair products (AVX512-BF16): 32 weights per instruction, no widening.
constexpr int64_t kStep = 32;
using Mask = __mmask32;
inline Mask tail_mask(int64_t left) { return left >= 32 ? ~Mask(0) : static_cast<Mask>((1ull << left) - 1); }
inline __m512i load(const uint16_t* p, Mask mask) { return _mm512_maskz_loadu_epi16(mask, p); }
inline __m512 madd(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(w), reinterpret_cast<__m512bh&>(x));
}
#elif defined(__AVX512BW__)
// AVX512 without bf16 instructions: widen 16 weights to fp32 by a shift, then multiply-add.
constexpr int64_t kStep = 16;
using Mask = __mmask16;
inline Mask tail_mask(int64_t left) { return left >= 16 ? ~Mask(0) : static_cast<Mask>((1u << left) - 1); }
inline __m512i load(const uint16_t* p, Mask mask) {
  return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16);
}
inline __m512 madd(__m512 acc, __m512i w, __m512i x) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
}
#endif

constexpr int64_t kMaxRows = 8;    // activation rows per pass over the weights
// weight rows prefetched ahead: one token's 211 SmolLM2 products read at 16.6 GB/s against 13.3
// without the prefetch (15 paired rounds, docs/benchmarks.md round 6)
constexpr int64_t kAhead = 8;

// Every activation row's result is computed the same way whatever else the call holds: one
// fp32 sum per (row, output) over the same steps in the same order, reduced the same way, so a
// row alone and a row among eight give the same bits (engine batch invariance rests on this).
#if defined(__AVX512BW__)
// Weight rows [0, R) of w against activation rows [0, M) of x; the R * M sums stay in registers.
template <int R, int M>
void block(const uint16_t* x, const uint16_t* w, int64_t k, float* out) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += kStep) {
    const Mask mask = tail_mask(k - j);
    __m512i xv[M];
    for (int i = 0; i < M; ++i) xv[i] = load(x + i * k + j, mask);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kAhead + r) * k + j), _MM_HINT_T0);
      const __m512i wv = load(w + r * k + j, mask);
      for (int i = 0; i < M; ++i) acc[r][i] = madd(acc[r][i], wv, xv[i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) out[i * R + r] = _mm512_reduce_add_ps(acc[r][i]);
}
#else
// Portable form: sixteen partial sums per dot product, which compilers vectorise without -ffast-math.
template <int R, int M>
void block(const uint16_t* x, const uint16_t* w, int64_t k, float* out) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) {
      float part[16] = {0};
      for (int64_t j = 0; j < k; ++j) part[j & 15] += widen(w[r * k + j]) * widen(x[i * k + j]);
      float s = 0;
      for (int l = 0; l < 16; ++l) s += part[l];
      out[i * R + r] = s;
    }
}
#endif

using BlockFn = void (*)(const uint16_t*, const uint16_t*, int64_t, float*);

// Weight rows per block for m activation rows: four sums in flight for one row, and no more
// than eight accumulators' worth of registers beyond that.
struct Plan {
  int64_t rows;
  BlockFn full, single;  // a block of `rows` weight rows, and one weight row (a matrix's tail)
};

template <int M>
Plan plan_for() {
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  return {R, &block<R, M>, &block<1, M>};
}

Plan plan_for_rows(int64_t m) {
  switch (m) {
    case 1: return plan_for<1>();
    case 2: return plan_for<2>();
    case 3: return plan_for<3>();
    case 4: return plan_for<4>();
    case 5: return plan_for<5>();
    case 6: return plan_for<6>();
    case 7: return plan_for<7>();
    default: return plan_for<8>();
  }
}

// The kernel's own helper threads. The server runs torch's OpenMP pool with passive waiting
// (cli/server.py: spinning workers slowed everything sharing 2 cores), and waking a sleeping
// worker for each of a decode step's ~200 products cost up to ~13 ms per token here. These helpers
// spin briefly after each product (the next one comes within tens of microseconds inside a
// step), then sleep; the calling thread never waits for a sleeping helper: both claim chunks
// from one counter, so a helper that is late only takes fewer.
class Helpers {
 public:
  using Fn = std::function<void(int64_t)>;

  explicit Helpers(int count) {
    for (int i = 0; i < count; ++i) std::thread([this] { loop(); }).detach();
  }

  // fn(0) .. fn(chunks - 1), each once, on this thread and any helper awake to join. A second
  // caller meanwhile (another model's engine thread) runs its chunks alone.
  void run(int64_t chunks, const Fn& fn) {
    bool idle = false;
    if (!busy_.compare_exchange_strong(idle, true, std::memory_order_acquire)) {
      for (int64_t c = 0; c < chunks; ++c) fn(c);
      return;
    }
    const uint32_t gen = ++gen_;  // wraps after 2^32 products, harmlessly
    Job& job = jobs_[gen & 1];
    job.fn = &fn;
    job.chunks.store(chunks, std::memory_order_relaxed);
    job.done.store(0, std::memory_order_relaxed);
    ticket_.store(static_cast<uint64_t>(gen) << 32);  // publishes the job; seq_cst pairs with the sleepers' count
    if (sleepers_.load() > 0) ticket_.notify_all();
    claim(gen);
    // a helper still finishing its last chunk; yield now and then in case the OS preempted it
    for (int spins = 1; job.done.load(std::memory_order_acquire) < chunks; ++spins) {
      pause();
      if (spins % 4096 == 0) std::this_thread::yield();
    }
    busy_.store(false, std::memory_order_release);
  }

 private:
  struct Job {
    const Fn* fn = nullptr;
    std::atomic<int64_t> chunks{0};
    std::atomic<int64_t> done{0};
  };

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Take chunks of job `gen` until none is left (or a newer job replaced it).
  void claim(uint32_t gen) {
    Job& job = jobs_[gen & 1];
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t next = static_cast<int64_t>(t & 0xffffffffu);
      if (static_cast<uint32_t>(t >> 32) != gen || next >= job.chunks.load(std::memory_order_relaxed)) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      (*job.fn)(next);
      job.done.fetch_add(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void loop() {
    uint32_t seen = 0;
    auto idle_since = std::chrono::steady_clock::now();
    for (;;) {
      const uint64_t t = ticket_.load(std::memory_order_acquire);
      if (static_cast<uint32_t>(t >> 32) != seen) {
        seen = static_cast<uint32_t>(t >> 32);
        claim(seen);
        idle_since = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - idle_since < kSpin) {
        for (int i = 0; i < 64; ++i) pause();
      } else {
        sleepers_.fetch_add(1);
        ticket_.wait(t);  // returns at once if a job was published since t was read
        sleepers_.fetch_sub(1);
        idle_since = std::chrono::steady_clock::now();
      }
    }
  }

  static constexpr auto kSpin = std::chrono::microseconds(200);  // a step's gaps are tens of us
  std::atomic<uint64_t> ticket_{0};  // job generation << 32 | next chunk
  std::atomic<int> sleepers_{0};
  std::atomic<bool> busy_{false};  // a caller holds the helpers
  uint32_t gen_ = 0;  // jobs published (guarded by busy_)
  Job jobs_[2];  // a stale helper validates its generation before using a slot
};

// Set once by set_helpers (row_gemv.py passes torch's thread count minus one); never destroyed:
// detached threads outlive static destruction at exit. Without helpers every product runs on
// the calling thread.
std::atomic<Helpers*> g_helpers{nullptr};

void set_helpers(int64_t count) {
  if (count > 0 && g_helpers.load() == nullptr) g_helpers.store(new Helpers(static_cast<int>(count)));
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 tensors only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [out, in] matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(-1) == k && x.numel() > 0, "x's last dimension must equal the weight's input size");
  const int64_t rows = x.numel() / k;
  at::Tensor xc = x.contiguous();
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  std::vector<float> bf;
  if (bias.has_value() && bias->defined()) {
    at::Tensor b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == n, "bias must be bf16 [out]");
    const auto* bs = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
    bf.resize(n);
    for (int64_t i = 0; i < n; ++i) bf[i] = widen(bs[i]);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* bp = bf.empty() ? nullptr : bf.data();
  Helpers* pool = g_helpers.load(std::memory_order_acquire);
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {  // one pass over the weights per eight rows
    const int64_t m = std::min(kMaxRows, rows - m0);
    const Plan plan = plan_for_rows(m);
    const uint16_t* xm = xs + m0 * k;
    const int64_t blocks = (n + plan.rows - 1) / plan.rows;
    // grain: ~64 KiB of weights per chunk, so small matrices stay on the calling thread
    const int64_t grain = std::max<int64_t>(1, 65536 / (plan.rows * k * 2));
    const int64_t chunks = (blocks + grain - 1) / grain;
    const Helpers::Fn chunk = [&](int64_t c) {
      float out[kMaxRows * 4];
      for (int64_t blk = c * grain, end = std::min(blocks, blk + grain); blk < end; ++blk) {
        const int64_t n0 = blk * plan.rows;
        const int64_t nb = std::min(plan.rows, n - n0);
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
            ys[(m0 + i) * n + n0 + r] = narrow(out[i * nb + r] + (bp ? bp[n0 + r] : 0.0f));
      }
    };
    if (chunks == 1 || pool == nullptr) {
      for (int64_t c = 0; c < chunks; ++c) chunk(c);
    } else {
      pool->run(chunks, chunk);
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(mlxcel_cpu, lib) {
  lib.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  lib.impl("rows_linear", c10::DispatchKey::CPU, &rows_linear);
  lib.def("set_helpers(int count) -> ()", &set_helpers);
}
