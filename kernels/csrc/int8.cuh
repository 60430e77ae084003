// The int8 KV cache's conversions on the device: the quantising writes (write_kv.cu,
// layer_ops.cu) and the split kernel's dequantisation in registers (pipeline.cuh).
//
// Format (kernels/kv_quant.py computes the same): a row of D elements of one token and KV head is
// stored as D int8 codes and one float16 scale, symmetric: scale = amax / 127 in float32, capped
// at kInt8ScaleMax and rounded up to float16 (so that no element maps past 127), and
// code = rint(x / scale) (ties to even), clamped to +-127; a row of zeros has scale 0, codes 0.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "flash_decode.h"

namespace flashdecode {

// The split kernel multiplies each V row's codes by its scale in fp16 (the product rounded once,
// as plain fp16 attention over the dequantised cache rounds it); the cap keeps it finite.
static_assert(kInt8Max * kInt8ScaleMax <= 65504.f, "code * scale must fit in fp16");

// Four int8 codes -> two words of two fp16 holding the codes exactly. code ^ 0x80 is code + 128
// as an unsigned byte; under the exponent byte 0x64 it makes the fp16 1024 + code + 128 (fp16's
// step is 1 in [1024, 2048)), and subtracting 1152 leaves the code. Element order follows the
// bytes: bytes 0, 1 of ``codes`` become the low word.
static __device__ __forceinline__ uint2 int8x4_to_half2x2(uint32_t codes) {
  const uint32_t biased = codes ^ 0x80808080u;
  const uint32_t lo_bits = __byte_perm(biased, 0x64646464u, 0x4140);
  const uint32_t hi_bits = __byte_perm(biased, 0x64646464u, 0x4342);
  const __half2 offset = __half2half2(__ushort_as_half(0x6480u));  // 1152
  const __half2 lo = __hsub2(*reinterpret_cast<const __half2*>(&lo_bits), offset);
  const __half2 hi = __hsub2(*reinterpret_cast<const __half2*>(&hi_bits), offset);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

// A row's scale from its largest magnitude (what kernels.kv_quant.row_scales computes).
static __device__ __forceinline__ __half int8_row_scale(float amax) {
  return __float2half_ru(fminf(__fdiv_rn(amax, kInt8Max), kInt8ScaleMax));
}

// The code of x at ``scale`` (a row scale as float): rint(x / scale) clamped to +-127; 0 where the
// row's scale is 0.
static __device__ __forceinline__ int8_t quantize_int8(float x, float scale) {
  if (!(scale > 0.f)) return 0;
  return static_cast<int8_t>(fminf(fmaxf(rintf(__fdiv_rn(x, scale)), -kInt8Max), kInt8Max));
}

}  // namespace flashdecode
