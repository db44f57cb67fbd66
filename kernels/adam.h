// One Adam(W) element update, written once for the host (cpu_adam.cpp) and the device (fused_adam.cu).
//
// The arithmetic follows torch's fused Adam/AdamW operation for operation in fp32 (gradient divided
// by the divisor, decoupled decay as `p *= 1 - lr * wd` or L2 as `g += wd * p`, `exp_avg.lerp_`,
// denominator `sqrt(v) / sqrt(1 - beta2^step) + eps`), so our kernels and torch's fallback agree to
// an ulp and either can train a model. No torch headers: the kernels compile standalone (fast, and
// with plain nvcc in CI), and zerorun/ops.py calls them through a C ABI.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ZR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ZR_HOST_DEVICE inline __attribute__((always_inline))
#endif

namespace zerorun {

// Element types crossing the C ABI (ops.py passes these codes).
enum DType : int { kNone = -1, kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Per-step constants, computed once on the host in double precision like torch does, then used as fp32.
struct AdamConfig {
  float grad_divisor;          // gradients are divided by this (world size x loss scale / clip coefficient)
  float decay_factor;          // AdamW: p *= 1 - lr * weight_decay
  float l2;                    // Adam: g += weight_decay * p
  float lerp_weight;           // exp_avg.lerp_(g, 1 - beta1), in torch's two-sided form
  uint32_t lerp_from_grad;     //   (weight >= 0.5 interpolates from g's side for accuracy; not a bool: GCC
                               //   vectorises a select on a 32-bit value, not on a bool, in the CPU loop)
  float beta2;
  float one_minus_beta2;
  float step_size;             // lr / (1 - beta1^step)
  float bias_correction2_sqrt; // sqrt(1 - beta2^step)
  float bias_correction2_rsqrt; //   its correctly rounded reciprocal (for the CPU's exact quotient)
  float eps;
};

inline AdamConfig make_adam_config(int64_t step, double lr, double beta1, double beta2, double eps,
                                   double weight_decay, bool decoupled, double grad_divisor) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const double weight = 1.0 - beta1;
  const bool from_grad = !(std::fabs(static_cast<float>(weight)) < 0.5f);
  AdamConfig c;
  c.grad_divisor = static_cast<float>(grad_divisor);
  c.decay_factor = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
  c.lerp_weight = from_grad ? static_cast<float>(weight) - 1.0f : static_cast<float>(weight);
  c.lerp_from_grad = from_grad ? 1u : 0u;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.step_size = static_cast<float>(lr / bias_correction1);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  // 1 / x in double, then rounded to float, is the correctly rounded float reciprocal (a double holds more
  // than 2 x 24 + 2 bits, so the double rounding is innocuous)
  c.bias_correction2_rsqrt = static_cast<float>(1.0 / static_cast<double>(c.bias_correction2_sqrt));
  c.eps = static_cast<float>(eps);
  return c;
}

// ---- fp32 as bits (the exact quotient below and the bf16/fp16 conversions) ----

ZR_HOST_DEVICE uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

ZR_HOST_DEVICE float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// sqrt(v) / sqrt(1 - beta2^step), correctly rounded like torch's division. kReciprocal (needs an FMA) frees the
// divider, the CPU loop's bottleneck once the memory keeps up (one sqrt and two divisions per element): it
// multiplies by the correctly rounded reciprocal and corrects the quotient by its exact remainder, which
// gives the correctly rounded quotient (Markstein's theorem, given no underflow: sqrt(v) is 0 or >= 2^-75 and
// the divisor >= 2^-27 for any beta2 < 1, so the remainder is exact even as a subnormal, which torch keeps by
// default). Only an infinite sqrt(v) has no finite remainder: it passes through, as the division's inf.
template <bool kReciprocal>
ZR_HOST_DEVICE float bias_corrected_sqrt(float v, const AdamConfig& c) {
  const float root = sqrtf(v);
  if (!kReciprocal) return root / c.bias_correction2_sqrt;
  const float quotient = root * c.bias_correction2_rsqrt;
  const float remainder = fmaf(-quotient, c.bias_correction2_sqrt, root);
  const uint32_t finite = float_to_bits(root) < 0x7F800000u ? 0xFFFFFFFFu : 0u;  // root >= 0, +inf or NaN
  return fmaf(bits_to_float(float_to_bits(remainder) & finite), c.bias_correction2_rsqrt, quotient);
}

// One element: p (fp32 master), m, v updated in place from the raw gradient g. kUnscale=false skips
// the division when the divisor is 1 (exact either way; a division per element costs when the shard
// is in cache). kFma=false is for CPUs without FMA (baseline x86-64), where fmaf is a library call.
// kReciprocal: see bias_corrected_sqrt (the CPU kernel takes it wherever it has an FMA; the CUDA kernel divides).
template <bool kDecoupled, bool kUnscale = true, bool kFma = true, bool kReciprocal = false>
ZR_HOST_DEVICE void adam_update(float& p, float g, float& m, float& v, const AdamConfig& c) {
  static_assert(kFma || !kReciprocal, "the exact quotient needs a fused multiply-add");
  // The fmas sit where torch's compiled fused kernel has them, so results match it bit for bit.
  if (kUnscale) g = g / c.grad_divisor;
  if (kDecoupled) {
    p = p * c.decay_factor;
  } else {
    g = kFma ? fmaf(p, c.l2, g) : g + p * c.l2;
  }
  const float base = c.lerp_from_grad ? g : m;
  m = kFma ? fmaf(c.lerp_weight, g - m, base) : base + c.lerp_weight * (g - m);
  v = kFma ? fmaf(c.one_minus_beta2 * g, g, v * c.beta2) : v * c.beta2 + c.one_minus_beta2 * g * g;
  const float denom = bias_corrected_sqrt<kReciprocal>(v, c) + c.eps;
  p = p - c.step_size * m / denom;
}

// One flat shard's tensors, as both kernels receive them (lowp_out may be null).
struct Shard {
  float* params;
  const void* grads;
  float* exp_avg;
  float* exp_avg_sq;
  void* lowp_out;
};

// ---- fp32 <-> bf16/fp16 as bit patterns, round-to-nearest-even, branch-free so loops vectorise ----

ZR_HOST_DEVICE uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (f != f) ? uint16_t(0x7FC0) : uint16_t(rounded);  // NaN stays a quiet NaN
}

ZR_HOST_DEVICE float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// fp32 -> fp16: scaling by 2^112 then 2^-110 lets the FPU do the rounding (also of subnormals);
// the well-known branch-free method of Maratyszcza's FP16 library.
ZR_HOST_DEVICE uint16_t float_to_fp16(float f) {
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

ZR_HOST_DEVICE float fp16_to_float(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude = two_w < (1u << 27) ? float_to_bits(denormalized) : float_to_bits(normalized);
  return bits_to_float(sign | magnitude);
}

template <int kDType>
ZR_HOST_DEVICE float load_as_float(const void* data, int64_t i) {
  if (kDType == kFloat32) return static_cast<const float*>(data)[i];
  if (kDType == kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  return fp16_to_float(static_cast<const uint16_t*>(data)[i]);
}

template <int kDType>
ZR_HOST_DEVICE uint16_t float_to_lowp(float f) {
  return kDType == kBFloat16 ? float_to_bf16(f) : float_to_fp16(f);
}

}  // namespace zerorun
