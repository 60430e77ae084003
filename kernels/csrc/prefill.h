// Plain-C++ interface between the torch binding (prefill_binding.cpp) and the split-KV prefill
// kernel (prefill.cu): new query rows of several sequences over their paged KV cache.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "flash_decode.h"

#if !defined(FLASHDECODE_PREFILL_ROWS) || !defined(FLASHDECODE_PREFILL_TILE)
#error "build through kernels/build.py: it defines the constants of kernels/constants.py (nvcc_defines())"
#endif

namespace flashdecode {

// Query rows (new token, query head of the group) one prefill block serves, and KV tokens per stage.
constexpr int kPrefillRows = FLASHDECODE_PREFILL_ROWS;
constexpr int kPrefillTile = FLASHDECODE_PREFILL_TILE;
static_assert(kPrefillRows == 64 && kPrefillTile % 16 == 0, "four warps of 16 rows; tiles of whole MMA steps");

struct PrefillParams {
  const void* q;                    // [T, Hq, D]; last dim contiguous, strides in elements
  int64_t q_stride_t, q_stride_h;
  const void* k_cache;              // [num_blocks, Hkv, block_size, D] contiguous
  const void* v_cache;
  const int32_t* block_table;       // [B, max_blocks], row stride block_table_stride
  int64_t block_table_stride;
  const int32_t* cu_query_starts;   // [B + 1]: sequence i's new rows are q[cu[i]:cu[i + 1]]
  const int32_t* seq_lens;          // [B]: cached + new tokens; the new rows are the last positions
  void* out;                        // [T, Hq, D] contiguous, q's dtype
  float* partial_out;               // [>= T * num_splits, Hq, D] (num_splits > 1)
  float* partial_lse;               // [>= T * num_splits, Hq]
  int batch, num_rows, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_blocks;
  int num_splits;                   // KV splits per (row tile, KV head), planned on the host
  int row_tiles;                    // grid z: an upper bound of the row tiles per KV head
  float scale;
  DType dtype;
  int window;                       // row at position p sees p - window < pos <= p (0: every pos <= p)
  KvDType kv_dtype;
  const void* k_scale;              // int8 caches: [num_blocks, Hkv, block_size] float16, else null
  const void* v_scale;
};

cudaError_t launch_flash_prefill(const PrefillParams& params, cudaStream_t stream);

}  // namespace flashdecode
