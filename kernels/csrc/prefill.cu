// Split-KV prefill after a cached prefix (prefill_kernel.cuh): the launch. The split count comes
// from the planner (kernels/planner.py, prefill_plan); a grid of several splits is followed by the
// decode kernel's merge (merge.cuh), which reads the workspace as (new token, split, query head).
// docs/prefill-kernel.md describes the whole.

#include "merge.cuh"
#include "prefill_kernel.cuh"

namespace flashdecode {
namespace {

template <typename T, int D, typename KV>
cudaError_t launch_prefill_typed(const PrefillParams& p, cudaStream_t stream) {
  using S = PrefillShape<T, D, KV>;
  static uint64_t smem_raised = 0;
  cudaError_t err = allow_dynamic_smem(prefill_kernel<T, D, KV>, S::kSmemBytes, smem_raised);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_splits, p.num_kv_heads, p.row_tiles);
  err = launch_pdl(prefill_kernel<T, D, KV>, grid, dim3(kPrefillThreads), S::kSmemBytes, stream, p);
  if (err != cudaSuccess || p.num_splits == 1) return err;
  DecodeParams m{};   // the merge's view: a "sequence" per new token
  m.out = p.out;
  m.partial_out = p.partial_out;
  m.partial_lse = p.partial_lse;
  m.batch = p.num_rows;
  m.num_q_heads = p.num_q_heads;
  m.num_kv_heads = p.num_kv_heads;
  m.head_dim = D;
  m.num_splits = p.num_splits;
  m.dtype = p.dtype;
  m.merge_waits_first = false;
  return launch_pdl(merge_kernel<T, D>, dim3(p.num_q_heads, p.num_rows), dim3(kMergeThreads), 0, stream, m);
}

template <typename T, typename KV>
cudaError_t launch_prefill_head_dim(const PrefillParams& p, cudaStream_t stream) {
  if (p.head_dim == 64) return launch_prefill_typed<T, 64, KV>(p, stream);
  if (p.head_dim == 128) return launch_prefill_typed<T, 128, KV>(p, stream);
  if (p.head_dim == 256) return launch_prefill_typed<T, 256, KV>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_flash_prefill(const PrefillParams& p, cudaStream_t stream) {
  if (p.num_splits < 1 || p.num_splits > kMaxSplits || p.batch < 1 || p.num_rows < 1 || p.num_kv_heads < 1 ||
      p.num_q_heads % p.num_kv_heads || p.row_tiles < 1 || p.row_tiles > 65535 || p.num_kv_heads > 65535)
    return cudaErrorInvalidValue;
  if (p.num_splits > 1 && p.num_rows > 65535) return cudaErrorInvalidValue;   // the merge's grid y
  if (!supported_block_size(p.block_size) || p.window < 0) return cudaErrorInvalidValue;
  const bool int8 = p.kv_dtype == KvDType::kInt8;
  if (int8 != (p.k_scale != nullptr) || int8 != (p.v_scale != nullptr)) return cudaErrorInvalidValue;
  if (p.dtype == DType::kBFloat16)
    return int8 ? launch_prefill_head_dim<__nv_bfloat16, int8_t>(p, stream)
                : launch_prefill_head_dim<__nv_bfloat16, __nv_bfloat16>(p, stream);
  return int8 ? launch_prefill_head_dim<__half, int8_t>(p, stream) : launch_prefill_head_dim<__half, __half>(p, stream);
}

}  // namespace flashdecode
