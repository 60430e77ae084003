// Paged, GQA-aware split-KV flash decoding for Hopper (sm_90), plus the KV-cache write.
//
// Grid (num_splits, Hkv * ceil(G / 16), B). A block serves up to 16 query heads of one KV head
// over one split of one sequence. A producer warp streams the split's K/V tiles (32 KB: 64 tokens
// at D=128, 128 at D=64; each page's per-head rows are contiguous, so one cp.async.bulk per page)
// into a ring of shared-memory stages guarded by mbarriers. Each consumer warp owns 16 tokens of a
// tile (32 at head_dim 64 for groups of at most eight heads: four warps instead of eight): S = Q K^T
// and O += P V on the tensor cores (m16n8k16, fp32 accumulation) with an online softmax per warp;
// the warps' states are combined at the end of the split. With more than one
// split the partials are merged exactly, by one of the launch plans of flash_decode.h: the
// default (kMergeAuto, launch_typed) has the splits of a (sequence, head group) form a cluster
// and push their rows into the leader's shared memory where that pays, and otherwise writes them
// to the workspace for a small merge kernel.
//
// Fragment trick: reading K and V rows with one 16-byte load per thread avoids ldmatrix bank
// conflicts on the unpadded tiles. The head dimension is the reduction of S = Q K^T, so K's
// elements may be fed to the MMA in any order that Q's fragments follow as well; for P V the
// head dimension is the output column, so V's 8x8 pieces are transposed with movmatrix and the
// output columns land in a known permutation (each thread ends up owning 8 contiguous columns).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flash_decode.h"
#include "launch.h"

namespace flashdecode {
namespace {

constexpr int kRows = kHeadsPerBlock;
constexpr int kStageBytes = 32 * 1024;             // one tile of K and V
constexpr int kStages = 3;                         // 96 KB: two blocks per SM
constexpr int kMinStages = 2;                      // the shared memory of the epilogue and the merge
constexpr int kMaxStages = kMaxRingStages;         // deeper only where a block is alone on its SM
constexpr int kMergeThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -__builtin_huge_valf();

// A tile is 32 KB of K+V: 128 tokens for D=64, 64 for D=128. A consumer warp owns W of its tokens:
// D=64 has 4 consumer warps of 32 (8 of 16 for groups of more than eight heads), D=128 4 of 16.
template <int D, int W>
struct Shape {
  static_assert(W == 16 || W == 32, "a consumer warp owns 16 or 32 tokens of a tile");
  static constexpr int kTile = tile_tokens(D);                   // tokens per pipeline stage
  static constexpr int kConsumerWarps = kTile / W;
  static constexpr int kProducerWarp = kConsumerWarps;
  static constexpr int kThreads = (kConsumerWarps + 1) * 32;
  static_assert(2 * kTile * D * 2 == kStageBytes, "a tile of K and V fills one stage");
  static constexpr int kSmemBytes = kMinStages * kStageBytes;    // the least a block holds
  // Two blocks per SM; three of the four-warp ones, with rings of two stages (which caps them at
  // 128 registers: some scheduler then holds four of their warps).
  static constexpr int kMinBlocks = W == 32 ? 3 : 2;
  static constexpr int kGroups = D / 32;                         // 16-byte loads per row per thread
  static constexpr int kOStride = D + 4;                         // padded fp32 row, epilogue
  static_assert(kConsumerWarps * kRows * kOStride * 4 <= kSmemBytes, "epilogue does not fit");
  static_assert(kRows * kMaxSplits * 4 + kThreads * 16 <= kSmemBytes, "merge does not fit");
  static constexpr int kSpreadSmemBytes = 160 * 1024;              // over half an SM's 228 KB
};

// Most dynamic shared memory a split block asks for (the SM's 228 KB less the static part and
// the per-block reserve): a deeper ring, then a cluster's receive area; see launch_typed.
constexpr int kMaxSmemBytes = 224 * 1024;
// What a cluster's leader receives past its ring: every split's LSEs, then its rows.
constexpr int kRecvLseBytes = kMaxClusterSplits * kRows * 4;

// ---- PTX wrappers ---------------------------------------------------------------------------

// Timeline stamps (diagnostic build only): the SM clock when ``dep`` (a loaded value) is ready.
enum Stamp {
  kEntry, kWaited, kLength, kTable, kFirstTile, kLoopDone, kSynced, kReduced, kStored, kClusterSynced, kMerged, kExit,
  kEntryNs, kExitNs,
  kConsumerWaits, kProducerWaits  // cycles consumer warp 0 spent waiting for data, the producer for free stages
};
#ifdef FLASHDECODE_TIMELINE
__device__ long long g_timeline[kTimelineBlocks][kTimelineStamps];
__device__ __forceinline__ int64_t timeline_block() {
  return blockIdx.x + (int64_t)gridDim.x * (blockIdx.y + (int64_t)gridDim.y * blockIdx.z);
}
__device__ __forceinline__ void stamp(Stamp which, uint32_t dep = 0) {
  const int64_t block = timeline_block();
  long long t;
  asm volatile("{\n .reg .b32 z;\n and.b32 z, %1, 0;\n mov.u64 %0, %%clock64;\n}" : "=l"(t) : "r"(dep) : "memory");
  if (block < kTimelineBlocks) g_timeline[block][which] = t;
  if (which == kEntry || which == kExit) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    if (block < kTimelineBlocks) g_timeline[block][which == kEntry ? kEntryNs : kExitNs] = t;
  }
}
__device__ __forceinline__ long long clock_now() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}
__device__ __forceinline__ void record(Stamp which, long long value) {
  const int64_t block = timeline_block();
  if (block < kTimelineBlocks) g_timeline[block][which] = value;
}
#else
__device__ __forceinline__ void stamp(Stamp, uint32_t = 0) {}
__device__ __forceinline__ long long clock_now() { return 0; }
__device__ __forceinline__ void record(Stamp, long long) {}
#endif

// Diagnostic (kernels.timeline --copy-only): the consumers release every tile unread, so a call
// costs the memory path, the epilogue and the merge alone; its output is wrong.
#ifdef FLASHDECODE_COPY_ONLY
constexpr bool kCopyOnly = true;
#else
constexpr bool kCopyOnly = false;
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// Distributed shared memory: the same variable in the cluster's block ``rank``.
__device__ __forceinline__ uint32_t cluster_addr(const void* p, uint32_t rank) {
  uint32_t addr;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(addr) : "r"(smem_u32(p)), "r"(rank));
  return addr;
}

__device__ __forceinline__ void cluster_store(uint32_t addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

__device__ __forceinline__ void cluster_store4(uint32_t addr, float4 v) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

// Every thread of every block of the cluster arrives; writes before arriving (to any block's
// shared memory) are visible to the threads that wait.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// The first phase of the cluster barrier only says that a block has started: no block writes to
// another's shared memory before every block of the cluster is running.
__device__ __forceinline__ void cluster_arrive_started() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_started() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Whether the splits of a (sequence, head group) merge in a cluster (modes 5, 6 and 9; the launcher
// falls back to a merge kernel where the cluster does not fit).
__host__ __device__ __forceinline__ bool merges_in_cluster(const DecodeParams& p) {
  return p.merge_mode == kMergeCluster || p.merge_mode == kMergeClusterPdl || p.merge_mode == kMergeClusterPdlLoads;
}

// When a split block lets the next grid (a PDL dependent) in:
// - at entry: the merge kernel gets its blocks resident now and they wait (griddepcontrol.wait)
//   until this whole grid has finished and flushed;
// - once its last loads are issued (modes 8 and 9 with one split, mode 9 with a cluster; the
//   launcher never runs mode 9 with a multi-split grid that is not a cluster);
// - once its rows are stored (modes 5 and 6, and mode 4 with one split).
enum Trigger { kAtEntry, kAtLoads, kAtStores };

__device__ __forceinline__ Trigger trigger_point(const DecodeParams& p) {
  const int mode = p.merge_mode;
  const bool one_split = gridDim.x == 1;
  if (mode == kMergeClusterPdlLoads || (mode == kMergePdlLoads && one_split)) return kAtLoads;
  if ((mode == kMergeCluster && !one_split) || mode == kMergeClusterPdl || (mode == kMergePdlLate && one_split))
    return kAtStores;
  return kAtEntry;
}

// A no-op unless this grid was launched as a PDL dependent; a second call returns at once.
__device__ __forceinline__ void wait_for_predecessor() {
  pdl_wait();
  if (threadIdx.x == 0) stamp(kWaited);
}

__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <typename T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct Elem<__half> {
  static __device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <typename T>
__device__ __forceinline__ void store4(T* dst, float4 v) {
  uint2 packed{Elem<T>::pack(v.x, v.y), Elem<T>::pack(v.z, v.w)};
  *reinterpret_cast<uint2*>(dst) = packed;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Which query heads a block serves and which part of its sequence.
struct Work {
  int b, kv_head, q_head0, rows;
  int len, start, end;
};

template <int D>
__device__ __forceinline__ Work block_work(const DecodeParams& p) {
  constexpr int kTile = tile_tokens(D);
  Work w;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head_tiles = (group + kRows - 1) / kRows;
  w.b = blockIdx.z;
  w.kv_head = blockIdx.y / head_tiles;
  w.q_head0 = w.kv_head * group + (blockIdx.y % head_tiles) * kRows;
  w.rows = min(kRows, (w.kv_head + 1) * group - w.q_head0);
  w.len = min(p.seq_lens[w.b], p.max_blocks * p.block_size);
  int chunk = max((max(w.len, 0) + gridDim.x - 1) / gridDim.x, p.min_chunk);
  chunk = (chunk + kTile - 1) / kTile * kTile;
  const int64_t start = (int64_t)blockIdx.x * chunk;  // min_chunk may be up to 2^30
  w.start = (int)min(start, (int64_t)w.len);
  w.end = (int)min(start + chunk, (int64_t)w.len);
  return w;
}

// ---- merge of split partials ------------------------------------------------------------------

// Output rows [q_head0, q_head0 + rows) of sequence b from its num_splits partials.
// Uses every thread of the block; smem holds rows * num_splits weights + blockDim.x float4.
template <typename T, int D>
__device__ void merge_rows(const DecodeParams& p, int b, int q_head0, int rows, float* smem) {
  const int splits = p.num_splits, hq = p.num_q_heads;
  const int64_t slot0 = (int64_t)b * splits;  // the workspace row of split 0
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  float* weights = smem;
  float4* partial = reinterpret_cast<float4*>(smem + kRows * kMaxSplits);
  const float* lse = p.partial_lse + slot0 * hq + q_head0;
  for (int i = threadIdx.x; i < rows * splits; i += blockDim.x)
    weights[(i % rows) * splits + i / rows] = __ldcg(lse + (int64_t)(i / rows) * hq + i % rows);
  __syncthreads();

  for (int row = warp; row < rows; row += warps) {
    float* w = weights + row * splits;
    float mx = kNegInf;
    for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, w[s]);
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    if (mx != kNegInf)
      for (int s = lane; s < splits; s += 32) sum += __expf(w[s] - mx);
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float total = mx == kNegInf ? kNegInf : mx + __logf(sum);
    __syncwarp();
    for (int s = lane; s < splits; s += 32) w[s] = (total == kNegInf || w[s] == kNegInf) ? 0.f : __expf(w[s] - total);
  }
  __syncthreads();

  constexpr int kCols = D / 4;
  const int items = rows * kCols;
  const int tid = threadIdx.x;
  const int64_t split_stride = (int64_t)hq * D;
  if (items >= (int)blockDim.x) {  // enough columns for every thread: no split slicing
    for (int item = tid; item < items; item += blockDim.x) {
      const int row = item / kCols, col = item % kCols;
      const float* src = p.partial_out + (slot0 * hq + q_head0 + row) * D + col * 4;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
      for (int s = 0; s < splits; ++s) {
        const float w = weights[row * splits + s];
        if (w > 0.f) {
          const float4 v = __ldcg(reinterpret_cast<const float4*>(src + s * split_stride));
          acc.x += w * v.x;
          acc.y += w * v.y;
          acc.z += w * v.z;
          acc.w += w * v.w;
        }
      }
      store4(static_cast<T*>(p.out) + ((int64_t)b * hq + q_head0 + row) * D + col * 4, acc);
    }
    return;
  }
  const int slices = blockDim.x / items;
  if (tid < items * slices) {
    const int item = tid % items, slice = tid / items;
    const int row = item / kCols, col = item % kCols;
    const float* src = p.partial_out + (slot0 * hq + q_head0 + row) * D + col * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = slice; s < splits; s += slices) {
      const float w = weights[row * splits + s];
      if (w > 0.f) {  // empty splits never wrote their partial output
        const float4 v = __ldcg(reinterpret_cast<const float4*>(src + s * split_stride));
        acc.x += w * v.x;
        acc.y += w * v.y;
        acc.z += w * v.z;
        acc.w += w * v.w;
      }
    }
    partial[tid] = acc;
  }
  __syncthreads();
  if (tid < items) {
    float4 acc = partial[tid];
    for (int s = 1; s < slices; ++s) {
      const float4 v = partial[s * items + tid];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    const int row = tid / kCols, col = tid % kCols;
    store4(static_cast<T*>(p.out) + ((int64_t)b * hq + q_head0 + row) * D + col * 4, acc);
  }
}

// Most splits merge_row_one_trip serves: eight partial rows per thread. It pays from 16 splits on
// (9/3/64 B=1 M=32768, 44 splits: 10.0 against 12.0 us; 32/8/128 B=1 M=4096, 16: 8.7 against
// 9.9); with 5 it was up to 1 % slower (NOTES.md).
template <int D>
constexpr int one_trip_splits() { return 8 * (kMergeThreads / (D / 4)); }
constexpr int kOneTripMinSplits = 16;

// One output row (query head ``head`` of sequence b) in a single round trip to memory: each warp
// loads the LSEs (two per lane) while each thread's partial rows are already in flight, and
// derives the weights itself. The arithmetic and its order are merge_rows' (rows = 1), so the
// result is bit for bit the same.
template <typename T, int D>
__device__ void merge_row_one_trip(const DecodeParams& p, int b, int head, float4* partial) {
  constexpr int kCols = D / 4, kSlices = kMergeThreads / kCols, kPerThread = one_trip_splits<D>() / kSlices;
  static_assert(one_trip_splits<D>() <= 64, "two LSEs per lane");
  const int splits = p.num_splits, hq = p.num_q_heads, lane = threadIdx.x % 32;
  const int col = threadIdx.x % kCols, slice = threadIdx.x / kCols;
  const int64_t slot0 = (int64_t)b * splits, split_stride = (int64_t)hq * D;
  const float* lse = p.partial_lse + slot0 * hq + head;
  const float* src = p.partial_out + (slot0 * hq + head) * D + col * 4;
  const float l0 = lane < splits ? __ldcg(lse + (int64_t)lane * hq) : kNegInf;
  const float l1 = lane + 32 < splits ? __ldcg(lse + (int64_t)(lane + 32) * hq) : kNegInf;
  float4 v[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (slice + k * kSlices < splits)
      v[k] = __ldcg(reinterpret_cast<const float4*>(src + (slice + k * kSlices) * split_stride));

  float mx = fmaxf(fmaxf(kNegInf, l0), l1);
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  if (mx != kNegInf) {
    if (lane < splits) sum += __expf(l0 - mx);
    if (lane + 32 < splits) sum += __expf(l1 - mx);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float total = mx == kNegInf ? kNegInf : mx + __logf(sum);

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int s = slice + k * kSlices;
    const float lo = __shfl_sync(0xffffffffu, l0, s & 31), hi = __shfl_sync(0xffffffffu, l1, s & 31);
    const float ls = s < 32 ? lo : hi;
    const float w = (total == kNegInf || ls == kNegInf) ? 0.f : __expf(ls - total);
    if (s < splits && w > 0.f) {  // empty splits never wrote their partial output
      acc.x += w * v[k].x;
      acc.y += w * v[k].y;
      acc.z += w * v[k].z;
      acc.w += w * v[k].w;
    }
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x < kCols) {
    for (int s = 1; s < kSlices; ++s) {
      const float4 x = partial[s * kCols + threadIdx.x];
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    store4(static_cast<T*>(p.out) + ((int64_t)b * hq + head) * D + col * 4, acc);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const DecodeParams p) {
  if (p.merge_mode == kMergePdlLate || p.merge_mode == kMergePdlLoads) {  // the next split grid lands on SMs this split grid has left
    pdl_wait();
    pdl_trigger();
  } else {
    pdl_trigger_then_wait();  // the wait is a no-op unless launched as a PDL dependent
  }
  __shared__ __align__(16) float smem[kRows * kMaxSplits + kMergeThreads * 4];
  if (p.merge_one_trip && p.num_splits >= kOneTripMinSplits && p.num_splits <= one_trip_splits<D>())
    merge_row_one_trip<T, D>(p, blockIdx.y, blockIdx.x, reinterpret_cast<float4*>(smem));
  else
    merge_rows<T, D>(p, blockIdx.y, blockIdx.x, 1, smem);
}

// The cluster's leader (split 0) writes the output rows of its (sequence, head group) from the
// LSEs and normalised rows every split pushed into its shared memory; an empty split (lse = -inf)
// is skipped, never multiplied.
template <typename T, int D>
__device__ void cluster_merge(const DecodeParams& p, const Work& w, const float* recv_lse, const float* recv_rows) {
  constexpr int kCols = D / 4;
  const int splits = gridDim.x;
  for (int item = threadIdx.x; item < w.rows * kCols; item += blockDim.x) {
    const int row = item / kCols, col = item % kCols;
    float mx = kNegInf;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, recv_lse[s * kRows + row]);
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float lse = recv_lse[s * kRows + row];
      if (lse != kNegInf) {
        const float wgt = __expf(lse - mx);
        const float4 part = *reinterpret_cast<const float4*>(recv_rows + (s * w.rows + row) * D + 4 * col);
        sum += wgt;
        acc.x += wgt * part.x;
        acc.y += wgt * part.y;
        acc.z += wgt * part.z;
        acc.w += wgt * part.w;
      }
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    store4(static_cast<T*>(p.out) + ((int64_t)w.b * p.num_q_heads + w.q_head0 + row) * D + 4 * col,
           make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
  }
}

// ---- the split kernel -------------------------------------------------------------------------

// The next tile's place in the ring of shared-memory stages: its stage, and how often the ring
// has wrapped (the parity of the stage's barrier phase).
struct RingSlot {
  int stages, stage = 0, round = 0;
  __device__ __forceinline__ explicit RingSlot(int n) : stages(n) {}
  __device__ __forceinline__ void advance() {
    if (++stage == stages) stage = 0, ++round;
  }
};

template <typename T, int D>
__device__ __forceinline__ void produce(const DecodeParams& p, const Work& w, int n_tiles, RingSlot& slot,
                                        T* stages, uint64_t* full, uint64_t* empty) {
  constexpr int kTile = tile_tokens(D);
  const int lane = threadIdx.x % 32;
  const int bs = p.block_size;
  // A tile is fetched in kTile / copy_rows bulk copies per K and V, one per lane; copy_rows
  // divides both the page and the tile, so no copy crosses a page.
  const int copy_rows = n_tiles >= kCopyRowsMinTiles ? p.copy_rows : min(bs, kTile);
  const int copies = kTile / copy_rows;
  const int pages = (w.len + bs - 1) / bs;
  const int32_t* table = p.block_table + (int64_t)w.b * p.block_table_stride;
  const int64_t block_elems = (int64_t)p.num_kv_heads * bs * D;
  const int64_t head_elems = (int64_t)w.kv_head * bs * D;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);

  // Block ids of pages [base, base + 64), one per lane in cur and next; 0 past the last page. A
  // tile's pages never straddle base + 32 (a tile is a whole number of pages, or part of one, and
  // starts on a tile boundary), so a tile reads cur alone: next is in long before it is needed.
  int base = w.start / bs;
  auto fetch = [&](int page) { return page < pages ? __ldg(table + page) : 0; };
  int cur = fetch(base + lane), next = fetch(base + 32 + lane);
  if (lane == 0) stamp(kTable, cur);

  // With read_ahead, the first tiles are asked for before the predecessor has finished: every one
  // but a tile holding row len - 1, which the predecessor may still be writing.
  const int fill = min(p.ahead_tiles > 0 ? p.ahead_tiles : kReadAheadTiles, slot.stages);
  const int ahead = p.read_ahead ? min(fill, n_tiles - (w.end == w.len ? 1 : 0)) : 0;
  long long waited = 0;
  for (int i = 0; i < n_tiles; ++i, slot.advance()) {
    if (i == ahead) pdl_wait();
    const int stage = slot.stage;
    if (i >= slot.stages) {
      const long long t = clock_now();
      mbar_wait(&empty[stage], (slot.round - 1) & 1);
      waited += clock_now() - t;
    }
    const int t0 = w.start + i * kTile;
    const int page0 = t0 / bs;
    if (page0 - base >= 32) {
      base += 32;
      cur = next;
      next = fetch(base + 32 + lane);
    }
    const int first_token = t0 + lane * copy_rows;
    const int page = first_token / bs;
    const int block = min(max(__shfl_sync(0xffffffffu, cur, (page - base) & 31), 0), p.num_blocks - 1);
    const int rows = lane < copies ? max(0, min(copy_rows, w.len - first_token)) : 0;
    const uint32_t bytes = rows * D * (uint32_t)sizeof(T);
    const uint32_t stage_bytes = 2 * __reduce_add_sync(0xffffffffu, bytes);
    if (lane == 0) mbar_arrive_expect_tx(&full[stage], stage_bytes);
    __syncwarp();
    if (rows > 0) {
      const int64_t src = block * block_elems + head_elems + (int64_t)(first_token - page * bs) * D;
      T* k_dst = stages + (int64_t)stage * 2 * kTile * D + lane * copy_rows * D;
      bulk_load(k_dst, k_cache + src, bytes, &full[stage]);
      bulk_load(k_dst + kTile * D, v_cache + src, bytes, &full[stage]);
    }
  }
  if (ahead >= n_tiles) pdl_wait();  // all read ahead; the epilogue writes
  if (trigger_point(p) == kAtLoads) pdl_trigger();
  if (lane == 0) record(kProducerWaits, waited);
}

// Online softmax for one row of this thread's tokens (its N scores x, log2 domain): the row's
// running max m and sum l move on, the scores become their exponentials, and the factor that
// rescales what was accumulated before is returned.
template <int N>
__device__ __forceinline__ float softmax_step(float& m, float& l, float (&x)[N]) {
  float mx = fmaxf(x[0], x[1]);
#pragma unroll
  for (int k = 2; k < N; k += 2) mx = fmaxf(mx, fmaxf(x[k], x[k + 1]));
  const float new_m = fmaxf(m, quad_max(mx));
  const float base = new_m == kNegInf ? 0.f : new_m;
  const float alpha = exp2_approx(m - base);
  m = new_m;
  float acc = l * alpha;
#pragma unroll
  for (int k = 0; k < N; k += 2) {
    x[k] = exp2_approx(x[k] - base);
    x[k + 1] = exp2_approx(x[k + 1] - base);
    acc = acc + (x[k] + x[k + 1]);
  }
  l = acc;
  return alpha;
}

// One consumer warp's pass over the split: online softmax state (m, l) per query-head row
// (this thread's rows r and r + 8) and the output fragments o, unnormalised. The warp owns W
// tokens of each tile, in pieces of 8 (h); P V takes them 16 at a time (kk). Without kHi the
// block serves at most eight query heads: rows r + 8 are padding and get no softmax work.
template <typename T, int D, int W, bool kHi>
__device__ __forceinline__ void consume(const DecodeParams& p, const Work& w, int n_tiles, RingSlot& slot,
                                        const T* stages,
                                        uint64_t* full, uint64_t* empty, float (&o)[D / 32][4][4], float& m_lo,
                                        float& m_hi, float& l_lo, float& l_hi) {
  using S = Shape<D, W>;
  constexpr int kTile = S::kTile, kPieces = W / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, qd = lane % 4;
  const T* q = static_cast<const T*>(p.q) + w.b * p.q_stride_b;
  const uint4 zero{0, 0, 0, 0};
  uint4 q_lo[S::kGroups], q_hi[S::kGroups];
#pragma unroll
  for (int j = 0; j < S::kGroups; ++j) {
    const int col = 32 * j + 8 * qd;
    q_lo[j] = r < w.rows ? __ldg(reinterpret_cast<const uint4*>(q + (w.q_head0 + r) * p.q_stride_h + col)) : zero;
    q_hi[j] = kHi && r + 8 < w.rows
                  ? __ldg(reinterpret_cast<const uint4*>(q + (w.q_head0 + r + 8) * p.q_stride_h + col))
                  : zero;
  }
  const float scale_log2 = p.scale * kLog2e;

  long long waited = 0;
  for (int i = 0; i < n_tiles; ++i, slot.advance()) {
    const int stage = slot.stage;
    const int t_warp = w.start + i * kTile + warp * W;
    const long long t = clock_now();
    mbar_wait(&full[stage], slot.round & 1);
    if (i > 0) waited += clock_now() - t;
    if (i == 0 && warp == 0 && lane == 0) stamp(kFirstTile);
    const T* k_tile = stages + (int64_t)stage * 2 * kTile * D + warp * W * D;
    const T* v_tile = k_tile + kTile * D;
    if (t_warp >= w.end || kCopyOnly) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[stage]);
      continue;
    }
    float s[kPieces][4];
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      s[h][0] = s[h][1] = s[h][2] = s[h][3] = 0.f;
#pragma unroll
      for (int j = 0; j < S::kGroups; ++j) {
        const uint4 k = *reinterpret_cast<const uint4*>(k_tile + (8 * h + r) * D + 32 * j + 8 * qd);
        Elem<T>::mma(s[h], q_lo[j].x, q_hi[j].x, q_lo[j].y, q_hi[j].y, k.x, k.y);
        Elem<T>::mma(s[h], q_lo[j].z, q_hi[j].z, q_lo[j].w, q_hi[j].w, k.z, k.w);
      }
    }
    uint4 v[kPieces][S::kGroups];
#pragma unroll
    for (int h = 0; h < kPieces; ++h)
#pragma unroll
      for (int j = 0; j < S::kGroups; ++j)
        v[h][j] = *reinterpret_cast<const uint4*>(v_tile + (8 * h + r) * D + 32 * j + 8 * qd);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[stage]);

#pragma unroll
    for (int h = 0; h < kPieces; ++h)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[h][c] *= scale_log2;
    if (t_warp + W > w.end) {  // the sequence ends inside this warp's tokens
#pragma unroll
      for (int h = 0; h < kPieces; ++h) {
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (t_warp + 8 * h + 2 * qd + (c & 1) >= w.end) s[h][c] = kNegInf;
        if (t_warp + 8 * h + r >= w.end)  // rows past the end may hold anything, NaN included
#pragma unroll
          for (int j = 0; j < S::kGroups; ++j) v[h][j] = zero;
      }
    }
    float lo[2 * kPieces], hi[2 * kPieces];  // row r's scores, then row r + 8's
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      lo[2 * h] = s[h][0], lo[2 * h + 1] = s[h][1];
      hi[2 * h] = s[h][2], hi[2 * h + 1] = s[h][3];
    }
    const float alpha_lo = softmax_step(m_lo, l_lo, lo);
    const float alpha_hi = kHi ? softmax_step(m_hi, l_hi, hi) : 1.f;
    uint32_t pa[W / 16][4];  // P as the A fragments of each 16 tokens
#pragma unroll
    for (int kk = 0; kk < W / 16; ++kk) {
      pa[kk][0] = Elem<T>::pack(lo[4 * kk], lo[4 * kk + 1]);
      pa[kk][1] = kHi ? Elem<T>::pack(hi[4 * kk], hi[4 * kk + 1]) : 0;
      pa[kk][2] = Elem<T>::pack(lo[4 * kk + 2], lo[4 * kk + 3]);
      pa[kk][3] = kHi ? Elem<T>::pack(hi[4 * kk + 2], hi[4 * kk + 3]) : 0;
    }
#pragma unroll
    for (int j = 0; j < S::kGroups; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        o[j][c][0] *= alpha_lo;
        o[j][c][1] *= alpha_lo;
        if constexpr (kHi) {
          o[j][c][2] *= alpha_hi;
          o[j][c][3] *= alpha_hi;
        }
#pragma unroll
        for (int kk = 0; kk < W / 16; ++kk)
          Elem<T>::mma(o[j][c], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3],
                       transpose8x8(word(v[2 * kk][j], c)), transpose8x8(word(v[2 * kk + 1][j], c)));
      }
  }
  l_lo = quad_sum(l_lo);
  l_hi = quad_sum(l_hi);
  if (warp == 0 && lane == 0) {
    stamp(kLoopDone, __float_as_uint(l_lo) ^ __float_as_uint(o[S::kGroups - 1][3][3]));
    record(kConsumerWaits, waited);
  }
}

// Where a block's rows and LSEs go: the output itself (a grid of one split), a workspace slot for
// the merge kernel, or the cluster leader's shared memory.
enum Sink { kToOutput, kToPartial, kToCluster };

// Shared memory past a block's ring (and past the epilogue, which reuses the first stages).
__host__ __device__ __forceinline__ int past_ring(const DecodeParams& p) {
  return max(p.ring_stages, kMinStages) * kStageBytes;
}

// A cluster leader's receive area, past its ring: every split's LSEs (kRows each), then its rows.
__device__ __forceinline__ float* cluster_recv_lse(const DecodeParams& p, uint8_t* smem) {
  return reinterpret_cast<float*>(smem + past_ring(p));
}
__device__ __forceinline__ float* cluster_recv_rows(const DecodeParams& p, uint8_t* smem) {
  return cluster_recv_lse(p, smem) + kMaxClusterSplits * kRows;
}

// One block's attention over tokens [w.start, w.end) of one (sequence, head group): the K/V ring
// (producer warp and consumer warps), then the epilogue that combines the consumer warps and
// writes the rows and their LSEs to ``sink`` (``slot``: the workspace row for kToPartial). Every
// thread of the block calls it.
template <typename T, int D, int W>
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
  T* stages = reinterpret_cast<T*>(smem);
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
      consume<T, D, W, false>(p, w, n_tiles, ring, stages, full, empty, o, m_lo, m_hi, l_lo, l_hi);
    else if (w.rows > 8)
      consume<T, D, W, true>(p, w, n_tiles, ring, stages, full, empty, o, m_lo, m_hi, l_lo, l_hi);
    else
      consume<T, D, W, false>(p, w, n_tiles, ring, stages, full, empty, o, m_lo, m_hi, l_lo, l_hi);
    if (qd == 0) {
      warp_max[warp][r] = m_lo;
      warp_max[warp][r + 8] = m_hi;
      warp_sum[warp][r] = l_lo;
      warp_sum[warp][r + 8] = l_hi;
    }
  } else {
    produce<T, D>(p, w, n_tiles, ring, stages, full, empty);
  }
  __syncthreads();  // every consumer's state is in and every stage is drained
  if (threadIdx.x == 0) stamp(kSynced);

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
      float* dst = o_smem + (warp * kRows + row) * S::kOStride + 8 * qd;
#pragma unroll
      for (int j = 0; j < S::kGroups; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          *reinterpret_cast<float2*>(dst + 32 * j + 2 * c) =
              make_float2(o[j][c][2 * half] * factor, o[j][c][2 * half + 1] * factor);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) stamp(kReduced);
  if (sink == kToCluster) cluster_wait_started();

  float* recv_lse = cluster_recv_lse(p, smem);
  float* recv_rows = cluster_recv_rows(p, smem);
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
template <int D, int W>
__device__ __forceinline__ void write_empty(const DecodeParams& p, const Work& w, bool cluster, uint8_t* smem) {
  const int splits = gridDim.x, hq = p.num_q_heads;
  if (splits == 1) {
    uint16_t* out = static_cast<uint16_t*>(p.out) + ((int64_t)w.b * hq + w.q_head0) * D;
    for (int idx = threadIdx.x; idx < w.rows * D; idx += Shape<D, W>::kThreads) out[idx] = 0;
  } else if (cluster) {
    cluster_wait_started();
    if (threadIdx.x < w.rows)
      cluster_store(cluster_addr(cluster_recv_lse(p, smem) + blockIdx.x * kRows + threadIdx.x, 0), kNegInf);
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

template <typename T, int D, int W>
__global__ void __launch_bounds__(Shape<D, W>::kThreads, Shape<D, W>::kMinBlocks) split_kernel(const DecodeParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ int is_last;

  const int splits = gridDim.x;
  const bool cluster = splits > 1 && merges_in_cluster(p);
  if (threadIdx.x == 0) stamp(kEntry);
  if (cluster) cluster_arrive_started();
  if (trigger_point(p) == kAtEntry) pdl_trigger();
  // With read_ahead the length, the block ids and the first ring fill are asked for now; the
  // consumers wait before they read q, the producer before the rest of the ring (produce).
  if (!p.read_ahead) wait_for_predecessor();
  init_ring<D, W>(p, full, empty);  // while the sequence length is in flight

  const Work w = block_work<D>(p);
  if (threadIdx.x == 0) stamp(kLength, w.len);
  __syncthreads();  // the ring's barriers are initialised

  if (w.start < w.end) {
    const Sink sink = splits == 1 ? kToOutput : cluster ? kToCluster : kToPartial;
    attend<T, D, W>(p, w, sink, (int64_t)w.b * splits + blockIdx.x, smem, full, empty);
  } else {
    wait_for_predecessor();
    write_empty<D, W>(p, w, cluster, smem);
  }
  if (trigger_point(p) == kAtStores) pdl_trigger();
  if (threadIdx.x == 0) stamp(kStored);

  if (cluster) {  // the leader waits for every split's push (the barrier's second phase)
    cluster_arrive();
    if (blockIdx.x != 0) {
      if (threadIdx.x == 0) stamp(kExit);
      return;
    }
    cluster_wait();
    if (threadIdx.x == 0) stamp(kClusterSynced);
    cluster_merge<T, D>(p, w, cluster_recv_lse(p, smem), cluster_recv_rows(p, smem));
    if (threadIdx.x == 0) stamp(kMerged);
    if (threadIdx.x == 0) stamp(kExit);
    return;
  }
  if (threadIdx.x == 0) stamp(kExit);

  if (splits == 1 || p.merge_mode != kMergeLastBlock) return;
  // The last block of this (sequence, head group) to finish merges all its splits.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counter = p.merge_counters + (int64_t)w.b * gridDim.y + blockIdx.y;
    const int arrived = atomicAdd(counter, 1);
    is_last = arrived == splits - 1;
    if (is_last) atomicExch(counter, 0);  // ready for the next call (and graph replay)
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  merge_rows<T, D>(p, w.b, w.q_head0, w.rows, reinterpret_cast<float*>(smem));
}

// ---- launchers ---------------------------------------------------------------------------------

int sm_count() {
  static int known[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return 0;
  int n = __atomic_load_n(&known[device], __ATOMIC_ACQUIRE);
  if (n == 0 && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess)
    __atomic_store_n(&known[device], n, __ATOMIC_RELEASE);
  return n;
}

// Two splits of at most eight query heads at head_dim 64 whose blocks fill one wave of three per
// SM (the planner's THREE_PER_SM plan, e.g. 9/3/64 at B=64): four-warp blocks of 32 tokens per
// consumer warp, rings of two stages, the two splits merging in a cluster (NOTES.md: faster than
// one split of eight-warp blocks landing two or one per SM).
bool three_per_sm(const DecodeParams& p) {
  if (p.merge_mode != kMergeAuto || p.head_dim != 64 || p.num_splits != 2 || p.ring_stages != 0) return false;
  if (p.num_q_heads > 8 * p.num_kv_heads) return false;
  const int64_t blocks = 2LL * p.num_kv_heads * p.batch, sms = sm_count();
  return blocks > 2 * sms && blocks <= 3 * sms;
}

// Whether a cluster of ``splits`` split blocks fits on this device (cached per device and size).
template <typename T, int D, int W>
bool cluster_fits(int splits) {
  using S = Shape<D, W>;
  static int8_t known[64][kMaxClusterSplits + 1];  // 0 unknown, 1 fits, -1 does not
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return false;
  int8_t& slot = known[device][splits];
  int8_t k = __atomic_load_n(&slot, __ATOMIC_ACQUIRE);
  if (k != 0) return k > 0;
  cudaError_t err = splits <= 8 ? cudaSuccess
                                 : cudaFuncSetAttribute(split_kernel<T, D, W>,
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
    err = cudaOccupancyMaxActiveClusters(&clusters, split_kernel<T, D, W>, &config);
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

template <typename T, int D, int W>
cudaError_t launch_split(const DecodeParams& p, dim3 grid, int smem_bytes, bool cluster, bool pdl,
                         cudaStream_t stream) {
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
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attr;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, split_kernel<T, D, W>, p);
}

template <typename T, int D, int W>
cudaError_t launch_typed(const DecodeParams& params, cudaStream_t stream) {
  using S = Shape<D, W>;
  static uint64_t smem_raised = 0;
  cudaError_t err = allow_dynamic_smem(split_kernel<T, D, W>, kMaxSmemBytes, smem_raised);
  if (err != cudaSuccess) return err;
  DecodeParams p = params;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head_tiles = (group + kRows - 1) / kRows;
  const dim3 grid(p.num_splits, p.num_kv_heads * head_tiles, p.batch);
  const int64_t blocks = (int64_t)grid.x * grid.y * grid.z;
  const int sms = sm_count();
  if (W == 32 && three_per_sm(p)) {
    p.spread = false;
    p.merge_mode = kMergeClusterPdlLoads;
    p.ring_stages = kMinStages;
  } else if (p.merge_mode == kMergeAuto) {
    // Every grid a PDL dependent that reads ahead, and lets the next grid in as early as it can
    // without its blocks landing unevenly (measured, NOTES.md):
    // - a one-wave grid is spread one block per SM (else early-placed blocks doubled up on some
    //   SMs: 10-14 % slower). Its splits merge in a cluster where clusters cannot crowd the SMs
    //   they share (two splits, or a grid of at most half the SMs; sixteen-block clusters on 128
    //   blocks were 50 % slower), and that grid, or one of a single split, lets the next in once
    //   its loads are issued; otherwise the merge kernel, every trigger at entry;
    // - a grid of more blocks than two per SM is placed whole before the next can start: every
    //   trigger at entry;
    // - in between (9/3/64 at B=64), mode 8: a grid of one split lets the next grid in once its
    //   loads are issued; one of several splits merges by kernel as mode 4;
    // - two splits of a grid that fills one wave of three four-warp blocks per SM: three_per_sm.
    p.spread = blocks <= sms;
    const bool small_clusters = p.num_splits == 2 || 2 * blocks <= sms;
    if (p.spread)
      p.merge_mode = p.num_splits == 1 || small_clusters ? kMergeClusterPdlLoads : kMergePdlChain;
    else
      p.merge_mode = blocks > 2 * sms ? kMergePdlChain : kMergePdlLoads;
  }
  const bool cluster_mode = merges_in_cluster(p);
  // Only a spread block or a cluster's may hold a deeper ring than three stages (a deeper ring
  // measured no faster: NOTES.md; it leaves no room for a second block); a cluster leader
  // receives past it.
  const bool spread = p.spread && blocks <= sms;
  const bool alone = cluster_mode || spread;
  // Blocks that share an SM stream long sequences faster in copies of 16 rows than of whole
  // pages (9/3/64 B=64 M=4096: 52.2 against 54.9 us); lone blocks are slower so (NOTES.md).
  const int whole = min(p.block_size, S::kTile);
  if (p.copy_rows == 0) p.copy_rows = blocks > sms && whole % 16 == 0 ? 16 : whole;
  if (p.ring_stages == 0) p.ring_stages = kStages;
  else if (!alone) p.ring_stages = min(p.ring_stages, kStages);
  const int past = past_ring(p);
  const int rows = group < kRows ? group : kRows;
  const int recv_bytes = kRecvLseBytes + p.num_splits * rows * D * 4;
  const bool cluster = cluster_mode && p.num_splits > 1 && p.num_splits <= kMaxClusterSplits &&
                       past + recv_bytes <= kMaxSmemBytes && cluster_fits<T, D, W>(p.num_splits);
  if (cluster_mode && !cluster && p.num_splits > 1)  // too many splits for one cluster: merge by kernel
    p.merge_mode = p.merge_mode == kMergeCluster      ? kMergeKernelPdl
                   : p.merge_mode == kMergeClusterPdl ? kMergePdlLate
                                                      : kMergePdlChain;
  int smem = past + (cluster ? recv_bytes : 0);
  if (spread || (cluster && p.spread)) smem = max(smem, S::kSpreadSmemBytes);  // clusters too share SMs unless spread
  // Made resident early (PDL) while its predecessor still held SMs, a grid of 1-2 blocks per SM
  // landed unevenly unless spread (measured: 32/8/128 B=8 M=32768 244 -> 307 us): modes 0-2 and 5
  // launch it plainly.
  const bool pdl = p.merge_mode == kMergePdlChain || p.merge_mode == kMergePdlLate || p.merge_mode == kMergeClusterPdl ||
                   p.merge_mode == kMergePdlLoads || p.merge_mode == kMergeClusterPdlLoads;
  err = launch_split<T, D, W>(p, grid, smem, cluster, pdl, stream);
  if (err != cudaSuccess || p.num_splits == 1 || cluster || p.merge_mode == kMergeLastBlock) return err;

  const dim3 merge_grid(p.num_q_heads, p.batch);
  if (p.merge_mode == kMergeKernel) {
    merge_kernel<T, D><<<merge_grid, kMergeThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  return launch_pdl(merge_kernel<T, D>, merge_grid, dim3(kMergeThreads), 0, stream, p);
}

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

cudaError_t launch_flash_decode(const DecodeParams& p, cudaStream_t stream) {
  if (p.num_splits < 1 || p.num_splits > kMaxSplits || p.batch < 1) return cudaErrorInvalidValue;
  const int group = p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 0;
  if (p.warp_tokens != 0 && p.warp_tokens != 16 && !(p.warp_tokens == 32 && p.head_dim == 64 && group <= 8))
    return cudaErrorInvalidValue;
  // Four consumer warps of 32 tokens beat eight of 16 at head_dim 64 (NOTES.md); groups
  // of more than eight heads keep eight warps, which hold the padding rows' softmax state.
  const bool wide = p.warp_tokens == 32 || (p.warp_tokens == 0 && p.head_dim == 64 && group <= 8);
  if (p.dtype == DType::kBFloat16) {
    if (p.head_dim == 64)
      return wide ? launch_typed<__nv_bfloat16, 64, 32>(p, stream) : launch_typed<__nv_bfloat16, 64, 16>(p, stream);
    if (p.head_dim == 128) return launch_typed<__nv_bfloat16, 128, 16>(p, stream);
  } else {
    if (p.head_dim == 64) return wide ? launch_typed<__half, 64, 32>(p, stream) : launch_typed<__half, 64, 16>(p, stream);
    if (p.head_dim == 128) return launch_typed<__half, 128, 16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

#ifdef FLASHDECODE_TIMELINE
cudaError_t read_timeline(int64_t* host, bool reset) {
  cudaError_t err = cudaMemcpyFromSymbol(host, g_timeline, sizeof(g_timeline));
  if (err == cudaSuccess && reset) {
    void* ptr = nullptr;
    err = cudaGetSymbolAddress(&ptr, g_timeline);
    if (err == cudaSuccess) err = cudaMemset(ptr, 0, sizeof(g_timeline));
  }
  return err;
}
#endif

cudaError_t launch_write_kv(const WriteKvParams& p, cudaStream_t stream) {
  const int64_t total = p.num_tokens * p.num_kv_heads * (p.row_bytes / 16);
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  write_kv_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashdecode
