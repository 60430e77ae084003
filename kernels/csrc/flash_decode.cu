// Paged, GQA-aware split-KV flash decoding for Hopper (sm_90): the launch policy.
//
// The split count and the three-per-SM choice come from the planner (kernels/planner.py, through
// DecodeParams); from them and the SM count this file picks the rest of each grid's launch, as
// measured best on the H200 (docs/log.md). The kernels are in split_kernel.cuh (the split's
// pipeline in pipeline.cuh) and merge.cuh; docs/kernel.md describes the whole.

#include "split_kernel.cuh"

namespace flashdecode {
namespace {

// Whether a cluster of ``splits`` split blocks fits on this device (cached per device and size).
template <typename T, int D, int W, typename KV>
bool cluster_fits(int splits) {
  using S = Shape<D, W>;
  static int8_t known[64][kMaxClusterSplits + 1];  // 0 unknown, 1 fits, -1 does not
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return false;
  int8_t& slot = known[device][splits];
  int8_t k = __atomic_load_n(&slot, __ATOMIC_ACQUIRE);
  if (k != 0) return k > 0;
  cudaError_t err = splits <= 8 ? cudaSuccess
                                 : cudaFuncSetAttribute(split_kernel<T, D, W, KV>,
                                                        cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (err == cudaSuccess) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(splits, 1, 1);
    config.blockDim = dim3(S::kThreads);
    config.dynamicSmemBytes = kMaxSmemBytes;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = splits;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    int clusters = 0;
    err = cudaOccupancyMaxActiveClusters(&clusters, split_kernel<T, D, W, KV>, &config);
    if (err == cudaSuccess) {
      __atomic_store_n(&slot, int8_t(clusters > 0 ? 1 : -1), __ATOMIC_RELEASE);
      return clusters > 0;
    }
  } else {  // this device does not take clusters of this size
    __atomic_store_n(&slot, int8_t(-1), __ATOMIC_RELEASE);
  }
  // The failed call's error is this launch's answer (the merge kernel serves it), not one for the
  // caller's next check. A failed occupancy query is asked again next time.
  cudaGetLastError();
  return false;
}

template <typename T, int D, int W, typename KV>
cudaError_t launch_split(const DecodeParams& p, dim3 grid, int smem_bytes, bool cluster, cudaStream_t stream) {
  using S = Shape<D, W>;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(S::kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (cluster) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = grid.x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // every grid is a PDL dependent
  attr[n].val.programmaticStreamSerializationAllowed = 1;
  ++n;
  config.attrs = attr;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, split_kernel<T, D, W, KV>, p);
}

template <typename T, int D, int W, typename KV>
cudaError_t launch_typed(const DecodeParams& params, cudaStream_t stream) {
  using S = Shape<D, W>;
  static uint64_t smem_raised = 0;
  cudaError_t err = allow_dynamic_smem(split_kernel<T, D, W, KV>, kMaxSmemBytes, smem_raised);
  if (err != cudaSuccess) return err;
  DecodeParams p = params;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head_tiles = (group + kRows - 1) / kRows;
  const dim3 grid(p.num_splits, p.num_kv_heads * head_tiles, p.batch);
  const int64_t blocks = (int64_t)grid.x * grid.y * grid.z;
  const int sms = sm_count();
  // Every grid is a PDL dependent that reads ahead, and lets the next grid in as early as it can
  // without its blocks landing unevenly (measured: docs/log.md):
  // - the three-per-SM plan (two splits filling one wave of three four-warp blocks per SM, e.g.
  //   9/3/64 at B=64): rings of two stages, the two splits merging in a cluster, the next grid
  //   let in once the loads are issued;
  // - a one-wave grid is spread one block per SM (else early-placed blocks doubled up on some
  //   SMs: 10-14 % slower). Its splits merge in a cluster where clusters cannot crowd the SMs
  //   they share (two splits, or a grid of at most half the SMs; sixteen-block clusters on 128
  //   blocks were 50 % slower), and that grid, or one of a single split, lets the next in once
  //   its loads are issued; otherwise the merge kernel, every trigger at entry;
  // - a grid of more blocks than two per SM is placed whole before the next can start: every
  //   trigger at entry;
  // - in between: a grid of one split lets the next in once its loads are issued; one of several
  //   splits lets it in at entry, and its merge kernel only once the split grid has finished.
  const bool spread = !p.three_per_sm && blocks <= sms;
  bool wants_cluster = false;
  p.trigger_at_loads = false;
  p.merge_waits_first = false;
  if (p.three_per_sm || (spread && (p.num_splits <= 2 || 2 * blocks <= sms))) {
    wants_cluster = true;
    p.trigger_at_loads = true;
  } else if (!spread && blocks <= kBlocksPerSm * sms) {
    p.trigger_at_loads = p.num_splits == 1;
    p.merge_waits_first = true;
  }
  // Blocks that share an SM stream long sequences faster in copies of 16 rows than of whole
  // pages (9/3/64 B=64 M=4096: 52.2 against 54.9 us); lone blocks are slower so.
  const int whole = min(p.block_size, S::kTile);
  p.copy_rows = blocks > sms && whole % 16 == 0 ? 16 : whole;
  p.ring_stages = (p.three_per_sm ? kMinStages : kStages) * stages_per_tile_bytes<KV>();
  const int past = past_ring<KV, D>(p);
  const int rows = group < kRows ? group : kRows;
  const int recv_bytes = kRecvLseBytes + p.num_splits * rows * D * 4;
  p.cluster = wants_cluster && p.num_splits > 1 && p.num_splits <= kMaxClusterSplits &&
              past + recv_bytes <= kMaxSmemBytes && cluster_fits<T, D, W, KV>(p.num_splits);
  if (wants_cluster && !p.cluster && p.num_splits > 1) p.trigger_at_loads = false;  // the merge kernel serves
  int smem = past + (p.cluster ? recv_bytes : 0);
  if (spread) smem = max(smem, S::kSpreadSmemBytes);  // no SM can take two of its blocks
  err = launch_split<T, D, W, KV>(p, grid, smem, p.cluster, stream);
  if (err != cudaSuccess || p.num_splits == 1 || p.cluster) return err;
  return launch_pdl(merge_kernel<T, D>, dim3(p.num_q_heads, p.batch), dim3(kMergeThreads), 0, stream, p);
}

// KV: T, or int8_t for int8 caches.
template <typename T, typename KV>
cudaError_t launch_head_dim(const DecodeParams& p, bool wide, cudaStream_t stream) {
  if (p.head_dim == 64) return wide ? launch_typed<T, 64, 32, KV>(p, stream) : launch_typed<T, 64, 16, KV>(p, stream);
  if (p.head_dim == 128) return launch_typed<T, 128, 16, KV>(p, stream);
  if (p.head_dim == 256) return launch_typed<T, 256, 16, KV>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_flash_decode(const DecodeParams& p, cudaStream_t stream) {
  if (p.num_splits < 1 || p.num_splits > kMaxSplits || p.batch < 1 || p.num_kv_heads < 1) return cudaErrorInvalidValue;
  if (!supported_block_size(p.block_size) || p.window < 0) return cudaErrorInvalidValue;
  // Four consumer warps of 32 tokens beat eight of 16 at head_dim 64 (docs/log.md); groups of
  // more heads keep eight warps, which hold the padding rows' softmax state.
  const bool wide = p.head_dim == kWideWarpHeadDim && p.num_q_heads / p.num_kv_heads <= kWideWarpMaxGroup;
  if (p.three_per_sm && !(wide && p.num_splits == 2)) return cudaErrorInvalidValue;
  const bool int8 = p.kv_dtype == KvDType::kInt8;
  if (int8 != (p.k_scale != nullptr) || int8 != (p.v_scale != nullptr)) return cudaErrorInvalidValue;
  if (p.dtype == DType::kBFloat16)
    return int8 ? launch_head_dim<__nv_bfloat16, int8_t>(p, wide, stream)
                : launch_head_dim<__nv_bfloat16, __nv_bfloat16>(p, wide, stream);
  return int8 ? launch_head_dim<__half, int8_t>(p, wide, stream) : launch_head_dim<__half, __half>(p, wide, stream);
}

}  // namespace flashdecode
