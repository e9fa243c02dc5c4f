// The blockwise FP8 format, defined once for host and device code (mirrors
// mok_megatron/ops/fp8_blockwise.py, whose docstring states the rules).
//
// Blocks of (kBlockRows, kBlockCols) in {(1, 128), (128, 1), (128, 128)} share one float32
// scale s, x ~= e4m3 data * s. For a block with amax = max|x|: non-finite -> s = NaN, data NaN;
// all zero -> s = 1; else s = max(amax / 448, 2^-126) and data = e4m3(clamp(x / s)), or with
// power-of-two scales s = 2^e (the smallest e with amax <= 448 * 2^e, clamped to [-126, 120])
// and data = e4m3(clamp(x * 2^-e)).
#pragma once

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/common/mxfp8.cuh"

namespace mok::fp8_blockwise {

constexpr int kBlock = 128;
constexpr int kMinExponent = -126;
constexpr int kMaxExponent = 120;  // enough for any finite float32 amax
constexpr float kDataMax = mxfp8::kDataMax;
constexpr uint8_t kDataNaN = mxfp8::kDataNaN;
constexpr float kMinScale = 1.1754943508222875e-38f;  // 2^-126: s stays a normal float32

struct BlockScale {
  float scale;   // the stored s (NaN for a non-finite block, 1 for an all-zero one)
  float factor;  // 2^-e to multiply by (pow2), or the divisor s (otherwise)
  bool nonfinite;
};

// The scale of a block whose |x| maximum has float32 bits amax_bits (sign bit clear).
MOK_HOST_DEVICE BlockScale block_scale(uint32_t amax_bits, bool pow2) {
  if (amax_bits >= mxfp8::kFloatInfBits) {
    return BlockScale{mxfp8::float_from_bits(0x7FC00000u), 1.0f, true};
  }
  const bool zero = amax_bits == 0;
  if (pow2) {
    int e = mxfp8::scale_exponent(amax_bits);  // its own clamp is [-127, 127]
    e = e < kMinExponent ? kMinExponent : (e > kMaxExponent ? kMaxExponent : e);
    return BlockScale{zero ? 1.0f : mxfp8::exp2_int(e), mxfp8::exp2_int(-e), false};
  }
  const float amax = mxfp8::float_from_bits(amax_bits);
  float s = amax / kDataMax;  // NOTE: IEEE division (no fast-math in this project)
  s = s < kMinScale ? kMinScale : s;
  return BlockScale{zero ? 1.0f : s, s, false};
}

// Stage 1's FP8 token rows (the dispatch of (1, 128)-quantised tokens, half the bf16 bytes): a
// row holds the token's `hidden` e4m3 bytes, then its hidden / 128 float32 scales, then zeros up
// to whole 16-byte vectors. The dispatch and the row gather move it as bf16
// (packed_row_bytes / 2 elements per row).
MOK_HOST_DEVICE constexpr int64_t packed_scales_offset(int64_t hidden) { return hidden; }
MOK_HOST_DEVICE constexpr int64_t packed_row_bytes(int64_t hidden) {
  return (hidden + hidden / kBlock * static_cast<int64_t>(sizeof(float)) + 15) / 16 * 16;
}

}  // namespace mok::fp8_blockwise
