// Adam(W) over one flat fp32 shard on a CUDA device, optionally writing the bf16/fp16 copy of the
// updated parameters in the same pass: one launch per shard, on the caller's stream.
//
// Exported with a C ABI (zerorun/ops.py calls it through ctypes with torch's current stream) and free
// of torch headers, so `nvcc -c fused_adam.cu` alone proves it compiles. Each thread updates four
// consecutive elements with 16-byte loads and stores when every pointer allows it (the common case:
// torch allocations are 256-byte aligned and shards start at multiples of the alignment); otherwise,
// and for the tail, one element at a time.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "adam.h"

namespace {

using namespace zerorun;

constexpr int kThreads = 256;
constexpr int kVec = 4;


template <bool kDecoupled, int kGrad, int kLowp>
__device__ __forceinline__ void update_one(const Shard& s, const AdamConfig& c, int64_t i) {
  float p = s.params[i], m = s.exp_avg[i], v = s.exp_avg_sq[i];
  adam_update<kDecoupled>(p, load_as_float<kGrad>(s.grads, i), m, v, c);
  s.params[i] = p;
  s.exp_avg[i] = m;
  s.exp_avg_sq[i] = v;
  if (kLowp != kNone) static_cast<uint16_t*>(s.lowp_out)[i] = float_to_lowp<kLowp>(p);
}

template <int kGrad>
__device__ __forceinline__ void load_grads4(const void* grads, int64_t q, float out[kVec]) {
  if (kGrad == kFloat32) {
    const float4 g = static_cast<const float4*>(grads)[q];
    out[0] = g.x, out[1] = g.y, out[2] = g.z, out[3] = g.w;
  } else {
    const uint2 raw = static_cast<const uint2*>(grads)[q];  // four 16-bit values
    const uint16_t h[kVec] = {uint16_t(raw.x), uint16_t(raw.x >> 16), uint16_t(raw.y), uint16_t(raw.y >> 16)};
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = kGrad == kBFloat16 ? bf16_to_float(h[k]) : fp16_to_float(h[k]);
  }
}

// vectorised: quads [0, n / 4) four elements per step, then the < 4 tail elements by the first threads.
// scalar (some pointer misaligned): every element one by one.
template <bool kDecoupled, int kGrad, int kLowp, bool kVectorised>
__global__ void __launch_bounds__(kThreads) adam_kernel(Shard s, AdamConfig c, int64_t n) {
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (!kVectorised) {
    for (int64_t i = first; i < n; i += stride) update_one<kDecoupled, kGrad, kLowp>(s, c, i);
    return;
  }
  const int64_t quads = n / kVec;
  for (int64_t q = first; q < quads; q += stride) {
    float4 p = reinterpret_cast<float4*>(s.params)[q];
    float4 m = reinterpret_cast<float4*>(s.exp_avg)[q];
    float4 v = reinterpret_cast<float4*>(s.exp_avg_sq)[q];
    float g[kVec];
    load_grads4<kGrad>(s.grads, q, g);
    adam_update<kDecoupled>(p.x, g[0], m.x, v.x, c);
    adam_update<kDecoupled>(p.y, g[1], m.y, v.y, c);
    adam_update<kDecoupled>(p.z, g[2], m.z, v.z, c);
    adam_update<kDecoupled>(p.w, g[3], m.w, v.w, c);
    reinterpret_cast<float4*>(s.params)[q] = p;
    reinterpret_cast<float4*>(s.exp_avg)[q] = m;
    reinterpret_cast<float4*>(s.exp_avg_sq)[q] = v;
    if (kLowp != kNone) {
      const uint2 out = {uint32_t(float_to_lowp<kLowp>(p.x)) | uint32_t(float_to_lowp<kLowp>(p.y)) << 16,
                         uint32_t(float_to_lowp<kLowp>(p.z)) | uint32_t(float_to_lowp<kLowp>(p.w)) << 16};
      static_cast<uint2*>(s.lowp_out)[q] = out;
    }
  }
  const int64_t tail = quads * kVec + first;
  if (tail < n) update_one<kDecoupled, kGrad, kLowp>(s, c, tail);
}

bool aligned(const void* pointer, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(pointer) % bytes == 0; }

int max_blocks() {
  int device = 0, sms = 80;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms * 8;  // enough resident warps to saturate memory; the grid-stride loop covers the rest
}

template <bool D, int G, int L>
cudaError_t launch(const Shard& s, const AdamConfig& c, int64_t n, cudaStream_t stream) {
  const uintptr_t grad_bytes = G == kFloat32 ? 16 : 8;
  const bool vectorised = aligned(s.params, 16) && aligned(s.exp_avg, 16) && aligned(s.exp_avg_sq, 16) &&
                          aligned(s.grads, grad_bytes) && (L == kNone || aligned(s.lowp_out, 8));
  const int64_t work = vectorised ? n / kVec + 1 : n;
  const int blocks = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads, max_blocks()));
  if (vectorised)
    adam_kernel<D, G, L, true><<<blocks, kThreads, 0, stream>>>(s, c, n);
  else
    adam_kernel<D, G, L, false><<<blocks, kThreads, 0, stream>>>(s, c, n);
  return cudaGetLastError();
}

template <bool D, int G>
cudaError_t launch_lowp(int lowp, const Shard& s, const AdamConfig& c, int64_t n, cudaStream_t stream) {
  switch (lowp) {
    case kNone: return launch<D, G, kNone>(s, c, n, stream);
    case kBFloat16: return launch<D, G, kBFloat16>(s, c, n, stream);
    case kFloat16: return launch<D, G, kFloat16>(s, c, n, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <bool D>
cudaError_t launch_grad(int grad, int lowp, const Shard& s, const AdamConfig& c, int64_t n, cudaStream_t stream) {
  switch (grad) {
    case kFloat32: return launch_lowp<D, kFloat32>(lowp, s, c, n, stream);
    case kBFloat16: return launch_lowp<D, kBFloat16>(lowp, s, c, n, stream);
    case kFloat16: return launch_lowp<D, kFloat16>(lowp, s, c, n, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

// One Adam(W) step over n elements on `stream` (a cudaStream_t; null = the legacy default stream).
// Same arguments as zr_cpu_adam in cpu_adam.cpp. Returns a cudaError_t (0 = launched).
int zr_cuda_adam(float* params, const void* grads, int grad_dtype, float* exp_avg, float* exp_avg_sq, void* lowp_out,
                 int lowp_dtype, int64_t n, int64_t step, double lr, double beta1, double beta2, double eps,
                 double weight_decay, int decoupled, double grad_divisor, void* stream) {
  if (n <= 0) return cudaSuccess;
  if (lowp_out == nullptr) lowp_dtype = kNone;
  const AdamConfig config = make_adam_config(step, lr, beta1, beta2, eps, weight_decay, decoupled != 0, grad_divisor);
  const Shard shard{params, grads, exp_avg, exp_avg_sq, lowp_out};
  const auto s = static_cast<cudaStream_t>(stream);
  return decoupled ? launch_grad<true>(grad_dtype, lowp_dtype, shard, config, n, s)
                   : launch_grad<false>(grad_dtype, lowp_dtype, shard, config, n, s);
}

const char* zr_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
