// A decode step's greedy token for the rows a grammar constrains, in one launch (grammar_argmax.cu):
// for each listed row r, ids[r] becomes the first index of the largest logits[r, t] among the
// tokens t < vocab whose bit is set in bitmask[r] (xgrammar's layout: bit t % 32 of word t / 32; a
// set bit allows the token). NaN logits are skipped, a row whose allowed logits are all -inf gets
// its first allowed token and a row that allows no token gets 0. The other rows' ids are left
// alone. kernels/grammar_argmax.py holds the reference.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace flashdecode {

struct GrammarArgmaxParams {
  const float* logits;       // [batch, >= vocab], row stride logits_stride
  int64_t logits_stride;
  const int32_t* bitmask;    // [>= batch, >= ceil(vocab / 32)], row stride bitmask_stride
  int64_t bitmask_stride;
  const int32_t* rows;       // [count] row indices, or null: rows 0 .. count - 1
  int32_t* ids;              // [>= batch]
  int64_t count;
  int vocab;
};

cudaError_t launch_grammar_argmax(const GrammarArgmaxParams& p, cudaStream_t stream);

}  // namespace flashdecode
