// torch.library registration of flashdecode::flash_prefill (CUDA), the split-KV prefill after a
// cached prefix (prefill.cu). A fragment of the flashdecode library that binding.cpp defines.
// kernels/ops.py validates inputs with readable errors; these checks guard the raw pointers.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>

#include "binding_common.h"
#include "prefill.h"

namespace flashdecode {
namespace {

at::Tensor flash_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& cu_query_starts, const at::Tensor& seq_lens,
                         double scale, int64_t num_splits, int64_t row_tiles, at::Tensor& partial_out,
                         at::Tensor& partial_lse, int64_t window, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale) {
  const auto device = q.device();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &v_cache, &block_table, &cu_query_starts,
                                                                      &seq_lens, &partial_out, &partial_lse})
    TORCH_CHECK(t->is_cuda() && t->device() == device, "every tensor must be on ", device, ", got ", t->device());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0 && aligned16(q),
              "q must be [T, Hq, D] with a contiguous last dim and 16-byte aligned rows");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q must be bf16 or fp16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  aligned16(k_cache) && aligned16(v_cache),
              "k_cache and v_cache must be contiguous, 16-byte aligned [num_blocks, Hkv, block_size, D] of one shape");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || k_cache.scalar_type() == q.scalar_type(), "caches must have q's dtype or be int8");
  TORCH_CHECK(int8 == k_scale.has_value() && int8 == v_scale.has_value(),
              "k_scale and v_scale are required for int8 caches and refused for others");
  if (int8)
    for (const at::Tensor* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->is_cuda() && t->device() == device && t->scalar_type() == at::kHalf &&
                      t->sizes() == k_cache.sizes().slice(0, 3) && t->is_contiguous() && aligned16(*t),
                  "k_scale and v_scale must be contiguous, 16-byte aligned float16 [num_blocks, Hkv, block_size]");
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(1), bs = k_cache.size(2);
  const int64_t batch = block_table.size(0);
  TORCH_CHECK(supported_head_dim(d) && k_cache.size(3) == d, "head_dim must be 64, 128 or 256 in q and the caches");
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0, "num_q_heads ", hq, " is not a multiple of num_kv_heads ", hkv);
  TORCH_CHECK(supported_block_size(bs), "unsupported block_size ", bs);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1,
              "block_table must be int32 [B, max_blocks] with unit column stride");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == batch &&
                  seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32 [B]");
  TORCH_CHECK(cu_query_starts.scalar_type() == at::kInt && cu_query_starts.dim() == 1 &&
                  cu_query_starts.size(0) == batch + 1 && cu_query_starts.is_contiguous(),
              "cu_query_starts must be contiguous int32 [B + 1]");
  TORCH_CHECK(rows >= 1 && batch >= 1, "q needs at least one row and block_table one sequence");
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, "window must be in 0..", INT32_MAX, " (0: none), got ", window);
  TORCH_CHECK(num_splits >= 1 && num_splits <= kMaxSplits, "num_splits must be in 1..", kMaxSplits);
  TORCH_CHECK(k_cache.size(0) >= 1, "the caches need at least one block");   // block ids are clamped into them
  // Blocks past the last row tile exit; fewer than this bound could leave rows of the output unwritten.
  const int64_t min_row_tiles = (rows * (hq / hkv) + kPrefillRows - 1) / kPrefillRows + batch;
  TORCH_CHECK(row_tiles >= min_row_tiles && row_tiles <= 65535, "row_tiles must be in ", min_row_tiles,
              "..65535 (ceil(T * group / ", kPrefillRows, ") + B), got ", row_tiles);
  if (num_splits > 1) {
    TORCH_CHECK(rows <= 65535, "a call of several splits takes at most 65535 rows, got ", rows);
    TORCH_CHECK(partial_out.scalar_type() == at::kFloat && partial_out.is_contiguous() && partial_out.dim() == 3 &&
                    partial_out.size(0) >= rows * num_splits && partial_out.size(1) == hq && partial_out.size(2) == d &&
                    aligned16(partial_out),
                "partial_out must be 16-byte aligned float32 [>= T * num_splits, Hq, D]");   // the merge reads float4
    TORCH_CHECK(partial_lse.scalar_type() == at::kFloat && partial_lse.is_contiguous() &&
                    partial_lse.numel() >= rows * num_splits * hq,
                "partial_lse must be float32 [>= T * num_splits, Hq]");
  }

  c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({rows, hq, d}, q.options());
  PrefillParams p{};
  set_attention_params(p, q, k_cache, v_cache, block_table, seq_lens, out, partial_out, partial_lse, scale, num_splits,
                       window, int8 ? KvDType::kInt8 : KvDType::kSameAsQuery, k_scale, v_scale);
  p.q_stride_t = q.stride(0);
  p.cu_query_starts = cu_query_starts.data_ptr<int32_t>();
  p.batch = static_cast<int>(batch);
  p.num_rows = static_cast<int>(rows);
  p.row_tiles = static_cast<int>(row_tiles);
  const cudaError_t err = launch_flash_prefill(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_prefill launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace
}  // namespace flashdecode

TORCH_LIBRARY_FRAGMENT(flashdecode, m) {
  m.def(
      "flash_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cu_query_starts, "
      "Tensor seq_lens, float scale, int num_splits, int row_tiles, Tensor(a!) partial_out, Tensor(b!) partial_lse, "
      "int window=0, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashdecode, CUDA, m) { m.impl("flash_prefill", &flashdecode::flash_prefill); }
