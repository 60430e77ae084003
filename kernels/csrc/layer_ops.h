// Plain-C++ interface of the small per-layer kernels (layer_ops.cu) that, with the attention
// kernels, make a decoder layer's decode step: RMSNorm (optionally fused with the residual add),
// rotary embedding fused with the per-head q/k norms and the KV-cache write, the gated
// activations, and the GEMV of a decode step's few rows (which can take the residual add and
// RMSNorm in front of it and the gated activation behind it).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "flash_decode.h"

namespace flashdecode {

struct RmsNormParams {
  void* out;                 // [rows, hidden], row stride out_stride (elements); may alias x
  const void* x;             // [rows, hidden], row stride x_stride
  const void* residual;      // [rows, hidden] contiguous, or null: with it, residual_out = residual + x,
  void* residual_out;        //   then out = norm(residual_out); residual_out may be residual itself
  const void* weight;        // [hidden], of x's dtype, or float32 (Gemma's rounding: scaled in float32, rounded once)
  bool weight_fp32;
  int64_t rows, x_stride, out_stride;
  int hidden;                // a multiple of 8
  float eps;
  DType dtype;
};

// The gated MLP activations: act(gate) * up.
enum class GatedAct : int { kSilu = 0, kGeluTanh = 1 };

struct SiluMulParams {
  void* out;                 // [rows, inter] contiguous
  const void* in;            // [rows, 2 * inter] contiguous: gate then up
  int64_t rows;
  int inter;                 // a multiple of 8
  GatedAct act;
  DType dtype;
};

// The largest head_dim rope_write_kv takes: the attention kernel's largest.
constexpr int kMaxRopeHeadDim = kHeadDims[2];

struct RopeKvParams {
  void* qkv;                 // [T, (Hq + 2 Hkv) * D], row stride qkv_stride: q and k rotated in place
  int64_t qkv_stride;
  const int32_t* positions;  // [T]
  const float* cos_sin;      // [max_positions, D]: cos of the D/2 frequencies, then their sin
  void* k_cache;             // [num_blocks, Hkv, block_size, D] contiguous
  void* v_cache;
  const void* slot_mapping;  // [T] int32 or int64; a negative slot writes nothing
  bool slots_are_int64;
  const void* q_norm;        // [D] each, or both null: each query and key head is RMS-normalised
  const void* k_norm;        //   before it is rotated (weights of qkv's dtype, or float32 as RmsNormParams)
  bool norm_fp32;
  float eps;
  int64_t num_tokens;
  int num_q_heads, num_kv_heads, head_dim, block_size;
  DType dtype;
  KvDType kv_dtype;          // kInt8: the rotated key and the value are stored quantised per row, their
  void* k_scale;             // scales in [num_blocks, Hkv, block_size] float16 tensors; else null
  void* v_scale;
};

struct GemvParams {
  void* y;                   // [rows, n] contiguous, or [rows, n / 2] when gated
  const void* x;             // [rows, k], row stride x_stride
  int64_t x_stride;
  const void* norm_weight;   // [k] (x's dtype or float32, as RmsNormParams), or null: with it the input
  bool norm_fp32;            //   rows are rms_norm(residual + x)
  float eps;
  const void* residual;      // [rows, k], row stride residual_stride (with norm_weight)
  int64_t residual_stride;
  void* residual_out;        // [rows, k] contiguous: residual + x (with norm_weight)
  const void* w;             // [n, k] contiguous (an nn.Linear weight)
  const void* bias;          // [n] or null; never with gated
  int rows, n, k;            // rows <= kGemvMaxRows, k a multiple of 8, rows * k * 4 <= kGemvMaxSmemBytes
  bool gated;                // w stacks the gate's n / 2 rows on the up's: y = act(x Wg^T) * (x Wu^T),
  GatedAct act;              //   each rounded as transformers' MLP rounds
  DType dtype;
};

// Most rows a GEMV launch serves (each weight row is read once and used for every input row; the
// product routes only one or two rows here, kernels/layer_ops.py's gemv_serves), and the shared
// memory that holds its input rows (as float32).
constexpr int kGemvMaxRows = 4;
constexpr int kGemvMaxSmemBytes = 200 * 1024;

cudaError_t launch_gemv(const GemvParams& params, cudaStream_t stream);
cudaError_t launch_rms_norm(const RmsNormParams& params, cudaStream_t stream);
cudaError_t launch_silu_and_mul(const SiluMulParams& params, cudaStream_t stream);
cudaError_t launch_rope_write_kv(const RopeKvParams& params, cudaStream_t stream);

}  // namespace flashdecode
