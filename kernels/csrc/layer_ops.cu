// Per-layer kernels around attention. Each rounds to the storage type where transformers' Llama
// modules round (after the residual add, after normalising, after SiLU), so the fused layer
// follows the reference model's bf16 arithmetic instead of drifting from it.

#include <algorithm>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "int8.cuh"
#include "launch.h"
#include "layer_ops.h"

namespace flashdecode {
namespace {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

template <typename T> __device__ __forceinline__ float rounded(float v) { return to_float(from_float<T>(v)); }

// Eight elements moved as one 16-byte access.
template <typename T>
struct alignas(16) Vec8 {
  T v[8];
};

// The sum over the block of each of kRows values; every thread gets the same totals.
template <int kRows>
__device__ void block_sums(float (&v)[kRows]) {
  __shared__ float warp_sums[kRows][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    for (int offset = 16; offset > 0; offset >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], offset);
    if (lane == 0) warp_sums[r][warp] = v[r];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    v[r] = lane < blockDim.x / 32 ? warp_sums[r][lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], offset);
  }
}

template <GatedAct kAct>
__device__ __forceinline__ float gated_act(float g) {
  if constexpr (kAct == GatedAct::kSilu) {
    return g / (1.f + expf(-g));
  } else {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    return 0.5f * g * (1.f + tanhf(kSqrt2OverPi * (g + 0.044715f * g * g * g)));
  }
}

// A norm's output: Llama's rounding (normalised, rounded, times the weight of the storage type)
// or, with a float32 weight, Gemma's (normalised times the weight in float32, rounded once).
template <typename T>
__device__ __forceinline__ T scaled_norm(float x, float inv_rms, const void* weight, bool weight_fp32, int i) {
  if (weight_fp32) return from_float<T>(static_cast<const float*>(weight)[i] * (x * inv_rms));
  return from_float<T>(to_float(static_cast<const T*>(weight)[i]) * rounded<T>(x * inv_rms));
}

// One block per row. With a residual: residual_out = round(residual + x), out = norm(residual_out) * w.
template <typename T, bool kResidual>
__global__ void rms_norm_kernel(RmsNormParams p) {
  pdl_trigger_then_wait();
  const int64_t row = blockIdx.x;
  const int vecs = p.hidden / 8;
  const auto* x = reinterpret_cast<const Vec8<T>*>(static_cast<const T*>(p.x) + row * p.x_stride);
  const auto* res = reinterpret_cast<const Vec8<T>*>(static_cast<const T*>(p.residual) + row * p.hidden);
  auto* res_out = reinterpret_cast<Vec8<T>*>(static_cast<T*>(p.residual_out) + row * p.hidden);
  auto* out = reinterpret_cast<Vec8<T>*>(static_cast<T*>(p.out) + row * p.out_stride);

  float squares = 0.f;
  for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
    Vec8<T> a = x[i];
    if constexpr (kResidual) {
      const Vec8<T> r = res[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(r.v[j]));
      res_out[i] = a;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) squares += to_float(a.v[j]) * to_float(a.v[j]);
  }
  float total[1] = {squares};
  block_sums<1>(total);
  const float inv_rms = rsqrtf(total[0] / p.hidden + p.eps);
  for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
    // Each thread rereads only what it wrote itself above, and x is not read after the barrier.
    const Vec8<T> a = kResidual ? res_out[i] : x[i];
    Vec8<T> o;
    if (p.weight_fp32) {
#pragma unroll
      for (int j = 0; j < 8; ++j) o.v[j] = scaled_norm<T>(to_float(a.v[j]), inv_rms, p.weight, true, i * 8 + j);
    } else {
      const Vec8<T> g = reinterpret_cast<const Vec8<T>*>(p.weight)[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) o.v[j] = from_float<T>(to_float(g.v[j]) * rounded<T>(to_float(a.v[j]) * inv_rms));
    }
    out[i] = o;
  }
}

template <typename T, GatedAct kAct>
__global__ void act_and_mul_kernel(SiluMulParams p) {
  pdl_trigger_then_wait();
  const int vecs = p.inter / 8;
  const int64_t total = p.rows * vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs;
    const int col = static_cast<int>(i % vecs);
    const auto* in = reinterpret_cast<const Vec8<T>*>(static_cast<const T*>(p.in) + row * 2 * p.inter);
    const Vec8<T> gate = in[col], up = in[vecs + col];
    Vec8<T> o;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float g = to_float(gate.v[j]);
      o.v[j] = from_float<T>(rounded<T>(gated_act<kAct>(g)) * to_float(up.v[j]));
    }
    reinterpret_cast<Vec8<T>*>(static_cast<T*>(p.out) + row * p.inter)[col] = o;
  }
}

constexpr int kRopeWarps = 8;                          // heads a block of rope_write_kv serves
constexpr int kRopePerLane = kMaxRopeHeadDim / 32;     // elements of a head per lane
constexpr int kRopeMaxPairs = kRopePerLane / 2;

// A head's cache row, held by a warp (every lane calls it): this lane's x[i] goes to column
// col(i) (none where col(i) < 0), as it is, or for int8 caches (KV = int8_t) as codes at the
// row's scale, which the warp reduces and lane 0 stores at ``row`` of ``scales`` (int8.cuh).
template <typename T, typename KV, typename Col>
__device__ __forceinline__ void store_row(const T (&x)[kRopePerLane], Col col, KV* dst, void* scales, int64_t row) {
  if constexpr (std::is_same_v<T, KV>) {
#pragma unroll
    for (int i = 0; i < kRopePerLane; ++i)
      if (col(i) >= 0) dst[col(i)] = x[i];
  } else {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kRopePerLane; ++i)
      if (col(i) >= 0) amax = fmaxf(amax, fabsf(to_float(x[i])));
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const __half scale = int8_row_scale(amax);
#pragma unroll
    for (int i = 0; i < kRopePerLane; ++i)
      if (col(i) >= 0) dst[col(i)] = quantize_int8(to_float(x[i]), __half2float(scale));
    if (threadIdx.x % 32 == 0) static_cast<__half*>(scales)[row] = scale;
  }
}

// One warp per head of one token (grid: tokens x groups of kRopeWarps heads), so that all loads
// of a decode step's q/k/v row are in flight at once (a block looping over a token's heads pays
// an L2 round trip per pass, several us a layer at batch 1). A query or key head is
// RMS-normalised in place when the params carry the norms' weights, rotated in place
// (rotate-half: lane l holds the pairs (j, j + D/2) for j = l, l + 32, ...), and a key head is
// stored at the token's cache slot; a value head is only stored. KV: T, or int8_t for int8
// caches, which store the rounded values' codes and row scales (as write_kv would store them).
template <typename T, typename KV>
__global__ void rope_write_kv_kernel(RopeKvParams p) {
  pdl_trigger_then_wait();
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y * kRopeWarps + threadIdx.x / 32;
  const int hq = p.num_q_heads, hkv = p.num_kv_heads;
  if (head >= hq + 2 * hkv) return;
  const int64_t t = blockIdx.x;
  const int d = p.head_dim, half = d / 2;
  T* h = static_cast<T*>(p.qkv) + t * p.qkv_stride + int64_t(head) * d;
  const int64_t slot = p.slots_are_int64 ? static_cast<const int64_t*>(p.slot_mapping)[t]
                                         : static_cast<const int32_t*>(p.slot_mapping)[t];
  // the index of the cache row (token, KV head) of this slot, rows of D elements each
  auto cache_row = [&](int kv_head) { return (slot / p.block_size * hkv + kv_head) * p.block_size + slot % p.block_size; };

  if (head >= hq + hkv) {  // a value head
    if (slot < 0) return;
    const int kv_head = head - hq - hkv;
    T v[kRopePerLane];
#pragma unroll
    for (int i = 0; i < kRopePerLane; ++i)
      if (lane + 32 * i < d) v[i] = h[lane + 32 * i];
    const int64_t row = cache_row(kv_head);
    store_row<T, KV>(v, [&](int i) { return lane + 32 * i < d ? lane + 32 * i : -1; },
                     static_cast<KV*>(p.v_cache) + row * d, p.v_scale, row);
    return;
  }

  const float* cos = p.cos_sin + int64_t(p.positions[t]) * d;
  const float* sin = cos + half;
  float x1[kRopeMaxPairs], x2[kRopeMaxPairs], c[kRopeMaxPairs], s[kRopeMaxPairs];
#pragma unroll
  for (int i = 0; i < kRopeMaxPairs; ++i) {
    const int j = lane + 32 * i;
    const bool in = j < half;
    x1[i] = in ? to_float(h[j]) : 0.f;
    x2[i] = in ? to_float(h[j + half]) : 0.f;
    c[i] = in ? cos[j] : 0.f;
    s[i] = in ? sin[j] : 0.f;
  }
  if (p.q_norm != nullptr) {
    float squares = 0.f;
#pragma unroll
    for (int i = 0; i < kRopeMaxPairs; ++i) squares += x1[i] * x1[i];
#pragma unroll
    for (int i = 0; i < kRopeMaxPairs; ++i) squares += x2[i] * x2[i];
    for (int offset = 16; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    const float inv_rms = rsqrtf(squares / d + p.eps);
    const void* w = head < hq ? p.q_norm : p.k_norm;
#pragma unroll
    for (int i = 0; i < kRopeMaxPairs; ++i) {
      const int j = lane + 32 * i;
      if (j >= half) continue;
      x1[i] = to_float(scaled_norm<T>(x1[i], inv_rms, w, p.norm_fp32, j));
      x2[i] = to_float(scaled_norm<T>(x2[i], inv_rms, w, p.norm_fp32, j + half));
    }
  }
  // y[i] and y[kRopeMaxPairs + i]: the rotated pair (j, j + D/2), j = lane + 32 i
  T y[kRopePerLane];
#pragma unroll
  for (int i = 0; i < kRopeMaxPairs; ++i) {
    const int j = lane + 32 * i;
    if (j >= half) continue;
    y[i] = from_float<T>(x1[i] * c[i] - x2[i] * s[i]);
    y[kRopeMaxPairs + i] = from_float<T>(x2[i] * c[i] + x1[i] * s[i]);
    h[j] = y[i];
    h[j + half] = y[kRopeMaxPairs + i];
  }
  if (head >= hq && slot >= 0) {
    const int64_t row = cache_row(head - hq);
    auto col = [&](int i) { const int j = lane + 32 * (i % kRopeMaxPairs); return j < half ? j + (i / kRopeMaxPairs) * half : -1; };
    store_row<T, KV>(y, col, static_cast<KV*>(p.k_cache) + row * d, p.k_scale, row);
  }
}

// A weight load: 16 bytes read once per step and never again before the next one (a decode
// step's weights are far larger than L2), so it skips L1. Volatile so that the loads issued
// ahead of griddepcontrol.wait stay ahead of it.
template <typename T>
__device__ __forceinline__ Vec8<T> load_weights(const Vec8<T>* src) {
  Vec8<T> v;
  uint4& u = *reinterpret_cast<uint4*>(&v);
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "l"(src));
  return v;
}

// The GEMV's input rows into shared memory as float32: x itself, or with kNorm
// rms_norm(residual + x), rounded to T as rms_norm_kernel rounds; block 0 also stores the sum
// to residual_out.
template <typename T, int kRows, bool kNorm>
__device__ void stage_input(const GemvParams& p, float* xs) {
  const int vecs = p.k / 8;
  auto x_row = [&](int r) { return reinterpret_cast<const Vec8<T>*>(static_cast<const T*>(p.x) + r * p.x_stride); };
  auto store = [&](int r, int i, const Vec8<T>& a) {
    auto* dst = reinterpret_cast<float4*>(xs + r * p.k + i * 8);
    dst[0] = make_float4(to_float(a.v[0]), to_float(a.v[1]), to_float(a.v[2]), to_float(a.v[3]));
    dst[1] = make_float4(to_float(a.v[4]), to_float(a.v[5]), to_float(a.v[6]), to_float(a.v[7]));
  };
  if constexpr (!kNorm) {
    for (int i = threadIdx.x; i < kRows * vecs; i += blockDim.x) store(i / vecs, i % vecs, x_row(i / vecs)[i % vecs]);
  } else {
    float squares[kRows] = {};
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        Vec8<T> a = x_row(r)[i];
        const Vec8<T> res =
            reinterpret_cast<const Vec8<T>*>(static_cast<const T*>(p.residual) + r * p.residual_stride)[i];
#pragma unroll
        for (int j = 0; j < 8; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(res.v[j]));
        if (blockIdx.x == 0) reinterpret_cast<Vec8<T>*>(static_cast<T*>(p.residual_out) + r * p.k)[i] = a;
#pragma unroll
        for (int j = 0; j < 8; ++j) squares[r] += to_float(a.v[j]) * to_float(a.v[j]);
        store(r, i, a);
      }
    }
    block_sums<kRows>(squares);
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
      // Each thread rescales only what it staged itself above.
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float inv_rms = rsqrtf(squares[r] / p.k + p.eps);
        float* row = xs + r * p.k + i * 8;
#pragma unroll
        for (int j = 0; j < 8; ++j) row[j] = to_float(scaled_norm<T>(row[j], inv_rms, p.norm_weight, p.norm_fp32, i * 8 + j));
      }
    }
  }
  __syncthreads();
}

// y = x W^T for a few rows (a decode step's batch): bandwidth and latency, not arithmetic, bound
// these. Each warp streams weight rows (with a gated epilogue, pairs of rows: the gate's and the
// up's) in chunks of 16-byte loads, kBatch per lane, and reduces them against every input row held
// in shared memory; the grid is at most what fits on the GPU at once, each warp striding over
// rows, and the next chunk's loads are in flight while the current one is reduced. The weights
// do not depend on the previous kernel, so the first chunk is loaded before griddepcontrol.wait,
// while that kernel still runs; only the input waits. With kNorm the input is normalised here
// (the residual add and RMSNorm in front of the q/k/v and gate/up projections); with kGated the
// epilogue is the MLP's act(gate) * up.
template <typename T, int kRows, bool kGated>
struct GemvChunk {
  // as many loads as fit in 128 registers with the next chunk's in flight too
  static constexpr int kBatch = kGated ? (kRows > 1 ? 2 : 3) : (kRows > 2 ? 4 : 8);
  Vec8<T> w[kBatch], up[kBatch];

  __device__ __forceinline__ void load(const Vec8<T>* w_row, const Vec8<T>* up_row, int first, int vecs) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = first + u * 32;
      if (i < vecs) {
        w[u] = load_weights(w_row + i);
        if constexpr (kGated) up[u] = load_weights(up_row + i);
      }
    }
  }
};

template <typename T, int kRows, bool kNorm, bool kGated, GatedAct kAct>
__global__ void __launch_bounds__(256, 2) gemv_kernel(GemvParams p) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  using Chunk = GemvChunk<T, kRows, kGated>;
  constexpr int kBatch = Chunk::kBatch;
  extern __shared__ __align__(16) uint8_t gemv_smem[];
  float* xs = reinterpret_cast<float*>(gemv_smem);   // [kRows, k]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_out = kGated ? p.n / 2 : p.n;
  const int stride = gridDim.x * (blockDim.x / 32);
  const int vecs = p.k / 8;
  const int chunks = (vecs + 32 * kBatch - 1) / (32 * kBatch);     // per weight row
  const auto* w = reinterpret_cast<const Vec8<T>*>(p.w);
  auto w_row = [&](int col) { return w + int64_t(col) * vecs; };
  auto up_row = [&](int col) { return w + int64_t(col + n_out) * vecs; };

  int col = blockIdx.x * (blockDim.x / 32) + warp, chunk = 0;
  Chunk cur, next;
  if (col < n_out) cur.load(w_row(col), up_row(col), lane, vecs);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  stage_input<T, kRows, kNorm>(p, xs);

  float acc[kRows], acc_up[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = acc_up[r] = 0.f;
  while (col < n_out) {
    const bool row_done = chunk + 1 == chunks;
    const int next_col = row_done ? col + stride : col, next_chunk = row_done ? 0 : chunk + 1;
    if (next_col < n_out) next.load(w_row(next_col), up_row(next_col), next_chunk * 32 * kBatch + lane, vecs);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = chunk * 32 * kBatch + u * 32 + lane;
      if (i >= vecs) continue;
      float wf[8], uf[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        wf[j] = to_float(cur.w[u].v[j]);
        if constexpr (kGated) uf[j] = to_float(cur.up[u].v[j]);
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float4* a = reinterpret_cast<const float4*>(xs + r * p.k + i * 8);
        const float4 lo = a[0], hi = a[1];
        const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[r] = fmaf(x[j], wf[j], acc[r]);
          if constexpr (kGated) acc_up[r] = fmaf(x[j], uf[j], acc_up[r]);
        }
      }
    }
    if (row_done) {
      const float bias = !kGated && p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[col]) : 0.f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float v = acc[r], up = acc_up[r];
        acc[r] = acc_up[r] = 0.f;
        for (int offset = 16; offset > 0; offset >>= 1) {
          v += __shfl_xor_sync(0xffffffffu, v, offset);
          if constexpr (kGated) up += __shfl_xor_sync(0xffffffffu, up, offset);
        }
        if (lane != 0) continue;
        T* out = static_cast<T*>(p.y) + int64_t(r) * n_out + col;
        if constexpr (kGated) {
          // transformers' rounding: gate and up projections, the activation, then the product
          *out = from_float<T>(rounded<T>(gated_act<kAct>(rounded<T>(v))) * rounded<T>(up));
        } else {
          *out = from_float<T>(v + bias);
        }
      }
    }
    col = next_col;
    chunk = next_chunk;
    cur = next;
  }
}

constexpr int kThreads = 128;

template <typename T, int kRows, bool kNorm, bool kGated, GatedAct kAct>
cudaError_t gemv_launch(const GemvParams& p, cudaStream_t stream) {
  auto* kernel = gemv_kernel<T, kRows, kNorm, kGated, kAct>;
  static uint64_t smem_raised = 0;
  const cudaError_t err = allow_dynamic_smem(kernel, kGemvMaxSmemBytes, smem_raised);
  if (err != cudaSuccess) return err;
  // Eight warps a block where that still gives every SM a block or two (fewer blocks stage the
  // input fewer times), four below; no more blocks than are resident at once.
  const int n_out = kGated ? p.n / 2 : p.n;
  const int warps = n_out >= 2048 ? 8 : 4;
  const size_t smem = size_t(kRows) * p.k * sizeof(float);
  int per_sm = 0;
  const cudaError_t occ = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, warps * 32, smem);
  if (occ != cudaSuccess) return occ;
  const int64_t wanted = (n_out + warps - 1) / warps;
  const int64_t resident = int64_t(std::max(per_sm, 1)) * std::max(sm_count(), 1);
  const unsigned blocks = static_cast<unsigned>(std::min(wanted, resident));
  return launch_pdl(kernel, dim3(blocks), dim3(warps * 32), smem, stream, p);
}

template <typename T, int kRows, bool kNorm>
cudaError_t gemv_epilogue(const GemvParams& p, cudaStream_t stream) {
  if (!p.gated) return gemv_launch<T, kRows, kNorm, false, GatedAct::kSilu>(p, stream);
  return p.act == GatedAct::kSilu ? gemv_launch<T, kRows, kNorm, true, GatedAct::kSilu>(p, stream)
                                  : gemv_launch<T, kRows, kNorm, true, GatedAct::kGeluTanh>(p, stream);
}

template <typename T, int kRows>
cudaError_t gemv_rows(const GemvParams& p, cudaStream_t stream) {
  return p.norm_weight != nullptr ? gemv_epilogue<T, kRows, true>(p, stream) : gemv_epilogue<T, kRows, false>(p, stream);
}

template <typename T>
cudaError_t gemv_typed(const GemvParams& p, cudaStream_t stream) {
  switch (p.rows) {
    case 1: return gemv_rows<T, 1>(p, stream);
    case 2: return gemv_rows<T, 2>(p, stream);
    case 3: return gemv_rows<T, 3>(p, stream);
    case 4: return gemv_rows<T, 4>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t rms_norm_typed(const RmsNormParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows));
  return p.residual != nullptr ? launch_pdl(rms_norm_kernel<T, true>, grid, dim3(kThreads), 0, stream, p)
                               : launch_pdl(rms_norm_kernel<T, false>, grid, dim3(kThreads), 0, stream, p);
}

template <typename T>
cudaError_t silu_and_mul_typed(const SiluMulParams& p, cudaStream_t stream) {
  const int64_t vecs = p.rows * (p.inter / 8);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((vecs + kThreads - 1) / kThreads, 65535));
  return p.act == GatedAct::kSilu
             ? launch_pdl(act_and_mul_kernel<T, GatedAct::kSilu>, dim3(blocks), dim3(kThreads), 0, stream, p)
             : launch_pdl(act_and_mul_kernel<T, GatedAct::kGeluTanh>, dim3(blocks), dim3(kThreads), 0, stream, p);
}

}  // namespace

cudaError_t launch_gemv(const GemvParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.n == 0) return cudaSuccess;
  return p.dtype == DType::kBFloat16 ? gemv_typed<__nv_bfloat16>(p, stream) : gemv_typed<__half>(p, stream);
}

cudaError_t launch_rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return p.dtype == DType::kBFloat16 ? rms_norm_typed<__nv_bfloat16>(p, stream) : rms_norm_typed<__half>(p, stream);
}

cudaError_t launch_silu_and_mul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return p.dtype == DType::kBFloat16 ? silu_and_mul_typed<__nv_bfloat16>(p, stream)
                                     : silu_and_mul_typed<__half>(p, stream);
}

cudaError_t launch_rope_write_kv(const RopeKvParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.head_dim % 2 || p.head_dim > kMaxRopeHeadDim) return cudaErrorInvalidValue;
  const int heads = p.num_q_heads + 2 * p.num_kv_heads;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>((heads + kRopeWarps - 1) / kRopeWarps));
  const dim3 block(kRopeWarps * 32);
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.kv_dtype == KvDType::kInt8) {
    if (p.k_scale == nullptr || p.v_scale == nullptr) return cudaErrorInvalidValue;
    return bf16 ? launch_pdl(rope_write_kv_kernel<__nv_bfloat16, int8_t>, grid, block, 0, stream, p)
                : launch_pdl(rope_write_kv_kernel<__half, int8_t>, grid, block, 0, stream, p);
  }
  return bf16 ? launch_pdl(rope_write_kv_kernel<__nv_bfloat16, __nv_bfloat16>, grid, block, 0, stream, p)
              : launch_pdl(rope_write_kv_kernel<__half, __half>, grid, block, 0, stream, p);
}

}  // namespace flashdecode
