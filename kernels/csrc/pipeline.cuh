// The split kernel's pipeline: a producer warp streams a split's K/V tiles from the paged cache
// into a ring of shared-memory stages (one cp.async.bulk per page and lane, mbarriers guarding
// each stage), and the consumer warps run S = Q K^T and O += P V on the tensor cores with an
// online softmax per warp.
//
// Fragment trick: reading K and V rows with one 16-byte load per thread avoids ldmatrix bank
// conflicts on the unpadded tiles. The head dimension is the reduction of S = Q K^T, so K's
// elements may be fed to the MMA in any order that Q's fragments follow as well; for P V the
// head dimension is the output column, so V's 8x8 pieces are transposed with movmatrix and the
// output columns land in a known permutation (each thread ends up owning 8 contiguous columns).
//
// INT8 caches (KV = int8_t): a stage holds the same tokens' codes in half the bytes, then their K
// and V row scales (2 bytes a token each), and the ring twice the stages, so about the same bytes
// are in flight. A thread's 16-byte load then holds 16 codes, the columns of two 8-column groups
// (fragment_col); they become fp16 in registers exactly (int8.cuh) and the MMAs run in fp16
// whatever q's type. The K scales multiply each token's scores (in fp32); a V row's codes are
// multiplied by its scale in fp16 before P V, each product rounded once, as plain fp16 attention
// over the dequantised cache would round it. Accumulation is in FP32 as for bf16 caches.
#pragma once

#include "common.cuh"

namespace flashdecode {
namespace {

constexpr int kStageBytes = 32 * 1024;             // one tile of K and V
constexpr int kStages = 3;                         // 96 KB: two blocks per SM
constexpr int kMinStages = 2;                      // the shared memory of the epilogue and the merge
// Blocks of fewer tiles than this copy whole pages whatever copy_rows says (measured: docs/log.md).
constexpr int kCopyRowsMinTiles = 8;
// Tiles a split block reads ahead (capped by its ring): the ring of three keeps a stage free, so
// that the producer asks for a tile the moment the predecessor finishes (measured: docs/log.md).
constexpr int kReadAheadTiles = 2;

// A tile is 32 KB of K+V: 128 tokens for D=64, 64 for D=128, 32 for D=256. A consumer warp owns W
// of its tokens: D=64 has 4 consumer warps of 32 (8 of 16 for groups of more than eight heads),
// D=128 4 of 16, D=256 2 of 16.
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
  // At D=256 a thread's output fragments alone take 128 registers: V is read from the stage in
  // the P V product (not ahead of the softmax), and the stage released after it.
  static constexpr bool kLateV = D > 128;
};

template <typename KV>
__host__ __device__ constexpr bool is_int8() { return std::is_same_v<KV, int8_t>; }

// INT8 caches: stages of half the code bytes plus the tile's K and V scales (a multiple of 128
// bytes at every head_dim), twice as many.
template <typename KV, int D>
__host__ __device__ constexpr int stage_bytes() {
  return is_int8<KV>() ? kStageBytes / 2 + 2 * tile_tokens(D) * 2 : kStageBytes;
}
template <typename KV>
__host__ __device__ constexpr int stages_per_tile_bytes() { return is_int8<KV>() ? 2 : 1; }
static_assert(stage_bytes<int8_t, 256>() % 128 == 0 && stage_bytes<int8_t, 128>() % 128 == 0 &&
                  stage_bytes<int8_t, 64>() % 128 == 0,
              "int8 stages stay 128-byte aligned");

// Stage ``stage`` of the ring: the tile's K rows, then its V rows, then (int8 caches) the K
// scales and the V scales, kTile each.
template <typename KV, int D>
__device__ __forceinline__ KV* stage_rows(uint8_t* ring, int stage) {
  return reinterpret_cast<KV*>(ring + (int64_t)stage * stage_bytes<KV, D>());
}
template <typename KV, int D>
__device__ __forceinline__ __half* stage_scales(uint8_t* ring, int stage) {
  return reinterpret_cast<__half*>(ring + (int64_t)stage * stage_bytes<KV, D>() + 2 * tile_tokens(D) * D);
}

// The MMAs' element type: q's, or fp16 for int8 caches (whose codes convert to fp16 exactly).
template <typename T, typename KV>
using MmaType = std::conditional_t<is_int8<KV>(), __half, T>;

// The first of the 8 head-dim columns that this thread's fragments of group j (32 columns per
// group) cover, for q, K and V alike: one 16-byte load holds one group of 2-byte elements, or
// two groups of int8 codes.
template <typename KV>
__device__ __forceinline__ int fragment_col(int j, int qd) {
  if constexpr (is_int8<KV>())
    return 64 * (j / 2) + 16 * qd + 8 * (j % 2);
  else
    return 32 * j + 8 * qd;
}

// This thread's fragments of one cache row (8 MMA elements per group), from shared memory.
template <typename KV, int D>
__device__ __forceinline__ void load_row(const KV* row, int qd, uint4 (&f)[D / 32]) {
  if constexpr (is_int8<KV>()) {
#pragma unroll
    for (int j = 0; j < D / 32; j += 2) {
      const uint4 codes = *reinterpret_cast<const uint4*>(row + fragment_col<KV>(j, qd));
      const uint2 a = int8x4_to_half2x2(codes.x), b = int8x4_to_half2x2(codes.y);
      const uint2 c = int8x4_to_half2x2(codes.z), d = int8x4_to_half2x2(codes.w);
      f[j] = make_uint4(a.x, a.y, b.x, b.y);
      f[j + 1] = make_uint4(c.x, c.y, d.x, d.y);
    }
  } else {
#pragma unroll
    for (int j = 0; j < D / 32; ++j) f[j] = *reinterpret_cast<const uint4*>(row + fragment_col<KV>(j, qd));
  }
}

// int8 caches: a V row's fragments times the row's scale (in fp16, each product rounded once).
template <int N>
__device__ __forceinline__ void scale_fragments(uint4 (&f)[N], __half scale) {
  const __half2 s = __half2half2(scale);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    uint32_t w[4] = {f[j].x, f[j].y, f[j].z, f[j].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&w[i]), s);
      w[i] = *reinterpret_cast<const uint32_t*>(&x);
    }
    f[j] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// This thread's fragment of group j of one cache row alone (the late V reads at D=256): for int8
// caches the group's 8 codes are half of load_row's 16-byte load.
template <typename KV>
__device__ __forceinline__ uint4 load_group(const KV* row, int j, int qd) {
  if constexpr (is_int8<KV>()) {
    const uint2 codes = *reinterpret_cast<const uint2*>(row + fragment_col<KV>(j, qd));
    const uint2 a = int8x4_to_half2x2(codes.x), b = int8x4_to_half2x2(codes.y);
    return make_uint4(a.x, a.y, b.x, b.y);
  } else {
    return *reinterpret_cast<const uint4*>(row + fragment_col<KV>(j, qd));
  }
}

// The next tile's place in the ring of shared-memory stages: its stage, and how often the ring
// has wrapped (the parity of the stage's barrier phase).
struct RingSlot {
  int stages, stage = 0, round = 0;
  __device__ __forceinline__ explicit RingSlot(int n) : stages(n) {}
  __device__ __forceinline__ void advance() {
    if (++stage == stages) stage = 0, ++round;
  }
};

template <typename KV, int D>
__device__ __forceinline__ void produce(const DecodeParams& p, const Work& w, int n_tiles, RingSlot& slot,
                                        uint8_t* ring, uint64_t* full, uint64_t* empty) {
  constexpr int kTile = tile_tokens(D);
  const int lane = threadIdx.x % 32;
  const int bs = p.block_size;
  // A tile is fetched in kTile / copy_rows bulk copies per K and V, one per lane; copy_rows
  // divides both the page and the tile, so no copy crosses a page.
  const int copy_rows = n_tiles >= kCopyRowsMinTiles ? p.copy_rows : min(bs, kTile);
  const int copies = kTile / copy_rows;
  const int pages = (w.len + bs - 1) / bs;
  const int32_t* table = p.block_table + (int64_t)w.b * p.block_table_stride;
  const int64_t block_rows = (int64_t)p.num_kv_heads * bs;  // cache rows (token, KV head) of a block
  const int64_t head_rows = (int64_t)w.kv_head * bs;
  const KV* k_cache = static_cast<const KV*>(p.k_cache);
  const KV* v_cache = static_cast<const KV*>(p.v_cache);
  const __half* k_scales = static_cast<const __half*>(p.k_scale);  // int8 caches: a scale per cache row
  const __half* v_scales = static_cast<const __half*>(p.v_scale);

  // Block ids of pages [base, base + 64), one per lane in cur and next; 0 past the last page. A
  // tile's pages never straddle base + 32 (a tile is a whole number of pages, or part of one, and
  // starts on a tile boundary), so a tile reads cur alone: next is in long before it is needed.
  int base = w.start / bs;
  auto fetch = [&](int page) { return page < pages ? __ldg(table + page) : 0; };
  int cur = fetch(base + lane), next = fetch(base + 32 + lane);
  // With read_ahead, the first tiles are asked for before the predecessor has finished: every one
  // but a tile holding row len - 1, which the predecessor may still be writing.
  const int fill = min(kReadAheadTiles * stages_per_tile_bytes<KV>(), slot.stages);  // the same bytes
  const int ahead = p.read_ahead ? min(fill, n_tiles - (w.end == w.len ? 1 : 0)) : 0;
  for (int i = 0; i < n_tiles; ++i, slot.advance()) {
    if (i == ahead) pdl_wait();
    const int stage = slot.stage;
    if (i >= slot.stages) mbar_wait(&empty[stage], (slot.round - 1) & 1);
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
    const uint32_t bytes = rows * D * (uint32_t)sizeof(KV);
    // int8 caches: the rows' scales too, in whole 16-byte pieces (8 scales; copy_rows and the
    // page are multiples of 16 rows, so the rounded copy stays inside the page)
    const uint32_t scale_bytes = is_int8<KV>() ? (rows + 7) / 8 * 16 : 0;
    uint32_t stage_bytes = 2 * __reduce_add_sync(0xffffffffu, bytes);
    if constexpr (is_int8<KV>()) stage_bytes += 2 * __reduce_add_sync(0xffffffffu, scale_bytes);
    if (lane == 0) mbar_arrive_expect_tx(&full[stage], stage_bytes);
    __syncwarp();
    if (rows > 0) {
      const int64_t src_row = block * block_rows + head_rows + (first_token - page * bs);
      KV* k_dst = stage_rows<KV, D>(ring, stage) + lane * copy_rows * D;
      bulk_load(k_dst, k_cache + src_row * D, bytes, &full[stage]);
      bulk_load(k_dst + kTile * D, v_cache + src_row * D, bytes, &full[stage]);
      if constexpr (is_int8<KV>()) {
        __half* s_dst = stage_scales<KV, D>(ring, stage) + lane * copy_rows;
        bulk_load(s_dst, k_scales + src_row, scale_bytes, &full[stage]);
        bulk_load(s_dst + kTile, v_scales + src_row, scale_bytes, &full[stage]);
      }
    }
  }
  if (ahead >= n_tiles) pdl_wait();  // all read ahead; the epilogue writes
  if (p.trigger_at_loads) pdl_trigger();
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
template <typename T, typename KV, int D, int W, bool kHi>
__device__ __forceinline__ void consume(const DecodeParams& p, const Work& w, int n_tiles, RingSlot& slot,
                                        uint8_t* ring,
                                        uint64_t* full, uint64_t* empty, float (&o)[D / 32][4][4], float& m_lo,
                                        float& m_hi, float& l_lo, float& l_hi) {
  using S = Shape<D, W>;
  using M = MmaType<T, KV>;
  constexpr int kTile = S::kTile, kPieces = W / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, qd = lane % 4;
  const T* q = static_cast<const T*>(p.q) + w.b * p.q_stride_b;
  const uint4 zero{0, 0, 0, 0};
  uint4 q_lo[S::kGroups], q_hi[S::kGroups];
#pragma unroll
  for (int j = 0; j < S::kGroups; ++j) {
    const int col = fragment_col<KV>(j, qd);
    q_lo[j] = r < w.rows ? to_mma<T, M>(__ldg(reinterpret_cast<const uint4*>(q + (w.q_head0 + r) * p.q_stride_h + col)))
                         : zero;
    q_hi[j] = kHi && r + 8 < w.rows
                  ? to_mma<T, M>(__ldg(reinterpret_cast<const uint4*>(q + (w.q_head0 + r + 8) * p.q_stride_h + col)))
                  : zero;
  }
  const float scale_log2 = p.scale * kLog2e;

  for (int i = 0; i < n_tiles; ++i, slot.advance()) {
    const int stage = slot.stage;
    const int t_warp = w.start + i * kTile + warp * W;
    mbar_wait(&full[stage], slot.round & 1);
    const KV* k_tile = stage_rows<KV, D>(ring, stage) + warp * W * D;
    const KV* v_tile = k_tile + kTile * D;
    if (t_warp >= w.end || t_warp + W <= w.first) {  // none of this warp's tokens is attended
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[stage]);
      continue;
    }
    // int8 caches: the K scales of this thread's score columns (tokens t_warp + 8 h + 2 qd + {0, 1})
    // and the V scales of its V rows (tokens t_warp + 8 h + r)
    float2 k_sc[kPieces];
    __half v_sc[kPieces];
    if constexpr (is_int8<KV>()) {
      const __half* scales = stage_scales<KV, D>(ring, stage) + warp * W;
#pragma unroll
      for (int h = 0; h < kPieces; ++h) {
        k_sc[h] = __half22float2(*reinterpret_cast<const __half2*>(scales + 8 * h + 2 * qd));
        v_sc[h] = scales[kTile + 8 * h + r];
      }
    }
    float s[kPieces][4];
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      s[h][0] = s[h][1] = s[h][2] = s[h][3] = 0.f;
      uint4 k[S::kGroups];
      load_row<KV, D>(k_tile + (8 * h + r) * D, qd, k);
#pragma unroll
      for (int j = 0; j < S::kGroups; ++j) {
        Elem<M>::mma(s[h], q_lo[j].x, q_hi[j].x, q_lo[j].y, q_hi[j].y, k[j].x, k[j].y);
        Elem<M>::mma(s[h], q_lo[j].z, q_hi[j].z, q_lo[j].w, q_hi[j].w, k[j].z, k[j].w);
      }
    }
    uint4 v[kPieces][S::kGroups];
    if constexpr (!S::kLateV) {
#pragma unroll
      for (int h = 0; h < kPieces; ++h) {
        load_row<KV, D>(v_tile + (8 * h + r) * D, qd, v[h]);
        if constexpr (is_int8<KV>()) scale_fragments(v[h], v_sc[h]);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[stage]);
    }

#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      if constexpr (is_int8<KV>()) {
        const float lo_col = scale_log2 * k_sc[h].x, hi_col = scale_log2 * k_sc[h].y;
        s[h][0] *= lo_col, s[h][1] *= hi_col, s[h][2] *= lo_col, s[h][3] *= hi_col;
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[h][c] *= scale_log2;
      }
    }
    // dead[h]: this thread's V row of piece h is outside [first, end) and may hold anything, NaN included.
    bool dead[kPieces];
#pragma unroll
    for (int h = 0; h < kPieces; ++h) dead[h] = false;
    if (t_warp + W > w.end || t_warp < w.first) {  // the sequence ends, or the window starts, in these tokens
#pragma unroll
      for (int h = 0; h < kPieces; ++h) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int t = t_warp + 8 * h + 2 * qd + (c & 1);
          if (t >= w.end || t < w.first) s[h][c] = kNegInf;
        }

        const int t = t_warp + 8 * h + r;
        dead[h] = t >= w.end || t < w.first;
        if constexpr (!S::kLateV)
          if (dead[h])
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
      pa[kk][0] = Elem<M>::pack(lo[4 * kk], lo[4 * kk + 1]);
      pa[kk][1] = kHi ? Elem<M>::pack(hi[4 * kk], hi[4 * kk + 1]) : 0;
      pa[kk][2] = Elem<M>::pack(lo[4 * kk + 2], lo[4 * kk + 3]);
      pa[kk][3] = kHi ? Elem<M>::pack(hi[4 * kk + 2], hi[4 * kk + 3]) : 0;
    }
#pragma unroll
    for (int j = 0; j < S::kGroups; ++j) {
      uint4 vj[kPieces];
#pragma unroll
      for (int h = 0; h < kPieces; ++h) {
        if constexpr (!S::kLateV) {
          vj[h] = v[h][j];
        } else if (dead[h]) {
          vj[h] = zero;
        } else {
          uint4 g[1] = {load_group<KV>(v_tile + (8 * h + r) * D, j, qd)};
          if constexpr (is_int8<KV>()) scale_fragments(g, v_sc[h]);
          vj[h] = g[0];
        }
      }
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
          Elem<M>::mma(o[j][c], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3],
                       transpose8x8(word(vj[2 * kk], c)), transpose8x8(word(vj[2 * kk + 1], c)));
      }
    }
    if constexpr (S::kLateV) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[stage]);
    }
  }
  l_lo = quad_sum(l_lo);
  l_hi = quad_sum(l_hi);
}

}  // namespace
}  // namespace flashdecode
