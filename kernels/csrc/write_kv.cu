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

__global__ void write_kv_kernel(const WriteKvParams p) {
  const int chunks = p.row_bytes / 16;
  const int64_t total = p.num_tokens * p.num_kv_heads * chunks;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int chunk = i % chunks;
    const int64_t token_head = i / chunks;
    const int head = token_head % p.num_kv_heads;
    const int64_t token = token_head / p.num_kv_heads;
    const int64_t slot = p.slots_are_int64 ? static_cast<const int64_t*>(p.slot_mapping)[token]
                                           : static_cast<const int32_t*>(p.slot_mapping)[token];
    if (slot < 0 || slot >= p.num_slots) continue;  // -1 marks a padded row
    const int64_t block = slot / p.block_size, row = slot % p.block_size;
    const int64_t dst = ((block * p.num_kv_heads + head) * p.block_size + row) * p.row_bytes + chunk * 16;
    const char* k_src = static_cast<const char*>(p.key) + token * p.key_stride_t + head * p.key_stride_h + chunk * 16;
    const char* v_src =
        static_cast<const char*>(p.value) + token * p.value_stride_t + head * p.value_stride_h + chunk * 16;
    *reinterpret_cast<uint4*>(static_cast<char*>(p.k_cache) + dst) = *reinterpret_cast<const uint4*>(k_src);
    *reinterpret_cast<uint4*>(static_cast<char*>(p.v_cache) + dst) = *reinterpret_cast<const uint4*>(v_src);
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
  const int chunks = p.row_bytes / 8;
  const int64_t total = p.num_tokens * p.num_kv_heads * chunks;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int chunk = i % chunks;
    const int64_t token_head = i / chunks;
    const int head = token_head % p.num_kv_heads;
    const int64_t token = token_head / p.num_kv_heads;
    const int64_t slot = p.slots_are_int64 ? static_cast<const int64_t*>(p.slot_mapping)[token]
                                           : static_cast<const int32_t*>(p.slot_mapping)[token];
    if (slot < 0 || slot >= p.num_slots) continue;  // -1 marks a padded row
    const int64_t block = slot / p.block_size, row = slot % p.block_size;
    const int64_t dst = ((block * p.num_kv_heads + head) * p.block_size + row) * p.row_bytes + chunk * 8;
    const char* k_src = static_cast<const char*>(p.key) + token * p.key_stride_t + head * p.key_stride_h + chunk * 16;
    const char* v_src =
        static_cast<const char*>(p.value) + token * p.value_stride_t + head * p.value_stride_h + chunk * 16;
    *reinterpret_cast<uint2*>(static_cast<char*>(p.k_cache) + dst) = quantize8<T>(k_src, p.k_scale[head]);
    *reinterpret_cast<uint2*>(static_cast<char*>(p.v_cache) + dst) = quantize8<T>(v_src, p.v_scale[head]);
  }
}

}  // namespace

cudaError_t launch_write_kv(const WriteKvParams& p, cudaStream_t stream) {
  const bool fp8 = p.kv_dtype == KvDType::kFp8E4m3;
  if (fp8 && (p.k_scale == nullptr || p.v_scale == nullptr)) return cudaErrorInvalidValue;
  const int64_t total = p.num_tokens * p.num_kv_heads * (p.row_bytes / (fp8 ? 8 : 16));
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
