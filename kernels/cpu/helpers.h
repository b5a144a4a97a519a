// Shared by mlxcel's CPU kernels (rows_linear.cpp, bf16_tiles.cpp, decode_ops.cpp, quant_rows.cpp), built
// into one library: bf16 <-> fp32 conversions, a linear's checked operands, the threads that split a
// kernel's work, and the read-ahead of the next products' weights.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Storage.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace mlxcel {

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

#if defined(__AVX2__)
// Eight fp32 lanes from bf16 bits (widened by a shift) or fp32, and their sum in one fixed order
// (halves, then pairs, then the last two): the AVX2 forms of the kernels share these.
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// p[j] = exp(p[j] - top) for j < n; returns their sum. The AVX512 and AVX2 forms are Cephes'
// expf polynomial (about 1 ulp), 16 or 8 scores at a time instead of one std::exp per score.
// (decode_ops.cpp's attention and kv_quant.cpp's share it)
inline float exp_shifted(float* p, int64_t n, float top) {
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + j), shift);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // exp(-87) ~ 1.6e-38: zero at fp32 scale beside the top's 1
    const __m512 n2 = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n2, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n2, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    y = _mm512_scalef_ps(y, n2);
    _mm512_mask_storeu_ps(p + j, m, y);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, y));
  }
  return _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
  // the same polynomial on eight lanes; 2^n built in the exponent bits (n >= -126 here)
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n - j, 8))), lane);
    __m256 x = _mm256_sub_ps(_mm256_maskload_ps(p + j, m), shift);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n2 = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n2, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n2, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n2), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    _mm256_maskstore_ps(p + j, m, y);
    sum = _mm256_add_ps(sum, _mm256_and_ps(y, _mm256_castsi256_ps(m)));
  }
  return reduce_add8(sum);
#else
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - top));
  return sum;
#endif
}

// A linear's operands, checked: y = x @ weight.T (+ bias), shaped [..., n], all of one dtype:
// bf16, or fp32 where `fp32` allows it (the row kernel's form for CPUs without bf16 instructions).
struct Linear {
  int64_t n, k, rows;
  at::Tensor x;              // contiguous
  std::vector<float> bias;   // in fp32; empty without one
  at::Tensor y;              // uninitialised
  bool bf16() const { return x.scalar_type() == at::kBFloat16; }
  const uint16_t* xs() const { return reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()); }
  uint16_t* ys() const { return reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()); }
  const float* xf() const { return x.data_ptr<float>(); }
  float* yf() const { return y.data_ptr<float>(); }
  const float* bs() const { return bias.empty() ? nullptr : bias.data(); }
};

inline Linear linear_operands(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              bool fp32 = false) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || (fp32 && dtype == at::kFloat), fp32 ? "bf16 or fp32 tensors only" : "bf16 tensors only");
  TORCH_CHECK(x.scalar_type() == dtype, "x and the weight must share a dtype");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [out, in] matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(-1) == k && x.numel() > 0, "x's last dimension must equal the weight's input size");
  std::vector<float> bf;
  if (bias.has_value() && bias->defined()) {
    at::Tensor b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == dtype && b.numel() == n, "bias must be [out] in the weight's dtype");
    bf.resize(n);
    if (dtype == at::kFloat) {
      std::memcpy(bf.data(), b.data_ptr<float>(), n * sizeof(float));
    } else {
      const auto* bs = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
      for (int64_t i = 0; i < n; ++i) bf[i] = widen(bs[i]);
    }
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return {n, k, x.numel() / k, x.contiguous(), std::move(bf), at::empty(shape, x.options())};
}

// The kernels' own helper threads. The server runs torch's OpenMP pool with passive waiting
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

  // Memory a helper reads into the cache while no job is pending, in order (rows_linear.cpp
  // names the weights the next products will read). Replaces the previous list; a range being
  // read when the list changes continues where it was. Each range holds its tensor's storage,
  // so memory freed meanwhile (a model unloaded) is never read.
  struct Range {
    const char* p;
    int64_t n;
    c10::Storage keep;
  };
  void read_ahead(std::vector<Range> ranges) {
    std::lock_guard<std::mutex> lock(ahead_mu_);
    size_t idx = 0;
    int64_t off = 0;
    for (size_t k = 0; k < ranges.size(); ++k)
      if (ranges[k].p == reading_) {
        idx = k;
        off = reading_off_;
        break;
      }
    ahead_ = std::move(ranges);
    ahead_idx_ = idx;
    ahead_off_ = off;
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

  // Read one slice of the read-ahead list (a load per cache line); false when none is left.
  bool read_some() {
    const char* p;
    int64_t n;
    c10::Storage keep;  // alive until this slice is read, whatever replaces the list
    {
      std::lock_guard<std::mutex> lock(ahead_mu_);
      if (ahead_idx_ >= ahead_.size()) return false;
      const Range& r = ahead_[ahead_idx_];
      keep = r.keep;
      p = r.p + ahead_off_;
      n = std::min<int64_t>(kSlice, r.n - ahead_off_);
      reading_ = r.p;
      reading_off_ = ahead_off_ += n;
      if (ahead_off_ >= r.n) {
        ++ahead_idx_;
        ahead_off_ = 0;
      }
    }
    uint64_t sink = 0;
    for (int64_t i = 0; i < n; i += 64) sink += static_cast<unsigned char>(p[i]);
    sink_.store(sink, std::memory_order_relaxed);  // keeps the loads
    return true;
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
      } else if (read_some()) {
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
  static constexpr int64_t kSlice = 16384;  // read-ahead bytes between looks for a job
  std::mutex ahead_mu_;
  std::vector<Range> ahead_;  // guarded by ahead_mu_, as are the three below
  size_t ahead_idx_ = 0;
  int64_t ahead_off_ = 0;
  const char* reading_ = nullptr;
  int64_t reading_off_ = 0;
  std::atomic<uint64_t> sink_{0};
  std::atomic<uint64_t> ticket_{0};  // job generation << 32 | next chunk
  std::atomic<int> sleepers_{0};
  std::atomic<bool> busy_{false};  // a caller holds the helpers
  uint32_t gen_ = 0;  // jobs published (guarded by busy_)
  Job jobs_[2];  // a stale helper validates its generation before using a slot
};

// Set once by set_helpers (row_gemv.py passes torch's thread count minus one); never destroyed:
// detached threads outlive static destruction at exit. Without helpers every product runs on
// the calling thread.
inline std::atomic<Helpers*> g_helpers{nullptr};

// fn(0) .. fn(chunks - 1): on the helpers when there are some and more than one chunk. A
// prompt-sized job (`prompt`: many rows) runs on torch's own threads instead: a prompt step's
// other ops are torch's multi-threaded ones, and a helper spinning after each job (as it should
// between a decode step's small products) took a core from them (elementwise ops ~5x slower).
inline void parallel(int64_t chunks, const Helpers::Fn& fn, bool prompt = false) {
  Helpers* pool = g_helpers.load(std::memory_order_acquire);
  if (prompt && chunks > 1) {
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) fn(c);
    });
  } else if (chunks == 1 || pool == nullptr) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
  } else {
    pool->run(chunks, fn);
  }
}

// More rows than a decode step holds: a prompt chunk's (see parallel).
constexpr int64_t kPromptRows = 32;

// The tensor that followed each weight tensor last time, so a helper can read the next products'
// weights into the cache while the caller is between products (Helpers::read_ahead). A decode
// step runs the same products in the same order every token, so last token's order names this
// token's next ones. One helper reads DRAM at ~10 GB/s here, so it covers part of a step's Python
// gaps' worth; 4 MiB ahead measured as well as 2 or 8 or better (rows_linear.cpp's bf16 rows). A
// packed product (quant_rows.cpp) notes its codes and scales, then asks after its biases, so
// the chain holds all three tensors of each product.
class LookAhead {
 public:
  // Record that `t` was read after the previous tensor noted.
  void note(const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mu_);
    note_locked(t);
  }

  // note(t), then the tensors that followed it last time, up to `budget` bytes.
  std::vector<Helpers::Range> after(const at::Tensor& t, int64_t budget) {
    const auto* w = static_cast<const char*>(t.data_ptr());
    std::lock_guard<std::mutex> lock(mu_);
    note_locked(t);
    std::vector<Helpers::Range> out;
    int64_t total = 0;
    for (const char* p = w; total < budget;) {
      auto it = next_.find(p);
      if (it == next_.end() || it->second.p == w) break;
      auto storage = it->second.storage.lock();
      if (!storage) {  // freed since: its successors are stale too
        next_.erase(it);
        break;
      }
      out.push_back({it->second.p, it->second.n, c10::Storage(std::move(storage))});
      total += it->second.n;
      p = it->second.p;
    }
    return out;
  }

 private:
  struct Next {
    const char* p;
    int64_t n;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  };
  void note_locked(const at::Tensor& t) {
    const auto* w = static_cast<const char*>(t.data_ptr());
    if (last_ != nullptr && last_ != w)
      next_.insert_or_assign(last_, Next{w, static_cast<int64_t>(t.nbytes()), t.storage().getWeakStorageImpl()});
    last_ = w;
  }
  std::mutex mu_;
  std::unordered_map<const char*, Next> next_;  // a tensor's data -> the one that followed it
  const char* last_ = nullptr;
};

inline LookAhead g_look_ahead;
inline std::atomic<int64_t> g_ahead_bytes{4 << 20};  // set_read_ahead (rows_linear.cpp); 0: off

// After a product that read `last` (its other tensors noted before it): have a helper read the
// next products' weights while the caller is away.
inline void read_ahead_after(const at::Tensor& last) {
  Helpers* pool = g_helpers.load(std::memory_order_acquire);
  const int64_t budget = g_ahead_bytes.load(std::memory_order_relaxed);
  if (pool != nullptr && budget > 0) pool->read_ahead(g_look_ahead.after(last, budget));
}

}  // namespace mlxcel
