// The split kernel: grid (num_splits, Hkv * ceil(G / 16), B). A block serves up to 16 query heads
// of one KV head over one split of one sequence: the pipeline (pipeline.cuh) over its tokens, then
// an epilogue that combines the consumer warps and writes the split's normalised rows and LSEs to
// the output (one split), the workspace (for merge_kernel) or the cluster leader's shared memory,
// where the leader merges them (cluster_merge).
#pragma once

#include "merge.cuh"
#include "pipeline.cuh"

namespace flashdecode {
namespace {

constexpr int kMaxStages = 6;                      // ring stages a block may hold (the static barriers)
// Most splits one cluster merge serves (a non-portable cluster size on Hopper); more use the kernel.
constexpr int kMaxClusterSplits = 16;
// Most dynamic shared memory a split block asks for (the SM's 228 KB less the static part and
// the per-block reserve): the ring, then a cluster's receive area; see launch_typed.
constexpr int kMaxSmemBytes = 224 * 1024;
// What a cluster's leader receives past its ring: every split's LSEs, then its rows.
constexpr int kRecvLseBytes = kMaxClusterSplits * kRows * 4;

// Where a block's rows and LSEs go: the output itself (a grid of one split), a workspace slot for
// the merge kernel, or the cluster leader's shared memory.
enum Sink { kToOutput, kToPartial, kToCluster };

// Shared memory past a block's ring (and past the epilogue, which reuses the first stages).
template <typename KV, int D>
__host__ __device__ __forceinline__ int past_ring(const DecodeParams& p) {
  return max(p.ring_stages * stage_bytes<KV, D>(), kMinStages * kStageBytes);
}

// A cluster leader's receive area, past its ring: every split's LSEs (kRows each), then its rows.
template <typename KV, int D>
__device__ __forceinline__ float* cluster_recv_lse(const DecodeParams& p, uint8_t* smem) {
  return reinterpret_cast<float*>(smem + past_ring<KV, D>(p));
}
template <typename KV, int D>
__device__ __forceinline__ float* cluster_recv_rows(const DecodeParams& p, uint8_t* smem) {
  return cluster_recv_lse<KV, D>(p, smem) + kMaxClusterSplits * kRows;
}

// One block's attention over tokens [w.start, w.end) of one (sequence, head group): the K/V ring
// (producer warp and consumer warps), then the epilogue that combines the consumer warps and
// writes the rows and their LSEs to ``sink`` (``slot``: the workspace row for kToPartial). Every
// thread of the block calls it.
template <typename T, int D, int W, typename KV>
__device__ __forceinline__ void attend(const DecodeParams& p, const Work& w, Sink sink, int64_t slot, uint8_t* smem,
                                       uint64_t* full, uint64_t* empty) {
  using S = Shape<D, W>;
  constexpr int kTile = S::kTile, kConsumerWarps = S::kConsumerWarps, kThreads = S::kThreads;
  __shared__ float warp_max[kConsumerWarps][kRows], warp_sum[kConsumerWarps][kRows];
  __shared__ float row_lse[kRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, qd = lane % 4;
  const bool consumer = warp != S::kProducerWarp;
  const int hq = p.num_q_heads;
  float* o_smem = reinterpret_cast<float*>(smem);
  const int n_tiles = (w.end - w.start + kTile - 1) / kTile;
  RingSlot ring(p.ring_stages);

  float o[S::kGroups][4][4];
#pragma unroll
  for (int j = 0; j < S::kGroups; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[j][c][0] = o[j][c][1] = o[j][c][2] = o[j][c][3] = 0.f;
  float m_lo = kNegInf, m_hi = kNegInf, l_lo = 0.f, l_hi = 0.f;
  if (consumer) {
    wait_for_predecessor();  // q is the predecessor's output
    if constexpr (W == 32)  // the launcher gives 32-token warps groups of at most eight heads
      consume<T, KV, D, W, false>(p, w, n_tiles, ring, smem, full, empty, o, m_lo, m_hi, l_lo, l_hi);
    else if (w.rows > 8)
      consume<T, KV, D, W, true>(p, w, n_tiles, ring, smem, full, empty, o, m_lo, m_hi, l_lo, l_hi);
    else
      consume<T, KV, D, W, false>(p, w, n_tiles, ring, smem, full, empty, o, m_lo, m_hi, l_lo, l_hi);
    if (qd == 0) {
      warp_max[warp][r] = m_lo;
      warp_max[warp][r + 8] = m_hi;
      warp_sum[warp][r] = l_lo;
      warp_sum[warp][r + 8] = l_hi;
    }
  } else {
    produce<KV, D>(p, w, n_tiles, ring, smem, full, empty);
  }
  __syncthreads();  // every consumer's state is in and every stage is drained

  if (consumer) {  // rescale to the block's max and normalise, into o_smem[warp][row][:]
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (half == 1 && w.rows <= 8) break;  // rows r + 8 are padding
      const int row = r + 8 * half;
      float mx = kNegInf;
#pragma unroll
      for (int k = 0; k < kConsumerWarps; ++k) mx = fmaxf(mx, warp_max[k][row]);
      const float base = mx == kNegInf ? 0.f : mx;
      float total = 0.f;
#pragma unroll
      for (int k = 0; k < kConsumerWarps; ++k) total += warp_sum[k][row] * exp2_approx(warp_max[k][row] - base);
      const float factor = total > 0.f ? __fdividef(exp2_approx((half ? m_hi : m_lo) - base), total) : 0.f;
      if (warp == 0 && qd == 0) row_lse[row] = total > 0.f ? (base + __log2f(total)) * kLn2 : kNegInf;
      float* dst = o_smem + (warp * kRows + row) * S::kOStride;
#pragma unroll
      for (int j = 0; j < S::kGroups; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          *reinterpret_cast<float2*>(dst + fragment_col<KV>(j, qd) + 2 * c) =
              make_float2(o[j][c][2 * half] * factor, o[j][c][2 * half + 1] * factor);
    }
  }
  __syncthreads();
  if (sink == kToCluster) cluster_wait_started();

  float* recv_lse = cluster_recv_lse<KV, D>(p, smem);
  float* recv_rows = cluster_recv_rows<KV, D>(p, smem);
  constexpr int kCols = D / 4;
  for (int idx = threadIdx.x; idx < w.rows * kCols; idx += kThreads) {
    const int row = idx / kCols, col = idx % kCols;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < kConsumerWarps; ++k) {
      const float4 x = *reinterpret_cast<const float4*>(o_smem + (k * kRows + row) * S::kOStride + 4 * col);
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    const int64_t head = w.q_head0 + row;
    if (sink == kToOutput)
      store4(static_cast<T*>(p.out) + ((int64_t)w.b * hq + head) * D + 4 * col, acc);
    else if (sink == kToCluster)
      cluster_store4(cluster_addr(recv_rows + (blockIdx.x * w.rows + row) * D + 4 * col, 0), acc);
    else
      *reinterpret_cast<float4*>(p.partial_out + (slot * hq + head) * D + 4 * col) = acc;
  }
  if (sink != kToOutput && threadIdx.x < w.rows) {
    if (sink == kToCluster)
      cluster_store(cluster_addr(recv_lse + blockIdx.x * kRows + threadIdx.x, 0), row_lse[threadIdx.x]);
    else
      p.partial_lse[slot * hq + w.q_head0 + threadIdx.x] = row_lse[threadIdx.x];
  }
}

// A block with no tokens: an empty split contributes lse = -inf and no output; a grid of one split
// (only for an invalid length of 0) writes zeros, never NaN.
template <int D, int W, typename KV>
__device__ __forceinline__ void write_empty(const DecodeParams& p, const Work& w, bool cluster, uint8_t* smem) {
  const int splits = gridDim.x, hq = p.num_q_heads;
  if (splits == 1) {
    uint16_t* out = static_cast<uint16_t*>(p.out) + ((int64_t)w.b * hq + w.q_head0) * D;
    for (int idx = threadIdx.x; idx < w.rows * D; idx += Shape<D, W>::kThreads) out[idx] = 0;
  } else if (cluster) {
    cluster_wait_started();
    if (threadIdx.x < w.rows)
      cluster_store(cluster_addr(cluster_recv_lse<KV, D>(p, smem) + blockIdx.x * kRows + threadIdx.x, 0), kNegInf);
  } else if (threadIdx.x < w.rows) {
    p.partial_lse[((int64_t)w.b * splits + blockIdx.x) * hq + w.q_head0 + threadIdx.x] = kNegInf;
  }
}

// The ring's barriers: a full barrier per stage (the producer's byte count) and an empty one (every
// consumer warp's release). Thread 0 initialises them; a block barrier must follow.
template <int D, int W>
__device__ __forceinline__ void init_ring(const DecodeParams& p, uint64_t* full, uint64_t* empty) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.ring_stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], Shape<D, W>::kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
}

template <typename T, int D, int W, typename KV>
__global__ void __launch_bounds__(Shape<D, W>::kThreads, Shape<D, W>::kMinBlocks) split_kernel(const DecodeParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];

  const int splits = gridDim.x;
  if (p.cluster) cluster_arrive_started();
  if (!p.trigger_at_loads) pdl_trigger();
  // With read_ahead the length, the block ids and the first ring fill are asked for now; the
  // consumers wait before they read q, the producer before the rest of the ring (produce).
  if (!p.read_ahead) wait_for_predecessor();
  init_ring<D, W>(p, full, empty);  // while the sequence length is in flight

  const Work w = block_work<D>(p);
  __syncthreads();  // the ring's barriers are initialised

  if (w.start < w.end) {
    const Sink sink = splits == 1 ? kToOutput : p.cluster ? kToCluster : kToPartial;
    attend<T, D, W, KV>(p, w, sink, (int64_t)w.b * splits + blockIdx.x, smem, full, empty);
  } else {
    wait_for_predecessor();
    write_empty<D, W, KV>(p, w, p.cluster, smem);
  }

  if (p.cluster) {  // the leader waits for every split's push (the barrier's second phase)
    cluster_arrive();
    if (blockIdx.x != 0) return;
    cluster_wait();
    cluster_merge<T, D>(p, w, cluster_recv_lse<KV, D>(p, smem), cluster_recv_rows<KV, D>(p, smem));
  }
}

}  // namespace
}  // namespace flashdecode
