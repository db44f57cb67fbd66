// Block int8 for tensors crossing the network (ZeRO++'s qwZ and qgZ; zerorun/runtime/comm/quantize.py
// describes the format). Exported with a C ABI; zerorun/ops.py builds it with torch.utils.cpp_extension
// and calls it through ctypes.
//
// Why it exists: torch needs five passes over memory to quantize (block maxima, a divide into scratch,
// round, clamp, the cast to int8) and two to dequantize-and-add, each pass a full sweep of a tensor
// far larger than the cache. Here a block of 2048 elements (8 KiB of fp32) is read once for its
// maximum and once more, from L1, to quantize: one sweep of memory each way.
//
// Same bits as torch's path: the scale is max|x| / 127 in fp32 (1 when the block is all zero), each
// value is x / scale rounded half to even and clamped to [-127, 127], and dequantizing is one fp32
// product (plus one sum when accumulating: no fused multiply-add, -ffp-contract=off), so a rank with
// the kernel and a rank without it send and compute the same values. A block holding an inf or a NaN
// gets a NaN scale and zero values, so every element it dequantizes to is a NaN: the loss scaler's
// overflow check still sees it (torch's path, by its own arithmetic, gives NaNs there too).
//
// Vectorisation: plain loops under `omp simd`, the rounding done by adding and subtracting 1.5 * 2^23
// (exact round-half-to-even for |v| < 2^22 in SSE2, no SSE4.1 `roundps` needed), compiled twice on x86-64
// (AVX2 and baseline) and picked at run time, as cpu_adam.cpp does.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "adam.h"

namespace {

using namespace zerorun;

constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: v + kRound - kRound rounds v half to even

template <int kIn>
inline __attribute__((always_inline)) void quantize_block(const void* __restrict x, int64_t begin, int64_t count,
                                                          int8_t* __restrict values, float* __restrict scale,
                                                          int64_t block) {
  float largest = 0.0f, probe = 0.0f;  // probe: 0, or NaN if the block holds an inf or a NaN
#pragma omp simd reduction(max : largest) reduction(+ : probe)
  for (int64_t i = 0; i < count; ++i) {
    const float v = load_as_float<kIn>(x, begin + i);
    const float a = fabsf(v);
    largest = a > largest ? a : largest;
    probe += v - v;
  }
  if (probe != probe) {
    *scale = bits_to_float(0x7FC00000u);
    std::fill(values, values + block, int8_t(0));
    return;
  }
  float s = largest / 127.0f;
  s = s == 0.0f ? 1.0f : s;
  *scale = s;
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    float q = (load_as_float<kIn>(x, begin + i) / s + kRound) - kRound;
    q = q > 127.0f ? 127.0f : q;
    q = q < -127.0f ? -127.0f : q;
    values[i] = static_cast<int8_t>(static_cast<int32_t>(q));
  }
  std::fill(values + count, values + block, int8_t(0));  // the last block's padding
}

template <int kOut, bool kAccumulate>
inline __attribute__((always_inline)) void dequantize_block(const int8_t* __restrict values, float scale,
                                                            void* __restrict out, int64_t begin, int64_t count) {
  if (kOut == kFloat32) {
    float* __restrict o = static_cast<float*>(out) + begin;
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) {
      const float product = static_cast<float>(values[i]) * scale;
      o[i] = kAccumulate ? o[i] + product : product;
    }
  } else {
    uint16_t* __restrict o = static_cast<uint16_t*>(out) + begin;
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) o[i] = float_to_lowp<kOut>(static_cast<float>(values[i]) * scale);
  }
}

// Blocks [first, last) of an n-element tensor.
template <int kIn>
inline __attribute__((always_inline)) void quantize_blocks(const void* x, int64_t n, int64_t block, int8_t* values, float* scales, int64_t first,
                     int64_t last) {
  for (int64_t b = first; b < last; ++b) {
    const int64_t begin = b * block;
    quantize_block<kIn>(x, begin, std::min(block, n - begin), values + begin, scales + b, block);
  }
}

template <int kOut, bool kAccumulate>
inline __attribute__((always_inline)) void dequantize_blocks(const int8_t* values, const float* scales, int64_t n, int64_t block, void* out, int64_t first,
                       int64_t last) {
  for (int64_t b = first; b < last; ++b) {
    const int64_t begin = b * block;
    dequantize_block<kOut, kAccumulate>(values + begin, scales[b], out, begin, std::min(block, n - begin));
  }
}

template <int kIn>
void quantize_blocks_generic(const void* x, int64_t n, int64_t block, int8_t* values, float* scales, int64_t first,
                             int64_t last) {
  quantize_blocks<kIn>(x, n, block, values, scales, first, last);
}

template <int kOut, bool kAccumulate>
void dequantize_blocks_generic(const int8_t* values, const float* scales, int64_t n, int64_t block, void* out,
                               int64_t first, int64_t last) {
  dequantize_blocks<kOut, kAccumulate>(values, scales, n, block, out, first, last);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ZR_X86_DISPATCH 1
template <int kIn>
__attribute__((target("avx2,f16c"))) void quantize_blocks_avx2(const void* x, int64_t n, int64_t block,
                                                               int8_t* values, float* scales, int64_t first,
                                                               int64_t last) {
  quantize_blocks<kIn>(x, n, block, values, scales, first, last);
}

template <int kOut, bool kAccumulate>
__attribute__((target("avx2,f16c"))) void dequantize_blocks_avx2(const int8_t* values, const float* scales, int64_t n,
                                                                 int64_t block, void* out, int64_t first,
                                                                 int64_t last) {
  dequantize_blocks<kOut, kAccumulate>(values, scales, n, block, out, first, last);
}
#endif

enum Isa : int { kGeneric = 0, kAvx2 = 1 };
const char* const kIsaNames[] = {"generic", "avx2"};
std::atomic<int> g_isa{-1};  // chosen on first use; zr_quantize_use_isa may lower it (tests, benchmarks)

int best_isa() {
#ifdef ZR_X86_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return kAvx2;
#endif
  return kGeneric;
}

using QuantizeFn = void (*)(const void*, int64_t, int64_t, int8_t*, float*, int64_t, int64_t);
using DequantizeFn = void (*)(const int8_t*, const float*, int64_t, int64_t, void*, int64_t, int64_t);

template <int kIn>
QuantizeFn quantize_for_isa() {
#ifdef ZR_X86_DISPATCH
  if (g_isa == kAvx2) return &quantize_blocks_avx2<kIn>;
#endif
  return &quantize_blocks_generic<kIn>;
}

template <int kOut, bool kAccumulate>
DequantizeFn dequantize_for_isa() {
#ifdef ZR_X86_DISPATCH
  if (g_isa == kAvx2) return &dequantize_blocks_avx2<kOut, kAccumulate>;
#endif
  return &dequantize_blocks_generic<kOut, kAccumulate>;
}

// Splits blocks [0, blocks) over up to num_threads threads, each a contiguous range.
template <typename Fn>
void over_blocks(int64_t blocks, int64_t block, int num_threads, Fn fn) {
  constexpr int64_t kMinPerThread = 1 << 16;  // elements: below this a thread costs more than it saves
  const int64_t useful = std::max<int64_t>(1, blocks * block / kMinPerThread);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, useful)));
  if (threads == 1) {
    fn(int64_t(0), blocks);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t chunk = (blocks + team - 1) / team;
    const int64_t first = std::min(blocks, t * chunk), last = std::min(blocks, first + chunk);
    if (first < last) fn(first, last);
  }
}

}  // namespace

extern "C" {

// Selects the instruction set: -1 = the best this CPU has, else at most `level` (0 generic, 1 avx2).
// Returns the level in use.
int zr_quantize_use_isa(int level) {
  const int best = best_isa();
  g_isa = (level < 0 || level > best) ? best : level;
  return g_isa;
}

const char* zr_quantize_isa_name() {
  if (g_isa < 0) zr_quantize_use_isa(-1);
  return kIsaNames[g_isa];
}

// x (n elements of in_dtype, a zerorun::DType code) -> values (ceil(n / block) * block int8, the padding
// zero) and scales (ceil(n / block) fp32). Returns 0, or 1 for an unsupported dtype code.
int zr_quantize(const void* x, int in_dtype, int64_t n, int64_t block, int8_t* values, float* scales,
                int num_threads) {
  if (g_isa < 0) zr_quantize_use_isa(-1);
  QuantizeFn fn = in_dtype == kFloat32    ? quantize_for_isa<kFloat32>()
                  : in_dtype == kBFloat16 ? quantize_for_isa<kBFloat16>()
                  : in_dtype == kFloat16  ? quantize_for_isa<kFloat16>()
                                          : nullptr;
  if (fn == nullptr || block <= 0) return 1;
  over_blocks((n + block - 1) / block, block, num_threads,
              [&](int64_t first, int64_t last) { fn(x, n, block, values, scales, first, last); });
  return 0;
}

// out (n elements of out_dtype) = values * scales, or += when accumulate (fp32 only). Returns 0, or 1
// for an unsupported combination.
int zr_dequantize(const int8_t* values, const float* scales, int64_t n, int64_t block, void* out, int out_dtype,
                  int accumulate, int num_threads) {
  if (g_isa < 0) zr_quantize_use_isa(-1);
  DequantizeFn fn = nullptr;
  if (accumulate) {
    fn = out_dtype == kFloat32 ? dequantize_for_isa<kFloat32, true>() : nullptr;
  } else {
    fn = out_dtype == kFloat32    ? dequantize_for_isa<kFloat32, false>()
         : out_dtype == kBFloat16 ? dequantize_for_isa<kBFloat16, false>()
         : out_dtype == kFloat16  ? dequantize_for_isa<kFloat16, false>()
                                  : nullptr;
  }
  if (fn == nullptr || block <= 0) return 1;
  over_blocks((n + block - 1) / block, block, num_threads,
              [&](int64_t first, int64_t last) { fn(values, scales, n, block, out, first, last); });
  return 0;
}

}  // extern "C"
