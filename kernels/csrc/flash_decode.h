// Plain-C++ interface between the torch binding (binding.cpp) and the CUDA kernels
// (flash_decode.cu), so that the .cu needs no torch headers and compiles quickly.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace flashdecode {

enum class DType : int { kBFloat16 = 0, kHalf = 1 };

// How split partials become the output when num_splits > 1.
enum MergeMode : int {
  kMergeLastBlock = 0,    // the last split block of each (sequence, KV head) merges, same launch
  kMergeKernel = 1,       // a second, small kernel
  kMergeKernelPdl = 2,    // the second kernel with programmatic dependent launch
  kMergePdlChain = 3,     // as 2, and the split kernel itself a PDL dependent of what precedes it
  kMergePdlLate = 4,      // as 3, but the next grid is let in only once this call's KV reads are done
  kMergeCluster = 5,      // the splits of a (sequence, head group) form a thread-block cluster and
                          // merge through distributed shared memory, in one launch (else as 2)
  kMergeClusterPdl = 6,   // as 5, launched as a PDL dependent with the late trigger of 4 (else as 4)
  kMergeAuto = 7,         // by the grid, as measured best on the H200 (launch_typed in flash_decode.cu)
  kMergePdlLoads = 8,     // as 4, but a one-split grid lets the next grid in once its last loads are issued
  kMergeClusterPdlLoads = 9,  // as 6, but a cluster or one-split grid lets the next in once its loads are
                              // issued (else as 3)
};

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
  int32_t* merge_counters;        // [>= B * Hkv * ceil(G / 16)], all zero between calls
  int batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_blocks, num_splits;
  int min_chunk;                  // fewest tokens a non-empty split gets (then rounded up to a tile)
  float scale;
  DType dtype;
  int merge_mode;
  bool spread;                    // a grid of at most one block per SM asks for enough shared
                                  // memory that no SM can take two of its blocks (cluster grids too;
                                  // without spread their blocks may share SMs)
  int ring_stages;                // K/V tiles in flight per block, 1..kMaxRingStages; 0: the launcher's
                                  // choice (3; 2 in the three-per-SM plan). More than 3 only for
                                  // spread or cluster grids.
  int copy_rows;                  // cache rows per bulk copy in a block of at least kCopyRowsMinTiles
                                  // tiles (shorter blocks copy whole pages, or whole tiles of larger
                                  // ones): a multiple of 8 dividing the page and the tile (128 rows at
                                  // D=64, 64 at D=128); 0: the launcher's choice
  int warp_tokens;                // tokens of a tile per consumer warp: 16, or 32 at head_dim 64 with groups
                                  // of <= 8 query heads (half the consumer warps, each over twice the
                                  // tokens); 0: the launcher's choice, 32 where allowed
  bool merge_one_trip;            // the merge kernel's row in one round trip to memory where that pays
                                  // (16-64 splits at head_dim 64, 16-32 at 128); false: two always
  int ahead_tiles;                // with read_ahead (else unused): K/V tiles asked for before the
                                  // predecessor has finished, at most the ring's depth; 0: the launcher's
                                  // choice (kReadAheadTiles). A ring deeper than that has a stage to
                                  // refill the moment it finishes
  bool read_ahead;                // seq_lens, block_table and the cache's rows before seq_len - 1 are
                                  // read before the kernels ahead in the stream have finished: none
                                  // that may still run may write them (q and row seq_len - 1 they
                                  // may); q is read, and every output written, after they finish
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
  int row_bytes;                  // D * element size, a multiple of 16
};

// Merge modes 0..kMergeModes - 1 exist.
constexpr int kMergeModes = 10;
// Tokens of one K/V tile (a 32 KB pipeline stage of K and V): 128 at head_dim 64, 64 at 128.
constexpr int tile_tokens(int head_dim) { return 8192 / head_dim; }
// Blocks of fewer tiles than this copy whole pages whatever copy_rows says (measured: NOTES.md).
constexpr int kCopyRowsMinTiles = 8;
// Tiles a split block reads ahead by default (capped by its ring): the default ring of three keeps
// a stage free, so that the producer asks for a tile the moment the predecessor finishes
// (measured: NOTES.md).
constexpr int kReadAheadTiles = 2;
// Deepest ring of K/V stages a block may ask for (deeper than 3 only where it is alone on its SM).
constexpr int kMaxRingStages = 6;
// Largest split count a launch accepts (bounds the merge's shared memory).
constexpr int kMaxSplits = 256;
// Most splits one cluster merge serves (a non-portable cluster size on Hopper); more use the kernel.
constexpr int kMaxClusterSplits = 16;
// Query heads one thread block serves (the MMA's M); larger GQA groups take several blocks.
constexpr int kHeadsPerBlock = 16;

cudaError_t launch_flash_decode(const DecodeParams& params, cudaStream_t stream);

#ifdef FLASHDECODE_TIMELINE
// Diagnostic build only (python -m kernels.timeline): per-block clock stamps of the last call.
constexpr int kTimelineBlocks = 4096;
constexpr int kTimelineStamps = 16;
cudaError_t read_timeline(int64_t* host, bool reset);
#endif
cudaError_t launch_write_kv(const WriteKvParams& params, cudaStream_t stream);

}  // namespace flashdecode
