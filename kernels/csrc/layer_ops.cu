// Per-layer kernels around attention. Each rounds to the storage type where transformers' Llama
// modules round (after the residual add, after normalising, after SiLU), so the fused layer
// follows the reference model's bf16 arithmetic instead of drifting from it.

#include <algorithm>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fp8.cuh"
#include "launch.h"
#include "layer_ops.h"

namespace flashdecode {
namespace {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

template <typename T> __device__ __forceinline__ float rounded(float v) { return to_float(from_float<T>(v)); }

// Eight elements moved as one 16-byte access.
template <typename T>
struct alignas(16) Vec8 {
  T v[8];
};

__device__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? warp_sums[lane] : 0.f;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <GatedAct kAct>
__device__ __forceinline__ float gated_act(float g) {
  if constexpr (kAct == GatedAct::kSilu) {
    return g / (1.f + expf(-g));
  } else {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    return 0.5f * g * (1.f + tanhf(kSqrt2OverPi * (g + 0.044715f * g * g * g)));
  }
}

// A norm's output: Llama's rounding (normalised, rounded, times the weight of the storage type)
// or, with a float32 weight, Gemma's (normalised times the weight in float32, rounded once).
template <typename T>
__device__ __forceinline__ T scaled_norm(float x, float inv_rms, const void* weight, bool weight_fp32, int i) {
  if (weight_fp32) return from_float<T>(static_cast<const float*>(weight)[i] * (x * inv_rms));
  return from_float<T>(to_float(static_cast<const T*>(weight)[i]) * rounded<T>(x * inv_rms));
}

// One block per row. With a residual: residual = round(residual + x), out = norm(residual) * w.
template <typename T, bool kResidual>
__global__ void rms_norm_kernel(RmsNormParams p) {
  pdl_trigger_then_wait();
  const int64_t row = blockIdx.x;
  const int vecs = p.hidden / 8;
  const auto* x = reinterpret_cast<const Vec8<T>*>(static_cast<const T*>(p.x) + row * p.x_stride);
  auto* res = reinterpret_cast<Vec8<T>*>(static_cast<T*>(p.residual) + row * p.hidden);
  auto* out = reinterpret_cast<Vec8<T>*>(static_cast<T*>(p.out) + row * p.out_stride);

  float squares = 0.f;
  for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
    Vec8<T> a = x[i];
    if constexpr (kResidual) {
      const Vec8<T> r = res[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(r.v[j]));
      res[i] = a;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) squares += to_float(a.v[j]) * to_float(a.v[j]);
  }
  const float inv_rms = rsqrtf(block_sum(squares) / p.hidden + p.eps);
  for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
    // Each thread rereads only what it wrote itself above, and x is not read after the barrier.
    const Vec8<T> a = kResidual ? res[i] : x[i];
    Vec8<T> o;
    if (p.weight_fp32) {
#pragma unroll
      for (int j = 0; j < 8; ++j) o.v[j] = scaled_norm<T>(to_float(a.v[j]), inv_rms, p.weight, true, i * 8 + j);
    } else {
      const Vec8<T> g = reinterpret_cast<const Vec8<T>*>(p.weight)[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) o.v[j] = from_float<T>(to_float(g.v[j]) * rounded<T>(to_float(a.v[j]) * inv_rms));
    }
    out[i] = o;
  }
}

template <typename T, GatedAct kAct>
__global__ void act_and_mul_kernel(SiluMulParams p) {
  pdl_trigger_then_wait();
  const int vecs = p.inter / 8;
  const int64_t total = p.rows * vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs;
    const int col = static_cast<int>(i % vecs);
    const auto* in = reinterpret_cast<const Vec8<T>*>(static_cast<const T*>(p.in) + row * 2 * p.inter);
    const Vec8<T> gate = in[col], up = in[vecs + col];
    Vec8<T> o;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float g = to_float(gate.v[j]);
      o.v[j] = from_float<T>(rounded<T>(gated_act<kAct>(g)) * to_float(up.v[j]));
    }
    reinterpret_cast<Vec8<T>*>(static_cast<T*>(p.out) + row * p.inter)[col] = o;
  }
}

// A cache element: the value itself, or for fp8 caches its e4m3 code at ``scale``.
template <typename T, typename KV>
__device__ __forceinline__ KV to_cache(T v, const float* scales, int kv_head) {
  if constexpr (std::is_same_v<T, KV>)
    return v;
  else
    return quantize_fp8(to_float(v), __ldg(scales + kv_head));
}

// One block per token: RMS-normalises its query and key heads in place when the params carry
// their weights (one warp per head), rotates them in place (rotate-half convention), then stores
// the rotated key and the value at the token's cache slot. KV: T, or uint8_t for fp8 caches,
// which store the rounded values' codes (as write_kv would store them).
template <typename T, typename KV>
__global__ void rope_write_kv_kernel(RopeKvParams p) {
  pdl_trigger_then_wait();
  const int64_t t = blockIdx.x;
  T* row = static_cast<T*>(p.qkv) + t * p.qkv_stride;
  const int d = p.head_dim, half = d / 2;
  const float* cos = p.cos_sin + int64_t(p.positions[t]) * d;
  const float* sin = cos + half;
  const int64_t slot = p.slots_are_int64 ? static_cast<const int64_t*>(p.slot_mapping)[t]
                                         : static_cast<const int32_t*>(p.slot_mapping)[t];
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  auto cache_row = [&](KV* cache, int kv_head) {
    return cache + ((block * p.num_kv_heads + kv_head) * p.block_size + offset) * d;
  };
  KV* k_cache = static_cast<KV*>(p.k_cache);
  KV* v_cache = static_cast<KV*>(p.v_cache);

  if (p.q_norm != nullptr) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int head = warp; head < p.num_q_heads + p.num_kv_heads; head += warps) {
      T* h = row + head * d;
      const void* w = head < p.num_q_heads ? p.q_norm : p.k_norm;
      float squares = 0.f;
      for (int j = lane; j < d; j += 32) squares += to_float(h[j]) * to_float(h[j]);
      for (int offset = 16; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
      const float inv_rms = rsqrtf(squares / d + p.eps);
      for (int j = lane; j < d; j += 32) h[j] = scaled_norm<T>(to_float(h[j]), inv_rms, w, p.norm_fp32, j);
    }
    __syncthreads();
  }

  const int rotated = (p.num_q_heads + p.num_kv_heads) * half;
  for (int i = threadIdx.x; i < rotated; i += blockDim.x) {
    const int head = i / half, j = i % half;
    T* h = row + head * d;
    const float x1 = to_float(h[j]), x2 = to_float(h[j + half]);
    const T y1 = from_float<T>(x1 * cos[j] - x2 * sin[j]);
    const T y2 = from_float<T>(x2 * cos[j] + x1 * sin[j]);
    h[j] = y1;
    h[j + half] = y2;
    if (head >= p.num_q_heads && slot >= 0) {
      KV* dst = cache_row(k_cache, head - p.num_q_heads);
      dst[j] = to_cache<T, KV>(y1, p.k_scale, head - p.num_q_heads);
      dst[j + half] = to_cache<T, KV>(y2, p.k_scale, head - p.num_q_heads);
    }
  }
  if (slot < 0) return;
  const T* value = row + (p.num_q_heads + p.num_kv_heads) * d;
  for (int i = threadIdx.x; i < p.num_kv_heads * d; i += blockDim.x)
    cache_row(v_cache, i / d)[i % d] = to_cache<T, KV>(value[i], p.v_scale, i / d);
}

// y = x W^T for a few rows (a decode step's batch): latency, not arithmetic, bounds these, and
// cuBLAS's GEMM kernels spend ~4 us on a 1 MB weight. The block first stages its input rows in
// shared memory (applying SiLU-and-multiply there, once per block, for the down projection);
// then each warp streams one weight row with 16-byte loads and reduces it against every row.
template <typename T, int kRows, bool kGated, GatedAct kAct>
__global__ void gemv_kernel(GemvParams p) {
  pdl_trigger_then_wait();
  extern __shared__ __align__(16) uint8_t gemv_smem[];
  T* xs = reinterpret_cast<T*>(gemv_smem);           // [kRows, k]
  const int vecs = p.k / 8;
  for (int i = threadIdx.x; i < kRows * vecs; i += blockDim.x) {
    const int r = i / vecs, c = i % vecs;
    const T* row = static_cast<const T*>(p.x) + r * p.x_stride;
    Vec8<T> a = reinterpret_cast<const Vec8<T>*>(row)[c];
    if constexpr (kGated) {
      const Vec8<T> up = reinterpret_cast<const Vec8<T>*>(row + p.k)[c];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float g = to_float(a.v[j]);
        a.v[j] = from_float<T>(rounded<T>(gated_act<kAct>(g)) * to_float(up.v[j]));
      }
    }
    reinterpret_cast<Vec8<T>*>(xs + r * p.k)[c] = a;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = blockIdx.x * (blockDim.x / 32) + warp;
  if (col >= p.n) return;
  const auto* w = reinterpret_cast<const Vec8<T>*>(static_cast<const T*>(p.w) + int64_t(col) * p.k);
  const float bias = p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[col]) : 0.f;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  for (int i = lane; i < vecs; i += 32) {
    const Vec8<T> wv = w[i];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const Vec8<T> a = reinterpret_cast<const Vec8<T>*>(xs + r * p.k)[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[r] = fmaf(to_float(a.v[j]), to_float(wv.v[j]), acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float v = acc[r];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) static_cast<T*>(p.y)[int64_t(r) * p.n + col] = from_float<T>(v + bias);
  }
}

constexpr int kThreads = 128;
constexpr int kGemvWarps = 4;

template <typename T, int kRows, bool kGated, GatedAct kAct>
cudaError_t gemv_launch(const GemvParams& p, cudaStream_t stream) {
  static uint64_t smem_raised = 0;
  const cudaError_t err = allow_dynamic_smem(gemv_kernel<T, kRows, kGated, kAct>, kGemvMaxSmemBytes, smem_raised);
  if (err != cudaSuccess) return err;
  const unsigned blocks = static_cast<unsigned>((p.n + kGemvWarps - 1) / kGemvWarps);
  const size_t smem = size_t(kRows) * p.k * sizeof(T);
  return launch_pdl(gemv_kernel<T, kRows, kGated, kAct>, dim3(blocks), dim3(kGemvWarps * 32), smem, stream, p);
}

template <typename T, int kRows>
cudaError_t gemv_rows(const GemvParams& p, cudaStream_t stream) {
  if (!p.gated) return gemv_launch<T, kRows, false, GatedAct::kSilu>(p, stream);
  return p.act == GatedAct::kSilu ? gemv_launch<T, kRows, true, GatedAct::kSilu>(p, stream)
                                  : gemv_launch<T, kRows, true, GatedAct::kGeluTanh>(p, stream);
}

template <typename T>
cudaError_t gemv_typed(const GemvParams& p, cudaStream_t stream) {
  switch (p.rows) {
    case 1: return gemv_rows<T, 1>(p, stream);
    case 2: return gemv_rows<T, 2>(p, stream);
    case 3: return gemv_rows<T, 3>(p, stream);
    case 4: return gemv_rows<T, 4>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t rms_norm_typed(const RmsNormParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows));
  return p.residual != nullptr ? launch_pdl(rms_norm_kernel<T, true>, grid, dim3(kThreads), 0, stream, p)
                               : launch_pdl(rms_norm_kernel<T, false>, grid, dim3(kThreads), 0, stream, p);
}

template <typename T>
cudaError_t silu_and_mul_typed(const SiluMulParams& p, cudaStream_t stream) {
  const int64_t vecs = p.rows * (p.inter / 8);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((vecs + kThreads - 1) / kThreads, 65535));
  return p.act == GatedAct::kSilu
             ? launch_pdl(act_and_mul_kernel<T, GatedAct::kSilu>, dim3(blocks), dim3(kThreads), 0, stream, p)
             : launch_pdl(act_and_mul_kernel<T, GatedAct::kGeluTanh>, dim3(blocks), dim3(kThreads), 0, stream, p);
}

}  // namespace

cudaError_t launch_gemv(const GemvParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.n == 0) return cudaSuccess;
  return p.dtype == DType::kBFloat16 ? gemv_typed<__nv_bfloat16>(p, stream) : gemv_typed<__half>(p, stream);
}

cudaError_t launch_rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return p.dtype == DType::kBFloat16 ? rms_norm_typed<__nv_bfloat16>(p, stream) : rms_norm_typed<__half>(p, stream);
}

cudaError_t launch_silu_and_mul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return p.dtype == DType::kBFloat16 ? silu_and_mul_typed<__nv_bfloat16>(p, stream)
                                     : silu_and_mul_typed<__half>(p, stream);
}

cudaError_t launch_rope_write_kv(const RopeKvParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(p.num_tokens);
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.kv_dtype == KvDType::kFp8E4m3) {
    if (p.k_scale == nullptr || p.v_scale == nullptr) return cudaErrorInvalidValue;
    return bf16 ? launch_pdl(rope_write_kv_kernel<__nv_bfloat16, uint8_t>, dim3(blocks), dim3(kThreads), 0, stream, p)
                : launch_pdl(rope_write_kv_kernel<__half, uint8_t>, dim3(blocks), dim3(kThreads), 0, stream, p);
  }
  return bf16 ? launch_pdl(rope_write_kv_kernel<__nv_bfloat16, __nv_bfloat16>, dim3(blocks), dim3(kThreads), 0, stream, p)
              : launch_pdl(rope_write_kv_kernel<__half, __half>, dim3(blocks), dim3(kThreads), 0, stream, p);
}

}  // namespace flashdecode
