// The MXFP8 format, defined once for host and device code (mirrors mok_megatron/ops/mxfp8.py).
//
// Blocks of kBlockSize = 32 consecutive elements share one E8M0 scale byte s (value 2^(s-127),
// s = 255 is NaN). For a block with amax = max|x| (float32), the exponent e is the smallest
// integer with amax <= 448 * 2^e, clamped to [-127, 127]; an all-zero block has e = 0; a block
// holding NaN or +-Inf gets s = 255 and every element NaN (0x7F). Element data is
// float8_e4m3fn(clamp(x * 2^-e, -448, 448)), round-to-nearest-even.
#pragma once

#include <cstdint>
#include <cstring>

#include "mok/common/macros.cuh"

namespace mok::mxfp8 {

MOK_HOST_DEVICE float float_from_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

MOK_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t out;
  std::memcpy(&out, &x, sizeof(out));
  return out;
#endif
}

constexpr int kBlockSize = 32;
constexpr int kScaleBias = 127;
constexpr int kMinScaleExponent = -127;
constexpr int kMaxScaleExponent = 127;
constexpr uint8_t kScaleNaN = 255;
constexpr uint8_t kDataNaN = 0x7F;  // float8_e4m3fn NaN, positive sign
constexpr float kDataMax = 448.0f;  // largest finite float8_e4m3fn
constexpr uint32_t kFloatInfBits = 0x7F800000u;
constexpr uint32_t kFloatAbsMask = 0x7FFFFFFFu;
// 448 = 0.875 * 2^9 = 1.75 * 2^8: the float32 mantissa field of 1.75.
constexpr uint32_t kDataMaxMantissaBits = 0x600000u;

// e for a block whose |x| maximum has float32 bits amax_bits (finite, sign bit clear).
// frexp view: amax = m * 2^x, m in [0.5, 1); e = x - 9 if m <= 0.875 else x - 8.
MOK_HOST_DEVICE int scale_exponent(uint32_t amax_bits) {
  if (amax_bits == 0) return 0;
  const int biased = static_cast<int>(amax_bits >> 23);
  // A float32 subnormal amax is below 2^-126 < 448 * 2^-127: the clamp decides.
  if (biased == 0) return kMinScaleExponent;
  const int frexp_exponent = biased - 126;
  const bool above_max = (amax_bits & 0x7FFFFFu) > kDataMaxMantissaBits;
  const int e = frexp_exponent - 9 + (above_max ? 1 : 0);
  if (e < kMinScaleExponent) return kMinScaleExponent;
  return e > kMaxScaleExponent ? kMaxScaleExponent : e;
}

// 2^k as an exact float32 for k in [-126, 127] (normal range; built from bits, no rounding).
MOK_HOST_DEVICE float exp2_int(int k) {
  return float_from_bits(static_cast<uint32_t>(k + 127) << 23);
}

// The scale of one block: the stored byte and the factor 2^-e that maps elements into fp8 range.
struct BlockScale {
  uint8_t biased_exponent;  // E8M0 byte; kScaleNaN for a non-finite block
  float inv_scale;          // 2^-e, in [2^-120, 2^127]: always a normal float32
  bool nonfinite;
};

MOK_HOST_DEVICE BlockScale block_scale(uint32_t amax_bits) {
  if (amax_bits >= kFloatInfBits) return BlockScale{kScaleNaN, 1.0f, true};
  const int e = scale_exponent(amax_bits);
  // NOTE: e <= 120 for any finite float32 amax, so -e >= -120 stays in exp2_int's range.
  return BlockScale{static_cast<uint8_t>(e + kScaleBias), exp2_int(-e), false};
}

}  // namespace mok::mxfp8
