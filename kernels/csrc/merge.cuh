// The exact merge of split partials: O = sum_c exp(lse_c - lse) O_c, by a small kernel over the
// workspace (merge_kernel) or by a cluster's leader from its shared memory (cluster_merge).
// An empty split (lse = -inf) is skipped, never multiplied: it never wrote its partial row.
#pragma once

#include "common.cuh"
#include "launch.h"

namespace flashdecode {
namespace {

constexpr int kMergeThreads = 128;

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
// 9.9); with 5 it was up to 1 % slower (docs/log.md).
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
  if (p.merge_waits_first) {  // the next split grid lands on SMs this split grid has left
    pdl_wait();
    pdl_trigger();
  } else {
    pdl_trigger_then_wait();  // the wait is a no-op unless launched as a PDL dependent
  }
  __shared__ __align__(16) float smem[kRows * kMaxSplits + kMergeThreads * 4];
  if (p.num_splits >= kOneTripMinSplits && p.num_splits <= one_trip_splits<D>())
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

}  // namespace
}  // namespace flashdecode
