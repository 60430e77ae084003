// Plain-C++ interface between the torch binding (binding.cpp) and the CUDA kernels
// (flash_decode.cu, write_kv.cu), so that the .cu files need no torch headers and compile quickly.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

// The numbers Python shares with these sources are defined in kernels/constants.py alone;
// kernels/build.py passes them as -D defines.
#if !defined(FLASHDECODE_HEAD_DIMS_0) || !defined(FLASHDECODE_HEAD_DIMS_1) || !defined(FLASHDECODE_HEAD_DIMS_2) || !defined(FLASHDECODE_WIDE_WARP_HEAD_DIM) || !defined(FLASHDECODE_HEADS_PER_BLOCK) || !defined(FLASHDECODE_MAX_SPLITS) || !defined(FLASHDECODE_MIN_CHUNK) || \
    !defined(FLASHDECODE_TILE_ELEMENTS) || !defined(FLASHDECODE_WIDE_WARP_MAX_GROUP) ||                          \
    !defined(FLASHDECODE_BLOCKS_PER_SM) || !defined(FLASHDECODE_WIDE_BLOCKS_PER_SM) ||                            \
    !defined(FLASHDECODE_BLOCK_SIZE_GRANULE) || !defined(FLASHDECODE_BLOCK_SIZE_PERIOD)
#error "build through kernels/build.py: it defines the constants of kernels/constants.py (nvcc_defines())"
#endif

namespace flashdecode {

// The head_dims the launcher instantiates kernels for (launch_flash_decode).
constexpr int kHeadDims[] = {FLASHDECODE_HEAD_DIMS_0, FLASHDECODE_HEAD_DIMS_1, FLASHDECODE_HEAD_DIMS_2};
static_assert(kHeadDims[0] == 64 && kHeadDims[1] == 128 && kHeadDims[2] == 256,
              "launch_flash_decode instantiates head_dim 64, 128 and 256");
constexpr bool supported_head_dim(int64_t head_dim) {
  return head_dim == kHeadDims[0] || head_dim == kHeadDims[1] || head_dim == kHeadDims[2];
}
// Query heads one thread block serves (the MMA's M); larger GQA groups take several blocks.
constexpr int kHeadsPerBlock = FLASHDECODE_HEADS_PER_BLOCK;
// Largest split count a launch accepts (bounds the merge's shared memory).
constexpr int kMaxSplits = FLASHDECODE_MAX_SPLITS;
// Fewest tokens a non-empty split gets (then rounded up to a whole tile).
constexpr int kMinChunk = FLASHDECODE_MIN_CHUNK;
// Groups of at most this many query heads per KV head run four consumer warps of 32 tokens at
// head_dim 64 (larger groups keep eight of 16, which hold the padding rows' softmax state).
constexpr int kWideWarpHeadDim = FLASHDECODE_WIDE_WARP_HEAD_DIM;
constexpr int kWideWarpMaxGroup = FLASHDECODE_WIDE_WARP_MAX_GROUP;
static_assert(kWideWarpHeadDim == 64, "the four-warp layout is instantiated at head_dim 64");
// Split blocks resident per SM: two, or three in the three-per-SM plan.
constexpr int kBlocksPerSm = FLASHDECODE_BLOCKS_PER_SM;
constexpr int kWideBlocksPerSm = FLASHDECODE_WIDE_BLOCKS_PER_SM;
// A cache block holds a multiple of kBlockSizeGranule tokens and divides, or is a multiple of,
// kBlockSizePeriod (the largest tile), so that no bulk copy crosses a page.
constexpr int kBlockSizeGranule = FLASHDECODE_BLOCK_SIZE_GRANULE;
constexpr int kBlockSizePeriod = FLASHDECODE_BLOCK_SIZE_PERIOD;
// Tokens of one K/V tile (a 32 KB pipeline stage of K and V): 128 at head_dim 64, 64 at 128, 32 at 256.
__host__ __device__ constexpr int tile_tokens(int head_dim) { return FLASHDECODE_TILE_ELEMENTS / head_dim; }
static_assert(tile_tokens(64) == kBlockSizePeriod, "the largest tile is the block-size period");
static_assert(kMinChunk % tile_tokens(64) == 0, "a minimal split is whole tiles");

constexpr bool supported_block_size(int64_t block_size) {
  return block_size > 0 && block_size % kBlockSizeGranule == 0 &&
         (kBlockSizePeriod % block_size == 0 || block_size % kBlockSizePeriod == 0);
}

enum class DType : int { kBFloat16 = 0, kHalf = 1 };
// The KV cache's element type: the query's own (bf16 or fp16), or int8 codes that dequantise as
// code * scale, one float16 scale per token and KV head for K and one for V (int8.cuh).
enum class KvDType : int { kSameAsQuery = 0, kInt8 = 1 };
// The largest int8 code, and the largest row scale (rows of larger magnitudes saturate).
constexpr float kInt8Max = 127.f;
constexpr float kInt8ScaleMax = 512.f;

struct DecodeParams {
  const void* q;                  // [B, Hq, D]; last dim contiguous, strides in elements
  int64_t q_stride_b, q_stride_h;
  const void* k_cache;            // [num_blocks, Hkv, block_size, D] contiguous
  const void* v_cache;
  const int32_t* block_table;     // [B, max_blocks], row stride block_table_stride
  int64_t block_table_stride;
  const int32_t* seq_lens;        // [B]
  void* out;                      // [B, Hq, D] contiguous
  float* partial_out;             // [>= B * num_splits, Hq, D]
  float* partial_lse;             // [>= B * num_splits, Hq]
  int batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_blocks, num_splits;
  float scale;
  DType dtype;
  bool three_per_sm;              // the planner's three-per-SM plan (kernels/planner.py): two splits of
                                  // four-warp blocks, three per SM, merging in a cluster
  bool read_ahead;                // seq_lens, block_table and the cache's rows before seq_len - 1 are
                                  // read before the kernels ahead in the stream have finished: none
                                  // that may still run may write them (q and row seq_len - 1 they
                                  // may); q is read, and every output written, after they finish

  // Chosen per grid by the launcher (launch_typed in flash_decode.cu); callers leave them.
  int ring_stages;                // K/V tiles in flight per block
  int copy_rows;                  // cache rows per bulk copy in a block of at least kCopyRowsMinTiles tiles
  bool cluster;                   // the splits of a (sequence, head group) form a cluster and merge in
                                  // the leader's shared memory
  bool trigger_at_loads;          // a split block lets the next grid in once its last loads are issued
                                  // (else at entry)
  bool merge_waits_first;         // the merge kernel lets the next grid in only once this split grid
                                  // has finished (else at entry)

  int window;                     // sliding window: positions >= seq_len - window only (0: every position)

  KvDType kv_dtype;               // kInt8: the caches hold int8 codes, dequantised with the row scales
  const void* k_scale;            // [num_blocks, Hkv, block_size] float16, contiguous and 16-byte
  const void* v_scale;            // aligned (int8 caches only, else null)
};

struct WriteKvParams {
  void* k_cache;                  // [num_blocks, Hkv, block_size, D] contiguous
  void* v_cache;
  const void* key;                // [T, Hkv, D]; last dim contiguous, strides in bytes
  const void* value;
  int64_t key_stride_t, key_stride_h, value_stride_t, value_stride_h;
  const void* slot_mapping;       // [T] int32 or int64
  bool slots_are_int64;
  int64_t num_tokens, num_slots;  // num_slots = num_blocks * block_size
  int num_kv_heads, block_size;
  int row_bytes;                  // D * the cache's element size, a multiple of 16 (8 for int8 caches)

  KvDType kv_dtype;               // kInt8: key/value (of src_dtype) are quantised per row, the row
  DType src_dtype;                // scales written beside the codes
  void* k_scale;                  // [num_blocks, Hkv, block_size] float16 (int8 caches only, else null)
  void* v_scale;
};

// The inverse of WriteKvParams: rows [K, Hkv, D] read from their slots (int8 codes dequantised).
struct ReadKvParams {
  const void* k_cache;            // [num_blocks, Hkv, block_size, D] contiguous
  const void* v_cache;
  void* key;                      // [K, Hkv, D] contiguous, of dst_dtype
  void* value;
  const int32_t* slot_mapping;    // [K]; a slot < 0 reads as a row of zeros
  int64_t num_rows, num_slots;    // num_slots = num_blocks * block_size
  int num_kv_heads, block_size, head_dim;

  KvDType kv_dtype;               // kInt8: rows are code * row scale, rounded to dst_dtype
  DType dst_dtype;
  const void* k_scale;            // [num_blocks, Hkv, block_size] float16 (int8 caches only, else null)
  const void* v_scale;
};

cudaError_t launch_flash_decode(const DecodeParams& params, cudaStream_t stream);
cudaError_t launch_write_kv(const WriteKvParams& params, cudaStream_t stream);
cudaError_t launch_read_kv(const ReadKvParams& params, cudaStream_t stream);

}  // namespace flashdecode
