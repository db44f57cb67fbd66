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
// At the format's own block (2048 = 256 x 8) each thread holds 8 neighbouring elements, so a whole
// block moves in 16-byte loads and 8-byte stores (`Contiguous`), its scale looked up once; an H200
// measured the strided form at 40-47% of a device-to-device copy (the per-element 64-bit division of
// the dequantize, the quantize's held values in local memory). Other block sizes, the last partial
// block and unaligned pointers take the element-wise form; both give the same bits.
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

// ---- the format's own block: 8 neighbouring elements per thread ------------------------------------

constexpr int kPer = 8;
constexpr int kBlock = kThreads * kPer;  // 2048, zerorun/runtime/comm/quantize.py's BLOCK

struct alignas(16) Eight16 {  // 8 bf16/fp16 elements, one 16-byte load or store
  uint16_t h[kPer];
};
struct alignas(8) Eight8 {  // 8 int8 values, one 8-byte load or store
  int8_t q[kPer];
};

template <int kIn>
__device__ __forceinline__ void load8(const void* x, int64_t i, float* v) {  // i: a multiple of 8, x 16-byte aligned
  if (kIn == kFloat32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + i);
    const float4 a = p[0], b = p[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const Eight16 e = *reinterpret_cast<const Eight16*>(static_cast<const uint16_t*>(x) + i);
#pragma unroll
    for (int k = 0; k < kPer; ++k) v[k] = kIn == kBFloat16 ? bf16_to_float(e.h[k]) : fp16_to_float(e.h[k]);
  }
}

template <int kOut>
__device__ __forceinline__ void store8(void* out, int64_t i, const float* v) {
  if (kOut == kFloat32) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(out) + i);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    Eight16 e;
#pragma unroll
    for (int k = 0; k < kPer; ++k) e.h[k] = float_to_lowp<kOut>(v[k]);
    *reinterpret_cast<Eight16*>(static_cast<uint16_t*>(out) + i) = e;
  }
}

// `aligned`: x 16-byte and values 8-byte aligned, so whole blocks take the vector loads and stores.
template <int kIn>
__global__ void __launch_bounds__(kThreads) quantize_contiguous(const void* x, int64_t n, int8_t* values,
                                                                float* scales, bool aligned) {
  __shared__ float warp_max[kThreads / 32];
  __shared__ int warp_bad[kThreads / 32];
  const int64_t begin = int64_t(blockIdx.x) * kBlock;
  const int64_t first = begin + int64_t(threadIdx.x) * kPer;
  const bool whole = aligned && begin + kBlock <= n;
  float held[kPer];
  if (whole) {
    load8<kIn>(x, first, held);
  } else {
#pragma unroll
    for (int k = 0; k < kPer; ++k) held[k] = first + k < n ? load_as_float<kIn>(x, first + k) : 0.0f;
  }
  float largest = 0.0f;
  int bad = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    bad |= !isfinite(held[k]);
    largest = fmaxf(largest, fabsf(held[k]));
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
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    largest = fmaxf(largest, warp_max[w]);
    bad |= warp_bad[w];
  }
  float s = __fdiv_rn(largest, 127.0f);
  s = s == 0.0f ? 1.0f : s;
  if (bad) s = __int_as_float(0x7FC00000);
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  Eight8 out;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    float q = bad ? 0.0f : rintf(__fdiv_rn(held[k], s));
    q = fminf(fmaxf(q, -127.0f), 127.0f);
    out.q[k] = first + k < n ? static_cast<int8_t>(static_cast<int32_t>(q)) : int8_t(0);
  }
  if (aligned) {
    *reinterpret_cast<Eight8*>(values + first) = out;  // the padding of the last block is zeros, as stored
  } else {
#pragma unroll
    for (int k = 0; k < kPer; ++k) values[first + k] = out.q[k];
  }
}

// `aligned`: values 8-byte and out 16-byte aligned.
template <int kOut, bool kAccumulate>
__global__ void __launch_bounds__(kThreads) dequantize_contiguous(const int8_t* values, const float* scales,
                                                                  int64_t n, void* out, bool aligned) {
  const int64_t begin = int64_t(blockIdx.x) * kBlock;
  const int64_t first = begin + int64_t(threadIdx.x) * kPer;
  if (first >= n) return;
  const float scale = scales[blockIdx.x];
  float v[kPer];
  if (aligned && first + kPer <= n) {
    const Eight8 q = *reinterpret_cast<const Eight8*>(values + first);
#pragma unroll
    for (int k = 0; k < kPer; ++k) v[k] = __fmul_rn(static_cast<float>(q.q[k]), scale);
    if (kAccumulate) {
      float before[kPer];
      load8<kFloat32>(out, first, before);
#pragma unroll
      for (int k = 0; k < kPer; ++k) v[k] = __fadd_rn(before[k], v[k]);
    }
    store8<kOut>(out, first, v);
    return;
  }
  for (int64_t i = first; i < first + kPer && i < n; ++i) {
    const float product = __fmul_rn(static_cast<float>(values[i]), scale);
    if (kOut == kFloat32) {
      float* o = static_cast<float*>(out);
      o[i] = kAccumulate ? __fadd_rn(o[i], product) : product;
    } else {
      static_cast<uint16_t*>(out)[i] = float_to_lowp<kOut>(product);
    }
  }
}

bool aligned_to(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

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
  if (block == kBlock) {
    const bool aligned = aligned_to(x, 16) && aligned_to(values, 8);
    if (in_dtype == kFloat32) quantize_contiguous<kFloat32><<<blocks, kThreads, 0, s>>>(x, n, values, scales, aligned);
    else if (in_dtype == kBFloat16) quantize_contiguous<kBFloat16><<<blocks, kThreads, 0, s>>>(x, n, values, scales,
                                                                                                 aligned);
    else if (in_dtype == kFloat16) quantize_contiguous<kFloat16><<<blocks, kThreads, 0, s>>>(x, n, values, scales,
                                                                                               aligned);
    else return 1;
    return static_cast<int>(cudaGetLastError());
  }
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
  if (block == kBlock) {
    const int64_t blocks = (n + block - 1) / block;
    const bool aligned = aligned_to(values, 8) && aligned_to(out, 16);
    if (accumulate) {
      if (out_dtype != kFloat32) return 1;
      dequantize_contiguous<kFloat32, true><<<blocks, kThreads, 0, s>>>(values, scales, n, out, aligned);
    } else if (out_dtype == kFloat32) {
      dequantize_contiguous<kFloat32, false><<<blocks, kThreads, 0, s>>>(values, scales, n, out, aligned);
    } else if (out_dtype == kBFloat16) {
      dequantize_contiguous<kBFloat16, false><<<blocks, kThreads, 0, s>>>(values, scales, n, out, aligned);
    } else if (out_dtype == kFloat16) {
      dequantize_contiguous<kFloat16, false><<<blocks, kThreads, 0, s>>>(values, scales, n, out, aligned);
    } else {
      return 1;
    }
    return static_cast<int>(cudaGetLastError());
  }
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
