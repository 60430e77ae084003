// torch.library registration of the flashdecode ops (CUDA): flash_decode, write_kv, read_kv and the per-layer
// ops rms_norm, add_rms_norm, silu_and_mul (either gated activation), gemv, add_rms_norm_gemv, rope_write_kv.
// kernels/ops.py validates inputs with readable errors and registers the fake (meta) kernels;
// the checks here only guard the raw pointers for callers of torch.ops.flashdecode directly.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "binding_common.h"
#include "flash_decode.h"
#include "layer_ops.h"

namespace flashdecode {
namespace {

void check_cuda(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, name, " must be on ", device, ", got ", t.device());
}

// The caches a write or a read of rows takes: contiguous [num_blocks, Hkv, block_size, D], both alike.
void check_cache_pair(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, Hkv, block_size, D] of one shape and dtype");
}

// An int8 cache's row scales: k_scale and v_scale, both contiguous, 16-byte aligned float16
// [num_blocks, Hkv, block_size] on the caches' device; other caches take neither. Returns the KV type.
KvDType check_kv_scales(const at::Tensor& k_cache, const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == k_scale.has_value() && int8 == v_scale.has_value(),
              "k_scale and v_scale are required for int8 caches and refused for others; caches are ",
              k_cache.scalar_type(), ", k_scale ", k_scale.has_value() ? "given" : "missing", ", v_scale ",
              v_scale.has_value() ? "given" : "missing");
  if (!int8) return KvDType::kSameAsQuery;
  for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
    check_cuda(*t, "k_scale/v_scale", k_cache.device());
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->sizes() == k_cache.sizes().slice(0, 3) && t->is_contiguous() && aligned16(*t),
                "k_scale and v_scale must be contiguous, 16-byte aligned float16 [num_blocks=", k_cache.size(0),
                ", Hkv=", k_cache.size(1), ", block_size=", k_cache.size(2), "], got ", t->scalar_type(), " ",
                t->sizes());
  }
  return KvDType::kInt8;
}

at::Tensor flash_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t num_splits,
                        bool three_per_sm, at::Tensor& partial_out, at::Tensor& partial_lse, bool read_ahead,
                        int64_t window, const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  const auto device = q.device();
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&k_cache, "k_cache"}, {&v_cache, "v_cache"},
                         {&block_table, "block_table"}, {&seq_lens, "seq_lens"}, {&partial_out, "partial_out"},
                         {&partial_lse, "partial_lse"}})
    check_cuda(*t, name, device);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with a contiguous last dim");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q must be bf16 or fp16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous [num_blocks, Hkv, block_size, D] of one shape");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == q.scalar_type() || k_cache.scalar_type() == at::kChar),
              "caches must have q's dtype or be int8");
  const KvDType kv_dtype = check_kv_scales(k_cache, k_scale, v_scale);
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(supported_head_dim(d), "head_dim must be ", kHeadDims[0], ", ", kHeadDims[1], " or ", kHeadDims[2],
              ", got ", d);
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, "window must be in 0..", INT32_MAX, " (0: none), got ", window);
  TORCH_CHECK(k_cache.size(3) == d, "cache head_dim ", k_cache.size(3), " != q head_dim ", d);
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0, "num_q_heads ", hq, " is not a multiple of num_kv_heads ", hkv);
  TORCH_CHECK(supported_block_size(bs), "unsupported block_size ", bs);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.size(0) == batch &&
                  block_table.stride(1) == 1,
              "block_table must be int32 [B, max_blocks] with unit column stride");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == batch &&
                  seq_lens.is_contiguous(),
              "seq_lens must be int32 [B]");
  TORCH_CHECK(num_splits >= 1 && num_splits <= kMaxSplits, "num_splits must be in 1..", kMaxSplits);
  TORCH_CHECK(!three_per_sm || (num_splits == 2 && d == kWideWarpHeadDim && hq / hkv <= kWideWarpMaxGroup),
              "the three-per-SM plan is two splits at head_dim ", kWideWarpHeadDim, " with at most ", kWideWarpMaxGroup,
              " query heads per KV head");
  TORCH_CHECK(q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0 && aligned16(q) && aligned16(k_cache) &&
                  aligned16(v_cache),
              "q and the caches must be 16-byte aligned");
  if (num_splits > 1) {
    TORCH_CHECK(partial_out.scalar_type() == at::kFloat && partial_out.is_contiguous() &&
                    partial_out.dim() == 3 && partial_out.size(1) == hq && partial_out.size(2) == d &&
                    partial_out.size(0) >= batch * num_splits,
                "partial_out must be float32 [>= B * num_splits, Hq, D]");
    TORCH_CHECK(partial_lse.scalar_type() == at::kFloat && partial_lse.is_contiguous() &&
                    partial_lse.numel() >= batch * num_splits * hq,
                "partial_lse must be float32 [>= B * num_splits, Hq]");
  }

  c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({batch, hq, d}, q.options());
  DecodeParams p{};
  set_attention_params(p, q, k_cache, v_cache, block_table, seq_lens, out, partial_out, partial_lse, scale, num_splits,
                       window, kv_dtype, k_scale, v_scale);
  p.q_stride_b = q.stride(0);
  p.batch = static_cast<int>(batch);
  p.three_per_sm = three_per_sm;
  p.read_ahead = read_ahead;
  const cudaError_t err = launch_flash_decode(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_decode launch failed: ", cudaGetErrorString(err));
  return out;
}

void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
              const std::optional<at::Tensor>& v_scale) {
  const auto device = k_cache.device();
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&v_cache, "v_cache"}, {&key, "key"}, {&value, "value"},
                         {&slot_mapping, "slot_mapping"}})
    check_cuda(*t, name, device);
  check_cache_pair(k_cache, v_cache);
  const int64_t hkv = k_cache.size(1), bs = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == hkv && key.size(2) == d,
              "key and value must be [T, Hkv, D] matching the cache");
  const KvDType kv_dtype = check_kv_scales(k_cache, k_scale, v_scale);
  const bool int8 = kv_dtype == KvDType::kInt8;
  TORCH_CHECK(value.scalar_type() == key.scalar_type() &&
                  (int8 ? key.scalar_type() == at::kBFloat16 || key.scalar_type() == at::kHalf
                        : key.scalar_type() == k_cache.scalar_type()),
              "key and value must have the cache's dtype (bf16 or fp16 for int8 caches)");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
              "slot_mapping must be int32 or int64 [T]");
  const int64_t elem = key.element_size(), row_bytes = d * k_cache.element_size();
  TORCH_CHECK(d * elem % 16 == 0 && row_bytes % 8 == 0, "head_dim * element size must be a multiple of 16 bytes");
  TORCH_CHECK(!int8 || 32 % (d / 8) == 0, "int8 caches take head_dim 8, 16, 32, 64, 128 or 256, got ", d);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->stride(2) == 1 && (t->stride(0) * elem) % 16 == 0 && (t->stride(1) * elem) % 16 == 0 &&
                    aligned16(*t) && aligned16(k_cache) && aligned16(v_cache),
                "key/value need a contiguous last dim and 16-byte aligned rows");

  c10::cuda::CUDAGuard guard(device);
  WriteKvParams p{};
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_stride_t = key.stride(0) * elem;
  p.key_stride_h = key.stride(1) * elem;
  p.value_stride_t = value.stride(0) * elem;
  p.value_stride_h = value.stride(1) * elem;
  p.slot_mapping = slot_mapping.data_ptr();
  p.slots_are_int64 = slot_mapping.scalar_type() == at::kLong;
  p.num_tokens = key.size(0);
  p.num_slots = k_cache.size(0) * bs;
  p.num_kv_heads = static_cast<int>(hkv);
  p.block_size = static_cast<int>(bs);
  p.row_bytes = static_cast<int>(row_bytes);
  p.kv_dtype = kv_dtype;
  p.src_dtype = key.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kHalf;
  if (int8) {
    p.k_scale = k_scale->data_ptr();
    p.v_scale = v_scale->data_ptr();
  }
  const cudaError_t err = launch_write_kv(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "write_kv launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> read_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                           const at::Tensor& slot_mapping, at::ScalarType dtype,
                                           const std::optional<at::Tensor>& k_scale,
                                           const std::optional<at::Tensor>& v_scale) {
  const auto device = k_cache.device();
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&k_cache, "k_cache"}, {&v_cache, "v_cache"},
                         {&slot_mapping, "slot_mapping"}})
    check_cuda(*t, name, device);
  check_cache_pair(k_cache, v_cache);
  const KvDType kv_dtype = check_kv_scales(k_cache, k_scale, v_scale);
  const bool int8 = kv_dtype == KvDType::kInt8;
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "read_kv reads into bfloat16 or float16, not ", dtype);
  TORCH_CHECK(int8 || dtype == k_cache.scalar_type(), "read_kv of a ", k_cache.scalar_type(),
              " cache reads into its own dtype, not ", dtype);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be contiguous int32 [K]");
  const int64_t hkv = k_cache.size(1), bs = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(d % 8 == 0 && aligned16(k_cache) && aligned16(v_cache), "head_dim must be a multiple of 8 and the caches "
              "16-byte aligned");
  at::Tensor key = at::empty({slot_mapping.size(0), hkv, d}, k_cache.options().dtype(dtype));
  at::Tensor value = at::empty({slot_mapping.size(0), hkv, d}, k_cache.options().dtype(dtype));

  c10::cuda::CUDAGuard guard(device);
  ReadKvParams p{};
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int32_t>();
  p.num_rows = slot_mapping.size(0);
  p.num_slots = k_cache.size(0) * bs;
  p.num_kv_heads = static_cast<int>(hkv);
  p.block_size = static_cast<int>(bs);
  p.head_dim = static_cast<int>(d);
  p.kv_dtype = kv_dtype;
  p.dst_dtype = dtype == at::kBFloat16 ? DType::kBFloat16 : DType::kHalf;
  if (int8) {
    p.k_scale = k_scale->data_ptr();
    p.v_scale = v_scale->data_ptr();
  }
  const cudaError_t err = launch_read_kv(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "read_kv launch failed: ", cudaGetErrorString(err));
  return {key, value};
}

DType dtype_of(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, "expected bf16 or fp16, got ",
              t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kHalf;
}

void check_rows(const at::Tensor& t, const char* name, int64_t width) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width && t.stride(1) == 1 && t.stride(0) % 8 == 0 && aligned16(t), name,
              " must be [rows, ", width, "] with a contiguous last dim and 16-byte aligned rows");
}

void check_norm_weight(const at::Tensor& weight, const at::Tensor& x) {
  check_cuda(weight, "norm weight", x.device());
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) % 8 == 0 && aligned16(weight),
              "norm weight must be contiguous [hidden], hidden a multiple of 8");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "norm weight must be of x's dtype (", x.scalar_type(), ") or float32, got ", weight.scalar_type());
}

void check_residual(const at::Tensor& residual, const at::Tensor& x) {
  check_cuda(residual, "residual", x.device());
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous and match x");
}

// residual_out: where residual + x goes, with a residual.
void rms_norm_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor* residual,
                   const at::Tensor* residual_out, const at::Tensor& weight, double eps) {
  check_norm_weight(weight, x);
  const int64_t hidden = weight.size(0);
  check_cuda(out, "out", x.device());
  check_rows(x, "x", hidden);
  check_rows(out, "out", hidden);
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "x and out must share a dtype");
  RmsNormParams p{};
  p.out = out.data_ptr();
  p.x = x.data_ptr();
  if (residual != nullptr) {
    check_residual(*residual, x);
    p.residual = residual->data_ptr();
    p.residual_out = residual_out->data_ptr();
  }
  p.weight = weight.data_ptr();
  p.weight_fp32 = weight.scalar_type() == at::kFloat;
  p.rows = x.size(0);
  p.x_stride = x.stride(0);
  p.out_stride = out.stride(0);
  p.hidden = static_cast<int>(hidden);
  p.eps = static_cast<float>(eps);
  p.dtype = dtype_of(x);
  c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = launch_rms_norm(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "rms_norm launch failed: ", cudaGetErrorString(err));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_into(out, x, nullptr, nullptr, weight, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor summed = at::empty(x.sizes(), x.options());
  rms_norm_into(out, x, &residual, &summed, weight, eps);
  return {out, summed};
}

GatedAct gated_act_of(int64_t act) {
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (silu) or 1 (gelu_pytorch_tanh), got ", act);
  return static_cast<GatedAct>(act);
}

// act -1: y = x W^T (+ bias); 0 or 1: w stacks the gate's rows on the up's, y = act(gate) * up.
// With norm_weight the input rows are rms_norm(residual + x) (residual required), and the sum
// comes back as the second tensor.
std::tuple<at::Tensor, at::Tensor> gemv_into(const at::Tensor& x, const at::Tensor& w,
                                             const std::optional<at::Tensor>& bias, int64_t act,
                                             const at::Tensor* residual, const at::Tensor* norm_weight, double eps) {
  check_cuda(w, "w", x.device());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) % 8 == 0 && aligned16(w) &&
                  w.scalar_type() == x.scalar_type(),
              "w must be contiguous [n, k] of x's dtype, k a multiple of 8");
  const int64_t n = w.size(0), k = w.size(1), rows = x.size(0);
  TORCH_CHECK(act >= -1, "act must be -1 (no gated epilogue), 0 (silu) or 1 (gelu_pytorch_tanh), got ", act);
  const bool gated = act >= 0;
  check_rows(x, "x", k);
  TORCH_CHECK(rows <= kGemvMaxRows, "gemv serves at most ", kGemvMaxRows, " rows, got ", rows);
  TORCH_CHECK(rows * k * int64_t(sizeof(float)) <= kGemvMaxSmemBytes, "gemv input rows (", rows, " x ", k,
              ") exceed its shared memory");
  TORCH_CHECK(!gated || n % 2 == 0, "a gated gemv's w stacks gate and up rows: n must be even, got ", n);
  TORCH_CHECK(!(gated && bias.has_value()), "a gated gemv takes no bias");
  if (bias.has_value()) {
    check_cuda(*bias, "bias", x.device());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() && bias->scalar_type() == x.scalar_type(),
                "bias must be contiguous [n] of x's dtype");
  }
  at::Tensor y = at::empty({rows, gated ? n / 2 : n}, x.options());
  at::Tensor summed;
  GemvParams p{};
  p.y = y.data_ptr();
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  if (norm_weight != nullptr) {
    check_norm_weight(*norm_weight, x);
    TORCH_CHECK(norm_weight->size(0) == k, "norm weight has ", norm_weight->size(0), " elements, w's rows ", k);
    check_residual(*residual, x);
    summed = at::empty(x.sizes(), x.options());
    p.norm_weight = norm_weight->data_ptr();
    p.norm_fp32 = norm_weight->scalar_type() == at::kFloat;
    p.eps = static_cast<float>(eps);
    p.residual = residual->data_ptr();
    p.residual_stride = residual->stride(0);
    p.residual_out = summed.data_ptr();
  }
  p.w = w.data_ptr();
  p.rows = static_cast<int>(rows);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.gated = gated;
  p.act = gated ? gated_act_of(act) : GatedAct::kSilu;
  p.dtype = dtype_of(x);
  c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = launch_gemv(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "gemv launch failed: ", cudaGetErrorString(err));
  return {y, summed};
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t act) {
  return std::get<0>(gemv_into(x, w, bias, act, nullptr, nullptr, 0.0));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_gemv(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& norm_weight, double eps, const at::Tensor& w,
                                                     const std::optional<at::Tensor>& bias, int64_t act) {
  return gemv_into(x, w, bias, act, &residual, &norm_weight, eps);
}

at::Tensor silu_and_mul(const at::Tensor& x, int64_t act) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 16 == 0 && aligned16(x),
              "x must be contiguous [rows, 2 * inter], inter a multiple of 8");
  const int64_t inter = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), inter}, x.options());
  SiluMulParams p{};
  p.out = out.data_ptr();
  p.in = x.data_ptr();
  p.rows = x.size(0);
  p.inter = static_cast<int>(inter);
  p.act = gated_act_of(act);
  p.dtype = dtype_of(x);
  c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = launch_silu_and_mul(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "silu_and_mul launch failed: ", cudaGetErrorString(err));
  return out;
}

void rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_q_heads,
                   const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
                   const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const auto device = qkv.device();
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&positions, "positions"}, {&cos_sin, "cos_sin"},
                         {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&slot_mapping, "slot_mapping"}})
    check_cuda(*t, name, device);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == qkv.scalar_type() || k_cache.scalar_type() == at::kChar),
              "k_cache and v_cache must be contiguous [num_blocks, Hkv, block_size, D] of qkv's dtype or int8");
  const KvDType kv_dtype = check_kv_scales(k_cache, k_scale, v_scale);
  const int64_t hkv = k_cache.size(1), bs = k_cache.size(2), d = k_cache.size(3), tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_q_heads + 2 * hkv) * d && qkv.stride(1) == 1,
              "qkv must be [T, (Hq + 2 Hkv) * D] with a contiguous last dim");
  TORCH_CHECK(d % 2 == 0 && d <= kMaxRopeHeadDim, "head_dim must be even and at most ", kMaxRopeHeadDim, ", got ", d);
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == d && cos_sin.is_contiguous() &&
                  cos_sin.scalar_type() == at::kFloat,
              "cos_sin must be contiguous float32 [max_positions, D]");
  TORCH_CHECK(positions.scalar_type() == at::kInt && positions.dim() == 1 && positions.size(0) == tokens &&
                  positions.is_contiguous(),
              "positions must be contiguous int32 [T]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens && slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
              "slot_mapping must be int32 or int64 [T]");
  RopeKvParams p{};
  p.qkv = qkv.data_ptr();
  p.qkv_stride = qkv.stride(0);
  p.positions = positions.data_ptr<int32_t>();
  p.cos_sin = cos_sin.data_ptr<float>();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr();
  p.slots_are_int64 = slot_mapping.scalar_type() == at::kLong;
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  for (const auto* norm : {&q_norm, &k_norm}) {
    if (!norm->has_value()) continue;
    check_cuda(**norm, "q_norm/k_norm", device);
    TORCH_CHECK((*norm)->dim() == 1 && (*norm)->size(0) == d && (*norm)->is_contiguous() &&
                    ((*norm)->scalar_type() == qkv.scalar_type() || (*norm)->scalar_type() == at::kFloat) &&
                    (*norm)->scalar_type() == (*q_norm).scalar_type(),
                "q_norm and k_norm must be contiguous [D] of one dtype, qkv's or float32");
  }
  p.norm_fp32 = q_norm.has_value() && q_norm->scalar_type() == at::kFloat;
  p.q_norm = q_norm.has_value() ? q_norm->data_ptr() : nullptr;
  p.k_norm = k_norm.has_value() ? k_norm->data_ptr() : nullptr;
  p.eps = static_cast<float>(eps);
  p.num_tokens = tokens;
  p.num_q_heads = static_cast<int>(num_q_heads);
  p.num_kv_heads = static_cast<int>(hkv);
  p.head_dim = static_cast<int>(d);
  p.block_size = static_cast<int>(bs);
  p.dtype = dtype_of(qkv);
  p.kv_dtype = kv_dtype;
  if (kv_dtype == KvDType::kInt8) {
    p.k_scale = k_scale->data_ptr();
    p.v_scale = v_scale->data_ptr();
  }
  c10::cuda::CUDAGuard guard(device);
  const cudaError_t err = launch_rope_write_kv(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "rope_write_kv launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace flashdecode

TORCH_LIBRARY(flashdecode, m) {
  m.def(
      "flash_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, float scale, "
      "int num_splits, bool three_per_sm, Tensor(a!) partial_out, Tensor(b!) partial_lse, bool read_ahead=True, "
      "int window=0, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def(
      "write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slot_mapping, "
      "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "read_kv(Tensor k_cache, Tensor v_cache, Tensor slot_mapping, ScalarType dtype, Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x, int act=0) -> Tensor");
  m.def("gemv(Tensor x, Tensor w, Tensor? bias=None, int act=-1) -> Tensor");
  m.def(
      "add_rms_norm_gemv(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor w, Tensor? bias=None, "
      "int act=-1) -> (Tensor, Tensor)");
  m.def(
      "rope_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor slot_mapping, int num_q_heads, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0, "
      "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(flashdecode, CUDA, m) {
  m.impl("flash_decode", &flashdecode::flash_decode);
  m.impl("write_kv", &flashdecode::write_kv);
  m.impl("read_kv", &flashdecode::read_kv);
  m.impl("rms_norm", &flashdecode::rms_norm);
  m.impl("add_rms_norm", &flashdecode::add_rms_norm);
  m.impl("silu_and_mul", &flashdecode::silu_and_mul);
  m.impl("gemv", &flashdecode::gemv);
  m.impl("add_rms_norm_gemv", &flashdecode::add_rms_norm_gemv);
  m.impl("rope_write_kv", &flashdecode::rope_write_kv);
}
