// The float8_e4m3fn KV cache's conversions on the device: quantising writes (write_kv.cu,
// layer_ops.cu) and the split kernel's dequantisation in registers (pipeline.cuh).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace flashdecode {

// FP8 caches: the split kernel feeds e4m3 codes to fp16 MMAs. Moving a code's exponent and
// mantissa bits under fp16's gives code * 2^-8 exactly for every code, subnormals and zero
// included (fp16 has three more exponent bits and seven more mantissa bits); the 2^8 goes into
// the scales. Element order follows the bytes: bytes 0, 1 of ``codes`` become the low word.
inline constexpr float kFp8Unbias = 256.f;

static __device__ __forceinline__ uint32_t fp8_bits_to_half2(uint32_t pair_high_bytes) {
  // each half holds a code in its high byte: keep the sign, shift the rest down by one
  return (pair_high_bytes & 0x80008000u) | ((pair_high_bytes >> 1) & 0x3F803F80u);
}

// Four e4m3 codes -> two words of two fp16 (each code * 2^-8).
static __device__ __forceinline__ uint2 fp8x4_to_half2x2(uint32_t codes) {
  return make_uint2(fp8_bits_to_half2(__byte_perm(codes, 0u, 0x1404)),
                    fp8_bits_to_half2(__byte_perm(codes, 0u, 0x3424)));
}

// The e4m3 code of x / scale, rounded to nearest even and saturated to +-448 (what
// kernels.reference.quantize_fp8 computes).
static __device__ __forceinline__ uint8_t quantize_fp8(float x, float scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3));
}

}  // namespace flashdecode
