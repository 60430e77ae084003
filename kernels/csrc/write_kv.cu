// The KV-cache write: one layer's new key/value rows [T, Hkv, D] into their slots of the paged
// cache; slot -1 (any negative slot) marks a padded row that writes nothing.

#include <cstdint>

#include "flash_decode.h"

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

}  // namespace

cudaError_t launch_write_kv(const WriteKvParams& p, cudaStream_t stream) {
  const int64_t total = p.num_tokens * p.num_kv_heads * (p.row_bytes / 16);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  write_kv_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashdecode
