// The split-KV prefill kernel: grid (num_splits, Hkv, row_tiles). A block serves a tile of 64 query
// rows of one sequence and KV head, rows being the (new token, query head of the group) pairs in
// token-major order, over one split of the keys those rows attend to: four warps of 16 rows each
// run S = Q K^T and O += P V with mma.m16n8k16 (fp32 accumulation) and an online softmax in the
// log2 domain, over K/V tiles of 64 tokens (32 at head_dim 256) read from the paged cache with cp.async into two
// shared-memory stages (the next tile in flight while the current one is computed). Rows are causal
// (a row at position p sees keys <= p) and optionally windowed (> p - window). The block writes its
// rows normalised, to the output (one split) or with their LSEs to the workspace, which the decode
// kernel's merge_kernel merges with (new token, query head) as its (sequence, head).
//
// Shared-memory rows are padded by 16 bytes so that ldmatrix's eight row addresses fall in distinct
// banks. int8 caches: a stage holds the codes and the row scales; a conversion pass writes fp16 K
// (the codes, exact) and V (code * scale rounded once, as the decode kernel does) beside them plus
// the K scales as float (0 for tokens outside the split), and both MMAs run in fp16 with q
// converted once (saturated to fp16's range).
#pragma once

#include "common.cuh"
#include "launch.h"
#include "prefill.h"

namespace flashdecode {
namespace {

constexpr int kPrefillWarps = kPrefillRows / 16;
constexpr int kPrefillThreads = kPrefillWarps * 32;

template <typename T, int D, typename KV>
struct PrefillShape {
  static constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  using M = std::conditional_t<kInt8, __half, T>;                   // the MMAs' element type
  // head_dim 256 streams half the tokens a stage, so that two blocks fit an SM (101 KB each)
  static constexpr int kM = kPrefillRows, kN = D > 128 ? kPrefillTile / 2 : kPrefillTile;
  static constexpr int kStride = D + 8;                            // elements of a padded 2-byte row
  static constexpr int kCodeStride = D + 16;                       // bytes of a padded int8 row
  static constexpr int kQBytes = kM * kStride * 2;
  static constexpr int kTileBytes = kN * kStride * 2;              // one K (or V) tile of 2-byte elements
  // A stage: K then V tiles of the cache's type; int8: codes, then K and V scales (kN each).
  static constexpr int kStageBytes = kInt8 ? 2 * kN * kCodeStride + 2 * kN * 2 : 2 * kTileBytes;
  // int8: the converted fp16 K and V tiles and the K scales as float, past the two stages.
  static constexpr int kConvBytes = kInt8 ? 2 * kTileBytes + kN * 4 : 0;
  static constexpr int kSmemBytes = kQBytes + 2 * kStageBytes + kConvBytes;
  static constexpr int kMinBlocks = 2;
  static_assert(kQBytes % 16 == 0 && kStageBytes % 16 == 0 && kTileBytes % 16 == 0, "16-byte aligned regions");
  static_assert(kN % 16 == 0, "a stage is whole MMA steps of P V (and even, for the int8 scales' pairs)");
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// What one block serves: rows [row0, row0 + rows) of sequence b's n * group rows at KV head
// kv_head, over keys [start, end); keys before ``first`` lie before every row's window.
struct PrefillWork {
  int b, kv_head, row0, rows, n, len, q_start;
  int pos_min, pos_max;   // the positions of the tile's first and last rows
  int first, start, end;
};

// Which sequence and row tile blockIdx.z is (warp 0 scans the sequences' tile counts 32 at a time),
// and the split's keys. b = -1: past the last tile.
__device__ __forceinline__ PrefillWork prefill_work(const PrefillParams& p, int tile_keys) {
  __shared__ int s_seq, s_tile;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < 32) {
    int base = 0, seq = -1, tile = 0;
    for (int c = 0; c < p.batch && seq < 0; c += 32) {
      const int i = c + lane;
      const int n = i < p.batch ? max(0, p.cu_query_starts[i + 1] - p.cu_query_starts[i]) : 0;
      const int tiles = (n * group + kPrefillRows - 1) / kPrefillRows;
      int incl = tiles;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, base + incl > (int)blockIdx.z);
      if (hit) {
        const int src = __ffs(hit) - 1;
        const int before = __shfl_sync(0xffffffffu, incl - tiles, src);
        seq = c + src;
        tile = blockIdx.z - base - before;
      }
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) s_seq = seq, s_tile = tile;
  }
  __syncthreads();
  PrefillWork w;
  w.b = s_seq;
  w.kv_head = blockIdx.y;
  if (w.b < 0) return w;
  w.q_start = p.cu_query_starts[w.b];
  w.n = max(0, p.cu_query_starts[w.b + 1] - w.q_start);
  w.len = min(p.seq_lens[w.b], p.max_blocks * p.block_size);
  w.row0 = s_tile * kPrefillRows;
  w.rows = min(kPrefillRows, w.n * group - w.row0);
  w.pos_min = w.len - w.n + w.row0 / group;
  w.pos_max = w.len - w.n + (w.row0 + w.rows - 1) / group;
  w.first = p.window > 0 ? max(w.pos_min - p.window + 1, 0) : 0;
  const int origin = w.first / tile_keys * tile_keys;
  const int span = max(w.pos_max + 1 - origin, 0);
  int chunk = max((span + (int)gridDim.x - 1) / (int)gridDim.x, kMinChunk);
  chunk = (chunk + tile_keys - 1) / tile_keys * tile_keys;
  const int64_t start = origin + (int64_t)blockIdx.x * chunk;
  w.start = (int)min(start, (int64_t)(w.pos_max + 1));
  w.end = (int)min(start + chunk, (int64_t)(w.pos_max + 1));
  return w;
}

// Asks for keys [kv0, kv0 + kN) of the split into a stage; keys outside [first, end) are zero-filled
// (the rows past a sequence's end may hold anything).
template <typename T, int D, typename KV>
__device__ __forceinline__ void prefill_load_tile(const PrefillParams& p, const PrefillWork& w, int kv0,
                                                  uint8_t* stage) {
  using S = PrefillShape<T, D, KV>;
  constexpr int kChunks = D * (int)sizeof(KV) / 16;   // 16-byte pieces of a row
  const int bs = p.block_size;
  const int32_t* table = p.block_table + (int64_t)w.b * p.block_table_stride;
  const KV* k_cache = static_cast<const KV*>(p.k_cache);
  const KV* v_cache = static_cast<const KV*>(p.v_cache);
  constexpr int kRowBytes = S::kInt8 ? S::kCodeStride : S::kStride * 2;
  uint8_t* k_dst = stage;
  uint8_t* v_dst = stage + S::kN * kRowBytes;
  for (int idx = threadIdx.x; idx < S::kN * kChunks; idx += kPrefillThreads) {
    const int tok = idx / kChunks, c = idx % kChunks;
    const int pos = kv0 + tok;
    const bool valid = pos >= w.first && pos < w.end;
    const int block = valid ? min(max(__ldg(table + pos / bs), 0), p.num_blocks - 1) : 0;
    const int64_t row = ((int64_t)block * p.num_kv_heads + w.kv_head) * bs + pos % bs;
    const int64_t src = valid ? row * D + c * (16 / (int)sizeof(KV)) : 0;
    cp_async16(k_dst + tok * kRowBytes + c * 16, k_cache + src, valid);
    cp_async16(v_dst + tok * kRowBytes + c * 16, v_cache + src, valid);
  }
  if constexpr (S::kInt8) {   // scales in pairs of tokens (a pair never straddles a page: kv0 is even)
    __half* ks_dst = reinterpret_cast<__half*>(stage + 2 * S::kN * S::kCodeStride);
    const __half* k_scales = static_cast<const __half*>(p.k_scale);
    const __half* v_scales = static_cast<const __half*>(p.v_scale);
    for (int pair = threadIdx.x; pair < S::kN / 2; pair += kPrefillThreads) {
      const int pos = kv0 + 2 * pair;
      const bool valid = pos + 1 >= w.first && pos < w.end;   // either token; the other is dropped later
      const int block = valid ? min(max(__ldg(table + pos / bs), 0), p.num_blocks - 1) : 0;
      const int64_t row = valid ? ((int64_t)block * p.num_kv_heads + w.kv_head) * bs + pos % bs : 0;
      cp_async4(ks_dst + 2 * pair, k_scales + row, valid);
      cp_async4(ks_dst + S::kN + 2 * pair, v_scales + row, valid);
    }
  }
}

// int8 caches: the stage's codes as fp16 K and scaled fp16 V rows, and the K scales as float; keys
// outside [first, end) become zeros (their codes and scales may be anything, NaN included).
template <typename T, int D, typename KV>
__device__ __forceinline__ void prefill_convert(const PrefillWork& w, int kv0, const uint8_t* stage, __half* k_out,
                                                __half* v_out, float* k_scale_out) {
  using S = PrefillShape<T, D, KV>;
  const __half* scales = reinterpret_cast<const __half*>(stage + 2 * S::kN * S::kCodeStride);
  constexpr int kChunks = D / 8;   // 8 codes -> 8 fp16
  for (int idx = threadIdx.x; idx < S::kN * kChunks; idx += kPrefillThreads) {
    const int tok = idx / kChunks, c = idx % kChunks;
    const int pos = kv0 + tok;
    const bool valid = pos >= w.first && pos < w.end;
    uint4 k = make_uint4(0, 0, 0, 0), v = k;
    if (valid) {
      const uint2 kc = *reinterpret_cast<const uint2*>(stage + tok * S::kCodeStride + 8 * c);
      const uint2 vc = *reinterpret_cast<const uint2*>(stage + (S::kN + tok) * S::kCodeStride + 8 * c);
      const uint2 k0 = int8x4_to_half2x2(kc.x), k1 = int8x4_to_half2x2(kc.y);
      uint2 v0 = int8x4_to_half2x2(vc.x), v1 = int8x4_to_half2x2(vc.y);
      const __half2 s = __half2half2(scales[S::kN + tok]);
      uint32_t vw[4] = {v0.x, v0.y, v1.x, v1.y};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&vw[i]), s);
        vw[i] = *reinterpret_cast<const uint32_t*>(&x);
      }
      k = make_uint4(k0.x, k0.y, k1.x, k1.y);
      v = make_uint4(vw[0], vw[1], vw[2], vw[3]);
    }
    *reinterpret_cast<uint4*>(k_out + tok * S::kStride + 8 * c) = k;
    *reinterpret_cast<uint4*>(v_out + tok * S::kStride + 8 * c) = v;
  }
  for (int tok = threadIdx.x; tok < S::kN; tok += kPrefillThreads) {
    const int pos = kv0 + tok;
    k_scale_out[tok] = pos >= w.first && pos < w.end ? __half2float(scales[tok]) : 0.f;
  }
}

// Rows with no key in the split: lse = -inf in the workspace, or zeros in the output (one split,
// only for lengths that break the contract).
template <int D>
__device__ __forceinline__ void prefill_write_empty(const PrefillParams& p, const PrefillWork& w) {
  const int group = p.num_q_heads / p.num_kv_heads, splits = gridDim.x;
  for (int i = threadIdx.x; i < w.rows * D; i += kPrefillThreads) {
    const int row = w.row0 + i / D;
    const int64_t token = w.q_start + row / group, head = w.kv_head * group + row % group;
    if (splits == 1)
      static_cast<uint16_t*>(p.out)[(token * p.num_q_heads + head) * D + i % D] = 0;   // +0 in bf16 and fp16
    else if (i % D == 0)
      p.partial_lse[(token * splits + blockIdx.x) * p.num_q_heads + head] = kNegInf;
  }
}

template <typename T, int D, typename KV>
__global__ void __launch_bounds__(kPrefillThreads, (PrefillShape<T, D, KV>::kMinBlocks))
    prefill_kernel(const PrefillParams p) {
  using S = PrefillShape<T, D, KV>;
  using M = typename S::M;
  constexpr int kN = S::kN, kStride = S::kStride;
  extern __shared__ __align__(128) uint8_t smem[];
  pdl_trigger_then_wait();   // q and the new rows' K/V are the predecessors' outputs

  const PrefillWork w = prefill_work(p, kN);
  if (w.b < 0 || w.rows <= 0) return;
  if (w.start >= w.end) {
    prefill_write_empty<D>(p, w);
    return;
  }
  const int group = p.num_q_heads / p.num_kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, qd = lane % 4;
  M* q_smem = reinterpret_cast<M*>(smem);
  uint8_t* stages = smem + S::kQBytes;
  M* conv_k = reinterpret_cast<M*>(stages + 2 * S::kStageBytes);
  M* conv_v = conv_k + kN * kStride;
  float* conv_k_scale = reinterpret_cast<float*>(conv_v + kN * kStride);
  const int n_tiles = (w.end - w.start + kN - 1) / kN;

  prefill_load_tile<T, D, KV>(p, w, w.start, stages);
  cp_async_commit();
  {  // the tile's query rows (token-major), zeros past its last row
    const T* q = static_cast<const T*>(p.q);
    for (int idx = threadIdx.x; idx < S::kM * (D / 8); idx += kPrefillThreads) {
      const int i = idx / (D / 8), c = idx % (D / 8), row = w.row0 + i;
      uint4 x = make_uint4(0, 0, 0, 0);
      if (i < w.rows) {
        const int64_t token = w.q_start + row / group, head = w.kv_head * group + row % group;
        x = to_mma<T, M>(__ldg(reinterpret_cast<const uint4*>(q + token * p.q_stride_t +
                                                                         head * p.q_stride_h + 8 * c)));
      }
      *reinterpret_cast<uint4*>(q_smem + i * kStride + 8 * c) = x;
    }
  }
  // This thread's rows (r and r + 8 of its warp's 16) and their positions; padding rows sit at -1.
  int row_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = warp * 16 + r + 8 * h;
    row_pos[h] = i < w.rows ? w.len - w.n + (w.row0 + i) / group : -1;
  }
  const float scale_log2 = p.scale * kLog2e;
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};

  for (int i = 0; i < n_tiles; ++i) {
    const int kv0 = w.start + i * kN;
    if (i + 1 < n_tiles) {
      prefill_load_tile<T, D, KV>(p, w, kv0 + kN, stages + ((i + 1) & 1) * S::kStageBytes);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    uint8_t* stage = stages + (i & 1) * S::kStageBytes;
    const M* k_tile;
    const M* v_tile;
    if constexpr (S::kInt8) {
      prefill_convert<T, D, KV>(w, kv0, stage, conv_k, conv_v, conv_k_scale);
      __syncthreads();
      k_tile = conv_k, v_tile = conv_v;
    } else {
      k_tile = reinterpret_cast<const M*>(stage);
      v_tile = k_tile + kN * kStride;
    }

    float s[kN / 8][4];
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, q_smem + (warp * 16 + (lane % 8) + ((lane / 8) & 1) * 8) * kStride + ks * 16 + (lane / 16) * 8);
#pragma unroll
      for (int j = 0; j < kN / 8; j += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, k_tile + (8 * j + (lane % 8) + (lane / 16) * 8) * kStride + ks * 16 + ((lane / 8) & 1) * 8);
        Elem<M>::mma(s[j], a[0], a[1], a[2], a[3], b[0], b[1]);
        Elem<M>::mma(s[j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
    }
    // Scale to the log2 domain (int8: each key's scale too), then mask what a row may not see.
    const bool masked = kv0 < w.first || kv0 + kN > w.end || kv0 + kN - 1 > w.pos_min ||
                        (p.window > 0 && kv0 <= w.pos_max - p.window);
#pragma unroll
    for (int j = 0; j < kN / 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int key = kv0 + 8 * j + 2 * qd + (c & 1);
        float x = s[j][c] * scale_log2;
        if constexpr (S::kInt8) x *= conv_k_scale[8 * j + 2 * qd + (c & 1)];
        if (masked) {
          const int pos = row_pos[c >> 1];
          if (key >= w.end || key > pos || (p.window > 0 && key <= pos - p.window)) x = kNegInf;
        }
        s[j][c] = x;
      }
    // Online softmax per row (h = 0: row r, 1: row r + 8).
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      const float new_m = fmaxf(m[h], quad_max(mx));
      const float base = new_m == kNegInf ? 0.f : new_m;
      alpha[h] = exp2_approx(m[h] - base);
      m[h] = new_m;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
        s[j][2 * h] = exp2_approx(s[j][2 * h] - base);
        s[j][2 * h + 1] = exp2_approx(s[j][2 * h + 1] - base);
        sum += s[j][2 * h] + s[j][2 * h + 1];
      }
      l[h] = l[h] * alpha[h] + sum;
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= alpha[0], o[j][1] *= alpha[0];
      o[j][2] *= alpha[1], o[j][3] *= alpha[1];
    }
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      const uint32_t a0 = Elem<M>::pack(s[2 * kk][0], s[2 * kk][1]), a1 = Elem<M>::pack(s[2 * kk][2], s[2 * kk][3]);
      const uint32_t a2 = Elem<M>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      const uint32_t a3 = Elem<M>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int j = 0; j < D / 8; j += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_tile + (16 * kk + (lane % 8) + ((lane / 8) & 1) * 8) * kStride + 8 * j + (lane / 16) * 8);
        Elem<M>::mma(o[j], a0, a1, a2, a3, b[0], b[1]);
        Elem<M>::mma(o[j + 1], a0, a1, a2, a3, b[2], b[3]);
      }
    }
    __syncthreads();   // every warp is done with the stage before the next load fills it
  }

  // Normalise and write rows r and r + 8 of this warp: columns 8 j + 2 qd, + 1.
  const int splits = gridDim.x;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float total = quad_sum(l[h]);
    const int i = warp * 16 + r + 8 * h;
    if (i >= w.rows) continue;
    const int row = w.row0 + i;
    const int64_t token = w.q_start + row / group, head = w.kv_head * group + row % group;
    const float inv = total > 0.f ? 1.f / total : 0.f;
    if (splits == 1) {
      T* dst = static_cast<T*>(p.out) + (token * p.num_q_heads + head) * D + 2 * qd;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<uint32_t*>(dst + 8 * j) = Elem<T>::pack(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
    } else {
      const int64_t slot = (token * splits + blockIdx.x) * p.num_q_heads + head;
      float* dst = p.partial_out + slot * D + 2 * qd;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
      if (qd == 0) p.partial_lse[slot] = total > 0.f ? (m[h] + __log2f(total)) * kLn2 : kNegInf;
    }
  }
}

}  // namespace
}  // namespace flashdecode
