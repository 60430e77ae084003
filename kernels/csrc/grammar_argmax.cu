// The kernel of grammar_argmax.h: one thread block per constrained row reads its logits (four at a
// time where aligned, several loads in flight per thread), keeps those its mask allows and reduces
// (value, index) pairs, the lower index winning ties.

#include <climits>
#include <cstdint>

#include "grammar_argmax.h"

namespace flashdecode {
namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 4;     // float4 loads in flight per thread: one block per row must hide the latency alone

struct Best {
  float value;
  int index;  // INT_MAX: none seen (value unused)
};

__device__ __forceinline__ Best better(Best a, Best b) {
  if (b.index == INT_MAX) return a;
  if (a.index == INT_MAX) return b;
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}

__device__ __forceinline__ Best consider(Best best, float v, int t, uint32_t allowed_bits, int bit) {
  if (((allowed_bits >> bit) & 1u) && v == v) best = better(best, Best{v, t});   // NaN is never drawn
  return best;
}

// ``vectorized``: the row's logits are 16-byte aligned, read as float4 (four tokens under one mask word).
template <bool vectorized>
__global__ void __launch_bounds__(kThreads)
grammar_argmax_kernel(const float* __restrict__ logits, int64_t logits_stride, const int32_t* __restrict__ bitmask,
                      int64_t bitmask_stride, const int32_t* __restrict__ rows, int32_t* __restrict__ ids, int vocab) {
  const int row = rows != nullptr ? rows[blockIdx.x] : static_cast<int>(blockIdx.x);
  const float* x = logits + row * logits_stride;
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask + row * bitmask_stride);
  Best best{0.f, INT_MAX};
  int scalar_from = 0;
  if constexpr (vectorized) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int quads = vocab / 4;
    for (int base = threadIdx.x; base < quads; base += kThreads * kUnroll) {
      float4 v[kUnroll];
      uint32_t w[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {          // every load issued before any is compared
        const int q = base + u * kThreads;
        if (q < quads) {
          v[u] = x4[q];
          w[u] = bits[q / 8];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int q = base + u * kThreads;
        if (q < quads) {
          const int t = 4 * q, bit = t % 32;
          best = consider(best, v[u].x, t, w[u], bit);
          best = consider(best, v[u].y, t + 1, w[u], bit + 1);
          best = consider(best, v[u].z, t + 2, w[u], bit + 2);
          best = consider(best, v[u].w, t + 3, w[u], bit + 3);
        }
      }
    }
    scalar_from = 4 * quads;
  }
#pragma unroll 4
  for (int t = scalar_from + threadIdx.x; t < vocab; t += kThreads) best = consider(best, x[t], t, bits[t / 32], t % 32);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    best = better(best, Best{__shfl_down_sync(0xffffffffu, best.value, offset),
                             __shfl_down_sync(0xffffffffu, best.index, offset)});
  __shared__ Best per_warp[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) per_warp[warp] = best;
  __syncthreads();
  if (warp == 0) {
    best = lane < kThreads / 32 ? per_warp[lane] : Best{0.f, INT_MAX};
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      best = better(best, Best{__shfl_down_sync(0xffffffffu, best.value, offset),
                               __shfl_down_sync(0xffffffffu, best.index, offset)});
    if (lane == 0) ids[row] = best.index == INT_MAX ? 0 : best.index;
  }
}

static_assert(kThreads % 32 == 0 && kThreads / 32 <= 32, "one warp reduces the warps' bests");

}  // namespace

cudaError_t launch_grammar_argmax(const GrammarArgmaxParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  const bool aligned = reinterpret_cast<uintptr_t>(p.logits) % 16 == 0 && p.logits_stride % 4 == 0;
  auto kernel = aligned ? grammar_argmax_kernel<true> : grammar_argmax_kernel<false>;
  kernel<<<static_cast<unsigned>(p.count), kThreads, 0, stream>>>(p.logits, p.logits_stride, p.bitmask,
                                                                 p.bitmask_stride, p.rows, p.ids, p.vocab);
  return cudaGetLastError();
}

}  // namespace flashdecode
