// torch.library registration of flashdecode::flash_decode and flashdecode::write_kv (CUDA).
// kernels/ops.py validates inputs with readable errors and registers the fake (meta) kernels;
// the checks here only guard the raw pointers for callers of torch.ops.flashdecode directly.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "flash_decode.h"

namespace flashdecode {
namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_cuda(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, name, " must be on ", device, ", got ", t.device());
}

at::Tensor flash_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t num_splits,
                        at::Tensor& partial_out, at::Tensor& partial_lse, at::Tensor& merge_counters,
                        int64_t merge_mode, int64_t min_chunk) {
  const auto device = q.device();
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&block_table, "block_table"},
                         {&seq_lens, "seq_lens"}, {&partial_out, "partial_out"}, {&partial_lse, "partial_lse"},
                         {&merge_counters, "merge_counters"}})
    check_cuda(*t, name, device);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with a contiguous last dim");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q must be bf16 or fp16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous [num_blocks, Hkv, block_size, D] of one shape");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "caches must have q's dtype");
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128, got ", d);
  TORCH_CHECK(k_cache.size(3) == d, "cache head_dim ", k_cache.size(3), " != q head_dim ", d);
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0, "num_q_heads ", hq, " is not a multiple of num_kv_heads ", hkv);
  TORCH_CHECK(bs % 16 == 0 && (128 % bs == 0 || bs % 128 == 0), "unsupported block_size ", bs);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.size(0) == batch &&
                  block_table.stride(1) == 1,
              "block_table must be int32 [B, max_blocks] with unit column stride");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == batch &&
                  seq_lens.is_contiguous(),
              "seq_lens must be int32 [B]");
  TORCH_CHECK(num_splits >= 1 && num_splits <= kMaxSplits, "num_splits must be in 1..", kMaxSplits);
  TORCH_CHECK(q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0 && aligned16(q) && aligned16(k_cache) &&
                  aligned16(v_cache),
              "q and the caches must be 16-byte aligned");
  const int64_t head_tiles = (hq / hkv + kHeadsPerBlock - 1) / kHeadsPerBlock;
  if (num_splits > 1) {
    TORCH_CHECK(partial_out.scalar_type() == at::kFloat && partial_out.is_contiguous() &&
                    partial_out.dim() == 3 && partial_out.size(1) == hq && partial_out.size(2) == d &&
                    partial_out.size(0) >= batch * num_splits,
                "partial_out must be float32 [>= B * num_splits, Hq, D]");
    TORCH_CHECK(partial_lse.scalar_type() == at::kFloat && partial_lse.is_contiguous() &&
                    partial_lse.numel() >= batch * num_splits * hq,
                "partial_lse must be float32 [>= B * num_splits, Hq]");
    TORCH_CHECK(merge_counters.scalar_type() == at::kInt && merge_counters.is_contiguous() &&
                    merge_counters.numel() >= batch * hkv * head_tiles,
                "merge_counters must be int32 with >= B * Hkv * ceil(G / 16) zeros");
  }
  TORCH_CHECK(merge_mode >= 0 && merge_mode <= 2, "merge_mode must be 0, 1 or 2");
  TORCH_CHECK(min_chunk >= 1 && min_chunk <= (1 << 30), "min_chunk must be positive");

  c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({batch, hq, d}, q.options());
  DecodeParams p{};
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_lse = partial_lse.data_ptr<float>();
  p.merge_counters = merge_counters.data_ptr<int32_t>();
  p.batch = static_cast<int>(batch);
  p.num_q_heads = static_cast<int>(hq);
  p.num_kv_heads = static_cast<int>(hkv);
  p.head_dim = static_cast<int>(d);
  p.block_size = static_cast<int>(bs);
  p.max_blocks = static_cast<int>(block_table.size(1));
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.num_splits = static_cast<int>(num_splits);
  p.scale = static_cast<float>(scale);
  p.dtype = q.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kHalf;
  p.merge_mode = static_cast<int>(merge_mode);
  p.min_chunk = static_cast<int>(min_chunk);
  const cudaError_t err = launch_flash_decode(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_decode launch failed: ", cudaGetErrorString(err));
  return out;
}

void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  const auto device = k_cache.device();
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&v_cache, "v_cache"}, {&key, "key"}, {&value, "value"},
                         {&slot_mapping, "slot_mapping"}})
    check_cuda(*t, name, device);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, Hkv, block_size, D] of one shape and dtype");
  const int64_t hkv = k_cache.size(1), bs = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == hkv && key.size(2) == d,
              "key and value must be [T, Hkv, D] matching the cache");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type(),
              "key and value must have the cache's dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
              "slot_mapping must be int32 or int64 [T]");
  const int64_t elem = k_cache.element_size(), row_bytes = d * elem;
  TORCH_CHECK(row_bytes % 16 == 0, "head_dim * element size must be a multiple of 16 bytes");
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
  const cudaError_t err = launch_write_kv(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "write_kv launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace flashdecode

TORCH_LIBRARY(flashdecode, m) {
  m.def(
      "flash_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, float scale, "
      "int num_splits, Tensor(a!) partial_out, Tensor(b!) partial_lse, Tensor(c!) merge_counters, "
      "int merge_mode=2, int min_chunk=256) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(flashdecode, CUDA, m) {
  m.impl("flash_decode", &flashdecode::flash_decode);
  m.impl("write_kv", &flashdecode::write_kv);
}
