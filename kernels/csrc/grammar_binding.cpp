// torch.library registration of flashdecode::grammar_argmax (CUDA), a decode step's greedy token
// for the rows a grammar constrains (grammar_argmax.cu). A fragment of the flashdecode library that
// binding.cpp defines. kernels/grammar_argmax.py validates inputs with readable errors; these
// checks guard the raw pointers.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "grammar_argmax.h"

namespace flashdecode {
namespace {

void grammar_argmax(const at::Tensor& logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows,
                    at::Tensor& ids, int64_t vocab) {
  const auto device = logits.device();
  TORCH_CHECK(logits.is_cuda() && bitmask.device() == device && ids.device() == device,
              "logits, bitmask and ids must be on one CUDA device");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [batch, >= vocab] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1 &&
                  bitmask.size(0) >= logits.size(0) && bitmask.size(1) * 32 >= vocab,
              "bitmask must be int32 [>= batch, >= ceil(vocab / 32)] with contiguous rows");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.size(0) >= logits.size(0),
              "ids must be contiguous int32 [>= batch]");
  TORCH_CHECK(vocab >= 1 && vocab <= logits.size(1), "vocab must be in 1..logits.size(1)");
  GrammarArgmaxParams p{};
  p.logits = logits.data_ptr<float>();
  p.logits_stride = logits.stride(0);
  p.bitmask = bitmask.data_ptr<int32_t>();
  p.bitmask_stride = bitmask.stride(0);
  p.ids = ids.data_ptr<int32_t>();
  p.count = logits.size(0);
  p.vocab = static_cast<int>(vocab);
  if (rows.has_value()) {
    TORCH_CHECK(rows->device() == device && rows->dim() == 1 && rows->scalar_type() == at::kInt && rows->is_contiguous(),
                "rows must be contiguous int32 [n] on the logits' device");
    p.rows = rows->data_ptr<int32_t>();
    p.count = rows->size(0);
  }
  c10::cuda::CUDAGuard guard(device);
  const cudaError_t err = launch_grammar_argmax(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "grammar_argmax launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace flashdecode

TORCH_LIBRARY_FRAGMENT(flashdecode, m) {
  m.def("grammar_argmax(Tensor logits, Tensor bitmask, Tensor? rows, Tensor(a!) ids, int vocab) -> ()");
}

TORCH_LIBRARY_IMPL(flashdecode, CUDA, m) { m.impl("grammar_argmax", &flashdecode::grammar_argmax); }
