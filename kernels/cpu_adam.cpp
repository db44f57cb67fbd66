// Adam(W) over one flat fp32 shard on the CPU, optionally writing the bf16/fp16 copy of the updated
// parameters in the same pass. Exported with a C ABI; zerorun/ops.py builds it with
// torch.utils.cpp_extension and calls it through ctypes.
//
// Why it exists: the update is memory-bound (~28 bytes per parameter), so raw speed matches torch's
// fused kernel; the gain is fusing more into the one pass over memory: the gradient unscale (without
// writing the gradient back), bf16/fp16 gradients, and the low-precision copy-out that would
// otherwise be a second pass.
//
// Vectorisation: the loop is plain scalar code the compiler vectorises (`omp simd`), compiled three times
// on x86-64 (AVX-512, AVX2+FMA, baseline SSE2) and picked at run time, so one build in a cache shared
// across machines is correct and fast everywhere (preferred_isa() says which runs by default). GCC makes
// 512-bit loops of the fp32 variants and keeps 256-bit ones where 16-bit values are read or written. With an
// FMA, the division by sqrt(1 - beta2^step) is an exact multiply-and-correct (adam.h): a sqrt and two
// divisions per element kept the divider busy for most of the time the memory needs when two cores share it.
//
// Threads: each thread of the OpenMP team owns one contiguous range, as torch's parallel_for cuts (so
// pages stay near the core that first touched them), and works through it grain by grain; a thread that
// is done takes grains from the others' ranges, so a thread the OS preempts (a shared host, the backward
// running beside an overlapped step) no longer holds the whole step back. Grains are multiples of 64
// bytes of every output, so no two threads write one cache line.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "adam.h"

namespace {

using namespace zerorun;


template <bool kDecoupled, bool kUnscale, int kGrad, int kLowp, bool kFma>
inline __attribute__((always_inline)) void adam_range(const Shard& s, const AdamConfig& config, int64_t begin,
                                                      int64_t end) {
  float* __restrict p = s.params;
  const void* __restrict g = s.grads;
  float* __restrict m = s.exp_avg;
  float* __restrict v = s.exp_avg_sq;
  uint16_t* __restrict out = static_cast<uint16_t*>(s.lowp_out);
  const AdamConfig c = config;  // a local copy: the stores through p/m/v cannot alias it
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    adam_update<kDecoupled, kUnscale, kFma, kFma>(pi, load_as_float<kGrad>(g, i), mi, vi, c);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (kLowp != kNone) out[i] = float_to_lowp<kLowp>(pi);
  }
}

using RangeFn = void (*)(const Shard&, const AdamConfig&, int64_t, int64_t);

enum Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"generic", "avx2", "avx512"};

#if defined(__x86_64__) && defined(__GNUC__)
#define ZR_X86_DISPATCH 1
constexpr bool kGenericHasFma = false;  // baseline x86-64
#else
constexpr bool kGenericHasFma = true;   // aarch64, ppc64le: FMA is part of the base ISA
#endif

template <bool D, bool U, int G, int L>
void range_generic(const Shard& s, const AdamConfig& c, int64_t b, int64_t e) {
  adam_range<D, U, G, L, kGenericHasFma>(s, c, b, e);
}

#ifdef ZR_X86_DISPATCH
template <bool D, bool U, int G, int L>
__attribute__((target("avx2,fma,f16c"))) void range_avx2(const Shard& s, const AdamConfig& c, int64_t b, int64_t e) {
  adam_range<D, U, G, L, true>(s, c, b, e);
}

template <bool D, bool U, int G, int L>
__attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma,f16c"))) void range_avx512(const Shard& s,
                                                                                     const AdamConfig& c, int64_t b,
                                                                                     int64_t e) {
  adam_range<D, U, G, L, true>(s, c, b, e);
}
#endif

// The widest variant this CPU can run.
int supported_isa() {
#ifdef ZR_X86_DISPATCH
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw"))
    return kAvx512;
  if (avx2) return kAvx2;
#endif
  return kGeneric;
}

// The variant that runs by default. AVX-512 only where measured to help (`zerorun bench adam`'s "zerorun avx2"
// and "zerorun avx512" rows): on AMD's cores (Zen 4 measured: less time per element in cache, as fast or faster
// from memory). Intel's were not measured (and some lower their clock for 512-bit arithmetic): AVX2 there.
int preferred_isa() {
  const int supported = supported_isa();
#ifdef ZR_X86_DISPATCH
  if (supported == kAvx512 && __builtin_cpu_is("amd")) return kAvx512;
#endif
  return std::min<int>(supported, kAvx2);
}

std::atomic<int> g_isa{-1};  // chosen on first use; zr_cpu_adam_use_isa may change it (tests, benchmarks)

template <bool D, bool U, int G, int L>
RangeFn for_isa() {
#ifdef ZR_X86_DISPATCH
  if (g_isa == kAvx512) return &range_avx512<D, U, G, L>;
  if (g_isa == kAvx2) return &range_avx2<D, U, G, L>;
#endif
  return &range_generic<D, U, G, L>;
}

template <bool D, bool U, int G>
RangeFn for_lowp(int lowp) {
  switch (lowp) {
    case kNone: return for_isa<D, U, G, kNone>();
    case kBFloat16: return for_isa<D, U, G, kBFloat16>();
    case kFloat16: return for_isa<D, U, G, kFloat16>();
    default: return nullptr;
  }
}

template <bool D, bool U>
RangeFn for_grad(int grad, int lowp) {
  switch (grad) {
    case kFloat32: return for_lowp<D, U, kFloat32>(lowp);
    case kBFloat16: return for_lowp<D, U, kBFloat16>(lowp);
    case kFloat16: return for_lowp<D, U, kFloat16>(lowp);
    default: return nullptr;
  }
}

RangeFn pick(bool decoupled, bool unscale, int grad, int lowp) {
  if (decoupled) return unscale ? for_grad<true, true>(grad, lowp) : for_grad<true, false>(grad, lowp);
  return unscale ? for_grad<false, true>(grad, lowp) : for_grad<false, false>(grad, lowp);
}

constexpr int64_t kMinPerThread = 1 << 15;  // below this a thread costs more than it saves
constexpr int64_t kAlign = 32;              // 64 bytes of a 2-byte output: no two threads write one cache line
constexpr int64_t kMaxGrain = 1 << 17;      // ~0.1 ms of one core: what a preempted thread can hold back

// A thread's contiguous range, consumed grain by grain from the front by its owner and by helpers.
struct alignas(64) Range {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

// [begin, end) of the next grain of `range`, or begin >= end when it is used up.
inline int64_t claim(Range& range, int64_t grain) { return range.next.fetch_add(grain, std::memory_order_relaxed); }

void run_team(RangeFn range, const Shard& shard, const AdamConfig& config, int64_t n, int threads) {
  const int64_t chunk = ((n + threads - 1) / threads + kAlign - 1) / kAlign * kAlign;
  const int64_t grain = std::min(kMaxGrain, std::max(kAlign, chunk / 8 / kAlign * kAlign));
  std::unique_ptr<Range[]> ranges(new Range[threads]);
  for (int t = 0; t < threads; ++t) {
    ranges[t].next.store(std::min(n, t * chunk), std::memory_order_relaxed);
    ranges[t].end = std::min(n, (t + 1) * chunk);
  }
#pragma omp parallel num_threads(threads)
  {
    // its own range first, then the others' in turn (so a smaller team than asked for still covers them all)
    const int self = omp_get_thread_num();
    for (int k = 0; k < threads; ++k) {
      const int victim = (self + k) % threads;
      Range& r = ranges[victim];
      for (int64_t begin = claim(r, grain); begin < r.end; begin = claim(r, grain))
        range(shard, config, begin, std::min(r.end, begin + grain));
    }
  }
}

}  // namespace

extern "C" {

// Selects the instruction set: -1 = the default for this CPU, else at most `level` (0 generic, 1 avx2,
// 2 avx512) of what it supports. Returns the level in use.
int zr_cpu_adam_use_isa(int level) {
  const int chosen = level < 0 ? preferred_isa() : std::min(level, supported_isa());
  g_isa = chosen;
  return chosen;
}

int zr_cpu_adam_isa() {
  if (g_isa < 0) zr_cpu_adam_use_isa(-1);
  return g_isa;
}

const char* zr_cpu_adam_isa_name(int level) {
  return (level >= kGeneric && level <= kAvx512) ? kIsaNames[level] : "?";
}

// One Adam(W) step over n elements. grad_dtype / lowp_dtype are zerorun::DType codes (lowp -1: none).
// Returns 0, or 1 for an unsupported dtype code.
int zr_cpu_adam(float* params, const void* grads, int grad_dtype, float* exp_avg, float* exp_avg_sq, void* lowp_out,
                int lowp_dtype, int64_t n, int64_t step, double lr, double beta1, double beta2, double eps,
                double weight_decay, int decoupled, double grad_divisor, int num_threads) {
  if (g_isa < 0) zr_cpu_adam_use_isa(-1);
  if (lowp_out == nullptr) lowp_dtype = kNone;
  const RangeFn range = pick(decoupled != 0, grad_divisor != 1.0, grad_dtype, lowp_dtype);
  if (range == nullptr) return 1;
  const AdamConfig config = make_adam_config(step, lr, beta1, beta2, eps, weight_decay, decoupled != 0, grad_divisor);
  const Shard shard{params, grads, exp_avg, exp_avg_sq, lowp_out};
  const int64_t useful = std::max<int64_t>(1, n / kMinPerThread);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, useful)));
  if (threads == 1) {
    range(shard, config, 0, n);
  } else {
    run_team(range, shard, config, n, threads);
  }
  return 0;
}

}  // extern "C"
