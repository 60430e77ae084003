// The kernel of grammar_argmax.h: one thread block per constrained row reads its logits where its
// mask allows and reduces (value, index) pairs, the lower index winning ties.

#include <climits>

#include "grammar_argmax.h"

namespace flashdecode {
namespace {

constexpr int kThreads = 512;

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

__global__ void __launch_bounds__(kThreads)
grammar_argmax_kernel(const float* __restrict__ logits, int64_t logits_stride, const int32_t* __restrict__ bitmask,
                      int64_t bitmask_stride, const int32_t* __restrict__ rows, int32_t* __restrict__ ids, int vocab) {
  const int row = rows != nullptr ? rows[blockIdx.x] : static_cast<int>(blockIdx.x);
  const float* x = logits + row * logits_stride;
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask + row * bitmask_stride);
  Best best{0.f, INT_MAX};
#pragma unroll 4
  for (int t = threadIdx.x; t < vocab; t += kThreads) {   // coalesced reads; a mask word serves 32 threads
    if ((bits[t >> 5] >> (t & 31)) & 1u) {
      const float v = x[t];
      if (v == v) best = better(best, Best{v, t});        // NaN is never drawn
    }
  }
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
    for (int offset = 8; offset > 0; offset /= 2)
      best = better(best, Best{__shfl_down_sync(0xffffffffu, best.value, offset),
                               __shfl_down_sync(0xffffffffu, best.index, offset)});
    if (lane == 0) ids[row] = best.index == INT_MAX ? 0 : best.index;
  }
}

static_assert(kThreads % 32 == 0 && kThreads / 32 <= 32, "one warp reduces the warps' bests");

}  // namespace

cudaError_t launch_grammar_argmax(const GrammarArgmaxParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  grammar_argmax_kernel<<<static_cast<unsigned>(p.count), kThreads, 0, stream>>>(
      p.logits, p.logits_stride, p.bitmask, p.bitmask_stride, p.rows, p.ids, p.vocab);
  return cudaGetLastError();
}

}  // namespace flashdecode
