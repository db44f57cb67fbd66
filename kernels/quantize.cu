// Block int8 for CUDA tensors crossing the network (ZeRO++'s qwZ and qgZ on NCCL): the same format and
// the same bits as kernels/quantize.cpp (zerorun/runtime/comm/quantize.py describes both), so a rank
// quantizing on its GPU and one dequantizing on its CPU agree, and the tests compare them bit for bit.
//
// One CUDA block per block of the format (2048 elements): its 256 threads read 8 elements each into
// registers, reduce the largest magnitude through warp shuffles and shared memory, then quantize what
// they hold: one read of the input and one write of the int8 values and the scale, the roofline's
// traffic (`zerorun bench quantize --device cuda`). Dequantizing is one product per element (plus one
// sum when accumulating): --fmad=false keeps the product and the sum two roundings, as on the CPU.
//
// The arithmetic: scale = max|x| / 127 in fp32 (1 when the block is all zero), each value x / scale
// rounded half to even (rintf) and clamped to [-127, 127]. A block with an inf or a NaN gets a NaN scale
// and zero values, as on the CPU. Exported with a C ABI, free of torch headers (like fused_adam.cu):
// zerorun/ops.py calls it through ctypes with torch's current stream.
#include <cuda_runtime.h>

#include <cstdint>

#include "adam.h"

namespace {

using namespace zerorun;

constexpr int kThreads = 256;

template <int kIn>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const void* x, int64_t n, int block, int8_t* values,
                                                            float* scales) {
  __shared__ float warp_max[kThreads / 32];
  __shared__ int warp_bad[kThreads / 32];
  const int64_t begin = int64_t(blockIdx.x) * block;
  const int per = block / kThreads;  // elements per thread (block is a multiple of kThreads)
  float held[16];
  float largest = 0.0f;
  int bad = 0;
  for (int k = 0; k < per; ++k) {
    const int64_t i = begin + int64_t(k) * kThreads + threadIdx.x;
    const float v = i < n ? load_as_float<kIn>(x, i) : 0.0f;
    held[k] = v;
    bad |= !isfinite(v);
    largest = fmaxf(largest, fabsf(v));
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    bad |= __shfl_xor_sync(0xffffffffu, bad, offset);
  }
  if (threadIdx.x % 32 == 0) {
    warp_max[threadIdx.x / 32] = largest;
    warp_bad[threadIdx.x / 32] = bad;
  }
  __syncthreads();
  largest = 0.0f;
  bad = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    largest = fmaxf(largest, warp_max[w]);
    bad |= warp_bad[w];
  }
  float s = __fdiv_rn(largest, 127.0f);
  s = s == 0.0f ? 1.0f : s;
  if (bad) s = __int_as_float(0x7FC00000);
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  for (int k = 0; k < per; ++k) {
    const int64_t j = int64_t(k) * kThreads + threadIdx.x;
    float q = bad ? 0.0f : rintf(__fdiv_rn(held[k], s));
    q = fminf(fmaxf(q, -127.0f), 127.0f);
    values[begin + j] = (begin + j < n) ? static_cast<int8_t>(static_cast<int32_t>(q)) : int8_t(0);
  }
}

template <int kOut, bool kAccumulate>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const int8_t* values, const float* scales, int64_t n,
                                                              int block, void* out) {
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) {
    const float product = __fmul_rn(static_cast<float>(values[i]), scales[i / block]);
    if (kOut == kFloat32) {
      float* o = static_cast<float*>(out);
      o[i] = kAccumulate ? __fadd_rn(o[i], product) : product;
    } else {
      static_cast<uint16_t*>(out)[i] = float_to_lowp<kOut>(product);
    }
  }
}

int launch_blocks(int64_t n) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < 65536 ? (wanted > 0 ? wanted : 1) : 65536);
}

}  // namespace

extern "C" {

// x (n elements of in_dtype) -> values (ceil(n / block) * block int8, the padding zero) and scales, on
// `stream`. block: a multiple of 256, at most 4096. Returns 0, 1 for unsupported arguments, else a CUDA
// error code (zr_cuda_error_string names it).
int zr_cuda_quantize(const void* x, int in_dtype, int64_t n, int64_t block, int8_t* values, float* scales,
                     void* stream) {
  if (block <= 0 || block % kThreads || block > 16 * kThreads) return 1;
  const int64_t blocks = (n + block - 1) / block;
  if (blocks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  const int b = static_cast<int>(block);
  if (in_dtype == kFloat32) quantize_kernel<kFloat32><<<blocks, kThreads, 0, s>>>(x, n, b, values, scales);
  else if (in_dtype == kBFloat16) quantize_kernel<kBFloat16><<<blocks, kThreads, 0, s>>>(x, n, b, values, scales);
  else if (in_dtype == kFloat16) quantize_kernel<kFloat16><<<blocks, kThreads, 0, s>>>(x, n, b, values, scales);
  else return 1;
  return static_cast<int>(cudaGetLastError());
}

// out (n elements of out_dtype) = values * scales, or += when accumulate (fp32 only), on `stream`.
int zr_cuda_dequantize(const int8_t* values, const float* scales, int64_t n, int64_t block, void* out, int out_dtype,
                       int accumulate, void* stream) {
  if (block <= 0) return 1;
  if (n == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  const int b = static_cast<int>(block), grid = launch_blocks(n);
  if (accumulate) {
    if (out_dtype != kFloat32) return 1;
    dequantize_kernel<kFloat32, true><<<grid, kThreads, 0, s>>>(values, scales, n, b, out);
  } else if (out_dtype == kFloat32) {
    dequantize_kernel<kFloat32, false><<<grid, kThreads, 0, s>>>(values, scales, n, b, out);
  } else if (out_dtype == kBFloat16) {
    dequantize_kernel<kBFloat16, false><<<grid, kThreads, 0, s>>>(values, scales, n, b, out);
  } else if (out_dtype == kFloat16) {
    dequantize_kernel<kFloat16, false><<<grid, kThreads, 0, s>>>(values, scales, n, b, out);
  } else {
    return 1;
  }
  return static_cast<int>(cudaGetLastError());
}

const char* zr_cuda_quantize_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
