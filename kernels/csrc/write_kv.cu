// The KV-cache write: one layer's new key/value rows [T, Hkv, D] into their slots of the paged
// cache; slot -1 (any negative slot) marks a padded row that writes nothing. An int8 cache's
// rows are quantised in the same launch, each with its own scale (int8.cuh).
// And its inverse, the read: rows [K, Hkv, D] gathered from their slots (a prefill after a cached
// prefix attends over them), int8 codes dequantised in the same pass; slot -1 reads zeros.

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flash_decode.h"
#include "int8.cuh"

namespace flashdecode {
namespace {

// Thread i's share of the rows: 16 source bytes of one token's key and value row for one KV
// head, and where they land in the caches (kCacheBytes of each: 16 copied, or 8 int8 codes).
// False for a padded row's share (slot -1) and past the end.
struct RowChunk {
  const char* k_src;
  const char* v_src;
  int64_t dst;
  int head;
};

template <int kCacheBytes>
__device__ __forceinline__ bool row_chunk(const WriteKvParams& p, int64_t i, RowChunk& c) {
  const int chunks = p.row_bytes / kCacheBytes;
  const int chunk = i % chunks;
  const int64_t token_head = i / chunks;
  c.head = token_head % p.num_kv_heads;
  const int64_t token = token_head / p.num_kv_heads;
  const int64_t slot = p.slots_are_int64 ? static_cast<const int64_t*>(p.slot_mapping)[token]
                                         : static_cast<const int32_t*>(p.slot_mapping)[token];
  if (slot < 0 || slot >= p.num_slots) return false;
  const int64_t block = slot / p.block_size, row = slot % p.block_size;
  c.dst = ((block * p.num_kv_heads + c.head) * p.block_size + row) * p.row_bytes + chunk * kCacheBytes;
  c.k_src = static_cast<const char*>(p.key) + token * p.key_stride_t + c.head * p.key_stride_h + chunk * 16;
  c.v_src = static_cast<const char*>(p.value) + token * p.value_stride_t + c.head * p.value_stride_h + chunk * 16;
  return true;
}

__host__ __device__ __forceinline__ int64_t num_chunks(const WriteKvParams& p, int cache_bytes) {
  return p.num_tokens * p.num_kv_heads * (p.row_bytes / cache_bytes);
}

__global__ void write_kv_kernel(const WriteKvParams p) {
  const int64_t total = num_chunks(p, 16);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    RowChunk c;
    if (!row_chunk<16>(p, i, c)) continue;
    *reinterpret_cast<uint4*>(static_cast<char*>(p.k_cache) + c.dst) = *reinterpret_cast<const uint4*>(c.k_src);
    *reinterpret_cast<uint4*>(static_cast<char*>(p.v_cache) + c.dst) = *reinterpret_cast<const uint4*>(c.v_src);
  }
}

// Eight 2-byte source elements as float.
template <typename T>
__device__ __forceinline__ void load8(const char* src, float (&f)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if constexpr (std::is_same_v<T, __half>)
      f[i] = __half2float(x[i]);
    else
      f[i] = __bfloat162float(x[i]);
  }
}

__device__ __forceinline__ float amax8(const float (&f)[8]) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(f[i]));
  return m;
}

// Eight elements -> eight int8 codes at ``scale``.
__device__ __forceinline__ uint2 quantize8(const float (&f)[8], float scale) {
  uint32_t out[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i / 4] |= uint32_t(uint8_t(quantize_int8(f[i], scale))) << (8 * (i % 4));
  return make_uint2(out[0], out[1]);
}

// int8 caches: a row's D / 8 chunks go to as many consecutive threads of one warp (D / 8 divides
// 32), which reduce the row's largest magnitude by shuffles; each stores its 8 codes, the first
// the row's scale. Whole warps run each pass of the loop, so that the shuffles see every lane.
template <typename T>
__global__ void write_kv_int8_kernel(const WriteKvParams p) {
  const int chunks = p.row_bytes / 8;
  const int64_t total = num_chunks(p, 8);
  const int64_t passes = (total + 31) / 32 * 32;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < passes; i += (int64_t)gridDim.x * blockDim.x) {
    RowChunk c;
    const bool stored = i < total && row_chunk<8>(p, i, c);
    float k[8] = {}, v[8] = {};
    if (stored) {
      load8<T>(c.k_src, k);
      load8<T>(c.v_src, v);
    }
    float k_amax = amax8(k), v_amax = amax8(v);
    for (int offset = 1; offset < chunks; offset <<= 1) {
      k_amax = fmaxf(k_amax, __shfl_xor_sync(0xffffffffu, k_amax, offset));
      v_amax = fmaxf(v_amax, __shfl_xor_sync(0xffffffffu, v_amax, offset));
    }
    if (!stored) continue;
    const __half k_scale = int8_row_scale(k_amax), v_scale = int8_row_scale(v_amax);
    *reinterpret_cast<uint2*>(static_cast<char*>(p.k_cache) + c.dst) = quantize8(k, __half2float(k_scale));
    *reinterpret_cast<uint2*>(static_cast<char*>(p.v_cache) + c.dst) = quantize8(v, __half2float(v_scale));
    if (c.dst % p.row_bytes == 0) {
      static_cast<__half*>(p.k_scale)[c.dst / p.row_bytes] = k_scale;
      static_cast<__half*>(p.v_scale)[c.dst / p.row_bytes] = v_scale;
    }
  }
}

// Eight int8 codes * scale -> eight elements of T (16 bytes), rounded once from float (the
// product is exact in float).
template <typename T>
__device__ __forceinline__ uint4 dequantize8(uint2 codes, float scale) {
  uint4 out;
  T* y = reinterpret_cast<T*>(&out);
  const int8_t* c = reinterpret_cast<const int8_t*>(&codes);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float f = float(c[i]) * scale;
    if constexpr (std::is_same_v<T, __half>)
      y[i] = __float2half_rn(f);
    else
      y[i] = __float2bfloat16_rn(f);
  }
  return out;
}

// A thread reads 8 elements (16 output bytes) of one row's key and value for one KV head.
template <typename T, bool kInt8>
__global__ void read_kv_kernel(const ReadKvParams p) {
  const int chunks = p.head_dim / 8;
  const int64_t total = p.num_rows * p.num_kv_heads * chunks;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int chunk = i % chunks;
    const int64_t row_head = i / chunks;
    const int head = row_head % p.num_kv_heads;
    const int64_t slot = p.slot_mapping[row_head / p.num_kv_heads];
    uint4 k = make_uint4(0, 0, 0, 0), v = k;
    if (slot >= 0 && slot < p.num_slots) {
      const int64_t block = slot / p.block_size, row = slot % p.block_size;
      const int64_t cache_row = (block * p.num_kv_heads + head) * p.block_size + row;
      const int64_t src = cache_row * p.head_dim + chunk * 8;
      if constexpr (kInt8) {
        const float ks = __half2float(static_cast<const __half*>(p.k_scale)[cache_row]);
        const float vs = __half2float(static_cast<const __half*>(p.v_scale)[cache_row]);
        k = dequantize8<T>(*reinterpret_cast<const uint2*>(static_cast<const int8_t*>(p.k_cache) + src), ks);
        v = dequantize8<T>(*reinterpret_cast<const uint2*>(static_cast<const int8_t*>(p.v_cache) + src), vs);
      } else {
        k = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.k_cache) + src);
        v = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.v_cache) + src);
      }
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(p.key) + row_head * p.head_dim + chunk * 8) = k;
    *reinterpret_cast<uint4*>(static_cast<T*>(p.value) + row_head * p.head_dim + chunk * 8) = v;
  }
}

template <typename T>
void launch_read_kv_as(const ReadKvParams& p, unsigned grid, int threads, cudaStream_t stream) {
  if (p.kv_dtype == KvDType::kInt8)
    read_kv_kernel<T, true><<<grid, threads, 0, stream>>>(p);
  else
    read_kv_kernel<T, false><<<grid, threads, 0, stream>>>(p);
}

}  // namespace

cudaError_t launch_read_kv(const ReadKvParams& p, cudaStream_t stream) {
  if (p.kv_dtype == KvDType::kInt8 && (p.k_scale == nullptr || p.v_scale == nullptr)) return cudaErrorInvalidValue;
  if (p.head_dim % 8 != 0) return cudaErrorInvalidValue;
  const int64_t total = p.num_rows * p.num_kv_heads * (p.head_dim / 8);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const unsigned grid = (unsigned)(blocks < 8192 ? blocks : 8192);
  if (p.dst_dtype == DType::kBFloat16)
    launch_read_kv_as<__nv_bfloat16>(p, grid, threads, stream);
  else
    launch_read_kv_as<__half>(p, grid, threads, stream);
  return cudaGetLastError();
}

cudaError_t launch_write_kv(const WriteKvParams& p, cudaStream_t stream) {
  const bool int8 = p.kv_dtype == KvDType::kInt8;
  if (int8 && (p.k_scale == nullptr || p.v_scale == nullptr || 32 % (p.row_bytes / 8) != 0))
    return cudaErrorInvalidValue;
  const int64_t total = num_chunks(p, int8 ? 8 : 16);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const unsigned grid = (unsigned)(blocks < 4096 ? blocks : 4096);
  if (!int8)
    write_kv_kernel<<<grid, threads, 0, stream>>>(p);
  else if (p.src_dtype == DType::kBFloat16)
    write_kv_int8_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(p);
  else
    write_kv_int8_kernel<__half><<<grid, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashdecode
