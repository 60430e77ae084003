// What the torch bindings of the two attention ops share (binding.cpp: flash_decode,
// prefill_binding.cpp: flash_prefill): the alignment test and the launch parameters' common fields.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "flash_decode.h"

namespace flashdecode {

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Fills the fields DecodeParams and PrefillParams share from checked tensors: q and its head stride,
// the paged caches and their layout, the block table, seq_lens, the output, the split buffers and
// the scalars (k_scale and v_scale for int8 caches). q's row stride, batch and each op's own
// fields are the caller's.
template <typename Params>
void set_attention_params(Params& p, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& out,
                          const at::Tensor& partial_out, const at::Tensor& partial_lse, double scale,
                          int64_t num_splits, int64_t window, KvDType kv_dtype,
                          const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  p.q = q.data_ptr();
  p.q_stride_h = q.stride(1);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_lse = partial_lse.data_ptr<float>();
  p.num_q_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k_cache.size(1));
  p.head_dim = static_cast<int>(q.size(2));
  p.block_size = static_cast<int>(k_cache.size(2));
  p.max_blocks = static_cast<int>(block_table.size(1));
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.num_splits = static_cast<int>(num_splits);
  p.scale = static_cast<float>(scale);
  p.dtype = q.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kHalf;
  p.window = static_cast<int>(window);
  p.kv_dtype = kv_dtype;
  if (kv_dtype == KvDType::kInt8) {
    p.k_scale = k_scale->data_ptr();
    p.v_scale = v_scale->data_ptr();
  }
}

}  // namespace flashdecode
