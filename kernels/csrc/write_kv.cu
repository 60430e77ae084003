// The KV-cache write: one layer's new key/value rows [T, Hkv, D] into their slots of the paged
// cache; slot -1 (any negative slot) marks a padded row that writes nothing. An fp8 cache's
// rows are quantised in the same launch, with one scale per KV head for K and one for V.

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flash_decode.h"
#include "fp8.cuh"

namespace flashdecode {
namespace {

// Thread i's share of the rows: 16 source bytes of one token's key and value row for one KV
// head, and where they land in the caches (kCacheBytes of each: 16 copied, or 8 fp8 codes).
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

// Eight 2-byte source elements of x / scale -> eight e4m3 codes.
template <typename T>
__device__ __forceinline__ uint2 quantize8(const char* src, float scale) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* x = reinterpret_cast<const T*>(&raw);
  uint32_t out[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float f;
    if constexpr (std::is_same_v<T, __half>)
      f = __half2float(x[i]);
    else
      f = __bfloat162float(x[i]);
    out[i / 4] |= uint32_t(quantize_fp8(f, scale)) << (8 * (i % 4));
  }
  return make_uint2(out[0], out[1]);
}

// fp8 caches: a thread quantises 8 elements (16 source bytes, 8 cache bytes) of a key and a value row.
template <typename T>
__global__ void write_kv_fp8_kernel(const WriteKvParams p) {
  const int64_t total = num_chunks(p, 8);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    RowChunk c;
    if (!row_chunk<8>(p, i, c)) continue;
    *reinterpret_cast<uint2*>(static_cast<char*>(p.k_cache) + c.dst) = quantize8<T>(c.k_src, p.k_scale[c.head]);
    *reinterpret_cast<uint2*>(static_cast<char*>(p.v_cache) + c.dst) = quantize8<T>(c.v_src, p.v_scale[c.head]);
  }
}

}  // namespace

cudaError_t launch_write_kv(const WriteKvParams& p, cudaStream_t stream) {
  const bool fp8 = p.kv_dtype == KvDType::kFp8E4m3;
  if (fp8 && (p.k_scale == nullptr || p.v_scale == nullptr)) return cudaErrorInvalidValue;
  const int64_t total = num_chunks(p, fp8 ? 8 : 16);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const unsigned grid = (unsigned)(blocks < 4096 ? blocks : 4096);
  if (!fp8)
    write_kv_kernel<<<grid, threads, 0, stream>>>(p);
  else if (p.src_dtype == DType::kBFloat16)
    write_kv_fp8_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(p);
  else
    write_kv_fp8_kernel<__half><<<grid, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashdecode
